"""Decode benchmark: qsa_triton vs upstream SGLang 0.5.23 peers (and Pallas when available).

  python bench/decode.py [--json PATH] [--quick] [--pallas]   the comparison table (issue 3)
  python bench/decode.py --providers sm121,ours,generic --plot decode.png
                                    choose and order the providers; ``speedup_vs_first`` (JSON)
                                    and "x first" (table) are against the first one listed
  python bench/decode.py --sweep [--json PATH]           geometry/split sweep of our kernel
  python bench/decode.py --sweep --pdl-only [--json PATH] only the PDL on/off pass of the sweep

PDL (Programmatic Dependent Launch between our split and merge kernels, ``qsa_triton.decode``):
the comparison table runs the mode QSA_DECODE_PDL / ``PDL_AUTO`` selects and prints it; the sweep
ends each shape with pass C, the shipped plan and the best configuration each with PDL off and on
(interleaved, same inputs), and summarises the on/off time ratio.

Providers, interleaved in one process on one set of inputs (``bench.common.time_interleaved``:
CUDA-graph replay of back-to-back calls, round-robin, median of CUDA-event timings; see
``docs/anchors.md`` for why):
  * ``ours``     ``qsa_triton.sparse_decode`` (plan from ``interop.plan``), and ``ours@self``,
                 the same provider timed again as a noise check (ratio should be ~1.00);
  * ``sm121``    upstream's packed decode kernel (``interop.peer.load_sm121_decode``); it supports
                 only (24,2) and (12,1) and B <= 128: other shapes skip it;
  * ``generic``  upstream's ``sparse_gqa_packed_decode_triton`` (its chunk-prefill kernel with one
                 query row; identity indices per row padded with -1, kv_lens = row lengths);
  * ``pallas``   with ``--pallas``: ``bench.pallas_decode_provider.make_provider`` (JAX; not
                 graph-capturable: timed as an eager loop of jitted chains of 8 decodes, see its
                 docstring; its correctness check runs a single decode).
Every provider's output is checked against an FP32 torch reference on every case (rtol = atol =
2e-2 and relative L2 <= 5e-3, ``qsa-contract.md`` §6): the script exits non-zero if any fails.
Bytes = K + V rows actually read (sum of row lengths x Hkv x D x 2 bytes x 2); % copy = those
bytes per second over the device-to-device copy bandwidth measured in the same run.

Shape grid: TP1 (24,2) / TP2 (12,1) / TP4 (6,1) x B in {1, 4, 16, 32, 64, 128} x {saturated (2051
keys per row), mixed (uniform 17..2051, fixed seed)}, D = 256, bf16, max_seqlen_k = 2051.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # if jax is loaded (pallas)

__all__ = ["torch_reference", "make_inputs", "run_compare", "run_sweep", "main", "TP", "BATCHES",
           "PROVIDERS", "provider_entries", "case_record", "result_header"]

TP = {"TP1": (24, 2), "TP2": (12, 1), "TP4": (6, 1)}
BATCHES = (1, 4, 16, 32, 64, 128)
ROWS = ("saturated", "mixed")
#: diagnostic row kinds (bench/decode_variants.py --rows), with the plan still sized for 2051
#: keys: "even" = 2048 keys, 64 blocks of 32, so 4 splits per row are equal (2051 gives
#: 17/16/16/16 blocks); "k1" / "k64" = 1 / 64 keys, one split per row doing one block, the
#: merge kernel (where the plan has one) launched and finding nothing to merge: the call's
#: fixed cost; "k128" = 128 keys, two or four one-block splits and a real merge at B = 1
#: (bench/NOTES.md, decode v7)
EXTRA_ROWS = {"even": 2048, "k1": 1, "k64": 64, "k128": 128}
D = 256
MSK = 2051
RTOL = ATOL = 2e-2
REL_L2 = 5e-3
#: provider names (``--providers``), in the default order; ``speedup_vs_first`` compares with the
#: first one listed
PROVIDERS = ("ours", "sm121", "generic", "pallas")
PROVIDER_ALIASES = {"upstream-sm121": "sm121", "upstream-generic": "generic", "triton": "ours"}


def torch_reference(q, k, v, cq, ck, scale=None):
    """FP32 reference of packed varlen decode on q's device (``qsa-contract.md`` §2).

    Args:
      q: [B, Hq, D]; k, v: [C, Hkv, D]; cq, ck: int32 [B + 1] (same device).
    Returns:
      float32 [B, Hq, D]; zeros for empty rows. Rows are padded to the longest row and masked,
      so memory is B x max_len x Hkv x D floats (fine on the H200 for the qualified shapes).
    Validated against ``interop.reference.decode_reference`` (float64) by
    ``tests/test_triton_decode.py::test_gpu_torch_reference_matches_fp64_reference``.
    """
    import torch  # noqa: PLC0415

    b, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    scale = d ** -0.5 if scale is None else scale
    lens = (ck[1:] - ck[:-1]).long()
    lmax = max(int(lens.max()), 1)
    pos = torch.arange(lmax, device=q.device)
    valid = pos[None, :] < lens[:, None]
    rows = (ck[:-1].long()[:, None] + pos[None, :]).clamp(0, max(k.shape[0] - 1, 0))
    out = torch.empty(b, hq, d, dtype=torch.float32, device=q.device)
    step = max(1, (1 << 27) // (lmax * hkv * d))  # bound the gathered fp32 K/V per chunk
    for s0 in range(0, b, step):
        sl = slice(s0, min(b, s0 + step))
        pad = ~valid[sl][:, :, None, None]  # padding positions: zeroed (may hold NaN/Inf garbage)
        kk = k[rows[sl]].float().masked_fill(pad, 0.0)  # [b', L, Hkv, D]
        vv = v[rows[sl]].float().masked_fill(pad, 0.0)
        qq = q[cq[:-1].long()[sl]].float().view(-1, hkv, g, d)
        sc = torch.einsum("bhgd,blhd->bhgl", qq, kk) * scale
        sc = sc.masked_fill(~valid[sl][:, None, None, :], float("-inf"))
        p = torch.softmax(sc, -1).nan_to_num(0.0)
        out[sl] = torch.einsum("bhgl,blhd->bhgd", p, vv).reshape(-1, hq, d)
    return out


def make_inputs(tp: str, b: int, rows: str, *, seed: int = 0, device="cuda", slack: int = 0,
                dtype=None):
    """Inputs for one case (bf16 unless ``dtype``): (q, k, v, cu_q, cu_k, lens list)."""
    import numpy as np  # noqa: PLC0415
    import torch  # noqa: PLC0415

    hq, hkv = TP[tp]
    kinds = ROWS + tuple(EXTRA_ROWS)
    if rows not in kinds:
        raise ValueError(f"rows must be one of {kinds}, got {rows!r}")
    rng = np.random.default_rng([seed, b, hq, kinds.index(rows)])
    if rows in EXTRA_ROWS:
        lens = np.full(b, EXTRA_ROWS[rows])
    else:
        lens = np.full(b, MSK) if rows == "saturated" else rng.integers(17, MSK + 1, b)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    cap = int(cu[-1]) + slack
    g = torch.Generator(device=device).manual_seed(int(seed * 1000 + b))
    dtype = torch.bfloat16 if dtype is None else dtype
    q = torch.randn(b, hq, D, generator=g, device=device, dtype=torch.float32).to(dtype)
    k = torch.randn(cap, hkv, D, generator=g, device=device, dtype=torch.float32).to(dtype)
    v = torch.randn(cap, hkv, D, generator=g, device=device, dtype=torch.float32).to(dtype)
    cq = torch.arange(b + 1, dtype=torch.int32, device=device)
    ck = torch.from_numpy(cu).to(device)
    return q, k, v, cq, ck, lens.tolist()


def _check(out, ref) -> dict[str, Any]:
    import torch  # noqa: PLC0415

    o = out.float()
    finite = bool(torch.isfinite(o).all())
    err = (o - ref).abs()
    within = bool((err <= ATOL + RTOL * ref.abs()).all())
    den = float(ref.norm())
    rl = float((o - ref).norm()) / den if den > 0 else float(o.norm())
    return {"rel_l2": rl, "max_abs": float(err.max()), "ok": finite and within and rl <= REL_L2}


# ---------------------------------------------------------------------------------------------
# providers
def _peer_providers(q, k, v, cq, ck, lens, scale, skip: set[str]) -> tuple[dict, dict]:
    """{name: callable} for the upstream peers usable on this shape, and {name: reason} skipped."""
    import torch  # noqa: PLC0415

    provs: dict[str, Callable] = {}
    skipped: dict[str, str] = {}
    b, hq, _ = q.shape
    hkv = k.shape[1]
    if "sm121" not in skip:
        if (hq, hkv) in ((24, 2), (12, 1)) and b <= 128:
            try:
                from interop.peer import load_sm121_decode  # noqa: PLC0415

                sm121 = load_sm121_decode()
                provs["sm121"] = lambda: sm121.qwen38_qsa_sm121(q, k, v, cq, ck, scale)
            except Exception as e:  # noqa: BLE001 - optional peer
                skipped["sm121"] = f"{type(e).__name__}: {e}"
        else:
            skipped["sm121"] = f"upstream supports (24,2)/(12,1), B<=128 only; got ({hq},{hkv}) B={b}"
    if "generic" not in skip:
        try:
            from interop.peer import load_sparse_attn  # noqa: PLC0415

            generic = load_sparse_attn()
            width = max(max(lens), 1)
            kv_lens = (ck[1:] - ck[:-1]).contiguous()
            # identity indices per row, -1 padding past the row's length: upstream's kernel treats
            # every index >= 0 as valid (it trusts the indexer's -1 padding)
            pos = torch.arange(width, dtype=torch.int32, device=q.device)
            idx = torch.where(pos[None, :] < kv_lens[:, None], pos[None, :], -1).to(torch.int32)
            idx = idx.contiguous()
            provs["generic"] = lambda: generic.sparse_gqa_packed_decode_triton(
                q, k, v, idx, cq, ck, kv_lens, scale)
        except Exception as e:  # noqa: BLE001
            skipped["generic"] = f"{type(e).__name__}: {e}"
    if "pallas" not in skip:
        try:
            import importlib  # noqa: PLC0415

            pmod = importlib.import_module("bench.pallas_decode_provider")
            provs["pallas"] = pmod.make_provider(q, k, v, cq, ck, MSK, scale, inner_reps=8)
        except ModuleNotFoundError as e:
            skipped["pallas"] = f"not available: {e}"
        except Exception as e:  # noqa: BLE001
            skipped["pallas"] = f"{type(e).__name__}: {str(e)[:300]}"
    return provs, skipped


def _timers(dev):
    """(time_interleaved, copy bandwidth) for the device; on CPU (``--smoke-cpu``: the
    interpreter, to exercise this script's code paths without a GPU) a wall-clock stand-in."""
    from bench.common import copy_bandwidth_bytes_per_s, time_interleaved  # noqa: PLC0415

    if dev.type == "cuda":
        return time_interleaved, copy_bandwidth_bytes_per_s(dev)

    def cpu_timer(providers, *, rounds=1, self_check=False, **_):
        items = list(providers.items())
        if self_check and items:
            items.append((items[0][0] + "@self", items[0][1]))
        out = {}
        for name, fn in items:
            t0 = time.perf_counter()
            fn()
            us = (time.perf_counter() - t0) * 1e6
            out[name] = {"median_us": us, "p10_us": us, "p90_us": us, "min_us": us, "reps": 1,
                         "rounds": 1, "cuda_graph": False, "inner_reps": 1}
        return out

    return cpu_timer, 1e12


def provider_entries(timing: dict, checks: dict, nbytes: int, bw: float,
                     first: str | None) -> dict:
    """One case's ``providers`` dict from timings and reference checks (pure: the tests call it
    with fake timings).

    Args:
      timing: ``{name: time_interleaved entry}`` (``median_us`` ..., or ``error``), in provider
        order; ``name@self`` entries are the self-vs-self noise check.
      checks: ``{name: _check result}``.
      nbytes: K + V bytes the case reads; bw: copy bandwidth in bytes per second.
      first: the first provider listed (``--providers``): ``speedup_vs_first`` = its median time /
        this provider's (> 1: faster than the first); absent when the first was not timed.
    Each timed entry also gets ``GBps``, ``pct_copy_bw`` and, when upstream's sm121 kernel was
    timed, ``speedup_vs_sm121`` (issue 3 targets)."""
    from bench.common import SELF_SUFFIX, speedup_vs_first  # noqa: PLC0415

    times = {n: t.get("median_us") for n, t in timing.items() if "error" not in t}
    vs_first = speedup_vs_first(times, first)
    vs_sm121 = speedup_vs_first(times, "sm121")
    out = {}
    for name, t in timing.items():
        chk = checks.get(name.removesuffix(SELF_SUFFIX), {})
        if "error" in t:
            out[name] = {**t, **chk}
            continue
        us = t["median_us"]
        entry = {**t, "GBps": nbytes / (us * 1e-6) / 1e9,
                 "pct_copy_bw": 100 * nbytes / (us * 1e-6) / bw, **chk}
        if name in vs_sm121:
            entry["speedup_vs_sm121"] = vs_sm121[name]
        if name in vs_first:
            entry["speedup_vs_first"] = vs_first[name]
        out[name] = entry
    return out


def case_record(tp: str, b: int, rows: str, lens, timing: dict, checks: dict, bw: float, *,
                first: str | None, plan=None, merge=None, skipped=None) -> dict:
    """One entry of ``result["cases"]`` (pure; see ``provider_entries``)."""
    hq, hkv = TP[tp]
    nbytes = int(sum(lens)) * hkv * D * 2 * 2
    return {"tp": tp, "Hq": hq, "Hkv": hkv, "B": b, "rows": rows, "keys": int(sum(lens)),
            "bytes": int(nbytes), "plan": getattr(plan, "__dict__", plan), "merge": merge,
            "skipped": dict(skipped or {}), "first_provider": first,
            "providers": provider_entries(timing, checks, nbytes, bw, first)}


def result_header(*, gpu: str, copy_bandwidth_Bps: float, providers: list[str], rounds: int,
                  **meta) -> dict:
    """The top of the comparison result (pure): ``providers`` in order, the first of them is what
    ``speedup_vs_first`` compares with."""
    from bench.common import now_iso  # noqa: PLC0415

    return {"gpu": gpu, "date": now_iso(), **meta, "copy_bandwidth_Bps": copy_bandwidth_Bps,
            "method": "CUDA-graph replay of back-to-back calls, providers interleaved "
            "round-robin, median of CUDA-event timings per replay / calls; every provider checked "
            "against an FP32 reference on every case",
            "providers": list(providers), "first_provider": providers[0] if providers else None,
            "rounds": rounds, "cases": [], "failures": []}


def run_compare(*, tps=tuple(TP), batches=BATCHES, rows=ROWS, rounds: int = 15,
                skip: set[str] = frozenset(), seed: int = 0, device: str = "cuda",
                progress_path=None, providers: list[str] | None = None) -> dict:
    """The comparison table over the shape grid. Returns a JSON-able dict (see module doc).
    ``providers``: names from ``PROVIDERS`` in the order to time them (default: ours, then the
    peers not in ``skip``); ratios ``speedup_vs_first`` are against the first of them.
    With ``progress_path`` the results so far are rewritten there after every case (so a run
    cut short by a time limit still leaves its numbers)."""
    import torch  # noqa: PLC0415

    import qsa_triton  # noqa: PLC0415
    from bench.common import gpu_name, order_providers  # noqa: PLC0415
    from qsa_triton import decode as dec  # noqa: PLC0415

    if providers is None:
        providers = [n for n in PROVIDERS if n not in skip]
    else:
        providers = [n for n in providers if n not in skip]
    skip = set(skip) | {n for n in PROVIDERS if n not in providers}
    first = providers[0] if providers else None
    dev = torch.device(device)
    dec.prepare(dev)
    time_interleaved, bw = _timers(dev)
    res = result_header(
        gpu=gpu_name(), copy_bandwidth_Bps=bw, providers=providers, rounds=rounds,
        torch=torch.__version__, triton=_triton_version(), merge_mode=dec.MERGE_MODE,
        pdl=dec.pdl_enabled(dev, kv_rows=1), pdl_env=os.environ.get(dec.PDL_ENV, "auto"),
        pdl_auto_max_kv_rows=dec.PDL_AUTO_MAX_KV_ROWS,
        pdl_late_min_kv_rows=dec.PDL_LATE_MIN_KV_ROWS,
        pdl_supported=dec.pdl_supported(dev))
    print(f"{gpu_name()}: copy bandwidth {bw / 1e12:.2f} TB/s (read + written)")
    auto = res["pdl_env"].strip().lower() in ("", "auto")
    mode = ("off" if not res["pdl"] else
            f"on where B x Hkv <= {dec.PDL_AUTO_MAX_KV_ROWS} (entry trigger) or >= "
            f"{dec.PDL_LATE_MIN_KV_ROWS} (trigger after the K/V loop)" if auto else "on")
    print(f"ours: PDL {mode} ({dec.PDL_ENV}={res['pdl_env']}, PDL_AUTO={dec.PDL_AUTO}, "
          f"supported={res['pdl_supported']})")
    print(f"providers: {', '.join(providers)} (x first = time of {first} / time)")
    hdr = (f"{'case':24s} {'provider':10s} {'us':>8s} {'p10':>7s} {'p90':>7s} {'GB/s':>7s} "
           f"{'%copy':>6s} {'x first':>8s} {'x sm121':>8s} {'relL2':>8s}")
    print(hdr)
    for tp in tps:
        for b in batches:
            for r in rows:
                # CPU smoke: fp16, since the interpreter computes bf16 elementwise math on raw bits
                # (upstream's generic kernel pre-scales q in bf16)
                q, k, v, cq, ck, lens = make_inputs(
                    tp, b, r, seed=seed, device=dev,
                    dtype=torch.float16 if dev.type == "cpu" else torch.bfloat16)
                scale = D ** -0.5
                hq, hkv = TP[tp]
                plan, merge = dec.plan_for(b, hkv, hq // hkv, D, MSK, dev)
                provs = {}
                if "ours" in providers:
                    provs["ours"] = (lambda q=q, k=k, v=v, cq=cq, ck=ck:
                                     qsa_triton.sparse_decode(q, k, v, cq, ck, MSK, scale))
                peers, skipped = _peer_providers(q, k, v, cq, ck, lens, scale, skip)
                provs.update(peers)
                provs = order_providers(provs, providers)
                ref = torch_reference(q, k, v, cq, ck, scale)
                checks = {}
                for name, fn in list(provs.items()):
                    try:
                        out = fn()
                        if dev.type == "cuda":
                            torch.cuda.synchronize()
                        if getattr(fn, "inner_reps", 1) != 1:
                            # chained provider: check a single decode through its maker
                            out = _pallas_single(q, k, v, cq, ck, scale)
                        checks[name] = _check(out, ref)
                    except Exception as e:  # noqa: BLE001 - a peer failing must not stop the run
                        checks[name] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
                        provs.pop(name)
                del ref
                timing = time_interleaved(provs, rounds=rounds, self_check=True) if provs else {}
                case = case_record(tp, b, r, lens, timing, checks, bw, first=first, plan=plan,
                                   merge=merge, skipped=skipped)
                for name, entry in case["providers"].items():
                    if "median_us" not in entry:
                        res["failures"].append({"tp": tp, "B": b, "rows": r, "provider": name,
                                                "ok": False, "error": entry.get("error")})
                        print(f"  !! {name} could not be timed: {entry.get('error')}")
                        continue
                    label = f"{tp} B={b:<3d} {r}"
                    vf, vs = entry.get("speedup_vs_first"), entry.get("speedup_vs_sm121")
                    rl = entry.get("rel_l2")
                    print(f"{label:24s} {name:10s} {entry['median_us']:8.2f} {entry['p10_us']:7.2f} "
                          f"{entry['p90_us']:7.2f} {entry['GBps']:7.0f} {entry['pct_copy_bw']:6.1f} "
                          f"{'-' if vf is None else f'{vf:.2f}':>8s} "
                          f"{'-' if vs is None else f'{vs:.2f}':>8s} "
                          f"{'' if rl is None else f'{rl:8.1e}'}"
                          + ("" if entry.get("ok", True) else "  FAIL"))
                for name, c in checks.items():
                    if not c.get("ok"):
                        res["failures"].append({"tp": tp, "B": b, "rows": r, "provider": name, **c})
                        print(f"  !! {name} failed the check: {c}")
                res["cases"].append(case)
                if progress_path:
                    from bench.common import write_json  # noqa: PLC0415

                    write_json(progress_path, {**res, "partial": True})
                del q, k, v
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
    res["summary"] = _summary(res)
    return res


def _pallas_single(q, k, v, cq, ck, scale):
    import importlib  # noqa: PLC0415

    pmod = importlib.import_module("bench.pallas_decode_provider")
    return pmod.make_provider(q, k, v, cq, ck, MSK, scale, inner_reps=1)()


def _triton_version() -> str:
    import triton  # noqa: PLC0415

    return triton.__version__


def _geomean(xs):
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def _summary(res: dict) -> dict:
    """Issue 3 targets: geomean >= 1.3x sm121, no case < 0.95x, B=1 saturated <= 0.5x sm121's
    time, B >= 64 saturated >= 85% of the copy bandwidth; plus the self-vs-self noise check (the
    first timed provider against itself) and, per provider, the geomean of ``speedup_vs_first``
    over the cases where both ran."""
    sp, worst, b1, big, selfr = [], None, [], [], []
    vs_first: dict[str, list[float]] = {}
    for c in res["cases"]:
        p = c["providers"]
        for n, e in p.items():
            if "speedup_vs_first" in e and not n.endswith("@self"):
                vs_first.setdefault(n, []).append(e["speedup_vs_first"])
        selfs = [n for n in p if n.endswith("@self")]
        if selfs:
            n0 = selfs[0].removesuffix("@self")
            if "median_us" in p[selfs[0]] and "median_us" in p.get(n0, {}):
                selfr.append(p[selfs[0]]["median_us"] / p[n0]["median_us"])
        if "ours" in p and "speedup_vs_sm121" in p["ours"]:
            s = p["ours"]["speedup_vs_sm121"]
            sp.append(s)
            if worst is None or s < worst[0]:
                worst = (s, f"{c['tp']} B={c['B']} {c['rows']}")
            if c["B"] == 1 and c["rows"] == "saturated":
                b1.append(1 / s)
        if "pct_copy_bw" in p.get("ours", {}) and c["B"] >= 64 and c["rows"] == "saturated":
            big.append(p["ours"]["pct_copy_bw"])
    out = {
        "first_provider": res.get("first_provider"),
        "geomean_speedup_vs_first": {n: _geomean(v) for n, v in vs_first.items()},
        "geomean_speedup_vs_sm121": _geomean(sp),
        "min_speedup_vs_sm121": worst[0] if worst else None,
        "min_speedup_case": worst[1] if worst else None,
        "b1_saturated_time_ratio_vs_sm121": b1,
        "b_ge_64_saturated_pct_copy_bw_min": min(big) if big else None,
        "self_vs_self_ratio_range": [min(selfr), max(selfr)] if selfr else None,
        "all_correct": not res["failures"],
    }
    out["targets_met"] = {
        "geomean>=1.3": out["geomean_speedup_vs_sm121"] >= 1.3 if sp else None,
        "min>=0.95": (worst[0] >= 0.95) if worst else None,
        "b1_sat<=0.5": all(x <= 0.5 for x in b1) if b1 else None,
        "b>=64_sat>=85%": (min(big) >= 85.0) if big else None,
    }
    return out


# ---------------------------------------------------------------------------------------------
# sweep
SWEEP_SHAPES = [("TP1", 1, "saturated"), ("TP1", 4, "saturated"), ("TP1", 16, "saturated"),
                ("TP1", 16, "mixed"), ("TP1", 64, "saturated"), ("TP1", 128, "saturated"),
                ("TP2", 1, "saturated"), ("TP2", 32, "saturated"), ("TP2", 128, "saturated")]
# (block_n, num_warps, num_stages) tried besides the plan's own ("plan"); shared memory on
# D = 256 in brackets (SM12x limit 101,376 B)
SWEEP_GEOMETRY = [(32, 4, 3),  # [75 KB]
                  (32, 4, 2), (32, 4, 4), (32, 8, 3),  # [42 KB], [108 KB: H200 only], [75 KB]
                  (16, 4, 3),  # [42 KB]
                  (64, 4, 2), (64, 8, 2), (64, 4, 3)]  # [76 KB], [76 KB], [141 KB: H200 only]


def run_sweep(*, shapes=SWEEP_SHAPES, geometry=SWEEP_GEOMETRY, rounds: int = 7, seed: int = 0,
              device: str = "cuda", progress_path=None, pdl_only: bool = False) -> dict:
    """Three passes per shape, all interleaved within a pass:
      A: every (block_n, num_warps, num_stages) with the plan's split policy;
      B: the best geometry of pass A with other split policies (max_splits x min_blocks) and
         both merge modes;
      C: Programmatic Dependent Launch off vs on for the shipped plan and for the best
         configuration of A and B (only where ``dec.pdl_supported``). ``pdl_only``: pass C
         alone, for the shipped plan (quick).
    Passes A and B run the default PDL mode (``dec.pdl_enabled``).
    Each configuration is checked against the FP32 reference. Returns a JSON-able dict with
    per-shape medians, the best configuration per shape and each configuration's geomean time
    relative to the plan default over all shapes (what a single global choice would give)."""
    import dataclasses  # noqa: PLC0415

    import torch  # noqa: PLC0415

    from bench.common import gpu_name  # noqa: PLC0415
    from interop.plan import plan_decode  # noqa: PLC0415
    from qsa_triton import decode as dec  # noqa: PLC0415

    dev = torch.device(device)
    time_interleaved, bw = _timers(dev)
    res: dict[str, Any] = {"gpu": gpu_name(), "copy_bandwidth_Bps": bw, "shapes": [],
                           "failures": [], "pdl_default": {"on": dec.pdl_enabled(dev, kv_rows=1),
                                                            "max_kv_rows": dec.PDL_AUTO_MAX_KV_ROWS},
                           "pdl_supported": dec.pdl_supported(dev)}
    pdl_ratio: dict[str, list[float]] = {}  # on / off time, per configuration kind
    rel_by_cfg: dict[str, list[float]] = {}
    for tp, b, r in shapes:
        t0 = time.time()
        q, k, v, cq, ck, lens = make_inputs(tp, b, r, seed=seed, device=dev)
        hq, hkv = TP[tp]
        nbytes = sum(lens) * hkv * D * 2 * 2
        ref = torch_reference(q, k, v, cq, ck)
        pdl_now = dec.pdl_enabled(dev, kv_rows=b * hkv)  # the default mode for this shape
        base_plan = plan_decode(b, hkv, hq // hkv, D, MSK, dec._sm_count(dev))

        def provider(plan, merge, pdl=None):
            return lambda: dec.decode_with_plan(q, k, v, cq, ck, MSK, plan=plan, merge=merge,
                                                pdl=pdl)

        def measure(cands: dict[str, tuple]) -> dict[str, dict]:
            provs, meta = {}, {}
            for name, (plan, merge, *pdl) in cands.items():
                fn = provider(plan, merge, *pdl)
                try:
                    chk = _check(fn(), ref)
                except Exception as e:  # noqa: BLE001 - e.g. out of shared memory
                    chk = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:200]}"}
                meta[name] = {"plan": plan.__dict__, "merge": merge,
                              "pdl": pdl[0] if pdl else pdl_now, **chk}
                if chk.get("ok"):
                    provs[name] = fn
                else:
                    res["failures"].append({"tp": tp, "B": b, "rows": r, "config": name, **chk})
            timing = time_interleaved(provs, rounds=rounds, target_replay_us=1000.0) if provs else {}
            for name, t in timing.items():
                meta[name].update(t)
                if "median_us" in t:
                    meta[name]["pct_copy_bw"] = 100 * nbytes / (t["median_us"] * 1e-6) / bw
                else:
                    res["failures"].append({"tp": tp, "B": b, "rows": r, "config": name, **t})
            return meta

        plan_now, _ = dec.plan_for(b, hkv, hq // hkv, D, MSK, dev)  # the shipped default

        def pass_c(configs: dict[str, tuple]) -> dict[str, dict]:
            """PDL off vs on for each (plan, merge), interleaved; ratios into pdl_ratio."""
            if not dec.pdl_supported(dev):
                return {}
            cands = {f"{n}_pdl_{'on' if on else 'off'}": (p, m, on)
                     for n, (p, m) in configs.items() for on in (False, True)}
            meta = measure(cands)
            for n in configs:
                off, on = meta[f"{n}_pdl_off"].get("median_us"), meta[f"{n}_pdl_on"].get("median_us")
                if off and on:
                    pdl_ratio.setdefault(n, []).append(on / off)
                    print(f"[sweep] {tp} B={b:<3d} {r:9s} PDL {n}: off {off:8.2f} us, on {on:8.2f} us "
                          f"(on/off {on / off:.3f})")
            return meta

        if pdl_only:
            meta_c = pass_c({"plan": (plan_now, "kernel")})
            res["shapes"].append({"tp": tp, "B": b, "rows": r, "bytes": int(nbytes),
                                  "plan_default": plan_now.__dict__, "pass_c": meta_c})
            if progress_path:
                from bench.common import write_json  # noqa: PLC0415

                write_json(progress_path, {**res, "partial": True})
            del q, k, v, ref
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            continue
        cands_a = {"plan": (plan_now, "kernel")}
        for bn, w, st in geometry:
            if (bn, w, st) == (plan_now.block_n, plan_now.num_warps, plan_now.num_stages):
                continue
            p = dataclasses.replace(plan_decode(b, hkv, hq // hkv, D, MSK, dec._sm_count(dev),
                                                block_n=bn), num_warps=w, num_stages=st)
            cands_a[f"bn{bn}_w{w}_s{st}"] = (p, "kernel")
        meta_a = measure(cands_a)
        timed_a = {n: m for n, m in meta_a.items() if "median_us" in m}
        default_name = "plan"
        if not timed_a:
            print(f"[sweep] {tp} B={b} {r}: no configuration ran: {meta_a}")
            res["shapes"].append({"tp": tp, "B": b, "rows": r, "pass_a": meta_a})
            continue
        best_a = min(timed_a, key=lambda n: timed_a[n]["median_us"])
        best_plan = cands_a[best_a][0]
        cands_b = {}
        splits_opts = sorted({1, 2, 4, 8, 16, 32, 64, base_plan.max_splits})
        for ms in splits_opts:
            for mb in (1, 2, 4):
                p = dataclasses.replace(best_plan, max_splits=ms, min_blocks_per_split=mb)
                if ms == 1 and mb != 1:
                    continue
                cands_b[f"{best_a}_ms{ms}_mb{mb}"] = (p, "kernel")
                if 1 < ms <= 8 and mb == best_plan.min_blocks_per_split:
                    cands_b[f"{best_a}_ms{ms}_mb{mb}_inline"] = (p, "inline")
        meta_b = measure(cands_b)
        timed_b = {n: m for n, m in meta_b.items() if "median_us" in m}
        all_timed = {**{f"A:{n}": m for n, m in timed_a.items()}, **{f"B:{n}": m for n, m in timed_b.items()}}
        best = min(all_timed, key=lambda n: all_timed[n]["median_us"])
        dflt = timed_a.get(default_name, {}).get("median_us")
        if dflt:
            for n, m in timed_a.items():
                rel_by_cfg.setdefault(n, []).append(m["median_us"] / dflt)
        best_cfg = {**{f"A:{n}": v for n, v in cands_a.items()},
                    **{f"B:{n}": v for n, v in cands_b.items()}}[best]
        pdl_cfgs = {"plan": (plan_now, "kernel")}
        if best != "A:plan":
            pdl_cfgs["best"] = best_cfg[:2]
        meta_c = pass_c(pdl_cfgs)
        shape = {"tp": tp, "B": b, "rows": r, "bytes": int(nbytes), "plan_default": base_plan.__dict__,
                 "default_us": dflt, "best": best, "best_us": all_timed[best]["median_us"],
                 "best_pct_copy_bw": all_timed[best]["pct_copy_bw"], "pass_a": meta_a,
                 "pass_b": meta_b, "pass_c": meta_c}
        res["shapes"].append(shape)
        if progress_path:
            from bench.common import write_json  # noqa: PLC0415

            write_json(progress_path, {**res, "partial": True})
        print(f"[sweep] {tp} B={b:<3d} {r:9s} default {dflt or float('nan'):8.2f} us | best A "
              f"{best_a} {timed_a[best_a]['median_us']:8.2f} us | best {best} "
              f"{all_timed[best]['median_us']:8.2f} us ({all_timed[best]['pct_copy_bw']:.0f}% copy)"
              f"  [{time.time() - t0:.0f}s]")
        top = sorted(timed_b, key=lambda n: timed_b[n]["median_us"])[:5]
        sms = dec._sm_count(dev)
        # programs per SM of a configuration = B x Hkv x max_splits / SMs (PROGRAMS_PER_SM in
        # interop/plan.py is the knob that sets max_splits from it)
        print("         top split policies (programs/SM): " + ", ".join(
            f"{n.removeprefix(best_a + '_')} {timed_b[n]['median_us']:.2f}us "
            f"({b * hkv * timed_b[n]['plan']['max_splits'] / sms:.2f})" for n in top))
        shape["best_programs_per_sm"] = (b * hkv * all_timed[best]["plan"]["max_splits"] / sms)
        del q, k, v, ref
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    res["pdl_on_over_off_geomean"] = {n: _geomean(v) for n, v in pdl_ratio.items()}
    res["pdl_on_over_off"] = pdl_ratio
    if pdl_ratio:
        print("[sweep] PDL on/off time, geomean over shapes (< 1: PDL faster): " + ", ".join(
            f"{n} {g:.3f}" for n, g in res["pdl_on_over_off_geomean"].items()))
    elif not res["pdl_supported"]:
        print("[sweep] PDL pass skipped: not supported here (needs sm_90+, not the interpreter)")
    res["geometry_geomean_vs_default"] = {n: _geomean(v) for n, v in rel_by_cfg.items()}
    done = [sh for sh in res["shapes"] if "best" in sh]
    if done and res["geometry_geomean_vs_default"]:
        ppsm = sorted(sh["best_programs_per_sm"] for sh in done)
        res["suggest"] = {
            "geometry (block_n, warps, stages) with the best geomean":
                min(res["geometry_geomean_vs_default"], key=res["geometry_geomean_vs_default"].get),
            "best programs per SM, per shape": {f"{sh['tp']} B={sh['B']} {sh['rows']}":
                                                round(sh["best_programs_per_sm"], 2) for sh in done},
            "median best programs per SM (PROGRAMS_PER_SM)": ppsm[len(ppsm) // 2],
            "shapes where the inline merge won": [f"{sh['tp']} B={sh['B']} {sh['rows']}"
                                                  for sh in done if sh["best"].endswith("_inline")],
            "best speedup over the shipped plan, per shape": {
                f"{sh['tp']} B={sh['B']} {sh['rows']}": round(sh["default_us"] / sh["best_us"], 3)
                for sh in done if sh.get("default_us")},
        }
        print("[sweep] suggestion:")
        for k_, v_ in res["suggest"].items():
            print(f"         {k_}: {v_}")
    print("[sweep] geometry, geomean time vs default over shapes (lower is better):")
    for n, g in sorted(res["geometry_geomean_vs_default"].items(), key=lambda kv: kv[1]):
        print(f"         {n:16s} {g:6.3f}")
    return res


# ---------------------------------------------------------------------------------------------
def main(argv=None, prog: str | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog,
                                 description="qsa_triton decode benchmark (see module docstring)")
    ap.add_argument("--json", default=None, help="output JSON (default $OUT/decode[_sweep].json)")
    ap.add_argument("--plot", default=None, metavar="PNG",
                    help="also draw the comparison as a PNG (bench/plot.py: median us and %% of "
                         "the copy bandwidth against B, per TP x rows; needs matplotlib)")
    ap.add_argument("--providers", default=None, metavar="A,B,...",
                    help="providers to time, in this order (default: ours,sm121,generic, plus "
                         "pallas with --pallas); ratios 'speedup_vs_first' are against the first. "
                         f"Names: {', '.join(PROVIDERS)} (aliases: "
                         + ", ".join(f"{k}={v}" for k, v in PROVIDER_ALIASES.items()) + ")")
    ap.add_argument("--sweep", action="store_true", help="sweep our kernel's geometry and splits")
    ap.add_argument("--quick", action="store_true", help="TP1 and TP2 at B in {1, 16, 128} only")
    ap.add_argument("--skip", default="", help="comma list of providers to skip (sm121,generic)")
    ap.add_argument("--pallas", action="store_true",
                    help="also time qsa_pallas (bench.pallas_decode_provider; JAX compiles per "
                         "shape, so use it with --quick to stay within the time budget)")
    ap.add_argument("--tp", default=None, help="comma list of TP1,TP2,TP4 (default all)")
    ap.add_argument("--batches", default=None, help="comma list of B (default 1,4,16,32,64,128)")
    ap.add_argument("--rows", default=None, help="comma list of saturated,mixed (default both)")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--pdl-only", action="store_true",
                    help="with --sweep: only the PDL on/off pass (shipped plan), for every shape")
    ap.add_argument("--smoke-cpu", action="store_true",
                    help="exercise the script on CPU (Triton interpreter, B=1 only, no timing value)")
    args = ap.parse_args(argv)
    # every argument is checked before torch / CUDA are touched (exit 2, like argparse)
    from bench.common import ProviderError, parse_providers  # noqa: PLC0415

    try:
        selection = parse_providers(args.providers, PROVIDERS, PROVIDER_ALIASES,
                                    script="bench/decode.py")
        skip = set(filter(None, (x.strip() for x in args.skip.split(","))))
        bad_skip = skip - set(PROVIDERS) - set(PROVIDER_ALIASES)
        if bad_skip:
            raise ProviderError(f"bench/decode.py: unknown provider(s) {sorted(bad_skip)} in "
                                f"--skip; allowed: {', '.join(PROVIDERS)}")
        skip = {PROVIDER_ALIASES.get(x, x) for x in skip}
        for flag, text, allowed in (("--tp", args.tp, TP), ("--rows", args.rows, ROWS)):
            bad = [x for x in (text or "").split(",") if x and x not in allowed]
            if bad:
                raise ProviderError(f"bench/decode.py: unknown {flag} value(s) {bad}; allowed: "
                                    f"{', '.join(allowed)}")
        if args.batches:
            try:
                bs = [int(x) for x in args.batches.split(",")]
            except ValueError:
                bs = [0]
            if any(x < 1 for x in bs):
                raise ProviderError(f"bench/decode.py: --batches wants positive integers; got "
                                    f"{args.batches!r}")
        if args.sweep and (selection is not None or args.plot):
            raise ProviderError("bench/decode.py: --providers and --plot apply to the comparison "
                                "run, not to --sweep")
        if selection is not None:
            selection = [n for n in selection if n not in skip]
            if not selection:
                raise ProviderError("bench/decode.py: --providers minus --skip leaves no provider")
    except ProviderError as e:
        print(e, file=sys.stderr)
        return 2
    if args.smoke_cpu:
        os.environ["TRITON_INTERPRET"] = "1"  # before qsa_triton / the peers define kernels
        try:
            from tests import triton_interp_patch  # noqa: F401, PLC0415 - bf16 dot on CPU
        except ImportError:
            pass

    import torch  # noqa: PLC0415

    from bench.common import out_dir, write_json  # noqa: PLC0415

    device = "cpu" if args.smoke_cpu else "cuda"
    if not args.smoke_cpu and not torch.cuda.is_available():
        print("bench/decode.py needs a CUDA GPU (or --smoke-cpu)", file=sys.stderr)
        return 2
    t0 = time.time()
    if args.sweep:
        kw = {"device": device, **({"rounds": args.rounds} if args.rounds else {})}
        if args.smoke_cpu:
            kw.update(shapes=[("TP2", 1, "mixed")], geometry=SWEEP_GEOMETRY[:2])
        path = args.json or str(out_dir() / "decode_sweep.json")
        res = run_sweep(progress_path=path, pdl_only=args.pdl_only, **kw)
        write_json(path, res)
        wrong = [f for f in res["failures"] if "rel_l2" in f]  # ran, but gave wrong numbers
        print(f"wrote {path} in {time.time() - t0:.0f}s; configurations that failed to run: "
              f"{len(res['failures']) - len(wrong)}; wrong results: {len(wrong)}")
        for f in res["failures"]:
            print(f"  {f}")
        return 0 if not wrong else 1
    if selection is None:
        if not args.pallas:
            skip.add("pallas")
        selection = [n for n in PROVIDERS if n not in skip]
    kw = {"skip": skip, "device": device, "providers": selection}
    if args.smoke_cpu:
        kw.update(tps=("TP1", "TP4"), batches=(1,), rows=("mixed",))
        # the peers ask torch.cuda for a device index / name even for CPU tensors: answer for them
        torch.cuda.current_device = lambda: 0
        torch.cuda.get_device_name = lambda *a, **k: "cpu (smoke)"
    elif args.quick:
        kw.update(tps=("TP1", "TP2"), batches=(1, 16, 128))
    if args.tp:
        kw["tps"] = tuple(args.tp.split(","))
    if args.batches:
        kw["batches"] = tuple(int(x) for x in args.batches.split(","))
    if args.rows:
        kw["rows"] = tuple(args.rows.split(","))
    if args.rounds:
        kw["rounds"] = args.rounds
    path = args.json or str(out_dir() / "decode.json")
    res = run_compare(progress_path=path, **kw)
    res["wall_s"] = time.time() - t0
    write_json(path, res)
    s = res["summary"]
    print(f"\nsummary: {s}")
    print(f"wrote {path} in {res['wall_s']:.0f}s")
    rc = 0
    if args.plot:
        from bench.plot import try_plot  # noqa: PLC0415

        rc = 0 if try_plot("decode", res, args.plot, path) else 1
    if res["failures"]:
        print(f"FAILED correctness checks: {[(f['tp'], f['B'], f['rows'], f['provider']) for f in res['failures']]}")
        return 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
