"""Draw a benchmark report (the JSON of ``bench/decode.py`` or ``bench/prefill.py``) as a PNG, or
print it as a Markdown table (``bench/RESULTS.md``).

  python3 -m bench.plot REPORT.json OUT.png
  python3 -m bench.plot --table REPORT.json [REPORT.json ...]

The plot has one panel per group of cases (each case names its panels and its x value in the
report's ``plot`` field: batch size for decode, KV length or query rows for prefill, the pool dtype
for paged prefill): time per call (log scale) above, % of the copy bandwidth measured in the same
run below (the bytes a case must read; over 100 means cache hits). Numeric x values are drawn on a
log2 axis, names as categories. The legend gives each provider's geometric-mean speedup over the
first provider; a point whose output failed the reference check is a red x. ``@self`` entries (the
noise check) are not drawn. matplotlib (Agg, no pyplot).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

__all__ = ["plot", "table", "main"]

SELF = "@self"


def _num(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) \
        and math.isfinite(x) else None


def _providers(report: dict) -> list[str]:
    seen = [n for c in report.get("cases", []) for n in c.get("providers", {})
            if not n.endswith(SELF)]
    order = [n for n in report.get("providers", []) if n in seen]
    return order + [n for n in dict.fromkeys(seen) if n not in order]


def _geomeans(report: dict) -> dict[str, float]:
    s = (report.get("summary") or {}).get("providers") or {}
    return {n: v["geomean_speedup_vs_first"] for n, v in s.items()
            if _num(v.get("geomean_speedup_vs_first"))}


def plot(report: dict, path) -> Path:
    """Draw ``report`` to the PNG ``path`` (folders created); returns the path."""
    from matplotlib import colormaps, ticker  # noqa: PLC0415
    from matplotlib.figure import Figure  # noqa: PLC0415

    names = _providers(report)
    panels: dict[str, list] = {}
    for c in report.get("cases", []):
        for panel, x in c.get("plot") or []:
            panels.setdefault(panel, []).append((x, c))
    what = report.get("title", report.get("mode", "benchmark"))
    title = f"{what} — {report.get('gpu', '?')} — {report.get('date', 'date not recorded')}"
    ncols = max(1, min(3, len(panels)))
    nrows = 2 * max(1, math.ceil(len(panels) / ncols))
    fig = Figure(figsize=(5.4 * ncols, 2.8 * nrows + 1.2), layout="constrained")
    first, gm = report.get("first_provider"), _geomeans(report)
    bw = _num(report.get("copy_bandwidth_Bps"))
    fig.suptitle(f"{title}\nmedian of interleaved CUDA-event timings; x = time of {first} / time"
                 + (f"; copy bandwidth {bw / 1e12:.2f} TB/s" if bw else ""), fontsize=10)
    if not panels or not names:
        fig.add_subplot().text(0.5, 0.5, "no timed case in this report", ha="center")
    cmap = colormaps["tab10"]
    color = {n: cmap(i % 10) for i, n in enumerate(names)}
    label = {n: n + ("" if n == first or n not in gm else f" ({gm[n]:.2f}x)") for n in names}
    axes = fig.subplots(nrows, ncols, squeeze=False) if panels else None
    for k, (panel, pts) in enumerate(panels.items()):
        at, ap = axes[2 * (k // ncols)][k % ncols], axes[2 * (k // ncols) + 1][k % ncols]
        numeric = all(_num(x) for x, _ in pts)
        xs = sorted({x for x, _ in pts}, key=lambda x: (not numeric, x if numeric else str(x)))
        pos = {x: (x if numeric else i) for i, x in enumerate(xs)}
        for n in names:
            for ax, key in ((at, "median_us"), (ap, "pct_copy_bw")):
                got = [(pos[x], _num(c["providers"].get(n, {}).get(key)),
                        c["providers"].get(n, {}).get("ok")) for x, c in pts]
                # untimed points out first: a None beside a number at one x cannot be sorted
                got = sorted((g for g in got if g[1] is not None), key=lambda g: g[:2])
                if got:
                    ax.plot([g[0] for g in got], [g[1] for g in got], marker="o", ms=4,
                            color=color[n], label=label[n])
                    bad = [g for g in got if g[2] is False]
                    ax.plot([g[0] for g in bad], [g[1] for g in bad], "x", ms=9, color="red")
        for ax in (at, ap):
            if numeric:
                ax.set_xscale("log", base=2)
                ax.minorticks_off()
            ax.set_xticks([pos[x] for x in xs], [f"{x:g}" if numeric else str(x) for x in xs])
            ax.grid(True, alpha=0.3)
        at.set_title(panel, fontsize=9)
        at.set_yscale("log")
        at.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        at.set_ylabel("µs / call")
        ap.set_ylabel("% of copy bandwidth")
        ap.axhline(100, color="grey", lw=0.8, ls="--")
        ap.set_ylim(bottom=0)
    if axes is not None:
        for k in range(len(panels), (nrows // 2) * ncols):
            axes[2 * (k // ncols)][k % ncols].axis("off")
            axes[2 * (k // ncols) + 1][k % ncols].axis("off")
        handles = {}
        for ax in fig.axes:
            for h, lab in zip(*ax.get_legend_handles_labels()):
                handles.setdefault(lab, h)
        if handles:
            fig.legend(handles.values(), handles.keys(), loc="outside lower center",
                       ncols=min(4, len(handles)), fontsize=9)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=100)
    return path


def _time(us: float) -> str:
    return f"{us / 1e3:.3f} ms" if us >= 1000 else f"{us:.2f} µs"


def table(report: dict) -> str:
    """``report`` as Markdown: one row per case, per provider the median time, its speedup over
    the first provider and % of the copy bandwidth; then the geomeans and the noise range."""
    if report.get("kind", "").startswith("compare"):
        return _compare_table(report)
    names, first = _providers(report), report.get("first_provider")
    lines = [f"**{report.get('title', report.get('mode'))}**, {report.get('gpu')}, "
             f"{report.get('date')}; x = time of {first} / time; % = bytes read per second over "
             "the copy bandwidth measured in the same run.", "",
             "| case | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for c in report.get("cases", []):
        cells = []
        for n in names:
            e = c["providers"].get(n, {})
            us = _num(e.get("median_us"))
            if us is None:
                cells.append("—" if "skipped" in e else "error" if "error" in e else "")
                continue
            sp, pct = _num(e.get("speedup_vs_first")), _num(e.get("pct_copy_bw"))
            cells.append(_time(us) + ("" if n == first or sp is None else f" ({sp:.2f}x)")
                         + ("" if pct is None else f", {pct:.0f}%")
                         + ("" if e.get("ok", True) else " FAIL"))
        lines.append(f"| {c['name']} | " + " | ".join(cells) + " |")
    gm = _geomeans(report)
    rng = (report.get("summary") or {}).get("self_vs_self")
    noise = f"; noise ({first}@self / {first}) {rng[0]:.3f}..{rng[1]:.3f}" if rng else ""
    lines += ["", "Geomean x over the cases each ran: " + (", ".join(
        f"{n} {g:.3f}" for n, g in gm.items() if n != first) or "—") + noise + "."]
    return "\n".join(lines) + "\n"


def _compare_table(report: dict) -> str:
    names = report.get("providers", [])
    lines = [f"**{report.get('mode')}: old tree vs new tree**, {report.get('gpu')}, "
             f"{report.get('date')}; speedup = time old / time new.", "",
             "| case | " + " | ".join(f"{n} old | {n} new | speedup" for n in names) + " |",
             "|---|" + "---|---|---|" * len(names)]
    for c in report.get("cases", []):
        cells = []
        for n in names:
            e = c["providers"].get(n, {})
            cells += [_time(t) if (t := _num(e.get(k, {}).get("median_us"))) else "—"
                      for k in ("old", "new")]
            cells.append(f"{e['speedup']:.3f}" if _num(e.get("speedup")) else "—")
        lines.append(f"| {c['name']} | " + " | ".join(cells) + " |")
    lines += ["", "Geomean speedup new vs old: " + ", ".join(
        f"{n} {s['geomean_speedup_new_vs_old']:.4f} over {s['cases']} cases"
        for n, s in (report.get("summary") or {}).items() if s.get("geomean_speedup_new_vs_old"))
        + "."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m bench.plot", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--table", action="store_true", help="print Markdown tables instead of a plot")
    ap.add_argument("files", nargs="+", help="REPORT.json OUT.png, or with --table the reports")
    args = ap.parse_args(argv)
    if not args.table and len(args.files) != 2:
        ap.error("plotting takes REPORT.json OUT.png")
    loaded = []
    for f in args.files if args.table else args.files[:1]:
        try:
            r = json.loads(Path(f).read_text())
            why = None if isinstance(r, dict) and "cases" in r else "not a bench/ report"
        except (OSError, ValueError) as e:
            why = f"cannot read it ({e})"
        if why:
            print(f"bench.plot: {f}: {why}", file=sys.stderr)
            return 2
        loaded.append(r)
    if args.table:
        print("\n".join(table(r) for r in loaded))
    else:
        print(f"wrote {plot(loaded[0], args.files[1])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
