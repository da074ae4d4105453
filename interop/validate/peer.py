"""Load upstream SGLang 0.5.23's QSA kernels by path, as a *peer* (benchmarks) and an *oracle*
(differential tests). Never copied into this project; optional: callers skip when absent.

The ``sglang`` package root (the folder holding ``srt/`` and ``kernels/``) is, in this order,
``$QSA_SGLANG_PATH``, an installed ``sglang`` distribution (found without importing it: its
``__init__`` pulls in the whole serving stack), or ``.peer/sglang`` at the repository root
(unpacked from ``pip download sglang==0.5.23 --no-deps``). ``sparse_attn.py`` imports
``sglang.srt.batch_invariant_ops.is_batch_invariant_mode_enabled``: a stub returning False is
registered before loading (``anchors.md``). Upstream's modules import torch and triton when
loaded, so only the loaders touch them.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import sys
import types
from pathlib import Path

__all__ = ["sglang_root", "load_sparse_attn", "load_sm121_decode", "PeerUnavailable"]


#: where the peer's files are looked for last: .peer/sglang at the repository root (not the
#: current directory)
_PEER_DIR = Path(__file__).resolve().parents[2] / ".peer" / "sglang"


class PeerUnavailable(RuntimeError):
    """The sglang==0.5.23 files are not present on this machine."""


def sglang_root() -> Path | None:
    """Folder of the ``sglang`` package files, or None when absent."""
    env = os.environ.get("QSA_SGLANG_PATH")
    candidates = [Path(env)] if env else []
    try:  # an installed distribution only: our stub package (load_sparse_attn) has no spec
        importlib.metadata.distribution("sglang")
        spec = importlib.util.find_spec("sglang")
    except (importlib.metadata.PackageNotFoundError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        candidates.append(Path(next(iter(spec.submodule_search_locations))))
    candidates.append(_PEER_DIR)
    for c in candidates:
        if (c / "srt" / "layers" / "attention" / "qsa" / "sparse_attn.py").is_file():
            return c
    return None


def _load(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@functools.cache
def load_sparse_attn() -> types.ModuleType:
    """Upstream ``sglang/srt/layers/attention/qsa/sparse_attn.py`` (prefill kernels and
    ``sparse_gqa_packed_decode_triton``, the generic decode path).

    Raises:
      PeerUnavailable: the files are absent.
    """
    root = sglang_root()
    if root is None:
        raise PeerUnavailable("sglang==0.5.23 not found (pip download sglang==0.5.23 --no-deps, "
                              f"unpack its sglang/ folder to {_PEER_DIR} or set QSA_SGLANG_PATH)")
    if "sglang.srt.batch_invariant_ops" not in sys.modules:
        stub = types.ModuleType("sglang.srt.batch_invariant_ops")
        stub.is_batch_invariant_mode_enabled = lambda: False
        for parent in ("sglang", "sglang.srt"):
            sys.modules.setdefault(parent, types.ModuleType(parent))
        sys.modules["sglang.srt.batch_invariant_ops"] = stub
    return _load("qsa_peer_sparse_attn", root / "srt" / "layers" / "attention" / "qsa" / "sparse_attn.py")


@functools.cache
def load_sm121_decode() -> types.ModuleType:
    """Upstream ``sglang/kernels/kda_kernels/qwen38_qsa_sm121/kernel.py`` (the packed decode
    kernel; entry ``qwen38_qsa_sm121(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale)``).

    Raises:
      PeerUnavailable: the files are absent.
    """
    root = sglang_root()
    path = None if root is None else root / "kernels" / "kda_kernels" / "qwen38_qsa_sm121" / "kernel.py"
    if path is None or not path.is_file():
        raise PeerUnavailable("sglang==0.5.23 SM121 decode kernel not found")
    return _load("qsa_peer_sm121_decode", path)
