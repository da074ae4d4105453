"""The one contract both implementations honour (``qsa-contract.md`` §2-5); numpy only.

Every public entry point of ``qsa_triton`` and ``qsa_pallas`` calls a ``check_*`` function here
before any launch. The checks see only ``TensorSpec`` values and host scalars, so a bad call gives
the same ``ContractError`` (argument, expected, got, the qualified envelope) from torch and jax.
Default mode: what the kernels need to be correct; ``strict=True`` adds the qualified envelope
(``QUALIFIED``) that upstream validated. Both refuse tensors that require grad (forward-only).
Device-resident values are never read here; the ``validate_*`` debug validators read them."""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import Any, Sequence

import numpy as np

from .arch import DeviceFacts
from .indices import IndexerPlan

__all__ = [
    "ContractError", "TensorSpec", "spec_of", "DecodeProblem", "PrefillProblem", "check_decode",
    "check_prefill", "check_prefill_chunk", "check_prefill_paged", "PagedDecodeProblem",
    "check_decode_paged", "Route", "route", "exact_contract", "envelope_text",
    "validate_decode_metadata", "validate_decode_paged_metadata", "validate_prefill_metadata",
    "prefill_selection", "prefill_selection_problem", "QUALIFIED",
    "QUALIFIED_INDEXER", "IndexerProblem", "check_indexer_decode", "check_indexer_prefill",
    "check_expand_block_indices", "check_indexer_plan", "validate_indexer_decode_metadata",
    "validate_indexer_prefill_metadata", "check_decode_step", "check_prefill_step",
    "check_prefill_step_rows", "FORWARD_ONLY", "DECODE_STEP_DOC", "PREFILL_STEP_DOC",
    "PREFILL_KINDS",
]

# --------------------------------------------------------------------------------------------
# The qualified envelope (qsa-contract.md §2, §3, §6).
QUALIFIED = {
    "head_pairs": ((24, 2), (12, 1), (6, 1)),
    "prefill_head_pairs": ((24, 2), (12, 1), (6, 1), (3, 1), (12, 2)),
    "head_dim": 256, "batch": (1, 128), "max_seqlen_k": 2055, "max_seqlen_q": 1,
    "dtypes": ("bfloat16", "float16"), "kv_fp8": "float8_e4m3fn", "index_width": 2051,
    "block_width": 512,  # the indexer's top-k: block_indices= columns (index_width = 4 NB + 3)
    # paged decode (§2b): R rows = up to 128 requests x 4 MTP verify rows; W index columns
    "paged_rows": (1, 512), "paged_width": (1, 2055),
}
#: the three prefill variants (qsa-contract.md §3): ``sparse_prefill``, ``_chunk``, ``_paged``
PREFILL_KINDS = ("ordinary", "chunk", "paged")
_FLOAT_DTYPES = ("bfloat16", "float16")
_FP8_DTYPES = ("float8_e4m3fn",)
_MAX_GROUP = 16
_HEAD_DIMS = (32, 64, 128, 256)


class ContractError(ValueError):
    """A call outside what the kernels compute correctly (strict mode: outside the qualified
    envelope); the message names entry point, argument, expected, got and the envelope."""

    def __init__(self, fn: str, arg: str, expected: str, got: Any, *, strict: bool = False):
        fn = str(fn)  # (a validator called with fn=None still gets its error)
        self.fn, self.arg, self.expected, self.got = fn, arg, expected, got
        mode = "strict" if strict else "default"
        env = envelope_text(fn)
        super().__init__(f"{fn}: argument '{arg}': expected {expected}; got {got}."
                         + (f" [{mode} mode] Qualified envelope: {env}" if env else ""))


def envelope_text(fn: str = "sparse_decode") -> str:
    """One-line text of the qualified envelope for an entry point ("" for a helper that is no
    attention or indexer entry point, e.g. ``replicate_kv_heads``)."""
    if fn.startswith("qsa_") and fn.endswith("_step"):  # the end-to-end step: both halves
        attention = "sparse_decode_paged" if "decode" in fn else "sparse_prefill_paged"
        return f"attention: {envelope_text(attention)}; indexer: {_indexer_envelope_text()}"
    if fn.startswith(("indexer", "expand_block")):
        return _indexer_envelope_text()
    q = QUALIFIED
    pairs = ", ".join(f"({a},{b})" for a, b in q["head_pairs"])
    if "decode_paged" in fn:
        (rlo, rhi), (wlo, whi) = q["paged_rows"], q["paged_width"]
        return (f"q bf16|fp16, pool q's dtype or fp8 e4m3, D={q['head_dim']}, (Hq,Hkv) in "
                f"{{{pairs}}}, {rlo}<=R<={rhi} rows (128 requests x "
                f"4 MTP verify rows), indices int32 [R,W] or [R,Hkv,W] with {wlo}<=W<={whi}")
    if "decode" in fn or "flash_attn" in fn:
        return (f"dtype bf16|fp16, D={q['head_dim']}, (Hq,Hkv) in {{{pairs}}}, "
                f"{q['batch'][0]}<=B<={q['batch'][1]}, 1<=max_seqlen_k<={q['max_seqlen_k']}, "
                f"max_seqlen_q=1")
    if "prefill" not in fn:
        return ""
    pairs = ", ".join(f"({a},{b})" for a, b in q["prefill_head_pairs"])
    return (f"dtype bf16|fp16 (K/V also fp8 e4m3 in chunk/paged), D={q['head_dim']}, "
            f"(Hq,Hkv) in {{{pairs}}}, indices int32 [T,W] or [T,Hkv,W] with W>=1 "
            f"(W={q['index_width']} in production), or block_indices with NB={q['block_width']} "
            f"(default mode: 1<=NB<={_INDEXER_TOPK[1]})")


#: What a PyTorch input that requires grad is refused with (both the checkers and the Triton
#: wrappers' refusal while Dynamo traces): the library is forward-only
FORWARD_ONLY = ("a tensor that does not require grad while grad mode is on (the kernels are "
                "forward-only; call them under torch.no_grad() / torch.inference_mode() or pass "
                ".detach())")


# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """Framework-free description of one tensor: ``shape``, canonical ``dtype`` name (the same
    for torch and jax), ``device`` "cpu" or "cuda" (jax's "gpu" too) and its ``index`` (None for
    tracers), element ``strides`` (None: row-major), ``requires_grad`` (torch only, and only
    while grad mode is on; refused)."""

    shape: tuple[int, ...]
    dtype: str
    device: str = "cpu"
    index: int | None = None
    strides: tuple[int, ...] | None = None
    requires_grad: bool = False

    ndim = property(lambda self: len(self.shape))
    numel = property(lambda self: math.prod(self.shape))
    # messages name CPU ordinals only where they differ (``same_device``): a torch CPU tensor has
    # none, and the same bad call must read the same in both frameworks
    where = property(lambda s: s.device if s.index is None or s.device == "cpu"
                     else f"{s.device}:{s.index}")

    def is_contiguous(self) -> bool:
        # a zero-size tensor holds nothing to address: any strides pass
        if self.strides is None or self.numel == 0:
            return True
        expected = np.cumprod((1,) + tuple(max(n, 1) for n in self.shape[:0:-1]))[::-1]
        return all(s == e or n == 1 for s, e, n in zip(self.strides, expected, self.shape))

    def __str__(self) -> str:
        return f"{self.dtype}{list(self.shape)} on {self.where}"

    @classmethod
    def from_torch(cls, t) -> "TensorSpec":
        """Spec of a torch tensor (no torch import: duck-typed)."""
        dev = t.device
        grad = bool(t.requires_grad)
        if grad:  # under torch.no_grad() / inference_mode() nothing is recorded: nothing to refuse
            torch = sys.modules.get(type(t).__module__.split(".")[0])
            grad = torch is None or bool(torch.is_grad_enabled())
        return cls(tuple(int(s) for s in t.shape), str(t.dtype).removeprefix("torch."),
                   str(dev.type), dev.index, tuple(int(s) for s in t.stride()), grad)

    @classmethod
    def from_jax(cls, a) -> "TensorSpec":
        """Spec of a jax array or tracer / ShapeDtypeStruct (no jax import: duck-typed)."""
        dtype = a.dtype.name if hasattr(a.dtype, "name") else np.dtype(a.dtype).name
        device, index = "cpu", None
        try:
            devices = a.devices() if callable(getattr(a, "devices", None)) else None
        except Exception:  # noqa: BLE001 - tracers raise; they carry no device
            devices = None
        if devices:
            d = next(iter(devices))
            device = "cuda" if d.platform in ("gpu", "cuda", "rocm") else d.platform
            # the ordinal of a committed array, CPU too (host devices of one jax process); an
            # uncommitted one follows the others (jax moves it), a torch CPU tensor reports
            # none, and ``same_device`` compares ordinals only where both sides have one
            committed = bool(getattr(a, "committed", True))
            index = int(d.id) if len(devices) == 1 and committed else None
        else:
            kinds = getattr(getattr(a, "sharding", None), "_device_assignment", None)
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
    """TensorSpec of a torch tensor, jax array / tracer, numpy array or TensorSpec; TypeError
    for anything else."""
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
    max_seqlen_q: int  # the hint, at most T (a request never has more rows than q)
    softmax_scale: float
    k_scale: float
    v_scale: float
    dtype: str
    kv_dtype: str


class _Checker:
    """The checks every entry point shares, carrying the messages' context (entry point, mode)."""

    def __init__(self, fn: str, strict: bool):
        self.fn, self.strict = fn, False
        self.host_bool("strict", strict)  # every entry point's strict, checked once
        self.strict = bool(strict)

    def fail(self, arg: str, expected: str, got: Any):
        raise ContractError(self.fn, arg, expected, got, strict=self.strict)

    def spec(self, name: str, x: Any) -> TensorSpec:
        try:
            s = spec_of(x)
        except TypeError:
            self.fail(name, "a tensor (torch.Tensor, jax.Array or numpy array)", type(x).__name__)
        if s.requires_grad:  # forward-only kernels: a backward() would fail far from the cause
            self.fail(name, FORWARD_ONLY, "requires_grad=True")
        return s

    def specs(self, **named: Any) -> list[TensorSpec]:
        """``spec`` of each argument, in order (so the first bad one is reported)."""
        return [self.spec(name, x) for name, x in named.items()]

    def rank(self, name: str, s: TensorSpec, ndim: int | tuple[int, ...], what: str):
        ok = (ndim,) if isinstance(ndim, int) else ndim
        if s.ndim not in ok:
            self.fail(name, f"a {'-or-'.join(map(str, ok))}-D tensor {what}", f"shape {list(s.shape)}")

    def dtype(self, name: str, s: TensorSpec, allowed: Sequence[str]):
        if s.dtype not in allowed:
            self.fail(name, f"dtype in {{{', '.join(allowed)}}}", s.dtype)

    def rows(self, name: str, s: TensorSpec, n: int, why: str):
        if s.shape[0] != n:
            self.fail(name, f"{n} rows ({why})", f"{s.shape[0]} rows")

    def same_device(self, name: str, s: TensorSpec, ref: TensorSpec, ref_name: str = "q"):
        if s.device != ref.device:
            self.fail(name, f"a tensor on {ref_name}'s device ({ref.where})", s.where)
        if s.index is not None and ref.index is not None and s.index != ref.index:
            self.fail(name, f"a tensor on {ref_name}'s device ({ref.device}:{ref.index})",
                      f"{s.device}:{s.index}")

    def last_dim_contiguous(self, name: str, s: TensorSpec):
        # zero-size tensors pass whatever their strides (nothing is ever addressed in them)
        if s.strides is not None and s.ndim and s.numel and s.shape[-1] > 1 and s.strides[-1] != 1:
            self.fail(name, "unit stride in the last dimension", f"strides {list(s.strides)}")

    def contiguous(self, name: str, s: TensorSpec):
        if not s.is_contiguous():
            self.fail(name, "a contiguous tensor", f"strides {list(s.strides)}")

    def metadata(self, name: str, x: Any, length: int | None, ref: TensorSpec,
                 ref_name: str = "q", note: str = "") -> TensorSpec:
        """int32 [length] (any length when None), contiguous, on ref's device; ``note`` says
        where the length comes from."""
        s = self.spec(name, x)
        self.rank(name, s, 1, "of int32 metadata")
        self.dtype(name, s, ("int32",))
        if length is not None and s.shape[0] != length:
            self.fail(name, f"length {length}{note}", f"length {s.shape[0]}")
        self.same_device(name, s, ref, ref_name)
        self.contiguous(name, s)
        return s

    def cu_seqlens(self, name: str, x: Any, ref: TensorSpec) -> int:
        """int32 [B + 1] metadata with B >= 1; returns B."""
        s = self.metadata(name, x, None, ref)
        if s.shape[0] < 2:
            self.fail(name, "length B + 1 >= 2", f"length {s.shape[0]}")
        return s.shape[0] - 1

    def table(self, name: str, s: TensorSpec, what: str, ref: TensorSpec):
        """A 2-D int32 table (``req_to_token``) on ref's device, unit last stride."""
        self.rank(name, s, 2, what)
        self.dtype(name, s, ("int32",))
        self.same_device(name, s, ref)
        self.last_dim_contiguous(name, s)

    def indices(self, name: str, s: TensorSpec, rows: int, hkv: int, ref: TensorSpec, sym: str,
                what: str, meaning: str, width: tuple[int, int | None] | None,
                col: str = "W") -> int:
        """int32 [rows, W] or [rows, Hkv, W] (``sym`` names the rows, ``col`` the columns), W in
        ``width`` (lo, hi or None) when given, on ref's device, unit last stride; returns W."""
        self.rank(name, s, (2, 3), what)
        if s.dtype != "int32":
            self.fail(name, f"dtype int32 ({meaning})", s.dtype)
        self.rows(name, s, rows, f"q's {sym}")
        if s.ndim == 3 and s.shape[1] != hkv:
            self.fail(name, f"[{sym}, Hkv={hkv}, {col}]", f"shape {list(s.shape)}")
        w = s.shape[-1]
        if width is not None and not (width[0] <= w and (width[1] is None or w <= width[1])):
            self.fail(name, f"{col} >= {width[0]} index columns" if width[1] is None else
                      f"{col} in [{width[0]}, {width[1]}] index columns", f"{col} = {w}")
        self.same_device(name, s, ref)
        self.last_dim_contiguous(name, s)
        return w

    def host_bool(self, name: str, value: Any):
        if not isinstance(value, (bool, np.bool_)):
            self.fail(name, "a host bool", type(value).__name__)

    def host_int(self, name: str, value: Any, lo: int, hi: int | None, hi_note: str = ""):
        # torch.compile hands a host int that changed between calls to the fake impls as a
        # SymInt (a host value still): range-checked symbolically, never specialised by int()
        symbolic = type(value).__name__ == "SymInt"
        if not symbolic and (isinstance(value, bool) or not isinstance(value, (int, np.integer))):
            self.fail(name, "a host int (a static upper bound, not a device value)",
                      type(value).__name__)
        value = value if symbolic else int(value)
        if value < lo or (hi is not None and value > hi):
            rng = (f"{name} >= {lo}" if hi is None else f"{name} = {lo}{hi_note}" if lo == hi
                   else f"{lo} <= {name} <= {hi}{hi_note}")
            self.fail(name, rng, value)
        return value

    def scalar(self, name: str, value: Any, default: float | None = None,
               positive: bool = True) -> float:
        if value is None and default is not None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
            self.fail(name, "a host float", type(value).__name__)
        value = float(value)
        if not math.isfinite(value) or (positive and value <= 0):
            self.fail(name, "a finite float > 0", value)
        return value

    def scales(self, qs: TensorSpec, ks: TensorSpec, softmax_scale, k_scale, v_scale, pool: bool):
        """(softmax_scale or D ** -0.5, k_scale, v_scale); the K/V scales must be 1.0 unless K/V
        (``pool``: the pool) are FP8."""
        scale = self.scalar("softmax_scale", softmax_scale, default=qs.shape[2] ** -0.5)
        ksc, vsc = self.scalar("k_scale", k_scale), self.scalar("v_scale", v_scale)
        if ks.dtype == qs.dtype and (ksc != 1.0 or vsc != 1.0):
            self.fail("k_scale", "k_scale = v_scale = 1.0 unless "
                      f"{'the pool is' if pool else 'K/V are'} float8_e4m3fn",
                      f"k_scale={ksc}, v_scale={vsc} with "
                      + (f"a {ks.dtype} pool" if pool else f"{ks.dtype} K/V"))
        return scale, ksc, vsc

    def heads(self, hq: int, hkv: int, q_name: str, kv_name: str, pairs):
        if hq < 1:
            self.fail(q_name, "at least one query head (Hq >= 1)", f"{hq} query heads")
        if hkv < 1 or hq % hkv != 0:
            self.fail(kv_name, f"a KV head count dividing the {hq} query heads of '{q_name}'",
                      f"{hkv} KV heads")
        group = hq // hkv
        if group > _MAX_GROUP:
            self.fail(q_name, f"a GQA group Hq/Hkv <= {_MAX_GROUP}", f"group {group} ({hq}/{hkv})")
        if self.strict and (hq, hkv) not in pairs:
            self.fail(q_name, f"(Hq, Hkv) in {{{', '.join(map(str, pairs))}}}", (hq, hkv))
        return group

    def q_kv(self, qs, ks, vs, k: str, v: str, q_shape: str, kv_shape: str, kv_dtypes,
             pairs: str = "head_pairs", rows: tuple[str, str, str] | None = None,
             kv_rows: tuple[int, str] | None = None):
        """q [rows, Hq, D] against K and V [*, Hkv, D], in this order: ranks, dtypes, K's head
        dim and (``kv_rows`` = (count, why)) row count against q, equal K/V shapes (so a wrong K
        is named as K), head dim, GQA group (strict: in ``QUALIFIED[pairs]``), the row count
        (``rows`` = (QUALIFIED key, what, symbol): >= 1, strict: in range), unit last strides,
        K/V on q's device. Returns (rows, Hq, D, group)."""
        self.rank("q", qs, 3, q_shape)
        self.dtype("q", qs, _FLOAT_DTYPES)
        self.rank(k, ks, 3, kv_shape)
        self.rank(v, vs, 3, kv_shape)
        if ks.dtype not in kv_dtypes:
            fp8 = [t for t in kv_dtypes if t != qs.dtype]
            self.fail(k, f"q's dtype ({qs.dtype})" + (f" or {' / '.join(fp8)}" if fp8 else ""),
                      ks.dtype)
        if vs.dtype != ks.dtype:
            self.fail(v, f"{k}'s dtype ({ks.dtype})", vs.dtype)
        n, hq, d = qs.shape
        if ks.shape[2] != d:
            self.fail(k, f"head dim {d} (q's)", ks.shape[2])
        if kv_rows is not None:
            self.rows(k, ks, *kv_rows)
        if vs.shape != ks.shape:
            self.fail(v, f"{k}'s shape {list(ks.shape)}", f"shape {list(vs.shape)}")
        self.head_dim("q", d)
        group = self.heads(hq, ks.shape[1], "q", k, QUALIFIED[pairs])
        if rows is not None:
            (lo, hi), (_, what, sym) = QUALIFIED[rows[0]], rows
            if n < 1 or (self.strict and n > hi):
                self.fail("q", f"{what} in [{lo}, {hi}]" if self.strict else f"{what} >= 1",
                          f"{sym} = {n}")
        for name, x in (("q", qs), (k, ks), (v, vs)):
            self.last_dim_contiguous(name, x)
        self.same_device(k, ks, qs)
        self.same_device(v, vs, qs)
        return n, hq, d, group

    def head_dim(self, name: str, d: int, strict_d: int | None = QUALIFIED["head_dim"]):
        if d not in _HEAD_DIMS:
            self.fail(name, f"head dim D in {_HEAD_DIMS} (a power of two 32..256)", d)
        if self.strict and strict_d is not None and d != strict_d:
            self.fail(name, f"head dim D = {strict_d}", d)


def check_decode(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_k, softmax_scale=None, *,
    max_seqlen_q: int = 1, strict: bool = False, fn: str = "sparse_decode",
    batch_invariant: bool = False,
) -> DecodeProblem:
    """Check a packed varlen decode call (``qsa-contract.md`` §2) before any launch.

    q: [B, Hq, D] bf16|fp16; k, v: [C, Hkv, D] q's dtype on q's device; cu_seqlens_q/k: int32
    [B + 1] contiguous on q's device (not read); max_seqlen_k: host int >= 1; softmax_scale: host
    float > 0 or None (D ** -0.5); max_seqlen_q: 1; batch_invariant: host bool (§2c); strict:
    also the qualified envelope; fn: the entry point named in messages. Returns DecodeProblem;
    raises ContractError (argument, expected, got, envelope).
    """
    c = _Checker(fn, strict)
    c.host_bool("batch_invariant", batch_invariant)
    qs, ks, vs, cq, ck = c.specs(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q,
                                 cu_seqlens_k=cu_seqlens_k)
    if ks.dtype == "float8_e4m3fn":  # a likely mix-up: say where FP8 K/V is taken
        c.fail("k", f"q's dtype ({qs.dtype}); FP8 e4m3 K/V is taken by sparse_decode_paged "
               "(the pool) and the chunk / paged prefill", ks.dtype)
    b, hq, d, group = c.q_kv(qs, ks, vs, "k", "v", "[B, Hq, D]", "[C, Hkv, D]", (qs.dtype,),
                             rows=("batch", "batch B", "B"))
    c.host_int("max_seqlen_q", max_seqlen_q, 1, 1, " (decode: one query row per sequence)")
    c.metadata("cu_seqlens_q", cq, b + 1, qs, note=" = B + 1 (decode: one query row per "
               f"sequence, B = q's {b} rows)")
    c.metadata("cu_seqlens_k", ck, b + 1, qs, note=" = B + 1")
    msk = c.host_int("max_seqlen_k", max_seqlen_k, 1, QUALIFIED["max_seqlen_k"] if strict else None)
    scale = c.scalar("softmax_scale", softmax_scale, default=d ** -0.5)
    return DecodeProblem(b, hq, ks.shape[1], group, d, ks.shape[0], msk, scale, qs.dtype)


def _b_from_cu_q(b: int, plus: str = "") -> str:
    """The ``note`` of a length that follows from cu_seqlens_q's: says which argument set B."""
    return (f" = B{plus} (B = {b} requests: the length of cu_seqlens_q - 1; the two lengths "
            "disagree, one of them is wrong)")


def _check_prefill(kind: str, fn: str, strict, q, k, v, indices, indices_name: str, kv_names,
                   meta, max_seqlen_q, softmax_scale, k_scale, v_scale) -> PrefillProblem:
    """The prefill checks: q/K/V, the indices, ``meta(checker, q's spec, K's spec)`` (the
    variant's metadata; returns B), then the host scalars."""
    c = _Checker(fn, strict)
    (kn, vn), ordinary = kv_names, kind == "ordinary"
    qs, ks, vs, ids = c.specs(**{"q": q, kn: k, vn: v, indices_name: indices})
    t, _, _, group = c.q_kv(qs, ks, vs, kn, vn, "[T, Hq, D]", "[rows, Hkv, D]",
                            (qs.dtype,) + (() if ordinary else _FP8_DTYPES),
                            pairs="prefill_head_pairs",
                            kv_rows=(qs.shape[0], "packed like q") if ordinary else None)
    what = ("request-relative token positions, invalid entries negative or >= len"
            if indices_name == "indices" else "row-relative block ids, invalid ids negative or >= "
            "the row's visible blocks")
    col = "W" if indices_name == "indices" else "NB"
    w = c.indices(indices_name, ids, t, ks.shape[1], qs, "T", f"[T, {col}] or [T, Hkv, {col}]",
                  what, (1, None), col)
    if indices_name == "block_indices":  # the indexer's top-k block ids, not a token row
        nb = QUALIFIED["block_width"]
        if (w != nb) if c.strict else w > _INDEXER_TOPK[1]:
            c.fail("block_indices", f"NB = {nb} block ids a row (the indexer's top-{nb})"
                   if c.strict else f"NB <= {_INDEXER_TOPK[1]} block ids a row (the indexer's "
                   "top-k; token indices go in indices=)", f"NB = {w}")
    b = meta(c, qs, ks)
    # a grid-size hint: no request has more rows than q, so both backends plan with min(hint, T)
    msq = max(1, min(c.host_int("max_seqlen_q", max_seqlen_q, 1, None), t))
    scale, ksc, vsc = c.scales(qs, ks, softmax_scale, k_scale, v_scale, pool=False)
    return PrefillProblem(kind, t, b, qs.shape[1], ks.shape[1], group, qs.shape[2], w,
                          ids.ndim == 3, msq, scale, ksc, vsc, qs.dtype, ks.dtype)


def check_prefill(q, k, v, indices, cu_seqlens, max_seqlen_q, softmax_scale=None, *,
                  strict: bool = False, fn: str = "sparse_prefill",
                  indices_name: str = "indices") -> PrefillProblem:
    """Check an ordinary sparse prefill call (``qsa-contract.md`` §3) before any launch.

    q: [T, Hq, D] bf16|fp16; k, v: [T, Hkv, D] packed like q, q's dtype; indices: int32 [T, W]
    or [T, Hkv, W] request-relative positions; cu_seqlens: int32 [B + 1] on q's device;
    max_seqlen_q: host int >= 1; softmax_scale: host float > 0 or None (D ** -0.5);
    indices_name: "block_indices" when ``indices`` holds the indexer's block ids. Returns
    PrefillProblem; raises ContractError (argument, expected, got, envelope).
    """
    def meta(c, qs, _):  # k's rows: checked with q (q_kv's kv_rows)
        return c.cu_seqlens("cu_seqlens", cu_seqlens, qs)

    return _check_prefill("ordinary", fn, strict, q, k, v, indices, indices_name, ("k", "v"), meta,
                          max_seqlen_q, softmax_scale, 1.0, 1.0)


def check_prefill_chunk(q, k, v, indices, cu_seqlens_q, cu_seqlens_k, kv_lens, max_seqlen_q,
                        softmax_scale=None, k_scale=1.0, v_scale=1.0, *, strict: bool = False,
                        fn: str = "sparse_prefill_chunk",
                        indices_name: str = "indices") -> PrefillProblem:
    """Check a chunk sparse prefill call (``qsa-contract.md`` §3) before any launch.

    k, v: [Ck, Hkv, D] each request's context packed, q's dtype or float8_e4m3fn; k_scale,
    v_scale: host floats > 0, 1.0 unless FP8; cu_seqlens_q, cu_seqlens_k: int32 [B + 1];
    kv_lens: int32 [B]; the rest as ``check_prefill``. Returns PrefillProblem; raises
    ContractError (argument, expected, got, envelope).
    """
    def meta(c, qs, _):
        c.specs(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, kv_lens=kv_lens)
        b = c.cu_seqlens("cu_seqlens_q", cu_seqlens_q, qs)
        c.metadata("cu_seqlens_k", cu_seqlens_k, b + 1, qs, note=_b_from_cu_q(b, " + 1"))
        c.metadata("kv_lens", kv_lens, b, qs, note=_b_from_cu_q(b))
        return b

    return _check_prefill("chunk", fn, strict, q, k, v, indices, indices_name, ("k", "v"), meta,
                          max_seqlen_q, softmax_scale, k_scale, v_scale)


def check_prefill_paged(q, k_cache, v_cache, req_to_token, req_indices, indices, cu_seqlens_q,
                        kv_lens, max_seqlen_q, softmax_scale=None, k_scale=1.0, v_scale=1.0, *,
                        strict: bool = False, fn: str = "sparse_prefill_paged",
                        indices_name: str = "indices") -> PrefillProblem:
    """Check a paged sparse prefill call (``qsa-contract.md`` §3) before any launch.

    k_cache, v_cache: [slots, Hkv, D] the pool, q's dtype or FP8; req_to_token: int32
    [max_reqs, max_context] position -> slot; req_indices: int32 [B]; the rest as
    ``check_prefill_chunk``. Returns PrefillProblem; raises ContractError (argument, expected,
    got, envelope).
    """
    def meta(c, qs, _):
        c.specs(cu_seqlens_q=cu_seqlens_q, kv_lens=kv_lens)
        b = c.cu_seqlens("cu_seqlens_q", cu_seqlens_q, qs)
        c.metadata("kv_lens", kv_lens, b, qs, note=_b_from_cu_q(b))
        c.metadata("req_indices", req_indices, b, qs, note=_b_from_cu_q(b))
        c.table("req_to_token", c.spec("req_to_token", req_to_token),
                "[max_reqs, max_context] of int32 pool slots", qs)
        return b

    return _check_prefill("paged", fn, strict, q, k_cache, v_cache, indices, indices_name,
                          ("k_cache", "v_cache"), meta, max_seqlen_q, softmax_scale, k_scale,
                          v_scale)


def prefill_selection_problem(indices, block_indices, overlap) -> tuple[str, str, Any] | None:
    """``prefill_selection``'s refusal as (argument, expected, got), or None, without raising
    (a wrapper traced by torch.compile cannot raise; it hands the refusal to an op)."""
    if (indices is None) == (block_indices is None):
        return ("indices", "token indices, or indices=None and block_indices= (exactly one "
                "selection)", "both" if indices is not None else "neither")
    if overlap is None:
        return None
    if block_indices is None:
        return "overlap", "None unless block_indices= is given", overlap
    if isinstance(overlap, bool) or not isinstance(overlap, (int, float, np.floating, np.integer)):
        return ("overlap", "None or a host float in [0, 1]",
                f"{overlap!r} ({type(overlap).__name__})")
    # float(): a plain number under torch.compile too (a symbolic float, once a compiled call has
    # seen two values, cannot be formatted while tracing; the hint is a host routing choice)
    value = float(overlap)
    if not 0.0 <= value <= 1.0:
        return "overlap", "None or a host float in [0, 1]", f"{value!r} ({type(overlap).__name__})"
    return None


def prefill_selection(fn: str, indices, block_indices, overlap) -> tuple[str, Any, float | None]:
    """Which selection a prefill call passes: token ``indices``, or ``indices=None`` with
    ``block_indices=``; ``overlap`` (None or a host float in [0, 1]) only with the latter.
    Returns ("indices" | "block_indices", the selection, overlap or None); raises ContractError
    for both or neither selection, or a bad ``overlap`` (``prefill_selection_problem``)."""
    problem = prefill_selection_problem(indices, block_indices, overlap)
    if problem is not None:
        raise ContractError(fn, *problem)
    if block_indices is None:
        return "indices", indices, None
    return "block_indices", block_indices, None if overlap is None else float(overlap)


# --------------------------------------------------------------------------------------------
# Arch routing (qsa-contract.md §5).
@dataclasses.dataclass(frozen=True)
class Route:
    """Kernel family and geometry source of one (device, op): ``op``, ``kernel``, ``geometry``
    (a table name or "decode-heuristic"), ``exact_contract`` (only the strict envelope may run)
    and a human-readable ``reason``."""

    op: str
    kernel: str
    geometry: str
    exact_contract: bool
    reason: str


def route(facts: DeviceFacts, op: str) -> Route:
    """Routing per arch (``qsa-contract.md`` §5): sm_121 decode the exact (strict) contract only
    (upstream gates its kernel on exact (12, 1)); sm_120 prefill upstream's tuned family on the
    188-SM part only, else the L20 table; H20 its table; sm_90 our measured table; anything else
    the L20 table. Raises ValueError for an unknown op."""
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
                         "sm_120 188-SM part: upstream tuned family within its gates, "
                         "else L20 table")
        return Route(op, kernel, "l20-table", False,
                     f"sm_120 with {facts.sm_count} SMs: tuned family is qualified on 188 SMs only")
    return Route(op, kernel, "l20-table", False, f"{facts.arch}: upstream's default (L20) table")


def exact_contract(facts: DeviceFacts | None, op: str = "decode") -> bool:
    """True where ``route`` sends ``op`` on this device to the exact contract only (sm_121
    decode): the entry point must check with ``strict=True``. ``facts`` None is never exact."""
    return facts is not None and route(facts, op).exact_contract


# --------------------------------------------------------------------------------------------
# Debug validators: read device metadata on the host (a sync), off the hot path.
def _np(x) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x
    if type(x).__module__.startswith("torch"):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _ints(c: "_Checker", name: str, x, ndim: int | tuple[int, ...] | None = None) -> np.ndarray:
    """``x`` (torch / jax / numpy) as int64 numpy, refusing a non-integer array (a float or bool
    tensor passed by mistake would otherwise be truncated silently), another rank than ``ndim``
    and values outside int32 (the entry points' dtype)."""
    dt = getattr(x, "dtype", None)
    if type(x).__module__.startswith("torch") and (
            dt.is_floating_point or dt.is_complex or str(dt) == "torch.bool"):
        c.fail(name, "an integer array (the entry points take int32)", f"dtype {dt}")
    a = _np(x)
    if a.dtype.kind not in "iu":
        c.fail(name, "an integer array (the entry points take int32)", f"dtype {a.dtype}")
    ranks = (ndim,) if isinstance(ndim, int) else ndim
    if ranks is not None and a.ndim not in ranks:
        c.fail(name, f"a {' or '.join(map(str, ranks))}-D array", f"shape {list(a.shape)}")
    if a.size and (int(a.min()) < -2**31 or int(a.max()) > 2**31 - 1):
        c.fail(name, "int32 values (the entry points' dtype)",
               f"values in [{int(a.min())}, {int(a.max())}]")
    return a.astype(np.int64)


def validate_decode_metadata(cu_seqlens_q, cu_seqlens_k, capacity: int, max_seqlen_k: int, *,
                             batch: int | None = None, fn: str = "sparse_decode") -> None:
    """Check decode metadata contents (host sync; debug only): ``cu_seqlens_q/k`` integer arrays
    (torch / jax / numpy), ``capacity`` = k's rows and ``max_seqlen_k`` host ints, ``batch``: q's
    rows B (None: the sequences cu_seqlens_k describes). Raises ContractError: a non-integer
    array or a non-int bound, cu_seqlens of different lengths or not B + 1 long, not starting at
    0 or decreasing, a row longer than max_seqlen_k, rows past the K/V capacity, query rows out
    of range."""
    c = _Checker(fn, False)
    capacity = c.host_int("capacity", capacity, 0, None)
    max_seqlen_k = c.host_int("max_seqlen_k", max_seqlen_k, 1, None)
    cq, ck = (_ints(c, n, x, 1) for n, x in (("cu_seqlens_q", cu_seqlens_q),
                                             ("cu_seqlens_k", cu_seqlens_k)))
    if batch is None:
        if ck.size < 2:
            c.fail("cu_seqlens_k", "B + 1 >= 2 entries (B >= 1 sequences)", ck.size)
        batch = ck.size - 1
    else:
        batch = c.host_int("batch", batch, 1, None)
        if ck.size != batch + 1:
            c.fail("cu_seqlens_k", f"B + 1 = {batch + 1} entries", ck.size)
    if cq.size != batch + 1:
        c.fail("cu_seqlens_q", f"B + 1 = {batch + 1} entries (as long as cu_seqlens_k)",
               f"shape {list(cq.shape)}")
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
    if cq.size and (cq[:-1] >= batch).any():
        c.fail("cu_seqlens_q", f"query rows < {batch}", cq.tolist())


def validate_decode_paged_metadata(req_to_token, req_indices, indices, seq_lens,
                                   pool_slots: int, *, fn: str = "sparse_decode_paged") -> dict:
    """Check paged-decode metadata contents (host sync; debug only). The kernels skip entries
    that break the addressing (``qsa-contract.md`` §7), so such a caller bug shows only as fewer
    keys attended; this makes it loud.

    req_to_token: int [max_reqs, max_context]; req_indices, seq_lens: int [R]; indices: int
    [R, W] or [R, Hkv, W] (torch / jax / numpy), or None for ``qsa_decode_step`` (whose indexer
    may select any position: every position < seq_lens[r] is checked); pool_slots:
    ``k_cache.shape[0]``. Returns {"rows": R, "valid": entries with ``0 <= idx <
    seq_lens[r]``}. Raises ContractError naming
    the first row with ``req_indices[r]`` outside ``[0, max_reqs)`` (empty rows excepted),
    ``seq_lens[r] > max_context``, or a valid entry's slot outside ``[0, pool_slots)``.
    """
    c = _Checker(fn, False)
    pool_slots = c.host_int("pool_slots", pool_slots, 0, None)
    rt = _ints(c, "req_to_token", req_to_token, 2)
    sl = _ints(c, "seq_lens", seq_lens, 1)
    # indices None: each row's positions 0 .. seq_lens[r] - 1, made per row once seq_lens is
    # known to fit the table (a garbage length must not allocate its range)
    idx = (np.zeros((sl.size, 1), np.int64) if indices is None
           else _ints(c, "indices", indices, (2, 3)))
    rows = idx.shape[0]  # R = 0 (an idle batch) has nothing to check
    ri = _ints(c, "req_indices", req_indices, 1)
    for name, a in (("req_indices", ri), ("seq_lens", sl)):
        if a.size != rows:
            c.fail(name, f"[R] with R = {rows} (the rows of indices)", f"shape {list(a.shape)}")
    max_reqs, max_ctx = rt.shape
    live = sl > 0
    bad = live & ((ri < 0) | (ri >= max_reqs))
    if bad.any():
        r = int(np.argmax(bad))
        c.fail("req_indices", f"rows in [0, {max_reqs}) of req_to_token", f"row {r}: {int(ri[r])}")
    over = sl > max_ctx
    if over.any():
        r = int(np.argmax(over))
        c.fail("seq_lens", f"seq_lens[r] <= max_context = {max_ctx} (req_to_token's width)",
               f"row {r}: {int(sl[r])}")
    flat = idx.reshape(idx.shape[0], int(np.prod(idx.shape[1:])))
    n_valid = 0
    for r in np.nonzero(live)[0]:
        sel = (np.arange(sl[r]) if indices is None
               else flat[r][(flat[r] >= 0) & (flat[r] < sl[r])])
        n_valid += int(sel.size)
        slots = rt[ri[r], sel]
        out = (slots < 0) | (slots >= int(pool_slots))
        if out.any():
            j = int(np.argmax(out))
            c.fail("req_to_token", f"slots in [0, {int(pool_slots)}) for every valid position",
                   f"row {int(r)} (table row {int(ri[r])}), position {int(sel[j])}: slot "
                   f"{int(slots[j])}")
    return {"rows": int(sl.size), "valid": n_valid}


def validate_prefill_metadata(indices, cu_seqlens_q, kv_lens, kind: str, *, cu_seqlens_k=None,
                              req_to_token=None, req_indices=None, pool_slots: int | None = None,
                              flag_duplicates: bool = False, fn: str | None = None) -> dict:
    """Check prefill metadata contents (host sync; debug only). ``kv_lens``: the validity bound
    per request (None for ``kind="ordinary"``: the request length; required for chunk / paged);
    ``cu_seqlens_k`` (chunk): the requests' K/V row ranges; ``fn``: the entry point errors name
    (None: ``sparse_prefill`` / ``sparse_prefill_chunk`` / ``sparse_prefill_paged`` by
    ``kind``). Checks the ranks and int32 values of every array, cu_seqlens_q
    (starts at 0, non-decreasing, ends at or before the T rows of ``indices``), one length per
    request, ``kv_lens[b]`` within the request's ``cu_seqlens_k`` range, valid entries first, at
    most the row's visible tokens valid, and (``req_to_token`` given) table rows, columns and
    slots in range. Returns {"rows", "valid", "duplicates"} counts; raises ContractError naming
    the first violation's row and column."""
    if kind not in PREFILL_KINDS:
        raise ContractError(fn or "validate_prefill_metadata", "kind",
                            f"one of {', '.join(map(repr, PREFILL_KINDS))}", kind)
    if fn is None:
        fn = "sparse_prefill" if kind == "ordinary" else f"sparse_prefill_{kind}"
    c = _Checker(fn, False)
    if pool_slots is not None:
        pool_slots = c.host_int("pool_slots", pool_slots, 0, None)
    if req_to_token is None and (req_indices is not None or pool_slots is not None):
        c.fail("req_to_token", "the table whenever req_indices or pool_slots is given",
               "None")
    if (kv_lens is None) != (kind == "ordinary"):
        c.fail("kv_lens", "None for kind='ordinary' (a request sees its own rows), else one "
               "length per request", "None" if kv_lens is None else "an array")
    cq = _ints(c, "cu_seqlens_q", cu_seqlens_q, 1)
    idx = _ints(c, "indices", indices, (2, 3))
    if cq.size < 1 or cq[0] != 0 or (np.diff(cq) < 0).any():  # (1-D: _ints)
        c.fail("cu_seqlens_q", "cu[0] == 0 and non-decreasing values", cq.tolist())
    if cq[-1] > idx.shape[0]:
        c.fail("cu_seqlens_q", f"cu_seqlens_q[B] <= T = {idx.shape[0]} (the rows of indices)",
               int(cq[-1]))
    qlen = np.diff(cq)
    lens = qlen if kv_lens is None else _ints(c, "kv_lens", kv_lens, 1)
    if lens.shape != qlen.shape:
        c.fail("kv_lens", f"one length per request ({qlen.size})", f"shape {list(lens.shape)}")
    if kind != "ordinary" and (lens < qlen).any():
        b = int(np.argmax(lens < qlen))
        c.fail("kv_lens", "kv_lens[b] >= the request's query rows",
               f"request {b}: {lens[b]} < {qlen[b]}")
    if cu_seqlens_k is not None:
        ck = _ints(c, "cu_seqlens_k", cu_seqlens_k, 1)
        if ck.shape != cq.shape or ck[0] != 0 or (np.diff(ck) < 0).any():
            c.fail("cu_seqlens_k", f"B + 1 = {cq.size} non-decreasing values from 0",
                   ck.tolist())
        over = lens > np.diff(ck)
        if over.any():
            b = int(np.argmax(over))
            c.fail("kv_lens", "kv_lens[b] <= cu_seqlens_k[b + 1] - cu_seqlens_k[b] (the "
                   "request's K/V rows)", f"request {b}: {lens[b]} > {int(ck[b + 1] - ck[b])}")
    if idx.ndim == 2:
        idx = idx[:, None, :]
    dups = 0
    st = None
    if req_to_token is not None:
        rt = _ints(c, "req_to_token", req_to_token, 2)
        ri = _ints(c, "req_indices", req_indices, 1)
        if ri.size != qlen.size:
            c.fail("req_indices", f"one table row per request ({qlen.size})",
                   f"shape {list(ri.shape)}")
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


# --------------------------------------------------------------------------------------------
# Paged decode (qsa-contract.md §2b, §2c).
@dataclasses.dataclass(frozen=True)
class PagedDecodeProblem:
    """What a paged decode call resolved to (host ints and the resolved scales)."""

    rows: int  # R
    num_q_heads: int
    num_kv_heads: int
    group: int
    head_dim: int
    slots: int  # pool slots
    max_reqs: int
    max_context: int
    width: int  # W
    per_head_indices: bool  # indices [R, Hkv, W]
    softmax_scale: float
    k_scale: float
    v_scale: float
    dtype: str
    kv_dtype: str
    batch_invariant: bool


def check_decode_paged(q, k_cache, v_cache, req_to_token, req_indices, indices, seq_lens,
                       softmax_scale=None, k_scale=1.0, v_scale=1.0, *,
                       batch_invariant: bool = False, strict: bool = False,
                       fn: str = "sparse_decode_paged") -> PagedDecodeProblem:
    """Check a paged decode call (``qsa-contract.md`` §2b) before any launch.

    q: [R, Hq, D] bf16|fp16; k_cache, v_cache: [slots, Hkv, D] (slots may be 0), q's dtype or
    float8_e4m3fn; req_to_token: int32 [max_reqs, max_context]; req_indices, seq_lens: int32 [R];
    indices: int32 [R, W] or [R, Hkv, W] (W >= 1); all on q's device, unit last stride, not
    read. softmax_scale, k_scale, v_scale: as ``check_prefill_chunk``; batch_invariant, strict:
    host bools (strict: ``envelope_text``). Returns PagedDecodeProblem; raises ContractError
    (argument, expected, got, envelope).
    """
    c = _Checker(fn, strict)
    qs, ks, vs, rt, ri, ids, sl = c.specs(
        q=q, k_cache=k_cache, v_cache=v_cache, req_to_token=req_to_token, req_indices=req_indices,
        indices=indices, seq_lens=seq_lens)
    c.host_bool("batch_invariant", batch_invariant)
    r, hq, d, group = c.q_kv(qs, ks, vs, "k_cache", "v_cache", "[R, Hq, D]", "[slots, Hkv, D]",
                             (qs.dtype,) + _FP8_DTYPES,
                             rows=("paged_rows", "R query rows", "R"))
    c.table("req_to_token", rt, "[max_reqs, max_context] of int32 pool slots", qs)
    c.metadata("req_indices", ri, r, qs)
    c.metadata("seq_lens", sl, r, qs)
    w = c.indices("indices", ids, r, ks.shape[1], qs, "R",
                  "[R, W] or [R, Hkv, W] of int32 logical positions",
                  "logical positions; invalid entries negative or >= seq_lens[r]",
                  QUALIFIED["paged_width"] if strict else (1, None))
    scale, ksc, vsc = c.scales(qs, ks, softmax_scale, k_scale, v_scale, pool=True)
    return PagedDecodeProblem(r, hq, ks.shape[1], group, d, ks.shape[0], rt.shape[0], rt.shape[1],
                              w, ids.ndim == 3, scale, ksc, vsc, qs.dtype, ks.dtype,
                              bool(batch_invariant))


# --------------------------------------------------------------------------------------------
# The indexer (qsa-contract.md §4b): scoring + exact top-k, and the block expansion (§4).
QUALIFIED_INDEXER = {
    "heads": 4, "head_dim": 128, "topk": 512, "compress_ratio": 4, "page_size": 16,
    "dtypes": ("bfloat16", "float16"), "k_fp8": "float8_e4m3fn", "batch": (1, 128),
}
_INDEXER_Q_DTYPES = ("bfloat16", "float16", "float8_e4m3fn")
_INDEXER_MAX_HEADS = 16
_INDEXER_TOPK = (16, 2048)


def _indexer_envelope_text() -> str:
    q = QUALIFIED_INDEXER
    return (f"indexer q [rows, {q['heads']}, {q['head_dim']}] bf16|fp16 (or fp8 e4m3 with fp8 "
            f"keys), compressed keys bf16|fp16|fp8 e4m3 [.., 1, {q['head_dim']}], topk={q['topk']}, "
            f"compress_ratio={q['compress_ratio']}, decode page size {q['page_size']}, "
            f"{q['batch'][0]}<=B<={q['batch'][1]} decode rows; expansion width "
            f"topk*ratio+ratio-1 = {q['topk'] * q['compress_ratio'] + q['compress_ratio'] - 1}")


@dataclasses.dataclass(frozen=True)
class IndexerProblem:
    """What an indexer call resolved to: ``max_blocks`` bounds a row's visible blocks (decode:
    max_pages * page_size; prefill: N); ``pages``, ``page_size`` are 0 for prefill;
    ``compute_dtype`` is the dots' (bf16 for FP8 q: e4m3 values are exact in bf16)."""

    kind: str
    rows: int
    heads: int
    head_dim: int
    max_blocks: int
    pages: int
    page_size: int
    topk: int
    compress_ratio: int
    dtype: str
    k_dtype: str
    compute_dtype: str

    @property
    def width(self) -> int:
        """Expanded token row width: topk * ratio + ratio - 1 (2051)."""
        return self.topk * self.compress_ratio + self.compress_ratio - 1


def _indexer_common(c: _Checker, q, k, k_name: str, k_rank: int, k_what: str, topk, ratio):
    qs, ks = c.specs(**{"q": q, k_name: k})
    c.rank("q", qs, 3, "[rows, heads, head_dim] (the indexer query)")
    c.dtype("q", qs, _INDEXER_Q_DTYPES)
    c.rank(k_name, ks, k_rank, k_what)
    allowed = ("float8_e4m3fn",) if qs.dtype == "float8_e4m3fn" else (qs.dtype, "float8_e4m3fn")
    c.dtype(k_name, ks, allowed)
    rows, heads, d = qs.shape
    if not 1 <= heads <= _INDEXER_MAX_HEADS:
        c.fail("q", f"1 <= indexer heads <= {_INDEXER_MAX_HEADS}", heads)
    c.head_dim("q", d, strict_d=None)  # the indexer's strict D is checked below, not attention's
    if ks.shape[-2] != 1:
        c.fail(k_name, "one compressed-key head (shape[-2] == 1: the indexer is MQA)",
               f"shape {list(ks.shape)}")
    if ks.shape[-1] != d:
        c.fail(k_name, f"head dim {d} (q's)", ks.shape[-1])
    c.last_dim_contiguous("q", qs)
    c.contiguous(k_name, ks)
    c.same_device(k_name, ks, qs)
    lo, hi = _INDEXER_TOPK
    host = not isinstance(topk, bool) and isinstance(topk, (int, np.integer))
    if not host or not lo <= int(topk) <= hi or int(topk) & (int(topk) - 1):
        c.fail("topk", f"a host int, a power of two in [{lo}, {hi}]",
               topk if host else f"{type(topk).__name__} {topk!r}")
    r = c.host_int("compress_ratio", ratio, 2, 16)
    q8 = QUALIFIED_INDEXER
    if c.strict:
        if heads != q8["heads"] or d != q8["head_dim"]:
            c.fail("q", f"[rows, {q8['heads']}, {q8['head_dim']}]", f"shape {list(qs.shape)}")
        if int(topk) != q8["topk"]:
            c.fail("topk", f"{q8['topk']}", topk)
        if r != q8["compress_ratio"]:
            c.fail("compress_ratio", f"{q8['compress_ratio']}", r)
    compute = "bfloat16" if qs.dtype == "float8_e4m3fn" else qs.dtype
    return qs, ks, rows, heads, d, int(topk), r, compute


def check_indexer_decode(q, k_cache, page_table, seq_lens, *, topk: int = 512,
                         compress_ratio: int = 4, strict: bool = False,
                         fn: str = "indexer_topk_decode") -> IndexerProblem:
    """Check a decode indexer call (``qsa-contract.md`` §4b) before any launch.

    q: [B, H, D] bf16|fp16|fp8 e4m3 (H <= 16, D a power of two 32..256); k_cache: [pages,
    page_size, 1, D] contiguous, q's dtype or FP8 (FP8 q needs FP8 keys); page_table: int32
    [B, max_pages >= 1]; seq_lens: int32 [B] (not read); topk: a power of two 16..2048;
    compress_ratio: 2..16; strict: ``QUALIFIED_INDEXER``. Returns IndexerProblem; raises
    ContractError (argument, expected, got, envelope).
    """
    c = _Checker(fn, strict)
    qs, ks, b, heads, d, k, r, compute = _indexer_common(
        c, q, k_cache, "k_cache", 4, "[pages, page_size, 1, head_dim] (the paged compressed keys)",
        topk, compress_ratio)
    lo, hi = QUALIFIED_INDEXER["batch"]
    if b < 1 or (strict and b > hi):
        c.fail("q", f"rows B in [{lo}, {hi}]" if strict else "rows B >= 1", f"B = {b}")
    pages, psz = ks.shape[0], ks.shape[1]
    if psz < 1:
        c.fail("k_cache", "page_size >= 1", psz)
    if strict and psz != QUALIFIED_INDEXER["page_size"]:
        c.fail("k_cache", f"page_size {QUALIFIED_INDEXER['page_size']}", psz)
    pt, sl = c.specs(page_table=page_table, seq_lens=seq_lens)
    c.rank("page_table", pt, 2, "[B, max_pages] of int32 page ids")
    c.dtype("page_table", pt, ("int32",))
    c.rows("page_table", pt, b, "one per query row")
    if pt.shape[1] < 1:
        c.fail("page_table", "max_pages >= 1", pt.shape[1])
    c.same_device("page_table", pt, qs)
    c.last_dim_contiguous("page_table", pt)
    c.metadata("seq_lens", sl, b, qs)
    return IndexerProblem("decode", b, heads, d, pt.shape[1] * psz, pages, psz, k, r, qs.dtype,
                          ks.dtype, compute)
def check_indexer_plan(fn: str, prob: IndexerProblem, plan, default_plan) -> None:
    """Raise ContractError unless the indexer plan can run ``prob`` (``IndexerPlan.problem``):
    argument ``plan`` for a caller's plan, else ``page_table`` / ``k`` for a context past what
    ``default_plan()`` (called only when ``plan`` is None) covers."""
    if plan is not None and not isinstance(plan, IndexerPlan):
        raise ContractError(fn, "plan", "None or an interop.indices.IndexerPlan (plan_indexer / "
                            "indexer_plan_for)", type(plan).__name__)
    arg, own = ("plan", plan) if plan is not None else (
        "page_table" if prob.kind == "decode" else "k", default_plan())
    why = own.problem(prob.kind, prob.max_blocks, prob.topk)
    if why:  # a custom plan that cannot run this call, or a context past what any plan covers
        expected, _, have = why.partition(", got ")  # problem(): "<expected>, got <value>"
        where = repr(plan) if plan is not None else f"{prob.max_blocks} blocks a row"
        raise ContractError(fn, arg, expected, f"{have} in {where}" if have else where)


def check_indexer_prefill(q, k, row_starts, row_ends, *, topk: int = 512, compress_ratio: int = 4,
                          positions=None, seq_lens=None, strict: bool = False,
                          fn: str = "indexer_topk_prefill") -> IndexerProblem:
    """Check a prefill indexer call (``qsa-contract.md`` §4b) before any launch.

    q: [T, H, D] as ``check_indexer_decode`` (T >= 0); k: [N, 1, D] contiguous packed keys, q's
    dtype or FP8; row_starts, row_ends: int32 [T] (row m scores keys [start, end)); positions,
    seq_lens: int32 [T] or None (the fused expansion's); metadata on q's device, not read.
    Returns IndexerProblem; raises ContractError (argument, expected, got, envelope).
    """
    c = _Checker(fn, strict)
    qs, ks, t, heads, d, kk, r, compute = _indexer_common(
        c, q, k, "k", 3, "[N, 1, head_dim] (packed compressed keys)", topk, compress_ratio)
    for name, x in (("row_starts", row_starts), ("row_ends", row_ends), ("positions", positions),
                    ("seq_lens", seq_lens)):
        if x is not None or name in ("row_starts", "row_ends"):
            c.metadata(name, x, t, qs)
    return IndexerProblem("prefill", t, heads, d, ks.shape[0], 0, 0, kk, r, qs.dtype, ks.dtype,
                          compute)


def check_expand_block_indices(block_ids, positions, seq_lens, *, compress_ratio: int = 4,
                               strict: bool = False, fn: str = "expand_block_indices") -> int:
    """Check a block-expansion call (``qsa-contract.md`` §4) before any launch: ``block_ids``
    int32 [M, topk] contiguous; ``positions``, ``seq_lens`` int32 [M] on its device;
    ``compress_ratio`` 2..16 (strict: 4, topk 512). Returns the width ``topk * ratio + ratio -
    1``; raises ContractError (argument, expected, got, envelope)."""
    c = _Checker(fn, strict)
    bs = c.spec("block_ids", block_ids)
    c.rank("block_ids", bs, 2, "[M, topk] of int32 block ids")
    c.dtype("block_ids", bs, ("int32",))
    c.contiguous("block_ids", bs)
    m, k = bs.shape
    if not 1 <= k <= _INDEXER_TOPK[1]:
        c.fail("block_ids", f"1 <= topk <= {_INDEXER_TOPK[1]} columns", k)
    r = c.host_int("compress_ratio", compress_ratio, 2, 16)
    if strict and (k != QUALIFIED_INDEXER["topk"] or r != QUALIFIED_INDEXER["compress_ratio"]):
        c.fail("block_ids", f"[M, {QUALIFIED_INDEXER['topk']}] with compress_ratio "
               f"{QUALIFIED_INDEXER['compress_ratio']}", f"[M, {k}] with ratio {r}")
    c.metadata("positions", positions, m, bs, "block_ids")
    c.metadata("seq_lens", seq_lens, m, bs, "block_ids")
    return k * r + r - 1


# --------------------------------------------------------------------------------------------
# The end-to-end step (indexer -> expansion -> paged attention) as both packages document it
# (substituted for ``STEP_DOC`` in their docstrings).
DECODE_STEP_DOC = """``sparse_decode_paged``'s arguments with its ``indices`` replaced by the
    indexer's inputs (``index_q``, ``index_k_cache``, ``index_page_table``), same order and
    meaning in ``qsa_triton`` and ``qsa_pallas``. Row r is one decode query (MTP verify rows are rows too) of
    request ``req_indices[r]`` with ``seq_lens[r]`` tokens of context, its own token included.

    Args:
      q: [R, Hq, D] bfloat16|float16, the attention query rows (R >= 1).
      k_cache, v_cache: [slots, Hkv, D] the KV pool, q's dtype or float8_e4m3fn (then
        ``k_scale`` multiplies the FP32 scores and ``v_scale`` the P·V result).
      req_to_token: int32 [max_reqs, max_context], token position -> pool slot (SGLang's table).
      req_indices: int32 [R], the table row of each query row's request.
      index_q: [R, H, Di] bfloat16|float16|float8_e4m3fn, the indexer query (H = 4, Di = 128 in
        the model: rotated, weight-free scoring), contiguous last dim.
      index_k_cache: [pages, P, 1, Di] contiguous paged compressed keys (one per block of
        ``compress_ratio`` tokens: mean of 4 keys, normed, rotated; P = 16 blocks = one 64-token
        KV page), index_q's dtype or float8_e4m3fn.
      index_page_table: int32 [R, max_pages]; block n of row r lives at
        ``index_k_cache[index_page_table[r, n // P], n % P, 0]``; entries past the row's
        ``floor(seq_lens[r] / compress_ratio)`` blocks are never read.
      seq_lens: int32 [R] tokens of context per row (positions ``0 .. seq_lens[r] - 1``; the
        row's own position is ``seq_lens[r] - 1``).
      softmax_scale: host float > 0 (applied to FP32 scores), default D ** -0.5.
      k_scale, v_scale: host floats > 0, 1.0 unless the pool is FP8.
      topk: blocks kept per row, a host int, a power of two in [16, 2048] (512);
        compress_ratio: tokens per block, a host int in [2, 16] (4). The attention then reads
        ``topk * ratio + ratio - 1`` (2051) index columns per row.
      batch_invariant: a row's output bits depend only on its own inputs (``qsa-contract.md``
        §2c; the indexer is row-local anyway).
      strict: the qualified envelopes of both halves; the attention's is always on for a GPU
        that ``interop.contract.route`` sends to the exact contract (sm_121).
      interpret (``qsa_pallas`` only): None -> Pallas interpret mode on a CPU backend, the
        compiled kernels on a GPU.

    Returns:
      [R, Hq, D] in q's dtype: ``softmax(scale · k_scale · q[r, h] · Kᵀ) · V · v_scale`` over
      the tokens the indexer selected for row r (KV head h // G); exact zeros for a row with no
      context (``seq_lens[r] <= 0``). Equal to ``interop.reference.decode_step_reference``
      within the attention tolerance.

    Source: upstream's QSA decode path (``sglang/srt/layers/attention/qsa/``: ``mqa.py``
    scoring, ``kernel.py`` top-k and expansion, the compaction + decode it feeds), computed
    here as the indexer kernels then the paged decode reading the pool in place."""

PREFILL_STEP_DOC = """``sparse_prefill_paged``'s arguments with its ``indices`` replaced by the
    indexer's inputs (``index_q``, ``index_k``, ``index_cu_seqlens_k``), same order and meaning
    in ``qsa_triton`` and ``qsa_pallas``. Request b has ``kv_lens[b]`` tokens of context (cached prefix + this
    chunk); its ``q_len_b = cu_seqlens_q[b + 1] - cu_seqlens_q[b]`` new rows are the last ones
    (bottom-right causal).

    Args:
      q: [T, Hq, D] bfloat16|float16, the new rows of all requests packed.
      k_cache, v_cache: [slots, Hkv, D] the KV pool (this chunk's K/V already written), q's
        dtype or float8_e4m3fn (with ``k_scale`` / ``v_scale``).
      req_to_token: int32 [max_reqs, max_context]; req_indices: int32 [B] (as
        ``sparse_prefill_paged``).
      index_q: [T, H, Di] the indexer query of every row.
      index_k: [N, 1, Di] contiguous compressed keys of every request packed: request b's
        ``floor(kv_lens[b] / ratio)`` blocks (at least all a row may see) are rows
        ``index_cu_seqlens_k[b] .. index_cu_seqlens_k[b + 1] - 1``; index_q's dtype or FP8.
      index_cu_seqlens_k: int32 [B + 1].
      cu_seqlens_q: int32 [B + 1]; kv_lens: int32 [B].
      max_seqlen_q: host int >= 1 (a grid-size hint, as ``sparse_prefill_paged``).
      softmax_scale, k_scale, v_scale, topk, compress_ratio, strict, interpret: as
        ``qsa_decode_step``.

    Returns:
      [T, Hq, D] in q's dtype: each row attends to the tokens its indexer row selected (at most
      ``topk`` of its ``floor((p + 1) / ratio)`` visible blocks plus the causal tail); zeros for
      rows outside every request. Equal to ``interop.reference.prefill_step_reference`` within
      the attention tolerance.

    Source: upstream's QSA prefill path (``sglang/srt/layers/attention/qsa/``: ``mqa.py``,
    ``kernel.py``, ``qsa_indexer.py``'s row ranges), computed here as the indexer kernels then
    the paged prefill."""

_STEP_INDEXER_NAMES = {"q": "index_q", "k_cache": "index_k_cache", "page_table": "index_page_table",
                       "k": "index_k"}


def _check_step(fn: str, strict: bool, q, index_q, indexer, attention, min_rows: int = 0,
                indexer_plan=None):
    """Both step checks: one ``index_q`` row per ``q`` row on q's device; ``indexer(meta)``
    (``meta``: an int32 [rows] spec for the metadata the step derives) and, with
    ``indexer_plan`` (the backend's ``IndexerProblem -> IndexerPlan``), the default plan's reach
    (``check_indexer_plan``), their errors renamed to the step's arguments; then
    ``attention(ids)`` (``ids``: the indexer's int32 [rows, width] output); at least ``min_rows``
    rows of q. Returns (checker, q's spec, IndexerProblem, attention problem)."""
    c = _Checker(fn, strict)
    qs, iq = c.specs(q=q, index_q=index_q)
    c.rank("q", qs, 3, "[rows, Hq, D]")
    if qs.shape[0] < min_rows:  # decode: the indexer needs a row (its check names index_q)
        c.fail("q", f"rows >= {min_rows}", f"{qs.shape[0]} rows")
    c.rank("index_q", iq, 3, "[rows, index_heads, index_head_dim] (the indexer query)")
    c.rows("index_q", iq, qs.shape[0], "one per row of q")
    c.same_device("index_q", iq, qs)
    try:
        ip = indexer(TensorSpec((qs.shape[0],), "int32", qs.device, qs.index, (1,)))
        if indexer_plan is not None:
            check_indexer_plan(fn, ip, None, lambda: indexer_plan(ip))
    except ContractError as e:
        if e.arg not in _STEP_INDEXER_NAMES:
            raise
        expected = e.expected
        for old, new in _STEP_INDEXER_NAMES.items():  # "(q's)" in a message is index_q's here
            expected = expected.replace(f"({old}'s)", f"({new}'s)")
        raise ContractError(fn, _STEP_INDEXER_NAMES[e.arg], expected, e.got,
                            strict=strict) from None
    ids = TensorSpec((qs.shape[0], ip.width), "int32", qs.device, qs.index, None)
    return c, qs, ip, attention(ids)


def check_decode_step(q, k_cache, v_cache, req_to_token, req_indices, index_q, index_k_cache,
                      index_page_table, seq_lens, softmax_scale=None, k_scale=1.0, v_scale=1.0, *,
                      topk: int = 512, compress_ratio: int = 4, batch_invariant: bool = False,
                      strict: bool = False, attention_strict: bool = False,
                      fn: str = "qsa_decode_step", indexer_plan=None
                      ) -> tuple[PagedDecodeProblem, IndexerProblem]:
    """Check a decode step call (``DECODE_STEP_DOC``) before anything runs: the indexer's inputs
    as ``check_indexer_decode`` (and, with ``indexer_plan``, the backend's ``IndexerProblem ->
    IndexerPlan``, that its default plan covers the call, as ``check_indexer_plan``), the
    attention's as ``check_decode_paged`` with the indexer's output as ``indices``.
    ``attention_strict``: the attention's envelope alone (the exact contract). Returns
    (PagedDecodeProblem, IndexerProblem); raises ContractError naming the step's argument,
    expected, got and both envelopes."""
    _, _, ip, ap = _check_step(
        fn, strict, q, index_q,
        lambda meta: check_indexer_decode(index_q, index_k_cache, index_page_table, seq_lens,
                                          topk=topk, compress_ratio=compress_ratio,
                                          strict=strict, fn=fn),
        lambda ids: check_decode_paged(q, k_cache, v_cache, req_to_token, req_indices, ids,
                                       seq_lens, softmax_scale, k_scale, v_scale,
                                       batch_invariant=batch_invariant,
                                       strict=bool(strict) or bool(attention_strict), fn=fn),
        min_rows=1, indexer_plan=indexer_plan)
    return ap, ip


def check_prefill_step(q, k_cache, v_cache, req_to_token, req_indices, index_q, index_k,
                       index_cu_seqlens_k, cu_seqlens_q, kv_lens, max_seqlen_q, softmax_scale=None,
                       k_scale=1.0, v_scale=1.0, *, topk: int = 512, compress_ratio: int = 4,
                       strict: bool = False, fn: str = "qsa_prefill_step", indexer_plan=None
                       ) -> tuple[PrefillProblem, IndexerProblem]:
    """Check a prefill step call (``PREFILL_STEP_DOC``) before anything runs: ``index_q``,
    ``index_k`` as ``check_indexer_prefill``, the attention's inputs as ``check_prefill_paged``
    with the indexer's output as ``indices``, ``index_cu_seqlens_k`` int32 [B + 1] on q's device;
    ``indexer_plan`` as ``check_decode_step``'s. Returns (PrefillProblem, IndexerProblem); raises
    as ``check_decode_step``."""
    c, qs, ip, ap = _check_step(
        fn, strict, q, index_q,
        lambda meta: check_indexer_prefill(index_q, index_k, meta, meta, topk=topk,
                                           compress_ratio=compress_ratio, positions=meta,
                                           seq_lens=meta, strict=strict, fn=fn),
        lambda ids: check_prefill_paged(q, k_cache, v_cache, req_to_token, req_indices, ids,
                                        cu_seqlens_q, kv_lens, max_seqlen_q, softmax_scale,
                                        k_scale, v_scale, strict=strict, fn=fn),
        indexer_plan=indexer_plan)
    c.metadata("index_cu_seqlens_k", index_cu_seqlens_k, ap.requests + 1, qs,
               note=_b_from_cu_q(ap.requests, " + 1"))
    return ap, ip


def check_prefill_step_rows(cu_seqlens_q, kv_lens, index_cu_seqlens_k, total_rows,
                            compress_ratio: int = 4, *, fn: str = "prefill_step_rows") -> int:
    """Check a ``prefill_step_rows`` call (both backends) before anything runs: int32
    ``cu_seqlens_q`` [B + 1], ``kv_lens`` [B], ``index_cu_seqlens_k`` [B + 1] on one device
    (not read), host ints ``total_rows`` >= 0 and ``compress_ratio`` in 2..16. Returns B;
    raises ContractError (argument, expected, got)."""
    c = _Checker(fn, False)
    cu = c.spec("cu_seqlens_q", cu_seqlens_q)
    b = c.cu_seqlens("cu_seqlens_q", cu_seqlens_q, cu)
    c.metadata("kv_lens", kv_lens, b, cu, "cu_seqlens_q", note=_b_from_cu_q(b))
    c.metadata("index_cu_seqlens_k", index_cu_seqlens_k, b + 1, cu, "cu_seqlens_q",
               note=_b_from_cu_q(b, " + 1"))
    c.host_int("total_rows", total_rows, 0, None)
    c.host_int("compress_ratio", compress_ratio, 2, 16)
    return b


def validate_indexer_decode_metadata(page_table, seq_lens, pages: int, page_size: int, *,
                                     compress_ratio: int = 4, fn: str = "indexer_topk_decode",
                                     page_table_arg: str = "page_table") -> None:
    """Check decode indexer metadata contents (host sync; debug only): raises ContractError for a
    non-integer array or a non-int size, a row with more blocks than ``max_pages * page_size``
    or a visible block's page id outside ``[0, pages)`` (the kernels stay in bounds, but both
    are caller bugs). ``fn`` and
    ``page_table_arg`` name the call in the error (the decode step: ``fn="qsa_decode_step",
    page_table_arg="index_page_table"``)."""
    c = _Checker(fn, False)
    pages = c.host_int("pages", pages, 0, None)
    page_size = c.host_int("page_size", page_size, 1, None)
    compress_ratio = c.host_int("compress_ratio", compress_ratio, 2, 16)
    pt = _ints(c, page_table_arg, page_table, 2)
    nb = np.maximum(_ints(c, "seq_lens", seq_lens, 1), 0) // compress_ratio
    if nb.size != pt.shape[0]:
        c.fail("seq_lens", f"one length per {page_table_arg} row ({pt.shape[0]})",
               f"shape {list(nb.shape)}")
    cap = pt.shape[1] * page_size
    if nb.size and nb.max() > cap:
        b = int(np.argmax(nb))
        c.fail("seq_lens", f"seq_len // {compress_ratio} <= page-table capacity {cap} blocks",
               f"row {b}: {int(nb[b])} blocks")
    for b in range(pt.shape[0]):
        used = pt[b, : -(-int(nb[b]) // page_size)]
        if used.size and (used.min() < 0 or used.max() >= pages):
            c.fail(page_table_arg, f"page ids in [0, {pages}) for every visible block",
                   f"row {b}: {used[(used < 0) | (used >= pages)][:4].tolist()}")


def validate_indexer_prefill_metadata(row_starts, row_ends, num_keys: int, *,
                                      fn: str = "indexer_topk_prefill") -> None:
    """Check prefill indexer row ranges ``0 <= start <= end <= N`` (host sync; debug only);
    raises ContractError for a non-integer array, a non-int ``num_keys`` or the first row
    outside."""
    c = _Checker(fn, False)
    num_keys = c.host_int("num_keys", num_keys, 0, None)
    rs, re = _ints(c, "row_starts", row_starts, 1), _ints(c, "row_ends", row_ends, 1)
    if re.size != rs.size:
        c.fail("row_ends", f"as long as row_starts ({rs.size})", f"shape {list(re.shape)}")
    bad = (rs < 0) | (re < rs) | (re > num_keys)
    if bad.any():
        m = int(np.argmax(bad))
        c.fail("row_starts" if rs[m] < 0 else "row_ends",
               f"0 <= row_starts <= row_ends <= {num_keys} (packed key rows)",
               f"row {m}: [{int(rs[m])}, {int(re[m])})")
