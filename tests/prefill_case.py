"""Seeded sparse prefill inputs for the backend prefill tests (numpy; each backend converts).

``make_case`` builds one call of any variant from ``interop.indices`` (realistic block-structured
indices, scattered ``req_to_token`` rows and pool slots) and ``reference()`` gives its float64
``interop.reference`` result. Values are rounded to the kernel dtypes here (ml_dtypes), so
``torch.from_numpy(x).to(dtype)`` / ``jnp.asarray(x, dtype)`` are exact and the reference sees
exactly what a kernel sees.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

from interop import indices as I
from interop import reference as R

RTOL = ATOL = 2e-2  # qsa-contract.md §6
REL_L2 = 5e-3
_NP = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16,
       "float8_e4m3fn": ml_dtypes.float8_e4m3fn}
#: positional parameters of each entry point, in order
PARAMS = {
    "ordinary": ("q", "k", "v", "indices", "cu_seqlens", "max_seqlen_q"),
    "chunk": ("q", "k", "v", "indices", "cu_seqlens_q", "cu_seqlens_k", "kv_lens",
              "max_seqlen_q"),
    "paged": ("q", "k_cache", "v_cache", "req_to_token", "req_indices", "indices",
              "cu_seqlens_q", "kv_lens", "max_seqlen_q"),
}
FLOATS = ("q", "k", "v", "k_cache", "v_cache")


@dataclasses.dataclass
class PrefillCase:
    """One prefill call: ``arrays`` (name -> numpy; floats as float32 holding values exact in
    ``dtype`` / ``kv_dtype``, metadata int32), ``max_seqlen_q`` and the scales."""

    kind: str
    arrays: dict
    dtype: str
    kv_dtype: str
    max_seqlen_q: int
    softmax_scale: float | None = None
    k_scale: float = 1.0
    v_scale: float = 1.0

    def args(self) -> list:
        """Positional arguments of the entry point (numpy), ``max_seqlen_q`` last."""
        return [self.max_seqlen_q if n == "max_seqlen_q" else self.arrays[n]
                for n in PARAMS[self.kind]]

    def scales(self) -> tuple:
        """(softmax_scale,) or (softmax_scale, k_scale, v_scale): the trailing positionals."""
        if self.kind == "ordinary":
            return (self.softmax_scale,)
        return (self.softmax_scale, self.k_scale, self.v_scale)

    def reference(self) -> np.ndarray:
        """float64 [T, Hq, D] from ``interop.reference``."""
        a = self.args()[:-1]
        fn = {"ordinary": R.prefill_reference, "chunk": R.prefill_chunk_reference,
              "paged": R.prefill_paged_reference}[self.kind]
        return fn(*a, *self.scales())

    def empty_rows(self) -> np.ndarray:
        """Rows whose reference is exactly zero (no valid entry for any head)."""
        return np.nonzero((self.reference() == 0).all(axis=(1, 2)))[0]


def rounded(x, dtype: str) -> np.ndarray:
    """float32 copy of x rounded to ``dtype`` (``float16`` | ``bfloat16`` | ``float8_e4m3fn``)."""
    return np.asarray(x, np.float32).astype(_NP[dtype]).astype(np.float32)


def make_case(kind: str, hq: int, hkv: int, q_lens, prefix=None, *, d: int = 32,
              width: int = 12, per_head: bool = False, junk: str = "mixed", empty_rows=(),
              dtype: str = "float16", kv_dtype: str | None = None, k_scale: float = 1.0,
              v_scale: float = 1.0, softmax_scale: float | None = None, poison: bool = False,
              table_junk: bool = False, pool_slack: int = 5, seed: int = 0) -> PrefillCase:
    """A seeded prefill call.

    Args:
      kind: "ordinary" | "chunk" | "paged"; q_lens: query rows per request; prefix: context
        before the chunk per request (chunk/paged: kv_lens = prefix + q_lens).
      per_head: indices [T, Hkv, W]; junk: padding mode (``interop.indices.JUNK_MODES``);
        empty_rows: rows with no valid entry.
      dtype: q's dtype; kv_dtype: K/V dtype (default q's).
      poison: K/V rows (pool slots) that no valid entry selects hold +-Inf / NaN.
      table_junk (paged): every req_to_token entry no valid entry reads (columns past a
        request's kv_len, the spare rows) holds a slot far past the pool.
    """
    rng = np.random.default_rng(seed)
    ql = np.asarray(q_lens, np.int64)
    kl = ql if kind == "ordinary" else ql + np.asarray(prefix, np.int64)
    lay = I.prefill_layout(kind, ql, kl, pool_slack=pool_slack, seed=seed)
    idx = I.prefill_indices(ql, None if kind == "ordinary" else kl, width=width, junk=junk,
                            empty_rows=list(empty_rows), num_kv_heads=hkv if per_head else None,
                            seed=seed + 1)
    t = int(ql.sum())
    rows = {"ordinary": t, "chunk": int(kl.sum()) + pool_slack, "paged": lay.pool_slots}[kind]
    kv_dtype = kv_dtype or dtype
    q = rounded(rng.standard_normal((t, hq, d)), dtype)
    k = rounded(rng.standard_normal((rows, hkv, d)), kv_dtype)
    v = rounded(rng.standard_normal((rows, hkv, d)), kv_dtype)
    a = {"indices": idx}
    if kind == "ordinary":
        a.update(q=q, k=k, v=v, cu_seqlens=lay.cu_seqlens_q)
    elif kind == "chunk":
        a.update(q=q, k=k, v=v, cu_seqlens_q=lay.cu_seqlens_q, cu_seqlens_k=lay.cu_seqlens_k,
                 kv_lens=lay.kv_lens)
    else:
        r2t = lay.req_to_token.copy()
        if table_junk:
            cols = np.arange(r2t.shape[1])[None, :]
            bound = np.zeros(r2t.shape[0], np.int64)
            bound[lay.req_indices] = lay.kv_lens
            r2t = np.where(cols >= bound[:, None], lay.pool_slots + 1000 + 7919 * cols, r2t)
            r2t = r2t.astype(np.int32)
        a.update(q=q, k_cache=k, v_cache=v, req_to_token=r2t, req_indices=lay.req_indices,
                 cu_seqlens_q=lay.cu_seqlens_q, kv_lens=lay.kv_lens)
    case = PrefillCase(kind, a, dtype, kv_dtype, int(lay.max_seqlen_q), softmax_scale,
                       k_scale, v_scale)
    if poison:
        poison_unselected(case)
    return case


def selected_rows(case: PrefillCase) -> np.ndarray:
    """bool [rows, Hkv]: K/V rows (pool slots) some valid entry of the case reads."""
    a = case.arrays
    k = a["k"] if "k" in a else a["k_cache"]
    hkv = k.shape[1]
    cu = a["cu_seqlens"] if case.kind == "ordinary" else a["cu_seqlens_q"]
    ql = np.diff(cu.astype(np.int64))
    req, r, _vis, bound = I.row_layout(ql, None if case.kind == "ordinary" else a["kv_lens"])
    visible = r + 1 if case.kind == "ordinary" else r + bound - ql[req] + 1
    idx = a["indices"].astype(np.int64)
    idx = idx if idx.ndim == 3 else np.repeat(idx[:, None, :], hkv, 1)
    used = np.zeros((k.shape[0], hkv), bool)
    for row, h, col in zip(*np.nonzero((idx >= 0) & (idx < bound[:, None, None]))):
        if col >= visible[row]:
            continue
        b, pos = int(req[row]), int(idx[row, h, col])
        if case.kind == "ordinary":
            kv_row = int(cu[b]) + pos
        elif case.kind == "chunk":
            kv_row = int(a["cu_seqlens_k"][b]) + pos
        else:
            kv_row = int(R.pool_slots_of(a["req_to_token"], a["req_indices"], b, [pos],
                                         k.shape[0])[0])
            if kv_row < 0:
                continue
        used[kv_row, h] = True
    return used


def poison_unselected(case: PrefillCase) -> None:
    """Write +Inf / -Inf into K and NaN into V wherever no valid entry reads (in place)."""
    used = selected_rows(case)
    names = ("k", "v") if "k" in case.arrays else ("k_cache", "v_cache")
    k, v = (case.arrays[n].copy() for n in names)
    k[~used] = np.inf
    k[np.nonzero(~used)[0][::2], np.nonzero(~used)[1][::2], 0] = -np.inf
    v[~used] = np.nan
    case.arrays[names[0]], case.arrays[names[1]] = k, v


def poison_selected(case: PrefillCase) -> None:
    """Write NaN into one element of a selected K row and of a selected V row (of KV head 0;
    other rows and heads stay finite, in place): an attended NaN, which must reach the output
    where the reference (``interop.reference``) has NaN and nowhere else."""
    used = np.nonzero(selected_rows(case)[:, 0])[0]
    names = ("k", "v") if "k" in case.arrays else ("k_cache", "v_cache")
    k, v = (case.arrays[n].copy() for n in names)
    k[used[0], 0, 1] = np.nan
    v[used[-1], 0, 3] = np.nan
    case.arrays[names[0]], case.arrays[names[1]] = k, v


def assert_nan_matches(out, ref, what: str = "") -> None:
    """NaN exactly where the reference has NaN (some, not all), ``assert_matches`` on the
    (query row, head) pairs without one."""
    out = np.asarray(out, np.float32)
    nan = np.isnan(ref)
    assert nan.any() and not nan.all(), f"{what}: the case attends no NaN"
    np.testing.assert_array_equal(np.isnan(out), nan, err_msg=what)
    fine = ~nan.any(axis=-1)
    assert_matches(out[fine], ref[fine], what)


def lying_paged_case(seed=0, **kw) -> PrefillCase:
    """Paged metadata that lies, each lie an invalid entry for the kernels (never dereferenced):
    request 0's kv_len passes req_to_token's width, request 1 maps positions to a slot past the
    pool and to a negative slot, request 2 names a row outside req_to_token (its rows: zeros).
    Pool slots no valid entry reads are poisoned after the edits."""
    case = make_case("paged", 12, 2, [4, 3, 2], [9, 5, 3], width=14, junk="mixed", seed=seed,
                     **kw)
    a = case.arrays
    a["req_to_token"] = np.ascontiguousarray(a["req_to_token"][:, :8])  # kv_lens[0] = 13 > 8
    row1 = a["req_indices"][1]
    a["req_to_token"][row1, 2] = a["k_cache"].shape[0] + 3
    a["req_to_token"][row1, 5] = -4
    a["req_indices"] = a["req_indices"].copy()
    a["req_indices"][2] = a["req_to_token"].shape[0] + 6
    poison_unselected(case)
    return case


def assert_matches(out, ref, what: str = "") -> None:
    """The contract's acceptance rule: finite, allclose(2e-2, 2e-2), relative L2 <= 5e-3, and
    exact zeros where the reference is zero (rows without a valid entry)."""
    out = np.asarray(out, np.float32)
    assert out.shape == ref.shape, what
    assert np.isfinite(out).all(), f"{what}: non-finite output"
    np.testing.assert_allclose(out, ref, rtol=RTOL, atol=ATOL, err_msg=what)
    err = R.rel_l2(out, ref)
    assert err <= REL_L2, f"{what}: rel L2 {err:.2e} > {REL_L2}"
    zero = (ref == 0).all(axis=-1)
    assert (out[zero] == 0).all(), f"{what}: rows without a valid entry are not exact zeros"


def torch_reference(kind: str, t: dict, softmax_scale=None, k_scale: float = 1.0,
                    v_scale: float = 1.0, *, chunk_rows: int = 128):
    """float32 torch version of ``interop.reference`` on the tensors' device (GPU-sized cases,
    where the float64 numpy loop is too slow): the same validity rule (paged lying metadata
    included), gathers only valid entries, zeros for rows without one.

    Args:
      kind: "ordinary" | "chunk" | "paged"; t: parameter name -> torch tensor (``PARAMS``).

    Returns:
      float32 torch tensor [T, Hq, D].
    """
    import torch  # noqa: PLC0415

    q = t["q"]
    k, v = (t["k"], t["v"]) if "k" in t else (t["k_cache"], t["v_cache"])
    n, hq, d = q.shape
    hkv = k.shape[1]
    cu = (t["cu_seqlens"] if kind == "ordinary" else t["cu_seqlens_q"]).long()
    ql = cu[1:] - cu[:-1]
    req = torch.repeat_interleave(torch.arange(ql.numel(), device=q.device), ql)
    r = torch.arange(n, device=q.device) - cu[req]
    bound = ql[req] if kind == "ordinary" else t["kv_lens"].long()[req]
    visible = r + 1 if kind == "ordinary" else r + bound - ql[req] + 1
    scale = (d ** -0.5 if softmax_scale is None else softmax_scale) * k_scale
    heads = torch.arange(hkv, device=q.device)[None, :, None]
    out = torch.zeros(n, hq, d, dtype=torch.float32, device=q.device)
    with torch.no_grad():
        for s in range(0, n, chunk_rows):
            e = min(n, s + chunk_rows)
            ii = t["indices"][s:e].long()
            ii = ii if ii.dim() == 3 else ii[:, None, :].expand(-1, hkv, -1)
            cols = torch.arange(ii.shape[-1], device=q.device)
            ok = (ii >= 0) & (ii < bound[s:e, None, None]) & (cols < visible[s:e, None, None])
            pos = torch.where(ok, ii, 0)
            if kind == "paged":
                r2t = t["req_to_token"].long()
                row = t["req_indices"].long()[req[s:e]]
                row_ok = (row >= 0) & (row < r2t.shape[0])
                ok &= row_ok[:, None, None] & (pos < r2t.shape[1])
                pos = torch.where(ok, pos, 0)
                phys = r2t[torch.where(row_ok, row, 0)[:, None, None], pos] if r2t.numel() else pos
                ok &= (phys >= 0) & (phys < k.shape[0])
            else:
                base = cu if kind == "ordinary" else t["cu_seqlens_k"].long()
                phys = base[req[s:e]][:, None, None] + pos
            phys = torch.where(ok, phys, 0)
            kk = torch.where(ok[..., None], k[phys, heads].float(), 0.0)
            vv = torch.where(ok[..., None], v[phys, heads].float(), 0.0)
            qq = q[s:e].float().view(e - s, hkv, hq // hkv, d)
            sc = torch.einsum("nhgd,nhwd->nhgw", qq, kk) * scale
            sc = sc.masked_fill(~ok[:, :, None, :], float("-inf"))
            p = torch.nan_to_num(torch.softmax(sc, dim=-1), nan=0.0)  # rows without an entry
            o = torch.einsum("nhgw,nhwd->nhgd", p, vv) * v_scale
            out[s:e] = o.reshape(e - s, hq, d)
    return out
