"""The ``qsa`` command: ``contract``, ``check`` (also ``--tp N``), ``compile``, ``bench``,
``replay``, ``capture`` (``qsa --help`` and ``qsa COMMAND --help`` describe each); one
``_cmd_*`` function per command takes the parsed arguments and returns the exit status.

Every file is written only where an option names it (--json, --out, --plot), except a
benchmark's report: ``qsa bench`` writes it to --json, else ``$OUT/<name>.json``, else
``./bench-out/<name>.json``. A bad argument exits with status 2 and a message naming it. Output
uses ``rich`` tables when rich is installed, plain text otherwise; torch / jax / triton are
imported by the commands that need them, so ``qsa contract`` works on a numpy-only install.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Callable, Sequence

__all__ = ["main", "build_parser", "bench_main", "print_table", "envelope_rows", "UsageError"]


class UsageError(Exception):
    """A bad argument: ``main`` prints ``qsa COMMAND: message`` on stderr and returns 2."""


def _parsed(parse: Callable, text):
    """``parse(text)`` with its ValueError (a bad option value) raised as a UsageError."""
    try:
        return parse(text)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _split_list(text: str | None) -> list[str]:
    return [t.strip() for t in (text or "").split(",") if t.strip()]


# --------------------------------------------------------------------------------------------
# Output helpers.
def _console():
    try:
        from rich.console import Console  # noqa: PLC0415
    except ImportError:
        return None
    return Console(highlight=False, soft_wrap=False,
                   width=max(100, shutil.get_terminal_size((120, 24)).columns))


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[object]],
                *, file=None) -> None:
    """Print one table (rich when available, aligned plain text otherwise)."""
    rows = [[str(c) for c in r] for r in rows]
    console = _console() if file is None else None
    if console is not None:
        from rich.markup import escape  # noqa: PLC0415 - cells like "[exact]" are not markup
        from rich.table import Table  # noqa: PLC0415

        table = Table(title=escape(title), title_justify="left")
        for c in columns:
            table.add_column(escape(str(c)), overflow="fold")
        for r in rows:
            table.add_row(*(escape(c) for c in r))
        console.print(table)
        return
    out = file or sys.stdout
    widths = [max([len(str(c))] + [len(r[i]) for r in rows]) for i, c in enumerate(columns)]
    print(title, file=out)
    print("  ".join(str(c).ljust(w) for c, w in zip(columns, widths)), file=out)
    print("  ".join("-" * w for w in widths), file=out)
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)), file=out)
    print(file=out)


def _fmt(x, spec=".2e") -> str:
    return "-" if x is None else format(x, spec)


def _finite_json(obj):
    """Strict JSON: non-finite floats (a crashed or NaN case) become the strings "inf"/"nan"."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: _finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite_json(v) for v in obj]
    return obj


def _write_json(path: str, doc: dict, *, say: bool = True) -> Path:
    """Write ``doc`` and the versions as strict JSON, replacing the file whole (a run cut short
    leaves the last complete document); ``say``: print ``wrote PATH``."""
    from .crosscheck import versions  # noqa: PLC0415

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    tmp.write_text(json.dumps(_finite_json({**doc, "versions": versions()}), indent=1,
                              default=str, allow_nan=False))
    tmp.replace(path)
    if say:
        print(f"wrote {path}")
    return path


def load_check_implementations(interpret: bool):
    """The implementations ``qsa check`` compares (a seam: tests inject fakes here)."""
    from . import crosscheck as X  # noqa: PLC0415

    return X.load_implementations(interpret)


def _implementations(args) -> tuple[bool, str, list]:
    """(interpret, device, implementations) of check / replay: ``--impls`` applied, the
    ``--peer`` appended (skipped with a note when its files are absent)."""
    from . import crosscheck as X  # noqa: PLC0415

    interpret = X.prepare_backends(True if args.interpret else None)
    device = "cpu" if interpret else "cuda"
    impls = load_check_implementations(interpret)
    if getattr(args, "impls", None) is not None:
        wanted = _split_list(args.impls)
        unknown = [w for w in wanted if w not in {i.name for i in impls}]
        if unknown or not wanted:
            raise UsageError(f"--impls: unknown {unknown or [args.impls]}; allowed: "
                             f"{', '.join(i.name for i in impls)}")
        impls = [i for i in impls if i.name in wanted]
    if getattr(args, "peer", None):
        try:
            impls.append(X.load_peer(args.peer, device))
        except ValueError as e:  # an unknown peer name
            raise UsageError(str(e)) from None
        except Exception as e:  # noqa: BLE001 - peer absent or broken: skip it, say so
            print(f"qsa {args.command}: peer {args.peer!r} unavailable, skipped ({e})",
                  file=sys.stderr)
    return interpret, device, impls


# --------------------------------------------------------------------------------------------
# qsa contract
def envelope_rows() -> list[tuple[str, str, str]]:
    """(op, entry points, envelope) for every entry point of ``interop.cases.ENTRY_OP``, the
    entry points that share one envelope (``interop.contract.envelope_text``) in one row."""
    from interop.cases import ENTRY_OP  # noqa: PLC0415
    from interop.contract import envelope_text  # noqa: PLC0415

    groups: dict[tuple[str, str], list[str]] = {}
    for entry, op in ENTRY_OP.items():
        groups.setdefault((op, envelope_text(entry)), []).append(entry)
    return [(op, " / ".join(entries), text) for (op, text), entries in groups.items()]


def _cmd_contract(args) -> int:
    from interop.arch import KNOWN_ARCHS, DeviceFacts  # noqa: PLC0415
    from interop.contract import QUALIFIED, route  # noqa: PLC0415

    from .compile import parse_archs  # noqa: PLC0415 - numpy-only: imports no backend

    names = _parsed(parse_archs, args.arch) if args.arch else list(KNOWN_ARCHS)
    print_table("Qualified envelope per entry point (qsa-contract.md §2-4b, "
                "interop.contract.envelope_text)", ("op", "entry points", "envelope"),
                envelope_rows())
    pairs = ", ".join(f"({a},{b})" for a, b in QUALIFIED["head_pairs"])
    ppairs = ", ".join(f"({a},{b})" for a, b in QUALIFIED["prefill_head_pairs"])
    (rlo, rhi), (wlo, whi) = QUALIFIED["paged_rows"], QUALIFIED["paged_width"]
    mode_rows = [
        ("dtype", "bf16 | fp16 (chunk/paged K/V and the decode pool also fp8 e4m3)", "same"),
        ("head dim D", "power of two 32..256", f"D = {QUALIFIED['head_dim']}"),
        ("(Hq, Hkv)", "Hkv divides Hq, group <= 16",
         f"decode {{{pairs}}}; prefill {{{ppairs}}}"),
        ("batch B (decode)", "B >= 1", f"{QUALIFIED['batch'][0]} <= B <= {QUALIFIED['batch'][1]}"),
        ("rows R (paged decode)", "R >= 1", f"{rlo} <= R <= {rhi}"),
        ("max_seqlen_k (decode)", ">= 1", f"1 .. {QUALIFIED['max_seqlen_k']}"),
        ("max_seqlen_q (decode)", "= 1", "= 1"),
        ("metadata", "int32, 1-D, length B+1 (kv_lens B), on q's device, contiguous", "same"),
        ("indices", "int32 [T, W] or [T, Hkv, W], W >= 1",
         f"W = {QUALIFIED['index_width']} in production; paged decode {wlo} <= W <= {whi}"),
        ("block_indices (prefill)", "int32 [T, NB] or [T, Hkv, NB], 1 <= NB <= 2048",
         f"NB = {QUALIFIED['block_width']}"),
    ]
    print_table("Checks: default mode vs --strict (interop.contract.check_*)",
                ("item", "default mode (correctness)", "strict mode (qualified)"), mode_rows)
    route_rows = []
    for n in names:
        for part in KNOWN_ARCHS[n].example_parts:
            facts = DeviceFacts.for_arch(n, name=part)
            d = route(facts, "decode")
            prefill = {op: route(facts, op) for op in ("prefill", "prefill_chunk", "prefill_paged")}
            route_rows.append((n, f"{part.removeprefix('NVIDIA ')} ({facts.sm_count} SM)",
                               f"{d.kernel} [{'exact' if d.exact_contract else 'default'}]",
                               " / ".join(sorted({r.geometry for r in prefill.values()})),
                               prefill["prefill"].reason))
    print_table("Routing per arch (interop.contract.route)",
                ("arch", "part", "decode [checks]", "prefill geometry", "why (prefill)"), route_rows)
    from interop.geometry import PREFILL_SPLIT_RULES as u  # noqa: PLC0415
    k = ", ".join(f"{n} for {b}" for b, n in u["programs_per_sm"].items())
    print(f"Split-KV prefill (interop.geometry.prefill_splits): floor(k x SMs / (T x Hkv)) "
          f"shares a row (k = {k}), at most {u['max_splits']} and W // {u['min_split_columns']}, "
          f"at least 1")
    print_table("Arch facts (interop.arch.KNOWN_ARCHS)",
                ("arch", "cc", "tensor cores", "max smem / block"),
                [(n, f"{i.cc[0]}.{i.cc[1]}", i.tensor_cores, f"{i.smem_per_block:,} B")
                 for n, i in KNOWN_ARCHS.items() if n in names])
    return _contract_self_test() if args.strict else 0


def _contract_self_test() -> int:
    """--strict: the envelope's corners must pass the strict checks and the cases just outside
    be refused; prints the outcome, returns 1 on any surprise."""
    from interop.contract import QUALIFIED, ContractError, TensorSpec, check_decode  # noqa: PLC0415
    from interop.contract import check_prefill_chunk  # noqa: PLC0415

    def dec(b=1, hq=24, hkv=2, msk=2051, d=256, msq=1):
        kv, cu = TensorSpec((4096, hkv, d), "bfloat16"), TensorSpec((b + 1,), "int32")
        return check_decode(TensorSpec((b, hq, d), "bfloat16"), kv, kv, cu, cu, msk,
                            max_seqlen_q=msq, strict=True)

    def pre(hq, hkv, kv="bfloat16", t=64, d=256):
        k, two = TensorSpec((512, hkv, d), kv), TensorSpec((2,), "int32")
        return check_prefill_chunk(TensorSpec((t, hq, d), "bfloat16"), k, k,
                                   TensorSpec((t, 2051), "int32"), two, two,
                                   TensorSpec((1,), "int32"), t, strict=True)

    (lo, hi), msk = QUALIFIED["batch"], QUALIFIED["max_seqlen_k"]
    cases = [(f"decode ({hq},{hkv}) B={b}" + (f" max_seqlen_k={m}" if b == lo else ""), dec,
              dict(b=b, hq=hq, hkv=hkv, msk=m), True)
             for hq, hkv in QUALIFIED["head_pairs"] for b, m in ((lo, msk), (hi, 2051))]
    cases += [(f"prefill_chunk ({hq},{hkv}) fp8 K/V", pre, dict(hq=hq, hkv=hkv,
               kv="float8_e4m3fn"), True) for hq, hkv in QUALIFIED["prefill_head_pairs"]]
    cases += [(name, dec, kw, False) for name, kw in (
        ("decode B=0", dict(b=0)), (f"decode B={hi + 1}", dict(b=hi + 1)),
        ("decode (16,2)", dict(hq=16)), ("decode max_seqlen_k=0", dict(msk=0)),
        (f"decode max_seqlen_k={msk + 1}", dict(msk=msk + 1)),
        ("decode max_seqlen_q=2", dict(msq=2)), ("decode D=128", dict(d=128)))]
    cases.append(("prefill (24,4)", pre, dict(hq=24, hkv=4), False))
    rows, bad = [], 0
    for name, fn, kwargs, should_pass in cases:
        try:
            fn(**kwargs)
            ok, got = should_pass, "accepted"
        except ContractError as e:
            ok, got = not should_pass, f"refused ({e.arg})"
        bad += not ok
        rows.append((name, "accept" if should_pass else "refuse", got, "ok" if ok else "FAIL"))
    print_table("Strict-mode self test", ("case", "expected", "got", "result"), rows)
    return 1 if bad else 0


# --------------------------------------------------------------------------------------------
# qsa check
def _device_name(device: str) -> str:
    if device == "cpu":
        return f"CPU ({platform.machine()}), interpreters"
    try:
        import torch  # noqa: PLC0415

        return torch.cuda.get_device_name()
    except Exception:  # noqa: BLE001
        return device


def _run_with_progress(X, specs, impls, device, reference, after) -> list:
    """Run the matrix: a rich progress bar on a terminal, else one line per case (every failure;
    every case of a matrix up to 300, else every tenth); ``after(results so far)`` after each."""
    prog = None
    if sys.stderr.isatty():
        try:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress,  # noqa: PLC0415
                                       TextColumn, TimeElapsedColumn, TimeRemainingColumn)

            prog = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), TimeRemainingColumn(), transient=True)
        except ImportError:
            pass
    results, n = [], len(specs)
    with prog or contextlib.nullcontext():
        task = prog.add_task("cases", total=n) if prog else None
        for i, spec in enumerate(specs, 1):
            if prog:
                prog.update(task, description=spec.name)
            r = X.run_case(spec, impls, device=device, reference=reference)
            results.append(r)
            after(results)
            why = "" if r.passed else ": " + " | ".join(r.failures)
            if prog:
                if not r.passed:
                    prog.console.print(f"FAIL {r.name}{why}", markup=False)
                prog.advance(task)
            elif not r.passed or n <= 300 or i % 10 == 0 or i == n:
                verdict = "FAIL" if not r.passed else "skip" if _unchecked(r) else "ok  "
                print(f"[{i}/{n}] {verdict} {r.name} ({r.seconds:.1f}s){why}", flush=True)
    return results


def _unchecked(result) -> bool:
    """No implementation ran on the case (every one skipped it): nothing was compared."""
    return all(v.get("skipped") for v in result.impl.values())


def _cmd_check_tp(args) -> int:
    """``qsa check --tp N`` (``interop.validate.tp.check``); 2 where the devices are missing."""
    from . import crosscheck as X  # noqa: PLC0415
    from . import tp as TP  # noqa: PLC0415

    other = [o for o, v in (("--ops", args.ops), ("--filter", args.filter), ("--peer", args.peer),
                            ("--full", args.full), ("--quick", args.quick)) if v]
    if other:
        raise UsageError(f"--tp runs its own cases (interop.validate.tp.tp_cases); "
                         f"{', '.join(other)} do not apply")
    frameworks = _split_list(args.impls) or ["pallas", "triton"]
    if not set(frameworks) <= {"pallas", "triton"}:
        raise UsageError(f"--impls: {args.impls!r}; allowed with --tp: pallas, triton")
    interpret = X.prepare_backends(True if args.interpret else None)
    try:
        report = TP.check(args.tp, interpret=interpret, frameworks=frameworks, time=args.time,
                          log=lambda line: print(line, flush=True))
    except TP.Unavailable as e:
        print(f"qsa check --tp {args.tp}: cannot run: {e}", file=sys.stderr)
        return 2
    if args.json:
        _write_json(args.json, {"command": f"qsa check --tp {args.tp}", **report})
    print(f"qsa check --tp {args.tp}: " + ("every rank passed" if report["passed"] else "FAILED"))
    return 0 if report["passed"] else 1


def _cmd_check(args) -> int:
    from . import crosscheck as X  # noqa: PLC0415

    if args.tp:
        return _cmd_check_tp(args)
    if args.time:
        raise UsageError("--time goes with --tp")
    ops = _parsed(X.select_ops, args.ops)
    interpret, device, impls = _implementations(args)
    full = args.full or (not args.quick and not interpret)
    specs = X.full_matrix(ops) if full else X.quick_matrix(ops)
    if args.filter:
        specs = [s for s in specs if any(f in s.name for f in _split_list(args.filter))]
        if not specs:
            raise UsageError(f"--filter {args.filter!r} matches no case")
    names = [i.name for i in impls]
    mode = "full" if full else "quick"
    print(f"qsa check: {mode} matrix, {len(specs)} case(s), ops {','.join(ops)}, "
          f"{'interpret mode (CPU)' if interpret else 'compiled kernels (' + device + ')'}, "
          f"implementations {', '.join(names)}", flush=True)

    def write_json(results, complete: bool) -> None:
        if not args.json:
            return
        failed = [r for r in results if not r.passed]
        _write_json(args.json, say=complete, doc={
            "command": "qsa check", "matrix": mode, "ops": list(ops), "interpret": interpret,
            "device": _device_name(device),
            "tolerance": {"rtol": X.RTOL, "atol": X.ATOL, "rel_l2": X.REL_L2},
            "implementations": names, "complete": complete, "cases_planned": len(specs),
            # the case that was about to run (a crash, e.g. a CUDA fault, ends the run there)
            "next_case": None if complete or len(results) >= len(specs) else specs[len(results)].name,
            "summary": X.summarize(results, names),
            "passed": complete and not failed and not all(map(_unchecked, results)),
            "unchecked": [r.name for r in results if _unchecked(r)],
            "cases": [r.as_dict() for r in results]})

    write_json([], False)
    results = _run_with_progress(X, specs, impls, device, args.reference,
                                 after=lambda rs: write_json(rs, False))
    for op, s in X.summarize(results, names).items():
        cols = ["cases", "passed", *(f"rel L2 {n}" for n in names), "|Pallas-Triton|", "worst case"]
        row = [s["cases"], s["passed"], *(_fmt(s[f"max_rel_l2[{n}]"]) for n in names),
               _fmt(s["max_pallas_triton"], ".3g"), s["worst_case"]]
        print_table(f"{op}: {s['passed']}/{s['cases']} passed (max over cases; rtol=atol="
                    f"{X.RTOL:g}, rel L2 <= {X.REL_L2:g})", cols, [row])
        skipped = {n: s[f"skipped[{n}]"] for n in names if s[f"skipped[{n}]"]}
        if skipped:
            print("  skipped: " + ", ".join(f"{n} {c} case(s)" for n, c in skipped.items()))
            for n in skipped:
                for why in s.get(f"skip_reasons[{n}]", []):
                    print(f"    {n}: {why}")
    failed = [r for r in results if not r.passed]
    if failed:
        print_table(f"FAILED: {len(failed)} case(s)", ("case", "why"),
                    [(r.name, " | ".join(r.failures)) for r in failed])
    unchecked = [r for r in results if r.passed and _unchecked(r)]
    write_json(results, True)
    if failed:
        print(f"qsa check: {len(failed)} case(s) FAILED: " + ", ".join(r.name for r in failed[:10])
              + (" ..." if len(failed) > 10 else ""))
        return 1
    if len(unchecked) == len(results):
        print(f"qsa check: nothing was checked: every implementation skipped all {len(results)} "
              "case(s) (see 'skipped' above)")
        return 1
    print("qsa check: all cases passed" + (
        f" ({len(unchecked)} of {len(results)} not checked: every implementation skipped them)"
        if unchecked else ""))
    return 0


# --------------------------------------------------------------------------------------------
# qsa compile
_COMPILE_COLUMNS = ("backend", "arch", "config", "warps/stages", "shared B / limit", "regs",
                    "spill B", "verdict")


def _cmd_compile(args) -> int:
    from . import compile as CC  # noqa: PLC0415

    archs = _parsed(CC.parse_archs, args.arch)
    families = _split_list(args.family) or list(CC.FAMILIES)
    allowed = [*CC.FAMILIES, *(f"{b}:{k}" for b, ks in CC.FAMILIES.items() for k in ks)]
    bad = [f for f in families if f not in allowed]
    if bad:
        raise UsageError(f"--family: unknown {bad}; allowed: {', '.join(allowed)}")
    # the CPUs this process may run on (os.cpu_count() reports a CI container's host's count)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    jobs = args.jobs if args.jobs is not None else cpus or 1
    if jobs < 1:
        raise UsageError(f"--jobs must be >= 1, got {jobs}")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        # the interpreter replaces @triton.jit functions: compile in a clean interpreter
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env.setdefault("JAX_PLATFORMS", "cpu")
        return subprocess.run([sys.executable, "-m", "interop.validate.cli", "compile",
                               *args._argv[1:]], env=env).returncode
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # lowering needs no GPU
    reports = CC.run(archs, families, progress=lambda m: print(m, flush=True), jobs=jobs,
                     triton_modules=_split_list(args.triton_modules),
                     pallas_modules=_split_list(args.pallas_modules))
    if args.verbose:
        print_table("Every configuration", _COMPILE_COLUMNS, CC.summary_rows(reports))
    groups: dict[tuple[str, str], list] = {}
    for r in reports:
        groups.setdefault((r.family, r.arch), []).append(r)
    sum_rows = []
    for (fam, arch), rs in groups.items():
        real = [r for r in rs if not r.note]
        shared = [r.shared for r in real if r.shared is not None]
        regs = [r.regs for r in real if r.regs is not None]
        sum_rows.append([fam, arch, len(real), sum(r.fits for r in real),
                         f"{max(shared):,}" if shared else "-",
                         f"{CC.KNOWN_ARCHS[arch].smem_per_block:,}", max(regs) if regs else "-",
                         sum(1 for r in real if r.spill_bytes),
                         "; ".join(f"{r.name}: {r.note}" for r in rs if r.note)])
    print_table("qsa compile: configurations per backend and arch",
                ("backend", "arch", "configs", "fit", "max shared B", "limit B", "max regs",
                 "with spills", "notes"), sum_rows)
    failed = [r for r in reports if not r.fits]
    if failed:
        print_table(f"FAILED: {len(failed)} configuration(s) do not fit", _COMPILE_COLUMNS,
                    CC.summary_rows(failed))
    if args.json:
        _write_json(args.json, {"command": "qsa compile", "archs": archs, "families": families,
                                "passed": not failed, "configs": [r.as_dict() for r in reports]})
    print("qsa compile: " + ("every configuration fits" if not failed
                             else f"{len(failed)} configuration(s) do NOT fit"))
    return 1 if failed else 0


# --------------------------------------------------------------------------------------------
# qsa bench
BENCHES = {
    "decode": "sparse_decode: qsa_triton (and qsa_pallas) vs upstream SGLang's decode kernels, "
              "interleaved CUDA-graph timing, FP32 check of every provider (bench/decode.py)",
    "prefill": "sparse prefill (ordinary, chunk, paged): the same providers and checks "
               "(bench/prefill.py)",
    "indexer": "the QSA indexer (scoring + exact top-512 + expansion), decode and prefill: "
               "qsa_triton and qsa_pallas vs upstream's torch path and XLA (bench/indexer.py)",
}


def _bench_usage(file) -> None:
    print(f"usage: qsa bench {{{','.join(BENCHES)}}} [OPTIONS...]", file=file)
    print("\nBenchmarks on a CUDA GPU; they live in the repository's bench/ folder (run from a "
          "checkout).\n", file=file)
    for name, text in BENCHES.items():
        print(textwrap.fill(text, width=100, initial_indent=f"  {name:<8} ",
                            subsequent_indent=" " * 11), file=file)
    print("\n`qsa bench NAME --help` lists a benchmark's options. Its JSON report goes to "
          "--json FILE,\nelse $OUT/<report>.json, else ./bench-out/<report>.json.", file=file)


def bench_main(argv: Sequence[str]) -> int:
    """``qsa bench WHICH [OPTIONS...]``: hand the options to ``bench/<WHICH>.py``'s ``main``
    (its own argparse, so ``--help`` shows its real options). Exit status 2 with a usage when
    WHICH is missing or unknown."""
    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        _bench_usage(sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    which, rest = argv[0], argv[1:]
    if which not in BENCHES:
        _bench_usage(sys.stderr)
        print(f"qsa bench: unknown benchmark {which!r}; choose one of: {', '.join(BENCHES)}",
              file=sys.stderr)
        return 2
    root = Path(__file__).resolve().parents[2]  # the repository: bench/ sits next to interop/
    if (root / "bench" / f"{which}.py").is_file() and str(root) not in sys.path:
        sys.path.insert(0, str(root))
    try:
        mod = importlib.import_module(f"bench.{which}")
    except ImportError as e:
        print(f"qsa bench: bench/{which}.py is not available ({e}); run from a checkout of the "
              "repository", file=sys.stderr)
        return 2
    return int(mod.main(rest[1:] if rest[:1] == ["--"] else rest, prog=f"qsa bench {which}") or 0)


# --------------------------------------------------------------------------------------------
# qsa replay / qsa capture
def _cmd_replay(args) -> int:
    from . import capture as CAP  # noqa: PLC0415
    from . import crosscheck as X  # noqa: PLC0415

    _, device, impls = _implementations(args)
    try:
        results = CAP.replay(args.files, impls, device=device, reference=args.reference,
                             rel_l2_limit=args.rel_l2)
    except (OSError, ValueError, ImportError) as e:
        raise UsageError(str(e)) from None
    for cap, res, stored in results:
        m = cap.metadata
        rows = []
        if stored is not None:
            rows.append([f"stored ({m.get('producer') or '?'})", _fmt(stored["rel_l2_vs_reference"]),
                         "-", "ok" if stored["within_tolerance"] else "outside tolerance (reported)"])
        for name, r in res.impl.items():
            if r.get("skipped"):
                rows.append([name, "-", "-", f"skipped: {r['skipped']}"])
            else:
                rows.append([name, _fmt(r.get("rel_l2")), _fmt(r.get("rel_l2_vs_expected")),
                             "ok" if r["passed"] else "FAIL " + (r.get("error") or "")])
        print_table(f"{res.name}: {cap.entry} {m.get('rank_shape', '')}, captured on "
                    f"{m.get('arch', '?')} ({m.get('device', '?')}), model {m.get('model_revision') or '-'}",
                    ("output", "rel L2 vs FP64 reference", "rel L2 vs stored", "verdict"), rows)
    limit = X.REL_L2 if args.rel_l2 is None else args.rel_l2
    print(f"(judged against the FP64 reference: rtol=atol={X.RTOL:g}, rel L2 <= {limit:g})")
    failed = [res for _, res, _ in results if not res.passed]
    for res in failed:
        print(f"FAIL {res.name}: {' | '.join(res.failures)}")
    bad_stored = [res.name for _, res, st in results if st is not None and not st["within_tolerance"]]
    if bad_stored:
        # the stored output is the captured run's result: a record, judged only on request
        print(f"WARNING: the stored output is outside tolerance of the FP64 reference in "
              f"{len(bad_stored)} file(s): {', '.join(bad_stored)} (the captured call returned a "
              f"wrong result{'' if args.fail_on_stored else '; --fail-on-stored makes this an error'})")
    if args.json:
        _write_json(args.json, {"command": "qsa replay", "device": device, "passed": not failed,
                                "files": [{"file": res.name, "metadata": cap.metadata,
                                           "stored": stored, "result": res.as_dict()}
                                          for cap, res, stored in results]})
    print("qsa replay: " + ("all files passed" if not failed else f"{len(failed)} file(s) FAILED")
          + (f"; stored output wrong in {len(bad_stored)} file(s)" if bad_stored else ""))
    return 1 if failed or (bad_stored and args.fail_on_stored) else 0


def _cmd_capture(args) -> int:
    from . import capture as CAP  # noqa: PLC0415
    from . import crosscheck as X  # noqa: PLC0415

    interpret = X.prepare_backends(True if args.interpret else None)
    # only the cases a capture file can hold (the attention entry points), quick names first
    ops = sorted({CAP.ENTRY_OP[e] for e in CAP.ENTRIES})
    quick = [s for s in X.quick_matrix() if s.op in ops]
    full = [s for s in X.full_matrix() if s.op in ops]
    specs = {s.name: s for s in quick + full}
    if args.list:
        print("\n".join(specs))
        return 0
    if not args.case:
        raise UsageError("--case NAME is required (--list prints the case names)")
    if interpret:  # the quick cases win on a CPU (their dtype runs in the interpreter)
        specs.update({s.name: s for s in quick})
    spec = specs.get(args.case)
    other = {s.name: s for s in X.quick_matrix() + X.full_matrix()}.get(args.case)
    if spec is None and other is not None:
        raise UsageError(f"case {args.case!r} is of the operation {other.op!r}; capture files "
                         f"hold the attention entry points ({', '.join(ops)} cases) only")
    if spec is None:
        close = [n for n in specs if args.case in n][:8]
        raise UsageError(
            f"unknown case {args.case!r}" + (f"; did you mean: {', '.join(close)}" if close else "")
            + f"\ncapturable quick-matrix cases ({len(quick)}: qsa check's indexer and step cases "
            f"are not capturable; the full matrix adds {len(specs) - len(quick)}, "
            "`qsa capture --list` prints every name):\n"
            + textwrap.fill(", ".join(s.name for s in quick), width=100, initial_indent="  ",
                            subsequent_indent="  ", break_on_hyphens=False))
    if not args.out:
        raise UsageError("--out FILE is required (the capture file to write)")
    impls = {i.name: i for i in load_check_implementations(interpret)}
    impl = impls.get(args.impl)
    if impl is None:
        raise UsageError(f"--impl must be one of {', '.join(impls)}")
    device = "cpu" if interpret else "cuda"
    inp = X.build_inputs(spec, device)
    path = CAP.save_capture(args.out, inp.entry, inp.named(), expected=X._call(impl, inp),
                            model_revision=args.model_revision or "synthetic (qsa check case)",
                            producer=f"{impl.name}.{inp.entry}", note=f"qsa check case {spec.name}")
    print(f"wrote {path} ({inp.entry}, case {spec.name}, output of {impl.name} on {device})")
    return 0


# --------------------------------------------------------------------------------------------
# The parser.
_SHARED = {  # options of several commands
    "--interpret": dict(action="store_true",
                        help="force interpret mode (CPU tensors) even where a GPU exists"),
    "--json": dict(metavar="FILE", help="write the results as JSON (parent folders are created)"),
    "--peer": dict(metavar="NAME", help="also run upstream SGLang's kernels: 'sglang' (skipped "
                   "when absent)"),
    "--reference": dict(choices=("auto", "numpy", "torch"), default="auto",
                        help="FP64 reference: numpy (interop.reference), torch (float64, batched; "
                        "for large cases) or auto (default)"),
}


def _command(sub, name: str, func: Callable, help: str, *shared: str, **kwargs):
    """One subcommand: ``help`` (also its description unless given), the ``_SHARED`` options
    named, ``func`` as its handler."""
    p = sub.add_parser(name, help=help, description=kwargs.pop("description", help), **kwargs)
    for opt in shared:
        p.add_argument(opt, **_SHARED[opt])
    p.set_defaults(func=func)
    return p


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser with every subcommand."""
    parser = argparse.ArgumentParser(prog="qsa", description="QSA sparse attention: contract, "
                                     "cross-check, compile, bench, capture/replay")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = _command(sub, "contract", _cmd_contract, "print every entry point's qualified envelope "
                 "and the routing per arch", description="Print the qualified contract of every "
                 "entry point (qsa-contract.md §2-4b), the default-vs-strict checks, and which "
                 "kernel family / geometry source each arch routes to.")
    p.add_argument("--arch", help="comma-separated archs (sm_90, sm_100, sm_120, sm_121); "
                   "default: all known")
    p.add_argument("--strict", action="store_true", help="also run the strict checks on the "
                   "envelope's corners and just outside (exit 1 if any is accepted/refused wrongly)")

    p = _command(sub, "check", _cmd_check, "cross-check Pallas vs Triton vs the FP64 reference",
                 "--json", "--peer", "--interpret", "--reference", description="Feed identical "
                 "inputs to qsa_pallas and qsa_triton (zero-copy through DLPack), compare each "
                 "with the FP64 reference and with each other (and with upstream SGLang with "
                 "--peer). Exit status 1 if any case fails.")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true",
                      help="the reduced matrix (default on a CPU machine: interpret mode)")
    size.add_argument("--full", action="store_true",
                      help="the full matrix (default on a GPU machine: compiled kernels)")
    p.add_argument("--ops", help="comma-separated: decode,prefill,paged,indexer,step (default: "
                   "all; paged = sparse_decode_paged, indexer = scoring + exact top-k + "
                   "expansion, step = the end-to-end qsa_decode_step / qsa_prefill_step)")
    p.add_argument("--filter", metavar="TEXT", help="only cases whose name contains TEXT "
                   "(comma-separated alternatives)")
    p.add_argument("--impls", metavar="NAMES", help="implementations to run: triton,pallas "
                   "(default both; one alone for a single-framework install)")
    p.add_argument("--tp", type=int, choices=(2, 4), help="tensor parallel instead of the matrix: "
                   "the QSA step (decode, prefill) split over TP ranks, every rank against the TP1 "
                   "call (bitwise in batch-invariant decode): JAX shard_map over TP devices, "
                   "TP torch.distributed processes; CPU: host devices / gloo, GPU: one rank per "
                   "GPU / NCCL (needs TP GPUs)")
    p.add_argument("--time", action="store_true", help="with --tp on GPUs: per-rank time vs "
                   "the single-GPU TP-shaped call in the same run (PASS within 10%%)")

    p = _command(sub, "compile", _cmd_compile, "AOT-compile every shipped kernel configuration "
                 "per arch", "--json", description="Compile every Triton kernel configuration "
                 "the selectors can choose, and lower + compile every Pallas kernel for the arch's "
                 "abstract device, without a GPU; report shared memory, registers and spills "
                 "against the arch's limits. Exit status 1 if any configuration does not fit.")
    p.add_argument("--arch", help="comma-separated: sm_90, sm_100, sm_120, sm_121 (default: "
                   "sm_90,sm_120,sm_121)")
    p.add_argument("--jobs", type=int, help="worker processes, one kernel family (with every "
                   "arch) each, the longest first (default: CPU count; 1 = in this process)")
    p.add_argument("--family", help="comma-separated: triton, pallas (default: both) or one "
                   "kernel family such as triton:decode, pallas:decode_paged")
    p.add_argument("-v", "--verbose", action="store_true", help="print every configuration")
    p.add_argument("--triton-modules", metavar="M,..", help="modules whose compile_configs(arch) "
                   "replace the built-in Triton lists (out-of-tree kernels)")
    p.add_argument("--pallas-modules", metavar="M,..", help="modules whose "
                   "lowering_cases(device_kind) replace the built-in Pallas lists")

    # listed for `qsa --help`; main() hands `qsa bench ...` to bench_main before argparse
    sub.add_parser("bench", help="benchmarks on a GPU: decode | prefill | indexer "
                   "(bench/decode.py, bench/prefill.py, bench/indexer.py)", add_help=False)

    p = _command(sub, "replay", _cmd_replay, "re-run captured kernel calls "
                 "(interop.validate.capture format)", "--peer", "--json", "--reference",
                 "--interpret", description="Run qsa_triton and qsa_pallas (and the peer) on each "
                 "captured call and report relative L2 against the FP64 reference and against the "
                 "stored output. Exit status 1 if an implementation is outside tolerance.")
    p.add_argument("files", nargs="+", metavar="FILE", help="qsa-capture/1 safetensors files")
    p.add_argument("--rel-l2", type=float, help="relative L2 limit vs the reference (default "
                   "5e-3; upstream uses 2e-3 on real captured tensors)")
    p.add_argument("--fail-on-stored", action="store_true", help="exit 1 also when a file's "
                   "stored output is outside tolerance of the FP64 reference (default: a "
                   "WARNING; the implementations are what is judged)")

    p = _command(sub, "capture", _cmd_capture, "save one `qsa check` case (decode, prefill or "
                 "paged decode) and an implementation's output as a capture file (for qsa replay)",
                 "--interpret")
    p.add_argument("--case", metavar="NAME", help="a case name from the quick or full matrix "
                   "(interop.cases; --list prints them)")
    p.add_argument("--list", action="store_true", help="print the name of every case a capture "
                   "file can hold (decode, paged, prefill) and exit")
    p.add_argument("--impl", default="triton", help="implementation producing the stored output: "
                   "triton (default) or pallas")
    p.add_argument("--out", metavar="FILE", help="destination .safetensors (parent folders are "
                   "created)")
    p.add_argument("--model-revision", default="", help="free text recorded in the metadata")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``qsa`` console script. Returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    args._argv = argv
    try:
        return int(args.func(args) or 0)
    except UsageError as e:
        print(f"qsa {args.command}: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (`qsa capture --list | head`): exit quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
