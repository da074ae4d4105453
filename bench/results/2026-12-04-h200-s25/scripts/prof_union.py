"""Scratch: per-kernel profile (torch.profiler) of the union provider on a few cases."""
import sys, collections, torch
from bench import prefill as BP
sel = sys.argv[1:] or ["union/chunk/12x1/kv32k/T8192/J0.9", "union/chunk/6x1/kv32k/T8192/J0.9",
                       "union/ordinary/12x1/kv8k/T8192/J0.9"]
class A: sections = "matrix"; heads = None; jaccards = "0.9"
cases = [c for c in BP.union_cases(A, "bench") if c[0].name in sel]
for case in cases:
    c, _ = BP.union_prepare(case, "cuda")
    for prov in ("ours-union", "ours-rows"):
        fn = BP.UNION_PROVIDERS[prov].setup(c)
        for _ in range(3): fn()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
            for _ in range(5): fn()
            torch.cuda.synchronize()
        agg = collections.defaultdict(lambda: [0.0, 0])
        for e in p.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                agg[e.name][0] += e.device_time if hasattr(e, "device_time") else e.cuda_time
                agg[e.name][1] += 1
        tot = sum(v[0] for v in agg.values()) / 5
        print(f"== {case[0].name} {prov} J={c.jaccard:.3f}: {tot:.1f} us kernels per call")
        for n, (t, k) in sorted(agg.items(), key=lambda x: -x[1][0])[:8]:
            print(f"   {t/5:9.1f} us x{k/5:4.1f}  {n[:90]}")
