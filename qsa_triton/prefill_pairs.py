"""Experimental sparse prefill over *pairs* of adjacent query rows sharing one gathered tile.

Why: the per-(row, KV head) kernel (``prefill.py``, like upstream's) gathers every selected K/V
row once per query row; at 8192 rows x 2051 columns that is ~17 GB of L2 traffic per call and the
kernel is bound by it (``docs/anchors.md``), while adjacent rows select mostly the same tokens.
Here one program serves two adjacent rows r, r+1 of a request: it walks the *union* of their
selections, gathers each union token's K/V once, and masks per row. Gather traffic drops from
2·W to about W + (tokens of r+1 not selected by r) per pair; the tensor-core work stays that of
the per-row kernel (head tile 2·G padded instead of G padded to 16, which is the same tile for G
<= 8 and twice the rows for G = 12, each row then used).

Two kernels:
  0. ``sorted_keys``: every row's entries masked (invalid or column >= visible -> INT32_MAX) and
     sorted by one segmented ``torch.sort`` (``QSA_GROUP_SORT=kernel``: ``tl.sort`` in step 1).
  1. ``_qsa_pair_union`` (pre-pass, one program per (pair, index head)): loads both sorted rows,
     and with branch-free binary searches (``tl.gather`` on the sorted tiles) finds for every
     entry of row r how often row r+1 selects the same token, and which entries of row r+1 row r
     does not select. It writes the union list: row r's columns in their order (row-r weight 1,
     row-(r+1) weight = count in r+1 / count in r, so duplicates keep gather semantics), then the
     extra entries of row r+1 (weights 0 and 1), as *physical* K/V rows (ordinary: cu_q[b] + idx,
     chunk: cu_k[b] + idx, paged: slot_table[b, idx]); invalid entries become -1.
  2. ``_qsa_pair_attn``: flash-attention forward over the union list, head tile [2·G -> BLOCK_M,
     D], scores of a row with weight w get + log2(w) (w = 1: exact, unchanged), weight 0 -> -inf.

Scratch: the sorted keys (T x Hidx x W int32, plus torch.sort's int64 indices), and 2·W int32
rows + 2·W float32 weights per pair (T x Hidx x 2W x 8 B allocated; about a quarter written). Semantics identical to ``interop.reference`` (an entry is valid iff 0 <= idx < len,
invalid entries never dereferenced, rows without a valid entry give 0). Selected with
``QSA_PREFILL_ALGO=pairs`` (default ``rows``) until the H200 benchmark says which is faster.
Row r's part of the union is its sorted valid entries (ascending positions), then r+1's extras.
W is limited to 8192 columns (the sort tile); wider calls use the per-row kernel.
Like ``prefill.py``, every kernel here grid-strides over its request's rows (pairs), so the host's
max_seqlen_q only sizes the grid: a too-small value still covers every row.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from interop.geometry import Geometry

__all__ = ["pair_union", "pairs_forward", "MAX_PAIR_WIDTH", "pair_geometry"]

MAX_PAIR_WIDTH = 8192
_BIG = tl.constexpr(2**31 - 1)  # sentinel for invalid entries (sorts last)


@triton.jit
def _lower_bound(sorted_vals, x, WP: tl.constexpr, LOG_WP: tl.constexpr):
    """Number of elements < x in ``sorted_vals`` ([WP], ascending), for every lane of x."""
    pos = tl.zeros(x.shape, tl.int32)
    # a loop, not static_range: unrolled searches made the pre-pass take minutes to compile
    for k in range(LOG_WP):
        step = WP >> (k + 1)
        probe = tl.gather(sorted_vals, pos + (step - 1), 0)
        pos = tl.where(probe < x, pos + step, pos)
    # a final probe resolves the last element (pos may need to become WP)
    last = tl.gather(sorted_vals, tl.minimum(pos, WP - 1), 0)
    return tl.where((pos == WP - 1) & (last < x), pos + 1, pos)


@triton.jit
def _has_duplicates(sorted_vals, WP: tl.constexpr):
    """1 if two neighbours of the sorted tile are equal valid entries (sentinels excluded)."""
    i = tl.arange(0, WP)
    nxt = tl.gather(sorted_vals, tl.minimum(i + 1, WP - 1), 0)
    dup = (i < WP - 1) & (nxt == sorted_vals) & (sorted_vals != _BIG)
    return tl.max(dup.to(tl.int32), 0)


@triton.jit
def _qsa_pair_union(
    idx_ptr, cu_q_ptr, base_ptr, kv_lens_ptr, table_ptr, urow_ptr, uw_ptr, ulen_ptr, W,
    stride_it, stride_ih, stride_tb, stride_ut, stride_uh, stride_lt,
    HIDX: tl.constexpr, WP: tl.constexpr, LOG_WP: tl.constexpr, MODE: tl.constexpr,
    PRESORTED: tl.constexpr,
):
    bh = tl.program_id(1)
    b = bh // HIDX
    hi = bh % HIDX
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    # grid-stride over the request's pairs (first rows 2·pid, 2·(pid + grid0), ...): a too-small
    # max_seqlen_q still covers every pair
    for r0 in range(2 * tl.program_id(0), q_len, 2 * tl.num_programs(0)):
        has1 = (r0 + 1) < q_len
        row0 = (q_start + r0).to(tl.int64)
        if MODE == 0:
            bound = q_len
            vis0 = r0 + 1
            base = q_start
        else:
            bound = tl.load(kv_lens_ptr + b)
            vis0 = r0 + bound - q_len + 1
            if MODE == 1:
                base = tl.load(base_ptr + b)
            else:
                base = 0
        n0 = tl.minimum(tl.maximum(vis0, 0), W)
        n1 = tl.where(has1, tl.minimum(tl.maximum(vis0 + 1, 0), W), 0)
        cols = tl.arange(0, WP)
        in0 = cols < n0
        in1 = cols < n1
        irow = idx_ptr + row0 * stride_it + hi * stride_ih
        e0 = tl.load(irow + cols, mask=in0, other=-1)
        e1 = tl.load(irow + stride_it + cols, mask=in1, other=-1)
        v0 = in0 & (e0 >= 0) & (e0 < bound)
        v1 = in1 & (e1 >= 0) & (e1 < bound)
        t0 = tl.where(v0, e0, _BIG)
        t1 = tl.where(v1, e1, _BIG)
        if PRESORTED:  # rows already masked and sorted (sorted_keys): valid entries first
            s0 = t0
            s1 = t1
        else:
            s0 = tl.sort(t0)
            s1 = tl.sort(t1)
        # counts of each row-r token in row r+1 (c1) and in row r (c0); presence of the row-(r+1)
        # tokens in row r. Without duplicates (the usual case: the indexer selects distinct
        # blocks) a count is one lower-bound search plus one probe; the second search per count
        # runs only when a sorted row has two equal valid neighbours.
        t0n = tl.where(v0, t0 + 1, _BIG)
        lb1 = _lower_bound(s1, t0, WP, LOG_WP)
        c1 = (tl.gather(s1, tl.minimum(lb1, WP - 1), 0) == t0).to(tl.int32) * (lb1 < WP).to(tl.int32)
        if _has_duplicates(s1, WP) != 0:
            c1 = _lower_bound(s1, t0n, WP, LOG_WP) - lb1
        c0 = tl.full([WP], 1, tl.int32)
        if _has_duplicates(s0, WP) != 0:
            c0 = _lower_bound(s0, t0n, WP, LOG_WP) - _lower_bound(s0, t0, WP, LOG_WP)
        lb0 = _lower_bound(s0, t1, WP, LOG_WP)
        in_r = (tl.gather(s0, tl.minimum(lb0, WP - 1), 0) == t1) & (lb0 < WP)
        w1 = tl.where(v0, c1.to(tl.float32) / tl.maximum(c0, 1).to(tl.float32), 0.0)
        extra = v1 & ~in_r
        slot = tl.cumsum(extra.to(tl.int32), 0) - 1
        n_x = tl.sum(extra.to(tl.int32), 0)
        if MODE == 2:
            trow = table_ptr + b.to(tl.int64) * stride_tb
            ph0 = tl.load(trow + e0, mask=v0, other=-1)
            ph1 = tl.load(trow + e1, mask=extra, other=-1)
        else:
            ph0 = base + e0
            ph1 = base + e1
        urow = urow_ptr + row0 * stride_ut + hi * stride_uh
        uw = uw_ptr + row0 * stride_ut + hi * stride_uh
        tl.store(urow + cols, tl.where(v0, ph0, -1), mask=in0)
        tl.store(uw + cols, w1, mask=in0)
        tl.store(urow + n0 + slot, ph1, mask=extra)
        tl.store(uw + n0 + slot, tl.full([WP], 1.0, tl.float32), mask=extra)
        tl.store(ulen_ptr + row0 * stride_lt + hi * 2, n0 + n_x)
        tl.store(ulen_ptr + row0 * stride_lt + hi * 2 + 1, n0)


@triton.jit
def _qsa_pair_attn(
    q_ptr, k_ptr, v_ptr, o_ptr, cu_q_ptr, urow_ptr, uw_ptr, ulen_ptr, qk_scale, v_scale,
    stride_qt, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_ot, stride_oh,
    stride_ut, stride_uh, stride_lt,
    HKV: tl.constexpr, HIDX: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, OFF64: tl.constexpr,
):
    bh = tl.program_id(1)
    b = bh // HKV
    h = bh % HKV
    hi = h % HIDX  # shared indices (HIDX = 1) -> 0, per-head -> h
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    for r0 in range(2 * tl.program_id(0), q_len, 2 * tl.num_programs(0)):  # grid-stride (pairs)
        n_rows = tl.minimum(q_len - r0, 2)  # 1 for the last row of an odd-length request
        row0 = (q_start + r0).to(tl.int64)
        n_u = tl.load(ulen_ptr + row0 * stride_lt + hi * 2)
        n0 = tl.load(ulen_ptr + row0 * stride_lt + hi * 2 + 1)
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, D)
        sub = offs_m // G  # 0: row r, 1: row r+1
        m_ok = (offs_m < 2 * G) & (sub < n_rows)
        qrow = row0 + sub.to(tl.int64)
        heads = (h * G + offs_m % G).to(tl.int64)
        q = tl.load(q_ptr + qrow[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=m_ok[:, None], other=0.0)
        urow = urow_ptr + row0 * stride_ut + hi * stride_uh
        uw = uw_ptr + row0 * stride_ut + hi * stride_uh
        k_head = k_ptr + h * stride_kh
        v_head = v_ptr + h * stride_vh
        first = (sub == 0)[:, None]
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        for start in range(0, n_u, BLOCK_N):
            cols = start + offs_n
            in_u = cols < n_u
            pr = tl.load(urow + cols, mask=in_u, other=-1)
            w1 = tl.load(uw + cols, mask=in_u, other=0.0)
            valid = in_u & (pr >= 0)
            w0 = tl.where(valid & (cols < n0), 1.0, 0.0)
            if OFF64:  # see prefill.needs_off64
                kv_row = pr.to(tl.int64)
            else:
                kv_row = pr
            kt = tl.load(k_head + kv_row[:, None] * stride_kn + offs_d[None, :],
                         mask=valid[:, None], other=0.0).to(q.dtype)
            s = tl.dot(q, tl.trans(kt)) * qk_scale
            w = tl.where(first, w0[None, :], w1[None, :])
            s = tl.where(w > 0.0, s + tl.math.log2(tl.maximum(w, 1e-30)), float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.math.exp2(m_i - m_ref)
            p = tl.math.exp2(s - m_ref[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            vt = tl.load(v_head + kv_row[:, None] * stride_vn + offs_d[None, :],
                         mask=valid[:, None], other=0.0).to(q.dtype)
            acc = tl.dot(p.to(q.dtype), vt, acc * alpha[:, None])
            m_i = m_new
        has = l_i > 0.0
        inv = tl.where(has, v_scale / tl.where(has, l_i, 1.0), 0.0)
        out = acc * inv[:, None]
        tl.store(o_ptr + qrow[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=m_ok[:, None])


@triton.jit
def _qsa_mask_keys(
    idx_ptr, keys_ptr, cu_q_ptr, kv_lens_ptr, W, stride_it, stride_ih, stride_kt, stride_kh,
    HIDX: tl.constexpr, ORDINARY: tl.constexpr, BLOCK: tl.constexpr,
):
    """keys[row, h, c] = idx where valid (0 <= idx < len, c < visible), else INT32_MAX."""
    bh = tl.program_id(1)
    b = bh // HIDX
    h = bh % HIDX
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    for r in range(tl.program_id(0), q_len, tl.num_programs(0)):  # grid-stride over rows
        row = (q_start + r).to(tl.int64)
        if ORDINARY:
            bound = q_len
        else:
            bound = tl.load(kv_lens_ptr + b)
        n_cols = tl.minimum(tl.maximum(r + bound - q_len + 1, 0), W)
        cols = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
        e = tl.load(idx_ptr + row * stride_it + h * stride_ih + cols, mask=cols < n_cols, other=-1)
        ok = (cols < n_cols) & (e >= 0) & (e < bound)
        tl.store(keys_ptr + row * stride_kt + h * stride_kh + cols, tl.where(ok, e, _BIG),
                 mask=cols < W)


def sorted_keys(indices, cu_seqlens_q, kv_lens, max_seqlen_q: int, ordinary: bool):
    """Each row's index entries masked (invalid or past the visible count -> INT32_MAX) and sorted
    ascending with ``torch.sort`` (one segmented sort over all rows: much cheaper than sorting
    inside the union kernels, whose 4096-lane tiles leave one program per SM). Same shape as
    ``indices``, int32."""
    keys = torch.empty(indices.shape, dtype=torch.int32, device=indices.device)
    t, w = indices.shape[0], indices.shape[-1]
    if t == 0:
        return keys
    hidx = indices.shape[1] if indices.dim() == 3 else 1
    requests = cu_seqlens_q.shape[0] - 1
    block = min(1024, triton.next_power_of_2(w))
    _qsa_mask_keys[(max_seqlen_q, requests * hidx, triton.cdiv(w, block))](
        indices, keys, cu_seqlens_q, kv_lens, w, indices.stride(0),
        indices.stride(1) if indices.dim() == 3 else 0, keys.stride(0),
        keys.stride(1) if keys.dim() == 3 else 0,
        HIDX=hidx, ORDINARY=ordinary, BLOCK=block, num_warps=4,
    )
    return torch.sort(keys, dim=-1).values


def presort_enabled() -> bool:
    """``QSA_GROUP_SORT`` (read on every call): ``torch`` (default: rows sorted by ``sorted_keys``
    before the union pre-pass) or ``kernel`` (``tl.sort`` inside the union pre-pass)."""
    return os.environ.get("QSA_GROUP_SORT", "torch").strip().lower() != "kernel"


def pair_geometry(group: int, block_n: int = 32, num_warps: int = 4, num_stages: int = 2) -> Geometry:
    """Geometry of the pair kernel: head tile next_pow2(2·G) (>= 16)."""
    return Geometry(max(16, triton.next_power_of_2(2 * group)), block_n, num_warps, num_stages,
                    "pairs-default")


def pair_union(mode: int, indices, cu_seqlens_q, base, kv_lens, slot_table, max_seqlen_q,
               num_warps: int = 16, presort: bool | None = None):
    """Run the union pre-pass. ``mode``: 0 ordinary, 1 chunk (``base`` = cu_seqlens_k), 2 paged
    (``slot_table``). Returns (union rows int32 [T, Hidx, 2W], row-(r+1) weights float32
    [T, Hidx, 2W], lengths int32 [T, Hidx, 2] = (union length, row-r columns)), written at each
    pair's first row. 16 warps: a 4096-lane tile then needs 128 registers per thread (8 warps:
    227, ptxas on sm_90), so more warps per SM hide the search latency."""
    t, w = indices.shape[0], indices.shape[-1]
    if w > MAX_PAIR_WIDTH:
        raise ValueError(f"pair kernel: W = {w} > {MAX_PAIR_WIDTH}")
    hidx = indices.shape[1] if indices.dim() == 3 else 1
    dev = indices.device
    urow = torch.empty((t, hidx, 2 * w), dtype=torch.int32, device=dev)
    uw = torch.empty((t, hidx, 2 * w), dtype=torch.float32, device=dev)
    ulen = torch.zeros((t, hidx, 2), dtype=torch.int32, device=dev)
    if t == 0:
        return urow, uw, ulen
    wp = triton.next_power_of_2(w)
    requests = cu_seqlens_q.shape[0] - 1
    presort = presort_enabled() if presort is None else presort
    if presort:
        indices = sorted_keys(indices, cu_seqlens_q, kv_lens, max_seqlen_q, mode == 0)
    grid = (triton.cdiv(max_seqlen_q, 2), requests * hidx)
    _qsa_pair_union[grid](
        indices, cu_seqlens_q, base, kv_lens, slot_table, urow, uw, ulen, w,
        indices.stride(0), indices.stride(1) if indices.dim() == 3 else 0,
        slot_table.stride(0) if slot_table.dim() == 2 else 0, urow.stride(0), urow.stride(1),
        ulen.stride(0),
        HIDX=hidx, WP=wp, LOG_WP=wp.bit_length() - 1, MODE=mode, PRESORTED=presort,
        num_warps=num_warps,
    )
    return urow, uw, ulen


def pairs_forward(kind: str, q, k, v, indices, cu_seqlens_q, *, cu_seqlens_k=None, kv_lens=None,
                  slot_table=None, max_seqlen_q: int, softmax_scale: float, k_scale: float = 1.0,
                  v_scale: float = 1.0, geometry: Geometry | tuple | None = None):
    """Sparse prefill of any variant through the pair kernels (no contract check here: the public
    entry points in ``prefill.py`` check first). Returns [T, Hq, D] in q's dtype."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    out = torch.empty_like(q)
    if t == 0:
        return out
    mode = {"ordinary": 0, "chunk": 1, "paged": 2}[kind]
    base = cu_seqlens_k if kind == "chunk" else cu_seqlens_q
    lens = kv_lens if kv_lens is not None else cu_seqlens_q
    table = slot_table if slot_table is not None else cu_seqlens_q
    urow, uw, ulen = pair_union(mode, indices, cu_seqlens_q, base, lens, table, max_seqlen_q)
    if geometry is None:
        geo = pair_geometry(g)
    elif isinstance(geometry, Geometry):
        geo = geometry
    else:
        geo = pair_geometry(g, *geometry[-3:])
    hidx = urow.shape[1]
    requests = cu_seqlens_q.shape[0] - 1
    _qsa_pair_attn[(triton.cdiv(max_seqlen_q, 2), requests * hkv)](
        q, k, v, out, cu_seqlens_q, urow, uw, ulen,
        float(softmax_scale) * float(k_scale) * 1.4426950408889634, float(v_scale),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), urow.stride(0), urow.stride(1), ulen.stride(0),
        HKV=hkv, HIDX=hidx, G=g, D=d, BLOCK_M=geo.block_m, BLOCK_N=geo.block_n,
        OFF64=_off64(k, v), num_warps=geo.num_warps, num_stages=geo.num_stages,
    )
    return out


def _off64(k, v) -> bool:
    from .prefill import needs_off64  # noqa: PLC0415 - prefill imports this module lazily

    return needs_off64(k, v)
