"""The differential runner behind ``qsa check``: identical inputs to the Pallas and the Triton
kernels (zero-copy through ``interop.dlpack``), each compared with the FP64 reference and with
each other, optionally with upstream SGLang's kernels (``interop.validate.peer``) as an
independent oracle.

The cases are ``interop.cases``: ``full_matrix()`` on a GPU (compiled kernels), ``quick_matrix()``
on a CPU (interpret mode); a case's arguments come from ``interop.cases.case_data``, its values
are drawn by torch on the run's device. Operations (``--ops``): ``decode`` (packed),
``prefill`` (ordinary / chunk / paged), ``paged`` (``sparse_decode_paged``), ``indexer``
(``indexer_select_decode`` / ``_prefill``: scoring + exact top-k + expansion) and ``step`` (the
end-to-end ``qsa_decode_step`` / ``qsa_prefill_step``).

Pass criteria per implementation and case: ``interop.cases.compare`` (``qsa-contract.md`` §6),
and Pallas vs Triton elementwise within the same tolerance (the indexer's token positions
exactly equal).

The reference is ``interop.reference`` (float64 numpy) for small cases and ``torch_reference``
(the same semantics in float64 torch, batched over rows, on the GPU) for large ones;
``tests/test_crosscheck.py`` checks the two agree.

torch and jax are imported lazily; call ``prepare_backends()`` before the kernel packages are
imported so that a CPU machine runs Triton's interpreter.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
import traceback
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from interop import cases as C
from interop import reference as R
from interop.cases import (ATOL, DECODE_BATCHES, ENTRY, INDEX_ENTRIES, OPS, PARAMS,  # noqa: F401
                           PREFILL_KINDS, REL_L2, RTOL, TP_SHAPES, DecodeSpec, IndexerSpec,
                           PagedSpec, PrefillSpec, Spec, StepSpec, full_matrix, quick_matrix)

__all__ = [  # with the names re-exported from interop.cases for the tests and bench/
    "versions", "select_ops", "has_cuda", "prepare_backends", "Implementation",
    "load_implementations", "load_peer", "peer_indices", "peer_prefill_skip", "Inputs",
    "build_inputs", "numpy_reference", "torch_reference", "empty_mask", "CaseResult", "evaluate",
    "run_case", "summarize", "iter_names", "RTOL", "ATOL", "REL_L2", "OPS", "TP_SHAPES",
    "DECODE_BATCHES", "ENTRY", "PARAMS", "DecodeSpec", "PrefillSpec", "PagedSpec", "IndexerSpec",
    "StepSpec", "quick_matrix", "full_matrix",
]

def versions() -> dict:
    """Python's and the installed packages' versions (None: not installed), for JSON reports
    and capture metadata."""
    import sys  # noqa: PLC0415
    from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415

    out = {"python": sys.version.split()[0]}
    for pkg in ("qsa", "numpy", "torch", "triton", "jax", "jaxlib"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def select_ops(text: str | None) -> tuple[str, ...]:
    """Parse ``--ops`` ("decode,prefill,paged,indexer,step"; None: all of them).

    Raises:
      ValueError: an unknown or empty operation list (message lists the allowed values).
    """
    if text is None:
        return OPS
    parts = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in parts if p not in OPS]
    if bad or not parts:
        raise ValueError(f"--ops: unknown operation(s) {bad or [text]!r}; allowed: "
                         f"{', '.join(OPS)} (comma-separated)")
    return tuple(dict.fromkeys(parts))


# --------------------------------------------------------------------------------------------
# Backends.
def has_cuda() -> bool:
    """A CUDA device is visible (checked without initialising any framework)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return False
    return os.path.exists("/dev/nvidia0") or os.path.exists("/dev/nvidiactl")


def prepare_backends(interpret: bool | None = None) -> bool:
    """Set up the environment before any kernel package is imported; returns interpret mode.

    On a machine without CUDA (or with ``interpret=True``): ``TRITON_INTERPRET=1`` (Triton's
    interpreter must be on before ``@triton.jit`` kernels are defined) and ``JAX_PLATFORMS=cpu``.
    """
    if interpret is None:
        interpret = not has_cuda()
    if interpret:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    else:
        # torch and jax share the GPU in one process: no 75% up-front grab by XLA
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    return interpret


@dataclasses.dataclass
class Implementation:
    """One family of entry points.

    Attributes:
      name: "triton" | "pallas" | "peer:sglang" | anything (fakes in tests).
      framework: "torch" (called with torch tensors) or "jax" (called with jax arrays made
        zero-copy by ``interop.dlpack.to_jax``).
      fns: entry point name -> callable (``interop.cases.ENTRY``'s values: ``sparse_decode``,
        the prefill variants, ``sparse_decode_paged``, ``indexer_select_*``, ``qsa_*_step``),
        the contract's signatures.
      kwargs: extra keyword arguments for every call (Pallas: ``interpret``).
      supports: optional predicate (spec -> reason or None) for cases it cannot run (skipped).
    """

    name: str
    framework: str
    fns: dict[str, Callable]
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    supports: Callable[[Spec], str | None] | None = None


def _entry_points(package: str) -> dict[str, Callable]:
    """The ``interop.cases.ENTRY`` entry points of a kernel package (none when it cannot be
    imported, e.g. jax absent: every case then reports it as missing)."""
    import importlib  # noqa: PLC0415

    try:
        mod = importlib.import_module(package)
    except ImportError:
        return {}
    return {name: getattr(mod, name) for name in ENTRY.values() if hasattr(mod, name)}


def load_implementations(interpret: bool) -> list[Implementation]:
    """qsa_triton and qsa_pallas entry points (call ``prepare_backends`` first)."""
    return [Implementation("triton", "torch", _entry_points("qsa_triton"),
                           supports=_interpreter_bf16_guard if interpret else None),
            Implementation("pallas", "jax", _entry_points("qsa_pallas"),
                           {"interpret": bool(interpret)})]


def _interpreter_bf16_guard(spec) -> str | None:
    """Triton's interpreter (3.6-3.9) multiplies bf16 dot operands as raw 16-bit integers
    (architecture.md): skip bf16 cases there unless the test-only interpreter patch is active."""
    import sys  # noqa: PLC0415

    if getattr(spec, "dtype", None) != "bfloat16":
        return None
    patch = sys.modules.get("tests.triton_interp_patch")
    if patch is not None and getattr(patch, "applied", False):
        return None
    return ("Triton's CPU interpreter mis-multiplies bf16 dots (architecture.md); run bf16 "
            "cases on a GPU")


def peer_indices(indices, cu_q, lens):
    """Index entries outside [0, len) replaced by upstream's padding value -1 (torch, any device).

    Why: upstream masks only ``idx >= 0`` and reads any other entry (paged: through the slot
    table, past the pool), so entries outside [0, len) are outside its contract. Same semantics under ours (invalid
    entries never contribute), so the peer stays an independent oracle on junk cases."""
    import torch  # noqa: PLC0415

    cu_q = cu_q.long()
    req = torch.repeat_interleave(torch.arange(len(cu_q) - 1, device=cu_q.device),
                                  cu_q[1:] - cu_q[:-1])  # request of each query row
    bound = lens.long()[req].view(-1, *([1] * (indices.dim() - 1)))
    return torch.where((indices >= 0) & (indices < bound), indices,
                       torch.full_like(indices, -1))


def peer_prefill_skip(spec: PrefillSpec) -> str | None:
    """Why upstream's prefill kernels cannot be an oracle for ``spec`` (None: they can). Outside
    upstream's own contract: rows with no valid entry (it divides by the softmax normaliser
    unguarded: 0/0 = NaN, where ours gives exact zeros) and per-KV-head indices for paged prefill
    (``sparse_gqa_paged_prefill_triton`` asserts ``indices.ndim == 2``). Junk index values are
    not a reason: ``peer_indices`` maps them to upstream's -1."""
    if spec.empty_rows:
        return "upstream gives NaN (0/0) for rows with no valid entry; the contract wants exact zeros"
    if spec.kind == "paged" and spec.per_head:
        return "upstream's paged prefill takes [T, W] indices only (asserts indices.ndim == 2)"
    return None


def load_peer(name: str = "sglang", device: str = "cuda") -> Implementation:
    """Upstream SGLang 0.5.23's kernels as a peer implementation (``interop.validate.peer``).

    Decode uses the SM121 packed kernel (exact contract only: other shapes are skipped); prefill
    uses upstream's public interfaces, with index entries outside [0, len) passed as -1 (upstream
    masks only negative entries; see ``peer_indices``). FP8 K/V are dequantised to q's dtype
    first (upstream packs FP8 pools to the query dtype before its kernels), with k_scale folded into the softmax
    scale and v_scale applied to the output.

    Args:
      device: where the cases' tensors live; upstream's kernels run on "cuda" only (on a CPU
        every case is reported as skipped).

    Raises:
      ValueError: unknown peer name. interop.validate.peer.PeerUnavailable: files absent.
    """
    if name != "sglang":
        raise ValueError(f"--peer: unknown peer {name!r}; allowed: sglang")
    from . import peer  # noqa: PLC0415
    from interop.contract import ContractError, check_decode  # noqa: PLC0415

    # SM121 decode first: load_sparse_attn() registers stub 'sglang' modules without __spec__,
    # after which peer.sglang_root()'s importlib.util.find_spec("sglang") raises ValueError
    try:
        sm121 = peer.load_sm121_decode()
    except peer.PeerUnavailable:
        sm121 = None
    sa = peer.load_sparse_attn()

    def _scale(q, s):
        return q.shape[-1] ** -0.5 if s is None else s

    def _deq(q, k, v):
        return (k.to(q.dtype), v.to(q.dtype)) if k.dtype != q.dtype else (k, v)

    def decode(q, k, v, cu_q, cu_k, max_seqlen_k, softmax_scale=None):
        return sm121.qwen38_qsa_sm121(q, k, v, cu_q, cu_k, _scale(q, softmax_scale))

    def prefill(q, k, v, indices, cu, max_seqlen_q, softmax_scale=None):
        indices = peer_indices(indices, cu, cu[1:] - cu[:-1])
        return sa.sparse_gqa_fwd_interface_triton(q, k, v, max_seqlen_q, indices, cu,
                                                  _scale(q, softmax_scale))

    def chunk(q, k, v, indices, cu_q, cu_k, kv_lens, max_seqlen_q, softmax_scale=None,
              k_scale=1.0, v_scale=1.0):
        k, v = _deq(q, k, v)
        indices = peer_indices(indices, cu_q, kv_lens)
        out = sa.sparse_gqa_fwd_interface_triton_ck(q, k, v, indices, cu_q, cu_k, kv_lens,
                                                    _scale(q, softmax_scale) * k_scale,
                                                    max_q=max_seqlen_q)
        return out if v_scale == 1.0 else (out.float() * v_scale).to(q.dtype)

    def paged(q, k_cache, v_cache, req_to_token, req_indices, indices, cu_q, kv_lens,
              max_seqlen_q, softmax_scale=None, k_scale=1.0, v_scale=1.0):
        # upstream's kernel takes one slot table row per request
        slot_table = C.slot_table_of({"req_to_token": req_to_token, "req_indices": req_indices})
        k_cache, v_cache = _deq(q, k_cache, v_cache)
        indices = peer_indices(indices, cu_q, kv_lens)
        out = sa.sparse_gqa_paged_prefill_triton(q, k_cache, v_cache, slot_table, indices, cu_q,
                                                 kv_lens, _scale(q, softmax_scale) * k_scale,
                                                 max_q=max_seqlen_q)
        return out if v_scale == 1.0 else (out.float() * v_scale).to(q.dtype)

    def supports(spec: Spec) -> str | None:
        if not isinstance(spec, (DecodeSpec, PrefillSpec)):
            return "the upstream peer is wired for the attention entry points only"
        if device != "cuda":
            return "upstream's kernels need a CUDA device (torch.cuda calls)"
        if isinstance(spec, DecodeSpec):
            if sm121 is None:
                return "upstream SM121 decode kernel absent"
            from interop.contract import TensorSpec  # noqa: PLC0415

            try:
                check_decode(TensorSpec((spec.batch, spec.hq, spec.d), spec.dtype),
                             TensorSpec((1, spec.hkv, spec.d), spec.dtype),
                             TensorSpec((1, spec.hkv, spec.d), spec.dtype),
                             TensorSpec((spec.batch + 1,), "int32"),
                             TensorSpec((spec.batch + 1,), "int32"), spec.max_len, strict=True)
            except ContractError as e:
                return f"upstream decode runs the exact contract only ({e.arg})"
        return peer_prefill_skip(spec) if isinstance(spec, PrefillSpec) else None

    return Implementation(f"peer:{name}", "torch", {"sparse_decode": decode,
                                                     "sparse_prefill": prefill,
                                                     "sparse_prefill_chunk": chunk,
                                                     "sparse_prefill_paged": paged},
                          supports=supports)


# --------------------------------------------------------------------------------------------
# Inputs.
@dataclasses.dataclass
class Inputs:
    """Torch tensors of one case (on the run's device) plus host metadata for checks.

    ``args`` is the positional argument list of the entry point, ``kwargs`` its keyword
    arguments; ``empty`` marks output rows that must be exactly 0 (bool [rows, Hq] numpy).
    """

    entry: str
    args: list
    kwargs: dict
    empty: np.ndarray
    host: dict

    def named(self) -> dict:
        """Every argument by parameter name (``interop.cases.PARAMS``)."""
        pos, _ = PARAMS[self.entry]
        return {**dict(zip(pos, self.args)), **self.kwargs}


def build_inputs(spec: Spec, device: str = "cpu") -> Inputs:
    """Seeded inputs of one case as torch tensors on ``device``.

    The call's structure (metadata, indices, poisoned K/V entries, outputs that must be zero)
    is ``interop.cases.case_data``; the values are N(0, 1) drawn by torch on ``device`` (fast for
    the GPU's full matrix) in the case's dtype (FP8 K/V: N(0, 1) cast to float8_e4m3fn), integers
    in [-2, 2] for the case's ``integer_valued`` tensors (the indexer's), zeros in its
    ``zero_rows``.
    """
    import torch  # noqa: PLC0415

    data = C.case_data(spec)
    gen = torch.Generator(device=device)
    gen.manual_seed(1000 + spec.seed)
    named: dict[str, Any] = {}
    for name, (shape, dtype) in data.floats.items():
        if name in data.integer_valued:
            x = torch.randint(-2, 3, shape, generator=gen, device=device).to(torch.float32)
        else:
            x = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
        if name in data.zero_rows:
            x[torch.as_tensor(data.zero_rows[name], device=device)] = 0.0
        if data.poison is not None and name in data.kv_names:
            x[torch.as_tensor(data.poison, device=device)] = float("nan")
        named[name] = x.to(getattr(torch, dtype))
    for name, a in data.ints.items():
        named[name] = torch.as_tensor(np.ascontiguousarray(a, np.int32), device=device)
    args, kwargs = data.arguments(named)
    return Inputs(data.entry, args, kwargs, data.empty, {"case": data})


# --------------------------------------------------------------------------------------------
# References.
def _np64(t) -> np.ndarray:
    return t.detach().float().cpu().numpy().astype(np.float64)


def _host(named: dict) -> dict:
    """Arguments as numpy (floats as float64 values, as the kernel sees them) or host scalars."""
    out = {}
    for k, x in named.items():
        if hasattr(x, "cpu"):
            out[k] = _np64(x) if x.is_floating_point() else x.cpu().numpy()
        else:
            out[k] = x
    return out


def numpy_reference(spec: Spec | None, inp: Inputs) -> np.ndarray:
    """``interop.cases.reference`` (float64 numpy) on the inputs; ``spec`` is unused, kept for
    symmetry with ``torch_reference``."""
    named = inp.named()
    if inp.entry == "sparse_decode":  # rows past cu_seqlens_k[B] are never read: not converted
        used = max(int(named["cu_seqlens_k"].max()), 0)
        named = {**named, "k": named["k"][:used], "v": named["v"][:used]}
    return C.reference(inp.entry, _host(named))


def torch_reference(spec: Spec | None, inp: Inputs, *, budget_bytes: int = 1 << 30):
    """The same semantics as ``interop.reference`` in float64 torch, batched over rows (for the
    full matrix on the GPU, where the per-row numpy loop is too slow). Dispatches on
    ``inp.entry``; ``spec`` is unused.

    Per row: an entry counts iff 0 <= idx < bound (request length or kv_lens[b]) and it stands in
    the row's first min(W, visible) columns; other entries are gathered from a safe position and
    zeroed (poisoned rows stay out) and masked to -inf; a row with no valid entry is 0.

    Returns:
      float64 torch tensor [rows, Hq, D] on the inputs' device.
    """
    import torch  # noqa: PLC0415

    a, kw = inp.args, inp.kwargs
    if inp.entry == "sparse_decode":
        return torch.as_tensor(numpy_reference(spec, inp), device=a[0].device)
    kind = {"sparse_prefill": "ordinary", "sparse_prefill_chunk": "chunk",
            "sparse_prefill_paged": "paged"}[inp.entry]
    hkv = a[1].shape[1]
    q = a[0]
    dev = q.device
    t, hq, d = q.shape
    g = hq // hkv
    scale = (d ** -0.5 if kw.get("softmax_scale") is None else kw["softmax_scale"])
    k_scale, v_scale = kw.get("k_scale", 1.0), kw.get("v_scale", 1.0)
    n = inp.named()
    k, v, idx = n[PARAMS[inp.entry][0][1]], n[PARAMS[inp.entry][0][2]], n["indices"]
    table = None
    if kind == "ordinary":
        cu_q = n["cu_seqlens"]
        lens = cu_q[1:] - cu_q[:-1]
        base = cu_q[:-1]
    elif kind == "chunk":
        cu_q, lens, base = n["cu_seqlens_q"], n["kv_lens"], n["cu_seqlens_k"][:-1]
    else:
        cu_q, lens, table, base = n["cu_seqlens_q"], n["kv_lens"], C.slot_table_of(n), None
    req = torch.searchsorted(cu_q[1:].long(), torch.arange(t, device=dev), right=True)
    bound = lens.long()[req]
    idx3 = idx.long() if idx.ndim == 3 else idx.long()[:, None, :]
    w = idx3.shape[-1]
    cu64 = cu_q.long()
    row_in_req = torch.arange(t, device=dev) - cu64[req]
    q_len = cu64[req + 1] - cu64[req]
    visible = row_in_req + 1 if kind == "ordinary" else row_in_req + bound - q_len + 1
    cap = visible.clamp(min=0, max=w)
    col = torch.arange(w, device=dev)
    per_row = hkv * w * d * 8 * 3 + hq * w * 8 * 2
    step = max(1, min(t, budget_bytes // max(per_row, 1)))
    out = torch.zeros((t, hq, d), dtype=torch.float64, device=dev)
    heads = torch.arange(hkv, device=dev)
    for lo in range(0, t, step):
        hi = min(t, lo + step)
        ix = idx3[lo:hi].expand(-1, hkv, -1) if idx3.shape[1] == 1 else idx3[lo:hi]
        bnd = bound[lo:hi, None, None]
        valid = (ix >= 0) & (ix < bnd) & (col < cap[lo:hi, None, None])
        safe = torch.where(valid, ix, torch.zeros_like(ix))
        if table is None:
            rows = base.long()[req[lo:hi]][:, None, None] + safe
        else:
            rows = torch.gather(table.long()[req[lo:hi]], 1, safe.reshape(hi - lo, -1)).reshape(safe.shape)
        keep = valid[..., None]
        kk = torch.where(keep, k[rows, heads[None, :, None]].double(), 0.0)  # [R, Hkv, W, D]
        vv = torch.where(keep, v[rows, heads[None, :, None]].double(), 0.0)
        qq = q[lo:hi].double().reshape(hi - lo, hkv, g, d)
        s = torch.einsum("rhgd,rhwd->rhgw", qq, kk) * (scale * k_scale)
        s = s.masked_fill(~valid[:, :, None, :], float("-inf"))
        m = s.amax(-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(s - m)
        l = p.sum(-1, keepdim=True)
        o = torch.einsum("rhgw,rhwd->rhgd", p, vv) / torch.where(l > 0, l, torch.ones_like(l))
        out[lo:hi] = (o * v_scale).reshape(hi - lo, hq, d)
    return out


# --------------------------------------------------------------------------------------------
# Running.
@dataclasses.dataclass
class CaseResult:
    """Outcome of one case.

    Attributes:
      name, op: the case. passed: every implementation within tolerance and Pallas ~ Triton.
      impl: per implementation: {rel_l2, max_abs, allclose, finite, zeros_ok, passed, seconds,
        error, skipped}.
      pair_max_abs: max |Pallas - Triton| (None when either is missing).
      pair_ok: Pallas vs Triton elementwise within rtol/atol.
      failures: human-readable reasons.
    """

    name: str
    op: str
    passed: bool
    impl: dict[str, dict]
    pair_max_abs: float | None
    pair_ok: bool | None
    failures: list[str]
    reference: str
    seconds: float

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _call(impl: Implementation, inp: Inputs):
    """Run one implementation on the inputs; returns its output as a torch tensor (a jax
    output is handed over zero-copy through ``interop.dlpack``)."""
    fn = impl.fns.get(inp.entry)
    if fn is None:
        raise NotImplementedError(f"{impl.name} has no {inp.entry}")
    if impl.framework == "jax":
        from interop.dlpack import to_jax, to_torch  # noqa: PLC0415

        args = [to_jax(x) if type(x).__module__.startswith("torch") else x for x in inp.args]
        out = fn(*args, **inp.kwargs, **impl.kwargs)
        out_t = to_torch(out)
    else:
        out_t = fn(*inp.args, **inp.kwargs, **impl.kwargs)
    return out_t


def empty_mask(inp: Inputs) -> np.ndarray:
    """bool [rows, Hq]: output rows that must be exactly 0 (``interop.cases.empty_outputs``),
    recomputed from the inputs' device metadata on the host (captures carry no spec)."""
    n = inp.named()
    host = {k: x.cpu().numpy() for k, x in n.items()
            if hasattr(x, "cpu") and not x.is_floating_point()}
    if inp.entry in INDEX_ENTRIES:
        return C.empty_outputs(inp.entry, host, 1, 1)
    kv = n[PARAMS[inp.entry][0][1]]
    return C.empty_outputs(inp.entry, host, inp.args[0].shape[1], kv.shape[1],
                           pool_slots=kv.shape[0], rows=inp.args[0].shape[0])


_TORCH_REFERENCE = ("sparse_prefill", "sparse_prefill_chunk", "sparse_prefill_paged")


def _reference(inp: Inputs, method: str, size: int) -> tuple[np.ndarray, str]:
    if method in ("auto", "torch") and inp.entry not in _TORCH_REFERENCE:
        method = "numpy"  # torch_reference covers the prefill variants only
    if method == "auto":
        method = "numpy" if size <= 2_000_000 else "torch"
    if method == "numpy":
        return numpy_reference(None, inp), method
    if method == "torch":
        on_gpu = getattr(inp.args[0], "is_cuda", False)
        return torch_reference(None, inp, budget_bytes=(4 << 30) if on_gpu else (1 << 30)
                               ).cpu().numpy(), method
    raise ValueError(f"reference must be auto|numpy|torch, got {method!r}")


def _why(r: dict, rows: int, rel_l2_limit: float) -> str:
    """Why an output that ran failed ``interop.cases.compare``'s criteria."""
    if "mismatched_rows" in r:  # token positions: exact or wrong
        return f"{r['mismatched_rows']} of {rows} rows differ from the FP64 reference's selection"
    return "; ".join(why for why, ok in (
        ("non-finite output", r["finite"]),
        (f"rel L2 {r['rel_l2']:.2e} > {rel_l2_limit:g}", r["rel_l2"] <= rel_l2_limit),
        (f"max |err| {r['max_abs']:.3g} beyond rtol=atol={RTOL:g}", r["allclose"]),
        ("rows without valid keys not exactly 0", r["zeros_ok"])) if not ok)


def evaluate(name: str, op: str, inp: Inputs, impls: Sequence[Implementation], ref: np.ndarray,
             *, spec: Spec | None = None, reference: str = "numpy",
             expected: np.ndarray | None = None, rel_l2_limit: float = REL_L2,
             t0: float | None = None) -> CaseResult:
    """Run every implementation on ``inp`` and judge it against ``ref`` (and Pallas vs Triton).

    ``expected`` (replay: the stored output) adds ``rel_l2_vs_expected`` per implementation
    (reported, not judged). ``spec`` is passed to ``Implementation.supports``.
    """
    t0 = time.perf_counter() if t0 is None else t0
    empty = empty_mask(inp)
    results: dict[str, dict] = {}
    outs: dict[str, np.ndarray] = {}
    failures: list[str] = []
    for impl in impls:
        reason = impl.supports(spec) if (impl.supports and spec is not None) else None
        if reason:
            results[impl.name] = {"skipped": reason, "passed": True}
            continue
        t1 = time.perf_counter()
        try:
            out_t = _call(impl, inp)
            if getattr(out_t, "is_cuda", False):
                import torch  # noqa: PLC0415

                torch.cuda.synchronize()
            # index outputs (the indexer) stay integers: compared exactly
            out = _np64(out_t) if out_t.is_floating_point() else out_t.cpu().numpy().astype(np.int64)
            if out.shape != ref.shape:
                raise ValueError(f"output shape {list(out.shape)}, expected {list(ref.shape)}")
            r = C.compare(out, ref, empty, rel_l2_limit)
            if expected is not None:
                r["rel_l2_vs_expected"] = R.rel_l2(out, expected) if r["finite"] else float("inf")
            outs[impl.name] = out
        except Exception as e:  # noqa: BLE001 - a crash is a failed case, reported by name
            r = {"passed": False, "error": f"{type(e).__name__}: {e}".splitlines()[0][:300],
                 "traceback": traceback.format_exc(limit=4)}
        r["seconds"] = time.perf_counter() - t1
        results[impl.name] = r
        if not r["passed"]:
            failures.append(f"{impl.name}: " + (r.get("error") or _why(r, ref.shape[0],
                                                                         rel_l2_limit)))
    pair_max = pair_ok = None
    if "triton" in outs and "pallas" in outs:
        d = np.abs(outs["pallas"] - outs["triton"])
        pair_max = float(d.max()) if d.size else 0.0
        exact = np.issubdtype(outs["triton"].dtype, np.integer)  # token positions: bit-equal
        pair_ok = bool(pair_max == 0.0 if exact else np.all(d <= ATOL + RTOL * np.abs(outs["triton"])))
        if not pair_ok:
            failures.append("pallas vs triton: " + ("different token positions" if exact else
                            f"max |diff| {pair_max:.3g} beyond rtol=atol={RTOL:g}"))
    passed = not failures and all(r.get("passed") for r in results.values())
    return CaseResult(name, op, passed, results, pair_max, pair_ok, failures, reference,
                      time.perf_counter() - t0)


def run_case(spec: Spec, impls: Sequence[Implementation], *, device: str = "cpu",
             reference: str = "auto") -> CaseResult:
    """Build the inputs, run every implementation, compare with the reference and each other.

    Args:
      reference: "numpy" (``interop.reference``), "torch" (``torch_reference``, float64) or
        "auto" (numpy for small cases, torch otherwise).
    """
    t0 = time.perf_counter()
    try:
        inp = build_inputs(spec, device)
        ref, method = _reference(inp, reference, spec.size)
    except Exception as e:  # noqa: BLE001 - e.g. out of memory: fail this case, keep going
        msg = f"inputs/reference: {type(e).__name__}: {e}".splitlines()[0][:300]
        return CaseResult(spec.name, spec.op, False, {}, None, None, [msg], reference,
                          time.perf_counter() - t0)
    return evaluate(spec.name, spec.op, inp, impls, ref, spec=spec, reference=method, t0=t0)


def summarize(results: Sequence[CaseResult], impl_names: Sequence[str]) -> dict[str, dict]:
    """Per op: cases, passed, max rel L2 per implementation, max |Pallas - Triton|, worst case
    (largest rel L2 over implementations; a failed case first)."""
    summary: dict[str, dict] = {}
    for op in OPS:
        rs = [r for r in results if r.op == op]
        if not rs:
            continue

        def score(r: CaseResult) -> tuple:
            rels = [v.get("rel_l2", math.inf if "error" in v else 0.0) for v in r.impl.values()
                    if not v.get("skipped")]
            return (not r.passed, max(rels) if rels else 0.0)

        worst = max(rs, key=score)
        s = {"cases": len(rs), "passed": sum(r.passed for r in rs),
             "failed": [r.name for r in rs if not r.passed], "worst_case": worst.name,
             "max_pallas_triton": max((r.pair_max_abs for r in rs if r.pair_max_abs is not None),
                                      default=None)}
        for name in impl_names:
            vals = [r.impl[name].get("rel_l2", math.inf if "error" in r.impl[name] else None)
                    for r in rs if name in r.impl and not r.impl[name].get("skipped")]
            vals = [v for v in vals if v is not None]
            s[f"max_rel_l2[{name}]"] = max(vals) if vals else None
            s[f"skipped[{name}]"] = sum(1 for r in rs if r.impl.get(name, {}).get("skipped"))
            reasons = sorted({f"{r.name}: {r.impl[name]['skipped']}" for r in rs
                              if r.impl.get(name, {}).get("skipped")})
            s[f"skip_reasons[{name}]"] = reasons[:3]  # a few, so a user sees why
        summary[op] = s
    return summary


def iter_names(specs: Iterable[Spec]) -> list[str]:
    """Case names (unique by construction; tests check it)."""
    return [s.name for s in specs]
