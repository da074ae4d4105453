"""The QSA indexer (``qsa-contract.md`` §4b): both packages select exactly the FP64 reference's
block set, expand exactly like ``interop.indices.expand_block_indices``, and refuse bad calls
with the same ContractError.

Exactness rule (``interop.reference.topk_set_report``): the kernels score in FP32, the reference
in FP64. Where the FP32 logits are exact -- integer-valued q and k with |values| <= 2, so every
product and partial sum is a small integer -- the selected set must *equal* the reference's,
ties included (that is how every adversarial case here is built: thousands of equal logits,
all-zero rows, ...). On random real inputs the selection must be *admissible*: a valid top-k of
the reference logits up to a bound on the FP32 scoring error.

CPU: Triton under its interpreter (fp16 dots, and bf16 through tests/triton_interp_patch.py),
Pallas in interpret mode; tiny shapes. ``-m gpu``: production shapes compiled, CUDA-graph replay
with changed context lengths, jit with changed lengths, FP8 keys.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from interop import indices as I
from interop import reference as R
from interop.contract import (ContractError, check_indexer_decode,
                              validate_indexer_decode_metadata,
                              validate_indexer_prefill_metadata)

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jnp = jax.numpy

import qsa_pallas.indexer as PI  # noqa: E402
import qsa_triton.indexer as TI  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
H, D = 4, 128
GPU = torch.cuda.is_available()


def ints(rng, shape, lo=-2, hi=2):
    return rng.integers(lo, hi + 1, size=shape).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# Adversarial decode batch (topk 512): one batch, every case a row.
def decode_adversarial(seed=0):
    rng = np.random.default_rng(seed)
    lens = np.array([0, 3, 2048, 2051, 2052, 4 * 16 * 3 + 7, 5003, 2801, 2403], np.int64)
    case = I.indexer_decode_case(lens, page_size=16, junk="mixed", seed=seed)
    q = ints(rng, (len(lens), H, D))
    kc = ints(rng, (case.pages, 16, 1, D))
    # row 7: every dot <= 0 -> every logit is 0 after ReLU: the 512 smallest ids win
    q[7] = -np.abs(q[7]) - 1
    pages7 = case.page_table[7, : -(-(2801 // 4) // 16)]
    kc[pages7] = np.abs(kc[pages7])
    # row 8: logits in {0, 1, 2, 3} (massive ties at the 512th value)
    q[8] = 0
    q[8, 0, 0] = 1
    pages8 = case.page_table[8, : -(-(2403 // 4) // 16)]
    kc[pages8, :, :, 0] = rng.integers(0, 4, size=kc[pages8, :, :, 0].shape)
    return q, kc, case


@pytest.fixture(scope="module")
def dec512():
    q, kc, case = decode_adversarial()
    ref = R.indexer_topk_decode_reference(q, kc, case.page_table, case.seq_lens)
    sel = R.indexer_select_decode_reference(q, kc, case.page_table, case.seq_lens)
    return q, kc, case, ref, sel


def _torch_decode(fn, q, kc, case, dtype=torch.float16, kdtype=None, **kw):
    return fn(torch.tensor(q, dtype=dtype), torch.tensor(kc, dtype=dtype).to(kdtype or dtype),
              torch.tensor(case.page_table), torch.tensor(case.seq_lens), **kw).numpy()


def _jax_decode(fn, q, kc, case, dtype=jnp.bfloat16, kdtype=None, **kw):
    return np.asarray(fn(jnp.asarray(q, dtype), jnp.asarray(kc, kdtype or dtype),
                         jnp.asarray(case.page_table), jnp.asarray(case.seq_lens), **kw))


def test_reference_adversarial_rows_are_what_they_claim(dec512):
    q, kc, case, ref, sel = dec512
    assert (ref[0] == -1).all() and (ref[1] == -1).all()           # empty rows
    assert np.array_equal(ref[2], np.arange(512))                   # exactly 512 blocks: all
    assert np.array_equal(ref[3], np.arange(512))
    assert (ref[4] >= 0).all() and ref[4].max() <= 512              # 513 blocks: one dropped
    assert np.array_equal(ref[7], np.arange(512))                   # all zeros: smallest ids
    logits = R.indexer_logits_decode(q, kc, case.page_table, case.seq_lens)
    assert np.isin(logits[8][np.isfinite(logits[8])] * np.sqrt(128), [0, 1, 2, 3]).all()
    assert np.array_equal(sel[1, :3], [0, 1, 2]) and (sel[1, 3:] == -1).all()
    assert np.array_equal(sel[3, :2051], np.arange(2051))           # 2048 tokens + 3 tail
    n = I.expected_valid_count(case.seq_lens.astype(np.int64))
    assert np.array_equal((sel >= 0).sum(1), n)


def test_reference_inf_scores_and_no_keys():
    """+inf is the largest score, not an invisible block (the kernels' keys order it first);
    a prefill with no compressed keys gives -1 rows."""
    x = np.array([[1.0, np.inf, -np.inf, 3.0, 2.0]])
    assert np.array_equal(R.indexer_topk(x, 2), [[1, 3]])
    q = np.ones((2, 4, 8))
    got = R.indexer_topk_prefill_reference(q, np.zeros((0, 1, 8)), [0, 0], [0, 0], topk=16)
    assert got.shape == (2, 16) and (got == -1).all()


def test_triton_decode_adversarial_exact(dec512):
    q, kc, case, ref, sel = dec512
    assert np.array_equal(_torch_decode(TI.indexer_topk_decode, q, kc, case), ref)
    # bf16 through the interpreter's patched dot, and FP8 keys (integers <= 2 are exact in e4m3)
    assert np.array_equal(_torch_decode(TI.indexer_select_decode, q, kc, case,
                                        dtype=torch.bfloat16, kdtype=torch.float8_e4m3fn), sel)


def test_pallas_decode_adversarial_exact(dec512):
    q, kc, case, ref, sel = dec512
    assert np.array_equal(_jax_decode(PI.indexer_topk_decode, q, kc, case), ref)
    assert np.array_equal(_jax_decode(PI.indexer_select_decode, q, kc, case,
                                      kdtype=jnp.float8_e4m3fn), sel)


# ---------------------------------------------------------------------------------------------
# Small top-k: many chunks per row (C = 64) and a merge over up to 10 of them.
@pytest.fixture(scope="module")
def dec16():
    rng = np.random.default_rng(1)
    lens = np.array([2560, 1, 700, 256, 257 * 4 + 1, 2047])
    case = I.indexer_decode_case(lens, page_size=16, junk="-1", seed=3)
    qi, ki = ints(rng, (6, H, D), -1, 1), ints(rng, (case.pages, 16, 1, D), -1, 1)
    qf = rng.standard_normal((6, H, D)).astype(np.float16).astype(np.float32)
    kf = rng.standard_normal((case.pages, 16, 1, D)).astype(np.float16).astype(np.float32)
    return case, (qi, ki), (qf, kf)


def _tol(q, kc):
    """FP32 scoring error bound in logit units: 4 heads x 128 terms x |q||k| x 2^-22."""
    return float(4 * D * np.abs(q).max() * np.abs(kc).max() * 2.0**-22 / np.sqrt(D))


@pytest.mark.parametrize("impl", ["triton", "pallas"])
def test_decode_many_chunks_exact_and_random_admissible(dec16, impl):
    case, (qi, ki), (qf, kf) = dec16
    plan = I.plan_indexer("decode", 6, case.page_table.shape[1] * 16, 16)
    assert plan.chunk == 64 and plan.splits == 10
    run = ((lambda q, k: _torch_decode(TI.indexer_topk_decode, q, k, case, topk=16))
           if impl == "triton" else
           (lambda q, k: _jax_decode(PI.indexer_topk_decode, q, k, case, dtype=jnp.float16,
                                     topk=16)))
    ref = R.indexer_topk_decode_reference(qi, ki, case.page_table, case.seq_lens, topk=16)
    assert np.array_equal(run(qi, ki), ref)
    logits = R.indexer_logits_decode(qf, kf, case.page_table, case.seq_lens)
    rep = R.topk_set_report(run(qf, kf), logits, 16, tol=_tol(qf, kf))
    assert rep["admissible"] == rep["rows"], rep


@pytest.mark.parametrize("impl", ["triton", "pallas"])
def test_decode_lying_page_table_follows_the_rule(dec16, impl):
    """Page ids outside the cache for visible blocks (negative, = pages, huge) score 0, and a
    seq_len past the page table's capacity ends at it: both implementations equal the
    reference, which follows the same rule (qsa-contract.md §4b)."""
    case, (qi, ki), _ = dec16
    case = dataclasses.replace(case, page_table=case.page_table.copy(),
                               seq_lens=case.seq_lens.copy())
    case.page_table[0, [1, 5]] = [-3, case.pages]      # row 0: 2560 tokens = 40 pages
    case.page_table[5, 2] = 2**31 - 1
    case.seq_lens[3] = 10**6                           # past the table's capacity
    ref = R.indexer_topk_decode_reference(qi, ki, case.page_table, case.seq_lens, topk=16)
    logits = R.indexer_logits_decode(qi, ki, case.page_table, case.seq_lens)
    assert (logits[0, 16:32] == 0).all() and np.isfinite(logits[3]).all()
    got = (_torch_decode(TI.indexer_topk_decode, qi, ki, case, topk=16) if impl == "triton"
           else _jax_decode(PI.indexer_topk_decode, qi, ki, case, dtype=jnp.float16, topk=16))
    assert np.array_equal(got, ref)


# ---------------------------------------------------------------------------------------------
# Prefill: ragged requests, a tile straddling requests, rows with 510..514 visible blocks,
# tail-only rows.
def prefill_case(q_lens, kv_lens, seed, lo=-2, hi=2):
    rng = np.random.default_rng(seed)
    rs, re, cu, pos, sl = I.prefill_row_ranges(q_lens, kv_lens)
    q = ints(rng, (rs.shape[0], H, D), lo, hi)
    k = ints(rng, (int(cu[-1]), 1, D), lo, hi)
    return q, k, rs, re, pos, sl


PREFILL_CASES = {
    512: ([20, 2, 18], [2060, 3, 4101]),
    16: ([5, 20, 1, 30, 2], [5, 300, 77, 200, 2]),
}


def clip_rows(rs, re):
    """Rows 1-3 of a case get ranges past [0, N) (a caller bug the debug validator reports; the
    kernels clip them to the existing key rows, ids stay relative to row_starts)."""
    rs, re = rs.copy(), re.copy()
    rs[1], re[1] = -7, 40          # starts before the keys
    rs[2], re[2] = 60, 10**6       # ends past them
    rs[3], re[3] = 50, 20          # reversed: empty
    return rs, re


@pytest.fixture(scope="module", params=[512, 16])
def pre(request):
    topk = request.param
    q, k, rs, re, pos, sl = prefill_case(*PREFILL_CASES[topk], seed=topk)
    if topk == 16:
        rs, re = clip_rows(rs, re)
    ref = R.indexer_topk_prefill_reference(q, k, rs, re, topk=topk)
    sel = R.indexer_select_prefill_reference(q, k, rs, re, pos, sl, topk=topk)
    return topk, (q, k, rs, re, pos, sl), ref, sel


def test_prefill_reference_covers_the_boundaries(pre):
    topk, (q, k, rs, re, pos, sl), ref, sel = pre
    n_vis = np.clip(re, 0, k.shape[0]) - np.clip(rs, 0, k.shape[0])
    n_vis = np.maximum(n_vis, 0)
    if topk == 512:
        assert {510, 511, 512, 513, 514} <= set(n_vis.tolist())
        assert (n_vis == 0).any()
        assert np.array_equal((sel >= 0).sum(1), I.expected_valid_count(pos + 1))
    else:
        with pytest.raises(ContractError):
            validate_indexer_prefill_metadata(rs, re, k.shape[0])
        assert ref[1, 0] >= 7 and (ref[3] == -1).all()
    assert np.array_equal((ref >= 0).sum(1), np.minimum(n_vis, topk))


def test_triton_prefill_exact(pre):
    """topk 512: the fused expansion; topk 16 (several chunks, clipped rows): the block ids."""
    topk, (q, k, rs, re, pos, sl), ref, sel = pre
    t = lambda a, dt=None: torch.tensor(a, dtype=dt)  # noqa: E731
    qt, kt = t(q, torch.float16), t(k, torch.float16)
    if topk == 16:  # 2-bit rounds over 16 rows at once (the default prefill plan: 1-bit)

        plan = dataclasses.replace(I.plan_indexer("prefill", q.shape[0], k.shape[0], topk),
                                   radix_bits=2)
        got = TI.indexer_topk_prefill(qt, kt, t(rs), t(re), topk=topk, plan=plan).numpy()
        assert np.array_equal(got, ref)
    else:
        got = TI.indexer_select_prefill(qt, kt, t(rs), t(re), t(pos), t(sl), topk=topk).numpy()
        assert np.array_equal(got, sel)


@pytest.mark.parametrize("skip", [True, False, 16],
                         ids=["merge_from_bound", "full_merge", "compact"])
@pytest.mark.parametrize("scores", ["ties", "zero", "rising", "narrow"])
def test_prefill_bound_pass_exact(scores, skip, monkeypatch, device="cpu"):
    """Both packages' bound pass (``IndexerPlan.bound_chunk``, forced on a small case: 32-block
    chunks, a 64-block sample, 8 rows a program, row groups of 16 so the bound buffer is reused),
    with and without the merge starting from the bits the bound and the largest candidate share
    (``merge_from_bound``): exact top-16 with many ties (integer q, k), with every logit 0 (ReLU
    of negative dots: the bound is 0, every chunk takes the radix rounds), with scores rising
    with the block id (the sample holds the lowest scores: a loose bound) and with scores in a
    narrow band (bound and top share most bits: the merge skips most rounds), rows clipped past
    the keys included. "compact": pass 1 streams each chunk's keys >= the bound (the fixup
    redoes the chunks with more than topk) and the merge compacts the counted candidates to a
    16-slot tile two chunks a step (``merge_capacity``): rows under it and rows past it (those
    narrow to their exact top-k by rounds over the chunks first) in one call."""

    topk = 16
    # request 3 reaches 150 blocks (5 chunks): chunks past the 2-chunk sample with more than
    # topk keys >= the bound (the streamed pass 1's fixup: "rising" puts the top in chunk 2)
    q, k, rs, re, pos, sl = prefill_case([5, 20, 1, 30, 2], [5, 300, 77, 600, 2], seed=5)
    rs, re = clip_rows(rs, re)
    if scores == "zero":
        q, k = -np.abs(q), np.abs(k)
    elif scores == "rising":
        n = np.arange(k.shape[0], dtype=np.float32)
        k = np.zeros_like(k)
        k[:, 0, 0] = n % 97 + 1
        q = np.zeros_like(q)
        q[:, :, 0] = 1.0
    elif scores == "narrow":  # 1 + j / 128 (exact in bf16): one exponent, ties repeat
        n = np.arange(k.shape[0], dtype=np.float32)
        k = np.zeros_like(k)
        k[:, 0, 0] = 1 + (n * 37 % 101) / 128
        q = np.zeros_like(q)
        q[:, 0, 0] = 1.0
    ref = R.indexer_topk_prefill_reference(q, k, rs, re, topk=topk)
    base = I.plan_indexer("prefill", q.shape[0], k.shape[0], topk)
    plan = dataclasses.replace(base, chunk=32, tile=32, splits=-(-k.shape[0] // 32),
                               rows_per_program=8, row_group=16, bound_chunk=64,
                               merge_from_bound=skip is not False,
                               merge_capacity=0 if isinstance(skip, bool) else skip)
    monkeypatch.setattr(I.IndexerPlan, "compact_chunks", property(lambda self: 2))
    assert plan.problem("prefill", k.shape[0], topk) is None and plan.splits >= 4
    t = lambda a, dt=None: torch.tensor(a, dtype=dt, device=device)  # noqa: E731
    got = TI.indexer_topk_prefill(t(q, torch.float16), t(k, torch.float16), t(rs), t(re),
                                  topk=topk, plan=plan).cpu().numpy()
    assert np.array_equal(got, ref)
    a = jnp.asarray
    got = PI.indexer_topk_prefill(a(q, jnp.bfloat16), a(k, jnp.bfloat16), a(rs), a(re),
                                  topk=topk, plan=plan)
    assert np.array_equal(np.asarray(got), ref)


@pytest.mark.gpu
@pytest.mark.parametrize("scores", ["ties", "zero", "rising", "narrow"])
def test_gpu_prefill_streamed_and_compacted_exact(scores, monkeypatch):
    """``test_prefill_bound_pass_exact``'s streamed pass 1, fixup and compacting merge (rows
    under and past the merge tile) compiled: every thread of a CTA, the in-place compaction's
    barriers real."""
    test_prefill_bound_pass_exact(scores, 16, monkeypatch, device="cuda")


def test_pallas_prefill_exact(pre):
    topk, (q, k, rs, re, pos, sl), ref, sel = pre
    a = jnp.asarray
    qj, kj = a(q, jnp.bfloat16), a(k, jnp.bfloat16)
    if topk == 16:
        got = PI.indexer_topk_prefill(qj, kj, a(rs), a(re), topk=topk)
        assert np.array_equal(np.asarray(got), ref)
    else:
        got = PI.indexer_select_prefill(qj, kj, a(rs), a(re), a(pos), a(sl), topk=topk)
        assert np.array_equal(np.asarray(got), sel)


# ---------------------------------------------------------------------------------------------
# Expansion
def expansion_rows(n_lengths=5000, seed=0):
    """Every visible length 1..n (row p = L - 1, bound L) with indexer-like selections (all
    blocks when they fit, else 512 strata + recent blocks, ascending), plus 40 junk rows.

    Returns:
      (block_ids int32 [n, 512], positions, seq_lens, clean bool [n]: rows left as the indexer
      makes them).
    """
    vis = np.arange(1, n_lengths + 1, dtype=np.int64)
    blocks = I.select_blocks(vis, np.zeros_like(vis), seed=seed)
    big = np.iinfo(np.int64).max
    blocks = np.sort(np.where(blocks < 0, big, blocks), 1)
    blocks = np.where(blocks == big, -1, blocks)
    pos, sl = vis - 1, vis.copy()
    rng = np.random.default_rng(seed)
    junk = rng.choice(n_lengths, 40, replace=False)
    blocks[junk[:10], :5] = rng.integers(10**6, 2**31 - 1, size=(10, 5))   # ids past the bound
    blocks[junk[10:20], ::7] = -5                                          # holes, any value < 0
    sl[junk[20:30]] = rng.integers(0, 300, size=10)                        # short bounds
    pos[junk[30:35]] = -1                                                  # no causal row
    blocks[junk[35:40]] = rng.permutation(blocks[junk[35:40]].T).T         # not valid-first
    clean = np.ones(n_lengths, bool)
    clean[junk] = False
    return blocks.astype(np.int32), pos.astype(np.int32), sl.astype(np.int32), clean


@pytest.fixture(scope="module")
def exp_rows():
    b, p, s, clean = expansion_rows()
    return b, p, s, clean, I.expand_block_indices(b, p, s)


def test_expansion_reference_counts(exp_rows):
    b, p, s, clean, ref = exp_rows
    n = (ref >= 0).sum(1)
    assert np.array_equal(n[clean], I.expected_valid_count(p[clean] + 1))
    r = ref[clean].astype(np.int64)
    assert (np.diff(r, axis=1)[r[:, 1:] >= 0] > 0).all()  # ascending, valid first
    assert ((r >= 0) == (np.arange(r.shape[1]) < n[clean][:, None])).all()


def test_pallas_expansion_every_length_1_to_5000(exp_rows):
    b, p, s, _, ref = exp_rows
    got = PI.expand_block_indices(jnp.asarray(b), jnp.asarray(p), jnp.asarray(s))
    assert np.array_equal(np.asarray(got), ref)


def test_triton_expansion_lengths(exp_rows):
    """The interpreter runs one program per row: every length 1..300, the 2040..2070 window,
    every junk row and a random sample (the vectorised paths cover all 5000)."""
    b, p, s, clean, ref = exp_rows
    rng = np.random.default_rng(7)
    junky = np.nonzero(~clean)[0]
    rows = np.unique(np.concatenate([np.arange(300), np.arange(2039, 2070), junky,
                                     rng.choice(5000, 60, replace=False)]))
    got = TI.expand_block_indices(torch.tensor(b[rows]), torch.tensor(p[rows]),
                                  torch.tensor(s[rows]))
    assert np.array_equal(got.numpy(), ref[rows])


@pytest.mark.parametrize("ratio", [3, 4])
def test_expansion_extreme_positions_agree(ratio):
    """Positions at the int32 ends and below 0: the tail is computed without p + 1 (no wrap)
    and holds tokens >= 0 only, the same in the reference and both packages."""
    big = 2**31 - 1
    p = np.array([big, big - 1, big, -1, -6, -(2**31), 0, 5], np.int32)
    s = np.array([big, big, 7, 3, -5, -(2**31), 1, 6], np.int32)
    b = np.full((8, 4), -1, np.int32)
    b[6:, 0] = 0
    b[1, 0] = big // ratio  # its last token is past 2^31 - 1, its first ones are not
    ref = I.expand_block_indices(b, p, s, ratio=ratio, token_topk=4 * ratio)
    assert ref.min() >= -1
    first = {3: [big - 1, big - 1], 4: [-1, big - 3]}[ratio]  # rows 0, 1: the tail's / block's
    assert ref[:2, 0].tolist() == first and (ref[2:6] == -1).all()
    got_p = PI.expand_block_indices(jnp.asarray(b), jnp.asarray(p), jnp.asarray(s),
                                    compress_ratio=ratio)
    got_t = TI.expand_block_indices(torch.tensor(b), torch.tensor(p), torch.tensor(s),
                                    compress_ratio=ratio)
    assert np.array_equal(np.asarray(got_p), ref)
    assert np.array_equal(got_t.numpy(), ref)


def test_fused_select_is_topk_then_expansion_for_junk_lengths():
    """Negative and zero seq_lens: the fused decode selection equals the standalone expansion of
    its block ids (no tail at all), in both packages."""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((3, 4, 32)).astype(np.float16)
    kc = rng.standard_normal((4, 4, 1, 32)).astype(np.float16)
    pt = np.tile(np.arange(4, dtype=np.int32), (3, 1))
    sl = np.array([-5, 0, 7], np.int32)
    for mod, cv in ((TI, torch.tensor), (PI, jnp.asarray)):
        args = [cv(x) for x in (q, kc, pt, sl)]
        fused = np.asarray(mod.indexer_select_decode(*args, topk=16))
        blocks = mod.indexer_topk_decode(*args, topk=16)
        two = np.asarray(mod.expand_block_indices(blocks, cv(sl - 1), cv(sl)))
        assert np.array_equal(fused, two), mod.__name__
        assert (fused[:2] == -1).all() and fused.min() >= -1


# ---------------------------------------------------------------------------------------------
# Contract
BAD = [
    ("q", lambda q, kc, pt, sl: (q.astype(np.float32), kc, pt, sl), {}),
    ("q", lambda q, kc, pt, sl: (np.zeros((2, 17, 128), np.float16), kc, pt, sl), {}),
    ("k_cache", lambda q, kc, pt, sl: (q, kc[:, :, None].repeat(2, 2)[:, :, :, 0], pt, sl), {}),
    ("k_cache", lambda q, kc, pt, sl: (q, kc[..., :64], pt, sl), {}),
    ("page_table", lambda q, kc, pt, sl: (q, kc, pt.astype(np.int64), sl), {}),
    ("page_table", lambda q, kc, pt, sl: (q, kc, pt[:1], sl), {}),
    ("seq_lens", lambda q, kc, pt, sl: (q, kc, pt, sl[:1]), {}),
    ("topk", lambda q, kc, pt, sl: (q, kc, pt, sl), {"topk": 500}),
    ("compress_ratio", lambda q, kc, pt, sl: (q, kc, pt, sl), {"compress_ratio": 1}),
    ("k_cache", lambda q, kc, pt, sl: (q, kc[:, :8], pt, sl), {"strict": True}),
]


@pytest.mark.parametrize("arg,make,kw", BAD)
def test_bad_decode_calls_raise_the_same_error_before_launch(arg, make, kw):
    q = np.zeros((2, H, D), np.float16)
    kc = np.zeros((3, 16, 1, D), np.float16)
    pt = np.zeros((2, 2), np.int32)
    sl = np.zeros((2,), np.int32)
    args = [np.ascontiguousarray(a) for a in make(q, kc, pt, sl)]
    with pytest.raises(ContractError) as e_np:
        check_indexer_decode(*args, **kw)
    assert e_np.value.arg == arg
    t = [torch.tensor(a) for a in args]
    with pytest.raises(ContractError) as e_t:
        TI.indexer_topk_decode(*t, **kw)
    assert str(e_t.value) == str(e_np.value)
    if any(a.dtype == np.int64 for a in args):
        return  # jax narrows int64 to int32 (x64 off): nothing to refuse on that side
    j = [jnp.asarray(a) for a in args]
    with pytest.raises(ContractError) as e_j:
        PI.indexer_topk_decode(*j, **kw)
    assert str(e_j.value) == str(e_t.value)
    assert "Qualified envelope: indexer" in str(e_t.value)


def test_other_contract_errors():
    t = torch.zeros
    with pytest.raises(ContractError, match="'k'"):
        TI.indexer_topk_prefill(t(4, H, D, dtype=torch.float16), t(9, 1, 64, dtype=torch.float16),
                                t(4, dtype=torch.int32), t(4, dtype=torch.int32))
    with pytest.raises(ContractError, match="'positions'"):
        PI.indexer_select_prefill(jnp.zeros((4, H, D), jnp.float16), jnp.zeros((9, 1, D), jnp.float16),
                                  jnp.zeros(4, jnp.int32), jnp.zeros(4, jnp.int32),
                                  jnp.zeros(3, jnp.int32), jnp.zeros(4, jnp.int32))
    with pytest.raises(ContractError, match="'block_ids'"):
        TI.expand_block_indices(t(3, 512, dtype=torch.int64), t(3, dtype=torch.int32),
                                t(3, dtype=torch.int32))
    with pytest.raises(ContractError, match="'k'"):  # fp8 q needs fp8 keys
        PI.indexer_topk_prefill(jnp.zeros((4, H, D), jnp.float8_e4m3fn),
                                jnp.zeros((9, 1, D), jnp.bfloat16), jnp.zeros(4, jnp.int32),
                                jnp.zeros(4, jnp.int32))
    with pytest.raises(ContractError, match="'q'"):  # torch tensors into the JAX entry point
        PI.indexer_topk_decode(t(2, H, D), t(3, 16, 1, D), t(2, 2, dtype=torch.int32),
                               t(2, dtype=torch.int32))


def test_both_packages_export_the_shared_names_with_the_same_parameters():
    """``interop.indices.INDEXER_API``: in both packages' ``__all__``, with the same parameter
    names, order, kinds and defaults but for Pallas's own ``interpret``."""
    import inspect

    assert set(I.INDEXER_API) <= set(TI.__all__) and set(I.INDEXER_API) <= set(PI.__all__)
    for name in I.INDEXER_API:
        pt = inspect.signature(getattr(TI, name)).parameters.values()
        pj = inspect.signature(getattr(PI, name)).parameters.values()
        assert ([(p.name, p.kind, p.default) for p in pt]
                == [(p.name, p.kind, p.default) for p in pj if p.name != "interpret"]), name


def test_debug_validator_flags_decode_metadata():
    case = I.indexer_decode_case([100, 70], page_size=16, junk="mixed")
    validate_indexer_decode_metadata(case.page_table, case.seq_lens, case.pages, 16)
    bad = case.page_table.copy()
    bad[0, 0] = case.pages
    with pytest.raises(ContractError, match="indexer_topk_decode: argument 'page_table'"):
        validate_indexer_decode_metadata(bad, case.seq_lens, case.pages, 16)
    with pytest.raises(ContractError, match="qsa_decode_step: argument 'index_page_table'"):
        validate_indexer_decode_metadata(bad, case.seq_lens, case.pages, 16,
                                         fn="qsa_decode_step", page_table_arg="index_page_table")
    with pytest.raises(ContractError, match="seq_lens"):
        validate_indexer_decode_metadata(case.page_table, case.seq_lens * 4, case.pages, 16)
    # misuse of the validator's own arguments is named, never truncated
    for args, arg in (((case.page_table.astype(np.float32), case.seq_lens, case.pages, 16),
                       "page_table"),
                      ((case.page_table, case.seq_lens, np.array([case.pages]), 16), "pages"),
                      ((case.page_table, case.seq_lens, case.pages, 16.0), "page_size")):
        with pytest.raises(ContractError) as info:
            validate_indexer_decode_metadata(*args)
        assert info.value.arg == arg, str(info.value)
    with pytest.raises(ContractError) as info:
        validate_indexer_prefill_metadata(np.zeros(2), np.ones(2, np.int32), 4)
    assert info.value.arg == "row_starts"


def test_plan_is_static_and_bounded():

    for b in (1, 16, 64, 128):
        for ctx in (8192, 32768, 131072, 262144, 1 << 20):
            p = I.plan_indexer("decode", b, ctx // 4, 512)
            # rows of <= 8 x topk blocks: chunks of topk (pass 1 keeps them all), else 2 x topk
            assert p.chunk >= (512 if ctx // 4 <= 4096 else 1024) and p.chunk & (p.chunk - 1) == 0
            assert p.splits * p.chunk >= ctx // 4 and p.splits_pad * 512 <= 16384
    for ctx in (32768, 131072, 262144):
        p = I.plan_indexer("prefill", 8192, ctx // 4, 512)
        assert p.row_group % p.rows_per_program == 0
        assert p.row_group * p.splits * 512 * 8 <= 256 << 20
    assert I.plan_indexer("prefill", 8192, 8192, 512).row_group == 8192
    # decode pass 1: 4 warps, 8 only for 8192-block chunks of 64-block tiles (sm_12x shared
    # memory), where 4 spill
    sm12x = dict(smem_per_block=101_376, sm_count=188)
    warps = {(b, ctx, sm): (p.chunk, p.tile, p.num_warps)
             for b, ctx, sm in ((16, 32768, 0), (128, 131072, 0), (128, 131072, 1),
                                (128, 32768, 1))
             for p in [I.plan_indexer("decode", b, ctx // 4, 512, **(sm12x if sm else {}))]}
    assert warps == {(16, 32768, 0): (1024, 128, 4), (128, 131072, 0): (8192, 128, 4),
                     (128, 131072, 1): (8192, 64, 8), (128, 32768, 1): (4096, 64, 4)}
    # the prefill merge (compacting: a 2048-candidate tile at 32k, 8192 at 128k): 4 warps, but
    # 8 for the Pallas build's 8192 (32 candidates a thread)
    widths = {(ctx, be): I.plan_indexer("prefill", 8192, ctx // 4, 512, backend=be)
              for ctx in (32768, 131072) for be in ("triton", "pallas")}
    assert {key: (p.merge_capacity, p.bound_chunk, p.merge_warps)
            for key, p in widths.items()} == {
        (32768, "triton"): (2048, 2048, 4), (32768, "pallas"): (2048, 2048, 4),
        (131072, "triton"): (8192, 4096, 4), (131072, "pallas"): (8192, 4096, 8)}
    # past 64k blocks (256k tokens) the chunk doubles, 4 rows a program: no bound, no compaction
    assert I.plan_indexer("prefill", 8192, 65536, 512).merge_capacity == 0
    # the bound pass runs bound_chunk // tile tiles: a sample smaller than a tile is refused
    p = dataclasses.replace(I.plan_indexer("prefill", 4, 60, 16), chunk=64, tile=64, splits=1,
                            rows_per_program=4, row_group=4, bound_chunk=32)
    assert ">= tile 64, got 32" in p.problem("prefill", 60, 16)
    with pytest.raises(ValueError, match="backend"):
        I.plan_indexer("prefill", 8192, 8192, 512, backend="cuda")


def test_plan_override_same_result_and_bad_plan_refused(dec16):
    """The selection depends neither on the chunking (the tie rule is global) nor on the radix
    width: sweep plans with 4x larger chunks and 1-, 3-, 4- and 8-bit rounds (the scalar round,
    packed pairs, a 255-threshold round) give the reference's ids; a plan that cannot cover the
    rows, a plan with an impossible launch field, or something that is not a plan, is refused
    before launch."""

    case, (qi, ki), _ = dec16
    cap = case.page_table.shape[1] * 16
    plan = I.plan_indexer("decode", 6, cap, 16)
    big = dataclasses.replace(plan, chunk=256, splits=-(-cap // 256))
    ref = R.indexer_topk_decode_reference(qi, ki, case.page_table, case.seq_lens, topk=16)
    a = _torch_decode(TI.indexer_topk_decode, qi, ki, case, topk=16,
                      plan=dataclasses.replace(big, radix_bits=1, merge_radix_bits=4))
    assert np.array_equal(a, ref)
    b = _jax_decode(PI.indexer_topk_decode, qi, ki, case, dtype=jnp.float16, topk=16,
                    plan=dataclasses.replace(big, radix_bits=3, merge_radix_bits=8))
    assert np.array_equal(b, ref)
    for bad, why in ((dataclasses.replace(plan, splits=1), "splits x chunk"),
                     (dataclasses.replace(plan, row_group=0), "row_group >= 1"),
                     (dataclasses.replace(plan, num_warps=3), "powers of two"),
                     (dataclasses.replace(plan, merge_warps=0), "powers of two"),
                     (dataclasses.replace(plan, num_stages=0), "num_stages 1..8"),
                     (dataclasses.replace(plan, chunk=float(plan.chunk)), "Python int.*chunk="),
                     (dataclasses.replace(plan, splits=np.int64(plan.splits)), "splits=np.int64"),
                     (dataclasses.replace(plan, pdl="no"), "a bool; got pdl='no' in IndexerPlan"),
                     (dataclasses.asdict(plan), "IndexerPlan.*got dict")):
        with pytest.raises(ContractError, match=f"'plan'.*{why}"):
            _torch_decode(TI.indexer_topk_decode, qi, ki, case, topk=16, plan=bad)
        with pytest.raises(ContractError, match=f"'plan'.*{why}"):
            _jax_decode(PI.indexer_topk_decode, qi, ki, case, topk=16, plan=bad)


def test_jit_new_lengths_do_not_recompile(dec16):
    case, (qi, ki), _ = dec16
    args = (jnp.asarray(qi, jnp.float16), jnp.asarray(ki, jnp.float16),
            jnp.asarray(case.page_table))
    f = jax.jit(lambda q, k, pt, sl: PI.indexer_topk_decode(q, k, pt, sl, topk=16))
    a = f(*args, jnp.asarray(case.seq_lens))
    n = f._cache_size()
    sl2 = np.maximum(case.seq_lens - 37, 0).astype(np.int32)
    b = f(*args, jnp.asarray(sl2))
    assert f._cache_size() == n
    assert np.array_equal(np.asarray(b), R.indexer_topk_decode_reference(
        qi, ki, case.page_table, sl2, topk=16))
    assert not np.array_equal(np.asarray(a), np.asarray(b))


# ---------------------------------------------------------------------------------------------
# Ahead-of-time compiles for CUDA without a GPU: both packages, sm_90 and sm_120 (101,376 B).
_TRITON_AOT = r"""
import json, os, re, sys
os.environ.pop("TRITON_INTERPRET", None)
from interop.validate.compile import compile_triton_configs, triton_indexer_configs
picks = json.loads(sys.argv[1])
out = []
for arch, pick in picks.items():
    cfgs = [c for c in triton_indexer_configs(arch) if re.fullmatch(pick, c["name"])]
    for r in compile_triton_configs(arch, cfgs):
        out.append(dict(arch=arch, name=r.name, shared=r.shared, limit=r.smem_limit, regs=r.regs,
                        spill=r.spill_bytes, fits=r.fits, error=r.error))
print(json.dumps(out))
"""


def test_triton_kernels_fit_sm90_and_sm120():
    """The largest pass-1 decode program (8192 keys: the most registers; three 32 KB key buffers
    on sm_90, 16 KB on sm_120) compiles for sm_90 and sm_120, and the prefill pass 1 (streamed
    8 x 1024 keys, and its fixup) and its bound passes (4 x 2048 at 32k, 4 x 4096 at 128k) for
    sm_120, within shared memory and registers, the decode and the streamed pass 1 without
    spills (every configuration of both archs: ``qsa compile``)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    picks = {"sm_90": r"indexer_decode_C8192_T128_rb2_bf16",
             "sm_120": r"indexer_decode_C8192_T64_rb2_bf16"
                       r"|indexer_prefill_C1024_T64_bm8_bound1_counts[12]"
                       r"|indexer_prefill_C(2048|4096)_T64_bm4_bound2_counts0"}
    proc = subprocess.run([sys.executable, "-c", _TRITON_AOT, json.dumps(picks)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("[")]
    assert lines, proc.stderr[-3000:]
    rows = json.loads(lines[-1])
    assert len(rows) == 6, rows
    assert all(r["fits"] and r["shared"] <= r["limit"] for r in rows), rows
    assert all(r["shared"] <= 101_376 for r in rows if r["arch"] == "sm_120"), rows
    # pass-1 decode and the streamed prefill: no spills (the key stream must not wait on local
    # memory)
    # (the sm_90 8192-key decode program at 4 warps: 255 registers, up to 16 B spilled under
    # some Triton versions; 4 warps, two programs an SM, measured faster than 8)
    assert all(r["spill"] in (0, None) or r["arch"] == "sm_90" and r["spill"] <= 16 for r in rows
               if "_decode_" in r["name"] or r["name"].endswith("_counts1")), rows


def test_pallas_kernels_lower_for_cuda_and_fit_sm120():
    """Every kernel lowers for CUDA (decode with FP8 keys, prefill); the decode pass-1 kernel
    (the one with pipelined key tiles) compiles for sm_120 within 101,376 B."""
    from interop.arch import KNOWN_ARCHS
    from interop.validate.compile import pallas_indexer_cases
    from qsa_pallas import _compat as C

    kind = "NVIDIA RTX PRO 6000 Blackwell Workstation Edition"
    cases = pallas_indexer_cases(kind, k_dtype="float8_e4m3fn")
    for name, fn, args in cases:  # prefill: the bound pass and the streamed pass's fixup
        mods = {m.name for m in C.triton_modules(C.lower_for_device_kind(fn, args, kind))}
        n = 2 if "decode" in name else 4
        assert len(mods) == n and "qsa_indexer_merge" in mods, (name, mods)
    chunk = next(m for m in C.triton_modules(C.lower_for_device_kind(*cases[0][1:], kind))
                 if m.name == "qsa_indexer_decode_chunk")
    assert C.compile_ttir(chunk, 120)["shared"] <= KNOWN_ARCHS["sm_120"].smem_per_block
    # the prefill kernels at 128k (streamed pass 1, its fixup, the compacting merge) compile:
    # Triton's verifier, not the lowering, refuses a loop bound of another type
    for m in C.triton_modules(C.lower_for_device_kind(*cases[3][1:], kind)):
        assert C.compile_ttir(m, 90)["shared"] <= KNOWN_ARCHS["sm_90"].smem_per_block, m.name


# ---------------------------------------------------------------------------------------------
# GPU (H200): production shapes, compiled.
def _gpu_decode_inputs(b, ctx, seed, dtype, kdtype=None):
    """Integer-valued q/k (exact FP32 logits) at production size; every row a different length
    around ``ctx`` (not multiples of 4 or 16), page table scattered, junk past each row."""
    rng = np.random.default_rng(seed)
    lens = np.clip(ctx - rng.integers(0, 97, size=b), 0, None)
    lens[0] = ctx
    case = I.indexer_decode_case(lens, page_size=16, junk="mixed", seed=seed,
                                 max_pages=-(-ctx // 64))
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randint(-2, 3, (b, H, D), device="cuda", dtype=torch.int8, generator=g).to(dtype)
    kc = torch.randint(-2, 3, (case.pages, 16, 1, D), device="cuda", dtype=torch.int8,
                       generator=g).to(kdtype or dtype)
    return case, q, kc


def _check_rows(out, q, kc, case, rows, expand=False):
    """Row-by-row FP64 reference on the row's own pages only (the cache is up to 2 GiB)."""
    fn = R.indexer_select_decode_reference if expand else R.indexer_topk_decode_reference
    for r in rows:
        n_pages = -(-(int(case.seq_lens[r]) // 4) // 16)
        pages = torch.tensor(case.page_table[r, :n_pages].astype(np.int64), device=kc.device)
        kr = kc[pages].float().cpu().numpy()
        pt = np.arange(max(n_pages, 1), dtype=np.int32)[None]
        ref = fn(q[r:r + 1].float().cpu().numpy(), kr, pt, case.seq_lens[r:r + 1])
        assert np.array_equal(out[r], ref[0]), f"row {r}"


@pytest.mark.gpu
@pytest.mark.parametrize("b,ctx", [(1, 8192), (1, 262144), (16, 32768), (16, 131072),
                                   (64, 32768), (128, 8192), (128, 262144)])
def test_gpu_decode_production_exact(b, ctx):
    from interop.dlpack import to_jax

    case, q, kc = _gpu_decode_inputs(b, ctx, seed=b + ctx, dtype=torch.bfloat16)
    pt = torch.tensor(case.page_table, device="cuda")
    sl = torch.tensor(case.seq_lens, device="cuda")
    out_t = TI.indexer_select_decode(q, kc, pt, sl).cpu().numpy()
    rows = sorted({0, b - 1, b // 2})
    _check_rows(out_t, q, kc, case, rows, expand=True)
    torch.cuda.synchronize()
    out_j = PI.indexer_select_decode(to_jax(q), to_jax(kc), to_jax(pt), to_jax(sl))
    assert np.array_equal(np.asarray(out_j), out_t)
    blocks = TI.indexer_topk_decode(q, kc, pt, sl)
    _check_rows(blocks.cpu().numpy(), q, kc, case, rows[:1])
    ex = TI.expand_block_indices(blocks, sl - 1, sl)
    assert np.array_equal(ex.cpu().numpy(), out_t)


@pytest.mark.gpu
@pytest.mark.parametrize("b,ctx", [(16, 32768)])
def test_gpu_plan_variants_and_pdl_same_selection(b, ctx):
    """The default plan (merge launched with PDL where pass 1 is one wave), the same without
    PDL, and the bench's variants (1-bit rounds in pass 1; twice the chunk) select the same token
    rows, equal to the FP64 reference on a sampled row."""

    case, q, kc = _gpu_decode_inputs(b, ctx, seed=3 * b + ctx, dtype=torch.bfloat16)
    pt = torch.tensor(case.page_table, device="cuda")
    sl = torch.tensor(case.seq_lens, device="cuda")
    plan = TI.indexer_plan_for("decode", b, pt.shape[1] * 16, 512, q.device)
    out = TI.indexer_select_decode(q, kc, pt, sl).cpu().numpy()
    _check_rows(out, q, kc, case, [b - 1], expand=True)
    for p in (dataclasses.replace(plan, pdl=not plan.pdl),
              dataclasses.replace(plan, radix_bits=1),
              dataclasses.replace(plan, chunk=2 * plan.chunk, splits=-(-plan.splits // 2))):
        got = TI.indexer_select_decode(q, kc, pt, sl, plan=p).cpu().numpy()
        assert np.array_equal(got, out), p


@pytest.mark.gpu
def test_gpu_decode_fp8_keys_and_adversarial(dec512):
    q, kc, case, ref, sel = dec512
    dev = dict(device="cuda")
    args = (torch.tensor(q, **dev, dtype=torch.bfloat16),
            torch.tensor(kc, **dev).to(torch.float8_e4m3fn),
            torch.tensor(case.page_table, **dev), torch.tensor(case.seq_lens, **dev))
    assert np.array_equal(TI.indexer_topk_decode(*args).cpu().numpy(), ref)
    assert np.array_equal(TI.indexer_select_decode(*args).cpu().numpy(), sel)
    assert np.array_equal(_jax_decode(PI.indexer_select_decode, q, kc, case,
                                      kdtype=jnp.float8_e4m3fn), sel)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_with_changed_lengths():
    b, ctx = 16, 32768
    case, q, kc = _gpu_decode_inputs(b, ctx, seed=11, dtype=torch.bfloat16)
    pt = torch.tensor(case.page_table, device="cuda")
    sl = torch.tensor(case.seq_lens, device="cuda")
    TI.indexer_select_decode(q, kc, pt, sl)  # compile before capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode="thread_local"):
        out = TI.indexer_select_decode(q, kc, pt, sl)
    rng = np.random.default_rng(5)
    for shrink in ([0] * b, rng.integers(0, ctx, size=b), rng.integers(0, 9, size=b)):
        new = np.maximum(case.seq_lens - np.asarray(shrink), 0).astype(np.int32)
        sl.copy_(torch.tensor(new))
        g.replay()
        torch.cuda.synchronize()
        changed = I.IndexerDecodeCase(new, case.page_table, case.pages, 16)
        _check_rows(out.cpu().numpy(), q, kc, changed, [0, 7, 15], expand=True)
        assert np.array_equal(out.cpu().numpy(), TI.indexer_select_decode(q, kc, pt, sl).cpu().numpy())


@pytest.mark.gpu
@pytest.mark.parametrize("ctx", [32768, 131072])
def test_gpu_prefill_8192_rows_exact(ctx):
    q_lens, kv_lens = [8192], [ctx]
    q, k, rs, re, pos, sl = prefill_case(q_lens, kv_lens, seed=ctx)
    dev = dict(device="cuda")
    args = [torch.tensor(q, **dev, dtype=torch.bfloat16), torch.tensor(k, **dev, dtype=torch.bfloat16)]
    meta = [torch.tensor(a, **dev) for a in (rs, re, pos, sl)]
    out = TI.indexer_select_prefill(*args, *meta).cpu().numpy()
    rows = [0, 1, 4095, 8191]
    ref = R.indexer_select_prefill_reference(q[rows], k, rs[rows], re[rows], pos[rows], sl[rows])
    assert np.array_equal(out[rows], ref)
    a = jnp.asarray
    out_j = PI.indexer_select_prefill(a(q, jnp.bfloat16), a(k, jnp.bfloat16), a(rs), a(re),
                                      a(pos), a(sl))
    assert np.array_equal(np.asarray(out_j), out)


@pytest.mark.gpu
def test_gpu_sanitizer_small():
    """Small shapes for ``compute-sanitizer --tool memcheck`` (every kernel, junk page tables,
    straddling prefill tiles, rows past the keys)."""
    q, kc, case = decode_adversarial(seed=2)
    dev = dict(device="cuda")
    args = (torch.tensor(q, **dev, dtype=torch.bfloat16), torch.tensor(kc, **dev, dtype=torch.bfloat16),
            torch.tensor(case.page_table, **dev), torch.tensor(case.seq_lens, **dev))
    ref = R.indexer_select_decode_reference(q, kc, case.page_table, case.seq_lens)
    assert np.array_equal(TI.indexer_select_decode(*args).cpu().numpy(), ref)
    q, k, rs, re, pos, sl = prefill_case(*PREFILL_CASES[512], seed=3)
    t = [torch.tensor(a, **dev) for a in (rs, re, pos, sl)]
    out = TI.indexer_select_prefill(torch.tensor(q, **dev, dtype=torch.bfloat16),
                                    torch.tensor(k, **dev, dtype=torch.bfloat16), *t)
    assert np.array_equal(out.cpu().numpy(),
                          R.indexer_select_prefill_reference(q, k, rs, re, pos, sl))
    b, p, s, _ = expansion_rows(600)
    got = TI.expand_block_indices(*(torch.tensor(a, **dev) for a in (b, p, s)))
    assert np.array_equal(got.cpu().numpy(), I.expand_block_indices(b, p, s))
