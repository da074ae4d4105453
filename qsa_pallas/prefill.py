"""QSA sparse prefill as Pallas (Triton lowering) kernels: ordinary, chunk and paged.

Semantics: ``qsa-contract.md`` §3; oracle: ``interop.reference.prefill*_reference``. The
algorithm of ``qsa_triton.prefill`` (read its module docstring: the flash-attention forward over
gathered rows, Dao et al., 2022, as upstream SGLang's sparse prefill; the shared geometry
selector, here with ``backend="pallas"``; the paged slot pre-pass; FP8 dots in float16;
block-level selections through ``qsa_pallas.prefill_union`` or a plain-JAX expansion), except:

* the grid is (T, Hkv): every row is computed whatever ``max_seqlen_q`` (no tail launch); a row
  finds its request by counting ``cu_seqlens_q[1:] <= row`` (B is static); rows past
  ``cu_seqlens[B]`` (T padded under jit) give zeros; split-KV adds a third axis, and the LSE
  merge of its partials is plain XLA (``merge_splits``);
* the column loop is a ``lax.fori_loop`` with a traced bound: new lengths never retrace;
* the online softmax rescales the accumulator every step (the Triton kernels' conditional
  rescaling through ``lax.cond`` was slower here: bench/NOTES.md); the same result up to
  rounding;
* gathers clamp their indices into range *and* mask them (interpret mode clamps out-of-range
  gathers instead of faulting); the slot pre-pass is plain JAX;
* the lowering (``_compute_offsets_from_indices``, jax 0.10.2 and 0.11.2) uses int64 offsets
  only for refs over 2**32 bytes, so arrays of 2**31..2**32 elements (FP8 pools) are refused
  (``ContractError``). No jax x64 mode is needed.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from interop import contract
from interop.arch import DeviceFacts
from interop.contract import PrefillProblem
from interop.geometry import (BLOCK_INDICES_DOC, Geometry, UnionGeometry, geometry_mode,
                              prefill_splits, select_prefill, select_prefill_blocks)
from interop.plan import LOG2E, next_pow2

from . import _compat
from . import prefill_union as PU
from ._compat import forward_only, pl
from ._fp8 import fp16_query, is_fp8

__all__ = ["sparse_prefill", "sparse_prefill_chunk", "sparse_prefill_paged", "select_geometry",
           "select_block_geometry", "resolve_pool_slots"]

_INT32_MAX = 2**31 - 1
# CPU interpret mode: one small fixed (BLOCK_N, num_warps, num_stages): the interpreter's speed,
# not a GPU's, matters there.
_INTERPRET_GEOMETRY = (16, 4, 2)


# --------------------------------------------------------------------------------------------
# Geometry
def _selector_args(problem: PrefillProblem, facts) -> dict:
    """The shared selectors' arguments for ``problem`` on ``facts`` (None: the lowering
    target's, ``_compat.target_facts``, else sm_90)."""
    if facts is None:
        facts = _compat.target_facts() or DeviceFacts.for_arch("sm_90")
    return dict(facts=facts, kind=problem.kind, requests=problem.requests,
                max_q=problem.max_seqlen_q, group=problem.group, num_kv_heads=problem.num_kv_heads,
                head_dim=problem.head_dim, backend="pallas",
                kv_bytes=1 if problem.kv_dtype == "float8_e4m3fn" else 2)


def select_geometry(problem: PrefillProblem, *, interpret: bool, facts=None) -> Geometry:
    """Launch geometry (``block_m`` = the head tile) for a checked ``PrefillProblem``:
    ``interop.geometry.select_prefill(..., backend="pallas")`` on ``facts`` (tests) or the
    lowering target's; in interpret mode (CPU, facts None) a small fixed geometry."""
    if interpret and facts is None:  # the split count an sm_90 would get, as qsa_triton's
        bn, nw, ns = _INTERPRET_GEOMETRY
        splits = prefill_splits(DeviceFacts.for_arch("sm_90"), total_q=problem.total_q,
                                num_kv_heads=problem.num_kv_heads, width=problem.width,
                                backend="pallas")
        return Geometry(max(16, next_pow2(problem.group)), bn, nw, ns, "interpret-fixed",
                        splits)
    return select_prefill(total_q=problem.total_q, width=problem.width,
                          **_selector_args(problem, facts))


def select_block_geometry(problem: PrefillProblem, *, interpret: bool, overlap=None,
                          facts=None) -> UnionGeometry:
    """Kernel and geometry for block-level selections (``problem.width`` = NB):
    ``interop.geometry.select_prefill_blocks(..., backend="pallas")`` with the engine's
    ``overlap`` hint (None or in [0, 1]), facts as ``select_geometry``. In interpret mode the
    same kernel choice with small fixed tiles (union BLOCK_N = max(16, next_pow2(R + 3)))."""
    geo = select_prefill_blocks(total_q=max(problem.total_q, 1), block_width=problem.width,
                                overlap=overlap, **_selector_args(problem, facts))
    if not interpret or facts is not None:
        return geo
    if geo.kind == "union":
        return dataclasses.replace(geo, block_n=max(16, next_pow2(geo.tile_rows + 3)),
                                   num_warps=4, num_stages=1, source=geo.source + " interpret")
    bn, nw, ns = _INTERPRET_GEOMETRY
    return dataclasses.replace(geo, block_n=bn, num_warps=nw, num_stages=ns,
                               source=geo.source + " interpret")


#: a geometry forced on every prefill entry point called under ``_forced_geometry`` (compile
#: checks and tests; not public: the selector is the only geometry a caller gets)
_FORCED_GEOMETRY: contextvars.ContextVar = contextvars.ContextVar("qsa_pallas_prefill_geometry",
                                                                  default=None)


@contextlib.contextmanager
def _forced_geometry(geometry: Geometry | UnionGeometry):
    """Inside the block, the prefill entry points launch ``geometry`` instead of the selector's:
    a ``Geometry`` (token path, or the per-row kernel on block selections) or, with
    ``block_indices``, a ``UnionGeometry``. Read while an entry point traces (compile checks
    lower inside it). Raises TypeError for anything else."""
    if not isinstance(geometry, (Geometry, UnionGeometry)):
        raise TypeError(f"_forced_geometry: a Geometry or UnionGeometry, got {geometry!r}")
    token = _FORCED_GEOMETRY.set(geometry)
    try:
        yield geometry
    finally:
        _FORCED_GEOMETRY.reset(token)


# --------------------------------------------------------------------------------------------
# The kernel
@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything the kernel specialises on (hashable: the compile cache key). ``p`` is the
    checked problem with max_seqlen_q normalised to 1 (this grid covers every row whatever its
    value, so it must not key a recompile); ``geo`` the launch geometry without its label."""

    p: PrefillProblem
    geo: Geometry
    kv_rows: int  # rows of k/v (slots of the pool)
    interpret: bool
    # block-level calls with a union (``qsa_pallas.prefill_union``): its tile rows R (0: none)
    # and bound; rows of tiles within the bound are the tile kernel's (left zero here)
    union_rows: int = 0
    max_union: int = 0


def _find_request(cu_ref, row, requests: int):
    """b such that cu[b] <= row < cu[b + 1]: count of cu[1:B+1] <= row (B static, padded)."""
    bp = next_pow2(requests)
    j = lax.broadcasted_iota(jnp.int32, (bp,), 0)
    live = j < requests
    # vector gather with clamped indices (a static pl.ds would be rejected as out of bounds)
    ends = _compat.load(cu_ref.at[jnp.minimum(j + 1, requests)], mask=live, other=_INT32_MAX)
    ends = jnp.where(live, ends, _INT32_MAX)
    return jnp.sum((ends <= row).astype(jnp.int32), dtype=jnp.int32)


def _prefill_kernel(*refs, st: _Static):
    pr, geo = st.p, st.geo
    score_scale = pr.softmax_scale * pr.k_scale * LOG2E  # exp2 is the cheaper PTX path
    split = geo.splits > 1
    if split:  # split-KV: fp32 partials [S, T, Hq, D] and base-2 LSEs [S, T, Hq], merged after
        *ins, po_ref, lse_ref = refs
    else:
        *ins, o_ref = refs
    if st.union_rows:
        *ins, ul_ref = ins
    if pr.kind == "ordinary":
        q_ref, k_ref, v_ref, idx_ref, cu_ref = ins
    elif pr.kind == "chunk":
        q_ref, k_ref, v_ref, idx_ref, cu_ref, cuk_ref, kvl_ref = ins
    else:  # paged: idx_ref holds pool slots (-1 = invalid) instead of positions
        q_ref, k_ref, v_ref, idx_ref, cu_ref, kvl_ref = ins

    row = pl.program_id(0)
    h = pl.program_id(1)
    g, ht, d, bn, w = pr.group, geo.block_m, pr.head_dim, geo.block_n, pr.width

    # Rows past cu_seqlens[B] (a batch padded to a static T) belong to no request: b is clamped
    # so every scalar read stays in bounds, and the row gets no column (exact zeros).
    b = jnp.minimum(_find_request(cu_ref, row, pr.requests), pr.requests - 1)
    q_start = cu_ref[b]
    q_len = cu_ref[b + 1] - q_start
    r = row - q_start
    in_request = (r >= 0) & (r < q_len)
    if pr.kind == "ordinary":
        length = q_len  # validity bound: the request length
        visible = r + 1
        base = q_start  # k/v packed like q
    else:
        length = kvl_ref[b]
        visible = r + length - q_len + 1  # bottom-right causal alignment
        base = cuk_ref[b] if pr.kind == "chunk" else 0
    last_pos = PU.last_position(base, st.kv_rows)
    n_cols = jnp.where(in_request, jnp.clip(jnp.minimum(visible, w), 0, w), 0)
    if st.union_rows:  # rows of tiles the tile-union kernel takes: no column (it overwrites)
        n_cols = jnp.where(PU.row_runs(ul_ref, q_start, b, r, h, st.union_rows, st.max_union),
                           n_cols, 0)
    n_blocks = (n_cols + (bn - 1)) // bn

    # Query head tile [ht, d]: heads h*G .. h*G+G-1, padded heads masked to 0.
    hid = lax.broadcasted_iota(jnp.int32, (ht, 1), 0)
    head_ok = hid < g
    d_row = lax.broadcasted_iota(jnp.int32, (1, d), 1)
    q = _compat.load(q_ref.at[row, pl.ds(h * g, ht), :],
                     mask=jnp.broadcast_to(head_ok, (ht, d)), other=0.0)

    if is_fp8(k_ref.dtype):
        q, score_scale = fp16_query(q, score_scale)  # FP8 K/V: the dots in fp16 (qsa_pallas._fp8)

    cols0 = lax.broadcasted_iota(jnp.int32, (bn,), 0)
    compute_dtype = q.dtype

    def body(j, carry):
        acc, m_i, l_i = carry
        cols = j * bn + cols0
        # Columns at or past min(W, visible) are masked too (not only past W), so the result
        # never depends on BLOCK_N (same rule as qsa_triton's kernel).
        col_ok = cols < n_cols
        if pr.per_head_indices:
            ids = _compat.load(idx_ref.at[row, h, pl.ds(j * bn, bn)], mask=col_ok, other=-1)
        else:
            ids = _compat.load(idx_ref.at[row, pl.ds(j * bn, bn)], mask=col_ok, other=-1)
        if pr.kind == "paged":
            # entries are pool slots already (resolve_pool_slots): valid iff inside the pool
            valid = col_ok & (ids >= 0) & (ids < st.kv_rows)
            kv_rows = jnp.where(valid, ids, 0)
        else:
            valid = col_ok & (ids >= 0) & (ids < length)
            # in range even when cu_seqlens_k / kv_lens disagree with k's rows (bad metadata)
            kv_rows = jnp.where(valid, jnp.maximum(base + jnp.minimum(ids, last_pos), 0), 0)
        gmask = jnp.broadcast_to(valid[:, None], (bn, d))
        # Masked lanes are never dereferenced on the GPU and read `other` = 0 (interpret mode
        # gathers the clamped row, then substitutes `other`), so a non-finite never-selected row
        # cannot reach a dot. `other` must be a float literal: the lowering cannot cast an int
        # fill value to FP8. Feeding the load straight into the dot (no select in between)
        # keeps the gathered tile in the dot-operand path: with a select after the load the
        # compiled kernel staged the tile twice (more shared memory, more barriers).
        k = _compat.load(k_ref.at[kv_rows[:, None], h, d_row], mask=gmask,
                         other=0.0).astype(compute_dtype)
        # FP8 V: that second staging is wanted (``_compat.value_operand``)
        v = _compat.value_operand(
            _compat.load(v_ref.at[kv_rows[:, None], h, d_row], mask=gmask, other=0.0), gmask,
            compute_dtype)

        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32) * score_scale  # [ht, bn]
        s = jnp.where(valid[None, :], s, -jnp.inf)
        m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
        # Fully masked so far: keep the shift finite so exp2 gives 0, never NaN.
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m_i - m_use)
        p = jnp.exp2(s - m_use[:, None])
        # the denominator as a [ht, bn] running sum, reduced once after the loop (as
        # qsa_triton.prefill: no cross-warp row sum per step)
        l_new = l_i * alpha[:, None] + p
        pv = jnp.dot(p.astype(compute_dtype), v, preferred_element_type=jnp.float32)
        acc = acc * alpha[:, None] + pv
        return acc, m_new, l_new

    acc0 = jnp.zeros((ht, d), jnp.float32)
    m0 = jnp.full((ht,), -jnp.inf, jnp.float32)
    l0 = jnp.zeros((ht, bn), jnp.float32)
    if split:  # program_id(2)'s share of whole BLOCK_N steps (the unsplit walk's masks)
        steps = (w + bn - 1) // bn
        per = (steps + geo.splits - 1) // geo.splits
        j_lo = pl.program_id(2) * per
        acc, m_i, l_i = lax.fori_loop(j_lo, jnp.minimum(n_blocks, j_lo + per), body,
                                      (acc0, m0, l0))
        l_i = jnp.sum(l_i, axis=1)
        has = l_i > 0
        part = acc * jnp.where(has, 1.0 / jnp.where(has, l_i, 1.0), 0.0)[:, None]
        lse = jnp.where(has, m_i + jnp.log2(jnp.where(has, l_i, 1.0)), -jnp.inf)
        sp, zero = pl.program_id(2), jnp.int32(0)
        _compat.store(po_ref.at[sp, row, pl.ds(h * g, ht), pl.ds(zero, d)], part,
                      mask=jnp.broadcast_to(head_ok, (ht, d)))
        _compat.store(lse_ref.at[sp, row, pl.ds(h * g, ht)], lse, mask=head_ok[:, 0])
        return
    acc, _, l_i = lax.fori_loop(0, n_blocks, body, (acc0, m0, l0))
    l_i = jnp.sum(l_i, axis=1)

    # Rows with no valid entry: l = 0 -> exact zeros.
    inv = jnp.where(l_i > 0, pr.v_scale / jnp.where(l_i > 0, l_i, 1.0), 0.0)
    out = (acc * inv[:, None]).astype(o_ref.dtype)
    # every start int32 (a bare ``:`` starts at a Python 0, int64 under jax_enable_x64)
    _compat.store(o_ref.at[row, pl.ds(h * g, ht), pl.ds(jnp.int32(0), d)], out,
                  mask=jnp.broadcast_to(head_ok, (ht, d)))


@functools.partial(jax.jit, static_argnames=("st",))
def _launch(q, k, v, *meta, st: _Static):
    t, hq, d = q.shape
    s_ = st.geo.splits
    call = functools.partial(
        _compat.triton_call, functools.partial(_prefill_kernel, st=st),
        num_warps=st.geo.num_warps, num_stages=st.geo.num_stages, interpret=st.interpret,
        name=f"qsa_sparse_prefill_{st.p.kind}")
    if s_ == 1:
        return call(out_shape=jax.ShapeDtypeStruct((t, hq, d), q.dtype),
                    grid=(t, st.p.num_kv_heads))(q, k, v, *meta)
    # every (row, KV head, split) program writes its lanes (an empty share: LSE -inf, zeros)
    po, lse = call(out_shape=(jax.ShapeDtypeStruct((s_, t, hq, d), jnp.float32),
                              jax.ShapeDtypeStruct((s_, t, hq), jnp.float32)),
                   grid=(t, st.p.num_kv_heads, s_))(q, k, v, *meta)
    return merge_splits(po, lse, st.p.v_scale).astype(q.dtype)


def merge_splits(po, lse, v_scale: float):
    """Split-KV merge (FlashDecoding's): po fp32 [S, T, Hq, D] normalized partial outputs, lse
    fp32 [S, T, Hq] their base-2 LSEs (-inf: no valid entry) -> fp32 [T, Hq, D], each split
    weighted by 2**(lse - max lse), times ``v_scale``; exact zeros where no split saw an entry.
    Plain XLA: one fused pass over the partials."""
    mx = jnp.max(lse, axis=0)
    wt = jnp.exp2(lse - jnp.where(mx == -jnp.inf, 0.0, mx)[None])
    den = jnp.sum(wt, axis=0)
    num = jnp.sum(wt[..., None] * po, axis=0)
    return num * jnp.where(den > 0, v_scale / jnp.where(den > 0, den, 1.0), 0.0)[..., None]


# --------------------------------------------------------------------------------------------
# Entry points
def _run(problem: PrefillProblem, q, k, v, meta, *, interpret, geometry, skip=None):
    """The per-row kernel; ``skip``: None, or (union lengths [S, H], R, max_union) of a
    block-level call (``_Static.union_rows``)."""
    if problem.total_q == 0 or k.shape[0] == 0:  # nothing to gather from / no row: no launch
        return jnp.zeros(q.shape, q.dtype)
    interp = _compat.resolve_interpret(interpret)
    geo = geometry if geometry is not None else select_geometry(problem, interpret=interp)
    if skip is not None:  # the tile-union kernel overwrites its rows: one program a row here
        geo = dataclasses.replace(geo, splits=1)
    st = _Static(dataclasses.replace(problem, max_seqlen_q=1),
                 dataclasses.replace(geo, source=""), int(k.shape[0]), interp)
    if skip is not None:
        meta = (*meta, skip[0])
        st = dataclasses.replace(st, union_rows=skip[1], max_union=skip[2])
    return _launch(q, k, v, *meta, st=st)


def _run_blocks(problem: PrefillProblem, q, k, v, block_indices, meta: dict, *, interpret,
                geometry, overlap):
    """Block-level selections (``qsa_pallas.prefill_union``): the union build, the per-row
    kernel on the expansion of the rows of tiles past the work bound, the tile-union kernel on
    the other tiles; or the per-row kernel on the expansion (``geometry``: None = the selector;
    a ``UnionGeometry`` forces the kernels and the tiles; a ``Geometry`` forces the per-row
    kernel with that geometry)."""
    if problem.total_q == 0 or k.shape[0] == 0:
        return jnp.zeros(q.shape, q.dtype)
    if problem.kind == "paged" and math.prod(meta["req_to_token"].shape) == 0:
        return jnp.zeros(q.shape, q.dtype)  # an empty table: every position is invalid
    interp = _compat.resolve_interpret(interpret)
    geo = geometry
    if geo is None:
        geo = select_block_geometry(problem, interpret=interp, overlap=overlap)
    union = skip = None
    if isinstance(geo, UnionGeometry) and geo.kind == "union":
        union = PU.union_build(problem, block_indices, meta, geo)
        skip = (union[2], geo.tile_rows, union[3])
    elif geometry is None:  # the token selector on the expansion: same tile, its split count
        geo = None
    else:
        geo = Geometry(geo.head_tile, geo.block_n, geo.num_warps, geo.num_stages, geo.source)
    paged = problem.kind == "paged"
    pool = (meta["req_to_token"], meta["req_indices"], int(k.shape[0])) if paged else None
    idx = PU.expand_blocks(block_indices, meta["cu_seqlens_q"], meta.get("kv_lens"), pool=pool,
                           skip=skip, interpret=interp)
    tokens = dataclasses.replace(problem, width=int(idx.shape[-1]))
    out = _run_tokens(tokens, q, k, v, idx, meta, interpret=interpret,
                      geometry=None if union else geo, skip=skip, slots=paged)
    if union is None:
        return out
    return PU.union_run(problem, q, k, v, out, union, meta, geo, interpret=interp)


def _run_tokens(problem: PrefillProblem, q, k, v, indices, meta: dict, *, interpret, geometry,
                skip=None, slots: bool = False):
    """Token indices: the per-row kernel (paged: on the pool slots of ``resolve_pool_slots``,
    or on ``indices`` themselves where ``slots``: already pool slots; ``skip`` as ``_run``)."""
    cu, kv_lens = meta["cu_seqlens_q"], meta.get("kv_lens")
    if problem.kind == "ordinary":
        rest = (indices, cu)
    elif problem.kind == "chunk":
        rest = (indices, cu, meta["cu_seqlens_k"], kv_lens)
    else:
        if not slots:
            indices = resolve_pool_slots(indices, meta["req_to_token"], meta["req_indices"], cu,
                                         kv_lens, int(k.shape[0]))
        rest = (indices, cu, kv_lens)
    return _run(problem, q, k, v, rest, interpret=interpret, geometry=geometry, skip=skip)


def _entry(fn: str, checker, before: dict, after: dict, indices, block_indices, overlap,
           max_seqlen_q, softmax_scale, scales: tuple = (), *, strict, interpret):
    """One public prefill entry point ``fn``: every check before anything is traced, then the
    token or block path. The checker's arrays are ``before``, the selection, ``after`` (in the
    entry point's order); the first three of ``before`` are q, k, v."""
    name, sel, hint = contract.prefill_selection(fn, indices, block_indices, overlap)
    arrays = {**before, name: sel, **after}
    _compat.check_inputs(fn, interpret, **arrays)
    p = checker(*arrays.values(), max_seqlen_q, softmax_scale, *scales, fn=fn, strict=strict,
                indices_name=name)
    geometry_mode(fn)  # a bad $QSA_PREFILL_GEOMETRY is an error on every backend, CPU included
    q, k, v = list(before.values())[:3]
    _compat.check_backend(fn, interpret, q, k, v)
    _compat.check_offsets(fn, **arrays)  # only 1- and 2-byte arrays can fail it: q, K/V
    meta = {"cu_seqlens_q" if n == "cu_seqlens" else n: a for n, a in arrays.items()
            if n not in ("q", "k", "v", "k_cache", "v_cache", name)}
    geometry = _FORCED_GEOMETRY.get()
    if isinstance(geometry, UnionGeometry) and name != "block_indices":
        raise TypeError(f"{fn}: a forced UnionGeometry needs block_indices")
    if name == "block_indices":
        return _run_blocks(p, q, k, v, sel, meta, interpret=interpret, geometry=geometry,
                           overlap=hint)
    return _run_tokens(p, q, k, v, sel, meta, interpret=interpret, geometry=geometry)


@forward_only
def sparse_prefill(q, k, v, indices, cu_seqlens, max_seqlen_q, softmax_scale=None, *,
                   strict: bool = False, interpret=None, block_indices=None, overlap=None):
    """Ordinary sparse prefill (qsa-contract.md §3): K/V are this forward's rows, packed like q.

    Forward only. Algorithm: the module docstring. Same arguments as ``qsa_triton``'s, plus
    ``interpret``. Short calls run split-KV (``interop.geometry.prefill_splits``: FP32 partials
    [shares, T, Hq, D] merged by LSE in XLA; the share count follows T x Hkv, W and the GPU, and
    so does a row's rounding; each count traces once).

    Args:
      q: [T, Hq, D] bfloat16|float16 query rows of B requests packed back to back.
      k, v: [T, Hkv, D], q's dtype.
      indices: int32 [T, W] (shared by the KV heads) or [T, Hkv, W]; request-relative token
        positions, valid iff 0 <= idx < request length; selected entries first, then padding.
      cu_seqlens: int32 [B + 1], request b owns rows cu_seqlens[b] .. cu_seqlens[b + 1] - 1.
      max_seqlen_q: host int >= 1 (static; checked, but this grid covers every row anyway).
      softmax_scale: host float > 0, or None for D ** -0.5.
      strict: also enforce the qualified envelope (``interop.contract.QUALIFIED``).
      interpret: None -> interpret mode when jax's default backend is the CPU (as every
        qsa_pallas entry point, ``_compat.resolve_interpret``); True/False to force. The
        launch geometry is the shared selector's (``select_geometry`` /
        ``select_block_geometry``).
      BLOCKS_DOC

    Returns:
      [T, Hq, D] in q's dtype: out[t, h] = softmax(scale · q[t,h] · Kᵀ) · V over the valid
      entries of row t (KV head h // G); row r of request b reads at most min(W, r + 1)
      columns (bottom-right causal); a row with no valid entry, or outside every request (T
      padded past cu_seqlens[B]), is exact zeros.

    Raises:
      ContractError: from ``interop.contract.check_prefill`` (before any launch), an array
        whose offsets would overflow the lowering's int32 offsets, or
        ``interop.contract.prefill_selection`` (both or neither selection, a bad ``overlap``);
        torch tensors; an ``interpret`` that is not None or a bool; ``interpret=False`` on a
        CPU-only jax.
    """
    return _entry("sparse_prefill", contract.check_prefill, {"q": q, "k": k, "v": v},
                  {"cu_seqlens": cu_seqlens}, indices, block_indices, overlap, max_seqlen_q,
                  softmax_scale, strict=strict, interpret=interpret)


@forward_only
def sparse_prefill_chunk(q, k, v, indices, cu_seqlens_q, cu_seqlens_k, kv_lens, max_seqlen_q,
                         softmax_scale=None, k_scale=1.0, v_scale=1.0, *, strict: bool = False,
                         interpret=None, block_indices=None, overlap=None):
    """Chunk sparse prefill (qsa-contract.md §3): K/V hold each request's full context, packed.
    Forward only; algorithm, ``strict``, ``interpret``, ``block_indices`` and ``overlap`` as
    ``sparse_prefill``.

    Args (meaning as ``qsa_triton.sparse_prefill_chunk``):
      q: [T, Hq, D] bfloat16|float16; k, v: [Ck, Hkv, D] q's dtype or float8_e4m3fn (request
        b's context at rows cu_seqlens_k[b] ..); indices: int32 [T, W] or [T, Hkv, W], valid iff
        0 <= idx < kv_lens[b]; cu_seqlens_q, cu_seqlens_k: int32 [B + 1]; kv_lens: int32 [B].
      max_seqlen_q: host int >= 1; softmax_scale: host float > 0 or None (D ** -0.5); k_scale
        (on the scores), v_scale (on the output): host floats > 0, 1.0 unless K/V are FP8.

    Returns:
      [T, Hq, D] in q's dtype; row r of request b reads at most
      min(W, r + kv_lens[b] - q_len_b + 1) columns (bottom-right causal); zero rows as
      ``sparse_prefill``.

    Raises:
      ContractError: from ``interop.contract.check_prefill_chunk``, or the other checks of
        ``sparse_prefill``.
    """
    return _entry("sparse_prefill_chunk", contract.check_prefill_chunk, {"q": q, "k": k, "v": v},
                  {"cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k,
                   "kv_lens": kv_lens}, indices, block_indices, overlap, max_seqlen_q,
                  softmax_scale, (k_scale, v_scale), strict=strict, interpret=interpret)


@forward_only
def sparse_prefill_paged(q, k_cache, v_cache, req_to_token, req_indices, indices, cu_seqlens_q,
                         kv_lens, max_seqlen_q, softmax_scale=None, k_scale=1.0, v_scale=1.0, *,
                         strict: bool = False, interpret=None, block_indices=None,
                         overlap=None):
    """Paged sparse prefill (qsa-contract.md §3): K/V read in place from the pool through
    SGLang's ``req_to_token`` (the addressing of ``sparse_decode_paged``). Forward only;
    algorithm and keyword arguments as ``sparse_prefill``.

    Args (meaning as ``qsa_triton.sparse_prefill_paged``):
      q: [T, Hq, D] bfloat16|float16; k_cache, v_cache: [slots, Hkv, D] the pool, q's dtype or
        float8_e4m3fn; req_to_token: int32 [max_reqs, max_context] (position p of a request in
        row r is slot req_to_token[r, p]); req_indices: int32 [B], request b's row.
      indices: int32 [T, W] or [T, Hkv, W] positions, valid iff 0 <= idx < kv_lens[b]; a
        position >= max_context, a row outside [0, max_reqs) or a slot outside the pool is an
        invalid entry (never dereferenced); cu_seqlens_q: int32 [B + 1]; kv_lens: int32 [B].
      max_seqlen_q, softmax_scale, k_scale, v_scale: as ``sparse_prefill_chunk``.

    Returns:
      [T, Hq, D] in q's dtype, as ``sparse_prefill_chunk``.

    Raises:
      ContractError: from ``interop.contract.check_prefill_paged``, or the other checks of
        ``sparse_prefill`` (the offset check: FP8 pools of 2**31..2**32 elements).
    """
    return _entry("sparse_prefill_paged", contract.check_prefill_paged,
                  {"q": q, "k_cache": k_cache, "v_cache": v_cache, "req_to_token": req_to_token,
                   "req_indices": req_indices}, {"cu_seqlens_q": cu_seqlens_q, "kv_lens": kv_lens},
                  indices, block_indices, overlap, max_seqlen_q, softmax_scale,
                  (k_scale, v_scale), strict=strict, interpret=interpret)


sparse_prefill.__doc__ = sparse_prefill.__doc__.replace("BLOCKS_DOC", BLOCK_INDICES_DOC)


@jax.jit
def _resolve(indices, req_to_token, req_indices, cu_seqlens_q, kv_lens, pool_slots):
    t = indices.shape[0]
    n_req = kv_lens.shape[0]
    max_reqs, max_context = req_to_token.shape
    rows = jnp.arange(t, dtype=jnp.int32)
    req = jnp.sum((cu_seqlens_q[None, 1:] <= rows[:, None]).astype(jnp.int32), axis=1,
                  dtype=jnp.int32)
    in_request = (req < n_req) & (rows >= cu_seqlens_q[0])
    req = jnp.minimum(req, n_req - 1)
    table_row = req_indices[req]
    row_ok = in_request & (table_row >= 0) & (table_row < max_reqs)
    lead = (slice(None),) + (None,) * (indices.ndim - 1)
    bound = jnp.minimum(kv_lens[req], max_context)[lead]
    valid = row_ok[lead] & (indices >= 0) & (indices < bound)
    slot = req_to_token[jnp.where(row_ok, table_row, 0)[lead], jnp.where(valid, indices, 0)]
    valid = valid & (slot >= 0) & (slot < pool_slots)
    return jnp.where(valid, slot, -1).astype(jnp.int32)


def resolve_pool_slots(indices, req_to_token, req_indices, cu_seqlens_q, kv_lens,
                       pool_slots: int):
    """Pool slot of every index entry (plain JAX, jit-friendly): as
    ``qsa_triton.prefill.resolve_pool_slots`` without ``max_seqlen_q`` and without the
    visible-count mask (the kernel masks those columns); rows past cu_seqlens_q[B] are -1."""
    if math.prod(req_to_token.shape) == 0:  # an empty table: every entry is invalid
        return jnp.full(indices.shape, -1, jnp.int32)
    return _resolve(indices, req_to_token, req_indices, cu_seqlens_q, kv_lens,
                    jnp.int32(min(int(pool_slots), _INT32_MAX)))
