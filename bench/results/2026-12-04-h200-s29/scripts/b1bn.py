"""Scratch (session 29): paged decode at B = 1: one-chunk programs without pipelining (num_stages 1 / 2)
and 64-key chunks (33 splits, half the merge), TP1 / TP2 / TP4 single slots, interleaved graphs."""
import dataclasses, os, sys
import torch
sys.path.insert(0, os.getcwd())
from bench import common, decode as BD
from qsa_triton import decode_paged as DP

for tp in ("TP1", "TP2", "TP4"):
    spec = BD.PoolSpec(f"pool/{tp}/slots/bf16/B1/saturated", tp, 1, "saturated", "slots", "bf16")
    inp = BD.pool_inputs(spec, "cuda")
    ref = BD.pool_reference(*inp.args, inp.scale)
    q, k, idx = inp.args[0], inp.args[1], inp.args[5]
    base = DP._plan_of(q, k, idx, False)
    calls = {"upstream-step": BD._upstream_step(inp),
             "paged": (lambda: DP.sparse_decode_paged(*inp.args, inp.scale))}
    def mk(bn, s, st, w=4):
        plan = dataclasses.replace(base, block_n=bn, num_splits=s, num_stages=st, num_warps=w)
        return lambda: DP.decode_paged_with_plan(*inp.args, inp.scale, plan=plan)
    w = idx.shape[-1]
    for bn, st in ((32, 1), (32, 2), (64, 1), (64, 2), (64, 3), (16, 1)):
        s = min(-(-w // bn), base.num_splits * 32 // bn, 128)
        calls[f"bn{bn}/s{s}/st{st}"] = mk(bn, s, st)
    calls[f"bn32/s{base.num_splits}/st3/w2"] = mk(32, base.num_splits, 3, 2)
    ok = {}
    for n, f in calls.items():
        o = f().float(); torch.cuda.synchronize()
        if n != "upstream-step":
            e = common.errors(o, ref)
            if not common.within_tolerance(e):
                print("FAIL", n, e); continue
        ok[n] = f
    t = common.time_interleaved(ok, rounds=40)
    up = t["upstream-step"]["median_us"]
    print(spec.name, base, flush=True)
    for n, v in t.items():
        print(f"  {n:22s} {v['median_us']:7.2f} us  x{up / v['median_us']:.3f}", flush=True)
    BD._POOL_CACHE.clear(); torch.cuda.empty_cache()
