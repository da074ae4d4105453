"""Ahead-of-time compile lists (``interop.validate.compile``) and sm_120 / sm_121 shared memory
(``qsa-contract.md`` §5: 101,376 bytes per block).

The lists are checked without compiling: they hold every configuration the shipped decode plan and
the prefill selector can launch. A representative sample per kernel family (the largest shared
memory of each, a PDL variant, the merge kernel, both prefill kernels' variants with the most
shared memory, both Pallas kernels) is then compiled for sm_120 (and the decode split kernel for
sm_121) without a GPU and checked against the limit and the shared-memory model
``interop.plan.smem_bytes``. Every configuration is compiled by ``qsa compile`` (``.ci/run``
runs it before the tests).

The compiles run in a subprocess with ``TRITON_INTERPRET`` unset (the interpreter, switched on by
conftest for the CPU tests, replaces ``@triton.jit`` functions).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from interop.arch import KNOWN_ARCHS, KNOWN_PARTS
from interop.contract import QUALIFIED
from interop.geometry import all_configs
from interop.plan import fit_shared_memory, plan_decode
from interop.validate import compile as CC

ROOT = Path(__file__).resolve().parent.parent
SMS = sorted({n for _, n in KNOWN_PARTS.values()})


@pytest.mark.parametrize("arch", ["sm_90", "sm_120"])
def test_decode_list_covers_every_shipped_launch(arch):
    """``triton_decode_configs`` holds the split-kernel configuration of every launch the shipped
    plan makes for the qualified shapes on every known SM count: the (constexprs, warps, stages)
    ``_launch`` computes with ``_split_constexprs`` for the plan ``plan_for`` builds, under both
    merges and PDL on (entry / late trigger) and off; and a merge kernel per split chunk."""
    from qsa_triton import decode as dec

    cfgs = CC.triton_decode_configs(arch)
    listed = {(tuple(sorted(c["constexprs"].items())), c["num_warps"], c["num_stages"])
              for c in cfgs if c["kernel"] is dec._decode_split_kernel}
    limit = KNOWN_ARCHS[arch].smem_per_block
    missing = []
    for sms in SMS:
        for hq, hkv in QUALIFIED["head_pairs"]:
            g = hq // hkv
            for b in (1, 2, 3, 4, 8, 16, 17, 32, 48, 64, 96, 128):
                for msk in (1, 31, 64, 500, 2051, 2055):
                    plan = fit_shared_memory(plan_decode(b, hkv, g, 256, msk, sms, balance=True,
                                                         one_block_splits=True),
                                             head_dim=256, limit=limit)
                    kv_rows, splits = b * hkv, plan.max_splits
                    for merge in ("kernel", "inline"):
                        for pdl in (False, True):
                            consts = dec._split_constexprs(
                                plan, g, 256, inline=merge == "inline",
                                lse_all=splits > 1 and merge == "kernel", use_pdl=pdl,
                                pdl_late=pdl and dec._pdl_late_trigger(kv_rows))
                            key = (tuple(sorted(consts.items())), plan.num_warps, plan.num_stages)
                            if key not in listed:
                                missing.append((sms, hq, b, msk, merge, pdl))
    assert not missing, missing[:5]
    merges = {c["constexprs"]["SPLIT_CHUNK"] for c in cfgs if c["kernel"] is dec._decode_merge_kernel}
    assert merges == {2, 4, 8, 16, 32, 64, 128}
    assert len({c["name"] for c in cfgs}) == len(cfgs)


def test_paged_decode_list_covers_every_part():
    """``triton_decode_paged_configs`` holds the split kernel of every plan the launcher builds
    (``qsa_triton.decode_paged._plan``) on every known part with its SM count and shared memory
    (sm_90: two programs per SM), and the merge kernel of every multi-split plan."""
    from qsa_triton import decode as dec
    from qsa_triton import decode_paged as P

    cfgs = CC.triton_decode_paged_configs("sm_90")
    listed = {(c["signature"].get("k_ptr"), tuple(sorted(c["constexprs"].items())), c["num_warps"],
               c["num_stages"]) for c in cfgs}
    missing = []
    for arch, sms in KNOWN_PARTS.values():
        for (hq, hkv), kv, bi, r in CC._paged_shapes("bfloat16"):
            p = P._plan(r, hkv, hq // hkv, 256, 2051, sms, KNOWN_ARCHS[arch].smem_per_block, 2,
                        1 if kv == "float8_e4m3fn" else 2, bi)
            pdl = dec._TRITON_PDL and r * hkv == 1  # pdl_enabled on an sm_90+ part
            consts = {"G": hq // hkv, "D": 256, "HT": p.head_tile, "BLOCK_N": p.block_n,
                      "DIRECT": p.num_splits == 1, "OFF64": False, "USE_PDL": pdl}
            merge = {"D": 256, "SPLIT_P2": max(2, P.next_pow2(p.num_splits)), "USE_PDL": pdl}
            merge["D_CHUNK"] = P._merge_d_chunk(merge["SPLIT_P2"], 256)
            if (("*fp8e4nv" if kv != "bfloat16" else "*bf16", tuple(sorted(consts.items())),
                 p.num_warps, p.num_stages) not in listed or p.num_splits > 1
                    and (None, tuple(sorted(merge.items())), 4, 1) not in listed):
                missing.append((arch, sms, hq, kv, bi, r, p))
    assert not missing, missing[:5]


@pytest.mark.parametrize("arch", ["sm_120", "sm_121"])
def test_prefill_list_covers_every_selectable_geometry(arch):
    """``triton_prefill_configs`` compiles every geometry the selector can return on the arch, in
    every variant, plus the tail launch's geometry."""
    cfgs = CC.triton_prefill_configs(arch)
    compiled = {(c["constexprs"]["BLOCK_M"], c["constexprs"]["BLOCK_N"], c["num_warps"],
                 c["num_stages"]) for c in cfgs if not c["constexprs"]["ROW_LOOP"]}
    geos = {g.key for g in all_configs(arch)}
    assert geos <= compiled, f"not listed: {geos - compiled}"
    assert {c["constexprs"]["MODE"] for c in cfgs} == {0, 1, 2}
    assert any(c["constexprs"]["ROW_LOOP"] for c in cfgs)
    assert len({c["name"] for c in cfgs}) == len(cfgs)


_SAMPLE_SCRIPT = textwrap.dedent("""
    import json, sys
    from interop.plan import smem_bytes
    from interop.validate import compile as CC
    from qsa_pallas import _compat as C

    def est(c):
        k = c["constexprs"]
        if "HT" in k:  # decode split kernel
            return smem_bytes(head_tile=k["HT"], block_n=k["BLOCK_N"], head_dim=k["D"],
                              num_stages=c["num_stages"])
        if "BLOCK_M" in k:  # prefill kernel
            return smem_bytes(head_tile=k["BLOCK_M"], block_n=k["BLOCK_N"], head_dim=k["D"],
                              num_stages=c["num_stages"], kv_bytes=1 if "fp8" in c["name"] else 2)
        return None

    picked = []
    for arch in ("sm_120", "sm_121"):
        dec = CC.triton_decode_configs(arch)
        split = [c for c in dec if c["name"].startswith("decode_split")]
        top = max(split, key=est)
        picked.append((arch, top))
        if arch == "sm_121":
            continue
        geo = (top["constexprs"]["HT"], top["constexprs"]["BLOCK_N"], top["num_stages"])
        picked += [(arch, c) for c in split
                   if (c["constexprs"]["HT"], c["constexprs"]["BLOCK_N"], c["num_stages"]) == geo
                   and c["name"].endswith("_pdllate") and "_inline" in c["name"]]
        picked.append((arch, max((c for c in dec if c["name"].startswith("decode_merge")
                                  and c["name"].endswith("_pdl")),
                                 key=lambda c: c["constexprs"]["SPLIT_CHUNK"])))
        pre = CC.triton_prefill_configs(arch)
        for mode in (1, 2):  # chunk bf16 / slots: the largest main geometry of each
            picked.append((arch, max((c for c in pre if c["constexprs"]["MODE"] == mode
                                      and not c["constexprs"]["ROW_LOOP"]), key=est)))
    rows = []
    for arch, c in picked:
        (rep,) = CC.compile_triton_configs(arch, [c])
        rows.append({"name": c["name"], "arch": arch, "shared": rep.shared, "fits": rep.fits,
                     "error": rep.error, "estimate": est(c), "pdl": bool(c["options"])})
    kind = CC.DEVICE_KIND["sm_120"]
    for fam, cases in (("decode", CC.pallas_decode_cases(kind)),
                       ("prefill", CC.pallas_prefill_cases(kind))):
        if fam == "decode":  # the largest tiles, one split and several
            cases = [max((c for c in cases if "_s1_" in c[0]), key=lambda c: c[0]),
                     max((c for c in cases if "_s1_" not in c[0]), key=lambda c: c[0])]
        else:
            cases = [c for c in cases if "chunk_bf16" in c[0]][-1:]
        for name, fn, args in cases:
            for m in C.triton_modules(C.lower_for_device_kind(fn, args, kind)):
                res = C.compile_ttir(m, 120)
                rows.append({"name": f"{name}:{m.name}", "arch": "sm_120", "shared": res["shared"],
                             "fits": res["shared"] <= 101_376, "error": None, "estimate": None,
                             "pdl": False})
    print(json.dumps(rows))
""")


@pytest.mark.timeout(300)
def test_representative_configs_compile_and_fit_sm12x():
    """A sample per kernel family compiles for sm_120 / sm_121 without a GPU, fits 101,376 B of
    shared memory and stays within ``interop.plan.smem_bytes`` (the model the plans are fitted
    with must not under-count); PDL variants compile there too."""
    pytest.importorskip("triton")
    pytest.importorskip("jax")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _SAMPLE_SCRIPT], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=280)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("[")]
    assert lines, f"compile sample printed no report (rc={proc.returncode}):\n{proc.stderr[-4000:]}"
    rows = json.loads(lines[-1])
    names = [r["name"] for r in rows]
    for prefix in ("decode_split", "decode_merge", "prefill_mode1", "prefill_mode2",
                   "pallas_decode", "pallas_prefill"):
        assert any(n.startswith(prefix) for n in names), prefix
    assert any(r["pdl"] and r["name"].endswith("_pdllate") for r in rows)
    assert {r["arch"] for r in rows} == {"sm_120", "sm_121"}
    for r in rows:
        assert r["error"] is None and r["fits"], r
        assert 0 < r["shared"] <= 101_376, r
        if r["estimate"] is not None:
            assert r["shared"] <= r["estimate"], r
