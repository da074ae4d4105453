"""Sparse prefill benchmark (``qsa-contract.md`` §3): ours against upstream SGLang 0.5.23's
kernels, our Pallas twin and gather + dense attention, on the H200.

  python3 -m bench.prefill [--providers A,B,..] [--sections ..] [--heads ..]
                           [--json F] [--plot F.png]          time and check (GPU)
  python3 -m bench.prefill --smoke-cpu                        code paths on CPU, no timing
  python3 -m bench.prefill --memcheck                         edge cases for compute-sanitizer
  python3 -m bench.prefill --compare OLD_TREE                 this checkout vs another commit's
  python3 -m bench.prefill --mode union [--jaccards 0.9,0.5,0] [--heads ..] [--json F]

Cases (``interop.cases``; D = 256, bf16, W = 2051, realistic block-structured indices from
``interop.indices``: 512 blocks of 4 tokens plus the causal tail, adjacent rows sharing ~90% of
their blocks, padding -1): ``matrix``, 8192 query rows x heads 6/1, 12/1, 24/2 x KV length in
``BENCH_PREFILL_KV`` (8k: ordinary prefill, no prefix; else chunk prefill after a prefix);
``sweep``, chunk prefill at 32k context for 12/1 and 6/1 at the query-row counts of
``BENCH_PREFILL_ROWS``; ``paged``, 12/1 at 32k, 8192 rows, from a scattered BF16 or FP8 pool.
Bytes = the K and V rows gathered (valid entries x D x element size x 2, per KV head): a rate
above the copy bandwidth means L2 hits. TFLOP/s counts 4 x G x D per valid entry.

``--mode union``: block-level selections (``block_indices=``, the tile-union path, union build
included) at 8192 rows x heads x KV, the selections' neighbour Jaccard calibrated to each of
``--jaccards`` (``interop.indices.calibrate_overlap``; the measured value is in the report) with 4
sink blocks. Providers: ``ours-union`` (the selector), ``ours-hinted`` (``overlap=`` the measured
Jaccard), ``ours-rows`` (the per-row kernel on the expanded token indices), ``upstream-chunk``
and ``pallas-union``.

Also the shared test helpers: ``make_case`` (one seeded batch of any variant), ``Case`` (its
tensors, entry point and float64 numpy oracle), ``reference_f32`` (chunked float32 torch reference,
fast enough for 8192 rows x 2051 columns on the GPU), ``errors`` / ``within_tolerance``.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from typing import Any

import numpy as np

from bench import common
from bench.common import errors, within_tolerance
from interop import cases as C

__all__ = ["Case", "make_case", "reference_f32", "errors", "within_tolerance", "PROVIDERS",
           "PREFILL", "MODES", "main"]

D, T, KV_SWEEP, CHAIN = 256, 8192, 32768, 2
HEADS = {"6/1": (6, 1), "12/1": (12, 1), "24/2": (24, 2)}
SECTIONS = ("matrix", "sweep", "paged")
ENTRY = {"ordinary": "sparse_prefill", "chunk": "sparse_prefill_chunk",
         "paged": "sparse_prefill_paged"}


@dataclasses.dataclass
class Case:
    """One prefill batch on a device, with host copies of the metadata for the numpy oracle.

    kind: "ordinary" | "chunk" | "paged". q [T, Hq, D]; k, v: [T, Hkv, D] (ordinary), the packed
    contexts [sum kv_lens, Hkv, D] (chunk) or the pool [slots, Hkv, D] (paged); indices int32
    [T, W] or [T, Hkv, W]; cu_q int32 [B+1]; cu_k int32 [B+1] (chunk); kv_lens int32 [B];
    slot_table int32 [B, max_kv] (paged); max_q host int.
    """

    kind: str
    q: Any
    k: Any
    v: Any
    indices: Any
    cu_q: Any
    cu_k: Any
    kv_lens: Any
    slot_table: Any
    max_q: int
    k_scale: float = 1.0
    v_scale: float = 1.0
    softmax_scale: float | None = None

    @property
    def entry(self) -> str:
        """The entry point's name (same in ``qsa_triton`` and ``qsa_pallas``)."""
        return ENTRY[self.kind]

    @property
    def req_indices(self):
        """int32 [B] = 0..B-1: request b reads row b of ``slot_table`` (as ``req_to_token``)."""
        import torch  # noqa: PLC0415

        return torch.arange(self.cu_q.shape[0] - 1, dtype=torch.int32, device=self.cu_q.device)

    def args_for(self, fn, *, host: bool = False) -> list:
        """The positional arguments of ``fn``: this case's entry point in ``qsa_triton`` or
        ``qsa_pallas``, or (``host``: numpy arrays) its ``interop.reference`` function. The paged
        pool is addressed the way ``fn`` takes it: SGLang's ``req_to_token, req_indices`` (the
        slot table, one row per request) or, in checkouts before that convention (a ``--compare``
        old tree), the slot table alone."""
        f = (lambda t: t.detach().float().cpu().numpy() if t.is_floating_point()
             else t.cpu().numpy()) if host else (lambda t: t)
        q, k, v, idx, cu_q = (f(t) for t in (self.q, self.k, self.v, self.indices, self.cu_q))
        if self.kind == "ordinary":
            return [q, k, v, idx, cu_q] + ([] if host else [self.max_q]) + [self.softmax_scale]
        scales = [self.softmax_scale, self.k_scale, self.v_scale]
        lens = [f(self.kv_lens)] + ([] if host else [self.max_q])
        if self.kind == "chunk":
            return [q, k, v, idx, cu_q, f(self.cu_k), *lens, *scales]
        table = [f(self.slot_table)]
        if "req_indices" in inspect.signature(fn).parameters:
            table.append(f(self.req_indices))
        return [q, k, v, *table, idx, cu_q, *lens, *scales]

    def run(self, fn_ordinary=None, fn_chunk=None, fn_paged=None):
        """Call this case's ``qsa_triton`` entry point (or the given replacement)."""
        import qsa_triton  # noqa: PLC0415

        fn = {"ordinary": fn_ordinary, "chunk": fn_chunk, "paged": fn_paged}[self.kind]
        fn = fn or getattr(qsa_triton, self.entry)
        return fn(*self.args_for(fn))

    def numpy_reference(self) -> np.ndarray:
        """The float64 numpy oracle (``interop.reference``); small cases only."""
        from interop import reference as R  # noqa: PLC0415

        fn = getattr(R, f"prefill{'' if self.kind == 'ordinary' else '_' + self.kind}_reference")
        return fn(*self.args_for(fn, host=True))

    def valid_entries(self) -> int:
        """Valid (gathered) index entries over all rows and KV heads."""
        idx = self.indices.long()
        lens = _row_bound(self)
        while lens.dim() < idx.dim():
            lens = lens[..., None]
        n = int(((idx >= 0) & (idx < lens)).sum())
        return n * (self.k.shape[1] if self.indices.dim() == 2 else 1)


def _row_req(cu_q):
    import torch  # noqa: PLC0415

    q_lens = (cu_q[1:] - cu_q[:-1]).long()
    return torch.repeat_interleave(torch.arange(q_lens.numel(), device=cu_q.device), q_lens)


def _row_bound(c: Case):
    """Per query row, the validity bound of its entries (request length or kv_lens[b])."""
    lens = (c.cu_q[1:] - c.cu_q[:-1]) if c.kind == "ordinary" else c.kv_lens
    return lens.long()[_row_req(c.cu_q)]


def make_case(kind: str, hq: int, hkv: int, d: int, q_lens, kv_lens=None, *, width: int = 2051,
              junk: str = "-1", per_head: bool = False, dtype=None, kv_dtype=None,
              empty_rows=0.0, overlap: float = 0.9, nan_unselected: bool = False,
              pool_slack: int = 0, table_junk: bool = False, k_scale: float = 1.0,
              v_scale: float = 1.0, softmax_scale=None, seed: int = 0, device="cpu") -> Case:
    """A seeded prefill batch.

    Args:
      kind: "ordinary" | "chunk" | "paged". hq, hkv, d: heads and head dim.
      q_lens: query rows per request; kv_lens: context per request (chunk/paged, >= q_lens).
      width: W; junk: padding mode of ``interop.indices.JUNK_MODES``; per_head: indices
        [T, Hkv, W]; empty_rows: fraction or row list without a valid entry; overlap: adjacent-row
        block sharing (``interop.indices.prefill_indices``).
      dtype: q's torch dtype (default bf16); kv_dtype: K/V dtype (None: q's; float8_e4m3fn: FP8).
      nan_unselected: NaN in every K/V row (pool slot) no valid entry selects.
      pool_slack: unused extra pool slots (paged); table_junk: slot-table columns past each
        request's kv_len hold slots far past the pool (never to be read).
    Returns:
      Case with its tensors on ``device`` (values N(0, 1), generated on the CPU).
    Raises:
      ValueError: from ``interop.indices`` (unknown kind or junk mode, kv_lens < q_lens).
    """
    import torch  # noqa: PLC0415

    from interop import indices as I  # noqa: PLC0415

    dtype = dtype or torch.bfloat16
    g = torch.Generator().manual_seed(seed)
    ql = np.asarray(q_lens, np.int64)
    kl = ql if kind == "ordinary" or kv_lens is None else np.asarray(kv_lens, np.int64)
    ctx = None if kind == "ordinary" else kl
    lay = I.prefill_layout(kind, ql, ctx, pool_slack=pool_slack, seed=seed)
    idx = I.prefill_indices(ql, ctx, width=width, junk=junk, overlap=overlap,
                            empty_rows=empty_rows, num_kv_heads=hkv if per_head else None,
                            seed=seed)
    t = int(ql.sum())
    rows = {"ordinary": t, "chunk": int(kl.sum()), "paged": lay.pool_slots}[kind]
    q = torch.randn(t, hq, d, generator=g).to(dtype)
    k = torch.randn(rows, hkv, d, generator=g).to(kv_dtype or dtype)
    v = torch.randn(rows, hkv, d, generator=g).to(kv_dtype or dtype)
    st = None if lay.slot_table is None else lay.slot_table.astype(np.int64)
    if nan_unselected:
        req = np.repeat(np.arange(ql.size), ql)
        i3 = (idx if idx.ndim == 3 else np.broadcast_to(idx[:, None, :], (t, hkv, width)))
        i3 = i3.astype(np.int64)
        ok = (i3 >= 0) & (i3 < lay.kv_lens.astype(np.int64)[req][:, None, None])
        r_, h_, c_ = np.nonzero(ok)
        base = (lay.cu_seqlens_q if kind == "ordinary" else lay.cu_seqlens_k).astype(np.int64)
        pos = i3[r_, h_, c_]
        used = np.zeros((rows, hkv), bool)
        used[st[req[r_], pos] if kind == "paged" else base[req[r_]] + pos, h_] = True
        mask = torch.from_numpy(~used)[..., None]
        k = k.float().masked_fill(mask, float("nan")).to(k.dtype)
        v = v.float().masked_fill(mask, float("nan")).to(v.dtype)
    if kind == "paged" and table_junk:
        cols = np.arange(st.shape[1])[None, :]
        st = np.where(cols >= lay.kv_lens[:, None], lay.pool_slots + 1000 + cols * 7919, st)
    dev = torch.device(device)
    i32 = lambda a: torch.as_tensor(np.asarray(a, np.int64).astype(np.int32)).to(dev)  # noqa: E731
    return Case(kind, q.to(dev), k.to(dev), v.to(dev), i32(idx), i32(lay.cu_seqlens_q),
                i32(lay.cu_seqlens_k), i32(lay.kv_lens), None if st is None else i32(st),
                int(lay.max_seqlen_q), k_scale, v_scale, softmax_scale)


def reference_f32(c: Case, *, chunk_rows: int = 128):
    """Float32 torch reference of ``c`` on c's device, with ``interop.reference``'s semantics: an
    entry is valid iff 0 <= idx < len, invalid entries are never gathered, a row without a valid
    entry is 0.

    Returns:
      float32 [T, Hq, D].
    """
    import torch  # noqa: PLC0415

    q, k, v, idx = c.q, c.k, c.v, c.indices
    t, hq, d = q.shape
    hkv = k.shape[1]
    scale = (d ** -0.5 if c.softmax_scale is None else c.softmax_scale) * c.k_scale
    req, bound = _row_req(c.cu_q), _row_bound(c)
    base = None if c.kind == "paged" else (c.cu_q if c.kind == "ordinary" else c.cu_k).long()[req]
    out = torch.zeros(t, hq, d, dtype=torch.float32, device=q.device)
    heads = torch.arange(hkv, device=q.device)
    with torch.no_grad():
        for s in range(0, t, chunk_rows):
            e = min(t, s + chunk_rows)
            ii = idx[s:e].long()
            ii = ii[:, None, :].expand(-1, hkv, -1) if ii.dim() == 2 else ii
            ok = (ii >= 0) & (ii < bound[s:e, None, None])
            pos = torch.where(ok, ii, 0)
            phys = (c.slot_table.long()[req[s:e, None, None], pos] if base is None
                    else base[s:e, None, None] + pos)
            phys = torch.where(ok, phys, 0)
            kk = torch.where(ok[..., None], k[phys, heads[None, :, None]].float(), 0.0)
            vv = torch.where(ok[..., None], v[phys, heads[None, :, None]].float(), 0.0)
            qq = q[s:e].float().view(e - s, hkv, hq // hkv, d)
            sc = torch.einsum("nhgd,nhwd->nhgw", qq, kk) * scale
            p = torch.softmax(sc.masked_fill(~ok[:, :, None, :], float("-inf")), dim=-1)
            o = torch.einsum("nhgw,nhwd->nhgd", p.nan_to_num(0.0), vv) * c.v_scale
            out[s:e] = o.reshape(e - s, hq, d)
    return out


# ------------------------------------------------------------------------------ providers
def _ours(c: Case):
    return c.run


def _upstream():
    from interop.validate import peer  # noqa: PLC0415

    return peer.load_sparse_attn()


def _scale(c: Case) -> float:
    return c.softmax_scale if c.softmax_scale is not None else c.q.shape[-1] ** -0.5


def _up_ordinary(c: Case):
    up = _upstream()
    return lambda: up.sparse_gqa_fwd_interface_triton(c.q, c.k, c.v, c.max_q, c.indices, c.cu_q,
                                                      _scale(c))


def _up_chunk(c: Case):
    up = _upstream()
    cu_k, lens = (c.cu_k, c.kv_lens) if c.kind == "chunk" else \
        (c.cu_q, (c.cu_q[1:] - c.cu_q[:-1]).contiguous())
    return lambda: up.sparse_gqa_fwd_interface_triton_ck(c.q, c.k, c.v, c.indices, c.cu_q, cu_k,
                                                         lens, _scale(c), max_q=c.max_q)


def _pallas(c: Case):
    import qsa_pallas  # noqa: PLC0415

    fn = getattr(qsa_pallas, c.entry)
    return common.jax_chain(fn, c.args_for(fn), {}, CHAIN)


def _gather_dense(c: Case, rows_per_step: int = 256):
    """Each row's selected K/V materialised by a torch gather, then SDPA with a key mask (the
    "synthetic" column upstream reports)."""
    import torch  # noqa: PLC0415
    import torch.nn.functional as F  # noqa: PLC0415

    t, hq, d = c.q.shape
    hkv = c.k.shape[1]
    req, bound = _row_req(c.cu_q), _row_bound(c)
    base = None if c.kind == "paged" else (c.cu_q if c.kind == "ordinary" else c.cu_k).long()[req]
    heads = torch.arange(hkv, device=c.q.device)

    def run():
        out = torch.empty_like(c.q)
        for s in range(0, t, rows_per_step):
            e = min(t, s + rows_per_step)
            ii = c.indices[s:e].long()
            ii = ii[:, None, :].expand(-1, hkv, -1) if ii.dim() == 2 else ii
            ok = (ii >= 0) & (ii < bound[s:e, None, None])
            pos = torch.where(ok, ii, 0)
            phys = (c.slot_table.long()[req[s:e, None, None], pos] if base is None
                    else base[s:e, None, None] + pos)
            kk = c.k[phys, heads[None, :, None]].to(c.q.dtype)
            vv = c.v[phys, heads[None, :, None]].to(c.q.dtype)
            mask = ok.repeat_interleave(hq // hkv, dim=1)[:, :, None, :]
            o = F.scaled_dot_product_attention(c.q[s:e, :, None, :], kk, vv, attn_mask=mask,
                                               scale=_scale(c) * c.k_scale, enable_gqa=True)
            out[s:e] = (o[:, :, 0, :].nan_to_num(0.0) * c.v_scale).to(out.dtype)
        return out

    return run


def _upstream_supports(kinds):
    def supports(desc: dict) -> str | None:
        if desc["kind"] not in kinds:
            return f"upstream has no {desc['kind']} kernel of this form"
        if desc["junk"] != "-1" or desc["per_head"] or desc["empty_rows"]:
            return "upstream takes only -1 padding, [T, W] indices and rows with a valid entry"
        return None
    return supports


PROVIDERS = {p.name: p for p in (
    common.Provider("ours", _ours, "qsa_triton.sparse_prefill / _chunk / _paged"),
    common.Provider("upstream-chunk", _up_chunk, "upstream's sparse_gqa_fwd_interface_triton_ck "
                    "(its own L20/H20 table geometry; ordinary cases as chunks without a prefix)",
                    supports=_upstream_supports(("ordinary", "chunk"))),
    common.Provider("upstream-ordinary", _up_ordinary, "upstream's "
                    "sparse_gqa_fwd_interface_triton (ordinary prefill only)",
                    supports=_upstream_supports(("ordinary",))),
    common.Provider("gather-dense", _gather_dense, "torch gather of each row's K/V + "
                    "scaled_dot_product_attention with a key mask (context)"),
    common.Provider("pallas", _pallas, "qsa_pallas.sparse_prefill / _chunk / _paged (JAX; chain of "
                    f"{CHAIN} in one jit)", default=False),
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
    import torch  # noqa: PLC0415

    c = make_case(spec.kind, spec.hq, spec.hkv, spec.d, spec.q_lens, spec.kv_lens,
                  width=spec.width, junk=spec.junk, per_head=spec.per_head,
                  dtype=getattr(torch, spec.dtype),
                  kv_dtype=getattr(torch, spec.kv_dtype) if spec.kv_dtype else None,
                  empty_rows=spec.empty_rows, overlap=spec.overlap, nan_unselected=spec.poison,
                  pool_slack=spec.pool_slack, table_junk=spec.poison and spec.kind == "paged",
                  k_scale=spec.k_scale, v_scale=spec.v_scale, seed=spec.seed, device=device)
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
            "T": t, "kv": kv, "width": spec.width, "kv_dtype": spec.kv_dtype or spec.dtype,
            "junk": spec.junk, "per_head": spec.per_head, "empty_rows": bool(spec.empty_rows),
            "valid_entries": valid, "bytes": valid * spec.d * c.k.element_size() * 2,
            "flops": 4 * (spec.hq // spec.hkv) * spec.d * valid, "plot": plot}


PREFILL = common.Mode("prefill", "QSA sparse prefill", PROVIDERS, cases, prepare, describe)


# ----------------------------------------------------------------------- --mode union
JACCARDS = (0.9, 0.5, 0.0)


def union_cases(args, kind: str) -> list[dict]:
    """``bench``: 8192 rows x ``--heads`` x ``BENCH_PREFILL_KV`` x ``--jaccards``; ``smoke``: one
    tiny fp16 chunk case and one paged FP8 case (64 blocks per row) for the CPU interpreters."""
    heads = [HEADS[h] for h in common.choose(getattr(args, "heads", None), HEADS, "--heads")]
    try:
        jac = [float(x) for x in (getattr(args, "jaccards", None) or "").split(",") if x.strip()]
    except ValueError as e:
        raise common.ProviderError(f"--jaccards: {e}") from None
    if any(not 0.0 <= j <= 1.0 for j in jac):
        raise common.ProviderError(f"--jaccards: each in [0, 1], got {jac}")
    if kind != "bench":
        return [dict(kind="chunk", hq=12, hkv=1, d=64, q_lens=(9, 6), kv_lens=(40, 30), nb=8,
                     jaccard=0.9, dtype="float16", kv_dtype=None),
                dict(kind="paged", hq=6, hkv=1, d=64, q_lens=(7,), kv_lens=(50,), nb=8,
                     jaccard=0.0, dtype="float16", kv_dtype="float8_e4m3fn")]
    return [dict(kind="ordinary" if kv == T else "chunk", hq=hq, hkv=hkv, d=D, q_lens=(T,),
                 kv_lens=None if kv == T else (kv,), nb=512, jaccard=j, dtype="bfloat16",
                 kv_dtype=None) for hq, hkv in heads for kv in C.BENCH_PREFILL_KV
            for j in jac or JACCARDS]


def union_prepare(spec: dict, device):
    """A ``Case`` whose token indices are the expansion of a calibrated block selection, with
    ``blocks`` (int32 [T, nb]), ``jaccard`` (measured) attached."""
    import torch  # noqa: PLC0415

    from interop import indices as I  # noqa: PLC0415

    ql = np.asarray(spec["q_lens"], np.int64)
    kl = ql if spec["kv_lens"] is None else np.asarray(spec["kv_lens"], np.int64)
    ctx = None if spec["kv_lens"] is None else kl
    req, _, vis, _ = I.row_layout(ql, kl)
    sinks = 4 if spec["nb"] >= 32 else 1
    overlap, _ = I.calibrate_overlap(spec["jaccard"], vis, req, block_topk=spec["nb"],
                                     sinks=sinks, seed=1)
    blocks = I.prefill_block_indices(ql, ctx, block_width=spec["nb"], overlap=overlap,
                                     sinks=sinks, seed=1)
    fp8 = spec["kv_dtype"] is not None
    c = make_case(spec["kind"], spec["hq"], spec["hkv"], spec["d"], ql, ctx, dtype=getattr(torch, spec["dtype"]),
                  kv_dtype=getattr(torch, spec["kv_dtype"]) if fp8 else None,
                  k_scale=0.5 if fp8 else 1.0, v_scale=1.5 if fp8 else 1.0, seed=1, device=device)
    c.indices = torch.as_tensor(I.expand_prefill_blocks(blocks, ql, ctx).astype(np.int32),
                                device=device)
    c.blocks = torch.as_tensor(blocks.astype(np.int32), device=device)
    c.jaccard = float(I.neighbour_jaccard(blocks, req, vis))
    return c, reference_f32(c)


def union_describe(spec: dict, c: Case) -> dict:
    t, valid = sum(spec["q_lens"]), c.valid_entries()
    kv = spec["kv_lens"][0] if spec["kv_lens"] else t
    name = (f"union/{spec['kind']}/{spec['hq']}x{spec['hkv']}/kv{kv // 1024}k/T{t}"
            f"/J{spec['jaccard']}{'/fp8' if spec['kv_dtype'] else ''}")
    return {"name": name, "kind": spec["kind"], "hq": spec["hq"], "hkv": spec["hkv"], "T": t,
            "kv": kv, "jaccard_target": spec["jaccard"], "jaccard": c.jaccard,
            "junk": "-1", "per_head": False, "empty_rows": False, "valid_entries": valid,
            "bytes": valid * spec["d"] * c.k.element_size() * 2,
            "flops": 4 * (spec["hq"] // spec["hkv"]) * spec["d"] * valid,
            "plot": [[f"{t} rows, {spec['hq']}/{spec['hkv']} heads, KV {kv // 1024}k, "
                      "block selections", spec["jaccard"]]]}


def _blocks(c: Case, pallas: bool = False, **kw):
    import qsa_pallas  # noqa: PLC0415, F401 - the backend named by ``pallas``
    import qsa_triton  # noqa: PLC0415

    fn = getattr(qsa_pallas if pallas else qsa_triton, c.entry)
    args = dataclasses.replace(c, indices=None).args_for(fn)
    if pallas:  # block ids positional: jax_chain hands only positional tensors to jax
        return common.jax_chain(lambda *a: fn(*a[:-1], block_indices=a[-1], **kw),
                                args + [c.blocks], {}, CHAIN)
    return lambda: fn(*args, block_indices=c.blocks, **kw)


UNION_PROVIDERS = {p.name: p for p in (
    common.Provider("ours-union", _blocks, "qsa_triton entry points, block_indices= (selector)"),
    common.Provider("ours-hinted", lambda c: _blocks(c, overlap=min(1.0, max(0.0, c.jaccard))),
                    "the same with overlap= the measured Jaccard (the engine's hint)"),
    common.Provider("ours-rows", _ours, "qsa_triton per-row kernel on the expanded indices"),
    PROVIDERS["upstream-chunk"],
    common.Provider("pallas-union", lambda c: _blocks(c, pallas=True), "qsa_pallas, "
                    f"block_indices= (chain of {CHAIN} in one jit)"),
)}
UNION = common.Mode("prefill_union", "QSA tile-union sparse prefill (block selections)",
                    UNION_PROVIDERS, union_cases, union_prepare, union_describe)
MODES = {"default": PREFILL, "union": UNION}


def add_arguments(ap) -> None:
    ap.add_argument("--sections", metavar="S,..", help="matrix (8192 rows x heads x KV), sweep "
                    "(query rows at 32k), paged (BF16 and FP8 pools) (default all)")
    ap.add_argument("--heads", metavar="H,..", help="head pairs Hq/Hkv: " + ",".join(HEADS)
                    + " (default all; the sweep takes the Hkv = 1 pairs, paged 12/1)")
    ap.add_argument("--jaccards", metavar="J,..", help="union: target neighbour Jaccards of the "
                    "block selections (default " + ",".join(map(str, JACCARDS)) + ")")


def main(argv=None, prog: str | None = None) -> int:
    """``python3 -m bench.prefill`` / ``qsa bench prefill``; see the module docstring."""
    return common.main(MODES, "bench.prefill", argv, prog, __doc__.split("\n\nAlso")[0],
                       add_arguments)


if __name__ == "__main__":  # run as bench.prefill, so that pickled inputs name that module
    from bench.prefill import main as _main

    sys.exit(_main())
