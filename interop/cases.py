"""The one table of named shapes (tokamax's ``arg_specs`` idea), used by the tests, ``qsa check``
and ``bench/``; numpy only.

* One spec class per op (``OPS``): ``DecodeSpec``, ``PrefillSpec``, ``PagedSpec``,
  ``IndexerSpec`` and ``StepSpec``.
* ``full_matrix()`` (GPU, production shapes), ``quick_matrix()`` (CPU interpret mode, tiny sizes,
  fp16: the Triton interpreter's bf16 dot is wrong), ``conformance_matrix()`` /
  ``gpu_conformance_matrix()`` (what ``tests/conformance.py`` runs).
* ``PARAMS`` (each entry point's parameter names: the one place that knows their order),
  ``case_data()`` (a case's arguments by name but the random values), ``reference()`` (the FP64
  reference of a call by name), ``compare()`` (the pass criteria, ``qsa-contract.md`` §6).
* ``BENCH_*``: the shapes ``bench/`` times on the GPU."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Sequence

import numpy as np

from . import indices as I
from . import reference as R
from .contract import PREFILL_KINDS

__all__ = [
    "RTOL", "ATOL", "REL_L2", "OPS", "TP_SHAPES", "DECODE_BATCHES", "PREFILL_KINDS", "DecodeSpec",
    "PrefillSpec", "Spec", "full_matrix", "quick_matrix", "edge_cases", "conformance_matrix",
    "gpu_conformance_matrix", "by_name", "ENTRY", "PARAMS", "CaseData", "case_data",
    "empty_outputs", "token_indices", "slot_table_of", "reference", "compare",
    "BENCH_DECODE_BATCHES", "BENCH_DECODE_ROWS", "BENCH_PREFILL_ROWS", "BENCH_PREFILL_KV",
    "PagedSpec", "IndexerSpec", "StepSpec", "INDEX_ENTRIES", "KW_DEFAULTS", "ENTRY_OP",
]

RTOL = ATOL = 2e-2
REL_L2 = 5e-3
OPS = ("decode", "prefill", "paged", "indexer", "step")
TP_SHAPES = {"TP1": (24, 2), "TP2": (12, 1), "TP4": (6, 1)}
DECODE_BATCHES = tuple(range(1, 17)) + (17, 24, 32, 48, 64, 96, 128)


# --------------------------------------------------------------------------------------------
# The matrix as data.
@dataclasses.dataclass(frozen=True)
class DecodeSpec:
    """One packed varlen decode case (``qsa-contract.md`` §2), laid out by
    ``interop.indices.decode_case``. slack: extra K/V rows after the last sequence, NaN with
    ``poison``. pad_capacity: K/V capacity batch x max_len + slack whatever the lengths, so the
    patterns of one (rank shape, B) share shapes and jitted kernels."""

    name: str
    hq: int
    hkv: int
    d: int
    batch: int
    pattern: str
    max_len: int = I.WIDTH
    dtype: str = "bfloat16"
    zero_rows: int = 0
    slack: int = 0
    poison: bool = False
    seed: int = 0
    pad_capacity: bool = True
    op: str = "decode"

    @property
    def size(self) -> int:
        """Rough work estimate (keys x heads x D), for progress weighting (every spec has one)."""
        return self.batch * self.max_len * self.hq * self.d


@dataclasses.dataclass(frozen=True)
class PrefillSpec:
    """One sparse prefill case (``qsa-contract.md`` §3), laid out by
    ``interop.indices.prefill_layout`` and ``prefill_indices`` (junk, empty_rows, overlap,
    per_head: theirs). kind: "ordinary" | "chunk" | "paged"; kv_lens None for ordinary.
    kv_dtype: None (q's) or "float8_e4m3fn" with k_scale / v_scale. junk_inside: columns 0,
    cap // 2 and cap - 1 of every row's read window (cap = min(W, visible)) cycle through -1, -7,
    len, len + 19. duplicates: columns 2 and cap - 2 repeat column 1 (after junk_inside). poison:
    NaN in every K/V row no valid entry selects, and (paged) slot-table entries past each kv_len
    naming slots past the pool. max_q_hint: the max_seqlen_q passed (None: the longest).
    blocks: the ``block_indices=`` form: ``width`` = NB row-relative block ids a row
    (``interop.indices.prefill_block_indices``: junk anywhere, two rows with a repeated id
    where ``duplicates``), ``indices`` None; the reference reads their expansion
    (``token_indices``); junk_inside does not apply."""

    name: str
    kind: str
    hq: int
    hkv: int
    d: int
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...] | None = None
    width: int = I.WIDTH
    dtype: str = "bfloat16"
    kv_dtype: str | None = None
    k_scale: float = 1.0
    v_scale: float = 1.0
    junk: str = "-1"
    empty_rows: float | tuple[int, ...] = 0.0
    overlap: float = 0.9
    per_head: bool = False
    pool_slack: int = 64
    junk_inside: bool = False
    duplicates: bool = False
    poison: bool = False
    max_q_hint: int | None = None
    seed: int = 0
    blocks: bool = False
    op: str = "prefill"

    @property
    def size(self) -> int:
        w = I.RATIO * self.width + I.RATIO - 1 if self.blocks else self.width
        return sum(self.q_lens) * w * self.hq * self.d


@dataclasses.dataclass(frozen=True)
class PagedSpec:
    """One paged decode case (``qsa-contract.md`` §2b), laid out by
    ``interop.indices.paged_decode_case`` (per_head -> num_kv_heads); every pool slot no request
    owns is NaN. kv_dtype / scales: as ``PrefillSpec``; batch_invariant: the entry point's."""

    name: str
    hq: int
    hkv: int
    d: int
    context_lens: tuple[int, ...]
    width: int = I.WIDTH
    rows_per_request: int = 1
    dtype: str = "bfloat16"
    kv_dtype: str | None = None
    k_scale: float = 1.0
    v_scale: float = 1.0
    page_size: int = 64
    junk: tuple[str, ...] = ("-1",)
    junk_at: tuple[str, ...] = ()
    n_junk: int = 2
    duplicates: int = 0
    empty_rows: tuple[int, ...] = ()
    per_head: bool = False
    pool_slots: int | None = None
    batch_invariant: bool = False
    seed: int = 0
    op: str = "paged"

    @property
    def size(self) -> int:
        return len(self.context_lens) * self.rows_per_request * self.width * self.hq * self.d


@dataclasses.dataclass(frozen=True)
class IndexerSpec:
    """One indexer case (``indexer_select_decode`` / ``_prefill``, ``qsa-contract.md`` §4b),
    judged by exact equality: inputs are integers in [-2, 2] (exact FP32 logits, many ties).
    kind: "decode" (seq_lens; ``interop.indices.indexer_decode_case``) | "prefill" (q_lens,
    kv_lens; ``prefill_row_ranges``). k_dtype: None (q's) or FP8. zero_q_rows: rows whose query
    is 0 (every logit 0: the smallest block ids win)."""

    name: str
    kind: str
    seq_lens: tuple[int, ...] = ()
    q_lens: tuple[int, ...] = ()
    kv_lens: tuple[int, ...] = ()
    heads: int = 4
    d: int = 128
    topk: int = I.BLOCK_TOPK
    page_size: int = 16
    dtype: str = "bfloat16"
    k_dtype: str | None = None
    junk: str = "mixed"
    zero_q_rows: tuple[int, ...] = ()
    seed: int = 0
    op: str = "indexer"
    rows = property(lambda s: len(s.seq_lens) if s.kind == "decode" else sum(s.q_lens))

    @property
    def size(self) -> int:
        blocks = max(self.seq_lens or self.kv_lens or (0,)) // I.RATIO
        return self.rows * max(blocks, 1) * self.heads * self.d


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """One end-to-end QSA step case (``qsa_decode_step`` / ``qsa_prefill_step``), laid out by
    ``_step_layout``; indexer inputs are integers in [-2, 2], attention inputs N(0, 1). kind:
    "decode" (one row per request) | "prefill" (``q_lens`` rows, the last of each context).
    pool_pages: None (every request its own pages, plus two) or fewer (requests share pages)."""

    name: str
    kind: str
    hq: int
    hkv: int
    d: int
    context_lens: tuple[int, ...]
    q_lens: tuple[int, ...] = ()
    topk: int = I.BLOCK_TOPK
    index_heads: int = 4
    index_dim: int = 128
    dtype: str = "bfloat16"
    kv_dtype: str | None = None
    k_scale: float = 1.0
    v_scale: float = 1.0
    index_k_dtype: str | None = None
    pool_pages: int | None = None
    seed: int = 0
    op: str = "step"
    rows = property(lambda s: len(s.context_lens) if s.kind == "decode" else sum(s.q_lens))

    @property
    def size(self) -> int:
        return self.rows * (self.topk * I.RATIO + I.RATIO - 1) * self.hq * self.d


Spec = DecodeSpec | PrefillSpec | PagedSpec | IndexerSpec | StepSpec


def _k(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def _kv(kind: str, kv_lens):
    """A prefill case's kv_lens: None for ordinary prefill."""
    return None if kind == "ordinary" else kv_lens


def _constructors(dtype: str, **kwargs):
    """The five spec classes with ``dtype`` (and ``kwargs``, where a class has the field) bound."""
    def bind(cls):
        fields = {f.name for f in dataclasses.fields(cls)}
        return functools.partial(cls, dtype=dtype,
                                 **{k: v for k, v in kwargs.items() if k in fields})
    return tuple(bind(c) for c in (DecodeSpec, PrefillSpec, PagedSpec, IndexerSpec, StepSpec))


def full_matrix(ops: Sequence[str] = OPS, *, dtype: str = "bfloat16") -> list[Spec]:
    """The GPU matrix at production shapes (D = 256, W = max_seqlen_k = 2051): decode TP1/2/4 x
    ``DECODE_BATCHES`` x short/medium/saturated; prefill ordinary/chunk/paged x G 3, 6, 12 x Hkv
    1, 2 x KV 8k/32k/128k x 8192 rows, ragged, junk, empty rows, per-head, FP8, short calls
    (split-KV) and MTP verify, block selections (``block_indices=``, tile-union sized); paged
    decode,
    the indexer and the step at a few batch sizes (the FP64 reference dominates the run time)."""
    dec, pre, paged, ixr, step = _constructors(dtype)
    cases: list[Spec] = []
    if "decode" in ops:
        for tp, (hq, hkv) in TP_SHAPES.items():
            cases += [dec(f"decode/{tp}/B{b}/{pattern}", hq, hkv, 256, b, pattern, seed=b)
                      for b in DECODE_BATCHES for pattern in ("short", "medium", "saturated")]
            cases += [dec(f"decode/{tp}/B16/mixed+empty", hq, hkv, 256, 16, "mixed", zero_rows=3,
                          seed=7),
                      dec(f"decode/{tp}/B128/mixed+poison", hq, hkv, 256, 128, "mixed", slack=77,
                          poison=True, seed=8)]
    if "prefill" in ops:
        for kind in PREFILL_KINDS:
            kvs = (8192,) if kind == "ordinary" else (8192, 32768, 131072)
            cases += [pre(f"prefill/{kind}/G{g}xHkv{hkv}/kv{_k(kv)}/T8k", kind, g * hkv, hkv, 256,
                          (8192,), _kv(kind, (kv,)), seed=g * 10 + hkv)
                      for g in (3, 6, 12) for hkv in (1, 2) for kv in kvs]
        for kind in PREFILL_KINDS:
            cases += [pre(f"prefill/{kind}/ragged/G12xHkv1", kind, 12, 1, 256,
                          (2048, 17, 3072, 1, 3044), _kv(kind, (2048, 40000, 3072, 9000, 65536)),
                          seed=3),
                      pre(f"prefill/{kind}/junk-mixed+empty/G6xHkv1", kind, 6, 1, 256, (4096,),
                          _kv(kind, (32768,)), junk="mixed", empty_rows=0.02, seed=4),
                      pre(f"prefill/{kind}/junk-len+19/per-head/G12xHkv2", kind, 24, 2, 256,
                          (2048, 2048), _kv(kind, (2048, 20000)), junk="len+19", per_head=True,
                          seed=5)]
        cases += [pre(f"prefill/{kind}/fp8/G{g}xHkv{hkv}/kv32k", kind, g * hkv, hkv, 256, (4096,),
                      (32768,), kv_dtype="float8_e4m3fn", k_scale=0.75, v_scale=1.5, junk="len",
                      seed=6)
                  for kind in ("chunk", "paged") for g, hkv in ((6, 1), (12, 1), (12, 2))]
        # short calls: split-KV (interop.geometry.prefill_splits); MTP verify, 32 requests x 4
        cases += [pre(f"prefill/{kind}/split-KV/T32/G12xHkv1" + ("" if kind == "ordinary"
                                                                  else "/kv32k"),
                      kind, 12, 1, 256, (32,), _kv(kind, (32768,)), junk="mixed", seed=11)
                  for kind in PREFILL_KINDS]
        cases += [pre(f"prefill/chunk/mtp-verify/G{g}xHkv{hkv}/32x4", "chunk", g * hkv, hkv, 256,
                      (4,) * 32, (32768,) * 32, junk="mixed", seed=12)
                  for g, hkv in ((12, 1), (12, 2))]
        # block_indices= (the indexer's 512 block ids a row): enough tiles for the tile-union
        # kernel (interop.geometry.select_prefill_blocks), tiles past its bound per-row
        for kind in PREFILL_KINDS:
            cases += [pre(f"prefill/{kind}/blocks+junk+dup/G6xHkv1/T8k", kind, 6, 1, 256, (8192,),
                          _kv(kind, (32768,)), width=512, blocks=True, junk="mixed",
                          duplicates=True, seed=41),
                      pre(f"prefill/{kind}/blocks/per-head/G12xHkv2/ragged", kind, 24, 2, 256,
                          (3000, 17, 2100), _kv(kind, (3000, 40000, 9000)), width=512,
                          blocks=True, per_head=True, junk="len+19", seed=42)]
        cases += [pre(f"prefill/{kind}/blocks/fp8/G12xHkv1/kv32k", kind, 12, 1, 256, (4096,),
                      (32768,), width=512, blocks=True, kv_dtype="float8_e4m3fn", k_scale=0.75,
                      v_scale=1.5, junk="len", seed=43) for kind in ("chunk", "paged")]
    # one generator per op: a case's shape does not depend on which ops were selected
    rng = np.random.default_rng(2026)
    if "paged" in ops:
        for tp, (hq, hkv) in TP_SHAPES.items():
            for b in (1, 64) + ((128,) if tp == "TP1" else ()):
                ctx = rng.integers(1, 4097, size=b)
                ctx[0] = 2051  # one saturated row
                pool = (int((-(-ctx // 64)).sum()) + 2) * 64  # a tight pool: host FP64 copy
                cases.append(paged(f"paged/{tp}/B{b}", hq, hkv, 256, tuple(int(c) for c in ctx),
                                   pool_slots=pool, seed=b))
        cases += [
            paged("paged/TP1/mtp4/B32", 24, 2, 256, tuple(range(2000, 2032)), rows_per_request=4,
                  seed=5),
            paged("paged/TP2/fp8+per-head/B16", 12, 1, 256, tuple(range(3000, 3016)),
                  kv_dtype="float8_e4m3fn", k_scale=0.75, v_scale=1.5, per_head=True, seed=6),
            paged("paged/TP4/junk+dup+empty/B24", 6, 1, 256, tuple(range(100, 2500, 100)),
                  junk=("-1", "-7", "len", "len+19"), junk_at=("front", "middle", "end"),
                  duplicates=5, empty_rows=(0, 7), seed=7),
            paged("paged/TP1/batch-invariant/B32", 24, 2, 256, tuple(range(1, 4097, 128)),
                  batch_invariant=True, seed=8),
        ]
    if "indexer" in ops:
        rng = np.random.default_rng(2027)
        for b, ctx in ((1, 32768), (16, 32768), (64, 8192), (128, 32768)):
            lens = tuple(int(x) for x in np.clip(ctx - rng.integers(0, 97, size=b), 0, None))
            cases.append(ixr(f"indexer/decode/B{b}/{_k(ctx)}", "decode", seq_lens=lens, seed=b))
        cases += [
            ixr("indexer/decode/edges/B9", "decode",
                seq_lens=(0, 3, 2048, 2051, 2052, 4 * 16 * 3 + 7, 5003, 2801, 2403),
                zero_q_rows=(7,), seed=11),
            ixr("indexer/decode/fp8-keys/B16/32k", "decode", seq_lens=(32768,) * 16,
                k_dtype="float8_e4m3fn", seed=12),
            ixr("indexer/prefill/T1k/kv32k", "prefill", q_lens=(1024,), kv_lens=(32768,), seed=13),
            ixr("indexer/prefill/ragged", "prefill", q_lens=(20, 2, 18, 700),
                kv_lens=(2060, 3, 4101, 9000), seed=14),
        ]
    if "step" in ops:
        rng = np.random.default_rng(2028)
        for tp, (hq, hkv), batches in (("TP1", (24, 2), (1, 128)), ("TP2", (12, 1), (16, 64))):
            for b in batches:
                ctx = 32768 - rng.integers(0, 300, size=b)
                cases.append(step(f"step/decode/{tp}/B{b}/32k", "decode", hq, hkv, 256,
                                  tuple(int(c) for c in ctx), pool_pages=2048, seed=b))
        cases += [
            step("step/decode/TP4/fp8/B32/mixed", "decode", 6, 1, 256,
                 tuple(int(c) for c in rng.integers(0, 40000, size=32)), kv_dtype="float8_e4m3fn",
                 k_scale=0.75, v_scale=1.5, index_k_dtype="float8_e4m3fn", pool_pages=2048,
                 seed=21),
            step("step/prefill/TP2/T512/kv32k", "prefill", 12, 1, 256, (32768,), q_lens=(512,),
                 pool_pages=2048, seed=22),
            step("step/prefill/TP1/ragged", "prefill", 24, 2, 256, (2060, 3, 9000, 300),
                 q_lens=(20, 3, 200, 300), seed=23),
        ]
    return cases


def quick_matrix(ops: Sequence[str] = OPS, *, dtype: str = "float16") -> list[Spec]:
    """The CPU matrix: the kinds of ``full_matrix`` at tiny sizes (D = 64 mostly, W = 35 unless
    named, topk 16 so rows really drop blocks), plus ``edge_cases``."""
    dec, pre, paged, ixr, step = _constructors(dtype, width=35, topk=16)
    cases: list[Spec] = []
    if "decode" in ops:
        for tp, (hq, hkv) in TP_SHAPES.items():
            # short rows at max_len 67 would be 1-2 keys (output = V): 320 gives 1-10
            cases += [dec(f"decode/{tp}/B{b}/{pattern}", hq, hkv, 64, b, pattern,
                          max_len=320 if pattern == "short" else 67, seed=b)
                      for b in (1, 4, 17) for pattern in ("short", "medium", "saturated")]
        cases += [
            dec("decode/TP1/B5/mixed+empty", 24, 2, 64, 5, "mixed", max_len=67, zero_rows=2,
                seed=3),
            dec("decode/TP2/B4/saturated+poison", 12, 1, 64, 4, "saturated", max_len=45, slack=13,
                poison=True, seed=4),
            dec("decode/TP4/B2/saturated/D256", 6, 1, 256, 2, "saturated", max_len=40, seed=5),
            dec("decode/TP1/B3/mixed/D256", 24, 2, 256, 3, "mixed", max_len=40, seed=6),
        ]
    if "prefill" in ops:
        cases += [pre(f"prefill/{kind}/G{g}xHkv{hkv}", kind, g * hkv, hkv, 64,
                      (9, 1, 6) if hkv == 1 else (12,),
                      _kv(kind, (80, 1, 40) if hkv == 1 else (150,)), seed=g * 10 + hkv)
                  for kind in PREFILL_KINDS for g in (3, 6, 12) for hkv in (1, 2)]
        cases += [
            pre("prefill/ordinary/junk-mixed+empty/G12xHkv2", "ordinary", 24, 2, 64, (12,),
                junk="mixed", empty_rows=(5,), seed=2),
            pre("prefill/chunk/junk-len+empty/G6xHkv1", "chunk", 6, 1, 64, (7, 9), (150, 9),
                junk="len", empty_rows=(0, 10), seed=3),
            pre("prefill/chunk/fp8/G12xHkv1", "chunk", 12, 1, 64, (10,), (90,),
                kv_dtype="float8_e4m3fn", k_scale=0.5, v_scale=1.5, seed=4),
            pre("prefill/chunk/per-head/G3xHkv2", "chunk", 6, 2, 64, (6, 5), (60, 30),
                per_head=True, junk="len+19", seed=5),
            pre("prefill/paged/ragged+junk-7/G12xHkv1", "paged", 12, 1, 64, (8, 3, 1), (200, 3, 77),
                junk="-7", seed=6),
            pre("prefill/paged/fp8+empty/G6xHkv2", "paged", 12, 2, 64, (10,), (120,),
                kv_dtype="float8_e4m3fn", k_scale=1.25, v_scale=0.5, empty_rows=(3,), junk="mixed",
                seed=7),
            pre("prefill/chunk/D256/G12xHkv1", "chunk", 12, 1, 256, (4,), (64,), seed=8),
            pre("prefill/ordinary/W67/G6xHkv1", "ordinary", 6, 1, 64, (40,), width=67, seed=9),
            # a short call: 2 split-KV shares of W = 520 (interop.geometry.prefill_splits)
            pre("prefill/chunk/split-KV/G6xHkv1/W520", "chunk", 6, 1, 64, (3,), (600,),
                width=520, junk="mixed", seed=10),
            # block_indices= (NB block ids a row): the per-row kernel on the on-device expansion
            # at these sizes (the tile-union kernel: full_matrix, tests/test_prefill_union.py)
            pre("prefill/ordinary/blocks/G6xHkv1", "ordinary", 6, 1, 64, (9, 1, 6), width=8,
                blocks=True, junk="mixed", seed=31),
            pre("prefill/chunk/blocks+dup/per-head/G12xHkv2", "chunk", 24, 2, 64, (7, 5), (60, 30),
                width=8, blocks=True, per_head=True, duplicates=True, junk="len+19", seed=32),
            pre("prefill/paged/blocks+fp8+empty/G6xHkv1", "paged", 6, 1, 64, (10, 3), (120, 20),
                width=6, blocks=True, kv_dtype="float8_e4m3fn", k_scale=0.5, v_scale=1.5,
                empty_rows=(2,), junk="-7", seed=33),
        ]
    if "paged" in ops:
        cases += [
            paged("paged/TP1/B3/W67", 24, 2, 64, (40, 7, 90), width=67, seed=1),
            paged("paged/TP2/mtp2+junk+dup/W35", 12, 1, 64, (30, 61), rows_per_request=2,
                  junk=("-7", "len", "len+19"), junk_at=("front", "middle"), duplicates=2, seed=2),
            paged("paged/G6xHkv2/fp8+per-head+empty/W35", 12, 2, 64, (50, 3, 20),
                  kv_dtype="float8_e4m3fn", k_scale=0.5, v_scale=1.5, per_head=True,
                  empty_rows=(1,), page_size=1, seed=3),
            paged("paged/TP2/D256/W35", 12, 1, 256, (33, 12), seed=4),
            paged("paged/TP1/batch-invariant/W35", 24, 2, 64, (20, 0, 45), batch_invariant=True,
                  seed=5),
        ]
    if "indexer" in ops:
        cases += [
            ixr("indexer/decode/topk16", "decode", seq_lens=(0, 3, 64, 68, 71, 300, 1030, 2047),
                zero_q_rows=(6,), seed=5),
            ixr("indexer/decode/fp8-keys/topk16", "decode", seq_lens=(131, 65, 500),
                k_dtype="float8_e4m3fn", junk="-1", seed=6),
            ixr("indexer/prefill/topk16", "prefill", q_lens=(5, 20, 1), kv_lens=(5, 300, 77),
                zero_q_rows=(9,), seed=7),
        ]
    if "step" in ops:
        cases += [
            step("step/decode/TP2/topk16", "decode", 12, 1, 64, (0, 5, 70, 301, 1000), seed=8),
            step("step/decode/TP1/fp8/shared-pages/topk16", "decode", 24, 2, 64, (260, 77, 999),
                 kv_dtype="float8_e4m3fn", k_scale=0.75, v_scale=1.25,
                 index_k_dtype="float8_e4m3fn", pool_pages=9, seed=9),
            step("step/prefill/G6xHkv1/topk16", "prefill", 6, 1, 64, (200, 3, 90), q_lens=(6, 3, 4),
                 seed=10),
            step("step/prefill/G12xHkv2/fp8/topk16", "prefill", 24, 2, 64, (150,), q_lens=(7,),
                 kv_dtype="float8_e4m3fn", k_scale=0.5, v_scale=2.0, seed=11),
        ]
    return cases + edge_cases(ops, dtype=dtype)


def edge_cases(ops: Sequence[str] = OPS, *, dtype: str = "float16") -> list[Spec]:
    """The contract's edge cases at CPU sizes (W = 35): empty sequences, junk inside a read
    window, duplicates, per-KV-head indices, poisoned K/V, max_seqlen_q hints below the longest."""
    dec, pre, *_ = _constructors(dtype, width=35)
    cases: list[Spec] = []
    if "decode" in ops:
        cases.append(dec("decode/TP2/B3/all-empty", 12, 1, 64, 3, "short", max_len=20,
                         zero_rows=3, slack=5, poison=True, seed=11))
    if "prefill" in ops:
        cases += [
            pre("prefill/chunk/junk-inside/G6xHkv1", "chunk", 6, 1, 64, (6, 5, 1), (40, 5, 9),
                junk_inside=True, seed=12),
            pre("prefill/ordinary/junk-inside/per-head/G3xHkv2", "ordinary", 6, 2, 64, (10,),
                per_head=True, junk_inside=True, seed=13),
            pre("prefill/paged/duplicates/G12xHkv1", "paged", 12, 1, 64, (5, 4), (30, 12),
                duplicates=True, junk="len+19", seed=14),
            pre("prefill/chunk/duplicates+junk-inside/per-head/G12xHkv2", "chunk", 24, 2, 64, (4,),
                (50,), per_head=True, duplicates=True, junk_inside=True, seed=15),
            pre("prefill/paged/poison/G12xHkv1", "paged", 12, 1, 64, (6, 3), (120, 20),
                poison=True, pool_slack=19, junk="mixed", seed=16),
            pre("prefill/chunk/poison+fp8/per-head/G6xHkv2", "chunk", 12, 2, 64, (5,), (60,),
                kv_dtype="float8_e4m3fn", k_scale=0.5, v_scale=2.0, poison=True, per_head=True,
                seed=17),
            pre("prefill/chunk/max_seqlen_q-hint-2/G12xHkv1", "chunk", 12, 1, 64, (9, 3), (30, 3),
                max_q_hint=2, seed=19),
            pre("prefill/paged/max_seqlen_q-hint-1/G6xHkv1", "paged", 6, 1, 64, (7, 2), (20, 9),
                max_q_hint=1, seed=20),
            pre("prefill/ordinary/max_seqlen_q-hint-3/G3xHkv1", "ordinary", 3, 1, 64, (8, 2),
                max_q_hint=3, seed=21),
        ]
    return cases


def by_name(specs: Sequence[Spec]) -> dict[str, Spec]:
    """name -> spec (names are unique within a matrix)."""
    return {s.name: s for s in specs}


# The quick-matrix cases every implementation's conformance test runs (with all edge cases): each
# path once; the rest of the quick matrix repeats them at other sizes (``qsa check --quick``).
_CONFORMANCE = (
    "decode/TP1/B4/short", "decode/TP1/B4/medium", "decode/TP1/B4/saturated",
    "decode/TP2/B1/saturated", "decode/TP4/B17/medium", "decode/TP1/B5/mixed+empty",
    "decode/TP2/B4/saturated+poison", "decode/TP4/B2/saturated/D256", "decode/TP1/B3/mixed/D256",
    "prefill/ordinary/G3xHkv1", "prefill/ordinary/G12xHkv2", "prefill/chunk/G6xHkv1",
    "prefill/chunk/G12xHkv2", "prefill/paged/G3xHkv2", "prefill/paged/G12xHkv1",
    "prefill/ordinary/junk-mixed+empty/G12xHkv2", "prefill/chunk/junk-len+empty/G6xHkv1",
    "prefill/chunk/fp8/G12xHkv1", "prefill/chunk/per-head/G3xHkv2",
    "prefill/paged/ragged+junk-7/G12xHkv1", "prefill/paged/fp8+empty/G6xHkv2",
    "prefill/chunk/D256/G12xHkv1", "prefill/ordinary/W67/G6xHkv1",
    "prefill/chunk/blocks+dup/per-head/G12xHkv2",
)


def conformance_matrix(ops: Sequence[str] = OPS, *, dtype: str = "float16") -> list[Spec]:
    """``tests/conformance.py``'s CPU cases: a subset of ``quick_matrix`` plus ``edge_cases``."""
    quick = by_name(quick_matrix(ops, dtype=dtype))
    return [quick[n] for n in _CONFORMANCE if n in quick] + edge_cases(ops, dtype=dtype)


def gpu_conformance_matrix(ops: Sequence[str] = OPS, *, dtype: str = "bfloat16") -> list[Spec]:
    """``tests/conformance.py``'s GPU cases: production shapes small enough for the reference."""
    cases: list[Spec] = []
    if "decode" in ops:
        full = by_name(full_matrix(("decode",), dtype=dtype))
        cases += [full[n] for n in ("decode/TP1/B128/saturated", "decode/TP2/B16/mixed+empty",
                                    "decode/TP4/B1/short", "decode/TP1/B128/mixed+poison",
                                    "decode/TP2/B17/medium", "decode/TP4/B64/saturated")]
    if "prefill" in ops:
        pre = _constructors(dtype)[1]
        cases += [
            pre("gpu/prefill/ordinary/G6xHkv1/T2k", "ordinary", 6, 1, 256, (2048,), junk="len+19",
                seed=31),
            pre("gpu/prefill/chunk/junk-mixed+empty/G12xHkv1/kv32k/T1k", "chunk", 12, 1, 256,
                (1024,), (32768,), junk="mixed", empty_rows=(0, 700), seed=32),
            pre("gpu/prefill/paged/fp8/per-head/G12xHkv2/kv16k/T512", "paged", 24, 2, 256, (512,),
                (16384,), kv_dtype="float8_e4m3fn", k_scale=0.75, v_scale=1.5, per_head=True,
                pool_slack=1000, seed=33),
            pre("gpu/prefill/chunk/poison+junk-inside+dup/G6xHkv1/ragged", "chunk", 6, 1, 256,
                (300, 77, 1), (9000, 77, 5000), poison=True, junk_inside=True, duplicates=True,
                max_q_hint=64, seed=34),
            pre("gpu/prefill/paged/ragged/G3xHkv1", "paged", 3, 1, 256, (700, 5, 260),
                (4000, 5, 70000), junk="-7", pool_slack=333, seed=35),
        ]
    return cases


# --------------------------------------------------------------------------------------------
# Entry points and a case's arguments by name.
ENTRY = {"decode": "sparse_decode", "ordinary": "sparse_prefill", "chunk": "sparse_prefill_chunk",
         "paged": "sparse_prefill_paged", "decode_paged": "sparse_decode_paged",
         "indexer_decode": "indexer_select_decode", "indexer_prefill": "indexer_select_prefill",
         "step_decode": "qsa_decode_step", "step_prefill": "qsa_prefill_step"}
#: each entry point: its ``OPS`` operation, its FP64 reference (same parameter names less the
#: host hints and result-neutral switches), its positional then its keyword parameters
_ENTRIES = {
    "sparse_decode": ("decode", R.decode_reference,
                      "q k v cu_seqlens_q cu_seqlens_k max_seqlen_k", "softmax_scale"),
    "sparse_prefill": ("prefill", R.prefill_reference, "q k v indices cu_seqlens max_seqlen_q",
                       "softmax_scale"),
    "sparse_prefill_chunk": ("prefill", R.prefill_chunk_reference,
                             "q k v indices cu_seqlens_q cu_seqlens_k kv_lens max_seqlen_q",
                             "softmax_scale k_scale v_scale"),
    "sparse_prefill_paged": ("prefill", R.prefill_paged_reference,
                             "q k_cache v_cache req_to_token req_indices indices cu_seqlens_q "
                             "kv_lens max_seqlen_q", "softmax_scale k_scale v_scale"),
    "sparse_decode_paged": ("paged", R.decode_paged_reference,
                            "q k_cache v_cache req_to_token req_indices indices seq_lens",
                            "softmax_scale k_scale v_scale batch_invariant"),
    "indexer_select_decode": ("indexer", R.indexer_select_decode_reference,
                              "q k_cache page_table seq_lens", "topk"),
    "indexer_select_prefill": ("indexer", R.indexer_select_prefill_reference,
                               "q k row_starts row_ends positions seq_lens", "topk"),
    "qsa_decode_step": ("step", R.decode_step_reference,
                        "q k_cache v_cache req_to_token req_indices index_q index_k_cache "
                        "index_page_table seq_lens", "softmax_scale k_scale v_scale topk"),
    "qsa_prefill_step": ("step", R.prefill_step_reference,
                         "q k_cache v_cache req_to_token req_indices index_q index_k "
                         "index_cu_seqlens_k cu_seqlens_q kv_lens max_seqlen_q",
                         "softmax_scale k_scale v_scale topk"),
}
#: positional parameters of each entry point, then its keyword parameters
PARAMS = {e: (tuple(pos.split()), tuple(kw.split())) for e, (_, _, pos, kw) in _ENTRIES.items()}
#: the ``qsa check`` operation (``OPS``) of each entry point
ENTRY_OP = {e: v[0] for e, v in _ENTRIES.items()}
#: the default of every keyword parameter in ``PARAMS`` (the entry points' signatures)
KW_DEFAULTS = {"softmax_scale": None, "k_scale": 1.0, "v_scale": 1.0, "batch_invariant": False,
               "topk": I.BLOCK_TOPK}
#: entry points whose output is int32 token positions (judged by exact equality)
INDEX_ENTRIES = ("indexer_select_decode", "indexer_select_prefill")


@dataclasses.dataclass(frozen=True)
class CaseData:
    """One case's call by parameter name, except the random values: floats name -> (shape,
    dtype name); ints name -> int32 numpy; scalars name -> host value; poison bool [K/V rows,
    Hkv] set to NaN, or None; empty bool [output rows, Hq] that must be 0 (``empty_outputs``);
    integer_valued: floats drawn in [-2, 2]; zero_rows: name -> bool mask of rows set to 0."""

    spec: Spec
    entry: str
    floats: dict[str, tuple[tuple[int, ...], str]]
    ints: dict[str, np.ndarray]
    scalars: dict[str, Any]
    poison: np.ndarray | None
    empty: np.ndarray
    integer_valued: tuple[str, ...] = ()
    zero_rows: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)

    @property
    def kv_names(self) -> tuple[str, str]:
        return PARAMS[self.entry][0][1], PARAMS[self.entry][0][2]

    def values(self) -> dict[str, np.ndarray]:
        """Seeded float32 values of ``floats`` (N(0, 1), or integers for ``integer_valued``; zero
        rows, NaN poison applied); the caller casts them to ``floats[name][1]``."""
        rng = np.random.default_rng(1000 + self.spec.seed)
        out = {n: (rng.integers(-2, 3, size=shape).astype(np.float32)
                   if n in self.integer_valued else rng.standard_normal(shape, dtype=np.float32))
               for n, (shape, _) in self.floats.items()}
        for n, rows in self.zero_rows.items():
            out[n][np.asarray(rows, bool)] = 0.0
        if self.poison is not None:
            for n in self.kv_names:
                out[n][self.poison] = np.nan
        return out

    def arguments(self, named: dict[str, Any]) -> tuple[list, dict]:
        """(positional, keyword) arguments of the entry point: ``named`` (framework arrays of
        ``floats`` and ``ints``) merged with ``scalars``."""
        allv = {**self.scalars, **named}
        pos, kws = PARAMS[self.entry]
        if "block_indices" in allv:  # the block form: indices=None, block_indices= by keyword
            kws = kws + ("block_indices",)
            allv["indices"] = None
        return [allv[n] for n in pos], {n: allv[n] for n in kws if n in allv}


def _read_window(indices: np.ndarray, cu_seqlens_q, lens, ordinary: bool):
    """(idx3 int64 [T, H, W], valid [T, H, W], req [T]): the entries a row counts (§3)."""
    idx3 = np.asarray(indices, np.int64)
    idx3 = idx3 if idx3.ndim == 3 else idx3[:, None, :]
    cu = np.asarray(cu_seqlens_q, np.int64)
    lens = np.asarray(lens, np.int64)
    t, w = idx3.shape[0], idx3.shape[-1]
    req = np.clip(np.searchsorted(cu[1:], np.arange(t), side="right"), 0, max(len(lens) - 1, 0))
    r = np.arange(t) - cu[req]
    q_len = cu[req + 1] - cu[req]
    visible = r + 1 if ordinary else r + lens[req] - q_len + 1
    cap = np.minimum(w, np.maximum(visible, 0))
    valid = ((idx3 >= 0) & (idx3 < lens[req][:, None, None])
             & (np.arange(w) < cap[:, None, None]))
    return idx3, valid, req


def token_indices(entry: str, named: dict[str, Any]) -> np.ndarray:
    """A prefill call's token indices by parameter name: ``indices``, or where it is None the
    expansion of ``block_indices`` (``interop.indices.expand_prefill_blocks``, the token rows
    the block form equals). Host int32 numpy [T, W] or [T, Hkv, W]."""
    if named.get("indices") is not None or named.get("block_indices") is None:
        return np.asarray(named["indices"])
    cu = np.asarray(named["cu_seqlens" if entry == "sparse_prefill" else "cu_seqlens_q"],
                    np.int64)
    kv = None if entry == "sparse_prefill" else np.asarray(named["kv_lens"], np.int64)
    return I.expand_prefill_blocks(np.asarray(named["block_indices"]), np.diff(cu), kv)


def empty_outputs(entry: str, named: dict[str, Any], hq: int, hkv: int,
                  pool_slots: int | None = None, rows: int | None = None) -> np.ndarray:
    """bool [output rows, Hq] outputs that must be exactly 0 (no valid key, a step row outside
    every request), from host metadata by name; [rows, 1] all False for the indexer.
    ``pool_slots``: paged decode's (None: any); ``rows``: q's rows (prefill step)."""
    if entry in INDEX_ENTRIES:
        key = "seq_lens" if entry == "indexer_select_decode" else "row_starts"
        return np.zeros((np.asarray(named[key]).shape[0], 1), bool)
    if entry == "sparse_decode_paged":
        slots = I.resolve_paged_slots(named["req_to_token"], named["req_indices"],
                                      named["indices"], named["seq_lens"],
                                      2**62 if pool_slots is None else pool_slots)
        none = ~(slots >= 0).any(-1)  # [R] or [R, Hkv]
    elif entry == "qsa_decode_step":
        none = np.asarray(named["seq_lens"], np.int64) <= 0
    elif entry == "qsa_prefill_step":
        cu = np.asarray(named["cu_seqlens_q"], np.int64)
        rows = int(cu[-1]) if rows is None else int(rows)
        _, _, pos, bound = I.prefill_step_rows(cu, named["kv_lens"], named["index_cu_seqlens_k"],
                                               rows)
        none = (pos < 0) | (bound <= 0)
    elif entry == "sparse_decode":
        none = np.diff(np.asarray(named["cu_seqlens_k"], np.int64)) <= 0
    else:  # prefill: [T, 1 or Hkv]
        ordinary = entry == "sparse_prefill"
        cu = np.asarray(named["cu_seqlens" if ordinary else "cu_seqlens_q"], np.int64)
        lens = np.diff(cu) if ordinary else named["kv_lens"]
        none = ~_read_window(token_indices(entry, named), cu, lens, ordinary)[1].any(-1)
    none = none[:, None] if none.ndim == 1 else none
    return np.repeat(np.broadcast_to(none, (none.shape[0], hkv)), hq // hkv, axis=1)


def _edit_windows(idx: np.ndarray, visible: np.ndarray, bound: np.ndarray, spec: PrefillSpec):
    """``junk_inside`` and ``duplicates`` (see ``PrefillSpec``) on int64 [T, H, W] in place."""
    t, _, w = idx.shape
    rows = np.arange(t)
    cap = np.minimum(w, visible)
    if spec.junk_inside:
        junk = np.stack([np.full(t, -1), np.full(t, -7), bound, bound + 19], 1)
        for j, col in enumerate((np.zeros(t, np.int64), cap // 2, cap - 1)):
            idx[rows, :, col] = junk[rows, (rows + j) % 4][:, None]
    if spec.duplicates:
        src = np.minimum(1, cap - 1)
        for col in (np.minimum(2, cap - 1), np.maximum(cap - 2, 0)):
            idx[rows, :, col] = idx[rows, :, src]


def case_data(spec: Spec) -> CaseData:
    """A spec's ``CaseData`` (metadata and indices from ``interop.indices``). Raises ValueError
    for a spec the generators refuse (e.g. kv_lens < q_lens)."""
    if isinstance(spec, PagedSpec):
        return _paged_data(spec)
    if isinstance(spec, IndexerSpec):
        return _indexer_data(spec)
    if isinstance(spec, StepSpec):
        return _step_data(spec)
    if isinstance(spec, DecodeSpec):
        c = I.decode_case(spec.batch, spec.pattern, max_len=spec.max_len, seed=spec.seed,
                          zero_rows=spec.zero_rows, capacity_slack=spec.slack)
        cap = spec.batch * spec.max_len + spec.slack if spec.pad_capacity else c.capacity
        kv = ((cap, spec.hkv, spec.d), spec.dtype)
        poison = None
        if spec.poison and spec.slack:
            poison = np.zeros((cap, spec.hkv), bool)
            poison[int(c.cu_seqlens_k[-1]):] = True
        ints = {"cu_seqlens_q": c.cu_seqlens_q, "cu_seqlens_k": c.cu_seqlens_k}
        return CaseData(spec, "sparse_decode",
                        {"q": ((spec.batch, spec.hq, spec.d), spec.dtype), "k": kv, "v": kv}, ints,
                        {"max_seqlen_k": c.max_seqlen_k, "softmax_scale": None}, poison,
                        empty_outputs("sparse_decode", ints, spec.hq, spec.hkv))
    kind = spec.kind
    entry = ENTRY[kind]
    lay = I.prefill_layout(kind, spec.q_lens, spec.kv_lens, pool_slack=spec.pool_slack,
                           seed=spec.seed)
    kv_lens = None if kind == "ordinary" else lay.kv_lens
    heads = spec.hkv if spec.per_head else None
    if spec.blocks:
        if spec.junk_inside:
            raise ValueError(f"{spec.name}: junk_inside edits token rows, not block selections")
        empty = spec.empty_rows
        if isinstance(empty, float):  # a fraction of the rows, as prefill_indices takes it
            t_all = int(sum(lay.q_lens))
            empty = np.random.default_rng(spec.seed).choice(
                t_all, size=int(round(empty * t_all)), replace=False)
        idx = I.prefill_block_indices(lay.q_lens, kv_lens, block_width=spec.width,
                                      overlap=spec.overlap, junk=spec.junk, junk_anywhere=True,
                                      duplicates=2 if spec.duplicates else 0,
                                      empty_rows=tuple(int(r) for r in empty),
                                      num_kv_heads=heads, seed=spec.seed)
    else:
        idx = I.prefill_indices(lay.q_lens, kv_lens, width=spec.width, junk=spec.junk,
                                empty_rows=spec.empty_rows, overlap=spec.overlap,
                                num_kv_heads=heads, seed=spec.seed)
    if not spec.blocks and (spec.junk_inside or spec.duplicates):
        _, _, visible, bound = I.row_layout(lay.q_lens, kv_lens)
        idx3 = (idx if idx.ndim == 3 else idx[:, None, :]).astype(np.int64)
        _edit_windows(idx3, visible, bound, spec)
        idx = (idx3 if spec.per_head else idx3[:, 0]).astype(np.int32)
    ints: dict[str, np.ndarray] = {"block_indices" if spec.blocks else "indices": idx}
    if kind == "ordinary":
        ints["cu_seqlens"] = lay.cu_seqlens_q
    else:
        ints.update(cu_seqlens_q=lay.cu_seqlens_q, kv_lens=lay.kv_lens)
        if kind == "chunk":
            ints["cu_seqlens_k"] = lay.cu_seqlens_k
        else:
            rt = lay.req_to_token.copy()
            if spec.poison:  # positions past kv_len name slots past the pool
                rows = rt[lay.req_indices]
                past = np.arange(rt.shape[1])[None, :] >= lay.kv_lens[:, None]
                rows[past] = lay.pool_slots + 1 + np.nonzero(past)[1]
                rt[lay.req_indices] = rows
            ints.update(req_to_token=rt, req_indices=lay.req_indices)
    t = int(lay.cu_seqlens_q[-1])
    rows = {"ordinary": t, "chunk": int(lay.cu_seqlens_k[-1]), "paged": lay.pool_slots}[kind]
    kv = ((rows, spec.hkv, spec.d), spec.kv_dtype or spec.dtype)
    k_name, v_name = PARAMS[entry][0][1:3]
    poison = None
    if spec.poison:
        lens = np.diff(lay.cu_seqlens_q) if kind == "ordinary" else lay.kv_lens
        idx3, valid, req = _read_window(token_indices(entry, ints), lay.cu_seqlens_q, lens,
                                        kind == "ordinary")
        safe = np.where(valid, idx3, 0)
        if kind == "paged":
            kv_row = np.asarray(slot_table_of(ints), np.int64)[req[:, None, None], safe]
        else:
            base = lay.cu_seqlens_q if kind == "ordinary" else lay.cu_seqlens_k
            kv_row = np.asarray(base, np.int64)[req][:, None, None] + safe
        named_kv = np.zeros((rows, spec.hkv), bool)
        for h in range(spec.hkv):  # shared indices name the row for every KV head
            i = h if idx3.shape[1] > 1 else 0
            named_kv[kv_row[:, i][valid[:, i]], h] = True
        poison = ~named_kv
    scalars: dict[str, Any] = {"max_seqlen_q": spec.max_q_hint or lay.max_seqlen_q,
                               "softmax_scale": None}
    if kind != "ordinary":
        scalars.update(k_scale=spec.k_scale, v_scale=spec.v_scale)
    return CaseData(spec, entry, {"q": ((t, spec.hq, spec.d), spec.dtype), k_name: kv, v_name: kv},
                    ints, scalars, poison, empty_outputs(entry, ints, spec.hq, spec.hkv))


# --------------------------------------------------------------------------------------------
# Paged decode, the indexer, the end-to-end step: case data.
def _unowned(owned: np.ndarray, hkv: int) -> np.ndarray | None:
    """bool [slots, Hkv]: the pool slots no request owns (poisoned with NaN), or None."""
    return None if owned.all() else np.repeat(~owned[:, None], hkv, axis=1)


def _paged_data(spec: PagedSpec) -> CaseData:
    c = I.paged_decode_case(spec.context_lens, width=spec.width,
                            rows_per_request=spec.rows_per_request, pool_slots=spec.pool_slots,
                            page_size=spec.page_size, junk=spec.junk, junk_at=spec.junk_at,
                            n_junk=spec.n_junk, duplicates=spec.duplicates,
                            empty_rows=spec.empty_rows,
                            num_kv_heads=spec.hkv if spec.per_head else None, seed=spec.seed)
    r = c.seq_lens.shape[0]
    kv = ((c.pool_slots, spec.hkv, spec.d), spec.kv_dtype or spec.dtype)
    ints = {"req_to_token": c.req_to_token, "req_indices": c.req_indices, "indices": c.indices,
            "seq_lens": c.seq_lens}
    return CaseData(spec, "sparse_decode_paged",
                    {"q": ((r, spec.hq, spec.d), spec.dtype), "k_cache": kv, "v_cache": kv}, ints,
                    {"softmax_scale": None, "k_scale": spec.k_scale, "v_scale": spec.v_scale,
                     "batch_invariant": spec.batch_invariant}, _unowned(c.owned, spec.hkv),
                    empty_outputs("sparse_decode_paged", ints, spec.hq, spec.hkv, c.pool_slots))


def _indexer_data(spec: IndexerSpec) -> CaseData:
    kd = spec.k_dtype or spec.dtype
    if spec.kind == "decode":
        c = I.indexer_decode_case(spec.seq_lens, page_size=spec.page_size, junk=spec.junk,
                                  seed=spec.seed)
        rows = c.seq_lens.shape[0]
        floats = {"q": ((rows, spec.heads, spec.d), spec.dtype),
                  "k_cache": ((c.pages, spec.page_size, 1, spec.d), kd)}
        ints = {"page_table": c.page_table, "seq_lens": c.seq_lens}
        entry, k_name = "indexer_select_decode", "k_cache"
    else:
        rs, re, cu, pos, sl = I.prefill_row_ranges(spec.q_lens, spec.kv_lens)
        rows = rs.shape[0]
        floats = {"q": ((rows, spec.heads, spec.d), spec.dtype),
                  "k": ((int(cu[-1]), 1, spec.d), kd)}
        ints = {"row_starts": rs, "row_ends": re, "positions": pos, "seq_lens": sl}
        entry, k_name = "indexer_select_prefill", "k"
    zero = np.zeros(rows, bool)
    zero[list(spec.zero_q_rows)] = True
    return CaseData(spec, entry, floats, ints, {"topk": spec.topk}, None,
                    empty_outputs(entry, ints, 1, 1), integer_valued=("q", k_name),
                    zero_rows={"q": zero} if zero.any() else {})


def _step_layout(context_lens, *, pool_pages: int | None = None, page_size: int = 64,
                index_page_size: int = 16, spare_requests: int = 2, seed: int = 0) -> dict:
    """A ``StepSpec``'s pool tables (a row's compressed-K pages are its KV pages, junk after)."""
    if page_size != I.RATIO * index_page_size:
        raise ValueError(f"page_size {page_size} must be {I.RATIO} x index_page_size "
                         f"{index_page_size} (one compressed page per KV page)")
    lens = np.asarray(context_lens, np.int64).reshape(-1)
    rng = np.random.default_rng(seed)
    b = lens.shape[0]
    n_pages = -(-lens // page_size)
    if pool_pages is None:
        pool_pages = int(n_pages.sum()) + 2
    width = max(1, int(lens.max()) if lens.size else 1)
    max_reqs = b + int(spare_requests)
    table = np.zeros((max_reqs, width), np.int64)
    req_of = rng.permutation(max_reqs)[:b]
    shared = pool_pages - 1 < int(n_pages.sum())
    perm = rng.permutation(np.arange(1, pool_pages))
    at = 0
    owned = np.zeros(pool_pages * page_size, bool)
    pos = np.arange(width, dtype=np.int64)
    for i in range(b):
        n = int(n_pages[i])
        if shared:
            pages = rng.choice(np.arange(1, pool_pages), size=n, replace=n > pool_pages - 1)
        else:
            pages = perm[at:at + n]
            at += n
        slots = pages[pos[:lens[i]] // page_size] * page_size + pos[:lens[i]] % page_size
        table[req_of[i], :lens[i]] = slots
        owned[slots] = True
    ipt_w = max(1, -(-width // page_size))
    ipt = np.zeros((b, ipt_w), np.int64)
    i32 = np.iinfo(np.int32)
    for i in range(b):
        need = -(-(int(lens[i]) // I.RATIO) // index_page_size)
        ipt[i, :need] = table[req_of[i], np.arange(need) * page_size] // page_size
        ipt[i, need:] = rng.choice(np.array([-1, pool_pages, pool_pages + 5, i32.max, i32.min, 1]),
                                   size=ipt_w - need)
    return {"req_to_token": table.astype(np.int32), "req_indices": req_of.astype(np.int32),
            "index_page_table": ipt.astype(np.int32), "owned": owned, "pool_pages": pool_pages}


def _step_data(spec: StepSpec) -> CaseData:
    lay = _step_layout(spec.context_lens, pool_pages=spec.pool_pages, seed=spec.seed)
    pool = lay["pool_pages"] * 64
    kvd = spec.kv_dtype or spec.dtype
    ikd = spec.index_k_dtype or spec.dtype
    kl = np.asarray(spec.context_lens, np.int64)
    kv = ((pool, spec.hkv, spec.d), kvd)
    scalars = {"softmax_scale": None, "k_scale": spec.k_scale, "v_scale": spec.v_scale,
               "topk": spec.topk}
    ints = {"req_to_token": lay["req_to_token"], "req_indices": lay["req_indices"]}
    if spec.kind == "decode":
        rows, entry, ik = kl.shape[0], "qsa_decode_step", "index_k_cache"
        index_k = ((lay["pool_pages"], 16, 1, spec.index_dim), ikd)
        ints.update(index_page_table=lay["index_page_table"], seq_lens=kl.astype(np.int32))
    else:
        ql = np.asarray(spec.q_lens, np.int64)
        if ql.shape != kl.shape or (ql > kl).any():
            raise ValueError(f"q_lens {spec.q_lens} must pair with context_lens "
                             f"{spec.context_lens}, each <= its context")
        rows, entry, ik = int(ql.sum()), "qsa_prefill_step", "index_k"
        cu_k = I.cu_seqlens_from_counts(kl // I.RATIO)
        index_k = ((int(cu_k[-1]), 1, spec.index_dim), ikd)
        ints.update(index_cu_seqlens_k=cu_k, cu_seqlens_q=I.cu_seqlens_from_counts(ql),
                    kv_lens=kl.astype(np.int32))
        scalars["max_seqlen_q"] = int(ql.max())
    floats = {"q": ((rows, spec.hq, spec.d), spec.dtype), "k_cache": kv, "v_cache": kv,
              "index_q": ((rows, spec.index_heads, spec.index_dim), spec.dtype), ik: index_k}
    return CaseData(spec, entry, floats, ints, scalars, _unowned(lay["owned"], spec.hkv),
                    empty_outputs(entry, ints, spec.hq, spec.hkv, pool, rows=rows),
                    integer_valued=("index_q", ik))


def slot_table_of(named: dict[str, Any]):
    """``req_to_token[req_indices]``: per-request pool slots [B, max_context] of a paged call by
    parameter name (numpy or framework arrays)."""
    rows = named["req_indices"]
    rows = rows.long() if hasattr(rows, "long") else np.asarray(rows, np.int64)
    return named["req_to_token"][rows]


def reference(entry: str, named: dict[str, Any]) -> np.ndarray:
    """The FP64 reference (``interop.reference``) of a call by parameter name (numpy arrays as
    the kernel sees them, host scalars; missing keywords default): float64 [rows, Hq, D], or
    int32 [rows, W] for ``INDEX_ENTRIES``. Raises ValueError for an unknown entry point."""
    if entry not in _ENTRIES:
        raise ValueError(f"unknown entry point {entry!r}; known: {', '.join(PARAMS)}")
    fn = _ENTRIES[entry][1]
    params = inspect.signature(fn).parameters
    if named.get("block_indices") is not None and named.get("indices") is None:
        named = {**named, "indices": token_indices(entry, named)}
    return fn(**{k: v for k, v in named.items() if k in params})


def compare(out: np.ndarray, ref: np.ndarray, empty: np.ndarray | None = None,
            rel_l2_limit: float = REL_L2) -> dict:
    """The pass criteria (``qsa-contract.md`` §6) against the FP64 reference: finite, ``|out -
    ref| <= ATOL + RTOL |ref|``, relative L2 <= ``rel_l2_limit``, exact zeros where ``empty``
    (bool over the leading axes, or None). Returns {"rel_l2", "max_abs", "allclose", "finite",
    "zeros_ok", "passed"}; an integer ``ref`` passes only when equal (``rel_l2``: the fraction of
    rows that differ, plus "mismatched_rows")."""
    if np.issubdtype(np.asarray(ref).dtype, np.integer):
        o, r = np.asarray(out, np.float64), np.asarray(ref, np.float64)
        bad = (o != r).reshape(o.shape[0], -1).any(1) if o.size else np.zeros(0, bool)
        n_bad = int(bad.sum())
        return {"rel_l2": n_bad / max(o.shape[0], 1),
                "max_abs": float(np.abs(o - r).max()) if o.size else 0.0,
                "allclose": n_bad == 0, "finite": bool(np.isfinite(o).all()), "zeros_ok": True,
                "mismatched_rows": n_bad, "passed": n_bad == 0 and bool(np.isfinite(o).all())}
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    finite = bool(np.isfinite(out).all())
    diff = np.abs(out - ref)
    max_abs = float(np.nanmax(diff)) if diff.size else 0.0
    allclose = bool(finite and np.all(diff <= ATOL + RTOL * np.abs(ref)))
    rel = R.rel_l2(out, ref) if finite else float("inf")
    zeros_ok = bool(np.all(out[empty] == 0.0)) if empty is not None and empty.any() else True
    return {"rel_l2": rel, "max_abs": max_abs if finite else float("inf"), "allclose": allclose,
            "finite": finite, "zeros_ok": zeros_ok,
            "passed": finite and allclose and rel <= rel_l2_limit and zeros_ok}



# --------------------------------------------------------------------------------------------
# Benchmark shapes (GPU): decode TP1/TP2/TP4 x these batches x these row kinds at
# max_seqlen_k = 2051; prefill 8192-row chunks at these KV lengths for G 6/12 (Hkv 1) and 24/2,
# and the query-row sweep.
BENCH_DECODE_BATCHES = (1, 4, 16, 32, 64, 128)
BENCH_DECODE_ROWS = ("saturated", "mixed", "short")
BENCH_PREFILL_ROWS = (32, 128, 512, 2048, 8192)
BENCH_PREFILL_KV = (8192, 32768, 131072)
