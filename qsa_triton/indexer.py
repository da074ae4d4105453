"""The QSA indexer for PyTorch: block scoring, exact top-k and expansion as Triton kernels.

Semantics: ``qsa-contract.md`` §4b (scoring ``sum_h ReLU(q[m, h] . k[n])``, top-k rule) and §4
(expansion); FP64 references ``interop.reference.indexer_*``; plan ``interop.indices.
plan_indexer`` (shared with ``qsa_pallas.indexer``, the same algorithm). Two passes; no
[rows, blocks] logits tensor is ever written:

* Pass 1, one program per (row tile, chunk of C blocks): score the chunk in BLOCK_N-block tiles
  (the key tile as the M side of a ``tl.dot`` with the row's heads, FP32, ReLU, head sum), hold
  the scores as int32 *keys* (a float >= +0.0's bits order like the float; -0.0 and NaN become
  +0.0, invisible blocks -1) and select the chunk's exact top-k per row: a threshold tau by a
  radix search from bit 30 down, ``radix_bits`` bits a round (all digit counts of a round in one
  compare-and-sum), stopping early where a round's threshold counts exactly k keys (the keys >=
  it are the top k; else tau ends at the k-th largest key), then one prefix sum over (key > tau)
  + (key == tau) * 2^16 gives every tie's rank (the smallest block ids win) and every
  survivor's slot in block order.
* Pass 2, one program per row: the same selection over the row's S x k candidates (slot order
  is block order, so the tie rule carries over; decode: the radix rounds start below the bits
  shared by the row's largest candidate and the largest k-th key of one of its chunks, a lower
  bound of its k-th key: a chunk holding k candidates holds its own as its smallest), then the
  ascending block ids or, fused, the 2051-wide token row (``4g .. 4g + 3`` per block, the 0-3
  token causal tail, -1 after).
* Prefill with ``IndexerPlan.bound_chunk``: a bound pass first takes the k-th key of each row's
  first ``bound_chunk`` blocks (less ``BOUND_MARGIN_ULPS``: the passes sum in other orders). The
  k-th key over a subset never exceeds the k-th over all blocks, so every top-k block has a key
  >= that bound: pass 1 keeps a chunk's keys >= it without radix rounds wherever at most k pass,
  and the merge (``merge_from_bound``) takes the key bits the bound and the row's largest
  candidate share as known and searches only the bits below them.
* Prefill with ``IndexerPlan.merge_capacity`` (and the bound): pass 1 holds no key tile. Each
  scored tile's keys >= the bound go straight to the row's next slots of the chunk (a prefix
  sum per tile; the first k of them) and the chunk's count of them to a counts array; a fixup
  pass then redoes, as above, only the row tiles with a chunk counted past k (returning at once
  elsewhere). The merge moves a row's counted candidates to the front of its workspace (stable,
  in place, a CTA barrier between a group's loads and its stores) and selects from a tile of
  ``merge_capacity``; a row with more first finds its exact k-th key by radix rounds over the
  chunks in global memory and keeps only its top-k. Where the bound passes few keys (iid scores:
  about topk / ``bound_chunk`` of them), most of pass 1's and the merge's work is gone.

The selection is a radix select (Alabi et al., "Fast k-Selection Algorithms for Graphics
Processing Units", JEA 2012; upstream's ``fast_topk`` selects by radix digits too), exact, no
sort, on the unscaled FP32 sum: ties go to the smaller block id whatever the plan or the batch.
Graph safe: no host read of device data, a static plan, a per-call workspace, no atomics;
registered as ``torch.ops.qsa.indexer_*`` custom ops with fake impls.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from interop.arch import DeviceFacts
from interop.contract import (check_expand_block_indices, check_indexer_decode, check_indexer_plan,
                              check_indexer_prefill)
from interop.indices import BOUND_MARGIN_ULPS, INDEXER_API, IndexerPlan, plan_indexer
from interop.plan import next_pow2 as _next_pow2

from ._interp_guard import check_device, check_interpreter_dtype, check_torch_tensors
from .decode import _pdl_supported

__all__ = list(INDEXER_API)

_INT32_MAX = tl.constexpr(2**31 - 1)  # a constexpr global: usable inside @triton.jit
_BOUND_MARGIN = tl.constexpr(BOUND_MARGIN_ULPS)  # interop.indices.BOUND_MARGIN_ULPS
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


# ---------------------------------------------------------------------------------------------
# Shared device functions: the exact top-K of int32 keys (>= 0 visible, -1 not)
@triton.jit
def _kth_key(keys, K: tl.constexpr, RB: tl.constexpr, NJ: tl.constexpr):
    """tau [R] for ``keys`` [R, N] with #(key > tau) < K <= #(key >= tau), or #(key >= tau)
    == K: the K-th largest key of each row, or the threshold at which its search stopped early
    (module docstring); 0 for a row with fewer than K visible keys.

    Radix search from bit 30 down, RB bits a round (the first round takes the 31 mod RB leftover
    bits): a round counts #(key >= tau + j * 2^lo) for every digit j = 1 .. 2^RB - 1 at once (NJ
    = the digits rounded up to a power of two, the spare thresholds INT32_MAX count nothing) and
    adds the largest digit whose count is >= K. RB = 1 is one [R, N] compare-and-sum a round.
    """
    ROUNDS: tl.constexpr = (31 + RB - 1) // RB
    W0: tl.constexpr = 31 - RB * (ROUNDS - 1)
    tau = tl.zeros([keys.shape[0]], dtype=tl.int32)
    # _kth_key_row's early exit once every row is settled: a threshold counted exactly K of its
    # keys, or it has <= K visible keys (tau stays 0); a settled row's later rounds change no
    # selection
    settled = tl.sum((keys >= 0).to(tl.int32), axis=1) <= K
    r = tl.full([], 0, tl.int32)
    go = tl.min(settled.to(tl.int32), axis=0) == 0
    while go:
        lo = RB * (ROUNDS - 1 - r)
        if NJ == 1:
            cnt = tl.sum((keys >= (tau + (1 << lo))[:, None]).to(tl.int32), axis=1)
            tau += (cnt >= K).to(tl.int32) << lo
            settled = settled | (cnt == K)
        else:
            jj = tl.arange(0, NJ) + 1
            lim = tl.where(r == 0, 1 << W0, 1 << RB)
            thr = tl.where(jj[None, :] < lim, tau[:, None] + (jj[None, :] << lo), _INT32_MAX)
            cnt = tl.sum((keys[:, None, :] >= thr[:, :, None]).to(tl.int32), axis=2)  # [R, NJ]
            tau += tl.sum((cnt >= K).to(tl.int32), axis=1) << lo
            settled = settled | (tl.max((cnt == K).to(tl.int32), axis=1) > 0)
        r += 1
        go = (r < ROUNDS) & (tl.min(settled.to(tl.int32), axis=0) == 0)
    return tau


@triton.jit
def _select(keys, tau, K: tl.constexpr):
    """Exact top-K of ``keys`` [R, N] given ``_kth_key``'s ``tau`` [R], ties to the smaller
    index: key > tau, then the first K - #(key > tau) keys == tau in index order. One packed
    prefix sum (#above + #tie * 2^16, N < 2^16) gives both the tie rank and each survivor's slot
    in ascending index order. Returns (sel [R, N] bool, slot [R, N] int32, count [R])."""
    above = (keys > tau[:, None]).to(tl.int32)
    tie = (keys == tau[:, None]).to(tl.int32)
    incl = tl.cumsum(above + (tie << 16), axis=1)
    tot = tl.max(incl, axis=1)  # the last prefix: both totals
    want = K - (tot & 0xFFFF)
    a_ex = (incl & 0xFFFF) - above
    t_ex = (incl >> 16) - tie
    sel = (above > 0) | ((tie > 0) & (t_ex < want[:, None]))
    slot = a_ex + tl.minimum(t_ex, want[:, None])
    return sel, slot, (tot & 0xFFFF) + tl.minimum(tot >> 16, want)


@triton.jit
def _radix_start(lb, top, RB: tl.constexpr):
    """(first round, tau so far) of ``_kth_key_row`` for a row whose k-th key is known to lie in
    [``lb``, ``top``] (scalars >= 0): every key in that range has the bits above bit ``lo`` that
    ``lb`` and ``top`` share, so each round whose digit lies in that prefix is taken from ``lb``
    instead of counted."""
    ROUNDS: tl.constexpr = (31 + RB - 1) // RB
    diff = lb ^ top
    r0 = 0
    for r in tl.static_range(ROUNDS):
        r0 += ((diff >> (RB * (ROUNDS - 1 - r))) == 0).to(tl.int32)
    lo = tl.minimum(RB * (ROUNDS - r0), 31)  # the lowest bit the skipped rounds set
    return r0, tl.where(r0 > 0, (lb >> lo) << lo, 0)


@triton.jit
def _kth_key_row(keys, K: tl.constexpr, RB: tl.constexpr, NJ: tl.constexpr, r0, tau):
    """``_kth_key`` for one row: ``keys`` [N] -> scalar tau, from round ``r0`` with the bits
    above it in ``tau`` (0, 0: the whole search; ``_radix_start``). A round's NJ counts are
    packed two to an int32 (16-bit halves: N < 2^16), so its cross-warp reduction moves NJ / 2
    values."""
    ROUNDS: tl.constexpr = (31 + RB - 1) // RB
    W0: tl.constexpr = 31 - RB * (ROUNDS - 1)
    tau = tl.full([], 0, tl.int32) + tau  # a literal 0 start becomes a loop-carried int32
    r = tl.full([], 0, tl.int32) + r0
    # Early exit: once a threshold counts exactly K keys, the keys >= it are the row's top K, so
    # tau = that threshold selects them (no key equals tau unless it is the K-th) and the
    # remaining rounds could only raise tau up to the K-th key: they change no selection. The
    # count is a uniform scalar, so the test costs no extra reduction.
    go = r < ROUNDS
    if NJ == 1:
        while go:
            lo = ROUNDS - 1 - r
            cnt = tl.sum((keys >= tau + (1 << lo)).to(tl.int32), axis=0)
            tau += (cnt >= K).to(tl.int32) << lo
            r += 1
            go = (r < ROUNDS) & (cnt != K)
    else:
        HJ: tl.constexpr = NJ // 2
        ja = tl.arange(0, HJ) + 1  # digits 1 .. NJ/2 in the low halves
        jb = ja + HJ  # NJ/2 + 1 .. NJ in the high halves
        while go:
            lo = RB * (ROUNDS - 1 - r)
            lim = tl.where(r == 0, 1 << W0, 1 << RB)
            # thresholds whose digit does not exist this round (or would overflow) count nothing
            ta = tl.where(ja < lim, tau + (ja << lo), _INT32_MAX)
            tb = tl.where(jb < lim, tau + (jb << lo), _INT32_MAX)
            ge = ((keys[None, :] >= ta[:, None]).to(tl.int32)
                  + ((keys[None, :] >= tb[:, None]).to(tl.int32) << 16))
            # [NJ / 2, 1], two counts each; kept 2-D so that the digit's sum over the thresholds
            # stays inside each thread (no second cross-warp exchange)
            cnt = tl.sum(ge, axis=1, keep_dims=True)
            ok = ((cnt & 0xFFFF) >= K).to(tl.int32) + ((cnt >> 16) >= K).to(tl.int32)
            hit = ((cnt & 0xFFFF) == K).to(tl.int32) + ((cnt >> 16) == K).to(tl.int32)
            tau += tl.sum(tl.sum(ok, axis=1), axis=0) << lo
            r += 1
            go = (r < ROUNDS) & (tl.sum(tl.sum(hit, axis=1), axis=0) == 0)
    return tau


@triton.jit
def _select_row(keys, tau, K: tl.constexpr):
    """``_select`` for one row: ``keys`` [N], scalar ``tau`` -> (sel [N], slot [N], count)."""
    above = (keys > tau).to(tl.int32)
    tie = (keys == tau).to(tl.int32)
    incl = tl.cumsum(above + (tie << 16), axis=0)
    tot = tl.max(incl, axis=0)
    want = K - (tot & 0xFFFF)
    a_ex = (incl & 0xFFFF) - above
    t_ex = (incl >> 16) - tie
    sel = (above > 0) | ((tie > 0) & (t_ex < want))
    slot = a_ex + tl.minimum(t_ex, want)
    return sel, slot, (tot & 0xFFFF) + tl.minimum(tot >> 16, want)


@triton.jit
def _score_keys(tot):
    """FP32 head sums [..] -> int32 order-preserving keys (+0.0 for -0.0 and NaN)."""
    tot = tl.where(tot > 0.0, tot, 0.0)
    return tot.to(tl.int32, bitcast=True)


# ---------------------------------------------------------------------------------------------
# Pass 1: decode (one row per program, keys through the page table)
@triton.jit
def _decode_chunk_kernel(q_ptr, k_ptr, pt_ptr, seq_ptr, wsk_ptr, wsi_ptr,
                         stride_qb, stride_qh, stride_ptb, pages, cap, S,
                         H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, P: tl.constexpr,
                         RATIO: tl.constexpr, K: tl.constexpr, C: tl.constexpr,
                         T: tl.constexpr, RB: tl.constexpr, NJ: tl.constexpr,
                         COMPUTE: tl.constexpr, USE_PDL: tl.constexpr = False):
    if USE_PDL:
        # the merge grid (launched with PDL) may be scheduled now: it waits on the device for
        # this whole grid to complete (griddepcontrol.wait), so triggering at entry is safe
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    s = tl.program_id(1)
    nb = tl.minimum(tl.maximum(tl.load(seq_ptr + b), 0) // RATIO, cap)
    lo = s * C
    n_here = tl.minimum(tl.maximum(nb - lo, 0), C)
    if n_here > 0:
        NT: tl.constexpr = C // T
        h = tl.arange(0, HP)
        d = tl.arange(0, D)
        nt = tl.arange(0, NT)
        tt = tl.arange(0, T)
        # q^T [D, HP]: the key tile is the MMA's M side (T rows); padded heads load as 0, their
        # dot is exactly 0, ReLU(0) = 0: they add nothing
        qt = tl.load(q_ptr + b.to(tl.int64) * stride_qb + h[None, :] * stride_qh + d[:, None],
                     mask=(h < H)[None, :], other=0.0).to(COMPUTE)
        ids = nt[:, None] * T + tt[None, :]
        # A row with <= K blocks keeps all of them: its keys are never read (upstream's fast
        # top-k skips such rows the same way)
        keys = tl.where(ids < n_here, 0, -1)
        if nb > K:
            for t in range(0, tl.cdiv(n_here, T)):
                blk = lo + t * T + tt
                ok = blk < nb
                pid = tl.load(pt_ptr + b.to(tl.int64) * stride_ptb + blk // P, mask=ok, other=0)
                # A page id outside the cache is a caller bug: its blocks read nothing (score 0)
                pok = ok & (pid >= 0) & (pid < pages)
                row = pid.to(tl.int64) * P + blk % P
                k = tl.load(k_ptr + row[:, None] * D + d[None, :], mask=pok[:, None], other=0.0,
                            eviction_policy="evict_first")
                sc = tl.dot(k.to(COMPUTE), qt)  # [T, HP] fp32
                key = tl.where(ok, _score_keys(tl.sum(tl.maximum(sc, 0.0), axis=1)), -1)
                keys = tl.where((nt == t)[:, None], key[None, :], keys)
        keys = tl.reshape(keys, [C])
        ids = tl.reshape(ids, [C])
        tau = 0
        if n_here > K:
            tau = _kth_key_row(keys, K, RB, NJ, 0, 0)
        sel, pos, n_sel = _select_row(keys, tau, K)
        base = (b.to(tl.int64) * S + s) * K
        tl.store(wsk_ptr + base + pos, keys, mask=sel)
        tl.store(wsi_ptr + base + pos, lo + ids, mask=sel)
        # the chunk's unused slots read as "no candidate" (-1): the merge needs no counts, so its
        # key loads wait on nothing but this grid
        j = tl.arange(0, K)
        tl.store(wsk_ptr + base + j, tl.full([K], -1, tl.int32), mask=j >= n_sel)


# ---------------------------------------------------------------------------------------------
# Pass 1: prefill (BM rows per program share every key tile)
@triton.jit
def _prefill_chunk_kernel(q_ptr, k_ptr, rs_ptr, re_ptr, wsk_ptr, wsi_ptr, lb_ptr, cnt_ptr,
                          n_rows, n_keys, stride_qt, stride_qh, S,
                          H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, K: tl.constexpr,
                          C: tl.constexpr, T: tl.constexpr, BM: tl.constexpr,
                          RB: tl.constexpr, NJ: tl.constexpr, COMPUTE: tl.constexpr,
                          BOUND: tl.constexpr = 0, COUNTS: tl.constexpr = 0):
    # BOUND: 0 plain pass 1; 1 pass 1 with each row's lower bound of its k-th key (lb_ptr);
    # 2 the bound pass: chunk 0 only, writes the chunk's k-th key per row to lb_ptr.
    # COUNTS (with BOUND 1; the compacting merge reads only counted slots), cnt_ptr [rows, S]:
    # 1 streams: each tile's keys >= the bound go straight to the row's next slots (the first K
    # of them), the count of all of them to cnt_ptr (no key tile, no radix rounds); 2 the fixup:
    # only tiles with a (row, chunk) counted past K run, and write its exact top-K as pass 1
    pid_m = tl.program_id(0)
    s = tl.program_id(1)
    rloc = pid_m * BM + tl.arange(0, BM)
    rok = rloc < n_rows
    rs = tl.load(rs_ptr + rloc, mask=rok, other=0)
    re = tl.load(re_ptr + rloc, mask=rok, other=0)
    lo = tl.maximum(rs, 0)  # the row's first key row (rows outside [0, N) do not exist)
    n_vis = tl.where(rok, tl.maximum(tl.minimum(re, n_keys) - lo, 0), 0)
    c0 = s * C
    n_here = tl.minimum(tl.maximum(n_vis - c0, 0), C)  # [BM]
    todo = n_here > 0
    if COUNTS == 2:  # the fixup: nothing to do unless a row of the tile streamed more than K
        streamed = tl.load(cnt_ptr + rloc * S + s, mask=todo, other=0)
        todo = todo & (tl.max(streamed, axis=0) > K)
    if BOUND == 1:
        lb = tl.load(lb_ptr + rloc, mask=rok, other=0)
    if tl.max(todo.to(tl.int32), axis=0) > 0:
        NT: tl.constexpr = C // T
        HB: tl.constexpr = HP * BM
        d = tl.arange(0, D)
        nt = tl.arange(0, NT)
        tt = tl.arange(0, T)
        # All heads of the tile's rows stacked as one MMA operand, head-major: i = h * BM + m.
        i = tl.arange(0, HB)
        qrow = (pid_m * BM + i % BM).to(tl.int64)
        qmask = ((i // BM) < H) & ((pid_m * BM + i % BM) < n_rows)
        q = tl.load(q_ptr + qrow[:, None] * stride_qt + (i // BM)[:, None] * stride_qh + d[None, :],
                    mask=qmask[:, None], other=0.0).to(COMPUTE)
        if COUNTS == 1:
            n_ge = tl.zeros([BM], dtype=tl.int32)  # keys >= the bound so far, per row
            slot0 = (rloc * S + s) * K
            scored = n_vis > K  # the rest keep their <= K visible blocks (below)
        else:
            keys = tl.full([BM, NT, T], -1, tl.int32)
        # Rows of one request share their key rows; a tile straddling requests takes one
        # segment (rows with the same first key row) at a time.
        while tl.max(todo.to(tl.int32), axis=0) > 0:
            base = tl.min(tl.where(todo, lo, _INT32_MAX), axis=0)
            seg = todo & (lo == base)
            seg_n = tl.max(tl.where(seg, n_here, 0), axis=0)
            # rows with <= K visible blocks keep them all: a segment of only such rows is
            # neither loaded nor scored
            seg_score = tl.max(tl.where(seg, n_vis, 0), axis=0) > K
            for t in range(0, tl.where(seg_score, tl.cdiv(seg_n, T), 0)):
                j = t * T + tt
                kr = (base + c0 + j).to(tl.int64)
                k = tl.load(k_ptr + kr[:, None] * D + d[None, :], mask=(j < seg_n)[:, None],
                            other=0.0)
                sc = tl.dot(q, tl.trans(k.to(COMPUTE)))  # [HB, T]
                tot = tl.sum(tl.reshape(tl.maximum(sc, 0.0), [HP, BM, T]), axis=0)  # [BM, T]
                valid = seg[:, None] & (j[None, :] < n_here[:, None])
                key = tl.where(valid, _score_keys(tot), -1)
                if COUNTS == 1:
                    take = (valid & scored[:, None] & (key >= lb[:, None])).to(tl.int32)
                    at = n_ge[:, None] + tl.cumsum(take, axis=1) - take
                    put = (take > 0) & (at < K)
                    tl.store(wsk_ptr + slot0[:, None] + at, key, mask=put)
                    tl.store(wsi_ptr + slot0[:, None] + at, (lo - rs + c0)[:, None] + j[None, :],
                             mask=put)
                    n_ge += tl.sum(take, axis=1)
                else:
                    put = (nt == t)[None, :, None] & seg[:, None, None]
                    keys = tl.where(put, key[:, None, :], keys)
            todo = todo & (~seg)
        if COUNTS == 1:
            # rows with <= K visible blocks: all of them, key 0 (as pass 1 takes them)
            j = tl.arange(0, K)[None, :]
            few = (~scored)[:, None] & (j < n_here[:, None])
            tl.store(wsk_ptr + slot0[:, None] + j, tl.zeros([BM, K], tl.int32), mask=few)
            tl.store(wsi_ptr + slot0[:, None] + j, (lo - rs + c0)[:, None] + j, mask=few)
            tl.store(cnt_ptr + rloc * S + s, tl.where(scored, n_ge, n_here), mask=n_here > 0)
        else:
            ids = tl.reshape(nt[:, None] * T + tt[None, :], [1, C])
            keys = tl.reshape(keys, [BM, C])
            keys = tl.where((n_vis > K)[:, None], keys, tl.where(ids < n_here[:, None], 0, -1))
            tau = tl.zeros([BM], dtype=tl.int32)
            if tl.max(n_here, axis=0) > K:
                if BOUND == 1:
                    # every block of a row's top-k has a key >= the row's bound: where at most K
                    # keys of each row pass it, the bound is the threshold (no radix rounds)
                    fits = tl.sum((keys >= lb[:, None]).to(tl.int32), axis=1) <= K
                    if tl.min(fits.to(tl.int32), axis=0) > 0:
                        tau = lb
                    else:
                        tau = _kth_key(keys, K, RB, NJ)
                else:
                    tau = _kth_key(keys, K, RB, NJ)
            if BOUND == 2:  # <= the sample's k-th key, #(keys >= it) >= K (0: <= K visible)
                tl.store(lb_ptr + rloc, tl.maximum(tau - _BOUND_MARGIN, 0), mask=rok)
            else:
                sel, pos, n_sel = _select(keys, tau, K)
                slot = (rloc * S + s) * K  # < 2^31: the row group bounds the workspace
                rel = (lo - rs + c0)[:, None] + ids  # row-relative block id = key row - row_start
                tl.store(wsk_ptr + slot[:, None] + pos, keys, mask=sel)
                tl.store(wsi_ptr + slot[:, None] + pos, rel, mask=sel)
                if COUNTS:
                    tl.store(cnt_ptr + rloc * S + s, n_sel, mask=n_here > 0)
                else:
                    j = tl.arange(0, K)[None, :]  # unused slots of the rows' chunks: -1 (none)
                    tl.store(wsk_ptr + slot[:, None] + j, tl.full([BM, K], -1, tl.int32),
                             mask=(j >= n_sel[:, None]) & (n_here > 0)[:, None])


# ---------------------------------------------------------------------------------------------
# Pass 2: merge (+ optional fused expansion)
@triton.jit
def _chunk_group(wsk_ptr, cnt_ptr, base, crow, nch, g, K: tl.constexpr, CG: tl.constexpr):
    """Chunks g * CG .. of a row's counted candidates: (keys [CG, K] (-1 past a chunk's count),
    their slots, counted mask)."""
    c = g * CG + tl.arange(0, CG)[:, None]
    j = tl.arange(0, K)[None, :]
    m = j < tl.load(cnt_ptr + crow + c, mask=c < nch, other=0)
    src = base + c * K + j
    return tl.load(wsk_ptr + src, mask=m, other=-1), src, m


@triton.jit
def _kth_key_chunks(wsk_ptr, cnt_ptr, base, crow, nch, lb, K: tl.constexpr, CG: tl.constexpr):
    """(tau, ties kept) for a row with more counted candidates than the merge's tile: its k-th
    key by 1-bit radix rounds over the chunks (``_kth_key_row``'s search, starting from the
    bits ``lb`` and the largest candidate share) and K - #(key > tau)."""
    top = tl.full([], 0, tl.int32)
    for g in range(0, tl.cdiv(nch, CG)):
        kk, _, _ = _chunk_group(wsk_ptr, cnt_ptr, base, crow, nch, g, K, CG)
        top = tl.maximum(top, tl.max(tl.max(kk, axis=1), axis=0))
    r0, tau = _radix_start(lb, top, 1)
    tau = tl.full([], 0, tl.int32) + tau
    rr = tl.full([], 0, tl.int32) + r0
    go = rr < 31
    while go:  # with _kth_key_row's early exit
        thr = tau + (1 << (30 - rr))
        n_ge = tl.full([], 0, tl.int32)
        for g in range(0, tl.cdiv(nch, CG)):
            kk, _, _ = _chunk_group(wsk_ptr, cnt_ptr, base, crow, nch, g, K, CG)
            n_ge += tl.sum(tl.sum((kk >= thr).to(tl.int32), axis=1), axis=0)
        tau += (n_ge >= K).to(tl.int32) << (30 - rr)
        rr += 1
        go = (rr < 31) & (n_ge != K)
    n_above = tl.full([], 0, tl.int32)
    for g in range(0, tl.cdiv(nch, CG)):
        kk, _, _ = _chunk_group(wsk_ptr, cnt_ptr, base, crow, nch, g, K, CG)
        n_above += tl.sum(tl.sum((kk > tau).to(tl.int32), axis=1), axis=0)
    return tau, K - n_above


@triton.jit
def _compact(wsk_ptr, wsi_ptr, cnt_ptr, base, crow, nch, tau, want, K: tl.constexpr,
             CG: tl.constexpr):
    """Moves a row's counted candidates with key > ``tau``, and its first ``want`` with key ==
    ``tau``, to the front of its workspace in slot order (in place: a group's destinations lie
    below its end, later groups above it) and returns how many. tau = -1: every candidate."""
    n_above = tl.full([], 0, tl.int32)
    n_tie = tl.full([], 0, tl.int32)
    for g in range(0, tl.cdiv(nch, CG)):
        kk, src, m = _chunk_group(wsk_ptr, cnt_ptr, base, crow, nch, g, K, CG)
        ii = tl.load(wsi_ptr + src, mask=m, other=0)
        above = ((kk > tau) & m).to(tl.int32)
        tie = ((kk == tau) & m).to(tl.int32)
        incl = tl.reshape(tl.cumsum(tl.reshape(above + (tie << 16), [CG * K]), axis=0), [CG, K])
        a_ex = n_above + (incl & 0xFFFF) - above
        t_ex = n_tie + (incl >> 16) - tie
        keep = (above > 0) | ((tie > 0) & (t_ex < want))
        dest = base + a_ex + tl.minimum(t_ex, want)
        tl.debug_barrier()  # every thread has read the group before any slot is overwritten
        tl.store(wsk_ptr + dest, kk, mask=keep)
        tl.store(wsi_ptr + dest, ii, mask=keep)
        last = tl.max(tl.max(incl, axis=1), axis=0)
        n_above += last & 0xFFFF
        n_tie += last >> 16
    tl.debug_barrier()  # the compacted candidates are visible to every thread
    return n_above + tl.minimum(n_tie, want)


@triton.jit
def _merge_kernel(wsk_ptr, wsi_ptr, out_ptr, m0_ptr, m1_ptr, pos_ptr, bound_ptr, lb_ptr, cnt_ptr,
                  cap, stride_out, C, S,
                  PREFILL: tl.constexpr, EXPAND: tl.constexpr, RATIO: tl.constexpr,
                  K: tl.constexpr, SP: tl.constexpr,
                  W: tl.constexpr, WP: tl.constexpr, RP: tl.constexpr, RB: tl.constexpr,
                  NJ: tl.constexpr, FROM_BOUND: tl.constexpr = False, NCAP: tl.constexpr = 0,
                  CG: tl.constexpr = 1, USE_PDL: tl.constexpr = False):
    # NCAP > 0: the candidates are counted (pass 1's COUNTS) and compacted to a tile of NCAP
    r = tl.program_id(0)
    # the row's metadata are inputs, not pass 1's output: read before waiting for pass 1
    if PREFILL:
        rs = tl.load(m0_ptr + r)
        n = tl.maximum(tl.minimum(tl.load(m1_ptr + r), cap) - tl.maximum(rs, 0), 0)
        if EXPAND:
            p = tl.load(pos_ptr + r)
            bound = tl.load(bound_ptr + r)
    else:
        seq = tl.maximum(tl.load(m0_ptr + r), 0)
        n = tl.minimum(seq // RATIO, cap)
        p = seq - 1
        bound = seq
    if USE_PDL:  # launched with PDL: wait until pass 1 has completed and its writes are visible
        tl.extra.cuda.gdc_wait()
    # candidate slot = chunk * K + rank in the chunk: orders like the block id, so the tie rule
    # (smaller id first) is the slot order; a chunk's unused slots hold -1 (or are not counted)
    base = r.to(tl.int64) * S * K
    if NCAP > 0:
        crow = r.to(tl.int64) * S
        nch = tl.cdiv(n, C)
        cc = tl.arange(0, SP)
        total = tl.sum(tl.load(cnt_ptr + crow + cc, mask=cc < nch, other=0), axis=0)
        lbr = tl.load(lb_ptr + r) if FROM_BOUND else 0
        tau_f = tl.full([], -1, tl.int32)  # keep every candidate ...
        want_f = tl.full([], 0, tl.int32)
        if total > NCAP:  # ... or, past the tile, only the row's exact top-k
            tau_f, want_f = _kth_key_chunks(wsk_ptr, cnt_ptr, base, crow, nch, lbr, K, CG)
        n_c = _compact(wsk_ptr, wsi_ptr, cnt_ptr, base, crow, nch, tau_f, want_f, K, CG)
        slot = tl.arange(0, NCAP)
        has = slot < n_c
    else:
        slot = tl.arange(0, SP * K)
        has = slot // K < tl.cdiv(n, C)
    keys = tl.load(wsk_ptr + base + slot, mask=has, other=-1)
    blk = tl.load(wsi_ptr + base + slot, mask=has, other=0)
    tau = 0
    if tl.sum((keys >= 0).to(tl.int32), axis=0) > K:
        if FROM_BOUND:  # the row's k-th key is in [its bound, its largest candidate]
            if PREFILL:
                lbr = tl.load(lb_ptr + r)
            else:
                # a chunk holding K candidates holds its own k-th key as its smallest, and the
                # row's k-th key is never below any chunk's (a chunk with fewer holds -1)
                lbr = tl.max(tl.min(tl.reshape(keys, [SP, K]), axis=1), axis=0)
            r0, tau0 = _radix_start(lbr, tl.max(keys, axis=0), RB)
            tau = _kth_key_row(keys, K, RB, NJ, r0, tau0)
        else:
            tau = _kth_key_row(keys, K, RB, NJ, 0, 0)
    sel, pos, n_sel = _select_row(keys, tau, K)
    orow = out_ptr + r.to(tl.int64) * stride_out
    if EXPAND:
        # Everything is ascending, so the valid tokens of the selected blocks (< bound) are a
        # prefix; the causal tail [floor(L/R)*R, p] follows them.
        e = tl.arange(0, RP)[None, :]
        tok = blk[:, None] * RATIO + e
        tl.store(orow + pos[:, None] * RATIO + e, tok,
                 mask=sel[:, None] & (e < RATIO) & (tok < bound))
        m = tl.sum(tl.where(sel, tl.minimum(tl.maximum(bound - blk * RATIO, 0), RATIO), 0),
                   axis=0)
        # tail [start, p], start the largest multiple of RATIO <= p + 1, written without p + 1
        # (a position of 2^31 - 1 must not wrap); none for p < 0, tokens < bound only
        r1 = (p % RATIO + RATIO) % RATIO
        start = p - r1
        n_tail = 0
        for e in tl.static_range(RATIO - 1):
            n_tail += ((p >= 0) & (e <= r1) & (r1 < RATIO - 1)
                       & (start + e < bound)).to(tl.int32)
        col = tl.arange(0, WP)
        off = col - m
        val = tl.where(off < n_tail, start + off, -1)
        tl.store(orow + col, val, mask=(col >= m) & (col < W))
    else:
        j = tl.arange(0, K)
        tl.store(orow + pos, blk, mask=sel)
        tl.store(orow + j, tl.full([K], -1, tl.int32), mask=j >= n_sel)


# ---------------------------------------------------------------------------------------------
# Standalone expansion (any block ids, the exact reference rule)
@triton.jit
def _expand_kernel(blk_ptr, pos_ptr, sl_ptr, out_ptr, K: tl.constexpr, RATIO: tl.constexpr,
                   W: tl.constexpr, WP: tl.constexpr):
    r = tl.program_id(0)
    p = tl.load(pos_ptr + r)
    bound = tl.load(sl_ptr + r).to(tl.int64)
    TOK: tl.constexpr = K * RATIO
    col = tl.arange(0, WP)
    g = tl.load(blk_ptr + r.to(tl.int64) * K + col // RATIO, mask=col < TOK, other=-1)
    tok = g.to(tl.int64) * RATIO + col % RATIO  # 64-bit: a junk id * ratio must not wrap
    val = tl.where((g >= 0) & (tok < bound), tok, -1)
    # causal tail: floor division written out (Triton's // and % truncate toward zero)
    vis = p.to(tl.int64) + 1
    start = vis - ((vis % RATIO) + RATIO) % RATIO
    e = (col - TOK).to(tl.int64)
    tail = start + e
    tval = tl.where((e < vis - start) & (tail >= 0) & (tail < bound), tail, -1)
    val = tl.where(col < TOK, val, tval)
    inside = col < W
    valid = (val >= 0) & inside
    cv = tl.cumsum(valid.to(tl.int32), axis=0)
    n_valid = tl.sum(valid.to(tl.int32), axis=0)
    dest = tl.where(valid, cv - 1, n_valid + col - cv)  # stable partition: valid first
    tl.store(out_ptr + r.to(tl.int64) * W + dest, val.to(tl.int32), mask=inside)


# ---------------------------------------------------------------------------------------------
# Launchers
def indexer_plan_for(kind: str, rows: int, max_blocks: int, topk: int,
                     device: torch.device | None = None) -> IndexerPlan:
    """The shared static plan (``interop.indices.plan_indexer``) for ``kind`` ("decode" |
    "prefill"), ``rows`` query rows, ``max_blocks`` compressed blocks a row may score and
    ``topk``, on ``device``'s SM count and shared memory (an H200's without a CUDA device), as
    ``qsa_pallas.indexer_plan_for``. Raises ValueError as ``plan_indexer``. Source:
    ``interop.indices.plan_indexer`` (its rules and measurements)."""
    sms, smem = 132, 232_448
    if device is not None and device.type == "cuda":
        facts = DeviceFacts.from_torch(device)
        sms, smem = facts.sm_count, facts.smem_per_block
    return plan_indexer(kind, rows, max_blocks, topk, sm_count=sms, smem_per_block=smem)


def _compute_dtype(q: torch.Tensor):
    return tl.bfloat16 if q.dtype == torch.float8_e4m3fn else _TL_DTYPES[q.dtype]


def _width(topk: int, ratio: int, expand: bool) -> int:
    """Output columns: topk block ids, or the expansion's topk * ratio + ratio - 1 tokens."""
    return topk * ratio + ratio - 1 if expand else topk


def _decode_constexprs(plan: IndexerPlan, h: int, d: int, psz: int, ratio: int, compute):
    """The pass-1 decode kernel's constexprs for ``plan`` (one source for the launch and
    ``interop.validate.compile.triton_indexer_configs``)."""
    return dict(H=h, HP=max(16, _next_pow2(h)), D=d, P=psz, RATIO=ratio, K=plan.topk,
                C=plan.chunk, T=plan.tile, RB=plan.radix_bits,
                NJ=IndexerPlan.thresholds(plan.radix_bits), COMPUTE=compute)


def _prefill_constexprs(plan: IndexerPlan, h: int, d: int, compute, bound_pass: bool = False):
    """Pass 1's constexprs, or (``bound_pass``) the bound pass's: ``bound_chunk`` blocks, rows a
    program scaled so a program holds as many keys as a pass-1 program."""
    c, bm = plan.chunk, plan.rows_per_program
    if bound_pass:
        bm = max(4, bm * c // plan.bound_chunk)
        c = plan.bound_chunk
    return dict(H=h, HP=_next_pow2(h), D=d, K=plan.topk, C=c, T=plan.tile, BM=bm,
                RB=plan.radix_bits, NJ=IndexerPlan.thresholds(plan.radix_bits), COMPUTE=compute,
                BOUND=2 if bound_pass else 1 if plan.bound_chunk else 0)


def _merge_constexprs(plan: IndexerPlan, *, prefill: bool, expand: bool, ratio: int):
    w = plan.topk * ratio + ratio - 1
    return dict(PREFILL=prefill, EXPAND=expand, RATIO=ratio, K=plan.topk,
                SP=plan.splits_pad, W=w, WP=_next_pow2(w), RP=_next_pow2(ratio),
                RB=plan.merge_radix_bits, NJ=IndexerPlan.thresholds(plan.merge_radix_bits),
                FROM_BOUND=plan.merge_from_bound and (bool(plan.bound_chunk) or not prefill),
                NCAP=plan.merge_capacity if prefill else 0, CG=plan.compact_chunks)


def _merge(ws, out, m0, m1, pos, bound, cap, plan: IndexerPlan, *, prefill, expand, ratio,
           lb=None, cnt=None, pdl=False):
    rows = out.shape[0]
    if rows == 0:
        return out
    _merge_kernel[(rows,)](
        *ws, out, m0, m1 if m1 is not None else m0,
        pos if pos is not None else m0, bound if bound is not None else m0,
        lb if lb is not None else m0, cnt if cnt is not None else m0,
        cap, out.stride(0), plan.chunk, plan.splits,
        **_merge_constexprs(plan, prefill=prefill, expand=expand, ratio=ratio), USE_PDL=pdl,
        num_warps=plan.merge_warps, **({"launch_pdl": True} if pdl else {}))
    return out


def _workspace(rows: int, plan: IndexerPlan, device):
    """Pass 1's candidates (keys, block ids): int32 [rows * splits * topk] each."""
    n = rows * plan.splits * plan.topk
    return tuple(torch.empty((n,), dtype=torch.int32, device=device) for _ in range(2))


def _run_decode(q, k_cache, page_table, seq_lens, topk: int, ratio: int, expand: bool,
                plan: IndexerPlan | None = None):
    b, h, d = q.shape
    pages, psz = k_cache.shape[0], k_cache.shape[1]
    cap = page_table.shape[1] * psz
    plan = plan or indexer_plan_for("decode", b, cap, topk, q.device)
    out = torch.empty((b, _width(topk, ratio, expand)), dtype=torch.int32, device=q.device)
    if b == 0:
        return out
    ws = _workspace(b, plan, q.device)
    if k_cache.numel() == 0:  # no pages: every block reads nothing (pages = 0 masks all loads)
        k_cache = torch.zeros((1, 1, 1, d), dtype=k_cache.dtype, device=q.device)
    pdl = plan.pdl and _pdl_supported(q.device)
    _decode_chunk_kernel[(b, plan.splits)](
        q, k_cache, page_table, seq_lens, *ws,
        q.stride(0), q.stride(1), page_table.stride(0), pages, cap, plan.splits,
        **_decode_constexprs(plan, h, d, psz, ratio, _compute_dtype(q)), USE_PDL=pdl,
        num_warps=plan.num_warps, num_stages=plan.num_stages)
    return _merge(ws, out, seq_lens, None, None, None, cap, plan, prefill=False, expand=expand,
                  ratio=ratio, pdl=pdl)


def _run_prefill(q, k, row_starts, row_ends, positions, seq_lens, topk: int, ratio: int,
                 expand: bool, plan: IndexerPlan | None = None):
    t, h, d = q.shape
    n_keys = k.shape[0]
    plan = plan or indexer_plan_for("prefill", t, n_keys, topk, q.device)
    out = torch.empty((t, _width(topk, ratio, expand)), dtype=torch.int32, device=q.device)
    if t == 0:
        return out
    g = plan.row_group
    ws = _workspace(min(g, t), plan, q.device)
    bm = plan.rows_per_program
    consts = _prefill_constexprs(plan, h, d, _compute_dtype(q))
    if plan.bound_chunk:
        bconsts = _prefill_constexprs(plan, h, d, _compute_dtype(q), bound_pass=True)
        lb = torch.empty((min(g, t),), dtype=torch.int32, device=q.device)
    else:
        lb = ws[0]  # unused (BOUND = 0)
    # the candidate counts of the compacting merge (every (row, chunk) it reads is written)
    cnt = (torch.empty((min(g, t) * plan.splits,), dtype=torch.int32, device=q.device)
           if plan.merge_capacity else None)
    for r0 in range(0, t, g):  # row groups bound the candidate workspace (static: from shapes)
        r1 = min(t, r0 + g)
        qs = q[r0:r1]
        rs, re = row_starts[r0:r1], row_ends[r0:r1]
        if n_keys:  # no keys: every row is empty, the merge alone writes the (tail-only) rows
            if plan.bound_chunk:  # rows with nothing visible keep the bound 0 (no bound)
                lb.zero_()
                _prefill_chunk_kernel[(triton.cdiv(r1 - r0, bconsts["BM"]), 1)](
                    qs, k, rs, re, *ws, lb, lb, r1 - r0, n_keys, qs.stride(0), qs.stride(1), 1,
                    **bconsts, num_warps=plan.num_warps, num_stages=plan.num_stages)
            for counts in (1, 2) if cnt is not None else (0,):  # streamed, then the fixup
                _prefill_chunk_kernel[(triton.cdiv(r1 - r0, bm), plan.splits)](
                    qs, k, rs, re, *ws, lb, cnt if cnt is not None else lb, r1 - r0, n_keys,
                    qs.stride(0), qs.stride(1), plan.splits,
                    **consts, COUNTS=counts, num_warps=plan.num_warps,
                    num_stages=plan.num_stages)
        _merge(ws, out[r0:r1], rs, re, positions[r0:r1] if expand else None,
               seq_lens[r0:r1] if expand else None, n_keys, plan, prefill=True, expand=expand,
               ratio=ratio, lb=lb if plan.bound_chunk else None, cnt=cnt)
    return out


# ---------------------------------------------------------------------------------------------
# torch.library registration (the ops run after the entry points' checks; the fake impls check
# under torch.compile)
@torch.library.custom_op("qsa::indexer_decode", mutates_args=())
def _indexer_decode_op(q: torch.Tensor, k_cache: torch.Tensor, page_table: torch.Tensor,
                       seq_lens: torch.Tensor, topk: int, compress_ratio: int,
                       expand: bool, strict: bool = False) -> torch.Tensor:
    return _run_decode(q, k_cache, page_table, seq_lens, topk, compress_ratio, expand)


@_indexer_decode_op.register_fake
def _indexer_decode_fake(q, k_cache, page_table, seq_lens, topk, compress_ratio, expand,
                         strict=False):
    prob = check_indexer_decode(q, k_cache, page_table, seq_lens, topk=topk,
                                compress_ratio=compress_ratio, strict=strict)
    check_interpreter_dtype("indexer_topk_decode", prob.compute_dtype, _passed(q, prob))
    return q.new_empty((q.shape[0], _width(topk, compress_ratio, expand)), dtype=torch.int32)


@torch.library.custom_op("qsa::indexer_prefill", mutates_args=())
def _indexer_prefill_op(q: torch.Tensor, k: torch.Tensor, row_starts: torch.Tensor,
                        row_ends: torch.Tensor, positions: torch.Tensor | None,
                        seq_lens: torch.Tensor | None, topk: int, compress_ratio: int,
                        expand: bool, strict: bool = False) -> torch.Tensor:
    return _run_prefill(q, k, row_starts, row_ends, positions, seq_lens, topk, compress_ratio,
                        expand)


@_indexer_prefill_op.register_fake
def _indexer_prefill_fake(q, k, row_starts, row_ends, positions, seq_lens, topk, compress_ratio,
                          expand, strict=False):
    prob = check_indexer_prefill(q, k, row_starts, row_ends, topk=topk,
                                 compress_ratio=compress_ratio, positions=positions,
                                 seq_lens=seq_lens, strict=strict)
    check_interpreter_dtype("indexer_topk_prefill", prob.compute_dtype, _passed(q, prob))
    return q.new_empty((q.shape[0], _width(topk, compress_ratio, expand)), dtype=torch.int32)


@torch.library.custom_op("qsa::expand_block_indices", mutates_args=())
def _expand_op(block_ids: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor,
               compress_ratio: int, strict: bool = False) -> torch.Tensor:
    m, k = block_ids.shape
    w = _width(k, compress_ratio, True)
    out = torch.empty((m, w), dtype=torch.int32, device=block_ids.device)
    if m:
        _expand_kernel[(m,)](block_ids, positions, seq_lens, out, K=k, RATIO=compress_ratio,
                             W=w, WP=_next_pow2(w), num_warps=4)
    return out


@_expand_op.register_fake
def _expand_fake(block_ids, positions, seq_lens, compress_ratio, strict=False):
    w = check_expand_block_indices(block_ids, positions, seq_lens, compress_ratio=compress_ratio,
                                   strict=strict)
    return block_ids.new_empty((block_ids.shape[0], w))


# ---------------------------------------------------------------------------------------------
# Public entry points
def _entry(fn: str, checker, tensors: dict, extra: dict, args: tuple, strict: bool,
           plan: IndexerPlan | None, run, op):
    """An entry point's body: checks (in the fake impl while compiling), then ``run`` with the
    given plan (bypassing the custom op) or, for None, the registered ``op``. ``args``: the
    op's arguments (..., topk, compress_ratio, expand); ``extra``: keyword tensors checked."""
    q, topk, ratio = tensors["q"], args[-3], args[-2]
    if not torch.compiler.is_compiling():
        check_torch_tensors(fn, **tensors, **extra)
        prob = checker(*tensors.values(), topk=topk, compress_ratio=ratio, strict=strict, fn=fn,
                       **extra)
        check_interpreter_dtype(fn, prob.compute_dtype, _passed(q, prob))
        check_device(fn, q.device.type)
        check_indexer_plan(fn, prob, plan, lambda: _default_plan(prob, q.device))
    return op(*args, bool(strict)) if plan is None else run(*args, plan)


def _default_plan(prob, device: torch.device) -> IndexerPlan:
    """``indexer_plan_for`` of an ``IndexerProblem`` on ``device`` (the entry points' and the
    steps' check)."""
    return indexer_plan_for(prob.kind, prob.rows, prob.max_blocks, prob.topk, device)


def _passed(q: torch.Tensor, prob) -> str:
    """What the interpreter check reports as passed: q's dtype (and the dots', where other)."""
    got = str(q.dtype).replace("torch.", "")
    return got if got == prob.compute_dtype else f"{got} (its dots run in {prob.compute_dtype})"


def _decode_entry(fn: str, q, k_cache, page_table, seq_lens, topk: int, compress_ratio: int,
                  strict: bool, plan: IndexerPlan | None, *, expand: bool) -> torch.Tensor:
    return _entry(fn, check_indexer_decode,
                  dict(q=q, k_cache=k_cache, page_table=page_table, seq_lens=seq_lens), {},
                  (q, k_cache, page_table, seq_lens, topk, compress_ratio, expand), strict, plan,
                  _run_decode, torch.ops.qsa.indexer_decode)


def _prefill_entry(fn: str, q, k, row_starts, row_ends, positions, seq_lens, topk: int,
                   compress_ratio: int, strict: bool, plan: IndexerPlan | None, *,
                   expand: bool) -> torch.Tensor:
    """``expand``: the fused expansion, which takes and checks ``positions`` / ``seq_lens``
    (otherwise both None)."""
    return _entry(fn, check_indexer_prefill,
                  dict(q=q, k=k, row_starts=row_starts, row_ends=row_ends),
                  dict(positions=positions, seq_lens=seq_lens) if expand else {},
                  (q, k, row_starts, row_ends, positions, seq_lens, topk, compress_ratio, expand),
                  strict, plan, _run_prefill, torch.ops.qsa.indexer_prefill)


def indexer_topk_decode(q: torch.Tensor, k_cache: torch.Tensor, page_table: torch.Tensor,
                        seq_lens: torch.Tensor, *, topk: int = 512, compress_ratio: int = 4,
                        strict: bool = False, plan: IndexerPlan | None = None) -> torch.Tensor:
    """Decode indexer: score each row's paged compressed keys and keep the exact top-k blocks.

    Row b sees its first ``floor(seq_lens[b] / compress_ratio)`` blocks (at most
    ``max_pages * page_size``); block n is ``k_cache[page_table[b, n // page_size],
    n % page_size, 0]``; page-table entries past the row's blocks are never read. Scores:
    ``sum_h ReLU(q[b, h] . k[n])`` in FP32 (fp8 widened to bf16, exactly; upstream's division
    by ``score_scale`` keeps the order and is left out). Algorithm: module docstring.

    Args:
      q: [B, H, D] bf16|fp16|fp8 e4m3 (one row per decode query; MTP rows are rows too).
      k_cache: [pages, page_size, 1, D] q's dtype or fp8 e4m3, contiguous.
      page_table: int32 [B, max_pages]; seq_lens: int32 [B] token counts (device data).
      topk: blocks kept (512); compress_ratio: tokens per block (4).
      strict: enforce the qualified envelope (``interop.contract.QUALIFIED_INDEXER``).
      plan: an ``interop.indices.IndexerPlan`` replacing the shared one (benchmarks; the call
        then bypasses the torch.library op).

    Returns:
      int32 [B, topk]: the selected block ids ascending, -1 after; a row with <= topk blocks
      gets all of them; ties go to the smaller block id (``interop.reference.indexer_topk``).

    Raises:
      ContractError: before any launch: a call outside ``interop.contract.check_indexer_decode``,
        a non-torch argument, bf16 under an unpatched Triton interpreter, CPU tensors without
        the interpreter, a plan (given or the default: decode rows of up to 2^21 blocks,
        prefill calls of up to 2^20 packed keys, at topk 512) that cannot run this call.
    """
    return _decode_entry("indexer_topk_decode", q, k_cache, page_table, seq_lens, topk,
                         compress_ratio, strict, plan, expand=False)


def indexer_select_decode(q: torch.Tensor, k_cache: torch.Tensor, page_table: torch.Tensor,
                          seq_lens: torch.Tensor, *, topk: int = 512, compress_ratio: int = 4,
                          strict: bool = False, plan: IndexerPlan | None = None) -> torch.Tensor:
    """The whole decode indexer: ``indexer_topk_decode`` (same arguments and errors) with the
    expansion fused into its merge (row position ``seq_lens[b] - 1``, bound ``seq_lens[b]``).
    Returns int32 [B, topk * ratio + ratio - 1] (2051): ``interop.indices.expand_block_indices``
    of ``indexer_topk_decode``'s output, the ``indices`` of ``sparse_decode_paged``."""
    return _decode_entry("indexer_select_decode", q, k_cache, page_table, seq_lens, topk,
                         compress_ratio, strict, plan, expand=True)


def indexer_topk_prefill(q: torch.Tensor, k: torch.Tensor, row_starts: torch.Tensor,
                         row_ends: torch.Tensor, *, topk: int = 512, compress_ratio: int = 4,
                         strict: bool = False, plan: IndexerPlan | None = None) -> torch.Tensor:
    """Prefill indexer: each row's exact top-k over its packed compressed-key range.

    Row m scores key rows ``[row_starts[m], row_ends[m])`` of ``k`` (intersected with ``[0, N)``;
    ``interop.indices.prefill_row_ranges`` builds them); ids are relative to ``row_starts[m]``.
    Rows go in static groups that bound the candidate workspace (``plan_indexer``).

    Args:
      q: [T, H, D] bf16|fp16|fp8 e4m3; k: [N, 1, D] q's dtype or fp8 e4m3, contiguous.
      row_starts, row_ends: int32 [T] (device data).
      topk, compress_ratio, strict, plan: as ``indexer_topk_decode``.

    Returns:
      int32 [T, topk], ascending row-relative block ids, -1 after.

    Raises:
      ContractError: as ``indexer_topk_decode`` (``check_indexer_prefill``).
    """
    return _prefill_entry("indexer_topk_prefill", q, k, row_starts, row_ends, None, None, topk,
                          compress_ratio, strict, plan, expand=False)


def indexer_select_prefill(q: torch.Tensor, k: torch.Tensor, row_starts: torch.Tensor,
                           row_ends: torch.Tensor, positions: torch.Tensor,
                           seq_lens: torch.Tensor, *, topk: int = 512, compress_ratio: int = 4,
                           strict: bool = False, plan: IndexerPlan | None = None
                           ) -> torch.Tensor:
    """The whole prefill indexer: ``indexer_topk_prefill`` (same arguments and errors) with the
    expansion fused into its merge. ``positions``, ``seq_lens``: int32 [T], each row's position
    p and validity bound (its request's length). Returns int32 [T, topk * ratio + ratio - 1]
    (2051), ``expand_block_indices`` of ``indexer_topk_prefill``'s output: the ``indices`` the
    sparse prefill kernels take."""
    return _prefill_entry("indexer_select_prefill", q, k, row_starts, row_ends, positions,
                          seq_lens, topk, compress_ratio, strict, plan, expand=True)


def expand_block_indices(block_ids: torch.Tensor, positions: torch.Tensor,
                         seq_lens: torch.Tensor, *, compress_ratio: int = 4,
                         strict: bool = False) -> torch.Tensor:
    """Block ids -> token positions (``qsa-contract.md`` §4), one Triton program per row: every
    id g >= 0 gives tokens ``ratio*g ..`` (< seq_len, else -1), then the causal tail
    ``[floor((p + 1) / ratio) * ratio, p]`` (< seq_len), valid entries stably first; equal to
    ``interop.indices.expand_block_indices(block_ids, positions, seq_lens, ratio=compress_ratio,
    token_topk=topk * compress_ratio)`` for any input (that reference's defaults are top-512,
    ratio 4).

    Args: int32 ``block_ids`` [M, topk] contiguous (topk = ``block_ids.shape[1]``), int32
    ``positions`` and ``seq_lens`` [M]; ``compress_ratio``: tokens per block (2..16); ``strict``:
    also enforce the qualified envelope (topk 512, ratio 4). Returns int32 [M, topk *
    compress_ratio + compress_ratio - 1]. Raises ContractError before any launch
    (``interop.contract.check_expand_block_indices``; a CPU tensor without the interpreter).
    Source: upstream ``sglang/srt/layers/attention/qsa/kernel.py``'s expansion, re-derived.
    """
    fn = "expand_block_indices"
    if not torch.compiler.is_compiling():
        check_torch_tensors(fn, block_ids=block_ids, positions=positions, seq_lens=seq_lens)
        check_expand_block_indices(block_ids, positions, seq_lens, compress_ratio=compress_ratio,
                                   strict=strict, fn=fn)
        check_device(fn, block_ids.device.type, "block_ids")
    return torch.ops.qsa.expand_block_indices(block_ids, positions, seq_lens, compress_ratio,
                                              bool(strict))
