"""The QSA indexer for JAX: block scoring, exact top-k and expansion, Pallas on the Triton lowering.

Semantics: ``qsa-contract.md`` §4b and §4; FP64 references ``interop.reference.indexer_*``. Same
names, argument order, plan (``interop.indices.plan_indexer``) and two-pass algorithm (chunked
scoring into int32 keys, radix select of the exact top-k, merge with optional fused expansion)
as ``qsa_triton.indexer``: read its module docstring for the design, sources and bytes moved.

JAX specifics: lengths and row ranges are traced int32 inputs (no scalar prefetch in the Triton
lowering) and every data-dependent loop has a device-computed trip count (``fori_loop`` /
``while_loop``), so one jitted function serves every length; the entry points are jit-native and
work under ``lax.scan`` and ``shard_map`` (VMA check off). In interpret mode (CPU) a masked
scatter writes back the old value at masked lanes
(``jax._src.pallas.primitives._swap_discharge_rule``), which can clobber a written lane with the
same index, so every scatter sends its masked lanes to one spare slot past the data; on the GPU
masked lanes write nothing. The streamed pass 1's fixup and the compacting merge write the
workspace in place: those calls alias it from inputs to outputs (``input_output_aliases``), and
the merge's CTA barrier is ``debug_barrier`` (nothing in interpret mode, which runs a program's
ops in order). The standalone ``expand_block_indices`` is plain ``jnp`` (cumsum + scatter); the
fused paths expand inside the merge kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from interop.arch import DeviceFacts
from interop.contract import (check_expand_block_indices, check_indexer_decode, check_indexer_plan,
                              check_indexer_prefill)
from interop.indices import BOUND_MARGIN_ULPS, INDEXER_API, IndexerPlan, plan_indexer
from interop.plan import next_pow2 as _next_pow2

from . import _compat as C

__all__ = list(INDEXER_API)

_INT32_MAX = 2**31 - 1


def _target() -> tuple[int, int]:
    """(SM count, shared memory per block) of the target GPU; an H200's on a CPU-only jax."""
    facts = C.target_facts()
    if facts is None:
        return 132, 232_448
    return facts.sm_count, facts.smem_per_block


def indexer_plan_for(kind: str, rows: int, max_blocks: int, topk: int,
                     device=None) -> IndexerPlan:
    """The shared static plan (``interop.indices.plan_indexer``, the Pallas build's prefill merge
    width) for ``kind`` ("decode" | "prefill"), ``rows`` query rows, ``max_blocks`` compressed
    blocks a row may score and ``topk``, on ``device`` (a jax GPU device; None: the GPU being
    built for, ``_compat.target_facts``; an H200's SMs and shared memory on a CPU-only jax), as
    ``qsa_triton.indexer_plan_for``. Raises ValueError as ``plan_indexer``. Source:
    ``interop.indices.plan_indexer`` (its rules and measurements)."""
    if device is None:
        sms, smem = _target()
    else:
        facts = DeviceFacts.from_jax(device)
        sms, smem = facts.sm_count, facts.smem_per_block
    return plan_indexer(kind, rows, max_blocks, topk, sm_count=sms, smem_per_block=smem,
                        backend="pallas")


# ---------------------------------------------------------------------------------------------
# Shared in-kernel helpers (traced inside the kernels): the exact top-k of int32 keys
def _rounds(rb: int) -> tuple[int, int]:
    """(rounds, bits of the first round) of a radix search over 31 bits, rb bits a round."""
    n = -(-31 // rb)
    return n, 31 - rb * (n - 1)


def _radix_start(lb, top, rb: int):
    """(first round, tau so far) for a row whose k-th key lies in [``lb``, ``top``] (int32
    scalars >= 0): ``qsa_triton.indexer._radix_start`` (the rounds whose digits lie in the bits
    ``lb`` and ``top`` share are taken from ``lb``)."""
    n_rounds, _ = _rounds(rb)
    diff = lb ^ top
    r0 = jnp.int32(0)
    for r in range(n_rounds):
        r0 = r0 + ((diff >> (rb * (n_rounds - 1 - r))) == 0).astype(jnp.int32)
    lo = jnp.minimum(rb * (n_rounds - r0), 31)  # the lowest bit the skipped rounds set
    return r0, jnp.where(r0 > 0, jnp.left_shift(jnp.right_shift(lb, lo), lo), 0)


def _kth_key_row(keys, k: int, rb: int, run, start=None):
    """The k-th largest of ``keys`` [N] int32 (>= 0 visible, -1 not) as an int32 scalar, or the
    threshold counting exactly k keys where the search stops early (0 with fewer than k visible
    keys): ``qsa_triton.indexer._kth_key_row``'s radix search. ``run`` (traced bool): False
    skips the rounds (tau 0: the caller knows there are <= k keys). ``start``: None, or (first
    round, tau so far) from ``_radix_start``."""
    n_rounds, w0 = _rounds(rb)
    nj = IndexerPlan.thresholds(rb)
    if nj == 1:
        def round_(r, tau):
            lo = n_rounds - 1 - r
            cnt = jnp.sum((keys >= tau + jnp.left_shift(jnp.int32(1), lo)).astype(jnp.int32),
                          dtype=jnp.int32)
            return tau + jnp.left_shift((cnt >= k).astype(jnp.int32), lo), cnt == k
    else:
        ja = _iota((nj // 2, 1), 0) + 1  # digits 1 .. nj/2 in the low halves
        jb = ja + nj // 2  # nj/2 + 1 .. nj in the high halves

        def round_(r, tau):
            lo = rb * (n_rounds - 1 - r)
            lim = jnp.where(r == 0, jnp.int32(1 << w0), jnp.int32(1 << rb))
            # thresholds whose digit does not exist this round (or would overflow) count nothing
            ta = jnp.where(ja < lim, tau + jnp.left_shift(ja, lo), _INT32_MAX)
            tb = jnp.where(jb < lim, tau + jnp.left_shift(jb, lo), _INT32_MAX)
            ge = ((keys[None, :] >= ta).astype(jnp.int32)
                  + jnp.left_shift((keys[None, :] >= tb).astype(jnp.int32), 16))
            cnt = jnp.sum(ge, axis=1, dtype=jnp.int32)  # [nj / 2], two counts each
            ok = ((cnt & 0xFFFF) >= k).astype(jnp.int32) + ((cnt >> 16) >= k).astype(jnp.int32)
            hit = ((cnt & 0xFFFF) == k).astype(jnp.int32) + ((cnt >> 16) == k).astype(jnp.int32)
            return (tau + jnp.left_shift(jnp.sum(ok, dtype=jnp.int32), lo),
                    jnp.sum(hit, dtype=jnp.int32) > 0)

    def body(carry):  # the early exit of qsa_triton.indexer._kth_key_row
        r, tau, _ = carry
        tau, hit = round_(r, tau)
        return r + 1, tau, (r + 1 < n_rounds) & ~hit

    r0, tau0 = (jnp.int32(0), jnp.int32(0)) if start is None else start
    r0 = jnp.asarray(r0, jnp.int32)
    _, tau, _ = lax.while_loop(lambda c: c[2], body,
                               (r0, jnp.where(run, tau0, 0).astype(jnp.int32),
                                run & (r0 < n_rounds)))
    return tau


def _kth_key(keys, k: int, rb: int, run):
    """``_kth_key_row`` per row of ``keys`` [R, N] -> int32 [R] (1-bit rounds: one [R, N]
    compare-and-sum each; wider rounds one [R, NJ, N])."""
    n_rounds, w0 = _rounds(rb)
    nj = IndexerPlan.thresholds(rb)
    if nj == 1:
        def round_(r, tau):
            lo = n_rounds - 1 - r
            thr = tau + jnp.left_shift(jnp.int32(1), lo)
            cnt = jnp.sum((keys >= thr[:, None]).astype(jnp.int32), axis=1, dtype=jnp.int32)
            return tau + jnp.left_shift((cnt >= k).astype(jnp.int32), lo), cnt == k
    else:
        jj = _iota((1, nj), 1) + 1

        def round_(r, tau):
            lo = rb * (n_rounds - 1 - r)
            lim = jnp.where(r == 0, jnp.int32(1 << w0), jnp.int32(1 << rb))
            thr = jnp.where(jj < lim, tau[:, None] + jnp.left_shift(jj, lo), _INT32_MAX)
            cnt = jnp.sum((keys[:, None, :] >= thr[:, :, None]).astype(jnp.int32), axis=2,
                          dtype=jnp.int32)
            return (tau + jnp.left_shift(jnp.sum((cnt >= k).astype(jnp.int32), axis=1,
                                                   dtype=jnp.int32), lo),
                    jnp.max((cnt == k).astype(jnp.int32), axis=1) > 0)

    def body(carry):  # qsa_triton.indexer._kth_key's early exit once every row is settled
        r, tau, settled, _ = carry
        tau, hit = round_(r, tau)
        settled = settled | hit
        return r + 1, tau, settled, (r + 1 < n_rounds) & (jnp.min(settled.astype(jnp.int32)) == 0)

    settled = jnp.sum((keys >= 0).astype(jnp.int32), axis=1, dtype=jnp.int32) <= k
    carry = (jnp.int32(0), jnp.zeros((keys.shape[0],), jnp.int32), settled,
             run & (jnp.min(settled.astype(jnp.int32)) == 0))  # (no reduce_and in the lowering)
    return lax.while_loop(lambda c: c[3], body, carry)[1]


def _select(keys, tau, k: int):
    """Exact top-k of ``keys`` [..., N] given ``_kth_key``'s ``tau`` [...], ties to the
    smaller index (``qsa_triton.indexer._select``'s rule, for one row or a tile of rows).
    Returns (sel [..., N] bool, slot [..., N] int32, count [...])."""
    above = (keys > tau[..., None]).astype(jnp.int32)
    tie = (keys == tau[..., None]).astype(jnp.int32)
    incl = jnp.cumsum(above + jnp.left_shift(tie, 16), axis=-1, dtype=jnp.int32)
    tot = jnp.max(incl, axis=-1)  # the last prefix: both totals
    want = k - (tot & 0xFFFF)  # ties kept
    t_ex = (incl >> 16) - tie
    sel = (above > 0) | ((tie > 0) & (t_ex < want[..., None]))
    slot = (incl & 0xFFFF) - above + jnp.minimum(t_ex, want[..., None])
    return sel, slot, (tot & 0xFFFF) + jnp.minimum(tot >> 16, want)


def _score_keys(tot):
    """FP32 head sums -> int32 order-preserving keys (+0.0 for -0.0 and NaN)."""
    return lax.bitcast_convert_type(jnp.where(tot > 0.0, tot, 0.0), jnp.int32)


def _iota(shape, dim):
    return lax.broadcasted_iota(jnp.int32, shape, dim)


# ---------------------------------------------------------------------------------------------
# Pass 1: decode
def _decode_chunk_kernel(q_ref, k_ref, pt_ref, seq_ref, wsk_ref, wsi_ref, *, h: int,
                         hp: int, d: int, psz: int, ratio: int, k: int, c: int, t: int, s_n: int,
                         pages: int, cap: int, rb: int, compute, trash: int):
    b = pl.program_id(0)
    s = pl.program_id(1)
    nb = jnp.minimum(jnp.maximum(seq_ref[b], 0) // ratio, cap)
    lo = s * c
    n_here = jnp.clip(nb - lo, 0, c)
    nt_n = c // t
    dcol = _iota((1, d), 1)
    tt = _iota((t,), 0)
    nt2 = _iota((nt_n, 1), 0)
    ids = _iota((nt_n, t), 0) * t + _iota((nt_n, t), 1)

    def body():  # a chunk past the row's blocks does nothing (as qsa_triton's twin)
        hid = _iota((hp, d), 0)
        # Padded heads load as 0: their dot is 0, ReLU(0) = 0, so they add nothing.
        q = C.load(q_ref.at[b, pl.ds(0, hp), :], mask=hid < h, other=0.0).astype(compute)

        def tile(i, keys):
            blk = lo + i * t + tt
            ok = blk < nb
            pid = C.load(pt_ref.at[b, jnp.where(ok, blk // psz, 0)], mask=ok, other=0)
            # A page id outside the cache is a caller bug: its blocks read nothing (score 0).
            pok = ok & (pid >= 0) & (pid < pages)
            row = jnp.where(pok, pid * psz + blk % psz, 0)
            kt = C.load(k_ref.at[row[:, None], dcol], mask=pok[:, None],
                        other=0.0).astype(compute)
            sc = C.dot(kt, q, trans_b=True)  # [t, hp] fp32: the key tile is the MMA's M side
            key = jnp.where(ok, _score_keys(jnp.sum(jnp.maximum(sc, 0.0), axis=1)), -1)
            return jnp.where(nt2 == i, key[None, :], keys)

        # A row with <= k blocks keeps all of them: nothing is loaded or scored.
        n_tiles = jnp.where(nb > k, (n_here + (t - 1)) // t, 0).astype(jnp.int32)
        keys = lax.fori_loop(jnp.int32(0), n_tiles, tile, jnp.where(ids < n_here, 0, -1))
        keys = keys.reshape(c)
        tau = _kth_key_row(keys, k, rb, n_here > k)
        sel, pos, n_sel = _select(keys, tau, k)
        dest = jnp.where(sel, (b * s_n + s) * k + pos, trash)
        C.store(wsk_ref.at[dest], keys, mask=sel)
        C.store(wsi_ref.at[dest], lo + ids.reshape(c), mask=sel)
        # the chunk's unused slots read as "no candidate" (-1): the merge needs no counts
        j = _iota((k,), 0)
        pad = (j >= n_sel) & (n_here > 0)
        C.store(wsk_ref.at[jnp.where(pad, (b * s_n + s) * k + j, trash)],
                jnp.full((k,), -1, jnp.int32), mask=pad)

    pl.when(n_here > 0)(body)


# ---------------------------------------------------------------------------------------------
# Pass 1: prefill (bm rows per program share every key tile)
def _prefill_chunk_kernel(*refs, h: int, hp: int, d: int, k: int, c: int, t: int, s_n: int,
                          bm: int, n_rows: int, n_keys: int, rb: int, compute, trash: int,
                          bound: int = 0, counts: int = 0, cnt_trash: int = 0):
    # bound: 0 plain pass 1; 1 pass 1 with each row's lower bound of its k-th key (an input);
    # 2 the bound pass: chunk 0 only, its k-th key per row as the output. counts (bound 1): 1
    # streams the keys >= the bound and counts them, 2 the fixup (in place: the workspace and
    # counts are aliased inputs) redoes the tiles with a chunk counted past k (qsa_triton's twin)
    cnt_ref = None
    if bound == 2:
        q_ref, k_ref, rs_ref, re_ref, lb_out = refs
    elif counts:
        q_ref, k_ref, rs_ref, re_ref, lb_ref, *_, wsk_ref, wsi_ref, cnt_ref = refs
    elif bound == 1:
        q_ref, k_ref, rs_ref, re_ref, lb_ref, wsk_ref, wsi_ref = refs
    else:
        q_ref, k_ref, rs_ref, re_ref, wsk_ref, wsi_ref = refs
    pid_m = pl.program_id(0)
    s = pl.program_id(1)
    rloc = pid_m * bm + _iota((bm,), 0)
    rok = rloc < n_rows
    safe_r = jnp.where(rok, rloc, 0)
    rs = C.load(rs_ref.at[safe_r], mask=rok, other=0)
    re = C.load(re_ref.at[safe_r], mask=rok, other=0)
    lo = jnp.maximum(rs, 0)
    n_vis = jnp.where(rok, jnp.maximum(jnp.minimum(re, n_keys) - lo, 0), 0)
    c0 = s * c
    n_here = jnp.clip(n_vis - c0, 0, c)
    cslot = jnp.where(rok & (n_here > 0), rloc * s_n + s, cnt_trash)  # the rows' count slots
    todo0 = n_here > 0
    if counts == 2:  # the fixup: nothing to do unless a row of the tile streamed more than k
        streamed = C.load(cnt_ref.at[cslot], mask=todo0, other=0)
        todo0 = todo0 & (jnp.max(streamed) > k)
    lb = C.load(lb_ref.at[safe_r], mask=rok, other=0) if bound == 1 else None

    def body():
        slot0 = (rloc * s_n + s) * k
        rel0 = lo - rs + c0  # the row-relative id of the chunk's first block
        nt_n = c // t
        hb = hp * bm
        # All heads of the tile's rows stacked as one MMA operand, head-major: i = head * bm + m.
        i = _iota((hb, 1), 0)
        qrow = pid_m * bm + i % bm
        qmask = ((i // bm) < h) & (qrow < n_rows)
        dcol = _iota((1, d), 1)
        q = C.load(q_ref.at[jnp.where(qmask, qrow, 0), jnp.where(qmask, i // bm, 0), dcol],
                   mask=jnp.broadcast_to(qmask, (hb, d)), other=0.0).astype(compute)
        tt = _iota((t,), 0)
        nt3 = _iota((1, nt_n, t), 1)

        # Rows of one request share their key rows; a tile straddling requests takes one segment
        # (rows with the same first key row) at a time.
        def seg_cond(carry):
            todo, _ = carry
            return jnp.max(todo.astype(jnp.int32)) > 0

        def seg_body(carry):
            todo, acc = carry
            base = jnp.min(jnp.where(todo, lo, _INT32_MAX))
            seg = todo & (lo == base)
            seg_n = jnp.max(jnp.where(seg, n_here, 0))
            # rows with <= k visible blocks keep them all: a segment of only such rows is skipped
            seg_score = jnp.max(jnp.where(seg, n_vis, 0)) > k

            def tile(ti, acc):
                j = ti * t + tt
                jok = j < seg_n
                kr = jnp.where(jok, base + c0 + j, 0)
                kt = C.load(k_ref.at[kr[:, None], dcol], mask=jok[:, None], other=0.0)
                sc = C.dot(q, kt.astype(compute), trans_b=True)  # [hb, t]
                tot = jnp.sum(jnp.maximum(sc, 0.0).reshape(hp, bm, t), axis=0)  # [bm, t]
                valid = seg[:, None] & (j[None, :] < n_here[:, None])
                key = jnp.where(valid, _score_keys(tot), -1)
                if counts == 1:  # acc: keys >= the bound so far per row; the first k go to slots
                    take = (valid & (n_vis > k)[:, None] & (key >= lb[:, None])).astype(jnp.int32)
                    at = acc[:, None] + jnp.cumsum(take, axis=1, dtype=jnp.int32) - take
                    put = (take > 0) & (at < k)
                    dest = jnp.where(put, slot0[:, None] + at, trash)
                    C.store(wsk_ref.at[dest], key, mask=put)
                    C.store(wsi_ref.at[dest], rel0[:, None] + j[None, :], mask=put)
                    return acc + jnp.sum(take, axis=1, dtype=jnp.int32)
                put = (nt3 == ti) & seg[:, None, None]  # acc: the chunk's keys
                return jnp.where(put, key[:, None, :], acc)

            n_tiles = jnp.where(seg_score, (seg_n + (t - 1)) // t, 0).astype(jnp.int32)
            acc = lax.fori_loop(jnp.int32(0), n_tiles, tile, acc)
            return todo & ~seg, acc

        acc0 = (jnp.zeros((bm,), jnp.int32) if counts == 1
                else jnp.full((bm, nt_n, t), -1, jnp.int32))
        _, acc = lax.while_loop(seg_cond, seg_body, (todo0, acc0))
        if counts == 1:
            # rows with <= k visible blocks: all of them, key 0 (as pass 1 takes them)
            j = _iota((1, k), 1)
            few = (n_vis <= k)[:, None] & (j < n_here[:, None])
            dest = jnp.where(few, slot0[:, None] + j, trash)
            C.store(wsk_ref.at[dest], jnp.zeros((bm, k), jnp.int32), mask=few)
            C.store(wsi_ref.at[dest], rel0[:, None] + j, mask=few)
            C.store(cnt_ref.at[cslot], jnp.where(n_vis > k, acc, n_here), mask=n_here > 0)
            return
        keys = acc
        ids = (_iota((nt_n, t), 0) * t + _iota((nt_n, t), 1)).reshape(1, c)
        keys = keys.reshape(bm, c)
        keys = jnp.where((n_vis > k)[:, None], keys, jnp.where(ids < n_here[:, None], 0, -1))
        run = jnp.max(jnp.where(todo0, n_here, 0)) > k
        if bound == 1:
            # every block of a row's top-k has a key >= the row's bound: where at most k keys of
            # each row pass it, the bound is the threshold (the radix rounds do not run)
            fits = jnp.sum((keys >= lb[:, None]).astype(jnp.int32), axis=1, dtype=jnp.int32) <= k
            all_fit = jnp.min(fits.astype(jnp.int32)) > 0
            tau = jnp.where(all_fit, lb, _kth_key(keys, k, rb, run & ~all_fit))
        else:
            tau = _kth_key(keys, k, rb, run)
        if bound == 2:  # the sample's k-th key (0: <= k visible); row n_rows is the spare slot
            C.store(lb_out.at[jnp.where(rok, rloc, n_rows)],
                    jnp.maximum(tau - BOUND_MARGIN_ULPS, 0))
            return
        sel, pos, n_sel = _select(keys, tau, k)
        sel = sel & todo0[:, None]  # (the fixup rewrites only the tiles it redoes)
        dest = jnp.where(sel, slot0[:, None] + pos, trash)
        C.store(wsk_ref.at[dest], keys, mask=sel)
        C.store(wsi_ref.at[dest], rel0[:, None] + ids, mask=sel)  # row-relative block ids
        if counts:
            C.store(cnt_ref.at[cslot], n_sel, mask=todo0)
        else:
            j = _iota((1, k), 1)  # unused slots of the rows' chunks: -1 (no candidate)
            pad = (j >= n_sel[:, None]) & (n_here > 0)[:, None]
            C.store(wsk_ref.at[jnp.where(pad, slot0[:, None] + j, trash)],
                    jnp.full((bm, k), -1, jnp.int32), mask=pad)

    if bound == 2:  # every row's bound is written (0 where nothing is visible)
        body()
    else:  # qsa_triton's twin: a program with no row to do (the fixup's usual case) exits
        pl.when(jnp.max(todo0.astype(jnp.int32)) > 0)(body)


# ---------------------------------------------------------------------------------------------
# Pass 2: merge (+ optional fused expansion)
def _chunk_group(wsk_ref, cnt_ref, base, crow, nch, g, k: int, cg: int):
    """``qsa_triton.indexer._chunk_group``: (keys [cg, k], slots, counted mask)."""
    ch = g * cg + _iota((cg, 1), 0)
    j = _iota((1, k), 1)
    m = j < C.load(cnt_ref.at[jnp.where(ch < nch, crow + ch, 0)], mask=ch < nch, other=0)
    src = base + ch * k + j
    return C.load(wsk_ref.at[jnp.where(m, src, 0)], mask=m, other=-1), src, m


def _kth_key_chunks(wsk_ref, cnt_ref, base, crow, nch, lb, k: int, cg: int, run):
    """``qsa_triton.indexer._kth_key_chunks`` (``run`` False: no loop runs): (tau, ties kept)."""
    on = run.astype(jnp.int32)  # int32 loop bounds (a weakly typed where() lowers to i1)
    n_groups = on * ((nch + cg - 1) // cg).astype(jnp.int32)

    def over_groups(fn):
        return lax.fori_loop(jnp.int32(0), n_groups, lambda g, acc: acc + fn(
            _chunk_group(wsk_ref, cnt_ref, base, crow, nch, g, k, cg)[0]), jnp.int32(0))

    top = lax.fori_loop(jnp.int32(0), n_groups, lambda g, acc: jnp.maximum(acc, jnp.max(
        _chunk_group(wsk_ref, cnt_ref, base, crow, nch, g, k, cg)[0])), jnp.int32(0))
    r0, tau0 = _radix_start(lb, top, 1)

    def body(carry):  # with _kth_key_row's early exit
        rr, tau, _ = carry
        thr = tau + jnp.left_shift(jnp.int32(1), 30 - rr)
        n_ge = over_groups(lambda kk: jnp.sum((kk >= thr).astype(jnp.int32), dtype=jnp.int32))
        return (rr + 1, tau + jnp.left_shift((n_ge >= k).astype(jnp.int32), 30 - rr),
                (rr + 1 < 31) & (n_ge != k))

    r0 = r0.astype(jnp.int32)
    _, tau, _ = lax.while_loop(lambda c: c[2], body,
                               (r0, tau0.astype(jnp.int32), run & (r0 < 31)))
    n_above = over_groups(lambda kk: jnp.sum((kk > tau).astype(jnp.int32), dtype=jnp.int32))
    return tau, k - n_above


def _compact(wsk_ref, wsi_ref, cnt_ref, base, crow, nch, tau, want, k: int, cg: int,
             trash: int, interpret: bool):
    """``qsa_triton.indexer._compact``: the row's counted candidates with key > ``tau`` and its
    first ``want`` with key == ``tau`` to the front of its workspace, in slot order, in place;
    returns how many."""
    def body(g, carry):
        n_above, n_tie = carry
        kk, src, m = _chunk_group(wsk_ref, cnt_ref, base, crow, nch, g, k, cg)
        ii = C.load(wsi_ref.at[jnp.where(m, src, 0)], mask=m, other=0)
        above = ((kk > tau) & m).astype(jnp.int32)
        tie = ((kk == tau) & m).astype(jnp.int32)
        incl = jnp.cumsum((above + jnp.left_shift(tie, 16)).reshape(cg * k),
                          dtype=jnp.int32).reshape(cg, k)
        a_ex = n_above + (incl & 0xFFFF) - above
        t_ex = n_tie + (incl >> 16) - tie
        keep = (above > 0) | ((tie > 0) & (t_ex < want))
        dest = jnp.where(keep, base + a_ex + jnp.minimum(t_ex, want), trash)
        C.barrier(interpret)  # every thread has read the group before any slot is overwritten
        C.store(wsk_ref.at[dest], kk, mask=keep)
        C.store(wsi_ref.at[dest], ii, mask=keep)
        last = jnp.max(incl)
        return n_above + (last & 0xFFFF), n_tie + (last >> 16)

    n_groups = ((nch + cg - 1) // cg).astype(jnp.int32)
    n_above, n_tie = lax.fori_loop(jnp.int32(0), n_groups, body, (jnp.int32(0), jnp.int32(0)))
    C.barrier(interpret)  # the compacted candidates are visible to every thread
    return n_above + jnp.minimum(n_tie, want)


def _merge_kernel(*refs, prefill: bool, expand: bool, ratio: int, k: int, c: int, s_n: int,
                  sp: int, w: int, wp: int, cap: int, rb: int, trash: int,
                  from_bound: bool = False, chunk_lb: bool = False, ncap: int = 0, cg: int = 1,
                  ws_trash: int = 0, interpret: bool = False):
    # inputs: the workspace, the row metadata, [each row's bound of its k-th key (the bound
    # pass's output)], [ncap: the candidate counts]; outputs: the rows [, ncap: the workspace,
    # aliased to the inputs (compacted in place)]
    n_meta = 4 if prefill and expand else 2 if prefill else 1
    n_in = 2 + n_meta + int(from_bound) + int(bool(ncap))
    ins, outs = refs[:n_in], refs[n_in:]
    wsk_ref, wsi_ref = outs[1:] if ncap else ins[:2]
    m0_ref, m1_ref, pos_ref, bound_ref = (ins[2:2 + n_meta] + (None,) * 3)[:4]
    lb_ref = ins[2 + n_meta] if from_bound else None
    cnt_ref = ins[-1] if ncap else None
    o_ref = outs[0]
    r = pl.program_id(0)
    if prefill:
        rs = m0_ref[r]
        n = jnp.maximum(jnp.minimum(m1_ref[r], cap) - jnp.maximum(rs, 0), 0)
    else:
        seq = jnp.maximum(m0_ref[r], 0)
        n = jnp.minimum(seq // ratio, cap)
    # candidate slot = chunk * k + rank in the chunk: orders like the block id; a chunk's unused
    # slots hold -1 (or are not counted)
    base = r * s_n * k
    if ncap:
        crow = r * s_n
        nch = (n + (c - 1)) // c
        cc = _iota((sp,), 0)
        total = jnp.sum(C.load(cnt_ref.at[jnp.where(cc < nch, crow + cc, 0)], mask=cc < nch,
                               other=0), dtype=jnp.int32)
        # past the tile, only the row's exact top-k is kept; else every candidate (tau -1)
        over = total > ncap
        lbr = lb_ref[r] if from_bound else jnp.int32(0)
        tau_f, want_f = _kth_key_chunks(wsk_ref, cnt_ref, base, crow, nch, lbr, k, cg, over)
        n_c = _compact(wsk_ref, wsi_ref, cnt_ref, base, crow, nch,
                       jnp.where(over, tau_f, -1), jnp.where(over, want_f, 0), k, cg, ws_trash,
                       interpret)
        slot = _iota((ncap,), 0)
        has = slot < n_c
    else:
        slot = _iota((sp * k,), 0)
        has = slot // k < (n + (c - 1)) // c
    src = jnp.where(has, base + slot, 0)
    keys = C.load(wsk_ref.at[src], mask=has, other=-1)
    blk = C.load(wsi_ref.at[src], mask=has, other=0)
    # the row's k-th key is in [a lower bound, its largest candidate]: from_bound, the bound
    # pass's; chunk_lb (decode), the largest chunk k-th key: a chunk holding k candidates holds
    # its own k-th key as its smallest (one with fewer holds -1)
    lbr = (lb_ref[r] if from_bound else
           jnp.max(jnp.min(keys.reshape(sp, k), axis=1)) if chunk_lb else None)
    start = _radix_start(lbr, jnp.max(keys), rb) if lbr is not None else None
    tau = _kth_key_row(keys, k, rb, jnp.sum((keys >= 0).astype(jnp.int32), dtype=jnp.int32) > k,
                       start)
    sel, pos, n_sel = _select(keys, tau, k)
    if expand:
        if prefill:
            p = pos_ref[r]
            bound = bound_ref[r]
        else:
            p = seq - 1
            bound = seq
        # Everything is ascending: the valid tokens (< bound) of the selected blocks are a prefix;
        # the causal tail [floor(L/R)*R, p] follows, then -1.
        e = _iota((1, _next_pow2(ratio)), 1)
        tok = blk[:, None] * ratio + e
        ok = sel[:, None] & (e < ratio) & (tok < bound)
        C.store(o_ref.at[r, jnp.where(ok, pos[:, None] * ratio + e, trash)], tok, mask=ok)
        m = jnp.sum(jnp.where(sel, jnp.clip(bound - blk * ratio, 0, ratio), 0), dtype=jnp.int32)
        # tail [start, p], start the largest multiple of ratio <= p + 1, written without p + 1
        # (a position of 2^31 - 1 must not wrap): none for p < 0, tokens < bound only
        r1 = p % ratio  # floor modulo
        start = p - r1
        n_tail = jnp.int32(0)
        for e in range(ratio - 1):
            n_tail = n_tail + ((p >= 0) & (e <= r1) & (r1 < ratio - 1)
                               & (start + e < bound)).astype(jnp.int32)
        col = _iota((wp,), 0)
        off = col - m
        val = jnp.where(off < n_tail, start + off, -1)
        tail_ok = (col >= m) & (col < w)
        C.store(o_ref.at[r, jnp.where(tail_ok, col, trash)], val, mask=tail_ok)
    else:
        C.store(o_ref.at[r, jnp.where(sel, pos, trash)], blk, mask=sel)
        j = _iota((k,), 0)
        pad = j >= n_sel
        C.store(o_ref.at[r, jnp.where(pad, j, trash)], jnp.full((k,), -1, jnp.int32), mask=pad)


# ---------------------------------------------------------------------------------------------
# Launchers (jitted; every shape-derived choice is static)
def _workspace(rows: int, plan: IndexerPlan, interpret: bool):
    """(key and id workspace shapes, trash slot): interpret mode adds the masked-scatter spare
    slot (module docstring); on the GPU masked lanes write nothing."""
    n = rows * plan.splits * plan.topk
    sds = jax.ShapeDtypeStruct((n + 1 if interpret else n,), jnp.int32)
    return (sds, sds), n


def _merge(ws, metas, rows: int, plan: IndexerPlan, *, prefill: bool, expand: bool, ratio: int,
           cap: int, interpret: bool, lb=None, cnt=None):
    """The merge launch; ``cnt`` (the candidate counts, ``plan.merge_capacity``): it compacts
    the workspace ``ws`` in place (aliased)."""
    k = plan.topk
    w = k * ratio + ratio - 1 if expand else k
    spare = 1 if interpret else 0
    out_w = w + spare
    ncap = plan.merge_capacity if cnt is not None else 0
    kern = functools.partial(
        _merge_kernel, prefill=prefill, expand=expand, ratio=ratio, k=k, c=plan.chunk,
        s_n=plan.splits, sp=plan.splits_pad, w=w, wp=_next_pow2(w), cap=cap,
        rb=plan.merge_radix_bits, trash=out_w - 1 if interpret else w, from_bound=lb is not None,
        chunk_lb=not prefill and plan.merge_from_bound, ncap=ncap, cg=plan.compact_chunks,
        ws_trash=ws[0].shape[0] - 1, interpret=interpret)
    ins = (*ws, *metas) + ((lb,) if lb is not None else ()) + ((cnt,) if ncap else ())
    out_shape = jax.ShapeDtypeStruct((rows, out_w), jnp.int32)
    if ncap:
        out_shape = (out_shape, *(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in ws))
    out = C.triton_call(kern, out_shape=out_shape, grid=(rows,), num_warps=plan.merge_warps,
                        num_stages=1, interpret=interpret, name="qsa_indexer_merge",
                        input_output_aliases={0: 1, 1: 2} if ncap else None)(*ins)
    out = out[0] if ncap else out
    return out[:, :w] if spare else out


@functools.partial(jax.jit, static_argnames=("topk", "ratio", "expand", "interpret", "target",
                                             "plan"))
def _decode(q, k_cache, page_table, seq_lens, *, topk: int, ratio: int, expand: bool,
            interpret: bool, target: tuple[int, int], plan: IndexerPlan | None = None):
    b, h, d = q.shape
    pages, psz = k_cache.shape[0], k_cache.shape[1]
    cap = page_table.shape[1] * psz
    plan = plan or plan_indexer("decode", b, cap, topk, sm_count=target[0],
                                smem_per_block=target[1], backend="pallas")
    compute = jnp.bfloat16 if q.dtype == jnp.float8_e4m3fn else q.dtype
    k2 = k_cache.reshape(pages * psz, d) if pages * psz else jnp.zeros((1, d), k_cache.dtype)
    shapes, trash = _workspace(b, plan, interpret)
    kern = functools.partial(
        _decode_chunk_kernel, h=h, hp=max(16, _next_pow2(h)), d=d, psz=psz, ratio=ratio, k=topk,
        c=plan.chunk, t=plan.tile, s_n=plan.splits, pages=pages, cap=cap,
        rb=plan.radix_bits, compute=compute, trash=trash)
    ws = C.triton_call(kern, out_shape=shapes, grid=(b, plan.splits), num_warps=plan.num_warps,
                       num_stages=plan.num_stages, interpret=interpret,
                       name="qsa_indexer_decode_chunk")(q, k2, page_table, seq_lens)
    return _merge(ws, (seq_lens,), b, plan, prefill=False, expand=expand, ratio=ratio, cap=cap,
                  interpret=interpret)


@functools.partial(jax.jit, static_argnames=("topk", "ratio", "expand", "interpret", "target",
                                             "plan"))
def _prefill(q, k, row_starts, row_ends, positions, seq_lens, *, topk: int, ratio: int,
             expand: bool, interpret: bool, target: tuple[int, int],
             plan: IndexerPlan | None = None):
    t_rows, h, d = q.shape
    n_keys = k.shape[0]
    plan = plan or plan_indexer("prefill", t_rows, n_keys, topk, sm_count=target[0],
                                smem_per_block=target[1], backend="pallas")
    compute = jnp.bfloat16 if q.dtype == jnp.float8_e4m3fn else q.dtype
    k2 = k.reshape(n_keys, d) if n_keys else jnp.zeros((1, d), k.dtype)
    g = plan.row_group
    bm = plan.rows_per_program
    outs = []
    # Row groups bound the candidate workspace (static: from shapes only).
    for r0 in range(0, t_rows, g):
        r1 = min(t_rows, r0 + g)
        n = r1 - r0
        rs, re = row_starts[r0:r1], row_ends[r0:r1]
        shapes, trash = _workspace(n, plan, interpret)
        kern = functools.partial(
            _prefill_chunk_kernel, h=h, hp=_next_pow2(h), d=d, k=topk, c=plan.chunk,
            t=plan.tile, s_n=plan.splits, bm=bm, n_rows=n, n_keys=n_keys,
            rb=plan.radix_bits, compute=compute, trash=trash)
        extra, lb = (), None
        if plan.bound_chunk:  # the bound pass: two chunks' worth of keys, half the rows a program
            bm0 = max(4, bm * plan.chunk // plan.bound_chunk)
            lb = C.triton_call(
                functools.partial(kern, c=plan.bound_chunk, bm=bm0, s_n=1, bound=2),
                out_shape=jax.ShapeDtypeStruct((n + 1,), jnp.int32), grid=(-(-n // bm0), 1),
                num_warps=plan.num_warps, num_stages=plan.num_stages, interpret=interpret,
                name="qsa_indexer_prefill_bound")(q[r0:r1], k2, rs, re)
            kern, extra = functools.partial(kern, bound=1), (lb,)
        launch = functools.partial(
            C.triton_call, grid=(-(-n // bm), plan.splits), num_warps=plan.num_warps,
            num_stages=plan.num_stages, interpret=interpret, name="qsa_indexer_prefill_chunk")
        cnt = None
        if plan.merge_capacity:  # streamed, then the fixup in place; the counts' spare slot last
            n_cnt = n * plan.splits
            shapes = (*shapes, jax.ShapeDtypeStruct((n_cnt + 1 if interpret else n_cnt,),
                                                    jnp.int32))
            kern = functools.partial(kern, cnt_trash=n_cnt if interpret else 0)
            *ws, cnt = launch(functools.partial(kern, counts=1), out_shape=shapes)(
                q[r0:r1], k2, rs, re, *extra)
            *ws, cnt = launch(functools.partial(kern, counts=2), out_shape=shapes,
                              input_output_aliases={5: 0, 6: 1, 7: 2},
                              name="qsa_indexer_prefill_fixup")(
                                  q[r0:r1], k2, rs, re, *extra, *ws, cnt)
        else:
            ws = launch(kern, out_shape=shapes)(q[r0:r1], k2, rs, re, *extra)
        metas = (rs, re) + ((positions[r0:r1], seq_lens[r0:r1]) if expand else ())
        outs.append(_merge(tuple(ws), metas, n, plan, prefill=True, expand=expand, ratio=ratio,
                           cap=n_keys, interpret=interpret,
                           lb=lb if plan.merge_from_bound else None, cnt=cnt))
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=0)


# ---------------------------------------------------------------------------------------------
# Public entry points (same names and argument order as qsa_triton.indexer)
@C.forward_only
def indexer_topk_decode(q, k_cache, page_table, seq_lens, *, topk: int = 512,
                        compress_ratio: int = 4, strict: bool = False,
                        plan: IndexerPlan | None = None, interpret: bool | None = None):
    """Decode indexer: the exact top-k of each row's paged compressed key blocks by FP32 score
    ``sum_h ReLU(q[b, h] . k[n])``, as ``qsa_triton.indexer_topk_decode``.

    Args:
      q: [B, H, D] bf16|fp16|fp8 e4m3 jax array.
      k_cache: [pages, page_size, 1, D] q's dtype or fp8 e4m3.
      page_table: int32 [B, max_pages]; seq_lens: int32 [B] (traced; never read on the host).
      topk: blocks kept (512); compress_ratio: tokens per block (4).
      strict: enforce ``interop.contract.QUALIFIED_INDEXER``; plan: an ``IndexerPlan`` replacing
        the shared one (sweeps); interpret: None -> interpret mode on a CPU backend.

    Returns:
      int32 [B, topk]: selected block ids ascending, -1 after; a row with <= topk blocks gets all
      of them; ties go to the smaller block id (``interop.reference.indexer_topk``).

    Raises:
      ContractError: before anything is traced, ``interop.contract.check_indexer_decode``, or a
        plan (given or the default: decode rows of up to 2^21 blocks, prefill calls of up to
        2^20 packed keys, at topk 512) that cannot run this call; torch tensors; an
        ``interpret`` that is not None or a bool; ``interpret=False`` on a CPU-only jax.
    """
    return _decode_entry("indexer_topk_decode", q, k_cache, page_table, seq_lens, topk,
                         compress_ratio, strict, interpret, False, plan)


@C.forward_only
def indexer_select_decode(q, k_cache, page_table, seq_lens, *, topk: int = 512,
                          compress_ratio: int = 4, strict: bool = False,
                          plan: IndexerPlan | None = None, interpret: bool | None = None):
    """The whole decode indexer: ``indexer_topk_decode`` (same arguments and errors) with the
    expansion fused into the merge. Returns int32 [B, topk * ratio + ratio - 1] (2051) token
    positions ascending (position ``seq_lens[b] - 1``, bound ``seq_lens[b]``), -1 after: the
    ``indices`` of ``sparse_decode_paged``."""
    return _decode_entry("indexer_select_decode", q, k_cache, page_table, seq_lens, topk,
                         compress_ratio, strict, interpret, True, plan)


def _default_plan(prob):
    """``indexer_plan_for`` of an ``IndexerProblem`` (the entry points' and the steps' check)."""
    return indexer_plan_for(prob.kind, prob.rows, prob.max_blocks, prob.topk)


def _check_plan(fn, plan, prob):
    check_indexer_plan(fn, prob, plan, lambda: _default_plan(prob))


def _decode_entry(fn, q, k_cache, page_table, seq_lens, topk, ratio, strict, interpret, expand,
                  plan):
    C.check_inputs(fn, interpret, q=q, k_cache=k_cache, page_table=page_table, seq_lens=seq_lens)
    prob = check_indexer_decode(q, k_cache, page_table, seq_lens, topk=topk, compress_ratio=ratio,
                                strict=strict, fn=fn)
    C.check_backend(fn, interpret, q, k_cache, page_table, seq_lens)
    _check_plan(fn, plan, prob)
    return _decode(q, k_cache, page_table, seq_lens, topk=int(topk), ratio=int(ratio),
                   expand=expand, interpret=C.resolve_interpret(interpret),
                   target=_target(), plan=plan)


@C.forward_only
def indexer_topk_prefill(q, k, row_starts, row_ends, *, topk: int = 512, compress_ratio: int = 4,
                         strict: bool = False, plan: IndexerPlan | None = None,
                         interpret: bool | None = None):
    """Prefill indexer, as ``qsa_triton.indexer_topk_prefill``: row m's exact top-k over key rows
    ``[row_starts[m], row_ends[m])`` of ``k`` (within ``[0, N)``), ids relative to row_starts[m].

    Args:
      q: [T, H, D] bf16|fp16|fp8 e4m3; k: [N, 1, D] q's dtype or fp8 e4m3.
      row_starts, row_ends: int32 [T] (traced).
      topk, compress_ratio, strict, plan, interpret: as ``indexer_topk_decode``.

    Returns:
      int32 [T, topk], ascending row-relative block ids, -1 after.

    Raises:
      ContractError: before anything is traced (``interop.contract.check_indexer_prefill``),
        and as ``indexer_topk_decode`` (plan, torch tensors, ``interpret``).
    """
    return _prefill_entry("indexer_topk_prefill", q, k, row_starts, row_ends, None, None, topk,
                          compress_ratio, strict, interpret, False, plan)


@C.forward_only
def indexer_select_prefill(q, k, row_starts, row_ends, positions, seq_lens, *, topk: int = 512,
                           compress_ratio: int = 4, strict: bool = False,
                           plan: IndexerPlan | None = None, interpret: bool | None = None):
    """The whole prefill indexer: ``indexer_topk_prefill`` (same arguments and errors, plus
    ``positions``, ``seq_lens``: int32 [T], each row's position and validity bound) with the
    expansion fused into the merge. Returns int32 [T, topk * ratio + ratio - 1], equal to
    ``expand_block_indices`` of ``indexer_topk_prefill``'s output."""
    return _prefill_entry("indexer_select_prefill", q, k, row_starts, row_ends, positions,
                          seq_lens, topk, compress_ratio, strict, interpret, True, plan)


def _prefill_entry(fn, q, k, row_starts, row_ends, positions, seq_lens, topk, ratio, strict,
                   interpret, expand, plan):
    arrays = dict(q=q, k=k, row_starts=row_starts, row_ends=row_ends)
    if expand:
        arrays.update(positions=positions, seq_lens=seq_lens)
    C.check_inputs(fn, interpret, **arrays)
    prob = check_indexer_prefill(q, k, row_starts, row_ends, topk=topk, compress_ratio=ratio,
                                 positions=positions, seq_lens=seq_lens, strict=strict, fn=fn)
    C.check_backend(fn, interpret, *arrays.values())
    _check_plan(fn, plan, prob)
    if q.shape[0] == 0:
        return jnp.zeros((0, topk * ratio + ratio - 1 if expand else topk), jnp.int32)
    return _prefill(q, k, row_starts, row_ends, positions, seq_lens, topk=int(topk),
                    ratio=int(ratio), expand=expand, interpret=C.resolve_interpret(interpret),
                    target=_target(), plan=plan)


@functools.partial(jax.jit, static_argnames=("ratio",))
def _expand(block_ids, positions, seq_lens, *, ratio: int):
    m, k = block_ids.shape
    tok_n = k * ratio
    w = tok_n + ratio - 1
    g = block_ids.astype(jnp.int32)
    offs = jnp.arange(ratio, dtype=jnp.int32)
    bound = seq_lens.astype(jnp.int32)[:, None]
    # token g * ratio + e < bound, decided without forming it (a large id * ratio wraps around
    # int32): g <= (bound - 1 - e) // ratio, where bound > e
    tok = g[:, :, None] * ratio + offs
    b3 = bound[:, :, None]
    lim = jnp.where(b3 > offs, (jnp.maximum(b3, 1) - 1 - offs) // ratio, -1)
    ok = (g[:, :, None] >= 0) & (g[:, :, None] <= lim)
    tok = jnp.where(ok, tok, -1).reshape(m, tok_n)
    # tail [start, p], start the largest multiple of ratio <= p + 1, written without p + 1 (a
    # position of 2^31 - 1 must not wrap): none for p < 0, tokens < bound only
    p = positions.astype(jnp.int32)[:, None]
    r1 = p % ratio  # floor modulo, as the reference
    e = jnp.arange(ratio - 1, dtype=jnp.int32)[None, :]
    tail = p - r1 + e
    tail = jnp.where((p >= 0) & (e <= r1) & (r1 < ratio - 1) & (tail < bound), tail, -1)
    val = jnp.concatenate([tok, tail], axis=1)  # [m, w]
    valid = val >= 0
    cv = jnp.cumsum(valid.astype(jnp.int32), axis=1, dtype=jnp.int32)
    n_valid = cv[:, -1:]
    col = jnp.arange(w, dtype=jnp.int32)[None, :]
    dest = jnp.where(valid, cv - 1, n_valid + col - cv)  # stable partition: valid first
    rows = jnp.broadcast_to(jnp.arange(m, dtype=jnp.int32)[:, None], (m, w))
    return jnp.zeros((m, w), jnp.int32).at[rows, dest].set(val, unique_indices=True)


def expand_block_indices(block_ids, positions, seq_lens, *, compress_ratio: int = 4,
                         strict: bool = False):
    """Block ids -> token positions (``qsa-contract.md`` §4), vectorised ``jnp`` (jit-native):
    the rule of ``qsa_triton.expand_block_indices`` and ``interop.indices.expand_block_indices``
    (the latter with ``ratio=compress_ratio, token_topk=topk * compress_ratio``).

    Args:
      block_ids: int32 [M, topk] (topk = ``block_ids.shape[1]``); positions, seq_lens: int32
        [M] (traced).
      compress_ratio: host int, tokens per block (2..16). strict: host bool, also enforce the
        qualified envelope (topk 512, ratio 4).

    Returns:
      int32 [M, topk * compress_ratio + compress_ratio - 1].

    Raises:
      ContractError: ``interop.contract.check_expand_block_indices``; torch tensors.

    Source: upstream ``sglang/srt/layers/attention/qsa/kernel.py``'s expansion, re-derived.
    """
    fn = "expand_block_indices"
    C.check_inputs(fn, None, block_ids=block_ids, positions=positions, seq_lens=seq_lens)
    check_expand_block_indices(block_ids, positions, seq_lens, compress_ratio=compress_ratio,
                               strict=strict, fn=fn)
    return _expand(block_ids, positions, seq_lens, ratio=int(compress_ratio))

