"""Scratch (session 29): paged decode where programs stream 1-2 chunks (R x Hkv <= 8): the shipped
3 stages vs 1 / 2, the V gather issued with K, PDL; TP1/TP2/TP4 single slots, interleaved graphs."""
import dataclasses, os, sys
import torch
sys.path.insert(0, os.getcwd())
from bench import common, decode as BD
from qsa_triton import decode_paged as DP
from qsa_triton.decode import _pdl_supported

def mk(inp, plan=None, pdl=None, vearly=False):
    def call():
        DP._V_EARLY = vearly
        if plan is None:
            return DP.sparse_decode_paged(*inp.args, inp.scale)
        return DP.decode_paged_with_plan(*inp.args, inp.scale, plan=plan, pdl=pdl)
    return call

shapes = [("TP1", 1), ("TP1", 2), ("TP1", 4), ("TP2", 1), ("TP2", 2), ("TP2", 4), ("TP2", 8), ("TP4", 1), ("TP4", 4)]
for kv in sys.argv[1].split(","):
  for tp, b in shapes:
    spec = BD.PoolSpec(f"pool/{tp}/slots/{kv}/B{b}/saturated", tp, b, "saturated", "slots", kv, seed=b)
    inp = BD.pool_inputs(spec, "cuda")
    ref = BD.pool_reference(*inp.args, inp.scale)
    q, k, idx = inp.args[0], inp.args[1], inp.args[5]
    base = DP._plan_of(q, k, idx, False)
    calls = {"upstream-step": BD._upstream_step(inp), "paged": mk(inp)}
    for st in (1, 2):
        calls[f"st{st}"] = mk(inp, dataclasses.replace(base, num_stages=st))
    calls["st1/vearly"] = mk(inp, dataclasses.replace(base, num_stages=1), vearly=True)
    calls["st3/vearly"] = mk(inp, base, vearly=True)
    pairs = q.shape[0] * k.shape[1]
    if pairs <= 2:
        calls[f"st1/pdl{int(pairs != 1)}"] = mk(inp, dataclasses.replace(base, num_stages=1), pdl=pairs != 1)
    ok = {}
    for n, f in calls.items():
        o = f().float(); torch.cuda.synchronize()
        if n != "upstream-step":
            e = common.errors(o, ref)
            if not common.within_tolerance(e):
                print("FAIL", n, e); continue
        ok[n] = f
    t = common.time_interleaved(ok, rounds=30)
    up = t["upstream-step"]["median_us"]; pg = t["paged"]["median_us"]
    print(spec.name, base, flush=True)
    for n, v in t.items():
        print(f"  {n:16s} {v['median_us']:7.2f} us  x{up / v['median_us']:.3f} upstream  x{pg / v['median_us']:.3f} paged", flush=True)
    BD._POOL_CACHE.clear(); torch.cuda.empty_cache()
