"""Import isolation (architecture.md): ``import qsa_pallas`` never imports torch, ``import
qsa_triton`` never imports jax, the core modules import numpy only, and the bridge modules import
both frameworks lazily. Each check runs in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys

import pytest

CORE = ["interop", "interop.contract", "interop.arch", "interop.reference", "interop.indices"]


def _modules_after(stmt: str) -> set[str]:
    code = f"{stmt}\nimport sys\nprint(' '.join(sorted(m.split('.')[0] for m in sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return set(proc.stdout.split())


def test_qsa_pallas_does_not_import_torch():
    pytest.importorskip("jax")
    mods = _modules_after("import qsa_pallas")
    assert "qsa_pallas" in mods and "torch" not in mods


def test_qsa_triton_does_not_import_jax():
    pytest.importorskip("torch")
    mods = _modules_after("import qsa_triton")
    assert "qsa_triton" in mods
    assert "jax" not in mods and "jaxlib" not in mods


@pytest.mark.parametrize("module", CORE + ["interop.geometry", "interop.plan"])
def test_core_imports_numpy_only(module):
    import importlib.util

    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} not written yet")
    mods = _modules_after(f"import {module}")
    assert not mods & {"torch", "jax", "jaxlib", "triton"}, mods & {"torch", "jax", "jaxlib", "triton"}


@pytest.mark.parametrize("module", ["interop.dlpack", "interop.cli", "interop.crosscheck",
                                    "interop.capture", "interop.compile_check"])
def test_bridges_import_frameworks_lazily(module):
    import importlib.util

    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} not written yet")
    mods = _modules_after(f"import {module}")
    assert not mods & {"torch", "jax", "jaxlib", "triton"}, mods & {"torch", "jax", "jaxlib", "triton"}
