"""Every sparse prefill configuration the geometry selector can return on sm_120 / sm_121 compiles
for that arch and fits its 101,376 bytes of shared memory per block (``qsa-contract.md`` §5).

No GPU needed: ``triton.compile(ASTSource(...), target=GPUTarget("cuda", 120|121, 32))``. The
compile does not check the shared-memory limit, so ``compiled.metadata.shared`` is compared here.
Pointers and K/V strides are specialised as 16-byte aligned, like a real launch: without that the
gathers are not pipelined and the shared memory would be under-counted.

The compiles run in a subprocess with ``TRITON_INTERPRET`` unset (the interpreter, switched on by
conftest for the CPU tests, replaces ``@triton.jit`` functions).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from interop.arch import KNOWN_ARCHS
from interop.geometry import all_configs

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def report():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    # the variants with the most shared memory and the FP8 path (qsa_triton.prefill has no
    # __main__: kernel modules hold no AOT tooling)
    code = ("import json; from qsa_triton import prefill as P; "
            "sel = tuple(v for v in P.VARIANTS if v[0] in (P.MODE_CHUNK, P.MODE_SLOTS)); "
            "print(json.dumps({a: P.compile_check(a, variants=sel) for a in ('sm_120', 'sm_121')}))")
    proc = subprocess.run([sys.executable, "-c", code],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"compile check printed no report (rc={proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1])


@pytest.mark.parametrize("arch", ["sm_120", "sm_121"])
def test_every_selectable_config_fits_sm12x(report, arch):
    rows = report[arch]
    limit = KNOWN_ARCHS[arch].smem_per_block
    assert limit == 101_376
    geos = {g.key for g in all_configs(arch)}
    compiled = {(r["constexprs"]["BLOCK_M"], r["constexprs"]["BLOCK_N"], r["num_warps"],
                 r["num_stages"]) for r in rows}
    assert geos <= compiled, f"not compiled: {geos - compiled}"
    too_big = [(r["name"], r["shared"]) for r in rows if r["shared"] > limit]
    assert not too_big, f"over {limit} B of shared memory on {arch}: {too_big}"
    assert all(r["shared"] > 0 for r in rows)  # pipelined gathers do use shared memory
