"""`qsa bench decode|prefill`: --providers (choice, order, validation before any GPU work), ratios
against the first provider, --json, and the PNG plots (bench/plot.py) drawn from result dicts built
by the scripts' own builders with fake timings. CPU only, fast (one ~10 s CPU smoke run of
bench/decode.py in a subprocess)."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

common = pytest.importorskip("bench.common")
decode = pytest.importorskip("bench.decode")
pytest.importorskip("matplotlib")
plot = pytest.importorskip("bench.plot")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
BW = 4.0e12  # fake copy bandwidth, bytes/s


def _png_ok(path) -> bool:
    data = Path(path).read_bytes()
    return len(data) > 1000 and data[:8] == PNG_MAGIC and b"IEND" in data[-16:]


def _t(us: float) -> dict:
    return {"median_us": us, "p10_us": 0.95 * us, "p90_us": 1.05 * us, "min_us": 0.9 * us,
            "reps": 10, "rounds": 15, "cuda_graph": True, "inner_reps": 1}


# ------------------------------------------------------------------------------- shared helpers
def test_parse_providers_orders_resolves_aliases_and_drops_duplicates():
    got = common.parse_providers(" upstream-sm121 ,ours,generic,ours", decode.PROVIDERS,
                                 decode.PROVIDER_ALIASES)
    assert got == ["sm121", "ours", "generic"]
    assert common.parse_providers(None, decode.PROVIDERS) is None
    assert common.parse_providers("  ", decode.PROVIDERS) is None
    # bracketed names keep their commas; spaces inside do not matter
    assert common.parse_providers("ours[64,4,2],ours", ["ours", "ours[64, 4, 2]"]) == \
        ["ours[64, 4, 2]", "ours"]


def test_parse_providers_unknown_lists_the_allowed_names():
    with pytest.raises(common.ProviderError) as e:
        common.parse_providers("ours,sm120,foo", decode.PROVIDERS, decode.PROVIDER_ALIASES,
                               script="bench/decode.py")
    msg = str(e.value)
    assert "'sm120'" in msg and "'foo'" in msg
    for name in decode.PROVIDERS:
        assert name in msg
    assert "upstream-sm121" in msg


def test_speedup_vs_first_numbers():
    got = common.speedup_vs_first({"sm121": 16.0, "ours": 10.0, "generic": 20.0, "x": None},
                                  "sm121")
    assert got == pytest.approx({"sm121": 1.0, "ours": 1.6, "generic": 0.8})
    assert common.speedup_vs_first({"ours": 10.0}, "sm121") == {}
    assert common.order_providers({"a": 1, "b": 2, "c": 3}, ["c", "x", "a"]) == {"c": 3, "a": 1}
    assert list(common.order_providers({"a": 1, "b": 2}, None)) == ["a", "b"]


# ------------------------------------------------------------------------------- decode builders
def _fake_decode_result(providers=("sm121", "ours", "generic")) -> dict:
    """A comparison result with the structure run_compare writes: fake times per provider,
    sm121 skipped on TP4, one timing error, one failed check."""
    providers = list(providers)
    res = decode.result_header(gpu="NVIDIA H200 (fake)", copy_bandwidth_Bps=BW,
                               providers=providers, rounds=15)
    factor = {"sm121": 1.6, "ours": 1.0, "generic": 2.0, "pallas": 1.3}
    for tp in decode.TP:
        for b in decode.BATCHES:
            for r in decode.ROWS:
                lens = [decode.MSK] * b if r == "saturated" else [17 + 97 * i for i in range(b)]
                timing = {}
                for n in providers:
                    if n == "sm121" and tp == "TP4":
                        continue  # upstream does not support (6, 1)
                    timing[n] = _t((4.0 + 0.7 * b) * factor[n])
                if tp == "TP2" and b == 4 and "generic" in timing:
                    timing["generic"] = {"error": "RuntimeError: could not capture"}
                first_timed = next(iter(timing))
                timing[first_timed + "@self"] = _t(timing[first_timed]["median_us"] * 1.01)
                checks = {n: {"ok": not (n == "generic" and b == 128 and r == "mixed"),
                              "rel_l2": 1e-3, "max_abs": 1e-2} for n in timing if "@" not in n}
                skipped = {"sm121": "upstream supports (24,2)/(12,1)"} if tp == "TP4" else {}
                res["cases"].append(decode.case_record(tp, b, r, lens, timing, checks, BW,
                                                       first=providers[0], skipped=skipped))
    res["summary"] = decode._summary(res)
    return res


def test_decode_ratios_against_the_first_provider():
    lens = [decode.MSK] * 4
    timing = {"sm121": _t(16.0), "ours": _t(10.0), "generic": _t(20.0),
              "sm121@self": _t(16.32), "pallas": {"error": "boom"}}
    checks = {"sm121": {"ok": True, "rel_l2": 1e-3}, "ours": {"ok": True, "rel_l2": 2e-3},
              "generic": {"ok": False, "rel_l2": 9e-3}}
    case = decode.case_record("TP1", 4, "saturated", lens, timing, checks, BW, first="sm121")
    p = case["providers"]
    assert list(p) == ["sm121", "ours", "generic", "sm121@self", "pallas"]  # order kept
    assert case["first_provider"] == "sm121"
    assert p["sm121"]["speedup_vs_first"] == pytest.approx(1.0)
    assert p["ours"]["speedup_vs_first"] == pytest.approx(1.6)
    assert p["generic"]["speedup_vs_first"] == pytest.approx(0.8)
    assert p["sm121@self"]["speedup_vs_first"] == pytest.approx(16.0 / 16.32)
    assert p["ours"]["speedup_vs_sm121"] == pytest.approx(1.6)  # the issue-3 field stays
    nbytes = 4 * decode.MSK * 2 * decode.D * 2 * 2  # rows x keys x Hkv x D x bf16 x (K, V)
    assert case["bytes"] == nbytes
    assert p["ours"]["pct_copy_bw"] == pytest.approx(100 * nbytes / 10e-6 / BW)
    assert p["ours"]["GBps"] == pytest.approx(nbytes / 10e-6 / 1e9)
    assert p["generic"]["ok"] is False and p["sm121@self"]["rel_l2"] == 1e-3
    assert p["pallas"] == {"error": "boom"}

    # first = ours: the ratios turn around; no sm121 timed: no speedup_vs_sm121 field
    case = decode.case_record("TP4", 4, "saturated", lens, {"ours": _t(10.0), "generic": _t(25.0)},
                              {}, BW, first="ours")
    assert case["providers"]["generic"]["speedup_vs_first"] == pytest.approx(0.4)
    assert "speedup_vs_sm121" not in case["providers"]["ours"]
    # the first provider did not run: no ratios at all
    case = decode.case_record("TP4", 4, "saturated", lens, {"ours": _t(10.0)}, {}, BW,
                              first="sm121")
    assert "speedup_vs_first" not in case["providers"]["ours"]


def test_decode_summary_geomean_vs_first():
    res = _fake_decode_result()
    s = res["summary"]
    assert s["first_provider"] == "sm121" and res["providers"] == ["sm121", "ours", "generic"]
    assert s["geomean_speedup_vs_first"]["ours"] == pytest.approx(1.6)
    assert s["geomean_speedup_vs_first"]["generic"] == pytest.approx(0.8)
    assert s["geomean_speedup_vs_first"]["sm121"] == pytest.approx(1.0)
    assert s["geomean_speedup_vs_sm121"] == pytest.approx(1.6)
    lo, hi = s["self_vs_self_ratio_range"]
    assert lo == pytest.approx(1.01) and hi == pytest.approx(1.01)
    json.dumps(res)  # JSON-able as built


# ------------------------------------------------------------------------------- decode CLI
def test_decode_unknown_provider_exits_2_before_the_gpu_check(capsys):
    assert decode.main(["--providers", "ours,sm120"]) == 2
    err = capsys.readouterr().err
    assert "'sm120'" in err and "needs a CUDA GPU" not in err
    for name in decode.PROVIDERS:
        assert name in err
    assert decode.main(["--skip", "nope"]) == 2
    assert decode.main(["--tp", "TP3"]) == 2
    assert decode.main(["--sweep", "--plot", "x.png"]) == 2
    assert decode.main(["--providers", "ours", "--skip", "ours"]) == 2


def test_qsa_bench_forwards_providers_and_help(capsys):
    from interop import cli

    assert cli.main(["bench", "decode", "--providers", "bogus"]) == 2
    assert "allowed: ours, sm121, generic, pallas" in capsys.readouterr().err
    for which in ("decode", "prefill"):
        with pytest.raises(SystemExit) as info:
            cli.main(["bench", which, "--help"])
        assert info.value.code == 0
        out = capsys.readouterr().out
        assert "--providers" in out and "--plot" in out and "--json" in out


def test_decode_smoke_cpu_end_to_end(tmp_path):
    """bench/decode.py on CPU (interpreter, B = 1): --providers order, --json, --plot."""
    js, png = tmp_path / "d.json", tmp_path / "d.png"
    env = {**os.environ, "TRITON_INTERPRET": "1", "JAX_PLATFORMS": "cpu"}
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "decode.py"), "--smoke-cpu",
                        "--providers", "generic,ours", "--json", str(js), "--plot", str(png)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads(js.read_text())
    assert res["providers"] == ["generic", "ours"] and res["first_provider"] == "generic"
    assert _png_ok(png)
    for c in res["cases"]:
        pr = c["providers"]
        assert set(pr) <= {"generic", "ours", "generic@self", "ours@self"}
        assert pr["ours"]["ok"]
        if "median_us" in pr.get("generic", {}):  # the upstream peer is installed here
            assert list(pr)[:2] == ["generic", "ours"]
            assert pr["ours"]["speedup_vs_first"] == pytest.approx(
                pr["generic"]["median_us"] / pr["ours"]["median_us"])
        else:
            assert "speedup_vs_first" not in pr["ours"]


# ------------------------------------------------------------------------------- decode plots
def test_plot_decode_png(tmp_path):
    res = _fake_decode_result()
    out = plot.plot_decode(res, tmp_path / "decode.png")
    assert _png_ok(out)


@pytest.mark.parametrize("variant", ["one_provider", "partial_grid", "no_cases", "no_timings"])
def test_plot_decode_survives_missing_data(tmp_path, variant):
    res = _fake_decode_result(("ours",))
    if variant == "partial_grid":  # e.g. --tp TP2 --rows mixed, sm121 first but never timed
        res = _fake_decode_result(("sm121", "ours", "pallas"))
        res["cases"] = [c for c in res["cases"] if c["tp"] == "TP4" and c["rows"] == "mixed"]
        res.pop("date")
    elif variant == "no_cases":
        res["cases"] = []
    elif variant == "no_timings":
        for c in res["cases"]:
            c["providers"] = {n: {"error": "x"} for n in c["providers"]}
    assert _png_ok(plot.plot_decode(res, tmp_path / f"{variant}.png"))


def test_plot_cli_replots_saved_json(tmp_path):
    res = _fake_decode_result()
    res["cases"][0]["providers"]["ours"]["pct_copy_bw"] = float("nan")  # written as "nan"
    js = common.write_json(tmp_path / "decode.json", res)
    assert plot.main(["decode", str(js), str(tmp_path / "re.png")]) == 0
    assert _png_ok(tmp_path / "re.png")
    assert plot.main(["decode", str(tmp_path / "missing.json"), str(tmp_path / "x.png")]) == 2


# ------------------------------------------------------------------------------- prefill
prefill = pytest.importorskip("bench.prefill")


def _desc(kind, hq, hkv, total_q, kv):
    valid = total_q * 2051
    return {"kind": kind, "hq": hq, "hkv": hkv, "d": 256, "total_q": total_q,
            "q_lens": [total_q], "kv_lens": [kv], "width": 2051, "kv_dtype": "bfloat16",
            "geometry": None, "valid_entries": valid, "gathered_bytes": valid * 256 * 2 * 2,
            "flops": 4 * (hq // hkv) * 256 * valid}


def _results(case, times_ms: dict, first, ok=None):
    timing = {n: (_t(ms * 1e3) if ms is not None else {"error": "OutOfResources"})
              for n, ms in times_ms.items()}
    res = {n: {"check": {}, "ok": (ok or {}).get(n, True)} for n in timing}
    return prefill.add_rates(res, timing, case, first=first, copy_bw=BW)


def _fake_prefill_report(first="upstream-chunk", sweep=True) -> dict:
    matrix = []
    for hq, hkv in prefill.PAIRS:
        for kv in prefill.KVS:
            kind = "ordinary" if kv == 8192 else "chunk"
            case = _desc(kind, hq, hkv, 8192, kv)
            times = {"upstream-chunk": 2.6, "ours": 2.0, "ours[64, 4, 2]": 2.1}
            if kind == "ordinary":
                times["upstream-ordinary"] = 2.4
            if kv == 32768:
                times["gather-dense"] = 20.0
            base = "upstream-ordinary" if kind == "ordinary" else "upstream-chunk"
            matrix.append(prefill.row_record(case, _results(case, times, first), baseline=base,
                                             first=first))
    rep = {"meta": {"gpu": "NVIDIA H200 (fake)", "date": "2026-01-01T00:00:00+00:00",
                    "copy_bandwidth_Bps": BW, "first_provider": first,
                    "providers": [first, "ours", "ours[64, 4, 2]", "ours-pairs"]},
           "matrix": matrix}
    if sweep:
        rows = []
        for hq, hkv in ((12, 1), (6, 1)):
            for t in (32, 128, 512, 2048, 8192):
                case = _desc("chunk", hq, hkv, t, 32768)
                times = {"upstream-chunk": 0.03 + t / 3000, "ours": 0.025 + t / 4000,
                         "ours-pairs": None if t == 512 else 0.02 + t / 4500}
                rows.append(prefill.row_record(case, _results(case, times, first,
                                                              ok={"ours": t != 2048}),
                                               baseline="upstream-chunk", first=first))
        rep["query_sweep"] = rows
    return rep


def test_prefill_ratios_against_the_first_provider():
    case = _desc("chunk", 12, 1, 8192, 32768)
    res = _results(case, {"upstream-chunk": 3.0, "ours": 2.0, "ours[64, 4, 2]": 2.5,
                          "pallas": None}, "upstream-chunk")
    assert res["ours"]["speedup_vs_first"] == pytest.approx(1.5)
    assert res["ours[64, 4, 2]"]["speedup_vs_first"] == pytest.approx(1.2)
    assert res["upstream-chunk"]["speedup_vs_first"] == pytest.approx(1.0)
    assert res["pallas"] == {"check": {}, "ok": True, "error": "OutOfResources"}
    assert res["ours"]["ms"] == pytest.approx(2.0)
    assert res["ours"]["gather_tb_s"] == pytest.approx(case["gathered_bytes"] / 2e-3 / 1e12)
    assert res["ours"]["pct_copy_bw"] == pytest.approx(100 * case["gathered_bytes"] / 2e-3 / BW)
    assert res["ours"]["tflop_s"] == pytest.approx(case["flops"] / 2e-3 / 1e12)
    row = prefill.row_record(case, res, baseline="upstream-chunk", first="upstream-chunk")
    assert row["speedup_vs_upstream"] == pytest.approx(1.5)
    assert row["first_provider"] == "upstream-chunk"
    # first = ours (the default): the same numbers turned around
    res = _results(case, {"ours": 2.0, "upstream-chunk": 3.0}, "ours")
    assert res["upstream-chunk"]["speedup_vs_first"] == pytest.approx(2 / 3)
    # the first provider failed to run: no ratio, and no upstream ratio without ours
    res = _results(case, {"upstream-chunk": None, "ours": 2.0}, "upstream-chunk")
    assert "speedup_vs_first" not in res["ours"]
    assert prefill.row_record(case, _results(case, {"upstream-chunk": 3.0}, "upstream-chunk"),
                              baseline="upstream-chunk", first=None)["speedup_vs_upstream"] is None
    rep = _fake_prefill_report()
    gm = prefill._geomean_vs_first(rep["matrix"])
    assert gm["ours"] == pytest.approx(1.3) and gm["upstream-ordinary"] == pytest.approx(2.6 / 2.4)


def _ns(**kw):
    base = dict(providers=None, geometry=[], group_geometry=[(32, 4, 2)], pallas=False,
                dense=True, pairs=True)
    base.update(kw)
    return argparse.Namespace(**base)


def test_prefill_select_providers():
    a = _ns()
    assert prefill.select_providers(a) is None and a.geometry == [(64, 4, 2)]
    assert prefill._first(a) == "ours" and prefill._first(a, paged=True) == "ours-paged-prepass"

    a = _ns(providers="upstream-chunk, ours,ours[16,64,4,2],dense,pallas,ours-paged-inline")
    sel = prefill.select_providers(a)
    assert sel == ["upstream-chunk", "ours", "ours[16, 64, 4, 2]", "gather-dense", "pallas",
                   "ours-paged-inline"]
    assert a.geometry == [(16, 64, 4, 2)]  # forced geometry named in --providers is timed
    assert a.pallas and a.dense and not a.pairs
    assert prefill._first(a) == "upstream-chunk"
    assert prefill._first(a, paged=True) == "ours-paged-inline"
    assert prefill._wants(a, prefill.PAGED_PROVIDERS)
    provs = {"ours": 1, "upstream-ordinary": 2, "upstream-chunk": 3, "ours[16, 64, 4, 2]": 4}
    assert list(prefill._select(a, provs)) == ["upstream-chunk", "ours", "ours[16, 64, 4, 2]"]

    a = _ns(providers="ours,ours[64, 4, 2]", geometry=[(64, 4, 2)])
    assert prefill.select_providers(a) == ["ours", "ours[64, 4, 2]"]
    assert a.geometry == [(64, 4, 2)] and not prefill._wants(a, prefill.PAGED_PROVIDERS)

    with pytest.raises(common.ProviderError, match="allowed: ours, ours-rowsum, upstream-ordinary"):
        prefill.select_providers(_ns(providers="ours,ours[1,2]"))


def test_prefill_unknown_provider_exits_2_before_the_gpu_check(capsys, monkeypatch):
    import torch

    def no_cuda():
        raise AssertionError("CUDA looked at before --providers was validated")

    monkeypatch.setattr(torch.cuda, "is_available", no_cuda)
    assert prefill.main(["--providers", "ours,upstream"]) == 2
    err = capsys.readouterr().err
    assert "'upstream'" in err and "upstream-chunk" in err and "gather-dense" in err
    assert prefill.main(["--sweep-geometry", "--providers", "ours"]) == 2


def test_prefill_json_option_is_parsed(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert prefill.main(["--json", "x.json", "--plot", "x.png", "--providers", "ours"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err  # options accepted, then the GPU check


@pytest.mark.parametrize("variant", ["full", "matrix_only", "first_missing", "empty", "no_pct"])
def test_plot_prefill_png(tmp_path, variant):
    rep = _fake_prefill_report(sweep=variant != "matrix_only")
    if variant == "first_missing":
        rep = _fake_prefill_report(first="pallas")  # never ran: no ratios anywhere
        rep["query_sweep"][0]["results"] = {}
    elif variant == "empty":
        rep = {"meta": {"gpu": "cpu"}, "matrix": [], "failed_tolerance": []}
    elif variant == "no_pct":  # an older report: no copy bandwidth, no date
        rep["meta"].pop("copy_bandwidth_Bps")
        rep["meta"].pop("date")
        for r in rep["query_sweep"] + rep["matrix"]:
            for e in r["results"].values():
                e.pop("pct_copy_bw", None)
    assert _png_ok(plot.plot_prefill(rep, tmp_path / f"{variant}.png"))
    js = common.write_json(tmp_path / "p.json", rep)
    assert plot.main(["prefill", str(js), str(tmp_path / "re.png")]) == 0
    assert _png_ok(tmp_path / "re.png")


def test_prefill_main_end_to_end_with_stub_kernels(tmp_path, monkeypatch):
    """bench/prefill.py main() on CPU with the GPU parts stubbed (providers return the float32
    reference; fake interleaved timings): --providers order and filtering, sections without a
    selected provider skipped, --json at an explicit path, --plot."""
    import torch

    from bench import prefill_cases

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "stub GPU")
    monkeypatch.setattr(common, "copy_bandwidth_bytes_per_s", lambda *a, **k: BW)
    monkeypatch.setattr(prefill, "KVS", (64, 256))
    monkeypatch.setattr(prefill, "PAIRS", ((12, 1),))
    monkeypatch.setattr(prefill, "make_case", lambda *a, **k: prefill_cases.make_case(
        *a, **{**k, "device": "cpu", "width": 64}))
    speed = {"ours": 1.0, "upstream-chunk": 1.5, "upstream-ordinary": 1.2, "ours-pairs": 0.8,
             "ours[16, 64, 4, 2]": 1.1}

    def stub(c, factor):
        ref = prefill_cases.reference_f32(c).to(c.q.dtype)

        def fn():
            return ref
        fn.factor = factor
        return fn

    monkeypatch.setattr(prefill, "_upstream", lambda: object())
    monkeypatch.setattr(prefill, "_ours", lambda c: stub(c, 1.0))
    monkeypatch.setattr(prefill, "upstream_providers", lambda up, c: {
        "upstream-ordinary": stub(c, 1.2), "upstream-chunk": stub(c, 1.5)} if c.kind == "ordinary"
        else {"upstream-chunk": stub(c, 1.5)})
    monkeypatch.setattr(prefill, "forced_provider", lambda c, geo: stub(c, 1.1))
    monkeypatch.setattr(prefill, "pairs_providers", lambda c, **k: {
        "ours-pairs": stub(c, 0.8), "pairs-union-only": stub(c, 0.1)})
    monkeypatch.setattr(prefill, "gather_dense_provider", lambda c: stub(c, 9.0))
    order_seen = []

    def fake_time(provs, **kw):
        order_seen.append(list(provs))
        return {n: _t(100.0 * f.factor) for n, f in provs.items()}

    monkeypatch.setattr(prefill, "time_interleaved", fake_time)
    js, png = tmp_path / "sub" / "prefill.json", tmp_path / "prefill.png"
    rc = prefill.main(["--rows", "64", "--sweep-rows", "32,64", "--json", str(js),
                       "--plot", str(png), "--providers",
                       "upstream-chunk,ours,ours-pairs,ours[16,64,4,2]"])
    assert rc == 0
    rep = json.loads(js.read_text())
    assert rep["meta"]["providers"] == ["upstream-chunk", "ours", "ours-pairs",
                                        "ours[16, 64, 4, 2]"]
    assert rep["meta"]["first_provider"] == "upstream-chunk"
    assert rep["meta"]["copy_bandwidth_Bps"] == BW
    assert len(rep["matrix"]) == 2 and len(rep["query_sweep"]) == 4
    assert rep["paged"] == []  # no paged provider selected: section skipped
    assert order_seen[0] == ["upstream-chunk", "ours", "ours-pairs", "ours[16, 64, 4, 2]"]
    assert all(o[:2] == ["upstream-chunk", "ours"] for o in order_seen)
    for row in rep["matrix"] + rep["query_sweep"]:
        r = row["results"]
        assert "upstream-ordinary" not in r and "pairs-union-only" not in r
        for n in r:
            assert r[n]["speedup_vs_first"] == pytest.approx(1.5 / speed[n])
        if row["baseline"] == "upstream-ordinary":  # its baseline was not selected
            assert row["case"]["kind"] == "ordinary" and row["speedup_vs_upstream"] is None
        else:
            assert row["speedup_vs_upstream"] == pytest.approx(1.5)
    assert rep["geomean_speedup_vs_first_8192"]["ours"] == pytest.approx(1.5)
    assert _png_ok(png)


_SAVED = sorted(p for p in (ROOT / "bench" / "results").glob("*/*.json")
                if p.name in ("decode.json", "decode_fair.json", "decode_with_pallas.json",
                              "prefill_bench.json"))


@pytest.mark.parametrize("path", _SAVED[-6:], ids=lambda p: f"{p.parent.name}/{p.name}")
def test_plot_saved_gpu_reports(tmp_path, path):
    """The plots read the reports the GPU runs actually wrote (older ones: no date, no
    first_provider, no pct_copy_bw for prefill)."""
    which = "prefill" if path.name.startswith("prefill") else "decode"
    assert plot.main([which, str(path), str(tmp_path / "p.png")]) == 0
    assert _png_ok(tmp_path / "p.png")


def test_decode_ab_variants_build_and_run_on_cpu(tmp_path, monkeypatch):
    """bench/decode_ab.py's variants are edited copies of qsa_triton/decode.py: every edit still
    matches once, each copy imports under its own op name and computes the reference values
    (Triton interpreter), and "<name>_pdl" is accepted as a name."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from bench.decode_ab import EDITS, build_variants  # noqa: PLC0415
    from tests.test_triton_decode import assert_close, make_case, reference  # noqa: PLC0415

    mods = build_variants(list(EDITS) + ["head_pdl"], tmp_path)
    assert set(mods) == set(EDITS) | {"head_pdl"}
    assert mods["head_nopdl"][0].PDL_AUTO is False and mods["head"][0].PDL_AUTO is True
    case = make_case([5, 40], 12, 1, 64, seed=1)
    for name, (mod, merge) in mods.items():
        plan, _ = mod.plan_for(2, 1, 12, 64, 40, "cpu")
        out = mod.decode_with_plan(*case, 40, plan=plan, merge=merge)
        assert_close(out, reference(*case)), name


def test_decode_variants_plans_are_what_their_names_say():
    """bench/decode_variants.py: each policy variant fixes the plan it names (CPU: plans only)."""
    torch = pytest.importorskip("torch")
    from bench.decode_variants import VARIANTS, _plan
    from interop import plan as DP
    from qsa_triton import decode as dec

    cpu = torch.device("cpu")
    sms = dec._sm_count(cpu)
    plans = {n: _plan(dec, 64, 1, 12, cpu, spec) for n, spec in VARIANTS.items()}
    assert plans["v2"][0].balance_slots == 0 and plans["v2"][1] == "kernel"
    assert plans["v2"][0].max_splits == 2  # static rule: 132 // 64 -> 2
    assert plans["v3"][0].balance_slots == DP.BALANCE_SLOTS_PER_SM * sms
    assert plans["v3"][0].max_splits == DP.BALANCE_GRID_SPLITS and plans["v3"][1] == "auto"
    assert plans["v5"][0] == plans["v3"][0] and plans["v5"][2] is None and plans["v3"][2] is False
    assert plans["v5"][0].defer_rowsum and not plans["v4"][0].defer_rowsum
    assert plans["v4"][2] is False  # decode v4: no PDL from B x Hkv = 3 on
    assert _plan(dec, 1, 2, 12, cpu, VARIANTS["v4"])[0].max_splits == 64  # power of two
    # one split per block: of 64 keys at TP1 B = 1 (decode v6c), of 32 at TP2 B = 1
    assert (_plan(dec, 1, 2, 12, cpu, VARIANTS["v5"])[0].block_n,
            _plan(dec, 1, 2, 12, cpu, VARIANTS["v5"])[0].max_splits) == (64, 33)
    assert _plan(dec, 1, 1, 12, cpu, VARIANTS["v5"])[0].max_splits == 65
    wide = _plan(dec, 1, 1, 12, cpu, VARIANTS["v6_bn64_small"])[0]
    assert (wide.block_n, wide.max_splits) == (64, 33)
    assert _plan(dec, 1, 1, 12, cpu, VARIANTS["v6_tma_small"])[3] is True
    assert _plan(dec, 4, 1, 12, cpu, VARIANTS["v6_tma_small"])[3] is None  # not small
    assert _plan(dec, 32, 1, 12, cpu, VARIANTS["v6_inl32"])[1] == "inline"
    assert _plan(dec, 16, 1, 12, cpu, VARIANTS["v6_inl32"])[1] == "auto"
    assert plans["v6_kernel"][1] == "kernel"
    assert plans["v4_ms128_small"][0] == plans["v5"][0]  # B x Hkv = 64: not small
    small = _plan(dec, 1, 2, 12, cpu, VARIANTS["v4_bn16_small"])[0]
    assert small.max_splits == 128 and small.block_n == 16
    assert plans["v3_s1"][0].balance_slots == sms and plans["v3_s3"][0].balance_slots == 3 * sms
    assert plans["v3_kernel"][1] == "kernel" and plans["v3_inline"][1] == "inline"
    assert plans["v3_grid2"][0].max_splits == 2
    assert plans["v4_pdl_all"][2] is True and plans["v3_tail"][0].tail_in_loop
    # decode v7: fractional slots per SM round to whole programs; deep stages only at >= 64 rows
    assert plans["v7_s15"][0].balance_slots == round(1.5 * sms)
    assert _plan(dec, 64, 1, 12, cpu, VARIANTS["v7_s1_st6"])[0].num_stages == 6
    assert _plan(dec, 16, 1, 12, cpu, VARIANTS["v7_s1_st6"])[0].num_stages != 6
    assert _plan(dec, 1, 2, 12, cpu, VARIANTS["v7_ms1_small"])[0].max_splits == 1


def test_decode_extra_row_kinds():
    """The diagnostic row kinds give their fixed lengths; an unknown kind is refused."""
    import pytest

    from bench.decode import EXTRA_ROWS, make_inputs

    for kind, n in EXTRA_ROWS.items():
        q, k, v, cq, ck, lens = make_inputs("TP2", 3, kind, device="cpu")
        assert lens == [n] * 3 and ck.tolist() == [0, n, 2 * n, 3 * n] and k.shape[0] == 3 * n
    assert make_inputs("TP2", 3, "saturated", device="cpu")[-1] == [2051] * 3
    with pytest.raises(ValueError, match="rows must be one of"):
        make_inputs("TP2", 3, "full", device="cpu")
