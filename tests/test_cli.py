"""The ``qsa`` command: ``contract`` (phase 1) and argument errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from interop import cli


def test_contract_all_archs(capsys):
    assert cli.main(["contract"]) == 0
    out = capsys.readouterr().out
    for text in ("sm_90", "sm_100", "sm_120", "sm_121", "2055", "(24,2)", "101,376",
                 "sm90-table", "sm120-tuned-or-table", "[exact]"):
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
    proc = subprocess.run([sys.executable, "-m", "interop.cli", "contract", "--arch", "sm_90"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "sm90-table" in proc.stdout
