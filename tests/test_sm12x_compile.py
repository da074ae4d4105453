"""Ahead-of-time compile lists (``interop.validate.compile``) and sm_120 / sm_121 shared memory
(``qsa-contract.md`` §5: 101,376 bytes per block).

The lists are checked without compiling: they hold every configuration the shipped plans and
selectors can launch. A sample per kernel family and backend (``SAMPLES``: the largest tiles of
each variant and the helper kernels) is then compiled for sm_120 (the decode family also for
sm_121, by ptxas from sm_120's PTX) without a GPU and checked against the limit and the
shared-memory model ``interop.plan.smem_bytes``. Every configuration: ``qsa compile --arch
sm_120,sm_121`` (about 10 minutes on two cores; README "Tests").

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
    every variant, unsplit and split-KV, plus the tail launch's geometry, the split-KV merge per
    head tile, and the paged slot pre-pass."""
    every = CC.triton_prefill_configs(arch)
    assert any(c["name"].startswith("prefill_resolve_pool_slots") for c in every)
    cfgs = [c for c in every if "ROW_LOOP" in c["constexprs"]]
    compiled = {(c["constexprs"]["BLOCK_M"], c["constexprs"]["BLOCK_N"], c["num_warps"],
                 c["num_stages"]) for c in cfgs if not c["constexprs"]["ROW_LOOP"]}
    geos = {g.key for g in all_configs(arch)}
    assert geos <= compiled, f"not listed: {geos - compiled}"
    split = {(c["constexprs"]["BLOCK_M"], c["constexprs"]["BLOCK_N"], c["num_warps"],
              c["num_stages"]) for c in cfgs if c["constexprs"]["SPLIT"]}
    assert split == compiled, "every main geometry also split-KV"
    assert {c["constexprs"]["BLOCK_M"] for c in every if c["name"].startswith("prefill_merge")} \
        == {b for b, *_ in compiled}
    assert {c["constexprs"]["MODE"] for c in cfgs} == {0, 1, 2}
    assert any(c["constexprs"]["ROW_LOOP"] for c in cfgs)
    assert len({c["name"] for c in cfgs}) == len(cfgs)


#: (backend, kernel family, arches, configurations as a regular expression, how many per arch):
#: per family the largest tiles of each variant (bf16 / FP8 K/V, PDL, one split and several)
#: and its helper kernels; the indexer's sample lives in test_indexer.py
SAMPLES = [
    ("triton", "decode", ("sm_120", "sm_121"),
     r"decode_split_G12_ht16_bn64_w8_s1_(inline4_)?bf16_pdllate$|decode_merge_chunk2_bf16_pdl$", 3),
    ("triton", "prefill", ("sm_120",),
     r"prefill_mode1_bf16_bf16_G6_bm16_bn64_w4_s2(_split)?(_pdl)?$"
     r"|prefill_mode2_bf16_fp8e4nv_G6_bm16_bn64_w4_s2(_pdl)?$|prefill_merge_G6_bm16_bf16$", 4),
    ("triton", "decode_paged", ("sm_120",),
     r"paged_split_G12_ht16_bn32_w4_s7_bf16_kv(bf16_direct_off64|fp8e4nv_off64_pdl)$"
     r"|paged_merge_p128_bf16_pdl$", 3),
    ("triton", "prefill_union", ("sm_120",),
     r"prefill_union_build_R2_|prefill_union_skip_R8_"
     r"|prefill_union_mode2_bf16_(bf16|fp8e4nv)_R8_m64_", 4),
    ("pallas", "decode", ("sm_120",), r"pallas_decode_TP1_B1_|pallas_decode_TP2_B95_", 3),
    ("pallas", "prefill", ("sm_120",),
     r"pallas_prefill_(chunk_bf16|paged_fp8)_ht16_bn64_w4_s2(_split)?$", 4),
    ("pallas", "decode_paged", ("sm_120",),
     r"pallas_paged_12_1_(kvbfloat16_R1|kvfloat8_e4m3fn_R95)_", 2),
    ("pallas", "prefill_union", ("sm_120",),
     r"pallas_prefill_union_(paged_bf16_R8_m32|chunk_fp8_R8_m64)_bn32_w4_s3$", 6),
]

_SAMPLE_SCRIPT = ("import json, sys\n"
                  "from interop.validate import compile as CC\n"
                  "backend, family, archs, match = json.loads(sys.argv[1])\n"
                  "print(json.dumps([r.as_dict() for r in CC.check(backend, archs, "
                  "kernels=(family,), match=match)]))")


def _estimate(cfg: dict) -> int | None:
    """``interop.plan.smem_bytes`` of a decode split or per-row prefill configuration."""
    from interop.plan import smem_bytes

    k = cfg["constexprs"]
    if "HT" in k and "BLOCK_N" in k and "R" not in k:  # decode split kernel
        return smem_bytes(head_tile=k["HT"], block_n=k["BLOCK_N"], head_dim=k["D"],
                          num_stages=cfg["num_stages"])
    if "BLOCK_M" in k and "BLOCK_N" in k:  # per-row prefill kernel (not the split merge)
        return smem_bytes(head_tile=k["BLOCK_M"], block_n=k["BLOCK_N"], head_dim=k["D"],
                          num_stages=cfg["num_stages"], kv_bytes=1 if "fp8" in cfg["name"] else 2,
                          v_convert=True)
    return None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend,family,archs,match,count", SAMPLES,
                         ids=[f"{b}:{f}" for b, f, *_ in SAMPLES])
def test_sample_compiles_and_fits_sm12x(backend, family, archs, match, count):
    """A sample of each kernel family (``SAMPLES``) compiles for sm_120 without a GPU, fits
    101,376 B of shared memory and stays within ``interop.plan.smem_bytes`` where the plans are
    fitted with it (the model must not under-count); sm_121 reuses sm_120's PTX (ptxas only)
    once a full compile has shown the same PTX, with the same resources. Every configuration:
    ``qsa compile --arch sm_120,sm_121`` (README)."""
    pytest.importorskip("triton")
    pytest.importorskip("jax")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _SAMPLE_SCRIPT,
                           json.dumps([backend, family, archs, match])],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("[")]
    assert lines, f"compile sample printed no report (rc={proc.returncode}):\n{proc.stderr[-4000:]}"
    rows = json.loads(lines[-1])
    for arch in archs:
        assert sum(r["arch"] == arch for r in rows) == count, [r["name"] for r in rows]
    for r in rows:
        assert r["error"] is None and r["fits"], r
        assert 0 < r["shared"] <= 101_376, r
    if backend == "triton":
        cfgs = {c["name"]: c for c in CC._FAMILY_LISTS["triton"][family]("sm_120")}
        for r in rows:
            est = _estimate(cfgs[r["name"]])
            assert est is None or r["shared"] <= est, (r, est)
    if "sm_121" in archs:
        base = {r["name"]: r for r in rows if r["arch"] == "sm_120"}
        assembled = [r for r in rows if r["assembled_from"] == "sm_120"]
        assert assembled and all(r["arch"] == "sm_121" for r in assembled)
        for r in rows:
            if r["arch"] == "sm_121":
                b = base[r["name"]]
                assert (r["shared"], r["regs"], r["spill_bytes"]) == (
                    b["shared"], b["regs"], b["spill_bytes"]), (r, b)


def test_sibling_arch_reuses_ptx_only_after_a_matching_check(monkeypatch):
    """sm_121 is assembled from sm_120's PTX (ptxas only) once a full compile of the kernel gave
    the same PTX up to ``.target`` and line-info file names; a kernel whose PTX differs, and a
    configuration sm_120 did not compile, are compiled in full."""
    assembled = []
    monkeypatch.setattr(CC, "_assemble",
                        lambda ptx, arch, options: assembled.append((ptx, arch)) or b"cubin")
    sib = CC._SiblingPTX(["sm_121", "sm_120", "sm_90"])
    assert sib.order[-1] == "sm_121" and sib.base == {"sm_121": "sm_120"}

    def ptx(cc, body, path="/tmp/a"):
        return f".version 8.7\n.target sm_{cc}a\n\t.file\t1 \"{path}\"\n{body}\n"

    fulls = []

    def full(cc, body, path="/tmp/b"):
        def run():
            fulls.append((cc, body))
            return 100, b"c", ptx(cc, body, path)
        return run

    for i in range(3):
        for kernel in ("same", "differs"):
            sib.build("sm_120", (kernel, i), kernel, full(120, f"{kernel}{i}", "/tmp/a"), {})
    fulls.clear()
    got = [sib.build("sm_121", ("same", i), "same", full(121, f"same{i}"), {})[2] for i in range(3)]
    assert got == [None, "sm_120", "sm_120"] and fulls == [(121, "same0")]
    assert assembled == [(ptx(120, f"same{i}"), "sm_121") for i in (1, 2)]
    assert ".target sm_121a\n" in CC._retarget(assembled[0][0], "sm_121")
    fulls.clear()
    got = [sib.build("sm_121", ("differs", i), "differs", full(121, f"other{i}"), {})[2]
           for i in range(3)]
    assert got == [None] * 3 and len(fulls) == 3
    assert sib.build("sm_121", ("new", 0), "same", full(121, "new"), {})[2] is None


def test_sibling_ptx_match_ignores_paths_in_line_and_debug_info():
    """PTX of one kernel compiled from two checkouts (a Triton cache shared by both returns the
    other checkout's) differs only in ``.file`` lines and the DWARF sections after the code: the
    same PTX for the sibling check; a difference in the code is not."""
    code = ".version 8.7\n.target sm_120a\n.visible .entry k()\n{\n\tret;\n}\n"

    def ptx(path: str, body: str = code) -> str:
        return (body + f"\t.file\t1 \"{path}/qsa_triton/decode.py\"\n"
                + "\t.section\t.debug_info\n\t{\n" + "".join(f"\t.b8 {ord(c)}\n" for c in path)
                + "\t}\n")

    sm121 = ptx("/tmp/a").replace("sm_120a", "sm_121a")
    assert CC._same_ptx(sm121, ptx("/tmp/other-clone"), "sm_121")
    assert not CC._same_ptx(sm121, ptx("/tmp/a", code.replace("ret;", "trap;")), "sm_121")
