"""PNG plots of the benchmark reports, drawn from their JSON dicts (matplotlib, Agg; no pyplot).

  plot_decode(result, path)    bench/decode.py's comparison result (``run_compare``): x = batch
                               size B (log2), one column per rows pattern (saturated / mixed), one
                               pair of rows per TP: median µs per provider (log), then % of the
                               copy bandwidth measured in the same run.
  plot_prefill(report, path)   bench/prefill.py's report: the query-count sweep (x = query rows,
                               log2; one column per head pair: ms per provider, then % of the copy
                               bandwidth when the report carries it, else the effective gather
                               TB/s) and the 8192-row matrix as grouped bars (ms, log).

  python -m bench.plot decode  decode.json        decode.png
  python -m bench.plot prefill prefill_bench.json prefill.png

The title names the GPU and the date of the run (the report's ``date``; the file's date when an
older report has none), and the legend gives each provider's geometric-mean speedup over the first
provider (``speedup_vs_first``, > 1: faster). Providers or cases that are missing, skipped or
failed to run are left out; a point whose output failed the reference check is drawn as a red x.
The ``@self`` noise-check entries are not drawn.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

__all__ = ["plot_decode", "plot_prefill", "try_plot", "main"]

SELF_SUFFIX = "@self"
TP_ORDER = ("TP1", "TP2", "TP4", "TP8")
ROWS_ORDER = ("saturated", "mixed")


def _num(x: Any) -> float | None:
    """A finite float, or None (JSON stores NaN/Inf as strings, failed entries have none)."""
    if isinstance(x, bool) or x is None:
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _geomean(xs) -> float | None:
    xs = [x for x in (_num(v) for v in xs) if x and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def _order(preferred, seen) -> list[str]:
    """Provider names: ``preferred`` (the report's order) first, then the rest as seen."""
    out = [n for n in (preferred or []) if isinstance(n, str)]
    out += [n for n in seen if n not in out]
    return [n for n in out if not n.endswith(SELF_SUFFIX) and n in seen]


def _colors(names) -> dict[str, Any]:
    from matplotlib import colormaps  # noqa: PLC0415

    cmap = colormaps["tab20" if len(names) > 10 else "tab10"]
    return {n: cmap(i % cmap.N) for i, n in enumerate(names)}


def _date(result: dict, meta: dict) -> str:
    d = meta.get("date") or result.get("date")
    return str(d) if d else "date not recorded"


def _figure(w: float, h: float):
    from matplotlib.figure import Figure  # noqa: PLC0415 - no pyplot: no global backend state

    return Figure(figsize=(w, h), layout="constrained")


def _save(fig, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=110)
    return path


def _empty(title: str, why: str, path) -> Path:
    fig = _figure(8, 3)
    fig.suptitle(title)
    ax = fig.add_subplot()
    ax.axis("off")
    ax.text(0.5, 0.5, why, ha="center", va="center")
    return _save(fig, path)


def _log2_x(ax, xs):
    xs = sorted({x for x in xs if x and x > 0})
    ax.set_xscale("log", base=2)
    if xs:
        ax.set_xticks(xs)
        ax.set_xticklabels([str(int(x)) if float(x).is_integer() else f"{x:g}" for x in xs])
        ax.minorticks_off()


def _log_y(ax):
    """Log y axis with plain numbers (1, 2, 5 per decade) instead of powers of ten."""
    from matplotlib import ticker  # noqa: PLC0415

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(ticker.NullFormatter())


def _legend_label(name: str, first: str | None, gm: dict) -> str:
    g = gm.get(name)
    if first is None or g is None or name == first:
        return name + (" (first)" if name == first else "")
    return f"{name} ({g:.2f}x vs {first})"


def _series(ax, xs, ys, oks, color, label):
    """One provider's line (None when it has no point); failed reference checks as red x."""
    pts = [(x, y, ok) for x, y, ok in zip(xs, ys, oks) if x is not None and y is not None]
    if not pts:
        return None
    pts.sort(key=lambda p: p[0])
    (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=4, lw=1.4,
                      color=color, label=label)
    bad = [p for p in pts if p[2] is False]
    if bad:
        ax.plot([p[0] for p in bad], [p[1] for p in bad], ls="none", marker="x", ms=9, mew=2,
                color="red")
    return line


# ---------------------------------------------------------------------------------------- decode
def plot_decode(result: dict, path) -> Path:
    """The decode comparison (``bench/decode.py`` result dict) as a PNG at ``path``."""
    cases = [c for c in (result.get("cases") or []) if isinstance(c, dict)]
    gpu = result.get("gpu", "unknown GPU")
    title = f"QSA packed decode — {gpu} — {_date(result, {})}"
    seen: list[str] = []
    for c in cases:
        for n, e in (c.get("providers") or {}).items():
            if n not in seen and _num((e or {}).get("median_us")) is not None:
                seen.append(n)
    names = _order(result.get("providers"), seen)
    if not names:
        return _empty(title, "no timed provider in this report", path)
    first = result.get("first_provider") or (result.get("providers") or [None])[0]
    gm = {n: _geomean(c["providers"][n].get("speedup_vs_first") for c in cases
                      if n in (c.get("providers") or {}))
          for n in names}
    color = _colors(names)
    tps = [t for t in TP_ORDER if any(c.get("tp") == t for c in cases)]
    tps += [t for t in dict.fromkeys(c.get("tp") for c in cases) if t not in tps]
    rows = [r for r in ROWS_ORDER if any(c.get("rows") == r for c in cases)]
    rows += [r for r in dict.fromkeys(c.get("rows") for c in cases) if r not in rows]
    ncols, nrows = len(rows), 2 * len(tps)
    fig = _figure(5.2 * ncols + 1.0, 2.9 * nrows + 0.8)
    bw = _num(result.get("copy_bandwidth_Bps"))
    sub = ("median of interleaved CUDA-event timings"
           + (f"; ratios vs first provider: {first}" if first else "")
           + (f"; copy bandwidth {bw / 1e12:.2f} TB/s" if bw and bw < 1e15 else ""))
    fig.suptitle(f"{title}\n{sub}", fontsize=11)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    handles: dict[str, Any] = {}
    for i, tp in enumerate(tps):
        for j, r in enumerate(rows):
            at, ap = axes[2 * i][j], axes[2 * i + 1][j]
            sel = [c for c in cases if c.get("tp") == tp and c.get("rows") == r]
            hq, hkv = (sel[0].get("Hq"), sel[0].get("Hkv")) if sel else (None, None)
            heads = f" (Hq={hq}, Hkv={hkv})" if hq else ""
            at.set_title(f"{tp}{heads}, {r} rows", fontsize=10)
            drawn = False
            for n in names:
                pts = [(_num(c.get("B")), (c.get("providers") or {}).get(n) or {}) for c in sel]
                xs = [b for b, _ in pts]
                oks = [e.get("ok") for _, e in pts]
                label = _legend_label(n, first, gm)
                line = _series(at, xs, [_num(e.get("median_us")) for _, e in pts], oks, color[n],
                               label)
                if line is not None:
                    drawn = True
                    handles.setdefault(label, line)
                _series(ap, xs, [_num(e.get("pct_copy_bw")) for _, e in pts], oks, color[n], label)
            xs_all = [_num(c.get("B")) for c in sel]
            for ax in (at, ap):
                _log2_x(ax, xs_all)
                ax.grid(True, which="major", alpha=0.3)
            if drawn:
                _log_y(at)
            else:
                at.text(0.5, 0.5, "no timings", ha="center", va="center", transform=at.transAxes)
            at.set_ylabel("median µs / call")
            ap.set_ylabel("% of copy bandwidth")
            ap.axhline(100, color="grey", lw=0.8, ls="--")
            ap.set_ylim(bottom=0)
            ap.set_xlabel("batch size B")
    if handles:
        fig.legend(list(handles.values()), list(handles.keys()), loc="outside lower center",
                   ncols=min(4, len(handles)), fontsize=9)
    return _save(fig, path)


# --------------------------------------------------------------------------------------- prefill
def _case_label(case: dict) -> str:
    kind = case.get("kind", "?")
    kv = (case.get("kv_lens") or [None])[0] if kind != "ordinary" else case.get("total_q")
    kv_s = f"{kv // 1024}k" if isinstance(kv, int) and kv >= 1024 else str(kv)
    return f"{case.get('hq')}/{case.get('hkv')}\n{kind} kv={kv_s}"


def plot_prefill(result: dict, path) -> Path:
    """The prefill report (``bench/prefill.py``) as a PNG at ``path``: the query-count sweep
    as lines (when the report has one) and the 8192-row matrix as grouped bars (when it has one)."""
    meta = result.get("meta") or {}
    gpu = meta.get("gpu", "unknown GPU")
    title = f"QSA sparse prefill — {gpu} — {_date(result, meta)}"
    sweep = [r for r in (result.get("query_sweep") or []) if isinstance(r, dict)]
    matrix = [r for r in (result.get("matrix") or []) if isinstance(r, dict)]
    if not sweep and not matrix:
        return _empty(title, "no query sweep and no matrix in this report", path)
    first = meta.get("first_provider")
    seen: list[str] = []
    for r in sweep + matrix:
        for n, e in (r.get("results") or {}).items():
            if n not in seen and _num((e or {}).get("ms")) is not None:
                seen.append(n)
    names = _order(meta.get("providers"), seen)
    color = _colors(names)
    gm = {n: _geomean(r["results"][n].get("speedup_vs_first") for r in sweep + matrix
                      if n in (r.get("results") or {}))
          for n in names}
    groups = list(dict.fromkeys((r.get("case", {}).get("hq"), r.get("case", {}).get("hkv"))
                                for r in sweep))
    pct = any(_num(e.get("pct_copy_bw")) is not None
              for r in sweep for e in (r.get("results") or {}).values() if isinstance(e, dict))
    ncols = max(1, len(groups))
    nrows = (2 if sweep else 0) + (1 if matrix else 0)
    fig = _figure(max(6.0 * ncols, 11.0), 3.3 * nrows + 1.2)
    bw = _num(meta.get("copy_bandwidth_Bps"))
    sub = ("median of interleaved CUDA-event timings" + (f"; ratios vs first provider: {first}"
                                                          if first else "")
           + (f"; copy bandwidth {bw / 1e12:.2f} TB/s" if bw else ""))
    fig.suptitle(f"{title}\n{sub}", fontsize=11)
    gs = fig.add_gridspec(nrows, ncols)
    handles: dict[str, Any] = {}

    def label(n):
        return _legend_label(n, first, gm)

    row0 = 0
    if sweep:
        for j, (hq, hkv) in enumerate(groups):
            at, ap = fig.add_subplot(gs[0, j]), fig.add_subplot(gs[1, j])
            sel = [r for r in sweep if (r.get("case", {}).get("hq"), r.get("case", {}).get("hkv"))
                   == (hq, hkv)]
            kv = (sel[0].get("case", {}).get("kv_lens") or ["?"])[0] if sel else "?"
            at.set_title(f"query-count sweep, {hq}/{hkv} heads, chunk, kv={kv}", fontsize=10)
            drawn = False
            for n in names:
                pts = [(_num(r.get("case", {}).get("total_q")), (r.get("results") or {}).get(n) or {})
                       for r in sel]
                xs = [x for x, _ in pts]
                oks = [e.get("ok") for _, e in pts]
                line = _series(at, xs, [_num(e.get("ms")) for _, e in pts], oks, color[n], label(n))
                if line is not None:
                    drawn = True
                    handles.setdefault(label(n), line)
                key = "pct_copy_bw" if pct else "gather_tb_s"
                _series(ap, xs, [_num(e.get(key)) for _, e in pts], oks, color[n], label(n))
            xs_all = [_num(r.get("case", {}).get("total_q")) for r in sel]
            for ax in (at, ap):
                _log2_x(ax, xs_all)
                ax.grid(True, which="major", alpha=0.3)
            if drawn:
                _log_y(at)
            at.set_ylabel("median ms")
            if pct:
                ap.set_ylabel("% of copy bandwidth\n(gathered bytes; >100: cache hits)")
                ap.axhline(100, color="grey", lw=0.8, ls="--")
            else:
                ap.set_ylabel("effective gather TB/s")
            ap.set_ylim(bottom=0)
            ap.set_xlabel("query rows")
        row0 = 2
    if matrix:
        ax = fig.add_subplot(gs[row0, :])
        rows = [r.get("case", {}).get("total_q") for r in matrix]
        nrow = rows[0] if rows and all(x == rows[0] for x in rows) else None
        ax.set_title(f"{nrow or ''}-row matrix (lower is better)".lstrip("-"), fontsize=10)
        present = [n for n in names if any(_num(((r.get("results") or {}).get(n) or {}).get("ms"))
                                           for r in matrix)]
        width = 0.8 / max(1, len(present))
        for k, n in enumerate(present):
            xs, ys, bad = [], [], []
            for i, r in enumerate(matrix):
                e = (r.get("results") or {}).get(n) or {}
                ms = _num(e.get("ms"))
                if ms is None:
                    continue
                x = i - 0.4 + width * (k + 0.5)
                xs.append(x)
                ys.append(ms)
                if e.get("ok") is False:
                    bad.append((x, ms))
            bars = ax.bar(xs, ys, width=width, color=color[n], label=label(n))
            handles.setdefault(label(n), bars)
            if bad:
                ax.plot([b[0] for b in bad], [b[1] for b in bad], ls="none", marker="x", ms=8,
                        mew=2, color="red")
        ax.set_xticks(range(len(matrix)))
        ax.set_xticklabels([_case_label(r.get("case", {})) for r in matrix], fontsize=8)
        ax.set_ylabel("median ms")
        if present:
            _log_y(ax)
            lo = min(_num(((r.get("results") or {}).get(n) or {}).get("ms")) or math.inf
                     for r in matrix for n in present)
            if math.isfinite(lo):
                ax.set_ylim(bottom=lo / 1.6)  # the shortest bar stays visible on a log axis
        ax.grid(True, axis="y", alpha=0.3)
    if handles:
        fig.legend(list(handles.values()), list(handles.keys()), loc="outside lower center",
                   ncols=min(4, len(handles)), fontsize=8)
    return _save(fig, path)


# ------------------------------------------------------------------------------------------ CLI

def try_plot(kind: str, report: dict, png, json_path) -> bool:
    """Draw ``report`` (``kind`` "decode" | "prefill") to ``png`` after its JSON was written to
    ``json_path``; on any failure print why and the re-plot command to stderr and return False
    (the benchmark's numbers are already saved, so a plotting problem must not lose them)."""
    import sys  # noqa: PLC0415

    fn = plot_decode if kind == "decode" else plot_prefill
    try:
        print(f"wrote {fn(report, png)}")
        return True
    except Exception as e:  # noqa: BLE001 - the JSON is written; say why the plot is not
        print(f"bench/{kind}: --plot failed ({type(e).__name__}: {e}); re-plot with "
              f"python -m bench.plot {kind} {json_path} {png}", file=sys.stderr)
        return False

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.plot",
                                 description="Re-plot a saved benchmark JSON as a PNG.")
    ap.add_argument("which", choices=("decode", "prefill"))
    ap.add_argument("json", help="the report (bench/decode.py --json / bench/prefill.py --json)")
    ap.add_argument("png", help="output PNG")
    args = ap.parse_args(argv)
    try:
        result = json.loads(Path(args.json).read_text())
    except (OSError, ValueError) as e:
        print(f"bench.plot: cannot read {args.json}: {e}", file=sys.stderr)
        return 2
    if not isinstance(result, dict):
        print(f"bench.plot: {args.json} is not a benchmark report (not a JSON object)",
              file=sys.stderr)
        return 2
    if args.which == "decode" and "cases" not in result and "shapes" in result:
        print("bench.plot: this is a --sweep report; only the comparison run is plotted",
              file=sys.stderr)
        return 2
    fn = plot_decode if args.which == "decode" else plot_prefill
    date = None
    if "date" not in result and "date" not in (result.get("meta") or {}):
        import datetime  # noqa: PLC0415

        date = datetime.datetime.fromtimestamp(Path(args.json).stat().st_mtime).astimezone()
        date = date.isoformat(timespec="seconds") + " (file date)"
        if args.which == "decode":
            result = {**result, "date": date}
        else:
            result = {**result, "meta": {**(result.get("meta") or {}), "date": date}}
    print(f"wrote {fn(result, args.png)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
