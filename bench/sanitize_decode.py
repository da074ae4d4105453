"""Memory-safety run of ``qsa_triton.sparse_decode`` for ``compute-sanitizer --tool memcheck``.

  PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 9 \
      python bench/sanitize_decode.py

Without torch's caching allocator every tensor is its own cudaMalloc, so a read past the end of
K/V (or q, cu_seqlens, scratch, out) is an out-of-bounds access memcheck reports. Cases:
  * K/V sized exactly to ``cu_seqlens_k[B]`` (no slack): any read past the last row faults;
  * K/V with 4096 rows of NaN (or +-Inf) garbage after the rows: must not reach the output;
  * empty rows, rows ending mid-block, a row longer than ``max_seqlen_k``; both merge modes and
    several forced split counts; TP1 / TP2 / TP4 shapes; D = 256 bf16 and D = 64 fp16.
Every output is checked finite and against the FP32 reference (exit 1 on a mismatch).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    import os

    smoke = "--smoke-cpu" in sys.argv  # exercise this script on CPU (Triton interpreter)
    if smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        from tests import triton_interp_patch  # noqa: F401 - bf16 dot / rounding on CPU
    import numpy as np
    import torch

    import qsa_triton
    from bench.decode import torch_reference
    from qsa_triton import decode as dec

    dev = torch.device("cpu" if smoke else "cuda")
    bad = 0
    cases = [
        ((24, 2), 256, torch.bfloat16, [2051, 0, 33, 1, 700]),
        ((12, 1), 256, torch.bfloat16, [2400, 17, 0]),  # row 0 longer than max_seqlen_k 2051
        ((6, 1), 256, torch.bfloat16, [31, 2051, 64]),
        ((12, 1), 64, torch.float16, [0, 0, 129]),
    ]
    for ci, ((hq, hkv), d, dtype, lens) in enumerate(cases):
        for slack, fill in ((0, None), (4096, float("nan") if ci % 2 else float("inf"))):
            g = torch.Generator(device=dev).manual_seed(len(lens) + d)
            cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
            n = int(cu[-1])
            b = len(lens)
            q = torch.randn(b, hq, d, generator=g, device=dev).to(dtype)
            k = torch.empty(n + slack, hkv, d, device=dev, dtype=dtype)
            v = torch.empty_like(k)
            k[:n] = torch.randn(n, hkv, d, generator=g, device=dev).to(dtype)
            v[:n] = torch.randn(n, hkv, d, generator=g, device=dev).to(dtype)
            if slack:
                k[n:] = fill
                v[n:] = -fill if fill == fill else fill
            cq = torch.arange(b + 1, dtype=torch.int32, device=dev)
            ck = torch.from_numpy(cu).to(dev)
            ref = torch_reference(q, k, v, cq, ck)
            # tma: K/V boxes by TMA (the partial last block reads past the rows; past the end
            # of an exact-size K/V the hardware zero-fills, no access)
            for ov in ({}, {"max_splits": 1}, {"max_splits": 64}, {"max_splits": 4, "merge": "inline"},
                       {"tma": True}, {"tma": False}, {"tma": True, "max_splits": 64}):
                with dec.plan_override(**ov):
                    out = qsa_triton.sparse_decode(q, k, v, cq, ck, 2051)
                if not smoke:
                    torch.cuda.synchronize()
                o = out.float()
                err = float((o - ref).norm() / ref.norm().clamp_min(1e-30))
                ok = bool(torch.isfinite(o).all()) and err <= 5e-3
                bad += not ok
                print(f"({hq},{hkv}) D={d} {str(dtype)[6:]} lens={lens} slack={slack} fill={fill} "
                      f"{ov}: rel L2 {err:.2e} {'ok' if ok else 'FAIL'}", flush=True)
    print("sanitize_decode:", "all ok" if not bad else f"{bad} FAILED")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
