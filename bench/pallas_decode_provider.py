"""Pallas decode as a benchmark provider (torch buffers in, torch tensor out), JAX context peers,
and a Pallas-only timing run.

Imported by ``bench/decode.py`` (the Triton-vs-Pallas comparison, same process, same GPU buffers):

  make_provider(q, k, v, cu_q, cu_k, max_seqlen_k, scale, *, inner_reps=1) -> callable
      (use inner_reps=FAIR_INNER_REPS (64) for timing; see "Timing JAX work" below)
  make_context_providers(q, k, v, cu_q, cu_k, max_seqlen_k, scale, *, inner_reps=1) -> dict

Inputs are torch CUDA tensors; they are shared with jax zero-copy through ``interop.dlpack.to_jax``
(call these while the stream that produced the tensors is current). Each returned callable takes no
argument, runs one jitted jax function and returns a torch tensor (``interop.dlpack.to_torch``,
which makes torch's current stream wait for jax's work, so CUDA events recorded on torch's stream
around the call bracket the jax work).

Timing JAX work: the fair method (docs/anchors.md: "time many calls inside one jitted function").
  The Triton side is timed by replaying a CUDA graph of back-to-back calls, i.e. with no host
  dispatch in the measurement. JAX launches on its own streams, so a torch CUDA graph cannot
  capture a jax call; instead one jitted function runs N decodes back to back and the time per
  decode is (time of the whole call) / N, with N >= ``FAIR_INNER_REPS`` = 64 so that the one host
  dispatch of the jitted call (tens of µs) is amortised to < 1 µs per decode. Nothing is
  subtracted. Details:
  * the N decodes are an unrolled chain inside the one jit (no ``while`` loop: XLA's GPU while
    loop may copy its predicate to the host every iteration); each decode's q is the previous
    decode's output (same shape and dtype, cu_seqlens_q = identity rows in the benchmark), a true
    data dependency that costs no extra kernel, so XLA can neither CSE nor hoist the calls;
    the single decode is itself a jitted function, so the chain is traced and lowered once and
    called N times;
  * ``fn.kernel_launches()`` counts the Triton custom calls in the *compiled* (post-optimisation)
    HLO on a GPU (-1 on the CPU, where interpret mode has none): it must be 2 N (split + merge kernel
    per decode), i.e. XLA removed no decode; ``make_provider`` checks it on a GPU (a warning on
    stderr if not, and the count is part of ``timing_method``);
  * ``fn.inner_reps`` = N: ``bench/common.time_interleaved(..., use_cuda_graph=False)`` divides
    by it (CUDA events on torch's stream around a short loop of calls; ``to_torch`` makes torch's
    stream wait for jax's work); ``fn.self_time()`` is the pure-JAX equivalent (host wall clock
    around ``block_until_ready``, median of rounds, divided by N);
  * ``fn.timing_method`` is a one-line description of the above, for the benchmark's printout.
  ``inner_reps = 1`` returns exactly ``sparse_decode``'s output (use it for the correctness check).

Context peers (not our contract; timing context only, on K/V gathered per row once at set-up,
outside the timed region; rows padded to the longest row and masked by length):
  * ``jax_pallas_gqa``: ``jax.experimental.pallas.ops.gpu.decode_attention.gqa`` (deprecated,
    dense split-K GQA decode, Pallas Triton lowering);
  * ``jax_dpa_xla`` / ``jax_dpa_cudnn``: ``jax.nn.dot_product_attention`` with
    ``key_value_seq_lengths`` (cudnn dropped when it refuses the shape).

Pallas-only run (what ``bench/gpu_pallas_decode.sh`` calls; no torch needed, uses it for the copy
bandwidth when present): ``python -m bench.pallas_decode_provider --json $OUT/pallas_decode.json``
times TP1/TP2/TP4 x B in {1, 4, 16, 32, 64, 128} x {saturated, mixed} rows: Pallas (every case
checked first against an FP32 reference computed on the device) and the JAX context peers
(saturated rows, B in {1, 16, 128}), per-decode µs and % of the measured copy bandwidth (bytes =
K + V rows read). Timing: host wall clock around many calls of one jitted chain of ``inner_reps``
decodes, synchronised once at the end (async dispatch overlaps the host with the GPU), median over
15 rounds, N = ``FAIR_INNER_REPS`` decodes per jitted call (the fair method above). The CUDA-graph
numbers of the Triton side come from bench/decode.py.
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import sys
import time
from typing import Any, Callable

__all__ = ["make_provider", "make_context_providers", "gather_rows", "run_pallas_only", "main",
           "FAIR_INNER_REPS", "TIMING_METHOD", "count_kernel_launches"]

TP = {"TP1": (24, 2), "TP2": (12, 1), "TP4": (6, 1)}
BATCHES = (1, 4, 16, 32, 64, 128)
D = 256
MSK = 2051
# Decodes per jitted call when timing: one host dispatch (~20-50 µs) amortised to < 1 µs/decode.
FAIR_INNER_REPS = 64
TIMING_METHOD = ("pallas: one jitted call = unrolled chain of N decodes (q_i+1 = out_i), "
                 "time/call / N, N={n}; compiled HLO keeps {launches} Triton launches; "
                 "triton: CUDA-graph replay")


def _jax():
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    return jax, jnp


def _wrap(fn: Callable[[], Any], inner_reps: int, name: str, to_torch: bool = True,
          jitted: Callable | None = None, args: tuple = ()) -> Callable[[], Any]:
    """Attach the attributes the benchmark reads (``inner_reps``, ``cuda_graph_capturable``,
    ``provider``, ``timing_method``, ``kernel_launches()``, ``self_time()``); convert the result
    to torch."""
    if to_torch:
        from interop.dlpack import to_torch as _tt  # noqa: PLC0415

        def call():
            return _tt(fn())
    else:
        call = fn
    call.inner_reps = int(inner_reps)
    call.cuda_graph_capturable = False
    call.provider = name
    if jitted is not None:
        call.kernel_launches = functools.partial(count_kernel_launches, jitted, args)
        call.self_time = lambda rounds=15: {
            k_: v_ / inner_reps * 1e6 for k_, v_ in _time_jax(jitted, args, rounds=rounds).items()}
    call.timing_method = TIMING_METHOD.format(n=int(inner_reps), launches="2N")
    return call


def _chain(step: Callable, inner_reps: int) -> Callable:
    """x -> step(step(...step(x))) unrolled ``inner_reps`` times (each decode reads the previous
    output as its q, so the calls are serial and cannot be merged or hoisted). ``step`` is jitted
    once, so the chain traces and lowers it once and calls it ``inner_reps`` times."""
    jax, _ = _jax()
    one = jax.jit(step)

    def run(x, *rest):
        for _ in range(inner_reps):
            x = one(x, *rest)
        return x

    return run


# how a Triton kernel launch reads in compiled HLO text (XLA's spelling varies by version)
_TRITON_CALL_MARKERS = ('custom_call_target="__gpu$xla.gpu.triton"', "__gpu$xla.gpu.triton",
                        "triton_kernel_call")


def count_kernel_launches(jitted: Callable, args: tuple = ()) -> int:
    """Triton kernel launches in ``jitted(*args)`` (or in ``jitted`` when it is already a
    ``jax.stages.Compiled``): custom calls to the Triton kernel runner in the compiled
    (post-optimisation, after CSE/DCE) HLO on a GPU; on the CPU (interpret mode, where no Triton
    custom call exists) -1."""
    jax, _ = _jax()
    if jax.default_backend() != "gpu":
        return -1
    compiled = jitted if hasattr(jitted, "as_text") and not hasattr(jitted, "lower") else \
        jitted.lower(*args).compile()
    text = compiled.as_text() or ""
    for marker in _TRITON_CALL_MARKERS:  # the first one present (XLA's name varies by version)
        if marker in text:
            return text.count(marker)
    return 0


def make_provider(q, k, v, cu_q, cu_k, max_seqlen_k: int, scale: float | None = None, *,
                  inner_reps: int = 1, interpret: bool | None = None, plan=None,
                  check_launches: bool = True, direct: bool | None = None,
                  min_timing_reps: int = FAIR_INNER_REPS):
    """Zero-arg callable running ``qsa_pallas.sparse_decode`` on torch CUDA buffers.

    Args:
      q: torch [B, Hq, D] bf16|fp16; k, v: torch [C, Hkv, D]; cu_q, cu_k: torch int32 [B + 1];
        all on one CUDA device (CPU tensors work too: interpret mode).
      max_seqlen_k: host int; scale: softmax scale (None -> D ** -0.5).
      inner_reps: decodes per call, N (module docstring, "Timing JAX work"); use
        ``FAIR_INNER_REPS`` (64) for timing, 1 for correctness. plan: optional DecodePlan override.
      direct: ``qsa_pallas.sparse_decode``'s ``direct`` (one-split plans in one launch).
      min_timing_reps: inner_reps > 1 means "for timing": the chain is lengthened to at least
        this many decodes (the fair method; ``fn.inner_reps`` reports the N actually used, and
        the benchmark divides by it), so a caller asking for a short chain (bench/decode.py
        passed 8) still gets the amortised dispatch. 0 or 1 keeps inner_reps as given.
      check_launches: on a GPU with inner_reps > 1, compile the chain once more and check its HLO
        keeps 2 N Triton launches (a mismatch is printed to stderr and recorded in
        ``timing_method``).

    Returns:
      callable() -> torch [B, Hq, D] (q's dtype) with attributes ``inner_reps``,
      ``cuda_graph_capturable = False``, ``provider = "pallas"``, ``timing_method`` (str),
      ``kernel_launches()`` (int, 2 N expected; -1 on the CPU), ``self_time(rounds=15)``
      (pure-JAX per-decode µs: ``median_s``/``min_s`` keys, values in µs).

    Raises:
      ContractError: the shared contract check (run once here, before anything is compiled).
      DLPackLayoutError: a buffer DLPack cannot share.
    """
    jax, _ = _jax()
    import qsa_pallas  # noqa: PLC0415
    from interop.dlpack import to_jax  # noqa: PLC0415

    jq, jk, jv, jcq, jck = (to_jax(t) for t in (q, k, v, cu_q, cu_k))
    qsa_pallas.sparse_decode(jq, jk, jv, jcq, jck, max_seqlen_k, scale, interpret=interpret,
                             plan=plan, direct=direct)  # contract check + compile now
    step = functools.partial(_pallas_step, max_seqlen_k=max_seqlen_k, scale=scale,
                             interpret=interpret, plan=plan, direct=direct)
    args = (jq, jk, jv, jcq, jck)
    if inner_reps > 1:
        inner_reps = max(int(inner_reps), int(min_timing_reps))
    if inner_reps == 1:  # the warm-up call above compiled it: no second executable
        f = jax.jit(step)  # traced, not called: only kernel_launches() / self_time() compile it
        return _wrap(lambda: step(*args), 1, "pallas", jitted=f, args=args)
    # compiled once, ahead of time: the same executable is timed and has its HLO inspected
    f = jax.jit(_chain(step, inner_reps)).lower(*args).compile()
    call = _wrap(lambda: f(*args), inner_reps, "pallas", jitted=f, args=args)
    if check_launches and inner_reps > 1 and jax.default_backend() == "gpu":
        n = call.kernel_launches()
        if n != 2 * inner_reps:  # reported, not fatal: the count's spelling differs across XLAs
            print(f"[pallas provider] WARNING: timing chain of {inner_reps} decodes compiled to "
                  f"{n} Triton launches, expected {2 * inner_reps}", file=sys.stderr)
        call.timing_method = TIMING_METHOD.format(n=int(inner_reps), launches=n)
    return call


def _pallas_step(q, k, v, cq, ck, *, max_seqlen_k, scale, interpret, plan, direct=None):
    import qsa_pallas  # noqa: PLC0415

    return qsa_pallas.sparse_decode(q, k, v, cq, ck, max_seqlen_k, scale, interpret=interpret,
                                    plan=plan, direct=direct)


# ---------------------------------------------------------------------------------------------
# Context peers on gathered K/V
def gather_rows(k, v, cu_k_host, width: int):
    """Per-row K/V materialised densely: [B, width, Hkv, D] (rows padded with zeros), lengths [B].

    jax arrays in (packed [C, Hkv, D]), jax arrays out. ``cu_k_host``: numpy int [B + 1]."""
    jax, jnp = _jax()
    import numpy as np  # noqa: PLC0415

    ck = np.asarray(cu_k_host, np.int64)
    lens = np.diff(ck)
    pos = np.arange(width)[None, :]
    src = np.minimum(ck[:-1, None] + pos, max(k.shape[0] - 1, 0))
    valid = pos < lens[:, None]
    src_j = jnp.asarray(src.astype(np.int32))
    keep = jnp.asarray(valid)[..., None, None]
    kg = jnp.where(keep, k[src_j], 0).astype(k.dtype)
    vg = jnp.where(keep, v[src_j], 0).astype(v.dtype)
    return kg, vg, jnp.asarray(lens.astype(np.int32))


def _gqa_split(width: int, block_k: int, max_splits: int = 16) -> tuple[int, int]:
    """(padded width, k_splits) for jax's Pallas gqa: width % (k_splits * block_k) == 0."""
    width = block_k * math.ceil(width / block_k)
    nb = width // block_k
    splits = max(s for s in range(1, max_splits + 1) if nb % s == 0)
    return width, splits


def _gqa_step(width: int, sc: float):
    """(step(x, kg, vg, lens), padded width) for JAX's deprecated Pallas ``gqa`` decode (a
    context peer); raises ImportError / whatever the import raises when it is absent."""
    jax, _ = _jax()
    import warnings  # noqa: PLC0415

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from jax.experimental.pallas.ops.gpu import decode_attention as da  # noqa: PLC0415
    w, splits = _gqa_split(width, 64)
    interp = jax.default_backend() == "cpu"

    def step(x, kg, vg, lens):
        return da.gqa(x, kg, vg, kv_seq_len=lens, sm_scale=sc, block_k=64, k_splits=splits,
                      interpret=interp).astype(x.dtype)

    return step, w


def _dpa_step(impl: str, sc: float):
    """step(x, kg, vg, lens) for ``jax.nn.dot_product_attention`` with ``impl`` (xla | cudnn)."""
    jax, _ = _jax()

    def step(x, kg, vg, lens):
        o = jax.nn.dot_product_attention(x[:, None], kg, vg, scale=sc,
                                         key_value_seq_lengths=lens, implementation=impl)
        return o[:, 0].astype(x.dtype)

    return step


def make_context_providers(q, k, v, cu_q, cu_k, max_seqlen_k: int, scale: float | None = None, *,
                           inner_reps: int = 1, include=("jax_pallas_gqa", "jax_dpa_xla",
                                                         "jax_dpa_cudnn")) -> dict[str, Callable]:
    """JAX's own decode options on the same (torch CUDA) buffers, K/V gathered per row at set-up.

    Reads cu_seqlens_k on the host (set-up only). Rows are padded to the longest row (rounded up
    for gqa's split constraints); lengths mask the padding. q row s is ``q[cu_q[s]]``.

    Returns:
      {name: callable() -> torch [B, Hq, D]} (same attributes as ``make_provider``); a peer that
      fails to compile for the shape is left out (its error is printed to stderr).
    """
    jax, jnp = _jax()
    import numpy as np  # noqa: PLC0415
    from interop.dlpack import to_jax  # noqa: PLC0415

    jq, jk, jv = (to_jax(t) for t in (q, k, v))
    cq = np.asarray(cu_q.detach().cpu().numpy(), np.int64)
    ck = np.asarray(cu_k.detach().cpu().numpy(), np.int64)
    d = jq.shape[-1]
    sc = float(scale) if scale is not None else d ** -0.5
    qrows = jq[jnp.asarray(cq[:-1].astype(np.int32))]
    width = max(16, int(np.diff(ck).max(initial=1)))
    out: dict[str, Callable] = {}

    if "jax_pallas_gqa" in include:
        try:
            gqa_step, w = _gqa_step(width, sc)
            kg, vg, lens = gather_rows(jk, jv, ck, w)
            f = jax.jit(_chain(gqa_step, inner_reps))
            f(qrows, kg, vg, lens).block_until_ready()
            out["jax_pallas_gqa"] = _wrap(functools.partial(f, qrows, kg, vg, lens), inner_reps,
                                          "jax_pallas_gqa")
        except Exception as e:  # noqa: BLE001 - a context peer may not support the shape
            print(f"[context] jax_pallas_gqa unavailable: {type(e).__name__}: {e}", file=sys.stderr)

    kg, vg, lens = gather_rows(jk, jv, ck, width)
    for impl in ("xla", "cudnn"):
        name = f"jax_dpa_{impl}"
        if name not in include:
            continue
        try:
            dpa_step = _dpa_step(impl, sc)

            f = jax.jit(_chain(dpa_step, inner_reps))
            f(qrows, kg, vg, lens).block_until_ready()
            out[name] = _wrap(functools.partial(f, qrows, kg, vg, lens), inner_reps, name)
        except Exception as e:  # noqa: BLE001
            print(f"[context] {name} unavailable: {type(e).__name__}: {str(e)[:300]}",
                  file=sys.stderr)
    return out


# ---------------------------------------------------------------------------------------------
# Pallas-only timing (pure JAX; torch only for the copy bandwidth when available)
def _time_jax(f, args, *, rounds: int = 15, target_s: float = 2e-3) -> dict[str, float]:
    """Median wall time of ``f(*args)`` (one jitted call) after warm-up, host-synchronised."""
    jax, _ = _jax()
    jax.block_until_ready(f(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    one = time.perf_counter() - t0
    calls = max(1, min(50, int(target_s / max(one, 1e-6))))
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            r = f(*args)
        jax.block_until_ready(r)
        samples.append((time.perf_counter() - t0) / calls)
    return {"median_s": statistics.median(samples), "min_s": min(samples)}


def _copy_bandwidth() -> tuple[float, str]:
    try:
        import torch  # noqa: PLC0415

        if torch.cuda.is_available():
            from bench.common import copy_bandwidth_bytes_per_s  # noqa: PLC0415

            return copy_bandwidth_bytes_per_s(), "torch copy_ (bench.common)"
    except ImportError:
        pass
    jax, jnp = _jax()
    n = 1 << 28  # 256 Mi bf16 = 512 MiB each way
    x = jnp.ones((n,), jnp.bfloat16)
    f = jax.jit(lambda x: x + jnp.bfloat16(1))
    t = _time_jax(f, (x,), rounds=10)["median_s"]
    return 2 * n * 2 / t, "jax x+1 over 512 MiB"


def run_pallas_only(*, batches=BATCHES, tps=tuple(TP), inner_reps: int = FAIR_INNER_REPS,
                    context: bool = True, seed: int = 0, head_dim: int = D,
                    max_seqlen_k: int = MSK, context_batches=(1, 16, 128)) -> dict:
    """Time Pallas on the benchmark matrix (and the JAX context peers on saturated rows at
    ``context_batches``); check each Pallas output first against an FP32 reference computed on
    the device (rtol = atol = 2e-2, rel L2 <= 5e-3; the float64 ``interop.reference`` checks of
    the same shapes are in tests/test_pallas_decode.py's GPU suite)."""
    jax, jnp = _jax()
    import numpy as np  # noqa: PLC0415

    import qsa_pallas  # noqa: PLC0415
    from qsa_pallas.decode import decode_plan_for  # noqa: PLC0415

    bw, bw_src = _copy_bandwidth()
    dev = jax.devices()[0]
    res: dict[str, Any] = {"device": dev.device_kind, "jax": jax.__version__,
                           "copy_bandwidth_Bps": bw, "copy_bandwidth_source": bw_src,
                           "inner_reps": inner_reps, "method": "jitted unrolled chain of "
                           f"{inner_reps} decodes (q_i+1 = out_i), host wall clock around "
                           f"block_until_ready / {inner_reps}, median of 15, nothing subtracted",
                           "cases": []}
    rng = np.random.default_rng(seed)
    d, msk = head_dim, max_seqlen_k
    for tp in tps:
        hq, hkv = TP[tp]
        for b in batches:
            for rows in ("saturated", "mixed"):
                lens = np.full(b, msk) if rows == "saturated" else rng.integers(17, msk + 1, b)
                ck = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
                cap = int(ck[-1])
                kq = jax.random.split(jax.random.PRNGKey(int(rng.integers(1 << 30))), 3)
                q = jax.random.normal(kq[0], (b, hq, d), jnp.bfloat16)
                k = jax.random.normal(kq[1], (cap, hkv, d), jnp.bfloat16)
                v = jax.random.normal(kq[2], (cap, hkv, d), jnp.bfloat16)
                cq = jnp.arange(b + 1, dtype=jnp.int32)
                ckj = jnp.asarray(ck)
                case = {"tp": tp, "B": b, "rows": rows, "Hq": hq, "Hkv": hkv, "D": d,
                        "keys": int(cap), "bytes": int(cap * hkv * d * 2 * 2),
                        "plan": str(decode_plan_for(b, hq, hkv, d, msk))}
                out = qsa_pallas.sparse_decode(q, k, v, cq, ckj, msk)
                ref = _f32_reference(q, k, v, ck, d ** -0.5)
                o = np.asarray(out.astype(jnp.float32))
                case["rel_l2"] = float(np.linalg.norm(o - ref) / max(np.linalg.norm(ref), 1e-30))
                case["max_abs"] = float(np.abs(o - ref).max())
                case["ok"] = bool(np.isfinite(o).all() and case["rel_l2"] <= 5e-3
                                  and np.allclose(o, ref, rtol=2e-2, atol=2e-2))
                step = functools.partial(_pallas_step, max_seqlen_k=msk, scale=None,
                                         interpret=None, plan=None)
                f = jax.jit(_chain(step, inner_reps)).lower(q, k, v, cq, ckj).compile()
                t = _time_jax(f, (q, k, v, cq, ckj))
                case["kernel_launches"] = count_kernel_launches(f)
                plan_ = decode_plan_for(b, hq, hkv, d, msk)
                if plan_.max_splits == 1:  # the one-launch variant (qsa_pallas direct=True)
                    o_d = qsa_pallas.sparse_decode(q, k, v, cq, ckj, msk, direct=True)
                    o_d = np.asarray(o_d.astype(jnp.float32))
                    case["direct_rel_l2"] = float(np.linalg.norm(o_d - ref)
                                                  / max(np.linalg.norm(ref), 1e-30))
                    case["ok"] = case["ok"] and case["direct_rel_l2"] <= 5e-3
                    step_d = functools.partial(_pallas_step, max_seqlen_k=msk, scale=None,
                                               interpret=None, plan=None, direct=True)
                    f_d = jax.jit(_chain(step_d, inner_reps)).lower(q, k, v, cq, ckj).compile()
                    us_d = _time_jax(f_d, (q, k, v, cq, ckj))["median_s"] / inner_reps * 1e6
                    case["pallas_direct_us"] = us_d
                    case["pallas_direct_pct_copy_bw"] = 100 * case["bytes"] / (us_d * 1e-6) / bw
                us = t["median_s"] / inner_reps * 1e6
                case["pallas_us"] = us
                case["pallas_pct_copy_bw"] = 100 * case["bytes"] / (us * 1e-6) / bw
                if context and rows == "saturated" and b in context_batches:
                    case.update(_time_context(q, k, v, ck, inner_reps, bw, case["bytes"]))
                res["cases"].append(case)
                print(f"{tp} B={b:3d} {rows:9s} pallas {us:8.1f} us "
                      f"{case['pallas_pct_copy_bw']:5.1f}% copy-bw  relL2 {case['rel_l2']:.1e}"
                      + (f"  direct {case['pallas_direct_us']:.1f} us"
                         if "pallas_direct_us" in case else "")
                      + "".join(f"  {n} {case[n]:.1f}us" for n in case if n.endswith("_ctx_us")),
                      flush=True)
                del q, k, v
    return res


def _f32_reference(q, k, v, ck_host, scale):
    """FP32 packed decode reference on the device (rows gathered densely and masked), as numpy:
    the same semantics as ``interop.reference.decode_reference`` (q rows in order, zeros for
    empty rows), fast enough for B = 128 x 2051 rows in the timing run."""
    jax, jnp = _jax()
    import numpy as np  # noqa: PLC0415

    lens = np.diff(np.asarray(ck_host, np.int64))
    width = max(1, int(lens.max()))
    kg, vg, ln = gather_rows(k, v, ck_host, width)  # [B, W, Hkv, D]
    b, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.astype(jnp.float32).reshape(b, hkv, hq // hkv, d)
    s = jnp.einsum("bhgd,bwhd->bhgw", qg, kg.astype(jnp.float32)) * scale
    valid = (jnp.arange(width)[None, :] < ln[:, None])[:, None, None, :]
    s = jnp.where(valid, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(valid, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    den = p.sum(-1, keepdims=True)
    o = jnp.einsum("bhgw,bwhd->bhgd", p / jnp.where(den > 0, den, 1.0), vg.astype(jnp.float32))
    return np.asarray(o.reshape(b, hq, d))


def _time_context(q, k, v, ck, inner_reps, bw, nbytes) -> dict:
    jax, jnp = _jax()
    import numpy as np  # noqa: PLC0415

    b, hq, d = q.shape
    sc = d ** -0.5
    width = int(np.diff(ck).max())
    out = {}
    try:
        gqa_step, w = _gqa_step(width, sc)
        kg, vg, lens = gather_rows(k, v, ck, w)
        t = _time_jax(jax.jit(_chain(gqa_step, inner_reps)), (q, kg, vg, lens))
        out["jax_pallas_gqa_ctx_us"] = t["median_s"] / inner_reps * 1e6
        del kg, vg
    except Exception as e:  # noqa: BLE001
        out["jax_pallas_gqa_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    kg, vg, lens = gather_rows(k, v, ck, width)
    for impl in ("xla", "cudnn"):
        try:
            t = _time_jax(jax.jit(_chain(_dpa_step(impl, sc), inner_reps)), (q, kg, vg, lens))
            out[f"jax_dpa_{impl}_ctx_us"] = t["median_s"] / inner_reps * 1e6
        except Exception as e:  # noqa: BLE001
            out[f"jax_dpa_{impl}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    for key in [k_ for k_ in out if k_.endswith("_ctx_us")]:
        out[key.replace("_ctx_us", "_ctx_pct_copy_bw")] = 100 * nbytes / (out[key] * 1e-6) / bw
    return out


# ---------------------------------------------------------------------------------------------
# Compiled-kernel comparison (no GPU needed): Pallas kernels vs qsa_triton.decode's, for sm_90
def _cubin_stats(cubin: bytes) -> dict:
    """Registers / stack (``cuobjdump -res-usage``) and SASS counts of one cubin, with the
    cuobjdump that ships with Triton."""
    import os  # noqa: PLC0415
    import re  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import tempfile  # noqa: PLC0415

    import triton  # noqa: PLC0415

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as fh:
            fh.write(cubin)
        res = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True).stdout
        sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True).stdout
    ins = "\n".join(ln for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/\s+\S", ln))
    return {"regs": int(re.search(r"REG:(\d+)", res).group(1)),
            "stack": int((re.search(r"STACK:(\d+)", res) or [0, 0])[1]),
            "sass": ins.count("\n") + 1 if ins else 0,
            "ldg": len(re.findall(r"\bLDG\.", ins)), "ldg128": ins.count("LDG.E.128"),
            "ldgsts": ins.count("LDGSTS"), "mma": len(re.findall(r"\b(?:HMMA|HGMMA)\b", ins)),
            "wide64": len(re.findall(r"IMAD\.WIDE|IADD3\.X|\.X ", ins))}


def compile_table(arch: str = "sm_90", cases=(("TP1", 1), ("TP1", 128), ("TP4", 1),
                                                ("TP4", 128))) -> list[dict]:
    """Compile the Pallas decode kernels (lowered for the H200 with abstract devices, TTIR ->
    cubin with the installed Triton) and ``qsa_triton.decode.compile_configs(arch)``'s split /
    merge kernels (no PDL, merge="kernel"), and report shared memory, registers, stack and SASS
    counts (total, LDG, 128-bit LDG, LDGSTS (cp.async), HMMA/HGMMA, 64-bit integer ops) per
    kernel. Needs TRITON_INTERPRET unset (run as ``python -m bench.pallas_decode_provider
    --compile-table``)."""
    import functools as ft  # noqa: PLC0415
    import os  # noqa: PLC0415
    import tempfile  # noqa: PLC0415

    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    import triton  # noqa: PLC0415
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415
    from triton.compiler import ASTSource  # noqa: PLC0415

    jax, jnp = _jax()
    import qsa_pallas.decode as pd  # noqa: PLC0415
    import qsa_triton.decode as td  # noqa: PLC0415
    from interop.arch import KNOWN_ARCHS, device_kind  # noqa: PLC0415
    from qsa_pallas import _compat as C  # noqa: PLC0415

    cap = int("".join(map(str, KNOWN_ARCHS[arch].cc)))
    kind = device_kind(arch)
    target = GPUTarget("cuda", cap, 32)
    rows = []
    for cfg in td.compile_configs(arch):
        cons = cfg["constexprs"]
        if cons.get("USE_PDL") or cons.get("MERGE_INLINE"):
            continue
        src = ASTSource(fn=cfg["kernel"], signature=cfg["signature"], constexprs=cons,
                        attrs=cfg.get("attrs"))
        opts = {k: cfg[k] for k in ("num_warps", "num_stages") if cfg.get(k) is not None}
        c = triton.compile(src, target=target, options=opts)
        tag = ",".join(f"{k}={v}" for k, v in cons.items()
                       if k in ("G", "HT", "BLOCK_N", "SPLIT_CHUNK", "D_CHUNK"))
        rows.append({"kernel": f"triton {cfg['kernel'].__name__.strip('_')} {tag}",
                     "warps_stages": f"{opts.get('num_warps')}/{opts.get('num_stages')}",
                     "smem": int(c.metadata.shared), **_cubin_stats(c.asm["cubin"])})
    sds = jax.ShapeDtypeStruct
    for tp, b in cases:
        hq, hkv = TP[tp]
        with jax.sharding.use_abstract_mesh(C.abstract_mesh(kind)):
            plan = pd.decode_plan_for(b, hq, hkv, D, MSK)
        n = b * MSK
        args = (sds((b, hq, D), jnp.bfloat16), sds((n, hkv, D), jnp.bfloat16),
                sds((n, hkv, D), jnp.bfloat16), sds((b + 1,), jnp.int32), sds((b + 1,), jnp.int32))
        mods = C.triton_modules(C.lower_for_device_kind(
            ft.partial(pd._lowerable, max_seqlen_k=MSK, plan=plan), args, kind))
        if plan.max_splits == 1:
            mods += C.triton_modules(C.lower_for_device_kind(
                lambda *a, plan=plan: pd.sparse_decode(*a, MSK, interpret=False, plan=plan,
                                                       direct=True), args, kind))
        for m in mods:
            with tempfile.TemporaryDirectory() as d:
                path = os.path.join(d, f"{m.name}.ttir")
                with open(path, "w") as fh:
                    fh.write(m.text())
                c = triton.compile(path, target=target,
                                   options=dict(num_warps=m.num_warps, num_stages=m.num_stages))
            rows.append({"kernel": f"pallas {m.name} {tp} B={b} S={plan.max_splits}",
                         "warps_stages": f"{m.num_warps}/{m.num_stages}",
                         "smem": int(c.metadata.shared), **_cubin_stats(c.asm["cubin"])})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None, help="output JSON (default $OUT/pallas_decode.json)")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--tp", default=",".join(TP))
    ap.add_argument("--inner-reps", type=int, default=FAIR_INNER_REPS)
    ap.add_argument("--no-context", action="store_true")
    ap.add_argument("--head-dim", type=int, default=D)
    ap.add_argument("--max-seqlen-k", type=int, default=MSK)
    ap.add_argument("--compile-table", action="store_true",
                    help="print the compiled Pallas vs Triton kernel table for sm_90 and exit")
    args = ap.parse_args(argv)
    if args.compile_table:
        cols = ("warps_stages", "smem", "regs", "stack", "sass", "ldg", "ldg128", "ldgsts", "mma",
                "wide64")
        print(f"| kernel | {' | '.join(cols)} |\n|---|{'---|' * len(cols)}")
        for r in compile_table():
            print(f"| {r['kernel']} | {' | '.join(str(r[c]) for c in cols)} |")
        return 0
    from bench.common import out_dir, write_json  # noqa: PLC0415

    res = run_pallas_only(batches=[int(x) for x in args.batches.split(",")],
                          tps=tuple(args.tp.split(",")), inner_reps=args.inner_reps,
                          context=not args.no_context, head_dim=args.head_dim,
                          max_seqlen_k=args.max_seqlen_k)
    path = args.json or str(out_dir() / "pallas_decode.json")
    write_json(path, res)
    sat = [c["pallas_pct_copy_bw"] for c in res["cases"] if c["B"] >= 64 and c["rows"] == "saturated"]
    print(f"wrote {path}; B>=64 saturated: {min(sat, default=float('nan')):.1f}..."
          f"{max(sat, default=float('nan')):.1f}% of copy bandwidth; all correct: "
          f"{all(c['ok'] for c in res['cases'])}")
    return 0 if all(c["ok"] for c in res["cases"]) else 1


if __name__ == "__main__":
    sys.exit(main())
