"""Packed varlen sparse decode (``qsa-contract.md`` §2) as Triton kernels for PyTorch.

Public:
  sparse_decode(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_k, softmax_scale=None) -> out
  flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ...)
  prepare(device, ...)          persistent split-KV scratch, before CUDA-graph capture
  decode_with_plan(...)         same computation with an explicit DecodePlan (sweeps, tests)
  plan_override(**fields)       context manager: force plan fields (tests, sweeps)
  torch.ops.qsa.sparse_decode   the registered custom op (fake impl for torch.compile)
  compile_configs(arch)         every shipped kernel configuration, for AOT compile checks

Algorithm (our own; the split-KV / LSE-merge scheme is the standard flash-decoding one):
  * Kernel 1 (``_decode_split_kernel``): one program per (sequence s, KV head h, split j). It loads
    the G query heads of KV head h from row ``cu_seqlens_q[s]`` as one [head tile, D] tile (head tile
    = G padded to a power of two >= 16, padded rows masked to 0), then streams its share of the
    row's keys ``[cu_seqlens_k[s], cu_seqlens_k[s+1])`` in BLOCK_N chunks: tensor-core Q·Kᵀ in the
    input dtype, FP32 scores scaled by ``softmax_scale·log2(e)`` (the scale is applied to FP32
    scores, never to q in bf16), FP32 online softmax with exp2, P cast to the value dtype for the
    tensor-core P·V, FP32 accumulator.
  * Split-KV decided on the device (``interop/plan.py``): the grid is static
    (max_splits x B x Hkv, split-major); each program computes from the row's device length
    ``n_active = clamp(cdiv(cdiv(len, BLOCK_N), min_blocks), 1, max_splits)``, with the
    device-side balance (default) also at most ``max(1, len * slots // (total keys * Hkv))``
    (the row's share of ``plan.balance_slots`` programs), and the balanced block range
    ``[cdiv(j·blocks, n_active), cdiv((j+1)·blocks, n_active))`` (rounded up, so uneven extra
    blocks go to the first splits; the Pallas twin rounds down: both cover every block once);
    programs with j >= n_active
    exit at once (after marking their LSE slots empty for the merge kernel). No host read of any length: CUDA-graph replay with new lengths stays correct,
    and a row longer than ``max_seqlen_k`` is still covered entirely (splits just get longer).
  * A row whose n_active is 1 (short rows, large batches, empty rows) is finished by its one
    program (acc / l, exact zeros for an empty row). Otherwise every active split writes its
    normalised partial output (FP32 [D]) and its log2-domain LSE per query head to scratch, and
    * ``merge="kernel"``: kernel 2 (``_decode_merge_kernel``), one program per
      (sequence, query head, slice of D). The split kernel also writes LSE = -inf for every
      inactive split slot (and for split 0 of a row it finished itself), so the merge needs no
      row metadata and issues all its loads in one round trip: M = max_j lse_j (all -inf: row
      already done, nothing to do), weights 2^(lse_j - M) (empty splits weigh 0, their stale
      partials are masked out with a select), output sum_j w_j o_j / sum_j w_j;
    * ``merge="inline"``: the last split to arrive (an int32 acq_rel counter per (s, h)) merges in
      the same launch, ``INLINE_TILE`` splits' LSEs and partials per memory round trip (online
      rescale across chunks), and resets its counter to 0 before exiting;
    * ``merge="auto"`` (``MERGE_MODE``, the default): inline where 2 x B x Hkv >= SMs, else the
      kernel.
  * Offsets into K/V, q, out and the scratch are 64-bit.
  * Programmatic Dependent Launch (sm_90+, QSA_DECODE_PDL / ``plan_override(pdl=)``; "auto", the
    default, turns it on where B x Hkv <= ``PDL_AUTO_MAX_KV_ROWS`` and where B x Hkv >=
    ``PDL_LATE_MIN_KV_ROWS``): both kernels are then launched with ``launch_pdl``, so each may be
    scheduled before its predecessor on the stream has finished. Every program of either kernel
    executes ``gdc_wait`` (returns once the predecessor grid has completed and its memory is
    visible) before any load or store; the split kernel triggers its dependents
    (``gdc_launch_dependents``) on entry, or after its K/V loop where B x Hkv >=
    ``PDL_LATE_MIN_KV_ROWS`` (``pdl_late_trigger``), the merge kernel right after its wait. So
    the merge's launch latency hides behind the split kernel (and the next call's split launch
    behind the merge); results are bitwise the same as without PDL.
  * Small batches (``ONE_BLOCK_SPLITS``): where one split per BLOCK_N block fits one program per
    SM, the grid has exactly that many splits (not a power of two), so no split streams two
    blocks: 65 of 32 keys for 2051 keys, or 33 of 64 keys (8 warps,
    ``interop.plan.WIDE_BLOCK_N``) where Hkv >= 2 and those still fill half the SMs
    (TP1 B = 1).

Scratch: one set per device (LSE, partial outputs, counters), sized at first use for the largest
qualified shape (B = 128, every qualified head pair, D = 256, max_seqlen_k = 2055, through
``plan_decode``) or for the call if that is larger; ``prepare(device)`` creates it explicitly
(call it before CUDA-graph capture if no eager call happened first). A call that needs more than
exists is never silently wrong: outside capture the scratch is enlarged (old buffers are kept
alive, since captured graphs may still point at them); during capture a ``ContractError`` is
raised before any launch. Calls on one device share the scratch, so they must be stream-ordered
(serving runs decode on one stream, as upstream's kernel assumes too).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import threading
import types
from typing import Any

import torch
import triton
import triton.language as tl

try:  # Triton >= 3.4: host-side TMA tensor descriptors
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: pointer loads only
    TensorDescriptor = None

from interop.arch import DeviceFacts
from interop.contract import QUALIFIED, ContractError, check_decode, exact_contract
from interop.plan import (LOG2E, DecodePlan, fit_shared_memory, next_pow2, plan_decode, prev_pow2,
                          smem_bytes, split_blocks)

from ._interp_guard import check_device, check_interpreter_dtype, check_torch_tensors, interpreting

__all__ = [
    "sparse_decode",
    "flash_attn_varlen_func",
    "prepare",
    "decode_with_plan",
    "plan_override",
    "plan_for",
    "scratch_info",
    "smem_bytes",
    "fit_shared_memory",
    "compile_configs",
    "MERGE_MODE",
    "PDL_ENV",
    "PDL_AUTO",
    "PDL_AUTO_MAX_KV_ROWS",
    "PDL_LATE_MIN_KV_ROWS",
    "pdl_late_trigger",
    "INLINE_TILE_ELEMS",
    "inline_tile",
    "split_constexprs",
    "pdl_supported",
    "pdl_enabled",
    "TMA_AUTO",
    "tma_usable",
]

#: default merge of split partials: "kernel" (second small kernel), "inline" (last-arriving
#: split merges, counters reset in the same launch) or "auto": inline where B x Hkv >= SMs / 2
#: (rows get few splits, most none: no second launch), the kernel below that. Why (H200,
#: bench/NOTES.md decode v6b, run 34): with the one-round-trip inline merge, inline from
#: B x Hkv = 64 / 32 / 16 on gave geomean 1.614x / 1.605x / 1.576x upstream vs 1.618x for this
#: rule, and the kernel everywhere 1.601x (it loses 4-5 us at B x Hkv >= 128).
MERGE_MODE = "auto"
#: device-side balance of split counts over the batch's total keys (interop/plan.py);
#: plan_override(balance=False) gives the static per-row rule (decode v2).
BALANCE = True
#: small batches: exactly one split per BLOCK_N block where that fits one wave
#: (``interop.plan.plan_decode(one_block_splits=True)``; plan_override(one_block_splits=False)
#: gives the power-of-two split count of decode v4)
ONE_BLOCK_SPLITS = True

#: Programmatic Dependent Launch (PDL) between the split and merge kernels (and between a merge
#: kernel and the next call's split kernel). Why: at B=1 the whole decode is ~8 us of latency
#: (split kernel + merge-kernel launch gap + merge); with PDL the merge grid is scheduled while
#: the split kernel still runs and waits in-kernel (griddepcontrol.wait) for its results.
#: Source: CUDA C++ Programming Guide, "Programmatic Dependent Launch and Synchronization";
#: PTX ISA "griddepcontrol". Needs sm_90+ and Triton's ``launch_pdl`` launch option with
#: ``tl.extra.cuda.gdc_wait`` / ``gdc_launch_dependents`` (Triton >= 3.4: compiled
#: here with 3.9; 3.6, on the H200, has the same names; ``_TRITON_PDL`` checks at import).
#: Selected per call by the environment variable QSA_DECODE_PDL (read on every call, so a CUDA
#: graph keeps the mode it was captured with) or ``plan_override(pdl=True|False)``:
#:   "off": never; "on": always (ContractError where unsupported); "auto" (default): on where
#:   supported, PDL_AUTO is True and B x Hkv <= PDL_AUTO_MAX_KV_ROWS (entry trigger) or B x Hkv
#:   >= PDL_LATE_MIN_KV_ROWS (late trigger, see there). Why the small-batch bound (H200,
#:   bench/NOTES.md decode v4): at B = 1 the call is one latency chain and PDL hides the merge
#:   launch in every run (TP1 / TP2 / TP4 saturated: 7.70 -> 7.18, 7.78 -> 7.34, 7.13 -> 6.24
#:   us, runs 17, 18 and 22); at B = 4..16 it won in one run and lost up to 11% in another, from
#:   B x Hkv = 32 on it costs about 1 us (early-scheduled grids hold SM slots the split kernel
#:   needs). Results are bitwise the same either way (tests/test_triton_decode.py -m gpu, eager
#:   and under CUDA-graph replay).
PDL_ENV = "QSA_DECODE_PDL"
PDL_MODES = ("auto", "on", "off")
PDL_AUTO = True
PDL_AUTO_MAX_KV_ROWS = 2
#: from this many B x Hkv rows on, "auto" turns PDL on again, with the split kernel's trigger
#: moved after its K/V loop (``pdl_late_trigger``; PDL forced on uses the same placement). Why
#: (H200 run 28, bench/decode_ab.py, same process): the entry trigger costs about 1 us there
#: (TP2 B = 64 saturated 43.00 vs 41.99 us without PDL) while the late one saves about 1 us
#: (40.89; TP4 B = 64 39.84 vs 40.76, TP1 B = 32 40.71 vs 41.87, TP2 B = 128 71.98 vs 72.81); at
#: B x Hkv = 32 the late trigger lost (TP1 B = 16: 26.56 vs 25.41).
PDL_LATE_MIN_KV_ROWS = 64


def pdl_late_trigger(kv_rows: int) -> bool:
    """Whether a PDL launch of the split kernel triggers its dependents after the K/V loop
    (True, B x Hkv >= PDL_LATE_MIN_KV_ROWS) or at entry (False)."""
    return kv_rows >= PDL_LATE_MIN_KV_ROWS


# ---------------------------------------------------------------------------------------------
# Kernels
@triton.jit
def _online_block(q, k_ptrs, v_ptrs, m_i, l_i, acc, n_mask, scale_log2, MASKED: tl.constexpr,
                  DEFER_L: tl.constexpr = False):
    """One BLOCK_N step of the online softmax for a [HT, D] head tile (FP32 state)."""
    if MASKED:
        kt = tl.load(k_ptrs, mask=n_mask[:, None], other=0.0)
        vt = tl.load(v_ptrs, mask=n_mask[:, None], other=0.0)
    else:
        kt = tl.load(k_ptrs)
        vt = tl.load(v_ptrs)
    return _online_step(q, kt, vt, m_i, l_i, acc, n_mask, scale_log2, MASKED, DEFER_L)


@triton.jit
def _online_tma(q, k_desc, v_desc, row, h, m_i, l_i, acc, n_mask, scale_log2,
                BLOCK_N: tl.constexpr, D: tl.constexpr, MASKED: tl.constexpr,
                DEFER_L: tl.constexpr = False):
    """``_online_block`` with K/V rows [row, row + BLOCK_N) of KV head h loaded by TMA (tensor
    descriptors over [C, Hkv, D]). TMA reads whole boxes: rows past the block's valid ones
    (MASKED: the row's partial last block) are other sequences' rows or zero fill past C, so
    their scores are masked to -inf and their V rows zeroed (0 x NaN garbage would be NaN)."""
    kt = tl.reshape(k_desc.load([row, h, 0]), [BLOCK_N, D])
    vt = tl.reshape(v_desc.load([row, h, 0]), [BLOCK_N, D])
    if MASKED:
        vt = tl.where(n_mask[:, None], vt, 0.0)
    return _online_step(q, kt, vt, m_i, l_i, acc, n_mask, scale_log2, MASKED, DEFER_L)


@triton.jit
def _online_step(q, kt, vt, m_i, l_i, acc, n_mask, scale_log2, MASKED: tl.constexpr,
                 DEFER_L: tl.constexpr = False):
    """The online-softmax update for one loaded [BLOCK_N, D] K/V block."""
    s = tl.dot(q, tl.trans(kt)) * scale_log2  # FP32 [HT, BLOCK_N], log2 domain
    return _softmax_pv(s, vt, m_i, l_i, acc, n_mask, MASKED, DEFER_L)


@triton.jit
def _softmax_pv(s, vt, m_i, l_i, acc, n_mask, MASKED: tl.constexpr, DEFER_L: tl.constexpr):
    """Online softmax on the scaled scores s [HT, BLOCK_N] and the P·V update. DEFER_L: l_i is
    a [HT, BLOCK_N] running sum (the kernel reduces it once after its loop), so the block needs
    no cross-warp row sum."""
    if MASKED:
        s = tl.where(n_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)  # 0 on the first block (m_i = -inf, m_new finite)
    p = tl.exp2(s - m_new[:, None])
    if DEFER_L:
        l_i = l_i * alpha[:, None] + p
    else:
        l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
    return m_new, l_i, acc


@triton.jit
def _online_split(q0, q1, q2, q3, k0_ptrs, v_ptrs, m_i, l_i, acc, n_mask, scale_log2,
                  DH: tl.constexpr, QK_SPLIT: tl.constexpr, MASKED: tl.constexpr,
                  DEFER_L: tl.constexpr):
    """``_online_block`` with Q·Kᵀ as QK_SPLIT (2 or 4) independent dots over DH = D / QK_SPLIT
    columns each (q0..q3: the query tile's column slices; k0_ptrs: the first slice's pointers).
    Each partial dot is scaled before the sum: an unscaled ``dot + x`` would be folded back into
    one accumulating dot (Triton's dot-add combine), i.e. one dependent chain again."""
    if MASKED:
        k0 = tl.load(k0_ptrs, mask=n_mask[:, None], other=0.0)
        k1 = tl.load(k0_ptrs + DH, mask=n_mask[:, None], other=0.0)
        vt = tl.load(v_ptrs, mask=n_mask[:, None], other=0.0)
    else:
        k0 = tl.load(k0_ptrs)
        k1 = tl.load(k0_ptrs + DH)
        vt = tl.load(v_ptrs)
    s = tl.dot(q0, tl.trans(k0)) * scale_log2 + tl.dot(q1, tl.trans(k1)) * scale_log2
    if QK_SPLIT == 4:
        if MASKED:
            k2 = tl.load(k0_ptrs + 2 * DH, mask=n_mask[:, None], other=0.0)
            k3 = tl.load(k0_ptrs + 3 * DH, mask=n_mask[:, None], other=0.0)
        else:
            k2 = tl.load(k0_ptrs + 2 * DH)
            k3 = tl.load(k0_ptrs + 3 * DH)
        s += tl.dot(q2, tl.trans(k2)) * scale_log2 + tl.dot(q3, tl.trans(k3)) * scale_log2
    return _softmax_pv(s, vt, m_i, l_i, acc, n_mask, MASKED, DEFER_L)


@triton.jit
def _active_splits(cu_k_ptr, s, BLOCK_N, MAX_SPLITS, MIN_BLOCKS, NSEQ, HKV, SLOTS,
                   BALANCE: tl.constexpr):
    """(row start, row length, blocks, n_active) of sequence s, from device data only.

    BALANCE: the row's share of SLOTS programs, proportional to its length within the batch's
    total keys (interop/plan.py), capped by MAX_SPLITS and by one split per MIN_BLOCKS
    blocks; otherwise one split per MIN_BLOCKS blocks up to MAX_SPLITS."""
    k_lo = tl.load(cu_k_ptr + s)
    k_hi = tl.load(cu_k_ptr + s + 1)
    n = tl.maximum(k_hi - k_lo, 0)
    blocks = tl.cdiv(n, BLOCK_N)
    n_act = tl.minimum(tl.maximum(tl.cdiv(blocks, MIN_BLOCKS), 1), MAX_SPLITS)
    if BALANCE:
        total = tl.maximum(tl.load(cu_k_ptr + NSEQ) - tl.load(cu_k_ptr), 1).to(tl.int64)
        share = (n.to(tl.int64) * SLOTS) // (total * HKV)  # int64: n * SLOTS may pass 2^31
        n_act = tl.minimum(n_act, tl.maximum(share, 1).to(tl.int32))
    return k_lo, n, blocks, n_act


# The split rule both decode twins use (interop.plan.split_blocks), jitted with this module's
# globals: Triton needs triton.language visible from a jit function, the core cannot import it.
_split_blocks = triton.jit(types.FunctionType(split_blocks.__code__, globals(), "split_blocks"))


# Shape ints stay runtime values and are not specialised (Triton would otherwise compile a
# variant for every value == 1 / multiple of 16): one compiled kernel serves every B and split count.
@triton.jit(do_not_specialize=["HQ", "HKV", "MAX_SPLITS", "MIN_BLOCKS", "NSEQ", "SLOTS"])
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, part_ptr, cnt_ptr, cu_q_ptr, cu_k_ptr,
    scale_log2,
    stride_qb, stride_qh, stride_kc, stride_kh, stride_vc, stride_vh, stride_ob, stride_oh,
    HQ, HKV, MAX_SPLITS, MIN_BLOCKS, NSEQ, SLOTS,
    G: tl.constexpr, D: tl.constexpr, HT: tl.constexpr, BLOCK_N: tl.constexpr,
    MERGE_INLINE: tl.constexpr, LSE_ALL: tl.constexpr, USE_PDL: tl.constexpr,
    BALANCE: tl.constexpr, TAIL_IN_LOOP: tl.constexpr = False, USE_TMA: tl.constexpr = False,
    QK_SPLIT: tl.constexpr = 1, DEFER_L: tl.constexpr = False, PDL_LATE: tl.constexpr = False,
    INLINE_TILE: tl.constexpr = 4,
):
    if USE_PDL:
        # Programmatic Dependent Launch (see PDL_AUTO): this grid may start before the previous
        # kernel on the stream has finished, so wait for it (griddepcontrol.wait: all
        # prerequisite grids completed, their memory visible) before touching anything: q/k/v/
        # cu_seqlens may come from it, and a previous merge kernel may still read the scratch we
        # are about to overwrite. Every program waits (inactive ones store -inf LSEs too).
        # Early trigger (PDL_LATE False): the merge grid may then be scheduled while we run; it
        # sits in its own gdc_wait until this grid has completed, so triggering early is always
        # safe (all our programs are resident by the time the trigger fires: no deadlock).
        # Late trigger: after the K/V loop (below), so at large B the dependent grid is
        # scheduled only during this grid's tail, not while its programs stream.
        if not PDL_LATE:
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    pid = tl.program_id(0)
    # split-major order: every row's split 0 (active whenever the row is non-empty) gets the
    # lowest program ids, the splits that exit at once the highest. With (s, h)-major ids, a
    # grid of 4 splits per row with 2 active ran TP2 B=64 at 51.5 us vs 42.5 split-major (H200
    # runs 7-8; bench/NOTES.md, decode v3).
    n_sh = NSEQ * HKV
    j = pid // n_sh
    sh = pid % n_sh
    s = sh // HKV
    h = sh % HKV
    # the query row's index is loaded with cu_seqlens_k, before the split bookkeeping and its
    # early exit, so the q load can issue with the first K/V loads (at B = 1 a split streams
    # one or two blocks: its chain of dependent loads is its time)
    q_row = tl.load(cu_q_ptr + s).to(tl.int64)
    k_lo, n, blocks, n_act = _active_splits(cu_k_ptr, s, BLOCK_N, MAX_SPLITS, MIN_BLOCKS, NSEQ,
                                            HKV, SLOTS, BALANCE)
    offs_m = tl.arange(0, HT)
    m_ok = offs_m < G
    heads = h * G + offs_m  # global query head of each tile row
    part_row = (s.to(tl.int64) * HQ + heads) * MAX_SPLITS + j  # [HT] int64 scratch row
    if j >= n_act:
        if LSE_ALL:  # tell the merge kernel this split is empty (it never reads cu_seqlens_k)
            tl.store(lse_ptr + part_row, tl.full([HT], float("-inf"), tl.float32), mask=m_ok)
        return
    # block boundaries rounded up: where the blocks do not divide evenly the *first* splits take
    # the extra blocks, so the last split, which holds the row's partial (masked) block, is
    # never longer than the others (at B = 1, 65 blocks over 64 splits: split 0 streams two
    # full blocks, the last only the partial one). int64: blocks x j may pass 2^31.
    blk_lo, blk_hi = _split_blocks(blocks.to(tl.int64), j, n_act)
    start = (blk_lo * BLOCK_N).to(tl.int32)  # <= n: fits int32
    stop = tl.minimum(blk_hi * BLOCK_N, n).to(tl.int32)
    full_stop = start + ((stop - start) // BLOCK_N) * BLOCK_N

    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    q_rows = q_ptr + q_row * stride_qb + heads.to(tl.int64)[:, None] * stride_qh
    if QK_SPLIT == 1:
        q = tl.load(q_rows + offs_d[None, :], mask=m_ok[:, None], other=0.0)
    else:  # column slices of the query tile for the split Q·Kᵀ (_online_split)
        DH: tl.constexpr = D // QK_SPLIT
        offs_h = tl.arange(0, DH)
        q0 = tl.load(q_rows + offs_h[None, :], mask=m_ok[:, None], other=0.0)
        q1 = tl.load(q_rows + DH + offs_h[None, :], mask=m_ok[:, None], other=0.0)
        q = q0  # unused (keeps the name bound for the compiler's branch checks)
        q2 = q0
        q3 = q1
        if QK_SPLIT == 4:
            q2 = tl.load(q_rows + 2 * DH + offs_h[None, :], mask=m_ok[:, None], other=0.0)
            q3 = tl.load(q_rows + 3 * DH + offs_h[None, :], mask=m_ok[:, None], other=0.0)

    m_i = tl.full([HT], float("-inf"), tl.float32)
    if DEFER_L:
        l_i = tl.zeros([HT, BLOCK_N], tl.float32)
    else:
        l_i = tl.zeros([HT], tl.float32)
    acc = tl.zeros([HT, D], tl.float32)
    if USE_TMA:
        # k_ptr / v_ptr are tensor descriptors: one TMA copy per block instead of per-thread
        # address math and cp.async (at B = 1 the split kernel is bound by its warps'
        # instruction streams: ncu, bench/NOTES.md decode v4). TMA coordinates are int32 rows.
        row = k_lo + start
        for _ in range(start, full_stop, BLOCK_N):
            m_i, l_i, acc = _online_tma(q, k_ptr, v_ptr, row, h, m_i, l_i, acc, offs_n < BLOCK_N,
                                        scale_log2, BLOCK_N, D, False, DEFER_L)
            row += BLOCK_N
        if full_stop < stop:
            m_i, l_i, acc = _online_tma(q, k_ptr, v_ptr, k_lo + full_stop, h, m_i, l_i, acc,
                                        (full_stop + offs_n) < stop, scale_log2, BLOCK_N, D, True,
                                        DEFER_L)
    elif TAIL_IN_LOOP:
        row0 = k_lo.to(tl.int64) + start  # 64-bit row index into the packed K/V
        k_ptrs = (k_ptr + h.to(tl.int64) * stride_kh + (row0 + offs_n)[:, None] * stride_kc
                  + offs_d[None, :])
        v_ptrs = (v_ptr + h.to(tl.int64) * stride_vh + (row0 + offs_n)[:, None] * stride_vc
                  + offs_d[None, :])
        # every block in one (pipelined) loop, masked by rows: the split holding the row's
        # partial last block then waits for one memory round trip instead of two (at B = 1,
        # one or two blocks per split, that split decides the kernel's time)
        for off in range(start, stop, BLOCK_N):
            m_i, l_i, acc = _online_block(q, k_ptrs, v_ptrs, m_i, l_i, acc, (off + offs_n) < stop,
                                          scale_log2, True, DEFER_L)
            k_ptrs += BLOCK_N * stride_kc
            v_ptrs += BLOCK_N * stride_vc
    else:
        row0 = k_lo.to(tl.int64) + start  # 64-bit row index into the packed K/V
        k_ptrs = (k_ptr + h.to(tl.int64) * stride_kh + (row0 + offs_n)[:, None] * stride_kc
                  + offs_d[None, :])
        v_ptrs = (v_ptr + h.to(tl.int64) * stride_vh + (row0 + offs_n)[:, None] * stride_vc
                  + offs_d[None, :])
        if QK_SPLIT == 1:
            # interior blocks: no masks, so the loads vectorise and pipeline
            for _ in range(start, full_stop, BLOCK_N):
                m_i, l_i, acc = _online_block(q, k_ptrs, v_ptrs, m_i, l_i, acc, offs_n < BLOCK_N,
                                              scale_log2, False, DEFER_L)
                k_ptrs += BLOCK_N * stride_kc
                v_ptrs += BLOCK_N * stride_vc
            if full_stop < stop:  # the row's last, partial block (only in the last split)
                m_i, l_i, acc = _online_block(q, k_ptrs, v_ptrs, m_i, l_i, acc,
                                              (full_stop + offs_n) < stop, scale_log2, True, DEFER_L)
        else:
            k0_ptrs = (k_ptr + h.to(tl.int64) * stride_kh + (row0 + offs_n)[:, None] * stride_kc
                       + offs_h[None, :])
            for _ in range(start, full_stop, BLOCK_N):
                m_i, l_i, acc = _online_split(q0, q1, q2, q3, k0_ptrs, v_ptrs, m_i, l_i, acc,
                                              offs_n < BLOCK_N, scale_log2, DH, QK_SPLIT, False,
                                              DEFER_L)
                k0_ptrs += BLOCK_N * stride_kc
                v_ptrs += BLOCK_N * stride_vc
            if full_stop < stop:
                m_i, l_i, acc = _online_split(q0, q1, q2, q3, k0_ptrs, v_ptrs, m_i, l_i, acc,
                                              (full_stop + offs_n) < stop, scale_log2, DH,
                                              QK_SPLIT, True, DEFER_L)
    if DEFER_L:
        l_i = tl.sum(l_i, 1)

    if USE_PDL and PDL_LATE:
        tl.extra.cuda.gdc_launch_dependents()  # (programs that exit early count as triggered)
    o_rows = s.to(tl.int64) * stride_ob + heads.to(tl.int64) * stride_oh
    if n_act == 1:
        # whole row in this program; an empty row has acc = 0, l = 0 -> exact zeros
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(out_ptr + o_rows[:, None] + offs_d[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=m_ok[:, None])
        if LSE_ALL:  # "no partials here": the merge kernel leaves this row alone
            tl.store(lse_ptr + part_row, tl.full([HT], float("-inf"), tl.float32), mask=m_ok)
    else:
        # non-empty split (n_act <= blocks): l_i > 0 for the real heads
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        tl.store(lse_ptr + part_row, m_i + tl.log2(l_safe), mask=m_ok)
        tl.store(part_ptr + part_row[:, None] * D + offs_d[None, :], acc / l_safe[:, None],
                 mask=m_ok[:, None])
        if MERGE_INLINE:
            tl.debug_barrier()  # every thread's partial stores precede the release below
            arrived = tl.atomic_add(cnt_ptr + sh, 1, sem="acq_rel", scope="gpu")
            if arrived == n_act - 1:
                # the last-arriving split merges the row, INLINE_TILE splits per chunk: the chunk's
                # LSE and partial loads are independent of each other and of any reduction (all
                # elementwise on [HT] / [HT, D] in the accumulator's layout: no barrier between
                # them), so they issue together, one memory round trip per chunk (a runtime loop
                # over the splits paid one per split and step). Chunks after the first rescale
                # the running sum online, as the split loop does.
                base = (s.to(tl.int64) * HQ + heads) * MAX_SPLITS  # [HT]
                mx = tl.full([HT], float("-inf"), tl.float32)
                wsum = tl.zeros([HT], tl.float32)
                o = tl.zeros([HT, D], tl.float32)
                for c in range(0, n_act, INLINE_TILE):
                    m_new = mx
                    for t in tl.static_range(INLINE_TILE):
                        ok = m_ok & ((offs_m * 0 + (c + t)) < n_act)  # [HT]
                        m_new = tl.maximum(m_new, tl.load(lse_ptr + base + c + t, mask=ok,
                                                          other=float("-inf"), cache_modifier=".cg"))
                    # padded heads (m_ok False) stay at -inf: keep their arithmetic finite
                    m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)
                    alpha = tl.exp2(mx - m_ref)  # 0 on the first chunk
                    wsum = wsum * alpha
                    o = o * alpha[:, None]
                    for t in tl.static_range(INLINE_TILE):
                        ok = m_ok & ((offs_m * 0 + (c + t)) < n_act)  # [HT]
                        w = tl.exp2(tl.load(lse_ptr + base + c + t, mask=ok, other=float("-inf"),
                                            cache_modifier=".cg") - m_ref)  # empty split: 0
                        pt = tl.load(part_ptr + (base + c + t)[:, None] * D + offs_d[None, :],
                                     mask=ok[:, None], other=0.0, cache_modifier=".cg")
                        wsum += w
                        o += w[:, None] * pt
                    mx = m_new
                o = o / tl.where(wsum > 0.0, wsum, 1.0)[:, None]
                tl.store(out_ptr + o_rows[:, None] + offs_d[None, :],
                         o.to(out_ptr.dtype.element_ty), mask=m_ok[:, None])
                tl.atomic_xchg(cnt_ptr + sh, 0, sem="release", scope="gpu")


@triton.jit(do_not_specialize=["HQ", "MAX_SPLITS"])
def _decode_merge_kernel(
    out_ptr, lse_ptr, part_ptr, stride_ob, stride_oh, HQ, MAX_SPLITS,
    D: tl.constexpr, SPLIT_CHUNK: tl.constexpr, D_CHUNK: tl.constexpr, N_DC: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # One program per (sequence, query head, D_CHUNK columns). The split kernel wrote an LSE for
    # every split slot (-inf: empty / inactive / row finished by its single split), so this kernel
    # needs no row metadata: it issues the LSE and partial loads of the first SPLIT_CHUNK splits
    # together (one memory round trip; SPLIT_CHUNK covers every split unless an override asks for
    # more than 128) and masks by weight with tl.where, so stale partials are never used.
    pid = tl.program_id(0)
    row = pid // N_DC  # s * HQ + query head
    dc = pid % N_DC
    s = row // HQ
    hq = row % HQ
    base = row.to(tl.int64) * MAX_SPLITS
    offs_j = tl.arange(0, SPLIT_CHUNK)
    offs_d = dc * D_CHUNK + tl.arange(0, D_CHUNK)
    jm = offs_j < MAX_SPLITS
    if USE_PDL:
        # launched early (PDL): the split kernel's LSEs/partials are visible only after this
        # wait. Then let the next kernel (the next decode's split kernel) get scheduled; it
        # waits for our completion in turn before overwriting the scratch we read.
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    lse = tl.load(lse_ptr + base + offs_j, mask=jm, other=float("-inf"))
    part = tl.load(part_ptr + (base + offs_j)[:, None] * D + offs_d[None, :], mask=jm[:, None],
                   other=0.0)
    mx = tl.max(lse, 0)
    for c in range(SPLIT_CHUNK, MAX_SPLITS, SPLIT_CHUNK):  # only for > SPLIT_CHUNK splits
        mx = tl.maximum(mx, tl.max(tl.load(lse_ptr + base + c + offs_j,
                                           mask=(c + offs_j) < MAX_SPLITS, other=float("-inf")), 0))
    if mx > float("-inf"):  # the row has partials (n_active > 1)
        w = tl.exp2(lse - mx)  # empty splits: exp2(-inf) = 0
        wsum = tl.sum(w, 0)
        o = tl.sum(tl.where(w[:, None] > 0.0, w[:, None] * part, 0.0), 0)
        for c in range(SPLIT_CHUNK, MAX_SPLITS, SPLIT_CHUNK):
            cm = (c + offs_j) < MAX_SPLITS
            wc = tl.exp2(tl.load(lse_ptr + base + c + offs_j, mask=cm, other=float("-inf")) - mx)
            pc = tl.load(part_ptr + (base + c + offs_j)[:, None] * D + offs_d[None, :],
                         mask=cm[:, None], other=0.0)
            wsum += tl.sum(wc, 0)
            o += tl.sum(tl.where(wc[:, None] > 0.0, wc[:, None] * pc, 0.0), 0)
        o = o / wsum
        tl.store(out_ptr + s.to(tl.int64) * stride_ob + hq.to(tl.int64) * stride_oh + offs_d,
                 o.to(out_ptr.dtype.element_ty))


# ---------------------------------------------------------------------------------------------
# Plan (static geometry) and overrides
_override = threading.local()


@contextlib.contextmanager
def plan_override(**fields):
    """Force DecodePlan fields (``block_n``, ``max_splits``, ``min_blocks_per_split``,
    ``num_warps``, ``num_stages``, ``balance_slots``, ``tail_in_loop``, ``qk_split`` (1, 2 or 4),
    ``defer_rowsum``), ``balance`` (True | False: plan with or without the device-side balance),
    ``one_block_splits`` (True | False: one split per block at small batch, ``ONE_BLOCK_SPLITS``),
    ``merge`` ("kernel" | "inline" | "auto"), ``pdl`` (True | False:
    Programmatic Dependent Launch on/off, overriding QSA_DECODE_PDL) and/or ``tma`` (True |
    False: K/V blocks loaded by TMA where ``tma_usable``, overriding TMA_AUTO) for calls made inside the
    ``with`` block on this thread (tests: force splits > 1; sweeps). The plan is read when the
    kernel is launched, so a CUDA graph captured inside the block keeps that geometry.

    Raises (on entering the ``with`` block, before any call):
      ValueError: unknown field; ``pdl``, ``tma``, ``balance``, ``one_block_splits``,
        ``tail_in_loop`` or ``defer_rowsum`` not a bool; ``qk_split`` not 1, 2 or 4; ``merge``
        not kernel / inline / auto; ``block_n`` or ``head_tile`` not a power of two >= 16;
        ``num_warps`` not 1, 2, 4, 8 or 16; ``max_splits``, ``min_blocks_per_split`` or
        ``num_stages`` not an int >= 1; ``balance_slots`` not an int >= 0.
    """
    allowed = {f.name for f in dataclasses.fields(DecodePlan)} | {"merge", "pdl", "balance", "tma",
                                                                   "one_block_splits"}
    bad = set(fields) - allowed
    if bad:
        raise ValueError(f"plan_override: unknown fields {sorted(bad)}; allowed {sorted(allowed)}")
    for key in ("pdl", "tma", "balance", "one_block_splits", "tail_in_loop", "defer_rowsum"):
        if key in fields and not isinstance(fields[key], bool):
            raise ValueError(f"plan_override: {key} must be True or False, got {fields[key]!r}")
    if "qk_split" in fields and fields["qk_split"] not in (1, 2, 4):
        raise ValueError(f"plan_override: qk_split must be 1, 2 or 4, got {fields['qk_split']!r}")
    if "merge" in fields and fields["merge"] not in ("kernel", "inline", "auto"):
        raise ValueError(f"plan_override: merge must be 'kernel', 'inline' or 'auto', got "
                         f"{fields['merge']!r}")

    def _int(x) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    for key in ("block_n", "head_tile"):  # tl.arange extents and tensor-core tiles
        x = fields.get(key)
        if key in fields and not (_int(x) and x >= 16 and x & (x - 1) == 0):
            raise ValueError(f"plan_override: {key} must be a power of two >= 16, got {x!r}")
    if "num_warps" in fields and fields["num_warps"] not in (1, 2, 4, 8, 16):
        raise ValueError(f"plan_override: num_warps must be 1, 2, 4, 8 or 16, got "
                         f"{fields['num_warps']!r}")
    for key, lo in (("max_splits", 1), ("min_blocks_per_split", 1), ("num_stages", 1),
                    ("balance_slots", 0)):
        if key in fields and not (_int(fields[key]) and fields[key] >= lo):
            raise ValueError(f"plan_override: {key} must be an int >= {lo}, got {fields[key]!r}")
    prev = getattr(_override, "fields", None)
    _override.fields = {**(prev or {}), **fields}
    try:
        yield
    finally:
        _override.fields = prev


def _facts(device: torch.device) -> DeviceFacts | None:
    """The device's facts (``interop.arch``, cached there); None on CPU (Triton's interpreter:
    plans are sized for the H200's 132 SMs, no shared-memory limit)."""
    return DeviceFacts.from_torch(device) if device.type == "cuda" else None


def _sm_count(device: torch.device) -> int:
    facts = _facts(device)
    return 132 if facts is None else facts.sm_count


def plan_for(batch: int, num_kv_heads: int, group: int, head_dim: int, max_seqlen_k: int,
             device: torch.device | str = "cuda") -> tuple[DecodePlan, str]:
    """The (DecodePlan, merge mode) a call with these static shapes uses, overrides included."""
    device = torch.device(device)
    fields = dict(getattr(_override, "fields", None) or {})
    key = (batch, num_kv_heads, group, head_dim, max_seqlen_k, device.type, device.index,
           MERGE_MODE, BALANCE, ONE_BLOCK_SPLITS, tuple(sorted(fields.items())))
    hit = _PLANS.get(key)
    if hit is not None:
        return hit
    merge = fields.pop("merge", MERGE_MODE)
    fields.pop("pdl", None)  # launch mode, not geometry: resolved per call by pdl_enabled
    fields.pop("tma", None)  # load path, resolved per call by tma_usable
    if merge not in ("kernel", "inline", "auto"):
        raise ValueError(f"merge must be 'kernel', 'inline' or 'auto', got {merge!r}")
    facts = _facts(device)
    sms = _sm_count(device)
    plan = plan_decode(batch, num_kv_heads, group, head_dim, max_seqlen_k, sms,
                       max_splits=fields.pop("max_splits", None), block_n=fields.pop("block_n", None),
                       balance=bool(fields.pop("balance", BALANCE)),
                       one_block_splits=bool(fields.pop("one_block_splits", ONE_BLOCK_SPLITS)))
    if fields:
        plan = dataclasses.replace(plan, **fields)
    hit = (fit_shared_memory(plan, head_dim=head_dim, limit=facts and facts.smem_per_block), merge)
    if len(_PLANS) < 4096:
        _PLANS[key] = hit
    return hit


_PLANS: dict[tuple, tuple[DecodePlan, str]] = {}  # host-side cache: plan_for runs on every call


# ---------------------------------------------------------------------------------------------
# Ahead-of-time compile list (``qsa compile``, ``interop/compile_check.py``)
_SPLIT_PTRS = {"q_ptr": "*{dt}", "k_ptr": "*{dt}", "v_ptr": "*{dt}", "out_ptr": "*{dt}",
               "lse_ptr": "*fp32", "part_ptr": "*fp32", "cnt_ptr": "*i32", "cu_q_ptr": "*i32",
               "cu_k_ptr": "*i32", "scale_log2": "fp32"}
_MERGE_PTRS = {"out_ptr": "*{dt}", "lse_ptr": "*fp32", "part_ptr": "*fp32"}


def _aot(fn, ptrs: dict, consts: dict, dt: str) -> tuple[dict, dict]:
    """(signature, attrs) for ``triton.compile(ASTSource(fn, signature, constexprs, attrs))``:
    pointers and strides 16-divisible, as the JIT specialises them at run time (without that the
    K/V loads are neither vectorised nor pipelined, and shared memory is under-counted)."""
    sig = {n: (ptrs[n].format(dt=dt) if n in ptrs else "constexpr" if n in consts else "i32")
           for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n.endswith("_ptr") or n.startswith("stride")}
    return sig, attrs


def compile_configs(arch: str, *, head_dim: int = 256, dtype: str = "bf16") -> list[dict]:
    """Every decode kernel configuration the plan can launch on ``arch`` (a name in
    ``interop.arch.KNOWN_ARCHS``, e.g. ``"sm_120"``) for the qualified shapes: the split kernel per
    distinct (G, head tile, BLOCK_N, num_warps, num_stages) over B = 1..128 and the qualified head
    pairs, fitted to the arch's shared memory as ``plan_for`` does, with both merge modes; and the
    merge kernel per split chunk. Shape ints (B, splits) are runtime values: they add no variant.
    The split kernel with every launchable (merge inline, LSE_ALL, balance) combination
    (LSE_ALL False on the merge-kernel path: a one-split grid; names ``_nolse``). On sm_90+ (every
    known arch) also the Programmatic Dependent Launch variants of each (``USE_PDL=True``, option
    ``launch_pdl``; names contain ``_pdl`` for the entry trigger, ``_pdllate`` for the trigger
    after the K/V loop, ``PDL_LATE``) and of the merge kernel per chunk; and every split-kernel
    variant with TMA K/V loads (``USE_TMA=True``, ``k_ptr``/``v_ptr`` typed
    ``tensordesc<dtype[BLOCK_N,1,D]>``; names end in ``_tma``). Every constexpr ``_launch``
    passes is set, from the same ``split_constexprs`` (QK_SPLIT, DEFER_L, TAIL_IN_LOOP from the
    plan; INLINE_TILE on the inline path, names ``_inline<tile>``). The geometries are those
    ``plan_decode`` gives with the static rule and with the defaults (``BALANCE``,
    ``ONE_BLOCK_SPLITS``: BLOCK_N can be ``WIDE_BLOCK_N`` with 8 warps) for every SM count in
    ``interop.arch``'s table, fitted to the arch's shared memory.

    Returns:
      list of dicts: ``kernel`` (JITFunction), ``name``, ``signature``, ``constexprs`` (name ->
      value), ``attrs`` (16-divisibility of pointers/strides), ``num_warps``, ``num_stages``,
      ``options`` (extra ``triton.compile`` options: ``launch_pdl`` for the PDL variants).
    """
    from interop.arch import KNOWN_ARCHS, KNOWN_PARTS  # noqa: PLC0415

    info = KNOWN_ARCHS[arch]
    limit = info.smem_per_block
    pdl_modes = (False, True) if tuple(info.cc) >= (9, 0) and _TRITON_PDL else (False,)
    out, seen = [], set()
    lo, hi = QUALIFIED["batch"]
    # the geometry plan_for can pick: the static rule and the defaults (balance, one-block
    # splits, whose BLOCK_N can be WIDE_BLOCK_N), for every known SM count
    sms_all = sorted({sms for _, sms in KNOWN_PARTS.values()})
    plan_kw = [{}, {"balance": BALANCE, "one_block_splits": ONE_BLOCK_SPLITS}]
    for hq, hkv in QUALIFIED["head_pairs"]:
        g = hq // hkv
        plans = {fit_shared_memory(plan_decode(b, hkv, g, head_dim, QUALIFIED["max_seqlen_k"],
                                               sms, **kw), head_dim=head_dim, limit=limit)
                 for b in range(lo, hi + 1) for sms in sms_all for kw in plan_kw}
        # one compiled kernel per geometry (split counts and B are runtime values)
        geometry = {}
        for p in sorted(plans, key=lambda p: (p.block_n, p.max_splits)):
            geometry.setdefault((p.head_tile, p.block_n, p.num_warps, p.num_stages,
                                 p.tail_in_loop, p.qk_split, p.defer_rowsum), p)
        for p in geometry.values():
            # (merge inline, LSE_ALL, PDL, late trigger, balance): _launch passes LSE_ALL =
            # splits > 1 and merge == "kernel", MERGE_INLINE = merge == "inline"; PDL (auto or
            # forced on) goes with either merge and either trigger placement
            paths = [(False, True), (False, False), (True, False)]
            pdls = [(False, False)] + ([(True, False), (True, True)] if True in pdl_modes else [])
            variants = [(i, lse, pdl, late, bal) for i, lse in paths for pdl, late in pdls
                        for bal in (False, True)]
            tmas = (False, True) if tuple(info.cc) >= (9, 0) and TensorDescriptor else (False,)
            for (inline, lse_all, pdl, late, bal), tma in itertools.product(variants, tmas):
                # every constexpr the launch passes (a missing one would be compiled as a
                # runtime int, with both branches of its ifs: not the launched kernel)
                consts = split_constexprs(dataclasses.replace(p, balance_slots=int(bal)), g,
                                          head_dim, inline=inline, lse_all=lse_all, use_pdl=pdl,
                                          pdl_late=late, use_tma=tma)
                key = (tuple(consts.items()), p.num_warps, p.num_stages)
                if key in seen:
                    continue
                seen.add(key)
                sig, attrs = _aot(_decode_split_kernel, _SPLIT_PTRS, consts, dtype)
                if tma:  # K/V as tensor descriptors (one [BLOCK_N, 1, D] box)
                    desc = f"tensordesc<{dtype}[{p.block_n},1,{head_dim}]>"
                    sig = {**sig, "k_ptr": desc, "v_ptr": desc}
                    names = _decode_split_kernel.arg_names
                    attrs = {i: a for i, a in attrs.items() if names[i[0]] not in ("k_ptr", "v_ptr")}
                out.append({"kernel": _decode_split_kernel, "signature": sig, "constexprs": consts,
                            "attrs": attrs, "num_warps": p.num_warps, "num_stages": p.num_stages,
                            "options": {"launch_pdl": True} if pdl else {},
                            "name": f"decode_split_G{g}_ht{p.head_tile}_bn{p.block_n}_w{p.num_warps}"
                                    f"_s{p.num_stages}{'_inline%d' % consts['INLINE_TILE'] if inline else ''}"
                                    f"{'' if inline or lse_all else '_nolse'}_{dtype}"
                                    f"{'_bal' if bal else ''}{'_pdl' if pdl else ''}"
                                    f"{'late' if late else ''}"
                                    f"{'_tma' if tma else ''}"})
    for pdl in pdl_modes:
        for chunk in (2, 4, 8, 16, 32, 64, 128):
            d_chunk = _merge_d_chunk(chunk, head_dim)
            consts = {"D": head_dim, "SPLIT_CHUNK": chunk, "D_CHUNK": d_chunk,
                      "N_DC": head_dim // d_chunk, "USE_PDL": pdl}
            sig, attrs = _aot(_decode_merge_kernel, _MERGE_PTRS, consts, dtype)
            out.append({"kernel": _decode_merge_kernel, "signature": sig, "constexprs": consts,
                        "attrs": attrs, "num_warps": 4, "num_stages": 1,
                        "options": {"launch_pdl": True} if pdl else {},
                        "name": f"decode_merge_chunk{chunk}_{dtype}{'_pdl' if pdl else ''}"})
    return out


# ---------------------------------------------------------------------------------------------
# Persistent scratch
@dataclasses.dataclass
class _Scratch:
    lse: torch.Tensor  # fp32 [rows]          rows = B * Hq * max_splits
    part: torch.Tensor  # fp32 [rows * D]
    counters: torch.Tensor  # int32 [B * Hkv], zero between launches

    def fits(self, rows: int, elems: int, slots: int) -> bool:
        return (rows <= self.lse.numel() and elems <= self.part.numel()
                and slots <= self.counters.numel())


_scratch: dict[tuple[str, int | None], _Scratch] = {}
_retired: list[_Scratch] = []  # enlarged-away buffers stay alive: captured graphs may use them
_lock = threading.Lock()


def _dev_key(device: torch.device) -> tuple[str, int | None]:
    if device.type == "cuda" and device.index is None:
        return ("cuda", torch.cuda.current_device())
    return (device.type, device.index)


def _qualified_need() -> tuple[int, int, int]:
    """(rows, elems, slots) of the largest qualified decode shape under ``plan_decode``."""
    rows = elems = slots = 1
    d = QUALIFIED["head_dim"]
    lo, hi = QUALIFIED["batch"]
    for hq, hkv in QUALIFIED["head_pairs"]:
        for b in range(lo, hi + 1):
            for bal in (False, True):
                p = plan_decode(b, hkv, hq // hkv, d, QUALIFIED["max_seqlen_k"], balance=bal)
                r = b * hq * p.max_splits
                rows, elems, slots = max(rows, r), max(elems, r * d), max(slots, b * hkv)
    return rows, elems, slots


def prepare(device: torch.device | str | None = None, *, rows: int = 0, elems: int = 0,
            slots: int = 0) -> None:
    """Create (or enlarge) the persistent split-KV scratch of ``device`` now.

    Sized for the largest qualified decode shape (B = 128, (24,2)/(12,1)/(6,1), D = 256,
    max_seqlen_k = 2055 under ``interop.plan.plan_decode``: a few MB) or for the given
    minimums (``rows`` LSE entries, ``elems`` partial-output floats, ``slots`` counters),
    whichever is larger. Call it before capturing a CUDA graph that contains ``sparse_decode`` if
    no eager call ran first on that device. Idempotent.

    Args:
      device: torch device (default: the current CUDA device, or cpu without CUDA).
    """
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
    device = torch.device(device)
    _get_scratch(device, rows, elems, slots)


def _get_scratch(device: torch.device, rows: int, elems: int, slots: int) -> _Scratch:
    key = _dev_key(device)
    cur = _scratch.get(key)
    if cur is not None and cur.fits(rows, elems, slots):
        return cur
    with _lock:
        cur = _scratch.get(key)
        if cur is not None and cur.fits(rows, elems, slots):
            return cur
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise ContractError(
                "sparse_decode", "q",
                "a shape whose split-KV scratch exists before CUDA-graph capture "
                "(call qsa_triton.decode.prepare(device, rows=..., elems=..., slots=...) or run "
                "the shape eagerly once before capturing)",
                f"needs rows={rows}, elems={elems}, slots={slots}; have "
                + ("none" if cur is None else
                   f"rows={cur.lse.numel()}, elems={cur.part.numel()}, slots={cur.counters.numel()}"))
        qr, qe, qs = _qualified_need()
        if cur is not None:
            qr, qe, qs = max(qr, cur.lse.numel()), max(qe, cur.part.numel()), max(qs, cur.counters.numel())
            _retired.append(cur)
        dev = torch.device(*key) if key[1] is not None else torch.device(key[0])
        new = _Scratch(
            lse=torch.empty(max(rows, qr), dtype=torch.float32, device=dev),
            part=torch.empty(max(elems, qe), dtype=torch.float32, device=dev),
            counters=torch.zeros(max(slots, qs), dtype=torch.int32, device=dev),
        )
        _scratch[key] = new
        return new


def scratch_info(device: torch.device | str) -> dict[str, Any] | None:
    """Sizes of ``device``'s scratch (None if not created) and a copy of its counters (tests)."""
    cur = _scratch.get(_dev_key(torch.device(device)))
    if cur is None:
        return None
    return {"rows": cur.lse.numel(), "elems": cur.part.numel(), "slots": cur.counters.numel(),
            "counters": cur.counters.detach().clone(), "retired": len(_retired)}


# ---------------------------------------------------------------------------------------------
# Launch
def _launch(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_k: int, softmax_scale: float,
            plan: DecodePlan, merge: str, pdl: bool | None = None,
            tma: bool | None = None) -> torch.Tensor:
    check_device("sparse_decode", q.device.type)
    use_pdl = pdl_enabled(q.device, pdl, q.shape[0] * k.shape[1])  # may raise: before any allocation
    # launch_pdl=True is passed only when on: the interpreter / older Triton never see it
    pdl_kw = {"launch_pdl": True} if use_pdl else {}
    use_tma = (_tma_wanted() if tma is None else tma) and tma_usable(q.device, k, v)
    _qk_split(plan, q.shape[2], use_tma)  # may raise: before any allocation
    k_arg, v_arg = k, v
    if use_tma:  # [C, Hkv, D] descriptors, one [BLOCK_N, 1, D] box per block and KV head
        k_arg = TensorDescriptor(k, list(k.shape), list(k.stride()), [plan.block_n, 1, q.shape[2]])
        v_arg = TensorDescriptor(v, list(v.shape), list(v.stride()), [plan.block_n, 1, q.shape[2]])
    b, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    splits = int(plan.max_splits)
    if merge == "auto":  # see MERGE_MODE
        merge = "inline" if 2 * b * hkv >= _sm_count(q.device) else "kernel"
    rows = b * hq * splits if splits > 1 else 1
    sc = _get_scratch(q.device, rows, rows * d, b * hkv)  # may raise: before any allocation
    out = torch.empty((b, hq, d), dtype=q.dtype, device=q.device)
    ctx = torch.cuda.device(q.device) if q.device.type == "cuda" else contextlib.nullcontext()
    with ctx:
        _decode_split_kernel[(b * hkv * splits,)](
            q, k_arg, v_arg, out, sc.lse, sc.part, sc.counters, cu_seqlens_q, cu_seqlens_k,
            float(softmax_scale) * LOG2E,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1),
            hq, hkv, splits, plan.min_blocks_per_split, b, max(plan.balance_slots, 1),
            **split_constexprs(plan, g, d, inline=merge == "inline",
                               lse_all=splits > 1 and merge == "kernel", use_pdl=use_pdl,
                               pdl_late=use_pdl and pdl_late_trigger(b * hkv), use_tma=use_tma),
            num_warps=plan.num_warps, num_stages=plan.num_stages, **pdl_kw,
        )
        if splits > 1 and merge == "kernel":
            chunk = min(max(2, next_pow2(splits)), 128)  # every split in one round trip
            d_chunk = _merge_d_chunk(chunk, d)
            _decode_merge_kernel[(b * hq * (d // d_chunk),)](
                out, sc.lse, sc.part, out.stride(0), out.stride(1), hq, splits,
                D=d, SPLIT_CHUNK=chunk, D_CHUNK=d_chunk, N_DC=d // d_chunk,
                USE_PDL=use_pdl, num_warps=4, num_stages=1, **pdl_kw,
            )
    return out


#: K/V blocks loaded by TMA (Hopper+ tensor descriptors) where ``tma_usable``; decided by the
#: H200 A/B (bench/NOTES.md, decode v4); ``plan_override(tma=...)`` forces it per call.
TMA_AUTO = False


def _tma_wanted() -> bool:
    forced = (getattr(_override, "fields", None) or {}).get("tma")
    return TMA_AUTO if forced is None else forced


def tma_usable(device: torch.device | str, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the split kernel can load K/V through tensor descriptors: Triton has them, the
    device is CUDA of compute capability >= 9.0 (TMA) or Triton's interpreter runs (which
    emulates them), and k/v ([C, Hkv, D], C >= 1, last dim contiguous) meet TMA's alignment
    (16-byte base address and 16-byte strides). Otherwise the pointer path runs: same results.
    Source of the limits: CUDA driver API ``cuTensorMapEncodeTiled`` (and Triton's
    ``TensorDescriptor`` checks)."""
    if TensorDescriptor is None:
        return False
    if k.numel() == 0 or v.numel() == 0:  # a descriptor needs every extent > 0 (C = 0 is legal)
        return False
    device = torch.device(device)
    if device.type == "cuda" and not interpreting():
        if DeviceFacts.from_torch(device).cc < (9, 0):
            return False
    elif not interpreting():
        return False
    return all(t.data_ptr() % 16 == 0 and t.stride(-1) == 1
               and all(st * t.element_size() % 16 == 0 for st in t.stride()[:-1])
               for t in (k, v))


#: floats per merge-kernel tile ([SPLIT_CHUNK, D_CHUNK]), 16 per thread at 4 warps. Smaller tiles
#: (more programs, shorter streams) measured slower on the H200: 1024 / 512 floats gave geomean
#: 2.026x / 1.913x vs 2.085x (run 20, bench/NOTES.md decode v4b).
MERGE_TILE = 2048


def _qk_split(plan: DecodePlan, head_dim: int, use_tma: bool) -> int:
    """QK_SPLIT the split kernel runs: the plan's, where the pointer path runs (not TMA, not
    tail_in_loop) and every slice keeps >= 16 columns (the tensor-core K step); else 1."""
    k = int(plan.qk_split)
    if k not in (1, 2, 4):
        raise ValueError(f"qk_split must be 1, 2 or 4, got {k}")
    if use_tma or plan.tail_in_loop or head_dim // k < 16:
        return 1
    return k


#: the in-launch merge loads at most this many FP32 partial elements per chunk of splits (4
#: splits of [16, 256] = 128 registers per thread at 4 warps; compiled for sm_90 the inline split
#: kernel then uses 201-214 registers, no spills: `qsa compile -v`)
INLINE_TILE_ELEMS = 16384


def inline_tile(head_tile: int, head_dim: int) -> int:
    """INLINE_TILE of the split kernel's in-launch merge: the splits whose LSEs and partials the
    last-arriving split loads per memory round trip (a row with fewer active splits masks the
    rest off: predicated loads, no traffic).

    Args:
      head_tile: the padded G; head_dim: D.
    Returns:
      the largest power of two <= INLINE_TILE_ELEMS / (head_tile x D), at least 1 (4 at [16, 256]).
      Source: decode v6b in bench/NOTES.md (one round trip per chunk instead of two per split)."""
    return max(1, prev_pow2(max(1, INLINE_TILE_ELEMS // (head_tile * head_dim))))


def split_constexprs(plan: DecodePlan, group: int, head_dim: int, *, inline: bool,
                     lse_all: bool, use_pdl: bool, pdl_late: bool, use_tma: bool) -> dict:
    """The constexpr arguments of ``_decode_split_kernel`` for one launch: what ``_launch``
    passes and what ``compile_configs`` compiles (one definition, so the AOT list cannot drift
    from the launch). Raises ValueError for a bad ``plan.qk_split`` (``_qk_split``)."""
    return {"G": group, "D": head_dim, "HT": plan.head_tile, "BLOCK_N": plan.block_n,
            "MERGE_INLINE": inline, "LSE_ALL": lse_all, "USE_PDL": use_pdl,
            "BALANCE": plan.balance_slots > 0, "USE_TMA": use_tma,
            "TAIL_IN_LOOP": plan.tail_in_loop and not use_tma,
            "QK_SPLIT": _qk_split(plan, head_dim, use_tma), "DEFER_L": plan.defer_rowsum,
            "PDL_LATE": pdl_late,
            "INLINE_TILE": inline_tile(plan.head_tile, head_dim) if inline else 1}


def _merge_d_chunk(chunk: int, head_dim: int) -> int:
    """D_CHUNK of the merge kernel for SPLIT_CHUNK = chunk (MERGE_TILE floats, >= 16 columns)."""
    return max(16, min(head_dim, MERGE_TILE // chunk))


def _triton_has_pdl() -> bool:
    """Triton exposes the gdc ops and the ``launch_pdl`` launch option (Triton >= 3.4)."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions  # noqa: PLC0415
        cuda_ext = tl.extra.cuda
    except (ImportError, AttributeError):
        return False
    return (hasattr(cuda_ext, "gdc_wait") and hasattr(cuda_ext, "gdc_launch_dependents")
            and "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {}))


_TRITON_PDL = _triton_has_pdl()


def pdl_supported(device: torch.device | str) -> bool:
    """Whether Programmatic Dependent Launch can be used for ``device``: a CUDA device of
    compute capability >= 9.0, a Triton with gdc ops and ``launch_pdl``, and not Triton's
    interpreter (which has no gdc ops)."""
    device = torch.device(device)
    if device.type != "cuda" or interpreting() or not _TRITON_PDL:
        return False
    return DeviceFacts.from_torch(device).cc >= (9, 0)


def pdl_enabled(device: torch.device | str, pdl: bool | None = None,
                kv_rows: int | None = None) -> bool:
    """Resolve the PDL mode of one call: ``pdl`` (explicit), else ``plan_override(pdl=...)``,
    else the environment variable QSA_DECODE_PDL (auto | on | off, default auto; read on every
    call). auto = ``PDL_AUTO and pdl_supported(device)`` and, when the call's ``kv_rows``
    (B x Hkv) is given, ``kv_rows <= PDL_AUTO_MAX_KV_ROWS`` (entry trigger) or
    ``kv_rows >= PDL_LATE_MIN_KV_ROWS`` (trigger after the K/V loop, ``pdl_late_trigger``).

    Raises:
      ContractError: QSA_DECODE_PDL not one of auto/on/off; PDL requested (on / True) where
        ``pdl_supported`` is False.
    """
    source = "pdl"  # the argument that asked for PDL, named in the error below
    if pdl is None:
        pdl = (getattr(_override, "fields", None) or {}).get("pdl")
        source = "plan_override(pdl=...)"
    if pdl is None:
        source = f"${PDL_ENV}"
        mode = os.environ.get(PDL_ENV, "auto").strip().lower() or "auto"
        if mode not in PDL_MODES:
            raise ContractError("sparse_decode", f"${PDL_ENV}", "one of " + ", ".join(PDL_MODES),
                                repr(os.environ.get(PDL_ENV)))
        if mode == "auto":
            return (PDL_AUTO and (kv_rows is None or kv_rows <= PDL_AUTO_MAX_KV_ROWS
                                  or pdl_late_trigger(kv_rows))
                    and pdl_supported(device))
        pdl = mode == "on"
    if pdl and not pdl_supported(device):
        raise ContractError("sparse_decode", source, "PDL only on a CUDA device of compute "
                            "capability >= 9.0 with a Triton that has launch_pdl, never under "
                            "TRITON_INTERPRET=1 (use off or auto)", f"on for {torch.device(device)}")
    return bool(pdl)


def decode_with_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_k, softmax_scale=None, *,
                     plan: DecodePlan, merge: str = MERGE_MODE,
                     pdl: bool | None = None, tma: bool | None = None) -> torch.Tensor:
    """``sparse_decode`` with an explicit plan (benchmarks, sweeps); checks the contract first.
    ``pdl``: Programmatic Dependent Launch on/off (None: as ``pdl_enabled`` resolves it);
    ``tma``: TMA K/V loads where ``tma_usable`` (None: ``plan_override(tma=)`` / TMA_AUTO).

    Raises:
      ContractError: as ``sparse_decode``; also when ``plan.head_tile`` cannot hold the group,
        and as ``pdl_enabled``.
    """
    prob = check_decode(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_k, softmax_scale)
    if plan.head_tile < max(16, prob.group) or plan.head_tile & (plan.head_tile - 1):
        raise ContractError("decode_with_plan", "plan", "head_tile a power of two >= max(16, G)",
                            plan.head_tile)
    return _launch(q, k, v, cu_seqlens_q, cu_seqlens_k, prob.max_seqlen_k, prob.softmax_scale,
                   plan, merge, pdl, tma)


# ---------------------------------------------------------------------------------------------
# torch.library registration
@torch.library.custom_op("qsa::sparse_decode", mutates_args=())
def _sparse_decode_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                      max_seqlen_k: int, softmax_scale: float) -> torch.Tensor:
    """Registered op: contract already checked by the caller (``sparse_decode``)."""
    if exact_contract(_facts(q.device)):
        # SM121 routes decode to the exact qualified contract only (qsa-contract.md §5: a family
        # gate wider than exact (12, 1) caused silent corruption upstream). Checked here, in the
        # op body, so it also holds under torch.compile; a dict lookup on other devices.
        check_decode(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_k, softmax_scale,
                     strict=True)
    b, hq, d = q.shape
    plan, merge = plan_for(b, k.shape[1], hq // k.shape[1], d, max_seqlen_k, q.device)
    return _launch(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_k, softmax_scale, plan, merge)


@_sparse_decode_op.register_fake
def _sparse_decode_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_k, softmax_scale):
    # shapes/dtypes are checked again at trace time (FakeTensors carry shape/dtype/device/stride)
    check_decode(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_k, softmax_scale)
    return q.new_empty(q.shape)


# ---------------------------------------------------------------------------------------------
# Public entry points
def sparse_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                  cu_seqlens_k: torch.Tensor, max_seqlen_k: int, softmax_scale: float | None = None,
                  *, strict: bool = False) -> torch.Tensor:
    """Packed varlen sparse decode (``qsa-contract.md`` §2): one query row per sequence.

    Args:
      q: [B, Hq, D] bf16|fp16, last dim contiguous. Sequence s reads query row ``cu_seqlens_q[s]``.
      k, v: [C, Hkv, D] in q's dtype: the packed selected keys/values; sequence s owns rows
        ``[cu_seqlens_k[s], cu_seqlens_k[s+1])`` (nothing else is read). Hq = G·Hkv, G <= 16,
        D a power of two in 32..256.
      cu_seqlens_q, cu_seqlens_k: int32 [B + 1] on q's device (never read by the host).
      max_seqlen_k: host int >= 1, static bound of a row's key count: sizes the split-KV grid
        only; a longer row is still computed completely (its splits get longer).
      softmax_scale: host float, default D ** -0.5 (applied to FP32 scores).
      strict: also enforce the qualified envelope (``interop.contract.QUALIFIED``); always on
        for a GPU that ``interop.contract.route`` sends to the exact contract (sm_121).

    Returns:
      [B, Hq, D] in q's dtype: out[s, h] = softmax(scale · q[cu_q[s], h] · Kᵀ) · V over the row's
      keys with KV head h // G; exact zeros for a row with no keys.

    Raises:
      ContractError: before any launch, for a call outside the contract (see ``check_decode``);
        during CUDA-graph capture, for a shape whose scratch was not created before capture.
        Under torch.compile(fullgraph=True) the check runs in the op's fake implementation and
        its text reaches the caller inside Dynamo's TorchRuntimeError (``_checked``).

    Graph/compile safety: no host sync; use inside ``torch.compile(fullgraph=True)`` (custom op
    ``torch.ops.qsa.sparse_decode`` with a fake impl) and CUDA-graph capture (scratch exists after
    one eager call or ``prepare``).
    """
    msk, scale = _checked("sparse_decode", q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_k,
                          softmax_scale, strict=strict)
    return torch.ops.qsa.sparse_decode(q, k, v, cu_seqlens_q, cu_seqlens_k, msk, scale)


def _checked(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_k, softmax_scale, *,
             strict=False, max_seqlen_q=None) -> tuple[int, float]:
    """The public entry points' checks; returns (max_seqlen_k, softmax_scale) for the op.

    Under torch.compile the contract check moves into the op's fake implementation: Dynamo
    cannot raise an exception out of a fullgraph trace (it reports "Unsupported: observed
    exception" and drops the message), while an error raised while running the fake impl reaches
    the user inside Dynamo's TorchRuntimeError with the full ContractError text."""
    if torch.compiler.is_compiling():
        return max_seqlen_k, softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    check_torch_tensors(fn, q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    prob = check_decode(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_k, softmax_scale,
                        strict=strict, **({} if max_seqlen_q is None else
                                          {"max_seqlen_q": max_seqlen_q, "fn": fn}))
    check_interpreter_dtype(fn, prob.dtype)
    check_device(fn, q.device.type)
    return prob.max_seqlen_k, prob.softmax_scale


_FA_FN = "flash_attn_varlen_func"


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           softmax_scale=None, causal=True, *, window_size=(-1, -1),
                           alibi_slopes=None, dropout_p=0.0, softcap=0.0, return_attn_probs=False,
                           deterministic=False, block_table=None, **kwargs):
    """Drop-in for flash-attn's ``flash_attn_varlen_func`` in a QSA decode backend.

    The first seven arguments as flash-attn 2 (q [total_q, Hq, D], k/v [total_k, Hkv, D], int32
    cu_seqlens, host max_seqlen_q/k); then ``softmax_scale, causal`` (issue 3's signature, where
    flash-attn 2 has ``dropout_p`` first): pass them and flash-attn's other options by keyword,
    as SGLang's backends do. Decode only: ``max_seqlen_q`` must be 1, so
    total_q = B and output row s is sequence s. With one query row, bottom-right causal masking
    (flash-attn >= 2.1) keeps every key, so ``causal`` True or False give the same result.
    ``deterministic`` is accepted (this kernel is deterministic).

    Returns:
      [B, Hq, D] in q's dtype (see ``sparse_decode``).

    Raises:
      ContractError: for unsupported features (sliding window, ALiBi, dropout, softcap,
        returning attention probabilities, paged ``block_table``, unknown keyword arguments) and
        for anything ``sparse_decode`` rejects, including ``max_seqlen_q != 1``. Under
        torch.compile the contract check runs in the op's fake impl (see ``_checked``).
    """
    ws = tuple(window_size) if window_size is not None else (-1, -1)
    if ws != (-1, -1):
        raise ContractError(_FA_FN, "window_size", "(-1, -1) (no sliding window)", window_size)
    if alibi_slopes is not None:
        raise ContractError(_FA_FN, "alibi_slopes", "None (no ALiBi)", type(alibi_slopes).__name__)
    if dropout_p != 0.0:
        raise ContractError(_FA_FN, "dropout_p", "0.0 (no dropout)", dropout_p)
    if softcap != 0.0:
        raise ContractError(_FA_FN, "softcap", "0.0 (no logit softcap)", softcap)
    if return_attn_probs:
        raise ContractError(_FA_FN, "return_attn_probs", "False", return_attn_probs)
    if block_table is not None:
        raise ContractError(_FA_FN, "block_table", "None (packed K/V, not a paged cache)",
                            type(block_table).__name__)
    if kwargs:
        raise ContractError(_FA_FN, next(iter(kwargs)), "no such argument in this decode kernel",
                            sorted(kwargs))
    if not isinstance(causal, bool):
        raise ContractError(_FA_FN, "causal", "a bool", type(causal).__name__)
    if torch.compiler.is_compiling() and max_seqlen_q != 1:
        raise ContractError(_FA_FN, "max_seqlen_q", "1 (decode: one query row per sequence)",
                            max_seqlen_q)
    msk, scale = _checked(_FA_FN, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_k,
                          softmax_scale, max_seqlen_q=max_seqlen_q)
    return torch.ops.qsa.sparse_decode(q, k, v, cu_seqlens_q, cu_seqlens_k, msk, scale)
