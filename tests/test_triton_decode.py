"""Tests of ``qsa_triton`` packed varlen sparse decode (issue 3).

CPU (default): Triton interpreter, tiny shapes, compared with ``interop.reference`` (float64) at
rtol = atol = 2e-2 and relative L2 <= 5e-3 (``qsa-contract.md`` §6). fp16 everywhere, bf16 where
``tests/triton_interp_patch.py`` makes the interpreter's bf16 dot numeric.
GPU (``-m gpu``, run on the H200 by ``bench/gpu_decode.sh``): the shape suites of §6, CUDA graphs
with changed lengths, counters after 10,000 launches, torch.compile(fullgraph=True).
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import textwrap
import zlib

import numpy as np
import pytest
import torch

import qsa_triton
from interop.contract import ContractError
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


# ---------------------------------------------------------------------------------------------
# CPU: values
PAIRS = [(24, 2), (12, 1), (6, 1), (3, 1)]


@pytest.mark.parametrize("hq,hkv", PAIRS)
@pytest.mark.parametrize("merge", ["kernel", "inline"])
def test_matches_reference_d64_edge_lengths(hq, hkv, merge):
    bn = 16
    lens = [0, 1, bn - 1, bn, bn + 1, 70]
    case = make_case(lens, hq, hkv, 64, seed=hq)
    with dec.plan_override(block_n=bn, max_splits=4, merge=merge):
        plan, _ = dec.plan_for(len(lens), hkv, hq // hkv, 64, max(lens), CPU)
        out = qsa_triton.sparse_decode(*case, max(lens))
    assert max(n_active(lens, plan)) > 1  # the merge really ran
    assert out.shape == case[0].shape and out.dtype == case[0].dtype
    assert_close(out, reference(*case))
    assert torch.count_nonzero(out[0]) == 0


@pytest.mark.parametrize("merge", ["kernel", "inline"])
@pytest.mark.parametrize("slots", [1, 3, 9, 40])
@pytest.mark.parametrize("hq,hkv", [(24, 2), (6, 1)])
def test_device_side_balance_mixed_rows(hq, hkv, slots, merge):
    """Device-side balance (decode v3): a row's split count is its share of ``balance_slots``
    programs by length (floor, >= 1, <= max_splits, <= one per min block). A mixed batch with
    empty, short and long rows matches the reference for every slot count and both merges, is
    bitwise reproducible and leaves the inline counters at zero; the Python mirror shows that
    long rows split while short rows keep one program."""
    lens = [0, 3, 150, 17, 64, 1, 96]
    case = make_case(lens, hq, hkv, 64, seed=slots)
    with dec.plan_override(block_n=16, max_splits=8, min_blocks_per_split=1, balance=True,
                           balance_slots=slots, merge=merge):
        plan, _ = dec.plan_for(len(lens), hkv, hq // hkv, 64, max(lens), CPU)
        out = qsa_triton.sparse_decode(*case, max(lens))
        again = qsa_triton.sparse_decode(*case, max(lens))
    assert plan.balance_slots == slots
    acts = n_active(lens, plan, hkv)
    if slots >= 9:
        assert acts[2] > 1 and acts[1] == 1  # the long row splits, a short one does not
    else:
        assert max(acts) <= max(1, slots)
    assert_close(out, reference(*case))
    assert torch.equal(out, again)
    assert torch.count_nonzero(out[0]) == 0
    info = dec.scratch_info(CPU)
    assert info is not None and int(info["counters"].abs().sum()) == 0


@pytest.mark.parametrize("elems", [16 * 64, 2 * 16 * 64, 16384])
def test_inline_merge_chunks(elems, monkeypatch):
    """The in-launch merge (decode v6) loads INLINE_TILE splits' LSEs and partials per round trip
    and rescales online across chunks: with a tile of 1, 2 or 16 splits (INLINE_TILE_ELEMS
    patched) over rows of up to 8 active splits it matches the reference and the merge kernel,
    is bitwise reproducible and leaves the counters at zero."""
    monkeypatch.setattr(dec, "INLINE_TILE_ELEMS", elems)
    assert dec.inline_tile(16, 64) == elems // (16 * 64)  # 1, 2, 16 splits per round trip
    lens = [0, 1, 17, 130, 64, 33, 128]
    case = make_case(lens, 12, 1, 64, seed=elems)
    with dec.plan_override(block_n=16, max_splits=8, min_blocks_per_split=1, merge="inline"):
        plan, _ = dec.plan_for(len(lens), 1, 12, 64, max(lens), CPU)
        out = qsa_triton.sparse_decode(*case, max(lens))
        again = qsa_triton.sparse_decode(*case, max(lens))
    with dec.plan_override(block_n=16, max_splits=8, min_blocks_per_split=1, merge="kernel"):
        ref_kernel = qsa_triton.sparse_decode(*case, max(lens))
    assert max(n_active(lens, plan)) == 8  # more splits than a tile of 1 or 2
    assert_close(out, reference(*case))
    torch.testing.assert_close(out, ref_kernel, rtol=2e-3, atol=2e-3)
    assert torch.equal(out, again)
    assert torch.count_nonzero(out[0]) == 0
    info = dec.scratch_info(CPU)
    assert info is not None and int(info["counters"].abs().sum()) == 0


def test_balance_plan_grid_and_auto_merge():
    """plan_for with the default balance: large batches keep >= BALANCE_GRID_SPLITS splits in the
    grid (long rows of a mixed batch can split) and merge inline; small batches keep the static
    grid and the merge kernel."""
    from interop import plan as DP

    big, merge_big = dec.plan_for(128, 1, 12, 256, 2051, CPU)
    small, merge_small = dec.plan_for(1, 2, 12, 256, 2051, CPU)
    assert big.max_splits == DP.BALANCE_GRID_SPLITS and big.balance_slots == 2 * 132
    # one split per 64-key block (decode v6c): 2 x 33 programs still fill half the 132 SMs
    assert (small.block_n, small.max_splits, small.num_warps) == (DP.WIDE_BLOCK_N, 33, 8)
    with dec.plan_override(one_block_splits=False):
        pow2, _ = dec.plan_for(1, 2, 12, 256, 2051, CPU)
    assert (pow2.block_n, pow2.max_splits) == (32, 64)  # decode v4: split 0 streams two blocks
    with dec.plan_override(block_n=32):
        narrow, _ = dec.plan_for(1, 2, 12, 256, 2051, CPU)
    assert (narrow.max_splits, narrow.num_warps) == (65, 4)  # decode v5: 2 x 65 programs
    # TP2 B = 1: 33 wide splits would leave 99 of 132 SMs idle: 65 splits of 32 keys
    tp2 = dec.plan_for(1, 1, 12, 256, 2051, CPU)[0]
    assert (tp2.block_n, tp2.max_splits, tp2.num_warps) == (32, 65, 4)
    # one KV head: B = 2 gives the same 2 x 33 grid but keeps 32-key blocks (run 36: slower)
    assert dec.plan_for(2, 1, 12, 256, 2051, CPU)[0].block_n == 32
    # D <= 128 runs BLOCK_N 64 already: the rule leaves it alone
    assert dec.plan_for(1, 2, 12, 128, 2051, CPU)[0].num_warps == 4
    assert dec.plan_for(2, 2, 12, 256, 2051, CPU)[0].max_splits == 32  # 4 x 65 > 132: v4 rule
    assert dec.plan_for(1, 2, 12, 256, 1000, CPU)[0].max_splits == 32  # 32 blocks
    assert dec.plan_for(1, 2, 12, 256, 5000, CPU)[0].max_splits == 64  # 157 blocks: v4 rule
    with dec.plan_override(balance=False):
        static, _ = dec.plan_for(128, 1, 12, 256, 2051, CPU)
    assert static.max_splits == 1 and static.balance_slots == 0
    # saturated rows at B = 128: every row keeps one program (no merge at all)
    assert set(n_active([2051] * 128, big, 1)) == {2}  # 2 x 132 slots over 128 rows: 2 each
    assert set(n_active([2051] * 128, big, 2)) == {1}


@pytest.mark.parametrize("merge", ["kernel", "inline"])
@pytest.mark.parametrize("ms", [1, 2, 8])
def test_tail_in_loop_variant(ms, merge):
    """``tail_in_loop``: every block, the partial last one included, in one masked loop; same
    values as the reference for edge lengths (0, 1, BLOCK-1, BLOCK, BLOCK+1, long) and split counts."""
    lens = [0, 1, 15, 16, 17, 70, 33]
    case = make_case(lens, 12, 1, 64, seed=ms)
    with dec.plan_override(block_n=16, max_splits=ms, min_blocks_per_split=1, tail_in_loop=True,
                           merge=merge):
        plan, _ = dec.plan_for(len(lens), 1, 12, 64, max(lens), CPU)
        out = qsa_triton.sparse_decode(*case, max(lens))
    assert plan.tail_in_loop
    assert_close(out, reference(*case))
    assert torch.count_nonzero(out[0]) == 0


@pytest.mark.parametrize("qk_split,defer,d", [(2, False, 64), (4, True, 64), (1, True, 64),
                                               (2, True, 32), (4, False, 32)])
@pytest.mark.parametrize("merge", ["kernel", "inline"])
def test_split_qk_and_deferred_rowsum(qk_split, defer, d, merge):
    """Decode v5 loop variants (``qk_split``: Q·Kᵀ as independent dots over D slices;
    ``defer_rowsum``: the softmax denominator reduced once after the loop) match the reference
    for edge lengths and split rows, and match the plain loop to FP32 rounding. At D = 32 a
    4-way split would leave 8-column slices: it falls back to 1 (``_qk_split``)."""
    lens = [0, 1, 15, 16, 17, 70, 33]
    case = make_case(lens, 12, 1, d, seed=qk_split + 10 * defer)
    with dec.plan_override(block_n=16, max_splits=4, min_blocks_per_split=1, merge=merge):
        base = qsa_triton.sparse_decode(*case, max(lens))
    with dec.plan_override(block_n=16, max_splits=4, min_blocks_per_split=1, merge=merge,
                           qk_split=qk_split, defer_rowsum=defer):
        plan, _ = dec.plan_for(len(lens), 1, 12, d, max(lens), CPU)
        out = qsa_triton.sparse_decode(*case, max(lens))
    assert plan.qk_split == qk_split and plan.defer_rowsum == defer
    assert dec._qk_split(plan, d, False) == (qk_split if d // qk_split >= 16 else 1)
    assert dec._qk_split(plan, d, True) == 1  # the TMA path keeps one dot
    assert_close(out, reference(*case))
    torch.testing.assert_close(out, base, rtol=2e-3, atol=2e-3)
    assert torch.count_nonzero(out[0]) == 0


@pytest.mark.parametrize("field,bad", [("merge", "foo"), ("block_n", 48), ("block_n", 0),
                                       ("block_n", 8), ("head_tile", 12), ("num_warps", 3),
                                       ("max_splits", 0), ("max_splits", -1), ("max_splits", 2.0),
                                       ("min_blocks_per_split", 0), ("num_stages", 0),
                                       ("balance_slots", -1), ("max_splits", True)])
def test_plan_override_rejects_bad_geometry(field, bad):
    """plan_override refuses a field no launch could use when the ``with`` block is entered,
    naming the field (not later inside Triton, or as a ZeroDivisionError, or never)."""
    with pytest.raises(ValueError, match=f"plan_override: {field}"):
        with dec.plan_override(**{field: bad}):
            pass
    with dec.plan_override(**{field: {"merge": "inline", "block_n": 64, "head_tile": 32,
                                      "num_warps": 8, "max_splits": 3,
                                      "min_blocks_per_split": 1, "num_stages": 2,
                                      "balance_slots": 0}[field]}):
        pass  # a good value of the same field is accepted


def test_pdl_error_names_plan_override(monkeypatch):
    monkeypatch.delenv(dec.PDL_ENV, raising=False)
    monkeypatch.setattr(dec, "pdl_supported", lambda device: False)
    with dec.plan_override(pdl=True):
        with pytest.raises(ContractError, match=r"plan_override\(pdl=\.\.\.\)"):
            dec.pdl_enabled(torch.device("cpu"))
    monkeypatch.setenv(dec.PDL_ENV, "on")
    with pytest.raises(ContractError, match="QSA_DECODE_PDL"):
        dec.pdl_enabled(torch.device("cpu"))
    with pytest.raises(ContractError, match="'pdl'"):
        dec.pdl_enabled(torch.device("cpu"), pdl=True)


def test_qk_split_rejects_other_values():
    with pytest.raises(ValueError, match="qk_split"):
        with dec.plan_override(qk_split=3):
            pass
    with pytest.raises(ValueError, match="one_block_splits"):
        with dec.plan_override(one_block_splits="no"):
            pass
    import dataclasses

    plan = dataclasses.replace(dec.plan_for(2, 1, 12, 64, 40, CPU)[0], qk_split=3)
    with pytest.raises(ValueError, match="qk_split"):
        dec._qk_split(plan, 64, False)
    case = make_case([5, 9], 12, 1, 64)
    with pytest.raises(ValueError, match="qk_split"):  # before any allocation or launch
        dec.decode_with_plan(*case, 9, plan=plan)


@pytest.mark.parametrize("hq,hkv", PAIRS)
def test_tma_path_matches_pointer_path(hq, hkv):
    """K/V loaded through TMA tensor descriptors (the interpreter emulates them): the reference
    values and bitwise the pointer path's, for edge lengths and split counts, with NaN garbage
    in the K/V rows after the last sequence (a TMA box reads whole blocks: the row's partial last
    block sees them and must mask them)."""
    lens = [0, 1, 15, 16, 17, 70, 33]
    q, k, v, cq, ck = make_case(lens, hq, hkv, 64, seed=hq + 5)
    pad = torch.full((40, hkv, 64), float("nan"), dtype=k.dtype)
    k, v = torch.cat([k, pad]), torch.cat([v, pad])
    ref = reference(q, k, v, cq, ck)
    assert dec.tma_usable(CPU, k, v)
    for ms in (1, 4):
        with dec.plan_override(block_n=16, max_splits=ms, tma=True):
            out = qsa_triton.sparse_decode(q, k, v, cq, ck, 70)
        with dec.plan_override(block_n=16, max_splits=ms, tma=False):
            ptr = qsa_triton.sparse_decode(q, k, v, cq, ck, 70)
        assert_close(out, ref)
        assert torch.equal(out, ptr), ms
        assert torch.count_nonzero(out[0]) == 0


def test_launch_passes_kv_rows_and_tma_choice(monkeypatch):
    """The launch resolves PDL with the call's B x Hkv and hands the TMA choice to the kernel:
    descriptors for K/V exactly when tma_usable, pointers otherwise (C = 0 included: a descriptor
    needs every extent > 0, so an all-empty batch takes the pointer path)."""
    seen = []
    real_pdl = dec.pdl_enabled
    monkeypatch.setattr(dec, "pdl_enabled",
                        lambda device, pdl=None, kv_rows=None: seen.append(kv_rows) or real_pdl(
                            device, pdl, kv_rows))
    launches = []
    real_kernel = dec._decode_split_kernel

    class Spy:
        def __getitem__(self, grid):
            def run(*args, **kw):
                launches.append((type(args[1]).__name__, kw["USE_TMA"]))
                return real_kernel[grid](*args, **kw)
            return run

    monkeypatch.setattr(dec, "_decode_split_kernel", Spy())
    case = make_case([9, 30, 0], 12, 1, 64, seed=4)
    empty = make_case([0, 0], 12, 1, 64, slack=0)
    assert empty[1].shape[0] == 0 and not dec.tma_usable(CPU, empty[1], empty[2])
    for tma in (False, True):
        with dec.plan_override(tma=tma, max_splits=2, block_n=16):
            assert_close(qsa_triton.sparse_decode(*case, 30), reference(*case))
            out = qsa_triton.sparse_decode(*empty, 4)
        assert torch.count_nonzero(out) == 0
    assert seen == [3, 2, 3, 2]  # B x Hkv of each call
    assert launches == [("Tensor", False), ("Tensor", False),
                        ("TensorDescriptor", True), ("Tensor", False)]


def test_tma_usable_needs_alignment():
    """TMA needs 16-byte aligned bases and strides: a K/V view that is not falls back to the
    pointer path (same results), never a launch error."""
    lens = [9, 20]
    q, k, v, cq, ck = make_case(lens, 6, 1, 64, seed=2)
    assert dec.tma_usable(CPU, k, v)
    big_k = torch.cat([torch.zeros(1, 1, 64, dtype=k.dtype), k])
    odd = torch.empty(k.numel() + 1, dtype=k.dtype)[1:].view(k.shape)  # base off by one element
    odd.copy_(k)
    assert not dec.tma_usable(CPU, odd, v)
    with dec.plan_override(tma=True, max_splits=2, block_n=16):
        out = qsa_triton.sparse_decode(q, odd, v, cq, ck, 20)
    assert_close(out, reference(q, k, v, cq, ck))
    assert dec.tma_usable(CPU, big_k[1:], v)  # 256-byte row stride: aligned
    with pytest.raises(ValueError, match="tma must be True or False"):
        with dec.plan_override(tma="yes"):
            pass


@pytest.mark.parametrize("hq,hkv", [(24, 2), (12, 1)])
def test_matches_reference_d256_bf16(hq, hkv):
    lens = [33, 0, 5]
    case = make_case(lens, hq, hkv, 256, dtype=torch.bfloat16, seed=7)
    with dec.plan_override(max_splits=2):
        out = qsa_triton.sparse_decode(*case, 40)
    assert_close(out, reference(*case))


def test_default_plan_single_split_d256_fp16():
    lens = [1, 31, 32, 33]
    case = make_case(lens, 6, 1, 256, seed=3)
    out = qsa_triton.sparse_decode(*case, 33)  # default plan (block_n 32 for D = 256)
    assert_close(out, reference(*case))


def test_bf16_d64_many_splits():
    lens = [100, 3, 64]
    case = make_case(lens, 12, 1, 64, dtype=torch.bfloat16, seed=11)
    with dec.plan_override(block_n=16, max_splits=8):
        plan, _ = dec.plan_for(3, 1, 12, 64, 100, CPU)
        out = qsa_triton.sparse_decode(*case, 100)
    assert n_active(lens, plan)[0] == 7  # 7 blocks, min 1 per split
    assert_close(out, reference(*case))


def test_softmax_scale_and_query_row_mapping():
    lens = [20, 9, 0]
    case = make_case(lens, 12, 1, 64, seed=5, cu_q=[2, 0, 1, 3])
    with dec.plan_override(block_n=16, max_splits=2):
        out = qsa_triton.sparse_decode(*case, 20, softmax_scale=0.3)
    assert_close(out, reference(*case, scale=0.3))


def test_rows_longer_than_max_seqlen_k_fully_covered():
    lens = [90, 10]
    case = make_case(lens, 12, 1, 64, seed=9)
    for ms in (None, 4):
        with dec.plan_override(block_n=16, **({} if ms is None else {"max_splits": ms})):
            out = qsa_triton.sparse_decode(*case, 16)  # bound smaller than row 0
        assert_close(out, reference(*case))


def test_zero_rows_exact_zeros():
    lens = [0, 0, 0]
    case = make_case(lens, 12, 1, 64, slack=4, garbage=float("nan"))
    for ov in ({}, {"max_splits": 4, "block_n": 16}, {"max_splits": 4, "merge": "inline"}):
        with dec.plan_override(**ov):
            out = qsa_triton.sparse_decode(*case, 8)
        assert torch.equal(out, torch.zeros_like(out)), ov


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_garbage_outside_rows_never_reaches_output(bad):
    # rows end mid-block (17, 33 with BLOCK_N 16), so the masked tail blocks overlap the next
    # row and the garbage after the last one
    lens = [17, 0, 33]
    q, k, v, cq, ck = make_case(lens, 12, 1, 64, slack=20, garbage=bad, seed=2)
    assert not torch.isfinite(k[50:].float()).any()
    for ov in ({"block_n": 16}, {"block_n": 16, "max_splits": 4},
               {"block_n": 16, "max_splits": 4, "merge": "inline"}):
        with dec.plan_override(**ov):
            out = qsa_triton.sparse_decode(q, k, v, cq, ck, 40)
        assert_close(out, reference(q, k, v, cq, ck))
        assert torch.count_nonzero(out[1]) == 0


@pytest.mark.parametrize("stale", [float("nan"), 1e30, float("inf")])
def test_stale_scratch_never_used(stale):
    # the merge kernel reads every split slot's LSE: the split kernel must write all of them
    # (-inf for inactive splits), and stale partials must be masked by a select
    lens = [0, 5, 100, 17]
    case = make_case(lens, 12, 1, 64, seed=15)
    dec.prepare(CPU)
    sc = dec._scratch[dec._dev_key(CPU)]
    for ov in ({"block_n": 16, "max_splits": 8}, {"block_n": 16, "max_splits": 2}):
        sc.lse.fill_(stale)
        sc.part.fill_(stale)
        with dec.plan_override(**ov):
            out = qsa_triton.sparse_decode(*case, 100)
        assert_close(out, reference(*case))
        assert torch.count_nonzero(out[0]) == 0


def test_two_runs_bitwise_equal():
    case = make_case([50, 7, 0, 19], 24, 2, 64, seed=4)
    with dec.plan_override(block_n=16, max_splits=4):
        a = qsa_triton.sparse_decode(*case, 50)
        b = qsa_triton.sparse_decode(*case, 50)
    assert torch.equal(a, b)


def test_strided_q_heads_slice():
    lens = [21, 5]
    q, k, v, cq, ck = make_case(lens, 12, 1, 64, seed=8)
    big = torch.randn(2, 20, 64).half()
    big[:, 4:16] = q
    qs = big[:, 4:16]  # non-contiguous in dim 0
    assert not qs.is_contiguous()
    out = qsa_triton.sparse_decode(qs, k, v, cq, ck, 21)
    assert_close(out, reference(q, k, v, cq, ck))


def test_scratch_enlarges_outside_capture():
    case = make_case([200], 12, 1, 64, seed=1)
    dec.prepare(CPU)
    before = dec.scratch_info(CPU)
    need = 1 * 12 * 128
    with dec.plan_override(block_n=16, max_splits=128):  # more partials than sized
        out = qsa_triton.sparse_decode(*case, 200)
    after = dec.scratch_info(CPU)
    assert_close(out, reference(*case))
    assert after["rows"] >= max(need, before["rows"])


# ---------------------------------------------------------------------------------------------
# CPU: contract rejections
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
])
def test_bad_calls_raise_contract_error(mutate, arg):
    args = _ok_args()
    mutate(args)
    with pytest.raises(ContractError) as e:
        qsa_triton.sparse_decode(*args)
    assert e.value.arg == arg


def test_generic_group_10_and_d32():
    lens = [13, 40]
    case = make_case(lens, 10, 1, 32, seed=14)
    with dec.plan_override(block_n=16, max_splits=2):
        out = qsa_triton.sparse_decode(*case, 40)
    assert_close(out, reference(*case))


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


@pytest.mark.parametrize("kw,arg", [
    ({"window_size": (128, 0)}, "window_size"),
    ({"alibi_slopes": torch.ones(12)}, "alibi_slopes"),
    ({"dropout_p": 0.1}, "dropout_p"),
    ({"softcap": 30.0}, "softcap"),
    ({"return_attn_probs": True}, "return_attn_probs"),
    ({"block_table": torch.zeros(2, 4, dtype=torch.int32)}, "block_table"),
    ({"max_seqlen_q": 2}, "max_seqlen_q"),
    ({"not_an_arg": 1}, "not_an_arg"),
])
def test_flash_attn_varlen_func_rejections(kw, arg):
    q, k, v, cq, ck = make_case([5, 3], 12, 1, 64)
    kw = dict(kw)
    msq = kw.pop("max_seqlen_q", 1)
    with pytest.raises(ContractError) as e:
        qsa_triton.flash_attn_varlen_func(q, k, v, cq, ck, msq, 8, **kw)
    assert e.value.arg == arg


def test_flash_attn_varlen_func_matches_sparse_decode():
    case = make_case([12, 0, 30], 6, 1, 64, seed=6)
    a = qsa_triton.flash_attn_varlen_func(*case[:5], 1, 30, softmax_scale=0.2, causal=True)
    b = qsa_triton.flash_attn_varlen_func(*case[:5], 1, 30, 0.2, False)
    c = qsa_triton.sparse_decode(*case, 30, 0.2)
    assert torch.equal(a, c) and torch.equal(b, c)
    assert_close(a, reference(*case, scale=0.2))


# ---------------------------------------------------------------------------------------------
# CPU: torch.library registration, torch.compile tracing
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


def test_plan_override_rejects_unknown():
    with pytest.raises(ValueError):
        with dec.plan_override(blok_n=3):
            pass
    with pytest.raises(ValueError):  # pdl must be a bool
        with dec.plan_override(pdl="on"):
            pass


# ---------------------------------------------------------------------------------------------
# Programmatic Dependent Launch selection (QSA_DECODE_PDL / plan_override(pdl=...))
@pytest.mark.skipif(ON_GPU, reason="interpreter-only checks")
def test_pdl_off_under_interpreter_and_mode_validation(monkeypatch):
    case = make_case([40, 0, 7], 6, 1, 64, seed=11)
    ref = reference(*case)
    cpu = torch.device("cpu")
    monkeypatch.setattr(dec, "PDL_AUTO", True)  # even when auto means "on where supported"
    for env in (None, "auto", "AUTO", "off"):
        if env is None:
            monkeypatch.delenv(dec.PDL_ENV, raising=False)
        else:
            monkeypatch.setenv(dec.PDL_ENV, env)
        assert dec.pdl_supported(cpu) is False
        assert dec.pdl_enabled(cpu) is False
        with dec.plan_override(block_n=16, max_splits=2):
            assert_close(qsa_triton.sparse_decode(*case, 40), ref)
    with dec.plan_override(block_n=16, max_splits=2, pdl=False):  # explicit off runs
        assert_close(qsa_triton.sparse_decode(*case, 40), ref)
    monkeypatch.setenv(dec.PDL_ENV, "on")  # explicit on where unsupported: refused
    with pytest.raises(ContractError, match=dec.PDL_ENV):
        qsa_triton.sparse_decode(*case, 40)
    monkeypatch.delenv(dec.PDL_ENV)
    with dec.plan_override(pdl=True), pytest.raises(ContractError):
        qsa_triton.sparse_decode(*case, 40)
    with pytest.raises(ContractError):
        dec.decode_with_plan(*case, 40, plan=dec.plan_for(3, 1, 6, 64, 40, cpu)[0], pdl=True)


def test_pdl_auto_for_few_or_many_kv_rows(monkeypatch):
    """auto: PDL where supported and B x Hkv <= PDL_AUTO_MAX_KV_ROWS (entry trigger; H200: it
    hides the merge launch at B = 1, is a coin toss at B = 4..16) or B x Hkv >=
    PDL_LATE_MIN_KV_ROWS (trigger after the K/V loop: the entry trigger costs ~1 us there, the
    late one saves ~1 us); off in between; explicit modes ignore the bounds."""
    monkeypatch.setattr(dec, "pdl_supported", lambda device: True)
    monkeypatch.delenv(dec.PDL_ENV, raising=False)
    cpu = torch.device("cpu")
    lim, late = dec.PDL_AUTO_MAX_KV_ROWS, dec.PDL_LATE_MIN_KV_ROWS
    assert lim == 2 and late == 64
    assert dec.pdl_enabled(cpu, kv_rows=1) and dec.pdl_enabled(cpu, kv_rows=lim)
    assert not dec.pdl_enabled(cpu, kv_rows=lim + 1) and not dec.pdl_enabled(cpu, kv_rows=late - 1)
    assert dec.pdl_enabled(cpu, kv_rows=late) and dec.pdl_enabled(cpu, kv_rows=256)
    assert not dec.pdl_late_trigger(lim) and not dec.pdl_late_trigger(late - 1)
    assert dec.pdl_late_trigger(late)
    assert dec.pdl_enabled(cpu)  # no shape given: the device/mode answer
    monkeypatch.setenv(dec.PDL_ENV, "on")
    assert dec.pdl_enabled(cpu, kv_rows=1024)
    monkeypatch.setenv(dec.PDL_ENV, "off")
    assert not dec.pdl_enabled(cpu, kv_rows=1)
    monkeypatch.setattr(dec, "PDL_AUTO", False)
    monkeypatch.setenv(dec.PDL_ENV, "auto")
    assert not dec.pdl_enabled(cpu, kv_rows=1)


def test_pdl_env_rejects_unknown_value(monkeypatch):
    case = make_case([5], 6, 1, 64)
    for bad in ("yes", "1", "true"):
        monkeypatch.setenv(dec.PDL_ENV, bad)
        with pytest.raises(ContractError) as ei:
            dec.pdl_enabled(torch.device("cpu"))
        assert "auto, on, off" in str(ei.value) and bad in str(ei.value)
        if not ON_GPU:  # the entry point refuses it before any launch
            with pytest.raises(ContractError, match="auto, on, off"):
                qsa_triton.sparse_decode(*case, 5)
    # plan_override(pdl=False) wins over the environment (no read of it)
    with dec.plan_override(pdl=False):
        assert dec.pdl_enabled(torch.device("cpu")) is False


def test_aot_list_covers_every_default_launch():
    """``compile_configs`` (``qsa compile``) holds the split-kernel configuration of every launch
    the defaults (and the merge / PDL / TMA / balance / one-block overrides) make for the
    qualified shapes, on every known SM count: the (constexprs, warps, stages) that ``_launch``
    computes with ``split_constexprs`` for the plan ``plan_for`` builds."""
    from interop.arch import KNOWN_ARCHS, KNOWN_PARTS
    from interop.contract import QUALIFIED

    for arch in ("sm_90", "sm_120"):
        listed = {(tuple(sorted(c["constexprs"].items())), c["num_warps"], c["num_stages"])
                  for c in dec.compile_configs(arch) if c["kernel"] is dec._decode_split_kernel}
        limit = KNOWN_ARCHS[arch].smem_per_block
        missing = []
        for sms in sorted({n for _, n in KNOWN_PARTS.values()}):
            for hq, hkv in QUALIFIED["head_pairs"]:
                g = hq // hkv
                for b in (1, 2, 3, 4, 8, 16, 17, 32, 48, 64, 96, 128):
                    for msk in (1, 31, 64, 500, 2051, 2055):
                        for bal, one in ((True, True), (False, False), (True, False)):
                            plan = dec.fit_shared_memory(
                                dec.plan_decode(b, hkv, g, 256, msk, sms, balance=bal,
                                                one_block_splits=one), head_dim=256, limit=limit)
                            splits = plan.max_splits
                            kv_rows = b * hkv
                            auto = "inline" if 2 * kv_rows >= sms else "kernel"
                            for merge in {auto, "kernel", "inline"}:
                                for pdl, tma in ((False, False), (True, False), (False, True),
                                                 (True, True)):
                                    consts = dec.split_constexprs(
                                        plan, g, 256, inline=merge == "inline",
                                        lse_all=splits > 1 and merge == "kernel", use_pdl=pdl,
                                        pdl_late=pdl and dec.pdl_late_trigger(kv_rows),
                                        use_tma=tma)
                                    key = (tuple(sorted(consts.items())), plan.num_warps,
                                           plan.num_stages)
                                    if key not in listed:
                                        missing.append((arch, sms, hq, b, msk, bal, one, merge,
                                                        pdl, tma))
        assert not missing, missing[:5]


# ---------------------------------------------------------------------------------------------
# sm_120 / sm_121: shipped configurations must fit 101,376 B of shared memory (qsa-contract §5).
_SMEM_SCRIPT = textwrap.dedent("""
    import json
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from qsa_triton import decode as dec
    from interop.plan import DecodePlan

    res = []
    for arch, cc in (("sm_120", 120), ("sm_121", 121)):
        for c in dec.compile_configs(arch):
            if cc == 121 and c["name"].startswith("decode_merge"):
                continue  # same limits as sm_120; the tiny merge kernel once is enough
            src = ASTSource(c["kernel"], c["signature"], constexprs=c["constexprs"], attrs=c["attrs"])
            comp = triton.compile(src, target=GPUTarget("cuda", cc, 32),
                                  options={"num_warps": c["num_warps"], "num_stages": c["num_stages"],
                                           **c.get("options", {})})
            ptx = comp.asm["ptx"]
            gdc = ("griddepcontrol.wait" in ptx, "griddepcontrol.launch_dependents" in ptx,
                   bool(comp.metadata.launch_pdl))
            est = None
            if "BLOCK_N" in c["constexprs"]:
                k = c["constexprs"]
                est = dec.smem_bytes(head_tile=k["HT"], block_n=k["BLOCK_N"], head_dim=k["D"],
                                     num_stages=c["num_stages"])
            res.append([c["name"], cc, comp.metadata.shared, est, gdc])
    print(json.dumps(res))
""")


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_shipped_configs_fit_sm12x_shared_memory():
    # ~400 compiles: seconds when `qsa compile` (CI runs it first) has filled Triton's cache
    # (TRITON_DEFAULT_FP_FUSION is part of the cache key: set as compile_check sets it), several
    # minutes on 2 cores without it
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    r = subprocess.run([sys.executable, "-c", _SMEM_SCRIPT], env=env, capture_output=True, text=True,
                       timeout=1800, cwd=os.path.dirname(os.path.dirname(__file__)))
    if r.returncode != 0:
        pytest.skip(f"cannot compile for sm_120 here: {r.stderr[-400:]}")
    import json

    rows = json.loads(r.stdout.strip().splitlines()[-1])
    assert any(name.startswith("decode_split") for name, *_ in rows)
    assert any(name.startswith("decode_merge") for name, *_ in rows)
    # Programmatic Dependent Launch variants compile for sm_12x too, with both gdc instructions
    # and the launch option; the plain variants have neither
    assert any(name.endswith("_pdl") and name.startswith("decode_split") for name, *_ in rows)
    assert any(name.endswith("_pdl") and name.startswith("decode_merge") for name, *_ in rows)
    assert any(name.endswith("_pdllate") and "_inline" in name for name, *_ in rows)
    shared_of = {(name, cc): shared for name, cc, shared, *_ in rows}
    assert any(name.endswith("_tma") for name, *_ in rows)  # TMA K/V loads compile for sm_12x
    for name, cc, shared, estimate, gdc in rows:
        pdl = "_pdl" in name
        assert tuple(gdc) == ((True,) * 3 if pdl else (False,) * 3), (name, gdc)
        if pdl:  # PDL (entry or late trigger) adds no shared memory
            assert shared == shared_of[(re.sub(r"_pdl(late)?", "", name), cc)], (name, cc)
        if name.endswith("_tma"):  # TMA adds only its mbarriers (8 B per stage)
            assert 0 <= shared - shared_of[(name.removesuffix("_tma"), cc)] <= 64, (name, cc)
    for name, cc, shared, estimate, _ in rows:
        assert shared <= 101_376, (name, cc, shared)
        if estimate is not None:  # the estimate plan_for clamps with must not under-count
            assert shared <= estimate, (name, cc, shared, estimate)
        if name.startswith("decode_split"):
            assert shared > 25_000, (name, shared)  # pipelined K/V tiles do live in shared memory


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
    """FP32 torch reference on the device (``bench.decode.torch_reference``)."""
    from bench.decode import torch_reference as ref  # noqa: PLC0415

    return ref(q, k, v, cq, ck, scale)


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
        out = qsa_triton.sparse_decode(*case, SATURATED)
        assert_close(out, ref64)


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
                with dec.plan_override(merge=merge, **({} if ms is None else {"max_splits": ms})):
                    out = qsa_triton.sparse_decode(*case, SATURATED)
                assert_close_gpu(out, torch_reference(*case), f"{merge} ms={ms} B={b}")
                assert torch.count_nonzero(out[0]) == 0


@gpu
def test_gpu_tma_path_matches_pointer_path():
    """TMA K/V loads (tensor descriptors) against the pointer path and the reference over the
    comparison shapes, with NaN garbage after the last row (read by the partial last block's
    TMA box, masked)."""
    rng = np.random.default_rng(21)
    for tp, (hq, hkv) in TP.items():
        for b in (1, 3, 16, 64, 128):
            for kind in ("saturated", "mixed"):
                lens = lengths_for(kind, b, rng)
                q, k, v, cq, ck = gpu_case(lens, hq, hkv, slack=64, seed=b)
                k[int(ck[-1]):] = float("nan")
                v[int(ck[-1]):] = float("nan")
                assert dec.tma_usable(CUDA, k, v)
                ref = torch_reference(q, k, v, cq, ck)
                outs = {}
                for tma in (True, False):
                    with dec.plan_override(tma=tma):
                        outs[tma] = qsa_triton.sparse_decode(q, k, v, cq, ck, SATURATED)
                what = f"tma {tp} B={b} {kind}"
                assert_close_gpu(outs[True], ref, what)
                assert torch.equal(outs[True], outs[False]), what


@gpu
@pytest.mark.parametrize("d,hq,hkv,dtype", [
    (32, 16, 1, torch.float16), (64, 3, 1, torch.bfloat16), (128, 1, 1, torch.float16),
    (128, 8, 2, torch.bfloat16), (256, 16, 1, torch.bfloat16), (256, 32, 4, torch.float16),
])
def test_gpu_generic_d_and_g(d, hq, hkv, dtype):
    lens = [0, 1, 77, 513, 1500]
    case = gpu_case(lens, hq, hkv, d=d, dtype=dtype, seed=d + hq)
    for ms in (None, 16):
        with dec.plan_override(**({} if ms is None else {"max_splits": ms})):
            out = qsa_triton.sparse_decode(*case, 1500)
        assert_close_gpu(out, torch_reference(*case), f"D={d} {hq}/{hkv} {dtype} ms={ms}")


@gpu
def test_gpu_row_longer_than_max_seqlen_k_and_garbage():
    lens = [4000, 10, 0, SATURATED]
    q, k, v, cq, ck = gpu_case(lens, 24, 2, slack=128)
    k[int(ck[-1]):] = float("nan")
    v[int(ck[-1]):] = float("inf")
    out = qsa_triton.sparse_decode(q, k, v, cq, ck, 64)  # bound far below row 0
    assert_close_gpu(out, torch_reference(q, k, v, cq, ck), "long row")


@gpu
@pytest.mark.parametrize("merge", ["kernel", "inline"])
def test_gpu_cuda_graph_replay_with_new_lengths(merge):
    hq, hkv = TP["TP1"]
    b, cap = 16, 16 * SATURATED + 64
    rng = np.random.default_rng(2)
    dec.prepare(CUDA)
    q = torch.zeros(b, hq, 256, dtype=torch.bfloat16, device=CUDA)
    k = torch.zeros(cap, hkv, 256, dtype=torch.bfloat16, device=CUDA)
    v = torch.zeros_like(k)
    cq = torch.arange(b + 1, dtype=torch.int32, device=CUDA)
    ck = torch.zeros(b + 1, dtype=torch.int32, device=CUDA)

    def load(lens, seed):
        nq, nk, nv, _, nck = gpu_case(lens, hq, hkv, slack=cap - sum(lens), seed=seed)
        q.copy_(nq), k.copy_(nk), v.copy_(nv), ck.copy_(nck)

    load(lengths_for("short", b, rng), 0)
    with dec.plan_override(merge=merge):
        torch.cuda.synchronize()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            qsa_triton.sparse_decode(q, k, v, cq, ck, SATURATED)  # warm-up (compile) off-graph
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = qsa_triton.sparse_decode(q, k, v, cq, ck, SATURATED)
        for i, kind in enumerate(["saturated", "mixed", "short", "medium", "mixed"]):
            lens = lengths_for(kind, b, rng)
            lens[i] = 0
            load(lens, i + 1)
            graph.replay()
            eager = qsa_triton.sparse_decode(q, k, v, cq, ck, SATURATED)
            torch.cuda.synchronize()
            assert torch.equal(out, eager), kind
            assert_close_gpu(out, torch_reference(q, k, v, cq, ck), f"replay {kind}")


@gpu
def test_gpu_capture_refuses_missing_scratch():
    case = gpu_case([300] * 64, 12, 1)  # 64 x 12 x 4096 partial rows: more than any scratch
    with dec.plan_override(max_splits=4096, block_n=16, min_blocks_per_split=1):
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(ContractError):
            with torch.cuda.graph(graph):
                qsa_triton.sparse_decode(*case, 300)


@gpu
def test_gpu_inline_counters_zero_after_10000_launches():
    hq, hkv = TP["TP1"]
    rng = np.random.default_rng(3)
    lens = lengths_for("mixed", 32, rng)
    case = gpu_case(lens, hq, hkv)
    ref = torch_reference(*case)
    with dec.plan_override(merge="inline", max_splits=16):
        out = qsa_triton.sparse_decode(*case, SATURATED)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(100):
                out = qsa_triton.sparse_decode(*case, SATURATED)
        for _ in range(100):
            graph.replay()
    torch.cuda.synchronize()
    info = dec.scratch_info(CUDA)
    assert int(info["counters"].abs().sum()) == 0
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
    a = qsa_triton.sparse_decode(*case, SATURATED)
    b = qsa_triton.sparse_decode(*case, SATURATED)
    assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# GPU: Programmatic Dependent Launch (sm_90+): same numbers as without it, also under CUDA graphs
def pdl_gpu(fn):
    return gpu(pytest.mark.skipif(not (ON_GPU and dec.pdl_supported(CUDA)),
                                  reason="needs sm_90+ and a Triton with launch_pdl")(fn))


@pdl_gpu
@pytest.mark.parametrize("merge", ["kernel", "inline"])
def test_gpu_pdl_on_off_bitwise_equal(merge, monkeypatch):
    rng = np.random.default_rng(7)
    monkeypatch.setenv(dec.PDL_ENV, "auto")
    assert dec.pdl_enabled(CUDA) is dec.PDL_AUTO
    monkeypatch.setattr(dec, "PDL_AUTO", True)
    assert dec.pdl_enabled(CUDA) is True  # auto = on here once PDL_AUTO is flipped
    monkeypatch.setenv(dec.PDL_ENV, "off")
    assert dec.pdl_enabled(CUDA) is False
    monkeypatch.setenv(dec.PDL_ENV, "on")
    assert dec.pdl_enabled(CUDA) is True
    for tp, b, kind, ms in (("TP1", 1, "saturated", None), ("TP1", 16, "mixed", None),
                            ("TP2", 64, "mixed", None), ("TP1", 64, "saturated", None),
                            ("TP4", 3, "saturated", 8),
                            ("TP1", 5, "short", 4)):
        hq, hkv = TP[tp]
        lens = lengths_for(kind, b, rng)
        if b > 2:
            lens[1] = 0
        case = gpu_case(lens, hq, hkv, seed=b)
        ov = {"merge": merge, **({} if ms is None else {"max_splits": ms})}
        with dec.plan_override(pdl=False, **ov):
            off = qsa_triton.sparse_decode(*case, SATURATED)
        with dec.plan_override(pdl=True, **ov):
            on = qsa_triton.sparse_decode(*case, SATURATED)
        with dec.plan_override(**ov):  # the environment's "on"
            on_env = qsa_triton.sparse_decode(*case, SATURATED)
        torch.cuda.synchronize()
        assert torch.equal(on, off), f"{tp} B={b} {kind} {merge}"
        assert torch.equal(on_env, off), f"{tp} B={b} {kind} {merge} (env)"
        assert_close_gpu(on, torch_reference(*case), f"pdl {tp} B={b} {kind} {merge}")


@pdl_gpu
@pytest.mark.parametrize("b", [8, 32])
@pytest.mark.parametrize("merge", ["kernel", "inline"])
def test_gpu_pdl_cuda_graph_chain_replay_matches_eager(merge, b):
    # A graph of several back-to-back decodes on different inputs (so a merge kernel and the next
    # call's split kernel, which overwrites the shared scratch, are PDL neighbours) plus an
    # elementwise consumer of every output; replayed with new lengths / data, compared bitwise
    # with eager calls without PDL. B = 8 (x 2 KV heads): entry trigger; B = 32: B x Hkv = 64,
    # the trigger after the K/V loop (pdl_late_trigger).
    hq, hkv = TP["TP1"]
    n_calls = 4
    assert dec.pdl_late_trigger(b * hkv) is (b == 32)
    cap = b * SATURATED + 64
    rng = np.random.default_rng(8)
    dec.prepare(CUDA)
    qs = [torch.zeros(b, hq, 256, dtype=torch.bfloat16, device=CUDA) for _ in range(n_calls)]
    k = torch.zeros(cap, hkv, 256, dtype=torch.bfloat16, device=CUDA)
    v = torch.zeros_like(k)
    cq = torch.arange(b + 1, dtype=torch.int32, device=CUDA)
    ck = torch.zeros(b + 1, dtype=torch.int32, device=CUDA)

    def load(lens, seed):
        nq, nk, nv, _, nck = gpu_case(lens, hq, hkv, slack=cap - sum(lens), seed=seed)
        for i, q in enumerate(qs):
            q.copy_(torch.roll(nq, i, dims=1) * (1.0 + 0.25 * i))
        k.copy_(nk), v.copy_(nv), ck.copy_(nck)

    def chain():
        outs = [qsa_triton.sparse_decode(q, k, v, cq, ck, SATURATED) for q in qs]
        return outs, [o.float() * 2.0 for o in outs]  # a non-PDL consumer right after each

    load(lengths_for("saturated", b, rng), 0)
    with dec.plan_override(merge=merge, pdl=True):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            chain()  # warm-up (compile) off-graph
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs, twice = chain()
    for i, kind in enumerate(["saturated", "mixed", "short", "medium", "mixed", "saturated"]):
        lens = lengths_for(kind, b, rng)
        lens[i % b] = 0
        load(lens, i + 1)
        graph.replay()
        with dec.plan_override(merge=merge, pdl=False):
            eager = [qsa_triton.sparse_decode(q, k, v, cq, ck, SATURATED) for q in qs]
        torch.cuda.synchronize()
        for j in range(n_calls):
            assert torch.equal(outs[j], eager[j]), f"{kind} call {j}"
            assert torch.equal(twice[j], eager[j].float() * 2.0), f"{kind} consumer {j}"
        assert_close_gpu(outs[-1], torch_reference(qs[-1], k, v, cq, ck), f"pdl replay {kind}")


@pdl_gpu
def test_gpu_pdl_many_launches_counters_and_results():
    hq, hkv = TP["TP1"]
    rng = np.random.default_rng(9)
    case = gpu_case(lengths_for("mixed", 32, rng), hq, hkv)
    ref = torch_reference(*case)
    for merge, ms in (("inline", 16), ("kernel", None)):
        ov = {"merge": merge, "pdl": True, **({} if ms is None else {"max_splits": ms})}
        with dec.plan_override(**ov):
            first = qsa_triton.sparse_decode(*case, SATURATED)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outs = [qsa_triton.sparse_decode(*case, SATURATED) for _ in range(100)]
            for _ in range(50):
                graph.replay()
            eager = [qsa_triton.sparse_decode(*case, SATURATED) for _ in range(200)]
        torch.cuda.synchronize()
        info = dec.scratch_info(CUDA)
        assert int(info["counters"].abs().sum()) == 0, merge
        for o in (outs[0], outs[-1], eager[-1]):
            assert torch.equal(o, first), merge
        assert_close_gpu(first, ref, f"pdl {merge} after many launches")
