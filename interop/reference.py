"""Float64 numpy references for QSA decode, the three sparse prefill variants and the indexer.

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
    "indexer_logits",
    "indexer_logits_decode",
    "indexer_topk",
    "indexer_topk_decode_reference",
    "indexer_topk_prefill_reference",
    "indexer_select_decode_reference",
    "indexer_select_prefill_reference",
    "topk_set_report",
    "decode_step_reference",
    "prefill_step_reference",
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

# --------------------------------------------------------------------------------------------
# The indexer (qsa-contract.md §4b): block scoring, exact top-k, expansion.
#
# Source: upstream sglang 0.5.23 ``srt/layers/attention/qsa/mqa.py`` (the weight-free scoring
# ``logits[m, n] = sum_h ReLU(q[m, h] . k[n]) / score_scale``, paged decode and packed prefill
# column ranges), ``kernel.py`` (top-k output layout, expansion) and ``qsa_indexer.py`` /
# ``metadata.py`` (decode compressed length = floor(seq_len / ratio) blocks; prefill row at
# position p sees floor((p + 1) / ratio) blocks). Selection order and tie rule are ours (below).
def _score_scale(score_scale, d):
    return float(np.sqrt(d)) if score_scale is None else float(score_scale)


def indexer_logits(q, k, row_starts, row_ends, score_scale=None) -> np.ndarray:
    """Prefill scoring over packed compressed keys, in request-relative columns.

    ``out[m, j] = sum_h ReLU(q[m, h] . k[row_starts[m] + j]) / score_scale`` for the row's visible
    columns, -inf elsewhere. A row's visible key rows are ``[row_starts[m], row_ends[m])``
    intersected with ``[0, N)`` (rows of ``k`` that exist); column j names key row
    ``row_starts[m] + j``, so the columns of a row whose start is negative begin at ``-start``.

    Args:
      q: [M, H, D] float (bf16/fp16/fp8 values converted to float first).
      k: [N, 1, D] or [N, D] float: the packed compressed keys of the batch.
      row_starts, row_ends: int [M], absolute key rows, half-open.
      score_scale: float > 0, default sqrt(D) (upstream's).

    Returns:
      float64 [M, W] with W = max(1, max visible end - start over rows): -inf outside each row's
      visible columns.
    """
    q = np.asarray(q, np.float64)
    k = np.asarray(k, np.float64).reshape(np.shape(k)[0], -1)
    n = k.shape[0]
    rs = np.asarray(row_starts, np.int64).reshape(-1)
    re = np.asarray(row_ends, np.int64).reshape(-1)
    lo, hi = np.clip(rs, 0, n), np.clip(re, 0, n)
    width = int(max(1, (hi - rs).max() if rs.size else 1))
    out = np.full((q.shape[0], width), -np.inf)
    scale = _score_scale(score_scale, q.shape[-1])
    for m in range(q.shape[0]):
        if hi[m] <= lo[m]:
            continue
        s = np.maximum(q[m] @ k[lo[m]:hi[m]].T, 0.0).sum(0) / scale  # [cols]
        out[m, lo[m] - rs[m]: hi[m] - rs[m]] = s
    return out


def indexer_logits_decode(q, k_cache, page_table, seq_lens, *, compress_ratio: int = 4,
                          score_scale=None) -> np.ndarray:
    """Paged decode scoring: row b scores its ``floor(seq_lens[b] / ratio)`` compressed blocks.

    Block n of row b lives at ``k_cache[page_table[b, n // P], n % P, 0]`` (P = page size).
    Page-table entries past the row's blocks are never read (they may hold anything).

    Args:
      q: [B, H, D] float; k_cache: [pages, P, 1, D] float; page_table: int [B, max_pages];
      seq_lens: int [B] token counts (negative counts as 0).

    Returns:
      float64 [B, max_pages * P]: the row's logits in block order, -inf past its blocks.

    Raises:
      ValueError: a row with more blocks than its page table holds, or a page id of a visible
        block outside ``[0, pages)``.
    """
    q = np.asarray(q, np.float64)
    kc = np.asarray(k_cache, np.float64)
    pages, psz = kc.shape[0], kc.shape[1]
    kc = kc.reshape(pages * psz, -1)
    pt = np.asarray(page_table, np.int64)
    nb = np.maximum(np.asarray(seq_lens, np.int64).reshape(-1), 0) // compress_ratio
    cap = pt.shape[1] * psz
    out = np.full((q.shape[0], max(cap, 1)), -np.inf)
    scale = _score_scale(score_scale, q.shape[-1])
    for b in range(q.shape[0]):
        if nb[b] > cap:
            raise ValueError(f"row {b}: {nb[b]} blocks > page table capacity {cap}")
        blk = np.arange(nb[b])
        pid = pt[b, blk // psz]
        if pid.size and (pid.min() < 0 or pid.max() >= pages):
            raise ValueError(f"row {b}: page id outside [0, {pages}) for a visible block")
        rows = pid * psz + blk % psz
        out[b, :nb[b]] = np.maximum(q[b] @ kc[rows].T, 0.0).sum(0) / scale
    return out


def indexer_topk(logits, topk: int = 512) -> np.ndarray:
    """Exact top-k block selection over row-relative logits (finite = visible, -inf = not).

    A row with at most ``topk`` visible columns takes all of them. Otherwise it takes the
    ``topk`` columns that are largest under the order (logit descending, column ascending): ties
    go to the smaller block id, so the set is a function of the logits alone (deterministic).
    The ids are returned **in ascending order** (valid first, -1 after): the order the expansion
    keeps, so expanded token rows come out ascending as well (a sorted gather order for the
    attention kernels) and comparing two selections is comparing two arrays.

    Args:
      logits: float [M, W] (-inf for columns the row cannot see; NaN not allowed).
      topk: k >= 1.

    Returns:
      int32 [M, topk].

    Raises:
      ValueError: NaN in logits, topk < 1.
    """
    x = np.asarray(logits, np.float64)
    if topk < 1:
        raise ValueError(f"topk must be >= 1, got {topk}")
    if np.isnan(x).any():
        raise ValueError("logits contain NaN")
    out = np.full((x.shape[0], topk), -1, np.int32)
    for m in range(x.shape[0]):
        vis = np.nonzero(np.isfinite(x[m]))[0]
        if vis.size > topk:
            # lexsort: last key is primary -> value descending, then id ascending
            order = np.lexsort((vis, -x[m, vis]))
            vis = np.sort(vis[order[:topk]])
        out[m, :vis.size] = vis
    return out


def indexer_topk_decode_reference(q, k_cache, page_table, seq_lens, *, topk: int = 512,
                                  compress_ratio: int = 4) -> np.ndarray:
    """``indexer_topk(indexer_logits_decode(...))``: int32 [B, topk] block ids, ascending."""
    return indexer_topk(indexer_logits_decode(q, k_cache, page_table, seq_lens,
                                              compress_ratio=compress_ratio), topk)


def indexer_topk_prefill_reference(q, k, row_starts, row_ends, *, topk: int = 512) -> np.ndarray:
    """``indexer_topk(indexer_logits(...))``: int32 [M, topk] row-relative block ids, ascending."""
    return indexer_topk(indexer_logits(q, k, row_starts, row_ends), topk)


def indexer_select_decode_reference(q, k_cache, page_table, seq_lens, *, topk: int = 512,
                                    compress_ratio: int = 4) -> np.ndarray:
    """Decode indexer + expansion: int32 [B, topk * ratio + ratio - 1] token positions.

    The row's position is ``seq_lens[b] - 1`` (the decode token), its validity bound
    ``seq_lens[b]``; expansion is ``interop.indices.expand_block_indices``.
    """
    from .indices import expand_block_indices  # noqa: PLC0415 - indices imports nothing of ours

    blocks = indexer_topk_decode_reference(q, k_cache, page_table, seq_lens, topk=topk,
                                           compress_ratio=compress_ratio)
    sl = np.asarray(seq_lens, np.int64).reshape(-1)
    return expand_block_indices(blocks, sl - 1, sl, ratio=compress_ratio,
                                token_topk=topk * compress_ratio)


def indexer_select_prefill_reference(q, k, row_starts, row_ends, positions, seq_lens, *,
                                     topk: int = 512, compress_ratio: int = 4) -> np.ndarray:
    """Prefill indexer + expansion: int32 [M, topk * ratio + ratio - 1] token positions.

    Args:
      positions, seq_lens: int [M], each row's position p and validity bound (its request's
        length); the other arguments as ``indexer_logits``.
    """
    from .indices import expand_block_indices  # noqa: PLC0415

    blocks = indexer_topk_prefill_reference(q, k, row_starts, row_ends, topk=topk)
    return expand_block_indices(blocks, positions, seq_lens, ratio=compress_ratio,
                                token_topk=topk * compress_ratio)


def topk_set_report(selected, logits, topk: int, *, tol: float = 0.0) -> dict:
    """Compare a kernel's selection with the reference, row by row.

    Rule (documented in ``qsa-contract.md`` §4b terms): the kernels score in FP32 (bf16/fp16/fp8
    products, FP32 sums in an unspecified order), the reference in FP64, so the two can rank two
    blocks whose logits differ by FP32 rounding differently. Hence two verdicts per row:
      * ``exact``: the selected set equals ``indexer_topk(logits, topk)`` (the tie rule included).
        Required whenever the FP32 logits are exact (integer-valued q and k of small magnitude:
        every product and partial sum is an integer below 2**24), which is how the tests build
        their adversarial cases (many equal logits, all-zero rows, ...).
      * ``admissible``: the selection is a valid top-k of the reference logits up to ``tol``:
        right size (``min(topk, visible)``), distinct visible ids, ascending then -1 padded, and
        ``min(selected logits) >= max(unselected visible logits) - tol``. Used for random real
        inputs, with ``tol`` a bound on the FP32 scoring error.

    Args:
      selected: int [M, topk] kernel output (row-relative ids). logits: float [M, W] reference.
      tol: >= 0, logit units.

    Returns:
      dict(rows, exact (rows equal to the reference), admissible (rows within tol),
      bad_rows (list of row numbers not admissible, at most 20), max_violation (largest
      max(unselected) - min(selected) over rows, -inf if none)).
    """
    sel = np.asarray(selected, np.int64)
    x = np.asarray(logits, np.float64)
    ref = indexer_topk(x, topk)
    exact = adm = 0
    bad: list[int] = []
    worst = -np.inf
    for m in range(sel.shape[0]):
        row = sel[m]
        if np.array_equal(row, ref[m]):
            exact += 1
            adm += 1
            continue
        vis = np.isfinite(x[m])
        nvis = int(vis.sum())
        want = min(topk, nvis)
        ids = row[:want]
        ok = (ids.size == want and (row[want:] == -1).all() and (ids >= 0).all()
              and (ids < x.shape[1]).all() and (np.diff(ids) > 0).all())
        if ok:
            ok = bool(vis[ids].all())
        if ok and want < nvis:
            mask = vis.copy()
            mask[ids] = False
            gap = float(x[m, mask].max() - x[m, ids].min())
            worst = max(worst, gap)
            ok = gap <= tol
        if ok:
            adm += 1
        elif len(bad) < 20:
            bad.append(m)
    return {"rows": int(sel.shape[0]), "exact": exact, "admissible": adm, "bad_rows": bad,
            "max_violation": worst}


# --------------------------------------------------------------------------------------------
# The end-to-end QSA step: indexer -> expansion -> paged attention (``qsa_*.step``).
def decode_step_reference(q, k_cache, v_cache, req_to_token, req_indices, index_q, index_k_cache,
                          index_page_table, seq_lens, softmax_scale=None, k_scale=1.0,
                          v_scale=1.0, *, topk: int = 512, compress_ratio: int = 4) -> np.ndarray:
    """One decode step: ``indexer_select_decode_reference`` (scoring, exact top-k, expansion)
    gives each row's token positions, ``decode_paged_reference`` attends to them in the pool.

    Args:
      q: [R, Hq, D]; k_cache, v_cache: [slots, Hkv, D]; req_to_token: [max_reqs, max_context];
      req_indices, seq_lens: [R]; index_q: [R, H, Di]; index_k_cache: [pages, P, 1, Di];
      index_page_table: [R, max_pages]; the rest as ``decode_paged_reference``.

    Returns:
      [R, Hq, D] float64.
    """
    idx = indexer_select_decode_reference(index_q, index_k_cache, index_page_table, seq_lens,
                                          topk=topk, compress_ratio=compress_ratio)
    return decode_paged_reference(q, k_cache, v_cache, req_to_token, req_indices, idx, seq_lens,
                                  softmax_scale, k_scale, v_scale)


def prefill_step_reference(q, k_cache, v_cache, req_to_token, req_indices, index_q, index_k,
                           index_cu_seqlens_k, cu_seqlens_q, kv_lens, softmax_scale=None,
                           k_scale=1.0, v_scale=1.0, *, topk: int = 512,
                           compress_ratio: int = 4) -> np.ndarray:
    """One prefill step: per-row ranges, positions and bounds from the request tables
    (``interop.indices.prefill_step_rows``), ``indexer_select_prefill_reference`` over the packed
    compressed keys, then ``prefill_paged_reference`` from the pool.

    Args:
      q: [T, Hq, D]; k_cache, v_cache: [slots, Hkv, D]; req_to_token, req_indices: as
      ``prefill_paged_reference``; index_q: [T, H, Di]; index_k: [N, 1, Di] packed per request
      (request b's rows ``index_cu_seqlens_k[b] ..``); cu_seqlens_q: [B + 1]; kv_lens: [B].

    Returns:
      [T, Hq, D] float64.
    """
    from .indices import prefill_step_rows  # noqa: PLC0415

    rs, re, pos, sl = prefill_step_rows(cu_seqlens_q, kv_lens, index_cu_seqlens_k,
                                        np.shape(q)[0], ratio=compress_ratio)
    idx = indexer_select_prefill_reference(index_q, index_k, rs, re, pos, sl, topk=topk,
                                           compress_ratio=compress_ratio)
    return prefill_paged_reference(q, k_cache, v_cache, req_to_token, req_indices, idx,
                                   cu_seqlens_q, kv_lens, softmax_scale, k_scale, v_scale)
