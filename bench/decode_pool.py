"""Decode benchmark, pool mode (issue 16 item 6): the whole QSA decode step from a KV pool.

  python -m bench.decode_pool --json PATH [--tps TP1,TP2,TP4] [--batches 1,4,16,32,64,128]
        [--layouts pages,slots] [--kv bf16,fp8] [--rows saturated,short,mtp]
        [--providers upstream-step,packed-step,jax-step,paged,pallas-paged] [--rounds 15]
        [--pool-slots 2200000]
  python -m bench.decode_pool --smoke-cpu --json PATH     (tiny shapes on the interpreters)

Providers (same inputs, interleaved, each checked against an FP32 reference computed from the
pool on the device; rtol = atol = 2e-2 and relative L2 <= 5e-3, qsa-contract.md §6):
  * ``upstream-step``  upstream SGLang 0.5.23 from its wheel (``interop.peer``): valid counts +
    prefix sum (``qwen_sparse_fa2_cu_seqlens_triton``), ``_compact_kv`` gather into a packed
    bf16 copy (``qwen_sparse_kv_extraction_compact_triton``; FP8 pools dequantised while
    copying), then the SM121 packed decode kernel ((24,2) / (12,1), R <= 128 only);
  * ``packed-step``    the same counts + prefix sum + compaction, then ``qsa_triton.sparse_decode``;
  * ``jax-step``       XLA compaction (slots resolved, rows gathered, scattered to their packed
    positions) + ``qsa_pallas.sparse_decode``;
  * ``paged``          ``qsa_triton.sparse_decode_paged``; ``pallas-paged`` its Pallas twin.
Timing: PyTorch providers as CUDA-graph replays of 20 back-to-back calls
(``bench.common.time_interleaved``); JAX providers as one ``jax.jit`` of an unrolled chain of 20
calls, each call's q the previous call's output, divided by 20 (XLA's GPU while loop round-trips
to the host; architecture.md). Providers interleaved round-robin, median of rounds.
Pools: ``--pool-slots`` slots (>= 2M) laid out as SGLang lays them (64-slot pages in scattered
order, ``pages``) or as single scattered slots (``slots``), bf16 or FP8 e4m3; rows: ``saturated``
(contexts of 8192 tokens: 2051 valid entries per row), ``short`` (contexts of 17..128 tokens:
the rest of the 2051 columns -1), ``mtp`` (32 requests x 4 verify rows, saturated).
Bytes = selected K + V rows read once (valid entries x Hkv x D x element size x 2); % copy = those
bytes per second over the measured device-to-device copy bandwidth (bench/decode.py's rule).
``summary`` checks issue 16's must-show thresholds (printed PASS / FAIL).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402

__all__ = ["PROVIDERS", "main", "run", "pool_reference", "summarize"]

TP = {"TP1": (24, 2), "TP2": (12, 1), "TP4": (6, 1)}
BATCHES = (1, 4, 16, 32, 64, 128)
PROVIDERS = ("upstream-step", "packed-step", "jax-step", "paged", "pallas-paged")
CHAIN = 20  # calls per CUDA graph / per jitted chain
W = 2051
RTOL = ATOL = 2e-2
REL_L2 = 5e-3


def pool_reference(q, k, v, table, req, idx, seq, scale, chunk=16):
    """FP32 reference on the device from the pool: out[r, h] over row r's valid entries
    (qsa-contract.md §2b, the lying-metadata rule included). Returns float32 [R, Hq, D]."""
    import torch  # noqa: PLC0415

    r, hq, d = q.shape
    slots, hkv = k.shape[0], k.shape[1]
    g = hq // hkv
    out = torch.zeros(r, hq, d, dtype=torch.float32, device=q.device)
    req_ok = (req >= 0) & (req < table.shape[0])
    bound = torch.where(req_ok, torch.clamp(seq, max=table.shape[1]), 0).long()
    for r0 in range(0, r, chunk):
        sl = slice(r0, min(r, r0 + chunk))
        ids = idx[sl].long()
        valid = (ids >= 0) & (ids < bound[sl, None])
        s_ = table[torch.where(req_ok[sl], req[sl], 0).long()[:, None],
                   torch.where(valid, ids, 0)].long()
        valid &= (s_ >= 0) & (s_ < slots)
        s_ = torch.where(valid, s_, 0)
        kk = k[s_].float().masked_fill(~valid[..., None, None], 0.0)  # [r', W, Hkv, D]
        vv = v[s_].float().masked_fill(~valid[..., None, None], 0.0)
        qq = q[sl].float().view(-1, hkv, g, d)
        sc = torch.einsum("bhgd,blhd->bhgl", qq, kk) * scale
        sc = sc.masked_fill(~valid[:, None, None, :], float("-inf"))
        p = torch.softmax(sc, -1).nan_to_num(0.0)
        out[sl] = torch.einsum("bhgl,blhd->bhgd", p, vv).reshape(-1, hq, d)
    return out


def _check(out, ref) -> dict:
    o = out.float()
    err = (o - ref).abs()
    den = float(ref.norm())
    rl = float((o - ref).norm()) / den if den > 0 else float(o.norm())
    ok = bool(o.isfinite().all()) and bool((err <= ATOL + RTOL * ref.abs()).all()) and rl <= REL_L2
    return {"ok": ok, "rel_l2": rl, "max_abs": float(err.max())}


def _upstream(tensors, hkv):
    """(counts+prefix+compaction callable -> (k_packed, v_packed, cu_k), sm121 module)."""
    import torch  # noqa: PLC0415

    from interop.peer import load_sm121_decode, load_sparse_attn  # noqa: PLC0415

    sa = load_sparse_attn()
    q, k, v, table, req, idx, seq = tensors
    r, w = idx.shape
    counts = torch.empty(r, dtype=torch.int32, device=q.device)
    cu_k = torch.empty(r + 1, dtype=torch.int32, device=q.device)
    kp = torch.empty(r * w, hkv, q.shape[2], dtype=q.dtype, device=q.device)
    vp = torch.empty_like(kp)

    def compact():
        sa.qwen_sparse_fa2_cu_seqlens_triton(seq, idx, counts, cu_k, r, w)
        sa.qwen_sparse_kv_extraction_compact_triton(k, v, table, req, idx, seq, cu_k, kp, vp, r, w)
        return kp, vp, cu_k

    return compact, load_sm121_decode


def _jax_step(jargs, scale, max_seqlen_k, interpret):
    """XLA compaction + qsa_pallas.sparse_decode, one call (jit-able)."""
    import jax.numpy as jnp  # noqa: PLC0415

    import qsa_pallas  # noqa: PLC0415

    def step(q, k, v, table, req, idx, seq):
        r, w = idx.shape
        req_ok = (req >= 0) & (req < table.shape[0])
        bound = jnp.where(req_ok, jnp.minimum(seq, table.shape[1]), 0)
        valid = (idx >= 0) & (idx < bound[:, None])
        slot = table[jnp.where(req_ok, req, 0)[:, None], jnp.where(valid, idx, 0)]
        valid &= (slot >= 0) & (slot < k.shape[0])
        counts = valid.sum(-1, dtype=jnp.int32)
        cu_k = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(counts, dtype=jnp.int32)])
        dest = jnp.where(valid, cu_k[:-1, None] + jnp.cumsum(valid, -1, dtype=jnp.int32) - 1,
                         r * w)  # invalid: out of range, dropped
        src = jnp.where(valid, slot, 0).reshape(-1)
        kp = jnp.zeros((r * w,) + k.shape[1:], q.dtype).at[dest.reshape(-1)].set(
            k[src].astype(q.dtype), mode="drop")
        vp = jnp.zeros((r * w,) + v.shape[1:], q.dtype).at[dest.reshape(-1)].set(
            v[src].astype(q.dtype), mode="drop")
        cu_q = jnp.arange(r + 1, dtype=jnp.int32)
        return qsa_pallas.sparse_decode(q, kp, vp, cu_q, cu_k, max_seqlen_k, scale,
                                        interpret=interpret)

    return step


def _jax_provider(fn, jargs, n, interpret):
    """Zero-arg callable running one jit of an unrolled chain of n calls (q_{i+1} = out_i);
    attributes for bench.common.time_interleaved (not graph-capturable, n calls per call)."""
    import jax  # noqa: PLC0415

    from interop.dlpack import to_torch  # noqa: PLC0415

    def chain(q, *rest):
        for _ in range(n):
            q = fn(q, *rest)
        return q

    compiled = jax.jit(chain).lower(*jargs).compile()

    def call():
        out = compiled(*jargs)
        return out if interpret else to_torch(out)

    call.inner_reps, call.cuda_graph_capturable = n, False
    return call


def _case(tp, b, rows, layout, kv, pool, dev, seed, smoke):
    """Inputs of one case on ``dev`` (torch): (q, k, v, table, req, idx, seq)."""
    import torch  # noqa: PLC0415

    from interop.indices import paged_decode_case  # noqa: PLC0415

    hq, hkv = TP[tp]
    rng = np.random.default_rng(seed)
    if rows == "mtp":
        contexts, per = np.full(max(1, b // 4), 8192), 4
    elif rows == "short":
        contexts, per = rng.integers(17, 129, b), 1
    else:
        contexts, per = np.full(b, 8192), 1
    width = 70 if smoke else W
    if smoke:
        contexts = np.minimum(contexts, 100)
    c = paged_decode_case(contexts, width=width, rows_per_request=per, pool_slots=pool["slots"],
                          page_size=64 if layout == "pages" else 1, seed=seed)
    g = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randn(len(c.req_indices), hq, pool["d"], generator=g, device=dev).to(pool["qdt"])
    meta = [torch.from_numpy(t).to(dev) for t in (c.req_to_token, c.req_indices, c.indices,
                                                  c.seq_lens)]
    return (q, pool["k"], pool["v"], *meta), int((c.indices >= 0).sum())


def run(*, tps, batches, layouts, kvs, rows, providers, rounds, pool_slots, smoke=False,
        seed=0, json_path=None) -> dict:
    import torch  # noqa: PLC0415

    from bench.common import (copy_bandwidth_bytes_per_s, gpu_name, now_iso,  # noqa: PLC0415
                              time_interleaved, write_json)

    dev = torch.device("cpu" if smoke else "cuda")
    bw = 1e12 if smoke else copy_bandwidth_bytes_per_s(dev)
    d, qdt = (64, torch.float16) if smoke else (256, torch.bfloat16)
    res = {"gpu": gpu_name(), "date": now_iso(), "copy_bandwidth_Bps": bw, "chain": CHAIN,
           "providers": list(providers), "pool_slots": pool_slots, "cases": [], "failures": []}
    print(f"{res['gpu']}: copy bandwidth {bw / 1e12:.2f} TB/s; providers {', '.join(providers)}")
    for tp in tps:
        hq, hkv = TP[tp]
        for kv in kvs:
            gen = torch.Generator(device=dev).manual_seed(seed)
            kdt = torch.float8_e4m3fn if kv == "fp8" else qdt
            pool = {"slots": pool_slots, "d": d, "qdt": qdt}
            pool["k"] = torch.randn(pool_slots, hkv, d, generator=gen, device=dev).to(kdt)
            pool["v"] = torch.randn(pool_slots, hkv, d, generator=gen, device=dev).to(kdt)
            for layout in layouts:
                for rk in rows:
                    for b in ((128,) if rk == "mtp" else batches):
                        t, nvalid = _case(tp, b, rk, layout, kv, pool, dev, seed + b, smoke)
                        scale = d ** -0.5
                        ref = pool_reference(*t, scale)
                        jargs = _to_jax(t, smoke)
                        provs, checks, skipped = {}, {}, {}
                        _providers(provs, skipped, providers, t, jargs, tp, scale, smoke)
                        for name, fn in list(provs.items()):
                            try:
                                one = fn.single() if hasattr(fn, "single") else fn()
                                checks[name] = _check(one, ref)
                            except Exception as e:  # noqa: BLE001 - one provider failing
                                checks[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:400]}
                                provs.pop(name)
                        timing = _time(provs, rounds, smoke, time_interleaved)
                        nbytes = nvalid * hkv * d * (1 if kv == "fp8" else 2) * 2
                        case = {"tp": tp, "B": b, "R": t[0].shape[0], "rows": rk, "layout": layout,
                                "kv": kv, "bytes": nbytes, "skipped": skipped, "providers": {}}
                        base = timing.get("upstream-step", {}).get("median_us")
                        for name in providers:
                            e = {**checks.get(name, {}), **timing.get(name, {})}
                            if "median_us" in e:
                                us = e["median_us"]
                                e["pct_copy_bw"] = 100 * nbytes / (us * 1e-6) / bw
                                if base:
                                    e["speedup_vs_upstream_step"] = base / us
                            if name in checks or name in timing:
                                case["providers"][name] = e
                            if name in checks and not e.get("ok", False):
                                res["failures"].append({**{k: case[k] for k in ("tp", "B", "rows",
                                                        "layout", "kv")}, "provider": name, **e})
                        _print(case)
                        res["cases"].append(case)
                        if json_path:
                            write_json(json_path, {**res, "partial": True})
            del pool
            if not smoke:
                torch.cuda.empty_cache()
    res["summary"] = summarize(res)
    if json_path:
        write_json(json_path, res)
    return res


def _to_jax(t, smoke):
    """The case's torch tensors as jax arrays: zero-copy on the GPU (``interop.dlpack``), numpy
    copies on the CPU smoke path (fp16 there)."""
    import jax.numpy as jnp  # noqa: PLC0415

    from interop.dlpack import to_jax  # noqa: PLC0415

    if smoke:
        return [jnp.asarray(x.numpy()) for x in t]
    return [to_jax(x) for x in t]


def _torch_out(a, smoke):
    import torch  # noqa: PLC0415

    from interop.dlpack import to_torch  # noqa: PLC0415

    return torch.from_numpy(np.array(a)) if smoke else to_torch(a)


def _providers(provs, skipped, selected, t, jargs, tp, scale, smoke):
    import torch  # noqa: PLC0415

    import qsa_pallas  # noqa: PLC0415
    import qsa_triton  # noqa: PLC0415

    q, k, v, table, req, idx, seq = t
    hq, hkv = TP[tp]
    cu_q = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    n = 1 if smoke else CHAIN
    if "paged" in selected:
        provs["paged"] = lambda: qsa_triton.sparse_decode_paged(*t, scale)
    if {"upstream-step", "packed-step"} & set(selected):
        try:
            compact, sm121 = _upstream(t, hkv)
            if "packed-step" in selected:
                provs["packed-step"] = lambda: _packed(compact, q, cu_q, scale)
            if "upstream-step" in selected:
                if (hq, hkv) in ((24, 2), (12, 1)) and q.shape[0] <= 128:
                    mod = sm121()
                    provs["upstream-step"] = lambda: _sm121(mod, compact, q, cu_q, scale)
                else:
                    skipped["upstream-step"] = "SM121 kernel: (24,2)/(12,1), R <= 128 only"
        except Exception as e:  # noqa: BLE001 - the peer is optional
            for name in ("upstream-step", "packed-step"):
                if name in selected:
                    skipped[name] = f"{type(e).__name__}: {e}"[:300]
    interp = bool(smoke)
    if "pallas-paged" in selected:
        fn = functools.partial(qsa_pallas.sparse_decode_paged, softmax_scale=scale,
                               interpret=interp if smoke else None)
        provs["pallas-paged"] = _jax_provider(fn, jargs, n, smoke)
        provs["pallas-paged"].single = _single(provs["pallas-paged"], fn, jargs, smoke)
    if "jax-step" in selected:
        step = _jax_step(jargs, scale, idx.shape[1], True if smoke else None)
        provs["jax-step"] = _jax_provider(step, jargs, n, smoke)
        provs["jax-step"].single = _single(provs["jax-step"], step, jargs, smoke)


def _single(chained, fn, jargs, smoke):
    """One call of a JAX provider for the reference check (the smoke path's chain is one call
    already: reuse its executable instead of compiling a second one)."""
    if smoke:
        return lambda: _torch_out(chained(), True)
    return lambda: _torch_out(fn(*jargs), False)


def _packed(compact, q, cu_q, scale):
    import qsa_triton  # noqa: PLC0415

    kp, vp, cu_k = compact()
    return qsa_triton.sparse_decode(q, kp, vp, cu_q, cu_k, W, scale)


def _sm121(mod, compact, q, cu_q, scale):
    kp, vp, cu_k = compact()
    return mod.qwen38_qsa_sm121(q, kp, vp, cu_q, cu_k, scale)


def _time(provs, rounds, smoke, time_interleaved):
    if not provs:
        return {}
    if not smoke:
        return time_interleaved(provs, reps=CHAIN, rounds=rounds)
    out = {}
    for name, fn in provs.items():  # CPU: one wall-clock call (exercises the code path only)
        t0 = time.perf_counter()
        fn()
        out[name] = {"median_us": (time.perf_counter() - t0) * 1e6 / getattr(fn, "inner_reps", 1)}
    return out


def _print(case):
    label = f"{case['tp']} {case['layout']:5s} {case['kv']:4s} {case['rows']:9s} B={case['B']:<3d}"
    for name, e in case["providers"].items():
        if "median_us" not in e:
            print(f"{label} {name:13s} {'-':>9s}  {e.get('error', '')}")
            continue
        sp = e.get("speedup_vs_upstream_step")
        print(f"{label} {name:13s} {e['median_us']:9.2f} us {e['pct_copy_bw']:6.1f}% copy "
              f"{'' if sp is None else f'{sp:5.2f}x up':>9s} relL2 {e.get('rel_l2', float('nan')):.1e}"
              + ("" if e.get("ok") else "  FAIL"))


def summarize(res) -> dict:
    """Issue 16's must-show thresholds over the measured cases (bf16 saturated unless stated):
    paged >= 2.5x upstream-step at every B with single slots and >= 2.0x with 64-slot pages;
    paged >= 85% of the copy bandwidth at B = 128; FP8 pool >= 1.6x faster than BF16 at B >= 64
    (paged); pallas-paged >= 3x jax-step at every B and >= 0.85x paged at B >= 16."""
    def us(case, name):
        return case["providers"].get(name, {}).get("median_us")

    checks = []
    by = {(c["tp"], c["layout"], c["kv"], c["rows"], c["B"]): c for c in res["cases"]}
    for (tp, layout, kv, rk, b), c in by.items():
        if rk != "saturated":
            continue
        p, up, pp, js = us(c, "paged"), us(c, "upstream-step"), us(c, "pallas-paged"), us(c, "jax-step")
        tag = f"{tp} {layout} {kv} B={b}"
        if kv == "bf16" and p and up:
            need = 2.5 if layout == "slots" else 2.0
            checks.append((f"paged >= {need}x upstream-step, {tag}", up / p, need))
        if kv == "bf16" and p and b == 128:
            checks.append((f"paged % copy bw >= 85, {tag}", c["providers"]["paged"]["pct_copy_bw"], 85.0))
        other = by.get((tp, layout, "bf16", rk, b))
        if kv == "fp8" and b >= 64 and p and other and us(other, "paged"):
            checks.append((f"fp8 pool >= 1.6x bf16 pool, {tag}", us(other, "paged") / p, 1.6))
        if kv == "bf16" and pp and js:
            checks.append((f"pallas-paged >= 3x jax-step, {tag}", js / pp, 3.0))
        if kv == "bf16" and pp and p and b >= 16:
            checks.append((f"pallas-paged >= 0.85x paged, {tag}", p / pp, 0.85))
    rows = [{"check": n, "value": v, "threshold": t, "pass": v >= t} for n, v, t in checks]
    for r in rows:
        print(f"{'PASS' if r['pass'] else 'FAIL'} {r['check']}: {r['value']:.2f}")
    return {"checks": rows, "all_pass": all(r["pass"] for r in rows) if rows else None}


def _csv(text, allowed, cast=str):
    items = [cast(x.strip()) for x in text.split(",") if x.strip()]
    bad = [x for x in items if allowed is not None and x not in allowed]
    if bad:
        raise SystemExit(f"decode_pool: unknown {bad}; allowed {list(allowed)}")
    return items


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True, help="output JSON path")
    ap.add_argument("--tps", default="TP1,TP2,TP4")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--layouts", default="pages,slots")
    ap.add_argument("--kv", default="bf16,fp8")
    ap.add_argument("--rows", default="saturated,short,mtp")
    ap.add_argument("--providers", default=",".join(PROVIDERS))
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--pool-slots", type=int, default=2_200_000)
    ap.add_argument("--smoke-cpu", action="store_true",
                    help="tiny shapes on the CPU interpreters (exercises the code paths)")
    a = ap.parse_args(argv)
    kw = dict(tps=_csv(a.tps, TP), batches=_csv(a.batches, None, int),
              layouts=_csv(a.layouts, ("pages", "slots")), kvs=_csv(a.kv, ("bf16", "fp8")),
              rows=_csv(a.rows, ("saturated", "short", "mtp")),
              providers=_csv(a.providers, PROVIDERS), rounds=a.rounds, pool_slots=a.pool_slots)
    if a.smoke_cpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        kw.update(tps=["TP2"], batches=[2], layouts=["pages"], kvs=["bf16"], rows=["saturated"],
                  rounds=1, pool_slots=4096, smoke=True,
                  providers=[p for p in kw["providers"] if p in ("jax-step", "paged",
                                                                  "pallas-paged")])
    return run(json_path=a.json, **kw)


if __name__ == "__main__":
    main()
