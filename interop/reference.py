"""Float64 numpy references for QSA decode, the sparse prefill variants, the indexer and the step.

Source: ``qsa-contract.md`` §2-4b (and §7). Inputs are numpy arrays of any float dtype (bf16/FP8
framework tensors converted to float32 first: the values the kernels see); all math is float64.
An index entry is valid iff ``0 <= idx < len``; invalid entries are never dereferenced; a position
listed twice counts twice; a row with no valid key gives exact zeros; ``k_scale`` multiplies the
scores and ``v_scale`` the P·V output. Prefill row r of request b reads only its first
``min(W, visible)`` index columns, as both kernels do (results do not depend on BLOCK_N).
"""

from __future__ import annotations

import numpy as np

from .indices import (cu_seqlens_from_counts, expand_block_indices, prefill_step_rows,
                      resolve_paged_slots)

__all__ = [
    "attend", "decode_reference", "prefill_reference", "prefill_chunk_reference",
    "prefill_paged_reference", "pool_slots_of", "decode_paged_reference", "rel_l2",
    "indexer_logits", "indexer_logits_decode", "indexer_topk", "indexer_topk_decode_reference",
    "indexer_topk_prefill_reference", "indexer_select_decode_reference",
    "indexer_select_prefill_reference", "topk_set_report", "decode_step_reference",
    "prefill_step_reference",
]


def rel_l2(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64 (0 when both are zero). Raises nothing of its own;
    source: qsa-contract.md §6 (upstream's relative-L2 acceptance metric)."""
    ref = np.asarray(ref, np.float64)
    num, den = np.linalg.norm(np.asarray(out, np.float64) - ref), np.linalg.norm(ref)
    return float(num / den) if den > 0 else float(num)


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, k_scale: float = 1.0,
           v_scale: float = 1.0) -> np.ndarray:
    """softmax(scale·k_scale·q·kᵀ)·v·v_scale for one KV head: q [G, D] (the query heads sharing
    it), k, v [N, D] (N may be 0) -> float64 [G, D], zeros when N == 0. Raises nothing of its
    own; source: qsa-contract.md §2 (softmax attention), §2b (k_scale, v_scale)."""
    q = np.asarray(q, np.float64)
    if k.shape[0] == 0:
        return np.zeros_like(q)
    s = (q @ np.asarray(k, np.float64).T) * (scale * k_scale)
    s -= s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    return (p @ np.asarray(v, np.float64)) * v_scale


def _scale(softmax_scale, d):
    """softmax_scale, or D ** -0.5 when None."""
    return float(d) ** -0.5 if softmax_scale is None else float(softmax_scale)


def decode_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=None) -> np.ndarray:
    """Packed varlen decode (§2): q [B, Hq, D], k, v [C, Hkv, D], cu_seqlens_q / _k int [B + 1],
    softmax_scale float or None (D ** -0.5). Returns float64 [B, Hq, D]: out[s, h] attends
    q[cu_seqlens_q[s], h] over k/v rows [cu_seqlens_k[s], cu_seqlens_k[s + 1]) of KV head h // G.
    Raises nothing of its own; source: qsa-contract.md §2, §7 (lying metadata)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    cq, ck = np.asarray(cu_seqlens_q, np.int64), np.asarray(cu_seqlens_k, np.int64)
    b, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    scale = _scale(softmax_scale, d)
    out = np.zeros((b, hq, d), np.float64)
    c = k.shape[0]
    for s in range(b):
        # metadata that lies (§7): q row clamped into [0, B), both key ends into [0, C], a
        # decreasing range is empty -- the kernels' rule
        row = min(max(int(cq[s]), 0), b - 1)
        lo, hi = (min(max(int(x), 0), c) for x in (ck[s], ck[s + 1]))
        hi = max(lo, hi)
        for h in range(hkv):
            out[s, h * g:(h + 1) * g] = attend(q[row, h * g:(h + 1) * g], k[lo:hi, h],
                                               v[lo:hi, h], scale)
    return out


def _prefill_core(q, indices, cu_seqlens_q, lens, k, v, rows_of, softmax_scale, k_scale, v_scale,
                  ordinary=False, clamp_rows=False):
    """The prefill loop; ``rows_of(b, positions)`` -> K/V row per position (-1: invalid).
    Metadata that lies (§7), the kernels' rule: only a request's rows inside ``[0, T)`` are
    computed (the others stay 0); ``clamp_rows`` (ordinary, chunk) clamps K/V rows into k."""
    q = np.asarray(q, np.float64)
    k, v = np.asarray(k, np.float64), np.asarray(v, np.float64)
    t, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    scale = _scale(softmax_scale, d)
    idx = np.asarray(indices, np.int64)
    if idx.ndim == 2:
        idx = idx[:, None, :]
    cq = np.asarray(cu_seqlens_q, np.int64)
    out = np.zeros((t, hq, d), np.float64)
    w = idx.shape[-1]
    for b in range(len(cq) - 1):
        q_len = cq[b + 1] - cq[b]
        for row in range(max(int(cq[b]), 0), min(int(cq[b + 1]), t)):
            r = row - cq[b]
            visible = r + 1 if ordinary else r + lens[b] - q_len + 1
            cap = int(min(w, max(visible, 0)))  # the row's first min(W, visible) columns only
            for h in range(hkv):
                sel = idx[row, h if idx.shape[1] > 1 else 0, :cap]
                sel = sel[(sel >= 0) & (sel < lens[b])]
                kv_rows = rows_of(b, sel)
                if clamp_rows:
                    kv_rows = np.clip(kv_rows, 0, k.shape[0] - 1)
                kv_rows = kv_rows[kv_rows >= 0]
                out[row, h * g:(h + 1) * g] = attend(
                    q[row, h * g:(h + 1) * g], k[kv_rows, h], v[kv_rows, h], scale, k_scale,
                    v_scale)
    return out


def prefill_reference(q, k, v, indices, cu_seqlens, softmax_scale=None) -> np.ndarray:
    """Ordinary sparse prefill (§3), K/V packed like q: q [T, Hq, D], k, v [T, Hkv, D], indices
    int [T, W] or [T, Hkv, W] request-relative (valid iff < the request length), cu_seqlens int
    [B + 1]. Returns float64 [T, Hq, D]. Raises nothing of its own;
    source: qsa-contract.md §3, §7."""
    cu = np.asarray(cu_seqlens, np.int64)
    return _prefill_core(q, indices, cu, np.diff(cu), k, v, lambda b, sel: cu[b] + sel,
                         softmax_scale, 1.0, 1.0, ordinary=True, clamp_rows=True)


def prefill_chunk_reference(q, k, v, indices, cu_seqlens_q, cu_seqlens_k, kv_lens,
                            softmax_scale=None, k_scale=1.0, v_scale=1.0) -> np.ndarray:
    """Chunk sparse prefill (§3), request b's context at k/v rows cu_seqlens_k[b]..: q [T, Hq, D],
    k, v [Ck, Hkv, D], indices int [T, W] or [T, Hkv, W] (valid iff < kv_lens[b]), cu_seqlens_q,
    cu_seqlens_k int [B + 1], kv_lens int [B]. Returns float64 [T, Hq, D]; lying metadata as the
    kernels (§7: rows inside [0, T) only, K/V rows clamped into k). Raises nothing of its own;
    source: qsa-contract.md §3, §7."""
    ck = np.asarray(cu_seqlens_k, np.int64)
    return _prefill_core(q, indices, cu_seqlens_q, np.asarray(kv_lens, np.int64), k, v,
                         lambda b, sel: ck[b] + sel, softmax_scale, k_scale, v_scale,
                         clamp_rows=True)


def pool_slots_of(req_to_token, req_indices, b: int, positions, pool_slots: int) -> np.ndarray:
    """int64 pool slot ``req_to_token[req_indices[b], p]`` of each position p of request b, -1
    where the row is outside the table, p outside its width or the slot outside
    ``[0, pool_slots)`` (the paged addressing rule, §2b/§7; the caller checks p < kv_lens[b]).
    Raises nothing of its own; source: qsa-contract.md §2b, §7."""
    pos = np.asarray(positions, np.int64)
    return resolve_paged_slots(req_to_token, np.asarray(req_indices)[[b]], pos.reshape(1, -1),
                               [np.iinfo(np.int64).max], pool_slots).reshape(pos.shape)


def prefill_paged_reference(q, k_cache, v_cache, req_to_token, req_indices, indices, cu_seqlens_q,
                            kv_lens, softmax_scale=None, k_scale=1.0, v_scale=1.0) -> np.ndarray:
    """Paged sparse prefill (§3, §7), K/V read from the pool: q [T, Hq, D], k_cache, v_cache
    [slots, Hkv, D], req_to_token int [max_reqs, max_context], req_indices int [B], indices int
    [T, W] or [T, Hkv, W] (valid iff < kv_lens[b] and ``pool_slots_of`` maps it into the pool),
    cu_seqlens_q int [B + 1], kv_lens int [B]. Returns float64 [T, Hq, D]. Raises nothing of its
    own; source: qsa-contract.md §3 (paged), §7."""
    pool = np.shape(k_cache)[0]
    return _prefill_core(q, indices, cu_seqlens_q, np.asarray(kv_lens, np.int64), k_cache, v_cache,
                         lambda b, sel: pool_slots_of(req_to_token, req_indices, b, sel, pool),
                         softmax_scale, k_scale, v_scale)


def decode_paged_reference(q, k_cache, v_cache, req_to_token, req_indices, indices, seq_lens,
                           softmax_scale=None, k_scale=1.0, v_scale=1.0) -> np.ndarray:
    """Paged decode (§2b): ``decode_reference`` on the rows a compaction (upstream's counts ->
    prefix sum -> ``_compact_kv``) would have packed per KV head, valid entries in column order,
    duplicates included; validity is ``interop.indices.resolve_paged_slots``'s. q [R, Hq, D],
    k_cache, v_cache [slots, Hkv, D], req_to_token int [max_reqs, max_context], req_indices,
    seq_lens int [R], indices int [R, W] or [R, Hkv, W]. Returns float64 [R, Hq, D]. Raises
    nothing of its own; source: qsa-contract.md §2b, §7; upstream ``_compact_kv`` in
    ``sglang/srt/layers/attention/qsa/sparse_attn.py``."""
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
# The indexer (§4b). Source: upstream sglang 0.5.23 ``srt/layers/attention/qsa/mqa.py``
# (scoring, column ranges), ``kernel.py`` (top-k layout, expansion), ``qsa_indexer.py`` /
# ``metadata.py`` (compressed lengths). Selection order and tie rule are ours (``indexer_topk``).
def _score_scale(score_scale, d):
    """score_scale, or sqrt(D) (upstream's) when None."""
    return float(np.sqrt(d)) if score_scale is None else float(score_scale)


def indexer_logits(q, k, row_starts, row_ends, score_scale=None) -> np.ndarray:
    """Prefill scoring over packed compressed keys: float64 [M, max(1, max(end - start))] with
    ``out[m, j] = sum_h ReLU(q[m, h] . k[row_starts[m] + j]) / score_scale`` on the key rows
    ``[row_starts[m], row_ends[m]) ∩ [0, N)``, -inf elsewhere (a negative start shifts the first
    column to ``-start``). q [M, H, D]; k [N, 1, D] or [N, D]; row_starts, row_ends int [M]
    (absolute, half-open); score_scale float > 0 or None (sqrt(D)). Raises nothing of its own;
    source: qsa-contract.md §4b, upstream ``sglang/srt/layers/attention/qsa/mqa.py``."""
    q = np.asarray(q, np.float64)
    k = np.asarray(k, np.float64)
    k = k.reshape(k.shape[0], int(np.prod(k.shape[1:])))  # (-1 is ambiguous with no keys)
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
    """Paged decode scoring of row b's ``floor(seq_lens[b] / ratio)`` blocks, block n at
    ``k_cache[page_table[b, n // P], n % P, 0]`` (entries past the row's blocks never read).
    q [B, H, D]; k_cache [pages, P, 1, D]; page_table int [B, max_pages]; seq_lens int [B]
    (negative = 0). Returns float64 [B, max_pages * P], -inf past each row's blocks. Lying
    metadata follows the contract's rule (§4b), as the kernels do: a row's blocks end at the page
    table's capacity, and a visible block whose page id lies outside the cache reads nothing
    (score 0). Source: qsa-contract.md §4b, upstream
    ``sglang/srt/layers/attention/qsa/mqa.py``."""
    q = np.asarray(q, np.float64)
    kc = np.asarray(k_cache, np.float64)
    pages, psz = kc.shape[0], kc.shape[1]
    kc = kc.reshape(pages * psz, -1)
    pt = np.asarray(page_table, np.int64)
    nb = np.maximum(np.asarray(seq_lens, np.int64).reshape(-1), 0) // compress_ratio
    cap = pt.shape[1] * psz
    out = np.full((q.shape[0], max(cap, 1)), -np.inf)
    scale = _score_scale(score_scale, q.shape[-1])
    nb = np.minimum(nb, cap)
    for b in range(q.shape[0]):
        blk = np.arange(nb[b])
        pid = pt[b, blk // psz]
        ok = (pid >= 0) & (pid < pages)
        keys = np.where(ok[:, None], kc[np.where(ok, pid * psz + blk % psz, 0)], 0.0)
        out[b, :nb[b]] = np.maximum(q[b] @ keys.T, 0.0).sum(0) / scale
    return out


def indexer_topk(logits, topk: int = 512) -> np.ndarray:
    """Exact top-k over row-relative logits float [M, W] (-inf: not visible; +inf is a score, the
    largest): int32 [M, topk], ids ascending then -1 (§7). A row with <= topk visible columns
    takes them all, else the topk largest under (logit descending, column ascending): ties go to
    the smaller block id. Raises ValueError: NaN in logits, topk < 1. Source: qsa-contract.md
    §4b (tie rule), §7 (ascending ids)."""
    x = np.asarray(logits, np.float64)
    if topk < 1:
        raise ValueError(f"topk must be >= 1, got {topk}")
    if np.isnan(x).any():
        raise ValueError("logits contain NaN")
    out = np.full((x.shape[0], topk), -1, np.int32)
    for m in range(x.shape[0]):
        vis = np.nonzero(x[m] > -np.inf)[0]
        if vis.size > topk:
            # lexsort: last key is primary -> value descending, then id ascending
            order = np.lexsort((vis, -x[m, vis]))
            vis = np.sort(vis[order[:topk]])
        out[m, :vis.size] = vis
    return out


def indexer_topk_decode_reference(q, k_cache, page_table, seq_lens, *, topk: int = 512,
                                  compress_ratio: int = 4) -> np.ndarray:
    """``indexer_topk(indexer_logits_decode(...))``: int32 [B, topk] block ids, ascending.
    Raises ValueError as those two do; source: qsa-contract.md §4b."""
    return indexer_topk(indexer_logits_decode(q, k_cache, page_table, seq_lens,
                                              compress_ratio=compress_ratio), topk)


def indexer_topk_prefill_reference(q, k, row_starts, row_ends, *, topk: int = 512) -> np.ndarray:
    """``indexer_topk(indexer_logits(...))``: int32 [M, topk] row-relative block ids, ascending.
    Raises ValueError as ``indexer_topk`` (NaN, topk < 1); source: qsa-contract.md §4b."""
    return indexer_topk(indexer_logits(q, k, row_starts, row_ends), topk)


def indexer_select_decode_reference(q, k_cache, page_table, seq_lens, *, topk: int = 512,
                                    compress_ratio: int = 4) -> np.ndarray:
    """Decode indexer + ``expand_block_indices`` at position seq_lens[b] - 1, bound seq_lens[b]:
    int32 [B, topk * ratio + ratio - 1] token positions. Raises ValueError as
    ``indexer_topk_decode_reference`` and ``expand_block_indices``;
    source: qsa-contract.md §4, §4b."""
    blocks = indexer_topk_decode_reference(q, k_cache, page_table, seq_lens, topk=topk,
                                           compress_ratio=compress_ratio)
    sl = np.asarray(seq_lens, np.int64).reshape(-1)
    return expand_block_indices(blocks, sl - 1, sl, ratio=compress_ratio,
                                token_topk=topk * compress_ratio)


def indexer_select_prefill_reference(q, k, row_starts, row_ends, positions, seq_lens, *,
                                     topk: int = 512, compress_ratio: int = 4) -> np.ndarray:
    """Prefill indexer + ``expand_block_indices``: int32 [M, topk * ratio + ratio - 1] token
    positions; positions, seq_lens int [M]: each row's p and bound; the rest as
    ``indexer_logits``. Raises ValueError as ``indexer_topk`` and ``expand_block_indices``
    (positions, seq_lens not one per row); source: qsa-contract.md §4, §4b."""
    blocks = indexer_topk_prefill_reference(q, k, row_starts, row_ends, topk=topk)
    return expand_block_indices(blocks, positions, seq_lens, ratio=compress_ratio,
                                token_topk=topk * compress_ratio)


def topk_set_report(selected, logits, topk: int, *, tol: float = 0.0) -> dict:
    """Judge a kernel's selection (int [M, topk]) against reference logits (float [M, W]).

    Kernels score in FP32, the reference in FP64, so logits within FP32 rounding may rank
    differently. A row is ``exact`` when it equals ``indexer_topk(logits, topk)`` (required for
    integer-valued inputs, whose FP32 logits are exact) and ``admissible`` when it is a top-k up
    to ``tol`` (logit units): min(topk, visible) distinct visible ids, ascending, -1 after, and
    min(selected) >= max(unselected visible) - tol. Returns {rows, exact, admissible (counts),
    bad_rows (<= 20 non-admissible rows), max_violation (max(unselected) - min(selected), -inf
    when none)}. Raises ValueError as ``indexer_topk`` (NaN, topk < 1); source: our own."""
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
        vis = x[m] > -np.inf
        nvis = int(vis.sum())
        want = min(topk, nvis)
        ids = row[:want]
        ok = (ids.size == want and (row[want:] == -1).all() and (ids >= 0).all()
              and (ids < x.shape[1]).all() and (np.diff(ids) > 0).all())
        ok = ok and bool(vis[ids].all())
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
    """One decode step: ``indexer_select_decode_reference`` (index_q [R, H, Di], index_k_cache
    [pages, P, 1, Di], index_page_table int [R, max_pages]) then ``decode_paged_reference`` on
    the rest (as there). Returns float64 [R, Hq, D]. Raises ValueError as
    ``indexer_select_decode_reference``; source: qsa-contract.md §4b, §2b."""
    idx = indexer_select_decode_reference(index_q, index_k_cache, index_page_table, seq_lens,
                                          topk=topk, compress_ratio=compress_ratio)
    return decode_paged_reference(q, k_cache, v_cache, req_to_token, req_indices, idx, seq_lens,
                                  softmax_scale, k_scale, v_scale)


def prefill_step_reference(q, k_cache, v_cache, req_to_token, req_indices, index_q, index_k,
                           index_cu_seqlens_k, cu_seqlens_q, kv_lens, softmax_scale=None,
                           k_scale=1.0, v_scale=1.0, *, topk: int = 512,
                           compress_ratio: int = 4) -> np.ndarray:
    """One prefill step: row ranges from ``interop.indices.prefill_step_rows``,
    ``indexer_select_prefill_reference`` over index_q [T, H, Di] and index_k [N, 1, Di] (request
    b's at rows index_cu_seqlens_k[b]..), then ``prefill_paged_reference`` on the rest (as
    there). Returns float64 [T, Hq, D]. Raises ValueError as ``indexer_select_prefill_reference``;
    source: qsa-contract.md §3, §4b, §7."""
    rs, re, pos, sl = prefill_step_rows(cu_seqlens_q, kv_lens, index_cu_seqlens_k,
                                        np.shape(q)[0], ratio=compress_ratio)
    idx = indexer_select_prefill_reference(index_q, index_k, rs, re, pos, sl, topk=topk,
                                           compress_ratio=compress_ratio)
    return prefill_paged_reference(q, k_cache, v_cache, req_to_token, req_indices, idx,
                                   cu_seqlens_q, kv_lens, softmax_scale, k_scale, v_scale)
