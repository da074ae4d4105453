"""QSA indexer benchmark (issue 18): scoring + exact top-512 + expansion, decode and prefill.

  python3 -m bench.indexer --out PATH.json              decode B 1/16/64/128 x 8k/32k/128k/256k,
                                                        prefill 8192 rows at 32k / 128k (H200)
  python3 -m bench.indexer --out PATH.json --smoke-cpu  tiny shapes on CPU (interpreters), no timing

Providers (same inputs; each computes the 2051-wide token rows):
  * ``triton`` / ``pallas``: ``qsa_{triton,pallas}.indexer_select_{decode,prefill}``;
  * ``torch``: upstream's torch reference path (gather the paged keys, FP32 ``einsum``, ReLU-sum,
    -inf mask, ``torch.topk``, vectorised expansion; prefill rows chunked under upstream's
    128 MiB logits budget); ``xla``: the same in plain JAX (``jnp.einsum`` bf16 -> FP32,
    ``lax.top_k``, ``qsa_pallas.expand_block_indices``);
  * ``floor`` (decode): one read of the visible compressed keys at the copy bandwidth measured in
    this run. %copy = key bytes (visible blocks x 128 x 2 B) / time / copy bandwidth.
Timing: PyTorch as CUDA-graph replays, interleaved (``bench.common.time_interleaved``); JAX as an
unrolled chain of ``--chain`` calls in one ``jax.jit`` (call i+1's lengths depend on call i's
output, values unchanged), median host wall time per call (docs/architecture.md).
Agreement (printed, in the JSON): each provider's block sets against the FP64 reference on
sampled rows (``interop.reference.topk_set_report``: exact / admissible within the FP32
summation bound); pallas vs triton token rows compared whole. Inputs: N(0, 1) bf16.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

H, D, TOPK, RATIO, PAGE = 4, 128, 512, 4, 16
BATCHES = (1, 16, 64, 128)
CONTEXTS = (8192, 32768, 131072, 262144)
PREFILL_CONTEXTS = (32768, 131072)
LOGITS_BUDGET = 128 << 20  # upstream _QSA_PREFILL_LOGITS_BUDGET_BYTES


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="JSON report path")
    p.add_argument("--smoke-cpu", action="store_true", help="tiny shapes on CPU, no timing")
    for name, default in (("--batches", BATCHES), ("--contexts", CONTEXTS),
                          ("--prefill-contexts", PREFILL_CONTEXTS)):
        p.add_argument(name, default=",".join(map(str, default)))
    p.add_argument("--rows", type=int, default=8192, help="prefill query rows")
    p.add_argument("--providers", default="triton,pallas,torch,xla")
    p.add_argument("--chain", type=int, default=20, help="JAX decode calls per jitted chain")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--check-rows", type=int, default=3, help="rows checked against FP64")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    a.topk = 16 if a.smoke_cpu else TOPK  # the smoke run's contexts are tiny
    return a


# Reference-style providers
def torch_expand(blocks, positions, seq_lens):
    """``interop.indices.expand_block_indices`` in torch (cumsum + scatter, graph-safe)."""
    import torch

    m, k = blocks.shape
    b = blocks.long()
    tok = (b[:, :, None] * RATIO + torch.arange(RATIO, device=b.device)).reshape(m, -1)
    tok = torch.where((b >= 0).repeat_interleave(RATIO, 1) & (tok < seq_lens[:, None]), tok, -1)
    vis = positions.long()[:, None] + 1
    start = torch.div(vis, RATIO, rounding_mode="floor") * RATIO
    e = torch.arange(RATIO - 1, device=b.device)[None]
    tail = torch.where((e < vis - start) & (start + e < seq_lens[:, None]), start + e, -1)
    val = torch.cat([tok, tail], 1)
    valid = val >= 0
    cv = valid.long().cumsum(1)
    col = torch.arange(val.shape[1], device=b.device)[None]
    dest = torch.where(valid, cv - 1, cv[:, -1:] + col - cv)
    return torch.empty_like(val).scatter_(1, dest, val).int()


def torch_topk_blocks(logits, k):
    """Top-k ids of -inf-masked logits, ascending, -1 for the masked ones (rows with < k)."""
    import torch

    big = torch.iinfo(torch.int64).max
    vals, ids = torch.topk(logits, min(k, logits.shape[1]), dim=1)
    ids = torch.sort(torch.where(torch.isfinite(vals), ids, big), 1).values
    ids = torch.where(ids == big, -1, ids)
    return torch.nn.functional.pad(ids, (0, k - ids.shape[1]), value=-1).int()


def torch_decode_blocks(q, kc, pt, sl, topk):
    """Upstream ``torch_qsa_mqa_decode`` + top-k (the 1/sqrt(D) scale dropped: order-preserving)."""
    import torch

    b = q.shape[0]
    gathered = kc[pt.long().clamp(0, kc.shape[0] - 1).reshape(-1), :, 0].reshape(b, -1, D)
    scores = torch.einsum("bhd,bnd->bnh", q.float(), gathered.float()).relu_().sum(-1)
    pos = torch.arange(scores.shape[1], device=q.device)[None]
    scores.masked_fill_(pos >= torch.div(sl, RATIO, rounding_mode="floor")[:, None], -float("inf"))
    return torch_topk_blocks(scores, topk)


def torch_prefill_blocks(q, k, rs, re, topk):
    """Upstream ``torch_qsa_mqa_prefill`` + top-k over row chunks under the 128 MiB budget."""
    import torch

    n = k.shape[0]
    chunk = max(1, LOGITS_BUDGET // (4 * max(n, 1)))
    col = torch.arange(n, device=q.device)[None]
    kf = k[:, 0].float()
    outs = []
    for r0 in range(0, q.shape[0], chunk):
        qs = slice(r0, r0 + chunk)
        s = torch.einsum("mhd,nd->mnh", q[qs].float(), kf).relu_().sum(-1)
        s.masked_fill_((col < rs[qs, None]) | (col >= re[qs, None]), -float("inf"))
        outs.append(torch_topk_blocks(s, topk))  # one request starting at 0: absolute = relative
    return torch.cat(outs)


def xla_fns(topk):
    import jax
    import jax.numpy as jnp
    from jax import lax

    from qsa_pallas.indexer import _expand

    def topk_blocks(logits):
        vals, ids = lax.top_k(logits, min(topk, logits.shape[1]))
        big = jnp.iinfo(jnp.int32).max
        ids = jnp.sort(jnp.where(jnp.isfinite(vals), ids, big), axis=1)
        return jnp.where(ids == big, -1, ids).astype(jnp.int32)

    @jax.jit
    def decode_blocks(q, kc, pt, sl):
        b = q.shape[0]
        g = kc[jnp.clip(pt, 0, kc.shape[0] - 1)].reshape(b, -1, D)
        s = jnp.einsum("bhd,bnd->bnh", q, g, preferred_element_type=jnp.float32)
        s = jnp.maximum(s, 0.0).sum(-1)
        s = jnp.where(jnp.arange(s.shape[1])[None] < (sl // RATIO)[:, None], s, -jnp.inf)
        return topk_blocks(s)

    @jax.jit
    def decode(q, kc, pt, sl):
        return _expand(decode_blocks(q, kc, pt, sl), sl - 1, sl, ratio=RATIO)

    @jax.jit
    def prefill_blocks(q, k, rs, re):
        s = jnp.einsum("mhd,nd->mnh", q, k[:, 0], preferred_element_type=jnp.float32)
        s = jnp.maximum(s, 0.0).sum(-1)
        col = jnp.arange(s.shape[1])[None]
        return topk_blocks(jnp.where((col >= rs[:, None]) & (col < re[:, None]), s, -jnp.inf))

    @jax.jit
    def prefill(q, k, rs, re, pos, sl):
        return _expand(prefill_blocks(q, k, rs, re), pos, sl, ratio=RATIO)

    return decode_blocks, decode, prefill_blocks, prefill


def time_jax_chain(fn, args, len_index, chain, rounds):
    """Median µs per call of ``fn(*args)`` run ``chain`` times back to back in one jit; call i+1
    takes lengths ``args[len_index]`` made to depend on call i's output (values unchanged)."""
    import jax
    import jax.numpy as jnp

    def run(*a):
        a = list(a)
        out = None
        for _ in range(chain):
            if out is not None:  # out[:, 0] >= -1: the lengths stay equal, XLA cannot know it
                lens = a[len_index]
                a[len_index] = jnp.minimum(lens, lens + jnp.minimum(out[:, 0], 0) + 1)
            out = fn(*a)
        return out

    f = jax.jit(run).lower(*args).compile()
    ts = []
    for _ in range(2):  # warm-up
        jax.block_until_ready(f(*args))
    for _ in range(rounds):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append((time.perf_counter() - t0) / chain * 1e6)
    return {"median_us": statistics.median(ts), "min_us": min(ts), "chain": chain,
            "rounds": rounds, "cuda_graph": False}


def sets_report(blocks, qn, key_rows, topk):
    """topk_set_report of ``blocks`` (np [rows, topk]) against FP64 on the given rows' keys."""
    from interop import reference as R

    width = max(max(kr.shape[0] for _, kr in key_rows), 1)
    lg = np.full((len(key_rows), width), -np.inf)
    for j, (i, kr) in enumerate(key_rows):
        lg[j, :len(kr)] = R.indexer_logits(qn[i:i + 1], kr[:, None], [0], [len(kr)])[0][:len(kr)]
    # FP32 summation bound (H sums of D products, gamma_D ~ D 2^-24, with slack), in logit units
    kmax = max(np.abs(kr).max() if kr.size else 0.0 for _, kr in key_rows)
    tol = H * D * D * 2.0**-23 * np.abs(qn).max() * kmax / np.sqrt(D)
    rows = [i for i, _ in key_rows]
    rep = R.topk_set_report(blocks[rows], lg, topk, tol=float(tol))
    return {k: rep[k] for k in ("rows", "exact", "admissible", "max_violation")}


def decode_shape(b, ctx, args, providers, bw, dev):
    import jax
    import torch

    import qsa_pallas
    import qsa_triton
    from bench.common import time_interleaved
    from interop import indices as I
    from interop.dlpack import to_jax

    rng = np.random.default_rng(args.seed + b + ctx)
    lens = np.maximum(ctx - rng.integers(0, 61, size=b), 0)
    case = I.indexer_decode_case(lens, page_size=PAGE, junk="-1", seed=args.seed,
                                 max_pages=-(-ctx // (RATIO * PAGE)))
    g = torch.Generator(device=dev).manual_seed(args.seed + b)
    q = torch.randn(b, H, D, device=dev, generator=g).bfloat16()
    kc = torch.randn(case.pages, PAGE, 1, D, device=dev, generator=g).bfloat16()
    pt = torch.tensor(case.page_table, device=dev)
    sl = torch.tensor(case.seq_lens, device=dev)
    key_bytes = int((case.seq_lens // RATIO).sum()) * D * 2
    rec = {"kind": "decode", "batch": b, "context": ctx, "key_bytes": key_bytes}
    rows = sorted({0, b // 2, b - 1})[: args.check_rows]
    qn = q.float().cpu().numpy()
    key_rows = []
    for r in rows:
        n_pages = -(-(int(case.seq_lens[r]) // RATIO) // PAGE)
        kr = kc[torch.tensor(case.page_table[r, :n_pages], device=dev).long()].float().cpu()
        key_rows.append((r, kr.numpy().reshape(-1, D)[: int(case.seq_lens[r]) // RATIO]))
    kw = dict(topk=args.topk)
    out = {}
    if "triton" in providers:
        out["triton"] = qsa_triton.indexer_select_decode(q, kc, pt, sl, **kw)
        rec["agree_triton"] = sets_report(qsa_triton.indexer_topk_decode(q, kc, pt, sl, **kw)
                                          .cpu().numpy(), qn, key_rows, args.topk)
    if "torch" in providers:
        rec["agree_torch"] = sets_report(torch_decode_blocks(q, kc, pt, sl, args.topk).cpu()
                                         .numpy(), qn, key_rows, args.topk)
    torch.cuda.synchronize() if dev == "cuda" else None
    jargs = tuple(to_jax(x) for x in (q, kc, pt, sl)) if {"pallas", "xla"} & set(providers) else ()
    if "pallas" in providers:
        tok = np.asarray(qsa_pallas.indexer_select_decode(*jargs, **kw))
        rec["pallas_equals_triton"] = bool(np.array_equal(tok, out["triton"].cpu().numpy())) \
            if "triton" in out else None
    xla_blocks, xla_decode, _, _ = xla_fns(args.topk)
    if "xla" in providers:
        rec["agree_xla"] = sets_report(np.asarray(xla_blocks(*jargs)), qn, key_rows, args.topk)
    if args.smoke_cpu:
        return rec
    fns = {}
    if "triton" in providers:
        fns["triton"] = lambda: qsa_triton.indexer_select_decode(q, kc, pt, sl)
    if "torch" in providers:
        fns["torch"] = lambda: torch_expand(torch_decode_blocks(q, kc, pt, sl, TOPK), sl - 1, sl)
    times = time_interleaved(fns, rounds=args.rounds, self_check=False) if fns else {}
    if "pallas" in providers:
        times["pallas"] = time_jax_chain(qsa_pallas.indexer_select_decode, jargs, 3, args.chain,
                                         args.rounds)
    if "xla" in providers:
        times["xla"] = time_jax_chain(xla_decode, jargs, 3, args.chain, args.rounds)
    jax.clear_caches()
    times["floor"] = {"median_us": key_bytes / bw * 1e6}
    rec["times"] = times
    return rec


def prefill_shape(ctx, args, providers, dev):
    import torch

    import qsa_pallas
    import qsa_triton
    from interop import indices as I
    from interop.dlpack import to_jax
    from bench.common import time_interleaved

    t = args.rows
    rs, re, cu, pos, sl = I.prefill_row_ranges([t], [ctx])
    g = torch.Generator(device=dev).manual_seed(args.seed + ctx)
    q = torch.randn(t, H, D, device=dev, generator=g).bfloat16()
    k = torch.randn(int(cu[-1]), 1, D, device=dev, generator=g).bfloat16()
    meta = [torch.tensor(a, device=dev) for a in (rs, re, pos, sl)]
    rec = {"kind": "prefill", "rows": t, "context": ctx}
    qn = q.float().cpu().numpy()
    kn = k.float().cpu().numpy()[:, 0]
    key_rows = [(r, kn[rs[r]:re[r]]) for r in sorted({0, t // 2, t - 1})[: args.check_rows]]
    kw = dict(topk=args.topk)
    if "triton" in providers:
        trit = qsa_triton.indexer_select_prefill(q, k, *meta, **kw).cpu().numpy()
        rec["agree_triton"] = sets_report(qsa_triton.indexer_topk_prefill(q, k, *meta[:2], **kw)
                                          .cpu().numpy(), qn, key_rows, args.topk)
    if "torch" in providers:
        rec["agree_torch"] = sets_report(torch_prefill_blocks(q, k, *meta[:2], args.topk).cpu()
                                         .numpy(), qn, key_rows, args.topk)
    torch.cuda.synchronize() if dev == "cuda" else None
    jargs = tuple(to_jax(x) for x in (q, k, *meta))
    if "pallas" in providers:
        tok = np.asarray(qsa_pallas.indexer_select_prefill(*jargs, **kw))
        rec["pallas_equals_triton"] = bool(np.array_equal(tok, trit)) \
            if "triton" in providers else None
    _, _, xla_blocks, xla_prefill = xla_fns(args.topk)
    if "xla" in providers:
        try:
            rec["agree_xla"] = sets_report(np.asarray(xla_blocks(*jargs[:4])), qn, key_rows,
                                           args.topk)
        except Exception as e:  # noqa: BLE001 - e.g. XLA running out of memory at 128k
            rec["xla_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            providers = [p for p in providers if p != "xla"]
    if args.smoke_cpu:
        return rec
    fns = {}
    if "triton" in providers:
        fns["triton"] = lambda: qsa_triton.indexer_select_prefill(q, k, *meta)
    if "torch" in providers:
        fns["torch"] = lambda: torch_expand(torch_prefill_blocks(q, k, *meta[:2], TOPK), *meta[2:])
    rounds, chain = max(3, args.rounds // 2), max(2, args.chain // 10)
    times = time_interleaved(fns, rounds=rounds) if fns else {}
    if "pallas" in providers:
        times["pallas"] = time_jax_chain(qsa_pallas.indexer_select_prefill, jargs, 2, chain,
                                         rounds)
    if "xla" in providers:
        times["xla"] = time_jax_chain(xla_prefill, jargs, 2, chain, rounds)
    rec["times"] = times
    return rec


def summary_line(rec, bw):
    t = rec.get("times", {})
    med = {k: v.get("median_us") for k, v in t.items() if isinstance(v, dict)}
    ours = med.get("triton")
    head = (f"decode B={rec['batch']:<3} ctx={rec['context']:>6}" if rec["kind"] == "decode"
            else f"prefill T={rec['rows']} ctx={rec['context']:>6}")
    parts = [f"{k}={v:.1f}us" for k, v in med.items() if v]
    if ours:
        parts += [f"x{o}={med[o] / ours:.2f}" for o in ("torch", "xla") if med.get(o)]
        if med.get("pallas"):
            parts.append(f"pallas/triton={ours / med['pallas']:.2f}")
        if rec["kind"] == "decode" and bw:
            parts.append(f"%copy={100 * rec['key_bytes'] / (ours * 1e-6) / bw:.0f}")
    agree = [f"{k[6:]}:{v['exact']}/{v['admissible']}/{v['rows']}"
             for k, v in rec.items() if k.startswith("agree_")]
    return f"{head}  {' '.join(parts)}  agree(exact/adm/rows) {' '.join(agree)}" + (
        f"  pallas==triton {rec['pallas_equals_triton']}" if "pallas_equals_triton" in rec else "")


def main(argv=None):
    args = parse(argv)
    if args.smoke_cpu:
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ["JAX_PLATFORMS"] = "cpu"
        from tests import triton_interp_patch  # noqa: F401 - bf16 dots on CPU
    import torch

    from bench.common import copy_bandwidth_bytes_per_s, gpu_name, now_iso, write_json

    providers = [p.strip() for p in args.providers.split(",") if p.strip()]
    if set(providers) - {"triton", "pallas", "torch", "xla"}:
        sys.exit(f"unknown providers in {providers}")
    records = []
    if args.smoke_cpu:
        dev, bw = "cpu", None
        for b, ctx in ((3, 1000), (2, 300)):
            records.append(decode_shape(b, ctx, args, providers, bw, dev))
            print(summary_line(records[-1], bw), flush=True)
        args.rows = 24
        records.append(prefill_shape(600, args, providers, dev))
        print(summary_line(records[-1], bw), flush=True)
    else:
        dev = "cuda"
        bw = copy_bandwidth_bytes_per_s()
        print(f"{gpu_name()}: copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
        ints = lambda text: [int(x) for x in text.split(",") if x.strip()]  # noqa: E731
        for ctx in ints(args.contexts):
            for b in ints(args.batches):
                records.append(decode_shape(b, ctx, args, providers, bw, dev))
                print(summary_line(records[-1], bw), flush=True)
                torch.cuda.empty_cache()
        for ctx in ints(args.prefill_contexts):
            records.append(prefill_shape(ctx, args, providers, dev))
            print(summary_line(records[-1], bw), flush=True)
            torch.cuda.empty_cache()
    # exit status: our selections must be admissible (pallas == triton is reported, not required:
    # FP32 head sums in another order may flip a near-tie on random data)
    bad_rows = [r for r in records if r.get("agree_triton", {}).get("admissible", 0)
                != r.get("agree_triton", {}).get("rows", 0)]
    write_json(args.out, {"date": now_iso(), "device": "cpu" if args.smoke_cpu else gpu_name(),
                          "copy_bandwidth": bw, "topk": args.topk, "records": records})
    print(f"wrote {args.out}")
    return 1 if bad_rows else 0


if __name__ == "__main__":
    sys.exit(main())
