"""Launch-geometry selector for the sparse prefill kernels, shared by both implementations.

One function, :func:`select_prefill`, maps (device facts, kernel kind, workload) to a
:class:`Geometry` ``(block_m, block_n, num_warps, num_stages, source)``. The Triton entry points
(``qsa_triton.prefill``) and the Pallas ones call it with the same arguments, so a given device and
workload launches the same tile shapes in both.

Everything that decides a geometry is *data* in this module:
  * ``TABLES``: per device family, a list of ``(max_total_q, (BLOCK_N, num_warps, num_stages))``
    rows, first row whose bound is >= total_q wins (``None`` = no bound). The H20 and L20 tables
    are upstream SGLang 0.5.23's (``sglang/srt/layers/attention/qsa/sparse_attn.py``, restated in
    ``qsa-contract.md`` §3); the SM90 table comes from our H200 sweeps (``SM90_TABLE_STATUS``).
  * ``TUNED_SM120``: upstream's SM120 tuned family and its gates (``qsa-contract.md`` §3): used only
    on the 188-SM sm_120 part, Triton >= 3.7, D = 256, W = 2051, G in {6, 12}; ordinary prefill at
    >= 8192 rows, chunk/paged prefill at >= 512 rows per request (mean) with
    ``max_q * requests <= 2 * total_q`` (not too ragged).
  * ``BLOCK_M`` of the tables is the head tile ``max(16, next_pow2(G))`` (upstream's rule: the
    smallest tensor-core M tile); the tuned family carries its own BLOCK_M.

Which table applies comes from :func:`interop.contract.route` (the one routing decision).
The environment variable ``QSA_PREFILL_GEOMETRY`` (read on every call, so tests and benchmarks can
flip it without re-importing) chooses:
  * ``auto`` (default, also when unset or empty): the tuned family where the route and all its
    gates allow it, else the route's table;
  * ``table``: the route's table, always;
  * ``tuned``: the tuned family whenever it has an entry for the group G (6 or 12), skipping the
    device, Triton-version and workload gates (an experiment switch: geometry never changes the
    result, only the speed); other groups fall back to the table.
Anything else raises ``ContractError`` naming the allowed values.

Every geometry is then made launchable by :func:`fit_prefill`: Pallas tiles rounded to powers of
two >= 16, then ``interop.plan.fit_shared_memory`` (the one shared-memory model of all kernels)
to the device's shared memory per block, so a row tuned for sm_90 still launches on sm_12x.

This module imports numpy-free stdlib only (plus ``interop.arch`` / ``contract`` / ``plan``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Iterable

from .arch import DeviceFacts, KNOWN_ARCHS
from .contract import ContractError, route
from .plan import fit_shared_memory, next_pow2, prev_pow2

__all__ = [
    "BLOCK_INDICES_DOC",
    "Geometry",
    "ENV_VAR",
    "ALLOWED_MODES",
    "TABLES",
    "TUNED_SM120",
    "SM90_TABLE_STATUS",
    "KINDS",
    "select_prefill",
    "fit_prefill",
    "table_for",
    "head_tile",
    "all_configs",
    "geometry_mode",
    "UnionGeometry",
    "UNION_RULES",
    "select_prefill_blocks",
    "fit_union",
    "max_union_entries",
    "all_union_configs",
]

ENV_VAR = "QSA_PREFILL_GEOMETRY"
ALLOWED_MODES = ("auto", "table", "tuned")
KINDS = ("ordinary", "chunk", "paged")
BACKENDS = ("triton", "pallas")


@dataclasses.dataclass(frozen=True)
class Geometry:
    """One launch configuration of a sparse prefill kernel.

    Attributes:
      block_m: head tile (rows of the Q tile: the G query heads of one KV head, padded).
      block_n: index columns (gathered K/V rows) per inner-loop step (BLOCK_N).
      num_warps: warps per program.
      num_stages: software-pipelining depth of the inner loop.
      source: where it came from, e.g. ``"l20-table[total_q<=512]"`` or ``"sm120-tuned[G=12]"``.
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    source: str = ""

    @property
    def key(self) -> tuple[int, int, int, int]:
        """(block_m, block_n, num_warps, num_stages), without the source label."""
        return (self.block_m, self.block_n, self.num_warps, self.num_stages)

    @property
    def head_tile(self) -> int:
        """``block_m`` under the name ``interop.plan.fit_shared_memory`` reads."""
        return self.block_m


# (max_total_q inclusive or None = unbounded, (BLOCK_N, num_warps, num_stages)).
# Source: upstream SGLang 0.5.23 sparse_attn.py, restated in qsa-contract.md §3.
_H20 = ((32, (32, 8, 2)), (64, (64, 8, 2)), (1024, (32, 4, 2)), (None, (16, 1, 2)))
_L20 = ((32, (32, 8, 2)), (64, (64, 8, 2)), (128, (64, 4, 2)), (512, (32, 4, 2)), (None, (16, 1, 2)))

#: Where the SM90 table comes from (recorded in benchmark JSON). The H200 sweeps of the Triton
#: kernel (bench/NOTES.md, "SM90 table"): 8-warp, 3-stage tiles win while few programs exist;
#: (32,4,2) at 257-1024 rows, where (64,4,2)'s 3 programs per SM leave a partial second wave;
#: (64,4,2) above, where the grid is many waves deep.
SM90_TABLE_STATUS = ("H200 sweeps (Triton 3.6, chunk prefill, G 6 and 12, 32k context): "
                     "(64,8,3) <= 128 rows, (64,4,2) <= 256, (32,4,2) <= 1024, (64,4,2) above; "
                     "bench/NOTES.md, 'SM90 table'")
_SM90 = ((128, (64, 8, 3)), (256, (64, 4, 2)), (1024, (32, 4, 2)), (None, (64, 4, 2)))
#: The Pallas kernel keeps (32,4,2) above 256 rows, where it was measured on the H200
#: (bench/NOTES.md, "Sparse prefill, Pallas"); (64,4,2) is unmeasured for Pallas, so the Triton
#: measurement does not switch it on.
_SM90_PALLAS = ((128, (64, 8, 3)), (256, (64, 4, 2)), (None, (32, 4, 2)))

TABLES: dict[str, tuple[tuple[int | None, tuple[int, int, int]], ...]] = {
    "h20-table": _H20,
    "l20-table": _L20,
    "sm90-table": _SM90,
    "sm90-table-pallas": _SM90_PALLAS,
}
# Per-backend table overrides, used where one backend measured best with other tuples.
_BACKEND_TABLE = {("pallas", "sm90-table"): "sm90-table-pallas"}

# Upstream's SM120 tuned family (qsa-contract.md §3). Geometry per group: (BLOCK_M, BLOCK_N,
# num_warps, num_stages).
TUNED_SM120 = {
    "cc": (12, 0),
    "sm_count": 188,
    "min_triton": (3, 7),
    "head_dim": 256,
    "width": 2051,
    "by_group": {6: (8, 16, 4, 3), 12: (16, 16, 2, 3)},
    "ordinary_min_total_q": 8192,
    "chunk_min_rows_per_request": 512,
    "chunk_max_ragged_factor": 2,  # max_q * requests <= factor * total_q
}

# Route geometry source -> table name (the SM120 188-SM route falls back to L20).
_ROUTE_TABLE = {
    "sm90-table": "sm90-table",
    "l20-table": "l20-table",
    "h20-table": "h20-table",
    "sm120-tuned-or-table": "l20-table",
}


def head_tile(group: int) -> int:
    """Table head tile BLOCK_M = max(16, next_pow2(G)) (upstream's rule; 16 = smallest mma M)."""
    return max(16, next_pow2(group))


def geometry_mode(fn: str = "select_prefill") -> str:
    """The ``QSA_PREFILL_GEOMETRY`` value now (``auto`` when unset/empty).

    Args:
      fn: the entry point named in the error message.

    Raises:
      ContractError: a value outside ``ALLOWED_MODES``.
    """
    raw = os.environ.get(ENV_VAR, "")
    mode = raw.strip().lower() or "auto"
    if mode not in ALLOWED_MODES:
        raise ContractError(fn, f"${ENV_VAR}",
                            f"one of {', '.join(ALLOWED_MODES)} (or unset = auto)", repr(raw))
    return mode


def table_for(name: str, total_q: int) -> tuple[tuple[int, int, int], str]:
    """Row of table ``name`` for ``total_q`` rows: ((BLOCK_N, warps, stages), label)."""
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


def select_prefill(facts: DeviceFacts, kind: str, *, total_q: int, requests: int, max_q: int,
                   group: int, num_kv_heads: int, head_dim: int, width: int,
                   backend: str = "triton", kv_bytes: int = 2) -> Geometry:
    """Launch geometry of one sparse prefill call.

    Args:
      facts: the device that will run the kernel (``DeviceFacts.from_torch()`` / ``from_jax()``,
        or hand-built for tests / ahead-of-time compiles).
      kind: ``"ordinary"``, ``"chunk"`` or ``"paged"`` (paged is gated like chunk: it runs the
        same loop over pool slots).
      total_q: query rows T of the call (all requests).
      requests: number of requests B.
      max_q: the longest request's query rows (``max_seqlen_q``).
      group: GQA group G = Hq / Hkv.
      num_kv_heads: Hkv (recorded for future tables; no table is keyed on it yet).
      head_dim: D.
      width: index columns W per row.
      backend: ``"triton"`` or ``"pallas"`` (recorded in ``source``); the same geometry except
        where ``_BACKEND_TABLE`` names a table measured for that backend (Pallas on sm_90), and
        Pallas tiles rounded up to powers of two >= 16 (``fit_prefill``).
      kv_bytes: bytes per K/V element (2, or 1 for FP8), for the shared-memory fit.

    Returns:
      Geometry with a ``source`` naming the table row or tuned entry and the env mode, fitted to
      ``facts.smem_per_block`` (``fit_prefill``).

    Raises:
      ContractError: ``QSA_PREFILL_GEOMETRY`` holds a value other than auto/table/tuned.
      ValueError: unknown ``kind`` or ``backend``, or non-positive sizes.

    Source of the data: upstream SGLang 0.5.23 (H20/L20 tables, SM120 tuned family, restated in
    ``qsa-contract.md`` §3); the SM90 table: our H200 sweep (``SM90_TABLE_STATUS``).
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
    return fit_prefill(geo, backend=backend, head_dim=head_dim, kv_bytes=kv_bytes,
                       limit=facts.smem_per_block)


def fit_prefill(geo: Geometry, *, backend: str, head_dim: int, kv_bytes: int,
                limit: int | None) -> Geometry:
    """The launchable form of a selected geometry on a device with ``limit`` bytes of shared
    memory per block (None: no limit, e.g. an interpreter).

    Pallas (Triton lowering) needs power-of-two tiles and dot operands of >= 16 rows, so its
    head tile and BLOCK_N are rounded up to powers of two >= 16 first. Then
    ``interop.plan.fit_shared_memory`` (fewer stages, then a smaller BLOCK_N) until
    ``interop.plan.smem_bytes`` fits; a changed geometry says ``fit<=limit`` in its source.
    """
    if backend == "pallas":
        geo = dataclasses.replace(geo, block_m=max(16, next_pow2(geo.block_m)),
                                  block_n=max(16, next_pow2(geo.block_n)))
    fitted = fit_shared_memory(geo, head_dim=head_dim, limit=limit, kv_bytes=kv_bytes)
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
    """Every geometry the selector can return on ``arch`` (any workload, any env mode, any group
    G in 1..16), deduplicated by (block_m, block_n, num_warps, num_stages), for compile checks.

    Includes the tuned family on every arch, because ``QSA_PREFILL_GEOMETRY=tuned`` forces it.

    Raises:
      ValueError: ``arch`` is not in ``interop.arch.KNOWN_ARCHS``.
    """
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
      kind: ``"union"`` (the tile-union kernel: R consecutive rows of one request per program,
        the union of their blocks gathered once) or ``"rows"`` (the per-row kernel on the
        selection expanded to tokens on the device; its launch geometry is ``select_prefill``'s).
      tile_rows: R, query rows per tile (1 for ``"rows"``).
      head_tile: rows of the Q tile, ``max(16, R x next_pow2(G))`` (the R rows' G heads each
        padded to a power of two); the name ``interop.plan.fit_shared_memory`` reads.
      block_n: K/V rows per inner step (BLOCK_N = 4 x union blocks per step).
      num_warps, num_stages: Triton launch parameters.
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


#: The selector's data (``select_prefill_blocks``; measurements in bench/NOTES.md, "Tile-union"):
#:   * ``q_rows``: the Q tile the union kernel aims for, R x next_pow2(G) = 64 rows (one wgmma M
#:     tile on sm_90; 4 mma.sync M tiles on sm_12x): G = 12 -> R = 4, G = 6 -> R = 8; a
#:     128-row tile (R doubled) measured slower (the union grows with R, the dots do not speed up);
#:   * ``max_tile_rows``: R <= 8 keeps the causal-tail step in one BLOCK_N >= 16 chunk
#:     (R + 3 tokens) and the union's sort at R x 512 keys;
#:   * ``min_rows_per_request``: below 2 rows per request (decode-like batches) a tile has one
#:     row and the per-row kernel is the same work without the union build;
#:   * ``min_overlap``: an engine that knows its selections barely overlap (neighbour Jaccard
#:     below this) passes ``overlap=`` and gets the per-row kernel without the union build;
#:   * ``max_sort_keys``: R x next_pow2(NB) keys sorted in one program's registers;
#:   * ``max_union_work``: the per-tile switch to row-by-row work (``max_union_entries``);
#:   * ``tile``: (BLOCK_N, num_warps, num_stages) by arch: BLOCK_N 32 (4 union blocks), 4 warps
#:     (one warpgroup owns the 64-row tile; 8 warps split it and measured slower), 2 stages fit
#:     sm_12x's 101,376 B (``interop.plan.smem_bytes``).
#: The ``block_indices`` / ``overlap`` arguments as every prefill entry point of both backends
#: documents them (substituted for ``BLOCKS_DOC`` in their docstrings).
BLOCK_INDICES_DOC = """block_indices: keyword-only alternative to ``indices`` (pass ``indices=None``): int32
        [T, NB] or [T, Hkv, NB], the indexer's row-relative block ids (block g = tokens
        4g .. 4g+3), in any order, invalid ids anywhere; g is valid iff
        0 <= g < visible // 4. Every row also attends its causal tail
        [4 * (visible // 4), visible). Result: the token path on
        ``interop.indices.expand_prefill_blocks`` up to summation order; a block listed twice is
        attended twice. One exception, only with repeated ids (the indexer's top-k never
        repeats one): where a row's repeats make its expansion longer than ``visible`` tokens,
        the token path keeps the first ``visible`` columns but the tile-union kernel attends
        every occurrence and the tail, so the result then depends on the kernel the selector
        picks. Runs the tile-union kernel or the per-row kernel
        (``interop.geometry.select_prefill_blocks``).
      overlap: with ``block_indices`` only: None, or the engine's expected Jaccard similarity of
        adjacent rows' block sets in [0, 1] (below ``UNION_RULES['min_overlap']`` the per-row
        kernel runs)."""

UNION_RULES = {
    "q_rows": 64,
    "max_tile_rows": 8,
    "min_rows_per_request": 2,
    "min_overlap": 0.3,
    "max_sort_keys": 8192,
    "max_union_work": 1.5,
    "tile": {"default": (32, 4, 2)},
}


def max_union_entries(geo: UnionGeometry, block_width: int, row_tile: int) -> int:
    """Largest union (entries) for which a tile runs the union path; past it the tile's rows run
    one at a time over their own blocks (vLLM #55372's bound: never much more dot work than the
    per-row kernel). Rule: the union path's padded dot work |union| x head_tile must stay within
    ``UNION_RULES['max_union_work']`` times the rows' own, R x NB x ``row_tile``. Both kernels
    compare it with the union's length on the device, per tile: barely overlapping selections
    then cost the row-by-row work plus the build instead of R-times larger dots (measured in
    bench/NOTES.md, "Tile-union"), overlapping ones take the union.

    Args:
      geo: a ``"union"`` UnionGeometry (tile_rows R, head_tile).
      block_width: NB, block ids per row (int).
      row_tile: the row path's Q tile, max(16, next_pow2(G)) rows (int).

    Returns:
      int >= 0, a count of union entries (may exceed int32: launchers cap it).
    """
    return int(UNION_RULES["max_union_work"] * geo.tile_rows * int(block_width) * row_tile
               // geo.head_tile)


def select_prefill_blocks(facts: DeviceFacts, kind: str, *, total_q: int, requests: int,
                          max_q: int, group: int, num_kv_heads: int, head_dim: int,
                          block_width: int, backend: str = "triton", kv_bytes: int = 2,
                          overlap: float | None = None) -> UnionGeometry:
    """Kernel and geometry of a prefill call with block-level selections.

    Rule (``UNION_RULES``; host facts only, no device value is read, so a captured graph or a
    jitted function keeps its choice when lengths change):
      1. ``overlap`` (the engine's hint: expected Jaccard similarity of adjacent rows' block
         sets; None = the indexer's typical 0.87-0.94) below ``min_overlap`` -> ``"rows"``;
      2. mean rows per request ``total_q // requests`` below ``min_rows_per_request`` ->
         ``"rows"``;
      3. R = q_rows // next_pow2(G), clamped to [1, max_tile_rows], to the largest power of two
         <= the mean rows per request, and halved while R x next_pow2(NB) > max_sort_keys;
         R = 1 -> ``"rows"`` (a one-row tile is the per-row kernel plus a build);
      4. else ``"union"`` with the arch's (BLOCK_N, warps, stages), fitted by ``fit_union``.
    ``"rows"`` carries the per-row kernel's ``select_prefill`` geometry (head_tile = its BLOCK_M).

    Args:
      facts, kind, total_q, requests, max_q, group, num_kv_heads, head_dim, backend, kv_bytes:
        as ``select_prefill``.
      block_width: NB, block ids per row.
      overlap: None or a float in [0, 1] (see rule 1).

    Returns:
      UnionGeometry.

    Raises:
      ValueError: bad kind/backend, non-positive sizes, overlap outside [0, 1].
      ContractError: a bad ``QSA_PREFILL_GEOMETRY`` (the per-row selector's switch).
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
    ht = next_pow2(group)
    r = max(1, min(u["max_tile_rows"], u["q_rows"] // ht, prev_pow2(per_request)))
    while r > 1 and r * next_pow2(block_width) > u["max_sort_keys"]:
        r //= 2
    if r == 1:
        return rows("R=1")
    bn, nw, ns = u["tile"].get(facts.arch, u["tile"]["default"])
    geo = UnionGeometry("union", r, max(16, r * ht), bn, nw, ns,
                        f"union[R={r},G={group}] {facts.arch} backend={backend}")
    return fit_union(geo, backend=backend, head_dim=head_dim, kv_bytes=kv_bytes,
                     limit=facts.smem_per_block)


def fit_union(geo: UnionGeometry, *, backend: str, head_dim: int, kv_bytes: int,
              limit: int | None) -> UnionGeometry:
    """The launchable form of a union geometry: BLOCK_N a power of two >= max(16, R + 3) (dot
    operands of >= 16 rows; the causal-tail step fits one chunk), then
    ``interop.plan.fit_shared_memory`` on ``interop.plan.smem_bytes`` with the Q tile as head
    tile (fewer stages, then a smaller BLOCK_N, never below that floor). ``"rows"`` geometries
    are returned as they are (``select_prefill`` fitted them)."""
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


def all_union_configs(arch: str, *, head_dim: int = 256) -> list[tuple[int, UnionGeometry]]:
    """Every union geometry ``select_prefill_blocks`` can return on ``arch`` (any G in 1..16,
    any rows per request, K/V of 2 or 1 bytes), deduplicated, for compile checks.

    Returns:
      list of (kv_bytes, UnionGeometry).

    Raises:
      ValueError: unknown arch.
    """
    if arch not in KNOWN_ARCHS:
        raise ValueError(f"all_union_configs: unknown arch {arch!r}; known: {sorted(KNOWN_ARCHS)}")
    facts = DeviceFacts.for_arch(arch, triton_version="3.9.0")
    seen: dict[tuple, tuple[int, UnionGeometry]] = {}
    for kv_bytes in (2, 1):
        for group in range(1, 17):
            for per_request in (2, 4, 8, 8192):
                for backend in BACKENDS:
                    geo = select_prefill_blocks(
                        facts, "chunk", total_q=per_request, requests=1, max_q=per_request,
                        group=group, num_kv_heads=1, head_dim=head_dim, block_width=512,
                        backend=backend, kv_bytes=kv_bytes)
                    if geo.kind == "union":
                        seen.setdefault((kv_bytes, geo.key), (kv_bytes, geo))
    return list(seen.values())
