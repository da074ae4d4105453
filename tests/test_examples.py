"""Every runnable example under ``docs/examples/`` runs as a new user would run it (a fresh
interpreter, none of the test suite's environment: the example must pick CPU or GPU and set
``TRITON_INTERPRET`` itself), prints what it checked, and passes its own check against the FP64
reference. The JAX examples also run with ``JAX_ENABLE_X64=1`` (a model that enables 64-bit
types must still be able to call the kernels: their index arithmetic stays int32)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "docs" / "examples").glob("*.py"))
NEEDS = {"jax": ("jax",), "torch": ("torch", "triton")}


def test_examples_exist():
    names = {p.name for p in EXAMPLES}
    assert {"jax_decode.py", "jax_step.py", "torch_decode.py", "torch_prefill.py",
            "jax_prefill_blocks.py"} <= names


RUNS = [(p, False) for p in EXAMPLES] + [(p, True) for p in EXAMPLES if p.name.startswith("jax")]


@pytest.mark.parametrize("path,x64", RUNS,
                         ids=lambda v: v.name if isinstance(v, Path) else ("x64" if v else "32"))
def test_example_runs_and_checks_itself(path, x64):
    for module in NEEDS.get(path.name.split("_")[0], ()):
        pytest.importorskip(module)
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "JAX_PLATFORMS", "XLA_FLAGS", "JAX_ENABLE_X64")}
    env["PYTHONPATH"] = str(ROOT)  # this checkout's packages, as an installed copy would be
    if x64:
        env["JAX_ENABLE_X64"] = "1"
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env=env)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    lines = out.splitlines()
    assert lines[-1] == "OK", out
    assert any(line.startswith("checked: ") for line in lines), out
    assert any("FP64 reference" in line for line in lines), out
