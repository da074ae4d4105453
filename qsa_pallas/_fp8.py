"""The dot operand type of FP8 (e4m3) K/V, shared by the Pallas kernels that read FP8 K/V: the
JAX twin of ``qsa_triton._fp8`` (read its docstring for why float16). Gathered K/V tiles are
converted to float16 (not to q's dtype), q once per program by ``fp16_query``."""

from __future__ import annotations

import jax.numpy as jnp

__all__ = ["fp16_query", "is_fp8"]


def is_fp8(dtype) -> bool:
    """True for float8_e4m3fn K/V (the kernels' FP8 dtype)."""
    return jnp.dtype(dtype) == jnp.dtype(jnp.float8_e4m3fn)


def fp16_query(q, qk_scale):
    """(q as float16 scaled by 2**-e, qk_scale * 2**e) for a [M, D] tile ``q`` of any float dtype;
    e = max(ceil(log2(max(max|q|, 1))) - 15, 0), and e = 0 when that is not finite or >= 256
    (Inf or NaN in q then reach the scores as in the q-dtype path). ``qk_scale``: a Python float
    or an FP32 scalar; returned as an FP32 scalar."""
    qf = q.astype(jnp.float32)
    qa = jnp.max(jnp.max(jnp.abs(qf), axis=1), axis=0)  # per axis, as the lowering reduces
    e = jnp.maximum(jnp.ceil(jnp.log2(jnp.maximum(qa, 1.0))) - 15.0, 0.0)
    e = jnp.where(e < 256.0, e, 0.0)  # NaN compares false: e = 0
    return (qf * jnp.exp2(-e)).astype(jnp.float16), qk_scale * jnp.exp2(e)
