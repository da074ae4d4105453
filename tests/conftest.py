"""Shared pytest setup.

On a machine without a CUDA GPU the Triton kernels run under Triton's interpreter, which must be
switched on before any ``@triton.jit`` function is defined, i.e. before ``qsa_triton`` is imported.
"""

import os

HAS_CUDA_DEVICE = os.path.exists("/dev/nvidia0") or os.path.exists("/dev/nvidiactl")
# jax allocates on demand beside torch (DLPack hand-offs) and beside the other pytest-xdist
# workers: preallocating 75% of the GPU in each worker runs the GPU suite out of memory
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
if not HAS_CUDA_DEVICE:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    # Four host devices for the shard_map tests, TP4 the most (set before jax initialises).
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=4").strip()

try:  # test-only patch of the Triton interpreter's bf16 dot (architecture.md, "Things that bite")
    from tests import triton_interp_patch  # noqa: F401
except ImportError:
    pass
