"""Experimental sparse prefill over *quads* of adjacent query rows sharing one gathered tile.

The four-row version of ``prefill_pairs.py`` (read its docstring first): one program serves rows
r0 .. r0+3 of one request, walks the union of their selections and gathers each union token's K/V
once; with ~90% neighbour overlap that is ~1.3 W gathered rows for four rows instead of 4 W. The
head tile is 4·G query heads (G = 12: 48 -> 64 rows, G = 6: 24 -> 32).

Pre-pass ``_qsa_quad_union`` (one program per (row group, index head)), 1-D tiles per row (a 2-D
[4, W] formulation took minutes to compile): each row's valid entries (0 <= idx < len, column <
visible) come sorted from ``prefill_pairs.sorted_keys`` (one torch.sort; ``QSA_GROUP_SORT=kernel``
sorts with tl.sort here instead); an entry of row a is *owned* by row a unless an earlier row of the group
selects the same token (lower-bound search + probe in the earlier rows' sorted tiles); the union
is the owned entries of row 0, then row 1, 2, 3 (physical K/V rows: cu_q[b] + idx, cu_k[b] + idx
or slot_table[b, idx]); per union entry, 4 weights: 0 for rows before the owner, 1 for the owner,
c_i(t) / c_a(t) for a later row i (counts of the token, so duplicates keep gather semantics).
Attention ``_qsa_quad_attn``: a score gets + log2(weight), weight 0 -> -inf.

Scratch: (T/4 + B) groups x Hidx x 4W int32 + 4 x 4W float32 (T = 8192, W = 2051: 67 + 269 MB
allocated, ~1.3 W x 20 B per group written). Selected with ``QSA_PREFILL_ALGO=quads``; W <= 8192.
Both kernels grid-stride over the request's row groups, so a too-small max_seqlen_q (a grid-size
hint) still covers every row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from interop.geometry import Geometry

from .prefill_pairs import _has_duplicates, _lower_bound, presort_enabled, sorted_keys

__all__ = ["quad_union", "quads_forward", "quad_geometry", "quad_slots", "MAX_QUAD_WIDTH"]

MAX_QUAD_WIDTH = 8192
_BIG = tl.constexpr(2**31 - 1)


@triton.jit
def _present(sorted_vals, t, WP: tl.constexpr, LOG_WP: tl.constexpr):
    """1 where t occurs in ``sorted_vals`` (one lower-bound search and one probe)."""
    lb = _lower_bound(sorted_vals, t, WP, LOG_WP)
    return ((tl.gather(sorted_vals, tl.minimum(lb, WP - 1), 0) == t) & (lb < WP)).to(tl.int32)


@triton.jit
def _count(sorted_vals, t, tn, dup, WP: tl.constexpr, LOG_WP: tl.constexpr):
    """Occurrences of t in ``sorted_vals``; a second search only when the tile has duplicates."""
    lb = _lower_bound(sorted_vals, t, WP, LOG_WP)
    c = ((tl.gather(sorted_vals, tl.minimum(lb, WP - 1), 0) == t) & (lb < WP)).to(tl.int32)
    if dup != 0:
        c = _lower_bound(sorted_vals, tn, WP, LOG_WP) - lb
    return c


@triton.jit
def _load_row(irow, j, n_rows, vis0, W, bound, WP: tl.constexpr):
    cols = tl.arange(0, WP)
    ncol = tl.where(j < n_rows, tl.minimum(tl.maximum(vis0 + j, 0), W), 0)
    e = tl.load(irow + cols, mask=cols < ncol, other=-1)
    v = (cols < ncol) & (e >= 0) & (e < bound)
    return e, v, tl.where(v, e, _BIG)


@triton.jit
def _store_row(urow, uw, stride_wi, ph, owned, off, w0, w1, w2, w3):
    """Store a row's owned entries at off + rank with their weights for rows 0..3."""
    slot = off + tl.cumsum(owned.to(tl.int32), 0) - 1
    tl.store(urow + slot, ph, mask=owned)
    tl.store(uw + slot, w0, mask=owned)
    tl.store(uw + stride_wi + slot, w1, mask=owned)
    tl.store(uw + 2 * stride_wi + slot, w2, mask=owned)
    tl.store(uw + 3 * stride_wi + slot, w3, mask=owned)
    return off + tl.sum(owned.to(tl.int32), 0)


@triton.jit
def _qsa_quad_union(
    idx_ptr, cu_q_ptr, base_ptr, kv_lens_ptr, table_ptr, urow_ptr, uw_ptr, ulen_ptr, W,
    stride_it, stride_ih, stride_tb, stride_ug, stride_uh, stride_wg, stride_wh, stride_wi,
    stride_lg,
    HIDX: tl.constexpr, WP: tl.constexpr, LOG_WP: tl.constexpr, MODE: tl.constexpr,
    PRESORTED: tl.constexpr,
):
    bh = tl.program_id(1)
    b = bh // HIDX
    hi = bh % HIDX
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    # grid-stride over the request's row groups (first rows 4·pid, 4·(pid + grid0), ...): a
    # too-small max_seqlen_q still covers every group
    for r0 in range(4 * tl.program_id(0), q_len, 4 * tl.num_programs(0)):
        gid = (q_start // 4 + b + r0 // 4).to(tl.int64)
        n_rows = tl.minimum(q_len - r0, 4)
        if MODE == 0:
            bound = q_len
            base = q_start
        else:
            bound = tl.load(kv_lens_ptr + b)
            if MODE == 1:
                base = tl.load(base_ptr + b)
            else:
                base = 0
        vis0 = r0 + bound - q_len + 1  # ordinary: bound = q_len -> r0 + 1
        irow = idx_ptr + (q_start + r0).to(tl.int64) * stride_it + hi * stride_ih
        e0, v0, t0 = _load_row(irow, 0, n_rows, vis0, W, bound, WP)
        e1, v1, t1 = _load_row(irow + stride_it, 1, n_rows, vis0, W, bound, WP)
        e2, v2, t2 = _load_row(irow + 2 * stride_it, 2, n_rows, vis0, W, bound, WP)
        e3, v3, t3 = _load_row(irow + 3 * stride_it, 3, n_rows, vis0, W, bound, WP)
        if PRESORTED:  # rows already masked and sorted (prefill_pairs.sorted_keys)
            s0 = t0
            s1 = t1
            s2 = t2
            s3 = t3
        else:
            s0 = tl.sort(t0)
            s1 = tl.sort(t1)
            s2 = tl.sort(t2)
            s3 = tl.sort(t3)
        dup = tl.maximum(tl.maximum(_has_duplicates(s0, WP), _has_duplicates(s1, WP)),
                         tl.maximum(_has_duplicates(s2, WP), _has_duplicates(s3, WP)))
        # ownership: not selected by an earlier row of the group
        o0 = v0
        o1 = v1 & (_present(s0, t1, WP, LOG_WP) == 0)
        o2 = v2 & ((_present(s0, t2, WP, LOG_WP) + _present(s1, t2, WP, LOG_WP)) == 0)
        o3 = v3 & ((_present(s0, t3, WP, LOG_WP) + _present(s1, t3, WP, LOG_WP)
                    + _present(s2, t3, WP, LOG_WP)) == 0)
        t0n = tl.where(v0, t0 + 1, _BIG)
        t1n = tl.where(v1, t1 + 1, _BIG)
        t2n = tl.where(v2, t2 + 1, _BIG)
        # own counts (duplicates inside the owner row) divide the later rows' counts
        one = tl.full([WP], 1.0, tl.float32)
        i0 = one
        i1 = one
        i2 = one
        if dup != 0:
            i0 = 1.0 / tl.maximum(_count(s0, t0, t0n, dup, WP, LOG_WP), 1).to(tl.float32)
            i1 = 1.0 / tl.maximum(_count(s1, t1, t1n, dup, WP, LOG_WP), 1).to(tl.float32)
            i2 = 1.0 / tl.maximum(_count(s2, t2, t2n, dup, WP, LOG_WP), 1).to(tl.float32)
        zero = tl.zeros([WP], tl.float32)
        if MODE == 2:
            trow = table_ptr + b.to(tl.int64) * stride_tb
            p0 = tl.load(trow + e0, mask=o0, other=-1)
            p1 = tl.load(trow + e1, mask=o1, other=-1)
            p2 = tl.load(trow + e2, mask=o2, other=-1)
            p3 = tl.load(trow + e3, mask=o3, other=-1)
        else:
            p0 = base + e0
            p1 = base + e1
            p2 = base + e2
            p3 = base + e3
        urow = urow_ptr + gid * stride_ug + hi * stride_uh
        uw = uw_ptr + gid * stride_wg + hi * stride_wh
        off = tl.zeros([], tl.int32)
        off = _store_row(urow, uw, stride_wi, p0, o0, off, one,
                         _count(s1, t0, t0n, dup, WP, LOG_WP).to(tl.float32) * i0,
                         _count(s2, t0, t0n, dup, WP, LOG_WP).to(tl.float32) * i0,
                         _count(s3, t0, t0n, dup, WP, LOG_WP).to(tl.float32) * i0)
        off = _store_row(urow, uw, stride_wi, p1, o1, off, zero, one,
                         _count(s2, t1, t1n, dup, WP, LOG_WP).to(tl.float32) * i1,
                         _count(s3, t1, t1n, dup, WP, LOG_WP).to(tl.float32) * i1)
        off = _store_row(urow, uw, stride_wi, p2, o2, off, zero, zero, one,
                         _count(s3, t2, t2n, dup, WP, LOG_WP).to(tl.float32) * i2)
        off = _store_row(urow, uw, stride_wi, p3, o3, off, zero, zero, zero, one)
        tl.store(ulen_ptr + gid * stride_lg + hi, off)


@triton.jit
def _qsa_quad_attn(
    q_ptr, k_ptr, v_ptr, o_ptr, cu_q_ptr, urow_ptr, uw_ptr, ulen_ptr, qk_scale, v_scale,
    stride_qt, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_ot, stride_oh,
    stride_ug, stride_uh, stride_wg, stride_wh, stride_wi, stride_lg,
    HKV: tl.constexpr, HIDX: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, OFF64: tl.constexpr,
):
    bh = tl.program_id(1)
    b = bh // HKV
    h = bh % HKV
    hi = h % HIDX
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    for r0 in range(4 * tl.program_id(0), q_len, 4 * tl.num_programs(0)):  # grid-stride (groups)
        gid = (q_start // 4 + b + r0 // 4).to(tl.int64)
        n_rows = tl.minimum(q_len - r0, 4)
        n_u = tl.load(ulen_ptr + gid * stride_lg + hi)
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, D)
        sub = offs_m // G
        m_ok = (offs_m < 4 * G) & (sub < n_rows)
        qrow = (q_start + r0 + sub).to(tl.int64)
        heads = (h * G + offs_m % G).to(tl.int64)
        q = tl.load(q_ptr + qrow[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=m_ok[:, None], other=0.0)
        urow = urow_ptr + gid * stride_ug + hi * stride_uh
        uw = uw_ptr + gid * stride_wg + hi * stride_wh
        k_head = k_ptr + h * stride_kh
        v_head = v_ptr + h * stride_vh
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        for start in range(0, n_u, BLOCK_N):
            cols = start + offs_n
            in_u = cols < n_u
            pr = tl.load(urow + cols, mask=in_u, other=-1)
            valid = in_u & (pr >= 0)
            if OFF64:  # see prefill.needs_off64
                kv_row = pr.to(tl.int64)
            else:
                kv_row = pr
            kt = tl.load(k_head + kv_row[:, None] * stride_kn + offs_d[None, :],
                         mask=valid[:, None], other=0.0).to(q.dtype)
            s = tl.dot(q, tl.trans(kt)) * qk_scale
            w0 = tl.load(uw + cols, mask=valid, other=0.0)
            w1 = tl.load(uw + stride_wi + cols, mask=valid, other=0.0)
            w2 = tl.load(uw + 2 * stride_wi + cols, mask=valid, other=0.0)
            w3 = tl.load(uw + 3 * stride_wi + cols, mask=valid, other=0.0)
            sel = sub[:, None]
            w = tl.where(sel == 0, w0[None, :], tl.where(sel == 1, w1[None, :],
                         tl.where(sel == 2, w2[None, :], w3[None, :])))
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


def quad_geometry(group: int, block_n: int = 32, num_warps: int = 4, num_stages: int = 2) -> Geometry:
    """Geometry of the quad kernel: head tile next_pow2(4·G) (>= 16)."""
    return Geometry(max(16, triton.next_power_of_2(4 * group)), block_n, num_warps, num_stages,
                    "quads-default")


def quad_slots(total_q: int, requests: int) -> int:
    """Scratch groups: request b's group g lives at q_start_b // 4 + b + g, unique because request
    b uses at most q_len_b // 4 + 1 groups; total <= T // 4 + B."""
    return total_q // 4 + requests


def quad_union(mode: int, indices, cu_seqlens_q, base, kv_lens, slot_table, max_seqlen_q: int,
               presort: bool | None = None):
    """Union pre-pass. ``mode``: 0 ordinary, 1 chunk (``base`` = cu_seqlens_k), 2 paged. Returns
    (union rows int32 [S, Hidx, 4W], weights float32 [S, Hidx, 4, 4W], lengths int32 [S, Hidx])
    with S = quad_slots(T, B)."""
    t, w = indices.shape[0], indices.shape[-1]
    if w > MAX_QUAD_WIDTH:
        raise ValueError(f"quad kernel: W = {w} > {MAX_QUAD_WIDTH}")
    hidx = indices.shape[1] if indices.dim() == 3 else 1
    requests = cu_seqlens_q.shape[0] - 1
    slots = quad_slots(t, requests)
    dev = indices.device
    urow = torch.empty((slots, hidx, 4 * w), dtype=torch.int32, device=dev)
    uw = torch.empty((slots, hidx, 4, 4 * w), dtype=torch.float32, device=dev)
    ulen = torch.zeros((slots, hidx), dtype=torch.int32, device=dev)
    if t == 0:
        return urow, uw, ulen
    wp = triton.next_power_of_2(w)
    presort = presort_enabled() if presort is None else presort
    if presort:
        indices = sorted_keys(indices, cu_seqlens_q, kv_lens, max_seqlen_q, mode == 0)
    _qsa_quad_union[(triton.cdiv(max_seqlen_q, 4), requests * hidx)](
        indices, cu_seqlens_q, base, kv_lens, slot_table, urow, uw, ulen, w,
        indices.stride(0), indices.stride(1) if indices.dim() == 3 else 0,
        slot_table.stride(0) if slot_table.dim() == 2 else 0, urow.stride(0), urow.stride(1),
        uw.stride(0), uw.stride(1), uw.stride(2), ulen.stride(0),
        HIDX=hidx, WP=wp, LOG_WP=wp.bit_length() - 1, MODE=mode, PRESORTED=presort,
        num_warps=16,  # 8 warps: 255 registers + spills per thread (ptxas, sm_90); 16: 128
    )
    return urow, uw, ulen


def quads_forward(kind: str, q, k, v, indices, cu_seqlens_q, *, cu_seqlens_k=None, kv_lens=None,
                  slot_table=None, max_seqlen_q: int, softmax_scale: float, k_scale: float = 1.0,
                  v_scale: float = 1.0, geometry: Geometry | tuple | None = None):
    """Sparse prefill of any variant through the quad kernels (no contract check here: the public
    entry points in ``prefill.py`` check first). Returns [T, Hq, D] in q's dtype."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    grp = hq // hkv
    out = torch.empty_like(q)
    if t == 0:
        return out
    mode = {"ordinary": 0, "chunk": 1, "paged": 2}[kind]
    base = cu_seqlens_k if kind == "chunk" else cu_seqlens_q
    lens = kv_lens if kv_lens is not None else cu_seqlens_q
    table = slot_table if slot_table is not None else cu_seqlens_q
    urow, uw, ulen = quad_union(mode, indices, cu_seqlens_q, base, lens, table, max_seqlen_q)
    if geometry is None:
        geo = quad_geometry(grp)
    elif isinstance(geometry, Geometry):
        geo = geometry
    else:
        geo = quad_geometry(grp, *geometry[-3:])
    requests = cu_seqlens_q.shape[0] - 1
    _qsa_quad_attn[(triton.cdiv(max_seqlen_q, 4), requests * hkv)](
        q, k, v, out, cu_seqlens_q, urow, uw, ulen,
        float(softmax_scale) * float(k_scale) * 1.4426950408889634, float(v_scale),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), urow.stride(0), urow.stride(1), uw.stride(0), uw.stride(1),
        uw.stride(2), ulen.stride(0),
        HKV=hkv, HIDX=urow.shape[1], G=grp, D=d, BLOCK_M=geo.block_m, BLOCK_N=geo.block_n,
        OFF64=_off64(k, v), num_warps=geo.num_warps, num_stages=geo.num_stages,
    )
    return out


def _off64(k, v) -> bool:
    from .prefill import needs_off64  # noqa: PLC0415 - prefill imports this module lazily

    return needs_off64(k, v)
