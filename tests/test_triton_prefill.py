"""Triton sparse prefill (ordinary, chunk, paged) against ``interop.reference``.

CPU: Triton interpreter (``tests/conftest.py`` sets TRITON_INTERPRET=1), tiny shapes, fp16 mostly
(bf16 only with ``tests/triton_interp_patch.py`` applied). GPU (``-m gpu``): 8192-row cases against
a float32 torch reference that is itself checked against the float64 oracle here.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest
import torch

from bench.prefill import errors, make_case, reference_f32, within_tolerance
from interop.contract import ContractError
from qsa_triton import prefill as P

HAS_CUDA = torch.cuda.is_available()
DEV = "cuda" if HAS_CUDA else "cpu"
FP16 = torch.float16
FP8 = torch.float8_e4m3fn


def _check(case, out=None):
    out = case.run() if out is None else out
    ref = case.numpy_reference()
    err = errors(out.float().cpu().numpy(), ref)
    assert within_tolerance(err), err
    return out, ref


def _bf16_ok() -> bool:
    if HAS_CUDA:
        return True
    try:
        from tests import triton_interp_patch  # noqa: PLC0415

        return bool(triton_interp_patch.applied)
    except ImportError:
        return False


# ------------------------------------------------------------------------------------ ordinary
@pytest.mark.parametrize("hq,hkv", [(3, 1), (6, 1), (12, 1), (12, 2), (24, 2)])
def test_ordinary_head_pairs_ragged(hq, hkv):
    case = make_case("ordinary", hq, hkv, 64, [5, 1, 7], width=12, junk="mixed", dtype=FP16,
                     nan_unselected=True, seed=hq * 10 + hkv, device=DEV)
    _check(case)


@pytest.mark.parametrize("junk", ["-1", "-7", "len", "len+19"])
def test_ordinary_junk_modes_per_head(junk):
    case = make_case("ordinary", 6, 2, 32, [4, 6], width=9, junk=junk, per_head=True,
                     dtype=FP16, nan_unselected=True, seed=3, device=DEV)
    assert case.indices.dim() == 3
    _check(case)


def test_ordinary_d256_bf16():
    if not _bf16_ok():
        pytest.skip("interpreter bf16 dot is wrong without tests/triton_interp_patch.py")
    case = make_case("ordinary", 12, 1, 256, [6], width=8, junk="len", dtype=torch.bfloat16,
                     seed=5, device=DEV)
    _check(case)


def test_rows_without_valid_entry_are_exact_zero():
    case = make_case("ordinary", 6, 1, 32, [4, 5], width=8, junk="len+19", dtype=FP16,
                     empty_rows=[0, 2, 5], nan_unselected=True, seed=4, device=DEV)
    out, _ = _check(case)
    for r in (0, 2, 5):
        assert torch.equal(out[r].cpu(), torch.zeros_like(out[r].cpu()))


# ------------------------------------------------------------------------------------ chunk
@pytest.mark.parametrize("hq,hkv,per_head", [(6, 1, False), (12, 2, True), (24, 2, False)])
def test_chunk_with_prefix_ragged(hq, hkv, per_head):
    case = make_case("chunk", hq, hkv, 64, [3, 4, 1], [9, 4, 14], width=13, junk="mixed",
                     per_head=per_head, dtype=FP16, nan_unselected=True, seed=7 + hq, device=DEV)
    _check(case)


def test_chunk_fp8_kv_with_scales():
    case = make_case("chunk", 6, 1, 64, [3, 2], [10, 6], width=11, junk="len", dtype=FP16,
                     kv_dtype=FP8, k_scale=0.75, v_scale=1.5, nan_unselected=True, seed=8,
                     device=DEV)
    assert case.k.dtype == FP8
    _check(case)


def test_fp8_conversion_path_matches_upcast_kv():
    """FP8 K/V give the same result as the same values already upcast to q's dtype (e4m3 values
    are exact in fp16), with the scales folded in by the reference."""
    case = make_case("chunk", 12, 1, 32, [4], [7], width=7, dtype=FP16, kv_dtype=FP8,
                     k_scale=2.0, v_scale=0.5, seed=9, device=DEV)
    out8 = case.run()
    case16 = make_case("chunk", 12, 1, 32, [4], [7], width=7, dtype=FP16, kv_dtype=FP8,
                       k_scale=2.0, v_scale=0.5, seed=9, device=DEV)
    k16, v16 = case16.k.to(FP16), case16.v.to(FP16)
    out16 = P._chunk_impl(case16.q, k16, v16, case16.indices, case16.cu_q, case16.cu_k,
                          case16.kv_lens, case16.max_q, 32 ** -0.5, 2.0, 0.5)
    torch.testing.assert_close(out8.float(), out16.float(), rtol=1e-3, atol=1e-3)


# ------------------------------------------------------------------------------------ paged
@pytest.mark.parametrize("inline", [False, True])
@pytest.mark.parametrize("per_head", [False, True])
def test_paged_junk_table_and_pool(inline, per_head, monkeypatch):
    monkeypatch.setenv("QSA_PAGED_SLOTS", "inline" if inline else "prepass")
    case = make_case("paged", 12, 2, 32, [3, 4], [8, 11], width=10, junk="mixed",
                     per_head=per_head, dtype=FP16, nan_unselected=True, pool_slack=5,
                     table_junk=True, seed=11, device=DEV)
    _check(case)


def test_paged_fp8_with_scales():
    case = make_case("paged", 6, 1, 64, [2, 3], [5, 9], width=9, junk="len+19", dtype=FP16,
                     kv_dtype=FP8, k_scale=1.25, v_scale=0.8, nan_unselected=True, pool_slack=3,
                     table_junk=True, seed=12, device=DEV)
    _check(case)


def test_resolve_pool_slots_prepass():
    case = make_case("paged", 6, 1, 32, [3, 2], [6, 7], width=8, junk="mixed", table_junk=True,
                     pool_slack=2, seed=13, device=DEV)
    slots = P.resolve_pool_slots(case.indices, case.slot_table, case.cu_q, case.kv_lens,
                                 case.max_q).cpu().numpy()
    idx, st = case.indices.cpu().numpy(), case.slot_table.cpu().numpy()
    cu, kl = case.cu_q.cpu().numpy(), case.kv_lens.cpu().numpy()
    for b in range(2):
        for r in range(cu[b + 1] - cu[b]):
            row = cu[b] + r
            vis = r + kl[b] - (cu[b + 1] - cu[b]) + 1
            for c in range(idx.shape[1]):
                e = idx[row, c]
                want = st[b, e] if (0 <= e < kl[b] and c < vis) else -1
                assert slots[row, c] == want


# ------------------------------------------------------------------------------------ properties
def test_two_runs_bitwise_equal():
    case = make_case("chunk", 12, 1, 64, [4, 3], [6, 9], width=12, junk="mixed", dtype=FP16,
                     seed=14, device=DEV)
    a, b = case.run(), case.run()
    assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["ordinary", "chunk"])
def test_deferred_row_sum_matches_per_tile_row_sum(kind, monkeypatch):
    """prefill v1.5: the softmax denominator reduced once per row (DEFER_ROWSUM, default) gives
    the reference and the per-tile row sum's values to FP32 rounding, junk entries and a row
    without valid entry included."""
    kv = None if kind == "ordinary" else [7, 30]
    case = make_case(kind, 12, 1, 64, [6, 20], kv, width=24, junk="mixed", dtype=FP16,
                     nan_unselected=True, seed=21, device=DEV)
    assert P.DEFER_ROWSUM is True
    deferred, _ = _check(case)
    monkeypatch.setattr(P, "DEFER_ROWSUM", False)
    per_tile, _ = _check(case)
    torch.testing.assert_close(deferred.float(), per_tile.float(), rtol=2e-3, atol=2e-3)


def test_geometry_does_not_change_the_result_beyond_rounding():
    case = make_case("ordinary", 6, 1, 32, [9], width=20, junk="len", dtype=FP16, seed=15,
                     device=DEV)
    outs = [P._prefill_impl(case.q, case.k, case.v, case.indices, case.cu_q, case.max_q,
                            32 ** -0.5, geometry=geo) for geo in ((16, 1, 2), (64, 4, 2), (8, 16, 4, 3))]
    for o in outs[1:]:
        torch.testing.assert_close(o.float(), outs[0].float(), rtol=2e-3, atol=2e-3)
    _check(case, outs[2])


def test_contract_checked_before_launch():
    case = make_case("ordinary", 6, 1, 32, [3], width=4, dtype=FP16, device=DEV)
    with pytest.raises(ContractError, match="indices"):
        P.sparse_prefill(case.q, case.k, case.v, case.indices.long(), case.cu_q, case.max_q)
    with pytest.raises(ContractError, match="k_scale"):
        P.sparse_prefill_chunk(case.q, case.k, case.v, case.indices, case.cu_q, case.cu_q,
                               case.cu_q[1:], case.max_q, None, 2.0, 1.0)


def test_bad_geometry_env_is_a_contract_error(monkeypatch):
    case = make_case("ordinary", 6, 1, 32, [3], width=4, dtype=FP16, device=DEV)
    monkeypatch.setenv("QSA_PREFILL_GEOMETRY", "fastest")
    with pytest.raises(ContractError, match="auto, table, tuned"):
        case.run()


@pytest.mark.parametrize("kind", ["ordinary", "chunk", "paged"])
@pytest.mark.parametrize("var,value", [("QSA_PREFILL_GEOMETRY", "fastest"),
                                       ("QSA_PREFILL_ALGO", "octets")])
def test_bad_env_switch_names_the_entry_point(kind, var, value, monkeypatch):
    """A bad switch fails in the public entry point, before the op, and names that entry point."""
    import qsa_triton

    case = make_case(kind, 6, 1, 32, [3], None if kind == "ordinary" else [5], width=4,
                     dtype=FP16, device=DEV)
    monkeypatch.setenv(var, value)
    fn = {"ordinary": "sparse_prefill", "chunk": "sparse_prefill_chunk",
          "paged": "sparse_prefill_paged"}[kind]
    with pytest.raises(ContractError, match=rf"^{fn}: argument '\${var}'"):
        if kind == "ordinary":
            qsa_triton.sparse_prefill(case.q, case.k, case.v, case.indices, case.cu_q, case.max_q)
        elif kind == "chunk":
            qsa_triton.sparse_prefill_chunk(case.q, case.k, case.v, case.indices, case.cu_q,
                                            case.cu_k, case.kv_lens, case.max_q)
        else:
            qsa_triton.sparse_prefill_paged(case.q, case.k, case.v, case.slot_table, case.indices,
                                            case.cu_q, case.kv_lens, case.max_q)


def test_custom_ops_registered_with_fake_impls():
    case = make_case("chunk", 6, 1, 32, [2], [4], width=4, dtype=FP16, device=DEV)
    args = (case.q, case.k, case.v, case.indices, case.cu_q, case.cu_k, case.kv_lens, case.max_q,
            0.125, 1.0, 1.0)
    torch.library.opcheck(torch.ops.qsa.sparse_prefill_chunk.default, args,
                          test_utils=("test_schema", "test_faketensor"))
    from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: PLC0415

    kv = case.q[:, :1].contiguous()
    mode = FakeTensorMode()
    fq, fk, fi, fc = (mode.from_tensor(t) for t in (case.q, kv, case.indices, case.cu_q))
    with mode:
        fake = torch.ops.qsa.sparse_prefill.default(fq, fk, fk, fi, fc, case.max_q, 0.1)
        assert fake.shape == case.q.shape and fake.dtype == case.q.dtype


def test_torch_reference_matches_oracle():
    for kind, kv in (("ordinary", None), ("chunk", [9, 5]), ("paged", [9, 5])):
        case = make_case(kind, 12, 2, 32, [4, 3], kv, width=10, junk="mixed", per_head=kind == "chunk",
                         dtype=FP16, nan_unselected=True, table_junk=kind == "paged", seed=16)
        ref64 = case.numpy_reference()
        ref32 = reference_f32(case, chunk_rows=3).numpy()
        np.testing.assert_allclose(ref32, ref64, rtol=1e-4, atol=1e-4)



# ------------------------------------------------------------------------------------ max_seqlen_q
_HINT_CASES = {
    "ordinary": dict(q_lens=[5, 1, 7], kv_lens=None),
    "chunk": dict(q_lens=[5, 1, 7], kv_lens=[9, 4, 12]),
    "paged": dict(q_lens=[5, 1, 7], kv_lens=[9, 4, 12]),
}


def _hint_case(kind, seed):
    c = _HINT_CASES[kind]
    return make_case(kind, 6, 1, 32, c["q_lens"], c["kv_lens"], width=9, junk="mixed",
                     dtype=FP16, nan_unselected=True, table_junk=kind == "paged", pool_slack=2,
                     empty_rows=[2], seed=seed, device=DEV)


def _same_with_small_hints(case):
    """max_seqlen_q is a grid-size hint: 1 and 2 (below the longest request, 7 rows) give the
    bitwise result of the right value, match the oracle, and leave no row unwritten (NaN)."""
    assert case.max_q == 7
    good, _ = _check(case)
    for hint in (1, 2):
        case.max_q = hint
        out = case.run()
        assert not bool(torch.isnan(out).any()), f"max_seqlen_q={hint}: rows left unwritten"
        assert torch.equal(out, good), f"max_seqlen_q={hint} differs from max_seqlen_q=7"
        _check(case, out)
    case.max_q = 7


@pytest.mark.parametrize("kind,slots", [("ordinary", None), ("chunk", None),
                                        ("paged", "prepass"), ("paged", "inline")])
def test_small_max_seqlen_q_covers_every_row(kind, slots, monkeypatch):
    if slots is not None:
        monkeypatch.setenv("QSA_PAGED_SLOTS", slots)
    _same_with_small_hints(_hint_case(kind, seed=70))


def test_resolve_pool_slots_small_max_seqlen_q():
    case = _hint_case("paged", seed=71)
    args = (case.indices, case.slot_table, case.cu_q, case.kv_lens)
    want = P.resolve_pool_slots(*args, 7)
    for hint in (1, 2):
        assert torch.equal(P.resolve_pool_slots(*args, hint), want)


@pytest.mark.parametrize("kind", ["ordinary", "paged"])
def test_pairs_small_max_seqlen_q_covers_every_row(pairs, kind):
    _same_with_small_hints(_hint_case(kind, seed=72))


@pytest.mark.parametrize("kind", ["ordinary", "chunk", "paged"])
def test_strict_rejects_outside_the_envelope(kind):
    """strict=True enforces the qualified envelope (D = 256): D = 64 is refused with a
    ContractError naming strict mode; the same call without strict runs."""
    case = _hint_case(kind, seed=73)
    fn = {"ordinary": P.sparse_prefill, "chunk": P.sparse_prefill_chunk,
          "paged": P.sparse_prefill_paged}[kind]
    with pytest.raises(ContractError, match=r"strict mode.*D=256|head dim D = 256.*strict mode"):
        case.run(**{f"fn_{kind}": functools.partial(fn, strict=True)})
    _check(case, case.run(**{f"fn_{kind}": functools.partial(fn, strict=False)}))


# ------------------------------------------------------------------------------------ GPU
gpu = pytest.mark.gpu


def _gpu_case(kind, hq, hkv, kv, seed):
    if kind == "ordinary":
        return make_case("ordinary", hq, hkv, 256, [8192], width=2051, dtype=torch.bfloat16,
                         seed=seed, device="cuda")
    return make_case("chunk", hq, hkv, 256, [8192], [kv], width=2051, dtype=torch.bfloat16,
                     seed=seed, device="cuda")


@gpu
@pytest.mark.parametrize("kind,kv", [("ordinary", 8192), ("chunk", 8192), ("chunk", 32768),
                                     ("chunk", 131072)])
@pytest.mark.parametrize("hq,hkv", [(6, 1), (12, 1), (24, 2)])
def test_gpu_8192_rows(kind, kv, hq, hkv):
    case = _gpu_case(kind, hq, hkv, kv, seed=hq + kv % 97)
    out1 = case.run()
    out2 = case.run()
    torch.cuda.synchronize()
    assert torch.equal(out1, out2), "second run not bitwise equal"
    err = errors(out1.float(), reference_f32(case))
    assert within_tolerance(err), err


@gpu
def test_gpu_fp8_paged_and_side_stream():
    case = make_case("paged", 12, 1, 256, [1024, 700], [4096, 9000], width=2051,
                     dtype=torch.bfloat16, kv_dtype=FP8, k_scale=0.9, v_scale=1.1,
                     junk="mixed", table_junk=True, pool_slack=1000, nan_unselected=True,
                     seed=21, device="cuda")
    main = case.run()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out_side = case.run()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert torch.equal(main, out_side)
    err = errors(main.float(), reference_f32(case))
    assert within_tolerance(err), err


@gpu
def test_gpu_torch_reference_matches_oracle_small():
    case = make_case("chunk", 12, 2, 256, [37, 5], [300, 90], width=2051, junk="mixed",
                     per_head=True, dtype=torch.bfloat16, seed=22, device="cuda")
    np.testing.assert_allclose(reference_f32(case).cpu().numpy(), case.numpy_reference(),
                               rtol=1e-3, atol=1e-3)
    err = errors(case.run().float(), case.numpy_reference())
    assert within_tolerance(err), err


@gpu
def test_gpu_cuda_graph_replay_with_changed_lengths():
    case = make_case("chunk", 12, 1, 256, [256, 256], [2048, 4096], width=2051,
                     dtype=torch.bfloat16, seed=23, device="cuda")
    case.run()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = case.run()
    g.replay()
    torch.cuda.synchronize()
    err = errors(out.float(), reference_f32(case))
    assert within_tolerance(err), err
    # shrink the second request's context in place (device data only) and replay
    short = make_case("chunk", 12, 1, 256, [256, 256], [2048, 1500], width=2051,
                      dtype=torch.bfloat16, seed=24, device="cuda")
    case.kv_lens.copy_(short.kv_lens)
    case.indices.copy_(short.indices)
    g.replay()
    torch.cuda.synchronize()
    err = errors(out.float(), reference_f32(case))
    assert within_tolerance(err), err


def test_env_override_is_read_every_call(monkeypatch):
    q = torch.zeros(8192, 12, 256, dtype=FP16)
    monkeypatch.setenv("QSA_PREFILL_GEOMETRY", "table")
    a = P.prefill_geometry("ordinary", q, requests=1, max_q=8192, num_kv_heads=1, width=2051)
    monkeypatch.setenv("QSA_PREFILL_GEOMETRY", "tuned")
    b = P.prefill_geometry("ordinary", q, requests=1, max_q=8192, num_kv_heads=1, width=2051)
    assert a.source.startswith(("sm90-table", "l20-table", "h20-table")) and "tuned" in b.source


# ------------------------------------------------------------------------------------ pairs
@pytest.fixture(params=["pairs/torch", "pairs/kernel", "quads/torch", "quads/kernel"])
def pairs(monkeypatch, request):
    """The row-group kernels, with rows sorted by torch.sort before the union pre-pass or by
    tl.sort inside it."""
    algo, sort = request.param.split("/")
    monkeypatch.setenv("QSA_PREFILL_ALGO", algo)
    monkeypatch.setenv("QSA_GROUP_SORT", sort)
    return algo


@pytest.mark.parametrize("kind,kv", [("ordinary", None), ("chunk", [9, 5, 14]),
                                     ("paged", [9, 5, 14])])
@pytest.mark.parametrize("hq,hkv,per_head", [(3, 1, False), (12, 1, False), (12, 2, True),
                                             (24, 2, False)])
def test_pairs_match_oracle(pairs, kind, kv, hq, hkv, per_head):
    case = make_case(kind, hq, hkv, 32, [5, 4, 7], kv, width=11, junk="mixed", per_head=per_head,
                     dtype=FP16, nan_unselected=True, empty_rows=[3], table_junk=kind == "paged",
                     pool_slack=3, overlap=0.7, seed=40 + hq + hkv, device=DEV)
    _check(case)


def test_pairs_fp8_and_low_overlap(pairs):
    case = make_case("chunk", 6, 1, 64, [6, 3], [17, 9], width=13, junk="len+19", dtype=FP16,
                     kv_dtype=FP8, k_scale=0.6, v_scale=1.7, overlap=0.0, nan_unselected=True,
                     seed=41, device=DEV)
    _check(case)


def test_pairs_duplicates_attend_twice(pairs):
    """Gather semantics: a position selected twice in a row counts twice, in row r, in row r+1,
    in both, or only in one of them."""
    case = make_case("chunk", 6, 1, 32, [8], [14], width=10, dtype=FP16, seed=42, device=DEV)
    idx = torch.full_like(case.indices, -1)
    rows = [[3, 3, 4, 0], [3, 5, 5, 5, 0], [1, 1, 2], [2, 2, 1, 1, 9], [7], [7, 7, 0, 0, 11],
            [4, 4, 4], [0, 11, 11, 3]]
    for r, sel in enumerate(rows):
        idx[r, :len(sel)] = torch.tensor(sel, dtype=torch.int32)
    case.indices = idx
    out, _ = _check(case)
    torch.testing.assert_close(out.float(), case.run().float(), rtol=0, atol=0)
    os_env = os.environ.pop("QSA_PREFILL_ALGO")
    try:
        rows_out = case.run()
    finally:
        os.environ["QSA_PREFILL_ALGO"] = os_env
    torch.testing.assert_close(out.float(), rows_out.float(), rtol=2e-3, atol=2e-3)


def test_pairs_union_lengths():
    """The union list of a pair is row r's visible columns plus the tokens only row r+1 selects."""
    from qsa_triton.prefill_pairs import pair_union  # noqa: PLC0415

    case = make_case("ordinary", 6, 1, 32, [7], width=9, overlap=0.5, seed=43, device=DEV)
    urow, uw, ulen = pair_union(0, case.indices, case.cu_q, case.cu_q, case.cu_q, case.cu_q,
                                case.max_q)
    idx = case.indices.cpu().numpy()
    for r0 in range(0, 7, 2):
        s0 = {int(e) for e in idx[r0, :min(9, r0 + 1)] if 0 <= e < 7}
        s1 = {int(e) for e in idx[r0 + 1, :min(9, r0 + 2)] if 0 <= e < 7} if r0 + 1 < 7 else set()
        n_u, n0 = ulen[r0, 0].tolist()
        assert n0 == min(9, r0 + 1)
        assert n_u == n0 + len(s1 - s0)
        assert set(urow[r0, 0, :n_u].tolist()) - {-1} == s0 | s1


def test_bad_algo_env(monkeypatch):
    case = make_case("ordinary", 6, 1, 32, [3], width=4, dtype=FP16, device=DEV)
    monkeypatch.setenv("QSA_PREFILL_ALGO", "octets")
    with pytest.raises(ContractError, match="rows, pairs, quads"):
        case.run()


def test_pairs_power_of_two_width_full_rows(pairs):
    """W a power of two with every column valid: the binary search's last probe matters."""
    case = make_case("ordinary", 6, 1, 32, [13], width=8, dtype=FP16, seed=44, device=DEV)
    g = torch.Generator().manual_seed(44)
    idx = torch.full((13, 8), -1, dtype=torch.int32)
    for r in range(13):
        sel = torch.randperm(r + 1, generator=g)[:8]
        idx[r, :sel.numel()] = sel.to(torch.int32)
    case.indices = idx.to(DEV)
    assert bool((case.indices[7:] >= 0).all())
    _check(case)


@pytest.fixture(params=["pairs", "quads"])
def gpu_groups(monkeypatch, request):
    """The row-group kernels on the GPU with the default (torch.sort) pre-sort only: the tl.sort
    variants are covered on CPU, and their compiles do not fit the GPU run's budget."""
    monkeypatch.setenv("QSA_PREFILL_ALGO", request.param)
    monkeypatch.delenv("QSA_GROUP_SORT", raising=False)
    return request.param


@gpu
@pytest.mark.parametrize("kind,kv,hq,hkv", [("ordinary", 8192, 6, 1), ("chunk", 32768, 12, 1),
                                            ("chunk", 131072, 24, 2)])
def test_gpu_pairs_8192_rows(gpu_groups, kind, kv, hq, hkv):
    case = _gpu_case(kind, hq, hkv, kv, seed=50 + hq)
    out1, out2 = case.run(), case.run()
    torch.cuda.synchronize()
    assert torch.equal(out1, out2)
    err = errors(out1.float(), reference_f32(case))
    assert within_tolerance(err), err


@gpu
def test_gpu_pairs_paged_junk(gpu_groups):
    case = make_case("paged", 12, 2, 256, [333, 64], [4096, 2100], width=2051, per_head=True,
                     junk="mixed", table_junk=True, pool_slack=100, nan_unselected=True,
                     kv_dtype=FP8, k_scale=0.8, v_scale=1.2, seed=51, device="cuda")
    err = errors(case.run().float(), reference_f32(case))
    assert within_tolerance(err), err


@pytest.mark.parametrize("algo", ["rows", "pairs", "quads"])
def test_forced_64bit_offsets_path(monkeypatch, algo):
    """The 64-bit K/V offset path (taken when k/v hold >= 2^31 elements) on small tensors."""
    monkeypatch.setenv("QSA_PREFILL_OFF64", "1")
    monkeypatch.setenv("QSA_PREFILL_ALGO", algo)
    for inline in ("prepass", "inline"):
        monkeypatch.setenv("QSA_PAGED_SLOTS", inline)
        case = make_case("paged", 12, 2, 32, [3, 5], [8, 11], width=10, junk="mixed",
                         dtype=FP16, nan_unselected=True, table_junk=True, pool_slack=4, seed=60,
                         device=DEV)
        _check(case)
    case = make_case("chunk", 6, 1, 32, [4, 3], [9, 5], width=10, junk="mixed", dtype=FP16,
                     seed=61, device=DEV)
    _check(case)
    assert P.needs_off64(case.k, case.v)
    monkeypatch.delenv("QSA_PREFILL_OFF64")
    assert not P.needs_off64(case.k, case.v)


def test_torch_compile_fullgraph_prefill_matches_eager_and_names_bad_arguments():
    """The three prefill entry points under torch.compile(fullgraph=True): same output as eager;
    a bad argument fails before any launch with the ContractError text (checked in the ops' fake
    implementations under compile, where Dynamo cannot raise out of the trace)."""
    import qsa_triton

    FP16 = torch.float16
    ch = make_case("chunk", 6, 1, 32, [3, 2], [9, 5], width=6, dtype=FP16, seed=21)
    pg = make_case("paged", 6, 1, 32, [3], [9], width=6, dtype=FP16, seed=22)
    od = make_case("ordinary", 6, 1, 32, [4, 2], width=6, dtype=FP16, seed=23)
    calls = {
        "ordinary": (lambda q, idx, cu: qsa_triton.sparse_prefill(q, od.k, od.v, idx, cu, od.max_q),
                     (od.q, od.indices, od.cu_q)),
        "chunk": (lambda q, idx, cu: qsa_triton.sparse_prefill_chunk(
            q, ch.k, ch.v, idx, cu, ch.cu_k, ch.kv_lens, ch.max_q), (ch.q, ch.indices, ch.cu_q)),
        "paged": (lambda q, idx, cu: qsa_triton.sparse_prefill_paged(
            q, pg.k, pg.v, pg.slot_table, idx, cu, pg.kv_lens, pg.max_q),
            (pg.q, pg.indices, pg.cu_q)),
    }
    for name, (fn, args) in calls.items():
        torch._dynamo.reset()
        cf = torch.compile(fn, fullgraph=True, backend="aot_eager")
        assert torch.equal(cf(*args), fn(*args)), name
        torch._dynamo.reset()
        with pytest.raises(Exception) as ei:
            torch.compile(fn, fullgraph=True, backend="aot_eager")(args[0], args[1].long(), args[2])
        msg = str(ei.value)
        assert "indices" in msg and "expected" in msg and "int64" in msg, (name, msg[:300])
