"""Launch plans shared by the Triton and the Pallas kernels: the split-KV decode plan, the split
rule, one shared-memory model and one fit function (stdlib only), so a device and shape launch the
same tiles in both implementations.

Decode plan. Only static facts go in (B, heads, D, ``max_seqlen_k``, the SM count): the plan fixes
the grid (B x Hkv x max_splits programs) and the tiles. How many splits of a (sequence, KV head)
work is decided on the device from that row's length, so a captured launch (CUDA graph, jitted
function) stays correct when lengths change:

    blocks   = cdiv(len, BLOCK_N)
    n_active = clamp(cdiv(blocks, min_blocks_per_split), 1, max_splits)
    split j < n_active covers blocks ``split_blocks(blocks, j, n_active)``

A row longer than ``max_seqlen_k`` is still covered (splits grow with the device length); the
bound only sizes the grid. Splits past ``n_active`` write nothing the merge uses; a zero-length
row has n_active = 1 and its split writes exact zeros.

Sizing (bench/NOTES.md, "Decode, Triton", "Structure"): the H200 sweep found
the best split count at about one program per SM, rounded down to a power of two
(B x Hkv x max_splits <= SMs); a partial second wave cost more, and at B x Hkv >= SMs no split.

One-block splits (``one_block_splits``, the Triton default): where one split per BLOCK_N block
fits that wave (B x Hkv x blocks <= SMs, blocks <= 2 x MAX_SPLITS_CAP) the grid has exactly
``blocks`` splits, so no split streams two blocks and ends after the others; where splits of
WIDE_BLOCK_N keys still give >= SMs / 2 programs and Hkv >= 2, BLOCK_N is WIDE_BLOCK_N, 8 warps.
Such a plan has one stage (nothing to prefetch); every other plan 3.

Device-side balance (``balance=True``, the Triton default): every program also reads the batch's
total keys (one load) and a row gets a share of ``balance_slots`` programs proportional to its
length, so the long rows of a mixed batch split too:

    n_active = clamp(floor(len * balance_slots / (total * Hkv)), 1, max_splits),
               and at most cdiv(blocks, min_blocks_per_split)

(summed over rows and heads <= balance_slots + rows); the grid keeps >= ``BALANCE_GRID_SPLITS``
splits, half that where B x Hkv > SMs (there a row's share of the slots is rarely above 2, and the
empty programs of the larger grid cost short rows dispatch waves).

Batch-invariant plan (``batch_invariant=True``, qsa-contract.md §2c): a row's split schedule
depends on its own length and (G, D) only, never on B, ``max_seqlen_k`` or the SM count: BLOCK_N
64 for D <= 128, else 32; 4 warps; 3 stages, fewer only where sm_12x's 101,376 B require it;
n_active = max(1, cdiv(len, BATCH_INVARIANT_SPLIT_KEYS)), no balance; the grid has
cdiv(max_seqlen_k, BATCH_INVARIANT_SPLIT_KEYS) splits (a longer row's splits just get longer, and
its bits then follow the bound). The merge order and tile depend on D only.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TypeVar

__all__ = ["DecodePlan", "plan_decode", "split_blocks", "smem_bytes", "fit_shared_memory",
           "next_pow2", "prev_pow2", "LOG2E", "BATCH_INVARIANT_SPLIT_KEYS"]

#: log2(e): the kernels scale FP32 scores by softmax_scale * LOG2E and use exp2 (cheaper PTX).
LOG2E = 1.4426950408889634

# Decode tunables, decided by the H200 sweeps (bench/NOTES.md, "Decode, Triton").
PROGRAMS_PER_SM = 1  # split-KV target: at most this many programs per SM for long rows
MAX_SPLITS_CAP = 64  # most splits per (sequence, KV head) under the power-of-two rule (the
#                      one-block rule allows up to 2x this; the Triton merge reads <= 128 at once)
MIN_BLOCKS_CAP = 2  # a split streams up to this many BLOCK_N blocks before another is activated
BALANCE_SLOTS_PER_SM = 2  # device-side balance: programs the rows share, per SM
BALANCE_GRID_SPLITS = 4  # ... and the smallest grid split count, so long mixed rows can split
#                          (halved where B x Hkv > SMs)
WIDE_BLOCK_N = 64  # BLOCK_N of one-block splits where they still fill half the SMs
#: batch-invariant decode: keys per split (a multiple of every BLOCK_N; 9 splits for 2051 keys),
#: the size of the paged decode's BATCH_INVARIANT_SPLIT_COLS, for the same reasons.
BATCH_INVARIANT_SPLIT_KEYS = 256


def prev_pow2(x: int) -> int:
    """Largest power of two <= x (x >= 1; 1 for x < 1). Raises nothing; source: our own."""
    return 1 << (max(1, int(x)).bit_length() - 1)


def next_pow2(x: int) -> int:
    """Smallest power of two >= x (1 for x <= 1). Raises nothing; source: our own."""
    return 1 << max(0, math.ceil(math.log2(max(1, x))))


def split_blocks(blocks, j, n_active):
    """Block range ``[lo, hi)`` of split ``j`` of ``n_active`` over a row of ``blocks`` blocks:
    ``lo = cdiv(j * blocks, n_active)``, ``hi = cdiv((j + 1) * blocks, n_active)``.

    Every block is covered once, each active split of a non-empty row gets >= 1 block, counts
    differ by at most one and the last split (the row's partial block) gets the fewest, so it is
    never the one that finishes last; ``j >= n_active`` starts at or past ``blocks``. Plain
    ``+ * //`` only, so it runs on host ints, inside a ``triton.jit`` kernel (pass int64
    ``blocks`` where ``blocks * n_active`` may pass 2**31) and on traced jax integers.
    Raises nothing of its own (n_active >= 1 is the caller's). Source: the module docstring;
    bench/NOTES.md, "Decode, Triton".
    """
    return (blocks * j + n_active - 1) // n_active, (blocks * (j + 1) + n_active - 1) // n_active


def smem_bytes(*, head_tile: int, block_n: int, head_dim: int, num_stages: int,
               kv_bytes: int = 2, q_bytes: int = 2, v_convert: bool = False) -> int:
    """Upper estimate of the shared memory (bytes) of one program of a Q-tile x K/V-stream
    attention kernel (decode split and prefill kernels of both backends): ``max(num_stages - 1,
    1)`` K+V tile copies (``2 x block_n x head_dim x kv_bytes``) plus 1/8 for the pipeliner's
    layout conversions, the Q and P tiles in ``q_bytes`` and 2 KiB of scratch; with
    ``v_convert`` and ``kv_bytes != q_bytes`` one [block_n, head_dim] V tile in ``q_bytes`` (both
    per-row prefill kernels convert FP8 V in its load layout and store it for the P.V operand).
    The compile tests assert ``compiled.metadata.shared <= smem_bytes`` for every shipped
    configuration on sm_90 and sm_120; it over-counts single-stage kernels. Raises nothing;
    source: our own model, checked against the limits of qsa-contract.md §5."""
    kv = 2 * block_n * head_dim * kv_bytes
    conv = block_n * head_dim * q_bytes if v_convert and kv_bytes != q_bytes else 0
    return (max(num_stages - 1, 1) * kv * 9 // 8 + head_tile * head_dim * q_bytes
            + head_tile * block_n * q_bytes + conv + 2048)


_Cfg = TypeVar("_Cfg")


def fit_shared_memory(cfg: _Cfg, *, head_dim: int, limit: int | None, kv_bytes: int = 2,
                      q_bytes: int = 2, v_convert: bool = False) -> _Cfg:
    """Shrink ``cfg`` (a frozen dataclass with ``head_tile``, ``block_n``, ``num_stages``) until
    ``smem_bytes`` (``v_convert`` passed on) fits ``limit`` bytes per block: fewer stages first
    (down to 1), then halved ``block_n`` (down to 16), other fields kept; the 1-stage, 16-column
    form if nothing fits. ``limit`` None (interpreters) returns ``cfg``. Why: a plan tuned on
    sm_90 (232,448 B) must still launch on sm_120 / sm_121 (101,376 B, ``qsa-contract.md`` §5).
    Raises nothing of its own; source: our own (``smem_bytes``'s model)."""
    if limit is None:
        return cfg

    def need(c) -> int:
        return smem_bytes(head_tile=c.head_tile, block_n=c.block_n, head_dim=head_dim,
                          num_stages=c.num_stages, kv_bytes=kv_bytes, q_bytes=q_bytes,
                          v_convert=v_convert)

    while need(cfg) > limit and cfg.num_stages > 1:
        cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
    while need(cfg) > limit and cfg.block_n > 16:
        cfg = dataclasses.replace(cfg, block_n=cfg.block_n // 2)
    return cfg


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """Static decode launch plan.

    Attributes:
      head_tile: G padded to a power of two >= 16 (tensor-core dots). block_n: BLOCK_N.
      max_splits: programs per (sequence, KV head) in the grid (a power of two, or the row's
        block count under ``one_block_splits``).
      min_blocks_per_split: a split is activated only with at least this many blocks.
      num_warps, num_stages: launch parameters (Pallas passes them as compiler params).
      balance_slots: 0 = the static rule; > 0 = device-side balance over this many programs
        (Triton only).
    """

    head_tile: int
    block_n: int
    max_splits: int
    min_blocks_per_split: int
    num_warps: int
    num_stages: int
    balance_slots: int = 0


def plan_decode(batch: int, num_kv_heads: int, group: int, head_dim: int, max_seqlen_k: int,
                sm_count: int = 132, *, max_splits: int | None = None,
                block_n: int | None = None, balance: bool = False,
                one_block_splits: bool = False, batch_invariant: bool = False) -> DecodePlan:
    """Plan a split-KV decode launch from static shapes.

    Args:
      batch: B; num_kv_heads: Hkv; group: G = Hq / Hkv; head_dim: D (power of two).
      max_seqlen_k: static upper bound of a row's key count (host int).
      sm_count: SMs of the target GPU (132 on the H200). max_splits, block_n: overrides (tests).
      balance: device-side balance (module docstring): >= BALANCE_GRID_SPLITS splits in the
        grid (half that at B x Hkv > sm_count), ``balance_slots = BALANCE_SLOTS_PER_SM *
        sm_count``.
      one_block_splits: one split per block where that fits one program per SM (module
        docstring; the balance's grid floor still applies); Triton only (its merge reads up to
        128 splits at once).
      batch_invariant: the batch-invariant plan (module docstring); batch and sm_count unused;
        it already fits sm_12x's shared memory, callers do not refit it.

    Returns a DecodePlan (num_stages 1 where one_block_splits gives every split one block, else
    3; callers fit the default plan to their device with
    ``fit_shared_memory``). Raises ValueError for batch_invariant with max_splits, block_n,
    balance or one_block_splits (that schedule has no knobs). Source: the module docstring;
    measurements in bench/NOTES.md.
    """
    if batch_invariant:
        if max_splits is not None or block_n is not None or balance or one_block_splits:
            raise ValueError("plan_decode: batch_invariant=True takes no max_splits, block_n, "
                             "balance or one_block_splits (its schedule depends on G and D only)")
        return _plan_decode_invariant(group, head_dim, max_seqlen_k)
    head_tile = max(16, next_pow2(group))
    num_warps = 4
    if block_n is None:
        block_n = 64 if head_dim <= 128 else 32
        programs = batch * num_kv_heads
        narrow, wide = (math.ceil(max_seqlen_k / n) for n in (block_n, WIDE_BLOCK_N))
        if (one_block_splits and max_splits is None and block_n < WIDE_BLOCK_N
                and num_kv_heads >= 2 and programs * narrow <= PROGRAMS_PER_SM * sm_count
                and narrow <= 2 * MAX_SPLITS_CAP and 2 * programs * wide >= sm_count):
            # 8 warps avoid the register spills of 4 at D = 256; one KV head measured slower
            # (bench/NOTES.md, "64-key blocks at TP1 B = 1").
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
            floor = BALANCE_GRID_SPLITS // (2 if programs > sm_count else 1)
            max_splits = max(max_splits, min(floor, next_pow2(blocks)))
    max_splits = max(1, int(max_splits))
    # A max_seqlen_k row uses every split, but a split streams a few blocks when there are
    # enough (amortises the Q load and the merge).
    min_blocks = max(1, min(MIN_BLOCKS_CAP, blocks // max_splits))
    slots = BALANCE_SLOTS_PER_SM * sm_count if balance else 0
    # one block a split: no next block to prefetch, and a pipelined loop's prologue only
    # lengthens the program's one latency chain (bench/NOTES.md, "Decode, Triton")
    stages = 1 if one_block_splits and max_splits >= blocks else 3
    return DecodePlan(head_tile, block_n, max_splits, min_blocks, num_warps, stages, slots)


def _plan_decode_invariant(group: int, head_dim: int, max_seqlen_k: int) -> DecodePlan:
    """The batch-invariant plan, fitted to sm_12x by fewer stages only (BLOCK_N is arithmetic)."""
    block_n = 64 if head_dim <= 128 else 32
    plan = DecodePlan(max(16, next_pow2(group)), block_n,
                      max(1, math.ceil(max_seqlen_k / BATCH_INVARIANT_SPLIT_KEYS)),
                      BATCH_INVARIANT_SPLIT_KEYS // block_n, 4, 3, 0)
    while plan.num_stages > 1 and smem_bytes(
            head_tile=plan.head_tile, block_n=block_n, head_dim=head_dim,
            num_stages=plan.num_stages) > SM12X_SMEM_BYTES:
        plan = dataclasses.replace(plan, num_stages=plan.num_stages - 1)
    return plan


# ---------------------------------------------------------------------------------------------
# Paged decode (qsa-contract.md §2b, §2c), both twins. The kernels split a row's W index
# *columns*, not its valid keys (validity is device data that can change under a captured graph;
# W is static): split j of S covers chunks [j * nb // S, (j + 1) * nb // S) of nb = cdiv(W,
# BLOCK_N). A split with no valid entry writes an empty partial (LSE = -inf) the merge weighs 0;
# a one-split plan writes the output itself.

__all__ += ["PagedDecodePlan", "plan_decode_paged", "paged_smem_bytes",
            "BATCH_INVARIANT_SPLIT_COLS", "PAGED_MAX_SPLITS"]

#: the paged kernel's dependent-load chain (index -> slot -> K/V) and the stages that give its
#: K/V gathers two buffers behind it (``paged_smem_bytes``)
PAGED_LOAD_CHAIN = 3
PAGED_DEEP_STAGES = 7
#: batch-invariant mode: index columns per split (9 splits at W = 2051, whatever the batch):
#: fewer columns fill more SMs at small batch, more write fewer FP32 partials at large batch
#: (9 x [G, D] floats per KV row, about 10% of the K/V bytes at D = 256; bench/NOTES.md).
BATCH_INVARIANT_SPLIT_COLS = 256
#: the most splits of one (row, KV head) (the Triton merge reads every split in one tile)
PAGED_MAX_SPLITS = 128
#: the Pallas twin's default plans: at most this many splits (its XLA merge walks the splits as
#: one chain per output element; bench/NOTES.md, "Paged decode")
PALLAS_PAGED_SPLITS = 16
#: shared memory per block on sm_120 / sm_121 (qsa-contract.md §5): every shipped paged plan
#: fits it, so a plan never depends on the part
SM12X_SMEM_BYTES = 101_376


@dataclasses.dataclass(frozen=True)
class PagedDecodePlan:
    """Static launch plan of the paged decode: ``head_tile`` (G padded to a power of two >= 16),
    ``block_n`` (index columns per inner step), ``num_splits`` per (row, KV head) (grid
    (num_splits, R, Hkv); 1 = no partials, no merge), ``num_warps``, ``num_stages``."""

    head_tile: int
    block_n: int
    num_splits: int
    num_warps: int
    num_stages: int

    def chunk_range(self, width: int, split: int) -> tuple[int, int]:
        """[first, last) BLOCK_N chunk of ``split`` for W = ``width`` (as the kernels compute it)."""
        nb = max(1, -(-width // self.block_n))
        return split * nb // self.num_splits, (split + 1) * nb // self.num_splits


def paged_smem_bytes(plan: PagedDecodePlan, head_dim: int, q_bytes: int = 2,
                     kv_bytes: int = 2, backend: str = "triton") -> int:
    """Estimated shared memory (bytes) of the paged split kernel: the pipelined K+V gather tiles
    in the pool's dtype, the Q and P tiles in q's dtype, and for an FP8 pool one converted
    [BLOCK_N, D] operand per tensor (``smem_bytes``'s model plus the conversion tiles). Raises
    nothing; source: our own; bench/NOTES.md, "Paged decode, Triton" (pipelining)."""
    kv = 2 * plan.block_n * head_dim * kv_bytes
    conv = 2 * plan.block_n * head_dim * q_bytes if kv_bytes != q_bytes else 0
    if backend == "triton":
        # the pipeliner shares the stages over the 3-deep dependent-load chain
        kv_buffers = max(1, (plan.num_stages - 1) // PAGED_LOAD_CHAIN) * kv
    else:
        # as XLA lowers the Pallas twin: one [BLOCK_N, D] tile per stage past the first
        kv_buffers = max(plan.num_stages - 1, 1) * kv // 2
    return (kv_buffers + conv + plan.head_tile * head_dim * q_bytes
            + plan.head_tile * plan.block_n * q_bytes)


def plan_decode_paged(rows: int, num_kv_heads: int, group: int, head_dim: int, width: int,
                      sm_count: int = 132, *, q_bytes: int = 2, kv_bytes: int = 2,
                      batch_invariant: bool = False,
                      smem_limit: int = SM12X_SMEM_BYTES,
                      backend: str = "triton", device_smem: int | None = None) -> PagedDecodePlan:
    """Plan a paged decode launch from static shapes only.

    Args:
      rows: R query rows (MTP verify rows included); num_kv_heads: Hkv; group: G (<= 16);
        head_dim: D (power of two 32..256); width: W index columns per row (>= 1).
      sm_count: SMs of the target GPU (132 on the H200).
      q_bytes, kv_bytes: element sizes of q and of the pool (1 for FP8 e4m3).
      batch_invariant: the schedule depends on (W, G, D, dtypes) only (qsa-contract.md §2c).
      smem_limit: bytes per block the plan must fit (``paged_smem_bytes``); default sm_12x's
        101,376 B, so one plan is valid on every supported part.
      backend: "triton" or "pallas": whose shared-memory model the fit uses.
      device_smem: shared memory per block of the GPU that runs it (None: ``smem_limit``):
        whether an SM holds two programs of the fitted plan.

    Returns a PagedDecodePlan. Rules (bench/NOTES.md, "Paged decode"):
      * BLOCK_N 32 for D > 128, else 64 (as ``plan_decode``); head tile max(16, next_pow2(G));
        4 warps; 7 stages where every program streams >= 2 chunks, else (one or two chunks) 1
        for Triton, 3 for Pallas; lowered until ``paged_smem_bytes`` fits ``smem_limit``.
      * default: num_splits = clamp(resident x sm_count // (R x Hkv), 1, nb), nb = cdiv(W,
        BLOCK_N), resident = 2 where two fitted plans fit ``device_smem``, else 1: a second
        program per SM hides the dependent-load latency (index -> slot -> K/V) at the cost of
        FP32 partials and a merge. Pallas at most ``PALLAS_PAGED_SPLITS``.
      * batch_invariant: num_splits = cdiv(W, BATCH_INVARIANT_SPLIT_COLS), capped at nb; it
        costs latency at small R and partials plus a merge from R x Hkv >= SMs.

    Raises ValueError for a size < 1 or when no plan fits ``smem_limit``. Source: our own;
    bench/NOTES.md, "Paged decode, Triton"; qsa-contract.md §2b, §2c.
    """
    if min(rows, num_kv_heads, group, head_dim, width, sm_count) < 1:
        raise ValueError(f"plan_decode_paged: sizes must be >= 1, got R={rows}, Hkv={num_kv_heads}, "
                         f"G={group}, D={head_dim}, W={width}, SMs={sm_count}")
    head_tile = max(16, next_pow2(group))

    def fitted(splits: int, block_n: int) -> PagedDecodePlan:
        cap = (PALLAS_PAGED_SPLITS if backend == "pallas" and not batch_invariant
               else PAGED_MAX_SPLITS)
        splits = max(1, min(splits, -(-width // block_n), cap))
        # deep pipelines pay only where a program streams several chunks; one or two chunks
        # (Triton): no pipeline, whose prologue lengthens the one latency chain (bench/NOTES.md,
        # "Paged decode, Triton")
        if -(-width // block_n) >= 2 * splits:
            stages = PAGED_DEEP_STAGES
        else:
            stages = 1 if backend == "triton" else 3
        plan = PagedDecodePlan(head_tile, block_n, splits, 4, stages)
        while paged_smem_bytes(plan, head_dim, q_bytes, kv_bytes, backend) > smem_limit:
            if plan.num_stages > 2:
                plan = dataclasses.replace(plan, num_stages=plan.num_stages - 1)
            elif plan.block_n > 16 and not batch_invariant:
                # (batch-invariant plans keep BLOCK_N: a split's column range must not move)
                plan = dataclasses.replace(plan, block_n=plan.block_n // 2, num_splits=min(
                    plan.num_splits, -(-width // (plan.block_n // 2))))
            else:
                raise ValueError(f"plan_decode_paged: no plan fits {smem_limit} B of shared "
                                 f"memory (D={head_dim}, G={group}, kv_bytes={kv_bytes})")
        return plan

    block_n = 64 if head_dim <= 128 else 32
    if batch_invariant:
        return fitted(-(-width // BATCH_INVARIANT_SPLIT_COLS), block_n)
    limit = device_smem or smem_limit
    plan = fitted(sm_count // (rows * num_kv_heads), block_n)
    if 2 * paged_smem_bytes(plan, head_dim, q_bytes, kv_bytes, backend) <= limit:
        two = fitted((2 * sm_count) // (rows * num_kv_heads), plan.block_n)
        if 2 * paged_smem_bytes(two, head_dim, q_bytes, kv_bytes, backend) <= limit:
            return two  # an SM holds two programs of the plan that launches
    return plan
