"""Scratch: one call each of bf16 / fp8[main] / fp8[vblk] at TP1 B=128 (for ncu)."""
import torch
from bench import decode as BD
from qsa_triton import decode_paged as DP
dev = torch.device("cuda")
for kv, vbs in (("bf16", (True,)), ("fp8", (False, True))):
    spec = BD.PoolSpec(f"pool/TP1/slots/{kv}/B128", "TP1", 128, "saturated", "slots", kv, seed=128)
    inp = BD.pool_inputs(spec, dev)
    for vb in vbs:
        DP._V_BLOCKED = vb
        DP.sparse_decode_paged(*inp.args, inp.scale); torch.cuda.synchronize()
        print(kv, vb, flush=True)
    BD._POOL_CACHE.clear(); del inp; torch.cuda.empty_cache()
