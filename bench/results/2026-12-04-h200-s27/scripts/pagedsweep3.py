"""Scratch (session 27): paged decode plans with 8 warps and BLOCK_N 64, BF16 and FP8 pools, TP1/TP2,
interleaved graphs of 20 calls, every output checked against the FP32 reference."""
import dataclasses, sys, torch
from bench import common, decode as BD
from qsa_triton import decode_paged as DP
rounds = int(sys.argv[1]); batches = [int(b) for b in sys.argv[2].split(",")]; tps = sys.argv[3].split(",")
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
            nb64 = -(-inp.args[5].shape[-1] // 64)
            v = {f"{kv}": mk(inp)}
            for w, st in ((8, 3), (8, 4), (8, 7), (4, 4)):
                sp = min(base.num_splits, nb64)
                p = dataclasses.replace(base, block_n=64, num_warps=w, num_splits=sp, num_stages=st if nb64 >= 2 * sp else 3)
                v[f"{kv}[bn64,w{w},st{st}]"] = mk(inp, p)
            for n, c in v.items():
                out = c(); torch.cuda.synchronize()
                err = common.errors(out, ref); ok = common.within_tolerance(err)
                if not ok: print(f"{tp} B{b} {n}: FAIL {err}", flush=True)
                else: calls[n] = c
            if kv == "bf16": print(f"{tp} B{b} plan {base}", flush=True)
        t = common.time_interleaved(calls, calls_per_replay=20, rounds=rounds)
        bf = t["bf16"]["median_us"]
        for n, r in t.items():
            if "median_us" in r:
                print(f"  {tp} B{b} {n:22s} {r['median_us']:8.2f} us  bf16/this {bf / r['median_us']:.3f}x", flush=True)
            else:
                print(f"  {tp} B{b} {n} {r}", flush=True)
        BD._POOL_CACHE.clear(); torch.cuda.empty_cache()
