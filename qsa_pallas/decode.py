"""Packed varlen sparse decode for JAX: a Pallas kernel on the Triton lowering, split-KV + merge.

Semantics: ``qsa-contract.md`` §2 (flash-attn varlen convention, one query row per sequence).
Design (mirrors ``qsa_triton.decode`` through the shared static plan ``interop.plan``):

* one program per (sequence s, KV head h, split j) covering the G query heads of h, padded to a
  power-of-two head tile (>= 16 so the dots map to tensor-core MMAs) and masked;
* the split's key range is derived *in the kernel* from ``cu_seqlens_k`` (an int32 input: the
  Triton lowering has no scalar prefetch), with the number of active splits decided on the device
  from the row length exactly as ``interop/plan.py`` describes; a row longer than
  ``max_seqlen_k`` is still covered completely (the split size grows with the device length);
* bf16/fp16 dots with FP32 scores (the scale is applied to the FP32 scores), FP32 online softmax;
  every K/V row index is clamped into the buffer *and* masked, so nothing outside
  ``[cu_k[s], cu_k[s+1])`` is read (interpret mode clamps out-of-range gathers instead of faulting,
  so only explicit masks make the CPU tests meaningful);
* each active split writes its normalised partial output and its LSE (FP32, ``-inf`` for the one
  split of a zero-length row); a second Pallas kernel (one program per sequence, query head and
  D chunk) recomputes the row's n_active from the same device length, weighs split j by
  ``exp(lse_j - max lse)`` (inactive / empty splits by exactly 0) and writes ``[B, Hq, D]`` in q's
  dtype: exact zeros for a row with no keys, never NaN. Two launches, no XLA glue kernels, no
  atomics at all;
* optionally (``direct=True`` / ``QSA_PALLAS_DIRECT=1``), a one-split plan (``max_splits == 1``:
  B x Hkv >= the SM count, e.g. TP1 B >= 34, TP2/TP4 B >= 67 on the H200) launches the split kernel alone, writing the normalised output in q's dtype
  straight into ``[B, Hq, D]`` (no FP32 partials, no merge launch), as the Triton kernel does for
  a row with one active split.

64-bit offsets: the Pallas Triton lowering switches its pointer offsets to i64 by itself when an
operand exceeds 2**32 bytes (``_compute_offsets_from_indices``); the row numbers the kernel computes
(``row * Hkv + h`` < C * Hkv rows) stay far below 2**31.

Algorithm sources: FlashAttention-2 online softmax / flash-decoding split-KV with an LSE merge (Dao
et al.); the split sizing rule is ``interop/plan.py``'s.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
from jax import lax

from interop.contract import ContractError, check_decode, exact_contract
from interop.plan import DecodePlan, fit_shared_memory, next_pow2, plan_decode, split_blocks

from . import _compat as C

__all__ = [
    "sparse_decode", "decode_plan_for", "decode_partials", "decode_direct", "merge_partials",
    "lowering_cases",
]


def decode_plan_for(batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                    max_seqlen_k: int, *, elem_bytes: int = 2, **overrides) -> DecodePlan:
    """The shared static split-KV plan (``interop.plan.plan_decode``) for these shapes on
    the target GPU (its SM count), with ``num_stages`` clamped to its shared memory.
    ``overrides`` go to ``plan_decode`` (``max_splits``, ``block_n``, ``sm_count``)."""
    facts = C.target_facts()
    sm = overrides.pop("sm_count", None) or (facts.sm_count if facts is not None else 132)
    smem = facts.smem_per_block if facts is not None else None
    plan = plan_decode(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim, max_seqlen_k,
                       sm, **overrides)
    return fit_shared_memory(plan, head_dim=head_dim, limit=smem, kv_bytes=elem_bytes,
                             q_bytes=elem_bytes)


# ---------------------------------------------------------------------------------------------
# The split kernel
def _active_splits(cuk_ref, s, block_n: int, min_blocks: int, max_splits: int):
    """Row s's (start, end, length, blocks, n_active) from device data only
    (``interop/plan.py``): blocks = cdiv(len, BLOCK_N), n_active = clamp(cdiv(blocks,
    min_blocks), 1, max_splits). A zero-length row has n_active = 1 (its split writes zeros)."""
    start = cuk_ref[s]
    end = cuk_ref[s + 1]
    length = jnp.maximum(end - start, 0)
    blocks = (length + (block_n - 1)) // block_n
    n_active = jnp.clip((blocks + (min_blocks - 1)) // min_blocks, 1, max_splits)
    return start, end, length, blocks, n_active


def _split_kernel(cuq_ref, cuk_ref, q_ref, k_ref, v_ref, o_ref, lse_ref=None, *, group: int,
                  head_tile: int, block_n: int, num_q_heads: int, num_kv_heads: int,
                  batch: int, capacity: int, max_splits: int, min_blocks: int, scale: float,
                  direct: bool = False):
    """One (sequence, KV head, split) program.

    Refs: cuq/cuk int32 [B + 1]; q [B * Hq, D]; k, v [C * Hkv, D] (row r, head h at r * Hkv + h);
    o_ref [HT, D] f32 block of [B, Hkv, S, HT, D]; lse_ref [HT] f32 block of [B, Hkv, S, HT].
    direct (plan.max_splits == 1): o_ref is the whole output [B * Hq, D] in q's dtype, written at
    rows s * Hq + h * G + g (the split is the whole row: no partials, no LSE, no merge launch,
    as the Triton kernel does for a row with n_active == 1); lse_ref is absent.
    """
    s, h, j = pl_program_ids()
    start, end, length, blocks, n_active = _active_splits(cuk_ref, s, block_n, min_blocks,
                                                          max_splits)
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
    has = l_i > 0
    out = acc / jnp.where(has, l_i, 1.0)[:, None]
    if direct:  # the whole row in this program: normalised output in q's dtype, zeros if empty
        o_idx = s * num_q_heads + h * group + heads
        C.store(o_ref.at[o_idx[:, None], dcol], out.astype(o_ref.dtype), mask=head_ok[:, None])
        return
    lse = jnp.where(has, m_i + jnp.log(jnp.where(has, l_i, 1.0)), -jnp.inf)
    # Padded head rows and inactive splits are never stored (nor read by the merge).
    keep = head_ok & (j < n_active)
    C.store(o_ref, out, mask=keep[:, None])
    C.store(lse_ref, lse, mask=keep)


def _merge_kernel(cuk_ref, o_ref, lse_ref, out_ref, *, group: int, head_tile: int, block_n: int,
                  num_kv_heads: int, max_splits: int, splits_p2: int, min_blocks: int,
                  d_chunk: int):
    """One (sequence s, query head h, D chunk c) program: the stable LSE merge of the row's
    active splits.

    Refs: cuk int32 [B + 1]; o [B * Hkv * S * HT, D] f32 and lse [B * Hkv * S * HT] f32 (the split
    kernel's outputs, flattened); out_ref: [d_chunk] block of out [B, Hq, D] (q's dtype).
    M = max_j lse_j over active splits (0 when the row is empty), w_j = exp(lse_j - M) (0 for
    lse = -inf and for masked splits j >= n_active), out = sum_j w_j o_j / sum_j w_j, with 0 / 1
    for an empty row: exact zeros, never NaN.
    """
    s, h, c = pl_program_ids()
    *_, n_active = _active_splits(cuk_ref, s, block_n, min_blocks, max_splits)
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


def pl_program_ids():
    return C.pl.program_id(0), C.pl.program_id(1), C.pl.program_id(2)


def decode_partials(q, k, v, cu_seqlens_q, cu_seqlens_k, *, plan: DecodePlan, softmax_scale: float,
                    interpret: bool):
    """Run only the split kernel (no checks): per-split normalised outputs and LSEs.

    Args:
      q: [B, Hq, D]; k, v: [C, Hkv, D] (C >= 1); cu_seqlens_q/k: int32 [B + 1].

    Returns:
      (o [B, Hkv, S, HT, D] float32, lse [B, Hkv, S, HT] float32), S = plan.max_splits,
      HT = plan.head_tile. Written: head rows < G of splits j < n_active(row); the rest is
      unwritten (garbage). A zero-length row's split 0 has o = 0 and lse = -inf.
    """
    b, hq, d = q.shape
    cap, hkv, _ = k.shape
    group = hq // hkv
    ht, s_max = plan.head_tile, plan.max_splits
    kernel = functools.partial(
        _split_kernel, group=group, head_tile=ht, block_n=plan.block_n, num_q_heads=hq,
        num_kv_heads=hkv, batch=b, capacity=cap, max_splits=s_max,
        min_blocks=plan.min_blocks_per_split, scale=float(softmax_scale))
    whole = C.pl.no_block_spec
    call = C.triton_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((b, hkv, s_max, ht, d), jnp.float32),
                   jax.ShapeDtypeStruct((b, hkv, s_max, ht), jnp.float32)),
        grid=(b, hkv, s_max),
        in_specs=[whole] * 5,
        out_specs=(C.pl.BlockSpec((None, None, None, ht, d), lambda i, h, j: (i, h, j, 0, 0)),
                   C.pl.BlockSpec((None, None, None, ht), lambda i, h, j: (i, h, j, 0))),
        num_warps=plan.num_warps, num_stages=plan.num_stages, interpret=interpret,
        name="qsa_decode_split")
    return call(cu_seqlens_q, cu_seqlens_k, q.reshape(b * hq, d), k.reshape(cap * hkv, d),
                v.reshape(cap * hkv, d))


def decode_direct(q, k, v, cu_seqlens_q, cu_seqlens_k, *, plan: DecodePlan, softmax_scale: float,
                  interpret: bool):
    """The split kernel alone for a one-split plan (``plan.max_splits == 1``, no checks): each
    (sequence, KV head) program attends its whole row and writes ``[B, Hq, D]`` in q's dtype
    directly (exact zeros for an empty row). Saves the merge launch and the FP32 partial round
    trip (B >= 34 on TP1, B >= 67 on TP2/TP4 with 132 SMs)."""
    b, hq, d = q.shape
    cap, hkv, _ = k.shape
    if plan.max_splits != 1:
        raise ValueError(f"decode_direct needs a one-split plan, got max_splits={plan.max_splits}")
    kernel = functools.partial(
        _split_kernel, group=hq // hkv, head_tile=plan.head_tile, block_n=plan.block_n,
        num_q_heads=hq, num_kv_heads=hkv, batch=b, capacity=cap, max_splits=1,
        min_blocks=plan.min_blocks_per_split, scale=float(softmax_scale), direct=True)
    whole = C.pl.no_block_spec
    call = C.triton_call(
        kernel, out_shape=jax.ShapeDtypeStruct((b * hq, d), q.dtype), grid=(b, hkv, 1),
        in_specs=[whole] * 5, out_specs=whole, num_warps=plan.num_warps,
        num_stages=plan.num_stages, interpret=interpret, name="qsa_decode_direct")
    out = call(cu_seqlens_q, cu_seqlens_k, q.reshape(b * hq, d), k.reshape(cap * hkv, d),
               v.reshape(cap * hkv, d))
    return out.reshape(b, hq, d)


def merge_partials(o, lse, cu_seqlens_k, *, num_q_heads: int, plan: DecodePlan, out_dtype,
                   interpret: bool):
    """The merge kernel: (o [B, Hkv, S, HT, D] f32, lse [B, Hkv, S, HT] f32) -> [B, Hq, D].

    One program per (sequence, query head, D chunk); the D chunk keeps the [S_p2, D_chunk] FP32
    tile at <= 4096 elements (32 per thread with 4 warps). Reads only the row's active splits.
    """
    b, hkv, s_max, ht, d = o.shape
    group = num_q_heads // hkv
    splits_p2 = max(2, next_pow2(s_max))
    d_chunk = max(16, min(d, 4096 // splits_p2))
    kernel = functools.partial(
        _merge_kernel, group=group, head_tile=ht, block_n=plan.block_n, num_kv_heads=hkv,
        max_splits=s_max, splits_p2=splits_p2, min_blocks=plan.min_blocks_per_split,
        d_chunk=d_chunk)
    whole = C.pl.no_block_spec
    call = C.triton_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((b, num_q_heads, d), out_dtype),
        grid=(b, num_q_heads, d // d_chunk),
        in_specs=[whole] * 3,
        out_specs=C.pl.BlockSpec((None, None, d_chunk), lambda i, h, c: (i, h, c)),
        num_warps=4, num_stages=1, interpret=interpret, name="qsa_decode_merge")
    return call(cu_seqlens_k, o.reshape(b * hkv * s_max * ht, d), lse.reshape(-1))


# One-split plans through ``decode_direct`` (one launch) instead of split + merge. Off by default
# until the H200 confirms it (bench: ``python -m bench.pallas_decode_provider`` times both) and
# tests/test_pallas_lowering.py accepts the one-module lowering; QSA_PALLAS_DIRECT=1 turns it on.
DIRECT_ONE_SPLIT = os.environ.get("QSA_PALLAS_DIRECT", "0") not in ("", "0")


@functools.partial(jax.jit, static_argnames=("plan", "softmax_scale", "interpret", "direct"))
def _decode(q, k, v, cu_seqlens_q, cu_seqlens_k, *, plan: DecodePlan, softmax_scale: float,
            interpret: bool, direct: bool = False):
    b, hq, d = q.shape
    cap, hkv, _ = k.shape
    if cap == 0:  # no keys anywhere: every row is empty (contract: exact zeros)
        return jnp.zeros_like(q)
    if direct and plan.max_splits == 1:  # one program per (sequence, KV head): one launch
        return decode_direct(q, k, v, cu_seqlens_q, cu_seqlens_k, plan=plan,
                             softmax_scale=softmax_scale, interpret=interpret)
    o, lse = decode_partials(q, k, v, cu_seqlens_q, cu_seqlens_k, plan=plan,
                             softmax_scale=softmax_scale, interpret=interpret)
    return merge_partials(o, lse, cu_seqlens_k, num_q_heads=hq, plan=plan, out_dtype=q.dtype,
                          interpret=interpret)


def sparse_decode(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_k, softmax_scale=None, *,
                  strict: bool = False, interpret: bool | None = None,
                  plan: DecodePlan | None = None, direct: bool | None = None):
    """Packed varlen sparse decode (``qsa-contract.md`` §2), Pallas on the Triton lowering.

    Same argument order and meaning as ``qsa_triton.sparse_decode``.

    Args:
      q: [B, Hq, D] bfloat16|float16 jax array; sequence s's query is row ``cu_seqlens_q[s]``.
      k, v: [C, Hkv, D], q's dtype: packed selected keys/values; sequence s owns rows
        ``[cu_seqlens_k[s], cu_seqlens_k[s + 1])``. C (capacity) is any size >= cu_seqlens_k[B].
      cu_seqlens_q, cu_seqlens_k: int32 [B + 1] device arrays (may be traced; never read on the
        host).
      max_seqlen_k: host int >= 1, static upper bound of a row's key count; it only sizes the
        split grid (a longer row is still attended completely).
      softmax_scale: host float > 0 (applied to FP32 scores), default D ** -0.5.
      strict: also enforce the qualified envelope (``interop.contract.QUALIFIED``), as
        ``qsa_triton.sparse_decode``; always on for a GPU that ``interop.contract.route`` sends to
        the exact contract (sm_121).
      interpret: None -> Pallas interpret mode when jax's default backend is the CPU, the compiled
        Triton kernel on a GPU; True/False forces it.
      plan: optional ``interop.plan.DecodePlan`` overriding the shared plan (tests, sweeps).
      direct: a one-split plan (``max_splits == 1``) runs ``decode_direct`` (the split kernel
        writes the output: one launch, no merge); None -> ``DIRECT_ONE_SPLIT``
        (env ``QSA_PALLAS_DIRECT``, off by default).

    Returns:
      [B, Hq, D] in q's dtype; ``out[s, h] = softmax(scale * q[cu_q[s], h] . K^T) . V`` over the
      row's keys of KV head ``h // G``; exact zeros for a row with no keys.

    Raises:
      ContractError: from ``interop.contract.check_decode`` (same message as the torch path),
        before anything is traced or launched.

    Works under ``jax.jit`` (``max_seqlen_k`` static, lengths traced), ``lax.scan`` and
    ``shard_map`` (see ``_compat.shard_map``: the VMA check must be off).
    """
    C.check_inputs("sparse_decode", interpret, q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q,
                   cu_seqlens_k=cu_seqlens_k)
    interp = C.resolve_interpret(interpret)
    # SM121 routes decode to the exact qualified contract only (qsa-contract.md §5), as in
    # qsa_triton; decided from static facts at trace time, so it costs nothing under jit.
    prob = check_decode(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_k, softmax_scale,
                        fn="sparse_decode",
                        strict=strict or (not interp and exact_contract(C.target_facts())))
    C.check_backend("sparse_decode", interpret, q, k, v, cu_seqlens_q, cu_seqlens_k)
    if plan is None:
        plan = decode_plan_for(prob.batch, prob.num_q_heads, prob.num_kv_heads, prob.head_dim,
                               prob.max_seqlen_k)
    elif plan.head_tile < max(16, prob.group) or plan.head_tile & (plan.head_tile - 1):
        raise ContractError("sparse_decode", "plan", "head_tile a power of two >= max(16, G)",
                            plan.head_tile)
    return _decode(q, k, v, cu_seqlens_q, cu_seqlens_k, plan=plan,
                   softmax_scale=float(prob.softmax_scale),
                   interpret=interp,
                   direct=DIRECT_ONE_SPLIT if direct is None else bool(direct))



def lowering_cases(device_kind: str, *, head_dim: int = 256, max_seqlen_k: int = 2051,
                   dtype=jnp.bfloat16) -> list[tuple[str, object, tuple]]:
    """Every distinct decode launch configuration the shared planner picks on ``device_kind`` for
    the qualified rank shapes (TP1 24/2, TP2 12/1, TP4 6/1) and B = 1..128, as
    ``(name, fn, args)`` to lower with ``_compat.lower_for_device_kind`` (``qsa compile`` and the
    lowering tests use this). ``args`` are ``jax.ShapeDtypeStruct``; nothing is allocated.
    """
    sds = jax.ShapeDtypeStruct
    cases, seen = [], set()
    with jax.sharding.use_abstract_mesh(C.abstract_mesh(device_kind)):
        for tp, (hq, hkv) in (("TP1", (24, 2)), ("TP2", (12, 1)), ("TP4", (6, 1))):
            for b in range(1, 129):
                plan = decode_plan_for(b, hq, hkv, head_dim, max_seqlen_k)
                key = (hq, hkv, plan)
                if key in seen:
                    continue
                seen.add(key)
                cap = b * max_seqlen_k
                args = (sds((b, hq, head_dim), dtype), sds((cap, hkv, head_dim), dtype),
                        sds((cap, hkv, head_dim), dtype), sds((b + 1,), jnp.int32),
                        sds((b + 1,), jnp.int32))
                fn = functools.partial(_lowerable, max_seqlen_k=max_seqlen_k, plan=plan)
                cases.append((f"pallas_decode_{tp}_B{b}_ht{plan.head_tile}_bn{plan.block_n}"
                              f"_s{plan.max_splits}_w{plan.num_warps}_st{plan.num_stages}",
                              fn, args))
    return cases


def _lowerable(q, k, v, cq, ck, *, max_seqlen_k, plan):
    return sparse_decode(q, k, v, cq, ck, max_seqlen_k, interpret=False, plan=plan)
