"""Scratch: the Triton tile-union kernel at forced geometries (M = 128 at 8 warps vs the shipped
M = 64 at 4), same inputs, interleaved CUDA-graph timing, each checked against the FP32 reference."""
import sys, torch
from bench import prefill as BP, common
from interop.geometry import UnionGeometry, select_prefill_blocks
from qsa_triton import prefill as P
sel = sys.argv[1].split(",")
geos = {}  # name -> {hq: UnionGeometry}
class A: sections = "matrix"; heads = None; jaccards = "0.9,0.0"
cases = [c for c in BP.union_cases(A, "bench") if c[0].name in sel]
for case in cases:
    spec = case[0]
    c, ref = BP.union_prepare(case, "cuda")
    g = spec.hq // spec.hkv
    ht = 16 if g > 8 else 8
    mode = {"ordinary": 0, "chunk": 1, "paged": 2}[c.kind]
    cu = c.cu_q
    def mk(geo):
        if mode == 0:
            return lambda: P._blocks_impl(0, c.q, c.k, c.v, c.blocks, cu, cu, cu, cu, cu, c.max_q,
                                          c.scale, 1.0, 1.0, geometry=geo)
        return lambda: P._blocks_impl(mode, c.q, c.k, c.v, c.blocks, cu, c.cu_k, c.kv_lens, cu, cu,
                                      c.max_q, c.scale, 1.0, 1.0, geometry=geo)
    r64 = 64 // ht
    r2 = 32 // ht
    variants = {
        "shipped": None,
        f"R{r2}_m32_bn32_w4_s2": UnionGeometry("union", r2, 32, 32, 4, 2, "x"),
        f"R{r2}_m32_bn64_w4_s2": UnionGeometry("union", r2, 32, 64, 4, 2, "x"),
        f"R{r2}_m32_bn32_w4_s3": UnionGeometry("union", r2, 32, 32, 4, 3, "x"),
        f"R{r2}_m32_bn32_w2_s2": UnionGeometry("union", r2, 32, 32, 2, 2, "x"),
        f"R{r64}_m64_bn16_w4_s3": UnionGeometry("union", r64, 64, 16, 4, 3, "x"),
    }
    calls = {}
    for n, geo in variants.items():
        fn = BP._call(c, blocks=True) if geo is None else mk(geo)
        try:
            out = fn(); torch.cuda.synchronize()
            err = common.errors(out, ref)
            ok = common.within_tolerance(err)
            print(f"{spec.name} {n}: check {'ok' if ok else 'FAIL'} {err}")
            if ok: calls[n] = fn
        except Exception as e:
            print(f"{spec.name} {n}: error {type(e).__name__}: {str(e)[:300]}")
    t = common.time_interleaved(calls, rounds=15)
    base = t.get("shipped", {}).get("median_us")
    for n, r in t.items():
        m = r.get("median_us")
        print(f"{spec.name:45s} {n:18s} {m if m is None else round(m,1)} us  x shipped {base/m if m and base else None}")
