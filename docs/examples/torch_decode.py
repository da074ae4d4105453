"""Sparse decode from PyTorch: the Triton kernel, checked against the FP64 reference.

    python docs/examples/torch_decode.py

Runs as it is on a CUDA GPU (bfloat16, compiled Triton kernel) or on a CPU: there it switches on
Triton's interpreter (``TRITON_INTERPRET=1``, which must be set before ``qsa_triton`` defines its
kernels) and uses float16, because the interpreter multiplies bfloat16 dot operands wrongly
(``docs/architecture.md``, "Things that bite"). The library is forward-only: tensors that
require grad are refused with ``ContractError``.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before qsa_triton is imported

import qsa_triton  # noqa: E402
from interop.cases import compare  # noqa: E402
from interop.reference import decode_reference  # noqa: E402

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float16

hq, hkv, d = 24, 2, 256                 # the TP1 rank shape: 12 query heads per KV head
lens = torch.tensor([2051, 300, 0, 17])  # selected keys per sequence (0: no key -> exact zeros)
max_seqlen_k = 2051                     # static bound (the indexer's top-k width)
b = len(lens)
cu_seqlens_k = torch.zeros(b + 1, dtype=torch.int32)
cu_seqlens_k[1:] = torch.cumsum(lens, 0)
cu_seqlens_q = torch.arange(b + 1, dtype=torch.int32)  # sequence s's query is row s

g = torch.Generator().manual_seed(0)
q = torch.randn(b, hq, d, generator=g).to(device, dtype)
k = torch.randn(int(cu_seqlens_k[-1]), hkv, d, generator=g).to(device, dtype)
v = torch.randn(int(cu_seqlens_k[-1]), hkv, d, generator=g).to(device, dtype)

out = qsa_triton.sparse_decode(q, k, v, cu_seqlens_q.to(device), cu_seqlens_k.to(device),
                               max_seqlen_k)

f64 = lambda t: t.double().cpu().numpy()  # noqa: E731
ref = decode_reference(f64(q), f64(k), f64(v), cu_seqlens_q.numpy(), cu_seqlens_k.numpy())
# the contract's pass criteria (qsa-contract.md §6): finite, |out - ref| <= 2e-2 + 2e-2 |ref|,
# relative L2 <= 5e-3, exact zeros for the sequence without keys
r = compare(f64(out), ref, empty=(lens == 0).numpy())

mode = "compiled Triton kernel" if device == "cuda" else "Triton interpreter (TRITON_INTERPRET=1)"
print(f"torch {torch.__version__} on {device} ({mode})")
print(f"checked: qsa_triton.sparse_decode, B={b}, Hq={hq}, Hkv={hkv}, D={d}, "
      f"{str(dtype).removeprefix('torch.')}, keys per sequence {lens.tolist()}, "
      f"max_seqlen_k={max_seqlen_k}")
print(f"max |out - FP64 reference| = {r['max_abs']:.2e}, relative L2 = {r['rel_l2']:.2e}, "
      f"sequence without keys exactly 0: {r['zeros_ok']}")
print("OK" if r["passed"] else "MISMATCH")
raise SystemExit(0 if r["passed"] else 1)
