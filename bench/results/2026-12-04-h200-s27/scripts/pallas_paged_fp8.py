"""Scratch (session 27): Pallas paged decode, FP8 V select on / off (module switch read at trace
time), FP8 and BF16 pools, TP1/TP2 saturated slots; Triton paged as the same-run reference."""
import sys, numpy as np, torch
from bench import common, decode as BD
import qsa_pallas
from qsa_pallas import decode_paged as PDP
rounds = int(sys.argv[1]); batches = [int(b) for b in sys.argv[2].split(",")]; tps = sys.argv[3].split(",")
dev = torch.device("cuda")
def variant(inp, flag):
    chain = BD._pallas_paged(inp)
    def call():
        PDP._V_SELECT = flag
        return chain()
    call.chain = getattr(chain, "chain", 1); call.capturable = getattr(chain, "capturable", False)
    return call
for tp in tps:
    for b in batches:
        spec = BD.PoolSpec(f"pool/{tp}/slots/fp8/B{b}", tp, b, "saturated", "slots", "fp8", seed=b)
        inp = BD.pool_inputs(spec, dev)
        ref = BD.pool_reference(*inp.args, inp.scale)
        calls = {}
        for flag in (False, True):
            PDP._V_SELECT = flag
            v = variant(inp, flag)
            chain = v.__closure__  # noqa
            out = BD._pallas_paged(inp).once(); torch.cuda.synchronize()
            err = common.errors(out, ref)
            print(f"{tp} B{b} select={flag} check {'ok' if common.within_tolerance(err) else 'FAIL ' + str(err)}", flush=True)
            calls[f"pallas-paged[select={flag}]"] = v
        calls["paged(triton)"] = BD._paged(inp)
        t = common.time_interleaved(calls, rounds=rounds)
        base = t["pallas-paged[select=False]"]["median_us"]
        for n, r in t.items():
            if "median_us" in r:
                print(f"  {tp} B{b} fp8 {n:28s} {r['median_us']:9.2f} us  old/this {base / r['median_us']:.3f}x", flush=True)
            else:
                print(f"  {tp} B{b} {n} {r}", flush=True)
        BD._POOL_CACHE.clear(); torch.cuda.empty_cache()
