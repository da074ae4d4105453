"""Sparse prefill cases and a float32 torch reference, shared by tests and ``bench/prefill.py``.

``make_case`` builds one seeded prefill batch (any variant, any device) from the realistic,
block-structured indices of ``interop.indices`` (512 blocks of 4 tokens plus the causal tail,
adjacent rows sharing most blocks). ``reference_f32`` is a chunked float32 torch version of
``interop.reference`` (same semantics: an entry is valid iff 0 <= idx < len, invalid entries are
never gathered, a row without a valid entry is 0) that runs on the GPU at 8192 rows x 2051 columns,
where the float64 numpy oracle is too slow; ``tests/test_triton_prefill.py`` checks it against the
oracle on small cases.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from interop import indices as I

__all__ = ["Case", "make_case", "reference_f32", "errors", "within_tolerance", "RTOL", "ATOL",
           "REL_L2"]

#: acceptance (qsa-contract.md §6): elementwise rtol = atol = 2e-2 and relative L2 <= 5e-3
RTOL = ATOL = 2e-2
REL_L2 = 5e-3


@dataclasses.dataclass
class Case:
    """One prefill batch. Tensors live on ``device``; host copies of the metadata are kept for
    the numpy oracle.

    kind: "ordinary" | "chunk" | "paged". q [T, Hq, D]; k, v: [T, Hkv, D] (ordinary), the packed
    contexts [sum kv_lens, Hkv, D] (chunk) or the pool [slots, Hkv, D] (paged); indices int32
    [T, W] or [T, Hkv, W]; cu_q int32 [B+1]; cu_k int32 [B+1] (chunk); kv_lens int32 [B];
    slot_table int32 [B, max_kv] (paged); max_q host int.
    """

    kind: str
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    indices: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    kv_lens: torch.Tensor
    slot_table: torch.Tensor | None
    max_q: int
    k_scale: float = 1.0
    v_scale: float = 1.0
    softmax_scale: float | None = None

    @property
    def total_q(self) -> int:
        return int(self.q.shape[0])

    def run(self, fn_ordinary=None, fn_chunk=None, fn_paged=None):
        """Call the public entry point of this case's variant (defaults: qsa_triton's)."""
        import qsa_triton.prefill as P  # noqa: PLC0415 - lazy: bench/tests import order

        if self.kind == "ordinary":
            return (fn_ordinary or P.sparse_prefill)(self.q, self.k, self.v, self.indices, self.cu_q,
                                                     self.max_q, self.softmax_scale)
        if self.kind == "chunk":
            return (fn_chunk or P.sparse_prefill_chunk)(
                self.q, self.k, self.v, self.indices, self.cu_q, self.cu_k, self.kv_lens,
                self.max_q, self.softmax_scale, self.k_scale, self.v_scale)
        return (fn_paged or P.sparse_prefill_paged)(
            self.q, self.k, self.v, self.slot_table, self.req_indices, self.indices, self.cu_q,
            self.kv_lens, self.max_q, self.softmax_scale, self.k_scale, self.v_scale)

    @property
    def req_indices(self) -> torch.Tensor:
        """int32 [B] = 0..B-1: ``slot_table`` is passed as ``req_to_token``, one row per request."""
        return torch.arange(self.cu_q.shape[0] - 1, dtype=torch.int32, device=self.cu_q.device)

    def numpy_reference(self) -> np.ndarray:
        """float64 numpy oracle (``interop.reference``); small cases only."""
        from interop import reference as R  # noqa: PLC0415

        f = lambda t: t.detach().float().cpu().numpy()  # noqa: E731
        q, k, v, idx = f(self.q), f(self.k), f(self.v), self.indices.cpu().numpy()
        cu = self.cu_q.cpu().numpy()
        if self.kind == "ordinary":
            return R.prefill_reference(q, k, v, idx, cu, self.softmax_scale)
        if self.kind == "chunk":
            return R.prefill_chunk_reference(q, k, v, idx, cu, self.cu_k.cpu().numpy(),
                                             self.kv_lens.cpu().numpy(), self.softmax_scale,
                                             self.k_scale, self.v_scale)
        return R.prefill_paged_reference(q, k, v, self.slot_table.cpu().numpy(),
                                         self.req_indices.cpu().numpy(), idx, cu,
                                         self.kv_lens.cpu().numpy(), self.softmax_scale,
                                         self.k_scale, self.v_scale)

    def valid_entries(self) -> int:
        """Valid (gathered) index entries over all rows and KV heads."""
        idx = self.indices.long()
        lens = _row_bound(self)
        while lens.dim() < idx.dim():
            lens = lens[..., None]
        n = int(((idx >= 0) & (idx < lens)).sum())
        return n * (self.k.shape[1] if self.indices.dim() == 2 else 1)


def _row_req(cu_q: torch.Tensor) -> torch.Tensor:
    q_lens = (cu_q[1:] - cu_q[:-1]).long()
    return torch.repeat_interleave(torch.arange(q_lens.numel(), device=cu_q.device), q_lens)


def _row_bound(c: Case) -> torch.Tensor:
    req = _row_req(c.cu_q)
    if c.kind == "ordinary":
        return (c.cu_q[1:] - c.cu_q[:-1]).long()[req]
    return c.kv_lens.long()[req]


def make_case(kind: str, hq: int, hkv: int, d: int, q_lens, kv_lens=None, *, width: int = I.WIDTH,
              junk: str = "-1", per_head: bool = False, dtype=torch.bfloat16, kv_dtype=None,
              empty_rows=0.0, overlap: float = 0.9, nan_unselected: bool = False,
              pool_slack: int = 0, table_junk: bool = False, k_scale: float = 1.0,
              v_scale: float = 1.0, softmax_scale=None, seed: int = 0, device="cpu") -> Case:
    """Seeded prefill batch.

    Args:
      kind: "ordinary" | "chunk" | "paged".
      hq, hkv, d: heads and head dim. q_lens: query rows per request; kv_lens: context per
        request (chunk/paged; >= q_lens; None = no prefix).
      width: W; junk: padding mode of ``interop.indices.JUNK_MODES``; per_head: indices
        [T, Hkv, W] instead of [T, W]; empty_rows: fraction or row list without a valid entry.
      dtype: q dtype; kv_dtype: K/V dtype (None = q's; torch.float8_e4m3fn for FP8).
      nan_unselected: write NaN into every K/V row (pool slot) no valid entry selects.
      pool_slack: unused extra pool slots (paged); table_junk: fill slot-table columns past each
        request's kv_len with slots past the pool (never to be read).
    """
    g = torch.Generator().manual_seed(seed)
    ql = np.asarray(q_lens, np.int64)
    kl = ql if kind == "ordinary" or kv_lens is None else np.asarray(kv_lens, np.int64)
    lay = I.prefill_layout(kind, ql, None if kind == "ordinary" else kl, pool_slack=pool_slack,
                           seed=seed)
    idx = I.prefill_indices(ql, None if kind == "ordinary" else kl, width=width, junk=junk,
                            overlap=overlap, empty_rows=empty_rows,
                            num_kv_heads=hkv if per_head else None, seed=seed)
    t = int(ql.sum())
    rows = {"ordinary": t, "chunk": int(kl.sum()), "paged": lay.pool_slots}[kind]
    q = torch.randn(t, hq, d, generator=g).to(dtype)
    kvd = kv_dtype or dtype
    k = torch.randn(rows, hkv, d, generator=g).to(kvd)
    v = torch.randn(rows, hkv, d, generator=g).to(kvd)
    st = None if lay.slot_table is None else lay.slot_table.astype(np.int64)
    if nan_unselected:
        used = np.zeros((rows, hkv), bool)
        bounds = lay.kv_lens.astype(np.int64)
        req = np.repeat(np.arange(ql.size), ql)
        base = (lay.cu_seqlens_q if kind == "ordinary" else lay.cu_seqlens_k).astype(np.int64)
        i3 = idx.astype(np.int64) if idx.ndim == 3 else np.broadcast_to(
            idx.astype(np.int64)[:, None, :], (t, hkv, idx.shape[-1]))
        ok = (i3 >= 0) & (i3 < bounds[req][:, None, None])
        r_, h_, c_ = np.nonzero(ok)
        pos = i3[r_, h_, c_]
        phys = st[req[r_], pos] if kind == "paged" else base[req[r_]] + pos
        used[phys, h_] = True
        mask = torch.from_numpy(~used)
        k = k.float().masked_fill(mask[..., None], float("nan")).to(kvd)
        v = v.float().masked_fill(mask[..., None], float("nan")).to(kvd)
    if kind == "paged" and table_junk:
        cols = np.arange(st.shape[1])[None, :]
        junk_slots = lay.pool_slots + 1000 + cols * 7919  # far past the pool
        st = np.where(cols >= lay.kv_lens[:, None], junk_slots, st)
    dev = torch.device(device)
    i32 = lambda a: torch.as_tensor(np.asarray(a, np.int64).astype(np.int32)).to(dev)  # noqa: E731
    return Case(kind, q.to(dev), k.to(dev), v.to(dev), i32(idx), i32(lay.cu_seqlens_q),
                i32(lay.cu_seqlens_k), i32(lay.kv_lens), None if st is None else i32(st),
                int(lay.max_seqlen_q), k_scale, v_scale, softmax_scale)


@torch.no_grad()
def reference_f32(c: Case, *, chunk_rows: int = 128) -> torch.Tensor:
    """float32 torch reference of ``c`` on c's device (same semantics as ``interop.reference``:
    reads all W columns, gathers only valid entries, zeros for rows without one).

    Returns:
      [T, Hq, D] float32.
    """
    q, k, v, idx = c.q, c.k, c.v, c.indices
    t, hq, d = q.shape
    hkv = k.shape[1]
    grp = hq // hkv
    scale = (d ** -0.5 if c.softmax_scale is None else c.softmax_scale) * c.k_scale
    req = _row_req(c.cu_q)
    bound = _row_bound(c)
    if c.kind == "ordinary":
        base = c.cu_q.long()[req]
    elif c.kind == "chunk":
        base = c.cu_k.long()[req]
    else:
        base = None
    out = torch.zeros(t, hq, d, dtype=torch.float32, device=q.device)
    heads = torch.arange(hkv, device=q.device)
    for s in range(0, t, chunk_rows):
        e = min(t, s + chunk_rows)
        ii = idx[s:e].long()
        if ii.dim() == 2:
            ii = ii[:, None, :].expand(-1, hkv, -1)
        ok = (ii >= 0) & (ii < bound[s:e, None, None])
        pos = torch.where(ok, ii, torch.zeros_like(ii))
        if base is None:
            phys = c.slot_table.long()[req[s:e, None, None], pos]
        else:
            phys = base[s:e, None, None] + pos
        phys = torch.where(ok, phys, torch.zeros_like(phys))
        kk = k[phys, heads[None, :, None]].float()  # [n, Hkv, W, D]
        kk = torch.where(ok[..., None], kk, torch.zeros_like(kk))
        vv = v[phys, heads[None, :, None]].float()
        vv = torch.where(ok[..., None], vv, torch.zeros_like(vv))
        qq = q[s:e].float().view(e - s, hkv, grp, d)
        sc = torch.einsum("nhgd,nhwd->nhgw", qq, kk) * scale
        sc = sc.masked_fill(~ok[:, :, None, :], float("-inf"))
        p = torch.softmax(sc, dim=-1)
        p = torch.nan_to_num(p, nan=0.0)  # rows without a valid entry
        o = torch.einsum("nhgw,nhwd->nhgd", p, vv) * c.v_scale
        out[s:e] = o.reshape(e - s, hq, d)
    return out


def errors(out, ref) -> dict:
    """max abs error, max excess over rtol/atol, relative L2 and finiteness of ``out`` vs ``ref``."""
    o = torch.as_tensor(out).double().cpu() if not isinstance(out, np.ndarray) else torch.from_numpy(out).double()
    r = torch.as_tensor(ref).double().cpu() if not isinstance(ref, np.ndarray) else torch.from_numpy(ref).double()
    finite = bool(torch.isfinite(o).all())
    diff = (o - r).abs()
    den = float(r.norm())
    rel = float((o - r).norm() / den) if den > 0 else float((o - r).norm())
    excess = float((diff - (ATOL + RTOL * r.abs())).max()) if o.numel() else 0.0
    return {"max_abs": float(diff.max()) if o.numel() else 0.0, "excess": excess,
            "rel_l2": rel if math.isfinite(rel) else float("inf"), "finite": finite}


def within_tolerance(err: dict) -> bool:
    """rtol = atol = 2e-2 elementwise, rel L2 <= 5e-3, finite (qsa-contract.md §6)."""
    return err["finite"] and err["excess"] <= 0.0 and err["rel_l2"] <= REL_L2
