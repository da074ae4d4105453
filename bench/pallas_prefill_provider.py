"""Pallas sparse prefill as a benchmark provider (torch buffers in, torch tensor out), and the
Pallas-vs-Triton timing run of issue 6.

Imported by ``bench/prefill.py`` (the Triton helper's benchmark, same process, same GPU buffers):

  make_provider(kind, torch_inputs, geometry=None, *, inner_reps=1, interpret=None) -> callable
  make_provider(case)  # a bench.prefill_cases.Case: kind and inputs from the case

``torch_inputs`` is a dict (or any object with those attributes, e.g. ``bench.prefill_cases.Case``)
of torch tensors named like ``Case`` or like the entry points' arguments:
``q``; ``k``/``k_cache``; ``v``/``v_cache``; ``indices``; ``cu_q``/``cu_seqlens``/``cu_seqlens_q``;
``cu_k``/``cu_seqlens_k`` (chunk); ``kv_lens`` (chunk, paged); ``slot_table`` (paged); host values
``max_q``/``max_seqlen_q``, ``softmax_scale``, ``k_scale``, ``v_scale``. The tensors are shared with
jax zero-copy through ``interop.dlpack.to_jax`` (call ``make_provider`` while the stream that
produced them is current; FP8 may travel as a uint8 view and be bit-cast once, at set-up).

The returned callable takes no argument, runs one jitted jax function and returns a torch tensor
(``interop.dlpack.to_torch``, which makes torch's current stream wait for jax's work, so CUDA
events recorded on torch's stream around the call bracket the jax work). It has
``cuda_graph_capturable = False`` (jax launches on its own streams) and ``inner_reps``: one call
runs ``inner_reps`` prefills back to back inside the jitted function, each reading the previous
output as its q (a data dependency: XLA can neither merge nor hoist them), so per-prefill time =
measured time / inner_reps and host dispatch is amortised (anchors.md: time JAX inside one jit).
``inner_reps = 1`` returns exactly the entry point's output (use it for correctness checks).

Timing run (``bench/gpu_pallas_prefill.sh`` calls it): ``python -m bench.pallas_prefill_provider
--json $OUT/pallas_prefill.json`` builds the issue's cases (8192 query rows, one request,
W = 2051, bf16, D = 256; ordinary at KV 8k and chunk at KV 8k/32k/128k; G = 6 and 12) with
``bench.prefill_cases.make_case``, checks Pallas and ``qsa_triton`` against the float32 torch
reference, and times both interleaved with ``bench.common.time_interleaved`` (Triton under CUDA
graphs, Pallas as an eager jitted chain). Ratio = Triton time / Pallas time (>= 0.8 is the
issue's target, as a geomean over the cases).
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
import time
from typing import Any, Callable

__all__ = ["make_provider", "CASES", "SWEEP", "run_comparison", "run_sweep", "main"]

#: The issue's timed cases: (kind, KV length, Hq, Hkv); 8192 query rows in one request.
CASES = [("ordinary", 8192, 6, 1), ("ordinary", 8192, 12, 1)] + [
    ("chunk", kv, hq, 1) for kv in (8192, 32768, 131072) for hq in (6, 12)]
T_ROWS = 8192
D = 256


def _get(inputs, *names, default=None):
    for n in names:
        if isinstance(inputs, dict):
            if n in inputs and inputs[n] is not None:
                return inputs[n]
        elif getattr(inputs, n, None) is not None:
            return getattr(inputs, n)
    return default


def _wrap(fn: Callable[[], Any], inner_reps: int, name: str) -> Callable[[], Any]:
    from interop.dlpack import to_torch  # noqa: PLC0415

    def call():
        return to_torch(fn())

    call.inner_reps = int(inner_reps)
    call.cuda_graph_capturable = False
    call.provider = name
    return call


def make_provider(kind, torch_inputs=None, geometry=None, *, inner_reps: int = 1,
                  interpret: bool | None = None) -> Callable[[], Any]:
    """Zero-arg callable running the Pallas sparse prefill of ``kind`` on torch buffers.

    Args:
      kind: "ordinary" | "chunk" | "paged"; or a ``bench.prefill_cases.Case`` (then
        ``torch_inputs`` is omitted and the kind is the case's: ``make_provider(case)``).
      torch_inputs: dict or object of torch tensors (CUDA; CPU works too, in interpret mode) and
        host values, named as in the module docstring.
      geometry: None (the shared selector via ``qsa_pallas.prefill.select_geometry``), a
        ``qsa_pallas.prefill.PallasPrefillGeometry``, or an ``interop.geometry.Geometry`` /
        tuple ``(block_m, block_n, num_warps, num_stages)`` (sweeps).
      inner_reps: prefills per call (chained through q; see module docstring).
      interpret: None -> interpret mode on CPU tensors.

    Returns:
      callable() -> torch [T, Hq, D] in q's dtype, with attributes ``inner_reps``,
      ``cuda_graph_capturable = False`` and ``provider = "pallas"``.

    Raises:
      ContractError: the shared contract check (run here once, before anything is timed).
      DLPackLayoutError: a buffer DLPack cannot share.
      ValueError: unknown kind or a missing input.
    """
    import jax  # noqa: PLC0415

    from interop.dlpack import to_jax  # noqa: PLC0415
    from qsa_pallas import prefill as P  # noqa: PLC0415

    if not isinstance(kind, str) and torch_inputs is None:  # make_provider(case)
        kind, torch_inputs = kind.kind, kind
    if kind not in ("ordinary", "chunk", "paged"):
        raise ValueError(f"make_provider: kind must be ordinary|chunk|paged, got {kind!r}")
    geo = _as_geometry(geometry, P)
    need = {"q": ("q",), "k": ("k", "k_cache"), "v": ("v", "v_cache"), "indices": ("indices",),
            "cu_q": ("cu_q", "cu_seqlens", "cu_seqlens_q")}
    if kind == "chunk":
        need.update(cu_k=("cu_k", "cu_seqlens_k"), kv_lens=("kv_lens",))
    if kind == "paged":
        need.update(kv_lens=("kv_lens",), slot_table=("slot_table",))
    arrays = {}
    for key, names in need.items():
        t = _get(torch_inputs, *names)
        if t is None:
            raise ValueError(f"make_provider({kind!r}): missing input {' / '.join(names)}")
        arrays[key] = to_jax(t)
    max_q = _get(torch_inputs, "max_q", "max_seqlen_q")
    if max_q is None:
        import numpy as np  # noqa: PLC0415

        cu = np.asarray(arrays["cu_q"])
        max_q = int(np.diff(cu).max())
    max_q = int(max_q)
    scale = _get(torch_inputs, "softmax_scale")
    ks = float(_get(torch_inputs, "k_scale", default=1.0))
    vs = float(_get(torch_inputs, "v_scale", default=1.0))

    step = functools.partial(_step, kind=kind, max_q=max_q, scale=scale, ks=ks, vs=vs,
                             interpret=interpret, geometry=geo)
    names = list(arrays)
    rest = [arrays[n] for n in names[1:]]
    jax.eval_shape(step, arrays["q"], *rest)  # the contract check now (traces, no compile)

    def chain(x, *rest):
        for _ in range(inner_reps):
            x = step(x, *rest)
        return x

    f = jax.jit(chain)
    jq = arrays["q"]
    return _wrap(lambda: f(jq, *rest), inner_reps, "pallas")


def _as_geometry(geometry, P):
    if geometry is None or isinstance(geometry, P.PallasPrefillGeometry):
        return geometry
    key = getattr(geometry, "key", None) or tuple(geometry)
    bm, bn, nw, ns = (int(x) for x in key)
    return P.PallasPrefillGeometry(max(16, bm), max(16, bn), nw, ns,
                                   getattr(geometry, "source", "explicit") or "explicit")


def _step(q, k, v, idx, cu_q, *rest, kind, max_q, scale, ks, vs, interpret, geometry):
    from qsa_pallas import prefill as P  # noqa: PLC0415

    kw = dict(interpret=interpret, geometry=geometry)
    if kind == "ordinary":
        return P.sparse_prefill(q, k, v, idx, cu_q, max_q, scale, **kw)
    if kind == "chunk":
        cu_k, kv_lens = rest
        return P.sparse_prefill_chunk(q, k, v, idx, cu_q, cu_k, kv_lens, max_q, scale, ks, vs, **kw)
    kv_lens, slot_table = rest
    return P.sparse_prefill_paged(q, k, v, slot_table, idx, cu_q, kv_lens, max_q, scale, ks, vs,
                                  **kw)


# ---------------------------------------------------------------------------------------------
# Pallas vs Triton on the cases
def run_comparison(cases=CASES, *, inner_reps: int = 4, rounds: int = 10, seed: int = 0) -> dict:
    """Check and time Pallas vs ``qsa_triton`` (same torch buffers) on ``cases``.

    Returns:
      dict with the device, versions and one record per case: errors of both against the float32
      torch reference, both medians (µs per prefill), ratio = triton_us / pallas_us; plus the
      geomean ratio.
    """
    import jax  # noqa: PLC0415
    import torch  # noqa: PLC0415

    import qsa_triton  # noqa: PLC0415
    from bench.common import time_interleaved  # noqa: PLC0415
    from bench.prefill_cases import errors, make_case, reference_f32, within_tolerance  # noqa: PLC0415
    from qsa_pallas import prefill as P  # noqa: PLC0415

    res: dict[str, Any] = {"device": torch.cuda.get_device_name(), "jax": jax.__version__,
                           "torch": torch.__version__, "inner_reps": inner_reps,
                           "method": "bench.common.time_interleaved: Triton CUDA-graph replay, "
                           f"Pallas eager jitted chain of {inner_reps}; median of {rounds}",
                           "cases": []}
    try:
        import triton  # noqa: PLC0415

        res["triton"] = triton.__version__
    except ImportError:
        pass
    ratios = []
    for kind, kv, hq, hkv in cases:
        c = make_case(kind, hq, hkv, D, [T_ROWS], None if kind == "ordinary" else [kv],
                      junk="-1", seed=seed, device="cuda")
        rec: dict[str, Any] = {"kind": kind, "kv": kv, "Hq": hq, "Hkv": hkv, "T": T_ROWS,
                               "W": int(c.indices.shape[-1])}
        ref = reference_f32(c)
        provs = {"triton": lambda c=c: c.run(),
                 "pallas": make_provider(kind, c, inner_reps=inner_reps)}
        out_p = _pallas_once(kind, c)
        out_t = c.run()
        torch.cuda.synchronize()
        rec["pallas_err"] = errors(out_p.float(), ref)
        rec["triton_err"] = errors(out_t.float(), ref)
        rec["pallas_vs_triton_err"] = errors(out_p.float(), out_t.float())
        rec["pallas_ok"] = within_tolerance(rec["pallas_err"])
        rec["triton_ok"] = within_tolerance(rec["triton_err"])
        rec["pallas_geometry"] = str(_pallas_geometry(P, kind, c))
        del ref, out_p, out_t
        t = time_interleaved(provs, rounds=rounds)
        rec["timing"] = t
        rec["triton_us"] = t["triton"]["median_us"]
        rec["pallas_us"] = t["pallas"]["median_us"]
        rec["ratio_triton_over_pallas"] = rec["triton_us"] / rec["pallas_us"]
        ratios.append(rec["ratio_triton_over_pallas"])
        res["cases"].append(rec)
        print(f"{kind:8s} kv={kv:6d} {hq}/{hkv}: triton {rec['triton_us']:8.1f} us  pallas "
              f"{rec['pallas_us']:8.1f} us  ratio {rec['ratio_triton_over_pallas']:.3f}  "
              f"relL2 pallas {rec['pallas_err']['rel_l2']:.1e} triton "
              f"{rec['triton_err']['rel_l2']:.1e}  [{rec['pallas_geometry']}]", flush=True)
        del c, provs
        torch.cuda.empty_cache()
    res["geomean_ratio_triton_over_pallas"] = (math.exp(sum(map(math.log, ratios)) / len(ratios))
                                               if ratios else float("nan"))
    res["target"] = ">= 0.8 (Pallas at least 0.8x Triton's speed)"
    res["all_correct"] = all(r["pallas_ok"] for r in res["cases"])
    return res


#: Pallas geometries timed by ``--sweep`` (BLOCK_N, num_warps, num_stages); head tile 16.
SWEEP = ((16, 1, 2), (16, 2, 2), (16, 4, 2), (16, 4, 3), (32, 2, 2), (32, 4, 2), (32, 4, 3),
         (64, 4, 2), (64, 8, 2))


def run_sweep(cases=(("chunk", 32768, 12, 1), ("chunk", 32768, 6, 1)), *, geometries=SWEEP,
              inner_reps: int = 4, rounds: int = 8, seed: int = 1,
              deadline: float | None = None) -> list[dict]:
    """Time Pallas at each geometry of ``geometries`` (and qsa_triton at its selected one) on
    ``cases``, interleaved in one run: data for a Pallas row in ``interop.geometry``'s table if
    the Pallas kernel measures best with other tuples than the Triton one."""
    import torch  # noqa: PLC0415

    from bench.common import time_interleaved  # noqa: PLC0415
    from bench.prefill_cases import make_case  # noqa: PLC0415
    from qsa_pallas import prefill as P  # noqa: PLC0415

    out = []
    for kind, kv, hq, hkv in cases:
        if deadline is not None and time.monotonic() > deadline:
            print(f"[sweep] out of time budget: {kind} kv={kv} {hq}/{hkv} skipped", flush=True)
            out.append({"kind": kind, "kv": kv, "Hq": hq, "Hkv": hkv, "skipped": "time budget"})
            continue
        c = make_case(kind, hq, hkv, D, [T_ROWS], [kv], junk="-1", seed=seed, device="cuda")
        provs = {"triton": lambda c=c: c.run()}
        for bn, nw, ns in geometries:
            geo = P.PallasPrefillGeometry(16, bn, nw, ns, "sweep")
            try:
                provs[f"pallas{(bn, nw, ns)}"] = make_provider(kind, c, geo, inner_reps=inner_reps)
            except Exception as e:  # noqa: BLE001 - a geometry that does not compile
                print(f"[sweep] {(bn, nw, ns)}: {type(e).__name__}: {str(e)[:200]}",
                      file=sys.stderr)
        t = time_interleaved(provs, rounds=rounds)
        rec = {"kind": kind, "kv": kv, "Hq": hq, "Hkv": hkv, "T": T_ROWS,
               "selected_pallas": str(_pallas_geometry(P, kind, c)),
               "us": {n: v["median_us"] for n, v in t.items()}}
        best = min((n for n in rec["us"] if n.startswith("pallas")), key=rec["us"].get)
        rec["best_pallas"] = best
        rec["best_ratio_triton_over_pallas"] = rec["us"]["triton"] / rec["us"][best]
        print(f"[sweep] {kind} kv={kv} {hq}/{hkv}: triton {rec['us']['triton']:.1f} us; "
              + ", ".join(f"{n[6:]} {v:.1f}" for n, v in rec["us"].items() if n != "triton")
              + f"; best {best}", flush=True)
        out.append(rec)
        del c, provs
        torch.cuda.empty_cache()
    return out


def _pallas_once(kind, c):
    """One eager Pallas prefill on the case's buffers (the entry point itself, as a user calls
    it), as a torch tensor."""
    from interop.dlpack import to_jax, to_torch  # noqa: PLC0415
    from qsa_pallas import prefill as P  # noqa: PLC0415

    j = lambda t: None if t is None else to_jax(t)  # noqa: E731
    q, k, v, idx, cu_q = j(c.q), j(c.k), j(c.v), j(c.indices), j(c.cu_q)
    if kind == "ordinary":
        out = P.sparse_prefill(q, k, v, idx, cu_q, c.max_q, c.softmax_scale)
    elif kind == "chunk":
        out = P.sparse_prefill_chunk(q, k, v, idx, cu_q, j(c.cu_k), j(c.kv_lens), c.max_q,
                                     c.softmax_scale, c.k_scale, c.v_scale)
    else:
        out = P.sparse_prefill_paged(q, k, v, j(c.slot_table), idx, cu_q, j(c.kv_lens), c.max_q,
                                     c.softmax_scale, c.k_scale, c.v_scale)
    return to_torch(out)


def _pallas_geometry(P, kind, c):
    from interop.contract import check_prefill, check_prefill_chunk  # noqa: PLC0415

    if kind == "ordinary":
        prob = check_prefill(c.q, c.k, c.v, c.indices, c.cu_q, c.max_q)
    else:
        prob = check_prefill_chunk(c.q, c.k, c.v, c.indices, c.cu_q, c.cu_k, c.kv_lens, c.max_q,
                                   None, c.k_scale, c.v_scale)
    return P.select_geometry(prob, interpret=False)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Pallas vs Triton sparse prefill (issue 6 cases)")
    ap.add_argument("--json", default=None, help="output JSON (default $OUT/pallas_prefill.json)")
    ap.add_argument("--inner-reps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--sweep", action="store_true",
                    help="also time Pallas at the SWEEP geometries on chunk 32k, G 12 and 6")
    ap.add_argument("--budget-s", type=float, default=60.0,
                    help="the sweep starts no new case after this many seconds of the run")
    args = ap.parse_args(argv)
    from bench.common import out_dir, write_json  # noqa: PLC0415

    t0 = time.monotonic()
    res = run_comparison(inner_reps=args.inner_reps, rounds=args.rounds)
    path = args.json or str(out_dir() / "pallas_prefill.json")
    write_json(path, res)  # the main result first, in case the sweep runs out of time
    print(f"wrote {path}; geomean Triton/Pallas time ratio "
          f"{res['geomean_ratio_triton_over_pallas']:.3f} (target >= 0.8); all Pallas outputs "
          f"correct: {res['all_correct']}", flush=True)
    if args.sweep:
        try:
            res["sweep"] = run_sweep(inner_reps=args.inner_reps,
                                     deadline=t0 + args.budget_s)
        except Exception as e:  # noqa: BLE001 - the comparison above is the main result
            res["sweep_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"[sweep] failed: {res['sweep_error']}", file=sys.stderr)
        write_json(path, res)
        print(f"wrote {path} (with the sweep)")
    return 0 if res["all_correct"] else 1


if __name__ == "__main__":
    sys.exit(main())
