"""Backend-only behaviour of the Triton sparse prefill (``qsa_triton.prefill``).

Plain value sweeps over shapes live in the shared conformance tests (``interop.cases``); here:
paged pool addressing (scattered ``req_to_token`` rows, junk table entries, lying metadata,
poisoned pool slots, the slot pre-pass itself), the 64-bit offset path, the grid-size hint
``max_seqlen_q``, forced geometries, the FP8 conversion path, the contract and env checks before
any launch, the torch.library ops under ``torch.compile``. CPU: Triton interpreter (conftest sets
TRITON_INTERPRET=1), fp16, tiny shapes. GPU (``pytest -m gpu``, the H200): 8192-row cases, a pool
past 2**31 elements, CUDA-graph replay with changed device metadata.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

import qsa_triton
from interop import reference as R
from interop.contract import ContractError
from qsa_triton import prefill as P
from tests.prefill_case import (FLOATS, PARAMS, assert_matches, lying_paged_case, make_case,
                                torch_reference)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
FN = {"ordinary": qsa_triton.sparse_prefill, "chunk": qsa_triton.sparse_prefill_chunk,
      "paged": qsa_triton.sparse_prefill_paged}


def tensors(case, device=DEV) -> dict:
    """The case's arrays as torch tensors in the kernel dtypes."""
    out = {}
    for name, x in case.arrays.items():
        t = torch.from_numpy(np.ascontiguousarray(x))
        if name in FLOATS:
            t = t.to(getattr(torch, case.dtype if name == "q" else case.kv_dtype))
        out[name] = t.to(device)
    return out


def run(case, fn=None, t=None, **kw):
    t = tensors(case) if t is None else t
    args = [case.max_seqlen_q if n == "max_seqlen_q" else t[n] for n in PARAMS[case.kind]]
    return (fn or FN[case.kind])(*args, *case.scales(), **kw)


def check(case, out=None):
    out = run(case) if out is None else out
    assert_matches(out.float().cpu().numpy(), case.reference(), case.kind)
    return out


# ------------------------------------------------------------------------------------ paged
@pytest.mark.parametrize("per_head,kv_dtype", [(False, None), (True, "float8_e4m3fn")])
def test_paged_scattered_rows_junk_table_and_poisoned_pool(per_head, kv_dtype):
    scales = dict(k_scale=1.25, v_scale=0.8) if kv_dtype else {}
    case = make_case("paged", 12, 2, [3, 4], [8, 11], per_head=per_head, kv_dtype=kv_dtype,
                     table_junk=True, poison=True, empty_rows=[2], seed=11, **scales)
    assert case.arrays["req_to_token"].shape[0] > 2  # the requests' rows of a larger table
    check(case)


def test_paged_lying_metadata_is_masked_never_read():
    case = lying_paged_case(seed=12)
    ref = case.reference()
    assert (ref[7:] == 0).all() and not (ref[:7] == 0).all()  # request 2 has no valid entry
    check(case)


def test_resolve_pool_slots_is_the_addressing_rule():
    """The pre-pass writes req_to_token[req_indices[b], idx] for valid entries of visible
    columns and -1 elsewhere, for any grid-size hint."""
    case = lying_paged_case(seed=13)
    a = case.arrays
    t = tensors(case)
    pool = a["k_cache"].shape[0]
    cu, kl, idx = a["cu_seqlens_q"], a["kv_lens"], a["indices"]
    want = np.full(idx.shape, -1)
    for b in range(len(kl)):
        for row in range(cu[b], cu[b + 1]):
            vis = row - cu[b] + kl[b] - (cu[b + 1] - cu[b]) + 1
            for c in range(min(vis, idx.shape[-1])):
                e = idx[row, c]
                if 0 <= e < kl[b]:
                    want[row, c] = R.pool_slots_of(a["req_to_token"], a["req_indices"], b, [e],
                                                   pool)[0]
    assert (want >= 0).any() and (want == -1).any()
    for hint in (1, 2, case.max_seqlen_q):
        got = P.resolve_pool_slots(t["indices"], t["req_to_token"], t["req_indices"],
                                   t["cu_seqlens_q"], t["kv_lens"], hint, pool)
        np.testing.assert_array_equal(got.cpu().numpy(), want, err_msg=f"hint {hint}")


def test_paged_empty_table_and_empty_pool_give_zeros():
    case = make_case("paged", 6, 1, [3], [4], seed=14)
    t = tensors(case)
    t["req_to_token"] = t["req_to_token"][:, :0]
    assert (run(case, t=t) == 0).all()
    t = tensors(case)
    t["k_cache"], t["v_cache"] = t["k_cache"][:0], t["v_cache"][:0]
    assert (run(case, t=t) == 0).all()


def test_64bit_offset_path(monkeypatch):
    """The 64-bit K/V / pool offsets (taken when k/v hold >= 2**31 elements, see the GPU test)
    on small tensors."""
    chunk = make_case("chunk", 6, 1, [4, 3], [5, 2], seed=61)
    t = tensors(chunk)
    assert not P.needs_off64(t["k"], t["v"])
    monkeypatch.setattr(P, "needs_off64", lambda k, v: True)
    check(chunk)
    check(lying_paged_case(seed=60))


# ------------------------------------------------------------------------------------ launch
@pytest.mark.parametrize("kind", ["ordinary", "chunk", "paged"])
def test_small_max_seqlen_q_covers_every_row(kind):
    """max_seqlen_q is a grid-size hint: 1 and 2 (below the longest request, 7 rows) give the
    bitwise result of the right value (the tail launch computes the rest); a hint far above T
    acts as T (its grid used to be max_seqlen_q programs long)."""
    case = make_case(kind, 6, 1, [5, 1, 7], None if kind == "ordinary" else [4, 3, 5],
                     width=9, table_junk=True, empty_rows=[2], seed=70)
    assert case.max_seqlen_q == 7
    good = check(case)
    for hint in (1, 2, 10**9):
        case.max_seqlen_q = hint
        assert torch.equal(run(case), good), f"max_seqlen_q={hint}"


@pytest.mark.parametrize("kind,blocks,split", [
    ("ordinary", False, False), ("chunk", False, False), ("paged", False, False),
    ("paged", True, False), ("chunk", False, True), ("paged", True, True)])
def test_rows_outside_every_request_give_zeros(kind, blocks, split, monkeypatch):
    """A batch padded to a static T (rows before cu_seqlens_q[0] and past cu_seqlens_q[B], as a
    CUDA graph of a fixed size or ``qsa_prefill_step``'s padding rows): those rows are exact
    zeros, as in qsa_pallas (test_pallas_prefill.py), not whatever the allocator held. The
    output is not pre-filled (the tail launch writes those zeros): new float tensors come back
    NaN-filled here, so a row no kernel writes fails; ``split``: split-KV (the merge kernel
    writes the rows inside the requests), by a lowered ``min_split_columns``."""
    from interop import geometry

    if split:
        monkeypatch.setitem(geometry.PREFILL_SPLIT_RULES, "min_split_columns", 4)
    empty_like = torch.empty_like

    def poisoned(x, *args, **kwargs):
        y = empty_like(x, *args, **kwargs)
        return y.fill_(float("nan")) if y.is_floating_point() else y

    monkeypatch.setattr(torch, "empty_like", poisoned)
    case = make_case(kind, 6, 1, [4, 3], None if kind == "ordinary" else [2, 5], seed=67)
    t = tensors(case)
    pre, post = 2, 3

    def grow(x, fill):
        def pad(n):
            return torch.full((n,) + x.shape[1:], fill, dtype=x.dtype, device=x.device)
        return torch.cat([pad(pre), x, pad(post)])

    t["q"], t["indices"] = grow(t["q"], 1), grow(t["indices"], 0)
    if kind == "ordinary":
        t["k"], t["v"] = grow(t["k"], 1), grow(t["v"], 1)
    cu = "cu_seqlens" if kind == "ordinary" else "cu_seqlens_q"
    t[cu] = t[cu] + pre
    kw = {}
    if blocks:  # the block form: the selector's kernel (tile union or per-row)
        kw["block_indices"] = torch.zeros(t["q"].shape[0], 3, dtype=torch.int32, device=DEV)
        t["indices"] = None
    for _ in range(3):  # leave NaN in the allocator's free blocks of the output's size
        del_me = torch.full_like(t["q"], float("nan"))
        del del_me
    out = run(case, t=t, **kw).float().cpu()
    if blocks:  # the rows inside the requests as in the unpadded call
        u = tensors(case)
        u["indices"] = None
        want = run(case, t=u, block_indices=kw["block_indices"][pre:-post]).float().cpu()
        torch.testing.assert_close(out[pre:-post], want, atol=2e-3, rtol=2e-3)
    else:
        assert_matches(out[pre:-post].numpy(), case.reference(), f"padded {kind}")
    assert (out[:pre] == 0).all() and (out[-post:] == 0).all()


def test_forced_geometry_does_not_change_the_result_beyond_rounding():
    case = make_case("ordinary", 6, 1, [9], width=20, junk="len", seed=15)
    t = tensors(case)
    outs = [P._prefill_impl(t["q"], t["k"], t["v"], t["indices"], t["cu_seqlens"], 9,
                            32 ** -0.5, geometry=geo)
            for geo in ((16, 1, 2), (64, 4, 2), (8, 16, 4, 3))]
    for o in outs:
        check(case, o)
    torch.testing.assert_close(outs[1].float(), outs[0].float(), rtol=2e-3, atol=2e-3)
    # a head tile below G would leave heads unwritten (the output is not pre-filled): refused
    with pytest.raises(ValueError, match="BLOCK_M < G"):
        P._prefill_impl(t["q"], t["k"], t["v"], t["indices"], t["cu_seqlens"], 9, 32 ** -0.5,
                        geometry=(4, 16, 4, 3))


@pytest.mark.parametrize("kind,per_head,kv_dtype", [
    ("ordinary", False, None), ("chunk", True, "float8_e4m3fn"), ("paged", False, None),
    ("paged", True, "float8_e4m3fn")])
def test_split_kv_matches_reference_and_unsplit(kind, per_head, kv_dtype, monkeypatch):
    """Split-KV (``Geometry.splits`` > 1, through the entry points: the selector's count with a
    lowered ``min_split_columns``): 3 shares of the 4 BLOCK_N steps (one short) and 5 (one
    empty) match the reference and the unsplit kernel to rounding, with rows without a valid
    entry (exact zeros), junk entries, poisoned unselected K/V, and with a max_seqlen_q hint
    below the longest request (the tail launch's rows unsplit); two runs are bitwise equal."""
    from interop import geometry

    case = make_case(kind, 6, 2, [5, 1, 7], None if kind == "ordinary" else [4, 3, 60],
                     width=200, per_head=per_head, kv_dtype=kv_dtype, empty_rows=[2],
                     table_junk=kind == "paged", poison=True, seed=71)
    t = tensors(case)
    geo = functools.partial(P.prefill_geometry, kind, t["q"], requests=3, max_q=7,
                            num_kv_heads=2, width=200)
    monkeypatch.setitem(geometry.PREFILL_SPLIT_RULES, "min_split_columns", 10**6)
    assert geo().splits == 1
    whole = check(case)
    for cols, splits in ((64, 3), (16, 5)):
        monkeypatch.setitem(geometry.PREFILL_SPLIT_RULES, "min_split_columns", cols)
        assert geo().splits == splits and geo().block_n == 64, geo()
        out = check(case)
        torch.testing.assert_close(out.float(), whole.float(), rtol=2e-3, atol=2e-3)
        assert torch.equal(out, run(case))
        case.max_seqlen_q = 2
        torch.testing.assert_close(check(case).float(), out.float(), rtol=2e-3, atol=2e-3)
        case.max_seqlen_q = 7
    assert (out[case.empty_rows()].float() == 0).all()


def test_split_kv_count_past_the_default_max(monkeypatch):
    """A raised ``max_splits`` rule reaches the merge kernel's tile too (it is read per call, as
    ``Geometry`` reads it): 16 non-empty shares (one BLOCK_N step each) of a 2-row call match
    the reference."""
    from interop import geometry

    monkeypatch.setitem(geometry.PREFILL_SPLIT_RULES, "max_splits", 16)
    monkeypatch.setitem(geometry.PREFILL_SPLIT_RULES, "min_split_columns", 64)
    case = make_case("chunk", 6, 1, [2], [1100], width=1024, junk="mixed", seed=23)
    geo = P.prefill_geometry("chunk", tensors(case)["q"], requests=1, max_q=2, num_kv_heads=1,
                             width=1024)
    assert geo.splits == 16 and geo.block_n == 64, geo
    check(case)


def test_fp8_conversion_path_matches_upcast_kv():
    """FP8 K/V give the same result as the same values upcast to q's dtype (e4m3 values are exact
    in fp16), the scales applied in the kernel."""
    case = make_case("chunk", 12, 1, [4], [3], width=7, kv_dtype="float8_e4m3fn", seed=9)
    t = tensors(case)
    args = (t["indices"], t["cu_seqlens_q"], t["cu_seqlens_k"], t["kv_lens"], 4, 32 ** -0.5,
            2.0, 0.5)
    out8 = P._chunk_impl(t["q"], t["k"], t["v"], *args)
    out16 = P._chunk_impl(t["q"], t["k"].half(), t["v"].half(), *args)
    torch.testing.assert_close(out8.float(), out16.float(), rtol=1e-3, atol=1e-3)


def test_two_runs_bitwise_equal():
    case = make_case("paged", 12, 1, [4, 3], [2, 6], width=12, seed=14)
    assert torch.equal(run(case), run(case))


# ------------------------------------------------------------------------------------ checks
def test_contract_checked_before_launch():
    case = make_case("paged", 6, 1, [3, 2], [1, 2], width=4, seed=16)
    t = tensors(case)
    bad = {"indices": t["indices"].long(), "req_indices": t["req_indices"][:1],
           "req_to_token": t["req_to_token"].long(), "kv_lens": t["kv_lens"][:1]}
    for name, x in bad.items():
        with pytest.raises(ContractError, match=name):
            run(case, t=dict(t, **{name: x}))
    ch = make_case("chunk", 6, 1, [3], [1], width=4, seed=16)
    ch.k_scale = 2.0  # scales only with FP8 K/V
    with pytest.raises(ContractError, match="k_scale"):
        run(ch)


@pytest.mark.parametrize("kind", ["ordinary", "chunk", "paged"])
def test_bad_geometry_env_names_the_entry_point(kind, monkeypatch):
    case = make_case(kind, 6, 1, [3], None if kind == "ordinary" else [2], width=4, seed=17)
    monkeypatch.setenv("QSA_PREFILL_GEOMETRY", "fastest")
    fn = FN[kind].__name__
    with pytest.raises(ContractError, match=rf"^{fn}: argument '\$QSA_PREFILL_GEOMETRY'"):
        run(case)


def test_geometry_env_is_read_every_call(monkeypatch):
    q = torch.zeros(8192, 12, 256, dtype=torch.float16)
    monkeypatch.setenv("QSA_PREFILL_GEOMETRY", "table")
    a = P.prefill_geometry("ordinary", q, requests=1, max_q=8192, num_kv_heads=1, width=2051)
    monkeypatch.setenv("QSA_PREFILL_GEOMETRY", "tuned")
    b = P.prefill_geometry("ordinary", q, requests=1, max_q=8192, num_kv_heads=1, width=2051)
    assert a.source.startswith("sm90-table") and b.source.startswith("sm120-tuned")


@pytest.mark.parametrize("kind", ["ordinary", "chunk", "paged"])
def test_strict_rejects_outside_the_envelope(kind):
    """strict=True enforces the qualified envelope (D = 256): D = 32 is refused, naming strict
    mode; the same call without strict runs."""
    case = make_case(kind, 6, 1, [3, 2], None if kind == "ordinary" else [2, 1], seed=73)
    with pytest.raises(ContractError, match=r"strict mode.*D=256|head dim D = 256.*strict mode"):
        run(case, fn=functools.partial(FN[kind], strict=True))
    check(case, run(case, fn=functools.partial(FN[kind], strict=False)))


def test_custom_ops_registered_with_fake_impls():
    case = make_case("paged", 6, 1, [2], [2], width=4, seed=18)
    t = tensors(case)
    args = (t["q"], t["k_cache"], t["v_cache"], t["req_to_token"], t["req_indices"],
            t["indices"], t["cu_seqlens_q"], t["kv_lens"], 2, 0.125, 1.0, 1.0)
    torch.library.opcheck(torch.ops.qsa.sparse_prefill_paged.default, args,
                          test_utils=("test_schema", "test_faketensor"))
    from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: PLC0415

    with FakeTensorMode() as mode:
        fake = torch.ops.qsa.sparse_prefill_paged.default(
            *(mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in args))
        assert fake.shape == t["q"].shape and fake.dtype == t["q"].dtype


def test_torch_compile_fullgraph_matches_eager_and_names_bad_arguments():
    """The three entry points under torch.compile(fullgraph=True): the eager output; a bad
    argument fails with the ContractError text (checked in the ops' fake implementations, where
    Dynamo cannot raise out of the trace)."""
    for kind in ("ordinary", "chunk", "paged"):
        case = make_case(kind, 6, 1, [3, 2], None if kind == "ordinary" else [4, 1], width=6,
                         seed=21)
        t = tensors(case)

        def fn(q, idx, t=t, case=case):
            return run(case, t=dict(t, q=q, indices=idx))

        torch._dynamo.reset()
        assert torch.equal(torch.compile(fn, fullgraph=True, backend="aot_eager")(
            t["q"], t["indices"]), fn(t["q"], t["indices"])), kind
        torch._dynamo.reset()
        with pytest.raises(Exception) as info:
            torch.compile(fn, fullgraph=True, backend="aot_eager")(t["q"], t["indices"].long())
        msg = str(info.value)
        assert "indices" in msg and "expected" in msg and "int64" in msg, (kind, msg[:300])


def test_torch_compile_max_seqlen_q_that_changes():
    """max_seqlen_q changing between compiled calls (SGLang's per-batch bound) reaches the fake
    impls as a SymInt: accepted by the contract check, every call equal to eager."""
    for kind in ("ordinary", "paged"):
        case = make_case(kind, 6, 1, [3, 2], None if kind == "ordinary" else [4, 1], width=6,
                         seed=22)
        t = tensors(case)
        names = list(PARAMS[kind])

        def fn(q, msq, t=t, kind=kind, names=names):
            args = [msq if n == "max_seqlen_q" else (q if n == "q" else t[n]) for n in names]
            return FN[kind](*args, *case.scales())

        want = fn(t["q"], 3)
        torch._dynamo.reset()
        cf = torch.compile(fn, fullgraph=True, backend="aot_eager")
        for msq in (3, 4, 7):
            assert torch.equal(cf(t["q"], msq), want), (kind, msq)


def test_torch_reference_matches_oracle():
    """The float32 torch reference the GPU tests use equals ``interop.reference``."""
    for case in (make_case("chunk", 12, 2, [4, 3], [5, 2], per_head=True, seed=19),
                 lying_paged_case(seed=20)):
        ref32 = torch_reference(case.kind, tensors(case, "cpu"), None, case.k_scale,
                                case.v_scale, chunk_rows=3)
        np.testing.assert_allclose(ref32.numpy(), case.reference(), rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------ GPU
gpu = pytest.mark.gpu


def gpu_check(case, t, out):
    ref = torch_reference(case.kind, t, None, case.k_scale, case.v_scale)
    assert_matches(out.float().cpu().numpy(), ref.cpu().double().numpy(), case.kind)


@gpu
@pytest.mark.parametrize("kind,kv", [("ordinary", 0), ("chunk", 8192), ("chunk", 32768),
                                     ("chunk", 131072), ("paged", 32768)])
@pytest.mark.parametrize("hq,hkv", [(6, 1), (12, 1), (24, 2)])
def test_gpu_8192_rows(kind, kv, hq, hkv):
    case = make_case(kind, hq, hkv, [8192], None if kind == "ordinary" else [kv - 8192],
                     d=256, width=2051, dtype="bfloat16", junk="mixed", empty_rows=[0, 5],
                     seed=hq + kv % 97)
    t = tensors(case, "cuda")
    out1, out2 = run(case, t=t), run(case, t=t)
    torch.cuda.synchronize()
    assert torch.equal(out1, out2), "second run not bitwise equal"
    gpu_check(case, t, out1)


@gpu
@pytest.mark.parametrize("kind,q_lens,hq,hkv,kv_dtype", [
    ("chunk", [4] * 8, 12, 1, None), ("paged", [4] * 8, 24, 2, "float8_e4m3fn"),
    ("chunk", [32], 6, 1, None), ("ordinary", [40], 12, 1, None)])
def test_gpu_split_kv_short_prefills(kind, q_lens, hq, hkv, kv_dtype):
    """The selector's split-KV on short prefills (MTP verify: 8 requests x 4 rows at 4k; a
    32-row chunk at 32k; a 40-row ordinary prefill, its columns all in split 0): the
    reference, exact zeros for empty rows, bitwise equal runs."""
    ctx = 32768 if len(q_lens) == 1 else 4096
    prefix = None if kind == "ordinary" else [ctx - n for n in q_lens]
    fp8 = kv_dtype is not None
    case = make_case(kind, hq, hkv, q_lens, prefix, d=256, width=2051, dtype="bfloat16",
                     kv_dtype=kv_dtype, junk="mixed", empty_rows=[0, 5], pool_slack=1000,
                     k_scale=0.5 if fp8 else 1.0, v_scale=1.5 if fp8 else 1.0, seed=hq + hkv)
    t = tensors(case, "cuda")
    geo = P.prefill_geometry(kind, t["q"], requests=len(q_lens), max_q=max(q_lens),
                             num_kv_heads=hkv, width=2051, kv_bytes=1 if fp8 else 2)
    assert geo.splits > 1, geo
    out1, out2 = run(case, t=t), run(case, t=t)
    torch.cuda.synchronize()
    assert torch.equal(out1, out2), "second run not bitwise equal"
    gpu_check(case, t, out1)
    assert (out1[[0, 5]] == 0).all()


@gpu
def test_gpu_fp8_paged_lying_metadata_and_side_stream():
    case = lying_paged_case(seed=21, d=256, dtype="bfloat16", kv_dtype="float8_e4m3fn",
                            k_scale=0.9, v_scale=1.1, pool_slack=1000)
    t = tensors(case, "cuda")
    main = run(case, t=t)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out_side = run(case, t=t)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert torch.equal(main, out_side)
    gpu_check(case, t, main)


@gpu
def test_gpu_pool_past_2_31_elements():
    """A bf16 pool of 4.3M slots at Hkv = 2, D = 256 (slot x Hkv x D passes 2**31): the 64-bit
    offset path, with the requests' positions mapped to slots at the top of the pool."""
    case = make_case("paged", 24, 2, [300, 77], [4000, 1500], d=256, width=2051,
                     dtype="bfloat16", junk="mixed", seed=22)
    t = tensors(case, "cuda")
    slots = 4_300_000
    g = torch.Generator(device="cuda").manual_seed(22)
    t["k_cache"] = torch.randn(slots, 2, 256, device="cuda", generator=g).to(torch.bfloat16)
    t["v_cache"] = torch.randn(slots, 2, 256, device="cuda", generator=g).to(torch.bfloat16)
    top = slots - 1 - torch.randperm(slots // 2, device="cuda", generator=g)
    r2t = t["req_to_token"]
    t["req_to_token"] = top[: r2t.numel()].view(r2t.shape).to(torch.int32).contiguous()
    assert P.needs_off64(t["k_cache"], t["v_cache"])
    gpu_check(case, t, run(case, t=t))


@gpu
@pytest.mark.parametrize("kind", ["chunk", "paged"])
def test_gpu_cuda_graph_replay_with_changed_device_metadata(kind):
    """A captured graph replays correctly after kv_lens and indices (and, paged, req_indices)
    change in place on the device."""
    first = make_case(kind, 12, 1, [256, 256], [1792, 3840], d=256, width=2051,
                      dtype="bfloat16", seed=23)
    t = tensors(first, "cuda")
    run(first, t=t)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = run(first, t=t)
    graph.replay()
    torch.cuda.synchronize()
    gpu_check(first, t, out)
    second = make_case(kind, 12, 1, [256, 256], [1792, 1244], d=256, width=2051,
                       dtype="bfloat16", seed=24)
    t2 = tensors(second, "cuda")
    for name in ("kv_lens", "indices"):
        t[name].copy_(t2[name])
    if kind == "paged":
        t["req_indices"].copy_(t["req_indices"].flip(0))  # swap the requests' table rows
    graph.replay()
    torch.cuda.synchronize()
    gpu_check(first, t, out)


@pytest.mark.parametrize("cu", [[0, 10, 40], [-5, 10, 17], [3, 2_147_483_000, 17]])
@pytest.mark.parametrize("kind", ["ordinary", "chunk", "paged"])
def test_lying_cu_seqlens_q_stays_inside_q_and_agrees_with_pallas(kind, cu):
    """A non-decreasing cu_seqlens_q that points outside [0, T): only rows inside q exist
    (nothing is read or written past q / out; K/V rows of a lying range are clamped into k),
    and qsa_triton gives qsa_pallas's output (the interpreter used to abort on these)."""
    import jax.numpy as jnp

    import qsa_pallas

    rng = np.random.default_rng(0)
    t, hq, hkv, d, w = 17, 6, 1, 64, 16
    q, k, v = (rng.standard_normal((t, h, d)).astype(np.float16) for h in (hq, hkv, hkv))
    idx = rng.integers(-2, 10, (t, w)).astype(np.int32)
    cu_q, kvl = np.array(cu, np.int32), np.array([10, 7], np.int32)
    table, req = np.arange(64, dtype=np.int32).reshape(2, 32), np.arange(2, dtype=np.int32)
    pool = rng.standard_normal((64, hkv, d)).astype(np.float16)
    outs = []
    for mod, conv in ((qsa_triton, torch.from_numpy), (qsa_pallas, jnp.asarray)):
        a = [conv(np.ascontiguousarray(x)) for x in (q, k, v, idx, cu_q, kvl, table, req, pool)]
        Q, K, V, I, CU, KVL, S, REQ, POOL = a
        if kind == "ordinary":
            o = mod.sparse_prefill(Q, K, V, I, CU, 10)
        elif kind == "chunk":
            o = mod.sparse_prefill_chunk(Q, K, V, I, CU, CU, KVL, 10)
        else:
            o = mod.sparse_prefill_paged(Q, POOL, POOL, S, REQ, I, CU, KVL, 10)
        outs.append(np.asarray(o.float() if mod is qsa_triton else o.astype("float32")))
    if kind != "paged":  # the block form (tile-union kernel or expansion) follows the same rule
        blocks = np.zeros((t, 5), np.int32)
        blocks[:, 1] = 1
        for mod, conv in ((qsa_triton, torch.from_numpy), (qsa_pallas, jnp.asarray)):
            Q, K, V, CU, KVL, BI = (conv(np.ascontiguousarray(x)) for x in (q, k, v, cu_q, kvl,
                                                                            blocks))
            o = (mod.sparse_prefill(Q, K, V, None, CU, 10, block_indices=BI) if kind == "ordinary"
                 else mod.sparse_prefill_chunk(Q, K, V, None, CU, CU, KVL, 10, block_indices=BI))
            outs.append(np.asarray(o.float() if mod is qsa_triton else o.astype("float32")))
    for o in outs:
        assert np.isfinite(o).all()
    # the FP64 reference applies the same rule (qsa-contract.md section 7) to the token form
    from interop import reference as R

    ref = (R.prefill_reference(q, k, v, idx, cu_q) if kind == "ordinary" else
           R.prefill_chunk_reference(q, k, v, idx, cu_q, cu_q, kvl) if kind == "chunk" else
           R.prefill_paged_reference(q, pool, pool, table, req, idx, cu_q, kvl))
    for o in outs[:2]:
        np.testing.assert_allclose(o, ref, rtol=2e-2, atol=2e-2)
    # the block form with cu_seqlens_q[0] < 0 stays in bounds (finite) but its tile mapping is
    # not qsa_pallas's: only the token form is compared there
    pairs = list(zip(outs[::2], outs[1::2]))
    for a, b in pairs[:1] if cu[0] < 0 else pairs:
        np.testing.assert_allclose(a, b, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("kind,kv_dtype", [
    ("chunk", None),
    # Triton's CPU interpreter decodes the e4m3 NaN byte as 480: FP8 on the GPU only
    pytest.param("chunk", "float8_e4m3fn", marks=pytest.mark.gpu),
    pytest.param("paged", "float8_e4m3fn", marks=pytest.mark.gpu)])
def test_attended_nan_reaches_the_output(kind, kv_dtype):
    """A NaN in a selected K element and in a selected V element (FP8: converted to fp16 in the
    V tile's load layout, qsa_triton.prefill) reaches exactly the reference's NaN positions."""
    from tests.prefill_case import assert_nan_matches, poison_selected

    case = make_case(kind, 6, 1, [5, 4], [3, 9], d=32, width=10, kv_dtype=kv_dtype, seed=31)
    poison_selected(case)
    assert_nan_matches(run(case).float().cpu().numpy(), case.reference(), f"{kind} {kv_dtype}")
