"""Chunk prefill from JAX on the indexer's block selections (``block_indices=``), under
``jax.jit``, checked against the FP64 reference of the expanded token rows.

    python docs/examples/jax_prefill_blocks.py

Runs as it is on a CUDA GPU (compiled Pallas-Triton kernels, bfloat16) or on a CPU (Pallas
interpret mode, float16, smaller head dim); ``qsa_pallas`` picks by jax's default backend.

The QSA indexer gives each query row its top-k block ids (4 tokens a block, row-relative, in any
order, -1 padding); the token row the attention reads is their expansion plus the row's causal
tail (``interop.indices.expand_prefill_blocks``, ``docs/qsa-contract.md`` §3-4). Passing the
block ids instead of the 2051-wide token rows lets the library build, per tile of R neighbouring
rows, the union of their blocks and gather each block once for all R rows (the tile-union
kernel), where ``interop.geometry.select_prefill_blocks`` expects that to pay: long chunks whose
neighbouring rows select mostly the same blocks. Small calls like this one take the per-row
kernel; the result is the same up to summation order either way.
"""

import jax
import jax.numpy as jnp
import numpy as np

import qsa_pallas
from interop import indices
from interop.cases import compare
from interop.reference import prefill_chunk_reference

on_gpu = jax.default_backend() == "gpu"
dtype = jnp.bfloat16 if on_gpu else jnp.float16
hq, hkv, d = 12, 1, 256 if on_gpu else 64   # the TP2 rank shape (D 64 keeps the CPU run short)
q_lens = np.array([12, 5])                  # new query rows per request
kv_lens = np.array([300, 40])               # context per request (prefix + chunk); kv >= q
nb = 32                                     # block ids per row (the model's indexer: 512)
cu_seqlens_q = indices.cu_seqlens_from_counts(q_lens)
cu_seqlens_k = indices.cu_seqlens_from_counts(kv_lens)
# indexer-like selections: neighbouring rows share ~90% of their blocks, -1 padding, and
# row 3 selects nothing (it still attends its causal tail)
blocks = indices.prefill_block_indices(q_lens, kv_lens, block_width=nb, overlap=0.9,
                                       empty_rows=[3], seed=0)

rng = np.random.default_rng(0)
t, rows = int(cu_seqlens_q[-1]), int(cu_seqlens_k[-1])
q = jnp.asarray(rng.standard_normal((t, hq, d)), dtype)
k = jnp.asarray(rng.standard_normal((rows, hkv, d)), dtype)
v = jnp.asarray(rng.standard_normal((rows, hkv, d)), dtype)


# max_seqlen_q is static (a grid bound); lengths and block ids are traced device data
@jax.jit
def prefill(q, k, v, cu_q, cu_k, kv_lens, blocks):
    return qsa_pallas.sparse_prefill_chunk(q, k, v, None, cu_q, cu_k, kv_lens,
                                           int(q_lens.max()), block_indices=blocks)


i32 = lambda a: jnp.asarray(a, jnp.int32)  # noqa: E731
out = prefill(q, k, v, i32(cu_seqlens_q), i32(cu_seqlens_k), i32(kv_lens), i32(blocks))

tokens = indices.expand_prefill_blocks(blocks, q_lens, kv_lens)  # the token rows they stand for
f64 = lambda x: np.asarray(x.astype(jnp.float32), np.float64)  # noqa: E731
ref = prefill_chunk_reference(f64(q), f64(k), f64(v), tokens, cu_seqlens_q, cu_seqlens_k, kv_lens)
# the contract's pass criteria (qsa-contract.md §6): finite, |out - ref| <= 2e-2 + 2e-2 |ref|,
# relative L2 <= 5e-3
r = compare(f64(out), ref)

backend = jax.default_backend()
mode = "compiled Pallas-Triton kernels" if on_gpu else "Pallas interpret mode"
print(f"jax {jax.__version__} on {backend} ({mode})")
print(f"checked: jax.jit(qsa_pallas.sparse_prefill_chunk(..., block_indices=)), Hq={hq}, "
      f"Hkv={hkv}, D={d}, {jnp.dtype(dtype).name}, {nb} block ids a row -> {tokens.shape[1]} "
      f"token columns, query rows {q_lens.tolist()}, contexts {kv_lens.tolist()}")
print(f"max |out - FP64 reference of the expanded tokens| = {r['max_abs']:.2e}, "
      f"relative L2 = {r['rel_l2']:.2e}")
print("OK" if r["passed"] else "MISMATCH")
raise SystemExit(0 if r["passed"] else 1)
