"""Scratch: one call each of the paged split kernel, bf16 and fp8 pools, TP1 B = 128 (for ncu)."""
import torch
from bench import decode as BD
from qsa_triton import decode_paged as DP
dev = torch.device("cuda")
for kv in ("bf16", "fp8"):
    spec = BD.PoolSpec(f"pool/TP1/slots/{kv}/B128", "TP1", 128, "saturated", "slots", kv, seed=128)
    inp = BD.pool_inputs(spec, dev)
    DP.sparse_decode_paged(*inp.args, inp.scale); torch.cuda.synchronize()
    print(kv, flush=True)
    BD._POOL_CACHE.clear(); del inp; torch.cuda.empty_cache()
