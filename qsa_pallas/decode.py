"""Packed varlen sparse decode (``qsa-contract.md`` §2) for JAX: Pallas on the Triton lowering.

Algorithm, plan (``interop.plan.plan_decode``, fitted to shared memory) and split rule
(``interop.plan.split_blocks``) as ``qsa_triton.decode`` (FlashAttention-2's online softmax,
flash-decoding split-KV, LSE merge). Differences:

* a 3-D grid (sequence, KV head, split); the key range and n_active come in the kernel from
  ``cu_seqlens_k`` (no scalar prefetch in the Triton lowering); every K/V row index is clamped
  into the buffer *and* masked (interpret mode clamps out-of-range gathers instead of faulting);
* a one-split plan runs the split kernel alone, writing q's dtype (bench/NOTES.md, "Decode,
  Pallas"); otherwise ``_merge_kernel`` weighs split j by ``exp(lse_j - max lse)``, by
  multiplication, so an attended NaN reaches the output whatever the split count;
* ``batch_invariant=True``: partials and ``_merge_ordered_kernel``, folding the row's own splits
  in order (a one-split row takes its partial as it is, as the Triton twin does);
* 64-bit offsets: the lowering switches to i64 itself for operands over 2**32 bytes; the row
  numbers computed here (``row * Hkv + h``) stay far below 2**31.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from interop.arch import DeviceFacts
from interop.contract import ContractError, check_decode, exact_contract
from interop.plan import DecodePlan, fit_shared_memory, next_pow2, plan_decode, split_blocks

from . import _compat as C

__all__ = ["sparse_decode", "plan_for"]


def plan_for(batch: int, num_kv_heads: int, group: int, head_dim: int, max_seqlen_k: int,
             device=None, *, batch_invariant: bool = False) -> tuple[DecodePlan, str]:
    """As ``qsa_triton.decode.plan_for``; differences: ``device`` a jax GPU device (None: the
    GPU being built for, ``_compat.target_facts``; CPU: 132 SMs, no shared-memory limit), no
    device-side balance, and merge "direct" (one-split plan) | "kernel" | "ordered"
    (batch_invariant)."""
    if batch_invariant:
        return plan_decode(batch, num_kv_heads, group, head_dim, max_seqlen_k,
                           batch_invariant=True), "ordered"
    facts = C.target_facts() if device is None else DeviceFacts.from_jax(device)
    sms = facts.sm_count if facts is not None else 132
    plan = plan_decode(batch, num_kv_heads, group, head_dim, max_seqlen_k, sms)
    plan = fit_shared_memory(plan, head_dim=head_dim, limit=facts and facts.smem_per_block)
    return plan, "direct" if plan.max_splits == 1 else "kernel"


# ---------------------------------------------------------------------------------------------
# The split kernel
def _active_splits(cuk_ref, s, block_n: int, min_blocks: int, max_splits: int, capacity: int):
    """Row s's (start, end, length, blocks, n_active) from device data only: blocks =
    cdiv(len, BLOCK_N), n_active = clamp(cdiv(blocks, min_blocks), 1, max_splits) (a zero-length
    row: 1 split, which writes zeros). Both ends are clamped into [0, C], so lying metadata
    never leads outside K/V (qsa-contract.md §2; the Triton twin clamps the same way)."""
    start = jnp.clip(cuk_ref[s], 0, capacity)
    end = jnp.clip(cuk_ref[s + 1], 0, capacity)
    length = jnp.maximum(end - start, 0)
    blocks = (length + (block_n - 1)) // block_n
    n_active = jnp.clip((blocks + (min_blocks - 1)) // min_blocks, 1, max_splits)
    return start, end, length, blocks, n_active


def _split_kernel(cuq_ref, cuk_ref, q_ref, k_ref, v_ref, o_ref, lse_ref=None, *, group: int,
                  head_tile: int, block_n: int, num_q_heads: int, num_kv_heads: int,
                  batch: int, capacity: int, max_splits: int, min_blocks: int, scale: float,
                  direct: bool = False):
    """One (sequence, KV head, split) program. Refs: cuq/cuk int32 [B + 1]; q [B * Hq, D];
    k, v [C * Hkv, D] (row r, head h at r * Hkv + h); o_ref [HT, D] f32 block of
    [B, Hkv, S, HT, D]; lse_ref [HT] f32 block of [B, Hkv, S, HT]. direct (one-split plan):
    o_ref is the whole output [B * Hq, D] in q's dtype (rows s * Hq + h * G + g), no lse_ref.
    """
    s, h, j = _program_ids()
    start, end, length, blocks, n_active = _active_splits(cuk_ref, s, block_n, min_blocks,
                                                          max_splits, capacity)
    # The shared split rule (interop.plan.split_blocks); for j >= n_active both ends clamp to
    # `blocks` (an empty split, never stored nor read).
    blk_lo, blk_hi = (jnp.minimum(x, blocks) for x in split_blocks(blocks, j, n_active))
    full = length // block_n  # blocks [0, full) lie entirely inside the row

    heads = lax.iota(jnp.int32, head_tile)
    if direct:
        # Padding lanes first (lane i holds head i - (HT - G)): the indexed output store below
        # clamps the padding lanes onto head 0's row and masks them; on the GPU they store
        # nothing, and interpret mode (a scatter of where(mask, val, old), later updates winning
        # on XLA:CPU) then lets the real head-0 lane, which comes after them, write last.
        heads = heads - (head_tile - group)
        head_ok = heads >= 0
        heads = jnp.maximum(heads, 0)
    else:
        head_ok = heads < group
    q_row = jnp.clip(cuq_ref[s], 0, batch - 1)
    q_idx = q_row * num_q_heads + h * group + jnp.minimum(heads, group - 1)
    dcol = lax.iota(jnp.int32, q_ref.shape[-1])[None, :]
    q = C.load(q_ref.at[q_idx[:, None], dcol], mask=head_ok[:, None], other=0)  # [HT, D] bf16/fp16

    cols = lax.iota(jnp.int32, block_n)

    def step(b, carry, masked: bool):
        acc, m_prev, l_prev = carry
        rows = start + b * block_n + cols
        # Clamp into the buffer *and* (in the row's last, partial block) mask: nothing outside
        # [start, end) is dereferenced, whatever the capacity.
        kv_idx = jnp.clip(rows, 0, capacity - 1) * num_kv_heads + h
        row_ok = rows < end if masked else None  # rows >= start by construction
        mask = row_ok[:, None] if masked else None
        other = 0 if masked else None
        kt = C.load(k_ref.at[kv_idx[:, None], dcol], mask=mask, other=other)  # [BN, D]
        scores = C.dot(q, kt, trans_b=True) * scale  # FP32 [HT, BN], scale on FP32 scores
        if masked:
            scores = jnp.where(row_ok[None, :], scores, -jnp.inf)
        # Every executed block has >= 1 in-row column, so m_new is finite and alpha well defined.
        m_new = jnp.maximum(m_prev, scores.max(axis=1))
        alpha = jnp.exp(m_prev - m_new)
        p = jnp.exp(scores - m_new[:, None])
        l_new = l_prev * alpha + p.sum(axis=1)
        vt = C.load(v_ref.at[kv_idx[:, None], dcol], mask=mask, other=other)  # [BN, D]
        acc = acc * alpha[:, None] + C.dot(p.astype(vt.dtype), vt)
        return acc, m_new, l_new

    d = q.shape[-1]
    init = (jnp.zeros((head_tile, d), jnp.float32),
            jnp.full((head_tile,), -jnp.inf, jnp.float32),
            jnp.zeros((head_tile,), jnp.float32))
    # Interior blocks unmasked (loads vectorise and pipeline), then the row's partial last block
    # (0 or 1 iterations, only in the split that owns it) with masks.
    carry = lax.fori_loop(blk_lo, jnp.minimum(blk_hi, full),
                          functools.partial(step, masked=False), init)
    acc, m_i, l_i = lax.fori_loop(jnp.maximum(blk_lo, full), blk_hi,
                                  functools.partial(step, masked=True), carry)
    # empty split: l == 0 (exact zeros, LSE -inf); an attended NaN makes l NaN: NaN output / LSE
    empty = l_i == 0
    out = acc / jnp.where(empty, 1.0, l_i)[:, None]
    if direct:  # the whole row in this program: normalised output in q's dtype, zeros if empty
        o_idx = s * num_q_heads + h * group + heads
        C.store(o_ref.at[o_idx[:, None], dcol], out.astype(o_ref.dtype), mask=head_ok[:, None])
        return
    lse = jnp.where(empty, -jnp.inf, m_i + jnp.log(jnp.where(empty, 1.0, l_i)))
    # Padded head rows and inactive splits are never stored (nor read by the merge).
    keep = head_ok & (j < n_active)
    C.store(o_ref, out, mask=keep[:, None])
    C.store(lse_ref, lse, mask=keep)


def _merge_kernel(cuk_ref, o_ref, lse_ref, out_ref, *, group: int, head_tile: int, block_n: int,
                  num_kv_heads: int, max_splits: int, splits_p2: int, min_blocks: int,
                  d_chunk: int, capacity: int):
    """One (sequence s, query head h, D chunk c) program: the stable LSE merge of the row's
    active splits. Refs: cuk int32 [B + 1]; o [B * Hkv * S * HT, D] and lse [B * Hkv * S * HT]
    f32 (the split kernel's outputs, flattened); out_ref a [d_chunk] block of out [B, Hq, D].
    M = max_j lse_j (0 for an empty row), w_j = exp(lse_j - M) (0 for lse = -inf and splits
    j >= n_active), out = sum_j w_j o_j / sum_j w_j (0 / 1 for an empty row: exact zeros).
    """
    s, h, c = _program_ids()
    *_, n_active = _active_splits(cuk_ref, s, block_n, min_blocks, max_splits, capacity)
    kvh = h // group
    g = h - kvh * group
    jj = lax.iota(jnp.int32, splits_p2)
    ok = jj < n_active  # n_active <= max_splits <= splits_p2
    rows = ((s * num_kv_heads + kvh) * max_splits + jnp.minimum(jj, max_splits - 1)) * head_tile + g
    lse = C.load(lse_ref.at[rows], mask=ok, other=-jnp.inf)  # [S_p2]
    m = lse.max()
    m = jnp.where(m == -jnp.inf, 0.0, m)
    w = jnp.exp(lse - m)
    den = w.sum()
    cols = c * d_chunk + lax.iota(jnp.int32, d_chunk)
    o = C.load(o_ref.at[rows[:, None], cols[None, :]], mask=ok[:, None], other=0.0)  # [S_p2, Dc]
    out = (w[:, None] * o).sum(axis=0) / jnp.where(den > 0, den, 1.0)
    out_ref[...] = out.astype(out_ref.dtype)


def _merge_ordered_kernel(cuk_ref, o_ref, lse_ref, out_ref, *, group: int, head_tile: int,
                          block_n: int, num_kv_heads: int, max_splits: int, min_blocks: int,
                          d_chunk: int, capacity: int):
    """Batch-invariant merge, one (sequence s, query head h, D chunk c) program, refs as
    ``_merge_kernel``'s: the weighted sum accumulated j = 0 .. n_active - 1 in a ``fori_loop``
    over the row's own splits (neither B nor the grid's split count enters), exact zeros where
    every split is empty, o_0 as it is for n_active = 1 (as the Triton twin's split kernel
    writes it). A NaN LSE or partial propagates by arithmetic (0 x NaN is NaN).
    """
    s, h, c = _program_ids()
    *_, n_active = _active_splits(cuk_ref, s, block_n, min_blocks, max_splits, capacity)
    kvh = h // group
    base = (s * num_kv_heads + kvh) * max_splits
    g = h - kvh * group
    cols = c * d_chunk + lax.iota(jnp.int32, d_chunk)

    def row(j):
        return (base + j) * head_tile + g

    lse0 = lse_ref[row(0)]
    mx = lax.fori_loop(1, n_active, lambda j, m: jnp.maximum(m, lse_ref[row(j)]), lse0)
    m_ref = jnp.where(mx == -jnp.inf, 0.0, mx)  # every split empty: a finite reference
    o0 = C.load(o_ref.at[row(0), cols])
    w0 = jnp.exp(lse0 - m_ref)

    def fold(j, carry):
        num, den = carry
        w = jnp.exp(lse_ref[row(j)] - m_ref)
        return num + w * C.load(o_ref.at[row(j), cols]), den + w

    num, den = lax.fori_loop(1, n_active, fold, (w0 * o0, w0))
    out = jnp.where(n_active == 1, o0, num / jnp.where(den == 0, 1.0, den))
    out_ref[...] = out.astype(out_ref.dtype)


def _program_ids():
    return C.pl.program_id(0), C.pl.program_id(1), C.pl.program_id(2)


def _split_call(q, k, v, cu_seqlens_q, cu_seqlens_k, *, plan: DecodePlan, softmax_scale: float,
                interpret: bool, direct: bool):
    """The split kernel, unchecked (C >= 1): direct -> out [B, Hq, D] in q's dtype; else f32
    (o [B, Hkv, S, HT, D], lse [B, Hkv, S, HT]), valid for heads < G of splits < n_active."""
    b, hq, d = q.shape
    cap, hkv, _ = k.shape
    ht, s_max = plan.head_tile, plan.max_splits
    if direct and s_max != 1:
        raise ValueError(f"the direct path needs a one-split plan, got max_splits={s_max}")
    kernel = functools.partial(
        _split_kernel, group=hq // hkv, head_tile=ht, block_n=plan.block_n, num_q_heads=hq,
        num_kv_heads=hkv, batch=b, capacity=cap, max_splits=s_max,
        min_blocks=plan.min_blocks_per_split, scale=float(softmax_scale), direct=direct)
    whole = C.pl.no_block_spec
    if direct:
        out_shape, out_specs = jax.ShapeDtypeStruct((b * hq, d), q.dtype), whole
    else:
        out_shape = (jax.ShapeDtypeStruct((b, hkv, s_max, ht, d), jnp.float32),
                     jax.ShapeDtypeStruct((b, hkv, s_max, ht), jnp.float32))
        out_specs = (C.pl.BlockSpec((None, None, None, ht, d), lambda i, h, j: (i, h, j, 0, 0)),
                     C.pl.BlockSpec((None, None, None, ht), lambda i, h, j: (i, h, j, 0)))
    call = C.triton_call(
        kernel, out_shape=out_shape, grid=(b, hkv, s_max), in_specs=[whole] * 5,
        out_specs=out_specs, num_warps=plan.num_warps, num_stages=plan.num_stages,
        interpret=interpret, name="qsa_decode_direct" if direct else "qsa_decode_split")
    res = call(cu_seqlens_q, cu_seqlens_k, q.reshape(b * hq, d), k.reshape(cap * hkv, d),
               v.reshape(cap * hkv, d))
    return res.reshape(b, hq, d) if direct else res


def _merge_call(o, lse, cu_seqlens_k, *, num_q_heads: int, plan: DecodePlan, out_dtype,
                capacity: int, interpret: bool, ordered: bool):
    """``_merge_kernel`` (a [S_p2, D chunk] FP32 tile of <= 4096 elements) or, ``ordered``,
    ``_merge_ordered_kernel`` (min(D, 256) columns): the split outputs -> [B, Hq, D]."""
    b, hkv, s_max, ht, d = o.shape
    common = dict(group=num_q_heads // hkv, head_tile=ht, block_n=plan.block_n, num_kv_heads=hkv,
                  max_splits=s_max, min_blocks=plan.min_blocks_per_split, capacity=capacity)
    if ordered:
        d_chunk = min(d, 256)
        kernel = functools.partial(_merge_ordered_kernel, d_chunk=d_chunk, **common)
    else:
        splits_p2 = max(2, next_pow2(s_max))
        d_chunk = max(16, min(d, 4096 // splits_p2))
        kernel = functools.partial(_merge_kernel, splits_p2=splits_p2, d_chunk=d_chunk, **common)
    call = C.triton_call(
        kernel, out_shape=jax.ShapeDtypeStruct((b, num_q_heads, d), out_dtype),
        grid=(b, num_q_heads, d // d_chunk), in_specs=[C.pl.no_block_spec] * 3,
        out_specs=C.pl.BlockSpec((None, None, d_chunk), lambda i, h, c: (i, h, c)),
        num_warps=4, num_stages=1, interpret=interpret,
        name="qsa_decode_merge_ordered" if ordered else "qsa_decode_merge")
    return call(cu_seqlens_k, o.reshape(b * hkv * s_max * ht, d), lse.reshape(-1))


@functools.partial(jax.jit, static_argnames=("plan", "softmax_scale", "interpret",
                                             "batch_invariant"))
def _decode(q, k, v, cu_seqlens_q, cu_seqlens_k, *, plan: DecodePlan, softmax_scale: float,
            interpret: bool, batch_invariant: bool = False):
    if k.shape[0] == 0:  # no keys anywhere: every row is empty (contract: exact zeros)
        return jnp.zeros_like(q)
    direct = plan.max_splits == 1 and not batch_invariant
    res = _split_call(q, k, v, cu_seqlens_q, cu_seqlens_k, plan=plan,
                      softmax_scale=softmax_scale, interpret=interpret, direct=direct)
    if direct:
        return res
    return _merge_call(*res, cu_seqlens_k, num_q_heads=q.shape[1], plan=plan, out_dtype=q.dtype,
                       capacity=k.shape[0], interpret=interpret, ordered=batch_invariant)


@C.forward_only
def sparse_decode(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_k, softmax_scale=None, *,
                  strict: bool = False, interpret: bool | None = None,
                  batch_invariant: bool = False):
    """Packed varlen sparse decode (``qsa-contract.md`` §2), forward-only: as
    ``qsa_triton.sparse_decode`` (same argument order and meaning).

    Args:
      q: [B, Hq, D] bfloat16|float16; k, v: [C, Hkv, D] in q's dtype, C >= cu_seqlens_k[B];
        Hq = G * Hkv, G <= 16, D a power of two in 32..256.
      cu_seqlens_q, cu_seqlens_k: int32 [B + 1] (may be traced; never read on the host).
      max_seqlen_k: host int >= 1 (sizes the split grid only); softmax_scale: host float > 0,
        default D ** -0.5; strict, batch_invariant: host bools, as the Triton twin's.
      interpret: None -> interpret mode when jax's default backend is the CPU; a bool forces it.

    Returns:
      [B, Hq, D] in q's dtype: ``softmax(scale * q[cu_q[s], h] . K^T) . V`` over the row's keys
      of KV head ``h // G``; exact zeros for a row with no keys; an attended NaN gives NaN.

    Raises:
      ContractError: before anything is traced (``interop.contract.check_decode``, the torch
        path's message); torch tensors; ``interpret=False`` on a CPU-only jax.

    Works under ``jax.jit`` (lengths traced), ``lax.scan`` and ``shard_map`` (VMA check off).
    Source: flash-decoding split-KV with an LSE merge, FlashAttention-2's online softmax; the
    plan and split rule of ``interop.plan`` (this module's docstring).
    """
    return _sparse_decode(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_k, softmax_scale,
                          strict=strict, interpret=interpret, batch_invariant=batch_invariant)


def _sparse_decode(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_k, softmax_scale=None, *,
                   strict: bool = False, interpret: bool | None = None,
                   plan: DecodePlan | None = None, batch_invariant: bool = False):
    """``sparse_decode`` with an optional explicit plan (tests, ahead-of-time lowering)."""
    C.check_inputs("sparse_decode", interpret, q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q,
                   cu_seqlens_k=cu_seqlens_k)
    interp = C.resolve_interpret(interpret)
    # SM121 routes decode to the exact qualified contract only (qsa-contract.md §5), as in
    # qsa_triton; decided from static facts at trace time, so it costs nothing under jit.
    prob = check_decode(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_k, softmax_scale,
                        fn="sparse_decode", batch_invariant=batch_invariant,
                        # strict last: the checker refuses a traced / non-bool strict
                        strict=(not interp and exact_contract(C.target_facts())) or strict)
    C.check_backend("sparse_decode", interpret, q, k, v, cu_seqlens_q, cu_seqlens_k)
    if plan is None:
        plan, _ = plan_for(prob.batch, prob.num_kv_heads, prob.group, prob.head_dim,
                           prob.max_seqlen_k, batch_invariant=batch_invariant)
    elif plan.head_tile < max(16, prob.group) or plan.head_tile & (plan.head_tile - 1):
        raise ContractError("sparse_decode", "plan", "head_tile a power of two >= max(16, G)",
                            plan.head_tile)
    return _decode(q, k, v, cu_seqlens_q, cu_seqlens_k, plan=plan,
                   softmax_scale=float(prob.softmax_scale), interpret=interp,
                   batch_invariant=bool(batch_invariant))
