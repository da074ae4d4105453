"""Scratch: ours-union at UNION_RULES['max_union_work'] 1.5 / 1.75 / 2.0 (the per-tile switch's
bound), same inputs, interleaved CUDA-graph timing, each checked against the FP32 reference."""
import sys, torch
from bench import prefill as BP, common
from interop import geometry
from qsa_triton import prefill as P
sel = sys.argv[1].split(",")
class A: sections = "matrix"; heads = None; jaccards = "0.9,0.5,0.0"
cases = [c for c in BP.union_cases(A, "bench") if c[0].name in sel]
for case in cases:
    spec = case[0]
    c, ref = BP.union_prepare(case, "cuda")
    mode = {"ordinary": 0, "chunk": 1, "paged": 2}[c.kind]
    cu = c.cu_q
    calls = {}
    for w in (1.5, 1.75, 2.0):
        def fn(w=w):
            old = geometry.UNION_RULES["max_union_work"]
            geometry.UNION_RULES["max_union_work"] = w
            try:
                if mode == 0:
                    return P._blocks_impl(0, c.q, c.k, c.v, c.blocks, cu, cu, cu, cu, cu, c.max_q,
                                          c.scale, 1.0, 1.0)
                return P._blocks_impl(mode, c.q, c.k, c.v, c.blocks, cu, c.cu_k, c.kv_lens, cu, cu,
                                      c.max_q, c.scale, 1.0, 1.0)
            finally:
                geometry.UNION_RULES["max_union_work"] = old
        out = fn(); torch.cuda.synchronize()
        err = common.errors(out, ref)
        print(f"{spec.name} work {w}: check {'ok' if common.within_tolerance(err) else 'FAIL'}")
        calls[f"work{w}"] = fn
    t = common.time_interleaved(calls, rounds=15)
    base = t["work1.5"]["median_us"]
    for n, r in t.items():
        print(f"{spec.name:45s} {n:10s} {r['median_us']:8.1f} us  x 1.5 {base / r['median_us']:.3f}")
