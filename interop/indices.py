"""Index helpers (``qsa-contract.md`` §3-4b, the source of every rule here): block expansion,
valid counts / ``cu_seqlens_k``, compaction, the indexer's launch plan and metadata, and seeded
realistic index generators for tests and benchmarks (numpy only, vectorised over rows).

Terms: ``ratio`` (4) tokens per indexer block, ``block_topk`` (512) blocks per row,
``token_topk`` (2048) columns kept after expansion, width = token_topk + ratio - 1 = 2051. Row r
of a request sees visible = r + kv_len - q_len + 1 tokens (ordinary prefill: kv_len = q_len); an
entry is valid iff 0 <= idx < len (the request length, or kv_lens[b] for chunk/paged)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal, Sequence

import numpy as np

__all__ = [
    "RATIO", "BLOCK_TOPK", "TOKEN_TOPK", "WIDTH", "JUNK_MODES", "DECODE_PATTERNS",
    "expected_valid_count", "expand_block_indices", "valid_first", "valid_mask",
    "valid_counts", "cu_seqlens_from_counts", "compact_kv", "row_layout", "select_blocks",
    "neighbour_jaccard", "calibrate_overlap", "expand_prefill_blocks", "prefill_block_indices",
    "tile_slots", "tile_union", "REPEATED_TILE", "prefill_indices", "PrefillLayout",
    "prefill_layout",
    "decode_lengths", "DecodeCase", "decode_case", "PAGED_JUNK", "PAGED_JUNK_AT",
    "resolve_paged_slots", "PagedDecodeCase", "paged_decode_case", "INDEXER_API",
    "IndexerPlan", "plan_indexer", "prefill_row_ranges", "prefill_step_rows",
    "IndexerDecodeCase", "indexer_decode_case", "BOUND_MARGIN_ULPS", "prefill_step_rows_xp",
]

RATIO = 4
BLOCK_TOPK = 512
TOKEN_TOPK = 2048
WIDTH = TOKEN_TOPK + RATIO - 1  # 2051

JUNK_MODES = ("-1", "-7", "len", "len+19", "mixed")
DECODE_PATTERNS = ("short", "medium", "saturated", "mixed")
_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1


def _geometry(width: int, ratio: int) -> tuple[int, int]:
    """(token_topk, block_topk) for an index width (2051 -> (2048, 512))."""
    if ratio < 1 or width < ratio:
        raise ValueError(f"index width must be >= ratio={ratio}, got width={width}")
    token_topk = width - ratio + 1
    return token_topk, -(-token_topk // ratio)


def expected_valid_count(visible, *, width: int = WIDTH, ratio: int = RATIO) -> np.ndarray:
    """Valid entries of an expanded row whose indexer picked every complete block it may:
    ``ratio * min(floor(L / ratio), block_topk)`` (at most token_topk) ``+ L mod ratio`` for
    L = ``visible`` tokens (int array-like, >= 0). Returns int64 of its shape; raises ValueError
    when width < ratio or ratio < 1. Source: qsa-contract.md §4 (valid count)."""
    token_topk, block_topk = _geometry(width, ratio)
    L = np.asarray(visible, np.int64)
    return np.minimum(ratio * np.minimum(L // ratio, block_topk), token_topk) + L % ratio


def valid_first(indices: np.ndarray, lens) -> np.ndarray:
    """Stably move the valid entries (0 <= idx < len) of every row of int [..., W] to the front
    (``lens`` broadcastable to ``indices.shape[:-1]``); same shape and dtype, no sort. Raises
    nothing of its own; source: qsa-contract.md §4 (valid entries stably first)."""
    idx = np.asarray(indices)
    valid = valid_mask(idx, lens)
    # destination column: valid -> (#valid before it); invalid -> n_valid + (#invalid before it)
    before = np.cumsum(valid, -1, dtype=np.int32)
    n_valid = before[..., -1:]
    col = np.arange(idx.shape[-1], dtype=np.int32)
    pos = np.where(valid, before - 1, n_valid + col - before)
    out = np.empty_like(idx)
    np.put_along_axis(out, pos, idx, axis=-1)
    return out


def expand_block_indices(block_ids, positions, seq_lens, *, ratio: int = RATIO,
                         token_topk: int = TOKEN_TOPK) -> np.ndarray:
    """Expand the indexer's block ids to token indices (§4): block g >= 0 of a row at position p
    becomes tokens ``ratio*g .. ratio*g + ratio - 1`` (>= seq_len: -1), truncated to
    ``token_topk`` columns, then the causal tail ``[floor((p + 1)/ratio)*ratio, p]`` in
    ``ratio - 1`` columns (tokens < 0 or >= seq_len: -1), valid entries stably first.
    block_ids int [M, block_topk] (row-relative); positions, seq_lens int [M]. Returns int32
    [M, token_topk + ratio - 1], -1 after the valid entries. Raises ValueError when the shapes
    disagree. Source: qsa-contract.md §4, upstream ``sglang/srt/layers/attention/qsa/kernel.py``."""
    blocks = np.asarray(block_ids, np.int64)
    if blocks.ndim != 2:
        raise ValueError(f"block_ids must be [M, block_topk], got shape {blocks.shape}")
    m = blocks.shape[0]
    pos = np.asarray(positions, np.int64).reshape(-1)
    sl = np.asarray(seq_lens, np.int64).reshape(-1)
    if pos.shape[0] != m or sl.shape[0] != m:
        raise ValueError(f"positions ({pos.shape[0]}) and seq_lens ({sl.shape[0]}) must have "
                         f"one entry per row ({m})")
    offs = np.arange(ratio, dtype=np.int64)
    tok = (blocks[:, :, None] * ratio + offs).reshape(m, blocks.shape[1] * ratio)
    tok = np.where(np.repeat(blocks >= 0, ratio, axis=1), tok, -1)
    tok = tok[:, :token_topk]
    if tok.shape[1] < token_topk:  # fewer blocks than token_topk / ratio: pad
        tok = np.concatenate([tok, np.full((m, token_topk - tok.shape[1]), -1, np.int64)], 1)
    tok = np.where(tok < sl[:, None], tok, -1)
    visible = pos + 1
    start = (visible // ratio) * ratio
    toffs = np.arange(ratio - 1, dtype=np.int64)
    tail = start[:, None] + toffs
    # a token is a position >= 0 (a negative position has no tail)
    tail = np.where((toffs < (visible - start)[:, None]) & (tail >= 0) & (tail < sl[:, None]),
                    tail, -1)
    out = np.concatenate([tok, tail], axis=1)
    # every invalid entry is -1 here, so "valid" is simply >= 0
    return valid_first(out, np.iinfo(np.int64).max).astype(np.int32)


def valid_mask(indices, lens) -> np.ndarray:
    """Boolean mask ``0 <= idx < len`` (lens broadcast over the last axis). Raises nothing of its
    own; source: qsa-contract.md §3, §4 (the validity rule)."""
    idx = np.asarray(indices)
    return (idx >= 0) & (idx < np.asarray(lens, np.int64)[..., None])


def valid_counts(indices, seq_lens) -> np.ndarray:
    """Valid entries per row, ``#{j : 0 <= indices[r, j] < seq_lens[r]}`` (§4), wherever they
    stand: int32 of shape ``indices.shape[:-1]`` for int ``indices`` [..., W]. Raises nothing of
    its own; source: qsa-contract.md §4."""
    return valid_mask(indices, seq_lens).sum(-1).astype(np.int32)


def cu_seqlens_from_counts(counts) -> np.ndarray:
    """Exclusive prefix sum: int32 [B + 1], cu[0] = 0 (the decode ``cu_seqlens_k``). Raises
    ValueError for a negative count or a total past int32. Source: qsa-contract.md §4."""
    c = np.asarray(counts, np.int64).reshape(-1)
    if (c < 0).any():
        raise ValueError("counts must be >= 0")
    cu = np.zeros(c.shape[0] + 1, np.int64)
    np.cumsum(c, out=cu[1:])
    if cu[-1] > _I32_MAX:
        raise ValueError(f"total count {cu[-1]} overflows int32 cu_seqlens")
    return cu.astype(np.int32)


def compact_kv(k_pool, v_pool, indices, seq_lens, slot_table=None, *, out_dtype=None,
               capacity: int | None = None):
    """Decode compaction (§4): row b's valid entries of ``indices`` int [B, W] (< seq_lens[b],
    column order) map to pool slots ``slot_table[b, idx]`` (int [B, max_context]; None: idx) and
    their ``k_pool`` / ``v_pool`` [slots, Hkv, D] rows land at ``cu_k[b] : cu_k[b + 1]``, cast to
    ``out_dtype`` (default the pool's). Returns (k_packed, v_packed [capacity (default cu_k[B],
    extra rows 0), Hkv, D], cu_seqlens_k int32 [B + 1]). Raises ValueError: capacity too small.
    Source: qsa-contract.md §4 (compaction), upstream ``_compact_kv`` in
    ``sglang/srt/layers/attention/qsa/sparse_attn.py``."""
    idx = np.asarray(indices, np.int64)
    mask = valid_mask(idx, seq_lens)
    cu = cu_seqlens_from_counts(mask.sum(-1))
    rows, cols = np.nonzero(mask)  # row-major: per row, in column order
    pos = idx[rows, cols]
    slots = pos if slot_table is None else np.asarray(slot_table, np.int64)[rows, pos]
    total = int(cu[-1])
    cap = total if capacity is None else int(capacity)
    if cap < total:
        raise ValueError(f"capacity {cap} < {total} valid entries")
    outs = []
    for pool in (k_pool, v_pool):
        pool = np.asarray(pool)
        dt = pool.dtype if out_dtype is None else np.dtype(out_dtype)
        buf = np.zeros((cap,) + pool.shape[1:], dt)
        buf[:total] = pool[slots].astype(dt)
        outs.append(buf)
    return outs[0], outs[1], cu


# --------------------------------------------------------------------------------------------
# Realistic prefill indices.
def row_layout(q_lens, kv_lens=None, *, check: bool = True):
    """Per row: (request id, row within the request, visible tokens, validity bound), int64 [T]
    each, for ``q_lens`` int [B] rows per request and ``kv_lens`` int [B] contexts (None: ordinary,
    kv_lens = q_lens). ``check=False`` accepts kv_lens < q_lens (lying metadata: those rows see
    <= 0 tokens). Raises ValueError for lengths of different sizes, or (check) kv_lens < q_lens.
    Source: qsa-contract.md §3 (visible, validity bound)."""
    ql = np.asarray(q_lens, np.int64).reshape(-1)
    kl = ql if kv_lens is None else np.asarray(kv_lens, np.int64).reshape(-1)
    if kl.shape != ql.shape:
        raise ValueError(f"kv_lens has {kl.shape[0]} entries, q_lens {ql.shape[0]}")
    if check and (kl < ql).any():
        raise ValueError(f"kv_lens must be >= q_lens per request, got {kl.tolist()} < "
                         f"{ql.tolist()}")
    req = np.repeat(np.arange(ql.shape[0]), ql)
    starts = np.concatenate([[0], np.cumsum(ql)[:-1]]) if ql.size else ql
    r = np.arange(req.shape[0]) - starts[req] if req.size else req
    visible = r + kl[req] - ql[req] + 1
    return req, r, visible, kl[req]


def select_blocks(visible, req, *, block_topk: int = BLOCK_TOPK, ratio: int = RATIO,
                  overlap: float = 0.9, sinks: int = 0, seed: int = 0) -> np.ndarray:
    """Indexer-like block selection: int64 [T, block_topk] distinct complete block ids per row
    (visible, req: int [T] visible tokens and request id), -1 padding.

    A row with ``nb = floor(visible / ratio)`` <= block_topk blocks selects them all. Otherwise it
    keeps the ``block_topk // 32`` most recent blocks, the first ``sinks`` blocks, and one block
    from each remaining equal stratum of ``[sinks, G)``, G = ``nb - n_recent`` rounded down to a
    multiple of ``block_topk // 8`` (strata stay put as a request's rows advance). A stratum's
    offset is drawn per (request, stratum) with probability ``sqrt(overlap)``, else per row, so
    adjacent rows share about ``overlap`` of their older blocks, like the real indexer's
    (anchors.md). Ids come in one random order per request, valid first. Raises ValueError:
    overlap outside [0, 1], sinks outside [0, block_topk - n_recent - 1]. Source: our own
    (overlap target: vLLM RFC #55394, as ``neighbour_jaccard`` measures it)."""
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap must be in [0, 1], got {overlap}")
    rng = np.random.default_rng(seed)
    vis = np.asarray(visible, np.int64)
    req = np.asarray(req, np.int64)
    t = vis.shape[0]
    n_req = int(req.max()) + 1 if t else 0
    nb = vis // ratio
    n_recent = max(1, block_topk // 32) if block_topk > 1 else 0
    sinks = int(sinks)
    if not 0 <= sinks <= block_topk - n_recent - 1:
        raise ValueError(f"sinks must be in [0, {block_topk - n_recent - 1}], got {sinks}")
    n_strata = block_topk - n_recent - sinks
    quant = max(1, block_topk // 8)
    older = nb - n_recent - sinks
    grid = (older // quant) * quant
    grid = np.where(grid >= n_strata, grid, older)[:, None]  # >= n_strata whenever nb > block_topk
    shared_u = rng.random((n_req, n_strata))
    row_u = rng.random((t, n_strata))
    # both rows of an adjacent pair keep the shared pick with probability sqrt(o)^2 = o
    use_shared = rng.random((t, n_strata)) < np.sqrt(overlap)
    u = np.where(use_shared, shared_u[req], row_u)
    # integer strata edges e_s = floor(s * G / n_strata), strictly increasing when G >= n_strata,
    # so one block per stratum gives distinct ids
    edges = (np.arange(n_strata + 1, dtype=np.int64) * grid) // max(n_strata, 1)
    lo, width_s = edges[:, :-1], np.diff(edges, axis=1)
    strat = sinks + lo + np.minimum((u * width_s).astype(np.int64), np.maximum(width_s - 1, 0))
    recent = nb[:, None] - 1 - np.arange(n_recent, dtype=np.int64)
    sink = np.broadcast_to(np.arange(sinks, dtype=np.int64), (t, sinks))
    sparse = np.concatenate([recent, sink, strat], axis=1)
    dense = np.where(np.arange(block_topk) < nb[:, None], np.arange(block_topk), -1)
    blocks = np.where((nb > block_topk)[:, None], sparse, dense)
    # per-request score order (same permutation for every row of a request)
    perm = np.argsort(rng.random((n_req, block_topk)), axis=1)
    blocks = np.take_along_axis(blocks, perm[req], axis=1)
    return valid_first(blocks, np.iinfo(np.int64).max)


def _selections(n_heads: int | None, rng, visible, req, token_topk: int | None = None,
                **select) -> np.ndarray:
    """int64 [T, n_heads or 1, NB or W]: ``select_blocks`` per head, expanded given token_topk."""
    heads = []
    for _ in range(n_heads or 1):
        g = select_blocks(visible, req, seed=int(rng.integers(2**31)), **select)
        heads.append(g if token_topk is None else expand_block_indices(
            g, visible - 1, visible, ratio=select["ratio"], token_topk=token_topk).astype(np.int64))
    return np.stack(heads, 1)


def _junk(shape, bound, mode: str, rng) -> np.ndarray:
    """int64 ``shape`` of invalid padding for rows with validity bound ``bound`` [T]."""
    b = np.asarray(bound, np.int64)[:, None]
    values = {"-1": (-1,), "-7": (-7,), "len": (b,), "len+19": (b + 19,),
              "mixed": (-1, -7, b, b + 19, _I32_MAX, _I32_MIN, -2**20)}.get(mode)
    if values is None:
        raise ValueError(f"junk mode must be one of {JUNK_MODES}, got {mode!r}")
    table = np.concatenate([np.broadcast_to(np.int64(v) if np.isscalar(v) else v, b.shape)
                            for v in values], axis=1)  # [T, values]
    if len(values) == 1:
        return np.broadcast_to(table, shape).copy()
    return np.take_along_axis(table, rng.integers(0, table.shape[1], size=shape), axis=1)


def prefill_indices(q_lens, kv_lens=None, *, width: int = WIDTH, ratio: int = RATIO,
                    overlap: float = 0.9, junk: str = "-1", empty_rows: float | Sequence[int] = 0.0,
                    num_kv_heads: int | None = None, seed: int = 0) -> np.ndarray:
    """Seeded realistic prefill indices: rows of ``row_layout(q_lens, kv_lens)`` (int [B] each;
    kv_lens None: ordinary) select blocks (``select_blocks``, ``overlap``) expanded by
    ``expand_block_indices``; padding becomes ``junk`` (``JUNK_MODES``: -1, -7, the row's bound,
    bound + 19, or "mixed": those and int32 extremes per entry). ``empty_rows``: a fraction of
    rows (float) or row numbers made all junk. Returns int32 [T, W] (``num_kv_heads`` None) or
    [T, Hkv, W] (one selection per head), valid first. Raises ValueError: unknown junk, bad
    overlap or empty_rows, kv_lens < q_lens, width < ratio. Source: our own (``select_blocks``,
    expanded as qsa-contract.md §4)."""
    if junk not in JUNK_MODES:
        raise ValueError(f"junk mode must be one of {JUNK_MODES}, got {junk!r}")
    token_topk, block_topk = _geometry(width, ratio)
    req, _r, visible, bound = row_layout(q_lens, kv_lens)
    t = req.shape[0]
    rng = np.random.default_rng(seed)
    idx = _selections(num_kv_heads, rng, visible, req, token_topk, block_topk=block_topk,
                      ratio=ratio, overlap=overlap)  # [T, H, W]
    if isinstance(empty_rows, (int, float, np.integer, np.floating)) and not isinstance(
            empty_rows, bool):
        empty_rows = float(empty_rows)
        if not 0.0 <= empty_rows <= 1.0:
            raise ValueError(f"empty_rows fraction must be in [0, 1], got {empty_rows}")
        empty = (np.nonzero(rng.random(t) < empty_rows)[0] if empty_rows > 0
                 else np.zeros(0, np.int64))
    else:
        empty = np.asarray(list(empty_rows), np.int64)
    if empty.size:
        idx[empty] = -1
    if junk != "-1":
        pad = idx < 0
        flat = _junk((t, idx.shape[1] * width), bound, junk, rng).reshape(idx.shape)
        idx = np.where(pad, flat, idx)
    idx = idx.astype(np.int32)
    return idx if num_kv_heads is not None else idx[:, 0]


# --------------------------------------------------------------------------------------------
# Block-level prefill selections (the indexer's output before expansion) and their tile unions.
def neighbour_jaccard(block_ids, req, visible=None, *, ratio: int = RATIO) -> float:
    """Mean Jaccard |A ∩ B| / |A ∪ B| of the valid block sets of adjacent rows of one request
    (vLLM RFC #55394 measured 0.87-0.94 at 8k on real top-k dumps). block_ids int [T, NB] (any
    order, duplicates once), req int [T], visible int [T] (valid iff 0 <= g < visible // ratio)
    or None (g >= 0). Returns a float in [0, 1], nan without pairs. Raises nothing of its own;
    source: our own (the metric vLLM RFC #55394 reports)."""
    g = np.asarray(block_ids, np.int64)
    req = np.asarray(req, np.int64)
    bound = (np.full(g.shape[0], np.iinfo(np.int64).max) if visible is None
             else np.maximum(np.asarray(visible, np.int64), 0) // ratio)
    g = np.where((g >= 0) & (g < bound[:, None]), g, -1)
    pair = np.nonzero(req[:-1] == req[1:])[0]
    if pair.size == 0:
        return float("nan")

    def distinct(x):  # distinct valid ids per row
        x = np.sort(x, axis=1)
        new = np.concatenate([np.ones((x.shape[0], 1), bool), x[:, 1:] != x[:, :-1]], axis=1)
        return (new & (x >= 0)).sum(1)

    a, b = g[pair], g[pair + 1]
    union = distinct(np.concatenate([a, b], axis=1))
    inter = distinct(a) + distinct(b) - union
    ok = union > 0
    return float(np.mean(inter[ok] / union[ok])) if ok.any() else float("nan")


def calibrate_overlap(jaccard: float, visible, req, *, block_topk: int = BLOCK_TOPK,
                      ratio: int = RATIO, sinks: int = 0, pairs: int = 512,
                      seed: int = 0) -> tuple[float, float]:
    """The ``select_blocks`` overlap reaching a target ``neighbour_jaccard`` on ``pairs`` adjacent
    row pairs of ``visible``, ``req`` (int [T]), by 14 bisection steps. Returns (overlap, Jaccard
    at it): the closest reachable (short rows select every block, so the Jaccard has a floor).
    Raises ValueError as ``select_blocks`` (bad sinks); source: our own (bisection)."""
    vis = np.asarray(visible, np.int64)
    req = np.asarray(req, np.int64)
    cand = np.nonzero(req[:-1] == req[1:])[0]
    if cand.size == 0:
        return 1.0, float("nan")
    pick = cand[np.linspace(0, cand.size - 1, min(pairs, cand.size)).astype(np.int64)]
    rows = np.stack([pick, pick + 1], 1).reshape(-1)
    sv, sr = vis[rows], req[rows]

    def measure(o):
        b = select_blocks(sv, sr, block_topk=block_topk, ratio=ratio, overlap=o, sinks=sinks,
                          seed=seed)
        return neighbour_jaccard(b, np.repeat(np.arange(rows.size // 2), 2), sv, ratio=ratio)

    lo, hi = 0.0, 1.0
    j_lo, j_hi = measure(lo), measure(hi)
    if jaccard <= j_lo:
        return lo, j_lo
    if jaccard >= j_hi:
        return hi, j_hi
    for _ in range(14):
        mid = 0.5 * (lo + hi)
        j = measure(mid)
        if j < jaccard:
            lo, j_lo = mid, j
        else:
            hi, j_hi = mid, j
    return (lo, j_lo) if abs(j_lo - jaccard) <= abs(j_hi - jaccard) else (hi, j_hi)


def expand_prefill_blocks(block_indices, q_lens, kv_lens=None, *, ratio: int = RATIO) -> np.ndarray:
    """Token indices equal to a block-level prefill selection (the ``block_indices=`` form of the
    prefill entry points; the bridge to ``interop.reference``): a block id valid iff
    ``0 <= g < visible // ratio`` expands to its ``ratio`` tokens, every row gets its causal
    tail, invalid ids are dropped (``expand_block_indices``, nothing truncated; duplicates kept).
    block_indices int [T, NB] or [T, Hkv, NB], any order; q_lens, kv_lens as ``row_layout``.
    Returns int32 [T, (Hkv,) ratio*NB + ratio - 1], valid first, -1 after. Raises ValueError when
    q_lens and kv_lens differ in size (``row_layout``); source: our own (``block_indices=``,
    ``interop.geometry.BLOCK_INDICES_DOC``), expanded as qsa-contract.md §4."""
    g = np.asarray(block_indices, np.int64)
    per_head = g.ndim == 3
    g3 = g if per_head else g[:, None, :]
    _, _, vis, bound = row_layout(q_lens, kv_lens, check=False)
    vis = np.maximum(vis, 0)
    nb_vis = vis // ratio
    t, h, nb = g3.shape
    g3 = np.where((g3 >= 0) & (g3 < nb_vis[:, None, None]), g3, -1)
    heads = [expand_block_indices(g3[:, i], vis - 1, bound, ratio=ratio, token_topk=ratio * nb)
             for i in range(h)]
    out = np.stack(heads, 1) if t else np.zeros((0, h, ratio * nb + ratio - 1), np.int32)
    return out if per_head else out[:, 0]


def prefill_block_indices(q_lens, kv_lens=None, *, block_width: int = BLOCK_TOPK,
                          ratio: int = RATIO, overlap: float = 0.9, sinks: int = 0,
                          junk: str = "-1", junk_anywhere: bool = False, duplicates: int = 0,
                          empty_rows: Sequence[int] = (), num_kv_heads: int | None = None,
                          seed: int = 0) -> np.ndarray:
    """Seeded ``select_blocks`` selections for the ``block_indices=`` path: int32 [T, NB]
    (``num_kv_heads`` None) or [T, Hkv, NB], NB = ``block_width``. q_lens, kv_lens, overlap,
    junk (in block terms: "len" = visible // ratio), empty_rows (they still attend their causal
    tail): as ``prefill_indices``. junk_anywhere: shuffle rows so valid and junk interleave.
    duplicates: that many seeded rows get one valid entry replaced by a copy of another. Raises
    ValueError as ``prefill_indices``, or for bad sinks. Source: our own (``select_blocks``)."""
    if junk not in JUNK_MODES:
        raise ValueError(f"junk mode must be one of {JUNK_MODES}, got {junk!r}")
    req, _r, visible, _bound = row_layout(q_lens, kv_lens)
    t = req.shape[0]
    rng = np.random.default_rng(seed)
    g = _selections(num_kv_heads, rng, visible, req, block_topk=block_width, ratio=ratio,
                    overlap=overlap, sinks=sinks)  # [T, H, NB], valid first, -1 after
    nb_vis = visible // ratio
    if duplicates:
        n_valid = (g >= 0).sum(-1)  # [T, H]
        rows = np.nonzero((n_valid >= 2).all(1))[0]
        for row in rng.choice(rows, size=min(int(duplicates), rows.size), replace=False):
            for h in range(g.shape[1]):
                i, j = rng.choice(int(n_valid[row, h]), size=2, replace=False)
                g[row, h, j] = g[row, h, i]
    if len(empty_rows):
        g[np.asarray(list(empty_rows), np.int64)] = -1
    pad = g < 0
    if junk != "-1":
        flat = _junk((t, g.shape[1] * block_width), nb_vis, junk, rng).reshape(g.shape)
        g = np.where(pad, flat, g)
    if junk_anywhere:
        perm = np.argsort(rng.random(g.shape), axis=-1)
        g = np.take_along_axis(g, perm, axis=-1)
    g = g.astype(np.int32)
    return g if num_kv_heads is not None else g[:, 0]


def tile_slots(q_lens, tile_rows: int) -> tuple[np.ndarray, np.ndarray, int]:
    """The tile-union kernels' numbering: tile j of request b (rows j*R .. j*R + R - 1) has slot
    ``cu_q[b] // R + b + j`` < ``T // R + B`` (a grid needing no host prefix sum). Returns
    (request of each tile, its first row in the request, number of slots), by slot. Raises
    ValueError for a negative q_len (``cu_seqlens_from_counts``); source: our own; bench/NOTES.md,
    "Tile-union sparse prefill"."""
    ql = np.asarray(q_lens, np.int64).reshape(-1)
    cu = cu_seqlens_from_counts(ql).astype(np.int64)
    r = int(tile_rows)
    req, first = [], []
    for b in range(ql.shape[0]):
        n = -(-int(ql[b]) // r)
        req += [b] * n
        first += list(range(0, n * r, r))
    return (np.asarray(req, np.int64), np.asarray(first, np.int64),
            int(cu[-1]) // r + ql.shape[0])


#: Union length both builds give a tile where a row lists a valid block twice (the indexer's
#: top-k never does): past every work bound, so the per-row kernel computes the tile's rows and
#: attends each occurrence (qsa-contract.md §3: gather semantics)
REPEATED_TILE = 2**31 - 1


def tile_union(block_indices, q_lens, kv_lens=None, *, tile_rows: int,
               ratio: int = RATIO) -> dict:
    """Reference of the tile-union build: ``{(slot, head): (blocks int64 [n], masks int64 [n])}``
    for every tile of ``tile_slots``, the union of its rows' valid blocks (ascending) with each
    row's membership bits, or None for a tile where a row lists a valid block twice (the builds
    give it length ``REPEATED_TILE``). Raises ValueError: q_lens and kv_lens of different sizes,
    a negative q_len. Source: our own; bench/NOTES.md, "Tile-union sparse prefill"."""
    g = np.asarray(block_indices, np.int64)
    g3 = g if g.ndim == 3 else g[:, None, :]
    nb_vis = np.maximum(row_layout(q_lens, kv_lens, check=False)[2], 0) // ratio
    ql = np.asarray(q_lens, np.int64).reshape(-1)
    cu = cu_seqlens_from_counts(ql).astype(np.int64)
    reqs, firsts, _ = tile_slots(ql, tile_rows)
    out = {}
    for b, j0 in zip(reqs, firsts):
        slot = int(cu[b]) // tile_rows + int(b) + int(j0) // tile_rows
        for h in range(g3.shape[1]):
            member, repeated = {}, False
            for i in range(tile_rows):
                if j0 + i >= ql[b]:
                    break
                row = int(cu[b] + j0 + i)
                ids, n = np.unique(g3[row, h][(g3[row, h] >= 0) & (g3[row, h] < nb_vis[row])],
                                   return_counts=True)
                repeated |= bool((n > 1).any())
                for blk in ids.tolist():
                    member[blk] = member.get(blk, 0) | (1 << i)
            keys = sorted(member)
            out[(slot, h)] = None if repeated else (np.asarray(keys, np.int64),
                                                    np.asarray([member[k] for k in keys],
                                                               np.int64))
    return out


@dataclasses.dataclass(frozen=True)
class PrefillLayout:
    """Host metadata of one prefill batch (int32 numpy): q_lens, kv_lens [B] (ordinary: equal),
    cu_seqlens_q, cu_seqlens_k [B + 1], max_seqlen_q (host int), and for paged req_to_token
    [max_reqs, max_context] (a seeded permutation of the pool's slots, unused entries 0) and
    req_indices [B] (else None); pool_slots: the pool's slots (paged) or packed context rows."""

    kind: str
    q_lens: np.ndarray
    kv_lens: np.ndarray
    cu_seqlens_q: np.ndarray
    cu_seqlens_k: np.ndarray
    max_seqlen_q: int
    req_to_token: np.ndarray | None
    req_indices: np.ndarray | None
    pool_slots: int

    @property
    def slot_table(self) -> np.ndarray | None:
        """int32 [B, max_context] ``req_to_token[req_indices]`` (paged), else None."""
        return None if self.req_to_token is None else self.req_to_token[self.req_indices]


def prefill_layout(kind: Literal["ordinary", "chunk", "paged"], q_lens, kv_lens=None, *,
                   pool_slack: int = 0, spare_requests: int = 2, seed: int = 0) -> PrefillLayout:
    """Metadata for a prefill batch of ``kind`` (ordinary|chunk|paged); ``kv_lens`` is ignored for
    ordinary. Paged pools get a scattered ``req_to_token`` with ``pool_slack`` unused slots and
    ``spare_requests`` unused rows (seeded). Raises ValueError: unknown kind, kv_lens < q_lens.
    Source: qsa-contract.md §3 (metadata per variant); the scattered pool is ours."""
    if kind not in ("ordinary", "chunk", "paged"):
        raise ValueError(f"kind must be ordinary|chunk|paged, got {kind!r}")
    ql = np.asarray(q_lens, np.int64).reshape(-1)
    kl = ql if kind == "ordinary" or kv_lens is None else np.asarray(kv_lens, np.int64).reshape(-1)
    row_layout(ql, kl)  # validates
    cu_q = cu_seqlens_from_counts(ql)
    cu_k = cu_seqlens_from_counts(kl)
    r2t, req_idx, slots = None, None, int(cu_k[-1])
    if kind == "paged":
        rng = np.random.default_rng(seed)
        slots = int(kl.sum()) + int(pool_slack)
        perm = rng.permutation(slots)
        width = max(1, int(kl.max()) if kl.size else 1)
        b = ql.shape[0]
        req_idx = rng.permutation(b + int(spare_requests))[:b]
        r2t = np.zeros((b + int(spare_requests), width), np.int64)
        for i in range(b):
            r2t[req_idx[i], : kl[i]] = perm[cu_k[i]: cu_k[i + 1]]
        r2t, req_idx = r2t.astype(np.int32), req_idx.astype(np.int32)
    return PrefillLayout(kind, ql.astype(np.int32), kl.astype(np.int32), cu_q, cu_k,
                         int(ql.max()) if ql.size else 1, r2t, req_idx, slots)


# --------------------------------------------------------------------------------------------
# Decode cases.
def decode_lengths(batch: int, pattern: str, *, max_len: int = WIDTH, seed: int = 0,
                   zero_rows: int = 0) -> np.ndarray:
    """Key counts int32 [B] of a decode batch, uniform in (bounds at least 1) "short" [1,
    max_len // 32], "medium" [max_len // 8, max_len // 2], "saturated" [max_len, max_len], "mixed"
    [min(17, max_len), max_len] (anchors.md); ``zero_rows`` seeded rows get 0. Raises ValueError:
    unknown pattern, B or max_len < 1. Source: qsa-contract.md §6 (decode shape suites)."""
    if pattern not in DECODE_PATTERNS:
        raise ValueError(f"decode pattern must be one of {DECODE_PATTERNS}, got {pattern!r}")
    if batch < 1 or max_len < 1:
        raise ValueError(f"need batch >= 1 and max_len >= 1, got {batch}, {max_len}")
    rng = np.random.default_rng(seed)
    lo, hi = {
        "short": (1, max(1, max_len // 32)),
        "medium": (max(1, max_len // 8), max(1, max_len // 2)),
        "saturated": (max_len, max_len),
        "mixed": (min(17, max_len), max_len),
    }[pattern]
    lens = rng.integers(lo, hi + 1, size=batch)
    if zero_rows:
        lens[rng.choice(batch, size=min(zero_rows, batch), replace=False)] = 0
    return lens.astype(np.int32)


@dataclasses.dataclass(frozen=True)
class DecodeCase:
    """One packed varlen decode batch (int32 numpy): ``lengths`` [B], ``cu_seqlens_q`` [B + 1]
    = 0..B, ``cu_seqlens_k`` [B + 1], ``max_seqlen_k`` (host bound), ``capacity`` K/V rows
    (>= cu_seqlens_k[B]; slack rows are junk a correct kernel never reads)."""

    lengths: np.ndarray
    cu_seqlens_q: np.ndarray
    cu_seqlens_k: np.ndarray
    max_seqlen_k: int
    capacity: int


def decode_case(batch: int, pattern: str, *, max_len: int = WIDTH, seed: int = 0,
                zero_rows: int = 0, capacity_slack: int = 0) -> DecodeCase:
    """A decode batch from ``decode_lengths``; ``max_seqlen_k`` is ``max_len`` (the static bound
    serving passes), the capacity ``cu_seqlens_k[B] + capacity_slack``. Raises ValueError as
    ``decode_lengths``; source: qsa-contract.md §2 (packed varlen layout)."""
    lens = decode_lengths(batch, pattern, max_len=max_len, seed=seed, zero_rows=zero_rows)
    cu_k = cu_seqlens_from_counts(lens)
    return DecodeCase(lens, np.arange(batch + 1, dtype=np.int32), cu_k, int(max_len),
                      int(cu_k[-1]) + int(capacity_slack))


# --------------------------------------------------------------------------------------------
# Paged decode (qsa-contract.md §2b): pools, req_to_token tables and realistic index rows.
#: junk values a paged-decode row may carry (``paged_decode_case``): -1, -7, = seq_len, seq_len + 19
PAGED_JUNK = ("-1", "-7", "len", "len+19")
PAGED_JUNK_AT = ("front", "middle", "end")


def resolve_paged_slots(req_to_token, req_indices, indices, seq_lens,
                        pool_slots: int) -> np.ndarray:
    """int64 pool slot of every paged-decode index entry of int [R, (Hkv,) W], -1 where invalid
    (§2b, §7): valid iff ``0 <= idx < min(seq_lens[r], max_context)``, req_indices[r] a row of
    req_to_token int [max_reqs, max_context] and the slot in ``[0, pool_slots)``. Raises nothing
    of its own; source: qsa-contract.md §2b, §7."""
    table = np.asarray(req_to_token, np.int64)
    idx = np.asarray(indices, np.int64)
    req = np.asarray(req_indices, np.int64).reshape(-1)
    lens = np.asarray(seq_lens, np.int64).reshape(-1)
    max_reqs, max_ctx = table.shape
    lead = (slice(None),) + (None,) * (idx.ndim - 1)
    req_ok = ((req >= 0) & (req < max_reqs))[lead]
    bound = np.minimum(lens, max_ctx)[lead]
    valid = req_ok & (idx >= 0) & (idx < bound)
    safe_req = np.where(req_ok[..., 0] if idx.ndim == 2 else req_ok[:, 0, 0], req, 0)
    slot = table[np.broadcast_to(safe_req[lead], idx.shape), np.where(valid, idx, 0)] \
        if table.size else np.zeros(idx.shape, np.int64)
    valid &= (slot >= 0) & (slot < pool_slots)
    return np.where(valid, slot, -1)


def _pool_slots(context_lens, *, pool_slots: int, page_size: int = 64, seed: int = 0
                ) -> np.ndarray:
    """int32 [B, max(context_lens)] slots in random pages 1.. (slot 0: SGLang's padding slot)."""
    lens = np.asarray(context_lens, np.int64).reshape(-1)
    rng = np.random.default_rng(seed)
    pages = -(-lens // page_size)
    n_pool_pages = pool_slots // page_size
    need = int(pages.sum())
    if need > n_pool_pages - 1:
        raise ValueError(f"pool of {pool_slots} slots has {n_pool_pages} pages of {page_size}; "
                         f"{need} (+ the padding page) needed")
    # distinct pages 1.. (page 0 holds the padding slot), in random order
    chosen = rng.choice(np.arange(1, n_pool_pages, dtype=np.int64), size=need, replace=False)
    table = np.zeros((lens.shape[0], max(1, int(lens.max()) if lens.size else 1)), np.int64)
    for b, first in enumerate(np.cumsum(pages) - pages):  # request b owns chosen[first:]
        pos = np.arange(lens[b])
        table[b, :lens[b]] = chosen[first + pos // page_size] * page_size + pos % page_size
    return table.astype(np.int32)


@dataclasses.dataclass(frozen=True)
class PagedDecodeCase:
    """One paged decode call's metadata (int32 numpy): req_to_token [max_reqs, max_context]
    (unused rows slot 0), req_indices, seq_lens [R] (MTP verify rows share a request), indices
    [R, (Hkv,) W] logical positions, pool_slots, page_size, owned: bool [pool_slots] slots some
    request owns (the others may hold NaN)."""

    req_to_token: np.ndarray
    req_indices: np.ndarray
    seq_lens: np.ndarray
    indices: np.ndarray
    pool_slots: int
    page_size: int
    owned: np.ndarray


def _paged_row(valid: np.ndarray, width: int, bound: int, junk: Sequence[str], at: Sequence[str],
               n_junk: int, rng) -> np.ndarray:
    """int64 [width]: ``valid`` with ``n_junk`` junk entries at each of ``at``, -1 after."""
    vals = {"-1": -1, "-7": -7, "len": bound, "len+19": bound + 19}
    junk_vals = [vals[j] for j in junk] or [-1]
    pieces = {a: [junk_vals[int(rng.integers(len(junk_vals)))] for _ in range(n_junk)] for a in at}
    room = max(0, width - n_junk * len(at))
    valid = list(valid)[:room]
    half = len(valid) // 2
    row = (pieces.get("front", []) + valid[:half] + pieces.get("middle", []) + valid[half:]
           + pieces.get("end", []))[:width]
    return np.asarray(row + [-1] * (width - len(row)), np.int64)


def paged_decode_case(context_lens, *, width: int = WIDTH, rows_per_request: int = 1,
                      pool_slots: int | None = None, page_size: int = 64, junk=("-1",),
                      junk_at=(), n_junk: int = 2, duplicates: int = 0,
                      empty_rows: Sequence[int] = (), num_kv_heads: int | None = None,
                      spare_requests: int = 2, seed: int = 0) -> PagedDecodeCase:
    """A seeded paged decode batch (§2b) laid out like a serving engine's: scattered pool slots
    (pages of ``page_size``; ``pool_slots`` default twice those needed), one ``req_to_token`` row
    per request at a shuffled row (plus ``spare_requests``), ``rows_per_request`` query rows each
    (MTP verify: row i sees ``context_lens[b] - rows + 1 + i`` tokens), indices from
    ``select_blocks`` + ``expand_block_indices`` ([R, W], or [R, Hkv, W] with num_kv_heads).
    ``n_junk`` values from ``junk`` (``PAGED_JUNK``) go at each of ``junk_at``
    (``PAGED_JUNK_AT``; () keeps rows valid-first, -1 after); ``duplicates`` entries per row copy
    other valid ones; ``empty_rows`` hold junk only. Raises ValueError: unknown junk value or
    position, a context shorter than rows_per_request - 1, rows_per_request < 1, too few
    pool_slots. Source: our own, laid out as qsa-contract.md §2b."""
    if any(j not in PAGED_JUNK for j in junk) or any(a not in PAGED_JUNK_AT for a in junk_at):
        raise ValueError(f"junk must be from {PAGED_JUNK}, junk_at from {PAGED_JUNK_AT}; got "
                         f"{junk!r}, {junk_at!r}")
    lens = np.asarray(context_lens, np.int64).reshape(-1)
    k = int(rows_per_request)
    if k < 1 or (lens < k - 1).any():
        raise ValueError(f"need rows_per_request >= 1 and context_lens >= rows_per_request - 1, "
                         f"got {k}, {lens.tolist()}")
    rng = np.random.default_rng(seed)
    b = lens.shape[0]
    if pool_slots is None:
        pool_slots = 2 * (int((-(-lens // page_size)).sum()) + 1) * page_size
    slots = _pool_slots(lens, pool_slots=pool_slots, page_size=page_size,
                        seed=int(rng.integers(2**31)))
    max_reqs = b + int(spare_requests)
    table = np.zeros((max_reqs, slots.shape[1]), np.int32)
    req_of = rng.permutation(max_reqs)[:b]
    table[req_of] = slots
    owned = np.zeros(pool_slots, bool)
    for i in range(b):
        owned[slots[i, : lens[i]]] = True
    req_rows = np.repeat(np.arange(b), k)
    seq = (lens[req_rows] - (k - 1) + np.tile(np.arange(k), b)).astype(np.int64)
    r = req_rows.shape[0]
    token_topk, block_topk = _geometry(width, RATIO)
    idx = _selections(num_kv_heads, rng, seq, req_rows, token_topk, block_topk=block_topk,
                      ratio=RATIO)  # [R, H, W], valid first, -1 after
    empty = {int(e) for e in empty_rows}
    for row in range(r):
        for h in range(idx.shape[1]):
            ent = idx[row, h]
            valid = ent[(ent >= 0) & (ent < seq[row])]
            if duplicates and valid.size > 1:
                at = rng.choice(valid.size, size=min(duplicates, valid.size - 1), replace=False)
                valid = valid.copy()
                valid[at] = valid[rng.integers(0, valid.size, size=at.size)]
            if row in empty:
                valid = valid[:0]
            idx[row, h] = _paged_row(valid, width, int(seq[row]), junk, junk_at, n_junk, rng)
    idx = idx.astype(np.int32)
    return PagedDecodeCase(table, req_of[req_rows].astype(np.int32), seq.astype(np.int32),
                           idx if num_kv_heads is not None else idx[:, 0], int(pool_slots),
                           int(page_size), owned)


# --------------------------------------------------------------------------------------------
# The indexer (qsa-contract.md §4b): shared public names, launch plan and metadata.
#: What ``qsa_triton.indexer`` and ``qsa_pallas.indexer`` both export, with the same arguments.
INDEXER_API = ("indexer_topk_decode", "indexer_topk_prefill", "indexer_select_decode",
               "indexer_select_prefill", "expand_block_indices", "indexer_plan_for")
_MERGE_MAX_CANDIDATES = 8192  # candidates one merge program selects from (splits x topk)
#: the bound pass lowers its k-th key by this many units in the last place (2^-10 of the score):
#: its scores come from programs of other shapes than pass 1's, whose FP32 sums may round apart
BOUND_MARGIN_ULPS = 1 << 13
_CHUNK_MAX = 8192  # blocks one pass-1 program holds (64 keys a thread at 4 warps, 32 at 8)
_PREFILL_WORKSPACE_BYTES = 256 << 20  # cap of the prefill candidates (keys + ids) per launch


def _pow2_at_least(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class IndexerPlan:
    """Static launch plan of the two-pass exact top-k indexer (both backends).

    Pass 1: one program per (row tile, chunk) scores ``chunk`` blocks of ``rows_per_program``
    rows (1 decode, 4..16 prefill) in tiles of ``tile`` (BLOCK_N) blocks and writes each row's
    exact top-k of the chunk as <= ``topk`` (key, block id) candidates, ascending. Pass 2: one
    program per row selects the exact top-k of its ``splits x topk`` candidates. Both select by
    radix search over the 31 key bits, ``radix_bits`` / ``merge_radix_bits`` per round, stopping
    once a round's threshold counts exactly topk keys.
    num_warps, num_stages: pass 1; merge_warps: pass 2; row_group: rows per launch pair; pdl:
    launch the merge with Programmatic Dependent Launch (Triton, sm_90+; Pallas ignores it).
    bound_chunk (prefill; 0 = off): a pass before pass 1 takes each row's first
    ``bound_chunk`` visible blocks and finds their top-k's k-th key less ``BOUND_MARGIN_ULPS``, a
    lower bound of the row's k-th key over all blocks; pass 1 then keeps a chunk's keys >= that
    bound without radix rounds wherever at most ``topk`` of them are (any block of the row's
    top-k is one of them). merge_from_bound (prefill with bound_chunk; decode): the row's k-th
    key lies between a lower bound (prefill: its bound; decode: the largest k-th key of one of
    its chunks, the smallest candidate of a chunk holding topk) and its largest candidate, so
    the merge takes the key bits those two share from the bound and runs only the radix rounds
    below them. merge_capacity (prefill with
    bound_chunk; 0 = off): pass 1 streams each tile's keys >= the bound into the chunk's slots
    (the first topk) and writes each (row, chunk)'s count of them, a fixup pass redoes exactly
    the chunks counted past topk, and the merge first moves a row's counted candidates to the
    front of its workspace (stable, in place) and selects from a tile of ``merge_capacity`` of
    them, not ``splits_pad x topk`` (a row with more first narrows them to its exact top-k by
    radix rounds over the chunks)."""

    kind: str
    topk: int
    chunk: int
    splits: int
    tile: int
    rows_per_program: int
    num_warps: int
    num_stages: int
    merge_warps: int
    row_group: int
    radix_bits: int = 2
    merge_radix_bits: int = 2
    pdl: bool = False
    bound_chunk: int = 0
    merge_from_bound: bool = True
    merge_capacity: int = 0

    @property
    def splits_pad(self) -> int:
        """S rounded up to a power of two (the merge's candidate tile is [S_pad x topk])."""
        return _pow2_at_least(self.splits)

    @staticmethod
    def thresholds(bits: int) -> int:
        """Thresholds per round of ``bits`` bits: 2^bits - 1 rounded up to a power of two."""
        return _pow2_at_least((1 << bits) - 1)

    def workspace_bytes(self, rows: int) -> int:
        """Bytes of candidate workspace for ``rows`` rows: keys + ids (int32) per slot."""
        return int(rows) * self.splits * self.topk * 8

    def problem(self, kind: str, max_blocks: int, topk: int) -> str | None:
        """Why this plan cannot run a ``kind`` call with these sizes (the kernels' limits), or
        None."""
        pow2 = lambda x: x >= 1 and x & (x - 1) == 0  # noqa: E731
        # a kernel constexpr or a grid size needs a Python int (a numpy int fails in a kernel)
        wrong = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                 if f.type in ("int", "bool") and type(getattr(self, f.name)).__name__ != f.type]
        if wrong:
            return (f"every size a Python int, pdl and merge_from_bound a bool, got "
                    f"{', '.join(wrong)}")
        if self.kind != kind or self.topk != topk:
            return f"a {kind} plan for topk={topk}, got kind={self.kind} topk={self.topk}"
        if not (pow2(self.chunk) and pow2(self.tile) and self.chunk >= max(topk, self.tile)
                and self.tile >= 16):
            return (f"power-of-two chunk >= max(topk, tile) and tile >= 16, got chunk "
                    f"{self.chunk}, tile {self.tile}")
        if self.splits * self.chunk < max(int(max_blocks), 1):
            return f"splits x chunk >= {max_blocks} blocks, got {self.splits} x {self.chunk}"
        rpp = self.rows_per_program
        if self.row_group < 1:
            return f"row_group >= 1, got {self.row_group}"
        if kind == "decode" and rpp != 1 or kind == "prefill" and (
                rpp not in (4, 8, 16) or self.row_group % rpp):
            return ("rows_per_program 1 (decode) or 4, 8, 16 (prefill: row_group a multiple of "
                    f"it), got {rpp}, row_group {self.row_group}")
        warps = (self.num_warps, self.merge_warps)
        if not all(isinstance(w, int) and pow2(w) and w <= 32 for w in warps):
            return f"num_warps and merge_warps powers of two <= 32, got {warps}"
        if not (isinstance(self.num_stages, int) and 1 <= self.num_stages <= 8):
            return f"num_stages 1..8, got {self.num_stages}"
        if max(self.chunk, self.splits_pad * topk) >= 1 << 16:
            return (f"chunk and splits_pad x topk < 65536 keys per selection, got "
                    f"{self.chunk}, {self.splits_pad} x {topk}")
        if not (1 <= self.radix_bits <= 8 and 1 <= self.merge_radix_bits <= 8):
            return f"radix bits 1..8, got {self.radix_bits}, {self.merge_radix_bits}"
        bc = self.bound_chunk
        if bc and (kind != "prefill" or not pow2(bc) or bc <= topk or bc < self.tile
                   or bc >= 1 << 16):
            return (f"bound_chunk 0, or (prefill) a power of two in ({topk}, 65536) and >= tile "
                    f"{self.tile}, got {bc}")
        cap = self.merge_capacity
        if cap and (not bc or not pow2(cap) or cap < topk or cap > self.splits_pad * topk):
            return (f"merge_capacity 0, or (with bound_chunk) a power of two in [{topk}, "
                    f"splits_pad x topk = {self.splits_pad * topk}], got {cap}")
        return None

    @property
    def compact_chunks(self) -> int:
        """Chunks the merge's compaction moves a step (a [chunks x topk] tile of <= 1024)."""
        return max(1, 1024 // self.topk)


@functools.lru_cache(maxsize=256)  # pure, and every entry-point check asks for it
def plan_indexer(kind: str, rows: int, max_blocks: int, topk: int = BLOCK_TOPK, *,
                 sm_count: int = 132, smem_per_block: int = 232_448,
                 backend: str = "triton") -> IndexerPlan:
    """The indexer's plan from static shapes only (graph/JIT safe): rows (B or T), max_blocks
    (static bound of a row's blocks: decode page-table capacity, prefill packed key rows), topk (a
    power of two), the GPU's ``sm_count`` and opt-in ``smem_per_block`` (bytes).

    Decode: the smallest power-of-two chunk >= 2 * topk (>= topk where a row has <= 8 * topk
    blocks) giving about 2 x ``sm_count`` pass-1 programs, at most 8192 blocks, grown until a
    row's candidates fit one merge program's 8192; 128-block tiles with 5 stages where 110 KB of
    shared memory fit, else 64; 4 warps (8 past 4096-block chunks of 64-block tiles or
    8192-block ones: 4 spill there); 2-bit rounds in pass 1, 1-bit in the merge, which starts
    below the bits its largest candidate and its largest chunk k-th key share (bench/NOTES.md,
    "Indexer"). Prefill: chunk 2 * topk grown until a row's candidates fit 16384 (at least 64
    blocks), 8 rows per program (4 where the chunk is past 2 x topk, as at topk < 32), 4 warps
    (faster than 8 in the Triton build), 1-bit rounds, a merge of at least 4 warps with 32
    candidates per thread (``backend`` "pallas") or up to 64 ("triton": at 16384 candidates its
    8-warp merge beat 16 warps, the Pallas build's lost), rows grouped so one launch's
    candidates stay under 256 MiB; with >= 4 chunks and 8 rows a program (up to 32768 blocks at
    topk 512) a bound sample of 2 chunks, and the streamed pass 1 with a compacting merge
    (``merge_capacity`` half the slots, <= 8192; a 4-chunk sample from 16 chunks) where a
    row's expected candidates fit.
    Raises ValueError: unknown kind or backend, topk not a power of two, negative sizes.
    Source: our own; bench/NOTES.md, "Indexer"."""
    if kind not in ("decode", "prefill"):
        raise ValueError(f"kind must be decode|prefill, got {kind!r}")
    if backend not in ("triton", "pallas"):
        raise ValueError(f"backend must be triton|pallas, got {backend!r}")
    if topk < 1 or topk & (topk - 1):
        raise ValueError(f"topk must be a power of two, got {topk}")
    if rows < 0 or max_blocks < 0:
        raise ValueError(f"rows and max_blocks must be >= 0, got {rows}, {max_blocks}")
    mb = max(int(max_blocks), 1)
    merge_chunk = _pow2_at_least(-(-mb * topk // _MERGE_MAX_CANDIDATES))

    def merge_warps(c, per_thread=16):  # 4..16 warps, <= per_thread candidates a thread
        return min(16, max(4, _pow2_at_least(-(-mb // c)) * topk // (32 * per_thread)))

    if merge_chunk > _CHUNK_MAX:  # past ~512k-token rows: up to 32768 merge candidates
        merge_chunk = max(_CHUNK_MAX, _pow2_at_least(-(-mb * topk // (4 * _MERGE_MAX_CANDIDATES))))
    if kind == "decode":
        target = -(-2 * sm_count // max(rows, 1))  # chunks per row for ~2 programs per SM
        c = min(_pow2_at_least(-(-mb // target)), _CHUNK_MAX)
        # a short row (at most 8 x topk blocks) in chunks of topk: pass 1 keeps every block (no
        # radix rounds) and the merge selects from all of them; longer rows keep 2 x topk (a
        # merge over every block cost more than pass 1's rounds) (bench/NOTES.md, "Indexer")
        c = max(c, topk if mb <= 8 * topk else 2 * topk, 64, merge_chunk)
        tile = min(128 if smem_per_block >= 110_000 else 64, c)
        splits = -(-mb // c)
        # 4 warps (two programs an SM where 8 warps' registers allow one), but 8 where a thread
        # would hold 64 keys of 64-block tiles (they spill there)
        warps = 4 if c <= 4096 or (tile == 128 and c <= 8192) else 8
        return IndexerPlan(kind, topk, c, splits, tile, 1, warps, 5, merge_warps(c), max(rows, 1),
                           radix_bits=2, merge_radix_bits=1,
                           pdl=max(rows, 1) * splits <= 2 * sm_count)
    # prefill rows merge up to 16384 candidates, and a pass-1 program holds 8 x 1024 keys (16 x
    # 1024 spilled registers in the Pallas build): fewer rows per program where the chunk grows
    c = max(2 * topk, 64, _pow2_at_least(-(-mb * topk // (2 * _MERGE_MAX_CANDIDATES))))
    bm = max(4, min(8, 8 * 2 * topk // c))
    tile = min(64, c)
    # the prefill merge: fewer warps wait at each round's barrier, each thread loops over more
    # candidates; the balance differs between the builds (bench/NOTES.md, "Indexer")
    # the bound pass where pass 1 has >= 4 chunks a row: a sample of two chunks, half the rows a
    # program (as many keys as a pass-1 program; not where pass 1 already has 4 rows)
    splits = -(-mb // c)
    bound = 2 * c if splits >= 4 and bm >= 8 else 0
    # with the bound: pass 1 streams the keys >= it and the merge compacts them into a tile of
    # half the slots (at most 8192) where a row's expected candidates (iid scores: blocks x
    # topk / sample) fit the tile, or half of it with a 4-chunk sample (>= 16 chunks; a row
    # past the tile takes the merge's slow path) (bench/NOTES.md, "Indexer")
    cap = 0
    if bound:
        sample = 4 * c if splits >= 16 else 2 * c
        cap = min(_MERGE_MAX_CANDIDATES, _pow2_at_least(splits) * topk // 2)
        if mb * topk // sample <= (cap // 2 if sample > bound else cap):
            bound = sample
        else:
            cap = 0
    warps = (merge_warps(c, 64 if backend == "triton" else 32) if not cap else
             max(4, cap // (32 * (64 if backend == "triton" else 32))))
    plan = IndexerPlan(kind, topk, c, splits, tile, bm, 4, 2, warps, 1,
                       radix_bits=1, merge_radix_bits=1, bound_chunk=bound,
                       merge_capacity=cap)
    group = max(bm, (_PREFILL_WORKSPACE_BYTES // plan.workspace_bytes(1)) // bm * bm)
    return dataclasses.replace(plan, row_group=min(group, -(-max(rows, 1) // bm) * bm))


def prefill_row_ranges(q_lens, kv_lens, *, ratio: int = RATIO):
    """Prefill indexer metadata (upstream ``build_qsa_row_ranges``): request b's
    ``floor(kv_lens[b] / ratio)`` compressed keys packed at rows ``cu_blocks[b] ..``; its row r at
    ``p = kv_lens[b] - q_lens[b] + r`` sees ``floor((p + 1) / ratio)`` of them. Returns int32
    (row_starts, row_ends [T] half-open absolute, cu_blocks [B + 1], positions [T], seq_lens [T]
    = kv_lens[b]). Raises ValueError: kv_lens[b] < q_lens[b]. Source: upstream
    ``build_qsa_row_ranges`` (``sglang/srt/layers/attention/qsa/metadata.py``), qsa-contract.md
    §7."""
    req, r, visible, bound = row_layout(q_lens, kv_lens)
    kl = np.asarray(kv_lens, np.int64).reshape(-1)
    cu = cu_seqlens_from_counts(kl // ratio)
    starts = cu[req].astype(np.int64)
    ends = starts + np.minimum(visible // ratio, (kl // ratio)[req])
    return (starts.astype(np.int32), ends.astype(np.int32), cu, (visible - 1).astype(np.int32),
            bound.astype(np.int32))


def prefill_step_rows(cu_seqlens_q, kv_lens, index_cu_seqlens_k, total_rows: int, *,
                      ratio: int = RATIO):
    """Per-row indexer metadata of a prefill step (the rule both backends'
    ``prefill_step_rows`` evaluate on the device): row t of request b sits at ``p = kv_lens[b] -
    q_len_b + (t - cu_seqlens_q[b])`` and sees the first ``floor(max(p + 1, 0) / ratio)`` of the
    packed rows ``index_cu_seqlens_k[b] .. [b + 1]``; a row outside every request gets an empty
    range, position -1, bound 0. Inputs int [B + 1], [B], [B + 1]; returns int32 [total_rows]
    (row_starts, row_ends, positions, seq_lens = kv_lens[b]). Raises nothing of its own; source:
    qsa-contract.md §4b, §7 (``prefill_row_ranges``'s rule per row)."""
    cu = np.asarray(cu_seqlens_q, np.int64).reshape(-1)
    kl = np.asarray(kv_lens, np.int64).reshape(-1)
    ck = np.asarray(index_cu_seqlens_k, np.int64).reshape(-1)
    return prefill_step_rows_xp(np, cu, kl, ck, np.arange(int(total_rows), dtype=np.int64), ratio)


def prefill_step_rows_xp(xp, cu, kl, ck, rows, ratio: int):
    """``prefill_step_rows``'s rule over an array module ``xp`` with numpy's API (``jax.numpy`` in
    ``qsa_pallas``; the core imports no backend); ``rows`` int [T] = 0..T-1. Raises nothing of its
    own; source: as ``prefill_step_rows``."""
    b = kl.shape[0]
    req = xp.searchsorted(cu[1:], rows, side="right")
    inside = (req < b) & (rows >= cu[0])
    rq = xp.minimum(req, b - 1)
    pos = kl[rq] - (cu[rq + 1] - cu[rq]) + rows - cu[rq]
    start = ck[rq]
    end = start + xp.minimum(xp.maximum(pos + 1, 0) // ratio, xp.maximum(ck[rq + 1] - start, 0))
    z = xp.zeros_like(rows)
    i32 = xp.int32
    return (xp.where(inside, start, z).astype(i32), xp.where(inside, end, z).astype(i32),
            xp.where(inside, pos, z - 1).astype(i32), xp.where(inside, kl[rq], z).astype(i32))


@dataclasses.dataclass(frozen=True)
class IndexerDecodeCase:
    """A paged compressed-K decode batch (int32 numpy): ``seq_lens`` [B] tokens per row,
    ``page_table`` [B, max_pages] (each row's pages distinct, seeded order, junk after),
    ``pages`` in the cache, ``page_size`` blocks per page (16: 64-token KV pages / 4)."""

    seq_lens: np.ndarray
    page_table: np.ndarray
    pages: int
    page_size: int


def indexer_decode_case(seq_lens, *, page_size: int = 16, max_pages: int | None = None,
                        junk: str = "mixed", extra_pages: int = 3, seed: int = 0
                        ) -> IndexerDecodeCase:
    """Page table for a decode batch, every row's pages scattered over one shared cache with
    ``extra_pages`` unused pages. ``seq_lens``: int [B] >= 0; ``max_pages``: table width (default
    the longest row's); ``junk`` past each row's pages: "zero", "-1" or "mixed" (-1, past the
    cache, int32 extremes, 0). Raises ValueError: max_pages too small, unknown junk. Source: our
    own, the cache layout of qsa-contract.md §4b."""
    sl = np.maximum(np.asarray(seq_lens, np.int64).reshape(-1), 0)
    need = -(-(sl // RATIO) // page_size)
    width = int(max(need.max() if need.size else 0, 1) if max_pages is None else max_pages)
    if need.size and need.max() > width:
        raise ValueError(f"max_pages {width} < {int(need.max())} pages a row needs")
    if junk not in ("zero", "-1", "mixed"):
        raise ValueError(f"junk must be zero|-1|mixed, got {junk!r}")
    rng = np.random.default_rng(seed)
    pages = int(need.sum()) + int(extra_pages)
    perm = rng.permutation(pages)
    pt = np.zeros((sl.shape[0], width), np.int64)
    at = 0
    for b in range(sl.shape[0]):
        n = int(need[b])
        pt[b, :n] = perm[at:at + n]
        at += n
        if junk == "mixed":
            pt[b, n:] = rng.choice(np.array([-1, pages, pages + 7, _I32_MAX, _I32_MIN, 0]),
                                   size=width - n)
        else:
            pt[b, n:] = {"zero": 0, "-1": -1}[junk]
    return IndexerDecodeCase(sl.astype(np.int32), pt.astype(np.int32), pages, int(page_size))
