"""The machinery shared by the benchmarks: provider registry, interleaved timing, reference check,
JSON report, command line, and the old-tree / new-tree comparison (``compare``).

A benchmark module declares ``Mode``s (cases, inputs and FP32 reference, bytes and flops, a
registry of ``Provider``s ``name -> setup(inputs) -> call``); ``run`` does the rest, the same way
for every mode:

* every provider of a case runs on the same inputs and its output is checked against the FP32
  reference (rtol = atol = 2e-2 elementwise, relative L2 <= 5e-3, finite: ``interop.cases``);
* the providers that pass are timed interleaved (``time_interleaved``): CUDA graphs of
  ``Mode.calls`` back-to-back calls (JAX: an unrolled chain in one ``jax.jit``, ``jax_chain``)
  replayed round-robin, the order rotating every round, each replay timed with CUDA events; the
  time is the median over rounds of replay time / calls. The first provider is timed a second
  time as ``NAME@self``: its ratio to itself is the run's noise (``docs/anchors.md``: plain
  ``do_bench`` of 4-60 us kernels was bimodal on the H200);
* the report (JSON) holds, per case and provider, the times, GB/s and % of the device-to-device
  copy bandwidth measured in the same run (bytes = what the case must read), the check, and
  ``speedup_vs_first`` = time of the first provider / time of this one.

torch and jax are imported lazily, so this module imports on any machine.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from interop.cases import ATOL, REL_L2, RTOL

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # jax shares the GPU with torch

__all__ = ["Provider", "Mode", "ProviderError", "choose", "positive_ints", "errors",
           "within_tolerance", "reference_f32", "chain_link", "unrolled", "jax_chain",
           "time_interleaved",
           "copy_bandwidth_bytes_per_s", "add_arguments", "run", "compare", "main", "write_json",
           "default_json_path", "geomean", "SELF_SUFFIX"]

SELF_SUFFIX = "@self"
ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("interop", "qsa_triton", "qsa_pallas")  # what --compare takes from the old tree


@dataclasses.dataclass(frozen=True)
class Provider:
    """One implementation of a mode's computation: ``name`` (for ``--providers``), ``doc`` (one
    line for ``--help``), ``default`` (timed when ``--providers`` is not given), ``supports``
    (the case's ``Mode.describe`` dict -> None, or why this provider does not apply) and
    ``setup``: inputs -> call. ``call()`` launches the work on torch's current stream, syncs
    nothing and returns the output (a torch tensor shaped like the reference); it may carry
    ``capturable = False`` (JAX: timed as an eager loop, not a CUDA graph), ``chain = n`` (one
    call does n calls of the op) and ``once`` (a single call's output, for the check). Raising
    means "cannot run this case" (reported, the others still run)."""

    name: str
    setup: Callable[[Any], Callable[[], Any]]
    doc: str
    supports: Callable[[Any], str | None] | None = None
    default: bool = True


@dataclasses.dataclass(frozen=True)
class Mode:
    """One benchmark: ``name`` (of the report, ``<name>.json`` by default), ``title`` (one line
    naming what is timed), ``providers`` (name -> Provider, the first is what ratios compare
    with), ``cases`` ((parsed command line, kind) -> cases; kind "bench", "smoke": tiny shapes
    for the CPU interpreters, or "memcheck": edge cases for compute-sanitizer), ``prepare``
    ((case, device) -> (inputs, FP32 reference)), ``describe`` ((case, inputs) -> JSON-able
    dict: ``name``, ``bytes`` the case must read, optionally ``flops``, ``plot`` ([[panel, x],
    ...]) and shape fields), ``calls`` (per CUDA-graph replay / JAX chain; None: ~2 ms a
    replay), ``finish`` (report -> None after a timed run's summary: the mode's verdicts) and
    ``view`` ((output, inputs) -> what is checked; None: the output)."""

    name: str
    title: str
    providers: dict[str, Provider]
    cases: Callable[[Any, str], list]
    prepare: Callable[[Any, Any], tuple[Any, Any]]
    describe: Callable[[Any, Any], dict]
    calls: int | None = None
    finish: Callable[[dict], None] | None = None
    view: Callable[[Any, Any], Any] | None = None


class ProviderError(ValueError):
    """A bad command-line value (the scripts exit 2 with its message, before touching a GPU)."""


def choose(text: str | None, allowed, flag: str, default=None) -> list[str]:
    """A comma list of names from ``allowed`` in the given order, duplicates dropped; None or
    blank text: ``default`` (None: every allowed name, in their order). Raises ProviderError
    naming ``flag`` and every allowed name on an unknown one."""
    allowed = list(allowed)
    names = list(dict.fromkeys(x.strip() for x in (text or "").split(",") if x.strip()))
    bad = [x for x in names if x not in allowed]
    if bad:
        raise ProviderError(f"unknown {flag} value(s) {', '.join(map(repr, bad))}; allowed: "
                            f"{', '.join(allowed)}")
    return names or list(allowed if default is None else default)


def positive_ints(text: str | None, default, flag: str) -> list[int]:
    """A comma list of positive integers (None or blank: ``default``); ProviderError otherwise."""
    try:
        out = [int(x) for x in text.split(",")] if text and text.strip() else list(default)
    except ValueError:
        out = [0]
    if any(x < 1 for x in out):
        raise ProviderError(f"{flag} wants positive integers, got {text!r}")
    return out


def peer():
    """``interop.validate.peer``: upstream SGLang's kernels, loaded from its wheel when used."""
    from interop.validate import peer as upstream  # noqa: PLC0415

    return upstream


def geomean(xs) -> float | None:
    """Geometric mean of the positive finite numbers in xs, None when there are none."""
    xs = [float(x) for x in xs if isinstance(x, (int, float)) and x > 0 and math.isfinite(x)]
    return math.exp(statistics.fmean(math.log(x) for x in xs)) if xs else None


# ------------------------------------------------------------------------------------- checks
def errors(out, ref) -> dict:
    """Max abs error, max excess over ``atol + rtol |ref|``, relative L2 and finiteness of ``out``
    against ``ref`` (torch tensors or numpy arrays), in float64 on ``ref``'s device."""
    import torch  # noqa: PLC0415

    r, o = (torch.as_tensor(x).detach().double() for x in (ref, out))
    o = o.to(r.device)
    diff = (o - r).abs()
    den = float(r.norm())
    rel = float((o - r).norm()) / den if den > 0 else float((o - r).norm())
    return {"max_abs": float(diff.max()) if o.numel() else 0.0,
            "excess": float((diff - (ATOL + RTOL * r.abs())).max()) if o.numel() else 0.0,
            "rel_l2": rel if math.isfinite(rel) else float("inf"),
            "finite": bool(torch.isfinite(o).all())}


def within_tolerance(err: dict) -> bool:
    """The acceptance rule (``qsa-contract.md`` §6): finite, elementwise within rtol/atol, relative
    L2 <= 5e-3."""
    return err["finite"] and err["excess"] <= 0.0 and err["rel_l2"] <= REL_L2


def reference_f32(q, k, v, gather, scale: float, v_scale: float = 1.0, chunk: int = 128):
    """The FP32 torch reference of sparse attention (every mode's), over chunks of query rows:
    q [n, Hq, D], k, v [rows, Hkv, D] (packed rows or the pool) -> float32 [n, Hq, D], zeros for
    a row without a valid entry. ``gather(s, e)`` -> (valid bool [e - s, Hkv, L], the K/V row of
    every entry [e - s, Hkv, L]) for query rows s .. e-1; invalid entries are never read (zero
    keys, masked: NaN in an unselected row never reaches the output). ``scale`` multiplies
    q . k (softmax scale x k_scale), ``v_scale`` the output."""
    import torch  # noqa: PLC0415

    n, hq, d = q.shape
    hkv = k.shape[1]
    heads = torch.arange(hkv, device=q.device)[None, :, None]
    out = torch.zeros(n, hq, d, dtype=torch.float32, device=q.device)
    with torch.no_grad():
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            ok, rows = gather(s, e)
            rows = torch.where(ok, rows, 0)
            kk, vv = (torch.where(ok[..., None], x[rows, heads].float(), 0.0) for x in (k, v))
            qq = q[s:e].float().view(e - s, hkv, hq // hkv, d)
            sc = torch.einsum("nhgd,nhld->nhgl", qq, kk) * scale
            p = torch.softmax(sc.masked_fill(~ok[:, :, None, :], float("-inf")), -1)
            o = torch.einsum("nhgl,nhld->nhgd", p.nan_to_num(0.0), vv) * v_scale
            out[s:e] = o.reshape(e - s, hq, d)
    return out


# --------------------------------------------------------------------------------------- JAX
#: integer arguments of at most this many elements (cu_seqlens, lengths, request ids) are tied to
#: the previous call's output in a chain (``chain_link``)
TIE_MAX_ELEMENTS = 1 << 16


def chain_link(xs: tuple, out) -> tuple:
    """The default link of ``unrolled``: ``(out, *xs[1:])``, the previous output as the first
    argument, and every integer argument of at most ``TIE_MAX_ELEMENTS`` elements plus a 0 that
    XLA cannot fold (``out``'s first element compared with its dtype's minimum). Without the
    tie, XLA merges the calls' identical work on the other arguments (a union build, a split
    schedule, a slot pre-pass, a compaction) into one per chain: that work was timed once per
    chain, not per call."""
    import jax.numpy as jnp  # noqa: PLC0415

    first = jnp.ravel(out)[0]
    info = jnp.finfo if jnp.issubdtype(first.dtype, jnp.floating) else jnp.iinfo
    zero = (first == info(first.dtype).min).astype(jnp.int32)

    def tie(x):
        small = hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.integer)
        return x + zero.astype(x.dtype) if small and x.size <= TIE_MAX_ELEMENTS else x

    return (out, *(tie(x) for x in xs[1:]))


def unrolled(step: Callable, n: int, link: Callable | None = None) -> Callable:
    """``(*xs) -> out``: n calls of ``step`` unrolled (to be jitted; with ``step`` itself jitted
    the chain traces it once and calls it n times), call i + 1 on ``link(xs, out_i)`` (default:
    ``chain_link``, the previous output as the first argument, the metadata tied to it)."""
    link = link or chain_link

    def run(*xs):
        out = step(*xs)
        for _ in range(n - 1):
            xs = link(xs, out)
            out = step(*xs)
        return out

    return run


def jax_chain(fn: Callable, args: list, kwargs: dict, chain: int,
              link: Callable | None = None) -> Callable[[], Any]:
    """A provider call: ``fn(*args, **kwargs)`` on torch buffers shared zero-copy with jax,
    ``chain`` calls unrolled in one ``jax.jit``, each depending on the previous output
    (``unrolled``'s ``link``, by default ``chain_link``): XLA can neither merge nor hoist them
    (its GPU ``while`` loop would round-trip to the host each trip). Host ints are static.
    ``call`` has ``chain``, ``capturable = False`` and ``once`` (one call's output, a torch
    tensor)."""
    import jax  # noqa: PLC0415

    from interop.dlpack import to_jax, to_torch  # noqa: PLC0415

    pos = [i for i, a in enumerate(args) if hasattr(a, "data_ptr")]
    arrays = [to_jax(args[i]) for i in pos]

    def one(*xs):
        full = list(args)
        for i, x in zip(pos, xs):
            full[i] = x
        return fn(*full, **kwargs)

    step = jax.jit(one)
    chained = jax.jit(unrolled(step, chain, link))

    def call():
        return to_torch(chained(*arrays))

    call.once = lambda: to_torch(step(*arrays))
    call.chain, call.capturable = chain, False
    return call


# ------------------------------------------------------------------------------------ timing
def copy_bandwidth_bytes_per_s(nbytes: int = 1 << 30, reps: int = 20) -> float:
    """Device-to-device copy bandwidth of the current CUDA device, bytes (read + written) per
    second: median of ``reps`` CUDA-event-timed copies of a 1 GiB buffer (far past the L2; the
    method of ``docs/anchors.md``, 4.25 TB/s on the H200)."""
    import torch  # noqa: PLC0415

    src = torch.ones(nbytes // 4, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    times = [_elapsed_us(lambda: dst.copy_(src)) for _ in range(reps + 3)][3:]  # 3 warm-up copies
    return 2 * nbytes / (statistics.median(times) * 1e-6)


def _elapsed_us(fn) -> float:
    """Run fn once; its time in µs: CUDA events on torch's current stream (host wall clock
    without CUDA)."""
    import torch  # noqa: PLC0415

    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3


def _sync():
    import torch  # noqa: PLC0415

    if torch.cuda.is_available():
        torch.cuda.synchronize()


class _Timed:
    """One provider ready to time: a CUDA graph of ``calls`` back-to-back calls, or (a call with
    ``capturable = False``, or no CUDA) an eager loop of calls, each doing ``chain`` ops."""

    def __init__(self, call, calls: int | None, target_us: float = 2000.0):
        import torch  # noqa: PLC0415

        self.call, self.graph = call, None
        self.chain = int(getattr(call, "chain", 1))
        call()  # warm-up: compiles
        if not torch.cuda.is_available():  # host wall clock: code paths only, one call a replay
            self.reps = 1
            return
        graphed = getattr(call, "capturable", True)
        call()
        _sync()
        if calls is None or not graphed:
            est = max(_elapsed_us(call), 1.0)
            calls = max(1, min(calls or 200, round(target_us / est)))
        # eager (JAX): >= 2 calls per timed replay, so one call's host dispatch overlaps the
        # previous call's GPU work instead of idling the GPU inside the measurement
        self.reps = calls if graphed else max(2, min(calls, 8))
        if graphed:
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, stream=torch.cuda.Stream()):
                for _ in range(self.reps):
                    call()
        _sync()

    def replay(self):
        if self.graph is not None:
            self.graph.replay()
        else:
            for _ in range(self.reps):
                self.call()

    def time_us(self) -> float:
        """One replay, timed: µs per op."""
        return _elapsed_us(self.replay) / (self.reps * self.chain)


def _stats(samples: list[float], t: _Timed | None = None) -> dict:
    s = sorted(samples)
    q = statistics.quantiles(s, n=10) if len(s) >= 2 else [s[0]] * 9
    out = {"median_us": statistics.median(s), "p10_us": q[0], "p90_us": q[-1], "min_us": s[0],
           "rounds": len(s)}
    if t is not None:
        out.update(calls_per_replay=t.reps, chain=t.chain, cuda_graph=t.graph is not None)
    return out


def time_interleaved(calls: dict[str, Callable], *, calls_per_replay: int | None = None,
                     rounds: int = 15, warmup_ms: float = 50.0) -> dict[str, dict]:
    """Time the provider calls of one case (name -> call, inputs ready, no host sync), interleaved:
    ``warmup_ms`` of untimed round-robin replays (GPU clocks settle after compile pauses), then
    ``rounds`` timed replays each, the order rotating each round; ``calls_per_replay`` calls per
    CUDA graph (None: sized to ~2 ms per replay). Returns name -> {"median_us", "p10_us",
    "p90_us", "min_us", "rounds", "calls_per_replay", "chain", "cuda_graph"} (µs per op), or
    {"error": text} for a provider that failed to warm up or be captured."""
    timed, out = {}, {}
    for name, call in calls.items():
        try:
            timed[name] = _Timed(call, calls_per_replay)
        except Exception as e:  # noqa: BLE001 - one provider failing must not stop the others
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            _sync()
    names = list(timed)
    t_end = time.perf_counter() + warmup_ms / 1e3
    while names and time.perf_counter() < t_end:
        for n in names:
            timed[n].replay()
        _sync()
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds if names else 0):
        for n in names[r % len(names):] + names[:r % len(names)]:
            samples[n].append(timed[n].time_us())
    for n in names:
        out[n] = _stats(samples[n], timed[n])
    return {n: out[n] for n in calls if n in out}


# ------------------------------------------------------------------------------------ reports
def write_json(path, obj) -> Path:
    """Write ``obj`` as indented JSON (NaN/Inf as strings), atomically; parents created."""
    def clean(x):
        if isinstance(x, dict):
            return {str(k): clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        if isinstance(x, float) and not math.isfinite(x):
            return str(x)
        return x if isinstance(x, (str, int, float, bool)) or x is None else str(x)

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(clean(obj), indent=1) + "\n")
    tmp.replace(path)
    return path


def default_json_path(name: str) -> Path:
    """``$OUT/<name>.json`` when ``$OUT`` is set (the device runner's output folder), else
    ``./bench-out/<name>.json``."""
    return Path(os.environ.get("OUT") or "bench-out") / f"{name}.json"


def _entry(timing: dict, check: dict, desc: dict, bw: float | None) -> dict:
    e = {**timing, **check}
    us = timing.get("median_us")
    if us:
        e["GBps"] = desc["bytes"] / (us * 1e-6) / 1e9
        if bw:
            e["pct_copy_bw"] = 100 * desc["bytes"] / (us * 1e-6) / bw
        if desc.get("flops"):
            e["TFLOPs"] = desc["flops"] / (us * 1e-6) / 1e12
    return e


def _ratios(entries: dict, first: str | None) -> None:
    base = entries.get(first, {}).get("median_us") if first else None
    for e in entries.values():
        if base and e.get("median_us"):
            e["speedup_vs_first"] = base / e["median_us"]


def summarize(report: dict) -> dict:
    """Per provider: cases timed, failed checks, geomean / min / max of ``speedup_vs_first``;
    and the ``@self`` noise range (time of the first provider's second graph / its first)."""
    out: dict[str, Any] = {"first_provider": report.get("first_provider"), "providers": {}}
    selfr = []
    for c in report["cases"]:
        p = c["providers"]
        for n, e in p.items():
            if n.endswith(SELF_SUFFIX):
                base = p.get(n.removesuffix(SELF_SUFFIX), {}).get("median_us")
                if base and e.get("median_us"):
                    selfr.append(e["median_us"] / base)
                continue
            s = out["providers"].setdefault(n, {"timed": 0, "failed_check": 0, "_sp": []})
            s["timed"] += "median_us" in e
            s["failed_check"] += e.get("ok") is False
            if "speedup_vs_first" in e:
                s["_sp"].append(e["speedup_vs_first"])
    for s in out["providers"].values():
        sp = s.pop("_sp")
        s.update(geomean_speedup_vs_first=geomean(sp), min_speedup_vs_first=min(sp, default=None),
                 max_speedup_vs_first=max(sp, default=None))
    out["self_vs_self"] = [min(selfr), max(selfr)] if selfr else None
    return out


def _fmt_row(case: str, name: str, e: dict, timed: bool) -> str:
    if "skipped" in e:
        return f"{case:34s} {name:18s} skipped: {e['skipped']}"
    if "error" in e and "median_us" not in e:
        err = e["error"]  # a missing peer: its how-to once, in the "not run" line below
        return f"{case:34s} {name:18s} error: " + (err.split(" (")[0] if err.startswith(
            "PeerUnavailable") else err[:90 if timed else None])
    if not timed:
        return f"{case:34s} {name:18s} rel L2 {e['rel_l2']:.1e} {'ok' if e['ok'] else 'FAIL'}"
    us, sp = e.get("median_us"), e.get("speedup_vs_first")
    cells = ["      -" if us is None else f"{us:9.2f}",
             f"{e['p10_us']:8.2f} {e['p90_us']:8.2f}" if us is not None else " " * 17,
             f"{e['pct_copy_bw']:6.1f}" if "pct_copy_bw" in e else "     -",
             f"{sp:7.3f}" if sp else "      -",
             f"{e['rel_l2']:.1e}" if "rel_l2" in e else "", "" if e.get("ok", True) else "FAIL"]
    return f"{case:34s} {name:18s} " + " ".join(cells)


# ------------------------------------------------------------------------------------ running
def _check_one(mode: Mode, name: str, desc: dict, inputs, ref) -> tuple[Callable | None, dict]:
    """Set provider ``name`` up on a case and check its output (``mode.view`` of it); (call or
    None, entry)."""
    import torch  # noqa: PLC0415

    provider = mode.providers[name]
    why = provider.supports(desc) if provider.supports else None
    if why:
        return None, {"skipped": why}
    try:
        call = provider.setup(inputs)
        out = getattr(call, "once", call)()
        out = mode.view(out, inputs) if mode.view else out
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    except peer().PeerUnavailable as e:  # an optional peer absent: not an error of the case
        return None, {"skipped": str(e)[:200]}
    except Exception as e:  # noqa: BLE001 - a provider that cannot run this case
        return None, {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    err = errors(out.float(), ref)
    return call, {**err, "ok": within_tolerance(err)}


def run(mode: Mode, args) -> dict:
    """Run a mode as the parsed command line asks (``--smoke-cpu`` / ``--memcheck``: check only;
    otherwise check and time on the GPU). Writes the JSON (after every case too, so a run cut
    short keeps its numbers) and returns the report."""
    import torch  # noqa: PLC0415

    kind = "smoke" if args.smoke_cpu else "memcheck" if args.memcheck else "bench"
    timed = kind == "bench"
    device = "cpu" if args.smoke_cpu else "cuda"
    names = choose(args.providers, mode.providers, "--providers",
                   [n for n, p in mode.providers.items() if p.default])
    first = names[0] if names else None
    bw = copy_bandwidth_bytes_per_s() if timed else None
    path = Path(args.json) if args.json else default_json_path(mode.name if timed
                                                               else f"{mode.name}_{kind}")
    n = mode.calls or "~2 ms of"
    method = (f"per case: every provider checked against an FP32 reference, then timed "
              f"interleaved: CUDA-graph replays of {n} back-to-back calls (JAX: an unrolled chain "
              f"of {n} calls in one jax.jit), round-robin with rotating order, median of "
              f"CUDA-event timings per replay / calls; NAME@self = the first provider's second "
              f"graph (noise)")
    report = _report(mode, kind, names, torch.cuda.get_device_name() if device == "cuda" else "cpu",
                     method if timed else "check only", copy_bandwidth_Bps=bw,
                     first_provider=first)
    if bw:
        print(f"{report['gpu']}: copy bandwidth {bw / 1e12:.2f} TB/s (read + written)")
    print(f"{mode.name}: providers {', '.join(names)}" + (f"; x first = time of {first} / time"
                                                          if timed else "; check only, no timing"))
    print(f"{'case':34s} {'provider':18s} " + (f"{'us/call':>9s} {'p10':>8s} {'p90':>8s} "
                                                f"{'%copy':>6s} {'x first':>7s} relL2" if timed
                                                else "check"))
    for case in mode.cases(args, kind):
        inputs, ref = mode.prepare(case, device)
        desc = mode.describe(case, inputs)
        calls, entries = {}, {}
        for n in names:
            call, entries[n] = _check_one(mode, n, desc, inputs, ref)
            if call is not None:
                calls[n] = call
        del ref
        if timed and calls:
            if first in calls:
                calls[first + SELF_SUFFIX] = calls[first]
                entries[first + SELF_SUFFIX] = dict(entries[first])
            timing = time_interleaved(calls, calls_per_replay=mode.calls, rounds=args.rounds)
            for n, t in timing.items():
                entries[n] = _entry(t, entries[n], desc, bw)
            _ratios(entries, first)
        report["cases"].append({**desc, "providers": entries})
        for n, e in entries.items():
            print(_fmt_row(desc["name"], n, e, timed))
        write_json(path, {**report, "partial": True})
        del inputs, calls
        if device == "cuda":
            torch.cuda.empty_cache()
    report["summary"] = summarize(report)
    if timed and mode.finish is not None:
        mode.finish(report)
    report["failures"] = [f"{c['name']} {n}" for c in report["cases"]
                          for n, e in c["providers"].items() if e.get("ok") is False]
    ran = [n for n in names if any("ok" in c["providers"].get(n, {}) for c in report["cases"])]
    report["ran"] = ran
    write_json(path, report)
    why = {n: _why_not(report, n, None) for n in names if n not in ran}  # each reason once
    print(f"ran: {', '.join(ran) or 'none'}; not run: " + ("; ".join(", ".join(n for n in why if
          why[n] == w) + f" ({w})" for w in dict.fromkeys(why.values())) or "none"))
    if timed:
        for n, s in report["summary"]["providers"].items():
            if s["geomean_speedup_vs_first"] and n != first:
                print(f"{n}: geomean time of {first} / time of {n} = "
                      f"{s['geomean_speedup_vs_first']:.3f} over {s['timed']} cases")
        if report["summary"]["self_vs_self"]:
            lo, hi = report["summary"]["self_vs_self"]
            print(f"noise ({first}@self / {first}): {lo:.3f} .. {hi:.3f}")
    print(f"failed checks: {', '.join(report['failures']) or 'none'}")
    print(f"wrote {path}")
    return report


def _why_not(report: dict, name: str, width: int | None = 100) -> str:
    """The first reason ``name`` did not run, at most ``width`` characters (None: whole; a cut
    one ends in "...", so a cut-off parenthesis reads as cut, not as the whole message)."""
    for c in report["cases"]:
        e = c["providers"].get(name, {})
        if "skipped" in e or "error" in e:
            why = e.get("skipped") or e.get("error")
            return why if width is None or len(why) <= width else why[:width - 3] + "..."
    return "no case"


def _report(mode: Mode, kind: str, names: list[str], gpu: str, method: str, **extra) -> dict:
    """A report's head (``cases`` filled in as they run): what, when, where, which versions."""
    import datetime  # noqa: PLC0415

    versions = {"python": sys.version.split()[0]}
    for mod in ("torch", "triton", "jax"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - optional
            pass
    return {"mode": mode.name, "title": mode.title, "kind": kind,
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "gpu": gpu, "versions": versions, "providers": names, "method": method, **extra,
            "cases": []}


# --------------------------------------------------------------------------- old vs new tree
class _Worker:
    """A process serving one (tree, provider): ``python3 -m bench.common --serve``."""

    def __init__(self, module: str, mode: str, tree: Path):
        cmd = [sys.executable, "-m", "bench.common", "--serve", module, mode, str(tree.resolve())]
        env = {**os.environ, "PYTHONPATH": ""}
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env)

    def ask(self, **msg) -> dict:
        if self.proc.poll() is not None:
            return {"error": f"worker exited ({self.proc.returncode})"}
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        return json.loads(line) if line else {"error": "worker exited (see its stderr above)"}

    def close(self):
        if self.proc.poll() is None:
            self.ask(op="exit")
        self.proc.wait(timeout=60)


def _serve(module: str, mode_key: str, tree: str) -> int:
    """Worker loop: this checkout's bench code, ``tree``'s kernel packages. Protocol: one JSON
    object per line on stdin (setup / replay / drop / exit), one reply per line on stdout;
    everything else the process prints goes to stderr."""
    import importlib  # noqa: PLC0415

    tree = str(Path(tree).resolve())
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    mode = importlib.import_module(module).MODES[mode_key]
    for name in [m for m in sys.modules if m.split(".")[0] in PACKAGES]:
        del sys.modules[name]  # the kernels and their core come from ``tree``
    sys.path.insert(0, tree)
    import torch  # noqa: PLC0415

    device = "cuda" if torch.cuda.is_available() else "cpu"
    state: dict[str, Any] = {}
    for line in sys.stdin:
        msg = json.loads(line)
        try:
            if msg["op"] == "setup":
                desc, inputs, ref = torch.load(msg["file"], map_location=device, weights_only=False)
                call, entry = _check_one(mode, msg["provider"], desc, inputs, ref)
                if call is not None:
                    state["timed"] = _Timed(call, mode.calls)
                    entry.update(calls_per_replay=state["timed"].reps, chain=state["timed"].chain)
                entry["modules"] = {m: sys.modules[m].__file__ for m in PACKAGES
                                    if m in sys.modules}
                stray = [f for f in entry["modules"].values() if not f.startswith(tree)]
                reply = {"error": f"imported {stray} from outside {tree}"} if stray else entry
            elif msg["op"] == "replay":
                t = state["timed"]
                reply = {"us": [t.time_us() if msg.get("timed", True) else t.replay()
                                for _ in range(msg.get("n", 1))]}
            elif msg["op"] == "drop":
                state.clear()
                if device == "cuda":
                    torch.cuda.empty_cache()
                reply = {}
            else:
                proto.write("{}\n")
                proto.flush()
                return 0
        except Exception as e:  # noqa: BLE001 - reported to the parent, the worker lives on
            reply = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        proto.write(json.dumps(reply) + "\n")
        proto.flush()
    return 0


def compare(mode: Mode, module: str, mode_key: str, args) -> dict:
    """Time ``--providers`` (default: the first) of this checkout ("new") against those of the
    checkout at ``args.compare`` ("old": its ``interop``, ``qsa_triton``, ``qsa_pallas``) in one
    run: one worker process per (tree, provider), replays alternating old/new (rotating order
    per round). Prints per-case and geomean speedups (time old / time new); writes the JSON."""
    import torch  # noqa: PLC0415

    names = choose(args.providers, mode.providers, "--providers", list(mode.providers)[:1])
    trees = {"old": Path(args.compare), "new": ROOT}
    path = Path(args.json) if args.json else default_json_path(f"{mode.name}_compare")
    device = "cpu" if args.smoke_cpu else "cuda"
    workers = {(t, n): _Worker(module, mode_key, p) for n in names for t, p in trees.items()}
    report = _report(
        mode, "compare" + ("/smoke" if args.smoke_cpu else ""), names,
        "cpu (smoke: code paths only, the times are meaningless)" if args.smoke_cpu
        else torch.cuda.get_device_name(),
        "one worker process per (tree, provider); inputs and FP32 reference built once by the new "
        "tree; replays of each worker's CUDA graph (JAX: jitted chain) alternating old/new "
        "round-robin; median of CUDA-event timings",
        trees={t: str(p.resolve()) for t, p in trees.items()}, rounds=args.rounds)
    print(f"compare {mode.name} on {report['gpu']}: old = {trees['old']}, new = {trees['new']}; "
          f"providers {', '.join(names)}; speedup = time old / time new")
    with tempfile.TemporaryDirectory(prefix="qsa-bench-") as tmp:
        for i, case in enumerate(mode.cases(args, "smoke" if args.smoke_cpu else "bench")):
            inputs, ref = mode.prepare(case, device)
            desc = mode.describe(case, inputs)
            file = os.path.join(tmp, f"case{i}.pt")
            torch.save((desc, inputs, ref), file)
            del inputs, ref
            if device == "cuda":
                torch.cuda.empty_cache()
            rec = {**desc, "providers": {}}
            for n in names:
                ws = {t: workers[(t, n)] for t in trees}
                entry = {t: w.ask(op="setup", file=file, provider=n) for t, w in ws.items()}
                live = [t for t in trees if entry[t].get("ok")]
                turn = 1 if args.smoke_cpu else 3  # timed replays per turn: fewer idle gaps
                for _ in range(turn):  # untimed warm replays, alternating
                    for t in live:
                        ws[t].ask(op="replay", n=turn, timed=False)
                samples = {t: [] for t in live}
                for r in range(args.rounds):
                    for t in live[r % 2:] + live[:r % 2]:
                        samples[t] += ws[t].ask(op="replay", n=turn).get("us", [])
                for t in live:
                    if samples[t]:
                        entry[t].update(_stats(samples[t]))
                for w in ws.values():
                    w.ask(op="drop")
                t_old, t_new = (entry[t].get("median_us") for t in ("old", "new"))
                entry["speedup"] = t_old / t_new if t_old and t_new else None
                rec["providers"][n] = entry
                why = entry["old"].get("error") or entry["new"].get("error") or "check failed"
                print(f"{desc['name']:34s} {n:12s} old {t_old or float('nan'):9.2f} us  new "
                      f"{t_new or float('nan'):9.2f} us  speedup "
                      + (f"{entry['speedup']:.3f}" if entry["speedup"] else f"- ({why})"))
            report["cases"].append(rec)
            write_json(path, {**report, "partial": True})
            os.remove(file)
    for w in workers.values():
        w.close()
    report["summary"] = {}
    for n in names:
        sp = [c["providers"][n]["speedup"] for c in report["cases"]]
        ok = [x for x in sp if x]
        g = geomean(ok)
        report["summary"][n] = {"geomean_speedup_new_vs_old": g, "cases": len(ok),
                                "min": min(ok, default=None), "max": max(ok, default=None),
                                "not_compared": len(sp) - len(ok)}
        print(f"{n}: geomean speedup new vs old over {len(ok)} cases = "
              + (f"{g:.4f} (new within 3% of old or faster: {'yes' if g >= 0.97 else 'NO'})"
                 if g else "-") + (f"; {len(sp) - len(ok)} cases not compared" if len(sp) > len(ok)
                                   else ""))
    write_json(path, report)
    print(f"wrote {path}")
    return report


# ---------------------------------------------------------------------------- command line
def add_arguments(ap: argparse.ArgumentParser, modes: dict[str, Mode]) -> None:
    """The options every benchmark has (the module adds its own filters)."""
    ap.epilog = "\n".join(
        ("providers:\n" if len(modes) == 1 else f"providers of --mode {key}:\n") + "\n".join(
            f"  {n:18s} {p.doc}" + ("" if p.default else " (not in the default set)")
            for n, p in m.providers.items()) for key, m in modes.items())
    ap.formatter_class = argparse.RawDescriptionHelpFormatter
    first = next(iter(modes.values()))
    ap.set_defaults(mode=next(iter(modes)))
    if len(modes) > 1:
        ap.add_argument("--mode", choices=list(modes),
                        help=f"what to time (default {ap.get_default('mode')})")
    ap.add_argument("--providers", metavar="A,B,...",
                    help="providers to run, in this order; 'x first' ratios are against the first "
                         "(default: the mode's default set, listed below)")
    ap.add_argument("--json", metavar="FILE", help="report path (default: in $OUT when set, else "
                    f"./bench-out: {first.name}.json timed, {first.name}_smoke.json with "
                    "--smoke-cpu, _memcheck / _compare likewise; other modes by their names)")
    ap.add_argument("--plot", metavar="PNG", help="also draw the report (bench/plot.py)")
    ap.add_argument("--rounds", type=int, default=15, help="timed replays per provider "
                    "(default 15)")
    ap.add_argument("--smoke-cpu", action="store_true", help="CPU, no timing: the code paths "
                    "(Triton interpreter, Pallas interpret mode) on tiny shapes, checked")
    ap.add_argument("--memcheck", action="store_true", help="GPU, no timing: edge cases (junk "
                    "indices, NaN outside the rows), checked; run it under compute-sanitizer")
    ap.add_argument("--compare", metavar="OLD_TREE", help="time the providers (default: the "
                    "first) of this checkout against those of the checkout at OLD_TREE (its "
                    "interop/, qsa_triton/, qsa_pallas/), alternating; geomean speedups")


def main(modes: dict[str, Mode], module: str, argv=None, prog: str | None = None,
         description: str = "", add_filters: Callable | None = None) -> int:
    """Parse, validate every value before touching a GPU (exit 2 on a bad one), then run, compare
    or smoke-test the chosen mode. Exit status 1 when a provider failed its check (or, comparing,
    a case could not be compared)."""
    ap = argparse.ArgumentParser(prog=prog or f"python3 -m {module}", description=description)
    add_arguments(ap, modes)
    if add_filters:
        add_filters(ap)
    args = ap.parse_args(argv)
    mode = modes[args.mode]
    try:
        choose(args.providers, mode.providers, "--providers")
        if args.memcheck and (args.smoke_cpu or args.compare):
            raise ProviderError("--memcheck runs on the GPU alone: not with --smoke-cpu or "
                                "--compare")
        if args.rounds < 1:
            raise ProviderError(f"--rounds must be >= 1, got {args.rounds}")
        mode.cases(args, "bench")  # validates the module's filters
        if args.compare and not (Path(args.compare) / "qsa_triton").is_dir():
            raise ProviderError(f"--compare {args.compare}: no qsa_triton/ there (expected a "
                                "checkout of the old commit's interop/, qsa_triton/, qsa_pallas/)")
    except ProviderError as e:
        print(f"{ap.prog}: {e}", file=sys.stderr)
        return 2
    if args.smoke_cpu:
        os.environ["TRITON_INTERPRET"] = "1"  # before any @triton.jit is defined
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        with contextlib.suppress(ImportError):  # the interpreter's bf16 dot is wrong (fp16 here)
            import tests.triton_interp_patch  # noqa: F401, PLC0415
    else:
        import torch  # noqa: PLC0415

        if not torch.cuda.is_available():
            print(f"{ap.prog} needs a CUDA GPU (or --smoke-cpu)", file=sys.stderr)
            return 2
    if args.compare:
        report = compare(mode, module, args.mode, args)
        return 0 if all(c["providers"][n].get("speedup") for c in report["cases"]
                        for n in report["providers"]) else 1
    report = run(mode, args)
    rc = 1 if report["failures"] else 0
    if args.plot:
        from bench.plot import plot  # noqa: PLC0415

        try:
            print(f"wrote {plot(report, args.plot)}")
        except Exception as e:  # noqa: BLE001 - the JSON is written; say why there is no plot
            print(f"--plot failed ({type(e).__name__}: {e}); re-plot with python3 -m bench.plot "
                  f"REPORT.json {args.plot}", file=sys.stderr)
            rc = rc or 1
    return rc


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"] and len(sys.argv) == 5:
        sys.exit(_serve(*sys.argv[2:]))
    print("usage: python3 -m bench.decode|bench.prefill ... (bench.common is a library; "
          "--serve MODULE MODE TREE is the --compare worker)", file=sys.stderr)
    sys.exit(2)
