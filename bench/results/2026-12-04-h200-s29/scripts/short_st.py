"""Scratch (session 29): packed decode at B x Hkv <= 16, shipped 3 stages vs 1 / 2, vs upstream's
SM121 kernel; short / mixed / saturated rows, interleaved graphs, every output checked."""
import dataclasses, os, sys
import torch
sys.path.insert(0, os.getcwd())
from bench import common, decode as BD
from interop import cases as C
from qsa_triton import decode as DEC

shapes = [("TP1", 1), ("TP1", 2), ("TP1", 4), ("TP1", 8), ("TP2", 1), ("TP2", 4), ("TP2", 8), ("TP2", 16)]
for tp, b in shapes:
    for rows in ("short", "mixed", "saturated"):
        spec = C.DecodeSpec(f"decode/{tp}/B{b}/{rows}", *C.TP_SHAPES[tp], BD.D, b, rows, pad_capacity=False, seed=b)
        inp, ref = BD.prepare(spec, "cuda")
        bb, hq, d = inp.q.shape; hkv = inp.k.shape[1]
        plan, merge = DEC.plan_for(bb, hkv, hq // hkv, d, inp.args[5], inp.q.device)
        calls = {"upstream": BD._sm121(inp), "ours": BD._ours(inp)}
        for st in (1, 2):
            p = dataclasses.replace(plan, num_stages=st)
            calls[f"st{st}"] = (lambda p=p: DEC._decode_with_plan(*inp.args, plan=p, merge=merge))
        ok = {}
        for n, f in calls.items():
            o = f().float(); torch.cuda.synchronize()
            e = common.errors(o, ref)
            if not common.within_tolerance(e):
                print("FAIL", n, e); continue
            ok[n] = f
        t = common.time_interleaved(ok, rounds=25)
        up = t["upstream"]["median_us"]; us = t["ours"]["median_us"]
        print(spec.name, plan, merge, flush=True)
        for n, v in t.items():
            print(f"  {n:10s} {v['median_us']:7.2f} us  x{up / v['median_us']:.3f} upstream  x{us / v['median_us']:.3f} ours", flush=True)
