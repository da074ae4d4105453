"""Launch plans shared by the Triton and the Pallas kernels: the split-KV decode plan, the split
rule, one shared-memory model and one fit function.

Framework-free (stdlib only). Both decode twins and both prefill twins size their launches here,
so a given device and shape launches the same tiles in both implementations.

Decode plan. Only static facts go in (batch, heads, head dim, ``max_seqlen_k``, the device's SM
count): the plan fixes the *grid* (B x Hkv x max_splits programs) and the tile sizes. How many of
the ``max_splits`` programs of a (sequence, KV head) actually work is decided **on the device**
from that row's length (``cu_seqlens_k[s+1] - cu_seqlens_k[s]``), so the same compiled launch
(CUDA graph, jitted function) stays correct when the lengths change:

    blocks      = cdiv(len, BLOCK_N)
    n_active    = clamp(cdiv(blocks, min_blocks_per_split), 1, max_splits)
    split j < n_active covers blocks [cdiv(j * blocks, n_active), cdiv((j + 1) * blocks, n_active))
                  (``split_blocks``: every active split of a non-empty row gets >= 1 block, since
                   n_active <= blocks; counts differ by at most one, and the last split, which
                   holds the row's partial block, gets the fewest: floor(blocks / n_active))

A row longer than ``max_seqlen_k`` is still covered completely (the split size grows with the
device length); ``max_seqlen_k`` only bounds the useful grid. Splits past ``n_active`` write
nothing the merge uses. A zero-length row has n_active = 1 and its one split writes exact zeros.

Sizing rule (why): at small batch upstream runs B x Hkv x <= 8 programs on 132 SMs and is far from
the memory floor (anchors.md). The H200 sweep (bench/NOTES.md, "Plan from a sweep: at most one
program per SM")
found the best split count at about ONE program per SM, rounded *down* to a power of two:
B x Hkv x max_splits <= SMs; a second, partial wave cost more, and at B x Hkv >= SMs no split
at all was fastest.

One-block splits (``one_block_splits``, the Triton default): where one split per BLOCK_N block
fits that one wave (B x Hkv x blocks <= SMs, blocks <= 2 x MAX_SPLITS_CAP), the grid has exactly
``blocks`` splits (65 for 2051 keys), so no split streams two blocks and ends after the others;
where splits of WIDE_BLOCK_N keys would still give >= SMs / 2 programs and Hkv >= 2, BLOCK_N is
WIDE_BLOCK_N with 8 warps (half the programs, partials and merge reads for the same keys).

Device-side balance (``balance=True``, the Triton default): the static rule sizes splits for rows
as long as ``max_seqlen_k``, so a mixed batch at large B would leave its long rows unsplit. With
balance every program also reads the batch's total keys (``cu_seqlens_k[B] - cu_seqlens_k[0]``,
one load) and a row gets a share of ``balance_slots`` programs proportional to its length:

    n_active = clamp(floor(len * balance_slots / (total * Hkv)), 1, max_splits),
               and at most cdiv(blocks, min_blocks_per_split)

(summed over rows and KV heads <= balance_slots + rows, so equal rows never exceed the slots). The
grid keeps at least ``BALANCE_GRID_SPLITS`` splits per row so long rows of a mixed batch can
split; splits past ``n_active`` exit at once.

Batch-invariant plan (``plan_decode(..., batch_invariant=True)``, qsa-contract.md §2c; used by
both twins' ``sparse_decode(..., batch_invariant=True)``): the split schedule of a row is a
function of its own length and the static (G, D) only, never of B, ``max_seqlen_k`` or the SM
count:

    BLOCK_N      = 64 for D <= 128, else 32 (the default's narrow block); 4 warps; 3 stages, fewer
                   only where sm_120 / sm_121's 101,376 B require it (never a smaller BLOCK_N)
    n_active     = max(1, cdiv(len, BATCH_INVARIANT_SPLIT_KEYS))  (cdiv(blocks, min_blocks) with
                   min_blocks = BATCH_INVARIANT_SPLIT_KEYS / BLOCK_N, no balance)
    split ranges = ``split_blocks(blocks, j, n_active)`` as above
    grid         = cdiv(max_seqlen_k, BATCH_INVARIANT_SPLIT_KEYS) splits per (row, KV head): for
                   any valid bound n_active fits the grid, so the bound only decides how many
                   splits exit at once (a row longer than the bound is still covered, its splits
                   just get longer, as in the default plan; its bits then follow the bound)

A row with n_active = 1 is finished by its one split (as in the default plan); the others are
merged in an order and with a tile that depend on D only (the backends' ``sparse_decode``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TypeVar

__all__ = ["DecodePlan", "plan_decode", "split_blocks", "smem_bytes", "fit_shared_memory",
           "next_pow2", "prev_pow2", "LOG2E", "BATCH_INVARIANT_SPLIT_KEYS"]

#: log2(e): exp(x) = exp2(x * LOG2E); the kernels scale FP32 scores by softmax_scale * LOG2E and
#: use exp2, the cheaper PTX path.
LOG2E = 1.4426950408889634

# Decode tunables, decided by the H200 sweeps (bench/NOTES.md, "Decode, Triton").
PROGRAMS_PER_SM = 1  # split-KV target: at most this many programs per SM for long rows
MAX_SPLITS_CAP = 64  # most splits per (sequence, KV head) under the power-of-two rule (the
#                      one-block rule allows up to 2x this; the Triton merge reads <= 128 at once)
MIN_BLOCKS_CAP = 2  # a split streams up to this many BLOCK_N blocks before another is activated
BALANCE_SLOTS_PER_SM = 2  # device-side balance: programs the rows share, per SM
BALANCE_GRID_SPLITS = 4  # ... and the smallest grid split count, so long mixed rows can split
WIDE_BLOCK_N = 64  # BLOCK_N of one-block splits where they still fill half the SMs
#: batch-invariant packed decode: keys per split (a multiple of every BLOCK_N the plan uses):
#: 9 splits for a 2051-key row, whatever the batch. The paged decode's batch-invariant split
#: (BATCH_INVARIANT_SPLIT_COLS index columns) has the same size, for the same reasons.
BATCH_INVARIANT_SPLIT_KEYS = 256


def prev_pow2(x: int) -> int:
    """Largest power of two <= x (x >= 1; 1 for x < 1)."""
    return 1 << (max(1, int(x)).bit_length() - 1)


def next_pow2(x: int) -> int:
    """Smallest power of two >= x (1 for x <= 1)."""
    return 1 << max(0, math.ceil(math.log2(max(1, x))))


def split_blocks(blocks, j, n_active):
    """Block range ``[lo, hi)`` of split ``j`` of ``n_active`` over a row of ``blocks`` blocks.

    ``lo = cdiv(j * blocks, n_active)``, ``hi = cdiv((j + 1) * blocks, n_active)``: every block
    is covered exactly once, each active split of a non-empty row gets >= 1 block (n_active <=
    blocks), the counts differ by at most one, the first split gets the most (cdiv(blocks,
    n_active)) and the last, which holds the row's partial block, the fewest (floor(blocks /
    n_active)), so it is never the one that finishes last. For ``j >= n_active`` the range starts
    at or past ``blocks`` (empty once clamped to ``blocks``).

    Plain ``+ * //`` on non-negative integers only, so the same function runs on host ints, inside
    a ``triton.jit`` kernel (``qsa_triton.decode`` jit-wraps it; pass int64 ``blocks`` where
    ``blocks * n_active`` may pass 2**31) and on traced jax integers in the Pallas kernel.
    """
    return (blocks * j + n_active - 1) // n_active, (blocks * (j + 1) + n_active - 1) // n_active


def smem_bytes(*, head_tile: int, block_n: int, head_dim: int, num_stages: int,
               kv_bytes: int = 2, q_bytes: int = 2) -> int:
    """Upper estimate of the shared memory (bytes) one program of a Q-tile x K/V-stream attention
    kernel needs (the decode split kernels and the prefill kernels of both backends).

    Model: ``max(num_stages - 1, 1)`` pipelined copies of the K and V tiles
    (``2 x block_n x head_dim x kv_bytes``) with 1/8 margin for the pipeliner's layout
    conversions, plus the Q tile (``head_tile x head_dim x q_bytes``), the P tile
    (``head_tile x block_n x q_bytes``) and 2 KiB of reduction scratch and barriers.
    Checked against ``compiled.metadata.shared`` of every shipped configuration for sm_90 and
    sm_120 (``qsa compile``; the compile tests assert
    ``shared <= smem_bytes``); it over-counts single-stage kernels.
    """
    kv = 2 * block_n * head_dim * kv_bytes
    return (max(num_stages - 1, 1) * kv * 9 // 8 + head_tile * head_dim * q_bytes
            + head_tile * block_n * q_bytes + 2048)


_Cfg = TypeVar("_Cfg")


def fit_shared_memory(cfg: _Cfg, *, head_dim: int, limit: int | None, kv_bytes: int = 2,
                      q_bytes: int = 2) -> _Cfg:
    """Shrink a launch configuration until ``smem_bytes`` fits ``limit`` bytes per block.

    ``cfg`` is any frozen dataclass with ``head_tile``, ``block_n`` and ``num_stages`` fields
    (``DecodePlan``, the prefill geometries); fewer pipeline stages first (down to 1), then a
    smaller ``block_n`` (halved, down to 16); other fields are kept (``dataclasses.replace``).
    ``limit`` None (CPU interpreters) returns ``cfg`` unchanged. Why: a configuration tuned on
    sm_90 (232,448 B per block) must still launch on sm_120 / sm_121 (101,376 B,
    ``qsa-contract.md`` §5). Returns the smallest change that fits, or the 1-stage, 16-column
    configuration if nothing does.
    """
    if limit is None:
        return cfg

    def need(c) -> int:
        return smem_bytes(head_tile=c.head_tile, block_n=c.block_n, head_dim=head_dim,
                          num_stages=c.num_stages, kv_bytes=kv_bytes, q_bytes=q_bytes)

    while need(cfg) > limit and cfg.num_stages > 1:
        cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
    while need(cfg) > limit and cfg.block_n > 16:
        cfg = dataclasses.replace(cfg, block_n=cfg.block_n // 2)
    return cfg


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """Static decode launch plan.

    Attributes:
      head_tile: query heads per program, G padded to a power of two (>= 16 for tensor-core dots).
      block_n: key rows per inner-loop step (BLOCK_N).
      max_splits: programs per (sequence, KV head) along the row (grid dimension; a power of
        two, or the row's block count under ``one_block_splits``).
      min_blocks_per_split: a split is only activated when it gets at least this many BLOCK_N blocks.
      num_warps, num_stages: Triton launch parameters (the Pallas kernels pass them through their
        compiler params).
      balance_slots: 0 = the static rule (n_active from the row's blocks only); > 0 = device-side
        balance over this many programs (module docstring; Triton kernel only).
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
      batch: B sequences; num_kv_heads: Hkv; group: G = Hq / Hkv; head_dim: D (power of two).
      max_seqlen_k: static upper bound of a row's key count (host int).
      sm_count: streaming multiprocessors of the target GPU (132 on the H200).
      max_splits, block_n: overrides (tests).
      balance: plan for the device-side balance (module docstring): at least
        BALANCE_GRID_SPLITS splits in the grid, ``balance_slots = BALANCE_SLOTS_PER_SM * sm_count``.
      one_block_splits: where one split per BLOCK_N block still fits one program per SM
        (B x Hkv x blocks <= PROGRAMS_PER_SM x sm_count, blocks <= 2 x MAX_SPLITS_CAP), use
        exactly ``blocks`` splits in the grid (not a power of two), so no split of a
        ``max_seqlen_k`` row streams two blocks (the balance's grid floor still applies to very
        short rows). Where BLOCK_N is not given, num_kv_heads >= 2 and one-block splits of
        WIDE_BLOCK_N rows would still give at least half as many programs as SMs, BLOCK_N is
        WIDE_BLOCK_N with 8 warps. Triton kernel only (its merge reads up to 128 splits at once).
      batch_invariant: the batch-invariant plan (module docstring): BLOCK_N, warps, stages and
        min_blocks_per_split from (G, D) only, max_splits = cdiv(max_seqlen_k,
        BATCH_INVARIANT_SPLIT_KEYS); batch and sm_count are not used. The plan already fits
        sm_120 / sm_121's shared memory (so every supported part); callers do not refit it.

    Returns:
      DecodePlan (num_stages 3: two K/V tiles in flight; callers fit the default plan to their
      device with ``fit_shared_memory``). Source: this module's docstring; measurements in
      bench/NOTES.md.

    Raises:
      ValueError: batch_invariant together with max_splits, block_n, balance or
        one_block_splits (the batch-invariant schedule has no knobs).
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
            # half the programs, partials and merge reads for the same keys; 8 warps avoid the
            # register spills of 4 at D = 256. Only with >= 2 KV heads: the same grid from two
            # sequences of one KV head measured slower (bench/NOTES.md, "64-key blocks at TP1
            # B = 1").
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
    slots = BALANCE_SLOTS_PER_SM * sm_count if balance else 0
    return DecodePlan(head_tile, block_n, max_splits, min_blocks, num_warps, 3, slots)


def _plan_decode_invariant(group: int, head_dim: int, max_seqlen_k: int) -> DecodePlan:
    """The batch-invariant decode plan (module docstring): static (G, D) in, the grid from
    ``max_seqlen_k`` only; fitted to sm_120 / sm_121's shared memory by fewer stages only (a
    smaller BLOCK_N would change the arithmetic)."""
    block_n = 64 if head_dim <= 128 else 32
    plan = DecodePlan(max(16, next_pow2(group)), block_n,
                      max(1, math.ceil(max_seqlen_k / BATCH_INVARIANT_SPLIT_KEYS)),
                      BATCH_INVARIANT_SPLIT_KEYS // block_n, 4, 3, 0)
    while plan.num_stages > 1 and smem_bytes(
            head_tile=plan.head_tile, block_n=block_n, head_dim=head_dim,
            num_stages=plan.num_stages) > SM12X_SMEM_BYTES:
        plan = dataclasses.replace(plan, num_stages=plan.num_stages - 1)
    return plan



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

#: depth of the paged kernel's dependent-load chain (index -> req_to_token -> K/V) and the
#: pipeline depth that gives its K/V gathers two buffers (``paged_smem_bytes``)
PAGED_LOAD_CHAIN = 3
PAGED_DEEP_STAGES = 7
#: batch-invariant mode: index columns per split (a multiple of every BLOCK_N the plan uses).
#: The split count is then cdiv(W, this) whatever the batch: 9 splits for W = 2051. Why this
#: size: fewer columns per split fill more SMs at small batch, more columns write fewer FP32
#: partials at large batch (9 splits x [G, D] floats per KV row: about 10% of the K/V bytes read
#: at D = 256 written and read back by the merge); the measured cost is in bench/NOTES.md.
BATCH_INVARIANT_SPLIT_COLS = 256
#: the most splits of one (row, KV head) (the Triton merge reads every split in one tile)
PAGED_MAX_SPLITS = 128
#: the Pallas twin's default plans: at most this many splits. Its merge is an XLA fusion that
#: walks the splits as one chain per output element, so its latency grows with the split count
#: where the Triton merge kernel reads all splits at once (bench/NOTES.md, "Paged decode").
PALLAS_PAGED_SPLITS = 16
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
                     kv_bytes: int = 2, backend: str = "triton") -> int:
    """Estimated shared memory (bytes) of the paged split kernel: (num_stages - 1) pipelined K+V
    gather tiles in the pool's dtype, the Q tile and the P tile in q's dtype, and for an FP8 pool
    one converted [BLOCK_N, D] dot operand in q's dtype per tensor. The model of
    ``qsa_triton.decode.smem_bytes`` (matches ``compiled.metadata.shared`` of the packed split
    kernel for stages >= 2) extended by the conversion tiles."""
    kv = 2 * plan.block_n * head_dim * kv_bytes
    conv = 2 * plan.block_n * head_dim * q_bytes if kv_bytes != q_bytes else 0
    if backend == "triton":
        # Triton's software pipeliner shares the stage budget over the kernel's chain of
        # dependent loads (index -> req_to_token -> K/V, depth 3): (num_stages - 1) // 3 K+V
        # buffers.
        kv_buffers = max(1, (plan.num_stages - 1) // PAGED_LOAD_CHAIN) * kv
    else:
        # the Pallas twin as XLA lowers it: one [BLOCK_N, D] tile per stage past the first
        # (sm_120 compiles: 109,056 B at 7 stages, BLOCK_N 32, D 256, bf16)
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
      rows: R query rows (MTP verify rows included); num_kv_heads: Hkv; group: G = Hq / Hkv
        (<= 16); head_dim: D (power of two 32..256); width: W index columns per row (>= 1).
      sm_count: streaming multiprocessors of the target GPU (132 on the H200).
      q_bytes, kv_bytes: element sizes of q and of the pool (1 for FP8 e4m3).
      batch_invariant: the schedule depends on (W, G, D, dtypes) only, never on R or the SM
        count (qsa-contract.md §2c).
      smem_limit: bytes per block the plan must fit (``paged_smem_bytes``); default sm_120 /
        sm_121's 101,376 B, so one plan is valid on every supported part.
      backend: "triton" or "pallas": whose shared-memory model the fit uses (the two kernels
        buffer their pipelined gathers differently; the schedule rules are the same).
      device_smem: opt-in shared memory per block of the GPU the launch runs on
        (``DeviceFacts.smem_per_block``), or None (taken as ``smem_limit``): whether an SM holds
        two programs of the fitted plan at once.

    Returns:
      PagedDecodePlan. Rules (why):
        * BLOCK_N 32 for D > 128, else 64: a [BLOCK_N, D] gather tile of 16 KB in bf16, as the
          packed decode (``plan_decode``); head tile max(16, next_pow2(G)); 4 warps; 7 stages
          where a program streams >= 2 chunks (two K/V buffers behind the 3-deep load chain),
          else 3; lowered until ``paged_smem_bytes`` fits ``smem_limit``.
        * default: as many programs as the SMs hold at once, at most two per SM: num_splits =
          clamp(resident x sm_count // (R x Hkv), 1, nb), nb = cdiv(W, BLOCK_N), resident = 2
          where two fitted plans fit ``device_smem`` (every plan on sm_90, only the shallow
          ones in sm_120 / sm_121's 99 KB), else 1. Why two:
          a program's gathers wait on a dependent chain (index -> slot -> K/V), and one 4-warp
          program per SM leaves that latency exposed; a second program per SM hides it at the
          cost of FP32 partials and a merge launch (bench/NOTES.md, "Paged decode"). So 1 split
          (no merge) once R x Hkv >= resident x SMs, and at small R one chunk per split; the
          Pallas twin at most ``PALLAS_PAGED_SPLITS``.
        * batch_invariant: num_splits = cdiv(W, BATCH_INVARIANT_SPLIT_COLS) (9 at W = 2051),
          capped at nb. Cost against the default (measured: bench/NOTES.md, "Paged decode"):
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

    def fitted(splits: int, block_n: int) -> PagedDecodePlan:
        cap = (PALLAS_PAGED_SPLITS if backend == "pallas" and not batch_invariant
               else PAGED_MAX_SPLITS)
        splits = max(1, min(splits, -(-width // block_n), cap))
        # Deep pipelines pay where a program streams several chunks: 7 stages give the K/V
        # gathers two buffers behind the 3-deep load chain; one-chunk splits keep 3
        # (bench/NOTES.md, "Paged decode, Triton").
        stages = PAGED_DEEP_STAGES if -(-width // block_n) >= 2 * splits else 3
        plan = PagedDecodePlan(head_tile, block_n, splits, 4, stages)
        while paged_smem_bytes(plan, head_dim, q_bytes, kv_bytes, backend) > smem_limit:
            if plan.num_stages > 2:
                plan = dataclasses.replace(plan, num_stages=plan.num_stages - 1)
            elif plan.block_n > 16 and not batch_invariant:
                # (batch-invariant plans keep BLOCK_N: the split's column range must not move)
                plan = dataclasses.replace(plan, block_n=plan.block_n // 2, num_splits=min(
                    plan.num_splits, -(-width // (plan.block_n // 2))))
            else:
                raise ValueError(f"plan_decode_paged: no plan fits {smem_limit} B of shared "
                                 f"memory (D={head_dim}, G={group}, kv_bytes={kv_bytes})")
        return plan

    block_n = 64 if head_dim <= 128 else 32
    if batch_invariant:
        return fitted(-(-width // BATCH_INVARIANT_SPLIT_COLS), block_n)
    plan = fitted(sm_count // (rows * num_kv_heads), block_n)
    if 2 * paged_smem_bytes(plan, head_dim, q_bytes, kv_bytes, backend) <= (device_smem or
                                                                             smem_limit):
        plan = fitted((2 * sm_count) // (rows * num_kv_heads), plan.block_n)
    return plan
