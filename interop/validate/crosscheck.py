"""The differential runner behind ``qsa check``: identical inputs to the Pallas and the Triton
kernels (zero-copy through ``interop.dlpack``), each compared with the FP64 reference and with
each other, optionally with upstream SGLang's kernels (``interop.validate.peer``) as an oracle.

Cases: ``interop.cases`` (``full_matrix()`` on a GPU, ``quick_matrix()`` in interpret mode),
values drawn by torch on the run's device. Pass criteria: ``interop.cases.compare``
(``qsa-contract.md`` §6), and Pallas vs Triton within the same tolerance (the indexer's token
positions exactly equal). Reference: ``interop.reference`` (float64 numpy), or for large prefill
cases ``torch_reference`` (float64 torch, batched). torch and jax are imported lazily; call
``prepare_backends()`` before the kernel packages are imported.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import os
import sys
import time
import traceback
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from interop import cases as C
from interop import reference as R
from interop.cases import (ATOL, DECODE_BATCHES, ENTRY, INDEX_ENTRIES, OPS, PARAMS,
                           PREFILL_KINDS, REL_L2, RTOL, TP_SHAPES, DecodeSpec, IndexerSpec,
                           PagedSpec, PrefillSpec, Spec, StepSpec, full_matrix, quick_matrix)

__all__ = [  # with interop.cases' matrices, specs and tolerances, re-exported
    "versions", "select_ops", "has_cuda", "prepare_backends", "Implementation",
    "load_implementations", "load_peer", "peer_indices", "peer_prefill_skip", "Inputs",
    "build_inputs", "numpy_reference", "torch_reference", "empty_mask", "CaseResult", "evaluate",
    "run_case", "summarize", "iter_names", "RTOL", "ATOL", "REL_L2", "OPS", "TP_SHAPES",
    "DECODE_BATCHES", "ENTRY", "PARAMS", "DecodeSpec", "PrefillSpec", "PagedSpec", "IndexerSpec",
    "StepSpec", "quick_matrix", "full_matrix"]
#: entry point -> prefill kind ("ordinary" | "chunk" | "paged")
PREFILL_KIND = {ENTRY[k]: k for k in PREFILL_KINDS}


def versions() -> dict:
    """Python's and the packages' versions (None: not installed), for reports and captures."""
    def get(pkg):
        try:
            return version(pkg)
        except PackageNotFoundError:
            return None
    return {"python": sys.version.split()[0],
            **{pkg: get(pkg) for pkg in ("qsa", "numpy", "torch", "triton", "jax", "jaxlib")}}


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
    """Set up the environment before any kernel package is imported; returns interpret mode
    (default: no CUDA device), which sets ``TRITON_INTERPRET=1`` and ``JAX_PLATFORMS=cpu``."""
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
    """One family of entry points: ``name`` ("triton", "pallas", "peer:sglang"); ``framework``
    "torch" or "jax" (arrays shared zero-copy through ``interop.dlpack``); ``fns`` entry point
    name -> callable with the contract's signature; ``kwargs`` added to every call;
    ``supports`` (spec -> reason or None) skips the cases it cannot run."""

    name: str
    framework: str
    fns: dict[str, Callable]
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    supports: Callable[[Spec], str | None] | None = None


def _entry_points(package: str) -> dict[str, Callable]:
    """The ``interop.cases.ENTRY`` entry points of a package (none when it cannot be imported)."""
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
    """Skip bf16 cases in Triton's interpreter (unless the test-only patch is active)."""
    patch = sys.modules.get("tests.triton_interp_patch")
    if getattr(spec, "dtype", None) != "bfloat16" or getattr(patch, "applied", False):
        return None
    return ("Triton's CPU interpreter mis-multiplies bf16 dots (architecture.md); run bf16 "
            "cases on a GPU")


def peer_indices(indices, cu_q, lens):
    """Index entries outside [0, len) replaced by upstream's padding value -1 (torch). Upstream
    masks only ``idx >= 0`` and reads any other entry; under our contract such entries never
    contribute, so the peer stays an oracle on junk cases."""
    import torch  # noqa: PLC0415

    cu_q = cu_q.long()
    req = torch.repeat_interleave(torch.arange(len(cu_q) - 1, device=cu_q.device),
                                  cu_q[1:] - cu_q[:-1])  # request of each query row
    bound = lens.long()[req].view(-1, *([1] * (indices.dim() - 1)))
    return torch.where((indices >= 0) & (indices < bound), indices,
                       torch.full_like(indices, -1))


def peer_prefill_skip(spec: PrefillSpec) -> str | None:
    """Why upstream's prefill kernels cannot be an oracle for ``spec`` (None: they can)."""
    if spec.empty_rows:
        return "upstream gives NaN (0/0) for rows with no valid entry; the contract wants exact zeros"
    if spec.kind == "paged" and spec.per_head:
        return "upstream's paged prefill takes [T, W] indices only (asserts indices.ndim == 2)"
    return None


def load_peer(name: str = "sglang", device: str = "cuda") -> Implementation:
    """Upstream SGLang 0.5.23's kernels as a peer implementation (``interop.validate.peer``):
    decode through the SM121 packed kernel (exact contract only), prefill through upstream's
    public interfaces (``peer_indices``; a block selection as its expansion); FP8 K/V
    dequantised to q's dtype, k_scale folded into the softmax scale, v_scale applied to the
    output. On a ``device`` other than "cuda" every case is skipped.

    Raises:
      ValueError: unknown peer name. interop.validate.peer.PeerUnavailable: files absent.
    """
    if name != "sglang":
        raise ValueError(f"--peer: unknown peer {name!r}; allowed: sglang")
    from . import peer  # noqa: PLC0415
    from interop.contract import ContractError, TensorSpec, check_decode  # noqa: PLC0415

    # SM121 decode first: load_sparse_attn() registers stub 'sglang' modules without __spec__,
    # after which peer.sglang_root()'s importlib.util.find_spec("sglang") raises ValueError
    try:
        sm121 = peer.load_sm121_decode()
    except peer.PeerUnavailable:
        sm121 = None
    sa = peer.load_sparse_attn()

    def _scale(q, s):
        return q.shape[-1] ** -0.5 if s is None else s

    def decode(q, k, v, cu_q, cu_k, max_seqlen_k, softmax_scale=None):
        return sm121.qwen38_qsa_sm121(q, k, v, cu_q, cu_k, _scale(q, softmax_scale))

    def prefill(q, k, v, indices, cu, max_seqlen_q, softmax_scale=None):
        indices = peer_indices(indices, cu, cu[1:] - cu[:-1])
        return sa.sparse_gqa_fwd_interface_triton(q, k, v, max_seqlen_q, indices, cu,
                                                  _scale(q, softmax_scale))

    def fp8(fn):  # K/V dequantised, k_scale into the softmax scale, v_scale onto the output
        def call(q, k, v, *rest, softmax_scale=None, k_scale=1.0, v_scale=1.0):
            if k.dtype != q.dtype:
                k, v = k.to(q.dtype), v.to(q.dtype)
            out = fn(q, k, v, *rest, _scale(q, softmax_scale) * k_scale)
            return out if v_scale == 1.0 else (out.float() * v_scale).to(q.dtype)
        return call

    @fp8
    def chunk(q, k, v, indices, cu_q, cu_k, kv_lens, max_seqlen_q, scale):
        return sa.sparse_gqa_fwd_interface_triton_ck(q, k, v, peer_indices(indices, cu_q, kv_lens),
                                                     cu_q, cu_k, kv_lens, scale, max_q=max_seqlen_q)

    @fp8
    def paged(q, k_cache, v_cache, req_to_token, req_indices, indices, cu_q, kv_lens,
              max_seqlen_q, scale):
        # upstream's kernel takes one slot table row per request
        slot_table = C.slot_table_of({"req_to_token": req_to_token, "req_indices": req_indices})
        return sa.sparse_gqa_paged_prefill_triton(q, k_cache, v_cache, slot_table,
                                                  peer_indices(indices, cu_q, kv_lens), cu_q,
                                                  kv_lens, scale, max_q=max_seqlen_q)

    def supports(spec: Spec) -> str | None:
        if not isinstance(spec, (DecodeSpec, PrefillSpec)):
            return "the upstream peer is wired for the attention entry points only"
        if device != "cuda":
            return "upstream's kernels need a CUDA device (torch.cuda calls)"
        if isinstance(spec, PrefillSpec):
            return peer_prefill_skip(spec)
        if sm121 is None:
            return "upstream SM121 decode kernel absent"
        kv, cu = TensorSpec((1, spec.hkv, spec.d), spec.dtype), TensorSpec((spec.batch + 1,), "int32")
        try:
            check_decode(TensorSpec((spec.batch, spec.hq, spec.d), spec.dtype), kv, kv, cu, cu,
                         spec.max_len, strict=True)
        except ContractError as e:
            return f"upstream decode runs the exact contract only ({e.arg})"
        return None

    import torch  # noqa: PLC0415

    def tokens(entry, fn):  # the block form: upstream on its expansion (upstream takes tokens)
        pos = PARAMS[entry][0]

        def call(*args, block_indices=None, **kw):
            if block_indices is not None:
                named = {n: a.cpu().numpy() for n, a in zip(pos, args)
                         if hasattr(a, "cpu") and not a.is_floating_point()}
                ids = C.token_indices(entry, {**named, "block_indices":
                                              block_indices.cpu().numpy()})
                args = list(args)
                args[pos.index("indices")] = torch.as_tensor(ids, device=args[0].device)
            return fn(*args, **kw)
        return call

    return Implementation(f"peer:{name}", "torch", {
        "sparse_decode": decode, "sparse_prefill": tokens("sparse_prefill", prefill),
        "sparse_prefill_chunk": tokens("sparse_prefill_chunk", chunk),
        "sparse_prefill_paged": tokens("sparse_prefill_paged", paged)}, supports=supports)


# --------------------------------------------------------------------------------------------
# Inputs.
@dataclasses.dataclass
class Inputs:
    """One call's torch tensors: ``args`` / ``kwargs`` of the entry point, ``empty`` bool
    [rows, Hq] (outputs that must be exactly 0), ``host`` {"case": CaseData} or {"capture": meta}."""

    entry: str
    args: list
    kwargs: dict
    empty: np.ndarray
    host: dict

    def named(self) -> dict:
        """Every argument by parameter name (``interop.cases.PARAMS``)."""
        return {**dict(zip(PARAMS[self.entry][0], self.args)), **self.kwargs}


def build_inputs(spec: Spec, device: str = "cpu") -> Inputs:
    """Seeded inputs of one case on ``device``: the structure from ``interop.cases.case_data``,
    values N(0, 1) in the case's dtype (integers in [-2, 2] for ``integer_valued`` tensors,
    zeros in ``zero_rows``, NaN at the poisoned K/V rows)."""
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


def numpy_reference(spec: Spec | None, inp: Inputs) -> np.ndarray:
    """``interop.cases.reference`` (float64 numpy) on the inputs; ``spec`` is unused."""
    named = inp.named()
    if inp.entry == "sparse_decode":  # rows past cu_seqlens_k[B] are never read: not converted
        used = max(int(named["cu_seqlens_k"].max()), 0)
        named = {**named, "k": named["k"][:used], "v": named["v"][:used]}
    return C.reference(inp.entry, {k: (_np64(x) if x.is_floating_point() else x.cpu().numpy())
                                   if hasattr(x, "cpu") else x for k, x in named.items()})


def torch_reference(spec: Spec | None, inp: Inputs, *, budget_bytes: int = 1 << 30):
    """``interop.reference``'s semantics in float64 torch, batched over rows (the full matrix
    on a GPU), for the prefill entry points (``sparse_decode``: ``numpy_reference``); ``spec`` is
    unused. An entry counts iff 0 <= idx < bound and it stands in the row's first min(W, visible)
    columns; others are gathered from a safe position, zeroed and masked to -inf.

    Returns:
      float64 torch tensor [rows, Hq, D] on the inputs' device.
    """
    import torch  # noqa: PLC0415

    q, kw, n = inp.args[0], inp.kwargs, inp.named()
    if inp.entry == "sparse_decode":
        return torch.as_tensor(numpy_reference(spec, inp), device=q.device)
    kind = PREFILL_KIND[inp.entry]
    dev, (t, hq, d) = q.device, q.shape
    k, v, idx = n[PARAMS[inp.entry][0][1]], n[PARAMS[inp.entry][0][2]], n["indices"]
    if idx is None:  # the block form: the expansion it equals
        idx = torch.as_tensor(C.token_indices(inp.entry, {  # the integer metadata only
            name: x.cpu().numpy() for name, x in n.items()
            if hasattr(x, "cpu") and not x.is_floating_point()}), device=q.device)
    hkv = k.shape[1]
    g = hq // hkv
    scale = (d ** -0.5 if kw.get("softmax_scale") is None else kw["softmax_scale"])
    k_scale, v_scale = kw.get("k_scale", 1.0), kw.get("v_scale", 1.0)
    table = None
    if kind == "ordinary":
        cu_q = n["cu_seqlens"]
        lens, base = cu_q[1:] - cu_q[:-1], cu_q[:-1]
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
        valid = (ix >= 0) & (ix < bound[lo:hi, None, None]) & (col < cap[lo:hi, None, None])
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
        p = torch.exp(s - torch.where(torch.isfinite(m), m, torch.zeros_like(m)))
        l = p.sum(-1, keepdim=True)
        o = torch.einsum("rhgw,rhwd->rhgd", p, vv) / torch.where(l > 0, l, torch.ones_like(l))
        out[lo:hi] = (o * v_scale).reshape(hi - lo, hq, d)
    return out


def _reference(inp: Inputs, method: str, size: int) -> tuple[np.ndarray, str]:
    """(reference output, the method used): "numpy", "torch" (prefill entry points only; others
    fall back to numpy) or "auto" (numpy up to 2,000,000 units of ``Spec.size``)."""
    if method in ("auto", "torch") and inp.entry not in PREFILL_KIND:
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


# --------------------------------------------------------------------------------------------
# Running.
@dataclasses.dataclass
class CaseResult:
    """Outcome of one case: ``impl`` per implementation {rel_l2, max_abs, allclose, finite,
    zeros_ok, passed, seconds, error, skipped}; ``pair_max_abs`` / ``pair_ok`` Pallas vs Triton
    (None when either is missing); ``failures`` reasons; ``reference`` the method used."""

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
    """One implementation's output on the inputs, as a torch tensor."""
    fn = impl.fns.get(inp.entry)
    if fn is None:
        raise NotImplementedError(f"{impl.name} has no {inp.entry}")
    if impl.framework != "jax":
        return fn(*inp.args, **inp.kwargs, **impl.kwargs)
    from interop.dlpack import to_jax, to_torch  # noqa: PLC0415

    def jx(x):
        return to_jax(x) if type(x).__module__.startswith("torch") else x

    kwargs = {k: jx(x) for k, x in inp.kwargs.items()}  # block_indices= is a tensor
    return to_torch(fn(*[jx(x) for x in inp.args], **kwargs, **impl.kwargs))


def empty_mask(inp: Inputs) -> np.ndarray:
    """bool [rows, Hq]: outputs that must be exactly 0 (``interop.cases.empty_outputs``),
    from the inputs' metadata (captures carry no spec)."""
    n = inp.named()
    host = {k: x.cpu().numpy() for k, x in n.items()
            if hasattr(x, "cpu") and not x.is_floating_point()}
    if inp.entry in INDEX_ENTRIES:
        return C.empty_outputs(inp.entry, host, 1, 1)
    kv = n[PARAMS[inp.entry][0][1]]
    return C.empty_outputs(inp.entry, host, inp.args[0].shape[1], kv.shape[1],
                           pool_slots=kv.shape[0], rows=inp.args[0].shape[0])


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
    """Run every implementation on ``inp``, judged against ``ref`` and Pallas vs Triton;
    ``expected`` (a stored output) adds ``rel_l2_vs_expected`` (reported, not judged)."""
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
    """``evaluate`` one case against the ``reference`` ("numpy", "torch", "auto"); a failure to
    build the inputs or the reference (e.g. out of memory) fails the case."""
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
    """Per op: cases, passed, failed, max rel L2 per implementation (a crash: inf), skips and
    three of their reasons, max |Pallas - Triton|, the worst case (failed first, then rel L2)."""
    def rel(v: dict):
        return v.get("rel_l2", math.inf if "error" in v else None)

    summary: dict[str, dict] = {}
    for op in OPS:
        rs = [r for r in results if r.op == op]
        if not rs:
            continue
        worst = max(rs, key=lambda r: (not r.passed, max(
            [rel(v) or 0.0 for v in r.impl.values() if not v.get("skipped")], default=0.0)))
        s = summary[op] = {
            "cases": len(rs), "passed": sum(r.passed for r in rs),
            "failed": [r.name for r in rs if not r.passed], "worst_case": worst.name,
            "max_pallas_triton": max((r.pair_max_abs for r in rs if r.pair_max_abs is not None),
                                     default=None)}
        for name in impl_names:
            ran = [r.impl[name] for r in rs if name in r.impl and not r.impl[name].get("skipped")]
            skipped = [r for r in rs if r.impl.get(name, {}).get("skipped")]
            s[f"max_rel_l2[{name}]"] = max((v for v in map(rel, ran) if v is not None), default=None)
            s[f"skipped[{name}]"] = len(skipped)
            s[f"skip_reasons[{name}]"] = sorted({f"{r.name}: {r.impl[name]['skipped']}"
                                                 for r in skipped})[:3]
    return summary


def iter_names(specs: Iterable[Spec]) -> list[str]:
    """Case names (unique by construction; tests check it)."""
    return [s.name for s in specs]
