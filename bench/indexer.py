"""QSA indexer benchmark: scoring + exact top-512 + expansion, decode and prefill.

Cases: decode B in {1, 16, 64, 128} x context {8k, 32k, 128k, 256k} tokens (every row a little
shorter than the context, 16-block pages scattered over the cache, -1 past each row); prefill
8192 query rows of one request at the end of a 32k and of a 128k context. q and compressed keys
N(0, 1) bf16, 4 heads x 128. Every provider returns the 2051-wide token rows.

Providers (``--help``): Pallas and XLA as a chain of calls in one ``jax.jit``, each call's
lengths made to depend on the previous output; ``torch`` gathers the paged keys, then FP32
``einsum``, ReLU-sum, -inf mask, ``torch.topk``, vectorised expansion (prefill rows chunked under
upstream's 128 MiB logits budget). Bytes = the visible compressed keys (blocks x 128 x 2 B): % copy
is the fraction of the copy bandwidth measured in the same run, i.e. time of one read of the
keys / time.

Check (against the FP32 reference, on a canonical view of the token rows):
per row, the number of selected blocks whose FP32 reference logit lies below the reference 512th
logit by more than the FP32 summation tolerance, or out of ascending order, and the number of
selected blocks; the reference is (0, min(512, visible blocks)). Near-ties may go either way.
After the timing table: one line per case with the must-show ratios, also kept in the JSON
(``must_show``).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from bench import common

H, D, TOPK, RATIO, PAGE, CHAIN = 4, 128, 512, 4, 16, 10
BATCHES, CONTEXTS = (1, 16, 64, 128), (8192, 32768, 131072, 262144)
PREFILL_CONTEXTS = (32768, 131072)
LOGITS_BUDGET = 128 << 20  # upstream _QSA_PREFILL_LOGITS_BUDGET_BYTES
# The private plan overrides timed next to the default (interop.indices.IndexerPlan fields).
VARIANTS = {"triton_rb1": lambda p: dataclasses.replace(p, radix_bits=1),
            "triton_c2x": lambda p: dataclasses.replace(
                p, chunk=2 * p.chunk, splits=-(-p.splits // 2),
                merge_warps=max(4, p.merge_warps // 2)),
            "triton_bm4": lambda p: dataclasses.replace(p, rows_per_program=4),
            "triton_w8": lambda p: dataclasses.replace(p, num_warps=8),
            "triton_rb2": lambda p: dataclasses.replace(p, radix_bits=2),
            "triton_t32": lambda p: dataclasses.replace(p, tile=32),
            "triton_nobound": lambda p: dataclasses.replace(p, bound_chunk=0, merge_capacity=0),
            "triton_noskip": lambda p: dataclasses.replace(p, merge_from_bound=False),
            "triton_nostream": lambda p: _nostream(p, 64)}


def _nostream(plan, per_thread: int):
    """The prefill plan before the streamed pass 1 and the compacting merge: a 2-chunk bound
    sample, every splits x topk slot merged (``per_thread`` candidates a merge thread)."""
    if not plan.merge_capacity:
        return plan
    return dataclasses.replace(plan, merge_capacity=0, bound_chunk=2 * plan.chunk, merge_warps=max(
        4, min(16, plan.splits_pad * plan.topk // (32 * per_thread))))


@dataclasses.dataclass
class Inputs:
    """One case on the device: the entry point's arguments, metadata and the check's data."""

    kind: str
    args: list  # decode: q, k_cache, page_table, seq_lens; prefill: q, k, rs, re, pos, seq_lens
    nb: Any  # int [rows]: visible blocks per row
    logits: Any  # float32 [rows, max blocks]: reference scores, -inf where not visible
    tol: float


# ------------------------------------------------------------------------- reference paths
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


def torch_decode_logits(q, kc, pt, sl):
    """Upstream ``torch_qsa_mqa_decode`` (the 1/sqrt(D) scale dropped: order-preserving)."""
    import torch

    b = q.shape[0]
    gathered = kc[pt.long().clamp(0, kc.shape[0] - 1).reshape(-1), :, 0].reshape(b, -1, D)
    s = torch.einsum("bhd,bnd->bnh", q.float(), gathered.float()).relu_().sum(-1)
    pos = torch.arange(s.shape[1], device=q.device)[None]
    return s.masked_fill_(pos >= torch.div(sl, RATIO, rounding_mode="floor")[:, None], -torch.inf)


def torch_prefill_logits(q, kf, rs, re):
    """Upstream ``torch_qsa_mqa_prefill``'s scores of the rows of ``q`` over the FP32 keys ``kf``
    [N, D], -inf outside each row's range [rs, re)."""
    import torch

    col = torch.arange(kf.shape[0], device=q.device)[None]
    s = torch.einsum("mhd,nd->mnh", q.float(), kf).relu_().sum(-1)
    return s.masked_fill_((col < rs[:, None]) | (col >= re[:, None]), -torch.inf)


def torch_prefill_blocks(q, k, rs, re, topk):
    """``torch_prefill_logits`` + top-k over row chunks under upstream's 128 MiB budget."""
    import torch

    chunk = max(1, LOGITS_BUDGET // (4 * max(k.shape[0], 1)))
    kf = k[:, 0].float()
    # one request starting at 0: absolute block ids = relative ones
    return torch.cat([torch_topk_blocks(torch_prefill_logits(q[r0:r0 + chunk], kf,
                                                             rs[r0:r0 + chunk], re[r0:r0 + chunk]),
                                        topk) for r0 in range(0, q.shape[0], chunk)])


def xla_fns(topk):
    """Upstream's reference path in plain JAX: {"decode", "prefill"} -> a function of the entry
    point's arguments -> the expanded token rows."""
    import jax.numpy as jnp
    from jax import lax

    from qsa_pallas.indexer import _expand

    def select(s, visible, pos, sl):  # ReLU-sum over heads, top-k ascending (-1 padded), expand
        s = jnp.where(visible, jnp.maximum(s, 0.0).sum(-1), -jnp.inf)
        vals, ids = lax.top_k(s, min(topk, s.shape[1]))
        big = jnp.iinfo(jnp.int32).max
        ids = jnp.sort(jnp.where(jnp.isfinite(vals), ids, big), axis=1)
        ids = jnp.where(ids == big, -1, ids).astype(jnp.int32)
        ids = jnp.pad(ids, ((0, 0), (0, topk - ids.shape[1])), constant_values=-1)
        return _expand(ids, pos, sl, ratio=RATIO)

    def decode(q, kc, pt, sl):
        g = kc[jnp.clip(pt, 0, kc.shape[0] - 1)].reshape(q.shape[0], -1, D)
        s = jnp.einsum("bhd,bnd->bnh", q, g, preferred_element_type=jnp.float32)
        return select(s, jnp.arange(s.shape[1])[None] < (sl // RATIO)[:, None], sl - 1, sl)

    def prefill(q, k, rs, re, pos, sl):
        s = jnp.einsum("mhd,nd->mnh", q, k[:, 0], preferred_element_type=jnp.float32)
        col = jnp.arange(s.shape[1])[None]
        return select(s, (col >= rs[:, None]) & (col < re[:, None]), pos, sl)

    return {"decode": decode, "prefill": prefill}


# ------------------------------------------------------------------------------ providers
def _jax_chain(fn, inp: Inputs):
    """A provider call: CHAIN calls of ``fn`` unrolled in one ``jax.jit`` (``common.jax_chain``).
    Call i+1 takes an argument that both passes read (decode: seq_lens; prefill: row_ends), made
    to depend on call i's output with its values unchanged (out[:, 0] >= -1), so XLA can neither
    merge the calls nor hoist a pass out of the chain. (Linking prefill through seq_lens, which
    only the expansion reads, let XLA compute pass 1 once per chain.)"""
    import jax.numpy as jnp

    at = 3 if inp.kind == "prefill" else len(inp.args) - 1

    def link(xs, out):
        x = xs[at]
        return (*xs[:at], jnp.minimum(x, x + jnp.minimum(out[:, 0], 0) + 1), *xs[at + 1:])

    return common.jax_chain(fn, inp.args, {}, CHAIN, link)


def _max_blocks(inp: Inputs) -> int:
    """The plan's static block bound: page-table capacity (decode) or packed key rows."""
    keys = inp.args[1]
    return inp.args[2].shape[1] * keys.shape[1] if inp.kind == "decode" else keys.shape[0]


def _triton(inp: Inputs, variant=None):
    from qsa_triton import indexer

    fn = getattr(indexer, f"indexer_select_{inp.kind}")
    kw = {}
    if variant is not None:
        q = inp.args[0]
        kw["plan"] = VARIANTS[variant](indexer.indexer_plan_for(inp.kind, q.shape[0],
                                                                _max_blocks(inp), TOPK, q.device))
    return lambda: fn(*inp.args, **kw)


def _pallas(inp: Inputs, num_warps: int | None = None, bound: bool = True, skip: bool = True,
            stream: bool = True):
    import functools

    import qsa_pallas

    fn = getattr(qsa_pallas, f"indexer_select_{inp.kind}")
    if num_warps is not None or not (bound and skip and stream):  # private plan overrides
        from qsa_pallas import indexer

        plan = indexer.indexer_plan_for(inp.kind, inp.args[0].shape[0], _max_blocks(inp), TOPK)
        plan = plan if stream else _nostream(plan, 32)
        plan = dataclasses.replace(plan, num_warps=num_warps or plan.num_warps,
                                   bound_chunk=plan.bound_chunk if bound else 0,
                                   merge_capacity=plan.merge_capacity if bound else 0,
                                   merge_from_bound=skip)
        fn = functools.partial(fn, plan=plan)
    return _jax_chain(fn, inp)


def _torch(inp: Inputs):
    if inp.kind == "decode":
        q, kc, pt, sl = inp.args
        return lambda: torch_expand(torch_topk_blocks(torch_decode_logits(q, kc, pt, sl), TOPK),
                                    sl - 1, sl)
    q, k, rs, re, pos, sl = inp.args
    return lambda: torch_expand(torch_prefill_blocks(q, k, rs, re, TOPK), pos, sl)


def _xla(inp: Inputs):
    return _jax_chain(xla_fns(TOPK)[inp.kind], inp)


PROVIDERS = {p.name: p for p in (
    common.Provider("triton", _triton, "qsa_triton.indexer_select_*"),
    common.Provider("pallas", _pallas, f"qsa_pallas.indexer_select_* (chain of {CHAIN})"),
    common.Provider("torch", _torch, "upstream's torch reference path + topk"),
    common.Provider("xla", _xla, f"the same in JAX: jnp.einsum + lax.top_k (chain of {CHAIN})"),
    common.Provider("triton_rb1", lambda inp: _triton(inp, "triton_rb1"), "Triton, private plan "
                    "override: 1-bit radix rounds in pass 1 (decode; prefill plans have them)"),
    common.Provider("triton_c2x", lambda inp: _triton(inp, "triton_c2x"), "Triton, private plan "
                    "override: twice the pass-1 chunk"),
    *(common.Provider(n, lambda inp, n=n: _triton(inp, n), f"Triton, private plan override: {w}",
                      default=False)
      for n, w in (("triton_bm4", "4 rows per pass-1 program"), ("triton_w8", "8 warps in pass 1"),
                   ("triton_rb2", "2-bit radix rounds in pass 1 (prefill; decode plans have "
                    "them)"),
                   ("triton_t32", "32-block key tiles"),
                   ("triton_nobound", "prefill without the bound pass"),
                   ("triton_noskip", "prefill merge without the bound's shared bits"),
                   ("triton_nostream", "prefill pass 1 keeping a key tile, merge of every slot"))),
    common.Provider("pallas_w8", lambda inp: _pallas(inp, 8), "Pallas, private plan override: 8 "
                    "warps in pass 1", default=False),
    common.Provider("pallas_nobound", lambda inp: _pallas(inp, bound=False), "Pallas, private "
                    "plan override: prefill without the bound pass", default=False),
    common.Provider("pallas_noskip", lambda inp: _pallas(inp, skip=False), "Pallas, private "
                    "plan override: prefill merge without the bound's shared bits", default=False),
    common.Provider("pallas_nostream", lambda inp: _pallas(inp, stream=False), "Pallas, private "
                    "plan override: prefill pass 1 keeping a key tile, merge of every slot",
                    default=False),
)}


def check_view(out, inp: Inputs):
    """[rows, 2] float32: (inadmissible or out-of-order selected blocks, selected blocks)."""
    import torch

    rows = out.shape[0]
    first = out[:, :TOPK * RATIO].reshape(rows, TOPK, RATIO)[:, :, 0].long()
    nb = inp.nb.long()
    valid = (first >= 0) & (first < nb[:, None] * RATIO)
    blk = torch.where(valid, first // RATIO, 0)
    lg = torch.gather(inp.logits, 1, blk.clamp(max=inp.logits.shape[1] - 1))
    kth = torch.topk(inp.logits, min(TOPK, inp.logits.shape[1]), dim=1).values[:, -1]
    kth = torch.where(nb > TOPK, kth, torch.full_like(kth, -torch.inf))
    bad = (valid & (lg < kth[:, None] - inp.tol)).sum(1)
    bad += (valid[:, 1:] & (~valid[:, :-1] | (blk[:, 1:] <= blk[:, :-1]))).sum(1)
    return torch.stack([bad.float(), valid.sum(1).float()], 1)


# ----------------------------------------------------------------------------------- cases
def decode_cases(args, kind: str) -> list[tuple[int, int]]:
    if kind == "smoke":
        return [(3, 2100), (2, 300)]
    if kind == "memcheck":
        return [(5, 2100), (16, 8192)]
    return [(b, c) for c in common.positive_ints(args.contexts, CONTEXTS, "--contexts")
            for b in common.positive_ints(args.batches, BATCHES, "--batches")]


def prefill_cases(args, kind: str) -> list[tuple[int, int]]:
    if kind in ("smoke", "memcheck"):
        return [(24, 2100)]
    ctxs = common.positive_ints(args.prefill_contexts, PREFILL_CONTEXTS, "--prefill-contexts")
    return [(args.rows, c) for c in ctxs]


def _with_reference(kind: str, args: list, nb, logits):
    """(Inputs, the check's reference: per row 0 inadmissible blocks and min(512, visible) blocks).
    The FP32 summation tolerance of the scores (sums of 4 x 128 products): 2^-16 of the largest."""
    import torch

    tol = float(logits[logits.isfinite()].abs().max()) * 2.0**-16 + 1e-6
    return (Inputs(kind, args, nb, logits, tol),
            torch.stack([torch.zeros_like(nb, dtype=torch.float32), nb.clamp(max=TOPK).float()], 1))


def prepare_decode(case, device):
    import numpy as np
    import torch

    from interop import indices as I

    b, ctx = case
    rng = np.random.default_rng(b + ctx)
    lens = np.maximum(ctx - rng.integers(0, 61, size=b), 0)
    cs = I.indexer_decode_case(lens, page_size=PAGE, junk="-1", seed=b,
                               max_pages=-(-ctx // (RATIO * PAGE)))
    g = torch.Generator(device=device).manual_seed(b + ctx)
    dt = torch.float16 if device == "cpu" else torch.bfloat16  # the CPU interpreter: fp16
    q = torch.randn(b, H, D, device=device, generator=g).to(dt)
    kc = torch.randn(cs.pages, PAGE, 1, D, device=device, generator=g).to(dt)
    pt, sl = torch.tensor(cs.page_table, device=device), torch.tensor(cs.seq_lens, device=device)
    return _with_reference("decode", [q, kc, pt, sl], torch.div(sl, RATIO, rounding_mode="floor"),
                           torch_decode_logits(q, kc, pt, sl))


def prepare_prefill(case, device):
    import torch

    from interop import indices as I

    t, ctx = case
    rs, re, cu, pos, sl = I.prefill_row_ranges([t], [ctx])
    g = torch.Generator(device=device).manual_seed(ctx)
    dt = torch.float16 if device == "cpu" else torch.bfloat16
    q = torch.randn(t, H, D, device=device, generator=g).to(dt)
    k = torch.randn(int(cu[-1]), 1, D, device=device, generator=g).to(dt)
    meta = [torch.tensor(a, device=device) for a in (rs, re, pos, sl)]
    return _with_reference("prefill", [q, k, *meta], meta[1] - meta[0],
                           torch_prefill_logits(q, k[:, 0].float(), meta[0], meta[1]))


def describe_decode(case, inp: Inputs) -> dict:
    b, ctx = case
    return {"name": f"decode/B{b}/ctx{ctx}", "B": b, "context": ctx,
            "bytes": int(inp.nb.sum()) * D * inp.args[1].element_size(),
            "plot": [[f"decode, context {ctx // 1024}k", b]]}


def describe_prefill(case, inp: Inputs) -> dict:
    t, ctx = case
    return {"name": f"prefill/T{t}/ctx{ctx}", "rows": t, "context": ctx,
            "bytes": inp.args[1].numel() * inp.args[1].element_size(),
            "plot": [["prefill", ctx // 1024]]}


def add_arguments(ap) -> None:
    ap.add_argument("--batches", metavar="B,..", help="decode batch sizes (default "
                    + ",".join(map(str, BATCHES)) + ")")
    ap.add_argument("--contexts", metavar="T,..", help="decode contexts in tokens (default "
                    + ",".join(map(str, CONTEXTS)) + ")")
    ap.add_argument("--prefill-contexts", metavar="T,..", help="prefill contexts (default "
                    + ",".join(map(str, PREFILL_CONTEXTS)) + ")")
    ap.add_argument("--rows", type=int, default=8192, help="prefill query rows (default 8192)")


# ------------------------------------------------------------------------- must-show lines
def must_show(report: dict) -> list[str]:
    """The issue's ratios per case: % copy of triton (and the floor), x torch / x xla, pallas /
    triton, the variants' time vs the default's, and whether every check passed."""
    lines = []
    for c in report.get("cases", []):
        p = {n: e.get("median_us") for n, e in c["providers"].items()}
        ours = p.get("triton")
        if not ours:
            continue
        bw = report.get("copy_bandwidth_Bps")
        parts = [f"triton {ours:.1f} us"]
        if bw and c.get("B"):
            parts.append(f"floor {c['bytes'] / bw * 1e6:.1f} us "
                         f"({c['providers']['triton'].get('pct_copy_bw', 0):.0f}% copy)")
        parts += [f"x{n} {p[n] / ours:.2f}" for n in ("torch", "xla") if p.get(n)]
        if p.get("pallas"):
            parts.append(f"pallas/triton {ours / p['pallas']:.2f}")
        parts += [f"{n} {p[n]:.1f} us" for n in VARIANTS if p.get(n)]
        fails = [n for n, e in c["providers"].items() if e.get("ok") is False]
        parts.append("checks ok" if not fails else f"FAILED: {','.join(fails)}")
        lines.append(f"{c['name']:24s} " + "; ".join(parts))
    return lines


def finish(report: dict) -> None:
    """``Mode.finish``: print the must-show lines and keep them in the report."""
    report["must_show"] = must_show(report)
    print("must-show:\n" + "\n".join(report["must_show"]))


MODES = {"decode": common.Mode("indexer_decode", "QSA indexer, decode (score + top-512 + expand)",
                               PROVIDERS, decode_cases, prepare_decode, describe_decode,
                               calls=CHAIN, finish=finish, view=check_view),
         "prefill": common.Mode("indexer_prefill", "QSA indexer, prefill (8192 rows)",
                                PROVIDERS, prefill_cases, prepare_prefill, describe_prefill,
                                calls=2, finish=finish, view=check_view)}


def main(argv=None, prog: str | None = None) -> int:
    """``python3 -m bench.indexer``; see the module docstring."""
    return common.main(MODES, "bench.indexer", argv, prog, __doc__, add_arguments)


if __name__ == "__main__":  # run as bench.indexer, so that pickled inputs name that module
    from bench.indexer import main as _main

    sys.exit(_main())
