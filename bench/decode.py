"""Decode benchmarks on the H200, ours against upstream SGLang 0.5.23's kernels and our Pallas
twins: ``--mode packed`` (default), the decode of packed K/V (``qsa-contract.md`` §2; the Pallas
twin only with ``--providers ours,pallas``); ``--mode pool``, the whole decode step from the KV
pool (§2b; ``pallas-paged`` is in its default set).

Packed cases (``interop.cases``, inputs as ``qsa check`` builds them): TP1 (24/2), TP2 (12/1),
TP4 (6/1) x B in ``BENCH_DECODE_BATCHES`` x rows (saturated: 2051 keys per row; mixed: 17..2051;
short: 1..64), D = 256, bf16, max_seqlen_k = 2051, K/V exactly as long as the rows. Pool cases:
the same TPs and B over a pool of ``POOL_SLOTS`` slots (bf16, or FP8 e4m3 with k_scale = v_scale
= 1 as SGLang's QSA pool) laid out as SGLang lays it (``pages``: 64-slot pages in scattered
order) or as single scattered slots (``slots``), W = 2051 index columns per row (indexer-like);
rows ``saturated`` (8192-token contexts), ``short`` (17..128 tokens), ``mtp`` (32 requests x 4
verify rows); ``x first`` is against upstream-step, and a timed run ends with the must-show
PASS / FAIL lines (JSON ``must_show``). Every provider is checked against an FP32 reference.

Bytes = the K and V rows a case must read (pool: the valid entries' rows, once); % copy = those
bytes per second over the copy bandwidth measured in the same run. Timing (``bench.common``):
CUDA-graph replays of 20 back-to-back calls; JAX as an unrolled chain of 20 calls in one
``jax.jit``, each call's q the previous output (jax-step's compaction depends on it too).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import sys
from typing import Any

from bench import common
from interop import cases as C

__all__ = ["DecodeInputs", "make_inputs", "torch_reference", "PROVIDERS", "PACKED", "MODES",
           "PoolSpec", "PoolInputs", "pool_inputs", "pool_reference", "jax_step", "must_show",
           "POOL_PROVIDERS", "POOL", "main"]

D, CHAIN = 256, 20


@dataclasses.dataclass
class DecodeInputs:
    """One packed decode batch on the device: the entry point's arguments and the row lengths."""

    q: Any
    k: Any
    v: Any
    cu_q: Any
    cu_k: Any
    max_seqlen_k: int
    scale: float | None
    lens: list[int]

    @property
    def args(self) -> list:
        return [self.q, self.k, self.v, self.cu_q, self.cu_k, self.max_seqlen_k, self.scale]


def make_inputs(spec: C.DecodeSpec, device) -> DecodeInputs:
    """Seeded inputs of a ``DecodeSpec`` on ``device``, as ``qsa check`` builds them
    (``interop.validate.crosscheck.build_inputs``: lengths from ``interop.indices.decode_case``,
    q/K/V N(0, 1) in the spec's dtype drawn on the device, the slack rows NaN when ``poison``)."""
    from interop.validate.crosscheck import build_inputs  # noqa: PLC0415

    n = build_inputs(spec, device).named()
    cu = n["cu_seqlens_k"]
    return DecodeInputs(n["q"], n["k"], n["v"], n["cu_seqlens_q"], cu, spec.max_len,
                        spec.d ** -0.5, (cu[1:] - cu[:-1]).tolist())


def torch_reference(q, k, v, cq, ck, scale=None):
    """FP32 reference of packed varlen decode on q's device (``qsa-contract.md`` §2): q [B, Hq, D],
    k, v [C, Hkv, D], cq, ck int32 [B + 1], scale (None: D ** -0.5) -> float32 [B, Hq, D], zeros
    for empty rows: ``pool_reference`` with the K/V rows as the pool, row b's table mapping
    position p to row ck[b] + p (whatever lies past a row, NaN included, is never read)."""
    import torch  # noqa: PLC0415

    lens = (ck[1:] - ck[:-1]).long()
    pos = torch.arange(max(int(lens.max()), 1), device=q.device)[None, :]
    return pool_reference(q[cq[:-1].long()], k, v, ck[:-1].long()[:, None] + pos,
                          torch.arange(len(lens), device=q.device),
                          torch.where(pos < lens[:, None], pos, -1), lens,
                          q.shape[-1] ** -0.5 if scale is None else scale)


# ------------------------------------------------------------------------------ providers
def _ours(inp: DecodeInputs, batch_invariant: bool = False):
    import qsa_triton  # noqa: PLC0415

    if batch_invariant:
        return lambda: qsa_triton.sparse_decode(*inp.args, batch_invariant=True)
    return lambda: qsa_triton.sparse_decode(*inp.args)


def _ours_inline(inp: DecodeInputs, max_splits: int | None = None):
    """Sweep: ``qsa_triton`` packed decode on the shipped plan with the last-arriving split
    merging its row in the launch (no merge kernel), splits capped at ``max_splits``."""
    from qsa_triton import decode  # noqa: PLC0415

    b, hq, d = inp.q.shape
    hkv = inp.k.shape[1]
    plan, _ = decode.plan_for(b, hkv, hq // hkv, d, inp.args[5], inp.q.device)
    if max_splits is not None:
        plan = dataclasses.replace(plan, max_splits=min(plan.max_splits, max_splits))
    return lambda: decode._decode_with_plan(*inp.args, plan=plan, merge="inline")


def _sm121(inp: DecodeInputs):
    sm121 = common.peer().load_sm121_decode()
    return lambda: sm121.qwen38_qsa_sm121(inp.q, inp.k, inp.v, inp.cu_q, inp.cu_k, inp.scale)


def _generic(inp: DecodeInputs):
    import torch  # noqa: PLC0415

    up = common.peer().load_sparse_attn()
    kv_lens = (inp.cu_k[1:] - inp.cu_k[:-1]).contiguous()
    # identity positions per row, -1 after the row's length: upstream masks only idx < 0
    pos = torch.arange(max(max(inp.lens), 1), dtype=torch.int32, device=inp.q.device)
    idx = torch.where(pos[None, :] < kv_lens[:, None], pos[None, :], -1).to(torch.int32)
    return lambda: up.sparse_gqa_packed_decode_triton(inp.q, inp.k, inp.v, idx, inp.cu_q,
                                                      inp.cu_k, kv_lens, inp.scale)


def _pallas(inp: DecodeInputs, batch_invariant: bool = False):
    import qsa_pallas  # noqa: PLC0415

    kw = {"batch_invariant": True} if batch_invariant else {}
    return common.jax_chain(qsa_pallas.sparse_decode, inp.args, kw, CHAIN)


def _sm121_supports(desc: dict, rows: str) -> str | None:
    """Upstream's SM121 kernel: D = 256, (24,2) / (12,1) heads, <= 128 rows (``desc[rows]``)."""
    if (desc["Hq"], desc["Hkv"]) not in ((24, 2), (12, 1)) or desc[rows] > 128 or desc["D"] != 256:
        return f"upstream's SM121 kernel takes D = 256, (24,2) and (12,1) heads, {rows} <= 128"
    return None


PROVIDERS = {p.name: p for p in (
    common.Provider("ours", _ours, "qsa_triton.sparse_decode"),
    common.Provider("upstream-sm121", _sm121, "upstream's packed decode kernel "
                    "(kda_kernels/qwen38_qsa_sm121, peer loaded from the 0.5.23 wheel)",
                    supports=functools.partial(_sm121_supports, rows="B")),
    common.Provider("upstream-generic", _generic, "upstream's sparse_gqa_packed_decode_triton "
                    "(its chunk-prefill kernel with one query row per sequence)"),
    common.Provider("pallas", _pallas, "qsa_pallas.sparse_decode (JAX; chain of 20 in one jit)",
                    default=False),
    *(common.Provider(f"ours[inline{n or ''}]", functools.partial(_ours_inline, max_splits=n),
                      f"sweep: qsa_triton packed decode, in-launch merge, <= {n or 'plan'} splits",
                      default=False) for n in (None, 16, 8)),
    common.Provider("ours[bi]", lambda inp: _ours(inp, True), "qsa_triton.sparse_decode with "
                    "batch_invariant=True (its cost: time / the time of ours)", default=False),
    common.Provider("pallas[bi]", lambda inp: _pallas(inp, True), "qsa_pallas.sparse_decode with "
                    "batch_invariant=True (JAX; chain of 20 in one jit)", default=False),
)}


# ----------------------------------------------------------------------------------- cases
def cases(args, kind: str) -> list[C.DecodeSpec]:
    """The specs of one run: ``bench`` (the grid, filtered by ``--tp/--batches/--rows``),
    ``smoke`` (tiny fp16 shapes for the CPU interpreters) or ``memcheck`` (empty rows, K/V sized
    exactly to the rows or followed by NaN rows, every merge path: B = 1 .. 128)."""
    tps = common.choose(getattr(args, "tp", None), C.TP_SHAPES, "--tp")
    rows = common.choose(getattr(args, "rows", None), C.BENCH_DECODE_ROWS, "--rows")
    batches = common.positive_ints(getattr(args, "batches", None), C.BENCH_DECODE_BATCHES,
                                   "--batches")
    spec = C.DecodeSpec
    if kind == "smoke":
        return [spec("decode/TP4/B2/mixed/D64", 6, 1, 64, 2, "mixed", max_len=67,
                     dtype="float16", pad_capacity=False, seed=1),
                spec("decode/TP1/B3/short+empty/D64", 24, 2, 64, 3, "short", max_len=200,
                     dtype="float16", zero_rows=1, slack=5, poison=True, pad_capacity=False,
                     seed=2)]
    if kind == "memcheck":
        return [spec(f"decode/{tp}/B{b}/{r}{'+nan' if slack else ''}", *C.TP_SHAPES[tp], D, b, r,
                     zero_rows=zero, slack=slack, poison=bool(slack), pad_capacity=False, seed=b)
                for tp, b, r, zero, slack in (
                    ("TP1", 1, "saturated", 0, 0), ("TP2", 1, "short", 0, 4096),
                    ("TP1", 5, "mixed", 1, 0), ("TP4", 5, "mixed", 2, 4096),
                    ("TP2", 16, "saturated", 0, 4096), ("TP1", 64, "mixed", 3, 0),
                    ("TP1", 128, "saturated", 0, 4096), ("TP2", 128, "mixed", 5, 0))]
    return [spec(f"decode/{tp}/B{b}/{r}", *C.TP_SHAPES[tp], D, b, r, pad_capacity=False, seed=b)
            for tp in tps for b in batches for r in rows]


def prepare(spec: C.DecodeSpec, device):
    inp = make_inputs(spec, device)
    return inp, torch_reference(inp.q, inp.k, inp.v, inp.cu_q, inp.cu_k, inp.scale)


def describe(spec: C.DecodeSpec, inp: DecodeInputs) -> dict:
    tp = next((t for t, hh in C.TP_SHAPES.items() if hh == (spec.hq, spec.hkv)), "")
    keys = int(sum(inp.lens))
    return {"name": spec.name, "tp": tp, "Hq": spec.hq, "Hkv": spec.hkv, "D": spec.d,
            "B": spec.batch, "rows": spec.pattern, "keys": keys,
            "bytes": keys * spec.hkv * spec.d * inp.k.element_size() * 2,
            "plot": [[f"{tp} ({spec.hq}/{spec.hkv} heads), {spec.pattern} rows", spec.batch]]}


PACKED = common.Mode("decode", "QSA packed sparse decode", PROVIDERS, cases, prepare, describe,
                     calls=CHAIN)


# =========================================================================================
# Pool mode (issue 16): the whole decode step from the KV pool
POOL_LAYOUTS = ("pages", "slots")  # SGLang's 64-slot pages in scattered order / single slots
POOL_KV = ("bf16", "fp8")
POOL_ROWS = ("saturated", "short", "mtp")  # 8192-token contexts / 17..128 / 32 requests x 4
POOL_SLOTS = 2_200_000
POOL_W = 2051
MTP_ROWS = 4  # verify rows per request (mtp: 32 requests x 4 rows = 128 rows)


@dataclasses.dataclass(frozen=True)
class PoolSpec:
    """One pool-mode case: ``batch`` query rows (mtp: ``batch // 4`` requests x 4 verify rows)
    of ``tp``'s heads over a ``kv`` pool of ``pool_slots`` slots laid out as ``layout``;
    ``junk``: junk entries (-1, -7, = len, len + 19) at the front, middle and end of the rows,
    duplicates, an empty row and NaN / Inf in every slot no request owns (memcheck, smoke)."""

    name: str
    tp: str
    batch: int
    rows: str
    layout: str
    kv: str
    pool_slots: int = POOL_SLOTS
    d: int = D
    dtype: str = "bfloat16"
    width: int = POOL_W
    junk: bool = False
    seed: int = 0


@dataclasses.dataclass
class PoolInputs:
    """The paged call's arguments on the device (``sparse_decode_paged`` order) and its facts."""

    args: list  # q, k_cache, v_cache, req_to_token, req_indices, indices, seq_lens
    scale: float
    valid: int  # valid entries over all rows (each reads one K and one V row per KV head)


_POOL_CACHE: dict = {}  # the last clean pool, reused by the next case of its shape and dtype


def pool_inputs(spec: PoolSpec, device) -> PoolInputs:
    """Seeded inputs of a ``PoolSpec``: ``interop.indices.paged_decode_case`` (indexer-like
    selections of W columns, valid first then -1; junk everywhere with ``junk``), q and the pool
    N(0, 1), generated on the device (the pool in its dtype, reused across cases of one shape
    unless ``junk`` poisons its free slots)."""
    import numpy as np  # noqa: PLC0415
    import torch  # noqa: PLC0415

    from interop import indices as I  # noqa: PLC0415

    hq, hkv = C.TP_SHAPES[spec.tp]
    rng = np.random.default_rng(spec.seed)
    if spec.rows == "mtp":
        contexts, per = np.full(max(1, spec.batch // MTP_ROWS), 8192), MTP_ROWS
    elif spec.rows == "short":
        contexts, per = rng.integers(17, 129, spec.batch), 1
    else:
        contexts, per = np.full(spec.batch, 8192), 1
    contexts = np.minimum(contexts, 4 * spec.width)  # (smoke widths: short tables)
    kw = dict(junk=I.PAGED_JUNK, junk_at=I.PAGED_JUNK_AT, duplicates=2,
              empty_rows=[len(contexts) * per // 2]) if spec.junk else {}
    c = I.paged_decode_case(contexts, width=spec.width, rows_per_request=per,
                            pool_slots=spec.pool_slots,
                            page_size=64 if spec.layout == "pages" else 1, seed=spec.seed, **kw)
    qdt = getattr(torch, spec.dtype)
    kdt = torch.float8_e4m3fn if spec.kv == "fp8" else qdt
    key = (spec.pool_slots, hkv, spec.d, str(kdt), str(device))
    if spec.junk or key not in _POOL_CACHE:
        _POOL_CACHE.clear()
        g = torch.Generator(device=device).manual_seed(spec.seed)
        k, v = (torch.randn(spec.pool_slots, hkv, spec.d, generator=g, device=device)
                for _ in range(2))
        if spec.junk:  # NaN / Inf wherever no request owns the slot (padding slot 0 too)
            free = torch.from_numpy(~c.owned).to(device)
            k[free], v[free] = float("nan"), float("inf")
        k, v = k.to(kdt), v.to(kdt)  # (e4m3 has no Inf: its Inf slots hold NaN)
        if not spec.junk:
            _POOL_CACHE[key] = (k, v)
    else:
        k, v = _POOL_CACHE[key]
    g = torch.Generator(device=device).manual_seed(1000 + spec.seed)
    q = torch.randn(len(c.req_indices), hq, spec.d, generator=g, device=device).to(qdt)
    meta = [torch.from_numpy(np.ascontiguousarray(t)).to(device)
            for t in (c.req_to_token, c.req_indices, c.indices, c.seq_lens)]
    valid = I.resolve_paged_slots(c.req_to_token, c.req_indices, c.indices, c.seq_lens,
                                  spec.pool_slots) >= 0
    return PoolInputs([q, k, v, *meta], spec.d ** -0.5, int(valid.sum()))


def pool_reference(q, k, v, table, req, idx, seq, scale, chunk=16):
    """FP32 reference of the paged decode from the pool, on q's device (``qsa-contract.md``
    §2b, lying metadata included): an entry is valid iff 0 <= idx < min(seq, table width), its
    request is a table row and its slot lies in the pool; invalid entries are never gathered
    (``common.reference_f32``). Returns float32 [R, Hq, D]; zeros for a row without one."""
    import torch  # noqa: PLC0415

    req_ok = (req >= 0) & (req < table.shape[0])
    bound = torch.where(req_ok, torch.clamp(seq, max=table.shape[1]), 0).long()
    row, hkv = torch.where(req_ok, req, 0).long(), k.shape[1]

    def gather(s, e):
        ids = idx[s:e].long()
        valid = (ids >= 0) & (ids < bound[s:e, None])
        slot = table[row[s:e, None], torch.where(valid, ids, 0)].long()
        valid &= (slot >= 0) & (slot < k.shape[0])
        return valid[:, None].expand(-1, hkv, -1), slot[:, None].expand(-1, hkv, -1)

    return common.reference_f32(q, k, v, gather, scale, chunk=chunk)


# ------------------------------------------------------------------------- pool providers
def _compaction(inp: PoolInputs):
    """Upstream's step before its decode (peer, 0.5.23 wheel): valid counts + prefix sum
    (``qwen_sparse_fa2_cu_seqlens_triton``), then ``qwen_sparse_kv_extraction_compact_triton``
    gathers the valid rows into a packed copy in q's dtype (an FP8 pool dequantised while
    copying). Returns ``compact() -> (k_packed, v_packed, cu_q, cu_k)``."""
    import torch  # noqa: PLC0415

    sa = common.peer().load_sparse_attn()
    q, k, v, table, req, idx, seq = inp.args
    r, w = idx.shape
    i32 = dict(dtype=torch.int32, device=q.device)
    counts, cu_k = torch.empty(r, **i32), torch.empty(r + 1, **i32)
    cu_q = torch.arange(r + 1, **i32)
    kp = torch.empty(r * w, k.shape[1], q.shape[2], dtype=q.dtype, device=q.device)
    vp = torch.empty_like(kp)

    def compact():
        sa.qwen_sparse_fa2_cu_seqlens_triton(seq, idx, counts, cu_k, r, w)
        sa.qwen_sparse_kv_extraction_compact_triton(k, v, table, req, idx, seq, cu_k, kp, vp,
                                                    r, w)
        return kp, vp, cu_q, cu_k

    return compact


def _compaction_supports(desc: dict) -> str | None:
    """Upstream's ``_compact_kv`` packs a row's valid entries at their column (``cols <
    count``): it needs them first in the row, which junk cases (entries anywhere) break."""
    if desc["junk"]:
        return "upstream's compaction needs a row's valid entries first (junk case)"
    return None


def _upstream_supports(desc: dict) -> str | None:
    return _compaction_supports(desc) or _sm121_supports(desc, rows="R")


def _upstream_step(inp: PoolInputs):
    compact, sm121 = _compaction(inp), common.peer().load_sm121_decode()
    return lambda: sm121.qwen38_qsa_sm121(inp.args[0], *compact(), inp.scale)


def _packed_step(inp: PoolInputs):
    import qsa_triton  # noqa: PLC0415

    compact, w = _compaction(inp), inp.args[5].shape[-1]
    return lambda: qsa_triton.sparse_decode(inp.args[0], *compact(), w, inp.scale)


def jax_step(scale: float, max_seqlen_k: int):
    """XLA compaction + ``qsa_pallas.sparse_decode``: what a JAX engine without a compaction
    kernel runs. ``step(q, k, v, table, req, idx, seq)`` resolves the slots, gathers the valid
    rows and scatters them to their packed positions, then decodes. The compaction depends on q
    through ``idx + int(q[0, 0, 0] * 0)`` (a float multiply XLA does not fold): in a chain
    (q = the previous output) every call gathers from the pool, as an engine's step does,
    instead of XLA hoisting one compaction out of the whole chain."""
    import jax.numpy as jnp  # noqa: PLC0415

    import qsa_pallas  # noqa: PLC0415

    def step(q, k, v, table, req, idx, seq):
        idx = idx + (q[0, 0, 0].astype(jnp.float32) * 0).astype(jnp.int32)
        r, w = idx.shape
        req_ok = (req >= 0) & (req < table.shape[0])
        bound = jnp.where(req_ok, jnp.minimum(seq, table.shape[1]), 0)
        valid = (idx >= 0) & (idx < bound[:, None])
        slot = table[jnp.where(req_ok, req, 0)[:, None], jnp.where(valid, idx, 0)]
        valid &= (slot >= 0) & (slot < k.shape[0])
        cu_k = jnp.concatenate([jnp.zeros(1, jnp.int32),
                                jnp.cumsum(valid.sum(-1, dtype=jnp.int32), dtype=jnp.int32)])
        dest = jnp.where(valid, cu_k[:-1, None] + jnp.cumsum(valid, -1, dtype=jnp.int32) - 1,
                         r * w).reshape(-1)  # invalid entries: out of range, dropped
        src = jnp.where(valid, slot, 0).reshape(-1)
        kp, vp = (jnp.zeros((r * w,) + x.shape[1:], q.dtype).at[dest].set(x[src].astype(q.dtype),
                                                                         mode="drop")
                  for x in (k, v))
        return qsa_pallas.sparse_decode(q, kp, vp, jnp.arange(r + 1, dtype=jnp.int32), cu_k,
                                        max_seqlen_k, scale)

    return step


def _jax_step(inp: PoolInputs):
    return common.jax_chain(jax_step(inp.scale, inp.args[5].shape[-1]), inp.args, {}, CHAIN)


def _paged(inp: PoolInputs, batch_invariant: bool = False):
    import qsa_triton  # noqa: PLC0415

    return lambda: qsa_triton.sparse_decode_paged(*inp.args, inp.scale,
                                                  batch_invariant=batch_invariant)


def _paged_splits(inp: PoolInputs, splits: int):
    """Sweep: ``qsa_triton`` paged decode on the shipped plan with ``splits`` splits (at most one
    per chunk; 7 stages where a split streams >= 2 chunks, as the plan's rule), through its
    public ``decode_paged_with_plan``: fewer, longer splits at small B cut the partials the merge
    reads, at the cost of programs."""
    from qsa_triton import decode_paged  # noqa: PLC0415

    q, k, idx = inp.args[0], inp.args[1], inp.args[5]
    plan = decode_paged._plan_of(q, k, idx, False)
    nb = -(-idx.shape[-1] // plan.block_n)
    s = max(1, min(splits, nb))
    plan = dataclasses.replace(plan, num_splits=s, num_stages=7 if nb >= 2 * s else 3)
    return lambda: decode_paged.decode_paged_with_plan(*inp.args, inp.scale, plan=plan)


def _pallas_paged(inp: PoolInputs, batch_invariant: bool = False):
    import qsa_pallas  # noqa: PLC0415

    return common.jax_chain(qsa_pallas.sparse_decode_paged, [*inp.args, inp.scale],
                            {"batch_invariant": batch_invariant}, CHAIN)


POOL_PROVIDERS = {p.name: p for p in (
    common.Provider("upstream-step", _upstream_step, "upstream's step: counts + prefix sum + "
                    "_compact_kv into a packed copy + its SM121 decode (0.5.23 wheel)",
                    supports=_upstream_supports),
    common.Provider("packed-step", _packed_step, "upstream's counts + prefix sum + compaction, "
                    "then qsa_triton.sparse_decode", supports=_compaction_supports),
    common.Provider("jax-step", _jax_step, "XLA compaction (dependent on the previous call) + "
                    "qsa_pallas.sparse_decode, chain of 20 in one jit"),
    common.Provider("paged", _paged, "qsa_triton.sparse_decode_paged (reads the pool in place)"),
    common.Provider("pallas-paged", _pallas_paged, "qsa_pallas.sparse_decode_paged, chain of "
                    "20 in one jit"),
    common.Provider("paged[bi]", functools.partial(_paged, batch_invariant=True),
                    "qsa_triton.sparse_decode_paged with batch_invariant=True (the mode's cost)",
                    default=False),
    common.Provider("pallas-paged[bi]", functools.partial(_pallas_paged, batch_invariant=True),
                    "qsa_pallas.sparse_decode_paged with batch_invariant=True", default=False),
    *(common.Provider(f"paged[s{n}]", functools.partial(_paged_splits, splits=n),
                      f"sweep: qsa_triton paged decode with {n} splits", default=False)
      for n in (3, 4, 6, 11, 17)),
)}


def pool_cases(args, kind: str) -> list[PoolSpec]:
    """The pool-mode specs of one run: ``bench`` (TP x pool dtype x layout x rows x B, filtered
    by the options; mtp: 32 requests x 4 rows), ``smoke`` (tiny fp16 / fp8 cases with junk) or
    ``memcheck`` (junk entries, duplicates, an empty row, NaN / Inf in free slots)."""
    if getattr(args, "compare", None):
        raise common.ProviderError("--mode pool has no --compare (its pool is gigabytes; time "
                                   "the providers of both trees in one run instead)")
    tps = common.choose(getattr(args, "tp", None), C.TP_SHAPES, "--tp")
    rows = common.choose(getattr(args, "rows", None), POOL_ROWS, "--rows")
    layouts = common.choose(getattr(args, "layouts", None), POOL_LAYOUTS, "--layouts")
    kvs = common.choose(getattr(args, "kv", None), POOL_KV, "--kv")
    batches = common.positive_ints(getattr(args, "batches", None), C.BENCH_DECODE_BATCHES,
                                   "--batches")
    slots = getattr(args, "pool_slots", None) or POOL_SLOTS
    need = max(*batches, 32) * 8192 + 128  # the largest saturated batch's pages + padding page
    if kind == "bench" and slots < need:
        raise common.ProviderError(f"--pool-slots must be >= {need} for B = {max(batches)}, "
                                   f"got {slots}")
    spec = PoolSpec
    if kind == "smoke":
        small = dict(pool_slots=4096, d=64, dtype="float16", width=70, junk=True)
        return [spec("pool/TP2/pages/bf16/B3/saturated/D64", "TP2", 3, "saturated", "pages",
                     "bf16", seed=1, **small),
                spec("pool/TP1/slots/fp8/B2x4/mtp/D64", "TP1", 8, "mtp", "slots", "fp8", seed=2,
                     **small)]
    if kind == "memcheck":
        return [spec(f"pool/{tp}/{lay}/{kv}/B{b}/{r}+junk", tp, b, r, lay, kv,
                     pool_slots=2 * b * 8192 + 4096, junk=True, seed=b)
                for tp, b, r, lay, kv in (("TP1", 8, "saturated", "slots", "bf16"),
                                          ("TP2", 5, "short", "pages", "fp8"),
                                          ("TP4", 1, "saturated", "pages", "bf16"),
                                          ("TP1", 8, "mtp", "pages", "fp8"))]
    return [spec(f"pool/{tp}/{lay}/{kv}/{f'B{b // MTP_ROWS}x{MTP_ROWS}' if r == 'mtp' else f'B{b}'}"
                 f"/{r}", tp, b, r, lay, kv, pool_slots=slots, seed=b)
            for tp, kv, lay, r in itertools.product(tps, kvs, layouts, rows)
            for b in ((32 * MTP_ROWS,) if r == "mtp" else batches)]


def pool_prepare(spec: PoolSpec, device):
    inp = pool_inputs(spec, device)
    return inp, pool_reference(*inp.args, inp.scale)


def pool_describe(spec: PoolSpec, inp: PoolInputs) -> dict:
    hq, hkv = C.TP_SHAPES[spec.tp]
    r = int(inp.args[0].shape[0])
    return {"name": spec.name, "tp": spec.tp, "Hq": hq, "Hkv": hkv, "D": spec.d,
            "B": r // MTP_ROWS if spec.rows == "mtp" else r, "R": r, "rows": spec.rows,
            "layout": spec.layout, "kv": spec.kv, "pool_slots": spec.pool_slots,
            "junk": bool(spec.junk), "valid_entries": inp.valid,
            "bytes": inp.valid * hkv * spec.d * (1 if spec.kv == "fp8" else 2) * 2,
            "plot": [[f"{spec.tp} ({hq}/{hkv} heads), {spec.layout}, {spec.kv} pool, "
                      f"{spec.rows} rows", r]]}


def must_show(report: dict) -> list[dict]:
    """Issue 16's benchmark thresholds over a pool-mode report (saturated rows, bf16 pool
    unless stated), for ``paged``: >= 2.5x
    upstream-step at every B with single slots, >= 2.0x with 64-slot pages; >= 85% of the copy
    bandwidth at B = 128; FP8 pool >= 1.6x faster than the bf16 pool at B >= 64; pallas-paged
    >= 3x jax-step at every B and >= 0.85x paged at B >= 16. Also (no threshold) the cost of
    batch-invariant mode, time with / time without, where ``paged[bi]`` was timed.

    Returns [{"check", "value", "threshold" (None: information), "pass" (None likewise)}]."""
    def us(case, name):
        return (case or {}).get("providers", {}).get(name, {}).get("median_us")

    by = {(c["tp"], c["layout"], c["kv"], c["rows"], c["R"]): c for c in report["cases"]}
    checks = []
    for (tp, lay, kv, rows, r), c in by.items():
        tag = f"{tp} {lay} {kv} B={c['B']}"
        up, js, pp, p0 = (us(c, n) for n in ("upstream-step", "jax-step", "pallas-paged",
                                             "paged"))
        if rows == "saturated":
            if p0 and kv == "bf16" and up:
                need = 2.5 if lay == "slots" else 2.0
                checks.append((f"paged >= {need}x upstream-step, {tag}", up / p0, need))
            if p0 and kv == "bf16" and r == 128:
                checks.append((f"paged % copy bw >= 85, {tag}",
                               c["providers"]["paged"]["pct_copy_bw"], 85.0))
            bf16 = us(by.get((tp, lay, "bf16", rows, r)), "paged")
            if p0 and kv == "fp8" and r >= 64 and bf16:
                checks.append((f"paged fp8 pool >= 1.6x bf16 pool, {tag}", bf16 / p0, 1.6))
            if kv == "bf16" and pp and js:
                checks.append((f"pallas-paged >= 3x jax-step, {tag}", js / pp, 3.0))
            if kv == "bf16" and pp and p0 and r >= 16:
                checks.append((f"pallas-paged >= 0.85x paged, {tag}", p0 / pp, 0.85))
        for n, base in (("paged[bi]", p0), ("pallas-paged[bi]", pp)):
            if us(c, n) and base:
                checks.append((f"cost of batch_invariant ({n} / {n[:-4]}), {tag} {rows}",
                               us(c, n) / base, None))
    return [{"check": n, "value": v, "threshold": t, "pass": None if t is None else v >= t}
            for n, v, t in checks]


def _pool_finish(report: dict) -> None:
    rows = must_show(report)
    report["must_show"] = {"checks": rows, "all_pass": all(r["pass"] for r in rows
                                                            if r["pass"] is not None)}
    for r in rows:
        verdict = "INFO" if r["pass"] is None else "PASS" if r["pass"] else "FAIL"
        print(f"{verdict} {r['check']}: {r['value']:.2f}")


POOL = common.Mode("decode_pool", "QSA paged sparse decode: the decode step from the KV pool",
                   POOL_PROVIDERS, pool_cases, pool_prepare, pool_describe, calls=CHAIN,
                   finish=_pool_finish)
MODES = {"packed": PACKED, "pool": POOL}


def add_arguments(ap) -> None:
    ap.add_argument("--tp", metavar="TP1,..", help=f"rank shapes (default {','.join(C.TP_SHAPES)})")
    ap.add_argument("--batches", metavar="B,..", help="batch sizes (default "
                    + ",".join(map(str, C.BENCH_DECODE_BATCHES)) + ")")
    ap.add_argument("--rows", metavar="KIND,..", help="row kinds (default packed: "
                    f"{','.join(C.BENCH_DECODE_ROWS)}; pool: {','.join(POOL_ROWS)})")
    ap.add_argument("--layouts", metavar="L,..", help=f"pool: {' or '.join(POOL_LAYOUTS)} "
                    "(default both)")
    ap.add_argument("--kv", metavar="DT,..", help=f"pool: {' or '.join(POOL_KV)} (default both)")
    ap.add_argument("--pool-slots", type=int, metavar="N",
                    help=f"pool: slots in the pool (default {POOL_SLOTS:,})")


def main(argv=None, prog: str | None = None) -> int:
    """``python3 -m bench.decode`` / ``qsa bench decode``; see the module docstring."""
    return common.main(MODES, "bench.decode", argv, prog, __doc__, add_arguments)


if __name__ == "__main__":  # run as bench.decode, so that pickled inputs name that module
    from bench.decode import main as _main

    sys.exit(_main())
