"""Float64 numpy references for QSA decode and the three sparse prefill variants.

Exactly the semantics of ``qsa-contract.md`` §2-3:
  * an index entry is valid iff ``0 <= idx < len`` (len per variant); invalid entries anywhere in a
    row are never dereferenced and never contribute; a position that appears twice counts twice;
  * a row (or decode sequence) with no valid key gives exact zeros;
  * FP8 K/V: ``k_scale`` multiplies the scores, ``v_scale`` the P·V output.

Inputs are numpy arrays of any float dtype (convert bf16/fp8 framework tensors to float32 first;
the FP8 values are then the dequantised-by-cast values the kernels see). All math is float64.
Row r of request b reads only its first ``min(W, visible)`` index columns (``qsa-contract.md`` §3:
a row never selects more entries than it sees, so entries past that are padding by construction):
ordinary ``visible = r + 1``; chunk/paged ``visible = r + kv_lens[b] - q_len_b + 1`` (bottom-right
causal). Both kernels stop exactly there too, so results do not depend on BLOCK_N, and the debug
validator (``contract.validate_prefill_metadata``) flags valid entries past that bound.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "attend",
    "decode_reference",
    "prefill_reference",
    "prefill_chunk_reference",
    "prefill_paged_reference",
    "pool_slots_of",
    "decode_paged_reference",
    "rel_l2",
]


def rel_l2(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64 (0 when both are zero)."""
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    num = np.linalg.norm(out - ref)
    den = np.linalg.norm(ref)
    return float(num / den) if den > 0 else float(num)


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, k_scale: float = 1.0,
           v_scale: float = 1.0) -> np.ndarray:
    """softmax(scale·k_scale·q·kᵀ)·v·v_scale for one KV head.

    Args:
      q: [G, D] query heads sharing the KV head; k, v: [N, D] selected rows (N may be 0).

    Returns:
      [G, D] float64; zeros when N == 0.
    """
    q = np.asarray(q, np.float64)
    if k.shape[0] == 0:
        return np.zeros_like(q)
    s = (q @ np.asarray(k, np.float64).T) * (scale * k_scale)
    s -= s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    return (p @ np.asarray(v, np.float64)) * v_scale


def _scale(softmax_scale, d):
    return float(d) ** -0.5 if softmax_scale is None else float(softmax_scale)


def decode_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=None) -> np.ndarray:
    """Packed varlen decode (``qsa-contract.md`` §2).

    Args:
      q: [B, Hq, D]; k, v: [C, Hkv, D]; cu_seqlens_q, cu_seqlens_k: int [B + 1].
      softmax_scale: float or None for D ** -0.5.

    Returns:
      [B, Hq, D] float64: out[s, h] attends q[cu_seqlens_q[s], h] over k/v rows
      [cu_seqlens_k[s], cu_seqlens_k[s + 1]) of KV head h // G; zeros for empty rows.
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    cq, ck = np.asarray(cu_seqlens_q, np.int64), np.asarray(cu_seqlens_k, np.int64)
    b, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    scale = _scale(softmax_scale, d)
    out = np.zeros((b, hq, d), np.float64)
    for s in range(b):
        lo, hi = ck[s], ck[s + 1]
        for h in range(hkv):
            out[s, h * g:(h + 1) * g] = attend(q[cq[s], h * g:(h + 1) * g], k[lo:hi, h], v[lo:hi, h], scale)
    return out


def _prefill_core(q, indices, cu_seqlens_q, lens, k, v, rows_of, scale, k_scale, v_scale,
                  ordinary=False):
    """Shared loop. ``rows_of(b, positions)`` -> K/V row per position (-1: an invalid entry)."""
    q = np.asarray(q, np.float64)
    k, v = np.asarray(k, np.float64), np.asarray(v, np.float64)
    t, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    idx = np.asarray(indices, np.int64)
    if idx.ndim == 2:
        idx = idx[:, None, :]
    cq = np.asarray(cu_seqlens_q, np.int64)
    out = np.zeros((t, hq, d), np.float64)
    w = idx.shape[-1]
    for b in range(len(cq) - 1):
        q_len = cq[b + 1] - cq[b]
        for row in range(cq[b], cq[b + 1]):
            r = row - cq[b]
            visible = r + 1 if ordinary else r + lens[b] - q_len + 1
            cap = int(min(w, max(visible, 0)))  # the row's first min(W, visible) columns only
            for h in range(hkv):
                sel = idx[row, h if idx.shape[1] > 1 else 0, :cap]
                sel = sel[(sel >= 0) & (sel < lens[b])]
                kv_rows = rows_of(b, sel)
                kv_rows = kv_rows[kv_rows >= 0]
                out[row, h * g:(h + 1) * g] = attend(
                    q[row, h * g:(h + 1) * g], k[kv_rows, h], v[kv_rows, h], scale, k_scale,
                    v_scale)
    return out


def prefill_reference(q, k, v, indices, cu_seqlens, softmax_scale=None) -> np.ndarray:
    """Ordinary sparse prefill: K/V are this forward's rows, packed like q.

    Args:
      q: [T, Hq, D]; k, v: [T, Hkv, D]; indices: int [T, W] or [T, Hkv, W] request-relative;
      cu_seqlens: int [B + 1].

    Returns:
      [T, Hq, D] float64; entry valid iff 0 <= idx < request length; row r reads its first
      min(W, r + 1) columns.
    """
    cu = np.asarray(cu_seqlens, np.int64)
    return _prefill_core(q, indices, cu, np.diff(cu), k, v, lambda b, sel: cu[b] + sel,
                         _scale(softmax_scale, np.shape(q)[2]), 1.0, 1.0, ordinary=True)


def prefill_chunk_reference(q, k, v, indices, cu_seqlens_q, cu_seqlens_k, kv_lens, softmax_scale=None,
                            k_scale=1.0, v_scale=1.0) -> np.ndarray:
    """Chunk sparse prefill: K/V hold each request's full context at rows cu_seqlens_k[b]...

    Args:
      q: [T, Hq, D]; k, v: [Ck, Hkv, D] (float values; FP8 already cast to float);
      indices: int [T, W] or [T, Hkv, W]; cu_seqlens_q, cu_seqlens_k: [B + 1]; kv_lens: [B].

    Returns:
      [T, Hq, D] float64; entry valid iff 0 <= idx < kv_lens[b].
    """
    ck = np.asarray(cu_seqlens_k, np.int64)
    return _prefill_core(q, indices, cu_seqlens_q, np.asarray(kv_lens, np.int64), k, v,
                         lambda b, sel: ck[b] + sel, _scale(softmax_scale, np.shape(q)[2]),
                         k_scale, v_scale)


def pool_slots_of(req_to_token, req_indices, b: int, positions, pool_slots: int) -> np.ndarray:
    """Pool slot of each position of request b, -1 where the entry is invalid.

    The paged addressing rule (SGLang's ``req_to_token``, ``qsa-contract.md`` §2b/§3): request b
    uses row ``req_indices[b]``; a position p maps to ``req_to_token[req_indices[b], p]``. Besides
    the caller's ``0 <= p < kv_lens[b]``, an entry whose row is outside the table, whose
    position is past its width, or whose slot is outside ``[0, pool_slots)`` is invalid (the
    kernels clamp such metadata on the device and never dereference it).
    """
    rt = np.asarray(req_to_token, np.int64)
    pos = np.asarray(positions, np.int64)
    row = int(np.asarray(req_indices)[b])
    if not 0 <= row < rt.shape[0]:
        return np.full(pos.shape, -1, np.int64)
    ok = (pos >= 0) & (pos < rt.shape[1])
    slots = np.where(ok, rt[row, np.where(ok, pos, 0)] if rt.shape[1] else -1, -1)
    return np.where((slots >= 0) & (slots < pool_slots), slots, -1)


def prefill_paged_reference(q, k_cache, v_cache, req_to_token, req_indices, indices, cu_seqlens_q,
                            kv_lens, softmax_scale=None, k_scale=1.0, v_scale=1.0) -> np.ndarray:
    """Paged sparse prefill: K/V read in place from the pool through ``req_to_token``.

    Args:
      q: [T, Hq, D]; k_cache, v_cache: [slots, Hkv, D]; req_to_token: int [max_reqs, max_context];
      req_indices: int [B]; indices: int [T, W] or [T, Hkv, W]; cu_seqlens_q: [B + 1];
      kv_lens: [B].

    Returns:
      [T, Hq, D] float64; entry valid iff 0 <= idx < kv_lens[b] and ``pool_slots_of`` maps it to
      a slot of the pool.
    """
    pool = np.shape(k_cache)[0]
    return _prefill_core(q, indices, cu_seqlens_q, np.asarray(kv_lens, np.int64), k_cache, v_cache,
                         lambda b, sel: pool_slots_of(req_to_token, req_indices, b, sel, pool),
                         _scale(softmax_scale, np.shape(q)[2]), k_scale, v_scale)


def decode_paged_reference(q, k_cache, v_cache, req_to_token, req_indices, indices, seq_lens,
                           softmax_scale=None, k_scale=1.0, v_scale=1.0) -> np.ndarray:
    """Paged decode (``qsa-contract.md`` §2b): ``decode_reference`` on the rows a compaction
    would have packed.

    Entry ``indices[r, (h,) c]`` is valid iff ``0 <= idx < seq_lens[r]``, ``idx < max_context``,
    ``req_indices[r]`` names a table row and the slot ``req_to_token[req, idx]`` lies in the pool
    (``interop.indices.resolve_paged_slots``); the valid entries of each row, in column order and
    duplicates included, are packed per KV head (as upstream's counts -> prefix sum ->
    ``_compact_kv`` would) and attended by the packed reference. ``k_scale`` multiplies the
    scores and ``v_scale`` the output (both folded into the packed rows: exact in float64).

    Args:
      q: [R, Hq, D]; k_cache, v_cache: [slots, Hkv, D] float values (an FP8 pool cast to float);
      req_to_token: int [max_reqs, max_context]; req_indices, seq_lens: int [R];
      indices: int [R, W] or [R, Hkv, W]; softmax_scale: float or None (D ** -0.5).

    Returns:
      [R, Hq, D] float64; exact zeros for a row (and KV head) with no valid entry.
    """
    from .indices import cu_seqlens_from_counts, resolve_paged_slots  # noqa: PLC0415

    q = np.asarray(q, np.float64)
    r, hq, d = q.shape
    k_cache, v_cache = np.asarray(k_cache), np.asarray(v_cache)
    hkv = k_cache.shape[1]
    g = hq // hkv
    slots = resolve_paged_slots(req_to_token, req_indices, indices, seq_lens, k_cache.shape[0])
    if slots.ndim == 2:
        slots = slots[:, None, :]
    out = np.zeros((r, hq, d), np.float64)
    cu_q = np.arange(r + 1)
    for h in range(hkv):
        sl = slots[:, h if slots.shape[1] > 1 else 0]
        cu_k = cu_seqlens_from_counts((sl >= 0).sum(-1))
        picked = sl[sl >= 0]  # row-major: each row's valid entries in column order
        kp = np.asarray(k_cache[picked, h:h + 1], np.float64) * float(k_scale)
        vp = np.asarray(v_cache[picked, h:h + 1], np.float64) * float(v_scale)
        out[:, h * g:(h + 1) * g] = decode_reference(q[:, h * g:(h + 1) * g], kp, vp, cu_q, cu_k,
                                                     _scale(softmax_scale, d))
    return out
