"""The interpreter checks of ``qsa_triton``'s entry points (after the contract check).

In Triton 3.6-3.9 the CPU interpreter (``TRITON_INTERPRET=1``) multiplies **bf16** ``tl.dot``
operands as their raw 16-bit patterns (architecture.md, "Things that bite"): a correct bf16
kernel silently returns garbage on CPU. So bf16 is refused there with a ``ContractError`` unless
the test patch (``tests/triton_interp_patch.py``) has fixed the dot and set
``triton.runtime.interpreter._qsa_bf16_dot_patched``. fp16 and GPU runs are unaffected.
"""

from __future__ import annotations

import os

import triton

from interop.contract import ContractError


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter now: ``TRITON_INTERPRET`` as Triton
    reads it (``triton.knobs.runtime.interpret``). The one interpreter check of ``qsa_triton``."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


# Triton reads TRITON_INTERPRET when a @triton.jit function is *defined* (our kernels: when
# qsa_triton is imported); setting it later leaves compiled-GPU kernels that crash on CPU tensors
# deep inside Triton ("0 active drivers"). Remember the value the kernels were defined under.
INTERPRETING_AT_IMPORT = interpreting()


def check_torch_tensors(fn: str, **tensors) -> None:
    """Raise ContractError for the first named argument that is not a torch.Tensor (the shared
    contract checker also accepts numpy/JAX arrays, which these entry points cannot launch on)."""
    import torch  # noqa: PLC0415

    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise ContractError(fn, name, "a torch.Tensor (use qsa_pallas for JAX arrays)",
                                type(t).__module__ + "." + type(t).__qualname__)


def check_device(fn: str, device_type: str) -> None:
    """Raise ContractError when ``device_type`` is not "cuda" and TRITON_INTERPRET was not set
    before ``qsa_triton`` was imported (the kernels were not defined for the interpreter)."""
    if device_type == "cuda" or INTERPRETING_AT_IMPORT:
        return
    late = " (it is set now, but only after qsa_triton was imported)" if interpreting() else ""
    raise ContractError(
        fn, "q", "a CUDA tensor, or CPU tensors with TRITON_INTERPRET=1 set before qsa_triton is "
        "imported (Triton reads it when the kernels are defined)", f"a {device_type} tensor{late}")


def check_interpreter_dtype(fn: str, dtype_name: str) -> None:
    """Raise ContractError for ``dtype_name == "bfloat16"`` under an unpatched interpreter."""
    if dtype_name != "bfloat16" or not interpreting():
        return
    try:
        from triton.runtime import interpreter  # noqa: PLC0415
    except ImportError:
        return
    if getattr(interpreter, "_qsa_bf16_dot_patched", False):
        return
    raise ContractError(
        fn, "q", "float16 under the Triton CPU interpreter (TRITON_INTERPRET=1): its bf16 tl.dot "
        "multiplies raw bit patterns in Triton 3.6-3.9; use fp16 on CPU or a GPU for bf16",
        "bfloat16")
