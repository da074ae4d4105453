"""How a JAX model uses QSA: one decode step of a 2-layer model, the layers a jitted ``lax.scan``,
each layer's attention ``qsa_pallas.qsa_decode_step`` (indexer -> top-k -> expansion -> paged
sparse attention from the KV pool), checked against the FP64 reference.

    python docs/examples/jax_step.py

Runs as it is on a CUDA GPU (compiled kernels: the TP2 rank shape, D = 256, 32k context,
top-512) or on a CPU (Pallas interpret mode: D = 64, short contexts, top-16 so that selection
still drops blocks).

Per layer the model writes this token's K/V into the pool, then calls the step with its
attention query, its indexer query and the layer's pool and compressed-K cache; the request
tables (``req_to_token``, ``req_indices``, the compressed-K page table, ``seq_lens``) are shared by
all layers and live on the device: new lengths do not recompile, nothing is read on the host.
(The indexer query -- a projection, rotated -- and the compressed-K cache -- written when a block
of 4 tokens completes: mean of the 4 keys, norm, rotation -- are the model's indexer code; here
both are given, integer-valued, so that the FP32 logits are exact and the FP64 reference selects
exactly the kernels' blocks.)
"""

import jax
import jax.numpy as jnp
import numpy as np

import qsa_pallas
from interop.cases import compare
from interop.reference import decode_step_reference

on_gpu = jax.default_backend() == "gpu"
n_layers, e = 2, 64                                 # layers, model width (toy projections)
hq, hkv, d = (12, 1, 256) if on_gpu else (12, 1, 64)  # TP2 rank: 12 query heads per KV head
ctx = np.array([32768, 20011, 517, 1] if on_gpu else [1000, 301, 70, 1])  # tokens incl. this one
topk = 512 if on_gpu else 16                        # indexer blocks kept per row (4 tokens each)
ih, idim = 4, 128                                   # the indexer query: 4 heads x 128
b, page = len(ctx), 64                              # decode rows; KV page (16 compressed blocks)

# The request tables: pages of 64 pool slots in scattered order (page 0 is padding), and the
# compressed-K page table: block n of a request lives in the compressed page of its KV page n // 16
rng = np.random.default_rng(0)
n_pages = -(-ctx // page)
pool_pages = int(n_pages.sum()) + 1
owner = np.split(rng.permutation(np.arange(1, pool_pages)), np.cumsum(n_pages)[:-1])
max_ctx = int(ctx.max())
pos = np.arange(max_ctx)
req_to_token = np.stack([np.where(pos < c, pg[np.minimum(pos // page, len(pg) - 1)] * page
                                  + pos % page, 0) for c, pg in zip(ctx, owner)]).astype(np.int32)
index_page_table = (req_to_token[:, ::page] // page).astype(np.int32)   # [B, ceil(max_ctx / 64)]
req_indices = np.arange(b, dtype=np.int32)
seq_lens = ctx.astype(np.int32)
new_slot = req_to_token[np.arange(b), seq_lens - 1]                    # this token's pool slot

# Per-layer weights and caches, stacked on a leading layer axis (the scan's xs)
dt = jnp.bfloat16 if on_gpu else jnp.float16       # CPU: fp16 (interpreter dot)
w = lambda *s: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[-2]), dt)  # noqa: E731
wq, wk, wv = w(n_layers, e, hq * d), w(n_layers, e, hkv * d), w(n_layers, e, hkv * d)
wo = w(n_layers, hq * d, e)
index_q = jnp.asarray(rng.integers(-2, 3, (n_layers, b, ih, idim)), dt)
k_cache = jnp.asarray(rng.standard_normal((n_layers, pool_pages * page, hkv, d)), dt)
v_cache = jnp.asarray(rng.standard_normal((n_layers, pool_pages * page, hkv, d)), dt)
index_k_cache = jnp.asarray(rng.integers(-2, 3, (n_layers, pool_pages, 16, 1, idim)), dt)
x = jnp.asarray(rng.standard_normal((b, e)), dt)


@jax.jit
def decode_step(x, wq, wk, wv, wo, index_q, k_cache, v_cache, index_k_cache, req_to_token,
                req_indices, index_page_table, seq_lens, new_slot):
    def layer(x, per_layer):
        wq, wk, wv, wo, iq, kc, vc, ikc = per_layer
        q = (x @ wq).reshape(b, hq, d)
        kc = kc.at[new_slot].set((x @ wk).reshape(b, hkv, d))   # this token's K/V into the pool
        vc = vc.at[new_slot].set((x @ wv).reshape(b, hkv, d))
        o = qsa_pallas.qsa_decode_step(q, kc, vc, req_to_token, req_indices, iq, ikc,
                                       index_page_table, seq_lens, topk=topk)
        return x + o.reshape(b, hq * d) @ wo, (o, q, kc, vc)

    return jax.lax.scan(layer, x, (wq, wk, wv, wo, index_q, k_cache, v_cache, index_k_cache))


tables = [jnp.asarray(a) for a in (req_to_token, req_indices, index_page_table, seq_lens, new_slot)]
x_out, (outs, qs, kcs, vcs) = decode_step(x, wq, wk, wv, wo, index_q, k_cache, v_cache,
                                          index_k_cache, *tables)

f64 = lambda a: np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)  # noqa: E731
# per layer, the contract's pass criteria (qsa-contract.md §6): finite, elementwise within
# 2e-2 + 2e-2 |ref|, relative L2 <= 5e-3
checks = [compare(f64(outs[i]), decode_step_reference(
    f64(qs[i]), f64(kcs[i]), f64(vcs[i]), req_to_token, req_indices, f64(index_q[i]),
    f64(index_k_cache[i]), index_page_table, seq_lens, topk=topk)) for i in range(n_layers)]

mode = "compiled Pallas-Triton kernels" if on_gpu else "Pallas interpret mode"
print(f"jax {jax.__version__} on {jax.default_backend()} ({mode})")
print(f"checked: jax.jit(lax.scan over {n_layers} layers of qsa_pallas.qsa_decode_step), B={b}, "
      f"Hq={hq}, Hkv={hkv}, D={d}, {jnp.dtype(dt).name}, contexts {ctx.tolist()}, top-{topk} "
      f"blocks of 4 -> {4 * topk + 3} token positions per row")
print(f"every layer vs the FP64 reference (indexer + expansion + paged attention): "
      f"max |out - ref| = {max(r['max_abs'] for r in checks):.2e}, "
      f"relative L2 = {max(r['rel_l2'] for r in checks):.2e}")
ok = all(r["passed"] for r in checks) and bool(np.isfinite(f64(x_out)).all())
print("OK" if ok else "MISMATCH")
raise SystemExit(0 if ok else 1)
