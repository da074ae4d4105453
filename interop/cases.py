"""The one table of named shapes (tokamax's ``arg_specs`` idea), used by the tests, ``qsa check``
and ``bench/``.

* ``DecodeSpec`` / ``PrefillSpec``: one case each, as data.
* ``full_matrix()`` (GPU, compiled kernels): decode TP1/TP2/TP4 x every B in 1..16, 17, 24, 32, 48,
  64, 96, 128 x short/medium/saturated rows (D = 256, bf16, max_seqlen_k = 2051); prefill
  ordinary/chunk/paged x G 3, 6, 12 x Hkv 1, 2 x KV 8k/32k/128k x 8192 rows (W = 2051, realistic
  block-structured indices), plus rows with junk after the valid prefix, rows with no valid entry,
  ragged batches, per-KV-head indices and FP8 K/V.
* ``quick_matrix()`` (CPU, interpret mode): the same kinds of cases at tiny sizes (D = 64 mostly,
  fp16 because the Triton interpreter's bf16 dot is wrong, W = 35 or 67).
* ``conformance_matrix()``: the part of the quick matrix (plus the named edge cases) that every
  implementation's conformance test runs (``tests/conformance.py``), small enough for a 2-core CPU.
* ``gpu_conformance_matrix()``: production-sized bf16 cases for the same tests on a GPU.
* ``BENCH_*``: the shapes ``bench/decode.py`` and ``bench/prefill.py`` time on the GPU.
* ``PARAMS`` / ``case_data()`` / ``reference()``: each entry point's parameter names, a case's
  arguments by name (everything but the random values), and the FP64 reference of a call given by
  name. This is the one place that knows the entry points' argument order.
* ``compare()``: the pass criteria (``RTOL``, ``ATOL``, ``REL_L2``, exact zeros).

Framework-free: numpy only.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from . import indices as I
from . import reference as R

__all__ = [
    "RTOL", "ATOL", "REL_L2", "OPS", "TP_SHAPES", "DECODE_BATCHES", "PREFILL_KINDS", "DecodeSpec",
    "PrefillSpec", "Spec", "full_matrix", "quick_matrix", "edge_cases", "conformance_matrix",
    "gpu_conformance_matrix", "by_name", "ENTRY", "PARAMS", "CaseData", "case_data",
    "empty_outputs", "slot_table_of", "reference", "compare", "BENCH_DECODE_BATCHES", "BENCH_DECODE_ROWS",
    "BENCH_PREFILL_ROWS", "BENCH_PREFILL_KV",
]

RTOL = ATOL = 2e-2
REL_L2 = 5e-3
OPS = ("decode", "prefill")
TP_SHAPES = {"TP1": (24, 2), "TP2": (12, 1), "TP4": (6, 1)}
DECODE_BATCHES = tuple(range(1, 17)) + (17, 24, 32, 48, 64, 96, 128)
PREFILL_KINDS = ("ordinary", "chunk", "paged")


# --------------------------------------------------------------------------------------------
# The matrix as data.
@dataclasses.dataclass(frozen=True)
class DecodeSpec:
    """One decode case (packed varlen, ``qsa-contract.md`` §2).

    Attributes:
      name: unique, human-readable ("decode/TP1/B17/saturated").
      hq, hkv, d: heads and head dim. batch: B. pattern: ``interop.indices.DECODE_PATTERNS``.
      max_len: longest row (saturated rows) and the ``max_seqlen_k`` passed.
      dtype: "bfloat16" | "float16". zero_rows: sequences with no key.
      slack: extra K/V rows after the last sequence; ``poison`` fills them with NaN (a kernel that
        reads outside its rows then produces NaN and fails).
      pad_capacity: K/V capacity = batch x max_len + slack whatever the lengths (as a serving
        buffer is), so the patterns of one (rank shape, B) share shapes and jitted kernels.
    """

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
        """Rough work estimate (keys x heads x D), for progress weighting."""
        return self.batch * self.max_len * self.hq * self.d


@dataclasses.dataclass(frozen=True)
class PrefillSpec:
    """One sparse prefill case (``qsa-contract.md`` §3).

    Attributes:
      name: unique ("prefill/chunk/G12xHkv1/kv32k").
      kind: "ordinary" | "chunk" | "paged". hq, hkv, d: heads and head dim.
      q_lens: query rows per request; kv_lens: context per request (chunk/paged; None ordinary).
      width: W index columns. dtype: q's dtype; kv_dtype: K/V dtype (None = q's, or
      "float8_e4m3fn" for chunk/paged with k_scale / v_scale).
      junk: padding mode (``interop.indices.JUNK_MODES``); empty_rows: fraction or row list of
      rows with no valid entry; overlap: adjacent-row sharing; per_head: indices [T, Hkv, W].
      junk_inside: columns 0, cap // 2 and cap - 1 of every row's read window (cap = min(W,
        visible)) overwritten with invalid values cycling through -1, -7, len, len + 19 (junk at
        the front, in the middle and at the end, not only after the valid prefix).
      duplicates: columns 2 and cap - 2 of every row's read window repeat column 1 (a valid
        position attended three times; applied after ``junk_inside``, whose columns it spares
        when cap >= 6).
      poison: NaN in every K/V row (pool slot) no valid entry selects (per KV head), and (paged)
        slot-table entries past each request's kv_len naming slots past the pool: a kernel that
        reads what the contract says it must not read then fails or faults.
      max_q_hint: the max_seqlen_q passed (None: the longest request); smaller than the longest
        request tests that the host hint is only a hint.
    """

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
    op: str = "prefill"

    @property
    def size(self) -> int:
        return sum(self.q_lens) * self.width * self.hq * self.d


Spec = DecodeSpec | PrefillSpec


def _k(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def full_matrix(ops: Sequence[str] = OPS, *, dtype: str = "bfloat16") -> list[Spec]:
    """The full matrix (GPU, compiled kernels): see the module docstring."""
    cases: list[Spec] = []
    if "decode" in ops:
        for tp, (hq, hkv) in TP_SHAPES.items():
            for b in DECODE_BATCHES:
                for pattern in ("short", "medium", "saturated"):
                    cases.append(DecodeSpec(f"decode/{tp}/B{b}/{pattern}", hq, hkv, 256, b, pattern,
                                            dtype=dtype, seed=b))
            cases += [
                DecodeSpec(f"decode/{tp}/B16/mixed+empty", hq, hkv, 256, 16, "mixed", dtype=dtype,
                           zero_rows=3, seed=7),
                DecodeSpec(f"decode/{tp}/B128/mixed+poison", hq, hkv, 256, 128, "mixed",
                           dtype=dtype, slack=77, poison=True, seed=8),
            ]
    if "prefill" in ops:
        t = 8192
        for kind in PREFILL_KINDS:
            for g in (3, 6, 12):
                for hkv in (1, 2):
                    kvs = (t,) if kind == "ordinary" else (8192, 32768, 131072)
                    for kv in kvs:
                        cases.append(PrefillSpec(
                            f"prefill/{kind}/G{g}xHkv{hkv}/kv{_k(kv)}/T{_k(t)}", kind, g * hkv, hkv,
                            256, (t,), None if kind == "ordinary" else (kv,), dtype=dtype,
                            seed=g * 10 + hkv))
        ragged_q = (2048, 17, 3072, 1, 3044)
        ragged_kv = (2048, 40000, 3072, 9000, 65536)
        for kind in PREFILL_KINDS:
            cases.append(PrefillSpec(f"prefill/{kind}/ragged/G12xHkv1", kind, 12, 1, 256, ragged_q,
                                     None if kind == "ordinary" else ragged_kv, dtype=dtype, seed=3))
            cases.append(PrefillSpec(f"prefill/{kind}/junk-mixed+empty/G6xHkv1", kind, 6, 1, 256,
                                     (4096,), None if kind == "ordinary" else (32768,), dtype=dtype,
                                     junk="mixed", empty_rows=0.02, seed=4))
            cases.append(PrefillSpec(f"prefill/{kind}/junk-len+19/per-head/G12xHkv2", kind, 24, 2,
                                     256, (2048, 2048), None if kind == "ordinary" else (2048, 20000),
                                     dtype=dtype, junk="len+19", per_head=True, seed=5))
        for kind in ("chunk", "paged"):
            for g, hkv in ((6, 1), (12, 1), (12, 2)):
                cases.append(PrefillSpec(
                    f"prefill/{kind}/fp8/G{g}xHkv{hkv}/kv32k", kind, g * hkv, hkv, 256, (4096,),
                    (32768,), dtype=dtype, kv_dtype="float8_e4m3fn", k_scale=0.75, v_scale=1.5,
                    junk="len", seed=6))
    return cases


def quick_matrix(ops: Sequence[str] = OPS, *, dtype: str = "float16") -> list[Spec]:
    """A reduced matrix that runs on CPU in interpret mode in a few minutes.

    Same kinds of cases as ``full_matrix`` at tiny sizes: the qualified head pairs, B 1..17,
    the three row patterns, zero-key rows and poisoned slack for decode; the three prefill
    variants with G 3/6/12 and Hkv 1/2, ragged batches, junk padding, empty rows, per-head
    indices, FP8 K/V; two D = 256 cases. fp16 by default (the Triton interpreter mis-multiplies
    bf16 dots).
    """
    cases: list[Spec] = []
    if "decode" in ops:
        for tp, (hq, hkv) in TP_SHAPES.items():
            for b in (1, 4, 17):
                for pattern in ("short", "medium", "saturated"):
                    cases.append(DecodeSpec(f"decode/{tp}/B{b}/{pattern}", hq, hkv, 64, b, pattern,
                                            max_len=67, dtype=dtype, seed=b))
        cases += [
            DecodeSpec("decode/TP1/B5/mixed+empty", 24, 2, 64, 5, "mixed", max_len=67, dtype=dtype,
                       zero_rows=2, seed=3),
            DecodeSpec("decode/TP2/B4/saturated+poison", 12, 1, 64, 4, "saturated", max_len=45,
                       dtype=dtype, slack=13, poison=True, seed=4),
            DecodeSpec("decode/TP4/B2/saturated/D256", 6, 1, 256, 2, "saturated", max_len=40,
                       dtype=dtype, seed=5),
            DecodeSpec("decode/TP1/B3/mixed/D256", 24, 2, 256, 3, "mixed", max_len=40,
                       dtype=dtype, seed=6),
        ]
    if "prefill" in ops:
        for kind in PREFILL_KINDS:
            for g in (3, 6, 12):
                for hkv in (1, 2):
                    q_lens = (9, 1, 6) if hkv == 1 else (12,)
                    kv_lens = None if kind == "ordinary" else ((80, 1, 40) if hkv == 1 else (150,))
                    cases.append(PrefillSpec(f"prefill/{kind}/G{g}xHkv{hkv}", kind, g * hkv, hkv, 64,
                                             q_lens, kv_lens, width=35, dtype=dtype,
                                             seed=g * 10 + hkv))
        cases += [
            PrefillSpec("prefill/ordinary/junk-mixed+empty/G12xHkv2", "ordinary", 24, 2, 64, (12,),
                        width=35, dtype=dtype, junk="mixed", empty_rows=(5,), seed=2),
            PrefillSpec("prefill/chunk/junk-len+empty/G6xHkv1", "chunk", 6, 1, 64, (7, 9),
                        (150, 9), width=35, dtype=dtype, junk="len", empty_rows=(0, 10), seed=3),
            PrefillSpec("prefill/chunk/fp8/G12xHkv1", "chunk", 12, 1, 64, (10,), (90,), width=35,
                        dtype=dtype, kv_dtype="float8_e4m3fn", k_scale=0.5, v_scale=1.5, seed=4),
            PrefillSpec("prefill/chunk/per-head/G3xHkv2", "chunk", 6, 2, 64, (6, 5), (60, 30),
                        width=35, dtype=dtype, per_head=True, junk="len+19", seed=5),
            PrefillSpec("prefill/paged/ragged+junk-7/G12xHkv1", "paged", 12, 1, 64, (8, 3, 1),
                        (200, 3, 77), width=35, dtype=dtype, junk="-7", seed=6),
            PrefillSpec("prefill/paged/fp8+empty/G6xHkv2", "paged", 12, 2, 64, (10,), (120,),
                        width=35, dtype=dtype, kv_dtype="float8_e4m3fn", k_scale=1.25, v_scale=0.5,
                        empty_rows=(3,), junk="mixed", seed=7),
            PrefillSpec("prefill/chunk/D256/G12xHkv1", "chunk", 12, 1, 256, (4,), (64,), width=35,
                        dtype=dtype, seed=8),
            PrefillSpec("prefill/ordinary/W67/G6xHkv1", "ordinary", 6, 1, 64, (40,), width=67,
                        dtype=dtype, seed=9),
        ]
    return cases + edge_cases(ops, dtype=dtype)


def edge_cases(ops: Sequence[str] = OPS, *, dtype: str = "float16") -> list[Spec]:
    """The contract's edge cases by name, at CPU sizes (part of ``quick_matrix``).

    A batch whose every sequence has no key (exact zeros, poisoned slack); invalid entries
    -1 / -7 / len / len + 19 at the front, middle and end of a row's read window; duplicated
    positions; per-KV-head indices; poisoned (NaN) K/V rows and pool slots that no valid entry
    names, also with FP8 K/V; a max_seqlen_q hint smaller than the longest request.
    """
    cases: list[Spec] = []
    if "decode" in ops:
        cases.append(DecodeSpec("decode/TP2/B3/all-empty", 12, 1, 64, 3, "short", max_len=20,
                                dtype=dtype, zero_rows=3, slack=5, poison=True, seed=11))
    if "prefill" in ops:
        P = PrefillSpec  # noqa: N806
        cases += [
            P("prefill/chunk/junk-inside/G6xHkv1", "chunk", 6, 1, 64, (6, 5, 1), (40, 5, 9),
              width=35, dtype=dtype, junk_inside=True, seed=12),
            P("prefill/ordinary/junk-inside/per-head/G3xHkv2", "ordinary", 6, 2, 64, (10,),
              width=35, dtype=dtype, per_head=True, junk_inside=True, seed=13),
            P("prefill/paged/duplicates/G12xHkv1", "paged", 12, 1, 64, (5, 4), (30, 12),
              width=35, dtype=dtype, duplicates=True, junk="len+19", seed=14),
            P("prefill/chunk/duplicates+junk-inside/per-head/G12xHkv2", "chunk", 24, 2, 64, (4,),
              (50,), width=35, dtype=dtype, per_head=True, duplicates=True, junk_inside=True,
              seed=15),
            P("prefill/paged/poison/G12xHkv1", "paged", 12, 1, 64, (6, 3), (120, 20), width=35,
              dtype=dtype, poison=True, pool_slack=19, junk="mixed", seed=16),
            P("prefill/chunk/poison+fp8/per-head/G6xHkv2", "chunk", 12, 2, 64, (5,), (60,),
              width=35, dtype=dtype, kv_dtype="float8_e4m3fn", k_scale=0.5, v_scale=2.0,
              poison=True, per_head=True, seed=17),
            P("prefill/chunk/max_seqlen_q-hint-2/G12xHkv1", "chunk", 12, 1, 64, (9, 3), (30, 3),
              width=35, dtype=dtype, max_q_hint=2, seed=19),
            P("prefill/paged/max_seqlen_q-hint-1/G6xHkv1", "paged", 6, 1, 64, (7, 2), (20, 9),
              width=35, dtype=dtype, max_q_hint=1, seed=20),
            P("prefill/ordinary/max_seqlen_q-hint-3/G3xHkv1", "ordinary", 3, 1, 64, (8, 2),
              width=35, dtype=dtype, max_q_hint=3, seed=21),
        ]
    return cases


def by_name(specs: Sequence[Spec]) -> dict[str, Spec]:
    """name -> spec (names are unique within a matrix)."""
    return {s.name: s for s in specs}


# The quick-matrix cases every implementation's conformance test runs (with all edge cases): each
# head pair and row pattern, one batch per tile regime, both D, every prefill variant with G 3,
# 6, 12 and Hkv 1, 2, ragged batches, junk, empty rows, per-head indices, FP8, W = 67. The rest
# of the quick matrix repeats these paths at other sizes (``qsa check --quick`` runs it all).
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
)


def conformance_matrix(ops: Sequence[str] = OPS, *, dtype: str = "float16") -> list[Spec]:
    """The cases of ``tests/conformance.py`` on a CPU (interpret mode): a subset of
    ``quick_matrix`` plus every ``edge_cases`` entry."""
    quick = by_name(quick_matrix(ops, dtype=dtype))
    return [quick[n] for n in _CONFORMANCE if n in quick] + edge_cases(ops, dtype=dtype)


def gpu_conformance_matrix(ops: Sequence[str] = OPS, *, dtype: str = "bfloat16") -> list[Spec]:
    """The cases of ``tests/conformance.py`` on a GPU (compiled kernels): production shapes (bf16,
    D = 256, max_seqlen_k = W = 2051) small enough for the FP64 numpy reference: decode corners of
    the full matrix, and prefill with 512-2048 query rows over long contexts."""
    cases: list[Spec] = []
    if "decode" in ops:
        full = by_name(full_matrix(("decode",), dtype=dtype))
        cases += [full[n] for n in ("decode/TP1/B128/saturated", "decode/TP2/B16/mixed+empty",
                                    "decode/TP4/B1/short", "decode/TP1/B128/mixed+poison",
                                    "decode/TP2/B17/medium", "decode/TP4/B64/saturated")]
    if "prefill" in ops:
        P = PrefillSpec  # noqa: N806
        cases += [
            P("gpu/prefill/ordinary/G6xHkv1/T2k", "ordinary", 6, 1, 256, (2048,), dtype=dtype,
              junk="len+19", seed=31),
            P("gpu/prefill/chunk/junk-mixed+empty/G12xHkv1/kv32k/T1k", "chunk", 12, 1, 256,
              (1024,), (32768,), dtype=dtype, junk="mixed", empty_rows=(0, 700), seed=32),
            P("gpu/prefill/paged/fp8/per-head/G12xHkv2/kv16k/T512", "paged", 24, 2, 256, (512,),
              (16384,), dtype=dtype, kv_dtype="float8_e4m3fn", k_scale=0.75, v_scale=1.5,
              per_head=True, pool_slack=1000, seed=33),
            P("gpu/prefill/chunk/poison+junk-inside+dup/G6xHkv1/ragged", "chunk", 6, 1, 256,
              (300, 77, 1), (9000, 77, 5000), dtype=dtype, poison=True, junk_inside=True,
              duplicates=True, max_q_hint=64, seed=34),
            P("gpu/prefill/paged/ragged/G3xHkv1", "paged", 3, 1, 256, (700, 5, 260),
              (4000, 5, 70000), dtype=dtype, junk="-7", pool_slack=333, seed=35),
        ]
    return cases


# --------------------------------------------------------------------------------------------
# Entry points and a case's arguments by name.
ENTRY = {"decode": "sparse_decode", "ordinary": "sparse_prefill", "chunk": "sparse_prefill_chunk",
         "paged": "sparse_prefill_paged"}
#: positional parameters of each entry point (qsa-contract.md), then its keyword parameters
PARAMS = {
    "sparse_decode": (("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_k"),
                      ("softmax_scale",)),
    "sparse_prefill": (("q", "k", "v", "indices", "cu_seqlens", "max_seqlen_q"), ("softmax_scale",)),
    "sparse_prefill_chunk": (("q", "k", "v", "indices", "cu_seqlens_q", "cu_seqlens_k", "kv_lens",
                              "max_seqlen_q"), ("softmax_scale", "k_scale", "v_scale")),
    "sparse_prefill_paged": (("q", "k_cache", "v_cache", "req_to_token", "req_indices", "indices",
                              "cu_seqlens_q", "kv_lens", "max_seqlen_q"),
                             ("softmax_scale", "k_scale", "v_scale")),
}


@dataclasses.dataclass(frozen=True)
class CaseData:
    """One case's call, by parameter name, except the random values (framework-free).

    Attributes:
      spec: the case. entry: the entry point ("sparse_decode", ...).
      floats: name -> (shape, dtype name) of q and the K/V buffers (q's dtype; K/V may be
        "float8_e4m3fn"); the values are N(0, 1) (``values()``), cast to the dtype by the caller.
      ints: name -> int32 numpy array (cu_seqlens*, kv_lens, req_to_token, req_indices, indices).
      scalars: name -> host value (max_seqlen_k / max_seqlen_q, softmax_scale, k_scale, v_scale).
      poison: bool [K/V rows, Hkv]: K/V entries set to NaN (a correct kernel never reads them),
        or None.
      empty: bool [output rows, Hq]: outputs that must be exactly 0 (``empty_outputs``).
    """

    spec: Spec
    entry: str
    floats: dict[str, tuple[tuple[int, ...], str]]
    ints: dict[str, np.ndarray]
    scalars: dict[str, Any]
    poison: np.ndarray | None
    empty: np.ndarray

    @property
    def kv_names(self) -> tuple[str, str]:
        return PARAMS[self.entry][0][1], PARAMS[self.entry][0][2]

    def values(self) -> dict[str, np.ndarray]:
        """Seeded float32 N(0, 1) values of q and K/V, poisoned entries NaN (numpy; the caller
        casts them to ``floats[name][1]``)."""
        rng = np.random.default_rng(1000 + self.spec.seed)
        out = {n: rng.standard_normal(shape, dtype=np.float32)
               for n, (shape, _) in self.floats.items()}
        if self.poison is not None:
            for n in self.kv_names:
                out[n][self.poison] = np.nan
        return out

    def arguments(self, named: dict[str, Any]) -> tuple[list, dict]:
        """(positional, keyword) arguments of the entry point: ``named`` (framework arrays of
        ``floats`` and ``ints``, by name) merged with ``scalars``."""
        allv = {**self.scalars, **named}
        pos, kws = PARAMS[self.entry]
        return [allv[n] for n in pos], {n: allv[n] for n in kws if n in allv}


def _read_window(indices: np.ndarray, cu_seqlens_q, lens, ordinary: bool):
    """(idx3 [T, H, W] int64, valid [T, H, W], req [T]): entries a row reads and counts (valid
    and inside its first min(W, visible) columns, ``qsa-contract.md`` §3)."""
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


def empty_outputs(entry: str, named: dict[str, Any], hq: int, hkv: int) -> np.ndarray:
    """bool [output rows, Hq]: outputs that must be exactly 0 (a decode sequence with no key; a
    prefill row and KV head with no valid entry in its read window), from host metadata given by
    parameter name (numpy arrays)."""
    if entry == "sparse_decode":
        ck = np.asarray(named["cu_seqlens_k"], np.int64)
        return np.repeat((np.diff(ck) <= 0)[:, None], hq, axis=1)
    if entry == "sparse_prefill":
        cu = np.asarray(named["cu_seqlens"], np.int64)
        _, valid, _ = _read_window(named["indices"], cu, np.diff(cu), True)
    else:
        _, valid, _ = _read_window(named["indices"], named["cu_seqlens_q"], named["kv_lens"], False)
    none = ~valid.any(-1)  # [T, 1 or Hkv]
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
    """Everything about a case but the random values: metadata and indices from
    ``interop.indices`` (realistic block-structured prefill indices), shapes, host scalars, the
    poisoned K/V entries and the outputs that must be exact zeros.

    Raises:
      ValueError: a spec the generators refuse (e.g. kv_lens < q_lens).
    """
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
    idx = I.prefill_indices(lay.q_lens, kv_lens, width=spec.width, junk=spec.junk,
                            empty_rows=spec.empty_rows, overlap=spec.overlap,
                            num_kv_heads=spec.hkv if spec.per_head else None, seed=spec.seed)
    if spec.junk_inside or spec.duplicates:
        _, _, visible, bound = I.row_layout(lay.q_lens, kv_lens)
        idx3 = (idx if idx.ndim == 3 else idx[:, None, :]).astype(np.int64)
        _edit_windows(idx3, visible, bound, spec)
        idx = (idx3 if spec.per_head else idx3[:, 0]).astype(np.int32)
    ints: dict[str, np.ndarray] = {"indices": idx}
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
        idx3, valid, req = _read_window(idx, lay.cu_seqlens_q, lens, kind == "ordinary")
        safe = np.where(valid, idx3, 0)
        if kind == "paged":
            kv_row = np.asarray(slot_table_of(ints), np.int64)[req[:, None, None], safe]
        else:
            base = lay.cu_seqlens_q if kind == "ordinary" else lay.cu_seqlens_k
            kv_row = np.asarray(base, np.int64)[req][:, None, None] + safe
        head = np.broadcast_to(np.arange(spec.hkv)[None, :, None] if idx3.shape[1] > 1 else
                               np.zeros((1, 1, 1), np.int64), kv_row.shape)
        named_kv = np.zeros((rows, spec.hkv), bool)
        for h in range(spec.hkv):  # shared indices name the row for every KV head
            sel = valid & ((head == h) | (idx3.shape[1] == 1))
            named_kv[kv_row[sel], h] = True
        poison = ~named_kv
    scalars: dict[str, Any] = {"max_seqlen_q": spec.max_q_hint or lay.max_seqlen_q,
                               "softmax_scale": None}
    if kind != "ordinary":
        scalars.update(k_scale=spec.k_scale, v_scale=spec.v_scale)
    return CaseData(spec, entry, {"q": ((t, spec.hq, spec.d), spec.dtype), k_name: kv, v_name: kv},
                    ints, scalars, poison, empty_outputs(entry, ints, spec.hq, spec.hkv))


def slot_table_of(named: dict[str, Any]):
    """The per-request pool slots ``[B, max_context]`` of a ``sparse_prefill_paged`` call given
    by parameter name (numpy or framework arrays): position p of request b lives in pool slot
    ``table[b, p]``. The one place that knows how the paged entry point addresses the pool."""
    rows = named["req_indices"]
    return named["req_to_token"][rows.long() if hasattr(rows, "long") else np.asarray(rows, np.int64)]


def reference(entry: str, named: dict[str, Any]) -> np.ndarray:
    """The FP64 reference (``interop.reference``) of a call given by parameter name.

    Args:
      entry: "sparse_decode" | "sparse_prefill" | "sparse_prefill_chunk" | "sparse_prefill_paged".
      named: every parameter of ``PARAMS[entry]`` as numpy arrays (float values as the kernel
        sees them, e.g. FP8 already cast to float) or host scalars; missing keyword parameters
        take their defaults.

    Returns:
      float64 [rows, Hq, D].

    Raises:
      ValueError: unknown entry point.
    """
    n = dict(named)
    sc, ks, vs = n.get("softmax_scale"), n.get("k_scale", 1.0), n.get("v_scale", 1.0)
    if entry == "sparse_decode":
        used = max(int(np.max(n["cu_seqlens_k"])), 0)  # rows past the last sequence are never read
        return R.decode_reference(n["q"], n["k"][:used], n["v"][:used], n["cu_seqlens_q"],
                                  n["cu_seqlens_k"], sc)
    if entry == "sparse_prefill":
        return R.prefill_reference(n["q"], n["k"], n["v"], n["indices"], n["cu_seqlens"], sc)
    if entry == "sparse_prefill_chunk":
        return R.prefill_chunk_reference(n["q"], n["k"], n["v"], n["indices"], n["cu_seqlens_q"],
                                         n["cu_seqlens_k"], n["kv_lens"], sc, ks, vs)
    if entry == "sparse_prefill_paged":
        return R.prefill_paged_reference(n["q"], n["k_cache"], n["v_cache"], n["req_to_token"],
                                         n["req_indices"], n["indices"], n["cu_seqlens_q"],
                                         n["kv_lens"], sc, ks, vs)
    raise ValueError(f"unknown entry point {entry!r}; known: {', '.join(PARAMS)}")


def compare(out: np.ndarray, ref: np.ndarray, empty: np.ndarray | None = None,
            rel_l2_limit: float = REL_L2) -> dict:
    """The pass criteria (``qsa-contract.md`` §6) of one output against the FP64 reference.

    Args:
      out, ref: float arrays of one shape; empty: bool mask over the leading axes of outputs
        that must be exactly 0 (or None).

    Returns:
      {"rel_l2", "max_abs", "allclose", "finite", "zeros_ok", "passed"}: finite output,
      ``|out - ref| <= ATOL + RTOL |ref|`` elementwise, relative L2 <= ``rel_l2_limit``, exact
      zeros where ``empty``.
    """
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
