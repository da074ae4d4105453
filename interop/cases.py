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
* ``BENCH_*``: the shapes ``bench/decode.py`` and ``bench/prefill.py`` time on the GPU.

Framework-free: numpy only.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from . import indices as I

__all__ = [
    "RTOL", "ATOL", "REL_L2", "OPS", "TP_SHAPES", "DECODE_BATCHES", "PREFILL_KINDS", "DecodeSpec",
    "PrefillSpec", "Spec", "full_matrix", "quick_matrix", "BENCH_DECODE_BATCHES",
    "BENCH_DECODE_ROWS", "BENCH_PREFILL_ROWS", "BENCH_PREFILL_KV",
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
      poison: NaN in every K/V row (pool slot) no valid entry selects, and (paged) slot-table
        entries past each request's kv_len naming slots past the pool: a kernel that reads what
        the contract says it must not read then fails or faults (bench memcheck cases).
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
    poison: bool = False
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
    return cases



# --------------------------------------------------------------------------------------------
# Benchmark shapes (GPU): decode TP1/TP2/TP4 x these batches x these row kinds at
# max_seqlen_k = 2051; prefill 8192-row chunks at these KV lengths for G 6/12 (Hkv 1) and 24/2,
# and the query-row sweep.
BENCH_DECODE_BATCHES = (1, 4, 16, 32, 64, 128)
BENCH_DECODE_ROWS = ("saturated", "mixed", "short")
BENCH_PREFILL_ROWS = (32, 128, 512, 2048, 8192)
BENCH_PREFILL_KV = (8192, 32768, 131072)
