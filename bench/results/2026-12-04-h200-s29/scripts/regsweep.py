"""Scratch (session 29): FP8 paged decode occupancy. The FP8 split kernel takes 189 registers (two
programs an SM); maxnreg 168 / 128 lets three / four reside, with splits sized to fill them.
TP1/TP2 saturated single slots, one process, interleaved 20-call graphs, every output checked."""
import dataclasses, sys, torch
from bench import common, decode as BD
from qsa_triton import decode_paged as DP
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 15
batches = [int(b) for b in (sys.argv[2] if len(sys.argv) > 2 else "16,64,128").split(",")]
tps = (sys.argv[3] if len(sys.argv) > 3 else "TP1,TP2").split(",")
kvs = (sys.argv[4] if len(sys.argv) > 4 else "fp8").split(",")
dev = torch.device("cuda")
SMS = torch.cuda.get_device_properties(dev).multi_processor_count

def mk(inp, plan=None, nreg=0):
    def call():
        DP._MAXNREG = nreg
        if plan is None:
            return DP.sparse_decode_paged(*inp.args, inp.scale)
        return DP.decode_paged_with_plan(*inp.args, inp.scale, plan=plan)
    return call

for tp in tps:
    for b in batches:
        calls = {}
        for kv in ("bf16",) + tuple(k for k in kvs if k != "bf16"):
            spec = BD.PoolSpec(f"pool/{tp}/slots/{kv}/B{b}", tp, b, "saturated", "slots", kv, seed=b)
            inp = BD.pool_inputs(spec, dev)
            ref = BD.pool_reference(*inp.args, inp.scale)
            base = DP._plan_of(inp.args[0], inp.args[1], inp.args[5], False)
            pairs = inp.args[0].shape[0] * inp.args[1].shape[1]
            nb = -(-inp.args[5].shape[-1] // base.block_n)
            variants = {kv: mk(inp)}
            if kv in kvs:
                combos = ((3, 0), (4, 0)) if kv == "bf16" else ((2, 168), (3, 168), (4, 128), (2, 128))
                for res, nreg in combos:
                    sp = max(1, min(nb, res * SMS // pairs))
                    st = 7 if nb >= 2 * sp else 3
                    p = dataclasses.replace(base, num_splits=sp, num_stages=st)
                    variants[f"{kv}[r{nreg},res{res},s{sp}]"] = mk(inp, p, nreg)
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
                print(f"  {tp} B{b} {n:28s} {r['median_us']:8.2f} us  bf16/this {bf / r['median_us']:.3f}x  p10 {r['p10_us']:.2f} p90 {r['p90_us']:.2f}", flush=True)
            else:
                print(f"  {tp} B{b} {n} {r}")
        BD._POOL_CACHE.clear(); torch.cuda.empty_cache()
