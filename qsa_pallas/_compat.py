"""Pallas (Triton lowering) API shims across jax 0.10.2 (CPU CI) and 0.11.2 (the H200 machine),
shared by every ``qsa_pallas`` module; add, don't rename. What differs between the versions:

* ``CompilerParams`` vs the older ``TritonCompilerParams``; ``plgpu.load / store(ref.at[...])``
  vs the older ``pl.load(ref, idx)``; ``jax.shard_map(check_vma=)`` vs the older
  ``jax.experimental.shard_map.shard_map(check_rep=)`` (``pallas_call`` needs the check off);
* lowering without a GPU: 0.10.2 falls back to compute capability 9.0, 0.11.2 maps the
  ``AbstractDevice`` kind to sm_90 / sm_120 / sm_121. Both embed the kernel's Triton MLIR (TTIR)
  in a ``__gpu$xla.gpu.triton`` custom call, so ``lower_for_device_kind`` works on a CPU-only
  machine; ``triton_modules`` pulls the TTIR back out and ``compile_ttir`` runs the rest of
  Triton's pipeline (checked: jax 0.10.2 + Triton 3.9.0, jax 0.11.2 + Triton 3.6.0).

Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib
import inspect
import math
import os
import re
import tempfile
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.experimental import pallas as pl

from interop.arch import DeviceFacts, triton_version
from interop.contract import ContractError

try:  # the Triton-lowering namespace (deprecated in 0.11, still the only one with gathers)
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover - very old jax
    from jax.experimental.pallas import gpu as plgpu  # type: ignore[no-redef]

__all__ = ["pl", "plgpu", "CompilerParams", "triton_call", "load", "store", "barrier", "dot",
           "shard_map", "resolve_interpret", "check_inputs", "check_backend", "check_offsets",
           "abstract_mesh", "lower_for_device_kind", "TritonModule", "triton_modules",
           "compile_ttir", "target_facts", "forward_only"]

# Import the modules that ``pallas_call`` lowering imports lazily: jax 0.11.2's ``jaxpr_fusion``
# registers a config option that is part of every jit trace context, so importing it mid-session
# makes every function jitted before recompile once. Best effort (absent in some jax versions).
for _name in ("jax._src.pallas.fuser.jaxpr_fusion",
              "jax._src.pallas.triton.pallas_call_registration"):
    try:
        importlib.import_module(_name)
    except Exception:  # noqa: BLE001 - absent / optional deps in other jax versions
        pass
del _name

CompilerParams = getattr(plgpu, "CompilerParams", None) or getattr(plgpu, "TritonCompilerParams")


def forward_only(fn: Callable) -> Callable:
    """Make a public entry point refuse differentiation with a ``ContractError``.

    The kernels have no derivative rules: without this, ``jax.grad`` / ``jax.jvp`` through a call
    would fail inside Pallas' jvp rule with a bare ``AssertionError``. The traced array
    arguments go through a ``jax.custom_jvp`` whose rule raises at trace time, naming the
    argument that carries a tangent (symbolic zeros tell which); inputs all under
    ``jax.lax.stop_gradient`` give a constant. Calls without tracers run ``fn`` directly; under
    ``jax.jit`` the custom_jvp lowers to ``fn``'s own program. Raises (from the returned
    function, at trace time) ContractError: a tangent reaches an array argument. Source: our
    own, on ``jax.custom_jvp`` (``defjvp(..., symbolic_zeros=True)``).
    """
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
        traced = [i for i, x in enumerate(leaves) if isinstance(x, jax.core.Tracer)]
        if not traced:
            return fn(*args, **kwargs)
        names = _leaf_names(sig, args, kwargs, leaves)

        def run(*arrays):
            new = list(leaves)
            for i, a in zip(traced, arrays):
                new[i] = a
            a2, k2 = jax.tree_util.tree_unflatten(tree, new)
            return fn(*a2, **k2)

        call = jax.custom_jvp(run)

        def refuse(primals, tangents):
            moving = [names[i] for i, t in zip(traced, tangents)
                      if not isinstance(t, _SYMBOLIC_ZERO)]
            if not moving:  # every input under stop_gradient: a constant, as for any function
                out = run(*primals)
                return out, jax.tree_util.tree_map(_zero_tangent, out)
            raise ContractError(fn.__name__, moving[0],
                                "no tangent: the kernels are forward-only (no JVP/VJP rule; "
                                "pass jax.lax.stop_gradient(x) to use the call in a "
                                "differentiated function)", "jax.jvp / jax.grad through it")

        call.defjvp(refuse, symbolic_zeros=True)
        return call(*(leaves[i] for i in traced))

    return wrapper


# a jax without the public symbolic-zero type refuses every traced call under jvp (never wrong)
_SYMBOLIC_ZERO = getattr(jax.custom_derivatives, "SymbolicZero", ())


def _zero_tangent(x):
    if jax.numpy.issubdtype(x.dtype, jax.numpy.inexact):
        return jax.numpy.zeros_like(x)
    return np.zeros(x.shape, jax.dtypes.float0)


def _leaf_names(sig: inspect.Signature, args, kwargs, leaves) -> list[str]:
    """The parameter name of each of ``leaves``, the pytree leaves of ``(args, kwargs)``."""
    bound = sig.bind_partial(*args, **kwargs)
    by_id: dict[int, str] = {}
    for name, value in bound.arguments.items():
        for leaf in jax.tree_util.tree_leaves(value):
            by_id.setdefault(id(leaf), name)
    return [by_id.get(id(x), "an array argument") for x in leaves]


def triton_call(kernel: Callable, *, out_shape, grid, in_specs=None, out_specs=None,
                num_warps: int | None = None, num_stages: int | None = None,
                interpret: bool = False, name: str | None = None,
                input_output_aliases: dict[int, int] | None = None, debug: bool = False):
    """``pl.pallas_call`` pinned to the Triton lowering; ``interpret=True`` runs it on CPU."""
    given = dict(in_specs=in_specs, out_specs=out_specs, name=name,
                 input_output_aliases=dict(input_output_aliases or {}) or None)
    return pl.pallas_call(kernel, out_shape=out_shape, grid=grid, interpret=interpret,
                          compiler_params=CompilerParams(num_warps=num_warps,
                                                         num_stages=num_stages),
                          debug=debug, **{k: v for k, v in given.items() if v is not None})


def load(ref, *, mask=None, other=None, eviction_policy: str | None = None):
    """Masked load of ``ref`` (index with ``ref.at[...]`` first). Masked-off lanes read ``other``
    and are never dereferenced on the GPU."""
    if hasattr(plgpu, "load"):
        kw = {} if eviction_policy is None else {"eviction_policy": eviction_policy}
        return plgpu.load(ref, mask=mask, other=other, **kw)
    return pl.load(ref, (), mask=mask, other=other)  # pragma: no cover - old jax


def store(ref, val, *, mask=None):
    """Masked store into ``ref`` (index with ``ref.at[...]`` first)."""
    if hasattr(plgpu, "store"):
        return plgpu.store(ref, val, mask=mask)
    return pl.store(ref, (), val, mask=mask)  # pragma: no cover - old jax


def barrier(interpret: bool) -> None:
    """A CTA barrier (``__syncthreads``: every thread's global writes before it are visible to
    the CTA's threads after it). Interpret mode runs a program as whole-array ops in order and
    has no lowering for it: nothing."""
    if not interpret:
        plgpu.debug_barrier()


def dot(a, b, *, trans_b: bool = False):
    """2-D matmul with FP32 accumulation (lowers to ``tt.dot``; inputs bf16/fp16 stay 16-bit)."""
    import jax.numpy as jnp  # noqa: PLC0415

    if trans_b:
        b = b.T
    return jnp.dot(a, b, preferred_element_type=jnp.float32)


def value_operand(v, mask, dtype):
    """A loaded V tile ``v`` ([BLOCK_N, D]; ``mask`` its row mask, broadcastable) as the P.V
    operand in ``dtype``. An FP8 tile is converted in its load layout behind a select (a no-op
    on masked rows, which read 0): a cast alone is moved past the load into the operand layout,
    four rows' bytes per register (byte-wide shared loads); behind the select V is staged as
    ``dtype`` and read by ``ldmatrix`` (the Triton twins do the same; bench/NOTES.md, "FP8 V in
    its load layout"). Other dtypes: a plain cast."""
    import jax.numpy as jnp  # noqa: PLC0415

    if v.dtype == dtype:
        return v
    if jnp.dtype(v.dtype).itemsize == 1:
        return jnp.where(mask, v.astype(dtype), 0.0)
    return v.astype(dtype)


def shard_map(f: Callable, *, mesh, in_specs, out_specs, check: bool = False) -> Callable:
    """``jax.shard_map`` with the replication/VMA check switched (off by default: a
    ``pallas_call`` inside ``shard_map`` fails the VMA check in jax 0.10+)."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check)
    from jax.experimental.shard_map import shard_map as _sm  # noqa: PLC0415  # pragma: no cover

    return _sm(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=check)


def _abstract_gpu():
    """The abstract CUDA device of an enclosing ``jax.sharding.use_abstract_mesh`` (lowering
    for a GPU without one), else None."""
    try:
        abstract = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    except Exception:  # noqa: BLE001 - older jax without abstract meshes
        return None
    return abstract if abstract is not None and abstract.platform in ("cuda", "gpu") else None


def target_facts():
    """``interop.arch.DeviceFacts`` of the GPU the kernels are built for: the abstract device of
    an enclosing ``jax.sharding.use_abstract_mesh`` (lowering without a GPU), else jax's first
    device if it is a GPU; None on a CPU-only jax or for an unknown compute capability."""
    abstract = _abstract_gpu()
    try:
        if abstract is not None and getattr(abstract, "device_kind", None):
            return DeviceFacts.from_device_kind(abstract.device_kind, triton_version())
        dev = jax.devices()[0]
        return DeviceFacts.from_jax(dev) if dev.platform == "gpu" else None
    except (ValueError, KeyError, RuntimeError):
        return None


# ---------------------------------------------------------------------------------------------
# Argument checks (ContractError before anything is traced)
def check_inputs(fn: str, interpret: bool | None, **arrays) -> None:
    """Refuse an ``interpret`` that is neither None nor a host bool, torch tensors and
    ``jax.ShapeDtypeStruct``s (the contract check reads their shapes; JAX cannot compute on
    them), and anything else that is not a jax.Array, a numpy array or None (lists, scalars)."""
    if interpret is not None and not isinstance(interpret, (bool, np.bool_)):
        raise ContractError(fn, "interpret", "None (interpret mode on a CPU backend, compiled "
                            "kernels on a GPU) or a host bool", type(interpret).__name__)
    for name, a in arrays.items():
        if type(a).__module__.split(".")[0] == "torch":
            raise ContractError(fn, name, "a jax.Array or numpy array (torch tensors: use "
                                "qsa_triton, or interop.dlpack to hand them to JAX zero-copy)",
                                type(a).__module__ + "." + type(a).__qualname__)
        if isinstance(a, jax.ShapeDtypeStruct):
            raise ContractError(fn, name, "a jax.Array or numpy array (a ShapeDtypeStruct has no "
                                "data: trace with jax.jit(f).lower(...) or jax.eval_shape)",
                                "jax.ShapeDtypeStruct")
        # (None: an optional array; the contract checker says when it is required)
        if a is not None and not isinstance(a, (jax.Array, np.ndarray)):
            raise ContractError(fn, name, "a jax.Array or numpy array",
                                type(a).__module__ + "." + type(a).__qualname__)


def check_backend(fn: str, interpret: bool | None, *arrays) -> None:
    """Refuse ``interpret=False`` on a CPU-only JAX (run after the contract check), eager or
    under ``jax.jit`` / ``shard_map``, unless lowering for an abstract CUDA device
    (``lower_for_device_kind``: compiled kernels built without a GPU)."""
    if interpret is False and jax.default_backend() == "cpu" and _abstract_gpu() is None:
        raise ContractError(fn, "interpret", "True or None on a CPU-only JAX (compiled Pallas "
                            "kernels need a CUDA GPU backend)", interpret)


def check_offsets(fn: str, **arrays) -> None:
    """Refuse arrays whose element offsets need 64 bits while the lowering uses int32: it
    switches to int64 offsets only for refs over 2**32 bytes (``_compute_offsets_from_indices``,
    jax 0.10.2 and 0.11.2), so a 1-byte array of more than 2**31 elements (up to 2**32 bytes)
    would wrap; 2**31 elements exactly still fit (largest offset 2**31 - 1)."""
    for name, a in arrays.items():
        numel = math.prod(a.shape)
        if numel - 1 > 2**31 - 1 and numel * np.dtype(a.dtype).itemsize <= 2**32:
            raise ContractError(fn, name, "at most 2**31 elements, or more than 2**32 bytes "
                                "(the Pallas Triton lowering uses int32 offsets below 2**32 "
                                "bytes; qsa_triton has no such limit)",
                                f"{numel} elements of {a.dtype}")


def resolve_interpret(interpret: bool | None) -> bool:
    """``None`` -> interpret on CPU, compiled Triton kernel on GPU; a bool is taken as given."""
    return jax.default_backend() == "cpu" if interpret is None else bool(interpret)


# ---------------------------------------------------------------------------------------------
# Abstract-device lowering (CPU CI lowers every kernel for CUDA without a GPU)
def abstract_mesh(device_kind: str, axis_sizes: Sequence[int] = (1,),
                  axis_names: Sequence[str] = ("x",), platform: str = "cuda"):
    """A ``jax.sharding.AbstractMesh`` whose ``AbstractDevice`` has the given device kind, its
    axes ``Auto``: under jax 0.11's default ``Explicit`` axes every aval carries a sharding, and
    the Pallas Triton lowering of a reduction inside nested loops then fails (the indexer's
    128k prefill plan), which a user's ``jax.jit`` / ``shard_map`` never sees."""
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType  # noqa: PLC0415

    dev = AbstractDevice(device_kind=device_kind, num_cores=None, platform=platform)
    return AbstractMesh(tuple(axis_sizes), tuple(axis_names), abstract_device=dev,
                        axis_types=(AxisType.Auto,) * len(axis_sizes))


def lower_for_device_kind(fn: Callable, args: Sequence[Any], device_kind: str, *,
                          platform: str = "cuda", static_argnames: Sequence[str] | None = None,
                          kwargs: dict[str, Any] | None = None):
    """Trace and lower ``fn(*args, **kwargs)`` (a function, jitted here with
    ``static_argnames``, or a jitted one; args ``jax.ShapeDtypeStruct`` or arrays) for CUDA
    under an abstract device of ``device_kind`` (e.g. "NVIDIA H200"). Returns
    ``jax.stages.Lowered``; raises what the Pallas Triton lowering raises."""
    jitted = fn if hasattr(fn, "trace") else jax.jit(fn, static_argnames=static_argnames)
    with jax.sharding.use_abstract_mesh(abstract_mesh(device_kind, platform=platform)):
        traced = jitted.trace(*args, **(kwargs or {}))
        return traced.lower(lowering_platforms=(platform,))


@dataclasses.dataclass(frozen=True)
class TritonModule:
    """One Pallas kernel as embedded in a lowered module: its name, Triton MLIR bytecode,
    num_warps, num_stages and grid (x, y, z)."""

    name: str
    ttir: bytes
    num_warps: int
    num_stages: int
    grid: tuple[int, int, int]

    def text(self) -> str:
        """The TTIR as text (parsed with jaxlib's Triton dialect)."""
        return _ttir_text(self.ttir)


def triton_modules(lowered) -> list[TritonModule]:
    """The Triton kernels embedded in a lowered jax computation (``__gpu$xla.gpu.triton`` calls)."""
    found: list[TritonModule] = []

    def visit(op):
        o = op.operation if hasattr(op, "operation") else op
        if o.name == "stablehlo.custom_call":
            target = str(o.attributes["call_target_name"]).strip('"')
            if "triton" in target and "mhlo.backend_config" in o.attributes:
                cfg = o.attributes["mhlo.backend_config"]
                ir_attr = cfg["ir"]
                raw = (ir_attr.value_bytes if hasattr(ir_attr, "value_bytes")
                       else bytes(str(ir_attr), "latin1"))
                found.append(TritonModule(
                    str(cfg["name"]).strip('"'), raw, _int_attr(cfg["num_warps"]),
                    _int_attr(cfg["num_stages"]),
                    (_int_attr(cfg["grid_x"]), _int_attr(cfg["grid_y"]), _int_attr(cfg["grid_z"]))))
        for region in o.regions:
            for block in region.blocks:
                for inner in block.operations:
                    visit(inner)

    visit(lowered.compiler_ir("stablehlo").operation)
    return found


def _int_attr(a) -> int:
    try:
        return int(a.value)
    except AttributeError:
        return int(str(a).split(":")[0].strip())


@functools.lru_cache(maxsize=64)
def _ttir_text(raw: bytes) -> str:
    from jax._src.lib.mlir import ir  # noqa: PLC0415
    from jax._src.pallas.triton import lowering as tl  # noqa: PLC0415

    ctx_factory = getattr(tl, "_new_ir_context", None)
    cm = ctx_factory() if ctx_factory is not None else contextlib.nullcontext()
    with cm as ctx:
        ctx = ctx if ctx is not None else ir.Context()
        return str(ir.Module.parse(raw, context=ctx))


@functools.lru_cache(maxsize=256)
def compile_ttir(module: TritonModule, capability: int, *, num_warps: int | None = None,
                 num_stages: int | None = None) -> dict[str, Any]:
    """Compile one embedded kernel's TTIR to a CUDA binary for ``capability`` (90, 120, 121...)
    with the installed ``triton``, without a GPU; cached. Triton's pipeline rejects e.g. a
    configuration too big for the target, but not sm_120/121's 101,376-byte shared-memory limit:
    compare ``result["shared"]``.

    Returns dict(name, shared (bytes per program), num_warps, num_stages, capability, cubin,
    ptx).
    Raises ImportError (no triton) or any Triton compile error.
    """
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silence Triton 3.9's notice
    import triton  # noqa: PLC0415
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415

    nw = module.num_warps if num_warps is None else num_warps
    ns = module.num_stages if num_stages is None else num_stages
    # a path named by the TTIR, so the line info (and the PTX) of one kernel is the same text
    # in every compile, whatever the process
    folder = os.path.join(tempfile.gettempdir(),
                          "qsa-ttir-" + hashlib.sha1(module.ttir).hexdigest())
    path = os.path.join(folder, re.sub(r"[^A-Za-z0-9_]", "_", module.name) + ".ttir")
    os.makedirs(folder, exist_ok=True)
    with open(f"{path}.{os.getpid()}", "w") as fh:
        fh.write(module.text())
    os.replace(f"{path}.{os.getpid()}", path)
    try:
        compiled = triton.compile(path, target=GPUTarget("cuda", int(capability), 32),
                                  options=dict(num_warps=nw, num_stages=ns))
    finally:
        with contextlib.suppress(OSError):  # another process may be compiling the same kernel
            os.remove(path)
            os.rmdir(folder)
    return dict(name=compiled.metadata.name, shared=int(compiled.metadata.shared), num_warps=nw,
                num_stages=ns, capability=int(capability), cubin=compiled.asm.get("cubin"),
                ptx=compiled.asm.get("ptx"))
