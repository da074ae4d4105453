"""The FP64 references agree with a direct per-head loop written independently here, handle junk
entries anywhere in a row, give exact zeros for rows with no valid entry and never produce NaN."""

from __future__ import annotations

import math

import numpy as np
import pytest

from interop.reference import (attend, decode_reference, prefill_chunk_reference,
                               prefill_paged_reference, prefill_reference, rel_l2)

JUNK = np.array([-1, -7, -(2**31), 2**31 - 1, -(2**20)], np.int64)


def loop_attention(qvec, keys, vals, scale, k_scale=1.0, v_scale=1.0):
    """One query head over a list of key/value rows, written with plain Python sums (log-sum-exp)."""
    if len(keys) == 0:
        return np.zeros(qvec.shape[0])
    logits = [scale * k_scale * float(np.dot(qvec, kk)) for kk in keys]
    m = max(logits)
    w = [math.exp(x - m) for x in logits]
    z = sum(w)
    out = np.zeros(qvec.shape[0])
    for wi, vv in zip(w, vals):
        out += (wi / z) * np.asarray(vv, np.float64)
    return out * v_scale


def junkify(rng, row_idx, bound, frac=0.4):
    """Replace a random subset of entries (anywhere) by junk, including 'bound' and 'bound + 19'."""
    row_idx = row_idx.copy()
    pick = rng.random(row_idx.shape) < frac
    choices = np.concatenate([JUNK, [bound, bound + 19]])
    row_idx[pick] = rng.choice(choices, size=int(pick.sum()))
    return row_idx


def per_head_prefill(q, gather, idx, req_of_row, bound_of_req, g, scale, k_scale=1.0, v_scale=1.0,
                     per_head=False, visible_of_row=None):
    """Direct loop; ``visible_of_row[row]`` caps the columns read (the contract's early stop)."""
    t, hq, _ = q.shape
    out = np.zeros(q.shape)
    for row in range(t):
        b = req_of_row[row]
        cap = idx.shape[-1] if visible_of_row is None else max(0, min(idx.shape[-1], visible_of_row[row]))
        for h in range(hq):
            kvh = h // g
            cols = (idx[row, kvh] if per_head else idx[row])[:cap]
            keys, vals = [], []
            for pos in cols:
                if 0 <= pos < bound_of_req[b]:
                    kk, vv = gather(b, int(pos), kvh)
                    keys.append(kk)
                    vals.append(vv)
            out[row, h] = loop_attention(q[row, h].astype(np.float64), keys, vals, scale, k_scale, v_scale)
    return out


def visible_rows(cu_q, kv_lens=None):
    """Per global row: the contract's visible count (ordinary r + 1; chunk/paged bottom-right)."""
    out = []
    for b in range(len(cu_q) - 1):
        q_len = cu_q[b + 1] - cu_q[b]
        for r in range(q_len):
            out.append(r + 1 if kv_lens is None else r + kv_lens[b] - q_len + 1)
    return np.array(out, np.int64)


def rand(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decode_matches_loop(seed):
    rng = np.random.default_rng(seed)
    b, hkv, g, d = 5, 2, 3, 32
    lens = rng.integers(0, 9, size=b)
    lens[1] = 0  # an empty sequence
    cu_k = np.concatenate([[0], np.cumsum(lens)])
    cap = int(cu_k[-1]) + 4  # slack rows a correct reference never reads
    q, k, v = rand(rng, b, hkv * g, d), rand(rng, cap, hkv, d), rand(rng, cap, hkv, d)
    k[cu_k[-1]:] = np.nan  # reading them would poison the output
    v[cu_k[-1]:] = np.nan
    cu_q = np.arange(b + 1)
    scale = 0.3
    ref = decode_reference(q, k, v, cu_q, cu_k, scale)
    for s in range(b):
        for h in range(hkv * g):
            lo, hi = cu_k[s], cu_k[s + 1]
            want = loop_attention(q[s, h].astype(np.float64), list(k[lo:hi, h // g]),
                                  list(v[lo:hi, h // g]), scale)
            np.testing.assert_allclose(ref[s, h], want, rtol=1e-12, atol=1e-12)
    assert np.all(ref[1] == 0.0)
    assert np.isfinite(ref).all()


def test_decode_default_scale_and_query_rows():
    rng = np.random.default_rng(5)
    q, k, v = rand(rng, 3, 4, 64), rand(rng, 6, 2, 64), rand(rng, 6, 2, 64)
    cu_q = np.array([0, 2, 1, 0])  # query rows read from memory (any row)
    cu_k = np.array([0, 2, 4, 6])
    ref = decode_reference(q, k, v, cu_q, cu_k)
    want = loop_attention(q[2, 3].astype(np.float64), list(k[2:4, 1]), list(v[2:4, 1]), 64 ** -0.5)
    np.testing.assert_allclose(ref[1, 3], want, rtol=1e-12)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("per_head", [False, True])
def test_prefill_ordinary_matches_loop(seed, per_head):
    rng = np.random.default_rng(seed)
    q_lens = np.array([3, 0, 6])
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    t, hkv, g, d, w = int(cu[-1]), 2, 2, 32, 7
    q, k, v = rand(rng, t, hkv * g, d), rand(rng, t, hkv, d), rand(rng, t, hkv, d)
    req = np.repeat(np.arange(len(q_lens)), q_lens)
    shape = (t, hkv, w) if per_head else (t, w)
    idx = rng.integers(0, 6, size=shape)
    for row in range(t):
        idx[row] = junkify(rng, idx[row], q_lens[req[row]])
    idx[2] = -1  # a row with no valid entry
    idx = idx.astype(np.int32)
    ref = prefill_reference(q, k, v, idx, cu, 0.2)
    gather = lambda b, p, h: (k[cu[b] + p, h], v[cu[b] + p, h])  # noqa: E731
    want = per_head_prefill(q, gather, idx, req, q_lens, g, 0.2, per_head=per_head,
                            visible_of_row=visible_rows(cu))
    np.testing.assert_allclose(ref, want, rtol=1e-11, atol=1e-12)
    assert np.all(ref[2] == 0.0) and np.isfinite(ref).all()


@pytest.mark.parametrize("seed", [0, 3])
def test_prefill_chunk_matches_loop_with_fp8_scales(seed):
    rng = np.random.default_rng(seed)
    q_lens, kv_lens = np.array([2, 4]), np.array([5, 9])
    cu_q = np.concatenate([[0], np.cumsum(q_lens)])
    cu_k = np.concatenate([[0], np.cumsum(kv_lens)]) + np.array([0, 2, 2])  # gap rows between requests
    t, hkv, g, d, w = int(cu_q[-1]), 1, 3, 32, 11
    ck = int(cu_k[-1]) + 1
    q = rand(rng, t, hkv * g, d)
    import ml_dtypes  # FP8 values as the kernels see them (cast to float)

    k = rand(rng, ck, hkv, d).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    v = rand(rng, ck, hkv, d).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    req = np.repeat(np.arange(2), q_lens)
    idx = rng.integers(0, 9, size=(t, w))
    for row in range(t):
        idx[row] = junkify(rng, np.minimum(idx[row], kv_lens[req[row]] - 1), kv_lens[req[row]])
    idx[0] = junkify(rng, idx[0], kv_lens[0], frac=1.0)  # all junk
    ref = prefill_chunk_reference(q, k, v, idx, cu_q, cu_k, kv_lens, None, 0.5, 1.7)
    gather = lambda b, p, h: (k[cu_k[b] + p, h], v[cu_k[b] + p, h])  # noqa: E731
    want = per_head_prefill(q, gather, idx, req, kv_lens, g, d ** -0.5, 0.5, 1.7,
                            visible_of_row=visible_rows(cu_q, kv_lens))
    np.testing.assert_allclose(ref, want, rtol=1e-11, atol=1e-12)
    assert np.all(ref[0] == 0.0) and np.isfinite(ref).all()


def test_prefill_paged_matches_loop_and_chunk():
    rng = np.random.default_rng(7)
    q_lens, kv_lens = np.array([3, 2]), np.array([6, 4])
    cu_q = np.concatenate([[0], np.cumsum(q_lens)])
    t, hkv, g, d, w, slots = 5, 2, 1, 32, 8, 16
    q = rand(rng, t, hkv * g, d)
    kc, vc = rand(rng, slots, hkv, d), rand(rng, slots, hkv, d)
    perm = rng.permutation(slots)
    # SGLang's req_to_token: requests 0 and 1 live in rows 2 and 0; unused entries hold garbage
    rt = np.full((3, 7), -5)
    rt[2, :6], rt[0, :4] = perm[:6], perm[6:10]
    ri = np.array([2, 0])
    st = rt[ri]  # the per-request view
    req = np.repeat(np.arange(2), q_lens)
    idx = np.stack([junkify(rng, rng.integers(0, kv_lens[req[r]], size=w), kv_lens[req[r]])
                    for r in range(t)])
    ref = prefill_paged_reference(q, kc, vc, rt, ri, idx, cu_q, kv_lens, 0.25)
    gather = lambda b, p, h: (kc[st[b, p], h], vc[st[b, p], h])  # noqa: E731
    want = per_head_prefill(q, gather, idx, req, kv_lens, g, 0.25,
                            visible_of_row=visible_rows(cu_q, kv_lens))
    np.testing.assert_allclose(ref, want, rtol=1e-11, atol=1e-12)
    # the same call as a chunk call over the gathered context gives the same result
    cu_k = np.array([0, 6, 10])
    kp = np.concatenate([kc[st[0, :6]], kc[st[1, :4]]])
    vp = np.concatenate([vc[st[0, :6]], vc[st[1, :4]]])
    chunk = prefill_chunk_reference(q, kp, vp, idx, cu_q, cu_k, kv_lens, 0.25)
    np.testing.assert_allclose(ref, chunk, rtol=1e-13, atol=1e-14)


def test_prefill_paged_lying_metadata_is_an_invalid_entry():
    """A slot outside the pool, a position past req_to_token's width (kv_lens too large) and a
    request row outside the table make invalid entries: the same result as padding them."""
    rng = np.random.default_rng(8)
    q, kc, vc = rand(rng, 4, 2, 16), rand(rng, 9, 1, 16), rand(rng, 9, 1, 16)
    rt = np.array([[3, 1, 99, 4], [0, 5, 6, 2]])  # 99: past the 9-slot pool
    idx = np.array([[0, 1, 2, 3, 5, -1]] * 4)  # 5 >= max_context = 4
    cu_q, kv_lens = np.array([0, 2, 4]), np.array([6, 6])
    got = prefill_paged_reference(q, kc, vc, rt, np.array([0, 1]), idx, cu_q, kv_lens)
    clean = idx.copy()
    clean[:, 4] = -1
    clean[:2, 2] = -1  # request 0 maps position 2 to slot 99
    want = prefill_paged_reference(q, kc, vc, rt, np.array([0, 1]), clean, cu_q, kv_lens)
    np.testing.assert_array_equal(got, want)
    assert (np.abs(want).sum(axis=(1, 2)) > 0).all()
    outside = prefill_paged_reference(q, kc, vc, rt, np.array([0, 7]), idx, cu_q, kv_lens)
    assert (outside[2:] == 0).all()
    np.testing.assert_array_equal(outside[:2], want[:2])


def test_never_nan_on_large_scores_and_duplicates_count_twice():
    q = np.full((1, 1, 32), 200.0)
    k = np.full((3, 1, 32), 200.0)
    v = np.arange(96, dtype=np.float64).reshape(3, 1, 32)
    out = prefill_chunk_reference(q, k, v, np.array([[0, 1, 1, -1]]), [0, 1], [0, 3], [3])
    assert np.isfinite(out).all()
    # equal logits: weights 1/3 for row 0, 2/3 for row 1 (position 1 counted twice)
    np.testing.assert_allclose(out[0, 0], (v[0, 0] + 2 * v[1, 0]) / 3, rtol=1e-12)


def test_attend_and_rel_l2():
    assert np.all(attend(np.ones((2, 4)), np.zeros((0, 4)), np.zeros((0, 4)), 1.0) == 0)
    assert rel_l2(np.zeros(3), np.zeros(3)) == 0.0
    assert rel_l2([1.0, 1.0], [1.0, 0.0]) == pytest.approx(1.0)


def test_prefill_reads_only_the_first_visible_columns():
    """Row r reads min(W, visible) columns (qsa-contract.md §3 early stop), as both kernels do:
    a valid entry standing past that bound is ignored, so row 0 of an ordinary request attends
    to exactly its first column."""
    rng = np.random.default_rng(5)
    q, k, v = rand(rng, 2, 1, 16), rand(rng, 2, 1, 16), rand(rng, 2, 1, 16)
    idx = np.array([[0, 1, -1, -1], [0, 1, -1, -1]], np.int32)
    out = prefill_reference(q, k, v, idx, [0, 2], 0.3)
    np.testing.assert_allclose(out[0, 0], v[0, 0], rtol=1e-12)  # one key: softmax weight 1
    want1 = loop_attention(q[1, 0].astype(np.float64), [k[0, 0], k[1, 0]], [v[0, 0], v[1, 0]], 0.3)
    np.testing.assert_allclose(out[1, 0], want1, rtol=1e-11)
    # padding first, then a valid entry past the bound: the row has no valid entry -> zeros
    out = prefill_reference(q, k, v, np.array([[-1, 0, -1, -1], [0, 1, -1, -1]], np.int32),
                            [0, 2], 0.3)
    assert np.all(out[0] == 0.0)
