"""The benchmark code paths on CPU (``bench/common.py``, ``decode.py``, ``prefill.py``, ``plot.py``,
``run_gpu.sh``): argument checks before any GPU work, the provider registries and case lists,
ratios and summaries from fake timings, the interleaved timer and the old/new worker protocol on
CPU callables, ``--smoke-cpu`` (only the providers that ran are listed, nothing timed), the decode
FP32 reference against ``interop.reference``, and the plots / tables. About half a minute."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import common, decode, indexer, prefill  # noqa: E402

BW = 4.0e12  # fake copy bandwidth, bytes/s


# ------------------------------------------------------------------------------ arguments
def test_choose_keeps_order_drops_duplicates_and_names_the_allowed():
    assert common.choose(" upstream-sm121 ,ours,ours", decode.PROVIDERS, "--providers") == \
        ["upstream-sm121", "ours"]
    assert common.choose(None, decode.PROVIDERS, "--providers", ["ours"]) == ["ours"]
    assert common.choose("  ", decode.PROVIDERS, "--providers") == list(decode.PROVIDERS)
    with pytest.raises(common.ProviderError) as e:
        common.choose("ours,sm120", decode.PROVIDERS, "--providers")
    assert "'sm120'" in str(e.value) and all(n in str(e.value) for n in decode.PROVIDERS)
    assert common.choose(None, ("a", "b"), "--x") == ["a", "b"]
    assert common.choose("b, a", ("a", "b"), "--x") == ["b", "a"]
    with pytest.raises(common.ProviderError, match="--x"):
        common.choose("c", ("a", "b"), "--x")
    assert common.positive_ints("4,1", (9,), "--b") == [4, 1]
    assert common.positive_ints("", (9,), "--b") == [9]
    for bad in ("0", "x", "2,-1"):
        with pytest.raises(common.ProviderError, match="--b"):
            common.positive_ints(bad, (9,), "--b")


@pytest.mark.parametrize("module,argv,msg", [
    (decode, ["--providers", "ours,nope"], "'nope'"),
    (decode, ["--tp", "TP3"], "--tp"),
    (decode, ["--batches", "0"], "--batches"),
    (decode, ["--rows", "long"], "--rows"),
    (decode, ["--memcheck", "--compare", "x"], "--memcheck"),
    (decode, ["--rounds", "0"], "--rounds"),
    (decode, ["--mode", "pool", "--layouts", "blocks"], "--layouts"),
    (decode, ["--mode", "pool", "--kv", "fp4"], "--kv"),
    (decode, ["--mode", "pool", "--rows", "mixed"], "--rows"),
    (decode, ["--mode", "pool", "--pool-slots", "1000"], "--pool-slots"),
    (decode, ["--mode", "pool", "--providers", "paged[nope]"], "'paged[nope]'"),
    (decode, ["--mode", "pool", "--compare", "x"], "no --compare"),
    (prefill, ["--sections", "matrix,tiles"], "--sections"),
    (prefill, ["--heads", "24/1"], "--heads"),
])
def test_bad_values_exit_2_before_any_gpu_work(capsys, module, argv, msg):
    assert module.main(argv) == 2
    assert msg in capsys.readouterr().err


def test_help_names_every_provider_and_option(capsys):
    for module in (decode, prefill, indexer):
        with pytest.raises(SystemExit) as info:
            module.main(["--help"], prog="qsa bench x")
        assert info.value.code == 0
        out = capsys.readouterr().out
        assert out.startswith("usage: qsa bench x")
        for name, p in module.PROVIDERS.items():
            assert name in out and p.doc.split()[0] in out
        for name in getattr(module, "POOL_PROVIDERS", {}):
            assert name in out
        for opt in ("--providers", "--json", "--plot", "--smoke-cpu", "--memcheck", "--compare"):
            assert opt in out
        assert "module docstring" not in out
        # the help is the user's: no issue-tracker numbers, no internal class names
        assert "issue 1" not in out and "Mode." not in out


def test_run_gpu_sh_refuses_unknown_steps_before_running_anything(tmp_path):
    for args in (["bogus"], ["decode", "compare=" + str(tmp_path / "nowhere")]):
        r = subprocess.run(["bash", str(ROOT / "bench" / "run_gpu.sh"), *args], capture_output=True,
                           text=True, env={**os.environ, "OUT": str(tmp_path / "out")}, timeout=60)
        assert r.returncode == 2, r.stderr
        assert not (tmp_path / "out" / "steps.txt").exists()


# ----------------------------------------------------------------------------------- cases
def test_case_lists():
    class A:
        tp = rows = batches = sections = heads = None

    specs = decode.cases(A(), "bench")
    assert len(specs) == 3 * 6 * 3 and len({s.name for s in specs}) == len(specs)
    assert {(s.hq, s.hkv) for s in specs} == {(24, 2), (12, 1), (6, 1)}
    assert all(s.d == 256 and s.max_len == 2051 and s.dtype == "bfloat16" for s in specs)
    a = A()
    a.tp, a.batches, a.rows = "TP2", "1,128", "short"
    assert [s.name for s in decode.cases(a, "bench")] == ["decode/TP2/B1/short",
                                                          "decode/TP2/B128/short"]
    mem = decode.cases(A(), "memcheck")
    assert any(s.poison and s.slack for s in mem) and any(s.zero_rows for s in mem)
    assert {s.batch for s in mem} >= {1, 64, 128}
    pre = prefill.cases(A(), "bench")
    names = [s.name for s in pre]
    assert len(names) == len(set(names)) == 9 + 8 + 2
    assert "prefill/ordinary/24x2/T8192" in names and "prefill/chunk/12x1/kv32k/T32" in names
    assert sum(s.kind == "paged" for s in pre) == 2
    assert any(s.kv_dtype == "float8_e4m3fn" for s in pre if s.kind == "paged")
    a = A()
    a.sections, a.heads = "sweep", "6/1"
    assert [s.q_lens[0] for s in prefill.cases(a, "bench")] == [32, 128, 512, 2048, 8192]
    assert all(s.poison and s.junk == "mixed" for s in prefill.cases(A(), "memcheck"))


def test_pool_case_lists_and_sweep_names():
    class A:
        tp = rows = batches = layouts = kv = pool_slots = compare = None

    specs = decode.pool_cases(A(), "bench")
    assert len(specs) == len({s.name for s in specs}) == 3 * 2 * 2 * (6 + 6 + 1)
    mtp = [s for s in specs if s.rows == "mtp"]
    assert {s.batch for s in mtp} == {128} and "B32x4" in mtp[0].name
    a = A()
    a.tp, a.kv, a.layouts, a.rows, a.batches = "TP1", "fp8", "slots", "saturated", "64"
    assert [s.name for s in decode.pool_cases(a, "bench")] == ["pool/TP1/slots/fp8/B64/saturated"]
    assert all(s.junk for s in decode.pool_cases(A(), "memcheck") + decode.pool_cases(A(), "smoke"))
    sweep = [n for n, p in decode.POOL_PROVIDERS.items() if not p.default]
    assert {"paged[bi]", "pallas-paged[bi]", "paged[s3]", "paged[s4]",
            "paged[s6]", "paged[s11]", "paged[s17]"} == set(sweep)
    assert list(decode.POOL_PROVIDERS)[0] == "upstream-step"  # 'x first' = vs upstream's step


def test_pool_must_show_from_fake_timings():
    def case(lay, kv, r, times):
        return {"tp": "TP1", "layout": lay, "kv": kv, "rows": "saturated", "R": r, "B": r,
                "providers": {n: {"median_us": t, "pct_copy_bw": 90.0 if t < 100 else 60.0}
                              for n, t in times.items()}}

    rep = {"cases": [
        case("slots", "bf16", 128, {"upstream-step": 400.0, "paged": 200.0,
                                    "jax-step": 400.0, "pallas-paged": 130.0,
                                    "paged[bi]": 220.0}),
        case("slots", "bf16", 64, {"upstream-step": 300.0, "paged": 90.0}),
        case("pages", "bf16", 16, {"upstream-step": 90.0, "paged": 40.0}),
        case("pages", "bf16", 128, {"paged": 95.0}),
        case("slots", "fp8", 128, {"paged": 110.0})]}
    rows = {r["check"]: r for r in decode.must_show(rep)}
    assert rows["paged >= 2.5x upstream-step, TP1 slots bf16 B=128"]["pass"] is False
    assert rows["paged >= 2.5x upstream-step, TP1 slots bf16 B=64"]["value"] == \
        pytest.approx(300 / 90)
    assert rows["paged >= 2.0x upstream-step, TP1 pages bf16 B=16"]["pass"] is True
    assert rows["paged % copy bw >= 85, TP1 slots bf16 B=128"]["pass"] is False
    assert rows["paged % copy bw >= 85, TP1 pages bf16 B=128"]["pass"] is True
    assert not any(k.startswith("paged[") for k in rows)  # no sweep variants any more
    assert rows["paged fp8 pool >= 1.6x bf16 pool, TP1 slots fp8 B=128"]["value"] == \
        pytest.approx(200 / 110)
    assert rows["pallas-paged >= 3x jax-step, TP1 slots bf16 B=128"]["pass"] is True
    assert rows["pallas-paged >= 0.85x paged, TP1 slots bf16 B=128"]["pass"] is True
    cost = rows["cost of batch_invariant (paged[bi] / paged), TP1 slots bf16 B=128 saturated"]
    assert cost["threshold"] is None and cost["value"] == pytest.approx(1.1)


def test_jax_step_compacts_on_every_call_of_a_chain(monkeypatch):
    """jax-step's compaction depends on the previous call's output, so an unrolled chain of n
    calls keeps n times the gathers after XLA's optimisations (the decode itself is stubbed)."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    import qsa_pallas
    from interop.indices import paged_decode_case

    monkeypatch.setattr(qsa_pallas, "sparse_decode", lambda q, kp, vp, cq, ck, m, s: q + (
        kp.astype(jnp.float32).sum() + vp.astype(jnp.float32).sum() + ck.sum()).astype(q.dtype))
    c = paged_decode_case([60, 90], width=70, seed=0)
    pool = jnp.ones((c.pool_slots, 1, 64), jnp.float16)
    args = [jnp.zeros((2, 12, 64), jnp.float16), pool, pool] + [
        jnp.asarray(t) for t in (c.req_to_token, c.req_indices, c.indices, c.seq_lens)]
    step = jax.jit(decode.jax_step(0.125, 70))
    gathers = [jax.jit(common.unrolled(step, n)).lower(*args).compile().as_text()
               .count(" gather(") for n in (1, 3)]
    assert gathers[0] >= 2 and gathers[1] == 3 * gathers[0], gathers


def test_chain_link_keeps_every_call_of_work_on_the_metadata():
    """The default chain link ties small integer arguments (cu_seqlens, lengths) to the previous
    output: work that reads only them and the other inputs (a union build's sort, a split
    schedule) stays once per call after XLA's optimisations, not once per chain; a large
    integer argument is passed as it is; the values are unchanged."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy

    def step(q, lens, big):  # q + (first of the sorted lengths) + (sum of big)
        return q + (jnp.sort(lens)[0] + big.sum()).astype(q.dtype)

    big = jnp.ones((common.TIE_MAX_ELEMENTS + 1,), jnp.int32)
    args = (jnp.zeros((4, 8), jnp.float32), jnp.asarray([5, 3, 9], jnp.int32), big)
    sorts = [jax.jit(common.unrolled(jax.jit(step), n)).lower(*args).compile().as_text()
             .count(" sort(") for n in (1, 3)]
    assert sorts == [1, 3], sorts
    untied = jax.jit(common.unrolled(jax.jit(step), 3, lambda xs, out: (out, *xs[1:])))
    assert untied.lower(*args).compile().as_text().count(" sort(") == 1  # what the tie prevents
    tied = common.chain_link(args, args[0] + 1)
    assert tied[2] is big and (tied[1] == args[1]).all()
    out = jax.jit(common.unrolled(jax.jit(step), 3))(*args)
    assert float(out[0, 0]) == 3 * (3 + big.size)


def test_upstream_providers_skip_what_upstream_cannot_take():
    sm = decode.PROVIDERS["upstream-sm121"].supports
    tp1 = {"Hq": 24, "Hkv": 2, "B": 4, "D": 256}
    assert sm({**tp1, "Hq": 6, "Hkv": 1}) and sm(tp1) is None
    assert "D = 256" in sm({**tp1, "D": 64})  # the smoke cases' D
    up = prefill.PROVIDERS["upstream-chunk"].supports
    base = {"kind": "chunk", "junk": "-1", "per_head": False, "empty_rows": False,
            "kv_dtype": "bfloat16"}
    assert up(base) is None
    for bad in ({"kind": "paged"}, {"junk": "mixed"}, {"per_head": True}, {"empty_rows": True},
                {"kv_dtype": "float8_e4m3fn"}):
        assert up({**base, **bad})
    assert prefill.PROVIDERS["upstream-ordinary"].supports(base)


# ---------------------------------------------------------------------- numbers and reports
def _fake_report(first="ours") -> dict:
    rep = {"mode": "decode", "title": "QSA packed sparse decode", "gpu": "NVIDIA H200 (fake)",
           "date": "2026-12-01", "providers": [first, "upstream-sm121"], "first_provider": first,
           "copy_bandwidth_Bps": BW, "cases": []}
    for b in (1, 16, 128):
        for rows in ("saturated", "short"):
            desc = {"name": f"decode/TP1/B{b}/{rows}", "bytes": b * 2051 * 2 * 256 * 4,
                    "plot": [[f"TP1, {rows} rows", b]]}
            ents = {}
            for n, f in ((first, 1.0), ("upstream-sm121", 1.6), (first + "@self", 1.02)):
                us = (5 + 0.7 * b) * f
                t = {"median_us": us, "p10_us": us, "p90_us": us, "min_us": us, "rounds": 15}
                ents[n] = common._entry(t, {"ok": not (b == 128 and n != first), "rel_l2": 1e-3},
                                        desc, BW)
            common._ratios(ents, first)
            rep["cases"].append({**desc, "providers": ents})
    rep["summary"] = common.summarize(rep)
    return rep


def test_entries_ratios_and_summary():
    rep = _fake_report()
    p = rep["cases"][0]["providers"]
    nbytes = rep["cases"][0]["bytes"]
    assert p["ours"]["speedup_vs_first"] == pytest.approx(1.0)
    assert p["upstream-sm121"]["speedup_vs_first"] == pytest.approx(1 / 1.6)
    assert p["ours"]["pct_copy_bw"] == pytest.approx(100 * nbytes / (5.7e-6) / BW)
    assert p["ours"]["GBps"] == pytest.approx(nbytes / 5.7e-6 / 1e9)
    s = rep["summary"]
    assert s["providers"]["upstream-sm121"]["geomean_speedup_vs_first"] == pytest.approx(1 / 1.6)
    assert s["providers"]["upstream-sm121"]["failed_check"] == 2
    assert "ours@self" not in s["providers"]
    assert s["self_vs_self"] == pytest.approx([1.02, 1.02])


def test_errors_and_tolerance():
    ref = torch.ones(4, 3)
    assert common.within_tolerance(common.errors(ref + 1e-3, ref))
    e = common.errors(ref + 0.05, ref)
    assert e["excess"] > 0 and not common.within_tolerance(e)
    bad = ref.clone()
    bad[0, 0] = float("nan")
    assert not common.errors(bad, ref)["finite"]
    assert common.errors(np.zeros(3), np.zeros(3))["rel_l2"] == 0.0


def test_time_interleaved_and_failures_on_cpu_callables():
    x = torch.randn(64, 64)
    calls = {"a": lambda: x @ x, "b": lambda: x + 1}

    def broken():
        raise RuntimeError("cannot")

    calls["c"] = broken
    t = common.time_interleaved(calls, calls_per_replay=3, rounds=4, warmup_ms=1)
    assert list(t) == ["a", "b", "c"] and t["c"]["error"].startswith("RuntimeError")
    for n in "ab":
        assert t[n]["rounds"] == 4 and t[n]["median_us"] > 0 and t[n]["chain"] == 1
        assert t[n]["p10_us"] <= t[n]["median_us"] <= t[n]["p90_us"]
    assert common.time_interleaved({"c": broken}, rounds=2)["c"]["error"]  # none left to time


def test_decode_reference_matches_interop_reference():
    from interop.reference import decode_reference

    spec = decode.cases(type("A", (), {})(), "smoke")[1]  # an empty row and NaN past the rows
    inp = decode.make_inputs(spec, "cpu")
    got = decode.torch_reference(inp.q, inp.k, inp.v, inp.cu_q, inp.cu_k, inp.scale).numpy()
    f = lambda t: t.double().numpy()  # noqa: E731
    used = int(inp.cu_k[-1])
    want = decode_reference(f(inp.q), f(inp.k[:used]), f(inp.v[:used]), inp.cu_q.numpy(),
                            inp.cu_k.numpy(), inp.scale)
    assert torch.isnan(inp.k[used:]).all() and 0 in inp.lens
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_not_run_reason_is_marked_when_cut():
    """The "not run" summary shortens a long reason visibly (it used to cut a peer's install hint
    mid-parenthesis)."""
    long = "PeerUnavailable: sglang==0.5.23 not found (pip download sglang==0.5.23 --no-deps, " \
           "unpack into .peer/ or set QSA_SGLANG_PATH)"
    rep = {"cases": [{"providers": {"a": {"ok": True}, "b": {"error": long},
                                    "c": {"skipped": "x"}}}]}
    cut = common._why_not(rep, "b")
    assert len(cut) == 100 and cut.endswith("...") and long.startswith(cut[:-3])
    assert common._why_not(rep, "c") == "x" and common._why_not(rep, "d") == "no case"
    assert common._why_not(rep, "b", width=len(long)) == long
    # a table row names a missing peer without its how-to (the summary gives that once)
    row = common._fmt_row("case", "b", {"error": long}, timed=False)
    assert row.endswith("error: PeerUnavailable: sglang==0.5.23 not found"), row
    assert common._fmt_row("case", "b", {"error": "X (y)"}, timed=False).endswith("X (y)")


# ------------------------------------------------------------------------- smoke and compare
# In this process the smoke runs need the Triton interpreter, which must be on before qsa_triton is
# first imported (conftest does that on a machine without a GPU).
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter path")


@cpu_only
def test_decode_smoke_cpu_lists_only_what_ran_and_times_nothing(tmp_path, capsys):
    path = tmp_path / "d.json"
    assert decode.main(["--smoke-cpu", "--providers", "ours,upstream-sm121", "--json",
                        str(path)]) == 0
    out = capsys.readouterr().out
    rep = json.loads(path.read_text())
    assert rep["ran"] == ["ours"] and rep["kind"] == "smoke" and rep["copy_bandwidth_Bps"] is None
    assert "ran: ours; not run: upstream-sm121 (" in out and "TB/s" not in out
    for c in rep["cases"]:
        assert c["providers"]["ours"]["ok"] is True
        assert not {"median_us", "GBps", "pct_copy_bw"} & set(c["providers"]["ours"])
        assert "skipped" in c["providers"]["upstream-sm121"] or \
            "error" in c["providers"]["upstream-sm121"]


@cpu_only
def test_prefill_smoke_cpu(tmp_path):
    path = tmp_path / "p.json"
    assert prefill.main(["--smoke-cpu", "--providers", "ours,gather-dense", "--json",
                         str(path)]) == 0
    rep = json.loads(path.read_text())
    assert rep["ran"] == ["ours", "gather-dense"] and not rep["failures"]
    assert {c["kind"] for c in rep["cases"]} == {"ordinary", "chunk", "paged"}
    assert all(c["bytes"] > 0 and c["valid_entries"] > 0 for c in rep["cases"])


def test_compare_runs_each_tree_in_its_own_worker(tmp_path):
    """--compare on CPU: the old tree's packages (here links to this checkout's, in another
    folder) are what the old worker imports; both workers check and time every case."""
    old = tmp_path / "old"
    old.mkdir()
    for pkg in common.PACKAGES:
        (old / pkg).symlink_to(ROOT / pkg)
    path = tmp_path / "c.json"
    r = subprocess.run([sys.executable, "-m", "bench.decode", "--smoke-cpu", "--compare", str(old),
                        "--rounds", "1", "--json", str(path)], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(path.read_text())
    assert rep["kind"] == "compare/smoke" and rep["providers"] == ["ours"]
    for c in rep["cases"]:
        e = c["providers"]["ours"]
        assert e["old"]["ok"] and e["new"]["ok"] and e["speedup"] > 0
        assert e["old"]["modules"]["qsa_triton"].startswith(str(old))
        assert e["new"]["modules"]["qsa_triton"].startswith(str(ROOT))
    assert "geomean speedup new vs old over 2 cases" in r.stdout


# ----------------------------------------------------------------------------------- plots
def test_plot_and_table(tmp_path):
    pytest.importorskip("matplotlib")
    from bench import plot

    rep = _fake_report()
    png = plot.plot(rep, tmp_path / "p.png")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    md = plot.table(rep)
    assert "| decode/TP1/B128/saturated |" in md and "(0.62x" in md and "FAIL" in md
    assert "upstream-sm121 0.625" in md and "noise (ours@self / ours) 1.020..1.020" in md
    empty = {**rep, "cases": []}
    assert plot.plot(empty, tmp_path / "e.png").stat().st_size > 1000
    # two cases at one x of a panel, one of them untimed for a provider (the union report's
    # FP8 rows): sorting used to compare None with a float
    twin = dict(rep["cases"][0], name="decode/TP1/B1/saturated-twin")
    twin["providers"] = {n: {**e, "median_us": None, "pct_copy_bw": None}
                         for n, e in twin["providers"].items()}
    assert plot.plot({**rep, "cases": [*rep["cases"], twin]}, tmp_path / "t.png").is_file()
    cmp_rep = {"kind": "compare", "mode": "decode", "providers": ["ours"], "cases": [
        {"name": "decode/TP1/B1/short", "providers": {"ours": {
            "old": {"median_us": 6.0}, "new": {"median_us": 5.0}, "speedup": 1.2}}}],
        "summary": {"ours": {"geomean_speedup_new_vs_old": 1.2, "cases": 1}}}
    assert "| decode/TP1/B1/short | 6.00 µs | 5.00 µs | 1.200 |" in plot.table(cmp_rep)


def test_plot_cli(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from bench import plot

    f = tmp_path / "r.json"
    f.write_text(json.dumps(_fake_report()))
    assert plot.main([str(f), str(tmp_path / "r.png")]) == 0
    assert plot.main(["--table", str(f)]) == 0 and "| case |" in capsys.readouterr().out
    (tmp_path / "bad.json").write_text("[1]")
    assert plot.main([str(tmp_path / "bad.json"), str(tmp_path / "x.png")]) == 2
    assert plot.main([str(tmp_path / "missing.json"), str(tmp_path / "x.png")]) == 2
