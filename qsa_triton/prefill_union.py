"""Tile-union sparse prefill (Triton): block-level selections, R query rows per program.

The ``block_indices=`` form of the three prefill entry points (``qsa-contract.md`` §3-4): row r
passes the indexer's row-relative block ids (4 tokens each, any order, invalid ids anywhere);
block g is valid iff ``0 <= g < visible // 4`` and every row also attends its causal tail
``[4 * (visible // 4), visible)``: the token path on ``interop.indices.expand_prefill_blocks``
up to summation order.

Algorithm (vLLM PR #55430 / RFC #55394; FSA, arXiv 2508.18224, for the K/V-outer view): adjacent
rows of one request select mostly the same blocks, so one program takes a tile of R consecutive
rows of one request and one KV head:

1. Union build (``_qsa_block_union``, per tile and index head): the R x NB keys
   ``block * R + row`` of the valid entries are ordered in registers (rows already in the
   indexer's order are merged by ``_merge_rows``, others sorted first), the first key of each
   block is compacted by a prefix sum, and each entry's membership is the segmented sum of
   ``1 << row``. A tile where a row lists a valid block twice (the indexer's top-k never does)
   gets length ``interop.indices.REPEATED_TILE``: the per-row kernel computes its rows and
   attends every occurrence (the contract's gather semantics, the token path's result).
2. Attention (``_qsa_prefill_union_fwd``, per tile and KV head): a [max(16, R x next_pow2(G)), D]
   Q tile walks the union BLOCK_N / 4 blocks at a time; each gathered K/V row serves the R rows,
   scores masked by membership, online softmax per (row, head) in base 2 with conditional
   rescaling (``softmax_weights``, shared with the per-row kernel); a last step covers the
   rows' causal tails (at most R + 3 tokens). Work is |union| x R rows, so the shared selector
   (``interop.geometry.select_prefill_blocks``) sends low-overlap and short-request workloads to
   the per-row kernel (``_qsa_expand_blocks``, then ``qsa_triton.prefill``'s kernel) alone.
3. Per-tile switch (vLLM #55372's bound: never more work than the per-row kernel): a tile whose
   union has more than ``interop.geometry.max_union_entries`` entries is skipped by the union
   kernel; its rows are expanded to tokens (``_qsa_expand_blocks``, rows of the other tiles
   left out) and computed by the per-row kernel (``qsa_triton.prefill``, its rows of the other
   tiles skipped too), launched after the union kernel as its Programmatic Dependent Launch
   dependent where the device has PDL (sm_90+; its program 0 waits for the union grid at its
   end, so the call completes after both): the few long row walks of an overlapping selection
   run in the union kernel's last wave, not after it (a row walk is long: a few rows alone cost
   one walk's latency). The selector sees host facts only; this switch is where the measured
   overlap decides. A light kernel first estimates each tile's union (``_qsa_union_skip``: the
   multiplicities of 32 sampled entries) and the build does not sort a tile estimated past 5/4
   of the bound: low-overlap selections cost little more than the per-row kernel.

Tiles: tile j of request b has slot ``cu_seqlens_q[b] // R + b + j`` (``interop.indices.
tile_slots``); ``T // R + B`` programs cover any batch and each finds its request from the
B + 1 device values: no host read, CUDA-graph safe. Paged: positions map to slots through
``req_to_token`` inside the loop; lying metadata is an invalid token, never dereferenced.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from interop.geometry import UnionGeometry, max_union_entries
from interop.indices import RATIO, REPEATED_TILE
from interop.plan import LOG2E, next_pow2

from ._fp8 import fp16_query

__all__ = ["build_block_union", "build_num_warps", "expand_blocks", "last_position", "pool_slot",
           "request_table", "row_runs", "softmax_weights", "union_build", "union_launch",
           "union_slots"]

_BIG = tl.constexpr(1 << 62)  # sort key of an invalid entry: after every valid key
_REPEATED = tl.constexpr(REPEATED_TILE)
_INT32_MAX = tl.constexpr(2**31 - 1)
_MAX_LEVELS = tl.constexpr(8)  # merge levels: R <= 256 rows per tile


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _tile_of(slot, cu_q_ptr, n_req, R: tl.constexpr, BP: tl.constexpr):
    """(request b, its first row, q_len, tile j, rows the tile may use) of a slot: b counts the
    requests b' >= 1 whose first slot cu[b'] // R + b' is <= slot; the row count is 0 for an
    idle slot, so row masks need no scalar condition (Triton's interpreter turns a scalar-bool &
    vector-bool into int32, which its loads refuse as masks)."""
    j = tl.arange(0, BP)
    cu = tl.load(cu_q_ptr + j, mask=j <= n_req, other=0)
    first = cu // R + j
    b = tl.sum(((j >= 1) & (j < n_req) & (first <= slot)).to(tl.int32), 0)
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    jt = slot - (q_start // R + b)
    q_used = tl.where((jt >= 0) & (jt * R < q_len), q_len, 0)
    return b, q_start, q_len, jt, q_used


@triton.jit
def _tile_rows(slot, i, cu_q_ptr, kv_lens_ptr, n_req, T, max_blocks, R: tl.constexpr,
               BP: tl.constexpr, ORDINARY: tl.constexpr):
    """Rows ``i`` (tile-row numbers, a vector) of tile ``slot``: (their rows in q, whether each
    is a row of the tile's request, its valid block-id bound: complete visible blocks capped at
    ``max_blocks``, the tile's first row in q and in its request, the request's rows the tile
    may use, kv_len - q_len)."""
    b, q_start, q_len, jt, q_used = _tile_of(slot, cu_q_ptr, n_req, R, BP)
    if ORDINARY:
        kv_len = q_len
    else:
        kv_len = tl.load(kv_lens_ptr + b)
    row_rel = jt * R + i
    row = q_start + row_rel
    row_ok = (row_rel >= 0) & (row_rel < q_used) & (row >= 0) & (row < T)
    n_ok = tl.minimum(tl.maximum(row_rel + kv_len - q_len + 1, 0) // 4, max_blocks)
    return row, row_ok, n_ok, q_start + jt * R, jt * R, q_used, kv_len - q_len


@triton.jit
def _merge_rows(z, R: tl.constexpr, NBP: tl.constexpr):
    """Sort the R x NBP keys of one tile given each row sorted (``z`` [R * NBP]: row i's keys at
    i * NBP.., ascending, odd rows negated, i.e. descending keys): log2(R) levels of bitonic
    merges, level l merging run pairs of NBP * 2**l keys (log2(NBP) + l + 1 compare-exchange
    stages: 21 at R = 4, NBP = 512, against a full sort's 66). ``tl.bitonic_merge`` sorts a
    bitonic run ascending; a run that must come out descending (for the next level's pair) is
    negated around it, so each level costs one sign flip besides its stages."""
    N: tl.constexpr = R * NBP
    e = tl.arange(0, N)
    neg = ((e // NBP) % 2) == 1  # the sign z carries now
    y = z
    for lvl in tl.static_range(_MAX_LEVELS):
        if ((2 * NBP) << lvl) <= N:
            y, neg = _merge_level(y, neg, e, (2 * NBP) << lvl, N)
    return y


@triton.jit
def _merge_level(y, neg, e, B: tl.constexpr, N: tl.constexpr):
    """One level of ``_merge_rows``: each run of B keys (two sorted halves, ascending then
    descending) sorted, descending for the odd runs unless B = N (the last level)."""
    want = (((e // B) % 2) == 1) & (B < N)
    y = tl.where(want != neg, -y, y)
    y = tl.reshape(tl.bitonic_merge(tl.reshape(y, [N // B, B])), [N])
    return y, want


@triton.jit
def _qsa_block_union(
    bidx_ptr, ublk_ptr, umem_ptr, ulen_ptr, cu_q_ptr, kv_lens_ptr,
    T, NB, n_req, max_blocks, stride_bt, stride_bh, stride_us, stride_uh, stride_ls, detect,
    skip_past, R: tl.constexpr, NBP: tl.constexpr, BP: tl.constexpr, ORDINARY: tl.constexpr,
    KEY64: tl.constexpr,
):
    """Union of the valid blocks of one tile's rows for one index head (module docstring, 1).
    Block ids >= ``max_blocks`` are invalid; ``KEY64``: 64-bit sort keys, where block * R + row
    can pass 2**31 (32-bit keys sort about twice as fast). ``detect`` (0 / 1): merge rows that
    are in the indexer's order without sorting them; 0 sorts every tile's rows first.
    ``skip_past`` >= 0: only the tiles ``_qsa_union_skip`` set to -1 are built, the others
    keep its length (module docstring, 3); < 0: every tile is built."""
    slot = tl.program_id(0)
    h = tl.program_id(1)
    if skip_past >= 0:  # decided by _qsa_union_skip, launched just before: -1 = build
        if tl.load(ulen_ptr + slot * stride_ls + h) >= 0:
            return
    N: tl.constexpr = R * NBP
    e = tl.arange(0, N)
    i = e // NBP
    c = e % NBP
    odd = (i % 2) == 1
    col = tl.where(odd, NBP - 1 - c, c)  # odd rows back to front: descending if sorted
    row, row_ok, n_ok, _, _, _, _ = _tile_rows(slot, i, cu_q_ptr, kv_lens_ptr, n_req, T,
                                               max_blocks, R, BP, ORDINARY)
    rowp = bidx_ptr + row.to(tl.int64) * stride_bt + h * stride_bh
    g = tl.load(rowp + col, mask=row_ok & (col < NB), other=-1)
    valid = row_ok & (col < NB) & (g >= 0) & (g < n_ok)
    if KEY64:
        key = tl.where(valid, g.to(tl.int64) * R + i, _BIG)
    else:
        key = tl.where(valid, g * R + i, _INT32_MAX)
    z = tl.where(odd, -key, key)  # every row ascending if the tile's rows are sorted
    zn = tl.gather(z, tl.minimum(e + 1, N - 1), 0)
    unsorted = tl.sum(((zn < z) & (c < NBP - 1)).to(tl.int32), 0)
    if (unsorted > 0) | (detect == 0):
        z = tl.reshape(tl.sort(tl.reshape(z, [R, NBP])), [N])
    ks = _merge_rows(z, R, NBP)
    prev = tl.gather(ks, tl.maximum(e - 1, 0), 0)
    base = slot.to(tl.int64) * stride_us + h * stride_uh
    dead = _BIG if KEY64 else _INT32_MAX  # the key of an invalid entry
    if tl.sum(((e > 0) & (ks == prev) & (ks < dead)).to(tl.int32), 0) > 0:
        # a row lists a block twice: the per-row kernel's (module docstring, 1)
        tl.store(ulen_ptr + slot * stride_ls + h, _REPEATED)
    else:
        _emit_union(ks, prev, ublk_ptr + base, umem_ptr + base, ulen_ptr + slot * stride_ls + h,
                    R, N, dead)


@triton.jit
def _qsa_union_skip(
    bidx_ptr, ulen_ptr, cu_q_ptr, kv_lens_ptr, T, NB, n_req, max_blocks, stride_bt, stride_bh,
    stride_ls, skip_past, R: tl.constexpr, NBP: tl.constexpr, BP: tl.constexpr,
    ORDINARY: tl.constexpr,
):
    """Which tiles the build skips (module docstring, 3), per tile and index head: length
    ``skip_past + 1`` where the estimated union (``_union_estimate``) passes 5/4 of
    ``skip_past``, 0 (final) where no row of the tile has a valid entry (an idle slot
    included: one such tile built alone would put a whole sort's latency on the call), else
    -1 (built). Its own kernel: without the build's sort registers many tiles run per SM, and
    the estimate's dependent row reads overlap across them."""
    slot = tl.program_id(0)
    h = tl.program_id(1)
    e = tl.arange(0, R * NBP)
    row, row_ok, n_ok, row0, rel0, q_used, kv_off = _tile_rows(
        slot, e // NBP, cu_q_ptr, kv_lens_ptr, n_req, T, max_blocks, R, BP, ORDINARY)
    row_ok = row_ok & (e % NBP < NB)
    g = tl.load(bidx_ptr + row.to(tl.int64) * stride_bt + h * stride_bh + e % NBP,
                mask=row_ok, other=-1)
    n_valid = tl.sum((row_ok & (g >= 0) & (g < n_ok)).to(tl.int32), 0)
    est = _union_estimate(bidx_ptr + h * stride_bh, stride_bt, n_valid, row0, rel0, q_used,
                          T, kv_off, NB, max_blocks, R, NBP)
    # a margin: tiles near the bound are built and decided by their exact length
    decided = tl.where(est * 4.0 > skip_past * 5.0, skip_past + 1, -1)
    tl.store(ulen_ptr + slot * stride_ls + h, tl.where(n_valid > 0, decided, 0))


@triton.jit
def _row_hits(head_ptr, stride_bt, gs, rel_i, row_i, q_used, T, kv_off, NB, max_blocks,
              NBP: tl.constexpr):
    """Whether each of ``gs`` (block ids, -1 = none) is a valid entry of tile row ``rel_i``
    (``row_i`` in the selection): one [len(gs), NBP] compare, the row re-read from L1/L2."""
    c = tl.arange(0, NBP)
    lim = tl.minimum(tl.maximum(rel_i + kv_off + 1, 0) // 4, max_blocks)
    use = (rel_i >= 0) & (rel_i < q_used) & (row_i >= 0) & (row_i < T)
    lim = tl.where(c < NB, tl.where(use, lim, 0), 0)  # a vector (interpreter-safe masks)
    gi = tl.load(head_ptr + row_i.to(tl.int64) * stride_bt + c, mask=lim > 0, other=-1)
    gi = tl.where((gi >= 0) & (gi < lim), gi, -1)  # an invalid entry matches no sample
    return tl.sum((gs[:, None] == gi[None, :]).to(tl.int32), 1) > 0


@triton.jit
def _union_estimate(head_ptr, stride_bt, n_valid, row0, rel0, q_used, T, kv_off, NB, max_blocks,
                    R: tl.constexpr, NBP: tl.constexpr):
    """Estimated union size of one tile before any sort (module docstring, 3): 32 valid entries
    sampled evenly over the R rows, each entry's multiplicity m = the number of rows that list
    it, and |union| ~ (valid entries) x mean(1 / m) (each distinct block is counted once over
    its m copies). 0.0 where no sample is valid. Without the R-row count: 0.0 where half of 32
    entries of the tile's first row are in its last (overlapping rows: the build decides), 3/4
    of the valid entries where under a quarter are in its second. Rows are re-read from L1/L2:
    32 x NBP compares a row, cheap beside the sort it may save."""
    S: tl.constexpr = 32
    k = tl.arange(0, S)
    # the first row against the last: most tiles of an indexer's selections stop here
    col = (k * NBP) // S
    ok0 = (rel0 >= 0) & (rel0 < q_used) & (row0 >= 0) & (row0 < T)
    n_ok0 = tl.where(ok0, tl.minimum(tl.maximum(rel0 + kv_off + 1, 0) // 4, max_blocks), 0)
    n_ok0 = tl.where(col < NB, n_ok0, 0)  # a vector (interpreter-safe masks)
    gs = tl.load(head_ptr + row0.to(tl.int64) * stride_bt + col, mask=n_ok0 > 0, other=-1)
    gs = tl.where((gs >= 0) & (gs < n_ok0), gs, -1)
    far = _row_hits(head_ptr, stride_bt, gs, rel0 + R - 1, row0 + R - 1, q_used, T, kv_off,
                    NB, max_blocks, NBP) & (gs >= 0)
    n_gs = tl.sum((gs >= 0).to(tl.int32), 0)
    if 2 * tl.sum(far.to(tl.int32), 0) >= n_gs:
        return 0.0
    # the first row against the second: neighbours sharing under a quarter (the low-overlap
    # selections the switch is for) give each row about 3/4 new blocks; no R-row count
    near = _row_hits(head_ptr, stride_bt, gs, rel0 + 1, row0 + 1, q_used, T, kv_off, NB,
                     max_blocks, NBP) & (gs >= 0)
    if 4 * tl.sum(near.to(tl.int32), 0) < n_gs:
        return n_valid.to(tl.float32) * 0.75
    ri = k % R
    col = ((k // R) * (NBP * R)) // S
    rel = rel0 + ri
    row = row0 + ri
    ok = (rel >= 0) & (rel < q_used) & (row >= 0) & (row < T) & (col < NB)
    n_ok = tl.minimum(tl.maximum(rel + kv_off + 1, 0) // 4, max_blocks)
    gs = tl.load(head_ptr + row.to(tl.int64) * stride_bt + col, mask=ok, other=-1)
    ok = ok & (gs >= 0) & (gs < n_ok)
    gs = tl.where(ok, gs, -1)
    m = tl.zeros([S], tl.int32)
    for i in tl.static_range(R):
        m += _row_hits(head_ptr, stride_bt, gs, rel0 + i, row0 + i, q_used, T, kv_off, NB,
                       max_blocks, NBP).to(tl.int32)
    inv = tl.where(ok, 1.0 / tl.maximum(m, 1).to(tl.float32), 0.0)
    n_s = tl.sum(ok.to(tl.float32), 0)
    return tl.where(n_s > 0, n_valid.to(tl.float32) * tl.sum(inv, 0) / tl.maximum(n_s, 1.0), 0.0)


@triton.jit
def _emit_union(ks, prev, ublk_row, umem_row, ulen_at, R: tl.constexpr, N: tl.constexpr,
                DEAD: tl.constexpr):
    """Store one tile's union from its sorted keys ``ks`` (``prev``: ks shifted right by one;
    keys >= DEAD are invalid, sorted last; no key twice): entry u is the u-th distinct block
    ``ks // R``, compacted by a prefix sum of the first key of each block; its membership is the
    segmented sum of ``1 << (ks % R)`` (an OR: a key occurs once per block)."""
    e = tl.arange(0, N)
    live = ks < DEAD
    ident = ks // R
    first = live & ((e == 0) | (ident != prev // R))
    identn = tl.gather(ident, tl.minimum(e + 1, N - 1), 0)
    last = live & ((e == N - 1) | (ident != identn))
    bits = tl.where(live, tl.full([N], 1, tl.int32) << (ks % R).to(tl.int32), 0)
    # both prefix sums in one int32 scan when they fit: the bits' sum stays below
    # SPLIT = (N / R) << R (each row's bit at most N / R times), the first keys' count <= N
    SPLIT: tl.constexpr = (N // R) << R
    if SPLIT * (N + 1) < 2**31:
        both = tl.cumsum(tl.where(first, SPLIT, 0) + bits, 0)
        pos = both // SPLIT - 1
        incl = both % SPLIT
    else:
        pos = tl.cumsum(first.to(tl.int32), 0) - 1
        incl = tl.cumsum(bits, 0)
    # segmented sum of the bits = incl at the segment's last key - excl at its first key
    start = tl.associative_scan(tl.where(first, incl - bits, 0), 0, _max_combine)
    tl.store(ublk_row + pos, ident.to(tl.int32), mask=last)
    tl.store(umem_row + pos, incl - start, mask=last)
    tl.store(ulen_at, tl.sum(first.to(tl.int32), 0))


@triton.jit
def softmax_weights(s, acc, m_i, l_i):
    """One base-2 online-softmax step of both prefill kernels: scores ``s`` fp32 [M, N] (-inf =
    masked), accumulator ``acc`` fp32 [M, D], row max ``m_i`` fp32 [M], deferred row sum ``l_i``
    fp32 [M, N]; returns (p = exp2(s - m_i) [M, N], acc, m_i, l_i + p). Conditional rescaling
    (FlashAttention-4, Dao et al. 2025): acc and l_i move to a new reference max only when some
    row's max grew by more than 2^8 since the one in use; below that every p <= 2^8 and the
    final division by the sum of the same reference is exact. Raises nothing."""
    m_blk = tl.max(s, 1)
    if tl.max((m_blk > m_i + 8.0).to(tl.int32), 0) > 0:
        m_new = tl.maximum(m_i, m_blk)
        # all-masked so far: keep the reference point finite (no -inf - -inf = NaN)
        alpha = tl.math.exp2(m_i - tl.where(m_new == float("-inf"), 0.0, m_new))
        acc = acc * alpha[:, None]
        l_i = l_i * alpha[:, None]
        m_i = m_new
    p = tl.math.exp2(s - tl.where(m_i == float("-inf"), 0.0, m_i)[:, None])
    return p, acc, m_i, l_i + p


@triton.jit
def _union_step(q, acc, m_i, l_i, tok, tok_ok, member, kv_base, last_pos, table_row, bound,
                pool_slots, k_head, v_head, stride_kn, stride_vn, qk_scale,
                D: tl.constexpr, MODE: tl.constexpr, OFF64: tl.constexpr):
    """One BLOCK_N step of the online softmax over positions ``tok`` for the whole Q tile."""
    offs_d = tl.arange(0, D)
    ok = tok_ok & (tok >= 0) & (tok < bound)
    if MODE == 2:
        slot = tl.load(table_row + tok, mask=ok, other=-1)
        ok = ok & (slot >= 0) & (slot < pool_slots)
        kv_row = slot
    else:
        # lying cu_seqlens can point past k/v: clamped into its rows (pool_slots = rows of k),
        # the per-row kernel's and qsa_pallas's rule
        kv_row = tl.where(tok > last_pos, pool_slots - 1, tl.maximum(kv_base + tok, 0))
    if OFF64:
        kv_row = kv_row.to(tl.int64)
    k = tl.load(k_head + kv_row[:, None] * stride_kn + offs_d[None, :], mask=ok[:, None],
                other=0.0).to(q.dtype)
    s = tl.dot(q, tl.trans(k)) * qk_scale
    s = tl.where(member & ok[None, :], s, float("-inf"))
    p, acc, m_i, l_i = softmax_weights(s, acc, m_i, l_i)
    v = tl.load(v_head + kv_row[:, None] * stride_vn + offs_d[None, :], mask=ok[:, None],
                other=0.0).to(q.dtype)
    acc = tl.dot(p.to(q.dtype), v, acc)
    return acc, m_i, l_i


@triton.jit
def _qsa_prefill_union_fwd(
    q_ptr, k_ptr, v_ptr, o_ptr, ublk_ptr, umem_ptr, ulen_ptr,
    cu_q_ptr, cu_k_ptr, kv_lens_ptr, r2t_ptr, req_idx_ptr,
    qk_scale, v_scale, T, n_req, max_reqs, max_context, pool_slots, max_union,
    stride_qt, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_ot, stride_oh,
    stride_us, stride_uh, stride_ls, stride_rt,
    PER_HEAD: tl.constexpr, G: tl.constexpr, HT: tl.constexpr, R: tl.constexpr,
    M: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr,
    OFF64: tl.constexpr, BP: tl.constexpr, TRIGGER: tl.constexpr,
):
    """Attention of one tile (R rows x G heads) and one KV head over its union (docstring, 2);
    nothing for a tile whose union has more than ``max_union`` entries (docstring, 3).
    ``TRIGGER``: the per-row kernel of the other tiles' rows is this grid's PDL dependent
    (docstring, 3): it may be scheduled as soon as every program has started."""
    if TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    slot = tl.program_id(0)
    h = tl.program_id(1)
    BLOCK_U: tl.constexpr = BLOCK_N // 4
    b, q_start, q_len, jt, q_used = _tile_of(slot, cu_q_ptr, n_req, R, BP)
    if MODE == 0:
        kv_len = q_len
        kv_base = q_start
    else:
        kv_len = tl.load(kv_lens_ptr + b)
        if MODE == 1:
            kv_base = tl.load(cu_k_ptr + b)
        else:
            kv_base = 0
    last_pos = last_position(kv_base, pool_slots)
    table_row = r2t_ptr
    bound = kv_len
    if MODE == 2:
        table_row, bound = request_table(r2t_ptr, req_idx_ptr, b, kv_len, max_reqs, max_context,
                                         stride_rt)

    offs_m = tl.arange(0, M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    i = offs_m // HT
    g = offs_m % HT
    row_rel = jt * R + i
    row = q_start + row_rel
    row_ok = (i < R) & (g < G) & (row_rel >= 0) & (row_rel < q_used) & (row >= 0) & (row < T)
    vis = tl.maximum(row_rel + kv_len - q_len + 1, 0)
    row64 = row.to(tl.int64)
    heads = (h * G + g).to(tl.int64)
    k_head = k_ptr + h * stride_kh
    v_head = v_ptr + h * stride_vh
    uh = h if PER_HEAD else 0
    ubase = slot.to(tl.int64) * stride_us + uh * stride_uh
    n_u = tl.where(q_used > 0, tl.load(ulen_ptr + slot * stride_ls + uh), 0)
    sub = offs_n % 4
    ent = offs_n // 4
    if n_u > max_union:  # the per-row kernel computed this tile's rows
        return
    q = tl.load(q_ptr + row64[:, None] * stride_qt + heads[:, None] * stride_qh
                + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    if k_ptr.dtype.element_ty == tl.float8e4nv:
        q, qk_scale = fp16_query(q, qk_scale)  # FP8 K/V: the dots in fp16 (qsa_triton._fp8)

    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M, BLOCK_N], tl.float32)  # row sums reduced once at the end (prefill.py)
    acc = tl.zeros([M, D], tl.float32)
    # causal tails: row i attends [4 * (vis_i // 4), vis_i); for R consecutive rows these lie in
    # [4 * (vis_0 // 4), vis_last), at most R + 3 <= BLOCK_N positions: one extra step, the
    # loop's last (a separate step after the loop doubled the registers and stopped the
    # software pipelining of the loop in the compiled kernel)
    vis0 = tl.maximum(jt * R + kv_len - q_len + 1, 0)
    tail_tok = (vis0 // 4) * 4 + offs_n
    tail_member = ((tail_tok[None, :] >= ((vis // 4) * 4)[:, None])
                   & (tail_tok[None, :] < vis[:, None]) & row_ok[:, None])
    # only positions in some row's tail are gathered (4k + 3 is in none): a non-finite K/V row
    # no row names must not reach the dots (0 x NaN)
    tail_ok = tl.max(tail_member.to(tl.int32), 0) > 0
    for c in range(0, n_u + BLOCK_U, BLOCK_U):
        e = c + ent
        e_ok = e < n_u
        blk = tl.load(ublk_ptr + ubase + e, mask=e_ok, other=0)
        mem = tl.load(umem_ptr + ubase + e, mask=e_ok, other=0)
        tail = c >= n_u
        tok = tl.where(tail, tail_tok, blk * 4 + sub)
        tok_ok = tl.where(tail, tail_ok, e_ok)
        member = tl.where(tail, tail_member, ((mem[None, :] >> i[:, None]) & 1) != 0)
        acc, m_i, l_i = _union_step(q, acc, m_i, l_i, tok, tok_ok, member & row_ok[:, None],
                                    kv_base, last_pos, table_row, bound, pool_slots, k_head,
                                    v_head, stride_kn, stride_vn, qk_scale, D, MODE, OFF64)
    l_sum = tl.sum(l_i, 1)
    has = l_sum > 0.0
    inv = tl.where(has, v_scale / tl.where(has, l_sum, 1.0), 0.0)
    out = acc * inv[:, None]
    tl.store(o_ptr + row64[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def row_runs(ulen_ptr, stride_ls, stride_lh, n_slots, max_union, q_start, b, r, h, ur):
    """Whether the per-row path (expansion, per-row kernel) takes row r of request b (index or
    KV head h): always without a union (``ur`` = 0); else only where the row's tile of ``ur``
    rows (slot q_start // ur + b + r // ur, as ``_tile_of``) has a union longer than
    ``max_union`` (the tile-union kernel takes the other tiles). ``ur`` is a runtime value, not
    a constexpr: no kernel variant of its own."""
    urs = tl.maximum(ur, 1)
    slot = tl.minimum(tl.maximum(q_start // urs + b + r // urs, 0), n_slots - 1)
    n_u = tl.load(ulen_ptr + slot.to(tl.int64) * stride_ls + h * stride_lh, mask=ur > 0,
                  other=0)
    return (ur == 0) | (n_u > max_union)


@triton.jit
def last_position(kv_base, kv_rows):
    """The largest position p with kv_base + p inside k's ``kv_rows`` rows (a lying range is
    clamped into k: larger positions read row kv_rows - 1; every prefill kernel), without the
    int32 overflow of kv_base + p; as ``qsa_pallas.prefill_union.last_position``. int32
    scalars in and out; raises nothing; source: qsa-contract.md §7 (lying ranges)."""
    return tl.where(kv_base < kv_rows - 1 - _INT32_MAX, _INT32_MAX, kv_rows - 1 - kv_base)


@triton.jit
def request_table(r2t_ptr, req_idx_ptr, b, kv_len, max_reqs, max_context, stride_rt):
    """(req_to_token row pointer, position bound) of request b of a paged call: a request index
    outside [0, max_reqs) has no valid position, and positions stop at the table's width
    (qsa-contract.md §7: lying metadata is an invalid entry, never dereferenced)."""
    req = tl.load(req_idx_ptr + b)
    req_ok = (req >= 0) & (req < max_reqs)
    table_row = r2t_ptr + tl.where(req_ok, req, 0).to(tl.int64) * stride_rt
    return table_row, tl.where(req_ok, tl.minimum(kv_len, max_context), 0)


@triton.jit
def pool_slot(tok, ok, table_row, bound, pool_slots):
    """The pool slot of positions ``tok`` (-1 where not ``ok``, outside [0, ``bound``) or
    mapped outside [0, ``pool_slots``)): the paged slot rule of every prefill kernel."""
    ok = ok & (tok >= 0) & (tok < bound)
    slot = tl.load(table_row + tok, mask=ok, other=-1)
    return tl.where(ok & (slot >= 0) & (slot < pool_slots), slot, -1)


@triton.jit
def _qsa_expand_blocks(
    bidx_ptr, out_ptr, cu_q_ptr, kv_lens_ptr, ulen_ptr, r2t_ptr, req_idx_ptr, NB, W, n_req,
    n_slots, max_union, union_rows, max_reqs, max_context, pool_slots, stride_bt, stride_bh,
    stride_ot, stride_oh, stride_ls, stride_lh, stride_rt, NBP: tl.constexpr, BP: tl.constexpr,
    BLOCK_W: tl.constexpr, ORDINARY: tl.constexpr, PAGED: tl.constexpr,
):
    """Token indices of one row's block selection (``interop.indices.expand_prefill_blocks``):
    valid blocks' 4 tokens each, in the row's order, then the causal tail, then -1. ``PAGED``:
    their pool slots instead (``pool_slot``). ``union_rows`` > 0: rows of tiles the tile-union
    kernel takes (``row_runs``) are not written."""
    row = tl.program_id(0)
    h = tl.program_id(1)
    j = tl.arange(0, BP)
    cu = tl.load(cu_q_ptr + j, mask=j <= n_req, other=_INT32_MAX)
    b = tl.sum(((j >= 1) & (j < n_req) & (cu <= row)).to(tl.int32), 0)
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    r = row - q_start
    in_req = (r >= 0) & (r < q_len)
    if row_runs(ulen_ptr, stride_ls, stride_lh, n_slots, max_union, q_start, b, r, h,
                 union_rows):
        if ORDINARY:
            kv_len = q_len
        else:
            kv_len = tl.load(kv_lens_ptr + b)
        table_row = r2t_ptr
        bound = kv_len
        if PAGED:
            table_row, bound = request_table(r2t_ptr, req_idx_ptr, b, kv_len, max_reqs,
                                             max_context, stride_rt)
        vis = tl.where(in_req, tl.maximum(r + kv_len - q_len + 1, 0), 0)
        n_vis = vis // 4
        c = tl.arange(0, NBP)
        g = tl.load(bidx_ptr + row.to(tl.int64) * stride_bt + h * stride_bh + c, mask=c < NB,
                    other=-1)
        valid = (c < NB) & (g >= 0) & (g < n_vis)
        pos = tl.cumsum(valid.to(tl.int32), 0) - 1
        count = tl.sum(valid.to(tl.int32), 0)
        orow = out_ptr + row.to(tl.int64) * stride_ot + h * stride_oh
        # each column written once: the entries as one [NBP, 4] store (a warp's lanes on
        # consecutive columns), the tail, then -1 from the end of the tail on
        t4 = tl.arange(0, 4)
        ok4 = valid[:, None] & (t4[None, :] < 4)
        tok = 4 * g[:, None] + t4[None, :]
        if PAGED:
            tok = pool_slot(tok, ok4, table_row, bound, pool_slots)
        tl.store(orow + 4 * pos[:, None] + t4[None, :], tok, mask=ok4)
        n_tail = vis - 4 * n_vis
        tail_ok = t4 < n_tail
        tok = 4 * n_vis + t4
        if PAGED:
            tok = pool_slot(tok, tail_ok, table_row, bound, pool_slots)
        tl.store(orow + 4 * count + t4, tok, mask=tail_ok)
        end = 4 * count + n_tail
        for w0 in range((end // BLOCK_W) * BLOCK_W, W, BLOCK_W):
            cols = w0 + tl.arange(0, BLOCK_W)
            tl.store(orow + cols, tl.full([BLOCK_W], -1, tl.int32), mask=(cols >= end) & (cols < W))


# ---------------------------------------------------------------------------------------------
# Launchers
def union_slots(total_q: int, requests: int, tile_rows: int) -> int:
    """Programs of the union grid: T // R + B slots (``interop.indices.tile_slots``)."""
    return total_q // tile_rows + requests


def _heads(x: torch.Tensor):
    """(index heads, head stride) of a selection [T, W] (shared: 1, 0) or [T, H, W]."""
    return (x.shape[1], x.stride(1)) if x.dim() == 3 else (1, 0)


def build_block_union(block_indices: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      kv_lens: torch.Tensor | None, tile_rows: int, max_blocks: int | None = None,
                      *, detect_sorted: bool = True, skip_past: int | None = None):
    """The union build alone (module docstring, 1; exposed for tests and benchmarks).

    Args:
      block_indices: int32 [T, NB] or [T, Hkv, NB] row-relative block ids.
      cu_seqlens_q: int32 [B + 1]; kv_lens: int32 [B] (chunk/paged) or None (ordinary: the
        request length bounds). All on one device.
      tile_rows: R, a power of two.
      max_blocks: host bound on block ids (ids at or past it are invalid) or None;
        max_blocks x R < 2**31 lets the build sort 32-bit keys.
      detect_sorted: merge rows already in the indexer's order without sorting them (checked
        per tile); False sorts every tile's rows (same result).
      skip_past: None (every tile built), or the union bound (``max_union_entries``): a tile
        whose estimated union passes 5/4 of it is not built, its length is ``skip_past + 1``
        (module docstring, 3).

    Returns:
      (blocks, masks int32 [S, H, R x NB], lengths int32 [S, H]), S = T // R + B, equal to
      ``interop.indices.tile_union``: entry u < lengths[s, h] is block ``blocks[s, h, u]`` for
      the rows whose bit is set in ``masks[s, h, u]``; entries past the length unwritten
      (a tile where a row lists a valid block twice: length ``interop.indices.REPEATED_TILE``,
      its ``tile_union`` value None; tiles skipped under ``skip_past``: length skip_past + 1;
      neither writes an entry).
    Raises ValueError for ``skip_past`` outside [0, 2**31 - 2].
    """
    if skip_past is not None and not 0 <= int(skip_past) < 2**31 - 1:
        raise ValueError(f"build_block_union: skip_past must be in [0, 2**31 - 2], "
                         f"got {skip_past}")
    t, nb = block_indices.shape[0], block_indices.shape[-1]
    hidx, stride_bh = _heads(block_indices)
    n_req = cu_seqlens_q.shape[0] - 1
    r = int(tile_rows)
    s = union_slots(t, n_req, r)
    ublk, umem = (torch.empty((s, hidx, r * nb), dtype=torch.int32, device=block_indices.device)
                  for _ in range(2))
    ulen = torch.empty((s, hidx), dtype=torch.int32, device=block_indices.device)
    # the largest key, (max_blocks - 1) * R + R - 1, stays below the int32 sentinel
    key64 = max_blocks is None or int(max_blocks) * r > 2**31 - 1
    max_blocks = 2**31 - 1 if max_blocks is None else min(int(max_blocks), 2**31 - 1)
    kv = kv_lens if kv_lens is not None else cu_seqlens_q
    if skip_past is not None:
        _qsa_union_skip[(s, hidx)](
            block_indices, ulen, cu_seqlens_q, kv, t, nb, n_req, max_blocks,
            block_indices.stride(0), stride_bh, ulen.stride(0), int(skip_past), R=r,
            NBP=next_pow2(nb), BP=next_pow2(n_req + 1), ORDINARY=kv_lens is None, num_warps=4)
    _qsa_block_union[(s, hidx)](
        block_indices, ublk, umem, ulen, cu_seqlens_q, kv, t, nb, n_req, max_blocks,
        block_indices.stride(0), stride_bh, ublk.stride(0), ublk.stride(1), ulen.stride(0),
        int(bool(detect_sorted)), -1 if skip_past is None else int(skip_past), R=r,
        NBP=next_pow2(nb), BP=next_pow2(n_req + 1),
        ORDINARY=kv_lens is None,
        KEY64=key64,
        num_warps=build_num_warps(r, next_pow2(nb)))
    return ublk, umem, ulen


def build_num_warps(tile_rows: int, nbp: int) -> int:
    """Warps of the union build for its R x NBP sort keys: 2 from 2048 keys (more of the merge's
    compare-exchange stages stay inside a thread, more programs share an SM), else 4. Source:
    bench/NOTES.md, "Tile-union sparse prefill" (build warps)."""
    return 2 if tile_rows * nbp >= 2048 else 4


def expand_blocks(block_indices: torch.Tensor, cu_seqlens_q: torch.Tensor,
                  kv_lens: torch.Tensor | None, *, pool=None, skip=None) -> torch.Tensor:
    """Token indices of a block-level selection on the device (the per-row kernel's input):
    int32 [T, 4 NB + 3] (or [T, Hkv, ..]) from int32 ``block_indices`` [T, NB] (or
    [T, Hkv, NB]), ``cu_seqlens_q`` [B + 1] and ``kv_lens`` [B] or None (ordinary); equal to
    ``interop.indices.expand_prefill_blocks`` (rows outside every request: all -1).
    ``pool``: None, or (req_to_token [max_reqs, max_context], req_indices [B], pool slots): the
    entries' pool slots instead (``qsa_triton.prefill.resolve_pool_slots`` of the expansion).
    ``skip``: None, or (union lengths [S, H], R, max_union): a row is written only where its
    tile (``row_runs``'s slot rule, rows outside every request included) is past max_union;
    the other rows may hold anything (the tile-union kernel computes them, no kernel reads
    rows outside every request)."""
    t, nb = block_indices.shape[0], block_indices.shape[-1]
    w = RATIO * nb + RATIO - 1
    hidx, stride_bh = _heads(block_indices)
    shape = (t, hidx, w) if block_indices.dim() == 3 else (t, w)
    out = torch.empty(shape, dtype=torch.int32, device=block_indices.device)
    if t == 0:
        return out
    n_req = cu_seqlens_q.shape[0] - 1
    ulen, ur, max_union = skip if skip is not None else (cu_seqlens_q, 0, 0)
    r2t, req_idx, pool_slots = pool if pool is not None else (cu_seqlens_q, cu_seqlens_q, 0)
    max_reqs, max_context = r2t.shape if pool is not None else (1, 1)
    _qsa_expand_blocks[(t, hidx)](
        block_indices, out, cu_seqlens_q, kv_lens if kv_lens is not None else cu_seqlens_q,
        ulen, r2t, req_idx, nb, w, n_req, ulen.shape[0], max_union, ur, max_reqs, max_context,
        min(int(pool_slots), 2**31 - 1), block_indices.stride(0), stride_bh, out.stride(0),
        _heads(out)[1], ulen.stride(0) if ur else 0,
        ulen.stride(1) if ur and ulen.shape[1] > 1 else 0, r2t.stride(0) if pool else 0,
        NBP=next_pow2(nb), BP=next_pow2(n_req + 1), BLOCK_W=min(1024, next_pow2(w)),
        ORDINARY=kv_lens is None, PAGED=pool is not None, num_warps=4)
    return out


def union_build(mode: int, q, k, block_indices, cu_q, kv_lens, req_to_token,
                geo: UnionGeometry):
    """The union build of one checked call (``mode``: 0 ordinary, 1 chunk, 2 paged) under
    ``geo`` ("union"): (blocks, masks int32 [S, H, R x NB], lengths int32 [S, H] as
    ``build_block_union``, max_union: the tile kernel's bound, a host int from
    ``interop.geometry.max_union_entries``). Raises ValueError for a geometry whose Q tile or
    BLOCK_N cannot hold R rows x next_pow2(G) heads and their causal tails. Source: module
    docstring, 1 and 3."""
    group = q.shape[1] // k.shape[1]
    r, ht = geo.tile_rows, next_pow2(group)
    if geo.head_tile < r * ht or geo.block_n < r + 3 or geo.block_n % 4:
        raise ValueError(f"union geometry {geo} cannot hold {r} rows x {ht} heads")
    # 32-bit sort keys under a host bound on valid block ids: paged, the table's columns; else
    # the int32 key limit (exact for R <= 4: ids stay below 2**29; R = 8 drops ids of 2**28 - 1
    # and more, a context of about 2**30 tokens: qsa-contract.md §7). Not k's rows: a lying
    # kv_lens / cu_seqlens range is clamped into k, its positions past k stay valid.
    bound = req_to_token.shape[1] // RATIO + 1 if mode == 2 else (2**31 - 1) // r
    max_union = min(max_union_entries(geo, block_indices.shape[-1], max(16, ht)),
                    REPEATED_TILE - 1)
    ublk, umem, ulen = build_block_union(block_indices, cu_q, None if mode == 0 else kv_lens, r,
                                         bound, skip_past=max_union)
    return ublk, umem, ulen, max_union


def union_launch(mode: int, q, k, v, out, union, cu_q, cu_k, kv_lens, req_to_token,
                 req_indices, scale: float, k_scale: float, v_scale: float,
                 geo: UnionGeometry, off64: bool, trigger: bool = False) -> None:
    """The tile-union kernel of one checked call into ``out`` (q's shape and dtype; rows of
    tiles past the bound are left as they are), ``union`` from ``union_build`` (metadata the
    mode does not read may be any int32 tensor); ``trigger``: the next launch is its PDL
    dependent (module docstring, 3)."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    ublk, umem, ulen, max_union = union
    n_req = cu_q.shape[0] - 1
    paged = mode == 2
    r2t = req_to_token if paged else cu_q
    max_reqs, max_context = (req_to_token.shape if paged else (1, 1))
    _qsa_prefill_union_fwd[(ulen.shape[0], hkv)](
        q, k, v, out, ublk, umem, ulen, cu_q, cu_k, kv_lens, r2t,
        req_indices if paged else cu_q,
        float(scale) * float(k_scale) * LOG2E, float(v_scale), t, n_req, max_reqs, max_context,
        min(int(k.shape[0]), 2**31 - 1), max_union,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), ublk.stride(0), ublk.stride(1), ulen.stride(0),
        r2t.stride(0) if paged else 0,
        PER_HEAD=ulen.shape[1] > 1, G=group, HT=next_pow2(group), R=geo.tile_rows,
        M=geo.head_tile, D=d, BLOCK_N=geo.block_n, MODE=mode, OFF64=off64,
        BP=next_pow2(n_req + 1), TRIGGER=bool(trigger), num_warps=geo.num_warps,
        num_stages=geo.num_stages)

