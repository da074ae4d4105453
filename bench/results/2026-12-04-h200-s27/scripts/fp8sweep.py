"""Scratch (session 27): FP8 paged decode variants vs BF16 pool, TP1/TP2 saturated slots, one process,
interleaved graphs of 20 calls, every output checked against the FP32 reference."""
import dataclasses, sys, torch
from bench import common, decode as BD
from qsa_triton import decode_paged as DP
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 15
batches = [int(b) for b in (sys.argv[2] if len(sys.argv) > 2 else "16,64,128").split(",")]
tps = (sys.argv[3] if len(sys.argv) > 3 else "TP1,TP2").split(",")
dev = torch.device("cuda")

def mk(inp, plan=None, vb=True):
    def call():
        DP._V_BLOCKED = vb
        if plan is None:
            return DP.sparse_decode_paged(*inp.args, inp.scale)
        return DP.decode_paged_with_plan(*inp.args, inp.scale, plan=plan)
    return call

for tp in tps:
    for b in batches:
        ins, calls, refs = {}, {}, {}
        for kv in ("bf16", "fp8"):
            spec = BD.PoolSpec(f"pool/{tp}/slots/{kv}/B{b}", tp, b, "saturated", "slots", kv, seed=b)
            inp = BD.pool_inputs(spec, dev)
            ref = BD.pool_reference(*inp.args, inp.scale)
            ins[kv] = (inp, ref)
            base = DP._plan_of(inp.args[0], inp.args[1], inp.args[5], False)
            if kv == "bf16":
                variants = {"bf16": mk(inp)}
            else:
                variants = {"fp8[main]": mk(inp, vb=False), "fp8[vblk]": mk(inp)}
                nb64 = -(-inp.args[5].shape[-1] // 64)
                for st in (4, 7):
                    sp = min(base.num_splits, nb64)
                    p = dataclasses.replace(base, block_n=64, num_splits=sp, num_stages=st if nb64 >= 2 * sp else 3)
                    variants[f"fp8[vblk,bn64,st{st}]"] = mk(inp, p)
                    if base.num_splits == 1 and st == 4:
                        p = dataclasses.replace(base, block_n=64, num_splits=2, num_stages=4)
                        variants[f"fp8[vblk,bn64,st4,s2]"] = mk(inp, p)
            for n, c in variants.items():
                out = c(); torch.cuda.synchronize()
                err = common.errors(out, ref)
                ok = common.within_tolerance(err)
                print(f"{tp} B{b} {n}: plan {base} check {'ok' if ok else 'FAIL ' + str(err)}", flush=True)
                if ok:
                    # pin the switch inside the captured graph: each call sets it before launching
                    calls[n] = c
        # the switch is read at launch: capture per variant happens in _Timed with its own setting
        t = common.time_interleaved(calls, calls_per_replay=20, rounds=rounds)
        bf = t["bf16"]["median_us"]
        for n, r in t.items():
            if "median_us" in r:
                print(f"  {tp} B{b} {n:16s} {r['median_us']:8.2f} us  bf16/this {bf / r['median_us']:.3f}x  p10 {r['p10_us']:.2f} p90 {r['p90_us']:.2f}", flush=True)
            else:
                print(f"  {tp} B{b} {n} {r}")
        BD._POOL_CACHE.clear(); torch.cuda.empty_cache()
