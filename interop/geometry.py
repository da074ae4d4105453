"""Launch geometry of the sparse prefill kernels, shared by both implementations.

:func:`select_prefill` maps (device facts, kernel kind, workload) to a :class:`Geometry`; the
Triton and the Pallas entry points call it with the same arguments, so a device and workload
launch the same tiles in both. Everything that decides a geometry is data here: ``TABLES`` (per
device family, ``(max_total_q, (BLOCK_N, num_warps, num_stages))`` rows, the first whose bound is
>= total_q wins, None = unbounded; H20/L20 from upstream SGLang 0.5.23, the SM90 table from our
H200 sweeps), ``TUNED_SM120`` (upstream's tuned family and its gates, ``qsa-contract.md`` §3) and
the head tile ``max(16, next_pow2(G))``. :func:`interop.contract.route` picks the table.

``QSA_PREFILL_GEOMETRY`` (read on every call): ``auto`` (default, also unset/empty) = the tuned
family where the route and all its gates allow it, else the table; ``table`` = always the table;
``tuned`` = the tuned family whenever it has an entry for G, skipping the device, Triton and
workload gates (geometry changes the speed, never the result). Anything else raises
``ContractError``. :func:`fit_prefill` then makes a geometry launchable (Pallas tiles powers of
two >= 16, then ``interop.plan.fit_shared_memory`` to the device's shared memory per block).
:func:`prefill_splits` (``PREFILL_SPLIT_RULES``) adds the split-KV share count of short calls.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Iterable

from .arch import DeviceFacts, KNOWN_ARCHS
from .contract import PREFILL_KINDS, ContractError, route
from .plan import fit_shared_memory, next_pow2, prev_pow2

__all__ = [
    "BLOCK_INDICES_DOC", "Geometry", "ENV_VAR", "ALLOWED_MODES", "TABLES", "TUNED_SM120",
    "SM90_TABLE_STATUS", "KINDS", "select_prefill", "fit_prefill", "table_for", "head_tile",
    "all_configs", "geometry_mode", "UnionGeometry", "UNION_RULES", "select_prefill_blocks",
    "fit_union", "max_union_entries", "all_union_configs", "PREFILL_SPLIT_RULES",
    "prefill_splits",
]

ENV_VAR = "QSA_PREFILL_GEOMETRY"
ALLOWED_MODES = ("auto", "table", "tuned")
KINDS = PREFILL_KINDS
BACKENDS = ("triton", "pallas")


@dataclasses.dataclass(frozen=True)
class Geometry:
    """One launch configuration of a sparse prefill kernel: ``block_m`` the head tile (the G query
    heads of one KV head, padded), ``block_n`` index columns per inner step (BLOCK_N), warps,
    pipeline stages, ``source``, e.g. ``"l20-table[total_q<=512]"``, and ``splits``: programs
    per (row, KV head), each over a contiguous share of the index columns, merged by LSE
    (split-KV, ``PREFILL_SPLIT_RULES``; 1 = one program a row). ``splits`` is not part of
    ``key``: Triton compiles its kernel once for any count > 1 (a launch count); the Pallas
    kernel traces per count (its share width is static). Raises ValueError for ``splits``
    outside [1, ``PREFILL_SPLIT_RULES["max_splits"]``]."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    source: str = ""
    splits: int = 1

    def __post_init__(self):
        # the merge kernels' split tile covers max_splits: a larger count must never launch
        if not 1 <= self.splits <= PREFILL_SPLIT_RULES["max_splits"]:
            raise ValueError(f"Geometry: splits must be in [1, "
                             f"{PREFILL_SPLIT_RULES['max_splits']}], got {self.splits}")

    @property
    def key(self) -> tuple[int, int, int, int]:
        """(block_m, block_n, num_warps, num_stages), without the source label."""
        return (self.block_m, self.block_n, self.num_warps, self.num_stages)

    @property
    def head_tile(self) -> int:
        """``block_m`` under the name ``interop.plan.fit_shared_memory`` reads."""
        return self.block_m


# Upstream SGLang 0.5.23 sparse_attn.py, restated in qsa-contract.md §3.
_H20 = ((32, (32, 8, 2)), (64, (64, 8, 2)), (1024, (32, 4, 2)), (None, (16, 1, 2)))
_L20 = ((32, (32, 8, 2)), (64, (64, 8, 2)), (128, (64, 4, 2)), (512, (32, 4, 2)), (None, (16, 1, 2)))

#: Where the SM90 table comes from (in benchmark JSON; bench/NOTES.md, "Geometry tables"):
#: (32,4,2) at 257-1024 rows, where (64,4,2)'s 3 programs per SM leave a partial second wave.
SM90_TABLE_STATUS = ("H200 sweeps (Triton 3.6, chunk prefill, G 6 and 12, 32k context): "
                     "(64,8,3) <= 128 rows, (64,4,2) <= 256, (32,4,2) <= 1024, (64,4,2) above; "
                     "bench/NOTES.md, 'Geometry tables'")
_SM90 = ((128, (64, 8, 3)), (256, (64, 4, 2)), (1024, (32, 4, 2)), (None, (64, 4, 2)))
#: Pallas keeps (32,4,2) above 256 rows: (64,4,2) above 1024 rows measured no faster for it
#: (bench/NOTES.md, "Sparse prefill, Triton").
_SM90_PALLAS = ((128, (64, 8, 3)), (256, (64, 4, 2)), (None, (32, 4, 2)))

TABLES: dict[str, tuple[tuple[int | None, tuple[int, int, int]], ...]] = {
    "h20-table": _H20, "l20-table": _L20, "sm90-table": _SM90, "sm90-table-pallas": _SM90_PALLAS,
}
_BACKEND_TABLE = {("pallas", "sm90-table"): "sm90-table-pallas"}

# Upstream's SM120 tuned family (qsa-contract.md §3); by_group: (BLOCK_M, BLOCK_N, warps, stages).
TUNED_SM120 = {
    "cc": (12, 0), "sm_count": 188, "min_triton": (3, 7), "head_dim": 256, "width": 2051,
    "by_group": {6: (8, 16, 4, 3), 12: (16, 16, 2, 3)},
    "ordinary_min_total_q": 8192, "chunk_min_rows_per_request": 512,
    "chunk_max_ragged_factor": 2,  # max_q * requests <= factor * total_q
}

# Route geometry source -> table name (the SM120 188-SM route falls back to L20).
_ROUTE_TABLE = {
    "sm90-table": "sm90-table", "l20-table": "l20-table", "h20-table": "h20-table",
    "sm120-tuned-or-table": "l20-table",
}


def head_tile(group: int) -> int:
    """Table head tile BLOCK_M = max(16, next_pow2(G)) (upstream's rule; 16 = smallest mma M).
    Raises nothing; source: upstream ``sglang/srt/layers/attention/qsa/sparse_attn.py``."""
    return max(16, next_pow2(group))


def geometry_mode(fn: str = "select_prefill") -> str:
    """The ``QSA_PREFILL_GEOMETRY`` value now (``auto`` when unset/empty); raises ContractError
    (naming ``fn``) for a value outside ``ALLOWED_MODES``. Source: qsa-contract.md §3 (the env
    override)."""
    raw = os.environ.get(ENV_VAR, "")
    mode = raw.strip().lower() or "auto"
    if mode not in ALLOWED_MODES:
        raise ContractError(fn, f"${ENV_VAR}",
                            f"one of {', '.join(ALLOWED_MODES)} (or unset = auto)", repr(raw))
    return mode


def table_for(name: str, total_q: int) -> tuple[tuple[int, int, int], str]:
    """Row of table ``name`` for ``total_q`` rows: ((BLOCK_N, warps, stages), label). Raises
    KeyError for a name not in ``TABLES``; source: ``TABLES`` (upstream SGLang 0.5.23,
    qsa-contract.md §3; SM90: bench/NOTES.md, "Geometry tables")."""
    for bound, cfg in TABLES[name]:
        if bound is None or total_q <= bound:
            label = f"{name}[total_q{'<=' + str(bound) if bound is not None else '>' + str(_last_bound(name))}]"
            return cfg, label
    raise AssertionError("tables end with an unbounded row")  # pragma: no cover


def _last_bound(name: str) -> int:
    return max(b for b, _ in TABLES[name] if b is not None)


def _tuned_gates(facts: DeviceFacts, kind: str, total_q: int, requests: int, max_q: int,
                 group: int, head_dim: int, width: int) -> list[str]:
    """Names of the tuned-family gates that fail (empty list = tuned applies)."""
    t = TUNED_SM120
    failed = []
    if facts.cc != t["cc"]:
        failed.append(f"arch {facts.arch} != sm_120")
    if facts.sm_count != t["sm_count"]:
        failed.append(f"{facts.sm_count} SMs != {t['sm_count']}")
    if facts.triton_tuple < t["min_triton"]:
        failed.append(f"Triton {facts.triton_version} < {'.'.join(map(str, t['min_triton']))}")
    if head_dim != t["head_dim"]:
        failed.append(f"D={head_dim} != {t['head_dim']}")
    if width != t["width"]:
        failed.append(f"W={width} != {t['width']}")
    if group not in t["by_group"]:
        failed.append(f"G={group} not in {sorted(t['by_group'])}")
    if kind == "ordinary":
        if total_q < t["ordinary_min_total_q"]:
            failed.append(f"ordinary total_q={total_q} < {t['ordinary_min_total_q']}")
    else:
        if total_q < t["chunk_min_rows_per_request"] * requests:
            failed.append(f"{kind}: {total_q} rows over {requests} requests < "
                          f"{t['chunk_min_rows_per_request']} rows per request")
        if max_q * requests > t["chunk_max_ragged_factor"] * total_q:
            failed.append(f"{kind}: max_q*requests={max_q * requests} > "
                          f"{t['chunk_max_ragged_factor']}*total_q")
    return failed


#: Split-KV for short prefills (``prefill_splits``): a call of T x Hkv rows too few to fill the
#: GPU leaves SMs idle while each program walks all W columns (MTP verify: 32 x 4 rows; chunks of
#: tens of rows), so each row's columns are split into up to floor(``programs_per_sm`` x SMs /
#: rows) shares (by backend: Triton's short-row tiles run one program an SM, and more shares than
#: fit at once only add waves), of at least ``min_split_columns`` each (a share's fixed cost: its
#: Q load and partial store), at most ``max_splits`` (each split writes fp32 partials). Measured:
#: bench/NOTES.md, "Split-KV prefill".
PREFILL_SPLIT_RULES = {"programs_per_sm": {"triton": 1, "pallas": 4}, "min_split_columns": 256,
                       "max_splits": 8}


def prefill_splits(facts: DeviceFacts, *, total_q: int, num_kv_heads: int, width: int,
                   backend: str = "triton") -> int:
    """Programs per (query row, KV head) of a sparse prefill call (``PREFILL_SPLIT_RULES``):
    floor(programs_per_sm[backend] x SMs / (T x Hkv)), at most ``max_splits`` and
    W // min_split_columns, at least 1. Host ints only (a captured graph keeps its count).
    Raises KeyError for an unknown backend; source: the split-KV of decode (FlashDecoding, Dao
    et al., 2023) applied to prefill rows."""
    u = PREFILL_SPLIT_RULES
    rows = max(1, int(total_q) * int(num_kv_heads))
    fill = u["programs_per_sm"][backend] * facts.sm_count // rows
    return max(1, min(u["max_splits"], fill, int(width) // u["min_split_columns"]))


def select_prefill(facts: DeviceFacts, kind: str, *, total_q: int, requests: int, max_q: int,
                   group: int, num_kv_heads: int, head_dim: int, width: int,
                   backend: str = "triton", kv_bytes: int = 2) -> Geometry:
    """Launch geometry of one sparse prefill call.

    Args:
      facts: the device that will run the kernel (real or hand-built DeviceFacts).
      kind: ``"ordinary"``, ``"chunk"`` or ``"paged"`` (paged is gated like chunk).
      total_q, requests, max_q: query rows T, requests B, the longest request's rows.
      group, num_kv_heads, head_dim, width: G = Hq / Hkv, Hkv (no table keys on it yet), D, W.
      backend: ``"triton"`` or ``"pallas"``: the same geometry except where ``_BACKEND_TABLE``
        names a table measured for that backend, and Pallas tiles rounded to powers of two >= 16.
      kv_bytes: bytes per K/V element (2, or 1 for FP8), for the shared-memory fit.

    Returns a Geometry fitted to ``facts.smem_per_block`` (``fit_prefill``), its ``source``
    naming the table row or tuned entry and the mode, ``splits`` from ``prefill_splits``.
    Raises ContractError for a bad ``QSA_PREFILL_GEOMETRY``, ValueError for an unknown kind or
    backend or a size < 1. Data: upstream SGLang 0.5.23 (H20/L20 tables, SM120 tuned family;
    ``qsa-contract.md`` §3), the SM90 table our H200 sweep (``SM90_TABLE_STATUS``).
    """
    if kind not in KINDS:
        raise ValueError(f"select_prefill: kind must be one of {KINDS}, got {kind!r}")
    if backend not in BACKENDS:
        raise ValueError(f"select_prefill: backend must be one of {BACKENDS}, got {backend!r}")
    for name, val in (("total_q", total_q), ("requests", requests), ("max_q", max_q),
                      ("group", group), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                      ("width", width)):
        if int(val) < 1:
            raise ValueError(f"select_prefill: {name} must be >= 1, got {val}")
    mode = geometry_mode()
    op = {"ordinary": "prefill", "chunk": "prefill_chunk", "paged": "prefill_paged"}[kind]
    r = route(facts, op)
    table = _ROUTE_TABLE.get(r.geometry, "l20-table")
    table = _BACKEND_TABLE.get((backend, table), table)
    tuned_entry = TUNED_SM120["by_group"].get(group)
    use_tuned = False
    if mode == "tuned":
        use_tuned = tuned_entry is not None
    elif mode == "auto" and r.geometry == "sm120-tuned-or-table":
        use_tuned = not _tuned_gates(facts, kind, total_q, requests, max_q, group, head_dim, width)
    if use_tuned:
        bm, bn, nw, ns = tuned_entry
        geo = Geometry(bm, bn, nw, ns, f"sm120-tuned[G={group}] mode={mode} backend={backend}")
    else:
        (bn, nw, ns), label = table_for(table, total_q)
        geo = Geometry(head_tile(group), bn, nw, ns, f"{label} mode={mode} backend={backend}")
    splits = prefill_splits(facts, total_q=total_q, num_kv_heads=num_kv_heads, width=width,
                            backend=backend)
    if splits > 1:
        geo = dataclasses.replace(geo, splits=splits, source=f"{geo.source} splits={splits}")
    return fit_prefill(geo, backend=backend, head_dim=head_dim, kv_bytes=kv_bytes,
                       limit=facts.smem_per_block)


def fit_prefill(geo: Geometry, *, backend: str, head_dim: int, kv_bytes: int,
                limit: int | None) -> Geometry:
    """The launchable form of ``geo`` with ``limit`` bytes of shared memory per block (None: no
    limit). Pallas needs power-of-two tiles and dots of >= 16 rows, so its head tile and BLOCK_N
    are rounded up first; then ``interop.plan.fit_shared_memory`` (with the tile both kernels'
    FP8 path converts V into, ``v_convert``). A changed geometry says
    ``fit<=limit`` in its source. Raises nothing of its own; source: our own (Pallas tiles),
    qsa-contract.md §5 (shared memory per block)."""
    if backend == "pallas":
        geo = dataclasses.replace(geo, block_m=max(16, next_pow2(geo.block_m)),
                                  block_n=max(16, next_pow2(geo.block_n)))
    fitted = fit_shared_memory(geo, head_dim=head_dim, limit=limit, kv_bytes=kv_bytes,
                               v_convert=True)
    if fitted != geo:
        fitted = dataclasses.replace(fitted, source=f"{geo.source} fit<={limit}B")
    return fitted


def _facts_for(arch: str) -> Iterable[DeviceFacts]:
    """Representative devices of an arch: every route the selector can take there."""
    info = KNOWN_ARCHS[arch]
    if arch == "sm_120":
        yield DeviceFacts.for_arch(arch, sm_count=188, triton_version="3.9.0")
        yield DeviceFacts.for_arch(arch, name="NVIDIA GeForce RTX 5090", sm_count=170,
                                   triton_version="3.9.0")
    elif arch == "sm_90":
        yield DeviceFacts.for_arch(arch, triton_version="3.9.0")
        yield DeviceFacts("NVIDIA H20", (9, 0), 78, info.smem_per_block, "3.9.0")
    else:
        yield DeviceFacts.for_arch(arch, triton_version="3.9.0")


def all_configs(arch: str) -> list[Geometry]:
    """Every geometry the selector can return on ``arch`` (any workload, env mode and G in 1..16;
    the tuned family everywhere, as ``tuned`` mode forces it), deduplicated by ``key``, for
    compile checks. Raises ValueError for an arch not in ``interop.arch.KNOWN_ARCHS``.
    Source: our own (enumerates ``select_prefill``'s tables and tuned family)."""
    if arch not in KNOWN_ARCHS:
        raise ValueError(f"all_configs: unknown arch {arch!r}; known: {sorted(KNOWN_ARCHS)}")
    seen: dict[tuple[int, int, int, int], Geometry] = {}
    tables = set()
    for facts in _facts_for(arch):
        for op in ("prefill", "prefill_chunk", "prefill_paged"):
            name = _ROUTE_TABLE.get(route(facts, op).geometry, "l20-table")
            tables.update({name} | {v for (_, k), v in _BACKEND_TABLE.items() if k == name})
    block_ms = sorted({head_tile(g) for g in range(1, 17)})
    for name in sorted(tables):
        for bound, (bn, nw, ns) in TABLES[name]:
            for bm in block_ms:
                g = Geometry(bm, bn, nw, ns, f"{name}[{bound}]")
                seen.setdefault(g.key, g)
    for grp, (bm, bn, nw, ns) in sorted(TUNED_SM120["by_group"].items()):
        g = Geometry(bm, bn, nw, ns, f"sm120-tuned[G={grp}]")
        seen.setdefault(g.key, g)
    return list(seen.values())


# ---------------------------------------------------------------------------------------------
# Block-level selections: tile-union kernel or the per-row kernel
@dataclasses.dataclass(frozen=True)
class UnionGeometry:
    """Launch plan of a prefill call given block-level selections (``block_indices=``).

    Attributes:
      kind: ``"union"`` (tile-union kernel: R consecutive rows of one request per program, the
        union of their blocks gathered once; tiles past ``max_union_entries`` go to the per-row
        kernel with ``select_prefill``'s geometry) or ``"rows"`` (the per-row kernel alone on the
        selection expanded to tokens on the device, with ``select_prefill``'s geometry).
      tile_rows: R (1 for ``"rows"``). head_tile: Q tile rows, ``max(16, R x next_pow2(G))``.
      block_n: K/V rows per inner step (4 x union blocks). num_warps, num_stages: as Geometry.
      source: the rule that decided, for benchmark JSON.
    """

    kind: str
    tile_rows: int
    head_tile: int
    block_n: int
    num_warps: int
    num_stages: int
    source: str = ""

    @property
    def key(self) -> tuple:
        """(kind, tile_rows, head_tile, block_n, num_warps, num_stages)."""
        return (self.kind, self.tile_rows, self.head_tile, self.block_n, self.num_warps,
                self.num_stages)


#: The ``block_indices`` / ``overlap`` arguments as every prefill entry point of both backends
#: documents them (substituted for ``BLOCKS_DOC`` in their docstrings).
BLOCK_INDICES_DOC = """block_indices: keyword-only alternative to ``indices`` (pass
        ``indices=None``): int32 [T, NB] or [T, Hkv, NB] with 1 <= NB <= 2048 (strict: 512),
        the indexer's row-relative block ids (block g = tokens 4g .. 4g+3), in any order,
        invalid ids anywhere; g is valid iff 0 <= g < visible // 4. Every row also attends its
        causal tail [4 * (visible // 4), visible). Result: the token path on
        ``interop.indices.expand_prefill_blocks`` up to summation order; a block listed twice is
        attended twice (such a tile's rows always go to the per-row kernel) and, as on token
        rows, only the expansion's first min(4 NB + 3, visible) entries count: repeated ids
        that expand past a row's visible tokens push its last entries, tail included, out. Runs the
        tile-union kernel (the per-row kernel on tiles whose union is past
        ``max_union_entries``) or the per-row kernel (``interop.geometry.select_prefill_blocks``).
      overlap: with ``block_indices`` only: None, or the engine's expected Jaccard similarity of
        adjacent rows' block sets in [0, 1] (below ``UNION_RULES['min_overlap']`` the per-row
        kernel runs)."""

#: The selector's data (``select_prefill_blocks``; measured in bench/NOTES.md, "Tile-union"):
#: ``q_rows``: the Q tile aimed for (one wgmma M tile; 128 rows measured slower), R x
#: next_pow2(G) lanes (Triton) or R x G (Pallas: dense rows, faster at G = 12, R = 5; R = 10 at
#: G = 6 measured slower than 8); ``max_tile_rows``: keeps the causal-tail step (R + 3 tokens) in
#: one BLOCK_N >= 16 chunk; ``min_rows_per_request``: below it a tile has one row;
#: ``min_overlap``: an engine's neighbour-Jaccard hint below it gets the per-row kernel;
#: ``max_sort_keys``: R x next_pow2(NB) keys sorted in registers; ``max_union_work``: see
#: ``max_union_entries``; ``min_rows_per_sm``: below that many query rows x KV heads (T x Hkv)
#: per SM the per-row kernel's T x Hkv light programs beat the fewer, heavier tiles (a tile's
#: gain grows with R, so rows, not tiles, set the bound: J 0.9 crossovers at 1k-2k rows for
#: R = 4 and 8; MTP verify batches measured slower as tiles); ``tile``: (BLOCK_N, warps,
#: stages) by backend (4 warps: one warpgroup owns the 64-row tile; a third stage measured
#: faster for Pallas only; ``fit_union`` drops stages to what sm_12x's shared memory holds).
UNION_RULES = {
    "q_rows": 64, "max_tile_rows": 8, "min_rows_per_request": 2, "min_overlap": 0.8,
    "max_sort_keys": 8192, "max_union_work": 1.5, "min_rows_per_sm": 15,
    "tile": {"triton": (32, 4, 2), "pallas": (32, 4, 3)},
}


def max_union_entries(geo: UnionGeometry, block_width: int, row_tile: int) -> int:
    """Largest union (entries) for which a tile runs the tile-union kernel; past it the per-row
    kernel computes the tile's rows (vLLM #55372's bound). Rule: the padded dot work
    |union| x head_tile stays within ``UNION_RULES['max_union_work']`` times the rows' own,
    R x NB x ``row_tile`` (the per-row kernel's Q tile). Both backends compare it with the
    union's length on the device, per tile. ``geo``: a ``"union"`` UnionGeometry;
    ``block_width``: NB.
    Returns an int >= 0 (may exceed int32: launchers cap it). Raises nothing of its own; source:
    vLLM #55372's bound; bench/NOTES.md, "Tile-union sparse prefill"."""
    return int(UNION_RULES["max_union_work"] * geo.tile_rows * int(block_width) * row_tile
               // geo.head_tile)


def select_prefill_blocks(facts: DeviceFacts, kind: str, *, total_q: int, requests: int,
                          max_q: int, group: int, num_kv_heads: int, head_dim: int,
                          block_width: int, backend: str = "triton", kv_bytes: int = 2,
                          overlap: float | None = None) -> UnionGeometry:
    """Kernel and geometry (UnionGeometry) of a prefill call with block-level selections.

    Rule (``UNION_RULES``; host facts only, so a captured graph keeps its choice):
      1. ``overlap`` (expected Jaccard similarity of adjacent rows' block sets, a float in
         [0, 1]; None = the indexer's typical 0.87-0.94) below ``min_overlap`` -> ``"rows"``;
      2. mean rows per request below ``min_rows_per_request`` -> ``"rows"``;
      3. Triton: R = q_rows // next_pow2(G), clamped to [1, max_tile_rows] and to the largest
         power of two <= the mean rows per request, halved while R x next_pow2(NB) >
         max_sort_keys; Pallas (dense rows, any R): R = q_rows // G clamped to [1,
         max_tile_rows] and to the mean rows per request, lowered while R x next_pow2(NB) >
         max_sort_keys; R = 1 -> ``"rows"``; the Q tile: next_pow2 of the R rows' lanes
         (R x next_pow2(G), or R x G for Pallas), at least 16;
      4. T x Hkv below ``min_rows_per_sm`` x SMs -> ``"rows"``;
      5. else ``"union"`` with the backend's (BLOCK_N, warps, stages), fitted by ``fit_union``.
    ``"rows"`` carries ``select_prefill``'s geometry. Other arguments as ``select_prefill``;
    ``block_width``: NB block ids per row. Raises ValueError (bad kind/backend, a size < 1,
    overlap outside [0, 1]) or ContractError (a bad ``QSA_PREFILL_GEOMETRY``).
    Source: our own; bench/NOTES.md, "Tile-union sparse prefill".
    """
    if overlap is not None and not 0.0 <= float(overlap) <= 1.0:
        raise ValueError(f"select_prefill_blocks: overlap must be None or in [0, 1], got {overlap}")
    if int(block_width) < 1:
        raise ValueError(f"select_prefill_blocks: block_width must be >= 1, got {block_width}")
    rows_geo = select_prefill(facts, kind, total_q=total_q, requests=requests, max_q=max_q,
                              group=group, num_kv_heads=num_kv_heads, head_dim=head_dim,
                              width=4 * int(block_width) + 3, backend=backend,
                              kv_bytes=kv_bytes)
    u = UNION_RULES

    def rows(why: str) -> UnionGeometry:
        return UnionGeometry("rows", 1, rows_geo.block_m, rows_geo.block_n, rows_geo.num_warps,
                             rows_geo.num_stages, f"rows[{why}] {rows_geo.source}")

    if overlap is not None and float(overlap) < u["min_overlap"]:
        return rows(f"overlap={float(overlap):.2f}<{u['min_overlap']}")
    per_request = total_q // requests
    if per_request < u["min_rows_per_request"]:
        return rows(f"rows/request={per_request}<{u['min_rows_per_request']}")
    if backend == "pallas":  # dense rows: R x G lanes of the Q tile, any R
        r = max(1, min(u["max_tile_rows"], u["q_rows"] // group, per_request))
        while r > 1 and r * next_pow2(block_width) > u["max_sort_keys"]:
            r -= 1
    else:  # R x next_pow2(G) lanes, R a power of two (the build's in-register sort)
        r = max(1, min(u["max_tile_rows"], u["q_rows"] // next_pow2(group),
                       prev_pow2(per_request)))
        while r > 1 and r * next_pow2(block_width) > u["max_sort_keys"]:
            r //= 2
    if r == 1:
        return rows("R=1")
    if total_q * num_kv_heads < u["min_rows_per_sm"] * facts.sm_count:
        return rows(f"rows={total_q * num_kv_heads}<{u['min_rows_per_sm']}x{facts.sm_count}SMs")
    bn, nw, ns = u["tile"][backend]
    lanes = r * (group if backend == "pallas" else next_pow2(group))
    geo = UnionGeometry("union", r, max(16, next_pow2(lanes)), bn, nw, ns,
                        f"union[R={r},G={group}] {facts.arch} backend={backend}")
    return fit_union(geo, backend=backend, head_dim=head_dim, kv_bytes=kv_bytes,
                     limit=facts.smem_per_block)


def fit_union(geo: UnionGeometry, *, backend: str, head_dim: int, kv_bytes: int,
              limit: int | None) -> UnionGeometry:
    """The launchable form of a union geometry: BLOCK_N a power of two >= max(16, R + 3) (dots
    of >= 16 rows; the causal tail in one chunk), then ``interop.plan.fit_shared_memory``, never
    below that floor. ``"rows"`` geometries are returned as they are. Raises nothing of its own;
    source: our own; bench/NOTES.md, "Tile-union sparse prefill"."""
    if geo.kind != "union":
        return geo
    floor = max(16, next_pow2(geo.tile_rows + 3))
    geo = dataclasses.replace(geo, block_n=max(floor, next_pow2(geo.block_n)))
    fitted = fit_shared_memory(geo, head_dim=head_dim, limit=limit, kv_bytes=kv_bytes)
    if fitted.block_n < floor:
        fitted = dataclasses.replace(fitted, block_n=floor)
    if fitted != geo:
        fitted = dataclasses.replace(fitted, source=f"{geo.source} fit<={limit}B")
    return fitted


def all_union_configs(arch: str, *, head_dim: int = 256,
                      backend: str | None = None) -> list[tuple[int, UnionGeometry]]:
    """Every union geometry ``select_prefill_blocks`` can return on ``arch`` for ``backend``
    (None: either) (any G in 1..16, any rows per request, 2- or 1-byte K/V), deduplicated, as
    (kv_bytes, UnionGeometry) for compile checks. Raises ValueError for an unknown arch or
    backend, ContractError for a bad ``QSA_PREFILL_GEOMETRY``. Source: our own (enumerates
    ``select_prefill_blocks``)."""
    if arch not in KNOWN_ARCHS:
        raise ValueError(f"all_union_configs: unknown arch {arch!r}; known: {sorted(KNOWN_ARCHS)}")
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"all_union_configs: unknown backend {backend!r}; known: {BACKENDS}")
    facts = DeviceFacts.for_arch(arch, triton_version="3.9.0")
    seen: dict[tuple, tuple[int, UnionGeometry]] = {}
    for kv_bytes in (2, 1):
        for group in range(1, 17):
            for per_request in (2, 4, 8, 8192):
                for be in BACKENDS if backend is None else (backend,):
                    geo = select_prefill_blocks(
                        facts, "chunk", total_q=8192, requests=8192 // per_request,
                        max_q=per_request,
                        group=group, num_kv_heads=1, head_dim=head_dim, block_width=512,
                        backend=be, kv_bytes=kv_bytes)
                    if geo.kind == "union":
                        seen.setdefault((kv_bytes, geo.key), (kv_bytes, geo))
    return list(seen.values())
