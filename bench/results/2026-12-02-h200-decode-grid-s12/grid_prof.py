"""Private experiment: the packed decode's balance grid floor (BALANCE_GRID_SPLITS) at large B."""
import dataclasses, json, os, sys
import torch
from bench import common
from bench import decode as BD
from interop import cases as C
from interop import plan as P
from interop.arch import DeviceFacts
from qsa_triton import decode as TD

OUT = os.environ.get("OUT", "/tmp")

def variant_plan(inp, floor):
    b, hq, d = inp.q.shape; hkv = inp.k.shape[1]
    old = P.BALANCE_GRID_SPLITS
    P.BALANCE_GRID_SPLITS = floor
    try:
        f = DeviceFacts.from_torch(inp.q.device)
        pl = P.fit_shared_memory(P.plan_decode(b, hkv, hq // hkv, d, inp.max_seqlen_k, f.sm_count,
                                               balance=True, one_block_splits=True),
                                 head_dim=d, limit=f.smem_per_block)
    finally:
        P.BALANCE_GRID_SPLITS = old
    return pl

res = []
for tp, b in [("TP1", 32), ("TP1", 64), ("TP1", 128), ("TP2", 64), ("TP2", 128), ("TP4", 128)]:
    for r in ["short", "mixed", "saturated"]:
        spec = C.DecodeSpec(f"decode/{tp}/B{b}/{r}", *C.TP_SHAPES[tp], 256, b, r, pad_capacity=False, seed=b)
        inp, ref = BD.prepare(spec, "cuda")
        plan, merge = TD.plan_for(b, inp.k.shape[1], inp.q.shape[1] // inp.k.shape[1], 256, inp.max_seqlen_k, inp.q.device)
        calls = {"ours": lambda: TD.sparse_decode(*inp.args)}
        for fl in (2, 1):
            pv = variant_plan(inp, fl)
            if pv != plan:
                calls[f"floor{fl}"] = (lambda pv=pv: TD._decode_with_plan(*inp.args, plan=pv, merge=merge))
        calls["generic"] = BD._generic(inp)
        if tp != "TP4":
            calls["sm121"] = BD._sm121(inp)
        ok = {}
        for n, f in calls.items():
            out = f(); torch.cuda.synchronize()
            ok[n] = common.within_tolerance(common.errors(out, ref))
        t = common.time_interleaved(calls, calls_per_replay=20, rounds=15)
        us = {n: t[n].get("median_us") for n in calls}
        o = us["ours"]
        print(f"{spec.name:26s} {merge:6s} splits {plan.max_splits:3d} " + "  ".join(f"{n} {u:6.2f}({o/u:4.2f})" for n, u in us.items() if u)
              + ("" if all(ok.values()) else f" CHECK {ok}"), flush=True)
        res.append({"case": spec.name, "us": us, "ok": ok, "plan": dataclasses.asdict(plan)})
json.dump(res, open(os.path.join(OUT, "grid_prof.json"), "w"), indent=1)
