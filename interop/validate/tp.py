"""Tensor parallel: the end-to-end QSA step split over TP ranks, every rank's output checked
against the single-device TP1 call on the same inputs (``qsa check --tp N``).

A rank holds query heads ``r*Hq/TP ..`` and their KV heads of the pool (``rank_heads``; at
TP > Hkv a KV head is replicated), as upstream's TP attention layers; request tables, lengths and
the indexer inputs are replicated. Nothing is exchanged inside the step; checked is the glue:

* JAX (``run_jax``): ``qsa_pallas.shard_step`` over a TP-device mesh (CPU host devices or GPUs),
  the pool replicated by ``qsa_pallas.replicate_kv_heads``; each device's shard against TP1.
* PyTorch (``run_torch``): TP spawned processes, gloo on CPU or NCCL on GPUs (``NO_MULTICAST``);
  each rank calls ``qsa_triton`` on its heads, rank 0 compares the gathered outputs with TP1.
  The last rank hands its tensors to jax (``interop.dlpack``), runs ``qsa_pallas`` and hands the
  output back: it must sit on the rank's device and agree with the Triton rank output.

Verdicts (``judge``): batch-invariant decode bitwise equal to TP1 (``qsa-contract.md`` §2c: the
split schedule depends on W, G and D only, and the head tile is 16 for G = 12 and 6 alike);
others within ``interop.cases.compare``'s tolerance. Timing (GPU, ``time=True``): each rank's
step (``CALLS`` calls in a CUDA graph, or one ``jax.jit`` chain) alone vs every rank at once,
interleaved over ``ROUNDS``, medians; PASS within ``TIME_LIMIT`` of the single-GPU time.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import statistics
import tempfile
import time as _time
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from interop import cases as C

__all__ = ["NO_MULTICAST", "TIME_LIMIT", "Unavailable", "TPCase", "RankResult", "rank_heads",
           "tp_cases", "judge", "run_jax", "run_torch", "check"]

#: set in every spawned rank's environment: NVLink multicast off (the device machines' rule)
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}
TIME_LIMIT = 1.10  # per-rank time / single-GPU time (issue 19)
CALLS, ROUNDS = 20, 15


class Unavailable(RuntimeError):
    """The run needs devices this machine does not have; the message says which."""


def _need_gpus(tp: int, who: str = "") -> None:
    """Raise Unavailable unless torch sees ``tp`` CUDA GPUs (one rank per GPU)."""
    import torch  # noqa: PLC0415

    if torch.cuda.device_count() < tp:
        raise Unavailable(f"{who}TP{tp} runs one rank per GPU: it needs {tp} CUDA GPUs, this "
                          f"machine has {torch.cuda.device_count()}")


class TPCase(NamedTuple):
    """A TP1 step case (``interop.cases.StepSpec``, 24/2 heads) and the decode mode."""

    spec: C.StepSpec
    batch_invariant: bool = False

    @property
    def name(self) -> str:
        return self.spec.name + ("/batch-invariant" if self.batch_invariant else "")

    def mode(self) -> dict:
        return {"batch_invariant": True} if self.batch_invariant else {}


def tp_cases(device: str) -> list[TPCase]:
    """The cases of ``qsa check --tp``: CPU: D = 64, fp16, topk 16, a batch-invariant decode and
    a prefill with a cached prefix; GPU: production shapes (D = 256, bf16, topk 512, ~32k
    contexts), decode at B 16 / 64 in both modes and FP8 at B 32, prefill 1024 + 77 rows."""
    if device == "cpu":
        dec = C.StepSpec("tp/decode", "decode", 24, 2, 64, (0, 5, 70, 301, 1000), topk=16,
                         dtype="float16", seed=41)
        pre = C.StepSpec("tp/prefill", "prefill", 24, 2, 64, (200, 3, 90), q_lens=(6, 3, 4),
                         topk=16, dtype="float16", seed=42)
        return [TPCase(dec, True), TPCase(pre)]

    def dec(b, fp8=False):
        ctx = 32768 - np.random.default_rng(b).integers(0, 300, size=b)
        extra = dict(kv_dtype="float8_e4m3fn", index_k_dtype="float8_e4m3fn") if fp8 else {}
        return C.StepSpec(f"tp/decode/B{b}" + ("/fp8" if fp8 else ""), "decode", 24, 2, 256,
                          tuple(int(c) for c in ctx), pool_pages=2048, seed=b, **extra)

    pre = C.StepSpec("tp/prefill/1024+77", "prefill", 24, 2, 256, (32768, 5000),
                     q_lens=(1024, 77), pool_pages=2048, seed=5)
    return [TPCase(dec(16), True), TPCase(dec(64), True), TPCase(dec(16)), TPCase(dec(64)),
            TPCase(dec(32, fp8=True), True), TPCase(pre)]


def rank_heads(hq: int, hkv: int, tp: int, rank: int) -> tuple[slice, slice]:
    """(query heads, KV heads) of ``rank`` as slices of the TP1 head axes: query heads
    ``rank*hq/tp ..``; KV heads ``rank*hkv/tp ..``, or at tp > hkv the one its query heads use.
    Raises ValueError when tp does not divide hq, or neither of tp and hkv divides the other."""
    if tp < 1 or hq % tp or (tp % hkv and hkv % tp) or not 0 <= rank < tp:
        raise ValueError(f"rank_heads: no even TP{tp} split of {hq}/{hkv} heads (rank {rank})")
    q = slice(rank * hq // tp, (rank + 1) * hq // tp)
    kv = rank // (tp // hkv) if tp > hkv else rank * hkv // tp
    return q, slice(kv, kv + max(1, hkv // tp))


def _span(s: slice) -> str:
    return f"{s.start}" if s.stop - s.start == 1 else f"{s.start}-{s.stop - 1}"


def _host(x) -> tuple[np.ndarray, np.ndarray]:
    """(raw 16-bit patterns, float64) of a bf16 / fp16 torch tensor or jax array."""
    if type(x).__module__.startswith("torch"):
        import torch  # noqa: PLC0415

        x = x.detach().cpu().contiguous()
        return x.view(torch.int16).numpy(), x.float().numpy().astype(np.float64)
    a = np.asarray(x)
    return a.view(np.int16), a.astype(np.float64)


@dataclasses.dataclass
class RankResult:
    """One rank's output against the TP1 call's heads of that rank."""

    framework: str
    case: str
    tp: int
    rank: int
    q_heads: str
    kv_heads: str
    bitwise: bool
    bitwise_required: bool
    max_abs: float
    passed: bool
    why: str = ""

    def line(self) -> str:
        how = ("bitwise equal" if self.bitwise else f"max |diff| {self.max_abs:.3g}, "
               + ("NOT bitwise (required)" if self.bitwise_required else "within tolerance"
                  if self.passed else "outside tolerance"))
        return (f"{'PASS' if self.passed else 'FAIL'} {self.framework:5s} TP{self.tp} rank "
                f"{self.rank} {self.case} (q heads {self.q_heads}, KV {self.kv_heads}): {how}"
                + (f"; {self.why}" if self.why else ""))


def judge(framework: str, case: TPCase, tp: int, rank: int, out, tp1_heads, empty: np.ndarray,
          why: str = "") -> RankResult:
    """``out`` (rank ``rank``'s output) against ``tp1_heads`` (the TP1 output's heads of that
    rank): bitwise in batch-invariant decode, else ``interop.cases.compare`` (exact zeros where
    ``empty``); ``why`` forces a FAIL."""
    qs, kvs = rank_heads(case.spec.hq, case.spec.hkv, tp, rank)
    (ob, of), (rb, rf) = _host(out), _host(tp1_heads)
    same = ob.shape == rb.shape
    bitwise = same and bool(np.array_equal(ob, rb))
    v = C.compare(of, rf, empty) if same else {"passed": False, "max_abs": float("inf")}
    need = case.batch_invariant and case.spec.kind == "decode"
    if not same:
        why = why or f"shape {list(ob.shape)} != {list(rb.shape)}"
    return RankResult(framework, case.name, tp, rank, _span(qs), _span(kvs), bitwise, need,
                      float(v["max_abs"]), not why and (bitwise if need else v["passed"]), why)


# ---------------------------------------------------------------------------------------------
# JAX: shard_map over a TP-device mesh
def _jax_inputs(case: TPCase, device: str):
    """(case data, args, kwargs) of one case as jax arrays (``crosscheck.build_inputs``)."""
    import torch  # noqa: PLC0415

    from interop.dlpack import to_jax  # noqa: PLC0415

    from .crosscheck import build_inputs  # noqa: PLC0415

    inp = build_inputs(case.spec, device)
    if device != "cpu":
        torch.cuda.synchronize()
    data = inp.host["case"]
    named = {n: to_jax(x) if isinstance(x, torch.Tensor) else x for n, x in inp.named().items()}
    args, kw = data.arguments(named)
    return data, args, {**kw, **case.mode()}


def run_jax(tps: Sequence[int], cases: Sequence[TPCase], *, device: str = "cpu",
            time: bool = False) -> tuple[list[RankResult], list[dict]]:
    """Each case at TP1 and at every TP in ``tps`` (``qsa_pallas.shard_step`` over the first TP
    jax devices): every device's shard judged against TP1's heads of that rank. ``time`` (GPU,
    default-mode decode): the sharded call against rank 0's shard alone (``_time_jax``).

    Returns (rank results, timings). Raises Unavailable: fewer jax devices than max(tps)."""
    import jax  # noqa: PLC0415
    from jax.sharding import Mesh  # noqa: PLC0415

    import qsa_pallas  # noqa: PLC0415

    devices = jax.devices()
    if len(devices) < max(tps):
        raise Unavailable(f"JAX TP{max(tps)} needs {max(tps)} devices, jax sees {len(devices)} "
                          f"({devices[0].platform}); on a CPU set XLA_FLAGS="
                          f"--xla_force_host_platform_device_count={max(tps)} before jax starts")
    results, timings = [], []
    for case in cases:
        data, args, kw = _jax_inputs(case, device)
        step = getattr(qsa_pallas, data.entry)
        tp1 = step(*args, **kw)
        for tp in tps:
            mesh = Mesh(np.array(devices[:tp]), ("tp",))
            a = list(args)
            a[1], a[2] = (qsa_pallas.replicate_kv_heads(x, tp) for x in args[1:3])
            out = qsa_pallas.shard_step(step, mesh)(*a, **kw)
            shards = {s.device: s for s in out.addressable_shards}
            for r, dev in enumerate(devices[:tp]):
                qs, _ = rank_heads(case.spec.hq, case.spec.hkv, tp, r)
                s = shards.get(dev)
                got = None if s is None else s.index[1]
                why = "" if got == qs else f"device {dev} holds heads {got}, not {qs}"
                results.append(judge("jax", case, tp, r, s.data if s else out[:, qs],
                                     tp1[:, qs], data.empty[:, qs], why))
            if time and case.spec.kind == "decode" and not case.batch_invariant:
                timings.append(_time_jax(case, step, a, kw, mesh, tp))
    return results, timings


def _time_jax(case: TPCase, step: Callable, args: list, kw: dict, mesh, tp: int, *,
              calls: int = CALLS, rounds: int = ROUNDS) -> dict:
    """Per-call µs of ``calls`` chained calls in one ``jax.jit``: the sharded step against rank
    0's shard alone on its device, interleaved over ``rounds``, medians of the wall clock."""
    import jax  # noqa: PLC0415
    from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: PLC0415

    import qsa_pallas  # noqa: PLC0415

    dev0 = mesh.devices.flat[0]
    qs, _ = rank_heads(case.spec.hq, case.spec.hkv, tp, 0)
    one = [jax.device_put(x[:, qs] if i == 0 else x[:, :args[1].shape[1] // tp] if i in (1, 2)
                          else x, dev0) for i, x in enumerate(args)]
    placed = [jax.device_put(x, NamedSharding(mesh, P(None, "tp", None) if i < 3 else P()))
              for i, x in enumerate(args)]
    sharded = qsa_pallas.shard_step(step, mesh)

    def chain(f):
        def run(q, *rest):
            for _ in range(calls):
                q = f(q, *rest, **kw)
            return q
        return jax.jit(run)

    fns = {"single": (chain(step), one), "rank": (chain(sharded), placed)}

    def wall_us(name):
        f, a = fns[name]
        t0 = _time.perf_counter()
        f(*a).block_until_ready()
        return (_time.perf_counter() - t0) * 1e6 / calls

    for name in fns:  # compile + warm
        for _ in range(3):
            wall_us(name)
    samples: dict[str, list[float]] = {n: [] for n in fns}
    for r in range(rounds):
        for name in (list(fns) if r % 2 else list(fns)[::-1]):
            samples[name].append(wall_us(name))
    return _timing("jax", case, tp, "all", *(statistics.median(samples[n]) for n in fns))


# ---------------------------------------------------------------------------------------------
# PyTorch: torch.distributed, one process per rank
def run_torch(tp: int, cases: Sequence[TPCase], *, device: str = "cpu",
              time: bool = False) -> tuple[list[RankResult], dict | None, list[dict]]:
    """The cases over ``tp`` spawned ranks (``_rank_main``), gloo on CPU, NCCL on CUDA. Returns
    (rank results judged on rank 0, the DLPack hand-off's record, timings).

    Raises:
      Unavailable: fewer CUDA GPUs than ``tp`` (device "cuda").
      torch.multiprocessing.ProcessRaisedException: a rank raised (its traceback inside).
    """
    import torch.multiprocessing as mp  # noqa: PLC0415

    if device != "cpu":
        _need_gpus(tp, "torch ")
    os.environ.update(NO_MULTICAST)  # the spawned ranks inherit the environment
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # jax beside torch (DLPack)
    with tempfile.TemporaryDirectory(prefix="qsa-tp-") as tmp:
        mp.spawn(_rank_main, args=(tp, device, list(cases), tmp, bool(time)), nprocs=tp,
                 join=True)
        doc = json.loads((Path(tmp) / "ranks.json").read_text())
    return [RankResult(**r) for r in doc["ranks"]], doc["dlpack"], doc["timing"]


def _rank_main(rank: int, tp: int, device: str, cases: list[TPCase], tmp: str,
               time: bool) -> None:
    """One rank: its heads of rank 0's inputs through ``qsa_triton``, outputs gathered as bytes
    and judged on rank 0 (which writes ``tmp/ranks.json``); the last rank's DLPack hand-off."""
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    import qsa_triton  # noqa: PLC0415

    from .crosscheck import build_inputs  # noqa: PLC0415

    if device == "cpu":
        dev, backend = "cpu", "gloo"
    else:
        torch.cuda.set_device(rank)
        dev, backend = f"cuda:{rank}", "nccl"
    dist.init_process_group(backend, init_method=f"file://{tmp}/rendezvous", rank=rank,
                            world_size=tp, timeout=datetime.timedelta(minutes=5))
    try:
        results, timing, dl = [], [], None
        for case in cases:
            inp = build_inputs(case.spec, dev)
            data, named = inp.host["case"], inp.named()
            for t in named.values():  # every rank takes rank 0's TP1 inputs, then its slice
                if isinstance(t, torch.Tensor):
                    dist.broadcast(t.view(torch.uint8), src=0)
            qs, kvs = rank_heads(case.spec.hq, case.spec.hkv, tp, rank)
            mine = {**named, "q": named["q"][:, qs].contiguous(),
                    **{n: named[n][:, kvs].contiguous() for n in ("k_cache", "v_cache")}}
            args, kw = data.arguments(mine)
            kw.update(case.mode())
            step = getattr(qsa_triton, data.entry)
            out = step(*args, **kw)
            parts = [torch.empty_like(out).view(torch.uint8) for _ in range(tp)]
            dist.all_gather(parts, out.contiguous().view(torch.uint8))
            if rank == 0:
                a1, k1 = data.arguments(named)
                tp1 = step(*a1, **{**k1, **case.mode()})
                for r, part in enumerate(parts):
                    q_r, _ = rank_heads(case.spec.hq, case.spec.hkv, tp, r)
                    results.append(dataclasses.asdict(judge(
                        "torch", case, tp, r, part.view(out.dtype), tp1[:, q_r],
                        data.empty[:, q_r])))
            if rank == tp - 1 and dl is None and case.spec.kind == "decode":
                dl = _dlpack_handoff(case, data.entry, args, kw, out, data.empty[:, qs], rank)
            if time and device != "cpu" and case.spec.kind == "decode" and not case.batch_invariant:
                timing.append(_time_torch(case, lambda: step(*args, **kw), rank, tp))
        every = [None] * tp
        dist.all_gather_object(every, {"dlpack": dl, "timing": timing})
        if rank == 0:
            doc = {"ranks": results, "dlpack": next((e["dlpack"] for e in every if e["dlpack"]),
                                                    None),
                   "timing": [t for e in every for t in e["timing"]]}
            (Path(tmp) / "ranks.json").write_text(json.dumps(doc))
        # every rank reaches teardown together: a rank that exits while rank 0 still writes can
        # abort rank 0's gloo threads (std::terminate, seen once in CI)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _dlpack_handoff(case: TPCase, entry: str, args: list, kw: dict, out, empty: np.ndarray,
                    rank: int) -> dict:
    """This rank's tensors to jax (on the tensor's device, sharing memory), ``qsa_pallas`` on
    them, the output back to torch: on the rank's device and close to the Triton output."""
    import jax  # noqa: PLC0415
    import torch  # noqa: PLC0415

    import qsa_pallas  # noqa: PLC0415
    from interop.dlpack import to_jax, to_torch  # noqa: PLC0415

    dev = out.device
    want = (jax.devices("cpu")[0] if dev.type == "cpu" else
            next(d for d in jax.devices() if d.id == dev.index))
    jargs = [to_jax(a) if isinstance(a, torch.Tensor) else a for a in args]
    pairs = [(t, j) for t, j in zip(args, jargs) if isinstance(t, torch.Tensor)]
    placed = all(j.devices() == {want} for _, j in pairs)
    # fp8 travels as a uint8 view, and XLA's CPU client copies a buffer not aligned to 64
    # bytes (small numpy-backed tables; CUDA allocations always are): those are not compared
    shared = all(j.unsafe_buffer_pointer() == t.data_ptr() for t, j in pairs
                 if "float8" not in str(t.dtype) and t.data_ptr() % 64 == 0)
    back = to_torch(getattr(qsa_pallas, entry)(*jargs, **kw))
    v = C.compare(_host(back)[1], _host(out)[1], empty)
    ok = placed and shared and back.device == dev and bool(v["passed"])
    return {"case": case.name, "rank": rank, "torch_device": str(dev), "jax_device": str(want),
            "placed": placed, "zero_copy": shared, "back_on_device": back.device == dev,
            "pallas_vs_triton_max_abs": float(v["max_abs"]), "passed": ok}


def _time_torch(case: TPCase, call: Callable, rank: int, tp: int) -> dict:
    """µs per call of this rank's step (a CUDA graph of ``CALLS`` calls) alone (the others at a
    barrier) and with every rank replaying at once; interleaved over ``ROUNDS``, medians."""
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    # thread-local: the NCCL watchdog thread's event queries must not abort this capture
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for _ in range(CALLS):
            call()
    torch.cuda.synchronize()

    def replay_us() -> float:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) * 1e3 / CALLS

    for _ in range(3):
        replay_us()
    alone, together = [], []
    for _ in range(ROUNDS):
        for solo in range(tp):
            dist.barrier(device_ids=[rank])
            if solo == rank:
                alone.append(replay_us())
        dist.barrier(device_ids=[rank])
        together.append(replay_us())
    return _timing("torch", case, tp, rank, statistics.median(alone), statistics.median(together))


def _timing(framework: str, case: TPCase, tp: int, rank, single: float, mine: float) -> dict:
    """A timing record: µs per call alone and with every rank running."""
    return {"framework": framework, "case": case.name, "tp": tp, "rank": rank,
            "single_us": single, "rank_us": mine, "ratio": mine / single,
            "passed": mine / single <= TIME_LIMIT}


# ---------------------------------------------------------------------------------------------
def check(tp: int, *, interpret: bool, frameworks: Sequence[str] = ("pallas", "triton"),
          time: bool = False, log: Callable[[str], Any] = print) -> dict:
    """``qsa check --tp``: ``tp_cases`` through ``run_jax`` ("pallas") and ``run_torch``
    ("triton"), one line per rank, hand-off and timing through ``log``. Returns a JSON-able
    report with ``passed``; one framework's exception is a failure, the other still runs.

    Raises:
      Unavailable: on GPUs fewer than ``tp`` CUDA devices; ``time`` without GPUs.
    """
    device = "cpu" if interpret else "cuda"
    if interpret and time:
        raise Unavailable("--time measures GPU time per rank; it needs CUDA GPUs (this run "
                          "uses the CPU interpreters)")
    if interpret:  # XLA host devices for the mesh (effective only before jax initialises)
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = (f"{flags} --xla_force_host_platform_device_count="
                                       f"{max(tp, 4)}").strip()
    else:
        _need_gpus(tp)
    cases = tp_cases(device)
    log(f"TP{tp} vs TP1 on {'CPU host devices / gloo, interpreters' if interpret else 'GPUs / NCCL'}"
        f": {len(cases)} case(s), {', '.join(frameworks)}")
    ranks, timing, errors, dl = [], [], [], None
    for fw, lib in (("pallas", "jax"), ("triton", "torch")):
        if fw not in frameworks:
            continue
        try:
            if fw == "pallas":
                r, t = run_jax((tp,), cases, device=device, time=time)
            else:
                r, dl, t = run_torch(tp, cases, device=device, time=time)
            ranks, timing = ranks + r, timing + t
        except Unavailable:
            raise
        except Exception as e:  # noqa: BLE001 - reported (a rank's traceback in the message)
            errors.append(f"{lib}: {type(e).__name__}: {e}")
    for r in ranks:
        log(r.line())
    if dl is not None:
        log(f"{'PASS' if dl['passed'] else 'FAIL'} dlpack TP{tp} rank {dl['rank']} {dl['case']}: "
            f"torch {dl['torch_device']} -> jax {dl['jax_device']} (placed {dl['placed']}, "
            f"zero-copy {dl['zero_copy']}) -> qsa_pallas -> torch (on the rank's device "
            f"{dl['back_on_device']}), vs the Triton rank output max |diff| "
            f"{dl['pallas_vs_triton_max_abs']:.3g}")
    elif "triton" in frameworks and not errors:
        errors.append("dlpack: no hand-off ran")
    for t in timing:
        log(f"{'PASS' if t['passed'] else 'FAIL'} time  {t['framework']} TP{tp} rank {t['rank']} "
            f"{t['case']}: {t['rank_us']:.1f} us per call with every rank running vs "
            f"{t['single_us']:.1f} us alone on one GPU ({t['ratio']:.3f}x, limit {TIME_LIMIT})")
    for e in errors:
        log(f"FAIL {e}")
    passed = (not errors and bool(ranks) and all(r.passed for r in ranks)
              and (dl is None or dl["passed"]) and all(t["passed"] for t in timing))
    return {"tp": tp, "device": device, "frameworks": list(frameworks),
            "cases": [c.name for c in cases], "ranks": [dataclasses.asdict(r) for r in ranks],
            "dlpack": dl, "timing": timing, "errors": errors, "passed": passed}
