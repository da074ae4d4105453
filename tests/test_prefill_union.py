"""Block-level selections and the tile-union sparse prefill, both backends (issue 17).

The block form (``block_indices=``) of the three entry points must equal ``interop.reference`` on
``interop.indices.expand_prefill_blocks`` (the token contract), whichever kernel the selector
picks: the tile-union kernels (``qsa_triton.prefill_union``, ``qsa_pallas.prefill_union``) and the
per-row kernels after the on-device expansion. CPU: Triton interpreter (fp16) and Pallas
interpret mode, tiny shapes (D = 32, NB = 5 blocks). GPU (``pytest -m gpu``, the H200): 8192-row
chunks at production shapes (NB = 512 blocks / W = 2051, D = 256), paged FP8 with lying metadata,
CUDA-graph replay, both backends.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from interop import indices as I
from interop.arch import DeviceFacts
from interop.contract import ContractError
from interop.geometry import (UNION_RULES, UnionGeometry, all_union_configs, fit_union,
                              select_prefill_blocks)
from interop.plan import smem_bytes
from tests.prefill_case import FLOATS, PARAMS, assert_matches, make_case, poison_unselected

ROOT = Path(__file__).resolve().parent.parent
NB = 5  # block ids per row on CPU (W = 23 after expansion)


# --------------------------------------------------------------------------------------------
# Cases
def block_case(kind, hq, hkv, q_lens, prefix=None, *, per_head=False, junk="mixed",
               duplicates=2, empty_rows=(), nb=NB, overlap=0.9, poison=False, lie=False,
               seed=0, **kw):
    """A ``tests.prefill_case`` call whose selection is block-level: ``case.blocks`` holds the
    block ids (junk anywhere, duplicates, all-junk rows), ``case.arrays['indices']`` their
    expansion (what ``case.reference()`` reads). ``lie`` (paged): request 0's kv_len passes
    req_to_token's width, request 1 maps positions to slots outside the pool, request 2 names a
    table row outside req_to_token."""
    case = make_case(kind, hq, hkv, q_lens, prefix, d=32, width=4 * nb + 3, seed=seed, **kw)
    a = case.arrays
    kl = None if kind == "ordinary" else a["kv_lens"]
    case.blocks = I.prefill_block_indices(
        q_lens, kl, block_width=nb, overlap=overlap, junk=junk, junk_anywhere=True,
        duplicates=duplicates, empty_rows=empty_rows, num_kv_heads=hkv if per_head else None,
        seed=seed + 100)
    a["indices"] = I.expand_prefill_blocks(case.blocks, q_lens, kl)
    if lie:
        r2t = a["req_to_token"]
        a["req_to_token"] = np.ascontiguousarray(r2t[:, : int(a["kv_lens"][0]) - 3])
        row1 = a["req_indices"][1]
        a["req_to_token"][row1, 1] = a["k_cache"].shape[0] + 5
        a["req_to_token"][row1, 3] = -9
        a["req_indices"] = a["req_indices"].copy()
        a["req_indices"][2] = a["req_to_token"].shape[0] + 4
    if poison:
        poison_unselected(case)
    return case


def straddling_case(**kw):
    """Ordinary, ragged: requests of 5, 1, 7 and 4 rows (tiles of 4 rows straddle every request
    boundary), junk anywhere, duplicates, an all-junk row whose visible count is a multiple of 4
    (row 9: no tail, exact zeros) and one with a tail left (row 4: not zero)."""
    return block_case("ordinary", 12, 1, [5, 1, 7, 4], empty_rows=[4, 9], seed=1, **kw)


def indexer_order(blocks, q_lens, kv_lens):
    """``blocks`` with each row's valid ids ascending first and its invalid ids after them (in
    their order): the indexer's form (``qsa_triton.indexer``: ascending, -1 after), which the
    Triton build merges without sorting the rows."""
    nb_vis = np.maximum(I.row_layout(q_lens, kv_lens, check=False)[2], 0) // 4
    g = np.asarray(blocks, np.int64)
    lead = (slice(None),) + (None,) * (g.ndim - 1)
    key = np.where((g >= 0) & (g < nb_vis[lead]), g, np.iinfo(np.int64).max)
    return np.take_along_axis(g, np.argsort(key, axis=-1, kind="stable"), -1).astype(np.int32)


def in_indexer_order(case):
    """``case`` with each row's block ids in the indexer's order (``indexer_order``)."""
    a = case.arrays
    ql = np.diff(a["cu_seqlens"] if case.kind == "ordinary" else a["cu_seqlens_q"])
    kl = None if case.kind == "ordinary" else a["kv_lens"]
    case.blocks = indexer_order(case.blocks, ql, kl)
    a["indices"] = I.expand_prefill_blocks(case.blocks, ql, kl)
    return case


CASES = {
    # ragged batch, no prefix, tiles straddling requests, zero rows
    "ordinary-ragged": lambda: straddling_case(),
    # the same in the indexer's order (the Triton build's merge path)
    "ordinary-ragged-sorted": lambda: in_indexer_order(straddling_case()),
    # prefixes (rows see more than W tokens, and fewer: the visible window shorter than W),
    # FP8 K/V with scales, per-KV-head selections, G = 3
    "chunk-fp8-perhead": lambda: block_case(
        "chunk", 6, 2, [6, 3, 1], [40, 2, 0], per_head=True, kv_dtype="float8_e4m3fn",
        k_scale=1.25, v_scale=0.75, junk="len+19", seed=2),
    # the pool through req_to_token: lying metadata, poisoned slots, junk table entries
    "paged-lying-poisoned": lambda: block_case(
        "paged", 12, 2, [5, 4, 3], [20, 9, 4], junk="-7", lie=True, poison=True,
        table_junk=True, seed=3),
}


def union_geometry(case, tile_rows, block_n=16) -> UnionGeometry:
    ht = 1 << max(0, (case.arrays["q"].shape[1] // _kv(case).shape[1] - 1).bit_length())
    return UnionGeometry("union", tile_rows, max(16, tile_rows * ht), block_n, 4, 1, "test")


def _kv(case):
    return case.arrays["k"] if "k" in case.arrays else case.arrays["k_cache"]


# --------------------------------------------------------------------------------------------
# Backends: one runner per package (public entry points, geometry forced or selected)
class TritonBackend:
    name = "triton"

    def __init__(self):
        import torch

        self.torch = torch
        from qsa_triton import prefill as P

        self.P = P

    def tensors(self, case) -> dict:
        torch = self.torch
        out = {}
        for n, x in case.arrays.items():
            t = torch.from_numpy(np.ascontiguousarray(x))
            if n in FLOATS:
                t = t.to(getattr(torch, case.dtype if n == "q" else case.kv_dtype))
            out[n] = t
        out["block_indices"] = torch.from_numpy(np.ascontiguousarray(case.blocks))
        return out

    def run(self, case, geometry=None, overlap=None, t=None):
        t = self.tensors(case) if t is None else t
        P = self.P
        if geometry is None:
            fn = {"ordinary": P.sparse_prefill, "chunk": P.sparse_prefill_chunk,
                  "paged": P.sparse_prefill_paged}[case.kind]
            args = [case.max_seqlen_q if n == "max_seqlen_q" else
                    (None if n == "indices" else t[n]) for n in PARAMS[case.kind]]
            out = fn(*args, *case.scales(), block_indices=t["block_indices"], overlap=overlap)
        else:
            mode = {"ordinary": 0, "chunk": 1, "paged": 2}[case.kind]
            sc = case.softmax_scale or case.arrays["q"].shape[-1] ** -0.5
            if case.kind == "ordinary":
                cu = t["cu_seqlens"]
                out = P._blocks_impl(0, t["q"], t["k"], t["v"], t["block_indices"], cu, cu, cu,
                                     cu, cu, case.max_seqlen_q, sc, 1.0, 1.0, geometry=geometry)
            else:
                k, v = (t["k"], t["v"]) if "k" in t else (t["k_cache"], t["v_cache"])
                cu = t["cu_seqlens_q"]
                out = P._blocks_impl(mode, t["q"], k, v, t["block_indices"], cu,
                                     t.get("cu_seqlens_k", cu), t["kv_lens"],
                                     t.get("req_to_token", cu), t.get("req_indices", cu),
                                     case.max_seqlen_q, sc, case.k_scale, case.v_scale,
                                     geometry=geometry)
        return out.float().cpu().numpy()

    def build(self, blocks, q_lens, kv_lens, tile_rows):
        torch = self.torch
        from qsa_triton import prefill_union as PU

        cu = torch.from_numpy(I.cu_seqlens_from_counts(q_lens))
        kl = None if kv_lens is None else torch.tensor(np.asarray(kv_lens, np.int32))
        # R = 2: 64-bit sort keys (no bound); R = 4: 32-bit keys under a host bound
        bound = None if tile_rows == 2 else max(kv_lens) // 4 + 1
        return [x.numpy() for x in PU.build_block_union(torch.from_numpy(blocks), cu, kl,
                                                        tile_rows, bound)]

    def expand(self, blocks, q_lens, kv_lens):
        torch = self.torch
        from qsa_triton import prefill_union as PU

        cu = torch.from_numpy(I.cu_seqlens_from_counts(q_lens))
        kl = None if kv_lens is None else torch.tensor(np.asarray(kv_lens, np.int32))
        return PU.expand_blocks(torch.from_numpy(blocks), cu, kl).numpy()


class PallasBackend:
    name = "pallas"

    def __init__(self):
        import jax.numpy as jnp

        import qsa_pallas

        self.jnp, self.qp = jnp, qsa_pallas

    def arrays(self, case) -> dict:
        jnp = self.jnp
        out = {n: jnp.asarray(x, case.dtype if n == "q" else case.kv_dtype) if n in FLOATS
               else jnp.asarray(x) for n, x in case.arrays.items()}
        out["block_indices"] = jnp.asarray(case.blocks)
        return out

    def run(self, case, geometry=None, overlap=None, t=None):
        a = self.arrays(case) if t is None else t
        fn = {"ordinary": self.qp.sparse_prefill, "chunk": self.qp.sparse_prefill_chunk,
              "paged": self.qp.sparse_prefill_paged}[case.kind]
        args = [case.max_seqlen_q if n == "max_seqlen_q" else
                (None if n == "indices" else a[n]) for n in PARAMS[case.kind]]
        if geometry is None:
            out = fn(*args, *case.scales(), block_indices=a["block_indices"], overlap=overlap)
        else:
            from qsa_pallas import prefill as P

            with P._forced_geometry(geometry):
                out = fn(*args, *case.scales(), block_indices=a["block_indices"],
                         overlap=overlap)
        return np.asarray(out.astype(self.jnp.float32))

    def build(self, blocks, q_lens, kv_lens, tile_rows):
        jnp = self.jnp
        from qsa_pallas import prefill_union as PU

        cu = jnp.asarray(I.cu_seqlens_from_counts(q_lens))
        kl = None if kv_lens is None else jnp.asarray(np.asarray(kv_lens, np.int32))
        return [np.asarray(x) for x in PU.block_union(jnp.asarray(blocks), cu, kl, tile_rows)]

    def expand(self, blocks, q_lens, kv_lens):
        jnp = self.jnp
        from qsa_pallas import prefill_union as PU

        cu = jnp.asarray(I.cu_seqlens_from_counts(q_lens))
        kl = None if kv_lens is None else jnp.asarray(np.asarray(kv_lens, np.int32))
        return np.asarray(PU.expand_blocks(jnp.asarray(blocks), cu, kl))


_BACKENDS: dict = {}


@pytest.fixture(params=["triton", "pallas"])
def backend(request):
    if request.param not in _BACKENDS:
        _BACKENDS[request.param] = (TritonBackend if request.param == "triton"
                                    else PallasBackend)()
    return _BACKENDS[request.param]


# --------------------------------------------------------------------------------------------
# The block rule (numpy)
def test_expansion_is_the_indexer_expansion_and_drops_junk():
    """``expand_prefill_blocks`` of the generator's clean selections has the token contract's
    valid counts (``expected_valid_count``: 4 per selected block plus the causal tail), valid
    entries first, all causal; junk block ids (-1, -7, the first invisible block, +19, int32
    extremes) anywhere in a row are dropped; a duplicate expands twice."""
    ql, kl = np.array([9, 6]), np.array([300, 6])
    clean = I.prefill_block_indices(ql, kl, block_width=16, seed=4)
    tok = I.expand_prefill_blocks(clean, ql, kl)
    _req, _r, vis, bound = I.row_layout(ql, kl)
    valid = I.valid_mask(tok, bound)
    assert tok.shape == (15, 67)
    np.testing.assert_array_equal(valid.sum(1), I.expected_valid_count(vis, width=67))
    assert not (valid[:, 1:] & ~valid[:, :-1]).any()
    assert (np.where(valid, tok, -1) < vis[:, None]).all()
    junky = I.prefill_block_indices(ql, kl, block_width=16, junk="mixed", junk_anywhere=True,
                                    seed=4)
    junk = (junky < 0) | (junky >= vis[:, None] // 4)
    assert len(np.unique(junky[junk])) > 4
    assert (junk[:, :-1] & ~junk[:, 1:]).any()  # junk before a valid id: anywhere in the row
    np.testing.assert_array_equal(np.sort(I.expand_prefill_blocks(junky, ql, kl), 1),
                                  np.sort(tok, 1))
    dup = clean.copy()
    dup[13, 1] = dup[13, 0]  # row 13 sees 5 tokens: block 0 (listed twice) + its tail token 4
    got = I.expand_prefill_blocks(dup, ql, kl)[13]
    assert sorted(got[got >= 0].tolist()) == [0, 0, 1, 1, 2, 2, 3, 3, 4]
    # an empty batch expands to an empty [0, W] (it raised a numpy reshape error)
    assert I.expand_prefill_blocks(np.zeros((0, NB), np.int32), [0], [5]).shape == (0, 4 * NB + 3)


def test_tile_slots_cover_every_tile_once_and_fit_the_grid():
    for ql in ([5, 1, 7, 4], [8], [0, 3, 0, 9], [1] * 6):
        for r in (1, 2, 4, 8):
            req, first, n = I.tile_slots(ql, r)
            cu = I.cu_seqlens_from_counts(ql)
            slots = cu[req] // r + req + first // r
            assert len(set(slots.tolist())) == len(slots) and (slots < n).all()
            assert n == sum(ql) // r + len(ql)
            covered = sorted((b, f + i) for b, f in zip(req, first) for i in range(r)
                             if f + i < ql[b])
            assert covered == sorted((b, i) for b in range(len(ql)) for i in range(ql[b]))


def test_neighbour_jaccard_and_calibration():
    req, _r, vis, _b = I.row_layout([2048], [32768])
    sel = lambda o: I.select_blocks(vis, req, overlap=o, sinks=4, seed=1)  # noqa: E731
    lo, hi = I.neighbour_jaccard(sel(0.0), req, vis), I.neighbour_jaccard(sel(1.0), req, vis)
    assert lo < 0.15 < 0.95 < hi
    o, j = I.calibrate_overlap(0.9, vis, req, sinks=4, pairs=256)
    assert 0.0 < o < 1.0 and abs(j - 0.9) < 0.03
    assert abs(I.neighbour_jaccard(sel(o), req, vis) - 0.9) < 0.03
    b = sel(0.5)
    long_rows = vis // 4 > 512
    assert (np.sort(b[long_rows], 1)[:, :4] == np.arange(4)).all()  # the sink blocks
    assert (I.select_blocks(vis, req, overlap=0.5, seed=1) ==
            I.select_blocks(vis, req, overlap=0.5, sinks=0, seed=1)).all()


# --------------------------------------------------------------------------------------------
# Selector (interop.geometry.select_prefill_blocks): every boundary
def _sel(total_q=8192, requests=1, group=12, nb=512, overlap=None, arch="sm_90", kv_bytes=2,
         backend="triton"):
    return select_prefill_blocks(DeviceFacts.for_arch(arch), "chunk", total_q=total_q,
                                 requests=requests, max_q=total_q // requests, group=group,
                                 num_kv_heads=1, head_dim=256, block_width=nb, backend=backend,
                                 kv_bytes=kv_bytes, overlap=overlap)


def test_selector_boundaries():
    u = UNION_RULES
    assert _sel().key[:3] == ("union", 4, 64)
    # overlap hint: below min_overlap -> rows, at it -> union
    assert _sel(overlap=u["min_overlap"]).kind == "union"
    assert _sel(overlap=np.nextafter(u["min_overlap"], 0)).kind == "rows"
    assert _sel(overlap=0.0).kind == "rows" and _sel(overlap=1.0).kind == "union"
    # rows per request (batches of 4096 requests): 1 -> rows, 2 -> union with R = 2, 3 -> R = 2,
    # 4 -> R = 4
    assert _sel(total_q=4096, requests=4096).kind == "rows"
    assert _sel(total_q=8192, requests=4096).tile_rows == 2
    assert _sel(total_q=12288, requests=4096).tile_rows == 2
    assert _sel(total_q=16384, requests=4096).tile_rows == 4
    # T x Hkv >= min_rows_per_sm x SMs (132 on sm_90: 1980 rows), else rows, whatever R (2048
    # rows: union at G 6 and 12; 1024: rows); the MTP verify shape (32 requests x 4 rows) -> rows
    need = u["min_rows_per_sm"] * DeviceFacts.for_arch("sm_90").sm_count
    for group, r in ((12, 4), (6, 8)):
        assert _sel(total_q=need, group=group).key[:2] == ("union", r)
        assert _sel(total_q=need - 1, group=group).kind == "rows"
        assert _sel(total_q=2048, group=group).kind == "union"
        assert _sel(total_q=1024, group=group).kind == "rows"
    # KV heads count: half the rows at Hkv = 2 reach the bound
    two = select_prefill_blocks(DeviceFacts.for_arch("sm_90"), "chunk", total_q=-(-need // 2),
                                requests=1, max_q=-(-need // 2), group=12, num_kv_heads=2,
                                head_dim=256, block_width=512)
    assert two.kind == "union", two
    assert _sel(total_q=need, backend="pallas").kind == "union"
    assert _sel(total_q=need - 1, backend="pallas").kind == "rows"
    mtp = _sel(total_q=128, requests=32)
    assert mtp.kind == "rows" and mtp.source.startswith("rows[rows=128<"), mtp
    # Triton: R x next_pow2(G) = q_rows, capped at max_tile_rows; Pallas (dense rows): R x G <=
    # q_rows, the Q tile the next power of two
    for group, r, rp in ((16, 4, 4), (12, 4, 5), (10, 4, 6), (9, 4, 7), (8, 8, 8), (6, 8, 8),
                         (5, 8, 8), (3, 8, 8), (1, 8, 8)):
        geo, pal = _sel(group=group), _sel(group=group, backend="pallas")
        assert (geo.tile_rows, geo.head_tile) == (r, max(16, r * I_next_pow2(group))), group
        assert (pal.tile_rows, pal.head_tile) == (rp, max(16, I_next_pow2(rp * group))), group
    # Pallas R: the mean rows per request, not its power of two
    assert _sel(total_q=12288, requests=4096, backend="pallas").tile_rows == 3
    # the sort cap: R x next_pow2(NB) <= max_sort_keys
    assert _sel(nb=2048).tile_rows == 4 and _sel(nb=2049).tile_rows == 2
    assert _sel(nb=u["max_sort_keys"] // 2).tile_rows == 2
    assert _sel(nb=u["max_sort_keys"]).kind == "rows"
    # the shared-memory fit: fewer stages, then BLOCK_N down to max(16, R + 3), never below
    geo = _sel()
    assert fit_union(geo, backend="triton", head_dim=256, kv_bytes=2, limit=None) == geo
    small = fit_union(geo, backend="triton", head_dim=256, kv_bytes=2, limit=60_000)
    assert (small.block_n, small.num_stages) == (16, 1) and "fit<=60000B" in small.source
    r8 = fit_union(_sel(group=6), backend="pallas", head_dim=256, kv_bytes=2, limit=1)
    assert r8.tile_rows == 8 and r8.block_n == 16  # the floor holds the R + 3 tail positions
    # rows: the per-row selector's geometry
    rows = _sel(overlap=0.0)
    assert rows.tile_rows == 1 and rows.source.startswith("rows[overlap")
    with pytest.raises(ValueError):
        _sel(overlap=1.5)


def I_next_pow2(x):
    return 1 << max(0, (x - 1).bit_length())


def assert_union(ublk, umem, ulen, ref, what=""):
    """A device build equals ``interop.indices.tile_union``: each tile's blocks and membership
    bits up to its length, ``REPEATED_TILE`` where a row lists a valid block twice (None)."""
    for (s, h), v in ref.items():
        n = int(ulen[s, h])
        if v is None:
            assert n == I.REPEATED_TILE, (what, s, h, n)
            continue
        assert n == len(v[0]), (what, s, h)
        np.testing.assert_array_equal(ublk[s, h, :n], v[0], err_msg=f"{what} {s} {h}")
        np.testing.assert_array_equal(umem[s, h, :n], v[1], err_msg=f"{what} {s} {h}")


def test_every_union_geometry_fits_sm12x_shared_memory_and_holds_its_tail():
    for arch in ("sm_120", "sm_121", "sm_90"):
        limit = DeviceFacts.for_arch(arch).smem_per_block
        geos = all_union_configs(arch)
        assert {g.tile_rows for _, g in all_union_configs(arch, backend="triton")} == {2, 4, 8}
        assert ({g.tile_rows for _, g in all_union_configs(arch, backend="pallas")}
                == {2, 4, 5, 6, 7, 8})
        # each backend compiles only its own tiles (qsa compile); together they are every tile
        per = [{(k, g.key) for k, g in all_union_configs(arch, backend=b)}
               for b in ("triton", "pallas")]
        assert per[0] | per[1] == {(k, g.key) for k, g in geos}
        assert all(len(p) < len(geos) for p in per)
        for kv_bytes, g in geos:
            assert smem_bytes(head_tile=g.head_tile, block_n=g.block_n, head_dim=256,
                              num_stages=g.num_stages, kv_bytes=kv_bytes) <= limit, (arch, g)
            assert g.block_n >= g.tile_rows + 3 and g.block_n % 4 == 0
            assert 16 <= g.block_n <= 32  # register pressure: BLOCK_N 16-32
    # one union tile for both packages at G = 12 but R (Pallas packs 5 rows of 12 heads);
    # Pallas pipelines one stage deeper where shared memory holds it (UNION_RULES["tile"])
    pallas, triton = _sel(backend="pallas").key, _sel().key
    assert (pallas[1], triton[1]) == (5, 4) and pallas[2:5] == triton[2:5]
    assert (pallas[5], triton[5]) == (3, 2)


# --------------------------------------------------------------------------------------------
# Union build and expansion on the device, both backends
def test_union_build_and_expansion_match_the_reference(backend):
    ql, kl = [5, 1, 7, 0, 4], [9, 30, 7, 2, 40]
    blocks = I.prefill_block_indices(ql, kl, block_width=6, junk="mixed", junk_anywhere=True,
                                     duplicates=4, empty_rows=[6], num_kv_heads=2, seed=8)
    for r in (2, 3, 4) if backend.name == "pallas" else (2, 4):  # Pallas: any R
        ublk, umem, ulen = backend.build(blocks, ql, kl, r)
        ref = I.tile_union(blocks, ql, kl, tile_rows=r)
        assert ulen.shape == (sum(ql) // r + len(ql), 2)
        # tiles whose rows repeat a block (the per-row kernel's) and tiles built
        assert any(v is None for v in ref.values()) and any(v for v in ref.values()), r
        seen = {s for s, _ in ref}
        assert_union(ublk, umem, ulen, ref, f"R={r}")
        assert (ulen[[s for s in range(ulen.shape[0]) if s not in seen]] == 0).all()
    np.testing.assert_array_equal(backend.expand(blocks, ql, kl),
                                  I.expand_prefill_blocks(blocks, ql, kl))
    np.testing.assert_array_equal(backend.expand(blocks[:, 0], ql, None),
                                  I.expand_prefill_blocks(blocks[:, 0], ql, None))


def test_pallas_union_build_sorts_four_tiles_a_row():
    """Pallas's build sorts four tiles in one sort row where rows of more than 8192 keys and
    more than 52 of them result (``_sort_tiles``; every union call on a GPU): the union still
    equals ``interop.indices.tile_union`` for each tile, junk and repeated ids included, the
    last sort row padded (lines not a multiple of four), per-KV-head selections too."""
    pytest.importorskip("jax")
    from qsa_pallas import prefill_union as PU

    ql, kl = [530, 539], [4000, 3000]  # R = 8: 135 slots x 2 heads, 68 sort rows
    blocks = I.prefill_block_indices(ql, kl, block_width=300, junk="mixed", junk_anywhere=True,
                                     duplicates=2, num_kv_heads=2, seed=3)
    assert -(-(2 * PU.union_slots(sum(ql), 2, 8)) // PU._SORT_GROUP) > 52
    assert PU._SORT_GROUP * 8 * 300 > 8192 and (2 * PU.union_slots(sum(ql), 2, 8)) % 4
    ublk, umem, ulen = (np.asarray(x) for x in PU.block_union(
        blocks, I.cu_seqlens_from_counts(ql), np.asarray(kl, np.int32), 8))
    ref = I.tile_union(blocks, ql, kl, tile_rows=8)
    assert any(v is None for v in ref.values()) and any(v for v in ref.values())
    assert_union(ublk, umem, ulen, ref, "four tiles a sort row")


def _tile_kinds(blocks, q_lens, kv_lens, r):
    """Per (slot, head) of ``I.tile_union``: (every row in indexer order, some row lists a
    valid id twice)."""
    nb_vis = np.maximum(I.row_layout(q_lens, kv_lens, check=False)[2], 0) // 4
    blocks = blocks if blocks.ndim == 3 else blocks[:, None]
    cu = I.cu_seqlens_from_counts(q_lens)
    reqs, firsts, _ = I.tile_slots(q_lens, r)
    out = {}
    for b, j0 in zip(reqs, firsts):
        rows = range(cu[b] + j0, min(cu[b] + j0 + r, cu[b + 1]))
        for h in range(blocks.shape[1]):
            ids = [blocks[t, h] for t in rows]
            ok = [(g >= 0) & (g < nb_vis[t]) for t, g in zip(rows, ids)]
            srt = all((np.diff(g[v]) >= 0).all() and not (~v[:-1] & v[1:]).any()
                      for g, v in zip(ids, ok))
            dup = any(len(g[v]) > len(np.unique(g[v])) for g, v in zip(ids, ok))
            out[(int(cu[b]) // r + int(b) + int(j0) // r, h)] = (srt, dup)
    return out


def test_triton_union_build_merge_path_matches_reference():
    """The Triton build merges the rows of a tile whose rows are in indexer order (valid ids
    ascending, invalid after) and sorts the rows of any other tile first: on tiles of both
    kinds in one call (requests straddled by every R, duplicates in sorted and unsorted rows,
    junk of every kind, an all-junk row, an empty request), R = 2 / 4 / 8 / 16, 32- and 64-bit
    keys, the union equals ``interop.indices.tile_union`` with the check on and with every
    tile forced through the row sort; then R = 16 x 64 ids (the membership pass unpacked)."""
    import torch

    from qsa_triton import prefill_union as PU

    ql, kl = [5, 1, 19, 0, 6], [9, 30, 90, 2, 40]
    raw = I.prefill_block_indices(ql, kl, block_width=6, junk="mixed", junk_anywhere=True,
                                  duplicates=6, empty_rows=[6], seed=8)
    blocks = indexer_order(raw, ql, kl)
    blocks[[13, 21]] = raw[[13, 21]]  # out of order: their tiles sort rows, the others merge
    torch_cu = torch.from_numpy(I.cu_seqlens_from_counts(ql))
    klt = torch.tensor(np.asarray(kl, np.int32))
    for r in (2, 4, 8, 16):
        kinds = _tile_kinds(blocks, ql, kl, r)
        assert any(s and d for s, d in kinds.values()), r  # sorted rows with copies
        assert any(s and not d for s, d in kinds.values()), r
        assert any(not s for s, _ in kinds.values()), r
        ref = I.tile_union(blocks, ql, kl, tile_rows=r)
        bound = None if r in (2, 16) else max(kl) // 4 + 1  # 64-bit / 32-bit keys
        got = {}
        for detect in (True, False):
            ublk, umem, ulen = (x.numpy() for x in PU.build_block_union(
                torch.from_numpy(blocks), torch_cu, klt, r, bound, detect_sorted=detect))
            assert_union(ublk, umem, ulen, ref, f"R={r} detect={detect}")
            got[detect] = ulen
        np.testing.assert_array_equal(got[True], got[False])
    # R = 16 x 64 ids per row: the membership pass's two prefix sums no longer share one int32
    ql, kl = [16, 3], [600, 40]
    raw = I.prefill_block_indices(ql, kl, block_width=64, junk="mixed", junk_anywhere=True,
                                  duplicates=3, seed=3)
    blocks = indexer_order(raw, ql, kl)
    blocks[16:] = raw[16:]
    assert _tile_kinds(blocks, ql, kl, 16) == {(0, 0): (True, True), (2, 0): (False, False)}
    ublk, umem, ulen = (x.numpy() for x in PU.build_block_union(
        torch.from_numpy(blocks), torch.from_numpy(I.cu_seqlens_from_counts(ql)),
        torch.tensor(kl, dtype=torch.int32), 16))
    ref = I.tile_union(blocks, ql, kl, tile_rows=16)
    assert ref[(0, 0)] is None and ref[(2, 0)]  # a repeat in the merged tile, none in the other
    assert_union(ublk, umem, ulen, ref, "R=16")


def test_triton_union_build_skips_tiles_estimated_past_the_bound():
    """The build's density test (``skip_past``): tiles of random selections (neighbour Jaccard
    ~0, union ~R x NB) are not built and get length skip_past + 1; tiles of overlapping
    selections (Jaccard 0.9) are built exactly as ``interop.indices.tile_union``; a skipped
    tile's exact union is past the bound; and a call on random selections through the tile-union
    geometry equals the reference (the skipped tiles' rows on the per-row kernel)."""
    torch = pytest.importorskip("torch")
    from interop.geometry import max_union_entries
    from qsa_triton import prefill_union as PU

    ql, kl, nb, r = [13, 8], [4096, 2000], 64, 4
    cu = torch.from_numpy(I.cu_seqlens_from_counts(ql))
    klt = torch.tensor(kl, dtype=torch.int32)
    bound = max_union_entries(UnionGeometry("union", r, 64, 16, 4, 1, "test"), nb, 16)
    for overlap in (0.0, 0.9):
        blocks = I.prefill_block_indices(ql, kl, block_width=nb, overlap=overlap, seed=5)
        ref = I.tile_union(blocks, ql, kl, tile_rows=r)
        ublk, umem, ulen = (x.numpy() for x in PU.build_block_union(
            torch.from_numpy(blocks), cu, klt, r, None, skip_past=bound))
        skipped = 0
        for (s, h), (b, m) in ref.items():  # no repeated block here: every value a union
            n = int(ulen[s, h])
            if n == bound + 1 and len(b) != n:
                skipped += 1
                assert len(b) > bound, (overlap, s, len(b))
                continue
            assert n == len(b), (overlap, s)
            np.testing.assert_array_equal(ublk[s, h, :n], b)
            np.testing.assert_array_equal(umem[s, h, :n], m)
        idle = [s for s in range(ulen.shape[0]) if (s, 0) not in ref]
        assert idle and (ulen[idle] == 0).all(), overlap  # idle slots: length 0
        full = sum(1 for (s, _), (b, _) in ref.items() if len(b) >= r * nb // 2)
        assert skipped == (full if overlap == 0.0 else 0), (overlap, skipped, full)
    with pytest.raises(ValueError, match="skip_past"):
        PU.build_block_union(torch.from_numpy(blocks), cu, klt, r, None, skip_past=-1)
    case = block_case("chunk", 12, 1, [9, 4], [300, 60], nb=16, overlap=0.0, seed=9)
    a, bound = case.arrays, max_union_entries(union_geometry(case, 4), 16, 16)
    ulen = PU.build_block_union(torch.from_numpy(case.blocks),
                                torch.from_numpy(a["cu_seqlens_q"]),
                                torch.from_numpy(a["kv_lens"]), 4, None, skip_past=bound)[2]
    assert 0 < int((ulen == bound + 1).sum()) < ulen.numel()  # both routes in the call
    be = _BACKENDS.setdefault("triton", TritonBackend())
    assert_matches(be.run(case, union_geometry(case, 4)), case.reference(), "triton random")


# --------------------------------------------------------------------------------------------
# Attention, both backends: tile-union kernel and the per-row kernel on the other tiles
@pytest.mark.parametrize("name", list(CASES))
def test_union_kernel_matches_reference(backend, name):
    case = CASES[name]()
    ref = case.reference()
    r = 4 if case.kind != "chunk" else 2
    out = backend.run(case, union_geometry(case, r))
    assert_matches(out, ref, f"{backend.name} {name} R={r}")
    if name == "ordinary-ragged":
        zero = (ref == 0).all(axis=(1, 2))
        assert zero[9] and not zero[4]  # no valid block + visible % 4 == 0 vs a tail left
        np.testing.assert_array_equal(backend.run(case, union_geometry(case, r)), out)


SWITCH_WORK = pytest.mark.parametrize("work", [0.0, 0.1, 1e9],
                                      ids=["rows-path", "mixed", "union-path"])


def _switch_mix(case):
    """(tiles the union kernel takes, tiles the per-row kernel takes) of ``case`` at R = 4 under
    the current ``max_union_work`` (``interop.geometry.max_union_entries`` on the reference
    union lengths, which the device builds equal)."""
    from interop.geometry import max_union_entries

    a = case.arrays
    ql = np.diff(a["cu_seqlens"] if case.kind == "ordinary" else a["cu_seqlens_q"])
    kl = None if case.kind == "ordinary" else a["kv_lens"]
    bound = max_union_entries(union_geometry(case, 4), NB, 16)
    sizes = [I.REPEATED_TILE if v is None else len(v[0])
             for v in I.tile_union(case.blocks, ql, kl, tile_rows=4).values()]
    return sum(n <= bound for n in sizes), sum(n > bound for n in sizes)


@SWITCH_WORK
@pytest.mark.parametrize("name", ["ordinary-ragged", "chunk-fp8-perhead", "paged-lying-poisoned"])
def test_triton_per_tile_switch_paths_match_reference(name, work, monkeypatch):
    """The per-tile switch (``interop.geometry.max_union_entries``): every tile to the per-row
    kernel (bound 0), tiles of both kinds in one call (work 0.1), every tile on the union kernel
    (no bound) give the reference, junk, duplicates, lying metadata and empty rows included."""
    from interop import geometry

    monkeypatch.setitem(geometry.UNION_RULES, "max_union_work", work)
    case = CASES[name]()
    be = _BACKENDS.setdefault("triton", TritonBackend())
    if work == 0.1:
        assert all(_switch_mix(case)), name
    out = be.run(case, union_geometry(case, 4))
    assert_matches(out, case.reference(), f"triton {name} max_union_work={work}")


@SWITCH_WORK
@pytest.mark.parametrize("name", ["ordinary-ragged", "chunk-fp8-perhead", "paged-lying-poisoned"])
def test_pallas_per_tile_switch_paths_match_reference(name, work, monkeypatch):
    """The Pallas twin of ``test_triton_per_tile_switch_paths_match_reference``."""
    from interop import geometry

    monkeypatch.setitem(geometry.UNION_RULES, "max_union_work", work)
    case = CASES[name]()
    be = _BACKENDS.setdefault("pallas", PallasBackend())
    out = be.run(case, union_geometry(case, 4))
    assert_matches(out, case.reference(), f"pallas {name} max_union_work={work}")


@pytest.mark.parametrize("r", [2, 4, 8])
def test_union_tail_step_gathers_no_unselected_row(backend, r):
    """NaN / Inf in every K/V row no row selects never reach a union tile's output: with every
    row's blocks invalid only the causal tails are attended, and position 4k + 3 lies in no
    row's tail although the tile's tail step spans it; rows with nothing visible stay 0."""
    case = block_case("ordinary", 6, 1, [8, 7], empty_rows=list(range(15)), poison=True,
                      seed=11)
    ref = case.reference()
    assert np.isfinite(ref).all()
    assert_matches(backend.run(case, union_geometry(case, r)), ref, f"{backend.name} R={r}")


@pytest.mark.parametrize("r", [2, 4])
def test_union_clamps_a_lying_kv_range_into_k(backend, r):
    """Chunk metadata that lies (kv_lens 40 over 24 rows of k): positions past k's rows are
    valid and read k's last row (qsa-contract.md §7), on the union path as on the per-row
    path; the build must not drop their blocks."""
    case = block_case("chunk", 6, 1, [4], [36], junk="-1", duplicates=0, seed=12)
    a = case.arrays
    for n in ("k", "v"):
        a[n] = np.ascontiguousarray(a[n][:24])
    case.blocks[:] = -1
    case.blocks[:, :2] = [0, 8]  # block 8: positions 32..35, past k's 24 rows
    a["indices"] = I.expand_prefill_blocks(case.blocks, [4], a["kv_lens"])
    ref = case.reference()
    assert_matches(backend.run(case, union_geometry(case, r)), ref, f"{backend.name} R={r}")


@pytest.mark.parametrize("route", ["union", "per-row"])
@pytest.mark.parametrize("span", [24.0, 96.0])
def test_rising_scores_take_both_rescale_paths(backend, route, span):
    """Conditional rescaling (both prefill kernels keep a stale row max until a new score passes
    it by more than 2^8): keys whose scores rise with their position (request by request, up
    to ``span`` in log2 units over a request's keys) make the walk both skip and take the
    rescale many times; union tiles visit blocks in ascending order (steady growth), the
    per-row kernel in the rows' index order. The union kernel at R = 4, or the per-row kernel
    alone, unsplit, 16 columns a step (7 steps a row)."""
    from tests.prefill_case import rounded

    case = block_case("chunk", 6, 1, [9, 7], [70, 40], nb=24, duplicates=0, seed=21)
    a = case.arrays
    rng = np.random.default_rng(5)
    d = a["q"].shape[-1]
    a["q"] = rounded(1.0 + 0.05 * rng.standard_normal(a["q"].shape), case.dtype)
    pos = np.zeros(a["k"].shape[0])
    cu = a["cu_seqlens_k"]
    for b in range(len(cu) - 1):
        n = int(cu[b + 1] - cu[b])
        pos[cu[b]:cu[b + 1]] = np.arange(n) / max(n - 1, 1)
    # score ~ q . k / sqrt(d) in nats = pos x span x ln 2 (log2 units: pos x span)
    ramp = pos * span * np.log(2.0) / np.sqrt(d)
    a["k"] = rounded(ramp[:, None, None] + 0.05 * rng.standard_normal(a["k"].shape),
                     case.kv_dtype)
    ref = case.reference()
    geo = (union_geometry(case, 4) if route == "union"
           else UnionGeometry("rows", 1, 16, 16, 4, 1, "test"))
    assert_matches(backend.run(case, geo), ref, f"{backend.name} {route} span={span}")


@pytest.mark.parametrize("r", [5, 8])
def test_union_builds_drop_block_ids_past_the_sort_key_limit(backend, r):
    """qsa-contract.md §7: the builds sort keys block x R + row, 31 bits in Triton, 30 in Pallas
    (two bits name a tile among four sorted together), so ids of floor((2**31 - 1) / R) (Triton)
    or floor((2**30 - 1) / R) (Pallas) and more are invalid in the union, the id below is kept.
    Reachable only through a row seeing more than ~8.6e8 tokens (here a lying kv_lens). Found
    by a break trial."""
    if backend.name == "triton" and r & (r - 1):
        pytest.skip("Triton's tiles have a power-of-two R")
    limit = (2**31 - 1 if backend.name == "triton" else 2**30 - 1) // r
    ql, kl = [r], [2**31 - 1]
    blocks = np.full((r, 3), -1, np.int32)
    blocks[:, 0] = 1
    blocks[0, 1], blocks[1, 1] = limit - 1, limit
    if backend.name == "triton":
        import torch

        from qsa_triton import prefill_union as PU

        ulen = PU.build_block_union(torch.from_numpy(blocks),
                                    torch.from_numpy(I.cu_seqlens_from_counts(ql)),
                                    torch.tensor(kl, dtype=torch.int32), r, limit)
        ublk, ulen = ulen[0].numpy(), ulen[2].numpy()
    else:
        ublk, _, ulen = backend.build(blocks, ql, kl, r)
    assert int(ulen[0, 0]) == 2 and list(ublk[0, 0, :2]) == [1, limit - 1], (ulen, ublk[0, 0])


def test_lying_kv_range_near_int32_max_clamps_into_k():
    """A lying chunk range whose positions reach 2**31 past a nonzero cu_seqlens_k[b]: every
    position still clamps into k's last row (qsa-contract.md §7), on the block path (union and
    per-row kernels) and the token path of both packages; cu_seqlens_k[b] + position must not
    wrap in int32 (it read row 0). Found by a break trial."""
    torch = pytest.importorskip("torch")
    jnp = pytest.importorskip("jax.numpy")
    import qsa_pallas
    import qsa_triton
    from interop import reference as Rf

    rng = np.random.default_rng(0)
    ql, cu_q = [1, 1], np.array([0, 1, 2], np.int32)
    cu_k, kv_lens = np.array([0, 10, 20], np.int32), np.array([10, 2**31 - 1], np.int32)
    q = rng.standard_normal((2, 6, 32)).astype(np.float16)
    k, v = (rng.standard_normal((20, 1, 32)).astype(np.float16) for _ in range(2))
    blocks = np.full((2, 5), -1, np.int32)
    blocks[0, 0] = 1
    blocks[1, :2] = [2**29 - 2, 3]  # positions 2**31 - 8 .. 2**31 - 5, past k's 20 rows
    idx = I.expand_prefill_blocks(blocks, ql, kv_lens)
    ref = Rf.prefill_chunk_reference(*(x.astype(np.float32) for x in (q, k, v)), idx, cu_q, cu_k,
                                     kv_lens)
    t, j = torch.from_numpy, jnp.asarray
    for sel in ("blocks", "tokens"):
        kw = {"block_indices": blocks} if sel == "blocks" else {}
        out = qsa_triton.sparse_prefill_chunk(
            t(q), t(k), t(v), None if kw else t(idx), t(cu_q), t(cu_k), t(kv_lens), 1,
            **{n: t(x) for n, x in kw.items()})
        assert_matches(out.float().numpy(), ref, f"triton {sel}")
        out = qsa_pallas.sparse_prefill_chunk(
            j(q), j(k), j(v), None if kw else j(idx), j(cu_q), j(cu_k), j(kv_lens), 1,
            **{n: j(x) for n, x in kw.items()})
        assert_matches(np.asarray(out).astype(np.float32), ref, f"pallas {sel}")
    # the tile-union kernels themselves (a forced union geometry, R = 2)
    case = block_case("chunk", 6, 1, [2, 2], [10, 10], junk="-1", duplicates=0, seed=13)
    a = case.arrays
    a["cu_seqlens_k"] = np.array([0, 10, 20], np.int32)
    a["kv_lens"] = np.array([10, 2**31 - 1], np.int32)
    for n in ("k", "v"):
        a[n] = np.ascontiguousarray(a[n][:20])
    case.blocks[:] = -1
    case.blocks[:, 0] = 1
    case.blocks[2:, 1:3] = [2**29 - 2, 3]
    a["indices"] = I.expand_prefill_blocks(case.blocks, [2, 2], a["kv_lens"])
    for name, be in (("triton", TritonBackend), ("pallas", PallasBackend)):
        got = _BACKENDS.setdefault(name, be()).run(case, union_geometry(case, 2))
        assert_matches(got, case.reference(), f"{name} union kernel")


def test_selected_paths_match_reference(backend, monkeypatch):
    """The public entry point without a forced geometry, paged: the selector's union kernel (8
    rows per request at G = 6 -> R = 8, the row-count rule off for this small batch) and, with
    the overlap hint below the rule, the per-row kernel on the on-device expansion (then the slot
    pre-pass)."""
    from interop import geometry

    monkeypatch.setitem(geometry.UNION_RULES, "min_rows_per_sm", 0)
    case = block_case("paged", 6, 1, [8, 9], [3, 20], junk="len", table_junk=True, seed=5)
    geo = _sel(total_q=17, requests=2, group=6, nb=NB)
    assert geo.key[:2] == ("union", 8)
    ref = case.reference()
    assert_matches(backend.run(case), ref, f"{backend.name} selected union")
    assert_matches(backend.run(case, overlap=0.0), ref, f"{backend.name} selected rows")


def test_repeated_ids_past_the_visible_tokens_push_the_tail_out(backend):
    """Repeated ids count per occurrence, and a row reads only the first min(W, visible)
    entries of its expansion (the token path's early stop, qsa-contract.md §3): row 4 of an
    ordinary prefill listing [1, 0, 1, 0] (block 1 not yet visible, block 0 twice) attends
    tokens 0, 1, 2, 3, 0 and not its own token 4; with [1, 0, -1, -1] it attends token 4."""
    case = block_case("ordinary", 2, 1, [8], nb=4, seed=3)
    rows = np.array([[1, 0, 1, 0], [1, 0, -1, -1]], np.int32)
    for blocks, sees_own in ((rows[0], False), (rows[1], True)):
        case.blocks = np.tile(blocks, (8, 1))
        case.arrays["indices"] = I.expand_prefill_blocks(case.blocks, [8], None)
        base = backend.run(case)
        assert_matches(base, case.reference(), f"{backend.name} {blocks.tolist()}")
        v = case.arrays["v"]
        old = v[4].copy()
        v[4] += 8.0  # token 4: row 4's causal tail (visible = 5)
        try:
            moved = np.abs(backend.run(case)[4] - base[4]).max()
        finally:
            v[4] = old
        assert (moved > 0.1) == sees_own, (blocks.tolist(), moved)


def test_empty_table_and_empty_pool_give_zeros(backend):
    case = block_case("paged", 6, 1, [3], [5], seed=9)
    case.arrays["req_to_token"] = np.ascontiguousarray(case.arrays["req_to_token"][:, :0])
    assert (backend.run(case) == 0).all()
    case = block_case("paged", 6, 1, [3], [5], seed=9)
    for n in ("k_cache", "v_cache"):
        case.arrays[n] = case.arrays[n][:0]
    assert (backend.run(case) == 0).all()


def test_torch_compile_names_a_bad_overlap_once_it_is_symbolic():
    """Under torch.compile a second ``overlap`` value makes it a symbolic float; a bad one after
    that still fails with the ContractError text (the check formats a plain float: a symbolic
    one cannot be formatted while tracing). Found by a fresh-user trial."""
    torch = pytest.importorskip("torch")
    import qsa_triton

    case = block_case("chunk", 12, 1, [8], [40], seed=4)
    t = TritonBackend().tensors(case)

    def fn(overlap):
        return qsa_triton.sparse_prefill_chunk(
            t["q"], t["k"], t["v"], None, t["cu_seqlens_q"], t["cu_seqlens_k"], t["kv_lens"], 8,
            block_indices=t["block_indices"], overlap=overlap)

    torch._dynamo.reset()
    cf = torch.compile(fn, fullgraph=True, backend="aot_eager")
    for overlap in (0.95, 0.5):
        assert torch.equal(cf(overlap), fn(overlap)), overlap
    with pytest.raises(Exception) as info:
        cf(2.0)
    msg = str(info.value)
    assert "overlap" in msg and "[0, 1]" in msg and "2.0" in msg, msg[:400]


def test_contract_checks_name_the_block_selection(backend):
    case = block_case("ordinary", 6, 1, [3], seed=6)
    if backend.name == "triton":
        torch = backend.torch
        t = backend.tensors(case)
        fn = backend.P.sparse_prefill
        blocks64 = t["block_indices"].long()
        args = (t["q"], t["k"], t["v"])
        cu = t["cu_seqlens"]
        idx = torch.from_numpy(case.arrays["indices"])
    else:
        a = backend.arrays(case)
        fn = backend.qp.sparse_prefill
        blocks64 = np.asarray(case.blocks, np.int64)
        args = (a["q"], a["k"], a["v"])
        cu = a["cu_seqlens"]
        idx = a["indices"]
        t = a
    with pytest.raises(ContractError, match="block_indices.*int32"):
        fn(*args, None, cu, 3, block_indices=blocks64)
    with pytest.raises(ContractError, match="exactly one selection"):
        fn(*args, idx, cu, 3, block_indices=t["block_indices"])
    with pytest.raises(ContractError, match="exactly one selection"):
        fn(*args, None, cu, 3)
    with pytest.raises(ContractError, match="overlap"):
        fn(*args, None, cu, 3, block_indices=t["block_indices"], overlap=1.5)
    with pytest.raises(ContractError, match="overlap"):
        fn(*args, idx, cu, 3, overlap=0.5)
    # a 2051-wide token row passed as block ids: more columns than any indexer top-k
    rows = idx.shape[0]
    tokens = (torch.zeros((rows, 2051), dtype=torch.int32) if backend.name == "triton"
              else backend.jnp.zeros((rows, 2051), backend.jnp.int32))
    with pytest.raises(ContractError, match="block_indices.*NB <= 2048.*indices="):
        fn(*args, None, cu, 3, block_indices=tokens)


def test_block_ops_registered_with_fake_impls():
    """The block-level custom ops: schema and fake-tensor behaviour (torch.compile sees them
    as opaque ops whose fake implementation runs the contract check)."""
    import torch

    be = TritonBackend()
    case = block_case("paged", 6, 1, [2], [3], seed=7)
    t = be.tensors(case)
    args = (t["q"], t["k_cache"], t["v_cache"], t["req_to_token"], t["req_indices"],
            t["block_indices"], t["cu_seqlens_q"], t["kv_lens"], 2, 0.125, 1.0, 1.0, -1.0)
    torch.library.opcheck(torch.ops.qsa.sparse_prefill_paged_blocks.default, args,
                          test_utils=("test_schema", "test_faketensor"))


def test_bench_smoke_cpu(tmp_path):
    """``bench.prefill --mode union --smoke-cpu``: a chunk and a paged FP8 case with calibrated
    block selections; every provider that runs here passes its check against the FP32
    reference (upstream's needs the peer)."""
    from bench import prefill  # noqa: PLC0415

    path = tmp_path / "union.json"
    rc = prefill.main(["--mode", "union", "--smoke-cpu", "--json", str(path), "--providers",
                       "ours-union,ours-hinted,ours-rows,pallas-union"])
    rep = json.loads(path.read_text())
    assert rc == 0 and rep["ran"] == ["ours-union", "ours-hinted", "ours-rows", "pallas-union"]
    assert {c["kind"] for c in rep["cases"]} == {"chunk", "paged"}
    for case in rep["cases"]:
        assert case["valid_entries"] > 0 and 0.0 <= case["jaccard"] <= 1.0
        for name in rep["ran"]:
            assert case["providers"][name]["ok"], (name, case["providers"][name])


# --------------------------------------------------------------------------------------------
# GPU (H200; the lead runs: pytest -m gpu tests/test_prefill_union.py)
gpu = pytest.mark.gpu
GPU_T = 8192


def _gpu_case(kind, kv_len, hq, hkv, kv_dtype="bfloat16", seed=0, **kw):
    fp8 = kv_dtype == "float8_e4m3fn"
    case = make_case(kind, hq, hkv, [GPU_T], None if kind == "ordinary" else [kv_len - GPU_T],
                     d=256, width=2051, dtype="bfloat16", kv_dtype=kv_dtype, junk="mixed",
                     pool_slack=1000, k_scale=0.5 if fp8 else 1.0, v_scale=1.5 if fp8 else 1.0,
                     seed=seed)
    kl = None if kind == "ordinary" else case.arrays["kv_lens"]
    case.blocks = I.prefill_block_indices([GPU_T], kl, block_width=512, sinks=4, junk="mixed",
                                          junk_anywhere=True, duplicates=3,
                                          empty_rows=[0, 7, GPU_T - 1], seed=seed + 1, **kw)
    case.arrays["indices"] = I.expand_prefill_blocks(case.blocks, [GPU_T], kl)
    return case


GPU_CASES = [("ordinary", 8192, 12, 1, "bfloat16"), ("chunk", 8192, 6, 1, "bfloat16"),
             ("chunk", 32768, 12, 1, "bfloat16"), ("chunk", 131072, 24, 2, "bfloat16"),
             ("chunk", 32768, 12, 1, "float8_e4m3fn"), ("paged", 32768, 12, 1, "bfloat16"),
             ("paged", 32768, 24, 2, "float8_e4m3fn")]
_GPU_IDS = [f"{c[0]}-kv{c[1] // 1024}k-{c[2]}x{c[3]}-{c[4]}" for c in GPU_CASES]


@gpu
@pytest.mark.parametrize("kind,kv_len,hq,hkv,kv_dtype", GPU_CASES, ids=_GPU_IDS)
def test_gpu_triton_union_8192_rows(kind, kv_len, hq, hkv, kv_dtype):
    import torch

    from tests.prefill_case import torch_reference

    case = _gpu_case(kind, kv_len, hq, hkv, kv_dtype, seed=hq + kv_len % 89)
    be = TritonBackend()
    t = {n: x.cuda() for n, x in be.tensors(case).items()}
    t["indices"] = torch.from_numpy(case.arrays["indices"]).cuda()
    geo = be.P.prefill_block_geometry(kind, t["q"], requests=1, max_q=GPU_T,
                                      num_kv_heads=hkv, block_width=512,
                                      kv_bytes=t["q"].element_size() if kv_dtype == "bfloat16"
                                      else 1)
    assert geo.kind == "union", geo
    out1 = be.run(case, t=t)
    out2 = be.run(case, t=t)
    assert np.array_equal(out1, out2), "second run not bitwise equal"
    ref = torch_reference(kind, t, None, case.k_scale, case.v_scale)
    assert_matches(out1, ref.cpu().double().numpy(), f"triton union {kind} {kv_len} {hq}/{hkv}")


@gpu
@pytest.mark.parametrize("kind,kv_len,hq,hkv,kv_dtype", GPU_CASES[::2], ids=_GPU_IDS[::2])
def test_gpu_pallas_union_8192_rows(kind, kv_len, hq, hkv, kv_dtype):
    import jax
    import jax.numpy as jnp

    if jax.default_backend() != "gpu":
        pytest.skip("needs a CUDA GPU for jax")
    from tests.test_pallas_prefill import jax_reference_f32

    case = _gpu_case(kind, kv_len, hq, hkv, kv_dtype, seed=hq + kv_len % 89)
    be = PallasBackend()
    a = be.arrays(case)
    out1, out2 = be.run(case, t=a), be.run(case, t=a)
    assert np.array_equal(out1, out2), "second run not bitwise equal"
    ref = np.asarray(jax_reference_f32(kind, a, case.k_scale, case.v_scale))
    assert_matches(out1, ref, f"pallas union {kind} {kv_len} {hq}/{hkv}")
    del jnp


@gpu
@pytest.mark.parametrize("r", [4, 8])
def test_gpu_triton_union_build_merge_path_8192_rows(r):
    """The production build (8192 rows, 512 block ids per row, overlap 0.9, 4 sink blocks, 32k
    context): rows in the indexer's order give ``interop.indices.tile_union`` through the merge
    path, as through the row-sort path (their speed: ``bench.prefill --mode union``,
    bench/NOTES.md)."""
    import torch

    from qsa_triton import prefill_union as PU

    ql, kl = [GPU_T], [32768]
    blocks = indexer_order(I.prefill_block_indices(ql, kl, block_width=512, sinks=4,
                                                   overlap=0.9, seed=r), ql, kl)
    b = torch.from_numpy(blocks).cuda()
    cu = torch.from_numpy(I.cu_seqlens_from_counts(ql)).cuda()
    klt = torch.tensor(kl, dtype=torch.int32, device="cuda")
    bound = 32768 // 4 + 1
    ref = I.tile_union(blocks, ql, kl, tile_rows=r)
    for detect in (True, False):
        ublk, umem, ulen = (x.cpu().numpy() for x in PU.build_block_union(
            b, cu, klt, r, bound, detect_sorted=detect))
        assert_union(ublk, umem, ulen, ref, f"detect={detect}")


@gpu
def test_gpu_triton_union_paged_lying_metadata_junk_fp8():
    """The memcheck target (compute-sanitizer): junk block ids everywhere, a table narrower than
    kv_len, slots outside the pool, a table row outside req_to_token, poisoned slots."""
    import torch

    from tests.prefill_case import torch_reference

    case = block_case("paged", 12, 1, [300, 77, 40], [4000, 1500, 900], nb=512, junk="mixed",
                      lie=True, poison=True, table_junk=True, pool_slack=1000, seed=31,
                      dtype="bfloat16", kv_dtype="float8_e4m3fn", k_scale=0.9, v_scale=1.1)
    be = TritonBackend()
    t = {n: x.cuda() for n, x in be.tensors(case).items()}
    t["indices"] = torch.from_numpy(case.arrays["indices"]).cuda()
    # d = 32 cases stay small enough for the sanitizer; the union kernel is forced
    out = be.run(case, union_geometry(case, 4, 32), t=t)
    torch.cuda.synchronize()
    ref = torch_reference("paged", t, None, case.k_scale, case.v_scale)
    assert_matches(out, ref.cpu().double().numpy(), "paged lying fp8 union")


@gpu
def test_gpu_triton_union_and_rows_beside_it_in_a_graph():
    """8192 rows of mixed selections (generator overlap 0.75: about 18% of the tiles past the
    union bound): the union kernel and, on sm_90+, the per-row kernel on the other tiles' rows
    as its PDL dependent (``qsa_triton.prefill_union``, module docstring, 3). Eager, then
    captured in a CUDA graph and replayed after new block ids are copied in: every row matches
    the reference, replays are bitwise the eager call's (each row is written by one kernel)."""
    import torch

    from interop.geometry import max_union_entries
    from tests.prefill_case import torch_reference

    cases = [_gpu_case("chunk", 32768, 12, 1, seed=s, overlap=0.75) for s in (51, 52)]
    be = TritonBackend()
    kl = cases[0].arrays["kv_lens"]
    geo = be.P.prefill_block_geometry("chunk", torch.empty((GPU_T, 12, 256)), requests=1,
                                      max_q=GPU_T, num_kv_heads=1, block_width=512)
    assert geo.kind == "union", geo
    bound = max_union_entries(geo, 512, 16)
    for c in cases:  # both routes in every call
        sizes = [I.REPEATED_TILE if u is None else len(u[0])
                 for u in I.tile_union(c.blocks, [GPU_T], kl, tile_rows=geo.tile_rows).values()]
        assert 0 < sum(n > bound for n in sizes) < len(sizes) // 2, (bound, max(sizes))
    t = {n: x.cuda() for n, x in be.tensors(cases[0]).items()}

    def call():
        return be.P.sparse_prefill_chunk(t["q"], t["k"], t["v"], None, t["cu_seqlens_q"],
                                         t["cu_seqlens_k"], t["kv_lens"], GPU_T,
                                         block_indices=t["block_indices"])

    eager = [call().float().cpu().numpy()]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = call()
    t["block_indices"].copy_(torch.from_numpy(cases[1].blocks).cuda())
    eager.append(call().float().cpu().numpy())
    for i, c in ((1, cases[1]), (0, cases[0]), (1, cases[1])):
        t["block_indices"].copy_(torch.from_numpy(c.blocks).cuda())
        graph.replay()
        torch.cuda.synchronize()
        got = out.float().cpu().numpy()
        assert np.array_equal(got, eager[i]), f"replay of selection {i} differs from eager"
    for i, c in enumerate(cases):
        t["indices"] = torch.from_numpy(c.arrays["indices"]).cuda()
        ref = torch_reference("chunk", t, None)
        assert_matches(eager[i], ref.cpu().double().numpy(), f"mixed selection {i}")


@gpu
def test_gpu_triton_union_cuda_graph_replay_with_new_metadata():
    import torch

    from tests.prefill_case import torch_reference

    first = block_case("chunk", 12, 1, [256, 256], [1792, 3840], nb=512, seed=41,
                       dtype="bfloat16")
    second = block_case("chunk", 12, 1, [256, 256], [1792, 1244], nb=512, seed=42,
                        dtype="bfloat16")
    be = TritonBackend()
    t = {n: x.cuda() for n, x in be.tensors(first).items()}
    be.run(first, t=t)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = be.P.sparse_prefill_chunk(t["q"], t["k"], t["v"], None, t["cu_seqlens_q"],
                                        t["cu_seqlens_k"], t["kv_lens"], 256,
                                        block_indices=t["block_indices"])
    t2 = {n: x.cuda() for n, x in be.tensors(second).items()}
    for n in ("kv_lens", "block_indices"):
        t[n].copy_(t2[n])
    graph.replay()
    torch.cuda.synchronize()
    t["indices"] = torch.from_numpy(second.arrays["indices"]).cuda()
    ref = torch_reference("chunk", t, None)
    assert_matches(out.float().cpu().numpy(), ref.cpu().double().numpy(), "graph replay")
