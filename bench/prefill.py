"""Sparse prefill benchmark on one GPU: ours vs upstream SGLang 0.5.23 vs gather + dense attention.

Usage (GPU; writes JSON under $OUT, default ./out):
  python -m bench.prefill                       # 8192-row matrix + query-count sweep + paged
  python -m bench.prefill --matrix-only         # only the 8192-row matrix
  python -m bench.prefill --geometry 16,64,4,2  # add a forced-geometry provider (repeatable)
  python -m bench.prefill --sweep-geometry      # BLOCK_N x warps x stages grid for the SM90 table
  python -m bench.prefill --providers upstream-chunk,ours,"ours[64,4,2]" --json F --plot F.png
                                                # choose and order the providers; ratios
                                                # (speedup_vs_first) against the first listed

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

``--providers`` picks and orders them (``provider_names`` lists every name; ``ours[...]`` with a
geometry not given by ``--geometry`` adds it). Each case records ``first_provider``, the first
listed provider the section has (the matrix and the query sweep share names; the paged section has
its own), and every result ``speedup_vs_first`` = that provider's ms / this one's (> 1: faster),
only when the first provider ran on the case; ``speedup_vs_upstream`` (issue 4 targets) stays.

Reported per provider: ms, gathered bytes (valid entries x D x bytes x 2 for K and V, per KV head),
effective gather rate (TB/s, bytes / time: a rate above HBM bandwidth means L2 hits), and useful
TFLOP/s (4 x G x D flops per valid entry per KV head), and the gather rate as a percentage of the
device-to-device copy bandwidth measured at the start (``pct_copy_bw``; above 100 means cache hits).
"""

from __future__ import annotations

import argparse
import importlib
import math
import statistics
import sys
import time

import torch

from bench.common import (ProviderError, now_iso, order_providers, out_dir, parse_providers,
                          speedup_vs_first, time_interleaved, write_json)
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


def add_rates(res: dict, timing: dict, metrics: dict, *, first: str | None = None,
              copy_bw: float | None = None) -> dict:
    """Fill ``res`` (``{provider: check dict}``, from ``measure``) with the timings (pure; the
    tests call it with fake timings): ``ms``, ``gather_tb_s``, ``tflop_s``, ``pct_copy_bw`` (with
    ``copy_bw`` in bytes/s) and ``speedup_vs_first`` = ms of ``first`` / ms (when ``first`` was
    timed). A timing entry with ``error`` is merged as it is. Returns ``res``."""
    for name, t in timing.items():
        entry = res.setdefault(name, {})
        if "median_us" not in t:
            entry.update(t)
            continue
        ms = t["median_us"] / 1e3
        entry.update(t, ms=ms, gather_tb_s=metrics["gathered_bytes"] / (ms * 1e-3) / 1e12,
                     tflop_s=metrics["flops"] / (ms * 1e-3) / 1e12)
        if copy_bw:
            entry["pct_copy_bw"] = 100 * metrics["gathered_bytes"] / (ms * 1e-3) / copy_bw
    vs = speedup_vs_first({n: r.get("ms") for n, r in res.items()}, first)
    for name, x in vs.items():
        res[name]["speedup_vs_first"] = x
    return res


def row_record(case: dict, res: dict, *, baseline: str | None, first: str | None,
               **extra) -> dict:
    """One row of ``matrix`` / ``query_sweep`` / ``paged`` (pure): the case description, the
    results, ``first_provider`` and ``speedup_vs_upstream`` = ms of ``baseline`` / ms of ours."""
    up = res.get(baseline, {}).get("ms") if baseline else None
    ours = res.get("ours", {}).get("ms")
    return {"case": case, "results": res, "baseline": baseline, "first_provider": first,
            "speedup_vs_upstream": (up / ours) if up and ours else None, **extra}


def measure(c: Case, providers: dict, *, rounds: int = 15, ref=None, check: bool = True,
            use_cuda_graph: bool = True, first: str | None = None,
            copy_bw: float | None = None) -> tuple[dict, list[str]]:
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
        add_rates(res, timing, case_metrics(c), first=first, copy_bw=copy_bw)
    return res, bad


def _ours(c: Case) -> callable:
    return lambda: c.run()


def _ours_rowsum(c: Case) -> callable:
    """``ours`` with the per-tile softmax row sum (``qsa_triton.prefill.DEFER_ROWSUM = False``,
    the kernel before prefill v1.5), for the A/B of that change in one process: the flag is
    read at launch, so a graph captured inside keeps it."""
    import qsa_triton.prefill as P  # noqa: PLC0415

    def fn():
        old, P.DEFER_ROWSUM = P.DEFER_ROWSUM, False
        try:
            return c.run()
        finally:
            P.DEFER_ROWSUM = old
    return fn


def _describe(c: Case) -> dict:
    import qsa_triton.prefill as P  # noqa: PLC0415

    q_lens = (c.cu_q[1:] - c.cu_q[:-1]).tolist()
    geo = P.prefill_geometry(c.kind, c.q, requests=len(q_lens), max_q=c.max_q,
                             num_kv_heads=c.k.shape[1], width=c.indices.shape[-1])
    return {"kind": c.kind, "hq": c.q.shape[1], "hkv": c.k.shape[1], "d": c.q.shape[2],
            "total_q": c.total_q, "q_lens": q_lens[:8], "kv_lens": c.kv_lens.tolist()[:8],
            "width": c.indices.shape[-1], "kv_dtype": str(c.k.dtype).removeprefix("torch."),
            "geometry": geo, **case_metrics(c)}


def _print_row(label: str, res: dict, base: str | None, first: str | None = None):
    """One line per case: each provider's ms, TB/s, TF/s, its speedup over the first provider
    (``first``) and, when that is another one, over upstream (``base``)."""
    parts = []
    for name, r in res.items():
        if "ms" not in r:
            parts.append(f"{name}: {r.get('error', 'n/a')[:60]}")
            continue
        ratio = ""
        for ref in dict.fromkeys(x for x in (first, base) if x):
            if ref in res and "ms" in res[ref] and name != ref:
                ratio += f" ({res[ref]['ms'] / r['ms']:.2f}x of {ref})"
        flag = "" if r.get("ok", True) else " FAIL"
        parts.append(f"{name} {r['ms']:.3f} ms {r['gather_tb_s']:.1f} TB/s "
                     f"{r['tflop_s']:.0f} TF/s{ratio}{flag}")
    print(f"[prefill] {label}: " + " | ".join(parts), flush=True)


# ------------------------------------------------------------------------------------ providers
PAGED_PROVIDERS = ("ours-paged-prepass", "ours-paged-inline")
PROVIDER_ALIASES = {"dense": "gather-dense", "pairs": "ours-pairs", "quads": "ours-quads",
                    "triton": "ours"}


def _geo_name(geo) -> str:
    return f"ours{list(geo)}"


def provider_names(geometries=((64, 4, 2),), group_geometries=((32, 4, 2),)) -> list[str]:
    """Every provider name the benchmark can time, in its default order: the 8192-row matrix
    and the query sweep (``ours``, upstream's two kernels, the pair/quad kernels and their
    pre-passes, forced geometries, ``pallas``, ``gather-dense``), then the paged section."""
    names = ["ours", "ours-rowsum", "upstream-ordinary", "upstream-chunk"]
    for algo in ("pairs", "quads"):
        names.append(f"ours-{algo}")
        names += [f"ours-{algo}{list(g)}" for g in group_geometries[1:]]
        names += [f"ours-{algo}-tlsort", f"{algo}-union-only"]
    names += [_geo_name(g) for g in geometries]
    names += ["pallas", "gather-dense", *PAGED_PROVIDERS]
    return list(dict.fromkeys(names))


def _forced_geometries_in(text: str | None) -> list[tuple]:
    """``ours[BM,BN,W,S]`` / ``ours[BN,W,S]`` names in a ``--providers`` text, as geometries."""
    import re  # noqa: PLC0415

    out = []
    for m in re.finditer(r"(?:^|,)\s*ours\[\s*([0-9][0-9,\s]*)\]", text or ""):
        geo = tuple(int(x) for x in m.group(1).replace(" ", "").split(",") if x)
        if len(geo) in (3, 4) and geo not in out:
            out.append(geo)
    return out


def select_providers(args) -> list[str] | None:
    """Resolve ``args.providers`` (validated; ``ProviderError`` on an unknown name) and turn on
    what the selection names (``--geometry`` for ``ours[...]``, pallas, gather-dense, the pair
    kernels); sets ``args.selection``. Touches no GPU."""
    for geo in _forced_geometries_in(args.providers):
        if geo not in args.geometry:
            args.geometry.append(geo)
    if not args.geometry:
        # anchors.md: (64, 4, 2) beat upstream's (16, 1, 2) pick by ~6% on 12/1 at 8192 rows
        args.geometry = [(64, 4, 2)]
    try:
        sel = parse_providers(args.providers, provider_names(args.geometry, args.group_geometry),
                              PROVIDER_ALIASES, script="bench/prefill.py")
    except ProviderError as e:
        raise ProviderError(f"{e}; and ours[BM,BN,W,S] / ours[BN,W,S] for any forced "
                            "geometry") from None
    if sel is not None:
        args.pallas = "pallas" in sel
        args.dense = "gather-dense" in sel
        args.pairs = any(n.startswith(("ours-pairs", "ours-quads", "pairs-", "quads-"))
                         for n in sel)
    args.selection = sel
    return sel


def _default_names(args) -> list[str]:
    """The providers a run without ``--providers`` times (``--pallas``, ``--no-dense``,
    ``--no-pairs`` considered), in order."""
    names = provider_names(args.geometry, args.group_geometry)
    drop = {"ours-rowsum"}  # an A/B provider: only when named in --providers
    if not args.pairs:
        drop |= {n for n in names if n.startswith(("ours-pairs", "ours-quads", "pairs-", "quads-"))}
    if not args.pallas:
        drop.add("pallas")
    if not args.dense:
        drop.add("gather-dense")
    return [n for n in names if n not in drop]


def _first(args, paged: bool = False) -> str:
    """The first provider listed for a section (paged or not), default ``ours`` /
    ``ours-paged-prepass``."""
    sel = getattr(args, "selection", None)
    default = PAGED_PROVIDERS[0] if paged else "ours"
    if sel is None:
        return default
    return next((n for n in sel if (n in PAGED_PROVIDERS) == paged), default)


def _wants(args, names) -> bool:
    sel = getattr(args, "selection", None)
    return sel is None or any(n in sel for n in names)


def _select(args, provs: dict) -> dict:
    return order_providers(provs, getattr(args, "selection", None))


def _geomean_vs_first(rows: list) -> dict:
    acc: dict[str, list[float]] = {}
    for r in rows:
        for n, e in r.get("results", {}).items():
            if e.get("speedup_vs_first"):
                acc.setdefault(n, []).append(e["speedup_vs_first"])
    return {n: math.exp(statistics.fmean(math.log(x) for x in v)) for n, v in acc.items()}


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
        _PARTIAL["report"]["geomean_speedup_vs_first_8192"] = _geomean_vs_first(rows)
    write_json(_PARTIAL["path"], _PARTIAL["report"])


def run_matrix(args, up) -> tuple[list, list]:
    """8192 rows, (Hq, Hkv) in PAIRS, KV in KVS: ordinary at 8k (no prefix), chunk at 32k/128k
    (8192 new rows after a prefix); ours vs upstream's matching kernel with its geometry."""
    rows, bad = [], []
    first = _first(args)
    bw = getattr(args, "copy_bw", None)
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
            provs = _case_providers(c, up, args)
            pal = pallas_provider(c) if args.pallas else None
            if pal is not None:
                provs["pallas"] = pal
            if args.dense and kv == 32768:  # context only: its cost does not depend on KV length
                provs["gather-dense"] = gather_dense_provider(c)
            provs = _select(args, provs)
            label = f"{hq}/{hkv} kv={kv} rows={args.rows}"
            if not provs:
                print(f"[prefill] {label}: none of the selected providers applies; skipped")
                del c
                continue
            res, b = measure(c, provs, rounds=args.rounds, first=first, copy_bw=bw)
            bad += [f"{hq}/{hkv} kv={kv} {n}" for n in b]
            _print_row(label, res, base, first)
            rows.append(row_record(_describe(c), res, baseline=base, first=first,
                                   setup_s=time.time() - t0))
            _save_partial("matrix", rows)
            del c
            torch.cuda.empty_cache()
    return rows, bad


def _case_providers(c: Case, up, args) -> dict:
    """ours, upstream's matching kernels, the row-group kernels (``--pairs``) and every forced
    ``--geometry`` for one case: the provider set of the 8192-row matrix and of the row sweep."""
    provs = {"ours": _ours(c)}
    if "ours-rowsum" in (getattr(args, "selection", None) or ()):
        provs["ours-rowsum"] = _ours_rowsum(c)
    provs.update(upstream_providers(up, c))
    if args.pairs:
        provs.update(pairs_providers(c, geometries=args.group_geometry))
    for geo in args.geometry:
        provs[f"ours{list(geo)}"] = forced_provider(c, geo)
    return provs


def run_query_sweep(args, up) -> tuple[list, list]:
    """Query-count sweep 32..8192 rows: one chunk request with a 32k context (the rows select a
    full 2051 columns each, as in chunked prefill), ours vs upstream's chunk kernel."""
    rows, bad = [], []
    first = _first(args)
    bw = getattr(args, "copy_bw", None)
    for hq, hkv in ((12, 1), (6, 1)):  # (24, 2) runs the (12, 1) program per KV head
        for t in args.sweep_rows:
            c = make_case("chunk", hq, hkv, 256, [t], [32768], seed=t + hq, device="cuda")
            provs = _select(args, _case_providers(c, up, args))
            label = f"sweep {hq}/{hkv} rows={t} kv=32768"
            if not provs:
                print(f"[prefill] {label}: none of the selected providers applies; skipped")
                del c
                continue
            res, b = measure(c, provs, rounds=args.rounds, first=first, copy_bw=bw)
            bad += [f"sweep {hq}/{hkv} rows={t} {n}" for n in b]
            _print_row(label, res, "upstream-chunk", first)
            rows.append(row_record(_describe(c), res, baseline="upstream-chunk", first=first))
            _save_partial("query_sweep", rows)
    return rows, bad


def run_paged(args) -> tuple[list, list]:
    """Paged (pool read in place, scattered slot table), bf16 and FP8 pools: pre-pass slot
    resolution vs the inline slot lookup, and the chunk kernel on the same data packed."""
    rows, bad = [], []
    first = _first(args, paged=True)
    bw = getattr(args, "copy_bw", None)
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
        provs = _select(args, provs)
        res, b = measure(c, provs, rounds=args.rounds, first=first, copy_bw=bw)
        bad += [f"paged {n}" for n in b]
        _print_row(f"paged 12/1 kv=32768 {c.k.dtype}", res, None, first)
        rows.append(row_record(_describe(c), res, baseline=None, first=first))
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


def main(argv=None, prog: str | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--json", default=None, metavar="FILE",
                    help="output JSON (default $OUT/prefill_bench.json, or "
                         "$OUT/prefill_geometry_sweep.json with --sweep-geometry)")
    ap.add_argument("--plot", default=None, metavar="PNG",
                    help="also draw the results as a PNG (bench/plot.py: ms and %% of the copy "
                         "bandwidth against query rows, and the matrix as grouped bars; needs "
                         "matplotlib)")
    ap.add_argument("--providers", default=None, metavar="A,B,...",
                    help="providers to time, in this order; ratios 'speedup_vs_first' are against "
                         "the first listed (per section: the paged section has its own names). "
                         "Names: " + ", ".join(provider_names()) + ", ours[BM,BN,W,S] (a forced "
                         "geometry; added to --geometry); aliases: "
                         + ", ".join(f"{k}={v}" for k, v in PROVIDER_ALIASES.items()))
    ap.add_argument("--geometry", type=_geo_arg, action="append", default=[],
                    help="forced geometry BM,BN,W,S (or BN,W,S); repeatable; default 64,4,2")
    ap.add_argument("--matrix-only", action="store_true")
    ap.add_argument("--sweep-only", action="store_true",
                    help="only the query-count sweep (--sweep-rows), with any --geometry")
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
    # every argument is checked before CUDA is touched (exit 2, like argparse)
    try:
        if args.sweep_geometry and (args.providers or args.plot):
            raise ProviderError("bench/prefill.py: --providers and --plot apply to the benchmark, "
                                "not to --sweep-geometry")
        select_providers(args)  # also fills the default --geometry
    except ProviderError as e:
        print(e, file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench.prefill needs a CUDA GPU", file=sys.stderr)
        return 2
    from bench.common import gpu_name  # noqa: PLC0415
    from interop.geometry import SM90_TABLE_STATUS  # noqa: PLC0415
    import triton  # noqa: PLC0415

    meta = {"gpu": gpu_name(), "date": now_iso(), "torch": torch.__version__,
            "triton": triton.__version__, "sm90_table_status": SM90_TABLE_STATUS}
    json_path = args.json or (out_dir() / ("prefill_geometry_sweep.json" if args.sweep_geometry
                                           else "prefill_bench.json"))
    t0 = time.time()
    _PARTIAL.update(report={"meta": meta, "partial": True}, path=json_path)
    if args.sweep_geometry:
        sweep = run_geometry_sweep(args)
        path = write_json(json_path, {"meta": meta, **sweep, "wall_s": time.time() - t0})
        print(f"[sweep] recommended SM90 table: {sweep['recommended_sm90_table']}")
        print(f"[sweep] wrote {path} in {time.time() - t0:.0f} s")
        return 0
    try:
        from bench.common import copy_bandwidth_bytes_per_s  # noqa: PLC0415

        args.copy_bw = copy_bandwidth_bytes_per_s(torch.device("cuda"))
    except Exception as e:  # noqa: BLE001 - the percentages are extra; the timings are not
        print(f"[prefill] copy bandwidth not measured: {e}", file=sys.stderr)
        args.copy_bw = None
    sel = args.selection
    meta.update(copy_bandwidth_Bps=args.copy_bw,
                providers=sel if sel is not None else _default_names(args),
                first_provider=_first(args), first_provider_paged=_first(args, paged=True),
                method="providers interleaved round-robin in one process on the same inputs, "
                       "CUDA-graph replay, median of CUDA-event timings; every provider checked "
                       "against a float32 reference on every run")
    if args.copy_bw:
        print(f"[prefill] copy bandwidth {args.copy_bw / 1e12:.2f} TB/s (read + written)")
    print(f"[prefill] providers: {', '.join(meta['providers'])}; ratios against "
          f"{meta['first_provider']} (paged: {meta['first_provider_paged']})")
    up = _upstream()
    matrix_names = [n for n in provider_names(args.geometry, args.group_geometry)
                    if n not in PAGED_PROVIDERS]
    matrix, bad = (run_matrix(args, up) if _wants(args, matrix_names) and not args.sweep_only
                   else ([], []))
    speeds = [r["speedup_vs_upstream"] for r in matrix if r["speedup_vs_upstream"]]
    geo = math.exp(statistics.fmean(math.log(s) for s in speeds)) if speeds else None
    report = {"meta": meta, "matrix": matrix, "geomean_speedup_vs_upstream_8192": geo,
              "geomean_speedup_vs_first_8192": _geomean_vs_first(matrix)}
    for algo in ("pairs", "quads"):
        ps = [r["results"][r["baseline"]]["ms"] / r["results"][f"ours-{algo}"]["ms"] for r in matrix
              if "ms" in r["results"].get(f"ours-{algo}", {})
              and "ms" in r["results"].get(r["baseline"], {})]
        key = f"{algo}_geomean_speedup_vs_upstream_8192"
        report[key] = math.exp(statistics.fmean(math.log(x) for x in ps)) if ps else None
        print(f"[prefill] {algo} geomean vs upstream: {report[key]}")
    if not args.matrix_only:
        report["query_sweep"], b2 = (run_query_sweep(args, up) if _wants(args, matrix_names)
                                     else ([], []))
        report["geomean_speedup_vs_first_sweep"] = _geomean_vs_first(report["query_sweep"])
        report["paged"], b3 = (run_paged(args) if _wants(args, PAGED_PROVIDERS)
                               and not args.sweep_only else ([], []))
        bad += b2 + b3
        slow = [(r["case"]["hq"], r["case"]["total_q"], r["speedup_vs_upstream"])
                for r in report["query_sweep"]
                if r["case"]["total_q"] >= 512 and r["speedup_vs_upstream"]
                and r["speedup_vs_upstream"] < 1.0]
        report["slower_than_upstream_at_ge_512_rows"] = slow
    report["failed_tolerance"] = bad
    report["wall_s"] = time.time() - t0
    path = write_json(json_path, report)
    print(f"[prefill] geomean speedup vs upstream at {args.rows} rows: "
          f"{geo if geo is None else round(geo, 3)}; vs {meta['first_provider']}: "
          f"{ {n: round(x, 3) for n, x in report['geomean_speedup_vs_first_8192'].items()} }; "
          f"failed tolerance: {bad or 'none'}; wrote {path} in {report['wall_s']:.0f} s")
    rc = 1 if bad else 0
    if args.plot:
        from bench.plot import try_plot  # noqa: PLC0415

        rc = rc or (0 if try_plot("prefill", report, args.plot, path) else 1)
    return rc


if __name__ == "__main__":
    sys.exit(main())
