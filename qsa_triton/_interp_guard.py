"""The shared guards of ``qsa_triton``'s entry points: the interpreter checks (after the
contract check) and the refusal of arguments while Dynamo traces."""

from __future__ import annotations

import os

import torch
import triton

from interop.contract import FORWARD_ONLY, ContractError


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter now: ``TRITON_INTERPRET`` as Triton
    reads it (``triton.knobs.runtime.interpret``). The one interpreter check of ``qsa_triton``."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


# Triton reads TRITON_INTERPRET when a kernel is *defined* (at import); CPU tensors on kernels
# defined for the GPU crash deep inside Triton, so remember the value at import.
INTERPRETING_AT_IMPORT = interpreting()


def check_torch_tensors(fn: str, **tensors) -> None:
    """Raise ContractError for the first named argument that is not a torch.Tensor (the shared
    contract checker also accepts numpy/JAX arrays, which these entry points cannot launch on)."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise ContractError(fn, name, "a torch.Tensor (use qsa_pallas for JAX arrays)",
                                type(t).__module__ + "." + type(t).__qualname__)


def check_device(fn: str, device_type: str, arg: str = "q") -> None:
    """Raise ContractError (naming ``arg``, the tensor whose device decides) when
    ``device_type`` is not "cuda" and TRITON_INTERPRET was not set before ``qsa_triton`` was
    imported (the kernels were not defined for the interpreter)."""
    if device_type == "cuda" or INTERPRETING_AT_IMPORT:
        return
    late = " (it is set now, but only after qsa_triton was imported)" if interpreting() else ""
    raise ContractError(
        fn, arg, "a CUDA tensor, or CPU tensors with TRITON_INTERPRET=1 set before qsa_triton is "
        "imported (Triton reads it when the kernels are defined)", f"a {device_type} tensor{late}")


def check_interpreter_dtype(fn: str, dtype_name: str, got: str | None = None,
                            arg: str = "q") -> None:
    """Raise ContractError for bf16 under the CPU interpreter: in Triton 3.6-3.9 it multiplies
    bf16 ``tl.dot`` operands as raw bit patterns (architecture.md, "Things that bite"), unless
    ``tests/triton_interp_patch.py`` fixed the dot and set ``_qsa_bf16_dot_patched``. ``got``:
    what the caller passed, where the dots' dtype differs from it (FP8 q is computed in bf16);
    ``arg``: the argument named."""
    if dtype_name != "bfloat16" or not interpreting():
        return
    try:
        from triton.runtime import interpreter  # noqa: PLC0415
    except ImportError:
        return
    if getattr(interpreter, "_qsa_bf16_dot_patched", False):
        return
    raise ContractError(
        fn, arg, "float16 under the Triton CPU interpreter (TRITON_INTERPRET=1): its bf16 tl.dot "
        "multiplies raw bit patterns in Triton 3.6-3.9; use fp16 on CPU or a GPU for bf16",
        got or "bfloat16")


@torch.library.custom_op("qsa::contract_error", mutates_args=())
def _contract_error_op(x: torch.Tensor, fn: str, arg: str, expected: str,
                       got: str) -> torch.Tensor:
    """Raises ``ContractError(fn, arg, expected, got)``: how a wrapper refuses an argument while
    Dynamo traces it (a raise in traced Python cannot leave a fullgraph trace; one in a fake impl
    reaches the caller with its text)."""
    raise ContractError(fn, arg, expected, got)


@_contract_error_op.register_fake
def _contract_error_fake(x, fn, arg, expected, got):
    raise ContractError(fn, arg, expected, got)


def refuse_traced(q: torch.Tensor, fn: str, arg: str, expected: str, got) -> torch.Tensor:
    """A refusal while Dynamo traces a wrapper: ``qsa::contract_error``, whose fake impl raises
    ``ContractError(fn, arg, expected, str(got))``."""
    if isinstance(got, (int, float)) and not isinstance(got, bool):
        # a number Dynamo made symbolic (a compiled call saw a second value) cannot be
        # formatted while tracing; its plain value can (a guard on it, on this failing path)
        got = f"{float(got)!r}" if isinstance(got, float) else f"{int(got)!r}"
    return torch.ops.qsa.contract_error(q, fn, arg, expected, str(got))


def traced_refusal(q: torch.Tensor, fn: str, tensors: dict | None = None, **host_scalars):
    """Under torch.compile, before a wrapper turns its host scalars into op arguments: the first
    one given as a tensor is refused through ``qsa::contract_error`` (eager calls get the same
    refusal from the contract checks), then, while grad mode is on, the first of ``tensors``
    (name -> tensor) that requires grad (the ops have no autograd formula: AOT autograd would
    fail on it without our message, the eager backend only in backward()); returns that op's
    result, or None. A 0-d tensor scale would otherwise fail deep in Dynamo without the message."""
    for name, x in host_scalars.items():
        if isinstance(x, torch.Tensor):
            return refuse_traced(q, fn, name, "a host number (a Python float or int, not a "
                                 "tensor)", f"Tensor {list(x.shape)}")
    if torch.is_grad_enabled():
        for name, x in (tensors or {}).items():
            if isinstance(x, torch.Tensor) and x.requires_grad:
                # q detached: the refusal op itself must not need an autograd formula
                return refuse_traced(q.detach(), fn, name, FORWARD_ONLY, "requires_grad=True")
    return None
