"""The differential runner behind ``qsa check``: identical inputs to the Pallas and the Triton
kernels (zero-copy through ``interop.dlpack``), each compared with the FP64 reference and with
each other, optionally with upstream SGLang's kernels (``interop.validate.peer``) as an independent oracle.

The case matrix is data (``DecodeSpec`` / ``PrefillSpec`` lists):
  * ``full_matrix()`` (GPU): decode TP1/TP2/TP4 x every B in 1..16, 17, 24, 32, 48, 64, 96, 128 x
    short/medium/saturated rows (D = 256, bf16, max_seqlen_k = 2051); prefill ordinary/chunk/paged
    x G 3, 6, 12 x Hkv 1, 2 x KV 8k/32k/128k x 8192 rows (W = 2051, realistic block-structured
    indices), plus rows with junk after the valid prefix, rows with no valid entry, ragged
    batches, per-KV-head indices and FP8 K/V.
  * ``quick_matrix()`` (CPU, interpret mode): the same kinds of cases at tiny sizes (D = 64 mostly,
    fp16 because the Triton interpreter's bf16 dot is wrong, W = 35 or 67).

Pass criteria per implementation and case (``qsa-contract.md`` §6): finite output, elementwise
``|out - ref| <= atol + rtol * |ref|`` with rtol = atol = 2e-2, relative L2 <= 5e-3, exact zeros on
rows/sequences with no valid key; and Pallas vs Triton elementwise within the same tolerance.

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

from interop import indices as I
from interop import reference as R
from interop.cases import (ATOL, DECODE_BATCHES, OPS, PREFILL_KINDS, REL_L2, RTOL, TP_SHAPES,  # noqa: F401
                    DecodeSpec, PrefillSpec, Spec, full_matrix, quick_matrix)

__all__ = [
    "RTOL", "ATOL", "REL_L2", "OPS", "DecodeSpec", "PrefillSpec", "quick_matrix", "full_matrix",
    "select_ops", "Implementation", "load_implementations", "load_peer", "peer_indices", "peer_prefill_skip",
    "prepare_backends",
    "has_cuda", "Inputs", "build_inputs", "torch_reference", "CaseResult", "run_case", "run_matrix",
    "summarize", "TP_SHAPES", "DECODE_BATCHES", "evaluate", "empty_mask", "numpy_reference",
    "ENTRY", "PARAMS",
]

def select_ops(text: str | None) -> tuple[str, ...]:
    """Parse ``--ops`` ("decode,prefill").

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
      fns: entry point name -> callable (``sparse_decode``, ``sparse_prefill``,
        ``sparse_prefill_chunk``, ``sparse_prefill_paged``), the contract's signatures.
      kwargs: extra keyword arguments for every call (Pallas: ``interpret``).
      supports: optional predicate (spec -> reason or None) for cases it cannot run (skipped).
    """

    name: str
    framework: str
    fns: dict[str, Callable]
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    supports: Callable[[Spec], str | None] | None = None


ENTRY = {"decode": "sparse_decode", "ordinary": "sparse_prefill", "chunk": "sparse_prefill_chunk",
         "paged": "sparse_prefill_paged"}
#: positional parameters of each entry point (qsa-contract.md), then its keyword parameters
PARAMS = {
    "sparse_decode": (("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_k"),
                      ("softmax_scale",)),
    "sparse_prefill": (("q", "k", "v", "indices", "cu_seqlens", "max_seqlen_q"), ("softmax_scale",)),
    "sparse_prefill_chunk": (("q", "k", "v", "indices", "cu_seqlens_q", "cu_seqlens_k", "kv_lens",
                              "max_seqlen_q"), ("softmax_scale", "k_scale", "v_scale")),
    "sparse_prefill_paged": (("q", "k_cache", "v_cache", "slot_table", "indices", "cu_seqlens_q",
                              "kv_lens", "max_seqlen_q"), ("softmax_scale", "k_scale", "v_scale")),
}


def _entry_points(module_names: Sequence[str]) -> dict[str, Callable]:
    import importlib  # noqa: PLC0415

    fns: dict[str, Callable] = {}
    for mod_name in module_names:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        for name in ENTRY.values():
            if name not in fns and callable(getattr(mod, name, None)):
                fns[name] = getattr(mod, name)
    return fns


def load_implementations(interpret: bool) -> list[Implementation]:
    """qsa_triton and qsa_pallas entry points (call ``prepare_backends`` first)."""
    triton_fns = _entry_points(["qsa_triton", "qsa_triton.decode", "qsa_triton.prefill"])
    pallas_fns = _entry_points(["qsa_pallas", "qsa_pallas.decode", "qsa_pallas.prefill"])
    return [Implementation("triton", "torch", triton_fns,
                           supports=_interpreter_bf16_guard if interpret else None),
            Implementation("pallas", "jax", pallas_fns, {"interpret": bool(interpret)})]


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

    def paged(q, k_cache, v_cache, slot_table, indices, cu_q, kv_lens, max_seqlen_q,
              softmax_scale=None, k_scale=1.0, v_scale=1.0):
        k_cache, v_cache = _deq(q, k_cache, v_cache)
        indices = peer_indices(indices, cu_q, kv_lens)
        out = sa.sparse_gqa_paged_prefill_triton(q, k_cache, v_cache, slot_table, indices, cu_q,
                                                 kv_lens, _scale(q, softmax_scale) * k_scale,
                                                 max_q=max_seqlen_q)
        return out if v_scale == 1.0 else (out.float() * v_scale).to(q.dtype)

    def supports(spec: Spec) -> str | None:
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


def _torch_dtype(torch, name: str):
    return getattr(torch, name)


def _randn(torch, shape, dtype, device, gen):
    x = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
    return x.to(dtype)


def build_inputs(spec: Spec, device: str = "cpu") -> Inputs:
    """Seeded inputs of one case as torch tensors on ``device``.

    Values are N(0, 1) in the case's dtype (FP8 K/V: N(0, 1) cast to float8_e4m3fn); metadata and
    indices come from ``interop.indices`` (realistic block-structured prefill indices).
    """
    import torch  # noqa: PLC0415

    gen = torch.Generator(device=device)
    gen.manual_seed(1000 + spec.seed)
    dt = _torch_dtype(torch, spec.dtype)
    i32 = lambda a: torch.as_tensor(np.asarray(a, np.int32), device=device)  # noqa: E731
    if isinstance(spec, DecodeSpec):
        c = I.decode_case(spec.batch, spec.pattern, max_len=spec.max_len, seed=spec.seed,
                          zero_rows=spec.zero_rows, capacity_slack=spec.slack)
        if spec.pad_capacity:
            c = dataclasses.replace(c, capacity=spec.batch * spec.max_len + spec.slack)
        q = _randn(torch, (spec.batch, spec.hq, spec.d), dt, device, gen)
        k = _randn(torch, (c.capacity, spec.hkv, spec.d), dt, device, gen)
        v = _randn(torch, (c.capacity, spec.hkv, spec.d), dt, device, gen)
        if spec.poison and spec.slack:
            k[int(c.cu_seqlens_k[-1]):] = float("nan")
            v[int(c.cu_seqlens_k[-1]):] = float("nan")
        empty = np.repeat((c.lengths == 0)[:, None], spec.hq, axis=1)
        return Inputs("sparse_decode", [q, k, v, i32(c.cu_seqlens_q), i32(c.cu_seqlens_k),
                                        c.max_seqlen_k], {"softmax_scale": None}, empty,
                      {"lengths": c.lengths})
    lay = I.prefill_layout(spec.kind, spec.q_lens, spec.kv_lens, pool_slack=spec.pool_slack,
                           seed=spec.seed)
    idx = I.prefill_indices(lay.q_lens, None if spec.kind == "ordinary" else lay.kv_lens,
                            width=spec.width, junk=spec.junk, empty_rows=spec.empty_rows,
                            overlap=spec.overlap, num_kv_heads=spec.hkv if spec.per_head else None,
                            seed=spec.seed)
    t = int(lay.cu_seqlens_q[-1])
    q = _randn(torch, (t, spec.hq, spec.d), dt, device, gen)
    rows = t if spec.kind == "ordinary" else (int(lay.cu_seqlens_k[-1]) if spec.kind == "chunk"
                                              else lay.pool_slots)
    kvdt = _torch_dtype(torch, spec.kv_dtype) if spec.kv_dtype else dt
    k = _randn(torch, (rows, spec.hkv, spec.d), kvdt, device, gen)
    v = _randn(torch, (rows, spec.hkv, spec.d), kvdt, device, gen)
    _, _, _, bound = I.row_layout(lay.q_lens, lay.kv_lens)
    valid = I.valid_mask(idx if idx.ndim == 3 else idx[:, None, :], bound[:, None])
    g = spec.hq // spec.hkv
    empty = np.repeat(~valid.any(-1), g if idx.ndim == 3 else spec.hq, axis=1)
    ti = torch.as_tensor(idx, device=device)
    kw: dict[str, Any] = {"softmax_scale": None}
    if spec.kind != "ordinary":
        kw.update(k_scale=spec.k_scale, v_scale=spec.v_scale)
    if spec.kind == "ordinary":
        args = [q, k, v, ti, i32(lay.cu_seqlens_q), lay.max_seqlen_q]
    elif spec.kind == "chunk":
        args = [q, k, v, ti, i32(lay.cu_seqlens_q), i32(lay.cu_seqlens_k), i32(lay.kv_lens),
                lay.max_seqlen_q]
    else:
        args = [q, k, v, i32(lay.slot_table), ti, i32(lay.cu_seqlens_q), i32(lay.kv_lens),
                lay.max_seqlen_q]
    return Inputs(ENTRY[spec.kind], args, kw, empty, {"layout": lay})


# --------------------------------------------------------------------------------------------
# References.
def _np64(t) -> np.ndarray:
    return t.detach().float().cpu().numpy().astype(np.float64)


def numpy_reference(spec: Spec | None, inp: Inputs) -> np.ndarray:
    """``interop.reference`` (float64 numpy) on the inputs (dispatch on ``inp.entry``; ``spec``
    is unused, kept for symmetry)."""
    a = inp.args
    kw = inp.kwargs
    host = [x.cpu().numpy() if hasattr(x, "cpu") and not x.is_floating_point() else x for x in a]
    if inp.entry == "sparse_decode":
        used = int(host[4][-1]) if len(host[4]) else 0  # rows past cu_seqlens_k[B] are never read
        return R.decode_reference(_np64(a[0]), _np64(a[1][:used]), _np64(a[2][:used]), host[3],
                                  host[4], kw.get("softmax_scale"))
    if inp.entry == "sparse_prefill":
        return R.prefill_reference(_np64(a[0]), _np64(a[1]), _np64(a[2]), host[3], host[4],
                                   kw.get("softmax_scale"))
    if inp.entry == "sparse_prefill_chunk":
        return R.prefill_chunk_reference(_np64(a[0]), _np64(a[1]), _np64(a[2]), host[3], host[4],
                                         host[5], host[6], kw.get("softmax_scale"),
                                         kw.get("k_scale", 1.0), kw.get("v_scale", 1.0))
    if inp.entry == "sparse_prefill_paged":
        return R.prefill_paged_reference(_np64(a[0]), _np64(a[1]), _np64(a[2]), host[3], host[4],
                                         host[5], host[6], kw.get("softmax_scale"),
                                         kw.get("k_scale", 1.0), kw.get("v_scale", 1.0))
    raise ValueError(f"unknown entry point {inp.entry!r}")


def torch_reference(spec: Spec | None, inp: Inputs, *, budget_bytes: int = 1 << 30):
    """The same semantics as ``interop.reference`` in float64 torch, batched over rows (for the
    full matrix on the GPU, where the per-row numpy loop is too slow). Dispatches on
    ``inp.entry``; ``spec`` is unused.

    Per row: entry valid iff 0 <= idx < bound (request length or kv_lens[b]); invalid entries are
    clamped to a safe position for the gather and masked to -inf; a row with no valid entry is 0.

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
    if kind == "ordinary":
        k, v, idx, cu_q = a[1], a[2], a[3], a[4]
        lens = cu_q[1:] - cu_q[:-1]
        base = cu_q[:-1]
        table = None
    elif kind == "chunk":
        k, v, idx, cu_q, cu_k, lens = a[1], a[2], a[3], a[4], a[5], a[6]
        base, table = cu_k[:-1], None
    else:
        k, v, table, idx, cu_q, lens = a[1], a[2], a[3], a[4], a[5], a[6]
        base = None
    req = torch.searchsorted(cu_q[1:].long(), torch.arange(t, device=dev), right=True)
    bound = lens.long()[req]
    idx3 = idx.long() if idx.ndim == 3 else idx.long()[:, None, :]
    w = idx3.shape[-1]
    per_row = hkv * w * d * 8 * 3 + hq * w * 8 * 2
    step = max(1, min(t, budget_bytes // max(per_row, 1)))
    out = torch.zeros((t, hq, d), dtype=torch.float64, device=dev)
    heads = torch.arange(hkv, device=dev)
    for lo in range(0, t, step):
        hi = min(t, lo + step)
        ix = idx3[lo:hi].expand(-1, hkv, -1) if idx3.shape[1] == 1 else idx3[lo:hi]
        bnd = bound[lo:hi, None, None]
        valid = (ix >= 0) & (ix < bnd)
        safe = torch.where(valid, ix, torch.zeros_like(ix))
        if table is None:
            rows = base.long()[req[lo:hi]][:, None, None] + safe
        else:
            rows = torch.gather(table.long()[req[lo:hi]], 1, safe.reshape(hi - lo, -1)).reshape(safe.shape)
        kk = k[rows, heads[None, :, None]].double()  # [R, Hkv, W, D]
        vv = v[rows, heads[None, :, None]].double()
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
    """Run one implementation on the inputs; returns the output as a float64 numpy array."""
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


def _compare(out: np.ndarray, ref: np.ndarray, empty: np.ndarray,
             rel_l2_limit: float = REL_L2) -> dict:
    finite = bool(np.isfinite(out).all())
    diff = np.abs(out - ref)
    max_abs = float(np.nanmax(diff)) if diff.size else 0.0
    allclose = bool(finite and np.all(diff <= ATOL + RTOL * np.abs(ref)))
    rel = R.rel_l2(out, ref) if finite else float("inf")
    zeros_ok = bool(np.all(out[empty] == 0.0)) if empty.any() else True
    return {"rel_l2": rel, "max_abs": max_abs if finite else float("inf"), "allclose": allclose,
            "finite": finite, "zeros_ok": zeros_ok,
            "passed": finite and allclose and rel <= rel_l2_limit and zeros_ok}


def empty_mask(inp: Inputs) -> np.ndarray:
    """bool [rows, Hq]: output rows that must be exactly 0 (a decode sequence with no key, a
    prefill row/KV head with no valid index entry), computed from the inputs on the host."""
    a = inp.args
    hq = a[0].shape[1]
    host = lambda x: x.cpu().numpy().astype(np.int64)  # noqa: E731
    if inp.entry == "sparse_decode":
        return np.repeat((np.diff(host(a[4])) == 0)[:, None], hq, axis=1)
    hkv = a[1].shape[1]
    if inp.entry == "sparse_prefill":
        idx, cu_q = host(a[3]), host(a[4])
        lens = np.diff(cu_q)
    elif inp.entry == "sparse_prefill_chunk":
        idx, cu_q, lens = host(a[3]), host(a[4]), host(a[6])
    else:
        idx, cu_q, lens = host(a[4]), host(a[5]), host(a[6])
    req = np.searchsorted(cu_q[1:], np.arange(idx.shape[0]), side="right")
    idx3 = idx if idx.ndim == 3 else idx[:, None, :]
    valid = I.valid_mask(idx3, lens[req][:, None]).any(-1)  # [rows, 1 or Hkv]
    return np.repeat(np.broadcast_to(valid, (idx.shape[0], hkv)), hq // hkv, axis=1) == 0


def _reference(inp: Inputs, method: str, size: int) -> tuple[np.ndarray, str]:
    if method == "auto":
        method = "numpy" if size <= 2_000_000 or inp.entry == "sparse_decode" else "torch"
    if method == "numpy":
        return numpy_reference(None, inp), method
    if method == "torch":
        on_gpu = getattr(inp.args[0], "is_cuda", False)
        return torch_reference(None, inp, budget_bytes=(4 << 30) if on_gpu else (1 << 30)
                               ).cpu().numpy(), method
    raise ValueError(f"reference must be auto|numpy|torch, got {method!r}")


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
            out = _np64(out_t)
            if out.shape != ref.shape:
                raise ValueError(f"output shape {list(out.shape)}, expected {list(ref.shape)}")
            r = _compare(out, ref, empty, rel_l2_limit)
            if expected is not None:
                r["rel_l2_vs_expected"] = R.rel_l2(out, expected) if r["finite"] else float("inf")
            outs[impl.name] = out
        except Exception as e:  # noqa: BLE001 - a crash is a failed case, reported by name
            r = {"passed": False, "error": f"{type(e).__name__}: {e}".splitlines()[0][:300],
                 "traceback": traceback.format_exc(limit=4)}
        r["seconds"] = time.perf_counter() - t1
        results[impl.name] = r
        if not r["passed"]:
            if "error" in r:
                failures.append(f"{impl.name}: {r['error']}")
            else:
                why = [w for w, ok in (("non-finite output", r["finite"]),
                                       (f"rel L2 {r['rel_l2']:.2e} > {rel_l2_limit:g}",
                                        r["rel_l2"] <= rel_l2_limit),
                                       (f"max |err| {r['max_abs']:.3g} beyond rtol=atol={RTOL:g}",
                                        r["allclose"]),
                                       ("rows without valid keys not exactly 0", r["zeros_ok"]))
                       if not ok]
                failures.append(f"{impl.name}: " + "; ".join(why))
    pair_max = pair_ok = None
    if "triton" in outs and "pallas" in outs:
        d = np.abs(outs["pallas"] - outs["triton"])
        pair_max = float(d.max()) if d.size else 0.0
        pair_ok = bool(np.all(d <= ATOL + RTOL * np.abs(outs["triton"])))
        if not pair_ok:
            failures.append(f"pallas vs triton: max |diff| {pair_max:.3g} beyond rtol=atol={RTOL:g}")
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


def run_matrix(specs: Sequence[Spec], impls: Sequence[Implementation], *, device: str = "cpu",
               reference: str = "auto", progress: Callable[[Spec, CaseResult], None] | None = None
               ) -> list[CaseResult]:
    """Run every case (sequentially); ``progress(spec, result)`` after each."""
    out = []
    for spec in specs:
        res = run_case(spec, impls, device=device, reference=reference)
        out.append(res)
        if progress is not None:
            progress(spec, res)
    return out


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
