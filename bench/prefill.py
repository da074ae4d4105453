"""Sparse prefill benchmark (``qsa-contract.md`` §3): ours against upstream SGLang 0.5.23's
kernels, our Pallas twin and gather + dense attention, on the H200.

Cases (``interop.cases``, inputs built as ``qsa check`` builds them; D = 256, bf16, W = 2051,
realistic block-structured indices from ``interop.indices``: 512 blocks of 4 tokens plus the
causal tail, adjacent rows sharing ~90% of their blocks, padding -1): ``matrix``, 8192 query rows
x heads 6/1, 12/1, 24/2 x KV length in ``BENCH_PREFILL_KV`` (8k: ordinary prefill, no prefix;
else chunk prefill after a prefix); ``sweep``, chunk prefill at 32k context for 12/1 and 6/1 at
the query-row counts of ``BENCH_PREFILL_ROWS``; ``paged``, 12/1 at 32k, 8192 rows, from a
scattered BF16 or FP8 pool. Each provider is checked against a chunked FP32 torch reference
(``reference_f32``). Bytes = the K and V rows gathered (valid entries x D x element size x 2, per
KV head): a rate above the copy bandwidth means L2 hits. TFLOP/s counts 4 x G x D per valid
entry.

``--mode union``: block-level selections (``block_indices=``, the tile-union path, union build
included) at 8192 rows x heads x KV, the selections' neighbour Jaccard calibrated to each of
``--jaccards`` (``interop.indices.calibrate_overlap``; the measured value is in the report) with 4
sink blocks.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
from typing import Any

import numpy as np

from bench import common
from interop import cases as C

__all__ = ["Case", "make_case", "reference_f32", "PROVIDERS", "PREFILL", "UNION", "MODES", "main"]

D, T, KV_SWEEP, CHAIN = 256, 8192, 32768, 2
HEADS = {"6/1": (6, 1), "12/1": (12, 1), "24/2": (24, 2)}
SECTIONS = ("matrix", "sweep", "paged")


@dataclasses.dataclass
class Case:
    """One prefill batch on a device: kind "ordinary" | "chunk" | "paged"; q [T, Hq, D]; k, v
    [T, Hkv, D] (ordinary), the packed contexts (chunk) or the pool [slots, Hkv, D] (paged);
    indices int32 [T, W] or [T, Hkv, W]; int32 cu_q [B+1], cu_k [B+1] (chunk), kv_lens [B]
    (chunk, paged), req_to_token [max_reqs, max_context] and req_indices [B] (paged); max_q host
    int; the default softmax scale D ** -0.5 (``scale``)."""

    kind: str
    q: Any
    k: Any
    v: Any
    indices: Any
    cu_q: Any
    cu_k: Any
    kv_lens: Any
    req_to_token: Any
    req_indices: Any
    max_q: int
    k_scale: float = 1.0
    v_scale: float = 1.0

    @property
    def scale(self) -> float:
        return self.q.shape[-1] ** -0.5

    @property
    def entry(self) -> str:
        """The entry point's name (same in ``qsa_triton`` and ``qsa_pallas``)."""
        return C.ENTRY[self.kind]

    @functools.cached_property
    def slot_table(self):
        """int [B, max_context]: the pool slot of position p of request b (paged)."""
        return self.req_to_token[self.req_indices.long()]

    @functools.cached_property
    def rows(self):
        """(request of each query row, the validity bound of its entries: request length or
        kv_lens[b]), int64 [T] each."""
        import torch  # noqa: PLC0415

        q_lens = (self.cu_q[1:] - self.cu_q[:-1]).long()
        req = torch.repeat_interleave(torch.arange(q_lens.numel(), device=q_lens.device), q_lens)
        return req, (q_lens if self.kind == "ordinary" else self.kv_lens.long())[req]

    def args_for(self, fn) -> list:
        """The positional arguments of ``fn``, this case's entry point in ``qsa_triton`` or
        ``qsa_pallas``. The paged pool is addressed the way ``fn`` takes it: SGLang's
        ``req_to_token, req_indices`` or, in checkouts before that convention (a ``--compare``
        old tree), the per-request slot table alone."""
        q, k, v, idx, cu_q = self.q, self.k, self.v, self.indices, self.cu_q
        if self.kind == "ordinary":
            return [q, k, v, idx, cu_q, self.max_q, None]
        tail = [self.kv_lens, self.max_q, None, self.k_scale, self.v_scale]
        if self.kind == "chunk":
            return [q, k, v, idx, cu_q, self.cu_k, *tail]
        table = ([self.req_to_token, self.req_indices]
                 if "req_indices" in inspect.signature(fn).parameters else [self.slot_table])
        return [q, k, v, *table, idx, cu_q, *tail]

    def valid_entries(self) -> int:
        """Valid (gathered) index entries over all rows and KV heads."""
        idx, bound = self.indices.long(), self.rows[1]
        n = int(((idx >= 0) & (idx < bound.view(-1, *[1] * (idx.dim() - 1)))).sum())
        return n * (self.k.shape[1] if self.indices.dim() == 2 else 1)


def make_case(spec: C.PrefillSpec, device) -> Case:
    """Seeded inputs of a ``PrefillSpec`` on ``device`` as ``qsa check`` builds them
    (``crosscheck.build_inputs``: ``interop.cases.case_data``'s metadata, indices and poison)."""
    from interop.validate.crosscheck import build_inputs  # noqa: PLC0415

    n = build_inputs(spec, device).named()
    k, v = (n["k_cache"], n["v_cache"]) if spec.kind == "paged" else (n["k"], n["v"])
    return Case(spec.kind, n["q"], k, v, n["indices"], n.get("cu_seqlens", n.get("cu_seqlens_q")),
                n.get("cu_seqlens_k"), n.get("kv_lens"), n.get("req_to_token"),
                n.get("req_indices"), int(n["max_seqlen_q"]), spec.k_scale, spec.v_scale)


def _gather(c: Case, s: int, e: int):
    """Query rows s..e-1 of ``c``: (valid [n, Hkv, W]: 0 <= idx < the row's bound, the K/V row
    each entry names [n, Hkv, W], read from position 0 where invalid)."""
    import torch  # noqa: PLC0415

    req, bound = c.rows
    ii = c.indices[s:e].long()
    ii = ii[:, None, :].expand(-1, c.k.shape[1], -1) if ii.dim() == 2 else ii
    ok = (ii >= 0) & (ii < bound[s:e, None, None])
    pos = torch.where(ok, ii, 0)
    if c.kind == "paged":
        return ok, c.slot_table.long()[req[s:e, None, None], pos]
    return ok, (c.cu_q if c.kind == "ordinary" else c.cu_k).long()[req[s:e], None, None] + pos


def reference_f32(c: Case):
    """Float32 torch reference of ``c`` on c's device (``common.reference_f32``), with
    ``interop.reference``'s semantics: an entry is valid iff 0 <= idx < len, invalid entries are
    never gathered, a row without a valid entry is 0. Returns float32 [T, Hq, D]."""
    return common.reference_f32(c.q, c.k, c.v, lambda s, e: _gather(c, s, e),
                                c.scale * c.k_scale, c.v_scale)


# ------------------------------------------------------------------------------ providers
def _call(c: Case, pallas: bool = False, blocks: bool = False, **kw):
    """A provider call of the case's entry point of ``qsa_triton`` or (``pallas``: a chain in one
    ``jax.jit``) ``qsa_pallas``; ``blocks``: on the block selection (``block_indices=``, ``kw``
    passed on) instead of the token indices."""
    import importlib  # noqa: PLC0415

    entry = getattr(importlib.import_module("qsa_pallas" if pallas else "qsa_triton"), c.entry)
    args, fn = (dataclasses.replace(c, indices=None) if blocks else c).args_for(entry), entry
    if blocks:  # the block ids last and positional: jax_chain hands only positional tensors to jax
        args.append(c.blocks)

        def fn(*a):
            return entry(*a[:-1], block_indices=a[-1], **kw)

    return common.jax_chain(fn, args, {}, CHAIN) if pallas else lambda: fn(*args)


def _up_ordinary(c: Case):
    up = common.peer().load_sparse_attn()
    return lambda: up.sparse_gqa_fwd_interface_triton(c.q, c.k, c.v, c.max_q, c.indices, c.cu_q,
                                                      c.scale)


def _up_chunk(c: Case):
    up = common.peer().load_sparse_attn()
    cu_k, lens = (c.cu_k, c.kv_lens) if c.kind == "chunk" else \
        (c.cu_q, (c.cu_q[1:] - c.cu_q[:-1]).contiguous())
    return lambda: up.sparse_gqa_fwd_interface_triton_ck(c.q, c.k, c.v, c.indices, c.cu_q, cu_k,
                                                         lens, c.scale, max_q=c.max_q)


def _gather_dense(c: Case, rows_per_step: int = 256):
    """Each row's selected K/V materialised by a torch gather, then SDPA with a key mask (the
    "synthetic" column upstream reports)."""
    import torch  # noqa: PLC0415
    import torch.nn.functional as F  # noqa: PLC0415

    t, hq, _ = c.q.shape
    hkv = c.k.shape[1]
    heads = torch.arange(hkv, device=c.q.device)[None, :, None]

    def run():
        out = torch.empty_like(c.q)
        for s in range(0, t, rows_per_step):
            e = min(t, s + rows_per_step)
            ok, rows = _gather(c, s, e)
            kk, vv = (x[rows, heads].to(c.q.dtype) for x in (c.k, c.v))
            mask = ok.repeat_interleave(hq // hkv, dim=1)[:, :, None, :]
            o = F.scaled_dot_product_attention(c.q[s:e, :, None, :], kk, vv, attn_mask=mask,
                                               scale=c.scale * c.k_scale, enable_gqa=True)
            out[s:e] = (o[:, :, 0, :].nan_to_num(0.0) * c.v_scale).to(out.dtype)
        return out

    return run


def _upstream_supports(desc: dict, kinds) -> str | None:
    if desc["kind"] not in kinds:
        return f"upstream has no {desc['kind']} kernel of this form"
    if desc["junk"] != "-1" or desc["per_head"] or desc["empty_rows"]:
        return "upstream takes only -1 padding, [T, W] indices and rows with a valid entry"
    if desc.get("kv_dtype") == "float8_e4m3fn":
        return "upstream's chunk kernel reads K/V in q's dtype"
    return None


PROVIDERS = {p.name: p for p in (
    common.Provider("ours", _call, "qsa_triton.sparse_prefill / _chunk / _paged"),
    common.Provider("upstream-chunk", _up_chunk, "upstream's sparse_gqa_fwd_interface_triton_ck "
                    "(its own L20/H20 table geometry; ordinary cases as chunks without a prefix)",
                    supports=functools.partial(_upstream_supports,
                                               kinds=("ordinary", "chunk"))),
    common.Provider("upstream-ordinary", _up_ordinary, "upstream's "
                    "sparse_gqa_fwd_interface_triton (ordinary prefill only)",
                    supports=functools.partial(_upstream_supports, kinds=("ordinary",))),
    common.Provider("gather-dense", _gather_dense, "torch gather of each row's K/V + "
                    "scaled_dot_product_attention with a key mask (context)"),
    common.Provider("pallas", functools.partial(_call, pallas=True), "qsa_pallas.sparse_prefill "
                    f"/ _chunk / _paged (JAX; chain of {CHAIN} in one jit)", default=False),
)}


# ----------------------------------------------------------------------------------- cases
def _spec(kind, hq, hkv, t, kv, *, kv_dtype=None, **kw) -> C.PrefillSpec:
    tag = "" if kv_dtype is None else "/fp8"
    ctx = "" if kind == "ordinary" else f"/kv{kv // 1024}k"
    return C.PrefillSpec(f"prefill/{kind}/{hq}x{hkv}{ctx}/T{t}{tag}", kind, hq, hkv, D, (t,),
                         None if kind == "ordinary" else (kv,), kv_dtype=kv_dtype,
                         seed=hq + t + kv % 1000, **kw)


def cases(args, kind: str) -> list[C.PrefillSpec]:
    """The specs of one run: ``bench`` (``--sections`` x ``--heads``), ``smoke`` (tiny fp16
    shapes of the three variants for the CPU interpreters) or ``memcheck`` (junk after the valid
    prefix, NaN in every unselected K/V row, slot-table entries past the pool, FP8 and per-head
    indices, a 2051-wide row window)."""
    secs = common.choose(getattr(args, "sections", None), SECTIONS, "--sections")
    heads = [HEADS[h] for h in common.choose(getattr(args, "heads", None), HEADS, "--heads")]
    P = C.PrefillSpec
    if kind == "smoke":
        return [P("prefill/ordinary/12x1/smoke", "ordinary", 12, 1, 64, (9, 1, 6), width=35,
                  dtype="float16", seed=1),
                P("prefill/chunk/12x2/smoke", "chunk", 12, 2, 64, (7, 5), (40, 9), width=35,
                  dtype="float16", seed=2),
                P("prefill/paged/12x1/fp8/smoke", "paged", 12, 1, 64, (6, 3), (50, 20), width=35,
                  dtype="float16", kv_dtype="float8_e4m3fn", k_scale=0.5, v_scale=1.5, seed=3)]
    if kind == "memcheck":
        junk = dict(junk="mixed", poison=True, pool_slack=64)
        out = [P(f"prefill/paged/12x2/junk+nan/{'fp8' if fp8 else 'bf16'}"
                 f"{'/per-head' if ph else ''}", "paged", 12, 2, D, (40, 25), (300, 2100),
                 kv_dtype="float8_e4m3fn" if fp8 else None, k_scale=0.7 if fp8 else 1.0,
                 v_scale=1.3 if fp8 else 1.0, per_head=ph, seed=31, **junk)
               for fp8 in (False, True) for ph in (False, True)]
        return out + [P("prefill/ordinary/6x1/junk+nan", "ordinary", 6, 1, D, (40, 25), seed=32,
                        **junk),
                      P("prefill/chunk/6x1/junk+nan", "chunk", 6, 1, D, (40, 25), (300, 2100),
                        seed=32, **junk)]
    out = []
    if "matrix" in secs:
        out += [_spec("ordinary" if kv == T else "chunk", hq, hkv, T, kv)
                for hq, hkv in heads for kv in C.BENCH_PREFILL_KV]
    if "sweep" in secs:
        out += [_spec("chunk", hq, hkv, t, KV_SWEEP) for hq, hkv in heads if hkv == 1
                for t in C.BENCH_PREFILL_ROWS if t != T or "matrix" not in secs]
    if "paged" in secs and (12, 1) in heads:
        out += [_spec("paged", 12, 1, T, KV_SWEEP, kv_dtype=dt, pool_slack=4096)
                for dt in (None, "float8_e4m3fn")]
    return out


def prepare(spec: C.PrefillSpec, device):
    c = make_case(spec, device)
    return c, reference_f32(c)


def describe(spec: C.PrefillSpec, c: Case) -> dict:
    t = sum(spec.q_lens)
    kv = spec.kv_lens[0] if spec.kv_lens else t  # ordinary: the keys are the request's rows
    valid = c.valid_entries()
    heads = f"{spec.hq}/{spec.hkv}"
    plot = []
    if spec.kind == "paged":
        plot.append([f"paged, {heads} heads, KV {kv // 1024}k, {t} rows",
                     "fp8" if spec.kv_dtype else "bf16"])
    elif t == T and len(spec.q_lens) == 1:
        plot.append([f"{t} query rows, {heads} heads (KV {T // 1024}k: ordinary, else chunk)", kv])
    if spec.kind == "chunk" and kv == KV_SWEEP and spec.hkv == 1 and len(spec.q_lens) == 1:
        plot.append([f"query rows, chunk at KV {KV_SWEEP // 1024}k, {heads} heads", t])
    return {"name": spec.name, "kind": spec.kind, "hq": spec.hq, "hkv": spec.hkv, "d": spec.d,
            "T": t, "kv": kv, "width": int(c.indices.shape[-1]),
            "kv_dtype": spec.kv_dtype or spec.dtype, "junk": spec.junk, "per_head": spec.per_head,
            "empty_rows": bool(spec.empty_rows),
            "valid_entries": valid, "bytes": valid * spec.d * c.k.element_size() * 2,
            "flops": 4 * (spec.hq // spec.hkv) * spec.d * valid, "plot": plot}


PREFILL = common.Mode("prefill", "QSA sparse prefill", PROVIDERS, cases, prepare, describe)


# ----------------------------------------------------------------------- --mode union
JACCARDS = (0.9, 0.5, 0.0)


UNION_SECTIONS = ("matrix", "sweep", "fp8", "mtp")
MTP = (32, 4)  # verify shape: requests x rows (draft tokens + 1) each, at KV_SWEEP


def _union(kind, hq, hkv, d, q_lens, kv_lens, nb: int, jaccard: float, **kw):
    """One union case: (its PrefillSpec, block ids per row, target neighbour Jaccard)."""
    kv, fp8 = kv_lens[0] if kv_lens else sum(q_lens), kw.get("kv_dtype") is not None
    reqs = f"/B{len(q_lens)}" if len(q_lens) > 1 else ""
    name = (f"union/{kind}/{hq}x{hkv}/kv{kv // 1024}k{reqs}/T{sum(q_lens)}/J{jaccard}"
            + ("/fp8" if fp8 else ""))
    return (C.PrefillSpec(name, kind, hq, hkv, d, q_lens, kv_lens, k_scale=0.5 if fp8 else 1.0,
                          v_scale=1.5 if fp8 else 1.0, seed=1, **kw), nb, jaccard)


def union_cases(args, kind: str) -> list[tuple]:
    """``bench``: ``--sections`` x ``--jaccards``: matrix (8192 rows x ``--heads`` x
    ``BENCH_PREFILL_KV``), sweep (``BENCH_PREFILL_ROWS`` at KV_SWEEP, the Hkv = 1 pairs), fp8
    (12/1, 8192 rows at KV_SWEEP: chunk and paged, BF16 and FP8 K/V), mtp (``MTP`` requests x
    rows at KV_SWEEP); ``smoke``: one tiny fp16 chunk case and one paged FP8 case (64 blocks per
    row) for the CPU interpreters."""
    heads = [HEADS[h] for h in common.choose(getattr(args, "heads", None), HEADS, "--heads")]
    secs = common.choose(getattr(args, "sections", None), UNION_SECTIONS, "--sections")
    try:
        jac = [float(x) for x in (getattr(args, "jaccards", None) or "").split(",") if x.strip()]
    except ValueError as e:
        raise common.ProviderError(f"--jaccards: {e}") from None
    if any(not 0.0 <= j <= 1.0 for j in jac):
        raise common.ProviderError(f"--jaccards: each in [0, 1], got {jac}")
    if kind != "bench":
        return [_union("chunk", 12, 1, 64, (9, 6), (40, 30), 8, 0.9, dtype="float16"),
                _union("paged", 6, 1, 64, (7,), (50,), 8, 0.0, dtype="float16",
                       kv_dtype="float8_e4m3fn")]
    jac = jac or JACCARDS
    out = []
    if "matrix" in secs:
        out += [_union("ordinary" if kv == T else "chunk", hq, hkv, D, (T,),
                       None if kv == T else (kv,), 512, j)
                for hq, hkv in heads for kv in C.BENCH_PREFILL_KV for j in jac]
    if "sweep" in secs:
        out += [_union("chunk", hq, hkv, D, (t,), (KV_SWEEP,), 512, j)
                for hq, hkv in heads if hkv == 1 for t in C.BENCH_PREFILL_ROWS
                if t != T or "matrix" not in secs for j in jac]
    if "fp8" in secs:  # the BF16 chunk case is the matrix's when that runs 12/1
        in_matrix = "matrix" in secs and (12, 1) in heads
        out += [_union(kd, 12, 1, D, (T,), (KV_SWEEP,), 512, j, kv_dtype=dt,
                       **({"pool_slack": 4096} if kd == "paged" else {}))
                for kd in ("chunk", "paged") for j in jac for dt in (None, "float8_e4m3fn")
                if not (kd == "chunk" and dt is None and in_matrix)]
    if "mtp" in secs:
        b, r = MTP
        out += [_union("chunk", hq, hkv, D, (r,) * b, (KV_SWEEP,) * b, 512, j)
                for hq, hkv in heads for j in jac]
    return out


def union_prepare(case: tuple, device):
    """A ``Case`` whose token indices are the expansion of a calibrated block selection, with
    ``blocks`` (int32 [T, nb]), ``jaccard`` (measured) attached."""
    import torch  # noqa: PLC0415

    from interop import indices as I  # noqa: PLC0415

    spec, nb, jaccard = case
    ql = np.asarray(spec.q_lens, np.int64)
    ctx = None if spec.kv_lens is None else np.asarray(spec.kv_lens, np.int64)
    req, _, vis, _ = I.row_layout(ql, ql if ctx is None else ctx)
    sinks = 4 if nb >= 32 else 1
    overlap, _ = I.calibrate_overlap(jaccard, vis, req, block_topk=nb, sinks=sinks, seed=1)
    blocks = I.prefill_block_indices(ql, ctx, block_width=nb, overlap=overlap, sinks=sinks, seed=1)
    # in the indexer's order: each row's block ids ascending, -1 after (qsa-contract.md §4b)
    top = np.iinfo(blocks.dtype).max
    blocks = np.sort(np.where(blocks < 0, top, blocks), axis=-1)
    blocks = np.where(blocks == top, -1, blocks)
    c = make_case(spec, device)
    c.indices = torch.as_tensor(I.expand_prefill_blocks(blocks, ql, ctx).astype(np.int32),
                                device=device)
    c.blocks = torch.as_tensor(blocks.astype(np.int32), device=device)
    c.jaccard = float(I.neighbour_jaccard(blocks, req, vis))
    return c, reference_f32(c)


def union_describe(case: tuple, c: Case) -> dict:
    spec, _, jaccard = case
    d = describe(spec, c)
    return {**d, "jaccard_target": jaccard, "jaccard": c.jaccard,
            "plot": [[f"{d['T']} rows, {spec.hq}/{spec.hkv} heads, KV {d['kv'] // 1024}k, "
                      "block selections", jaccard]]}


UNION_PROVIDERS = {p.name: p for p in (
    common.Provider("ours-union", functools.partial(_call, blocks=True),
                    "qsa_triton entry points, block_indices= (selector)"),
    common.Provider("ours-hinted",
                    lambda c: _call(c, blocks=True, overlap=min(1.0, max(0.0, c.jaccard))),
                    "the same with overlap= the measured Jaccard (the engine's hint)"),
    common.Provider("ours-rows", _call, "qsa_triton per-row kernel on the expanded indices"),
    PROVIDERS["upstream-chunk"],
    common.Provider("pallas-union", functools.partial(_call, pallas=True, blocks=True),
                    f"qsa_pallas, block_indices= (chain of {CHAIN} in one jit)"),
)}
UNION = common.Mode("prefill_union", "QSA tile-union sparse prefill (block selections)",
                    UNION_PROVIDERS, union_cases, union_prepare, union_describe)
MODES = {"default": PREFILL, "union": UNION}


def add_arguments(ap) -> None:
    ap.add_argument("--sections", metavar="S,..", help="default mode: matrix (8192 rows x heads "
                    "x KV), sweep (query rows at 32k), paged (BF16 and FP8 pools); union mode: "
                    "matrix, sweep, fp8 (chunk and paged, BF16 and FP8 K/V), mtp (32 requests x "
                    "4 rows at 32k) (default all; --smoke-cpu and --memcheck run their own "
                    "fixed cases)")
    ap.add_argument("--heads", metavar="H,..", help="head pairs Hq/Hkv: " + ",".join(HEADS)
                    + " (default all; the sweep takes the Hkv = 1 pairs, paged 12/1)")
    ap.add_argument("--jaccards", metavar="J,..", help="union: target neighbour Jaccards of the "
                    "block selections (default " + ",".join(map(str, JACCARDS)) + ")")


def main(argv=None, prog: str | None = None) -> int:
    """``python3 -m bench.prefill`` / ``qsa bench prefill``; see the module docstring."""
    return common.main(MODES, "bench.prefill", argv, prog, __doc__, add_arguments)


if __name__ == "__main__":  # run as bench.prefill, so that pickled inputs name that module
    from bench.prefill import main as _main

    sys.exit(_main())
