"""Backend-only tests of ``qsa_triton`` packed varlen sparse decode: plans, forced split-KV and
merge paths, scratch, PDL policy, torch.library / torch.compile, interpreter guards, CUDA graphs.

Plain value sweeps over shapes run for both backends in the conformance suite
(``tests/conformance.py`` on ``interop.cases.quick_matrix()``). CPU (default): Triton interpreter,
tiny shapes, values against ``interop.reference`` (float64) at rtol = atol = 2e-2 and relative
L2 <= 5e-3 (``qsa-contract.md`` §6); fp16 everywhere, bf16 where ``tests/triton_interp_patch.py``
makes the interpreter's bf16 dot numeric. GPU (``-m gpu``, the H200): the shape suites of §6,
forced merges and splits, CUDA graphs with changed lengths, counters after 10,000 launches,
torch.compile(fullgraph=True), PDL on/off bitwise.
"""

from __future__ import annotations

import dataclasses
import math
import zlib

import numpy as np
import pytest
import torch

import qsa_triton
from interop.contract import ContractError
from interop.plan import split_blocks
from interop.reference import decode_reference, rel_l2
from qsa_triton import decode as dec

ON_GPU = torch.cuda.is_available()
CPU = torch.device("cpu")
RTOL = ATOL = 2e-2
REL_L2 = 5e-3


# ---------------------------------------------------------------------------------------------
# helpers
def make_case(lens, hq, hkv, d, dtype=torch.float16, device=CPU, slack=3, garbage=None, seed=0,
              cu_q=None):
    """Packed decode inputs for row lengths ``lens``; ``slack`` extra K/V rows after the last row
    (filled with ``garbage`` when given), rows between sequences none."""
    g = torch.Generator().manual_seed(seed)
    b = len(lens)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    cap = int(cu[-1]) + slack
    q = torch.randn(b, hq, d, generator=g).to(dtype)
    k = torch.randn(cap, hkv, d, generator=g).to(dtype)
    v = torch.randn(cap, hkv, d, generator=g).to(dtype)
    if garbage is not None and slack:
        k[int(cu[-1]):] = garbage
        v[int(cu[-1]):] = garbage
    cq = torch.arange(b + 1, dtype=torch.int32) if cu_q is None else torch.tensor(cu_q, dtype=torch.int32)
    ck = torch.from_numpy(cu)
    return tuple(t.to(device) for t in (q, k, v, cq, ck))


def reference(q, k, v, cq, ck, scale=None):
    return decode_reference(q.float().cpu().numpy(), k.float().cpu().numpy(), v.float().cpu().numpy(),
                            cq.cpu().numpy(), ck.cpu().numpy(), scale)


def assert_close(out, ref):
    o = out.float().cpu().numpy()
    assert np.isfinite(o).all()
    np.testing.assert_allclose(o, ref, rtol=RTOL, atol=ATOL)
    assert rel_l2(o, ref) <= REL_L2, rel_l2(o, ref)


def forced_plan(case, msk, **fields):
    """The shipped plan for ``case`` with ``fields`` replaced (block_n, max_splits, ...)."""
    q, k = case[0], case[1]
    plan, _ = dec.plan_for(q.shape[0], k.shape[1], q.shape[1] // k.shape[1], q.shape[2], msk,
                           q.device)
    return dataclasses.replace(plan, **fields)


def forced(case, msk, scale=None, *, merge=None, pdl=None, **fields):
    """``sparse_decode`` on ``case`` with a forced plan / merge / PDL (``_decode_with_plan``)."""
    return dec._decode_with_plan(*case, msk, scale, plan=forced_plan(case, msk, **fields),
                                 merge=merge, pdl=pdl)


def n_active(lens, plan, hkv=1):
    """Python mirror of the kernel's device-side split count per row (for asserting that a test
    really exercises the split-KV merge), with the device-side balance when the plan has it."""
    out = []
    total = max(sum(lens), 1)
    for n in lens:
        blocks = math.ceil(n / plan.block_n)
        k = min(max(math.ceil(blocks / plan.min_blocks_per_split), 1), plan.max_splits)
        if plan.balance_slots:
            k = min(k, max(n * plan.balance_slots // (total * hkv), 1))
        out.append(k)
    return out


def counters_zero(device) -> bool:
    info = dec._scratch_info(device)
    return info is not None and int(info["counters"].abs().sum()) == 0


# ---------------------------------------------------------------------------------------------
# CPU: the shipped plan
def test_shipped_plan_balance_one_block_splits_and_merge():
    """plan_for: the device-side balance (large batches keep >= BALANCE_GRID_SPLITS splits so
    long rows of a mixed batch can split, half that past one program per SM; inline merge
    where a row gets <= 8 of the 2 x SMs balance slots: B x Hkv >= 32 on 132 SMs), one split per
    block at small batch (64-key blocks with 8 warps where Hkv >= 2 and they fill half the SMs),
    the power-of-two rule otherwise; 132 SMs under the interpreter."""
    from interop import plan as P

    big, merge_big = dec.plan_for(128, 1, 12, 256, 2051, CPU)
    assert (big.max_splits, big.balance_slots, merge_big) == (P.BALANCE_GRID_SPLITS, 2 * 132, "inline")
    assert dec.plan_for(128, 2, 12, 256, 2051, CPU)[0].max_splits == P.BALANCE_GRID_SPLITS // 2
    merges = {(b, hkv): dec.plan_for(b, hkv, 12, 256, 2051, CPU)[1]
              for b, hkv in ((8, 2), (16, 2), (16, 1), (32, 1))}
    assert merges == {(8, 2): "kernel", (16, 2): "inline", (16, 1): "kernel", (32, 1): "inline"}
    small, merge_small = dec.plan_for(1, 2, 12, 256, 2051, CPU)
    assert (small.block_n, small.max_splits, small.num_warps, merge_small) == (P.WIDE_BLOCK_N, 33, 8, "kernel")
    tp2 = dec.plan_for(1, 1, 12, 256, 2051, CPU)[0]  # 33 wide splits would leave 99 SMs idle
    assert (tp2.block_n, tp2.max_splits, tp2.num_warps) == (32, 65, 4)
    assert dec.plan_for(2, 1, 12, 256, 2051, CPU)[0].block_n == 32  # one KV head: narrow blocks
    assert dec.plan_for(1, 2, 12, 128, 2051, CPU)[0].num_warps == 4  # D <= 128: BLOCK_N 64 already
    assert dec.plan_for(2, 2, 12, 256, 2051, CPU)[0].max_splits == 32  # 4 x 65 > 132: pow2 rule
    assert dec.plan_for(1, 2, 12, 256, 1000, CPU)[0].max_splits == 32  # 32 blocks
    assert dec.plan_for(1, 2, 12, 256, 5000, CPU)[0].max_splits == 64  # 157 blocks: pow2 rule
    # one block a split: no pipeline (its prologue only lengthens the one latency chain);
    # otherwise 3 stages (no shared-memory limit on CPU)
    assert (small.num_stages, tp2.num_stages) == (1, 1)
    assert big.num_stages == dec.plan_for(2, 2, 12, 256, 2051, CPU)[0].num_stages == 3
    assert dec.plan_for(2, 1, 12, 256, 2051, CPU)[0].num_stages == 1  # 65 blocks, 65 splits
    assert dec.plan_for(4, 1, 12, 256, 2051, CPU)[0].num_stages == 3  # 32 splits: 2-3 blocks
    # saturated rows at B = 128: 2 x 132 slots over 128 rows, two splits each (Hkv = 1)
    assert set(n_active([2051] * 128, big, 1)) == {2}
    assert set(n_active([2051] * 128, big, 2)) == {1}


def test_plan_fits_the_devices_shared_memory(monkeypatch):
    """plan_for fits the plan to the device's opt-in shared memory (``interop.plan``): the
    pipelined B = 2 plan keeps its 3 stages on the H200 (232,448 B) and on sm_120 (101,376 B),
    a part with 64 KB per block gets 2; the one-block plan (no pipeline) keeps its 64-key blocks
    on both, 32 on that part."""
    import dataclasses

    from interop.arch import DeviceFacts

    dev = torch.device("cuda", 7)  # never touched: the facts are patched
    small = dataclasses.replace(DeviceFacts.for_arch("sm_120", sm_count=132), smem_per_block=65_536)
    for facts, stages in ((DeviceFacts.for_arch("sm_90", sm_count=132), 3),
                          (DeviceFacts.for_arch("sm_120", sm_count=132), 3), (small, 2)):
        monkeypatch.setattr(dec, "_facts", lambda d, f=facts: f)
        dec._PLANS.clear()
        plan, _ = dec.plan_for(2, 2, 12, 256, 2051, dev)  # 32-key blocks, 2 per split
        assert (plan.block_n, plan.num_stages) == (32, stages), facts
        wide, _ = dec.plan_for(1, 2, 12, 256, 2051, dev)  # the 64-key blocks, one per split
        assert (wide.block_n, wide.num_stages) == ((32 if facts is small else 64), 1), facts
    dec._PLANS.clear()


def test_split_rule_is_the_shared_one():
    """The kernel's block ranges follow ``interop.plan.split_blocks`` (both ends rounded up: the
    first split streams the most blocks, the last the fewest): rows whose splits stream
    different block counts give the reference values under both merges."""
    assert [split_blocks(5, j, 4) for j in range(4)] == [(0, 2), (2, 3), (3, 4), (4, 5)]
    lens = [16 * 5, 16 * 7 + 3, 16 * 3]  # 5 and 8 blocks over 4 splits, 3 blocks over 3
    case = make_case(lens, 12, 1, 64, seed=31)
    for merge in ("kernel", "inline"):
        out = forced(case, max(lens), merge=merge, block_n=16, max_splits=4,
                     min_blocks_per_split=1, balance_slots=0)
        assert_close(out, reference(*case))


# ---------------------------------------------------------------------------------------------
# CPU: forced split-KV and merge paths
PAIRS = [(24, 2), (12, 1), (6, 1), (3, 1)]


@pytest.mark.parametrize("hq,hkv", PAIRS)
@pytest.mark.parametrize("merge", ["kernel", "inline"])
def test_edge_lengths_forced_splits(hq, hkv, merge):
    bn = 16
    lens = [0, 1, bn - 1, bn, bn + 1, 70]
    case = make_case(lens, hq, hkv, 64, seed=hq)
    plan = forced_plan(case, max(lens), block_n=bn, max_splits=4)
    out = dec._decode_with_plan(*case, max(lens), plan=plan, merge=merge)
    assert max(n_active(lens, plan)) > 1  # the merge really ran
    assert out.shape == case[0].shape and out.dtype == case[0].dtype
    assert_close(out, reference(*case))
    assert torch.count_nonzero(out[0]) == 0


@pytest.mark.parametrize("merge", ["kernel", "inline"])
@pytest.mark.parametrize("slots", [1, 9, 40])
def test_device_side_balance_mixed_rows(slots, merge):
    """A row's split count is its share of ``balance_slots`` programs by length (floor, >= 1,
    <= max_splits, <= one per min block). A mixed batch with empty, short and long rows matches
    the reference for every slot count and both merges, is bitwise reproducible and leaves the
    inline counters at zero; long rows split while short rows keep one program."""
    lens = [0, 3, 150, 17, 64, 1, 96]
    case = make_case(lens, 24, 2, 64, seed=slots)
    plan = forced_plan(case, max(lens), block_n=16, max_splits=8, min_blocks_per_split=1,
                       balance_slots=slots)
    out = dec._decode_with_plan(*case, max(lens), plan=plan, merge=merge)
    again = dec._decode_with_plan(*case, max(lens), plan=plan, merge=merge)
    acts = n_active(lens, plan, 2)
    if slots >= 9:
        assert acts[2] > 1 and acts[1] == 1  # the long row splits, a short one does not
    else:
        assert max(acts) <= max(1, slots)
    assert_close(out, reference(*case))
    assert torch.equal(out, again)
    assert torch.count_nonzero(out[0]) == 0
    assert counters_zero(CPU)


@pytest.mark.parametrize("elems", [16 * 64, 2 * 16 * 64, 16384])
def test_inline_merge_chunks(elems, monkeypatch):
    """The in-launch merge loads INLINE_TILE splits' LSEs and partials per round trip and rescales
    online across chunks: with a tile of 1, 2 or 16 splits over rows of up to 8 active splits it
    matches the reference and the merge kernel, is bitwise reproducible and leaves the counters
    at zero."""
    monkeypatch.setattr(dec, "_INLINE_TILE_ELEMS", elems)
    assert dec._inline_tile(16, 64) == elems // (16 * 64)  # 1, 2, 16 splits per round trip
    lens = [0, 1, 17, 130, 64, 33, 128]
    case = make_case(lens, 12, 1, 64, seed=elems)
    plan = forced_plan(case, max(lens), block_n=16, max_splits=8, min_blocks_per_split=1,
                       balance_slots=0)
    out = dec._decode_with_plan(*case, max(lens), plan=plan, merge="inline")
    again = dec._decode_with_plan(*case, max(lens), plan=plan, merge="inline")
    by_kernel = dec._decode_with_plan(*case, max(lens), plan=plan, merge="kernel")
    assert max(n_active(lens, plan)) == 8  # more splits than a tile of 1 or 2
    assert_close(out, reference(*case))
    torch.testing.assert_close(out, by_kernel, rtol=2e-3, atol=2e-3)
    assert torch.equal(out, again)
    assert torch.count_nonzero(out[0]) == 0
    assert counters_zero(CPU)


@pytest.mark.parametrize("hq,hkv", [(24, 2), (12, 1)])
def test_d256_bf16_two_splits(hq, hkv):
    lens = [33, 0, 5]
    case = make_case(lens, hq, hkv, 256, dtype=torch.bfloat16, seed=7)
    assert_close(forced(case, 40, max_splits=2), reference(*case))


def test_bf16_d64_many_splits():
    lens = [100, 3, 64]
    case = make_case(lens, 12, 1, 64, dtype=torch.bfloat16, seed=11)
    plan = forced_plan(case, 100, block_n=16, max_splits=8, balance_slots=0)
    assert n_active(lens, plan)[0] == 7  # 7 blocks, min 1 per split
    assert_close(dec._decode_with_plan(*case, 100, plan=plan), reference(*case))


def test_softmax_scale_and_query_row_mapping():
    case = make_case([20, 9, 0], 12, 1, 64, seed=5, cu_q=[2, 0, 1, 3])
    assert_close(forced(case, 20, 0.3, block_n=16, max_splits=2), reference(*case, scale=0.3))


def test_generic_group_10_and_d32():
    case = make_case([13, 40], 10, 1, 32, seed=14)
    assert_close(forced(case, 40, block_n=16, max_splits=2), reference(*case))


def test_rows_longer_than_max_seqlen_k_fully_covered():
    case = make_case([90, 10], 12, 1, 64, seed=9)
    assert_close(qsa_triton.sparse_decode(*case, 16), reference(*case))  # bound below row 0
    assert_close(forced(case, 16, block_n=16, max_splits=4), reference(*case))


def test_zero_rows_exact_zeros():
    case = make_case([0, 0, 0], 12, 1, 64, slack=4, garbage=float("nan"))
    outs = [qsa_triton.sparse_decode(*case, 8), forced(case, 8, max_splits=4, block_n=16),
            forced(case, 8, max_splits=4, merge="inline")]
    for out in outs:
        assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("bad", [float("nan"), float("-inf")])
def test_garbage_outside_rows_never_reaches_output(bad):
    # rows end mid-block (17, 33 with BLOCK_N 16), so the masked tail blocks overlap the next
    # row and the garbage after the last one
    lens = [17, 0, 33]
    q, k, v, cq, ck = case = make_case(lens, 12, 1, 64, slack=20, garbage=bad, seed=2)
    assert not torch.isfinite(k[50:].float()).any()
    for out in (forced(case, 40, block_n=16), forced(case, 40, block_n=16, max_splits=4),
                forced(case, 40, block_n=16, max_splits=4, merge="inline")):
        assert_close(out, reference(q, k, v, cq, ck))
        assert torch.count_nonzero(out[1]) == 0


@pytest.mark.parametrize("stale", [float("nan"), float("inf")])
def test_stale_scratch_never_used(stale):
    # the merge kernel reads every split slot's LSE: the split kernel must write all of them
    # (-inf for inactive splits), and stale partials must be masked by a select
    case = make_case([0, 5, 100, 17], 12, 1, 64, seed=15)
    dec.prepare(CPU)
    sc = dec._scratch[dec._dev_key(CPU)]
    for ms in (8, 2):
        sc.lse.fill_(stale)
        sc.part.fill_(stale)
        out = forced(case, 100, block_n=16, max_splits=ms, merge="kernel")
        assert_close(out, reference(*case))
        assert torch.count_nonzero(out[0]) == 0


def test_strided_q_heads_slice():
    q, k, v, cq, ck = make_case([21, 5], 12, 1, 64, seed=8)
    big = torch.randn(2, 20, 64).half()
    big[:, 4:16] = q
    qs = big[:, 4:16]  # non-contiguous in dim 0
    assert not qs.is_contiguous()
    assert_close(qsa_triton.sparse_decode(qs, k, v, cq, ck, 21), reference(q, k, v, cq, ck))


def test_scratch_enlarges_outside_capture():
    case = make_case([200], 12, 1, 64, seed=1)
    dec.prepare(CPU)
    before = dec._scratch_info(CPU)
    out = forced(case, 200, block_n=16, max_splits=128, balance_slots=0)  # more than sized
    after = dec._scratch_info(CPU)
    assert_close(out, reference(*case))
    assert after["rows"] >= max(12 * 128, before["rows"])


def test_forced_plan_checks():
    case = make_case([5, 9], 12, 1, 64)
    plan = forced_plan(case, 9)
    with pytest.raises(ContractError, match="head_tile"):
        dec._decode_with_plan(*case, 9, plan=dataclasses.replace(plan, head_tile=8))
    with pytest.raises(ValueError, match="merge"):
        dec._decode_with_plan(*case, 9, plan=plan, merge="auto")


# ---------------------------------------------------------------------------------------------
# CPU: contract rejections at the entry points
def _ok_args():
    return list(make_case([5, 3], 12, 1, 64)) + [8]


def _set(i, make):
    return lambda a: a.__setitem__(i, make(a))


def _d48(a):
    a[0], a[1], a[2] = a[0][..., :48].contiguous(), a[1][..., :48].contiguous(), a[2][..., :48].contiguous()


@pytest.mark.parametrize("mutate,arg", [
    (_set(0, lambda a: a[0].float()), "q"),
    (_set(1, lambda a: a[1].float()), "k"),
    (_d48, "q"),  # D = 48: not a power of two
    (lambda a: a.__setitem__(slice(1, 3), [torch.randn(8, 5, 64).half()] * 2), "k"),  # 12 % 5
    (_set(0, lambda a: torch.randn(2, 17, 64).half()), "q"),  # G = 17 > 16
    (_set(4, lambda a: a[4].long()), "cu_seqlens_k"),
    (_set(3, lambda a: a[3][:2]), "cu_seqlens_q"),
    (_set(5, lambda a: 0), "max_seqlen_k"),
    (_set(5, lambda a: torch.tensor(8)), "max_seqlen_k"),
    (_set(2, lambda a: a[2][:, :, :32]), "v"),
    (_set(0, lambda a: a[0].transpose(1, 2).contiguous().transpose(1, 2)), "q"),  # D stride != 1
    (_set(1, lambda a: a[1].clone().requires_grad_()), "k"),  # forward-only
])
def test_bad_calls_raise_contract_error(mutate, arg):
    args = _ok_args()
    mutate(args)
    with pytest.raises(ContractError) as e:
        qsa_triton.sparse_decode(*args)
    assert e.value.arg == arg


def test_strict_envelope():
    args = _ok_args()
    with pytest.raises(ContractError):  # D = 64 is outside the qualified envelope
        qsa_triton.sparse_decode(*args, strict=True)
    q, k, v, cq, ck = make_case([1] * 129, 12, 1, 256, slack=0)
    with pytest.raises(ContractError) as e:
        qsa_triton.sparse_decode(q, k, v, cq, ck, 4, strict=True)
    assert e.value.arg == "q"
    q, k, v, cq, ck = make_case([4], 12, 1, 256, slack=0)
    with pytest.raises(ContractError) as e:
        qsa_triton.sparse_decode(q, k, v, cq, ck, 2056, strict=True)
    assert e.value.arg == "max_seqlen_k"


def test_public_names():
    assert len(dec.__all__) <= 8
    assert set(dec.__all__) == {"sparse_decode", "flash_attn_varlen_func", "prepare", "plan_for",
                                "pdl_enabled"}
    for name in dec.__all__:
        assert getattr(dec, name).__doc__


# ---------------------------------------------------------------------------------------------
# CPU: the flash-attn drop-in
#: flash-attn 2.8's flash_attn_varlen_func parameters and defaults, as written in
#: Dao-AILab/flash-attention flash_attn/flash_attn_interface.py
FLASH_ATTN_2_8 = [("q", None), ("k", None), ("v", None), ("cu_seqlens_q", None),
                  ("cu_seqlens_k", None), ("max_seqlen_q", None), ("max_seqlen_k", None),
                  ("dropout_p", 0.0), ("softmax_scale", None), ("causal", False),
                  ("window_size", (-1, -1)), ("softcap", 0.0), ("alibi_slopes", None),
                  ("deterministic", False), ("return_attn_probs", False), ("block_table", None)]


def test_flash_attn_varlen_func_is_a_positional_drop_in():
    """Same parameter order and defaults as flash-attn 2.8, called positionally exactly as that
    signature is written (with the decode's values), against the float64 reference."""
    import inspect

    params = inspect.signature(qsa_triton.flash_attn_varlen_func).parameters.values()
    assert [(p.name, None if p.default is inspect.Parameter.empty else p.default)
            for p in params] == FLASH_ATTN_2_8
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params)
    q, k, v, cq, ck = case = make_case([12, 0, 30, 7], 6, 1, 64, seed=6)
    ref = reference(*case, scale=0.2)
    for causal in (False, True):  # one query row: bottom-right causal keeps every key
        out = qsa_triton.flash_attn_varlen_func(q, k, v, cq, ck, 1, 30, 0.0, 0.2, causal,
                                                (-1, -1), 0.0, None, False, False, None)
        assert_close(out, ref)
    assert torch.equal(qsa_triton.flash_attn_varlen_func(q, k, v, cq, ck, 1, 30, 0.0, 0.2),
                       qsa_triton.sparse_decode(*case, 30, 0.2))
    default = qsa_triton.flash_attn_varlen_func(q, k, v, cq, ck, 1, 30)  # scale D ** -0.5
    assert_close(default, reference(*case))


@pytest.mark.parametrize("kw,arg", [
    ({"dropout_p": 0.1}, "dropout_p"),
    ({"dropout_p": True}, "dropout_p"),
    ({"window_size": (128, 0)}, "window_size"),
    ({"softcap": 30.0}, "softcap"),
    ({"alibi_slopes": torch.ones(12)}, "alibi_slopes"),
    ({"return_attn_probs": True}, "return_attn_probs"),
    ({"block_table": torch.zeros(2, 4, dtype=torch.int32)}, "block_table"),
    ({"causal": 1}, "causal"),
    ({"max_seqlen_q": 2}, "max_seqlen_q"),
])
def test_flash_attn_varlen_func_rejections(kw, arg):
    q, k, v, cq, ck = make_case([5, 3], 12, 1, 64)
    kw = dict(kw)
    msq = kw.pop("max_seqlen_q", 1)
    with pytest.raises(ContractError) as e:
        qsa_triton.flash_attn_varlen_func(q, k, v, cq, ck, msq, 8, **kw)
    assert e.value.arg == arg
    with pytest.raises(TypeError):  # like flash-attn: no catch-all keyword arguments
        qsa_triton.flash_attn_varlen_func(q, k, v, cq, ck, 1, 8, not_an_arg=1)


def test_flash_attn_prefill_style_call_names_the_decode_rule():
    """A prefill-style call (4 query rows in 2 sequences, max_seqlen_q = 2) is told the decode
    rule (one query row per sequence), not a bare cu_seqlens_q length; with max_seqlen_q = 1 the
    length message says where B + 1 comes from."""
    q, k, v, _, ck = make_case([5, 3, 2, 4], 12, 1, 64)
    cq2 = torch.tensor([0, 2, 4], dtype=torch.int32)
    with pytest.raises(ContractError, match="one query row per sequence") as e:
        qsa_triton.flash_attn_varlen_func(q, k, v, cq2, ck[:3], 2, 8)
    assert e.value.arg == "max_seqlen_q"
    with pytest.raises(ContractError, match=r"length 5 = B \+ 1 \(decode: one query row") as e:
        qsa_triton.flash_attn_varlen_func(q, k, v, cq2, ck[:3], 1, 8)
    assert e.value.arg == "cu_seqlens_q"


def test_requires_grad_is_refused_before_any_launch():
    """Forward-only: a tensor that requires grad is a ContractError naming it (not a generic
    torch error at backward()), for both entry points; under no_grad the same call runs."""
    q, k, v, cq, ck = make_case([5, 3], 12, 1, 64)
    qg = q.clone().requires_grad_()
    with pytest.raises(ContractError, match="forward-only") as e:
        qsa_triton.sparse_decode(qg, k, v, cq, ck, 8)
    assert e.value.arg == "q"
    with pytest.raises(ContractError, match="forward-only"):
        qsa_triton.flash_attn_varlen_func(q, k, v.clone().requires_grad_(), cq, ck, 1, 8)
    assert_close(qsa_triton.sparse_decode(qg.detach(), k, v, cq, ck, 8), reference(q, k, v, cq, ck))


# ---------------------------------------------------------------------------------------------
# CPU: torch.library registration, torch.compile tracing, interpreter guards
def test_opcheck():
    q, k, v, cq, ck = make_case([9, 0, 20], 12, 1, 32, seed=12)
    torch.library.opcheck(torch.ops.qsa.sparse_decode.default, (q, k, v, cq, ck, 20, 0.125))


def test_torch_compile_fullgraph_traces():
    case = make_case([9, 20], 12, 1, 32, seed=13)

    def f(q, k, v, cq, ck):
        return qsa_triton.sparse_decode(q, k, v, cq, ck, 20) * 2.0

    torch._dynamo.reset()
    cf = torch.compile(f, fullgraph=True, backend="aot_eager")
    assert torch.equal(cf(*case), f(*case))


def test_torch_compile_fullgraph_bad_input_names_the_argument():
    """Under torch.compile(fullgraph=True) a call outside the contract still fails before any
    launch, and the error carries the ContractError text (argument, expected, got): the check
    runs in the op's fake implementation there (Dynamo cannot raise out of a fullgraph trace)."""
    q, k, v, cq, ck = make_case([9, 20], 12, 1, 32, seed=14)

    def f(q, k, v, cq, ck):
        return qsa_triton.sparse_decode(q, k, v, cq, ck, 20)

    def fa(q, k, v, cq, ck):
        return qsa_triton.flash_attn_varlen_func(q, k, v, cq, ck, 1, 20)

    for fn in (f, fa):
        torch._dynamo.reset()
        with pytest.raises(Exception) as ei:
            torch.compile(fn, fullgraph=True, backend="aot_eager")(q, k, v, cq, ck.long())
        msg = str(ei.value)
        assert "cu_seqlens_k" in msg and "expected" in msg and "int64" in msg, msg[:400]


def test_torch_compile_host_ints_that_change_and_inputs_requiring_grad():
    """A host int that changes between compiled calls (max_seqlen_k here, max_seqlen_q in the
    prefill tests: SGLang's per-batch bounds) reaches the fake impl as a SymInt: accepted, and
    every call equals eager. An input that requires grad is refused with the ContractError text
    under torch.compile too (AOT autograd used to fail on the missing autograd formula, the
    eager backend only in backward()); under torch.no_grad() it runs."""
    q, k, v, cq, ck = make_case([9, 20], 12, 1, 32, seed=16)

    def f(q, k, v, cq, ck, msk):
        return qsa_triton.sparse_decode(q, k, v, cq, ck, msk)

    def fa(q, k, v, cq, ck, msk):
        return qsa_triton.flash_attn_varlen_func(q, k, v, cq, ck, 1, msk, window_size=(-1, 0))

    want = f(q, k, v, cq, ck, 20)
    for fn in (f, fa):
        torch._dynamo.reset()
        cf = torch.compile(fn, fullgraph=True, backend="aot_eager")
        for msk in (20, 21, 25):
            assert torch.equal(cf(q, k, v, cq, ck, msk), want), (fn.__name__, msk)
    for backend in ("aot_eager", "eager"):
        torch._dynamo.reset()
        cf = torch.compile(f, fullgraph=True, backend=backend)
        qg = q.clone().requires_grad_(True)
        with pytest.raises(Exception, match="'q'.*forward-only"):
            cf(qg, k, v, cq, ck, 20)
        with torch.no_grad():
            assert torch.equal(cf(qg, k, v, cq, ck, 20), want)


def test_torch_compile_names_a_refused_number_dynamo_made_symbolic():
    """A host number that changes between compiled calls becomes symbolic; a refused value of it
    (flash-attn's ``dropout_p`` here) still fails with the ContractError text and its value
    (``refuse_traced`` formats the plain number: Dynamo cannot format a symbolic one). Found
    with a fresh-user trial's ``overlap=`` case."""
    q, k, v, cq, ck = make_case([9, 20], 12, 1, 32, seed=17)

    def fa(q, k, v, cq, ck, p):
        return qsa_triton.flash_attn_varlen_func(q, k, v, cq, ck, 1, 20, p)

    torch._dynamo.reset()
    cf = torch.compile(fa, fullgraph=True, backend="aot_eager")
    assert torch.equal(cf(q, k, v, cq, ck, 0.0), qsa_triton.sparse_decode(q, k, v, cq, ck, 20))
    for p in (0.1, 0.2):
        with pytest.raises(Exception) as ei:
            cf(q, k, v, cq, ck, p)
        msg = str(ei.value)
        assert "dropout_p" in msg and f"got {p}" in msg, msg[:400]


def test_non_torch_inputs_are_a_contract_error():
    q, k, v, cq, ck = make_case([9, 20], 12, 1, 32, seed=15)
    with pytest.raises(ContractError, match="cu_seqlens_k.*torch.Tensor"):
        qsa_triton.sparse_decode(q, k, v, cq, ck.numpy(), 20)
    with pytest.raises(ContractError, match="'q'.*torch.Tensor"):
        qsa_triton.flash_attn_varlen_func(q.numpy(), k, v, cq, ck, 1, 20)


def test_flash_attn_adapter_refuses_bf16_under_the_unpatched_interpreter(monkeypatch):
    """Same guard as sparse_decode (the interpreter's bf16 dot is wrong): a ContractError naming
    flash_attn_varlen_func, never garbage."""
    from triton.runtime import interpreter

    monkeypatch.setattr(interpreter, "_qsa_bf16_dot_patched", False, raising=False)
    q, k, v, cq, ck = make_case([9, 20], 12, 1, 32, dtype=torch.bfloat16, seed=16)
    with pytest.raises(ContractError, match="flash_attn_varlen_func.*float16"):
        qsa_triton.flash_attn_varlen_func(q, k, v, cq, ck, 1, 20)


def test_fake_impl_checks_contract():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 12, 64, dtype=torch.float16)
        k = torch.empty(8, 1, 64, dtype=torch.float32)  # wrong dtype
        cu = torch.empty(3, dtype=torch.int32)
        with pytest.raises(ContractError):
            torch.ops.qsa.sparse_decode(q, k, k, cu, cu, 4, 0.125)
        out = torch.ops.qsa.sparse_decode(q, k.half(), k.half(), cu, cu, 4, 0.125)
        assert out.shape == q.shape and out.dtype == q.dtype


# ---------------------------------------------------------------------------------------------
# CPU: the Programmatic Dependent Launch policy
def test_pdl_policy(monkeypatch):
    """PDL where supported and B x Hkv <= 2 (trigger at entry) or >= 64 (trigger after the K/V
    loop), off in between; never under the interpreter, where forcing it is a ContractError."""
    case = make_case([40, 0, 7], 6, 1, 64, seed=11)
    if not ON_GPU:
        assert not dec._pdl_supported(CPU) and not dec.pdl_enabled(CPU, 1)
        with pytest.raises(ContractError, match="pdl"):
            forced(case, 40, pdl=True)
        assert_close(forced(case, 40, pdl=False, block_n=16, max_splits=2), reference(*case))
    monkeypatch.setattr(dec, "_pdl_supported", lambda device: True)
    assert [dec.pdl_enabled(CPU, n) for n in (1, 2, 3, 63, 64, 256)] == [True, True, False, False,
                                                                        True, True]
    assert [dec._pdl_late_trigger(n) for n in (2, 63, 64)] == [False, False, True]


# =============================================================================================
# GPU tests (H200): pytest -m gpu tests/test_triton_decode.py
def gpu(fn):
    """``@pytest.mark.gpu``, skipped (not run under the interpreter) when there is no CUDA GPU."""
    return pytest.mark.gpu(pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")(fn))


CUDA = torch.device("cuda") if ON_GPU else None
TP = {"TP1": (24, 2), "TP2": (12, 1), "TP4": (6, 1)}
GPU_BATCHES = list(range(1, 17)) + [17, 24, 32, 48, 64, 96, 128]
SATURATED = 2051


def lengths_for(kind: str, b: int, rng: np.random.Generator) -> list[int]:
    """short: 1..64 keys, medium: 200..1000, saturated: 2051 every row (qsa-contract §6)."""
    if kind == "short":
        return rng.integers(1, 65, b).tolist()
    if kind == "medium":
        return rng.integers(200, 1001, b).tolist()
    if kind == "mixed":
        return rng.integers(0, SATURATED + 1, b).tolist()
    return [SATURATED] * b


def torch_reference(q, k, v, cq, ck, scale=None):
    """FP32 torch reference on the device: per sequence softmax(scale q Kᵀ) V over its rows."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    hq, hkv = q.shape[1], k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    cqh, ckh = cq.tolist(), ck.tolist()
    for s in range(q.shape[0]):
        lo, hi = ckh[s], ckh[s + 1]
        if hi <= lo:
            continue
        qs = q[cqh[s]].float()  # [Hq, D]
        kk = k[lo:hi].float().repeat_interleave(hq // hkv, dim=1)  # [n, Hq, D]
        vv = v[lo:hi].float().repeat_interleave(hq // hkv, dim=1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", qs, kk) * scale, dim=-1)
        out[s] = torch.einsum("hn,nhd->hd", p, vv)
    return out


def gpu_case(lens, hq, hkv, d=256, dtype=torch.bfloat16, slack=64, seed=0):
    """Like ``make_case`` but generated on the GPU (host randn of 10^8 values is too slow)."""
    g = torch.Generator(device=CUDA).manual_seed(seed)
    b = len(lens)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    cap = int(cu[-1]) + slack
    q = torch.randn(b, hq, d, generator=g, device=CUDA).to(dtype)
    k = torch.randn(cap, hkv, d, generator=g, device=CUDA).to(dtype)
    v = torch.randn(cap, hkv, d, generator=g, device=CUDA).to(dtype)
    cq = torch.arange(b + 1, dtype=torch.int32, device=CUDA)
    return q, k, v, cq, torch.from_numpy(cu).to(CUDA)


def assert_close_gpu(out, ref, what=""):
    o = out.float()
    assert torch.isfinite(o).all(), what
    err = (o - ref).abs()
    tol = ATOL + RTOL * ref.abs()
    assert bool((err <= tol).all()), f"{what}: max err {float(err.max()):.3g}"
    den = float(ref.norm())
    rl = float((o - ref).norm()) / den if den > 0 else float(o.norm())
    assert rl <= REL_L2, f"{what}: rel L2 {rl:.3g}"


@gpu
def test_gpu_torch_reference_matches_fp64_reference():
    for hq, hkv in TP.values():
        case = gpu_case([0, 1, 300, SATURATED], hq, hkv, seed=hq)
        ref64 = reference(*case)
        ref32 = torch_reference(*case).cpu().numpy()
        assert rel_l2(ref32, ref64) < 1e-5
        np.testing.assert_allclose(ref32, ref64, atol=1e-4, rtol=1e-4)
        assert_close(qsa_triton.sparse_decode(*case, SATURATED), ref64)


@gpu
@pytest.mark.parametrize("tp", list(TP))
@pytest.mark.parametrize("kind", ["short", "medium", "saturated"])
def test_gpu_shape_suite(tp, kind):
    hq, hkv = TP[tp]
    rng = np.random.default_rng(zlib.crc32(f"{tp}/{kind}".encode()))  # reproducible per case
    for b in GPU_BATCHES:
        lens = lengths_for(kind, b, rng)
        case = gpu_case(lens, hq, hkv, seed=b)
        out = qsa_triton.sparse_decode(*case, SATURATED, strict=True)
        assert out.shape == (b, hq, 256) and out.dtype == torch.bfloat16
        assert_close_gpu(out, torch_reference(*case), f"{tp} {kind} B={b}")


@gpu
@pytest.mark.parametrize("merge", ["kernel", "inline"])
def test_gpu_merge_modes_and_forced_splits(merge):
    rng = np.random.default_rng(1)
    for hq, hkv in TP.values():
        for b in (1, 3, 16, 128):
            lens = lengths_for("mixed", b, rng)
            lens[0] = 0
            case = gpu_case(lens, hq, hkv, seed=b)
            for ms in (None, 1, 8, 64):
                out = forced(case, SATURATED, merge=merge,
                             **({} if ms is None else {"max_splits": ms}))
                assert_close_gpu(out, torch_reference(*case), f"{merge} ms={ms} B={b}")
                assert torch.count_nonzero(out[0]) == 0


@gpu
@pytest.mark.parametrize("d,hq,hkv,dtype", [
    (32, 16, 1, torch.float16), (64, 3, 1, torch.bfloat16), (128, 1, 1, torch.float16),
    (128, 8, 2, torch.bfloat16), (256, 16, 1, torch.bfloat16), (256, 32, 4, torch.float16),
])
def test_gpu_generic_d_and_g(d, hq, hkv, dtype):
    case = gpu_case([0, 1, 77, 513, 1500], hq, hkv, d=d, dtype=dtype, seed=d + hq)
    for out, ms in ((qsa_triton.sparse_decode(*case, 1500), None),
                    (forced(case, 1500, max_splits=16), 16)):
        assert_close_gpu(out, torch_reference(*case), f"D={d} {hq}/{hkv} {dtype} ms={ms}")


@gpu
def test_gpu_row_longer_than_max_seqlen_k_and_garbage():
    q, k, v, cq, ck = gpu_case([4000, 10, 0, SATURATED], 24, 2, slack=128)
    k[int(ck[-1]):] = float("nan")
    v[int(ck[-1]):] = float("inf")
    out = qsa_triton.sparse_decode(q, k, v, cq, ck, 64)  # bound far below row 0
    assert_close_gpu(out, torch_reference(q, k, v, cq, ck), "long row")


def _capture(fn):
    """(graph, result of ``fn()`` captured into it), after one warm-up call off-graph. The tests
    capture thread-locally (as ``interop.validate.tp``): an xdist worker also runs JAX, whose
    own threads' unsafe CUDA calls (cudaMalloc ...) invalidate a global-mode capture."""
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # compile off-graph
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = fn()
    return graph, out


def _graph_kv_buffers(b, hkv, cap):
    """Zeroed bf16 K/V [cap, hkv, 256], cu_seqlens_q = arange(b + 1) and a zero cu_seqlens_k
    [b + 1] on CUDA: the static buffers a captured graph reads (refilled by copy_)."""
    k = torch.zeros(cap, hkv, 256, dtype=torch.bfloat16, device=CUDA)
    return (k, torch.zeros_like(k), torch.arange(b + 1, dtype=torch.int32, device=CUDA),
            torch.zeros(b + 1, dtype=torch.int32, device=CUDA))


@gpu
@pytest.mark.parametrize("merge", ["kernel", "inline", None])
def test_gpu_cuda_graph_replay_with_new_lengths(merge):
    hq, hkv = TP["TP1"]
    b, cap = 16, 16 * SATURATED + 64
    rng = np.random.default_rng(2)
    dec.prepare(CUDA)
    q = torch.zeros(b, hq, 256, dtype=torch.bfloat16, device=CUDA)
    k, v, cq, ck = _graph_kv_buffers(b, hkv, cap)

    def load(lens, seed):
        nq, nk, nv, _, nck = gpu_case(lens, hq, hkv, slack=cap - sum(lens), seed=seed)
        q.copy_(nq), k.copy_(nk), v.copy_(nv), ck.copy_(nck)

    def call():
        if merge is None:  # the public entry point, shipped plan
            return qsa_triton.sparse_decode(q, k, v, cq, ck, SATURATED)
        return forced((q, k, v, cq, ck), SATURATED, merge=merge)

    load(lengths_for("short", b, rng), 0)
    graph, out = _capture(call)
    for i, kind in enumerate(["saturated", "mixed", "short", "medium", "mixed"]):
        lens = lengths_for(kind, b, rng)
        lens[i] = 0
        load(lens, i + 1)
        graph.replay()
        eager = call()
        torch.cuda.synchronize()
        assert torch.equal(out, eager), kind
        assert_close_gpu(out, torch_reference(q, k, v, cq, ck), f"replay {kind}")


@gpu
def test_gpu_capture_refuses_missing_scratch():
    case = gpu_case([300] * 64, 12, 1)  # 64 x 12 x 4096 partial rows: more than any scratch
    plan = forced_plan(case, 300, max_splits=4096, block_n=16, min_blocks_per_split=1)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(ContractError):
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            dec._decode_with_plan(*case, 300, plan=plan)


@gpu
def test_gpu_inline_counters_zero_after_10000_launches():
    hq, hkv = TP["TP1"]
    case = gpu_case(lengths_for("mixed", 32, np.random.default_rng(3)), hq, hkv)
    ref = torch_reference(*case)
    plan = forced_plan(case, SATURATED, max_splits=16)
    out = dec._decode_with_plan(*case, SATURATED, plan=plan, merge="inline")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for _ in range(100):
            out = dec._decode_with_plan(*case, SATURATED, plan=plan, merge="inline")
    for _ in range(100):
        graph.replay()
    torch.cuda.synchronize()
    assert counters_zero(CUDA)
    assert_close_gpu(out, ref, "after 10k launches")


@gpu
def test_gpu_torch_compile_fullgraph_matches_eager():
    case = gpu_case(lengths_for("mixed", 8, np.random.default_rng(4)), 12, 1)

    def f(q, k, v, cq, ck):
        return qsa_triton.sparse_decode(q, k, v, cq, ck, SATURATED).float() * 0.5

    torch._dynamo.reset()
    cf = torch.compile(f, fullgraph=True)
    assert torch.equal(cf(*case), f(*case))
    fa = torch.compile(lambda *a: qsa_triton.flash_attn_varlen_func(*a, 1, SATURATED), fullgraph=True)
    assert torch.equal(fa(*case), qsa_triton.sparse_decode(*case, SATURATED))


@gpu
def test_gpu_bitwise_repeatable():
    case = gpu_case(lengths_for("mixed", 64, np.random.default_rng(5)), 24, 2)
    assert torch.equal(qsa_triton.sparse_decode(*case, SATURATED),
                       qsa_triton.sparse_decode(*case, SATURATED))


# ---------------------------------------------------------------------------------------------
# GPU: Programmatic Dependent Launch (sm_90+): same numbers as without it, also under CUDA graphs
def pdl_gpu(fn):
    return gpu(pytest.mark.skipif(not (ON_GPU and dec._pdl_supported(CUDA)),
                                  reason="needs sm_90+ and a Triton with launch_pdl")(fn))


@pdl_gpu
@pytest.mark.parametrize("merge", ["kernel", "inline"])
def test_gpu_pdl_on_off_bitwise_equal(merge):
    rng = np.random.default_rng(7)
    assert dec.pdl_enabled(CUDA, 1) and dec.pdl_enabled(CUDA, 64) and not dec.pdl_enabled(CUDA, 8)
    for tp, b, kind, ms in (("TP1", 1, "saturated", None), ("TP1", 16, "mixed", None),
                            ("TP2", 64, "mixed", None), ("TP1", 64, "saturated", None),
                            ("TP4", 3, "saturated", 8), ("TP1", 5, "short", 4)):
        hq, hkv = TP[tp]
        lens = lengths_for(kind, b, rng)
        if b > 2:
            lens[1] = 0
        case = gpu_case(lens, hq, hkv, seed=b)
        ov = {} if ms is None else {"max_splits": ms}
        off = forced(case, SATURATED, merge=merge, pdl=False, **ov)
        on = forced(case, SATURATED, merge=merge, pdl=True, **ov)
        auto = forced(case, SATURATED, merge=merge, **ov)  # the shipped policy for this shape
        torch.cuda.synchronize()
        assert torch.equal(on, off), f"{tp} B={b} {kind} {merge}"
        assert torch.equal(auto, off), f"{tp} B={b} {kind} {merge} (auto)"
        assert_close_gpu(on, torch_reference(*case), f"pdl {tp} B={b} {kind} {merge}")


@pdl_gpu
@pytest.mark.parametrize("b", [8, 32])
@pytest.mark.parametrize("merge", ["kernel", "inline"])
def test_gpu_pdl_cuda_graph_chain_replay_matches_eager(merge, b):
    # A graph of several back-to-back decodes on different inputs (so a merge kernel and the next
    # call's split kernel, which overwrites the shared scratch, are PDL neighbours) plus an
    # elementwise consumer of every output; replayed with new lengths / data, compared bitwise
    # with eager calls without PDL. B = 8 (x 2 KV heads): entry trigger; B = 32: B x Hkv = 64,
    # the trigger after the K/V loop.
    hq, hkv = TP["TP1"]
    n_calls = 4
    assert dec._pdl_late_trigger(b * hkv) is (b == 32)
    cap = b * SATURATED + 64
    rng = np.random.default_rng(8)
    dec.prepare(CUDA)
    qs = [torch.zeros(b, hq, 256, dtype=torch.bfloat16, device=CUDA) for _ in range(n_calls)]
    k, v, cq, ck = _graph_kv_buffers(b, hkv, cap)

    def load(lens, seed):
        nq, nk, nv, _, nck = gpu_case(lens, hq, hkv, slack=cap - sum(lens), seed=seed)
        for i, q in enumerate(qs):
            q.copy_(torch.roll(nq, i, dims=1) * (1.0 + 0.25 * i))
        k.copy_(nk), v.copy_(nv), ck.copy_(nck)

    def chain(pdl):
        outs = [forced((q, k, v, cq, ck), SATURATED, merge=merge, pdl=pdl) for q in qs]
        return outs, [o.float() * 2.0 for o in outs]  # a non-PDL consumer right after each

    load(lengths_for("saturated", b, rng), 0)
    graph, (outs, twice) = _capture(lambda: chain(True))
    for i, kind in enumerate(["saturated", "mixed", "short", "medium", "mixed", "saturated"]):
        lens = lengths_for(kind, b, rng)
        lens[i % b] = 0
        load(lens, i + 1)
        graph.replay()
        eager, _ = chain(False)
        torch.cuda.synchronize()
        for j in range(n_calls):
            assert torch.equal(outs[j], eager[j]), f"{kind} call {j}"
            assert torch.equal(twice[j], eager[j].float() * 2.0), f"{kind} consumer {j}"
        assert_close_gpu(outs[-1], torch_reference(qs[-1], k, v, cq, ck), f"pdl replay {kind}")


@pdl_gpu
def test_gpu_pdl_many_launches_counters_and_results():
    hq, hkv = TP["TP1"]
    case = gpu_case(lengths_for("mixed", 32, np.random.default_rng(9)), hq, hkv)
    ref = torch_reference(*case)
    for merge, ms in (("inline", 16), ("kernel", None)):
        ov = {} if ms is None else {"max_splits": ms}
        first = forced(case, SATURATED, merge=merge, pdl=True, **ov)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            outs = [forced(case, SATURATED, merge=merge, pdl=True, **ov) for _ in range(100)]
        for _ in range(50):
            graph.replay()
        eager = [forced(case, SATURATED, merge=merge, pdl=True, **ov) for _ in range(200)]
        torch.cuda.synchronize()
        assert counters_zero(CUDA), merge
        for o in (outs[0], outs[-1], eager[-1]):
            assert torch.equal(o, first), merge
        assert_close_gpu(first, ref, f"pdl {merge} after many launches")


def test_lying_cu_seqlens_q_row_is_clamped_like_pallas():
    """cu_seqlens_q[s] outside [0, B) reads q row clamp(., 0, B - 1), as qsa_pallas does (it used
    to read outside q); the outputs of both packages are equal."""
    import jax.numpy as jnp

    import qsa_pallas

    torch.manual_seed(0)
    q = torch.randn(3, 12, 64, dtype=torch.float16)
    k, v = torch.randn(57, 1, 64, dtype=torch.float16), torch.randn(57, 1, 64, dtype=torch.float16)
    cu_k = torch.tensor([0, 50, 50, 57], dtype=torch.int32)
    for cu in ([0, 1, 2, 100000], [0, 1, -7, 3], [5, -1, 2, 3]):
        cu_q = torch.tensor(cu, dtype=torch.int32)
        ot = qsa_triton.sparse_decode(q, k, v, cu_q, cu_k, 64)
        op = qsa_pallas.sparse_decode(*(jnp.asarray(x.numpy()) for x in (q, k, v, cu_q, cu_k)), 64)
        assert torch.equal(ot.float(), torch.from_numpy(np.asarray(op.astype("float32")))), cu
        ref = decode_reference(*(x.numpy() for x in (q, k, v, cu_q, cu_k)))  # the same clamp
        np.testing.assert_allclose(ot.float().numpy(), ref, rtol=2e-2, atol=2e-3, err_msg=str(cu))
