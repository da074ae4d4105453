"""Packed varlen sparse decode (``qsa-contract.md`` §2, §2c) as Triton kernels for PyTorch.

Public: ``sparse_decode``, ``flash_attn_varlen_func`` (flash-attn 2.8's signature, decode only),
``prepare`` (scratch before CUDA-graph capture), ``plan_for``, ``pdl_enabled``, and the custom
op ``torch.ops.qsa.sparse_decode`` (fake impl for torch.compile). Forward-only.

Algorithm (our own; split-KV with an LSE merge is the standard flash-decoding scheme, the online
softmax FlashAttention-2's):
  * ``_decode_split_kernel``, one program per (split j, sequence s, KV head h), split-major so
    every row's split 0 gets the lowest ids: the G query heads of h as one [head tile, D] tile
    (G padded to a power of two >= 16, masked) stream BLOCK_N chunks of the row's keys
    ``[cu_seqlens_k[s], cu_seqlens_k[s+1])``: Q·Kᵀ on tensor cores, FP32 scores times
    ``softmax_scale·log2(e)``, online softmax with exp2, P·V in the value dtype, FP32
    accumulator; the denominator is kept per column and reduced once after the loop.
  * Split-KV decided on the device (``interop/plan.py``): a static grid of max_splits x B x Hkv;
    each program computes n_active = clamp(cdiv(blocks, min_blocks), 1, max_splits), capped by
    the row's share of ``plan.balance_slots`` programs, and its block range from the shared rule
    ``interop.plan.split_blocks``. No host read of a length: CUDA-graph replay stays correct and
    a row longer than ``max_seqlen_k`` is still covered (its splits get longer).
  * n_active == 1: the program writes the output (exact zeros for an empty row). Otherwise each
    split writes its normalised FP32 partial and log2 LSE to scratch, merged either by
    ``_decode_merge_kernel`` (inactive slots hold LSE -inf: no row metadata needed) or "inline"
    by the last split to arrive (an acq_rel counter per (s, h)); ``plan_for`` picks inline where
    the balance gives a row at most ``_INLINE_MAX_SPLITS`` splits (bench/NOTES.md, "Merge"). A
    split is empty only where l == 0 and the merges propagate a live split's NaN, so an attended
    NaN reaches the output whatever the split count.
  * ``batch_invariant=True``: ``plan_decode(..., batch_invariant=True)`` and always the merge
    kernel with a split tile fixed by D (``_BI_MERGE_SPLIT_CHUNK``).
  * Programmatic Dependent Launch (sm_90+; CUDA C++ Programming Guide, "Programmatic Dependent
    Launch and Synchronization"; PTX ``griddepcontrol``) where ``pdl_enabled``: every program
    runs ``gdc_wait`` before any load or store, so results are bitwise the same as without it
    (bench/NOTES.md, "Programmatic Dependent Launch").
  * Offsets into K/V, q, out and the scratch are 64-bit.

Scratch (LSE, partials, counters): one set per device, sized for the largest qualified shape or
the call; it grows outside capture (old buffers stay alive for captured graphs). Calls on one
device share it, so they must be stream-ordered.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import types
from typing import Any

import torch
import triton
import triton.language as tl

from interop.arch import DeviceFacts
from interop.contract import QUALIFIED, ContractError, check_decode, exact_contract
from interop.plan import (LOG2E, DecodePlan, fit_shared_memory, next_pow2, plan_decode, prev_pow2,
                          split_blocks)

from ._interp_guard import (check_device, check_interpreter_dtype, check_torch_tensors,
                            interpreting, refuse_traced, traced_refusal)

__all__ = ["sparse_decode", "flash_attn_varlen_func", "prepare", "plan_for", "pdl_enabled"]

#: PDL where B x Hkv <= this (trigger at entry: a B = 1 call is one latency chain) or >= the
#: next (trigger after the K/V loop: the dependent grid is scheduled during this grid's tail)
_PDL_ENTRY_MAX_KV_ROWS = 2
_PDL_LATE_MIN_KV_ROWS = 64
#: the last-arriving split merges its row in the launch (no merge kernel) where the balance gives
#: a row at most this many splits: the serial merge tail stays shorter than a second kernel
#: (bench/NOTES.md, "Merge")
_INLINE_MAX_SPLITS = 8
#: floats per merge-kernel tile ([SPLIT_CHUNK, D_CHUNK]), 16 per thread at 4 warps
_MERGE_TILE = 2048
#: the in-launch merge loads at most this many FP32 partial elements per chunk of splits (4 splits
#: of [16, 256] = 128 registers per thread at 4 warps; no spills on sm_90)
_INLINE_TILE_ELEMS = 16384
#: batch-invariant mode: the merge kernel's split tile, whatever max_splits is (9 splits cover the
#: qualified 2055 keys at 256 keys per split), so its reduction tree never depends on the bound
_BI_MERGE_SPLIT_CHUNK = 16


# ---------------------------------------------------------------------------------------------
# Kernels
@triton.jit
def _online_block(q, k_ptrs, v_ptrs, m_i, l_i, acc, n_mask, scale_log2, MASKED: tl.constexpr):
    """One BLOCK_N step of the online softmax for a [HT, D] head tile (FP32 state). l_i is the
    [HT, BLOCK_N] running denominator (reduced once after the loop)."""
    if MASKED:
        kt = tl.load(k_ptrs, mask=n_mask[:, None], other=0.0)
        vt = tl.load(v_ptrs, mask=n_mask[:, None], other=0.0)
    else:
        kt = tl.load(k_ptrs)
        vt = tl.load(v_ptrs)
    s = tl.dot(q, tl.trans(kt)) * scale_log2  # FP32 [HT, BLOCK_N], log2 domain
    if MASKED:
        s = tl.where(n_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)  # 0 on the first block (m_i = -inf, m_new finite)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha[:, None] + p
    acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
    return m_new, l_i, acc


@triton.jit
def _active_splits(cu_k_ptr, s, BLOCK_N, MAX_SPLITS, MIN_BLOCKS, NSEQ, HKV, SLOTS, CAP):
    """(row start, row length, blocks, n_active) of sequence s, from device data only: one split
    per MIN_BLOCKS blocks up to MAX_SPLITS, capped by the row's share of SLOTS programs,
    proportional to its length within the batch's total keys (``interop/plan.py``). Both ends
    are clamped into [0, CAP] (CAP = C, the K/V rows): metadata that lies never leads outside
    K/V, a decreasing cu_seqlens_k is an empty row (qsa-contract.md §2, as the Pallas twin)."""
    k_lo = tl.minimum(tl.maximum(tl.load(cu_k_ptr + s), 0), CAP)
    k_hi = tl.minimum(tl.maximum(tl.load(cu_k_ptr + s + 1), 0), CAP)
    n = tl.maximum(k_hi - k_lo, 0)
    blocks = tl.cdiv(n, BLOCK_N)
    n_act = tl.minimum(tl.maximum(tl.cdiv(blocks, MIN_BLOCKS), 1), MAX_SPLITS)
    total = tl.maximum(tl.load(cu_k_ptr + NSEQ) - tl.load(cu_k_ptr), 1).to(tl.int64)
    share = (n.to(tl.int64) * SLOTS) // (total * HKV)  # int64: n * SLOTS may pass 2^31
    n_act = tl.minimum(n_act, tl.maximum(share, 1).to(tl.int32))
    return k_lo, n, blocks, n_act


# The split rule both decode twins use (interop.plan.split_blocks), jitted with this module's
# globals: Triton needs triton.language visible from a jit function, the core cannot import it.
_split_blocks = triton.jit(types.FunctionType(split_blocks.__code__, globals(), "split_blocks"))


# Shape ints stay runtime values and are not specialised (Triton would otherwise compile a
# variant for every value == 1 / multiple of 16): one kernel serves every B and split count.
@triton.jit(do_not_specialize=["HQ", "HKV", "MAX_SPLITS", "MIN_BLOCKS", "NSEQ", "SLOTS", "CAP"])
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, part_ptr, cnt_ptr, cu_q_ptr, cu_k_ptr,
    scale_log2,
    stride_qb, stride_qh, stride_kc, stride_kh, stride_vc, stride_vh, stride_ob, stride_oh,
    HQ, HKV, MAX_SPLITS, MIN_BLOCKS, NSEQ, SLOTS, CAP,
    G: tl.constexpr, D: tl.constexpr, HT: tl.constexpr, BLOCK_N: tl.constexpr,
    MERGE_INLINE: tl.constexpr, LSE_ALL: tl.constexpr, USE_PDL: tl.constexpr,
    PDL_LATE: tl.constexpr, INLINE_TILE: tl.constexpr,
):
    if USE_PDL:
        # This grid may start before the previous kernel on the stream has finished, so wait for
        # it (griddepcontrol.wait: all prerequisite grids completed, their memory visible) before
        # touching anything: q/k/v/cu_seqlens may come from it, and a previous merge kernel may
        # still read the scratch we are about to overwrite. Every program waits (inactive ones
        # store -inf LSEs too). Entry trigger: the merge grid may be scheduled while we run; it
        # sits in its own gdc_wait until this grid has completed, so triggering early is safe
        # (all our programs are resident by the time the trigger fires: no deadlock). Late
        # trigger: after the K/V loop (below).
        if not PDL_LATE:
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    pid = tl.program_id(0)
    # split-major order: every row's split 0 (active whenever the row is non-empty) gets the
    # lowest program ids, the splits that exit at once the highest (the block scheduler then
    # spreads the working programs over the SMs; bench/NOTES.md, "Decode, Triton", "Structure")
    n_sh = NSEQ * HKV
    j = pid // n_sh
    sh = pid % n_sh
    s = sh // HKV
    h = sh % HKV
    # the query row's index is loaded with cu_seqlens_k, before the split bookkeeping and its
    # early exit, so the q load can issue with the first K/V loads (at B = 1 a split streams
    # one or two blocks: its chain of dependent loads is its time)
    # a lying cu_seqlens_q[s] reads a row of q, clamped into [0, B) (qsa_pallas's rule)
    q_row = tl.minimum(tl.maximum(tl.load(cu_q_ptr + s), 0), NSEQ - 1).to(tl.int64)
    k_lo, n, blocks, n_act = _active_splits(cu_k_ptr, s, BLOCK_N, MAX_SPLITS, MIN_BLOCKS, NSEQ,
                                            HKV, SLOTS, CAP)
    offs_m = tl.arange(0, HT)
    m_ok = offs_m < G
    heads = h * G + offs_m  # global query head of each tile row
    part_row = (s.to(tl.int64) * HQ + heads) * MAX_SPLITS + j  # [HT] int64 scratch row
    if j >= n_act:
        if LSE_ALL:  # tell the merge kernel this split is empty (it never reads cu_seqlens_k)
            tl.store(lse_ptr + part_row, tl.full([HT], float("-inf"), tl.float32), mask=m_ok)
        return
    # int64: blocks x j may pass 2^31
    blk_lo, blk_hi = _split_blocks(blocks.to(tl.int64), j, n_act)
    start = (blk_lo * BLOCK_N).to(tl.int32)  # <= n: fits int32
    stop = tl.minimum(blk_hi * BLOCK_N, n).to(tl.int32)
    full_stop = start + ((stop - start) // BLOCK_N) * BLOCK_N

    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    q_rows = q_ptr + q_row * stride_qb + heads.to(tl.int64)[:, None] * stride_qh
    q = tl.load(q_rows + offs_d[None, :], mask=m_ok[:, None], other=0.0)

    m_i = tl.full([HT], float("-inf"), tl.float32)
    l_i = tl.zeros([HT, BLOCK_N], tl.float32)
    acc = tl.zeros([HT, D], tl.float32)
    row0 = k_lo.to(tl.int64) + start  # 64-bit row index into the packed K/V
    k_ptrs = (k_ptr + h.to(tl.int64) * stride_kh + (row0 + offs_n)[:, None] * stride_kc
              + offs_d[None, :])
    v_ptrs = (v_ptr + h.to(tl.int64) * stride_vh + (row0 + offs_n)[:, None] * stride_vc
              + offs_d[None, :])
    # interior blocks: no masks, so the loads vectorise and pipeline
    for _ in range(start, full_stop, BLOCK_N):
        m_i, l_i, acc = _online_block(q, k_ptrs, v_ptrs, m_i, l_i, acc, offs_n < BLOCK_N,
                                      scale_log2, False)
        k_ptrs += BLOCK_N * stride_kc
        v_ptrs += BLOCK_N * stride_vc
    if full_stop < stop:  # the row's last, partial block (only in the last split)
        m_i, l_i, acc = _online_block(q, k_ptrs, v_ptrs, m_i, l_i, acc,
                                      (full_stop + offs_n) < stop, scale_log2, True)
    l_i = tl.sum(l_i, 1)

    if USE_PDL and PDL_LATE:
        tl.extra.cuda.gdc_launch_dependents()  # (programs that exit early count as triggered)
    o_rows = s.to(tl.int64) * stride_ob + heads.to(tl.int64) * stride_oh
    if n_act == 1:
        # whole row in this program; an empty row has acc = 0, l = 0 -> exact zeros (a NaN l,
        # from an attended NaN, stays NaN)
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + o_rows[:, None] + offs_d[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=m_ok[:, None])
        if LSE_ALL:  # "no partials here": the merge kernel leaves this row alone
            tl.store(lse_ptr + part_row, tl.full([HT], float("-inf"), tl.float32), mask=m_ok)
    else:
        # non-empty split (n_act <= blocks): l_i > 0 for the real heads, or NaN where an attended
        # key is NaN: then the LSE is NaN too (live for the merge, never the -inf of "empty")
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
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
                # them), so they issue together, one memory round trip per chunk. Chunks after
                # the first rescale the running sum online, as the split loop does.
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
    # together (one memory round trip; SPLIT_CHUNK covers every split of a shipped plan, <= 128;
    # more are read in further chunks) and masks by weight with tl.where, so stale partials are
    # never used.
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
    # live split: LSE != -inf (finite, or NaN from an attended NaN key); tl.max ignores NaN, so
    # "the row has partials" is counted, not read off the max
    live = lse != float("-inf")
    n_live = tl.sum(live.to(tl.int32), 0)
    mx = tl.max(lse, 0)
    for c in range(SPLIT_CHUNK, MAX_SPLITS, SPLIT_CHUNK):  # only for > SPLIT_CHUNK splits
        lc = tl.load(lse_ptr + base + c + offs_j, mask=(c + offs_j) < MAX_SPLITS,
                     other=float("-inf"))
        mx = tl.maximum(mx, tl.max(lc, 0))
        n_live += tl.sum((lc != float("-inf")).to(tl.int32), 0)
    if n_live > 0:  # the row has partials (n_active > 1)
        mx = tl.where(mx == float("-inf"), 0.0, mx)  # (every live LSE NaN: the weights are NaN)
        w = tl.exp2(lse - mx)  # empty splits: exp2(-inf) = 0
        wsum = tl.sum(w, 0)
        o = tl.sum(tl.where(w[:, None] > 0.0, w[:, None] * part, 0.0), 0)
        # an attended NaN reaches the output (qsa-contract.md: as the reference), also from a
        # split whose weight underflowed to 0; a select, so finite results keep their bits
        nan = tl.max((live[:, None] & (part != part)).to(tl.int32), 0)
        for c in range(SPLIT_CHUNK, MAX_SPLITS, SPLIT_CHUNK):
            cm = (c + offs_j) < MAX_SPLITS
            lc = tl.load(lse_ptr + base + c + offs_j, mask=cm, other=float("-inf"))
            wc = tl.exp2(lc - mx)
            pc = tl.load(part_ptr + (base + c + offs_j)[:, None] * D + offs_d[None, :],
                         mask=cm[:, None], other=0.0)
            wsum += tl.sum(wc, 0)
            o += tl.sum(tl.where(wc[:, None] > 0.0, wc[:, None] * pc, 0.0), 0)
            nan = tl.maximum(nan, tl.max(((lc != float("-inf"))[:, None] & (pc != pc))
                                         .to(tl.int32), 0))
        o = tl.where(nan > 0, float("nan"), o / wsum)  # a NaN LSE makes wsum NaN
        tl.store(out_ptr + s.to(tl.int64) * stride_ob + hq.to(tl.int64) * stride_oh + offs_d,
                 o.to(out_ptr.dtype.element_ty))


# ---------------------------------------------------------------------------------------------
# Plan (static geometry), device facts and the PDL policy
def _facts(device: torch.device) -> DeviceFacts | None:
    """The device's facts (``interop.arch``); None on CPU (plans sized for the H200's 132 SMs)."""
    return DeviceFacts.from_torch(device) if device.type == "cuda" else None


_PLANS: dict[tuple, tuple[DecodePlan, str]] = {}  # host-side cache: plan_for runs on every call


def plan_for(batch: int, num_kv_heads: int, group: int, head_dim: int, max_seqlen_k: int,
             device: torch.device | str | None = None, *,
             batch_invariant: bool = False) -> tuple[DecodePlan, str]:
    """The (``interop.plan.DecodePlan``, merge mode) a ``sparse_decode`` call with these static
    shapes (B, Hkv, G, D, host max_seqlen_k) uses on ``device`` (None: the current CUDA device,
    or the CPU, whose plans are sized for the H200's 132 SMs), cached per shape and device.

    Default: ``plan_decode`` with the device-side balance and one-block splits for the device's
    SM count, fitted to its shared memory; merge "inline" where the balance gives a row at most
    ``_INLINE_MAX_SPLITS`` splits (balance slots // (B x Hkv) <= 8: B x Hkv >= 32 on 132 SMs),
    else "kernel". batch_invariant: ``plan_decode(..., batch_invariant=True)`` and "kernel-fixed"
    (the merge kernel with a ``_BI_MERGE_SPLIT_CHUNK`` split tile), the same on every device.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    key = (batch, num_kv_heads, group, head_dim, max_seqlen_k, device.type, device.index,
           bool(batch_invariant))
    hit = _PLANS.get(key)
    if hit is not None:
        return hit
    if batch_invariant:
        hit = (plan_decode(batch, num_kv_heads, group, head_dim, max_seqlen_k,
                           batch_invariant=True), "kernel-fixed")
    else:
        facts = _facts(device)
        sms = 132 if facts is None else facts.sm_count
        plan = plan_decode(batch, num_kv_heads, group, head_dim, max_seqlen_k, sms, balance=True,
                           one_block_splits=True)
        plan = fit_shared_memory(plan, head_dim=head_dim, limit=facts and facts.smem_per_block)
        share = plan.balance_slots // max(1, batch * num_kv_heads)
        hit = (plan, "inline" if share <= _INLINE_MAX_SPLITS else "kernel")
    if len(_PLANS) < 4096:
        _PLANS[key] = hit
    return hit


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


def _pdl_supported(device: torch.device) -> bool:
    """CUDA cc >= 9.0, a Triton with gdc ops and ``launch_pdl``, not the interpreter."""
    if device.type != "cuda" or interpreting() or not _TRITON_PDL:
        return False
    return DeviceFacts.from_torch(device).cc >= (9, 0)


def _pdl_late_trigger(kv_rows: int) -> bool:
    """The split kernel triggers its dependents after the K/V loop (True) or at entry."""
    return kv_rows >= _PDL_LATE_MIN_KV_ROWS


def pdl_enabled(device: torch.device | str, kv_rows: int) -> bool:
    """Whether a decode call on ``device`` with ``kv_rows`` = B x Hkv uses Programmatic Dependent
    Launch: where supported (sm_90+, Triton >= 3.4, not the interpreter) and B x Hkv <= 2 or
    >= 64. Results are bitwise the same either way (module docstring)."""
    return ((kv_rows <= _PDL_ENTRY_MAX_KV_ROWS or _pdl_late_trigger(kv_rows))
            and _pdl_supported(torch.device(device)))


def _inline_tile(head_tile: int, head_dim: int) -> int:
    """Splits the in-launch merge loads per round trip: the largest power of two
    <= _INLINE_TILE_ELEMS / (head_tile x D), at least 1."""
    return max(1, prev_pow2(max(1, _INLINE_TILE_ELEMS // (head_tile * head_dim))))


def _split_constexprs(plan: DecodePlan, group: int, head_dim: int, *, inline: bool,
                      lse_all: bool, use_pdl: bool, pdl_late: bool) -> dict:
    """``_decode_split_kernel``'s constexprs for one launch (also the AOT compile list's)."""
    return {"G": group, "D": head_dim, "HT": plan.head_tile, "BLOCK_N": plan.block_n,
            "MERGE_INLINE": inline, "LSE_ALL": lse_all, "USE_PDL": use_pdl, "PDL_LATE": pdl_late,
            "INLINE_TILE": _inline_tile(plan.head_tile, head_dim) if inline else 1}


def _merge_chunks(splits: int, head_dim: int, fixed: bool = False) -> tuple[int, int]:
    """(SPLIT_CHUNK, D_CHUNK) of the merge kernel: every split (<= 128) in one round trip, or
    (``fixed``, batch-invariant) ``_BI_MERGE_SPLIT_CHUNK``; _MERGE_TILE floats, >= 16 columns."""
    chunk = _BI_MERGE_SPLIT_CHUNK if fixed else min(max(2, next_pow2(splits)), 128)
    return chunk, max(16, min(head_dim, _MERGE_TILE // chunk))


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

    def sizes(self) -> str:
        return f"rows={self.lse.numel()}, elems={self.part.numel()}, slots={self.counters.numel()}"


_scratch: dict[tuple[str, int | None], _Scratch] = {}
_retired: list[_Scratch] = []  # enlarged-away buffers stay alive: captured graphs may use them
_lock = threading.Lock()


def _dev_key(device: torch.device) -> tuple[str, int | None]:
    if device.type == "cuda" and device.index is None:
        return ("cuda", torch.cuda.current_device())
    return (device.type, device.index)


def _qualified_need() -> tuple[int, int, int]:
    """(rows, elems, slots) of the largest qualified shape under both shipped plans."""
    rows = elems = slots = 1
    d = QUALIFIED["head_dim"]
    lo, hi = QUALIFIED["batch"]
    msk = QUALIFIED["max_seqlen_k"]
    for hq, hkv in QUALIFIED["head_pairs"]:
        for b in range(lo, hi + 1):
            for p in (plan_decode(b, hkv, hq // hkv, d, msk, balance=True, one_block_splits=True),
                      plan_decode(b, hkv, hq // hkv, d, msk, batch_invariant=True)):
                r = b * hq * p.max_splits
                rows, elems, slots = max(rows, r), max(elems, r * d), max(slots, b * hkv)
    return rows, elems, slots


def prepare(device: torch.device | str | None = None, *, rows: int = 0, elems: int = 0,
            slots: int = 0) -> None:
    """Create (or enlarge) ``device``'s split-KV scratch now; call it before capturing a CUDA
    graph that contains ``sparse_decode`` if no eager call ran first on that device. Idempotent.

    Args:
      device: torch device (default: the current CUDA device, or cpu without CUDA).
      rows, elems, slots: minimum LSE entries (B x Hq x max_splits), FP32 partial elements
        (rows x D) and int32 counters (B x Hkv); the largest qualified shape (a few MB) at least.

    Raises:
      ContractError: while a CUDA graph is being captured and the scratch must grow.
    """
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
    _get_scratch(torch.device(device), rows, elems, slots)


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
                + ("none" if cur is None else cur.sizes()))
        qr, qe, qs = _qualified_need()
        if cur is not None:
            qr, qe = max(qr, cur.lse.numel()), max(qe, cur.part.numel())
            qs = max(qs, cur.counters.numel())
            _retired.append(cur)
        dev = torch.device(*key) if key[1] is not None else torch.device(key[0])
        new = _Scratch(
            lse=torch.empty(max(rows, qr), dtype=torch.float32, device=dev),
            part=torch.empty(max(elems, qe), dtype=torch.float32, device=dev),
            counters=torch.zeros(max(slots, qs), dtype=torch.int32, device=dev),
        )
        _scratch[key] = new
        return new


def _scratch_info(device: torch.device | str) -> dict[str, Any] | None:
    """Sizes of ``device``'s scratch (None if not created) and a copy of its counters (tests)."""
    cur = _scratch.get(_dev_key(torch.device(device)))
    if cur is None:
        return None
    return {"rows": cur.lse.numel(), "elems": cur.part.numel(), "slots": cur.counters.numel(),
            "counters": cur.counters.detach().clone(), "retired": len(_retired)}


# ---------------------------------------------------------------------------------------------
# Launch
_NO_BALANCE = 1 << 30  # SLOTS for a plan without the device-side balance: the share never binds


def _launch(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_k: int, softmax_scale: float,
            plan: DecodePlan, merge: str, pdl: bool | None = None) -> torch.Tensor:
    # merge: "inline" | "kernel" | "kernel-fixed" (the merge kernel, batch-invariant tile)
    b, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    use_pdl = pdl_enabled(q.device, b * hkv) if pdl is None else pdl
    # launch_pdl=True is passed only when on: the interpreter / older Triton never see it
    pdl_kw = {"launch_pdl": True} if use_pdl else {}
    splits = int(plan.max_splits)
    rows = b * hq * splits if splits > 1 else 1
    sc = _get_scratch(q.device, rows, rows * d, b * hkv)  # may raise: before any allocation
    out = torch.empty((b, hq, d), dtype=q.dtype, device=q.device)
    ctx = torch.cuda.device(q.device) if q.device.type == "cuda" else contextlib.nullcontext()
    with ctx:
        _decode_split_kernel[(b * hkv * splits,)](
            q, k, v, out, sc.lse, sc.part, sc.counters, cu_seqlens_q, cu_seqlens_k,
            float(softmax_scale) * LOG2E,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1),
            hq, hkv, splits, plan.min_blocks_per_split, b, plan.balance_slots or _NO_BALANCE,
            k.shape[0],
            **_split_constexprs(plan, g, d, inline=merge == "inline",
                                lse_all=splits > 1 and merge != "inline", use_pdl=use_pdl,
                                pdl_late=use_pdl and _pdl_late_trigger(b * hkv)),
            num_warps=plan.num_warps, num_stages=plan.num_stages, **pdl_kw,
        )
        if splits > 1 and merge != "inline":
            chunk, d_chunk = _merge_chunks(splits, d, fixed=merge == "kernel-fixed")
            _decode_merge_kernel[(b * hq * (d // d_chunk),)](
                out, sc.lse, sc.part, out.stride(0), out.stride(1), hq, splits,
                D=d, SPLIT_CHUNK=chunk, D_CHUNK=d_chunk, N_DC=d // d_chunk,
                USE_PDL=use_pdl, num_warps=4, num_stages=1, **pdl_kw,
            )
    return out


def _decode_with_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_k, softmax_scale=None, *,
                      plan: DecodePlan, merge: str | None = None,
                      pdl: bool | None = None) -> torch.Tensor:
    """``sparse_decode`` (contract checked) with a forced plan, merge ("kernel" | "inline" |
    "kernel-fixed"; None: ``plan_for``'s) and PDL (None: ``pdl_enabled``), for tests.

    Raises:
      ContractError: as ``sparse_decode``; a head tile that cannot hold G; PDL forced on where
        unsupported. ValueError: an unknown merge mode.
    """
    prob = check_decode(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_k, softmax_scale)
    check_device("sparse_decode", q.device.type)
    if plan.head_tile < max(16, prob.group) or plan.head_tile & (plan.head_tile - 1):
        raise ContractError("sparse_decode", "plan", "head_tile a power of two >= max(16, G)",
                            plan.head_tile)
    if pdl and not _pdl_supported(q.device):
        raise ContractError("sparse_decode", "pdl", "PDL only on a CUDA device of compute "
                            "capability >= 9.0 with a Triton that has launch_pdl, never under "
                            "the interpreter", f"on for {q.device}")
    if merge is None:
        merge = plan_for(prob.batch, prob.num_kv_heads, prob.group, prob.head_dim,
                         prob.max_seqlen_k, q.device)[1]
    if merge not in ("kernel", "inline", "kernel-fixed"):
        raise ValueError(f"merge must be 'kernel', 'inline' or 'kernel-fixed', got {merge!r}")
    return _launch(q, k, v, cu_seqlens_q, cu_seqlens_k, prob.max_seqlen_k, prob.softmax_scale,
                   plan, merge, pdl)


# ---------------------------------------------------------------------------------------------
# torch.library registration
@torch.library.custom_op("qsa::sparse_decode", mutates_args=())
def _sparse_decode_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                      max_seqlen_k: int, softmax_scale: float,
                      batch_invariant: bool = False, strict: bool = False) -> torch.Tensor:
    """Registered op: contract already checked by the caller (``sparse_decode``); ``strict``
    reaches the fake impl, where the check runs under torch.compile."""
    if exact_contract(_facts(q.device)):
        # sm_121 gets the exact qualified contract only (qsa-contract.md §5); checked in the op
        # body so that it also holds under torch.compile
        check_decode(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_k, softmax_scale,
                     batch_invariant=batch_invariant, strict=True)
    b, hq, d = q.shape
    plan, merge = plan_for(b, k.shape[1], hq // k.shape[1], d, max_seqlen_k, q.device,
                           batch_invariant=batch_invariant)
    return _launch(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_k, softmax_scale, plan, merge)


@_sparse_decode_op.register_fake
def _sparse_decode_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_k, softmax_scale,
                        batch_invariant=False, strict=False):
    # shapes/dtypes are checked again at trace time (FakeTensors carry shape/dtype/device/stride)
    prob = check_decode(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_k, softmax_scale,
                        batch_invariant=batch_invariant, strict=strict)
    check_interpreter_dtype("sparse_decode", prob.dtype)
    return q.new_empty(q.shape)


# ---------------------------------------------------------------------------------------------
# Public entry points
def sparse_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                  cu_seqlens_k: torch.Tensor, max_seqlen_k: int, softmax_scale: float | None = None,
                  *, strict: bool = False, batch_invariant: bool = False) -> torch.Tensor:
    """Packed varlen sparse decode (``qsa-contract.md`` §2): one query row per sequence.

    Args:
      q: [B, Hq, D] bf16|fp16, last dim contiguous. Sequence s reads query row ``cu_seqlens_q[s]``.
      k, v: [C, Hkv, D] in q's dtype: the packed selected keys/values; sequence s owns rows
        ``[cu_seqlens_k[s], cu_seqlens_k[s+1])`` (nothing else is read). Hq = G·Hkv, G <= 16,
        D a power of two in 32..256.
      cu_seqlens_q, cu_seqlens_k: int32 [B + 1] on q's device (never read by the host).
      max_seqlen_k: host int >= 1, static bound of a row's key count: sizes the split-KV grid
        only; a longer row is still computed completely.
      softmax_scale: host float, default D ** -0.5 (applied to FP32 scores).
      strict: also enforce the qualified envelope (``interop.contract.QUALIFIED``); always on
        for a GPU that ``interop.contract.route`` sends to the exact contract (sm_121).
      batch_invariant: host bool. True: a row's output bits depend only on its own q row, keys,
        length and scale, not on B, the other rows, its place, ``max_seqlen_k`` (any valid
        bound: >= the row's length) or the SM count (§2c); costs fewer programs at small B, a
        merge launch at large B.

    Returns:
      [B, Hq, D] in q's dtype: out[s, h] = softmax(scale · q[cu_q[s], h] · Kᵀ) · V over the row's
      keys with KV head h // G; exact zeros for a row with no keys; an attended NaN gives NaN
      for the KV head's query heads (as ``interop.reference``).

    Raises:
      ContractError: before any launch: ``check_decode`` (also ``requires_grad``), a CPU
        tensor without Triton's interpreter, bf16 under the unpatched interpreter (under
        torch.compile from the op's fake impl); in CUDA-graph capture, a scratch shortfall.

    No host sync: safe in ``torch.compile(fullgraph=True)`` and CUDA-graph capture (after one
    eager call or ``prepare``). Source: flash-decoding split-KV with an LSE merge,
    FlashAttention-2's online softmax; plan and split rule in ``interop.plan`` (this module's
    docstring).
    """
    if torch.compiler.is_compiling():
        refused = traced_refusal(q, "sparse_decode", dict(q=q, k=k, v=v),
                                 max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale)
        if refused is not None:
            return refused
    msk, scale = _checked("sparse_decode", q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_k,
                          softmax_scale, strict=strict, batch_invariant=batch_invariant)
    return torch.ops.qsa.sparse_decode(q, k, v, cu_seqlens_q, cu_seqlens_k, msk, scale,
                                       bool(batch_invariant), bool(strict))


def _checked(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_k, softmax_scale, *,
             strict=False, max_seqlen_q=None, batch_invariant=False) -> tuple[int, float]:
    """The public entry points' checks; returns (max_seqlen_k, softmax_scale) for the op. Under
    torch.compile they move into the op's fake impl: Dynamo drops an exception's message out of a
    fullgraph trace, while one raised in the fake impl reaches the user in full."""
    if torch.compiler.is_compiling():
        return max_seqlen_k, softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    check_torch_tensors(fn, q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    prob = check_decode(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_k, softmax_scale,
                        strict=strict, batch_invariant=batch_invariant,
                        **({} if max_seqlen_q is None else
                           {"max_seqlen_q": max_seqlen_q, "fn": fn}))
    check_interpreter_dtype(fn, prob.dtype)
    check_device(fn, q.device.type)
    return prob.max_seqlen_k, prob.softmax_scale


_FA_FN = "flash_attn_varlen_func"


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None):
    """Drop-in for flash-attn 2.8's ``flash_attn_varlen_func`` (its positional order and
    defaults, ``flash_attn/flash_attn_interface.py``) in a QSA decode backend: computes
    ``sparse_decode`` (shapes, dtypes, result there). Decode only: ``max_seqlen_q`` must be 1,
    so total_q = B. With one query row bottom-right causal masking keeps every key, so
    ``causal`` does not change the result; ``deterministic`` is accepted (the forward kernels
    are run-to-run deterministic); it does not switch on batch invariance, which is
    ``sparse_decode(..., batch_invariant=True)``.

    Raises:
      ContractError: ``dropout_p`` != 0, a sliding window, softcap, ALiBi, returning attention
        probabilities, a paged ``block_table``, a non-bool ``causal``, ``max_seqlen_q != 1``,
        and anything ``sparse_decode`` rejects.
    """
    if torch.compiler.is_compiling():
        refused = traced_refusal(q, _FA_FN, dict(q=q, k=k, v=v), max_seqlen_q=max_seqlen_q,
                                 max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale)
        if refused is not None:
            return refused
    ws = tuple(window_size) if window_size is not None else (-1, -1)
    refusals = (  # (refused?, argument, expected, got), in flash-attn's argument order
        (isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or dropout_p != 0,
         "dropout_p", "0.0 (no dropout: forward inference only)", dropout_p),
        # (-1, 0) is flash-attn's causal window: a decode row has no later key to leave out
        (ws not in ((-1, -1), (-1, 0)), "window_size",
         "(-1, -1) or (-1, 0) (no sliding window)", window_size),
        (softcap != 0.0, "softcap", "0.0 (no logit softcap)", softcap),
        (alibi_slopes is not None, "alibi_slopes", "None (no ALiBi)",
         type(alibi_slopes).__name__),
        (bool(return_attn_probs), "return_attn_probs", "False", return_attn_probs),
        (block_table is not None, "block_table", "None (packed K/V, not a paged cache)",
         type(block_table).__name__),
        (not isinstance(causal, bool), "causal", "a bool", type(causal).__name__),
        (torch.compiler.is_compiling() and max_seqlen_q != 1, "max_seqlen_q",
         "1 (decode: one query row per sequence)", max_seqlen_q))
    for refused, arg, expected, got in refusals:
        if not refused:
            continue
        if torch.compiler.is_compiling():  # Dynamo cannot raise it here: the op's fake impl does
            return refuse_traced(q, _FA_FN, arg, expected, got)
        raise ContractError(_FA_FN, arg, expected, got)
    msk, scale = _checked(_FA_FN, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_k,
                          softmax_scale, max_seqlen_q=max_seqlen_q)
    return torch.ops.qsa.sparse_decode(q, k, v, cu_seqlens_q, cu_seqlens_k, msk, scale)
