"""Test-only patch: make the Triton interpreter's bf16 arithmetic match the GPU's.

Two fixes, both only where bf16 is involved:
  1. ``tl.dot`` reads **bf16** operands as numbers (below);
  2. float32 -> bf16 casts round to nearest even, as ``cvt.rn.bf16.f32`` does on the GPU; the
     interpreter (``InterpreterBuilder.cast_impl``, Triton 3.6-3.9) truncates, which biases every
     bf16 P tile and output by up to 2^-8 in one direction: a correct kernel then shows ~5e-3
     relative L2 on rows of ~2000 keys, where the GPU shows ~2e-3.

Why (``docs/architecture.md``, "Things that bite"): in Triton 3.6-3.9 the interpreter stores bf16
tensors as their raw ``uint16`` bit patterns and its ``InterpreterBuilder.create_dot`` converts only
8-bit float operands before ``np.matmul``; bf16 operands are multiplied as 16-bit *integers*, so a
correct bf16 kernel is off by ~1e9 on CPU. This patch widens every bf16 operand to float32 (exact:
bf16 is the top half of a float32) and then hands over to the interpreter's own ``create_dot``, so
all other behaviour (accumulator dtype, fp8 handling) stays Triton's.

Scope: applied on import, only when ``TRITON_INTERPRET=1`` (a no-op for compiled GPU runs);
idempotent; if Triton's interpreter internals are not where expected it does nothing (the bf16 CPU
tests then fail loudly by the factor above, they are not silently skipped). Imported by
``tests/conftest.py``. Never used by library code.
"""

from __future__ import annotations

import os

__all__ = ["applied"]

applied = False


def _apply() -> bool:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("1", "true", "True"):
        return False
    try:
        import numpy as np  # noqa: PLC0415
        import triton.language as tl  # noqa: PLC0415
        from triton.runtime import interpreter as interp  # noqa: PLC0415
    except Exception:  # noqa: BLE001 - no triton: nothing to patch
        return False
    builder_cls = getattr(interp, "InterpreterBuilder", None)
    handle_cls = getattr(interp, "TensorHandle", None)
    original = getattr(builder_cls, "create_dot", None)
    if builder_cls is None or handle_cls is None or original is None:
        return False
    if getattr(original, "_qsa_bf16_patch", False):
        return True

    def _is_bf16(h) -> bool:
        return getattr(h, "dtype", None) == tl.bfloat16

    def _is_fp8(h) -> bool:
        dt = getattr(h, "dtype", None)
        return dt is not None and dt.is_floating() and dt.primitive_bitwidth == 8

    def _widen(h):
        """bf16 bits (uint16) -> float32 values; other operands unchanged unless half precision,
        which is widened too so both matmul operands share one float dtype."""
        if _is_bf16(h):
            bits = np.asarray(h.data).astype(np.uint32) << np.uint32(16)
            return handle_cls(bits.view(np.float32), tl.float32)
        if getattr(h, "dtype", None) == tl.float16:
            return handle_cls(np.asarray(h.data).astype(np.float32), tl.float32)
        return h

    def create_dot(self, a, b, *args, **kwargs):
        if (_is_bf16(a) or _is_bf16(b)) and not (_is_fp8(a) or _is_fp8(b)):
            a, b = _widen(a), _widen(b)
        return original(self, a, b, *args, **kwargs)

    create_dot._qsa_bf16_patch = True  # type: ignore[attr-defined]
    create_dot.__doc__ = "bf16-correct create_dot (tests/triton_interp_patch.py)"
    builder_cls.create_dot = create_dot

    cast_original = getattr(builder_cls, "cast_impl", None)
    if cast_original is not None:
        def cast_impl(self, src, dst_type):
            if (getattr(src, "dtype", None) is not None and src.dtype.scalar == tl.float32
                    and dst_type.scalar == tl.bfloat16):
                bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32)
                # round half to even on the 16 dropped bits; NaN stays a (quiet) NaN
                rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
                           >> np.uint32(16)).astype(np.uint16)
                nan = np.isnan(src.data)
                if nan.any():
                    rounded = np.where(nan, ((bits >> np.uint32(16)) | np.uint32(0x40)).astype(np.uint16),
                                       rounded)
                return handle_cls(rounded, dst_type.scalar)
            return cast_original(self, src, dst_type)

        cast_impl._qsa_bf16_patch = True  # type: ignore[attr-defined]
        builder_cls.cast_impl = cast_impl
        # the create_* casts are lambdas calling self.cast_impl: they pick the patch up
    return True


applied = _apply()
if applied:  # tells qsa_triton._interp_guard that bf16 dots are numeric now
    from triton.runtime import interpreter as _interp

    _interp._qsa_bf16_dot_patched = True
