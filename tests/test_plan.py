"""``interop.plan``: the split rule both decode twins use, the shared-memory model and the fit
function every backend uses (framework-free; no kernels run here)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from interop.plan import (DecodePlan, fit_shared_memory, next_pow2, plan_decode, prev_pow2,
                          smem_bytes, split_blocks)


@pytest.mark.parametrize("blocks", [1, 2, 5, 64, 65, 130, 1000])
def test_split_blocks_covers_every_block_once(blocks):
    for n in range(1, min(blocks, 130) + 1):
        ranges = [split_blocks(blocks, j, n) for j in range(n)]
        assert ranges[0][0] == 0 and ranges[-1][1] == blocks
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous, no overlap
        sizes = [hi - lo for lo, hi in ranges]
        assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
        assert sizes[0] == max(sizes) == -(-blocks // n)  # the first split: cdiv
        assert sizes[-1] == min(sizes) == blocks // n  # the last (partial block): floor
        assert split_blocks(blocks, n, n)[0] >= blocks  # past n_active: empty once clamped


def test_split_blocks_on_arrays():
    """Plain integer arithmetic: the same function runs on arrays (as on traced jax ints)."""
    blocks = np.array([65, 7, 1], np.int64)
    lo, hi = split_blocks(blocks, np.int64(3), np.array([64, 4, 1], np.int64))
    assert lo.tolist() == [4, 6, 3] and hi.tolist() == [5, 7, 4]


def test_smem_model_and_fit():
    # the qualified decode plan at D = 256: fits 101,376 B with 3 stages of 32 keys
    assert smem_bytes(head_tile=16, block_n=32, head_dim=256, num_stages=3) <= 101_376
    wide = DecodePlan(16, 64, 33, 1, 8, 3)
    assert smem_bytes(head_tile=16, block_n=64, head_dim=256, num_stages=3) > 101_376
    fitted = fit_shared_memory(wide, head_dim=256, limit=101_376)
    assert (fitted.block_n, fitted.num_stages) == (64, 2)  # stages first
    assert dataclasses.replace(fitted, num_stages=3) == wide  # nothing else changed
    assert fit_shared_memory(wide, head_dim=256, limit=None) is wide
    assert fit_shared_memory(wide, head_dim=256, limit=232_448) is wide
    # FP8 K/V tiles are half as large: 3 stages fit where bf16 needs 2
    assert fit_shared_memory(wide, head_dim=256, limit=101_376, kv_bytes=1).num_stages == 3

    @dataclasses.dataclass(frozen=True)
    class Geometry:  # any frozen dataclass with the three fields (the prefill geometries)
        head_tile: int
        block_n: int
        num_warps: int
        num_stages: int
        source: str

    g = fit_shared_memory(Geometry(16, 128, 8, 1, "table"), head_dim=256, limit=101_376)
    assert (g.block_n, g.num_stages, g.source) == (64, 1, "table")  # then a smaller BLOCK_N
    assert fit_shared_memory(Geometry(16, 256, 8, 3, "t"), head_dim=256, limit=1).block_n == 16


def test_pow2_and_plan_basics():
    assert [next_pow2(x) for x in (0, 1, 3, 16, 17)] == [1, 1, 4, 16, 32]
    assert [prev_pow2(x) for x in (1, 3, 16, 17)] == [1, 2, 16, 16]
    p = plan_decode(1, 2, 12, 256, 2051, 132)
    assert (p.head_tile, p.block_n, p.max_splits, p.balance_slots) == (16, 32, 64, 0)
    b = plan_decode(128, 1, 12, 256, 2051, 132, balance=True)
    assert (b.max_splits, b.balance_slots) == (4, 264)


def test_batch_invariant_decode_plan():
    """``plan_decode(..., batch_invariant=True)``: BLOCK_N, warps, stages and keys per split from
    (G, D) only, whatever the batch and SM count; the grid is cdiv(max_seqlen_k, 256) splits, so
    every row within the bound gets n_active = cdiv(len, 256) splits of whole BLOCK_N blocks; the
    plan fits sm_120 / sm_121's 101,376 B; no knobs."""
    from interop.plan import BATCH_INVARIANT_SPLIT_KEYS as W

    for g, d in ((12, 256), (6, 256), (3, 256), (12, 64), (16, 128)):
        plans = {plan_decode(b, hkv, g, d, 2051, sms, batch_invariant=True)
                 for b in (1, 7, 128) for hkv in (1, 2) for sms in (48, 132, 188)}
        assert len(plans) == 1
        p = plans.pop()
        assert (p.block_n, p.num_warps, p.balance_slots) == (64 if d <= 128 else 32, 4, 0)
        assert p.block_n * p.min_blocks_per_split == W and p.max_splits == 9
        assert smem_bytes(head_tile=p.head_tile, block_n=p.block_n, head_dim=d,
                          num_stages=p.num_stages) <= 101_376
        for msk in (1, 256, 257, 600, 2055, 5000):
            q = plan_decode(1, 1, g, d, msk, batch_invariant=True)
            assert q.max_splits == max(1, -(-msk // W))
            assert dataclasses.replace(q, max_splits=9) == p  # only the grid follows the bound
            for n in (x for x in (0, 1, 255, 256, 257, msk) if x <= msk):  # valid bound
                blocks = -(-n // q.block_n)
                n_active = min(max(-(-blocks // q.min_blocks_per_split), 1), q.max_splits)
                assert n_active == max(1, -(-n // W))
    for bad in ({"max_splits": 4}, {"block_n": 64}, {"balance": True}, {"one_block_splits": True}):
        with pytest.raises(ValueError, match="batch_invariant"):
            plan_decode(1, 2, 12, 256, 2051, batch_invariant=True, **bad)
