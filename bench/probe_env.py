"""One-shot environment probe for the GPU machine: versions, devices, Pallas Triton lowering names."""
import json, os, sys, time
out = {}
import torch, triton
out["python"] = sys.version
out["torch"] = torch.__version__; out["triton"] = triton.__version__
out["cuda"] = torch.cuda.is_available()
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    out["gpu"] = dict(name=p.name, cc=(p.major, p.minor), sms=p.multi_processor_count,
                      smem_optin=getattr(p, "shared_memory_per_block_optin", None))
import jax
out["jax"] = jax.__version__
out["jax_devices"] = [str(d) for d in jax.devices()]
d = jax.devices()[0]
out["jax_dev_attrs"] = {a: str(getattr(d, a, None)) for a in ("device_kind", "compute_capability", "core_count", "platform")}
from jax.experimental import pallas as pl
import jax.experimental.pallas.triton as plt
out["pallas_triton_names"] = [n for n in dir(plt) if not n.startswith("_")]
out["pallas_names"] = [n for n in dir(pl) if not n.startswith("_")][:80]
import shutil
out["compute_sanitizer"] = shutil.which("compute-sanitizer")
print(json.dumps(out, indent=1))
