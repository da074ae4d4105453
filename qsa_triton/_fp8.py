"""The dot operand type of FP8 (e4m3) K/V, shared by the Triton kernels that read FP8 K/V.

e4m3 converts to float16 with one instruction per two elements on sm_89+ (``cvt.rn.f16x2.e4m3x2``)
and exactly (every e4m3 value is an fp16 value), while e4m3 -> bfloat16 goes through fp16 and
fp32 (four instructions per two elements on sm_90): the conversion of each gathered tile, not
its bytes, bounded the FP8 kernels. So with FP8 K/V the dots run in float16: q is converted once
per program, scaled by a power of two 2**-e so that |q| <= 2**15 (e = 0 for any q within fp16's
range; the scaling is exact, only q entries below 2**-14 times 2**e lose bits as fp16
subnormals) with 2**e folded into the score scale, and P (in [0, 1]) is fed as float16, which
carries more mantissa than bfloat16. Accumulation stays FP32.
"""

import triton
import triton.language as tl


@triton.jit
def fp16_query(q, qk_scale):
    """(q as float16 scaled by 2**-e, qk_scale * 2**e) for a [M, D] tile ``q`` (module docstring).
    Inf or NaN in q: e = 0, so they reach the scores as in the q-dtype path."""
    qa = tl.max(tl.max(tl.abs(q.to(tl.float32)), 1), 0)
    e = tl.maximum(tl.ceil(tl.log2(tl.maximum(qa, 1.0))) - 15.0, 0.0)
    e = tl.where(e < 256.0, e, 0.0)
    return (q.to(tl.float32) * tl.exp2(-e)).to(tl.float16), qk_scale * tl.exp2(e)
