"""Paged sparse decode (``qsa-contract.md`` §2b, §2c) for JAX: a Pallas kernel on the Triton
lowering, jit-native (every length, position and slot is device data; only shapes, dtypes and
scales are static).

Same algorithm, plan (``interop.plan.plan_decode_paged``) and validity rule as
``qsa_triton.decode_paged`` (read its module docstring). Differences:

* a 3-D grid (split, row, KV head); lane i of the head tile holds head i - (HT - G), padding
  lanes first (the direct path's indexed store relies on it, see ``_split_kernel``);
* positions are gathered lane-wise, clamped into the row and masked (a dynamic ``pl.ds`` past
  the end would be clamped by interpret mode, shifting the data); every gather index is clamped
  into range as well as masked, since interpret mode clamps instead of faulting;
* a multi-split plan's merge is plain JAX (``_merge``): an unrolled chain over the splits in a
  fixed order (one XLA fusion; bits independent of R), NaN where a split's LSE or partial is NaN
  (every split was written by the kernel);
* 64-bit offsets: the lowering (``_compute_offsets_from_indices``, jax 0.10.2 / 0.11.2) uses
  int64 element offsets exactly for refs larger than 2**32 bytes, so an FP8 pool of 2**31..2**32
  elements would wrap: the entry point rejects it (``ContractError``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from interop.arch import DeviceFacts
from interop.contract import ContractError, check_decode_paged, route
from interop.plan import LOG2E, PAGED_MAX_SPLITS, PagedDecodePlan, plan_decode_paged

from . import _compat as C
from ._fp8 import fp16_query, is_fp8

__all__ = ["sparse_decode_paged", "decode_paged_with_plan", "plan_for"]


@dataclasses.dataclass(frozen=True)
class _Static:
    rows: int
    num_q_heads: int
    num_kv_heads: int
    group: int
    head_dim: int
    width: int
    per_head: bool
    slots: int
    max_reqs: int
    max_context: int
    qk_scale: float  # softmax_scale * k_scale * log2(e)
    v_scale: float
    plan: PagedDecodePlan
    interpret: bool


def _split_kernel(req_ref, seqlen_ref, table_ref, idx_ref, q_ref, k_ref, v_ref, *out_refs,
                  st: _Static):
    """Program (split j, row r, KV head h) over the refs of ``sparse_decode_paged``'s arguments.
    Outputs: direct (one split): out [R, Hq, D] in q's dtype (the whole array, indexed stores);
    else o [HT, D] f32 and lse [HT] f32 blocks of [S, R, Hkv, HT, (D)]."""
    j, r, h = C.pl.program_id(0), C.pl.program_id(1), C.pl.program_id(2)
    p = st.plan
    g, ht, d, bn, w = st.group, p.head_tile, st.head_dim, p.block_n, st.width
    direct = p.num_splits == 1
    nb = -(-w // bn)
    c_lo = (j * nb) // p.num_splits
    c_hi = ((j + 1) * nb) // p.num_splits

    req = req_ref[r]
    req_ok = (req >= 0) & (req < st.max_reqs)
    bound = jnp.where(req_ok, jnp.minimum(seqlen_ref[r], st.max_context), 0)
    req_safe = jnp.where(req_ok, req, 0)

    # lane i holds head i - (HT - G) (padding lanes first): the direct path's indexed store
    # clamps the padding lanes onto head 0's row and masks them; interpret mode (a scatter of
    # where(mask, val, old), later updates winning on XLA:CPU) then lets the real head-0 lane,
    # which comes after them, write last. The partial path uses the same lane order.
    lane = lax.iota(jnp.int32, ht) - (ht - g)
    head_ok = lane >= 0
    head = h * g + jnp.maximum(lane, 0)
    dcol = lax.iota(jnp.int32, d)[None, :]
    q = C.load(q_ref.at[r, head[:, None], dcol], mask=head_ok[:, None], other=0)  # [HT, D]
    qk_scale = st.qk_scale
    if is_fp8(k_ref.dtype):
        q, qk_scale = fp16_query(q, qk_scale)  # FP8 K/V: the dots in fp16 (qsa_pallas._fp8)
    dt = q.dtype
    offs = lax.iota(jnp.int32, bn)

    def body(c, carry):
        acc, m_i, l_i = carry
        cols = c * bn + offs
        in_w = cols < w
        cols_safe = jnp.minimum(cols, w - 1)
        if st.per_head:
            ent = C.load(idx_ref.at[r, h, cols_safe], mask=in_w, other=-1)
        else:
            ent = C.load(idx_ref.at[r, cols_safe], mask=in_w, other=-1)
        valid = in_w & (ent >= 0) & (ent < bound)
        slot = C.load(table_ref.at[req_safe, jnp.where(valid, ent, 0)], mask=valid, other=0)
        valid = valid & (slot >= 0) & (slot < st.slots)
        rows = jnp.where(valid, slot, 0)
        gmask = jnp.broadcast_to(valid[:, None], (bn, d))
        # `other` a float literal (the lowering cannot cast an int fill to FP8); the load feeds
        # the conversion and the dot directly (a select in between staged the tile twice in
        # the prefill kernel, qsa_pallas/prefill.py)
        kt = C.load(k_ref.at[rows[:, None], h, dcol], mask=gmask, other=0.0).astype(dt)
        s = C.dot(q, kt, trans_b=True) * qk_scale  # FP32 [HT, BN], log2 domain
        s = jnp.where(valid[None, :], s, -jnp.inf)
        m_new = jnp.maximum(m_i, s.max(axis=1))
        m_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # no valid column yet: finite
        alpha = jnp.exp2(m_i - m_ref)
        pr = jnp.exp2(s - m_ref[:, None])
        l_new = l_i * alpha + pr.sum(axis=1)
        vt = C.value_operand(C.load(v_ref.at[rows[:, None], h, dcol], mask=gmask, other=0.0),
                             gmask, dt)
        acc = acc * alpha[:, None] + C.dot(pr.astype(dt), vt)
        return acc, m_new, l_new

    init = (jnp.zeros((ht, d), jnp.float32), jnp.full((ht,), -jnp.inf, jnp.float32),
            jnp.zeros((ht,), jnp.float32))
    acc, m_i, l_i = lax.fori_loop(c_lo, c_hi, body, init)
    # empty (no valid entry): l == 0, exact zeros and LSE -inf; an attended NaN makes l NaN, and
    # then the output / partial and the LSE are NaN too (never the -inf the merge weighs 0)
    empty = l_i == 0
    l_safe = jnp.where(empty, 1.0, l_i)
    o = acc * jnp.where(empty, 0.0, st.v_scale / l_safe)[:, None]
    if direct:
        (out_ref,) = out_refs
        C.store(out_ref.at[r, head[:, None], dcol], o.astype(out_ref.dtype),
                mask=head_ok[:, None])
        return
    o_ref, lse_ref = out_refs
    o_ref[...] = o
    lse_ref[...] = jnp.where(empty, -jnp.inf, m_i + jnp.log2(l_safe))


def _merge(o, lse, st: _Static, out_dtype):
    """The LSE merge (module docstring): o [S, R, Hkv, HT, D], lse [S, R, Hkv, HT] -> [R, Hq, D]."""
    pad = st.plan.head_tile - st.group
    lse = lse[..., pad:]
    o = o[..., pad:, :]
    s = lse.shape[0]
    mx = lse[0]
    for i in range(1, s):
        mx = jnp.maximum(mx, lse[i])
    m_ref = jnp.where(mx == -jnp.inf, 0.0, mx)
    den = jnp.zeros_like(mx)
    num = jnp.zeros(o.shape[1:], jnp.float32)
    nan = jnp.zeros(o.shape[1:], jnp.bool_)
    for i in range(s):
        wi = jnp.exp2(lse[i] - m_ref)  # empty split: 0
        den = den + wi
        num = num + jnp.where(wi[..., None] > 0, wi[..., None] * o[i], 0.0)
        nan = nan | jnp.isnan(o[i]) | jnp.isnan(lse[i])[..., None]
    out = num / jnp.where(den > 0, den, 1.0)[..., None]  # every split empty: zeros
    out = jnp.where(nan, jnp.nan, out)
    r = o.shape[1]
    return out.reshape(r, st.num_q_heads, st.head_dim).astype(out_dtype)


@functools.partial(jax.jit, static_argnames=("st",))
def _decode_paged(q, k_cache, v_cache, req_to_token, req_indices, indices, seq_lens, *, st):
    if st.slots == 0 or st.width == 0 or st.max_reqs == 0 or st.max_context == 0:
        return jnp.zeros(q.shape, q.dtype)  # no entry can be valid: every row is empty
    p = st.plan
    r, hq, d = q.shape
    hkv = st.num_kv_heads
    kernel = functools.partial(_split_kernel, st=st)
    whole = C.pl.no_block_spec
    if p.num_splits == 1:
        out_shape = jax.ShapeDtypeStruct((r, hq, d), q.dtype)
        out_specs = whole
    else:
        s, ht = p.num_splits, p.head_tile
        out_shape = (jax.ShapeDtypeStruct((s, r, hkv, ht, d), jnp.float32),
                     jax.ShapeDtypeStruct((s, r, hkv, ht), jnp.float32))
        out_specs = (C.pl.BlockSpec((None, None, None, ht, d), lambda j, i, h: (j, i, h, 0, 0)),
                     C.pl.BlockSpec((None, None, None, ht), lambda j, i, h: (j, i, h, 0)))
    call = C.triton_call(kernel, out_shape=out_shape, grid=(p.num_splits, r, hkv),
                         in_specs=[whole] * 7, out_specs=out_specs, num_warps=p.num_warps,
                         num_stages=p.num_stages, interpret=st.interpret,
                         name="qsa_decode_paged_split")
    res = call(req_indices, seq_lens, req_to_token, indices, q, k_cache, v_cache)
    if p.num_splits == 1:
        return res
    return _merge(*res, st, q.dtype)


# ---------------------------------------------------------------------------------------------
# Entry points
def plan_for(rows: int, num_kv_heads: int, group: int, head_dim: int, width: int, device=None,
             *, q_dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16,
             batch_invariant: bool = False) -> PagedDecodePlan:
    """The plan (``interop.plan.plan_decode_paged``) a ``sparse_decode_paged`` call with R =
    ``rows``, Hkv, G = Hq / Hkv, D, W = ``width`` and these q / pool dtypes uses, as
    ``qsa_triton.decode_paged.plan_for``; ``device`` a jax GPU device (None: the GPU being
    built for, ``_compat.target_facts``; CPU: the H200's 132 SMs, which only shape the
    interpreter's grid). Raises ValueError as ``plan_decode_paged``. Source: ``interop.plan``."""
    facts = C.target_facts() if device is None else DeviceFacts.from_jax(device)
    sms, smem = (facts.sm_count, facts.smem_per_block) if facts is not None else (132, None)
    return plan_decode_paged(rows, num_kv_heads, group, head_dim,
                             max(1, width), sms, q_bytes=np.dtype(q_dtype).itemsize,
                             kv_bytes=np.dtype(kv_dtype).itemsize,
                             batch_invariant=bool(batch_invariant), backend="pallas",
                             device_smem=smem)


@functools.cache
def _exact_contract_backend() -> bool:
    """True where ``interop.contract.route`` sends decode to the exact contract only (sm_121)."""
    dev = jax.devices()[0]
    if dev.platform != "gpu":
        return False
    return route(DeviceFacts.from_jax(dev), "decode").exact_contract


_FN = "sparse_decode_paged"


def _prepare(args, softmax_scale, k_scale, v_scale, batch_invariant, strict, interpret):
    C.check_inputs(_FN, interpret, **dict(zip(("q", "k_cache", "v_cache", "req_to_token",
                                               "req_indices", "indices", "seq_lens"), args)))
    interp = C.resolve_interpret(interpret)
    prob = check_decode_paged(*args, softmax_scale, k_scale, v_scale,
                              batch_invariant=batch_invariant,
                              # strict last: the checker refuses a traced / non-bool strict
                              strict=(not interp and _exact_contract_backend()) or strict)
    C.check_backend(_FN, interpret, *args)
    C.check_offsets(_FN, k_cache=args[1])
    return prob, interp


def _static(prob, plan, interp) -> _Static:
    return _Static(prob.rows, prob.num_q_heads, prob.num_kv_heads, prob.group, prob.head_dim,
                   prob.width, prob.per_head_indices, prob.slots, prob.max_reqs, prob.max_context,
                   float(prob.softmax_scale * prob.k_scale * LOG2E), float(prob.v_scale), plan,
                   bool(interp))


@C.forward_only
def sparse_decode_paged(q, k_cache, v_cache, req_to_token, req_indices, indices, seq_lens,
                        softmax_scale=None, k_scale=1.0, v_scale=1.0, *,
                        batch_invariant: bool = False, strict: bool = False,
                        interpret: bool | None = None):
    """Paged sparse decode (``qsa-contract.md`` §2b): the whole decode step from the KV pool,
    as ``qsa_triton.sparse_decode_paged`` (same arguments, validity rule and result; algorithm
    and sources in ``qsa_triton.decode_paged``'s module docstring).

    Args:
      q: [R, Hq, D] bfloat16|float16; k_cache, v_cache: [slots, Hkv, D] in q's dtype or
        float8_e4m3fn; req_to_token: int32 [max_reqs, max_context]; req_indices, seq_lens: int32
        [R]; indices: int32 [R, W] or [R, Hkv, W] logical positions (may be traced).
      softmax_scale, k_scale, v_scale: host floats > 0 (default D ** -0.5, 1.0, 1.0);
        batch_invariant, strict: host bools, as the Triton twin's.
      interpret: None -> interpret mode when jax's default backend is the CPU; a bool forces it.

    Returns:
      [R, Hq, D] in q's dtype: ``softmax(scale · k_scale · q[r, h] · Kᵀ) · V · v_scale`` over the
      row's valid entries (KV head h // G); exact zeros for a row with none.

    Raises:
      ContractError: before anything is traced, ``interop.contract.check_decode_paged`` (the
        torch path's message); an FP8 pool of 2**31..2**32 elements (module docstring);
        ``interpret=False`` on a CPU-only JAX.

    Works under ``jax.jit`` (a new length never retraces), ``lax.scan`` and ``shard_map``.
    """
    args = (q, k_cache, v_cache, req_to_token, req_indices, indices, seq_lens)
    prob, interp = _prepare(args, softmax_scale, k_scale, v_scale, batch_invariant, strict,
                            interpret)
    plan = plan_for(prob.rows, prob.num_kv_heads, prob.group, prob.head_dim, prob.width,
                    q_dtype=q.dtype, kv_dtype=k_cache.dtype, batch_invariant=batch_invariant)
    return _decode_paged(*args, st=_static(prob, plan, interp))


def decode_paged_with_plan(q, k_cache, v_cache, req_to_token, req_indices, indices, seq_lens,
                           softmax_scale=None, k_scale=1.0, v_scale=1.0, *,
                           plan: PagedDecodePlan, interpret: bool | None = None):
    """``sparse_decode_paged`` (contract checked) with an explicit plan (tests, sweeps).

    Raises:
      ContractError: as ``sparse_decode_paged``; a plan whose head tile cannot hold G, whose
        BLOCK_N is not a power of two >= 16, or with more than PAGED_MAX_SPLITS splits.
    """
    args = (q, k_cache, v_cache, req_to_token, req_indices, indices, seq_lens)
    prob, interp = _prepare(args, softmax_scale, k_scale, v_scale, False, False, interpret)
    ht, bn = plan.head_tile, plan.block_n
    if ht < max(16, prob.group) or ht & (ht - 1) or bn < 16 or bn & (bn - 1) \
            or not 1 <= plan.num_splits <= PAGED_MAX_SPLITS:
        raise ContractError("decode_paged_with_plan", "plan", "head_tile a power of two >= "
                            f"max(16, G={prob.group}), block_n a power of two >= 16, 1 <= "
                            f"num_splits <= {PAGED_MAX_SPLITS}", plan)
    nb = max(1, -(-prob.width // bn))
    plan = dataclasses.replace(plan, num_splits=min(plan.num_splits, nb))
    return _decode_paged(*args, st=_static(prob, plan, interp))

