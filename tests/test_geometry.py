"""The shared prefill geometry selector (``interop/geometry.py``): every table boundary, every
gate of the SM120 tuned family, the env override, with hand-built device facts."""

from __future__ import annotations

import pytest

from interop import geometry as G
from interop.arch import DeviceFacts
from interop.contract import ContractError

H200 = DeviceFacts.for_arch("sm_90", triton_version="3.6.0")
H20 = DeviceFacts("NVIDIA H20", (9, 0), 78, 232_448, "3.6.0")
L20 = DeviceFacts("NVIDIA L20", (8, 9), 92, 101_376, "3.6.0")
PRO6000 = DeviceFacts.for_arch("sm_120", name="NVIDIA RTX PRO 6000 Blackwell Server Edition",
                               sm_count=188, triton_version="3.7.0")
RTX5090 = DeviceFacts.for_arch("sm_120", name="NVIDIA GeForce RTX 5090", sm_count=170,
                               triton_version="3.7.0")
GB10 = DeviceFacts.for_arch("sm_121", triton_version="3.7.0")

PROD = dict(group=12, num_kv_heads=1, head_dim=256, width=2051)


@pytest.fixture(autouse=True)
def _env_auto(monkeypatch):
    monkeypatch.delenv(G.ENV_VAR, raising=False)


def sel(facts, kind="ordinary", total_q=8192, requests=1, max_q=None, **kw):
    args = dict(PROD)
    args.update(kw)
    return G.select_prefill(facts, kind, total_q=total_q, requests=requests,
                            max_q=total_q if max_q is None else max_q, **args)


L20_ROWS = [(1, (32, 8, 2)), (32, (32, 8, 2)), (33, (64, 8, 2)), (64, (64, 8, 2)),
            (65, (64, 4, 2)), (128, (64, 4, 2)), (129, (32, 4, 2)), (512, (32, 4, 2)),
            (513, (16, 1, 2)), (1024, (16, 1, 2)), (1025, (16, 1, 2)), (1 << 20, (16, 1, 2))]
H20_ROWS = [(1, (32, 8, 2)), (32, (32, 8, 2)), (33, (64, 8, 2)), (64, (64, 8, 2)),
            (65, (32, 4, 2)), (128, (32, 4, 2)), (512, (32, 4, 2)), (513, (32, 4, 2)),
            (1024, (32, 4, 2)), (1025, (16, 1, 2)), (1 << 20, (16, 1, 2))]


@pytest.mark.parametrize("total_q,cfg", L20_ROWS)
@pytest.mark.parametrize("facts", [L20, RTX5090, GB10], ids=["L20", "5090", "GB10"])
def test_l20_table_boundaries(facts, total_q, cfg):
    g = sel(facts, total_q=total_q)
    assert (g.block_n, g.num_warps, g.num_stages) == cfg
    assert g.block_m == 16 and g.source.startswith("l20-table")


@pytest.mark.parametrize("total_q,cfg", H20_ROWS)
def test_h20_table_boundaries(total_q, cfg):
    g = sel(H20, total_q=total_q)
    assert (g.block_n, g.num_warps, g.num_stages) == cfg and g.source.startswith("h20-table")


@pytest.mark.parametrize("total_q", [t for t, _ in L20_ROWS])
def test_sm90_table_is_its_own(total_q):
    g = sel(H200, total_q=total_q)
    assert g.source.startswith("sm90-table")
    (bn, nw, ns), _ = G.table_for("sm90-table", total_q)
    assert (g.block_n, g.num_warps, g.num_stages) == (bn, nw, ns)
    assert "sweep" in G.SM90_TABLE_STATUS


SM90_ROWS = [(1, (64, 8, 3)), (32, (64, 8, 3)), (128, (64, 8, 3)), (129, (64, 4, 2)),
             (256, (64, 4, 2)), (257, (32, 4, 2)), (1024, (32, 4, 2)), (1025, (64, 4, 2)),
             (8192, (64, 4, 2))]


@pytest.mark.parametrize("total_q,cfg", SM90_ROWS)
def test_sm90_table_boundaries(total_q, cfg):
    g = sel(H200, total_q=total_q)
    assert (g.block_n, g.num_warps, g.num_stages) == cfg and g.block_m == 16


@pytest.mark.parametrize("group,block_m", [(1, 16), (3, 16), (6, 16), (12, 16), (16, 16)])
def test_table_head_tile(group, block_m):
    assert sel(L20, group=group).block_m == block_m
    assert G.head_tile(group) == block_m


# ------------------------------------------------------------------ SM120 tuned family gates
def test_tuned_on_188_sm_sm120():
    g6 = sel(PRO6000, group=6)
    g12 = sel(PRO6000, group=12)
    assert g6.key == (8, 16, 4, 3) and g6.source.startswith("sm120-tuned[G=6]")
    assert g12.key == (16, 16, 2, 3) and g12.source.startswith("sm120-tuned[G=12]")


@pytest.mark.parametrize("facts,why", [
    (RTX5090, "170-SM sm_120"),
    (GB10, "sm_121"),
    (H200, "sm_90"),
    (H20, "H20"),
    (DeviceFacts.for_arch("sm_120", sm_count=188, triton_version="3.6.0"), "Triton 3.6"),
    (DeviceFacts.for_arch("sm_120", sm_count=188, triton_version=None), "Triton unknown"),
])
def test_tuned_device_gates(facts, why):
    g = sel(facts, group=12)
    assert not g.source.startswith("sm120-tuned"), why
    table = "sm90-table" if g.source.startswith("sm90-table") else g.source.split("[")[0]
    assert g.key[1:] == G.table_for(table, 8192)[0]


def test_tuned_triton_floor_is_3_7():
    for v, tuned in (("3.6.9", False), ("3.7.0", True), ("3.9.0", True), ("4.0.0", True)):
        f = DeviceFacts.for_arch("sm_120", sm_count=188, triton_version=v)
        assert sel(f).source.startswith("sm120-tuned") is tuned, v


@pytest.mark.parametrize("kw", [dict(head_dim=128), dict(width=2050), dict(width=2052),
                                dict(group=3), dict(group=8), dict(group=16)])
def test_tuned_shape_gates(kw):
    assert sel(PRO6000, **kw).source.startswith("l20-table")


def test_tuned_ordinary_row_gate():
    assert sel(PRO6000, total_q=8191).source.startswith("l20-table")
    assert sel(PRO6000, total_q=8192).source.startswith("sm120-tuned")
    assert sel(PRO6000, total_q=8192, requests=16, max_q=512).source.startswith("sm120-tuned")


@pytest.mark.parametrize("kind", ["chunk", "paged"])
def test_tuned_chunk_gates(kind):
    # >= 512 rows per request
    assert sel(PRO6000, kind, total_q=512, requests=1, max_q=512).source.startswith("sm120-tuned")
    assert sel(PRO6000, kind, total_q=511, requests=1, max_q=511).source.startswith("l20-table")
    assert sel(PRO6000, kind, total_q=1024, requests=2, max_q=512).source.startswith("sm120-tuned")
    assert sel(PRO6000, kind, total_q=1023, requests=2, max_q=512).source.startswith("l20-table")
    # ragged: max_q * requests <= 2 * total_q
    assert sel(PRO6000, kind, total_q=2048, requests=2, max_q=2048).source.startswith("sm120-tuned")
    assert sel(PRO6000, kind, total_q=2048, requests=2, max_q=2049).source.startswith("l20-table")
    assert sel(PRO6000, kind, total_q=4096, requests=4, max_q=2048).source.startswith("sm120-tuned")
    assert sel(PRO6000, kind, total_q=4096, requests=4, max_q=2049).source.startswith("l20-table")


# ------------------------------------------------------------------ env override
def test_env_table_disables_tuned(monkeypatch):
    monkeypatch.setenv(G.ENV_VAR, "table")
    g = sel(PRO6000)
    assert g.source.startswith("l20-table") and "mode=table" in g.source


@pytest.mark.parametrize("value", ["auto", "AUTO", " auto ", ""])
def test_env_auto_spellings(monkeypatch, value):
    monkeypatch.setenv(G.ENV_VAR, value)
    assert sel(PRO6000).source.startswith("sm120-tuned")


def test_env_tuned_forces_family_where_defined(monkeypatch):
    monkeypatch.setenv(G.ENV_VAR, "tuned")
    assert sel(H200, group=6, total_q=32).key == (8, 16, 4, 3)
    assert sel(GB10, group=12, total_q=32).key == (16, 16, 2, 3)
    assert sel(PRO6000, group=12, head_dim=64, width=9).key == (16, 16, 2, 3)
    g = sel(H200, group=3, total_q=32)  # no tuned entry for G=3: table
    assert g.source.startswith("sm90-table") and g.key[1:] == G.table_for("sm90-table", 32)[0]


def test_env_read_on_every_call(monkeypatch):
    monkeypatch.setenv(G.ENV_VAR, "table")
    a = sel(PRO6000)
    monkeypatch.setenv(G.ENV_VAR, "tuned")
    b = sel(PRO6000)
    monkeypatch.delenv(G.ENV_VAR)
    c = sel(PRO6000, total_q=100)
    assert a.source.startswith("l20") and b.source.startswith("sm120-tuned")
    assert c.source.startswith("l20") and c.key[1:] == (64, 4, 2)


@pytest.mark.parametrize("bad", ["fast", "tuned,table", "1", "none"])
def test_env_bad_value(monkeypatch, bad):
    monkeypatch.setenv(G.ENV_VAR, bad)
    with pytest.raises(ContractError) as e:
        sel(H200)
    msg = str(e.value)
    assert "auto, table, tuned" in msg and G.ENV_VAR in msg and repr(bad) in msg


def test_bad_arguments():
    with pytest.raises(ValueError, match="kind"):
        sel(H200, "decode")
    with pytest.raises(ValueError, match="backend"):
        sel(H200, backend="cuda")
    with pytest.raises(ValueError, match="total_q"):
        sel(H200, total_q=0)


def test_pallas_backend_gets_the_same_geometry():
    """Same geometry for both backends, except the documented per-backend override (_BACKEND_TABLE:
    Pallas on sm_90 above 1024 rows keeps its measured (32,4,2))."""
    for facts in (PRO6000, GB10):
        a, b = sel(facts), sel(facts, backend="pallas")
        assert a.key == b.key and "backend=pallas" in b.source
    for total_q in (1, 128, 256, 1024):
        a, b = sel(H200, total_q=total_q), sel(H200, total_q=total_q, backend="pallas")
        assert a.key == b.key and "backend=pallas" in b.source
    a, b = sel(H200, total_q=1025), sel(H200, total_q=1025, backend="pallas")
    assert a.key != b.key and b.key[1:] == (32, 4, 2)


def test_split_kv_count_boundaries():
    """``prefill_splits``: floor(programs_per_sm[backend] x SMs / (T x Hkv)), capped by
    max_splits and W // min_split_columns; the selector's geometry carries it (label too)."""
    u = G.PREFILL_SPLIT_RULES
    assert u["programs_per_sm"] == {"triton": 1, "pallas": 4}
    assert u["max_splits"] == 8 and u["min_split_columns"] == 256

    def n(t, hkv=1, w=2051, facts=H200, backend="triton"):
        return G.prefill_splits(facts, total_q=t, num_kv_heads=hkv, width=w, backend=backend)

    # Triton, 132 SMs: one program an SM
    assert n(1) == n(16) == 8 and n(17) == 7 and n(32) == 4 and n(33) == 4 and n(44) == 3
    assert n(66) == 2 and n(67) == 1 and n(128) == 1 and n(33, hkv=2) == 2 and n(8192) == 1
    assert n(1, w=2047) == 7 and n(1, w=512) == 2 and n(1, w=511) == 1 and n(1, w=1) == 1
    assert n(1, facts=GB10) == 8 and n(12, facts=GB10) == 4 and n(25, facts=GB10) == 1
    # Pallas: four programs an SM (528 on an H200); MTP verify 32 x 4 rows at 12/1 and 24/2
    assert n(66, backend="pallas") == 8 and n(67, backend="pallas") == 7
    assert n(128, backend="pallas") == 4 and n(128, hkv=2, backend="pallas") == 2
    assert n(264, backend="pallas") == 2 and n(265, backend="pallas") == 1
    with pytest.raises(KeyError):
        n(1, backend="cuda")
    for bad in (0, 9):  # past the merge kernels' split tile: refused where a Geometry is built
        with pytest.raises(ValueError, match="splits"):
            G.Geometry(16, 32, 4, 2, splits=bad)
    g = sel(H200, "chunk", total_q=32, num_kv_heads=1)
    assert g.splits == 4 and "splits=4" in g.source, g
    g = sel(H200, "chunk", total_q=128, requests=32, max_q=4, num_kv_heads=2, backend="pallas")
    assert g.splits == 2 and "splits=2" in g.source, g
    assert sel(H200, total_q=128).splits == 1 and "splits" not in sel(H200).source


def test_check_matrices_exercise_split_kv():
    """``qsa check`` reaches split-KV in both packages: the quick (CPU) matrix has a case that
    splits on the interpreters' sm_90 facts, the full matrix short calls that split on an H200
    in each backend (Triton's T32, Pallas's MTP verify too)."""
    from interop import cases as C

    def splits(spec, backend):
        return G.prefill_splits(H200, total_q=sum(spec.q_lens), num_kv_heads=spec.hkv,
                                width=spec.width, backend=backend)

    for matrix, want in ((C.quick_matrix(("prefill",)), 1), (C.full_matrix(("prefill",)), 3)):
        for backend in ("triton", "pallas"):
            split = [s.name for s in matrix if not s.blocks and splits(s, backend) > 1]
            assert len(split) >= want, (backend, split)
    mtp = [s for s in C.full_matrix(("prefill",)) if "mtp-verify" in s.name]
    assert mtp and all(splits(s, "pallas") > 1 for s in mtp)


# ------------------------------------------------------------------ all_configs
@pytest.mark.parametrize("arch", ["sm_90", "sm_100", "sm_120", "sm_121"])
def test_all_configs_covers_every_selection(arch, monkeypatch):
    keys = {g.key for g in G.all_configs(arch)}
    assert len(keys) == len(G.all_configs(arch))
    facts_list = list(G._facts_for(arch))
    for mode in G.ALLOWED_MODES:
        monkeypatch.setenv(G.ENV_VAR, mode)
        for facts in facts_list:
            for kind in G.KINDS:
                for group in range(1, 17):
                    for total_q in (1, 32, 33, 64, 65, 128, 129, 512, 513, 1024, 1025, 8192):
                        for requests in (1, 2):
                            g = G.select_prefill(facts, kind, total_q=total_q, requests=requests,
                                                 max_q=total_q, group=group, num_kv_heads=1,
                                                 head_dim=256, width=2051)
                            assert g.key in keys, (arch, mode, kind, group, total_q, g)


def test_all_configs_unknown_arch():
    with pytest.raises(ValueError):
        G.all_configs("sm_75")


def test_pallas_keeps_its_measured_sm90_geometry_above_2048_rows():
    """Pallas was measured at (32,4,2) at 8192 rows; the Triton-only (64,4,2) row does not apply."""
    t = sel(H200, total_q=8192)
    p = G.select_prefill(H200, "chunk", total_q=8192, requests=1, max_q=8192, group=12,
                         num_kv_heads=1, head_dim=256, width=2051, backend="pallas")
    assert (t.block_n, t.num_warps, t.num_stages) == (64, 4, 2)
    assert (p.block_n, p.num_warps, p.num_stages) == (32, 4, 2)
    assert "sm90-table-pallas" in p.source
    small = G.select_prefill(H200, "chunk", total_q=64, requests=1, max_q=64, group=12,
                             num_kv_heads=1, head_dim=256, width=2051, backend="pallas")
    assert (small.block_n, small.num_warps, small.num_stages) == (64, 8, 3)


SM90_PALLAS_ROWS = [(1, (64, 8, 3)), (128, (64, 8, 3)), (129, (64, 4, 2)), (256, (64, 4, 2)),
                    (257, (32, 4, 2)), (1024, (32, 4, 2)), (1025, (32, 4, 2)), (1 << 20, (32, 4, 2))]


@pytest.mark.parametrize("total_q,cfg", SM90_PALLAS_ROWS)
def test_sm90_pallas_table_boundaries(total_q, cfg):
    g = sel(H200, total_q=total_q, backend="pallas")
    assert (g.block_n, g.num_warps, g.num_stages) == cfg and g.block_m == 16


# ------------------------------------------------------------------ fit (interop.plan)
def test_fit_prefill_rounds_pallas_tiles_and_fits_shared_memory():
    """Pallas tiles become powers of two >= 16; a geometry over the device's shared memory loses
    stages, then BLOCK_N (``interop.plan.fit_shared_memory`` on ``interop.plan.smem_bytes``)."""
    from interop.plan import smem_bytes

    tuned6 = G.Geometry(8, 16, 4, 3, "sm120-tuned[G=6]")
    assert G.fit_prefill(tuned6, backend="triton", head_dim=256, kv_bytes=2,
                         limit=101_376) == tuned6
    assert G.fit_prefill(tuned6, backend="pallas", head_dim=256, kv_bytes=2,
                         limit=101_376).key == (16, 16, 4, 3)
    big = G.Geometry(16, 64, 8, 3, "x")
    need = lambda g, kvb: smem_bytes(head_tile=g.block_m, block_n=g.block_n,  # noqa: E731
                                     head_dim=256, num_stages=g.num_stages, kv_bytes=kvb,
                                     v_convert=True)
    # FP8: 3 stages would fit without the converted V tile (64 x 256 fp16) the kernels add
    for limit, kvb, key in ((101_376, 2, (16, 64, 8, 2)), (60_000, 2, (16, 32, 8, 1)),
                            (101_376, 1, (16, 64, 8, 2)), (None, 2, (16, 64, 8, 3))):
        fit = G.fit_prefill(big, backend="triton", head_dim=256, kv_bytes=kvb, limit=limit)
        assert fit.key == key, (limit, kvb)
        assert limit is None or need(fit, kvb) <= limit
        assert (fit == big) == ("fit<=" not in fit.source)


def test_selector_output_is_fitted_to_the_device():
    small = DeviceFacts("NVIDIA L20", (8, 9), 92, 60_000, "3.6.0")  # a hypothetical 60 KB part
    g = sel(small, total_q=64)  # L20 table: (64, 8, 2)
    assert g.key == (16, 32, 8, 1) and "fit<=60000B" in g.source
    # FP8: half the K/V bytes, but the kernels' converted V tile (64 x 256 fp16) on top
    assert sel(small, total_q=64, kv_bytes=1).key == (16, 32, 8, 1)


@pytest.mark.parametrize("arch", ["sm_90", "sm_100", "sm_120", "sm_121"])
def test_shipped_tables_need_no_fit_on_known_archs(arch):
    """Every table and tuned row fits every known arch as tabled (D = 256, bf16 and FP8 K/V):
    the fit only rounds Pallas tiles."""
    from interop.arch import KNOWN_ARCHS

    for g in G.all_configs(arch):
        for kvb in (2, 1):
            assert G.fit_prefill(g, backend="triton", head_dim=256, kv_bytes=kvb,
                                 limit=KNOWN_ARCHS[arch].smem_per_block) == g
