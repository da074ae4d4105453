"""The one contract both implementations honour (``qsa-contract.md`` §2-3, §5).

Every public entry point of ``qsa_triton`` and ``qsa_pallas`` calls one of the ``check_*``
functions here *before* any launch. The checks see only ``TensorSpec`` values (shape, dtype name,
device, strides) plus host ints, so the same bad call gives the same ``ContractError`` message
whether it was made with torch tensors or jax arrays, and this module imports numpy only.

Two modes:
  * default: what the kernels need to be correct (ranks, dtypes, integral GQA group, power-of-two
    head dim, int32 metadata of the right length on the same device, matching K/V shapes, W >= 1).
  * ``strict=True``: additionally the qualified envelope of ``qsa-contract.md`` (head pairs, D = 256,
    1 <= B <= 128, max_seqlen_k <= 2055, max_seqlen_q = 1) that upstream validated and we promise.

Values that live on the device (cu_seqlens contents, indices) are never read here: that would be a
host sync. ``validate_*`` (the debug validator) reads them on the host, off the hot path.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import numpy as np

from .arch import DeviceFacts

__all__ = [
    "ContractError",
    "TensorSpec",
    "spec_of",
    "DecodeProblem",
    "PrefillProblem",
    "check_decode",
    "check_prefill",
    "check_prefill_chunk",
    "check_prefill_paged",
    "Route",
    "route",
    "exact_contract",
    "envelope_text",
    "validate_decode_metadata",
    "validate_prefill_metadata",
    "prefill_selection",
    "QUALIFIED",
]

# --------------------------------------------------------------------------------------------
# The qualified envelope (qsa-contract.md §2, §3, §6).
QUALIFIED = {
    "head_pairs": ((24, 2), (12, 1), (6, 1)),
    "prefill_head_pairs": ((24, 2), (12, 1), (6, 1), (3, 1), (12, 2)),
    "head_dim": 256,
    "batch": (1, 128),
    "max_seqlen_k": 2055,
    "max_seqlen_q": 1,
    "dtypes": ("bfloat16", "float16"),
    "kv_fp8": "float8_e4m3fn",
    "index_width": 2051,
}
_FLOAT_DTYPES = ("bfloat16", "float16")
_FP8_DTYPES = ("float8_e4m3fn",)
_MAX_GROUP = 16
_HEAD_DIMS = (32, 64, 128, 256)


class ContractError(ValueError):
    """A call outside what the kernels can compute correctly (or, in strict mode, outside the
    qualified envelope). The message names the entry point, the argument, what was expected,
    what was given and the qualified envelope."""

    def __init__(self, fn: str, arg: str, expected: str, got: Any, *, strict: bool = False):
        self.fn, self.arg, self.expected, self.got = fn, arg, expected, got
        mode = "strict" if strict else "default"
        super().__init__(
            f"{fn}: argument '{arg}': expected {expected}; got {got}. "
            f"[{mode} mode] Qualified envelope: {envelope_text(fn)}"
        )


def envelope_text(fn: str = "sparse_decode") -> str:
    """One-line text of the qualified envelope for an entry point."""
    q = QUALIFIED
    if "decode" in fn or "flash_attn" in fn:
        pairs = ", ".join(f"({a},{b})" for a, b in q["head_pairs"])
        return (f"dtype bf16|fp16, D={q['head_dim']}, (Hq,Hkv) in {{{pairs}}}, "
                f"{q['batch'][0]}<=B<={q['batch'][1]}, 1<=max_seqlen_k<={q['max_seqlen_k']}, "
                f"max_seqlen_q=1")
    pairs = ", ".join(f"({a},{b})" for a, b in q["prefill_head_pairs"])
    return (f"dtype bf16|fp16 (K/V also fp8 e4m3 in chunk/paged), D={q['head_dim']}, "
            f"(Hq,Hkv) in {{{pairs}}}, indices int32 [T,W] or [T,Hkv,W] with W>=1 "
            f"(W={q['index_width']} in production)")


# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """Framework-free description of one tensor.

    Attributes:
      shape: sizes, elements.
      dtype: canonical dtype name (``"bfloat16"``, ``"float16"``, ``"float32"``, ``"int32"``,
        ``"int64"``, ``"float8_e4m3fn"``, ...), the same for torch and jax.
      device: ``"cpu"`` or ``"cuda"`` (jax's ``"gpu"`` platform maps to ``"cuda"``).
      index: device ordinal, or None when unknown (jax arrays under tracing).
      strides: element strides, or None when the framework does not expose them (jax: row-major).
    """

    shape: tuple[int, ...]
    dtype: str
    device: str = "cpu"
    index: int | None = None
    strides: tuple[int, ...] | None = None

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def where(self) -> str:
        return self.device if self.index is None else f"{self.device}:{self.index}"

    def is_contiguous(self) -> bool:
        if self.strides is None:
            return True
        expected, acc = [], 1
        for size in reversed(self.shape):
            expected.append(acc)
            acc *= max(size, 1)
        expected.reverse()
        return all(s == e or n == 1 for s, e, n in zip(self.strides, expected, self.shape))

    def __str__(self) -> str:
        return f"{self.dtype}{list(self.shape)} on {self.where}"

    @classmethod
    def from_torch(cls, t) -> "TensorSpec":
        """Spec of a torch tensor (no torch import: duck-typed)."""
        dtype = str(t.dtype).removeprefix("torch.")
        dev = t.device
        return cls(tuple(int(s) for s in t.shape), dtype, str(dev.type), dev.index,
                   tuple(int(s) for s in t.stride()))

    @classmethod
    def from_jax(cls, a) -> "TensorSpec":
        """Spec of a jax array or tracer / ShapeDtypeStruct (no jax import: duck-typed)."""
        dtype = np.dtype(a.dtype).name if not hasattr(a.dtype, "name") else a.dtype.name
        device, index = "cpu", None
        devices = None
        try:
            devices = a.devices() if hasattr(a, "devices") and callable(a.devices) else None
        except Exception:  # noqa: BLE001 - tracers raise; they carry no device
            devices = None
        if devices:
            d = next(iter(devices))
            device = "cuda" if d.platform in ("gpu", "cuda", "rocm") else d.platform
            # cpu ordinals are meaningless across frameworks (torch reports none): drop them
            index = int(d.id) if len(devices) == 1 and device != "cpu" else None
        else:
            sharding = getattr(a, "sharding", None)
            kinds = getattr(sharding, "_device_assignment", None) if sharding is not None else None
            if kinds:
                device = "cuda" if kinds[0].platform in ("gpu", "cuda") else kinds[0].platform
            else:
                device = _jax_default_platform()
        return cls(tuple(int(s) for s in a.shape), dtype, device, index, None)


def _jax_default_platform() -> str:
    import sys  # noqa: PLC0415

    jax = sys.modules.get("jax")
    if jax is None:
        return "cpu"
    try:
        platform = jax.default_backend()
    except Exception:  # noqa: BLE001
        return "cpu"
    return "cuda" if platform in ("gpu", "cuda") else platform


def spec_of(x: Any) -> TensorSpec:
    """TensorSpec of a torch tensor, a jax array / tracer, a numpy array, or a TensorSpec."""
    if isinstance(x, TensorSpec):
        return x
    mod = type(x).__module__
    if mod.startswith("torch"):
        return TensorSpec.from_torch(x)
    if mod.startswith(("jax", "jaxlib")):
        return TensorSpec.from_jax(x)
    if isinstance(x, np.ndarray):
        return TensorSpec(x.shape, x.dtype.name, "cpu", None,
                          tuple(s // x.itemsize for s in x.strides) if x.itemsize else None)
    raise TypeError(f"cannot describe a {type(x).__name__} as a tensor")


# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DecodeProblem:
    """What a decode call resolved to: sizes (host ints) and the resolved scale."""

    batch: int
    num_q_heads: int
    num_kv_heads: int
    group: int
    head_dim: int
    capacity: int
    max_seqlen_k: int
    softmax_scale: float
    dtype: str


@dataclasses.dataclass(frozen=True)
class PrefillProblem:
    """What a prefill call (any variant) resolved to."""

    kind: str  # "ordinary" | "chunk" | "paged"
    total_q: int
    requests: int
    num_q_heads: int
    num_kv_heads: int
    group: int
    head_dim: int
    width: int  # W, index columns per row
    per_head_indices: bool  # indices [T, Hkv, W]
    max_seqlen_q: int
    softmax_scale: float
    k_scale: float
    v_scale: float
    dtype: str
    kv_dtype: str


class _Checker:
    """Collects the context (entry point name, mode) for the error messages."""

    def __init__(self, fn: str, strict: bool):
        self.fn, self.strict = fn, strict

    def fail(self, arg: str, expected: str, got: Any):
        raise ContractError(self.fn, arg, expected, got, strict=self.strict)

    def spec(self, name: str, x: Any) -> TensorSpec:
        try:
            return spec_of(x)
        except TypeError:
            self.fail(name, "a torch tensor or a jax array", type(x).__name__)

    def rank(self, name: str, s: TensorSpec, ndim: int | tuple[int, ...], what: str):
        ok = (ndim,) if isinstance(ndim, int) else ndim
        if s.ndim not in ok:
            self.fail(name, f"a {'-or-'.join(map(str, ok))}-D tensor {what}", f"shape {list(s.shape)}")

    def dtype(self, name: str, s: TensorSpec, allowed: Sequence[str]):
        if s.dtype not in allowed:
            self.fail(name, f"dtype in {{{', '.join(allowed)}}}", s.dtype)

    def same_device(self, name: str, s: TensorSpec, ref: TensorSpec, ref_name: str):
        if s.device != ref.device or (s.index is not None and ref.index is not None and s.index != ref.index):
            self.fail(name, f"a tensor on {ref_name}'s device ({ref.where})", s.where)

    def last_dim_contiguous(self, name: str, s: TensorSpec):
        if s.strides is not None and s.ndim and s.shape[-1] > 1 and s.strides[-1] != 1:
            self.fail(name, "unit stride in the last dimension", f"strides {list(s.strides)}")

    def metadata(self, name: str, s: TensorSpec, length: int | None, ref: TensorSpec, ref_name: str):
        self.rank(name, s, 1, "of int32 metadata")
        self.dtype(name, s, ("int32",))
        if length is not None and s.shape[0] != length:
            self.fail(name, f"length {length}", f"length {s.shape[0]}")
        self.same_device(name, s, ref, ref_name)
        if not s.is_contiguous():
            self.fail(name, "a contiguous tensor", f"strides {list(s.strides)}")

    def host_int(self, name: str, value: Any, lo: int, hi: int | None, hi_note: str = ""):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            self.fail(name, "a host int (a static upper bound, not a device value)",
                      type(value).__name__)
        value = int(value)
        if value < lo or (hi is not None and value > hi):
            rng = f"{lo} <= {name} <= {hi}{hi_note}" if hi is not None else f"{name} >= {lo}"
            self.fail(name, rng, value)
        return value

    def scalar(self, name: str, value: Any, default: float | None = None, positive: bool = True) -> float:
        if value is None and default is not None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
            self.fail(name, "a host float", type(value).__name__)
        value = float(value)
        if not math.isfinite(value) or (positive and value <= 0):
            self.fail(name, "a finite float > 0", value)
        return value

    def heads(self, hq: int, hkv: int, q_name: str, kv_name: str, pairs):
        if hkv < 1 or hq % hkv != 0:
            self.fail(kv_name, f"a KV head count dividing the {hq} query heads of '{q_name}'",
                      f"{hkv} KV heads")
        group = hq // hkv
        if group > _MAX_GROUP:
            self.fail(q_name, f"a GQA group Hq/Hkv <= {_MAX_GROUP}", f"group {group} ({hq}/{hkv})")
        if self.strict and (hq, hkv) not in pairs:
            self.fail(q_name, f"(Hq, Hkv) in {{{', '.join(map(str, pairs))}}}", (hq, hkv))
        return group

    def head_dim(self, name: str, d: int):
        if d not in _HEAD_DIMS:
            self.fail(name, f"head dim D in {_HEAD_DIMS} (a power of two 32..256)", d)
        if self.strict and d != QUALIFIED["head_dim"]:
            self.fail(name, f"head dim D = {QUALIFIED['head_dim']}", d)


def check_decode(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_k, softmax_scale=None, *,
    max_seqlen_q: int = 1, strict: bool = False, fn: str = "sparse_decode",
) -> DecodeProblem:
    """Check a packed varlen decode call (``qsa-contract.md`` §2) before any launch.

    Args:
      q: [B, Hq, D] bf16|fp16.
      k, v: [C, Hkv, D], q's dtype, q's device; C = capacity (rows), any size.
      cu_seqlens_q, cu_seqlens_k: int32 [B + 1], contiguous, on q's device (contents not read).
      max_seqlen_k: host int >= 1, static upper bound of any row's key count.
      softmax_scale: host float > 0, or None for D ** -0.5.
      max_seqlen_q: host int; must be 1 (decode has one query row per sequence).
      strict: also enforce the qualified envelope.
      fn: entry point name used in messages.

    Returns:
      DecodeProblem with the sizes and the resolved scale.

    Raises:
      ContractError: naming the argument, expected, got, and the qualified envelope.
    """
    c = _Checker(fn, strict)
    qs, ks, vs = c.spec("q", q), c.spec("k", k), c.spec("v", v)
    cq, ck = c.spec("cu_seqlens_q", cu_seqlens_q), c.spec("cu_seqlens_k", cu_seqlens_k)
    c.rank("q", qs, 3, "[B, Hq, D]")
    c.dtype("q", qs, _FLOAT_DTYPES)
    c.rank("k", ks, 3, "[C, Hkv, D]")
    c.rank("v", vs, 3, "[C, Hkv, D]")
    c.dtype("k", ks, (qs.dtype,))
    c.dtype("v", vs, (qs.dtype,))
    if vs.shape != ks.shape:
        c.fail("v", f"k's shape {list(ks.shape)}", f"shape {list(vs.shape)}")
    b, hq, d = qs.shape
    if ks.shape[2] != d:
        c.fail("k", f"head dim {d} (q's)", ks.shape[2])
    c.head_dim("q", d)
    group = c.heads(hq, ks.shape[1], "q", "k", QUALIFIED["head_pairs"])
    lo, hi = QUALIFIED["batch"]
    if b < 1 or (strict and b > hi):
        c.fail("q", f"batch B in [{lo}, {hi}]" if strict else "batch B >= 1", f"B = {b}")
    for name, s in (("q", qs), ("k", ks), ("v", vs)):
        c.last_dim_contiguous(name, s)
    c.same_device("k", ks, qs, "q")
    c.same_device("v", vs, qs, "q")
    c.metadata("cu_seqlens_q", cq, b + 1, qs, "q")
    c.metadata("cu_seqlens_k", ck, b + 1, qs, "q")
    c.host_int("max_seqlen_q", max_seqlen_q, 1, 1, " (decode: one query row per sequence)")
    msk = c.host_int("max_seqlen_k", max_seqlen_k, 1, QUALIFIED["max_seqlen_k"] if strict else None)
    scale = c.scalar("softmax_scale", softmax_scale, default=d ** -0.5)
    return DecodeProblem(b, hq, ks.shape[1], group, d, ks.shape[0], msk, scale, qs.dtype)


def _check_indices(c: _Checker, ids: TensorSpec, t: int, hkv: int, qs: TensorSpec,
                   name: str = "indices") -> tuple[int, bool]:
    # name "block_indices": the indexer's block ids (block-level selection), same layout rules
    what = ("request-relative token positions, invalid entries negative or >= len"
            if name == "indices" else "row-relative block ids, invalid ids negative or >= the "
            "row's visible blocks")
    c.rank(name, ids, (2, 3), "[T, W] or [T, Hkv, W]")
    if ids.dtype not in ("int32",):
        c.fail(name, f"dtype int32 ({what})", ids.dtype)
    if ids.shape[0] != t:
        c.fail(name, f"{t} rows (q's T)", f"{ids.shape[0]} rows")
    if ids.ndim == 3 and ids.shape[1] != hkv:
        c.fail(name, f"[T, Hkv={hkv}, W]", f"shape {list(ids.shape)}")
    w = ids.shape[-1]
    if w < 1:
        c.fail(name, "W >= 1 index columns", f"W = {w}")
    c.same_device(name, ids, qs, "q")
    c.last_dim_contiguous(name, ids)
    return w, ids.ndim == 3


def _check_prefill_common(c: _Checker, q, k, v, indices, kv_dtypes, k_name="k", v_name="v",
                          indices_name="indices"):
    qs, ks, vs = c.spec("q", q), c.spec(k_name, k), c.spec(v_name, v)
    ids = c.spec(indices_name, indices)
    c.rank("q", qs, 3, "[T, Hq, D]")
    c.dtype("q", qs, _FLOAT_DTYPES)
    c.rank(k_name, ks, 3, "[rows, Hkv, D]")
    c.rank(v_name, vs, 3, "[rows, Hkv, D]")
    allowed = (qs.dtype,) + tuple(kv_dtypes)
    c.dtype(k_name, ks, allowed)
    c.dtype(v_name, vs, (ks.dtype,))
    if vs.shape != ks.shape:
        c.fail(v_name, f"{k_name}'s shape {list(ks.shape)}", f"shape {list(vs.shape)}")
    t, hq, d = qs.shape
    if ks.shape[2] != d:
        c.fail(k_name, f"head dim {d} (q's)", ks.shape[2])
    c.head_dim("q", d)
    group = c.heads(hq, ks.shape[1], "q", k_name, QUALIFIED["prefill_head_pairs"])
    for name, s in (("q", qs), (k_name, ks), (v_name, vs)):
        c.last_dim_contiguous(name, s)
    c.same_device(k_name, ks, qs, "q")
    c.same_device(v_name, vs, qs, "q")
    w, per_head = _check_indices(c, ids, t, ks.shape[1], qs, indices_name)
    return qs, ks, w, per_head, group


def check_prefill(q, k, v, indices, cu_seqlens, max_seqlen_q, softmax_scale=None, *,
                  strict: bool = False, fn: str = "sparse_prefill",
                  indices_name: str = "indices") -> PrefillProblem:
    """Check an ordinary sparse prefill call (``qsa-contract.md`` §3) before any launch.

    Args:
      q: [T, Hq, D] bf16|fp16; k, v: [T, Hkv, D] this forward's new K/V, packed like q, q's dtype.
      indices: int32 [T, W] or [T, Hkv, W], request-relative positions; valid iff 0 <= idx < len.
      cu_seqlens: int32 [B + 1] on q's device.
      max_seqlen_q: host int >= 1, the longest request (grid bound).
      softmax_scale: host float > 0 or None for D ** -0.5.
      indices_name: "indices", or "block_indices" when ``indices`` holds the indexer's block ids
        (the block-level form of the entry points; same layout rules, W = NB).

    Raises:
      ContractError: naming the argument, expected, got, and the qualified envelope.
    """
    c = _Checker(fn, strict)
    qs, ks, w, per_head, group = _check_prefill_common(c, q, k, v, indices, (),
                                                       indices_name=indices_name)
    if ks.shape[0] != qs.shape[0]:
        c.fail("k", f"{qs.shape[0]} rows (packed like q)", f"{ks.shape[0]} rows")
    cu = c.spec("cu_seqlens", cu_seqlens)
    c.metadata("cu_seqlens", cu, None, qs, "q")
    if cu.shape[0] < 2:
        c.fail("cu_seqlens", "length B + 1 >= 2", f"length {cu.shape[0]}")
    msq = c.host_int("max_seqlen_q", max_seqlen_q, 1, None)
    scale = c.scalar("softmax_scale", softmax_scale, default=qs.shape[2] ** -0.5)
    return PrefillProblem("ordinary", qs.shape[0], cu.shape[0] - 1, qs.shape[1], ks.shape[1], group,
                          qs.shape[2], w, per_head, msq, scale, 1.0, 1.0, qs.dtype, ks.dtype)


def check_prefill_chunk(q, k, v, indices, cu_seqlens_q, cu_seqlens_k, kv_lens, max_seqlen_q,
                        softmax_scale=None, k_scale=1.0, v_scale=1.0, *, strict: bool = False,
                        fn: str = "sparse_prefill_chunk",
                        indices_name: str = "indices") -> PrefillProblem:
    """Check a chunk sparse prefill call (``qsa-contract.md`` §3) before any launch.

    Args:
      q: [T, Hq, D] bf16|fp16.
      k, v: [Ck, Hkv, D] each request's full context packed (rows cu_seqlens_k[b]..), q's dtype or
        float8_e4m3fn (then ``k_scale`` multiplies the scores, ``v_scale`` the P·V output).
      indices: int32 [T, W] or [T, Hkv, W]; valid iff 0 <= idx < kv_lens[b].
      cu_seqlens_q, cu_seqlens_k: int32 [B + 1]; kv_lens: int32 [B]; all on q's device.
      max_seqlen_q: host int >= 1.
      softmax_scale, k_scale, v_scale: host floats > 0 (softmax_scale None -> D ** -0.5).
      indices_name: as ``check_prefill``.

    Raises:
      ContractError: naming the argument, expected, got, and the qualified envelope.
    """
    c = _Checker(fn, strict)
    qs, ks, w, per_head, group = _check_prefill_common(c, q, k, v, indices, _FP8_DTYPES,
                                                       indices_name=indices_name)
    cq, ck, kl = (c.spec("cu_seqlens_q", cu_seqlens_q), c.spec("cu_seqlens_k", cu_seqlens_k),
                  c.spec("kv_lens", kv_lens))
    c.metadata("cu_seqlens_q", cq, None, qs, "q")
    if cq.shape[0] < 2:
        c.fail("cu_seqlens_q", "length B + 1 >= 2", f"length {cq.shape[0]}")
    b = cq.shape[0] - 1
    c.metadata("cu_seqlens_k", ck, b + 1, qs, "q")
    c.metadata("kv_lens", kl, b, qs, "q")
    return _prefill_tail(c, "chunk", qs, ks, w, per_head, group, b, max_seqlen_q, softmax_scale,
                         k_scale, v_scale)


def check_prefill_paged(q, k_cache, v_cache, req_to_token, req_indices, indices, cu_seqlens_q,
                        kv_lens, max_seqlen_q, softmax_scale=None, k_scale=1.0, v_scale=1.0, *,
                        strict: bool = False, fn: str = "sparse_prefill_paged",
                        indices_name: str = "indices") -> PrefillProblem:
    """Check a paged sparse prefill call (``qsa-contract.md`` §3) before any launch.

    Args:
      q: [T, Hq, D] bf16|fp16.
      k_cache, v_cache: [slots, Hkv, D] the KV pool, q's dtype or float8_e4m3fn.
      req_to_token: int32 [max_reqs, max_context]; position p of the request in row r lives in
        pool slot req_to_token[r, p] (SGLang's table, shared with ``sparse_decode_paged``).
      req_indices: int32 [B]; request b uses row req_indices[b] of req_to_token.
      indices: int32 [T, W] or [T, Hkv, W]; valid iff 0 <= idx < kv_lens[b] (and, as the kernels
        clamp lying metadata, idx < max_context, req_indices[b] < max_reqs, slot in the pool).
      cu_seqlens_q: int32 [B + 1]; kv_lens: int32 [B]; on q's device.
      max_seqlen_q: host int >= 1.
      indices_name: as ``check_prefill``.

    Raises:
      ContractError: naming the argument, expected, got, and the qualified envelope.
    """
    c = _Checker(fn, strict)
    qs, ks, w, per_head, group = _check_prefill_common(c, q, k_cache, v_cache, indices, _FP8_DTYPES,
                                                       "k_cache", "v_cache", indices_name)
    cq, kl = c.spec("cu_seqlens_q", cu_seqlens_q), c.spec("kv_lens", kv_lens)
    c.metadata("cu_seqlens_q", cq, None, qs, "q")
    if cq.shape[0] < 2:
        c.fail("cu_seqlens_q", "length B + 1 >= 2", f"length {cq.shape[0]}")
    b = cq.shape[0] - 1
    c.metadata("kv_lens", kl, b, qs, "q")
    c.metadata("req_indices", c.spec("req_indices", req_indices), b, qs, "q")
    rt = c.spec("req_to_token", req_to_token)
    c.rank("req_to_token", rt, 2, "[max_reqs, max_context] of int32 pool slots")
    c.dtype("req_to_token", rt, ("int32",))
    c.same_device("req_to_token", rt, qs, "q")
    c.last_dim_contiguous("req_to_token", rt)
    return _prefill_tail(c, "paged", qs, ks, w, per_head, group, b, max_seqlen_q, softmax_scale,
                         k_scale, v_scale)


def prefill_selection(fn: str, indices, block_indices, overlap) -> tuple[str, Any, float | None]:
    """Which selection a prefill call passes (both backends' entry points): token ``indices``,
    or ``indices=None`` with the indexer's ``block_indices=`` (the block-level form,
    ``interop.indices.expand_prefill_blocks``); ``overlap`` (the engine's neighbour-Jaccard hint
    for the kernel selector) only with ``block_indices``, None or a host float in [0, 1].

    Returns:
      ("indices" | "block_indices", the selection, overlap as a float or None).

    Raises:
      ContractError: both or neither selection given, or a bad ``overlap``.
    """
    if (indices is None) == (block_indices is None):
        raise ContractError(fn, "indices", "token indices, or indices=None and block_indices= "
                            "(exactly one selection)",
                            "both" if indices is not None else "neither")
    if block_indices is None:
        if overlap is not None:
            raise ContractError(fn, "overlap", "None unless block_indices= is given", overlap)
        return "indices", indices, None
    if overlap is None:
        return "block_indices", block_indices, None
    if (isinstance(overlap, bool) or not isinstance(overlap, (int, float, np.floating, np.integer))
            or not 0.0 <= float(overlap) <= 1.0):
        raise ContractError(fn, "overlap", "None or a host float in [0, 1]", overlap)
    return "block_indices", block_indices, float(overlap)


def _prefill_tail(c, kind, qs, ks, w, per_head, group, b, max_seqlen_q, softmax_scale, k_scale,
                  v_scale) -> PrefillProblem:
    msq = c.host_int("max_seqlen_q", max_seqlen_q, 1, None)
    scale = c.scalar("softmax_scale", softmax_scale, default=qs.shape[2] ** -0.5)
    ksc = c.scalar("k_scale", k_scale)
    vsc = c.scalar("v_scale", v_scale)
    if ks.dtype == qs.dtype and (ksc != 1.0 or vsc != 1.0):
        c.fail("k_scale", "k_scale = v_scale = 1.0 unless K/V are float8_e4m3fn",
               f"k_scale={ksc}, v_scale={vsc} with {ks.dtype} K/V")
    return PrefillProblem(kind, qs.shape[0], b, qs.shape[1], ks.shape[1], group, qs.shape[2], w,
                          per_head, msq, scale, ksc, vsc, qs.dtype, ks.dtype)


# --------------------------------------------------------------------------------------------
# Arch routing (qsa-contract.md §5).
@dataclasses.dataclass(frozen=True)
class Route:
    """Which kernel family and geometry source applies to one (device, op) pair.

    Attributes:
      op: "decode" | "prefill" | "prefill_chunk" | "prefill_paged".
      kernel: kernel family name ("qsa.decode.splitkv", "qsa.prefill", or "refused").
      geometry: geometry source ("sm90-table", "l20-table", "h20-table", "sm120-tuned-or-table",
        "decode-heuristic").
      exact_contract: True when only the strict envelope may run (SM121 decode).
      reason: one line a human can read.
    """

    op: str
    kernel: str
    geometry: str
    exact_contract: bool
    reason: str


def route(facts: DeviceFacts, op: str) -> Route:
    """Routing per arch.

    SM121 decode: exact (strict) contract only, as upstream gates its packed kernel on exact
    (12, 1) - a family "SM12x" gate caused silent corruption upstream (qsa-contract.md §5).
    SM120 prefill: upstream's tuned family only on the 188-SM part (Triton >= 3.7), else the L20
    table. SM90: our own measured table. Anything else: the L20 table (upstream's default).

    Raises:
      ValueError: unknown op.
    """
    ops = ("decode", "prefill", "prefill_chunk", "prefill_paged")
    if op not in ops:
        raise ValueError(f"route: op must be one of {ops}, got {op!r}")
    cc = facts.cc
    if op == "decode":
        exact = cc == (12, 1)
        why = ("sm_121: exact qualified contract only (strict checks)" if exact
               else f"{facts.arch}: generic split-KV decode, default checks")
        return Route(op, "qsa.decode.splitkv", "decode-heuristic", exact, why)
    kernel = "qsa.prefill"
    # H20 is sm_90 too: name check first, or upstream's H20 table is unreachable.
    if "H20" in facts.name and "H200" not in facts.name:
        return Route(op, kernel, "h20-table", False, "H20: upstream's H20 table")
    if cc == (9, 0):
        return Route(op, kernel, "sm90-table", False, "sm_90: table from our H200 sweep")
    if cc == (12, 0):
        if facts.sm_count == 188:
            return Route(op, kernel, "sm120-tuned-or-table", False,
                         "sm_120 188-SM part: upstream tuned family within its gates, else L20 table")
        return Route(op, kernel, "l20-table", False,
                     f"sm_120 with {facts.sm_count} SMs: tuned family is qualified on 188 SMs only")
    if "H20" in facts.name and "H200" not in facts.name:
        return Route(op, kernel, "h20-table", False, "H20: upstream's H20 table")
    return Route(op, kernel, "l20-table", False, f"{facts.arch}: upstream's default (L20) table")


def exact_contract(facts: DeviceFacts | None, op: str = "decode") -> bool:
    """The one exact-contract check: True where ``route`` sends ``op`` on this device to the exact
    qualified contract only (sm_121 decode), so the entry point must check with ``strict=True``.
    ``facts`` None (a CPU interpreter, no GPU) is never exact."""
    return facts is not None and route(facts, op).exact_contract


# --------------------------------------------------------------------------------------------
# Debug validator: host-side, reads device metadata (a sync), off the hot path.
def _np(x) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x
    if type(x).__module__.startswith("torch"):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def validate_decode_metadata(cu_seqlens_q, cu_seqlens_k, capacity: int, max_seqlen_k: int,
                             batch: int | None = None, fn: str = "sparse_decode") -> None:
    """Check decode metadata contents (host sync; debug only).

    Raises:
      ContractError: cu_seqlens not starting at 0 / decreasing, a row longer than max_seqlen_k
        (the kernels still compute such a row completely — the bound only sizes the split grid —
        but a declared bound the data breaks is a caller bug this debug check reports), rows past
        the K/V capacity, query rows out of range.
    """
    c = _Checker(fn, False)
    cq, ck = _np(cu_seqlens_q).astype(np.int64), _np(cu_seqlens_k).astype(np.int64)
    for name, cu in (("cu_seqlens_q", cq), ("cu_seqlens_k", ck)):
        if cu.size and cu[0] != 0:
            c.fail(name, "cu[0] == 0", int(cu[0]))
        steps = np.diff(cu)
        if (steps < 0).any():
            s = int(np.argmin(steps))
            c.fail(name, "non-decreasing values", f"cu[{s}]={cu[s]} > cu[{s + 1}]={cu[s + 1]}")
    lens = np.diff(ck)
    if lens.size and lens.max() > max_seqlen_k:
        s = int(np.argmax(lens))
        c.fail("cu_seqlens_k", f"every row length <= max_seqlen_k={max_seqlen_k} (the declared "
               "bound; the kernels still compute longer rows, only the grid is sized for it)",
               f"row {s} has {int(lens[s])} keys")
    if ck.size and ck[-1] > capacity:
        c.fail("cu_seqlens_k", f"cu_seqlens_k[B] <= capacity {capacity} of k/v", int(ck[-1]))
    if batch is not None and cq.size and (cq[:-1] >= batch).any():
        c.fail("cu_seqlens_q", f"query rows < {batch}", cq.tolist())


def validate_prefill_metadata(indices, cu_seqlens_q, lens, kind: str, *, req_to_token=None,
                              req_indices=None, pool_slots: int | None = None,
                              flag_duplicates: bool = False, fn: str = "sparse_prefill") -> dict:
    """Check prefill metadata contents (host sync; debug only).

    ``lens`` is the validity bound per request: the request length (ordinary; pass None to derive
    it from cu_seqlens_q) or kv_lens (chunk/paged). Checks: non-decreasing cu_seqlens_q, the
    valid-first layout (no valid entry after an invalid one), no valid entry beyond the row's
    visible count (the early-stop rule); paged (``req_to_token`` given): ``req_indices`` rows
    inside the table, valid positions inside its width, their slots inside the pool (the kernels
    treat anything else as an invalid entry; this check reports it).

    Returns:
      dict with counts: rows, valid entries, duplicate entries.

    Raises:
      ContractError: the first violation found, naming row and column.
    """
    c = _Checker(fn, False)
    cq = _np(cu_seqlens_q).astype(np.int64)
    if cq[0] != 0 or (np.diff(cq) < 0).any():
        c.fail("cu_seqlens_q", "cu[0] == 0 and non-decreasing values", cq.tolist())
    qlen = np.diff(cq)
    lens = qlen if lens is None else _np(lens).astype(np.int64)
    if kind != "ordinary" and (lens < qlen).any():
        b = int(np.argmax(lens < qlen))
        c.fail("kv_lens", "kv_lens[b] >= the request's query rows", f"request {b}: {lens[b]} < {qlen[b]}")
    idx = _np(indices).astype(np.int64)
    if idx.ndim == 2:
        idx = idx[:, None, :]
    dups = 0
    st = None
    if req_to_token is not None:
        rt, ri = _np(req_to_token).astype(np.int64), _np(req_indices).astype(np.int64)
        bad = (ri < 0) | (ri >= rt.shape[0])
        if bad.any():
            c.fail("req_indices", f"rows in [0, {rt.shape[0]}) of req_to_token", ri.tolist())
        st = rt[ri]  # [B, max_context]: the rows of this batch's requests
    n_valid = 0
    for b in range(len(qlen)):
        rows = idx[cq[b]:cq[b + 1]]
        valid = (rows >= 0) & (rows < lens[b])
        n_valid += int(valid.sum())
        # valid-first: once invalid, stays invalid along the row
        bad = valid[..., 1:] & ~valid[..., :-1]
        if bad.any():
            r, h, col = (int(x[0]) for x in np.nonzero(bad))
            c.fail("indices", "valid entries first, then only invalid padding",
                   f"row {cq[b] + r} head {h}: valid entry at column {col + 1} after padding")
        r_rel = np.arange(rows.shape[0])
        visible = r_rel + 1 if kind == "ordinary" else r_rel + lens[b] - qlen[b] + 1
        count = valid.sum(-1)
        over = count > visible[:, None]
        if over.any():
            r, h = (int(x[0]) for x in np.nonzero(over))
            c.fail("indices", f"at most visible={int(visible[r])} valid entries in a row",
                   f"row {cq[b] + r} head {h} has {int(count[r, h])}")
        if flag_duplicates:
            for r in range(rows.shape[0]):
                for h in range(rows.shape[1]):
                    sel = rows[r, h][valid[r, h]]
                    dups += sel.size - np.unique(sel).size
        if st is not None:
            sel = rows[valid]
            if sel.size and (sel.max() >= st.shape[1]):
                c.fail("req_to_token", f"a column for every valid position (< {st.shape[1]})",
                       int(sel.max()))
            slots = st[b, sel] if sel.size else sel
            if pool_slots is not None and slots.size and ((slots < 0) | (slots >= pool_slots)).any():
                c.fail("req_to_token", f"slots in [0, {pool_slots}) for valid positions",
                       int(slots[(slots < 0) | (slots >= pool_slots)][0]))
    return {"rows": int(cq[-1]), "valid": n_valid, "duplicates": dups}
