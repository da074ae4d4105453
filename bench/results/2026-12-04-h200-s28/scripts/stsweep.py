"""Scratch (session 28): paged decode pipeline depth. BF16 / FP8 pools at num_stages 7 (shipped),
10, 13 (10: three K/V buffers a load, 13: four), TP1/TP2 saturated single slots, one process,
interleaved 20-call graphs, every output checked against the FP32 reference."""
import dataclasses, sys, torch
from bench import common, decode as BD
from qsa_triton import decode_paged as DP
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 15
batches = [int(b) for b in (sys.argv[2] if len(sys.argv) > 2 else "16,64,128").split(",")]
tps = (sys.argv[3] if len(sys.argv) > 3 else "TP1,TP2").split(",")
dev = torch.device("cuda")

def mk(inp, plan=None):
    if plan is None:
        return lambda: DP.sparse_decode_paged(*inp.args, inp.scale)
    return lambda: DP.decode_paged_with_plan(*inp.args, inp.scale, plan=plan)

for tp in tps:
    for b in batches:
        calls = {}
        for kv in ("bf16", "fp8"):
            spec = BD.PoolSpec(f"pool/{tp}/slots/{kv}/B{b}", tp, b, "saturated", "slots", kv, seed=b)
            inp = BD.pool_inputs(spec, dev)
            ref = BD.pool_reference(*inp.args, inp.scale)
            base = DP._plan_of(inp.args[0], inp.args[1], inp.args[5], False)
            variants = {kv: mk(inp)}
            if base.num_stages == 7:
                for st in ((10,) if kv == "bf16" else (10, 13)):
                    variants[f"{kv}[s{st}]"] = mk(inp, dataclasses.replace(base, num_stages=st))
                    if kv == "fp8" and b >= 64:
                        p = dataclasses.replace(base, num_stages=st, num_splits=base.num_splits * 2)
                        variants[f"{kv}[s{st},x2]"] = mk(inp, p)
            for n, c in variants.items():
                out = c(); torch.cuda.synchronize()
                err = common.errors(out, ref)
                ok = common.within_tolerance(err)
                print(f"{tp} B{b} {n}: plan {base} check {'ok' if ok else 'FAIL ' + str(err)}", flush=True)
                if ok:
                    calls[n] = c
        t = common.time_interleaved(calls, calls_per_replay=20, rounds=rounds)
        bf = t["bf16"]["median_us"]
        for n, r in t.items():
            if "median_us" in r:
                print(f"  {tp} B{b} {n:16s} {r['median_us']:8.2f} us  bf16/this {bf / r['median_us']:.3f}x  p10 {r['p10_us']:.2f} p90 {r['p90_us']:.2f}", flush=True)
            else:
                print(f"  {tp} B{b} {n} {r}")
        BD._POOL_CACHE.clear(); torch.cuda.empty_cache()
