"""Sparse prefill benchmark on one GPU: ours vs upstream SGLang 0.5.23 vs gather + dense attention.

Usage (GPU; writes JSON under $OUT, default ./out):
  python -m bench.prefill                       # 8192-row matrix + query-count sweep + paged
  python -m bench.prefill --matrix-only         # only the 8192-row matrix
  python -m bench.prefill --geometry 16,64,4,2  # add a forced-geometry provider (repeatable)
  python -m bench.prefill --sweep-geometry      # BLOCK_N x warps x stages grid for the SM90 table

Method (``docs/anchors.md``, ``bench/common.py``): every provider of one case runs on the same
inputs, interleaved round-robin in one process; each provider's calls are captured into a CUDA
graph and replayed, timed with CUDA events; the median is reported. Every provider's output is
checked against a float32 torch reference on every run (rtol = atol = 2e-2, relative L2 <= 5e-3,
finite); the script exits non-zero past tolerance.

Indices are realistic and block-structured (``interop.indices.prefill_indices``: 512 blocks of 4
tokens plus the causal tail, adjacent rows sharing ~90% of their blocks), padding -1 (upstream's
kernels only mask idx < 0).

Providers: ``ours`` (public entry point, selector geometry), ``ours[BN, W, S]`` (forced
geometry; (64, 4, 2) by default), ``ours-pairs*`` (the experimental pair kernels) and
``pairs-union-only`` (their pre-pass alone), ``upstream-ordinary`` / ``upstream-chunk`` (SGLang
0.5.23 with its own table geometry; on an H200 its ``"H20" in device_name`` test picks the H20
table), ``gather-dense`` (torch gather + SDPA, context, KV 32k only), ``pallas`` (``--pallas``).

Reported per provider: ms, gathered bytes (valid entries x D x bytes x 2 for K and V, per KV head),
effective gather rate (TB/s, bytes / time: a rate above HBM bandwidth means L2 hits), and useful
TFLOP/s (4 x G x D flops per valid entry per KV head).
"""

from __future__ import annotations

import argparse
import importlib
import math
import statistics
import sys
import time

import torch

from bench.common import out_dir, time_interleaved, write_json
from bench.prefill_cases import Case, errors, make_case, reference_f32, within_tolerance

PAIRS = ((6, 1), (12, 1), (24, 2))
KVS = (8192, 32768, 131072)


# ------------------------------------------------------------------------------------ providers
def _upstream():
    try:
        from interop.peer import load_sparse_attn  # noqa: PLC0415

        return load_sparse_attn()
    except Exception as e:  # noqa: BLE001 - optional peer
        print(f"[prefill] upstream peer unavailable: {e}", file=sys.stderr)
        return None


def _scale(c: Case) -> float:
    return c.softmax_scale if c.softmax_scale is not None else c.q.shape[-1] ** -0.5


def upstream_providers(up, c: Case) -> dict:
    """Upstream's kernels with upstream's own (H20/L20 table) geometry. Only for -1 padding."""
    if up is None or c.kind == "paged":
        return {}
    provs = {}
    sc = _scale(c)
    if c.kind == "ordinary":
        provs["upstream-ordinary"] = lambda: up.sparse_gqa_fwd_interface_triton(
            c.q, c.k, c.v, c.max_q, c.indices, c.cu_q, sc)
        q_lens = (c.cu_q[1:] - c.cu_q[:-1]).contiguous()
        provs["upstream-chunk"] = lambda: up.sparse_gqa_fwd_interface_triton_ck(
            c.q, c.k, c.v, c.indices, c.cu_q, c.cu_q, q_lens, sc, max_q=c.max_q)
    else:
        provs["upstream-chunk"] = lambda: up.sparse_gqa_fwd_interface_triton_ck(
            c.q, c.k, c.v, c.indices, c.cu_q, c.cu_k, c.kv_lens, sc, max_q=c.max_q)
    return provs


def forced_provider(c: Case, geo) -> callable:
    """Our kernel with a forced (BLOCK_M, BLOCK_N, num_warps, num_stages) or (BLOCK_N, warps,
    stages) geometry (bypasses the selector; same contract check)."""
    import qsa_triton.prefill as P  # noqa: PLC0415

    sc = _scale(c)
    if c.kind == "ordinary":
        return lambda: P._prefill_impl(c.q, c.k, c.v, c.indices, c.cu_q, c.max_q, sc, geometry=geo)
    if c.kind == "chunk":
        return lambda: P._chunk_impl(c.q, c.k, c.v, c.indices, c.cu_q, c.cu_k, c.kv_lens, c.max_q,
                                     sc, c.k_scale, c.v_scale, geometry=geo)
    return lambda: P._paged_impl(c.q, c.k, c.v, c.slot_table, c.indices, c.cu_q, c.kv_lens,
                                 c.max_q, sc, c.k_scale, c.v_scale, geometry=geo)


def _with_env(name: str, value: str, fn):
    """Call fn with an environment variable set (read by the kernels' host code at call time;
    CUDA-graph capture records the kernels that call launched)."""
    import os  # noqa: PLC0415

    old = os.environ.get(name)
    os.environ[name] = value
    try:
        return fn()
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def pairs_providers(c: Case, geometries=((32, 4, 2),), algos=("pairs", "quads")) -> dict:
    """The experimental row-group kernels (``qsa_triton/prefill_pairs.py``: 2 rows,
    ``prefill_quads.py``: 4 rows) at the given (BLOCK_N, warps, stages), and their union
    pre-passes alone (to see their share)."""
    from qsa_triton import prefill_pairs as PP  # noqa: PLC0415
    from qsa_triton import prefill_quads as PQ  # noqa: PLC0415

    if c.indices.shape[-1] > PP.MAX_PAIR_WIDTH:
        return {}
    sc = _scale(c)
    kw = dict(cu_seqlens_k=c.cu_k if c.kind == "chunk" else None,
              kv_lens=None if c.kind == "ordinary" else c.kv_lens, slot_table=c.slot_table,
              max_seqlen_q=c.max_q, softmax_scale=sc, k_scale=c.k_scale, v_scale=c.v_scale)
    mode = {"ordinary": 0, "chunk": 1, "paged": 2}[c.kind]
    base = c.cu_k if c.kind == "chunk" else c.cu_q
    lens = c.kv_lens if c.kind != "ordinary" else c.cu_q
    table = c.slot_table if c.slot_table is not None else c.cu_q
    provs = {}
    for algo in algos:
        fwd = PP.pairs_forward if algo == "pairs" else PQ.quads_forward
        for i, geo in enumerate(geometries):
            name = f"ours-{algo}" if i == 0 else f"ours-{algo}{list(geo)}"
            provs[name] = (lambda geo=geo, fwd=fwd: fwd(c.kind, c.q, c.k, c.v, c.indices, c.cu_q,
                                                        geometry=geo, **kw))
        # the same with tl.sort inside the union pre-pass instead of the torch.sort pre-sort
        pre = PP if algo == "pairs" else PQ
        provs[f"ours-{algo}-tlsort"] = (
            lambda fwd=fwd, pre=pre: _with_env("QSA_GROUP_SORT", "kernel", lambda: fwd(
                c.kind, c.q, c.k, c.v, c.indices, c.cu_q, geometry=geometries[0], **kw)))
        if algo == "pairs":
            provs["pairs-union-only"] = lambda: PP.pair_union(mode, c.indices, c.cu_q, base, lens,
                                                              table, c.max_q)
        else:
            provs["quads-union-only"] = lambda: PQ.quad_union(mode, c.indices, c.cu_q, base, lens,
                                                              table, c.max_q)
    return provs


def gather_dense_provider(c: Case, rows_per_step: int = 256) -> callable:
    """Context: materialise each row's selected K/V (torch gather) and run SDPA with a key mask
    (``qsa-contract.md`` calls this the "synthetic" column upstream reports)."""
    import torch.nn.functional as F  # noqa: PLC0415

    t, hq, d = c.q.shape
    hkv = c.k.shape[1]
    g = hq // hkv
    sc = _scale(c) * c.k_scale
    req = torch.repeat_interleave(torch.arange(c.cu_q.numel() - 1, device=c.q.device),
                                  (c.cu_q[1:] - c.cu_q[:-1]).long())
    if c.kind == "ordinary":
        bound = (c.cu_q[1:] - c.cu_q[:-1]).long()[req]
        base = c.cu_q.long()[req]
    else:
        bound = c.kv_lens.long()[req]
        base = c.cu_k.long()[req] if c.kind == "chunk" else None
    heads = torch.arange(hkv, device=c.q.device)

    def run():
        out = torch.empty_like(c.q)
        for s in range(0, t, rows_per_step):
            e = min(t, s + rows_per_step)
            ii = c.indices[s:e].long()
            if ii.dim() == 2:
                ii = ii[:, None, :].expand(-1, hkv, -1)
            ok = (ii >= 0) & (ii < bound[s:e, None, None])
            pos = torch.where(ok, ii, 0)
            phys = c.slot_table.long()[req[s:e, None, None], pos] if base is None else base[s:e, None, None] + pos
            kk = c.k[phys, heads[None, :, None]].to(c.q.dtype)
            vv = c.v[phys, heads[None, :, None]].to(c.q.dtype)
            mask = ok.repeat_interleave(g, dim=1)[:, :, None, :]
            o = F.scaled_dot_product_attention(c.q[s:e, :, None, :], kk, vv, attn_mask=mask,
                                               scale=sc, enable_gqa=True)
            out[s:e] = (o[:, :, 0, :] * c.v_scale).to(out.dtype)
        return out

    return run


def pallas_provider(c: Case):
    """``bench.pallas_prefill_provider.make_provider(case)`` when the Pallas helper's module
    exists (returns a zero-argument callable, or None)."""
    try:
        mod = importlib.import_module("bench.pallas_prefill_provider")
    except Exception:  # noqa: BLE001 - optional
        return None
    try:
        return mod.make_provider(c)
    except Exception as e:  # noqa: BLE001
        print(f"[prefill] pallas provider failed to build: {e}", file=sys.stderr)
        return None


# ------------------------------------------------------------------------------------ metrics
def case_metrics(c: Case) -> dict:
    valid = c.valid_entries()  # per KV head
    d = c.q.shape[-1]
    g = c.q.shape[1] // c.k.shape[1]
    return {"valid_entries": valid, "gathered_bytes": valid * d * c.k.element_size() * 2,
            "flops": 4 * g * d * valid}


def measure(c: Case, providers: dict, *, rounds: int = 15, ref=None, check: bool = True,
            use_cuda_graph: bool = True) -> tuple[dict, list[str]]:
    """Check every provider against the float32 reference, then time them interleaved.

    Returns (results by provider, names of providers past tolerance)."""
    ref = reference_f32(c) if ref is None and check else ref
    res, bad = {}, []
    for name, fn in list(providers.items()):
        try:
            out = fn()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - a provider that cannot run this case
            res[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            providers.pop(name)
            continue
        if check and not name.endswith("-only"):
            err = errors(out.float(), ref)
            res[name] = {"check": err, "ok": within_tolerance(err)}
            if not res[name]["ok"]:
                bad.append(name)
        else:
            res[name] = {}
    if providers:
        # a provider that cannot be captured into a CUDA graph (the JAX/Pallas one) makes the
        # whole case eager, so its providers stay interleaved on equal terms (ms-scale kernels:
        # launch overhead is noise here)
        graphs = use_cuda_graph and all(getattr(f, "cuda_graph_capturable", True)
                                        for f in providers.values())
        timing = time_interleaved(providers, use_cuda_graph=graphs, rounds=rounds)
        for t in timing.values():
            t["cuda_graph"] = graphs
        m = case_metrics(c)
        for name, t in timing.items():
            ms = t["median_us"] / 1e3
            res[name].update(t, ms=ms, gather_tb_s=m["gathered_bytes"] / (ms * 1e-3) / 1e12,
                             tflop_s=m["flops"] / (ms * 1e-3) / 1e12)
    return res, bad


def _ours(c: Case) -> callable:
    return lambda: c.run()


def _describe(c: Case) -> dict:
    import qsa_triton.prefill as P  # noqa: PLC0415

    q_lens = (c.cu_q[1:] - c.cu_q[:-1]).tolist()
    geo = P.prefill_geometry(c.kind, c.q, requests=len(q_lens), max_q=c.max_q,
                             num_kv_heads=c.k.shape[1], width=c.indices.shape[-1])
    return {"kind": c.kind, "hq": c.q.shape[1], "hkv": c.k.shape[1], "d": c.q.shape[2],
            "total_q": c.total_q, "q_lens": q_lens[:8], "kv_lens": c.kv_lens.tolist()[:8],
            "width": c.indices.shape[-1], "kv_dtype": str(c.k.dtype).removeprefix("torch."),
            "geometry": geo, **case_metrics(c)}


def _print_row(label: str, res: dict, base: str | None):
    parts = []
    for name, r in res.items():
        if "ms" not in r:
            parts.append(f"{name}: {r.get('error', 'n/a')[:60]}")
            continue
        ratio = ""
        if base and base in res and "ms" in res[base] and name != base:
            ratio = f" ({res[base]['ms'] / r['ms']:.2f}x of {base})"
        flag = "" if r.get("ok", True) else " FAIL"
        parts.append(f"{name} {r['ms']:.3f} ms {r['gather_tb_s']:.1f} TB/s "
                     f"{r['tflop_s']:.0f} TF/s{ratio}{flag}")
    print(f"[prefill] {label}: " + " | ".join(parts), flush=True)


# ------------------------------------------------------------------------------------ runs
_PARTIAL: dict = {}


def _save_partial(section: str, rows: list):
    """Rewrite the partial report after every case, so a timed-out run still leaves its data."""
    if not _PARTIAL:
        return
    _PARTIAL["report"][section] = rows
    if section == "matrix":
        sp = [r["speedup_vs_upstream"] for r in rows if r.get("speedup_vs_upstream")]
        _PARTIAL["report"]["geomean_speedup_vs_upstream_8192"] = (
            math.exp(statistics.fmean(math.log(x) for x in sp)) if sp else None)
    write_json(_PARTIAL["path"], _PARTIAL["report"])


def run_matrix(args, up) -> tuple[list, list]:
    """8192 rows, (Hq, Hkv) in PAIRS, KV in KVS: ordinary at 8k (no prefix), chunk at 32k/128k
    (8192 new rows after a prefix); ours vs upstream's matching kernel with its geometry."""
    rows, bad = [], []
    for hq, hkv in PAIRS:
        for kv in KVS:
            t0 = time.time()
            if kv == args.rows:
                c = make_case("ordinary", hq, hkv, 256, [args.rows], seed=hq + kv % 1000,
                              device="cuda")
                base = "upstream-ordinary"
            else:
                c = make_case("chunk", hq, hkv, 256, [args.rows], [kv], seed=hq + kv % 1000,
                              device="cuda")
                base = "upstream-chunk"
            provs = {"ours": _ours(c)}
            provs.update(upstream_providers(up, c))
            if args.pairs:
                provs.update(pairs_providers(c, geometries=args.group_geometry))
            for geo in args.geometry:
                provs[f"ours{list(geo)}"] = forced_provider(c, geo)
            pal = pallas_provider(c) if args.pallas else None
            if pal is not None:
                provs["pallas"] = pal
            if args.dense and kv == 32768:  # context only: its cost does not depend on KV length
                provs["gather-dense"] = gather_dense_provider(c)
            res, b = measure(c, provs, rounds=args.rounds)
            bad += [f"{hq}/{hkv} kv={kv} {n}" for n in b]
            label = f"{hq}/{hkv} kv={kv} rows={args.rows}"
            _print_row(label, res, base)
            speed = (res[base]["ms"] / res["ours"]["ms"]) if base in res and "ms" in res.get(base, {}) \
                and "ms" in res["ours"] else None
            rows.append({"case": _describe(c), "results": res, "baseline": base,
                         "speedup_vs_upstream": speed, "setup_s": time.time() - t0})
            _save_partial("matrix", rows)
            del c
            torch.cuda.empty_cache()
    return rows, bad


def run_query_sweep(args, up) -> tuple[list, list]:
    """Query-count sweep 32..8192 rows: one chunk request with a 32k context (the rows select a
    full 2051 columns each, as in chunked prefill), ours vs upstream's chunk kernel."""
    rows, bad = [], []
    for hq, hkv in ((12, 1), (6, 1)):  # (24, 2) runs the (12, 1) program per KV head
        for t in args.sweep_rows:
            c = make_case("chunk", hq, hkv, 256, [t], [32768], seed=t + hq, device="cuda")
            provs = {"ours": _ours(c)}
            provs.update(upstream_providers(up, c))
            if args.pairs:
                provs.update(pairs_providers(c))
            res, b = measure(c, provs, rounds=args.rounds)
            bad += [f"sweep {hq}/{hkv} rows={t} {n}" for n in b]
            _print_row(f"sweep {hq}/{hkv} rows={t} kv=32768", res, "upstream-chunk")
            speed = (res["upstream-chunk"]["ms"] / res["ours"]["ms"]) if "ms" in res.get(
                "upstream-chunk", {}) and "ms" in res["ours"] else None
            rows.append({"case": _describe(c), "results": res, "speedup_vs_upstream": speed})
            _save_partial("query_sweep", rows)
    return rows, bad


def run_paged(args) -> tuple[list, list]:
    """Paged (pool read in place, scattered slot table), bf16 and FP8 pools: pre-pass slot
    resolution vs the inline slot lookup, and the chunk kernel on the same data packed."""
    rows, bad = [], []
    for kv_dtype in (None, torch.float8_e4m3fn):
        c = make_case("paged", 12, 1, 256, [args.rows], [32768], kv_dtype=kv_dtype,
                      pool_slack=4096, seed=5, device="cuda")
        import qsa_triton.prefill as P  # noqa: PLC0415

        sc = _scale(c)
        provs = {
            "ours-paged-prepass": lambda c=c: P._paged_impl(c.q, c.k, c.v, c.slot_table, c.indices,
                                                            c.cu_q, c.kv_lens, c.max_q, sc, 1.0,
                                                            1.0, inline_slots=False),
            "ours-paged-inline": lambda c=c: P._paged_impl(c.q, c.k, c.v, c.slot_table, c.indices,
                                                           c.cu_q, c.kv_lens, c.max_q, sc, 1.0,
                                                           1.0, inline_slots=True),
        }
        res, b = measure(c, provs, rounds=args.rounds)
        bad += [f"paged {n}" for n in b]
        _print_row(f"paged 12/1 kv=32768 {c.k.dtype}", res, "ours-paged-prepass")
        rows.append({"case": _describe(c), "results": res})
    return rows, bad


def _geo_grid(args):
    for bn in args.sweep_block_n:
        for nw in args.sweep_warps:
            for ns in args.sweep_stages:
                # deeper pipelines only where they are cheap in shared memory
                if ns > 2 and (bn > 32 or nw not in (2, 4)):
                    continue
                yield (bn, nw, ns)


def run_geometry_sweep(args) -> dict:
    """BLOCK_N x warps x stages at several total_q (chunk, 32k context, G 6 and 12): the data
    for the SM90 table. Each (G, total_q) point times every configuration interleaved; the
    recommendation per total_q is the configuration with the best geometric mean over G."""
    import qsa_triton.prefill as P  # noqa: PLC0415

    points, skipped = [], {}
    for hq in args.sweep_groups:
        for t in args.sweep_total_q:
            c = make_case("chunk", hq, 1, 256, [t], [32768], seed=t + hq, device="cuda")
            ref = reference_f32(c)
            provs = {}
            for geo in _geo_grid(args):
                fn = forced_provider(c, geo)
                try:
                    fn()
                    torch.cuda.synchronize()
                except Exception as e:  # noqa: BLE001 - out of resources etc.
                    skipped[str(geo)] = f"{type(e).__name__}: {str(e)[:120]}"
                    continue
                provs[",".join(map(str, geo))] = fn
            res, bad = measure(c, provs, rounds=args.sweep_rounds, ref=ref)
            timed = {k: v["ms"] for k, v in res.items() if "ms" in v and v.get("ok", True)}
            best = min(timed, key=timed.get) if timed else None
            table_geo = P.prefill_geometry("chunk", c.q, requests=1, max_q=t, num_kv_heads=1,
                                           width=c.indices.shape[-1])
            tg = f"{table_geo.block_n},{table_geo.num_warps},{table_geo.num_stages}"
            print(f"[sweep] G={hq} total_q={t}: best {best} {timed.get(best, float('nan')):.4f} ms;"
                  f" current table {tg} {timed.get(tg, float('nan')):.4f} ms", flush=True)
            points.append({"group": hq, "total_q": t, "ms": timed, "best": best,
                           "current_table": tg, "failed_check": bad})
            _save_partial("points", points)
            del c
    rec = []
    for t in args.sweep_total_q:
        pts = [p for p in points if p["total_q"] == t]
        common = set.intersection(*(set(p["ms"]) for p in pts)) if pts else set()
        if not common:
            continue
        gm = {k: math.exp(statistics.fmean(math.log(p["ms"][k]) for p in pts)) for k in common}
        best = min(gm, key=gm.get)
        rec.append((t, tuple(int(x) for x in best.split(",")), gm[best]))
    table = []
    for i, (t, cfg, _) in enumerate(rec):
        bound = None if i == len(rec) - 1 else t
        if table and table[-1][1] == cfg:
            table[-1] = (bound, cfg)
        else:
            table.append((bound, cfg))
    return {"grid": {"block_n": args.sweep_block_n, "warps": args.sweep_warps,
                     "stages": args.sweep_stages}, "points": points, "skipped": skipped,
            "recommended_by_total_q": rec, "recommended_sm90_table": table}


def _geo_arg(text: str):
    parts = tuple(int(x) for x in text.split(","))
    if len(parts) not in (3, 4):
        raise argparse.ArgumentTypeError("--geometry wants BM,BN,W,S or BN,W,S")
    return parts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--geometry", type=_geo_arg, action="append", default=[],
                    help="forced geometry BM,BN,W,S (or BN,W,S); repeatable; default 64,4,2")
    ap.add_argument("--matrix-only", action="store_true")
    ap.add_argument("--no-dense", dest="dense", action="store_false",
                    help="skip the gather + SDPA context provider")
    ap.add_argument("--pallas", dest="pallas", action="store_true",
                    help="add the Pallas provider (bench.pallas_prefill_provider) to the 8192-row "
                         "matrix; off by default (its JAX compiles do not fit the 8-minute run)")
    ap.add_argument("--no-pallas", dest="pallas", action="store_false")
    ap.add_argument("--no-pairs", dest="pairs", action="store_false",
                    help="skip the experimental pair/quad kernels (qsa_triton/prefill_pairs.py, "
                         "prefill_quads.py)")
    ap.add_argument("--group-geometry", type=_geo_arg, action="append", default=[],
                    help="BLOCK_N,warps,stages for the pair/quad kernels (repeatable; default "
                         "32,4,2)")
    ap.add_argument("--sweep-rows", type=lambda s: [int(x) for x in s.split(",")],
                    default=[32, 128, 512, 2048, 8192])
    ap.add_argument("--sweep-geometry", action="store_true",
                    help="only the BLOCK_N x warps x stages sweep (SM90 table data)")
    ap.add_argument("--sweep-block-n", type=lambda s: [int(x) for x in s.split(",")],
                    default=[16, 32, 64])
    ap.add_argument("--sweep-warps", type=lambda s: [int(x) for x in s.split(",")],
                    default=[1, 2, 4, 8])
    ap.add_argument("--sweep-stages", type=lambda s: [int(x) for x in s.split(",")],
                    default=[2, 3])
    ap.add_argument("--sweep-groups", type=lambda s: [int(x) for x in s.split(",")],
                    default=[12])
    ap.add_argument("--sweep-total-q", type=lambda s: [int(x) for x in s.split(",")],
                    default=[32, 64, 128, 256, 512, 1024, 2048, 8192])
    ap.add_argument("--sweep-rounds", type=int, default=7)
    args = ap.parse_args(argv)
    if not args.group_geometry:
        args.group_geometry = [(32, 4, 2)]
    if not args.geometry:
        # anchors.md: (64, 4, 2) beat upstream's (16, 1, 2) pick by ~6% on 12/1 at 8192 rows
        args.geometry = [(64, 4, 2)]
    if not torch.cuda.is_available():
        print("bench.prefill needs a CUDA GPU", file=sys.stderr)
        return 2
    from bench.common import gpu_name  # noqa: PLC0415
    from interop.geometry import SM90_TABLE_STATUS  # noqa: PLC0415
    import triton  # noqa: PLC0415

    meta = {"gpu": gpu_name(), "torch": torch.__version__, "triton": triton.__version__,
            "sm90_table_status": SM90_TABLE_STATUS}
    out = out_dir()
    t0 = time.time()
    _PARTIAL.update(report={"meta": meta, "partial": True},
                    path=out / ("prefill_geometry_sweep.json" if args.sweep_geometry
                                else "prefill_bench.json"))
    if args.sweep_geometry:
        sweep = run_geometry_sweep(args)
        path = write_json(out / "prefill_geometry_sweep.json", {"meta": meta, **sweep,
                                                                "wall_s": time.time() - t0})
        print(f"[sweep] recommended SM90 table: {sweep['recommended_sm90_table']}")
        print(f"[sweep] wrote {path} in {time.time() - t0:.0f} s")
        return 0
    up = _upstream()
    matrix, bad = run_matrix(args, up)
    speeds = [r["speedup_vs_upstream"] for r in matrix if r["speedup_vs_upstream"]]
    geo = math.exp(statistics.fmean(math.log(s) for s in speeds)) if speeds else None
    report = {"meta": meta, "matrix": matrix, "geomean_speedup_vs_upstream_8192": geo}
    for algo in ("pairs", "quads"):
        ps = [r["results"][r["baseline"]]["ms"] / r["results"][f"ours-{algo}"]["ms"] for r in matrix
              if "ms" in r["results"].get(f"ours-{algo}", {})
              and "ms" in r["results"].get(r["baseline"], {})]
        key = f"{algo}_geomean_speedup_vs_upstream_8192"
        report[key] = math.exp(statistics.fmean(math.log(x) for x in ps)) if ps else None
        print(f"[prefill] {algo} geomean vs upstream: {report[key]}")
    if not args.matrix_only:
        report["query_sweep"], b2 = run_query_sweep(args, up)
        report["paged"], b3 = run_paged(args)
        bad += b2 + b3
        slow = [(r["case"]["hq"], r["case"]["total_q"], r["speedup_vs_upstream"])
                for r in report["query_sweep"]
                if r["case"]["total_q"] >= 512 and r["speedup_vs_upstream"]
                and r["speedup_vs_upstream"] < 1.0]
        report["slower_than_upstream_at_ge_512_rows"] = slow
    report["failed_tolerance"] = bad
    report["wall_s"] = time.time() - t0
    path = write_json(out / "prefill_bench.json", report)
    print(f"[prefill] geomean speedup vs upstream at {args.rows} rows: "
          f"{geo if geo is None else round(geo, 3)}; failed tolerance: {bad or 'none'}; "
          f"wrote {path} in {report['wall_s']:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
