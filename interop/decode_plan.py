"""Static launch plan for split-KV packed decode, shared by the Triton and the Pallas kernels.

Only static facts go in (batch, heads, head dim, ``max_seqlen_k``, the device's SM count): the
plan fixes the *grid* (B x Hkv x max_splits programs) and the tile sizes. How many of the
``max_splits`` programs of a (sequence, KV head) actually work is decided **on the device** from
that row's length (``cu_seqlens_k[s+1] - cu_seqlens_k[s]``), so the same compiled launch (CUDA
graph, jitted function) stays correct when the lengths change:

    blocks      = cdiv(len, BLOCK_N)
    n_active    = clamp(cdiv(blocks, min_blocks_per_split), 1, max_splits)
    split j < n_active covers blocks [j*blocks // n_active, (j+1)*blocks // n_active)
                  (balanced: every active split of a non-empty row gets >= 1 block, since
                   n_active <= blocks; the counts differ by at most one block). The Triton
                   kernel rounds both ends up instead (cdiv), which puts the extra blocks on
                   the first splits; either way every block is covered exactly once.

A row longer than ``max_seqlen_k`` is still covered completely (the split size grows with the
device length); ``max_seqlen_k`` only bounds the useful grid. Splits past ``n_active`` write an
empty partial (LSE = -inf) that the merge weighs 0 (or write nothing, when the merge recomputes
n_active from the same device length and masks those splits itself). A zero-length row has
n_active = 1 and its one split writes exact zeros.

Sizing rule (why): at small batch upstream runs B x Hkv x <= 8 programs on 132 SMs and is far from
the memory floor (anchors.md: B = 1 at 7.5% of HBM). The H200 sweep (bench/NOTES.md, decode v2)
found the best split count per shape at about ONE program per SM, rounded *down* to a power of
two: B x Hkv x max_splits <= SMs; rounding up (a second, partial wave) cost 4-10%, and at
B x Hkv >= SMs no split at all (max_splits = 1) was fastest (TP1 B = 128: 126 us vs 138 us).
Exception (``one_block_splits``, the Triton kernel's default since decode v5): where one split per
BLOCK_N block fits that one wave (B x Hkv x blocks <= SMs, blocks <= 2 x MAX_SPLITS_CAP), the
grid has exactly ``blocks`` splits (65 for 2051 keys), so no split streams two blocks; and where
splits of WIDE_BLOCK_N keys would still give >= SMs / 2 programs and Hkv >= 2, BLOCK_N is
WIDE_BLOCK_N (8 warps): TP1 B = 1 at 2051 keys on 132 SMs, 2 x 33 programs (decode v6c).

Device-side balance (``balance=True``, the Triton kernel's default since decode v3): the static rule
above sizes splits for rows as long as ``max_seqlen_k``, so a mixed batch at large B left its long
rows unsplit (one program streams 2051 keys while most SMs are done: TP2 B = 128 mixed ran at
0.91x of upstream). With balance every program also reads the batch's total keys
(``cu_seqlens_k[B] - cu_seqlens_k[0]``, one load) and a row gets a share of ``balance_slots``
programs proportional to its length:

    n_active = clamp(floor(len * balance_slots / (total * Hkv)), 1, max_splits),
               and at most cdiv(blocks, min_blocks_per_split)

(sum over rows and KV heads <= balance_slots + rows, so equal rows never exceed the slots: no
partial second wave). The grid keeps at least ``BALANCE_GRID_SPLITS`` splits per row so long rows
of a mixed batch can split; splits past ``n_active`` exit at once.
"""

from __future__ import annotations

import dataclasses
import math

__all__ = ["DecodePlan", "plan_decode", "next_pow2", "prev_pow2"]

# Tunables (the H200 sweep, bench/decode.py --sweep, decides; recorded in bench/NOTES.md).
# split-KV target: at most this many programs per SM for long rows (H200 sweep, decode v2: 1 beat
# 2 on 8 of 9 shapes even though 2 programs of ~200 registers/thread fit on an SM at once).
PROGRAMS_PER_SM = 1
MAX_SPLITS_CAP = 64  # most splits of one (sequence, KV head) under the power-of-two rule (the
#                     one-block rule allows up to 2x this; the Triton merge reads <= 128 in one tile)
MIN_BLOCKS_CAP = 2  # a split streams up to this many BLOCK_N blocks before another is activated
#                     (sweep: 1, 2 and 4 within 1% on saturated rows; 2 best on mixed rows)
# device-side balance: programs the rows share (per SM), and the smallest grid split count (so a
# long row of a mixed batch can split even where B x Hkv fills the GPU). Decided by the H200
# sweep (bench/decode.py --sweep, decode v3 in bench/NOTES.md).
BALANCE_SLOTS_PER_SM = 2
BALANCE_GRID_SPLITS = 4
# decode v5 (bench/NOTES.md): the softmax denominator kept per column and reduced once after the
# loop (two fewer barriers per block): geomean 1.767x vs 1.702x and 1.783x vs 1.716x upstream in
# two H200 runs (27, 26), min 0.999x / 1.010x vs 0.962x / 0.968x. Q·Kᵀ split over D slices
# (qk_split 2 / 4) was slower everywhere (1.504x / 1.611x vs 1.716x): not the default.
DEFER_ROWSUM = True
# decode v6c (bench/NOTES.md): under ``one_block_splits``, BLOCK_N of this many rows where those
# one-block splits still give >= SMs / 2 programs (TP1 B = 1: 2 x 33 = 66 programs instead of
# 2 x 65). H200 run 35, B = 1 saturated / mixed: TP1 7.00 vs 7.59 and 7.00 vs 7.42 us / 6.83 vs
# 7.91 and 6.91 vs 7.03; where it would leave fewer programs (TP2 / TP4 B = 1: 33) it lost
# 0.5-0.8 us, hence the half-the-SMs bound.
WIDE_BLOCK_N = 64


def prev_pow2(x: int) -> int:
    """Largest power of two <= x (x >= 1)."""
    return 1 << (max(1, int(x)).bit_length() - 1)


def next_pow2(x: int) -> int:
    """Smallest power of two >= x (x >= 1)."""
    return 1 << max(0, math.ceil(math.log2(max(1, x))))


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """Static decode launch plan.

    Attributes:
      head_tile: query heads per program, G padded to a power of two (>= 16 for tensor-core dots).
      block_n: key rows per inner-loop step (BLOCK_N).
      max_splits: programs per (sequence, KV head) along the row (grid dimension; a power of
        two, or the row's block count under ``one_block_splits``).
      min_blocks_per_split: a split is only activated when it gets at least this many BLOCK_N blocks.
      num_warps, num_stages: Triton launch parameters (the Pallas kernel uses num_warps/num_stages
        through its compiler params as well).
      balance_slots: 0 = the static rule (n_active from the row's blocks only); > 0 = device-side
        balance over this many programs (module docstring; Triton kernel only).
      tail_in_loop: the row's partial last block inside the pipelined loop (masked loads) instead
        of after it (Triton kernel only; decode v3b in bench/NOTES.md).
      qk_split: Q·Kᵀ computed as this many independent dots over D/qk_split columns each (1, 2
        or 4; Triton pointer path only: 1 is used with TMA, tail_in_loop or slices under 16
        columns). Why: with a 16-row head tile each warp's Q·Kᵀ is one
        chain of D/16 dependent tensor-core instructions (16 at D = 256, SASS sm_90); independent
        halves let them overlap (decode v5 in bench/NOTES.md).
      defer_rowsum: keep the softmax denominator as a [head tile, BLOCK_N] running sum and reduce
        it once after the loop, instead of a cross-warp row sum (two barriers) per block (Triton
        kernel only; decode v5).
    """

    head_tile: int
    block_n: int
    max_splits: int
    min_blocks_per_split: int
    num_warps: int
    num_stages: int
    balance_slots: int = 0
    tail_in_loop: bool = False
    qk_split: int = 1
    defer_rowsum: bool = True  # the default loop (DEFER_ROWSUM); hand-built plans run it too


def plan_decode(batch: int, num_kv_heads: int, group: int, head_dim: int, max_seqlen_k: int,
                sm_count: int = 132, *, max_splits: int | None = None,
                block_n: int | None = None, balance: bool = False,
                one_block_splits: bool = False) -> DecodePlan:
    """Plan a split-KV decode launch from static shapes.

    Args:
      batch: B sequences; num_kv_heads: Hkv; group: G = Hq / Hkv; head_dim: D (power of two).
      max_seqlen_k: static upper bound of a row's key count (host int).
      sm_count: streaming multiprocessors of the target GPU (132 on the H200).
      max_splits, block_n: overrides (tests, sweeps).
      balance: plan for the device-side balance (module docstring): at least
        BALANCE_GRID_SPLITS splits in the grid, ``balance_slots = BALANCE_SLOTS_PER_SM * sm_count``.
      one_block_splits: where one split per BLOCK_N block still fits one program per SM
        (B x Hkv x blocks <= PROGRAMS_PER_SM x sm_count, blocks <= 2 x MAX_SPLITS_CAP), use
        exactly ``blocks`` splits in the grid (not a power of two: 65 for 2051 keys), so no
        split of a ``max_seqlen_k`` row streams two blocks (the balance's grid floor still
        applies to very short rows). Where BLOCK_N is not given (D > 128: 32), the rule above
        holds for it, num_kv_heads >= 2, and one-block splits of WIDE_BLOCK_N rows would still
        give at least half as many programs as SMs, BLOCK_N is WIDE_BLOCK_N with 8 warps (TP1
        B = 1 at 2051 keys on 132 SMs; the same grid from TP2 / TP4 B = 2 measured slower). Why (H200, decode v5 in
        bench/NOTES.md): with 64 splits over 65 blocks split 0 streams two and ends ~1.5 us after
        the others (per-program timeline, run 28); 65 splits: TP2 B = 1 saturated 6.03 vs 6.57
        us, TP1 7.97 vs 8.20, TP4 6.44 vs 6.89 (run 29). Triton kernel only (its merge reads any
        split count in one tile of up to 128).

    Returns:
      DecodePlan. Source: this module's docstring (sizing rule); constants to be replaced by the
      H200 sweep recorded in bench/NOTES.md.
    """
    head_tile = max(16, next_pow2(group))
    num_warps = 4
    if block_n is None:
        block_n = 64 if head_dim <= 128 else 32
        programs = batch * num_kv_heads
        narrow, wide = (math.ceil(max_seqlen_k / n) for n in (block_n, WIDE_BLOCK_N))
        if (one_block_splits and max_splits is None and block_n < WIDE_BLOCK_N
                and num_kv_heads >= 2 and programs * narrow <= PROGRAMS_PER_SM * sm_count
                and narrow <= 2 * MAX_SPLITS_CAP and 2 * programs * wide >= sm_count):
            # one-block splits of WIDE_BLOCK_N rows still occupy half the SMs: half the
            # programs, partials and merge reads for the same keys (docstring); 8 warps, as
            # fast as 4 there (7.02 vs 7.00 us) without their register spills (ptxas sm_90: 4
            # warps 255 registers + 40 B of spills at D = 256). Only with >= 2 KV heads: the
            # same 2 x 33 grid from two sequences of one KV head (TP2 / TP4 B = 2) measured
            # 0.4-0.7 us slower than 2 x 65 (run 36); why it differs is not understood.
            block_n = WIDE_BLOCK_N
            num_warps = 8
    blocks = max(1, math.ceil(max_seqlen_k / block_n))
    if max_splits is None:
        programs = batch * num_kv_heads
        want = max(1, (PROGRAMS_PER_SM * sm_count) // programs)
        max_splits = min(prev_pow2(want), MAX_SPLITS_CAP, next_pow2(blocks))
        if one_block_splits and blocks <= min(want, 2 * MAX_SPLITS_CAP):
            max_splits = blocks
        if balance:
            max_splits = max(max_splits, min(BALANCE_GRID_SPLITS, next_pow2(blocks)))
    max_splits = max(1, int(max_splits))
    # A row as long as max_seqlen_k should use every split (small batches fill the GPU), but a
    # split should stream at least a few blocks when there are enough of them (amortises the Q
    # load and the merge): 1..MIN_BLOCKS_CAP blocks per split.
    min_blocks = max(1, min(MIN_BLOCKS_CAP, blocks // max_splits))
    # 3 stages keep two K/V tiles in flight per program; D = 256, BLOCK_N = 32: 75 KB of shared
    # memory, inside SM12x's 101,376 B (qsa-contract.md §5). Implementations still clamp stages
    # to their device's shared memory.
    num_stages = 3
    slots = BALANCE_SLOTS_PER_SM * sm_count if balance else 0
    return DecodePlan(head_tile, block_n, max_splits, min_blocks, num_warps, num_stages, slots,
                      defer_rowsum=DEFER_ROWSUM)


# =============================================================================================
# Paged decode (qsa-contract.md §2b, §2c): the static split plan shared by
# qsa_triton.decode_paged and qsa_pallas.decode_paged. (Appended as its own section so it moves
# with this file when it is renamed.)
#
# The paged kernels split the W index *columns* of a row, not its valid keys: a column's
# validity (0 <= idx < seq_lens[r], the position's slot inside the pool) is device data that can
# change under a captured graph, while W is a static shape. Split j of S covers the BLOCK_N
# chunks [j * nb // S, (j + 1) * nb // S) of the nb = cdiv(W, BLOCK_N) chunks (balanced; every
# split gets >= 1 chunk since S <= nb). A split whose columns hold no valid entry writes an
# empty partial (LSE = -inf) that the merge weighs 0; a one-split plan writes the output itself.

__all__ += ["PagedDecodePlan", "plan_decode_paged", "paged_smem_bytes",
            "BATCH_INVARIANT_SPLIT_COLS", "PAGED_MAX_SPLITS"]

#: batch-invariant mode: index columns per split (a multiple of every BLOCK_N the plan uses).
#: The split count is then cdiv(W, this) whatever the batch: 9 splits for W = 2051. Why this
#: size: fewer columns per split fill more SMs at small batch, more columns write fewer FP32
#: partials at large batch (9 splits x [G, D] floats per KV row: about 10% of the K/V bytes read
#: at D = 256 written and read back by the merge); the lead's H200 run prices it.
BATCH_INVARIANT_SPLIT_COLS = 256
#: the most splits of one (row, KV head) (the Triton merge reads every split in one tile)
PAGED_MAX_SPLITS = 128
#: shared memory per block on sm_120 / sm_121 (qsa-contract.md §5): every shipped paged plan
#: fits it whatever the device it was planned for, so a plan never depends on the part
SM12X_SMEM_BYTES = 101_376


@dataclasses.dataclass(frozen=True)
class PagedDecodePlan:
    """Static launch plan of the paged decode (both implementations).

    Attributes:
      head_tile: G padded to a power of two >= 16 (tensor-core dots; padded rows masked).
      block_n: index columns per inner-loop step (BLOCK_N).
      num_splits: splits per (row, KV head): the grid is (num_splits, R, Hkv); 1 = the split
        kernel writes the output, no partials and no merge.
      num_warps, num_stages: Triton launch parameters (the Pallas kernel passes them through
        its compiler params).
    """

    head_tile: int
    block_n: int
    num_splits: int
    num_warps: int
    num_stages: int

    def chunk_range(self, width: int, split: int) -> tuple[int, int]:
        """[first, last) BLOCK_N chunk of ``split`` for W = ``width`` (what the kernels compute
        on the device: ``j * nb // S``)."""
        nb = max(1, -(-width // self.block_n))
        return split * nb // self.num_splits, (split + 1) * nb // self.num_splits


def paged_smem_bytes(plan: PagedDecodePlan, head_dim: int, q_bytes: int = 2,
                     kv_bytes: int = 2) -> int:
    """Estimated shared memory (bytes) of the paged split kernel: (num_stages - 1) pipelined K+V
    gather tiles in the pool's dtype, the Q tile and the P tile in q's dtype, and for an FP8 pool
    one converted [BLOCK_N, D] dot operand in q's dtype per tensor. The model of
    ``qsa_triton.decode.smem_bytes`` (matches ``compiled.metadata.shared`` of the packed split
    kernel for stages >= 2) extended by the conversion tiles."""
    kv = 2 * plan.block_n * head_dim * kv_bytes
    conv = 2 * plan.block_n * head_dim * q_bytes if kv_bytes != q_bytes else 0
    return (max(plan.num_stages - 1, 1) * kv + conv + plan.head_tile * head_dim * q_bytes
            + plan.head_tile * plan.block_n * q_bytes)


def plan_decode_paged(rows: int, num_kv_heads: int, group: int, head_dim: int, width: int,
                      sm_count: int = 132, *, q_bytes: int = 2, kv_bytes: int = 2,
                      batch_invariant: bool = False,
                      smem_limit: int = SM12X_SMEM_BYTES) -> PagedDecodePlan:
    """Plan a paged decode launch from static shapes only.

    Args:
      rows: R query rows (MTP verify rows included); num_kv_heads: Hkv; group: G = Hq / Hkv
        (<= 16); head_dim: D (power of two 32..256); width: W index columns per row (>= 1).
      sm_count: streaming multiprocessors of the target GPU (132 on the H200).
      q_bytes, kv_bytes: element sizes of q and of the pool (1 for FP8 e4m3).
      batch_invariant: the schedule depends on (W, G, D, dtypes) only, never on R or the SM
        count (qsa-contract.md §2c).
      smem_limit: bytes per block the plan must fit (``paged_smem_bytes``); default sm_120 /
        sm_121's 101,376 B, so one plan is valid on every supported part.

    Returns:
      PagedDecodePlan. Rules (why):
        * BLOCK_N 32 for D > 128, else 64: a [BLOCK_N, D] gather tile of 16 KB in bf16, as the
          packed decode (``plan_decode``); head tile max(16, next_pow2(G)); 4 warps; 3 stages
          (two gathers in flight per program), lowered until the tile fits ``smem_limit``.
        * default: about one program per SM (the packed decode's H200 finding, decode v2 in
          bench/NOTES.md): num_splits = clamp(sm_count // (R x Hkv), 1, nb), nb = cdiv(W,
          BLOCK_N); so 1 split (no merge) once R x Hkv >= SMs, and at TP1 B = 1, W = 2051 one
          chunk per split (65 splits: no split streams two, decode v5).
        * batch_invariant: num_splits = cdiv(W, BATCH_INVARIANT_SPLIT_COLS) (9 at W = 2051),
          capped at nb. Cost against the default (to be measured on the H200 by the lead):
          fewer programs at small R (TP1 B = 1: 2 x 9 = 18 programs instead of 130, so the
          call is latency bound), and from R x Hkv >= SMs the FP32 partials and the merge
          launch that the default's one-split plan does without.

    Raises:
      ValueError: a non-positive size, or no plan fits ``smem_limit``.
    """
    if min(rows, num_kv_heads, group, head_dim, width, sm_count) < 1:
        raise ValueError(f"plan_decode_paged: sizes must be >= 1, got R={rows}, Hkv={num_kv_heads}, "
                         f"G={group}, D={head_dim}, W={width}, SMs={sm_count}")
    head_tile = max(16, next_pow2(group))
    block_n = 64 if head_dim <= 128 else 32
    nb = -(-width // block_n)
    if batch_invariant:
        splits = -(-width // BATCH_INVARIANT_SPLIT_COLS)
    else:
        splits = max(1, (PROGRAMS_PER_SM * sm_count) // (rows * num_kv_heads))
    splits = max(1, min(splits, nb, PAGED_MAX_SPLITS))
    plan = PagedDecodePlan(head_tile, block_n, splits, 4, 3)
    while paged_smem_bytes(plan, head_dim, q_bytes, kv_bytes) > smem_limit:
        if plan.num_stages > 2:
            plan = dataclasses.replace(plan, num_stages=plan.num_stages - 1)
        elif plan.block_n > 16 and not batch_invariant:
            # (batch-invariant plans keep BLOCK_N: the split's column range must not move)
            plan = dataclasses.replace(plan, block_n=plan.block_n // 2,
                                       num_splits=min(plan.num_splits, -(-width // (plan.block_n // 2))))
        else:
            raise ValueError(f"plan_decode_paged: no plan fits {smem_limit} B of shared memory "
                             f"(D={head_dim}, G={group}, kv_bytes={kv_bytes})")
    return plan
