"""Scratch: one case, one provider, a few calls (for ncu)."""
import sys, torch
from bench import prefill as BP
name, prov = sys.argv[1], sys.argv[2]
class A: sections = "matrix"; heads = None; jaccards = "0.9,0.0"
case = [c for c in BP.union_cases(A, "bench") if c[0].name == name][0]
c, _ = BP.union_prepare(case, "cuda")
fn = BP.UNION_PROVIDERS[prov].setup(c)
for _ in range(2): fn()
torch.cuda.synchronize()
