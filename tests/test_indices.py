"""interop.indices: block expansion (valid-count formula for every L in 1..5000, valid first),
counts / cu_seqlens_k, compaction, and the realistic generators."""

from __future__ import annotations

import time

import numpy as np
import pytest

from interop import indices as I
from interop.contract import validate_prefill_metadata


def full_selection(L: np.ndarray, rng=None) -> np.ndarray:
    """Every complete block a row may select (up to 512), in random (score) order, -1 after."""
    nb = np.minimum(L // 4, 512)
    g = np.arange(512)
    blocks = np.where(g < nb[:, None], g, -1)
    if rng is not None:  # shuffle the valid prefix (the indexer's score order)
        keys = np.where(blocks >= 0, rng.random(blocks.shape), 2.0)
        blocks = np.take_along_axis(blocks, np.argsort(keys, 1), 1)
    # select the *last* 512 blocks for long rows (still distinct, complete)
    blocks = np.where(blocks >= 0, blocks + np.maximum(L // 4 - 512, 0)[:, None], -1)
    return blocks


def test_expansion_valid_count_formula_every_L_1_to_5000():
    L = np.arange(1, 5001)
    rng = np.random.default_rng(0)
    out = I.expand_block_indices(full_selection(L, rng), L - 1, L)
    assert out.shape == (5000, 2051) and out.dtype == np.int32
    valid = (out >= 0) & (out < L[:, None])
    want = 4 * np.minimum(L // 4, 512) + L % 4
    np.testing.assert_array_equal(valid.sum(1), want)
    np.testing.assert_array_equal(I.expected_valid_count(L), want)
    # valid entries first: never a valid entry after an invalid one; padding is -1
    assert not (valid[:, 1:] & ~valid[:, :-1]).any()
    assert (out[~valid] == -1).all()
    # no duplicates and the causal tail present
    for l in (1, 3, 4, 7, 2047, 2051, 4999):
        row = out[l - 1][: want[l - 1]]
        assert np.unique(row).size == row.size
        tail = np.arange((l // 4) * 4, l)
        assert np.isin(tail, row).all()


def test_expansion_details():
    # blocks: 2 and 0 valid, then -1; position 9 (L = 10: tail 8, 9); seq_len 9 cuts token 9
    blocks = np.full((1, 512), -1)
    blocks[0, :2] = [2, 0]
    out = I.expand_block_indices(blocks, [9], [9])
    assert out.shape == (1, 2051) and (out[0, 6:] == -1).all()
    valid = out[0][out[0] >= 0]
    # block 2 -> 8, (9, 10, 11 >= seq_len 9 -> -1); block 0 -> 0..3; tail 8 (9 >= seq_len)
    np.testing.assert_array_equal(valid, [8, 0, 1, 2, 3, 8])
    # order of valid entries is kept (stable)
    np.testing.assert_array_equal(I.valid_first(np.array([[5, -1, 3, 9, -2, 1]]), [6]),
                                  [[5, 3, 1, -1, 9, -2]])
    with pytest.raises(ValueError):
        I.expand_block_indices(blocks, [1, 2], [3])
    # small geometry: width 11 -> token_topk 8, 2 blocks
    out = I.expand_block_indices(np.array([[1, 0]]), [12], [13], token_topk=8)
    assert out.shape == (1, 11)
    np.testing.assert_array_equal(out[0], [4, 5, 6, 7, 0, 1, 2, 3, 12, -1, -1])


def test_counts_and_cu_seqlens():
    idx = np.array([[0, 5, -1, 2], [9, -3, 1, 1], [-1, -1, -1, -1]])
    lens = np.array([5, 2, 3])
    np.testing.assert_array_equal(I.valid_counts(idx, lens), [2, 2, 0])
    cu = I.cu_seqlens_from_counts(I.valid_counts(idx, lens))
    assert cu.dtype == np.int32
    np.testing.assert_array_equal(cu, [0, 2, 4, 4])
    with pytest.raises(ValueError):
        I.cu_seqlens_from_counts([-1])
    with pytest.raises(ValueError):
        I.cu_seqlens_from_counts([2**31, 1])


def test_compact_kv_matches_manual_gather():
    rng = np.random.default_rng(1)
    slots, hkv, d = 40, 2, 8
    kp = rng.standard_normal((slots, hkv, d)).astype(np.float32)
    vp = rng.standard_normal((slots, hkv, d)).astype(np.float32)
    st = np.stack([rng.permutation(slots)[:20] for _ in range(3)])
    idx = np.array([[3, -1, 19, 25, 0], [7, 7, -2, 100, 1], [-1, -1, -1, -1, -1]])
    lens = np.array([20, 10, 20])
    k, v, cu = I.compact_kv(kp, vp, idx, lens, st, capacity=12)
    np.testing.assert_array_equal(cu, [0, 3, 6, 6])
    want = [st[0, 3], st[0, 19], st[0, 0], st[1, 7], st[1, 7], st[1, 1]]
    np.testing.assert_array_equal(k[:6], kp[want])
    np.testing.assert_array_equal(v[:6], vp[want])
    assert k.shape == (12, hkv, d) and (k[6:] == 0).all()
    # no slot table: indices are rows; dtype conversion while copying (fp8 pool -> fp16)
    import ml_dtypes

    k8 = kp.astype(ml_dtypes.float8_e4m3fn)
    k2, _, cu2 = I.compact_kv(k8, k8, idx[:1], [40], out_dtype=np.float16)
    assert k2.dtype == np.float16
    np.testing.assert_array_equal(k2, k8[[3, 19, 25, 0]].astype(np.float16))
    with pytest.raises(ValueError):
        I.compact_kv(kp, vp, idx, lens, st, capacity=5)


@pytest.mark.parametrize("kind", ["ordinary", "chunk"])
@pytest.mark.parametrize("junk", I.JUNK_MODES)
def test_prefill_indices_realistic(kind, junk):
    q_lens = np.array([70, 1, 130])
    kv_lens = None if kind == "ordinary" else np.array([900, 1, 200])
    w = 67  # token_topk 64, 16 blocks: long rows saturate
    idx = I.prefill_indices(q_lens, kv_lens, width=w, junk=junk, seed=3)
    req, r, vis, bound = I.row_layout(q_lens, kv_lens)
    assert idx.shape == (201, w) and idx.dtype == np.int32
    valid = I.valid_mask(idx, bound)
    np.testing.assert_array_equal(valid.sum(1), I.expected_valid_count(vis, width=w))
    assert not (valid[:, 1:] & ~valid[:, :-1]).any()
    # every selected token is causal (< visible) and padding is what was asked for
    assert (np.where(valid, idx, -1) < vis[:, None]).all()
    pad = idx[~valid].astype(np.int64)
    b = np.broadcast_to(bound[:, None], idx.shape)[~valid]
    want = {"-1": pad == -1, "-7": pad == -7, "len": pad == b, "len+19": pad == b + 19,
            "mixed": (pad < 0) | (pad >= b)}[junk]
    assert want.all()
    if junk == "mixed":
        assert len(np.unique(pad)) > 4
    validate_prefill_metadata(idx, I.cu_seqlens_from_counts(q_lens),
                              None if kv_lens is None else kv_lens, kind)


def test_prefill_indices_options():
    q_lens, kv_lens = np.array([40, 24]), np.array([300, 24])
    a = I.prefill_indices(q_lens, kv_lens, width=35, num_kv_heads=2, empty_rows=[0, 41], seed=1)
    assert a.shape == (64, 2, 35)
    assert (a[[0, 41]] == -1).all() and (a[1] >= 0).any()
    assert not np.array_equal(a[:, 0], a[:, 1])  # different selection per KV head
    np.testing.assert_array_equal(a, I.prefill_indices(q_lens, kv_lens, width=35, num_kv_heads=2,
                                                       empty_rows=[0, 41], seed=1))
    frac = I.prefill_indices(np.array([400]), width=35, empty_rows=0.5, seed=2)
    n_empty = int(((frac < 0) | (frac >= 400)).all(1).sum())
    assert 120 < n_empty < 280
    with pytest.raises(ValueError):
        I.prefill_indices(q_lens, kv_lens, junk="zero")
    with pytest.raises(ValueError):
        I.prefill_indices(q_lens, np.array([30, 24]))
    with pytest.raises(ValueError):
        I.prefill_indices(q_lens, overlap=1.5)


def _adjacent_overlap(idx, n):
    shared = [np.intersect1d(idx[i, :n], idx[i + 1, :n]).size / n for i in range(100, 160)]
    return float(np.mean(shared))


def test_overlap_knob():
    q, kv = np.array([256]), np.array([40000])
    hi = _adjacent_overlap(I.prefill_indices(q, kv, overlap=1.0, seed=0), 2048)
    mid = _adjacent_overlap(I.prefill_indices(q, kv, overlap=0.5, seed=0), 2048)
    lo = _adjacent_overlap(I.prefill_indices(q, kv, overlap=0.0, seed=0), 2048)
    assert hi > 0.9 and lo < 0.2 and lo < mid < hi


def test_production_size_is_fast_and_valid():
    t0 = time.perf_counter()
    idx = I.prefill_indices([8192], [131072], junk="mixed", seed=0)
    elapsed = time.perf_counter() - t0
    assert idx.shape == (8192, 2051)
    assert elapsed < 15.0, elapsed  # ~0.7 s alone; a per-row Python loop would take minutes
    _, _, vis, bound = I.row_layout([8192], [131072])
    valid = I.valid_mask(idx, bound)
    assert (valid.sum(1) >= 2048).all() and not (valid[:, 1:] & ~valid[:, :-1]).any()
    # 512 distinct blocks per row
    rows = idx[::1024, :2048]
    assert all(np.unique(r // 4).size == 512 for r in rows)


def test_prefill_layout_paged():
    lay = I.prefill_layout("paged", [3, 5], [10, 7], pool_slack=6, spare_requests=3, seed=0)
    assert lay.req_to_token.shape == (5, 10) and lay.req_to_token.dtype == np.int32
    assert lay.req_indices.dtype == np.int32 and np.unique(lay.req_indices).size == 2
    assert lay.req_indices.max() < 5
    np.testing.assert_array_equal(lay.slot_table, lay.req_to_token[lay.req_indices])
    used = np.concatenate([lay.slot_table[0, :10], lay.slot_table[1, :7]])
    assert np.unique(used).size == 17 and used.max() < lay.pool_slots == 23
    np.testing.assert_array_equal(lay.cu_seqlens_q, [0, 3, 8])
    np.testing.assert_array_equal(lay.cu_seqlens_k, [0, 10, 17])
    assert lay.max_seqlen_q == 5
    ordinary = I.prefill_layout("ordinary", [4, 2], [99, 99])
    np.testing.assert_array_equal(ordinary.kv_lens, [4, 2])
    with pytest.raises(ValueError):
        I.prefill_layout("dense", [1])


@pytest.mark.parametrize("pattern", I.DECODE_PATTERNS)
def test_decode_case(pattern):
    c = I.decode_case(37, pattern, seed=4, capacity_slack=5)
    lo, hi = {"short": (1, 64), "medium": (256, 1025), "saturated": (2051, 2051),
              "mixed": (17, 2051)}[pattern]
    assert c.lengths.min() >= lo and c.lengths.max() <= hi
    np.testing.assert_array_equal(np.diff(c.cu_seqlens_k), c.lengths)
    assert c.cu_seqlens_k.dtype == np.int32 and c.cu_seqlens_k[0] == 0
    np.testing.assert_array_equal(c.cu_seqlens_q, np.arange(38))
    assert c.capacity == c.cu_seqlens_k[-1] + 5 and c.max_seqlen_k == 2051
    z = I.decode_lengths(8, pattern, zero_rows=2, max_len=40)
    assert (z == 0).sum() >= 2 and z.max() <= 40
    with pytest.raises(ValueError):
        I.decode_lengths(0, pattern)
    with pytest.raises(ValueError):
        I.decode_lengths(4, "huge")
