"""Scratch: where the Pallas union path's time goes at Jaccard 0 vs 0.9 (chain of 2 in one jit)."""
import sys
import jax, jax.numpy as jnp, torch
from bench import prefill as BP, common
import qsa_pallas.prefill_union as PU

class A: sections = "matrix"; heads = None; jaccards = "0.9,0.0"
sel = sys.argv[1:] or ["union/chunk/12x1/kv32k/T8192/J0.0", "union/chunk/12x1/kv32k/T8192/J0.9",
                       "union/chunk/6x1/kv32k/T8192/J0.0"]
cases = [c for c in BP.union_cases(A, "bench") if c[0].name in sel]
seen = {}
orig = PU.block_union
def rec(bi, cu, kl, tile_rows):
    seen["R"] = tile_rows
    return orig(bi, cu, kl, tile_rows)
PU.block_union = rec

def link(xs, out):
    first = jnp.ravel(out[0] if isinstance(out, tuple) else out)[0]
    zero = (first == jnp.iinfo(first.dtype).min).astype(jnp.int32)
    return (xs[0] + zero, *xs[1:])

for case in cases:
    c, _ = BP.union_prepare(case, "cuda")
    calls = {"p-union": BP._call(c, pallas=True, blocks=True),
             "p-hint0": BP._call(c, pallas=True, blocks=True, overlap=0.0),
             "p-rows": BP._call(c, pallas=True),
             "t-union": BP._call(c, blocks=True),
             "t-rows": BP._call(c)}
    calls["p-union"].once()
    R = seen["R"]
    kl = c.kv_lens
    calls["p-build"] = common.jax_chain(lambda b, cu, k: PU.block_union(b, cu, k, R)[2],
                                        [c.blocks, c.cu_q, kl], {}, 2, link)
    calls["p-expand"] = common.jax_chain(lambda b, cu, k: PU.expand_blocks(b, cu, k),
                                         [c.blocks, c.cu_q, kl], {}, 2, link)
    res = common.time_interleaved(calls, rounds=6)
    print(f"== {case[0].name} J={c.jaccard:.3f} R={R}")
    for n, r in res.items():
        print(f"   {n:10s} {r.get('median_us', float('nan')):9.1f} us  {r.get('error', '')}")
