"""Shared GPU timing helpers for the benchmarks (decode, prefill).

Why this way (``docs/anchors.md``): the decode kernels take 4-150 µs. Plain ``do_bench`` on the
H200 was bimodal for them (the same kernel measured up to 2x apart from one case to the next), so
we time the way serving runs them: a CUDA graph holding back-to-back calls, replayed; the
providers of one comparison alternate round-robin inside one process on one set of inputs, so slow
drifts of clocks / neighbours hit every provider alike; the reported number is the median over
rounds of CUDA-event timings of whole replays divided by the calls per replay. A provider compared
with itself (``self_check=True``) must come out at ~1.00: if not, the measurement is noise.

Everything here imports torch lazily so ``bench.common`` can be imported (e.g. for
``write_json``) on a machine without CUDA.

Public:
  copy_bandwidth_bytes_per_s(device) -> float
  time_interleaved(providers, *, use_cuda_graph=True, reps=None, rounds=15, ...) -> dict
  write_json(path, obj)
  gpu_name(device=None) -> str
  parse_providers(text, allowed, aliases=None, *, script) -> list[str]   (--providers a,b,c)
  order_providers(providers, selection) -> dict      (keep the selected ones, in that order)
  speedup_vs_first(times, first) -> dict             (time of ``first`` / time of each)
  now_iso() -> str                                    (the date written into the JSON reports)
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable

__all__ = [
    "copy_bandwidth_bytes_per_s",
    "time_interleaved",
    "write_json",
    "gpu_name",
    "out_dir",
    "SELF_SUFFIX",
    "ProviderError",
    "parse_providers",
    "order_providers",
    "speedup_vs_first",
    "now_iso",
]

#: key suffix of the self-vs-self sanity entry added by ``time_interleaved(self_check=True)``
SELF_SUFFIX = "@self"


class ProviderError(ValueError):
    """An unknown name in ``--providers`` (the scripts exit 2 with its message)."""


def parse_providers(text: str | None, allowed, aliases: dict[str, str] | None = None, *,
                    script: str = "bench") -> list[str] | None:
    """The ``--providers a,b,c`` list: names in the given order, aliases resolved, duplicates
    dropped (first occurrence kept). ``None`` or empty text gives ``None`` (the script's default
    set and order). Spaces inside names are ignored (``ours[64, 4, 2]`` == ``ours[64,4,2]``).

    Args:
      allowed: the canonical names (an iterable; its order is the order the error lists them in),
        compared without spaces.
      aliases: other accepted spellings -> canonical name.
    Raises:
      ProviderError: an unknown name; the message lists every allowed name and alias.
    """
    if text is None or not text.strip():
        return None
    allowed = list(allowed)
    canon = {a.replace(" ", ""): a for a in allowed}
    alias = {k.replace(" ", ""): v for k, v in (aliases or {}).items()}
    out: list[str] = []
    unknown: list[str] = []
    for raw in _split_names(text):
        key = raw.replace(" ", "")
        name = canon.get(key) or alias.get(key)
        if name is None:
            unknown.append(raw)
        elif name not in out:
            out.append(name)
    if unknown:
        names = ", ".join(allowed)
        al = ", ".join(f"{k} (= {v})" for k, v in (aliases or {}).items())
        raise ProviderError(f"{script}: unknown provider(s) {', '.join(map(repr, unknown))} in "
                            f"--providers; allowed: {names}" + (f"; aliases: {al}" if al else ""))
    return out


def _split_names(text: str) -> list[str]:
    """Split on commas outside brackets (``ours[64,4,2],ours`` -> two names)."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth = max(0, depth - 1)
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    parts.append(cur.strip())
    return [p for p in parts if p]


def order_providers(providers: dict, selection) -> dict:
    """``providers`` restricted to ``selection`` and in its order (``None``: unchanged)."""
    if selection is None:
        return dict(providers)
    return {n: providers[n] for n in selection if n in providers}


def speedup_vs_first(times: dict[str, float | None], first: str | None) -> dict[str, float]:
    """``{name: times[first] / times[name]}`` for every name with a positive time (> 1: faster
    than the first provider; the first itself gets 1.0). Empty when ``first`` has no time."""
    base = times.get(first) if first is not None else None
    if not base or base <= 0:
        return {}
    return {n: base / t for n, t in times.items() if t and t > 0}


def now_iso() -> str:
    """Local date and time, ISO 8601 to the second, with the UTC offset."""
    import datetime  # noqa: PLC0415

    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def _torch():
    import torch  # noqa: PLC0415

    return torch


def gpu_name(device=None) -> str:
    """Marketing name of the CUDA device (``"NVIDIA H200"``), or ``"cpu"`` without CUDA."""
    torch = _torch()
    if not torch.cuda.is_available():
        return "cpu"
    return torch.cuda.get_device_name(device)


def out_dir(default: str = "out") -> Path:
    """Results folder: ``$OUT`` when set (the device runner's output folder), else ``./out``.
    Created if missing."""
    p = Path(os.environ.get("OUT") or default)
    p.mkdir(parents=True, exist_ok=True)
    return p


def _jsonable(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _jsonable(dataclasses.asdict(obj))
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)  # JSON has no NaN/Inf
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    if hasattr(obj, "item") and callable(obj.item):  # numpy / torch scalars
        try:
            return _jsonable(obj.item())
        except Exception:  # noqa: BLE001
            pass
    return str(obj)


def write_json(path, obj) -> Path:
    """Write ``obj`` as indented JSON (dataclasses, tuples, numpy/torch scalars converted; NaN/Inf
    as strings). Parent folders are created. Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(_jsonable(obj), indent=2, sort_keys=False) + "\n")
    tmp.replace(path)
    return path


def copy_bandwidth_bytes_per_s(device=None, nbytes: int = 1 << 30, reps: int = 20) -> float:
    """Measured device-to-device copy bandwidth of ``device``, in bytes (read + written) per second.

    Copies a ``nbytes`` buffer (default 1 GiB, far beyond the 60 MB L2 of an H200) ``reps`` times,
    each timed with CUDA events; returns ``2 * nbytes / median_time``. Source of the method:
    ``docs/anchors.md`` (4.25 TB/s on the H200 measured this way). Halves ``nbytes`` on OOM.

    Raises:
      RuntimeError: CUDA is not available.
    """
    torch = _torch()
    if not torch.cuda.is_available():
        raise RuntimeError("copy_bandwidth_bytes_per_s needs a CUDA device")
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    while True:
        try:
            src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
            dst = torch.empty_like(src)
            break
        except torch.cuda.OutOfMemoryError:
            nbytes //= 2
            if nbytes < (1 << 24):
                raise
    src.fill_(1.0)
    with torch.cuda.device(device):
        for _ in range(3):
            dst.copy_(src)
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e-3)
    moved = 2 * src.numel() * src.element_size()
    del src, dst
    return moved / statistics.median(times)


class _Timed:
    """One provider prepared for timing: a replayable CUDA graph (or an eager loop) of ``reps``
    back-to-back calls."""

    def __init__(self, fn: Callable[[], Any], reps: int, use_cuda_graph: bool, stream):
        torch = _torch()
        self.fn, self.reps, self.graph = fn, reps, None
        # work items per call: a provider may run several decodes per call (``fn.inner_reps``)
        self.per_call = max(1, int(getattr(fn, "inner_reps", 1) or 1))
        self.graphed = use_cuda_graph and getattr(fn, "cuda_graph_capturable", True)
        if self.graphed:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=stream):
                for _ in range(reps):
                    fn()
            self.graph = g

    def run(self):
        if self.graph is not None:
            self.graph.replay()
        else:
            for _ in range(self.reps):
                self.fn()


def _estimate_us(fn, torch) -> float:
    """Eager per-call time estimate (µs), after two warm-up calls (also compiles kernels)."""
    fn()
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(5):
        fn()
    b.record()
    b.synchronize()
    return max(a.elapsed_time(b) * 1e3 / 5, 0.5)


def time_interleaved(
    providers: dict[str, Callable[[], Any]],
    *,
    use_cuda_graph: bool = True,
    reps: int | None = None,
    rounds: int = 15,
    target_replay_us: float = 2000.0,
    max_reps: int = 200,
    self_check: bool = False,
    warmup_ms: float = 50.0,
) -> dict[str, dict[str, float]]:
    """Time several providers of the same computation, interleaved, under CUDA graphs.

    Each provider (a zero-argument callable that launches the work on the current stream, e.g. a
    closure over pre-built inputs) is warmed up eagerly (compiling its kernels), then captured into
    one CUDA graph of ``reps`` back-to-back calls. A provider with the attribute
    ``cuda_graph_capturable = False`` (e.g. a JAX call, which launches on JAX's own streams) is
    timed as an eager loop instead (CUDA events on torch's current stream, which the provider
    must make wait for its work), and one with ``inner_reps = n`` counts as n calls per call;
    the result records both (``cuda_graph``, ``inner_reps``). Then ``rounds`` rounds replay every provider's
    graph once, in round-robin order that rotates each round (so no provider is always first after
    an idle gap); each replay is timed with CUDA events. Per-call time = replay time / reps.

    Args:
      providers: name -> callable. Each is called many times; it must not sync the host (graph
        capture forbids it) and must have its inputs ready.
      use_cuda_graph: False times eager loops of ``reps`` calls instead (includes launch overhead).
      reps: calls per replay; default: chosen per provider so one replay lasts about
        ``target_replay_us`` (clamped to [1, ``max_reps``]).
      rounds: timed replays per provider (the median is over these).
      self_check: also time the first provider a second time under the name
        ``name + SELF_SUFFIX`` (its own graph), as a noise check: its median should be within a few
        percent of the first provider's.
      warmup_ms: untimed round-robin replays of every provider before the timed rounds, at
        least this much wall time (lets the GPU clocks settle after compile/capture pauses).

    Returns:
      ``{name: {"median_us", "p10_us", "p90_us", "min_us", "reps", "rounds", "cuda_graph",
      "inner_reps"}}``, times in µs per call (per inner rep); a provider that raised while
      warming up or being captured gets ``{"error": "..."}`` instead (the others still run).

    Raises:
      RuntimeError: CUDA is not available.
    """
    torch = _torch()
    if not torch.cuda.is_available():
        raise RuntimeError("time_interleaved needs a CUDA device")
    items = list(providers.items())
    if self_check and items:
        items.append((items[0][0] + SELF_SUFFIX, items[0][1]))
    stream = torch.cuda.Stream()
    timed: dict[str, _Timed] = {}
    errors: dict[str, str] = {}
    for name, fn in items:
        try:
            n = reps
            if n is None:
                n = int(min(max_reps, max(1, round(target_replay_us / _estimate_us(fn, torch)))))
                if not getattr(fn, "cuda_graph_capturable", True):
                    n = max(1, min(n, 20))  # eager host loop: keep it short
            else:
                fn()
                fn()
            torch.cuda.synchronize()
            timed[name] = _Timed(fn, n, use_cuda_graph, stream)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - one provider failing (e.g. not capturable)
            errors[name] = f"{type(e).__name__}: {str(e)[:300]}"  # must not stop the others
            torch.cuda.synchronize()
    names = [n for n, _ in items if n in timed]
    samples: dict[str, list[float]] = {n: [] for n in names}
    # untimed warm replays, round-robin, for at least warmup_ms of wall time: the GPU clocks
    # ramp back up after the host-side compile/capture pauses (H200: the first case of a run
    # measured up to 15% slow with a single warm replay, p90 30% above the median)
    t_end = time.perf_counter() + warmup_ms / 1e3
    while True:
        for n in names:
            timed[n].run()
        torch.cuda.synchronize()
        if time.perf_counter() >= t_end:
            break
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            timed[n].run()
            b.record()
            b.synchronize()
            samples[n].append(a.elapsed_time(b) * 1e3 / (timed[n].reps * timed[n].per_call))
    out = {}
    for n in names:
        s = sorted(samples[n])
        q = statistics.quantiles(s, n=10) if len(s) >= 2 else [s[0]] * 9
        out[n] = {"median_us": statistics.median(s), "p10_us": q[0], "p90_us": q[-1],
                  "min_us": s[0], "reps": timed[n].reps, "rounds": rounds,
                  "cuda_graph": timed[n].graphed, "inner_reps": timed[n].per_call}
    for n, err in errors.items():
        out[n] = {"error": err}
    del timed
    return out
