"""Sparse prefill (``qsa-contract.md`` §3) as Triton kernels behind PyTorch custom ops.

Three entry points, one kernel body (``MODE``): ordinary (K/V are this forward's rows, packed
like q), chunk (each request's full context at rows ``cu_seqlens_k[b]..``) and paged (the pool,
position p of request b at slot ``req_to_token[req_indices[b], p]``).

Algorithm: the flash-attention forward (Dao et al., 2022) over gathered rows, as upstream
SGLang's sparse prefill: one program per (query row, KV head) holds the G query heads as a
BLOCK_M head tile with an FP32 accumulator [BLOCK_M, D], walks the row's index columns in
BLOCK_N steps up to ``min(W, visible)``, gathers the named K/V rows and runs the online softmax
in base 2 on FP32 scores scaled by ``softmax_scale * k_scale * log2(e)`` (P cast to q's dtype
for P·V); ``out = acc * v_scale / l``. Invalid entries (valid iff ``0 <= idx < len``) and
columns past ``min(W, visible)`` are masked, so the result does not depend on BLOCK_N; a row
with no valid entry stores exact zeros. The denominator is a [BLOCK_M, BLOCK_N] running sum
reduced once per row; the accumulator and that sum move to a new reference max only when a
head's max grows by more than 2^8 (conditional rescaling, FlashAttention-4, Dao et al. 2025);
K/V offsets are 32-bit below 2**31 elements (``needs_off64``).

Grid (min(max_seqlen_q, T), B * Hkv), as upstream's. max_seqlen_q is only a hint (row counts live
on the device): a tail launch (``ROW_LOOP``, TAIL_PROGRAMS programs per request and KV head) loops over
the rows past it, a separate variant because the row loop costs registers in the main kernel; it
also writes the zeros of the rows outside every request, so the output is never pre-filled (no
memset pass over it). Where the device has Programmatic Dependent Launch (sm_90+), the tail is
the main grid's PDL dependent (triggered at entry; its program 0 waits for the main grid before
exiting): its launch overlaps the main grid's last wave instead of following it.
Short prefills (``Geometry.splits`` > 1, ``interop.geometry.prefill_splits``): split-KV as in
decode (FlashDecoding, Dao et al., 2023): the main grid gets a third axis, each program a
contiguous share of whole BLOCK_N steps, storing its normalized FP32 output and base-2 LSE;
``_qsa_prefill_merge`` combines them per (row, KV head) in split order (deterministic).

Paged: a pre-pass (``resolve_pool_slots``) maps every entry to its pool slot once. FP8 K/V
(chunk, paged): the dots run in float16 (``qsa_triton._fp8``). Block-level selections
(``block_indices=``): the tile-union kernel (``qsa_triton.prefill_union``) or this kernel after
an on-device expansion, as ``interop.geometry.select_prefill_blocks`` says
(``QSA_PREFILL_GEOMETRY``, read on every call).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from interop import contract
from interop.arch import DeviceFacts
from interop.geometry import (BLOCK_INDICES_DOC, PREFILL_SPLIT_RULES, Geometry, UnionGeometry,
                              geometry_mode, select_prefill, select_prefill_blocks)
from interop.plan import LOG2E, next_pow2

from . import prefill_union as PU
from .prefill_union import last_position, pool_slot, request_table, row_runs, softmax_weights
from ._fp8 import fp16_query
from .decode import _pdl_supported
from ._interp_guard import (check_device, check_interpreter_dtype, check_torch_tensors,
                            refuse_traced, traced_refusal)

__all__ = ["sparse_prefill", "sparse_prefill_chunk", "sparse_prefill_paged", "prefill_geometry",
           "prefill_block_geometry", "MODE_ORDINARY", "MODE_CHUNK", "MODE_SLOTS"]


#: kernel modes (a constexpr): how an index entry becomes a K/V row and when it is valid
MODE_ORDINARY = 0  # row = cu_seqlens[b] + idx, valid iff 0 <= idx < q_len_b
MODE_CHUNK = 1  # row = cu_seqlens_k[b] + idx, valid iff 0 <= idx < kv_lens[b]
MODE_SLOTS = 2  # entries are pool slots resolved by the pre-pass; valid iff slot >= 0


@triton.jit
def _prefill_row(
    r, b, h, q_start, q_len,
    q_ptr, k_ptr, v_ptr, o_ptr, idx_ptr, cu_k_ptr, kv_lens_ptr,
    qk_scale, v_scale, W, kv_rows,
    stride_qt, stride_qh, stride_kh, stride_kn, stride_vh, stride_vn,
    stride_ot, stride_oh, stride_it, stride_ih,
    po_ptr, plse_ptr, n_splits, stride_ps, stride_pl, hq,
    G: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr, OFF64: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """Query row r of request b, KV head h: the whole online-softmax walk and the store; with
    ``SPLIT``, program_id(2)'s share of the columns, its normalized partial output and base-2
    LSE stored to ``po`` [n_splits, T, Hq, D] / ``plse`` [n_splits, T, Hq] (fp32) for
    ``_qsa_prefill_merge``."""
    row = (q_start + r).to(tl.int64)
    if MODE == 0:
        kv_len = q_len
        visible = r + 1
    else:
        kv_len = tl.load(kv_lens_ptr + b)
        visible = r + kv_len - q_len + 1  # bottom-right causal
    if MODE == 0:
        kv_base = q_start
    elif MODE == 1:
        kv_base = tl.load(cu_k_ptr + b)
    else:
        kv_base = 0
    last_pos = last_position(kv_base, kv_rows)  # lying ranges clamp into k, no overflow
    n_cols = tl.minimum(tl.maximum(visible, 0), W)

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    head_ok = offs_m < G
    heads = (h * G + offs_m).to(tl.int64)
    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=head_ok[:, None], other=0.0)
    if k_ptr.dtype.element_ty == tl.float8e4nv:
        q, qk_scale = fp16_query(q, qk_scale)  # FP8 K/V: the dots in fp16 (qsa_triton._fp8)
    idx_row = idx_ptr + row * stride_it + h * stride_ih
    k_head = k_ptr + h * stride_kh
    v_head = v_ptr + h * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    # the softmax denominator as a [BLOCK_M, BLOCK_N] running sum, reduced once after the loop:
    # no cross-warp row sum (shuffles, a shared-memory round trip, two barriers) per tile
    l_i = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    if SPLIT:  # shares of whole BLOCK_N steps: the column masks match the unsplit walk
        per = tl.cdiv(tl.cdiv(W, BLOCK_N), n_splits) * BLOCK_N
        c_lo = tl.program_id(2) * per
        c_hi = tl.minimum(n_cols, c_lo + per)
    else:
        c_lo = 0
        c_hi = n_cols
    for start in range(c_lo, c_hi, BLOCK_N):
        cols = start + offs_n
        in_row = cols < c_hi
        ent = tl.load(idx_row + cols, mask=in_row, other=-1)
        if MODE == 2:
            valid = in_row & (ent >= 0)
            kv_row = ent
        else:
            valid = in_row & (ent >= 0) & (ent < kv_len)
            # lying cu_seqlens can point past k/v: clamped into its rows (qsa_pallas's rule);
            # min before the add: kv_base + ent never passes kv_rows - 1 (no int32 overflow)
            kv_row = tl.maximum(kv_base + tl.minimum(ent, last_pos), 0)
        if OFF64:
            # row x stride overflows int32 once k/v hold >= 2^31 elements (pool > ~4.2M
            # slots at Hkv x D = 512); below that every valid offset fits int32 exactly and
            # the 32-bit math saves registers
            kv_row = kv_row.to(tl.int64)
        k = tl.load(k_head + kv_row[:, None] * stride_kn + offs_d[None, :],
                    mask=valid[:, None], other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        p, acc, m_i, l_i = softmax_weights(s, acc, m_i, l_i)  # conditional rescaling
        v = tl.load(v_head + kv_row[:, None] * stride_vn + offs_d[None, :],
                    mask=valid[:, None], other=0.0)
        if v.dtype == tl.float8e4nv:
            # convert in the load layout: behind the select (a no-op on masked-zero rows) Triton
            # cannot hoist the cast past its shared-memory load into the P.V operand layout,
            # where each register needs four rows' bytes (byte-wide shared loads; bench/NOTES.md)
            v = tl.where(valid[:, None], v.to(tl.float16), 0.0)
        else:
            v = v.to(q.dtype)
        acc = tl.dot(p.to(q.dtype), v, acc)
    l_i = tl.sum(l_i, 1)
    has = l_i > 0.0
    if SPLIT:
        sp = tl.program_id(2).to(tl.int64)
        lane = row * hq + heads  # partials are [n_splits, T, Hq(, D)], contiguous
        part = acc * tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)[:, None]
        tl.store(po_ptr + sp * stride_ps + lane[:, None] * D + offs_d[None, :], part,
                 mask=head_ok[:, None])
        lse = tl.where(has, m_i + tl.math.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(plse_ptr + sp * stride_pl + lane, lse, mask=head_ok)
    else:
        inv = tl.where(has, v_scale / tl.where(has, l_i, 1.0), 0.0)
        out = acc * inv[:, None]
        tl.store(o_ptr + row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=head_ok[:, None])


@triton.jit
def _request_rows(cu_q_ptr, b, n_rows):
    """Request b's q_start, q_len and the request-relative rows [r_lo, r_hi) that lie inside
    [0, n_rows): a lying cu_seqlens_q never makes a kernel read or write past q / out (int64
    bounds: a lying q_start may sit near the int32 limits)."""
    q_start = tl.load(cu_q_ptr + b)
    q_end = tl.load(cu_q_ptr + b + 1)
    r_lo = tl.maximum(q_start, 0).to(tl.int64) - q_start
    r_hi = tl.minimum(q_end, n_rows).to(tl.int64) - q_start
    return q_start, q_end - q_start, r_lo, r_hi


@triton.jit
def _qsa_sparse_prefill_fwd(
    q_ptr, k_ptr, v_ptr, o_ptr, idx_ptr,
    cu_q_ptr, cu_k_ptr, kv_lens_ptr, ulen_ptr, po_ptr, plse_ptr,
    qk_scale, v_scale, W, row_base, n_rows, kv_rows, n_slots, max_union, union_rows,
    stride_qt, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
    stride_ot, stride_oh, stride_it, stride_ih, stride_ls, stride_lh,
    n_splits, stride_ps, stride_pl, hq,
    HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr, OFF64: tl.constexpr,
    ROW_LOOP: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr,
):
    bh = tl.program_id(1)
    b = bh // HKV
    h = bh % HKV
    if not ROW_LOOP and PDL:
        # the tail launch (rows past max_seqlen_q, rows outside every request) is this grid's
        # PDL dependent: it writes other rows and reads nothing this grid writes, so it may run
        # beside this grid's last wave instead of after it (module docstring)
        tl.extra.cuda.gdc_launch_dependents()
    q_start, q_len, r_lo, r_hi = _request_rows(cu_q_ptr, b, n_rows)
    if ROW_LOOP:
        _zero_outside_rows(o_ptr, cu_q_ptr, n_rows, b, h, stride_ot, stride_oh, HKV, G, D,
                           BLOCK_M)
        # the tail launch: rows row_base + pid, + grid0, ... < q_len (none when the host's
        # max_seqlen_q = row_base was right); a separate variant (module docstring)
        for r in range(tl.maximum(r_lo, row_base) + tl.program_id(0), r_hi, tl.num_programs(0)):
            if row_runs(ulen_ptr, stride_ls, stride_lh, n_slots, max_union, q_start, b,
                         tl.cast(r, tl.int32), h, union_rows):
                _prefill_row(tl.cast(r, tl.int32), b, h, q_start, q_len, q_ptr, k_ptr, v_ptr,
                             o_ptr, idx_ptr, cu_k_ptr, kv_lens_ptr, qk_scale, v_scale, W, kv_rows,
                             stride_qt, stride_qh, stride_kh, stride_kn, stride_vh, stride_vn,
                             stride_ot, stride_oh, stride_it, stride_ih, po_ptr, plse_ptr,
                             n_splits, stride_ps, stride_pl, hq, G, D, BLOCK_M, BLOCK_N, MODE,
                             OFF64, False)
        if PDL:
            # launched as the main grid's PDL dependent: program 0 waits for it before exiting,
            # so this grid (and the call) completes after it
            if (tl.program_id(0) == 0) & (bh == 0):
                tl.extra.cuda.gdc_wait()
    else:
        r = row_base + tl.program_id(0)
        if (r >= r_lo) & (r < r_hi):
            if row_runs(ulen_ptr, stride_ls, stride_lh, n_slots, max_union, q_start, b, r, h,
                         union_rows):
                _prefill_row(r, b, h, q_start, q_len, q_ptr, k_ptr, v_ptr, o_ptr, idx_ptr,
                             cu_k_ptr, kv_lens_ptr, qk_scale, v_scale, W, kv_rows, stride_qt,
                             stride_qh, stride_kh, stride_kn, stride_vh, stride_vn, stride_ot,
                             stride_oh, stride_it, stride_ih, po_ptr, plse_ptr, n_splits,
                             stride_ps, stride_pl, hq, G, D, BLOCK_M, BLOCK_N, MODE, OFF64, SPLIT)
        if PDL and not SPLIT:
            # where launched as the tile-union kernel's PDL dependent (qsa_triton.prefill_union,
            # module docstring, 3): it writes other rows (row_runs maps rows to tiles as its
            # _tile_of does, so each row has one writer) and reads nothing this grid writes.
            # Program 0 waits for it before exiting, so this grid (and the call) completes
            # after it; the others exit when done, freeing their slot for the union kernel.
            # (A launch without a PDL primary returns from the wait at once; a union call is
            # never split.)
            if (tl.program_id(0) == 0) & (bh == 0):
                tl.extra.cuda.gdc_wait()


@triton.jit
def _zero_outside_rows(o_ptr, cu_q_ptr, n_rows, b, h, stride_ot, stride_oh, HKV: tl.constexpr,
                       G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr):
    """Exact zeros in the rows of out outside every request, [0, cu_q[0]) and [cu_q[B], T)
    clipped to [0, T) (qsa-contract.md §7), for KV head h's query heads: the output is not
    pre-filled. Tail program (p, b) takes the outside rows p + grid0 * b, step grid0 * B (none
    when cu_q spans [0, T), the usual call)."""
    n_req = tl.num_programs(1) // HKV
    lo = tl.minimum(tl.maximum(tl.load(cu_q_ptr), 0), n_rows)
    hi = tl.minimum(tl.maximum(tl.load(cu_q_ptr + n_req), lo), n_rows)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    heads = (h * G + offs_m).to(tl.int64)
    zero = tl.zeros([BLOCK_M, D], o_ptr.dtype.element_ty)
    step = tl.num_programs(0) * n_req
    for x in range(tl.program_id(0) + tl.num_programs(0) * b, lo + (n_rows - hi), step):
        row = tl.where(x < lo, x, hi + (x - lo)).to(tl.int64)
        tl.store(o_ptr + row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :], zero,
                 mask=(offs_m < G)[:, None])


@triton.jit
def _qsa_prefill_merge(
    o_ptr, po_ptr, plse_ptr, cu_q_ptr, v_scale, n_rows, stride_ot, stride_oh, n_splits,
    stride_ps, stride_pl, hq,
    HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
    SP: tl.constexpr,
):
    """The output of query row program_id(0) of request program_id(1) // HKV, KV head
    program_id(1) % HKV (the split launch's grid, whose programs wrote every partial read here)
    from its ``n_splits`` (<= SP) partials: each weighted by 2**(lse - max lse), summed in split
    order (deterministic); a head no split saw gets exact zeros."""
    bh = tl.program_id(1)
    b = bh // HKV
    h = bh % HKV
    q_start, q_len, r_lo, r_hi = _request_rows(cu_q_ptr, b, n_rows)
    r = tl.program_id(0)
    if (r >= r_lo) & (r < r_hi):
        row = (q_start + r).to(tl.int64)
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D)
        offs_s = tl.arange(0, SP)
        head_ok = offs_m < G
        heads = (h * G + offs_m).to(tl.int64)
        lane = row * hq + heads
        lse = tl.load(plse_ptr + offs_s.to(tl.int64)[:, None] * stride_pl + lane[None, :],
                      mask=(offs_s < n_splits)[:, None] & head_ok[None, :], other=float("-inf"))
        mx = tl.max(lse, 0)
        w = tl.math.exp2(lse - tl.where(mx == float("-inf"), 0.0, mx)[None, :])  # [SP, BLOCK_M]
        den = tl.sum(w, 0)
        num = tl.zeros([BLOCK_M, D], tl.float32)
        for s in range(n_splits):
            ws = tl.sum(tl.where((offs_s == s)[:, None], w, 0.0), 0)
            part = tl.load(po_ptr + s * stride_ps + lane[:, None] * D + offs_d[None, :],
                           mask=head_ok[:, None] & (ws > 0.0)[:, None], other=0.0)
            num += ws[:, None] * part
        out = num * tl.where(den > 0.0, v_scale / tl.where(den > 0.0, den, 1.0), 0.0)[:, None]
        tl.store(o_ptr + row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=head_ok[:, None])


@triton.jit
def _qsa_resolve_pool_slots(
    idx_ptr, slots_ptr, cu_q_ptr, kv_lens_ptr, r2t_ptr, req_idx_ptr, W, max_reqs, max_context,
    pool_slots, n_rows, stride_it, stride_ih, stride_st, stride_sh, stride_rt,
    HIDX: tl.constexpr, BLOCK: tl.constexpr,
):
    """slots[row, h, c] = req_to_token[req_indices[b], idx] for valid entries, else -1.

    Valid: c < visible, 0 <= idx < min(kv_lens[b], max_context), 0 <= req_indices[b] < max_reqs
    and the slot inside [0, pool_slots): lying metadata becomes an invalid entry, and neither the
    table nor the pool is read outside its bounds. Grid: (max_q, B * HIDX, cdiv(W, BLOCK)); rows
    past max_q are reached by a grid-stride loop, so a too-small max_q still resolves every row."""
    bh = tl.program_id(1)
    b = bh // HIDX
    h = bh % HIDX
    q_start, q_len, r_lo, r_hi = _request_rows(cu_q_ptr, b, n_rows)
    kv_len = tl.load(kv_lens_ptr + b)
    table_row, bound = request_table(r2t_ptr, req_idx_ptr, b, kv_len, max_reqs, max_context,
                                     stride_rt)
    cols = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    for r in range(r_lo + tl.program_id(0), r_hi, tl.num_programs(0)):  # grid-stride over rows
        row = q_start + r
        n_cols = tl.minimum(tl.maximum(r + kv_len - q_len + 1, 0), W)
        ent = tl.load(idx_ptr + row * stride_it + h * stride_ih + cols, mask=cols < n_cols, other=-1)
        tl.store(slots_ptr + row * stride_st + h * stride_sh + cols,
                 pool_slot(ent, cols < n_cols, table_row, bound, pool_slots), mask=cols < W)


# ---------------------------------------------------------------------------------------------
# Device facts and geometry
_INTERPRETER_FACTS = DeviceFacts.for_arch("sm_90", name="Triton interpreter (CPU)",
                                          triton_version=triton.__version__)


def _shape_args(q: torch.Tensor, num_kv_heads: int) -> dict:
    """The selectors' arguments that come from q and its device (CPU tensors: sm_90 facts)."""
    t, hq, d = q.shape
    facts = DeviceFacts.from_torch(q.device) if q.is_cuda else _INTERPRETER_FACTS
    return dict(facts=facts, total_q=max(t, 1), group=hq // num_kv_heads,
                num_kv_heads=num_kv_heads, head_dim=d)


def prefill_geometry(kind: str, q: torch.Tensor, *, requests: int, max_q: int, num_kv_heads: int,
                     width: int, kv_bytes: int = 2) -> Geometry:
    """Geometry the entry points use for this call: ``interop.geometry.select_prefill`` on the
    facts of q's device. ``kind``: "ordinary" | "chunk" | "paged"; q: [T, Hq, D]; requests: B;
    max_q: max_seqlen_q; width: W; kv_bytes: bytes per K/V element (1 for FP8). Raises
    ContractError for a bad ``QSA_PREFILL_GEOMETRY``."""
    return select_prefill(kind=kind, requests=requests, max_q=max_q, width=width,
                          kv_bytes=kv_bytes, **_shape_args(q, num_kv_heads))


def prefill_block_geometry(kind: str, q: torch.Tensor, *, requests: int, max_q: int,
                           num_kv_heads: int, block_width: int, kv_bytes: int = 2,
                           overlap: float | None = None) -> UnionGeometry:
    """Kernel and geometry for block-level selections (``interop.geometry.
    select_prefill_blocks``): as ``prefill_geometry`` with NB for W and ``overlap``, the engine's
    hint (expected neighbour Jaccard of the block selections) or None."""
    return select_prefill_blocks(kind=kind, requests=requests, max_q=max_q,
                                 block_width=block_width, kv_bytes=kv_bytes, overlap=overlap,
                                 **_shape_args(q, num_kv_heads))


def _geometry_from(forced, kind, q, k, **kw) -> Geometry:
    """The selector's geometry, or a forced one (benchmarks): a ``Geometry`` or a tuple
    ([BLOCK_M,] BLOCK_N, num_warps, num_stages). Raises ValueError for a forced head tile
    smaller than G (heads past it would never be written: the output is not pre-filled)."""
    hkv = k.shape[1]
    if forced is None:
        return prefill_geometry(kind, q, num_kv_heads=hkv, kv_bytes=k.element_size(), **kw)
    if isinstance(forced, Geometry):
        geo = forced
    else:
        bn, nw, ns = forced[-3:]
        bm = forced[0] if len(forced) == 4 else max(16, next_pow2(q.shape[1] // hkv))
        geo = Geometry(int(bm), int(bn), int(nw), int(ns), "forced")
    if geo.block_m < q.shape[1] // hkv:
        raise ValueError(f"forced geometry {geo}: BLOCK_M < G = {q.shape[1] // hkv}")
    return geo


def needs_off64(k: torch.Tensor, v: torch.Tensor) -> bool:
    """64-bit K/V row offsets: k or v holds >= 2^31 elements (row x stride can overflow int32)."""
    return max(k.numel(), v.numel()) >= 2**31


#: programs per (request, KV head) of the tail launch (rows past a too-small max_seqlen_q)
TAIL_PROGRAMS = 8


def merge_split_tile(splits: int = 1) -> int:
    """The merge kernel's SP: its [SP, BLOCK_M] LSE tile must cover ``splits`` (else shares are
    dropped); it is sized to the rule's ``max_splits`` (read per call, as ``Geometry`` reads it)
    so that one compiled merge serves every count the selector gives, and past it only when a
    geometry built under a raised rule brings more."""
    return next_pow2(max(int(splits), PREFILL_SPLIT_RULES["max_splits"]))


def tail_geometry(geo: Geometry) -> Geometry:
    """The tail launch's geometry: the main head tile, BLOCK_N 32, 4 warps, 2 stages (~42 KB of
    shared memory at D = 256: fits every arch; speed is irrelevant there)."""
    return Geometry(geo.block_m, 32, 4, 2, "tail")


_KINDS = {MODE_ORDINARY: "ordinary", MODE_CHUNK: "chunk", MODE_SLOTS: "paged"}


def _launch(mode, q, k, v, idx, cu_q, cu_k, kv_lens, max_q, scale, k_scale, v_scale, geometry,
            skip=None, out=None, union_pdl=False):
    """Both launches of one call (main grid, then the tail); ``geometry`` None: the selector;
    ``skip``: None, or (union lengths int32 [S, H], tile rows R, max_union) of a block-level
    call whose tiles within ``max_union`` the tile-union kernel computes (their rows are left
    as they are here). ``out``: the output to write (None: a new one; not pre-filled: every
    row is written, the tail launch zeroes the rows outside every request); ``union_pdl``:
    the main launch is the PDL dependent of the tile-union kernel just launched
    (``qsa_triton.prefill_union``, module docstring, 3)."""
    out = torch.empty_like(q) if out is None else out
    t, hq, d = q.shape
    hkv = k.shape[1]
    if t == 0 or k.shape[0] == 0:  # nothing to compute / gather from: every entry is invalid
        return out.zero_()
    max_q = min(max_q, t)  # no request has more rows than q: a larger hint only adds idle programs
    requests = cu_q.shape[0] - 1
    geo = _geometry_from(geometry, _KINDS[mode], q, k, requests=requests, max_q=max_q,
                         width=idx.shape[-1])
    ulen, ur, max_union = skip if skip is not None else (cu_q, 0, 0)
    args = (q, k, v, out, idx, cu_q, cu_k, kv_lens, ulen,
            float(scale) * float(k_scale) * LOG2E, float(v_scale), idx.shape[-1])
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
               out.stride(0), out.stride(1), idx.stride(0), idx.stride(1) if idx.dim() == 3 else 0,
               ulen.stride(0) if ur else 0, ulen.stride(1) if ur and ulen.shape[1] > 1 else 0)
    consts = dict(HKV=hkv, G=hq // hkv, D=d, BLOCK_M=geo.block_m, MODE=mode,
                  OFF64=needs_off64(k, v))
    # split-KV (geo.splits > 1; not with a union, whose rows the tile kernel writes): the main
    # launch writes fp32 partials, merged into out below; the tail launch writes out itself
    splits = int(geo.splits) if skip is None else 1  # Geometry checks its range
    po, plse = ((torch.empty((splits, t, hq, d), dtype=torch.float32, device=q.device),
                 torch.empty((splits, t, hq), dtype=torch.float32, device=q.device))
                if splits > 1 else (out, out))
    parts = (splits, t * hq * d, t * hq, hq)
    pdl = _pdl_supported(q.device)
    for row_loop, g, grid0, row_base in ((False, geo, max_q, 0),
                                         (True, tail_geometry(geo), TAIL_PROGRAMS, max_q)):
        split = splits > 1 and not row_loop
        # the main launch: the union kernel's dependent where union_pdl; the tail: the main
        # launch's (module docstring). launch_pdl only when on (interpreter: never)
        launch_pdl = union_pdl if not row_loop else pdl
        _qsa_sparse_prefill_fwd[(grid0, requests * hkv, splits if split else 1)](
            *args[:9], po, plse, *args[9:], row_base, t, k.shape[0], ulen.shape[0], max_union,
            ur, *strides, *parts, **consts, BLOCK_N=g.block_n, ROW_LOOP=row_loop, SPLIT=split,
            PDL=pdl, num_warps=g.num_warps, num_stages=g.num_stages,
            **({"launch_pdl": True} if launch_pdl else {}))
    if splits > 1:
        _qsa_prefill_merge[(max_q, requests * hkv)](
            out, po, plse, cu_q, float(v_scale), t, out.stride(0), out.stride(1), *parts,
            HKV=hkv, G=hq // hkv, D=d, BLOCK_M=geo.block_m, SP=merge_split_tile(splits),
            num_warps=4)
    return out


# ---------------------------------------------------------------------------------------------
# Implementations (the custom ops' bodies, after the entry points' checks; benchmarks and tests
# may force a ``geometry``)
def _prefill_impl(q, k, v, indices, cu_seqlens, max_seqlen_q, softmax_scale, geometry=None):
    return _launch(MODE_ORDINARY, q, k, v, indices, cu_seqlens, cu_seqlens, cu_seqlens,
                   max_seqlen_q, softmax_scale, 1.0, 1.0, geometry)


def _chunk_impl(q, k, v, indices, cu_seqlens_q, cu_seqlens_k, kv_lens, max_seqlen_q,
                softmax_scale, k_scale, v_scale, geometry=None):
    return _launch(MODE_CHUNK, q, k, v, indices, cu_seqlens_q, cu_seqlens_k, kv_lens,
                   max_seqlen_q, softmax_scale, k_scale, v_scale, geometry)


def resolve_pool_slots(indices, req_to_token, req_indices, cu_seqlens_q, kv_lens, max_seqlen_q,
                       pool_slots: int) -> torch.Tensor:
    """Pre-pass of the paged variant: the pool slot of every index entry.

    int32 ``indices`` [T, W] or [T, Hkv, W], ``req_to_token`` [max_reqs, max_context],
    ``req_indices`` [B], ``cu_seqlens_q`` [B + 1], ``kv_lens`` [B] on one device; host ints
    ``max_seqlen_q`` (grid-size hint) and ``pool_slots``. Returns int32 of indices' shape:
    ``req_to_token[req_indices[b], idx]`` where the entry is valid (column < visible,
    0 <= idx < kv_lens[b], in bounds of the table and the pool), else -1; rows past
    cu_seqlens_q[B] unwritten.
    """
    t, w = indices.shape[0], indices.shape[-1]
    if req_to_token.numel() == 0:  # an empty table: every entry is invalid
        return torch.full(indices.shape, -1, dtype=torch.int32, device=indices.device)
    slots = torch.empty(indices.shape, dtype=torch.int32, device=indices.device)
    if t == 0:
        return slots
    hidx = indices.shape[1] if indices.dim() == 3 else 1
    block = min(1024, triton.next_power_of_2(w))
    grid = (min(max_seqlen_q, t), (cu_seqlens_q.shape[0] - 1) * hidx, triton.cdiv(w, block))
    _qsa_resolve_pool_slots[grid](
        indices, slots, cu_seqlens_q, kv_lens, req_to_token, req_indices, w,
        req_to_token.shape[0], req_to_token.shape[1], min(int(pool_slots), 2**31 - 1),
        indices.shape[0], indices.stride(0), indices.stride(1) if indices.dim() == 3 else 0,
        slots.stride(0), slots.stride(1) if slots.dim() == 3 else 0, req_to_token.stride(0),
        HIDX=hidx, BLOCK=block, num_warps=4,
    )
    return slots


def _blocks_impl(mode, q, k, v, block_indices, cu_q, cu_k, kv_lens, req_to_token, req_indices,
                 max_q, scale, k_scale, v_scale, overlap=None, geometry=None):
    """Block-level selections, any mode, as the selector (or a forced ``UnionGeometry``) says
    (``qsa_triton.prefill_union``, module docstring): ``"union"``: the union build, this
    kernel on the expansion of the rows of tiles past the work bound, the tile-union kernel on
    the other tiles; ``"rows"``: this kernel on the expansion. Paged: the expansion writes pool
    slots. Metadata the mode does not read may be any int32 tensor."""
    geo, max_q = geometry, max(1, min(max_q, q.shape[0]))
    if geo is None:
        geo = prefill_block_geometry(_KINDS[mode], q, requests=cu_q.shape[0] - 1, max_q=max_q,
                                     num_kv_heads=k.shape[1],
                                     block_width=block_indices.shape[-1],
                                     kv_bytes=k.element_size(), overlap=overlap)
    kv = None if mode == MODE_ORDINARY else kv_lens
    pool = (req_to_token, req_indices, k.shape[0]) if mode == MODE_SLOTS else None
    if geo.kind != "union":
        idx = PU.expand_blocks(block_indices, cu_q, kv, pool=pool)
        # selected: the token selector on the expansion (the same tile, plus its split count)
        rows = None if geometry is None else Geometry(geo.head_tile, geo.block_n, geo.num_warps,
                                                      geo.num_stages, geo.source)
        return _launch(mode, q, k, v, idx, cu_q, cu_k, kv_lens, max_q, scale, k_scale, v_scale,
                       rows)
    if q.shape[0] == 0 or k.shape[0] == 0:
        return torch.zeros_like(q)
    union = PU.union_build(mode, q, k, block_indices, cu_q, kv_lens, req_to_token, geo)
    skip = (union[2], geo.tile_rows, union[3])
    idx = PU.expand_blocks(block_indices, cu_q, kv, pool=pool, skip=skip)
    out = torch.empty_like(q)  # every row is written (union tiles, per-row rows, the tail)
    # the union kernel first, the per-row kernel on the other tiles' rows as its PDL dependent
    # (qsa_triton.prefill_union, module docstring, 3)
    pdl = _pdl_supported(q.device)
    PU.union_launch(mode, q, k, v, out, union, cu_q, cu_k, kv_lens, req_to_token, req_indices,
                    scale, k_scale, v_scale, geo, needs_off64(k, v), trigger=pdl)
    return _launch(mode, q, k, v, idx, cu_q, cu_k, kv_lens, max_q, scale, k_scale, v_scale, None,
                   skip, out=out, union_pdl=pdl)


def _hint(overlap: float) -> float | None:
    """The ops carry ``overlap`` as a float (-1.0 = no hint); the selector takes None."""
    return None if overlap < 0 else overlap


# ---------------------------------------------------------------------------------------------
# torch.library custom ops (opaque to torch.compile; fake impls give the output metadata)
@torch.library.custom_op("qsa::sparse_prefill", mutates_args=())
def _op_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor,
                cu_seqlens: torch.Tensor, max_seqlen_q: int, softmax_scale: float,
                strict: bool = False) -> torch.Tensor:
    return _prefill_impl(q, k, v, indices, cu_seqlens, max_seqlen_q, softmax_scale)


@torch.library.custom_op("qsa::sparse_prefill_chunk", mutates_args=())
def _op_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor,
              cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, kv_lens: torch.Tensor,
              max_seqlen_q: int, softmax_scale: float, k_scale: float,
              v_scale: float, strict: bool = False) -> torch.Tensor:
    return _chunk_impl(q, k, v, indices, cu_seqlens_q, cu_seqlens_k, kv_lens, max_seqlen_q,
                       softmax_scale, k_scale, v_scale)


@torch.library.custom_op("qsa::sparse_prefill_paged", mutates_args=())
def _op_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              req_to_token: torch.Tensor, req_indices: torch.Tensor, indices: torch.Tensor,
              cu_seqlens_q: torch.Tensor, kv_lens: torch.Tensor, max_seqlen_q: int,
              softmax_scale: float, k_scale: float, v_scale: float,
              strict: bool = False) -> torch.Tensor:
    slots = resolve_pool_slots(indices, req_to_token, req_indices, cu_seqlens_q, kv_lens,
                               max_seqlen_q, k_cache.shape[0])
    return _launch(MODE_SLOTS, q, k_cache, v_cache, slots, cu_seqlens_q, cu_seqlens_q, kv_lens,
                   max_seqlen_q, softmax_scale, k_scale, v_scale, None)


@torch.library.custom_op("qsa::sparse_prefill_blocks", mutates_args=())
def _op_prefill_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       block_indices: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen_q: int,
                       softmax_scale: float, overlap: float,
                       strict: bool = False) -> torch.Tensor:
    return _blocks_impl(MODE_ORDINARY, q, k, v, block_indices, cu_seqlens, cu_seqlens,
                        cu_seqlens, cu_seqlens, cu_seqlens, max_seqlen_q, softmax_scale, 1.0, 1.0,
                        _hint(overlap))


@torch.library.custom_op("qsa::sparse_prefill_chunk_blocks", mutates_args=())
def _op_chunk_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     block_indices: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, kv_lens: torch.Tensor, max_seqlen_q: int,
                     softmax_scale: float, k_scale: float, v_scale: float,
                     overlap: float, strict: bool = False) -> torch.Tensor:
    return _blocks_impl(MODE_CHUNK, q, k, v, block_indices, cu_seqlens_q, cu_seqlens_k, kv_lens,
                        cu_seqlens_q, cu_seqlens_q, max_seqlen_q, softmax_scale, k_scale, v_scale,
                        _hint(overlap))


@torch.library.custom_op("qsa::sparse_prefill_paged_blocks", mutates_args=())
def _op_paged_blocks(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     req_to_token: torch.Tensor, req_indices: torch.Tensor,
                     block_indices: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     kv_lens: torch.Tensor, max_seqlen_q: int, softmax_scale: float,
                     k_scale: float, v_scale: float, overlap: float,
                     strict: bool = False) -> torch.Tensor:
    return _blocks_impl(MODE_SLOTS, q, k_cache, v_cache, block_indices, cu_seqlens_q,
                        cu_seqlens_q, kv_lens, req_to_token, req_indices, max_seqlen_q,
                        softmax_scale, k_scale, v_scale, _hint(overlap))


def _fake(fn: str, checker, n_args: int, blocks: bool):
    """An op's fake impl: the contract check under torch.compile (see ``_entry``; FakeTensors
    carry shape, dtype and device), then the output metadata. After q come the checker's
    ``n_args`` arguments, a block op's overlap hint (the checker does not take it) and, when the
    call passes it, ``strict`` (a fake impl sees only the arguments given, not the defaults)."""
    def fake(q, *args):
        rest = args[n_args + blocks:]
        p = checker(q, *args[:n_args], strict=bool(rest[0]) if rest else False,
                    **({"indices_name": "block_indices"} if blocks else {}))
        check_interpreter_dtype(fn, p.dtype)
        return torch.empty_like(q)
    return fake


for _op, _fn, _checker, _n, _blocks in (
        (_op_prefill, "sparse_prefill", contract.check_prefill, 6, False),
        (_op_chunk, "sparse_prefill_chunk", contract.check_prefill_chunk, 10, False),
        (_op_paged, "sparse_prefill_paged", contract.check_prefill_paged, 11, False),
        (_op_prefill_blocks, "sparse_prefill", contract.check_prefill, 6, True),
        (_op_chunk_blocks, "sparse_prefill_chunk", contract.check_prefill_chunk, 10, True),
        (_op_paged_blocks, "sparse_prefill_paged", contract.check_prefill_paged, 11, True)):
    _op.register_fake(_fake(_fn, _checker, _n, _blocks))
del _op, _fn, _checker, _n, _blocks


# ---------------------------------------------------------------------------------------------
# Public entry points
def _entry(fn: str, checker, before: dict, after: dict, indices, block_indices, overlap,
           max_seqlen_q, softmax_scale, strict: bool, scales: tuple | None = None):
    """One public prefill entry point ``fn``: check, then ``torch.ops.qsa.<fn>`` on ``indices``
    or ``torch.ops.qsa.<fn>_blocks`` on ``block_indices`` (plus the overlap hint, -1.0 = none).
    The checker's arrays are ``before``, the selection, ``after``; ``scales``: chunk/paged. Under
    torch.compile the check runs in the op's fake impl (Dynamo cannot raise out of a fullgraph
    trace; the fake impl's error keeps its text)."""
    q = before["q"]
    if torch.compiler.is_compiling():  # refusals that would raise in traced Python
        problem = contract.prefill_selection_problem(indices, block_indices, overlap)
        if problem is not None:
            return refuse_traced(q, fn, *problem)
        refused = traced_refusal(q, fn, before, max_seqlen_q=max_seqlen_q,
                                 softmax_scale=softmax_scale,
                                 **dict(zip(("k_scale", "v_scale"), scales or ())))
        if refused is not None:
            return refused
    name, sel, hint = contract.prefill_selection(fn, indices, block_indices, overlap)
    tensors = {**before, name: sel, **after}
    if torch.compiler.is_compiling():
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        mq, sc, ks, vs = max_seqlen_q, scale, *(scales or (1.0, 1.0))
    else:
        check_torch_tensors(fn, **tensors)
        p = checker(*tensors.values(), max_seqlen_q, softmax_scale, *(scales or ()),
                    strict=strict, indices_name=name)
        check_interpreter_dtype(fn, p.dtype)
        check_device(fn, q.device.type)
        geometry_mode(fn)  # a bad QSA_PREFILL_GEOMETRY fails here, before any allocation
        mq, sc, ks, vs = p.max_seqlen_q, p.softmax_scale, p.k_scale, p.v_scale
    args = (*tensors.values(), mq, sc, *((ks, vs) if scales is not None else ()))
    if name == "indices":
        return getattr(torch.ops.qsa, fn)(*args, bool(strict))
    return getattr(torch.ops.qsa, fn + "_blocks")(*args, -1.0 if hint is None else hint,
                                                  bool(strict))


def sparse_prefill(q, k, v, indices, cu_seqlens, max_seqlen_q, softmax_scale=None, *,
                   strict: bool = False, block_indices=None, overlap=None):
    """Ordinary sparse prefill: each query row attends to the selected rows of this forward's K/V.

    Forward only. Algorithm: the module docstring (the flash-attention forward over gathered
    rows, as upstream SGLang's sparse prefill; block-level selections: ``prefill_union``). Short
    calls run split-KV (``interop.geometry.prefill_splits``: FP32 scratch [shares, T, Hq, D] and
    an LSE merge; the share count follows T x Hkv, W and the GPU, and so does a row's rounding).

    Args:
      q: [T, Hq, D] bf16|fp16, rows of all requests packed.
      k, v: [T, Hkv, D], q's dtype, packed like q (request b's rows start at cu_seqlens[b]).
      indices: int32 [T, W] (shared by the KV heads) or [T, Hkv, W]; request-relative positions,
        selected entries first; valid iff 0 <= idx < request length. None with ``block_indices``.
      cu_seqlens: int32 [B + 1] on q's device.
      max_seqlen_q: host int >= 1, the longest request's rows: a grid-size hint only (too small:
        the tail launch still computes every row once, slower and with its own BLOCK_N, so
        those rows round differently; above T it acts as T).
      softmax_scale: host float or None (D ** -0.5).
      strict: also enforce the qualified envelope (``interop.contract.QUALIFIED``).
      BLOCKS_DOC

    Returns:
      [T, Hq, D] in q's dtype; row r of request b attends (causally, bottom-right) over at most
      min(W, r + 1) columns; a row with no valid entry, or outside every request (T padded past
      cu_seqlens[B]), is zero.

    Raises:
      ContractError: from ``interop.contract.check_prefill`` (before any allocation), both or
        neither of ``indices`` / ``block_indices``, a bad ``overlap`` or
        ``QSA_PREFILL_GEOMETRY``; a non-torch argument, a CPU tensor without Triton's
        interpreter, bf16 under the unpatched interpreter (under torch.compile from the op's
        fake impl).
    """
    return _entry("sparse_prefill", contract.check_prefill, {"q": q, "k": k, "v": v},
                  {"cu_seqlens": cu_seqlens}, indices, block_indices, overlap, max_seqlen_q,
                  softmax_scale, strict)


def sparse_prefill_chunk(q, k, v, indices, cu_seqlens_q, cu_seqlens_k, kv_lens, max_seqlen_q,
                         softmax_scale=None, k_scale=1.0, v_scale=1.0, *, strict: bool = False,
                         block_indices=None, overlap=None):
    """Chunk sparse prefill: new query rows attend to selected rows of each request's full
    context (prefix + this chunk), packed at rows ``cu_seqlens_k[b]`` of k/v. Forward only;
    algorithm, ``strict``, ``block_indices`` and ``overlap`` as ``sparse_prefill``.

    Args:
      q: [T, Hq, D] bf16|fp16; k, v: [Ck, Hkv, D], q's dtype or float8_e4m3fn.
      indices: int32 [T, W] or [T, Hkv, W]; valid iff 0 <= idx < kv_lens[b].
      cu_seqlens_q, cu_seqlens_k: int32 [B + 1]; kv_lens: int32 [B] (context length per request,
        >= its query rows); all on q's device.
      max_seqlen_q: host int >= 1, a grid-size hint; softmax_scale: host float or None
        (D ** -0.5); k_scale (on scores), v_scale (on the output): host floats, 1.0 unless FP8.

    Returns:
      [T, Hq, D] in q's dtype; row r of request b reads at most
      min(W, r + kv_lens[b] - q_len_b + 1) columns; zero rows as ``sparse_prefill``.

    Raises:
      ContractError: from ``interop.contract.check_prefill_chunk`` (before any allocation), or
        the other checks of ``sparse_prefill``.
    """
    return _entry("sparse_prefill_chunk", contract.check_prefill_chunk, {"q": q, "k": k, "v": v},
                  {"cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k,
                   "kv_lens": kv_lens}, indices, block_indices, overlap, max_seqlen_q,
                  softmax_scale, strict, (k_scale, v_scale))


def sparse_prefill_paged(q, k_cache, v_cache, req_to_token, req_indices, indices, cu_seqlens_q,
                         kv_lens, max_seqlen_q, softmax_scale=None, k_scale=1.0, v_scale=1.0, *,
                         strict: bool = False, block_indices=None, overlap=None):
    """Paged sparse prefill: K/V read in place from the KV pool through SGLang's ``req_to_token``
    (the addressing of ``sparse_decode_paged``). Forward only; algorithm, ``strict``,
    ``block_indices`` (positions map to slots as token indices do) and ``overlap`` as
    ``sparse_prefill``.

    Args:
      q: [T, Hq, D] bf16|fp16; k_cache, v_cache: [slots, Hkv, D] the pool, q's dtype or
        float8_e4m3fn (64-bit offsets where slots x Hkv x D passes 2**31).
      req_to_token: int32 [max_reqs, max_context], position p of the request in row r at slot
        req_to_token[r, p]; req_indices: int32 [B], request b's row.
      indices: int32 [T, W] or [T, Hkv, W] positions, valid iff 0 <= idx < kv_lens[b]; a
        position >= max_context, a row outside [0, max_reqs) or a slot outside the pool is an
        invalid entry (never dereferenced).
      cu_seqlens_q: int32 [B + 1]; kv_lens: int32 [B]; on q's device.
      max_seqlen_q, softmax_scale, k_scale, v_scale: as ``sparse_prefill_chunk``.

    Returns:
      [T, Hq, D] in q's dtype, as ``sparse_prefill_chunk``.

    Raises:
      ContractError: from ``interop.contract.check_prefill_paged`` (before any allocation), or
        the other checks of ``sparse_prefill``.
    """
    return _entry("sparse_prefill_paged", contract.check_prefill_paged,
                  {"q": q, "k_cache": k_cache, "v_cache": v_cache, "req_to_token": req_to_token,
                   "req_indices": req_indices}, {"cu_seqlens_q": cu_seqlens_q, "kv_lens": kv_lens},
                  indices, block_indices, overlap, max_seqlen_q, softmax_scale, strict,
                  (k_scale, v_scale))


sparse_prefill.__doc__ = sparse_prefill.__doc__.replace("BLOCKS_DOC", BLOCK_INDICES_DOC)
