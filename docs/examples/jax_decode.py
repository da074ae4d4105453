"""Sparse decode from JAX: the Pallas kernel under ``jax.jit``, checked against the FP64 reference.

    python docs/examples/jax_decode.py

Runs as it is on a CUDA GPU (the compiled Pallas-Triton kernel) or on a CPU (the same kernel in
Pallas interpret mode, slower); ``qsa_pallas`` picks by jax's default backend.

Shapes follow the flash-attn varlen convention (``docs/qsa-contract.md`` §2): B sequences, one
query row each; sequence s attends the packed keys ``k[cu_seqlens_k[s] : cu_seqlens_k[s + 1]]``.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

import qsa_pallas
from interop.cases import compare
from interop.reference import decode_reference

hq, hkv, d = 12, 1, 256                 # the TP2 rank shape: 12 query heads share 1 KV head
lens = np.array([2051, 517, 0, 40])     # selected keys per sequence (0: no key -> exact zeros)
max_seqlen_k = 2051                     # static bound (the indexer's top-k width)
b = len(lens)
cu_seqlens_k = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
cu_seqlens_q = np.arange(b + 1, dtype=np.int32)  # sequence s's query is row s

rng = np.random.default_rng(0)
q = jnp.asarray(rng.standard_normal((b, hq, d)), jnp.bfloat16)
k = jnp.asarray(rng.standard_normal((int(cu_seqlens_k[-1]), hkv, d)), jnp.bfloat16)
v = jnp.asarray(rng.standard_normal((int(cu_seqlens_k[-1]), hkv, d)), jnp.bfloat16)

# max_seqlen_k is static (it sizes the grid); the lengths are traced device data, so new
# lengths do not recompile
decode = jax.jit(functools.partial(qsa_pallas.sparse_decode, max_seqlen_k=max_seqlen_k))
out = decode(q, k, v, jnp.asarray(cu_seqlens_q), jnp.asarray(cu_seqlens_k))

f64 = lambda x: np.asarray(x.astype(jnp.float32), np.float64)  # noqa: E731
ref = decode_reference(f64(q), f64(k), f64(v), cu_seqlens_q, cu_seqlens_k)
# the contract's pass criteria (qsa-contract.md §6): finite, |out - ref| <= 2e-2 + 2e-2 |ref|,
# relative L2 <= 5e-3, exact zeros for the sequence without keys
r = compare(f64(out), ref, empty=lens == 0)

backend = jax.default_backend()
mode = "compiled Pallas-Triton kernel" if backend == "gpu" else "Pallas interpret mode"
print(f"jax {jax.__version__} on {backend} ({mode})")
print(f"checked: jax.jit(qsa_pallas.sparse_decode), B={b}, Hq={hq}, Hkv={hkv}, D={d}, bfloat16, "
      f"keys per sequence {lens.tolist()}, max_seqlen_k={max_seqlen_k}")
print(f"max |out - FP64 reference| = {r['max_abs']:.2e}, relative L2 = {r['rel_l2']:.2e}, "
      f"sequence without keys exactly 0: {r['zeros_ok']}")
print("OK" if r["passed"] else "MISMATCH")
raise SystemExit(0 if r["passed"] else 1)
