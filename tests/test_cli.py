"""The ``qsa`` command: ``contract`` (phase 1) and argument errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from interop.validate import cli


def test_contract_all_archs(capsys):
    assert cli.main(["contract"]) == 0
    out = capsys.readouterr().out
    for text in ("sm_90", "sm_100", "sm_120", "sm_121", "2055", "(24,2)", "101,376",
                 "sm90-table", "sm120-tuned-or-table", "[exact]"):
        assert text in out, text


def test_contract_prints_every_envelope(capsys, monkeypatch):
    """One row per distinct envelope of the contract module, every entry point named once:
    packed and paged decode, the prefill variants, the indexer, both steps."""
    from interop.cases import ENTRY_OP
    from interop.contract import envelope_text

    monkeypatch.setattr(cli, "_console", lambda: None)  # plain text: rows are not folded
    assert cli.main(["contract", "--arch", "sm_90"]) == 0
    out = capsys.readouterr().out
    rows = cli.envelope_rows()
    assert [r[0] for r in rows] == ["decode", "prefill", "paged", "indexer", "step", "step"]
    assert sorted(e for r in rows for e in r[1].split(" / ")) == sorted(ENTRY_OP)
    for entry in ENTRY_OP:
        assert envelope_text(entry) in out, entry
    for text in ("sparse_decode_paged", "indexer_select_decode / indexer_select_prefill",
                 "qsa_decode_step", "qsa_prefill_step", "1 <= R <= 512", "1 <= W <= 2055",
                 "topk=512"):
        assert text in out, text


def test_contract_one_arch_and_strict(capsys):
    assert cli.main(["contract", "--arch", "sm_121", "--strict"]) == 0
    out = capsys.readouterr().out
    assert "GB10" in out and "[exact]" in out and "H200" not in out
    assert "FAIL" not in out and "refused (max_seqlen_k)" in out


def test_contract_bad_arch(capsys):
    assert cli.main(["contract", "--arch", "sm_75"]) == 2
    assert "unknown arch" in capsys.readouterr().err
    assert cli.main(["contract", "--arch", "volta"]) == 2


def test_no_subcommand_is_an_error():
    with pytest.raises(SystemExit) as info:
        cli.main([])
    assert info.value.code == 2


def test_plain_table_without_rich(capsys):
    import io

    buf = io.StringIO()
    cli.print_table("T", ("a", "bb"), [(1, "x"), ("long", 2)], file=buf)
    lines = buf.getvalue().splitlines()
    assert lines[0] == "T" and lines[1].split() == ["a", "bb"] and lines[3].split() == ["1", "x"]


def test_console_script_runs():
    proc = subprocess.run([sys.executable, "-m", "interop.validate.cli", "contract", "--arch",
                           "sm_90"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "sm90-table" in proc.stdout


# --------------------------------------------------------------------------------------------
# qsa compile (run in a subprocess: TRITON_INTERPRET must be off to compile for a GPU target)
FAKE_TRITON = '''
import triton, triton.language as tl

@triton.jit
def fake_dot(a_ptr, b_ptr, c_ptr, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rm = tl.arange(0, BM); rn = tl.arange(0, BN); rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), tl.float32)
    for k in range(0, K, BK):
        a = tl.load(a_ptr + rm[:, None] * K + (k + rk)[None, :])
        b = tl.load(b_ptr + (k + rk)[:, None] * BN + rn[None, :])
        acc += tl.dot(a, b)
    tl.store(c_ptr + rm[:, None] * BN + rn[None, :], acc)

SIG = {"a_ptr": "*fp16", "b_ptr": "*fp16", "c_ptr": "*fp32", "K": "i32",
       "BM": "constexpr", "BN": "constexpr", "BK": "constexpr"}

def compile_configs(arch):
    small = dict(kernel=fake_dot, name="small_fits", signature=SIG,
                 constexprs={"BM": 16, "BN": 16, "BK": 32}, num_warps=4, num_stages=2)
    huge = dict(kernel=fake_dot, name="huge_tiles_too_big_for_sm12x", signature=SIG,
                constexprs={"BM": 128, "BN": 256, "BK": 256}, num_warps=8, num_stages=2)
    return [small, huge] if arch in ("sm_120", "sm_121") else [small]
'''

FAKE_PALLAS = '''
import jax, jax.numpy as jnp
from interop.plan import plan_decode
from qsa_pallas.decode import _sparse_decode

def lowering_cases(device_kind):
    sds = jax.ShapeDtypeStruct
    plan = plan_decode(2, 1, 12, 64, 64, sm_count=48, max_splits=2)
    args = (sds((2, 12, 64), jnp.float16), sds((128, 1, 64), jnp.float16),
            sds((128, 1, 64), jnp.float16), sds((3,), jnp.int32), sds((3,), jnp.int32))
    fn = lambda q, k, v, cq, ck: _sparse_decode(q, k, v, cq, ck, 64, interpret=False, plan=plan)
    return [("tiny_decode", fn, args)]
'''


def _compile_cli(tmp_path, *argv, triton_mods="qsa_fake_triton_kernels",
                 pallas_mods="qsa_fake_pallas_cases"):
    import json as _json
    import os

    (tmp_path / "qsa_fake_triton_kernels.py").write_text(FAKE_TRITON)
    (tmp_path / "qsa_fake_pallas_cases.py").write_text(FAKE_PALLAS)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=f"{tmp_path}{os.pathsep}{env.get('PYTHONPATH', '')}",
               JAX_PLATFORMS="cpu", TRITON_CACHE_DIR=str(tmp_path / "triton-cache"),
               COLUMNS="250")
    out = tmp_path / "compile.json"
    mods = [f"--triton-modules={triton_mods}", f"--pallas-modules={pallas_mods}"]
    proc = subprocess.run([sys.executable, "-m", "interop.validate.cli", "compile", *argv, *mods,
                           "--json", str(out)], capture_output=True, text=True, timeout=600, env=env)
    doc = _json.loads(out.read_text()) if out.exists() else None
    return proc, doc


def test_compile_flags_a_config_that_does_not_fit_sm12x(tmp_path):
    pytest.importorskip("triton")
    proc, doc = _compile_cli(tmp_path, "--arch", "sm_121", "--family", "triton")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "huge_tiles_too_big_for_sm12x" in proc.stdout and "do NOT fit" in proc.stdout
    rows = {c["name"]: c for c in doc["configs"]}
    assert rows["small_fits"]["fits"] and rows["small_fits"]["shared"] <= 101_376
    huge = rows["huge_tiles_too_big_for_sm12x"]
    assert not huge["fits"] and huge["shared"] > 101_376 == huge["smem_limit"]
    assert any("shared memory" in p for p in huge["problems"])


def test_compile_passes_when_everything_fits(tmp_path):
    pytest.importorskip("triton")
    pytest.importorskip("jax")
    proc, doc = _compile_cli(tmp_path, "--arch", "sm_90", "--jobs", "2")  # two worker processes
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "worker processes" in proc.stdout
    # each worker's progress per arch and list (a new user saw minutes of silence)
    assert "sm_90 triton:qsa_fake_triton_kernels: compiling 1 ..." in proc.stdout
    assert "sm_90 triton:qsa_fake_triton_kernels: 1 of 1 kernels fit (" in proc.stdout
    assert "sm_90 pallas:qsa_fake_pallas_cases: compiling 1 ..." in proc.stdout
    assert doc["passed"] and "every configuration fits" in proc.stdout
    fams = {(c["family"], c["name"]) for c in doc["configs"]}
    assert ("triton", "small_fits") in fams and ("pallas", "tiny_decode:qsa_decode_split") in fams
    assert all(c["shared"] is not None for c in doc["configs"])


def test_compile_module_without_configs_is_a_note(tmp_path):
    pytest.importorskip("triton")
    proc, doc = _compile_cli(tmp_path, "--arch", "sm_120", "--family", "triton",
                             triton_mods="json")  # a module with no compile_configs
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no compile_configs" in doc["configs"][0]["note"]


def test_compile_bad_arguments(capsys):
    assert cli.main(["compile", "--arch", "sm_75"]) == 2
    assert "unknown arch" in capsys.readouterr().err
    assert cli.main(["compile", "--family", "cuda"]) == 2
    assert "allowed: triton, pallas" in capsys.readouterr().err
    assert cli.main(["compile", "--family", "triton,pallas:union"]) == 2  # one kernel family
    assert "unknown ['pallas:union']" in (err := capsys.readouterr().err)
    assert "triton:decode" in err and "pallas:decode_paged" in err
    assert cli.main(["compile", "--jobs", "0"]) == 2
    assert "--jobs must be >= 1" in capsys.readouterr().err


def test_parse_archs():
    from interop.validate.compile import parse_archs

    assert parse_archs(None) == ["sm_90", "sm_120", "sm_121"]
    assert parse_archs("121, sm_90,sm_121") == ["sm_121", "sm_90"]
    with pytest.raises(ValueError, match="known"):
        parse_archs("sm_80")
    with pytest.raises(ValueError, match="no arch in ','"):
        parse_archs(",")  # used to compile nothing and report that everything fits
    assert parse_archs("sm_100") == ["sm_100"]  # accepted, so the help lists it
    arch_help = next(a.help for a in cli.build_parser()._subparsers._group_actions[0]
                     .choices["compile"]._actions if "--arch" in a.option_strings)
    assert all(n in arch_help for n in ("sm_90", "sm_100", "sm_120", "sm_121"))


def test_bench_without_a_benchmark_prints_a_real_usage(capsys):
    assert cli.main(["bench"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: qsa bench {decode,prefill,indexer} [OPTIONS...]")
    assert all(f"bench/{b}.py" in err for b in ("decode", "prefill", "indexer"))
    assert "--help" in err and "./bench-out/" in err  # where the report goes by default
    assert "which" not in err and "rest" not in err  # no internal argparse names
    assert cli.main(["bench", "--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: qsa bench")
    assert cli.main(["bench", "attention"]) == 2
    assert ("unknown benchmark 'attention'; choose one of: decode, prefill, indexer"
            in capsys.readouterr().err)


def test_bench_help_is_the_benchmarks_own(capsys):
    """`qsa bench decode --help` reaches bench/decode.py's parser: its real options, under the
    name the user typed."""
    import importlib.util

    if importlib.util.find_spec("bench.decode") is None:
        pytest.skip("bench/decode.py not in this checkout")
    for which in ("decode", "prefill", "indexer"):
        with pytest.raises(SystemExit) as info:
            cli.main(["bench", which, "--help"])
        assert info.value.code == 0
        out = capsys.readouterr().out
        assert out.startswith(f"usage: qsa bench {which}") and "--json" in out


def test_top_level_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for command in ("contract", "check", "compile", "bench", "replay", "capture"):
        assert f"    {command}" in out, command


def test_capture_lists_the_case_names(capsys, tmp_path):
    from interop import cases as C

    assert cli.main(["capture", "--case", "nope", "--out", str(tmp_path / "x.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "unknown case 'nope'" in err and "qsa capture --list" in err
    for spec in C.quick_matrix():
        assert (spec.name in err) == (spec.op in ("decode", "paged", "prefill")), spec.name
    assert not (tmp_path / "x.safetensors").exists()
    assert cli.main(["capture", "--case", "TP2/B4/satur", "--out", str(tmp_path / "x")]) == 2
    assert "did you mean: decode/TP2/B4/saturated" in capsys.readouterr().err
    assert cli.main(["capture", "--list"]) == 0
    names = capsys.readouterr().out.split()
    held = ("decode", "paged", "prefill")  # the indexer and step cases are not capture files
    assert len(names) == len(set(names)) and set(names) == {
        s.name for s in C.quick_matrix() + C.full_matrix() if s.op in held}
    step = next(s.name for s in C.quick_matrix() if s.op == "step")
    assert cli.main(["capture", "--case", step, "--out", str(tmp_path / "x")]) == 2
    assert "of the operation 'step'; capture files hold" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["capture", "--help"])
    assert "triton (default) or pallas" in " ".join(capsys.readouterr().out.split())
    assert cli.main(["capture", "--case", "decode/TP2/B1/short"]) == 2  # no --out
    assert "--out FILE is required" in capsys.readouterr().err
    assert cli.main(["capture", "--case", "nope"]) == 2  # an unknown case first, even without --out
    assert "unknown case 'nope'" in capsys.readouterr().err
    assert cli.main(["capture"]) == 2
    assert "--case NAME is required" in capsys.readouterr().err
