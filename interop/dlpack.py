"""Zero-copy torch <-> jax through DLPack, stream-correct on GPU.

``to_jax(tensor)`` and ``to_torch(array)`` share the producer's memory whenever DLPack allows it
and otherwise refuse with a clear error unless asked to copy; torch and jax are imported lazily.

Stream correctness (DLPack Python spec, ``__dlpack__(stream=...)``): the consumer passes *its*
stream to the producer's ``__dlpack__`` and the producer makes that stream wait for the work
pending on the producer's current stream. ``jax.dlpack.from_dlpack`` passes its own stream for
external ready events to ``torch.Tensor.__dlpack__``, which records an event on torch's *current*
stream; ``torch.from_dlpack`` passes torch's current stream to ``jax.Array.__dlpack__``, which
waits for the array's definition events. So: call ``to_jax`` while the stream that produced the
tensor is current (``with torch.cuda.stream(s): to_jax(t)``); ``to_torch`` makes torch's current
stream wait for jax's work.

Layouts: DLPack carries strides, and XLA accepts any *compact* layout (a permutation of a dense
row-major buffer: contiguous or transposed) but not gaps or broadcasting (stride 0). Those are
refused here with ``DLPackLayoutError`` naming the argument (or copied with ``copy=True``).

dtypes: bf16, fp16, fp32, int32 (int32 stays int32; 64-bit dtypes are refused when jax's x64
mode is off, since jax would narrow them silently), float8_e4m3fn (sent directly when both sides
support the DLPack fp8 code, else carried as a uint8 view and bit-cast back: bit-exact either
way).
"""

from __future__ import annotations

from typing import Any

__all__ = ["DLPackLayoutError", "to_jax", "to_torch", "is_compact"]

_FP8 = ("float8_e4m3fn", "float8_e5m2")
#: what jax narrows each 64-bit dtype to while x64 mode is off
_WIDE = {"int64": "int32", "uint64": "uint32", "float64": "float32", "complex128": "complex64"}




class DLPackLayoutError(ValueError):
    """A tensor DLPack cannot share without a copy (non-compact strides, int64 without x64...);
    the message names function, argument, expected and got, like ``ContractError``."""

    def __init__(self, fn: str, arg: str, expected: str, got: Any, hint: str = ""):
        self.fn, self.arg, self.expected, self.got = fn, arg, expected, got
        super().__init__(f"{fn}: argument '{arg}': expected {expected}; got {got}."
                         + (f" {hint}" if hint else ""))


def is_compact(shape, strides) -> bool:
    """True when ``strides`` (elements) describe a dense buffer in some dimension order, what
    XLA's DLPack import accepts. Size-0 tensors are compact; size-1 dimensions may have any
    stride; broadcasting (stride 0) and gaps are not compact."""
    shape, strides = tuple(int(s) for s in shape), tuple(int(s) for s in strides)
    if any(s == 0 for s in shape):
        return True
    dims = sorted((st, n) for n, st in zip(shape, strides) if n != 1)
    acc = 1
    for st, n in dims:
        if st != acc:
            return False
        acc *= n
    return True


def _torch_dtype_name(t) -> str:
    return str(t.dtype).removeprefix("torch.")


def to_jax(tensor, *, copy: bool = False, fp8_via_uint8: bool | None = None, stream=None):
    """A jax array sharing ``tensor``'s memory (torch -> jax).

    Args:
      tensor: torch.Tensor on CPU or CUDA; bf16/fp16/fp32/int32/uint8/float8_e4m3fn/... any
        shape including size 0; contiguous or any compact permutation (e.g. ``t.T``).
      copy: True -> copy (always allowed, any strides); False -> zero-copy or an error. A
        zero-copy result aliases ``tensor``: writing into the tensor afterwards (in place)
        changes the "immutable" jax array too; pass ``copy=True`` where the tensor is reused.
      fp8_via_uint8: None (auto: try the DLPack fp8 code, fall back to a uint8 view), True
        (always carry fp8 as uint8 and bit-cast in jax: jax's bitcast makes a new buffer).
      stream: the ``torch.cuda.Stream`` that produced ``tensor`` (default: torch's current
        stream). jax's stream is made to wait for the work queued on it before reading.

    Returns:
      jax.Array on the matching device, same dtype and values (same pointer unless copied or
      fp8 was carried as uint8).

    Raises:
      DLPackLayoutError: a tensor that requires grad, a 64-bit dtype while jax x64 is off, a
        sparse or meta tensor (always); non-compact strides (a slice with gaps, an
        expanded/broadcast view) or a lazy negative / conjugate bit when ``copy`` is False.
      TypeError: not a torch tensor.
    """
    import jax  # noqa: PLC0415 - lazy: only the bridge touches both frameworks
    import jax.numpy as jnp  # noqa: PLC0415
    import torch  # noqa: PLC0415

    if not type(tensor).__module__.startswith("torch"):
        raise TypeError(f"to_jax: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.requires_grad:  # torch's DLPack export refuses it too, as a bare BufferError
        raise DLPackLayoutError("to_jax", "tensor", "a tensor that does not require grad (DLPack "
                                "shares no autograd history)", "requires_grad=True",
                                "Pass tensor.detach() (the kernels are forward-only).")
    if (tensor.is_neg() or tensor.is_conj()) and copy:
        tensor = tensor.resolve_neg().resolve_conj()
    if tensor.is_neg() or tensor.is_conj():  # lazy sign / conjugate bits: DLPack drops them
        bit = "negative" if tensor.is_neg() else "conjugate"
        raise DLPackLayoutError("to_jax", "tensor", "a tensor without a lazy sign or conjugate "
                                "bit (DLPack carries the buffer, not the bit)", f"the {bit} bit "
                                "set", "Pass copy=True or tensor.resolve_neg().resolve_conj().")
    if tensor.layout != torch.strided or tensor.device.type == "meta":
        raise DLPackLayoutError("to_jax", "tensor", "a dense (strided) tensor with memory",
                                f"layout {tensor.layout} on {tensor.device.type}",
                                "Pass tensor.to_dense() / a materialised tensor.")
    if stream is not None and tensor.device.type == "cuda":
        with torch.cuda.stream(stream):  # export while the producing stream is current
            return to_jax(tensor, copy=copy, fp8_via_uint8=fp8_via_uint8)
    name = _torch_dtype_name(tensor)
    if not copy and not is_compact(tensor.shape, tensor.stride()):
        raise DLPackLayoutError(
            "to_jax", "tensor", "a compact layout (contiguous or a transposition of a dense "
            "buffer) that DLPack can share", f"shape {list(tensor.shape)} with strides "
            f"{list(tensor.stride())}", "Pass copy=True or call .contiguous() first.")
    if copy:
        # copy on the torch side (on the current stream), then share the private copy: jax 0.10's
        # from_dlpack(copy=True) still aliases CPU buffers
        tensor = tensor.clone(memory_format=torch.contiguous_format)
    if name in _WIDE and not jax.config.jax_enable_x64:
        raise DLPackLayoutError("to_jax", "tensor", f"a 32-bit or narrower dtype (jax x64 mode "
                                f"is off: {name} would be narrowed to {_WIDE[name]} silently)",
                                name, f"Convert with .to(torch.{_WIDE[name]}) first, or enable "
                                "jax_enable_x64.")
    if name in _FP8:
        if fp8_via_uint8 is not True:
            try:
                arr = jax.dlpack.from_dlpack(tensor)
                if str(arr.dtype) == name:
                    return arr
            except (TypeError, ValueError, BufferError, RuntimeError):  # no fp8 DLPack code here
                pass
        raw = tensor.view(torch.uint8)
        arr = jax.dlpack.from_dlpack(raw)
        return jax.lax.bitcast_convert_type(arr, getattr(jnp, name))
    return jax.dlpack.from_dlpack(tensor)


def to_torch(array, *, copy: bool = False, fp8_via_uint8: bool | None = None):
    """A torch tensor sharing ``array``'s memory (jax -> torch).

    jax arrays are always dense row-major, so every single-device array is shareable.

    Args:
      array: jax.Array on one device (CPU or CUDA), any shape including size 0.
      copy: True -> the tensor is a copy (``.clone()``) instead of a view of jax's buffer. A
        view aliases the jax array: writing into it changes that array (and every jax value
        sharing its buffer); pass ``copy=True`` before writing.
      fp8_via_uint8: None (auto: try the DLPack fp8 code, fall back to a uint8 bit-cast in jax and
        a ``.view(float8)`` in torch), True (always the uint8 route).

    Returns:
      torch.Tensor with the same dtype and values, on the matching device.

    Raises:
      DLPackLayoutError: the array is sharded over several devices, or a tracer (inside
        ``jax.jit``: no buffer to share).
      TypeError: not a jax array.
    """
    import torch  # noqa: PLC0415

    if not type(array).__module__.startswith(("jax", "jaxlib")):
        raise TypeError(f"to_torch: expected a jax.Array, got {type(array).__name__}")
    import jax  # noqa: PLC0415

    if isinstance(array, jax.core.Tracer):
        raise DLPackLayoutError("to_torch", "array", "a concrete jax.Array (DLPack shares a "
                                "buffer; a traced value inside jax.jit has none)",
                                type(array).__name__, "Convert outside the jitted function.")
    devices = array.devices() if callable(getattr(array, "devices", None)) else set()
    if len(devices) > 1:
        raise DLPackLayoutError("to_torch", "array", "an array on a single device",
                                f"an array sharded over {len(devices)} devices",
                                "Take one shard (array.addressable_shards[i].data) first.")
    name = str(array.dtype)
    if name in _FP8:
        t = None
        if fp8_via_uint8 is not True:
            try:
                t = torch.from_dlpack(array)
                if _torch_dtype_name(t) != name:
                    t = None
            except (TypeError, ValueError, BufferError, RuntimeError):
                t = None
        if t is None:
            import jax  # noqa: PLC0415
            import jax.numpy as jnp  # noqa: PLC0415

            raw = torch.from_dlpack(jax.lax.bitcast_convert_type(array, jnp.uint8))
            t = raw.view(getattr(torch, name))
        return t.clone() if copy else t
    t = torch.from_dlpack(array)
    return t.clone() if copy else t
