"""Sparse chunk prefill from PyTorch: the Triton kernel on indexer-like top-k indices, checked
against the FP64 reference.

    python docs/examples/torch_prefill.py

Runs as it is on a CUDA GPU (bfloat16, compiled) or on a CPU (Triton's interpreter, float16; see
``torch_decode.py`` for why).

A chunk prefill (``docs/qsa-contract.md`` §3): each request has ``kv_lens[b]`` tokens of context
(its cached prefix plus this chunk), packed at rows ``cu_seqlens_k[b]...`` of k/v, and
``q_len_b`` new query rows (the chunk's tail of the context). Row r of request b may attend
``visible = r + kv_lens[b] - q_len_b + 1`` tokens; its index row (width W = 2051 in the model)
names up to that many context positions, valid ones first, then padding (-1). An entry is valid
iff ``0 <= idx < kv_lens[b]``; a row with no valid entry gives exact zeros.
"""

import os

import numpy as np
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before qsa_triton is imported

import qsa_triton  # noqa: E402
from interop import indices  # noqa: E402
from interop.cases import compare  # noqa: E402
from interop.reference import prefill_chunk_reference  # noqa: E402

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float16

hq, hkv, d = 6, 1, 256                  # the TP4 rank shape
q_lens = np.array([12, 5])              # new query rows per request
kv_lens = np.array([300, 5])            # context per request (prefix + chunk); kv >= q
width = indices.WIDTH                   # 2051 index columns per row
cu_seqlens_q = indices.cu_seqlens_from_counts(q_lens)
cu_seqlens_k = indices.cu_seqlens_from_counts(kv_lens)
# block-structured top-k like the QSA indexer's (valid first, -1 after); row 3 has no valid entry
idx = indices.prefill_indices(q_lens, kv_lens, width=width, empty_rows=[3], seed=0)

g = torch.Generator().manual_seed(0)
t, rows = int(cu_seqlens_q[-1]), int(cu_seqlens_k[-1])
q = torch.randn(t, hq, d, generator=g).to(device, dtype)
k = torch.randn(rows, hkv, d, generator=g).to(device, dtype)
v = torch.randn(rows, hkv, d, generator=g).to(device, dtype)
dev = lambda a: torch.from_numpy(np.ascontiguousarray(a, np.int32)).to(device)  # noqa: E731

out = qsa_triton.sparse_prefill_chunk(q, k, v, dev(idx), dev(cu_seqlens_q), dev(cu_seqlens_k),
                                      dev(kv_lens), int(q_lens.max()))

f64 = lambda x: x.double().cpu().numpy()  # noqa: E731
ref = prefill_chunk_reference(f64(q), f64(k), f64(v), idx, cu_seqlens_q, cu_seqlens_k, kv_lens)
got = f64(out)

mode = "compiled Triton kernel" if device == "cuda" else "Triton interpreter (TRITON_INTERPRET=1)"
print(f"torch {torch.__version__} on {device} ({mode})")
print(f"checked: qsa_triton.sparse_prefill_chunk, Hq={hq}, Hkv={hkv}, D={d}, "
      f"{str(dtype).removeprefix('torch.')}, W={width}, valid entries per row "
      f"{indices.valid_counts(idx, np.repeat(kv_lens, q_lens)).tolist()}")
# request by request, the contract's pass criteria (qsa-contract.md §6): finite,
# |out - ref| <= 2e-2 + 2e-2 |ref|, relative L2 <= 5e-3, exact zeros for row 3 (no valid entry)
ok = True
for b in range(len(q_lens)):
    rows = np.arange(cu_seqlens_q[b], cu_seqlens_q[b + 1])
    r = compare(got[rows], ref[rows], empty=rows == 3)
    print(f"request {b} ({q_lens[b]} query rows, context {kv_lens[b]}): max |out - FP64 reference| "
          f"= {r['max_abs']:.2e}, relative L2 = {r['rel_l2']:.2e}, rows without valid entry "
          f"exactly 0: {r['zeros_ok']}")
    ok = ok and r["passed"]
print("OK" if ok else "MISMATCH")
raise SystemExit(0 if ok else 1)
