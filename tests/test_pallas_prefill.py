"""CPU tests (Pallas interpret mode) of ``qsa_pallas`` sparse prefill against ``interop.reference``.

Tiny shapes (D = 64 mostly, W = 24, a few rows per request) so the interpreter stays fast on two
shared cores. Every value check uses the contract's acceptance rule (qsa-contract.md §6):
``rtol = atol = 2e-2`` elementwise AND relative L2 <= 5e-3 against the float64 reference, plus
finiteness. ``make_case`` is shared with ``tests/test_cross_prefill.py``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from interop import indices as qidx
from interop.reference import (prefill_chunk_reference, prefill_paged_reference,
                               prefill_reference, rel_l2)
from qsa_pallas import ContractError, sparse_prefill, sparse_prefill_chunk, sparse_prefill_paged
from qsa_pallas import _compat

RTOL = ATOL = 2e-2
REL_L2 = 5e-3
FP8 = jnp.float8_e4m3fn


# --------------------------------------------------------------------------------------------
# Case builder
@dataclasses.dataclass
class Case:
    """One prefill call: numpy inputs (kernel dtypes), their float32 views and the reference."""

    kind: str
    np_args: dict  # name -> numpy array in the kernel's dtype (ml_dtypes for bf16/fp8)
    max_seqlen_q: int
    softmax_scale: float | None
    k_scale: float
    v_scale: float
    ref: np.ndarray  # [T, Hq, D] float64
    empty_rows: np.ndarray  # rows with no valid entry (must be exact zeros)

    def jax_args(self) -> dict:
        return {k: jnp.asarray(v) for k, v in self.np_args.items()}

    def call(self, **kw):
        a = self.jax_args()
        return run_pallas(self.kind, a, self.max_seqlen_q, self.softmax_scale, self.k_scale,
                          self.v_scale, **kw)


def run_pallas(kind, a, max_seqlen_q, softmax_scale=None, k_scale=1.0, v_scale=1.0, **kw):
    """Call the Pallas entry point of ``kind`` with the argument dict of ``make_case``."""
    if kind == "ordinary":
        return sparse_prefill(a["q"], a["k"], a["v"], a["indices"], a["cu_seqlens"], max_seqlen_q,
                              softmax_scale, **kw)
    if kind == "chunk":
        return sparse_prefill_chunk(a["q"], a["k"], a["v"], a["indices"], a["cu_seqlens_q"],
                                    a["cu_seqlens_k"], a["kv_lens"], max_seqlen_q, softmax_scale,
                                    k_scale, v_scale, **kw)
    return sparse_prefill_paged(a["q"], a["k_cache"], a["v_cache"], a["slot_table"], a["indices"],
                                a["cu_seqlens_q"], a["kv_lens"], max_seqlen_q, softmax_scale,
                                k_scale, v_scale, **kw)


def _f32(x) -> np.ndarray:
    return np.asarray(x).astype(np.float32)


def make_case(kind: str, hq: int, hkv: int, *, q_lens, prefix=None, d: int = 64, width: int = 24,
              per_head: bool = False, junk: str = "mixed", empty_rows=(), dtype=jnp.float16,
              kv_dtype=None, k_scale: float = 1.0, v_scale: float = 1.0,
              softmax_scale: float | None = None, poison: bool = False, pool_slack: int = 5,
              seed: int = 0) -> Case:
    """Build a prefill case with realistic block-structured indices (``interop.indices``).

    Args:
      kind: "ordinary" | "chunk" | "paged"; q_lens: query rows per request; prefix: context
        tokens before the chunk per request (chunk/paged; kv_lens = prefix + q_lens).
      per_head: indices [T, Hkv, W] instead of [T, W]; junk: padding mode (interop.indices).
      empty_rows: rows made entirely of junk (no valid entry).
      kv_dtype: K/V dtype (default q's; FP8 e4m3 for chunk/paged).
      poison: fill every K/V row that no valid entry selects with NaN / Inf.
    """
    rng = np.random.default_rng(seed)
    q_lens = np.asarray(q_lens, np.int64)
    kv_lens = q_lens if kind == "ordinary" else q_lens + np.asarray(prefix, np.int64)
    lay = qidx.prefill_layout(kind, q_lens, kv_lens, pool_slack=pool_slack, seed=seed)
    t = int(q_lens.sum())
    idx = qidx.prefill_indices(q_lens, None if kind == "ordinary" else kv_lens, width=width,
                               junk=junk, empty_rows=list(empty_rows),
                               num_kv_heads=hkv if per_head else None, seed=seed + 1)
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    rows = lay.pool_slots + (pool_slack if kind == "chunk" else 0)
    q = rng.standard_normal((t, hq, d)).astype(np.float32)
    k = rng.standard_normal((rows, hkv, d)).astype(np.float32)
    v = rng.standard_normal((rows, hkv, d)).astype(np.float32)

    req, _r, _vis, bound = qidx.row_layout(q_lens, None if kind == "ordinary" else kv_lens)
    idx3 = idx if per_head else np.repeat(idx[:, None, :], hkv, 1)
    valid = (idx3 >= 0) & (idx3 < bound[:, None, None])
    if poison:
        used = np.zeros((rows, hkv), bool)
        for row, h, col in zip(*np.nonzero(valid)):
            pos = int(idx3[row, h, col])
            b = int(req[row])
            if kind == "ordinary":
                kv_row = lay.cu_seqlens_q[b] + pos
            elif kind == "chunk":
                kv_row = lay.cu_seqlens_k[b] + pos
            else:
                kv_row = lay.slot_table[b, pos]
            used[kv_row, h if per_head else slice(None)] = True
        k[~used] = np.inf
        v[~used] = np.nan
        k[np.nonzero(~used)[0][::2], 0, 0] = -np.inf

    qj = np.asarray(jnp.asarray(q, dtype))
    kj = np.asarray(jnp.asarray(k, kv_dtype))
    vj = np.asarray(jnp.asarray(v, kv_dtype))
    q32, k32, v32 = _f32(qj), _f32(kj), _f32(vj)
    if kind == "ordinary":
        np_args = dict(q=qj, k=kj, v=vj, indices=idx, cu_seqlens=lay.cu_seqlens_q)
        ref = prefill_reference(q32, k32, v32, idx, lay.cu_seqlens_q, softmax_scale)
    elif kind == "chunk":
        np_args = dict(q=qj, k=kj, v=vj, indices=idx, cu_seqlens_q=lay.cu_seqlens_q,
                       cu_seqlens_k=lay.cu_seqlens_k, kv_lens=lay.kv_lens)
        ref = prefill_chunk_reference(q32, k32, v32, idx, lay.cu_seqlens_q, lay.cu_seqlens_k,
                                      lay.kv_lens, softmax_scale, k_scale, v_scale)
    else:
        np_args = dict(q=qj, k_cache=kj, v_cache=vj, slot_table=lay.slot_table, indices=idx,
                       cu_seqlens_q=lay.cu_seqlens_q, kv_lens=lay.kv_lens)
        ref = prefill_paged_reference(q32, k32, v32, lay.slot_table, idx, lay.cu_seqlens_q,
                                      lay.kv_lens, softmax_scale, k_scale, v_scale)
    empty = np.nonzero(~valid.any(-1).any(-1))[0]
    return Case(kind, np_args, lay.max_seqlen_q, softmax_scale, k_scale, v_scale, ref, empty)


def assert_matches(out, ref, *, what=""):
    """The contract's acceptance rule: finite, allclose(2e-2, 2e-2) and rel L2 <= 5e-3."""
    out = _f32(out)
    assert out.shape == ref.shape, what
    assert np.isfinite(out).all(), f"{what}: non-finite output"
    np.testing.assert_allclose(out, ref, rtol=RTOL, atol=ATOL, err_msg=what)
    err = rel_l2(out, ref)
    assert err <= REL_L2, f"{what}: rel L2 {err:.2e} > {REL_L2}"


# --------------------------------------------------------------------------------------------
# Values
HEAD_PAIRS = [(3, 1), (6, 1), (12, 1), (12, 2), (24, 2)]


@pytest.mark.parametrize("hq,hkv", HEAD_PAIRS)
def test_ordinary_head_pairs(hq, hkv):
    case = make_case("ordinary", hq, hkv, q_lens=[5, 11], junk="mixed", empty_rows=[7],
                     seed=hq + hkv)
    out = case.call()
    assert_matches(out, case.ref, what=f"ordinary {hq}/{hkv}")
    assert 7 in case.empty_rows
    assert (_f32(out)[case.empty_rows] == 0).all()


@pytest.mark.parametrize("hq,hkv,per_head,junk", [
    (12, 2, True, "-1"), (6, 1, False, "-7"), (24, 2, False, "len"), (3, 1, True, "len+19"),
])
def test_chunk_ragged_prefixes(hq, hkv, per_head, junk):
    case = make_case("chunk", hq, hkv, q_lens=[3, 7, 1], prefix=[10, 0, 21], per_head=per_head,
                     junk=junk, seed=3)
    assert_matches(case.call(), case.ref, what=f"chunk {hq}/{hkv} {junk}")


@pytest.mark.parametrize("hq,hkv,per_head,junk", [
    (12, 2, True, "mixed"), (12, 1, False, "len"), (6, 1, False, "-1"),
])
def test_paged_ragged_prefixes(hq, hkv, per_head, junk):
    case = make_case("paged", hq, hkv, q_lens=[4, 6], prefix=[13, 2], per_head=per_head,
                     junk=junk, pool_slack=9, seed=5)
    assert_matches(case.call(), case.ref, what=f"paged {hq}/{hkv} {junk}")


@pytest.mark.parametrize("per_head", [False, True])
def test_resolve_pool_slots_matches_numpy(per_head):
    from qsa_pallas.prefill import resolve_pool_slots  # noqa: PLC0415

    case = make_case("paged", 12, 2, q_lens=[3, 5], prefix=[4, 9], per_head=per_head,
                     junk="mixed", pool_slack=4, seed=61)
    a = case.np_args
    st = a["slot_table"].copy()
    st[1, 2] = 10**6  # a slot past the pool: invalid, never gathered
    pool = a["k_cache"].shape[0]
    got = np.asarray(resolve_pool_slots(jnp.asarray(a["indices"]), jnp.asarray(st),
                                        jnp.asarray(a["cu_seqlens_q"]), jnp.asarray(a["kv_lens"]),
                                        pool))
    req, _r, _vis, bound = qidx.row_layout([3, 5], a["kv_lens"])
    idx = a["indices"].astype(np.int64)
    lead = (slice(None),) + (None,) * (idx.ndim - 1)
    valid = (idx >= 0) & (idx < bound[lead])
    want = np.where(valid, st[req[lead], np.where(valid, idx, 0)], -1)
    want = np.where((want >= 0) & (want < pool), want, -1)
    np.testing.assert_array_equal(got, want)
    assert (got == -1).any() and (got >= 0).any()


@pytest.mark.parametrize("kind,kw", [("ordinary", {}), ("chunk", {}), ("paged", {})])
def test_rows_past_the_last_request_give_zeros(kind, kw):
    """A batch padded to a static T (rows past cu_seqlens[B]) is accepted: those rows are 0."""
    case = make_case(kind, 6, 1, q_lens=[4, 3], prefix=[2, 5], seed=67)
    a = case.jax_args()
    pad = 5
    a["q"] = jnp.concatenate([a["q"], jnp.ones((pad,) + a["q"].shape[1:], a["q"].dtype)])
    idx = a["indices"]
    a["indices"] = jnp.concatenate([idx, jnp.zeros((pad,) + idx.shape[1:], idx.dtype)])
    if kind == "ordinary":
        a["k"] = jnp.concatenate([a["k"], jnp.ones((pad,) + a["k"].shape[1:], a["k"].dtype)])
        a["v"] = jnp.concatenate([a["v"], jnp.ones((pad,) + a["v"].shape[1:], a["v"].dtype)])
    out = _f32(run_pallas(kind, a, case.max_seqlen_q, **kw))
    assert_matches(out[:-pad], case.ref, what=f"padded {kind} {kw}")
    assert (out[-pad:] == 0).all()


@pytest.mark.parametrize("kind,hq,hkv,per_head", [
    ("chunk", 12, 1, False), ("chunk", 24, 2, True), ("paged", 6, 1, False), ("paged", 12, 2, True),
])
def test_fp8_kv_with_scales(kind, hq, hkv, per_head):
    case = make_case(kind, hq, hkv, q_lens=[4, 5], prefix=[9, 17], per_head=per_head,
                     dtype=jnp.bfloat16, kv_dtype=FP8, k_scale=0.75, v_scale=1.6, seed=7)
    assert case.np_args["k" if kind == "chunk" else "k_cache"].dtype == np.dtype(FP8)
    assert_matches(case.call(), case.ref, what=f"fp8 {kind} {hq}/{hkv}")


def test_bf16_ordinary_and_custom_scale():
    case = make_case("ordinary", 12, 2, q_lens=[9], dtype=jnp.bfloat16, softmax_scale=0.2,
                     per_head=True, seed=11)
    assert_matches(case.call(), case.ref, what="bf16 ordinary scale 0.2")


@pytest.mark.parametrize("kind,kv_dtype", [("ordinary", None), ("chunk", None), ("paged", FP8)])
def test_nan_inf_in_unselected_rows_never_leak(kind, kv_dtype):
    # request 2 has no valid entry at all, so its K/V rows are certainly never selected
    case = make_case(kind, 6, 1, q_lens=[6, 5, 3], prefix=[7, 3, 2], junk="mixed", poison=True,
                     kv_dtype=kv_dtype, dtype=jnp.bfloat16 if kv_dtype else jnp.float16,
                     empty_rows=[2, 11, 12, 13], seed=13)
    kv = case.np_args["k" if kind != "paged" else "k_cache"]
    assert not np.isfinite(_f32(kv)).all(), "the poison must be there"
    out = case.call()
    assert_matches(out, case.ref, what=f"poisoned {kind}")
    assert (_f32(out)[case.empty_rows] == 0).all()


@pytest.mark.parametrize("kind", ["ordinary", "chunk", "paged"])
def test_rows_without_valid_entry_are_exact_zeros(kind):
    empty = [0, 3, 4]
    case = make_case(kind, 12, 2, q_lens=[4, 3], prefix=[5, 0], empty_rows=empty, junk="mixed",
                     seed=17)
    assert set(empty) <= set(case.empty_rows.tolist())
    out = _f32(case.call())
    assert (out[empty] == 0).all()
    assert_matches(out, case.ref, what=f"empty rows {kind}")


def test_chunk_shorter_context_than_rows_visible_clipped():
    """Width larger than any row's visible count (early stop) and W not a BLOCK_N multiple."""
    case = make_case("chunk", 12, 1, q_lens=[2, 9], prefix=[1, 4], width=37, seed=19)
    assert_matches(case.call(), case.ref, what="W=37")


def test_entries_past_the_visible_count_are_ignored_for_any_block_n():
    """The early stop masks columns >= min(W, visible) exactly (not at a BLOCK_N boundary): a
    stale in-range entry past the visible count (a layout the debug validator rejects) is not
    attended, whatever BLOCK_N, so results never depend on the geometry."""
    from qsa_pallas.prefill import PallasPrefillGeometry  # noqa: PLC0415

    case = make_case("chunk", 12, 1, q_lens=[6], prefix=[2], width=40, junk="-1", seed=59)
    a = case.jax_args()
    idx = np.asarray(case.np_args["indices"]).copy()
    visible = np.arange(6) + 2 + 1
    stale = idx.copy()
    for r in range(6):
        stale[r, visible[r]] = 0  # in range (< kv_len = 8), but past the row's visible count
    a["indices"] = jnp.asarray(stale)
    outs = []
    for bn in (16, 32, 64):
        geo = PallasPrefillGeometry(16, bn, 4, 2, "test")
        outs.append(_f32(run_pallas("chunk", a, case.max_seqlen_q, geometry=geo)))
        assert_matches(outs[-1], case.ref, what=f"BLOCK_N={bn}")
    np.testing.assert_allclose(outs[0], outs[2], rtol=1e-2, atol=1e-2)


def test_d256_chunk_fp8():
    case = make_case("chunk", 12, 1, q_lens=[3, 2], prefix=[6, 11], d=256, width=16,
                     dtype=jnp.bfloat16, kv_dtype=FP8, k_scale=1.3, v_scale=0.6, seed=23)
    assert_matches(case.call(), case.ref, what="D=256 fp8 chunk")


def test_d256_ordinary():
    case = make_case("ordinary", 6, 1, q_lens=[7], d=256, width=16, seed=29)
    assert_matches(case.call(), case.ref, what="D=256 ordinary")


@pytest.mark.parametrize("kind", ["ordinary", "paged"])
def test_two_runs_bitwise_equal(kind):
    case = make_case(kind, 12, 2, q_lens=[5, 4], prefix=[3, 8], per_head=True, seed=31)
    a, b = _f32(case.call()), _f32(case.call())
    assert np.array_equal(a, b)
    assert_matches(a, case.ref, what="determinism")


# --------------------------------------------------------------------------------------------
# jit, shard_map, a jitted multi-layer prefill step
def test_jit_traced_lengths_and_indices_one_trace():
    """Lengths and indices are traced (device data), max_seqlen_q static: two batches with the
    same shapes but different request splits reuse one trace and both match the reference."""
    traces = []

    @jax.jit
    def step(q, k, v, idx, cu_q, cu_k, kv_lens):
        traces.append(1)
        return sparse_prefill_chunk(q, k, v, idx, cu_q, cu_k, kv_lens, 8)

    c1 = make_case("chunk", 12, 2, q_lens=[4, 5], prefix=[6, 2], pool_slack=0, seed=37)
    c2 = make_case("chunk", 12, 2, q_lens=[8, 1], prefix=[3, 5], pool_slack=0, seed=41)
    for c in (c1, c2):
        assert c.np_args["k"].shape == c1.np_args["k"].shape
        a = c.jax_args()
        out = step(a["q"], a["k"], a["v"], a["indices"], a["cu_seqlens_q"], a["cu_seqlens_k"],
                   a["kv_lens"])
        assert_matches(out, c.ref, what="jit")
    assert len(traces) == 1


def test_shard_map_over_kv_heads():
    devices = jax.devices()
    if len(devices) < 2:
        pytest.skip(f"needs 2 devices (conftest forces 2 host devices), have {len(devices)}")
    from jax.sharding import Mesh, PartitionSpec as P  # noqa: PLC0415

    mesh = Mesh(np.array(devices[:2]), ("h",))
    for per_head in (False, True):
        case = make_case("paged", 12, 2, q_lens=[5, 3], prefix=[4, 9], per_head=per_head,
                         seed=43 + per_head)
        a = case.jax_args()
        idx_spec = P(None, "h", None) if per_head else P()

        def local(q, kc, vc, st, idx, cu, kl):
            return sparse_prefill_paged(q, kc, vc, st, idx, cu, kl, case.max_seqlen_q)

        f = jax.jit(_compat.shard_map(
            local, mesh=mesh,
            in_specs=(P(None, "h", None), P(None, "h", None), P(None, "h", None), P(), idx_spec,
                      P(), P()),
            out_specs=P(None, "h", None)))
        out = f(a["q"], a["k_cache"], a["v_cache"], a["slot_table"], a["indices"],
                a["cu_seqlens_q"], a["kv_lens"])
        assert_matches(out, case.ref, what=f"shard_map per_head={per_head}")


def _request_positions(cu_q, kv_lens, t):
    """Per packed row: request id and absolute context position (traced, plain JAX)."""
    rows = jnp.arange(t, dtype=jnp.int32)
    req = jnp.searchsorted(cu_q[1:], rows, side="right").astype(jnp.int32)
    q_len = cu_q[req + 1] - cu_q[req]
    pos = kv_lens[req] - q_len + (rows - cu_q[req])
    return req, pos


@pytest.mark.parametrize("hq,hkv,fp8", [(12, 2, False), (6, 1, True)])
def test_jitted_two_layer_prefill_step_writes_pool_then_paged_kernel(hq, hkv, fp8):
    """A jitted prefill step of a 2-layer toy model: per layer project q/k/v, scatter the new K/V
    into the paged pool through the slot table, run the paged kernel on the pool, project out,
    add the residual. Checked per layer against ``prefill_paged_reference`` on the pool the step
    wrote, and end to end against a float64 numpy re-implementation."""
    n_layers, d, e = 2, 64, 96
    q_lens, prefix = np.array([5, 4]), np.array([6, 3])
    kv_lens = q_lens + prefix
    lay = qidx.prefill_layout("paged", q_lens, kv_lens, pool_slack=7, seed=47)
    idx = qidx.prefill_indices(q_lens, kv_lens, width=24, junk="mixed", seed=48)
    t, slots = int(q_lens.sum()), lay.pool_slots
    rng = np.random.default_rng(49)
    dtype = jnp.float16  # bf16 residual-stream rounding alone would eat the end-to-end budget
    pool_dtype = FP8 if fp8 else dtype
    k_scale, v_scale = (0.5, 0.25) if fp8 else (1.0, 1.0)
    params = [dict(wq=rng.standard_normal((e, hq * d)) / np.sqrt(e),
                   wk=rng.standard_normal((e, hkv * d)) / np.sqrt(e),
                   wv=rng.standard_normal((e, hkv * d)) / np.sqrt(e),
                   wo=rng.standard_normal((hq * d, e)) / np.sqrt(hq * d)) for _ in range(n_layers)]
    params = [{k: np.asarray(jnp.asarray(w, dtype)) for k, w in p.items()} for p in params]
    x0 = np.asarray(jnp.asarray(rng.standard_normal((t, e)), dtype))
    # the prefix K/V already in the pool (quantised when FP8)
    pools0 = [(np.asarray(jnp.asarray(rng.standard_normal((slots, hkv, d)) / k_scale, pool_dtype)),
               np.asarray(jnp.asarray(rng.standard_normal((slots, hkv, d)) / v_scale, pool_dtype)))
              for _ in range(n_layers)]

    @jax.jit
    def prefill_step(params, x, pools, slot_table, indices, cu_q, kv_lens_d):
        req, pos = _request_positions(cu_q, kv_lens_d, x.shape[0])
        new_slots = slot_table[req, pos]
        new_pools, trace = [], []
        for p, (kc, vc) in zip(params, pools):
            q = (x @ p["wq"]).reshape(t, hq, d)
            k = (x @ p["wk"]).reshape(t, hkv, d)
            v = (x @ p["wv"]).reshape(t, hkv, d)
            kc = kc.at[new_slots].set((k.astype(jnp.float32) / k_scale).astype(kc.dtype))
            vc = vc.at[new_slots].set((v.astype(jnp.float32) / v_scale).astype(vc.dtype))
            attn = sparse_prefill_paged(q, kc, vc, slot_table, indices, cu_q, kv_lens_d,
                                        int(q_lens.max()), None, k_scale, v_scale)
            x = x + attn.reshape(t, hq * d) @ p["wo"]
            new_pools.append((kc, vc))
            trace.append((q, attn))
        return x, new_pools, trace

    jparams = [{k: jnp.asarray(w) for k, w in p.items()} for p in params]
    jpools = [(jnp.asarray(a), jnp.asarray(b)) for a, b in pools0]
    x_out, pools_out, trace = prefill_step(jparams, jnp.asarray(x0), jpools,
                                           jnp.asarray(lay.slot_table), jnp.asarray(idx),
                                           jnp.asarray(lay.cu_seqlens_q), jnp.asarray(lay.kv_lens))

    # per layer: the kernel on the pool the step wrote
    req, r, _vis, _bound = qidx.row_layout(q_lens, kv_lens)
    new_slots = lay.slot_table[req, kv_lens[req] - q_lens[req] + r]
    untouched = np.setdiff1d(np.arange(slots), new_slots)
    for l, ((q, attn), (kc, vc)) in enumerate(zip(trace, pools_out)):
        kc32, vc32 = _f32(kc), _f32(vc)
        np.testing.assert_array_equal(kc32[untouched], _f32(pools0[l][0])[untouched])
        ref = prefill_paged_reference(_f32(q), kc32, vc32, lay.slot_table, idx, lay.cu_seqlens_q,
                                      lay.kv_lens, None, k_scale, v_scale)
        assert_matches(attn, ref, what=f"layer {l}")

    # end to end: float64 numpy model that rounds to the activation dtype where the jitted step
    # stores activations (so FP8 quantisation of the written K/V sees the same inputs)
    def rnd(a, dt=dtype):
        return _f32(jnp.asarray(a, dt)).astype(np.float64)

    x = rnd(x0)
    for l, p in enumerate(params):
        pf = {k: rnd(w) for k, w in p.items()}
        q = rnd(x @ pf["wq"]).reshape(t, hq, d)
        kc, vc = _f32(pools0[l][0]).copy(), _f32(pools0[l][1]).copy()
        kc[new_slots] = rnd(rnd(x @ pf["wk"]).reshape(t, hkv, d) / k_scale, pool_dtype)
        vc[new_slots] = rnd(rnd(x @ pf["wv"]).reshape(t, hkv, d) / v_scale, pool_dtype)
        attn = prefill_paged_reference(q, kc, vc, lay.slot_table, idx, lay.cu_seqlens_q,
                                       lay.kv_lens, None, k_scale, v_scale)
        x = rnd(x + rnd(rnd(attn).reshape(t, hq * d) @ pf["wo"]))
    assert_matches(x_out, x, what="end to end")


# --------------------------------------------------------------------------------------------
# Bad calls
def test_bad_calls_raise_contract_error_before_launch():
    case = make_case("chunk", 12, 2, q_lens=[3, 2], prefix=[2, 2], seed=53)
    a = case.jax_args()
    base = dict(a)

    def call(**over):
        args = dict(base, **{k: v for k, v in over.items() if k in base})
        kw = {k: v for k, v in over.items() if k not in base}
        return run_pallas("chunk", args, kw.pop("max_seqlen_q", 3), kw.pop("softmax_scale", None),
                          kw.pop("k_scale", 1.0), kw.pop("v_scale", 1.0))

    bad = [
        dict(indices=a["indices"].astype(jnp.float32)),
        dict(indices=a["indices"][:-1]),
        dict(cu_seqlens_q=a["cu_seqlens_q"].astype(jnp.float32)),
        dict(cu_seqlens_k=a["cu_seqlens_k"][:-1]),
        dict(kv_lens=a["kv_lens"][:1]),
        dict(k=a["k"][:, :, :32], v=a["v"][:, :, :32]),
        dict(q=a["q"][:, :5]),  # 5 heads over 2 KV heads
        dict(q=a["q"].astype(jnp.float32)),
        dict(v=a["v"].astype(jnp.bfloat16)),
        dict(max_seqlen_q=0),
        dict(softmax_scale=-1.0),
        dict(k_scale=2.0),  # scales only with FP8 K/V
    ]
    for over in bad:
        with pytest.raises(ContractError):
            call(**over)
    with pytest.raises(ContractError):  # slot table rows != requests
        sparse_prefill_paged(a["q"], a["k"], a["v"], jnp.zeros((3, 8), jnp.int32), a["indices"],
                             a["cu_seqlens_q"], a["kv_lens"], 3)
    with pytest.raises(ContractError):  # ordinary: k not packed like q
        sparse_prefill(a["q"], a["k"], a["v"], a["indices"], a["cu_seqlens_q"], 3)


def test_empty_batch_and_empty_pool_give_zeros_without_launch():
    q = jnp.ones((0, 6, 64), jnp.float16)
    out = sparse_prefill(q, jnp.ones((0, 1, 64), jnp.float16), jnp.ones((0, 1, 64), jnp.float16),
                         jnp.zeros((0, 8), jnp.int32), jnp.zeros((2,), jnp.int32), 1)
    assert out.shape == (0, 6, 64)
    q = jnp.ones((3, 6, 64), jnp.float16)
    kv = jnp.ones((0, 1, 64), jnp.float16)  # an empty pool: every entry is invalid
    out = sparse_prefill_paged(q, kv, kv, jnp.zeros((1, 4), jnp.int32), jnp.zeros((3, 8), jnp.int32),
                               jnp.array([0, 3], jnp.int32), jnp.array([3], jnp.int32), 3)
    assert out.shape == q.shape and not bool(jnp.any(out != 0))


def test_fp8_pool_in_int32_offset_gap_is_rejected():
    """FP8 pools of 2**31 .. 2**32 elements would wrap the lowering's int32 offsets: rejected
    (abstract shapes: nothing is allocated); 16-bit pools that large get int64 offsets."""
    s = jax.ShapeDtypeStruct
    t, hq, hkv, d, w = 4, 12, 1, 256, 16
    args = lambda slots, dt: (s((t, hq, d), jnp.bfloat16), s((slots, hkv, d), dt),  # noqa: E731
                              s((slots, hkv, d), dt), s((1, 64), jnp.int32), s((t, w), jnp.int32),
                              s((2,), jnp.int32), s((1,), jnp.int32))
    gap = 2**31 // (hkv * d) + 1  # just over 2**31 elements, under 2**32 bytes at 1 byte each
    with pytest.raises(ContractError, match="int32"):
        jax.eval_shape(lambda *x: sparse_prefill_paged(*x, 4, interpret=True), *args(gap, FP8))
    out = jax.eval_shape(lambda *x: sparse_prefill_paged(*x, 4, interpret=True),
                         *args(gap, jnp.bfloat16))
    assert out.shape == (t, hq, d)
    out = jax.eval_shape(lambda *x: sparse_prefill_paged(*x, 4, interpret=True),
                         *args(2 * gap + 16, FP8))  # > 2**32 bytes: int64 offsets
    assert out.shape == (t, hq, d)


# --------------------------------------------------------------------------------------------
# GPU (H200, run by the lead: pytest -m gpu). The 8192-row cases.
GPU_T = 8192
GPU_CASES = [  # (kind, kv length, Hq, Hkv, kv dtype name)
    ("ordinary", 8192, 6, 1, "bfloat16"), ("ordinary", 8192, 12, 1, "bfloat16"),
    ("chunk", 8192, 6, 1, "bfloat16"), ("chunk", 8192, 12, 1, "bfloat16"),
    ("chunk", 32768, 6, 1, "bfloat16"), ("chunk", 32768, 12, 1, "bfloat16"),
    ("chunk", 131072, 6, 1, "bfloat16"), ("chunk", 131072, 12, 1, "bfloat16"),
    # FP8, the paged pool and TP1 heads at this size run in tests/test_cross_prefill.py
]


def gpu_case(kind, kv_len, hq, hkv, kv_dtype="bfloat16", *, t=GPU_T, d=256, width=2051,
             junk="mixed", seed=0):
    """(argument dict of jax arrays on the default device, max_seqlen_q, k_scale, v_scale):
    one request of ``t`` query rows over ``kv_len`` context tokens, realistic indices."""
    q_lens = np.array([t])
    kv_lens = np.array([kv_len])
    lay = qidx.prefill_layout(kind, q_lens, kv_lens, pool_slack=1000, seed=seed)
    idx = qidx.prefill_indices(q_lens, None if kind == "ordinary" else kv_lens, width=width,
                               junk=junk, empty_rows=[0, 5, t - 1], seed=seed + 1)
    rows = {"ordinary": t, "chunk": kv_len, "paged": lay.pool_slots}[kind]
    key = jax.random.split(jax.random.PRNGKey(seed), 3)
    kvd = jnp.dtype(kv_dtype)
    fp8 = kvd == jnp.dtype(FP8)
    k_scale, v_scale = (0.5, 1.5) if fp8 else (1.0, 1.0)
    q = jax.random.normal(key[0], (t, hq, d), jnp.float32).astype(jnp.bfloat16)
    k = (jax.random.normal(key[1], (rows, hkv, d), jnp.float32) / k_scale).astype(kvd)
    v = (jax.random.normal(key[2], (rows, hkv, d), jnp.float32) / v_scale).astype(kvd)
    a = dict(q=q, indices=jnp.asarray(idx), kv_lens=jnp.asarray(lay.kv_lens))
    if kind == "ordinary":
        a.update(k=k, v=v, cu_seqlens=jnp.asarray(lay.cu_seqlens_q))
    elif kind == "chunk":
        a.update(k=k, v=v, cu_seqlens_q=jnp.asarray(lay.cu_seqlens_q),
                 cu_seqlens_k=jnp.asarray(lay.cu_seqlens_k))
    else:
        a.update(k_cache=k, v_cache=v, slot_table=jnp.asarray(lay.slot_table),
                 cu_seqlens_q=jnp.asarray(lay.cu_seqlens_q))
    return a, int(lay.max_seqlen_q), k_scale, v_scale


def jax_reference_f32(kind, a, k_scale=1.0, v_scale=1.0, softmax_scale=None, *, chunk=128):
    """float32 JAX version of ``interop.reference`` (reads all W columns, gathers only valid
    entries, zeros for rows without one), chunked over rows so 8192 x 2051 fits on a GPU.
    Dots at HIGHEST precision (no TF32)."""
    q = a["q"]
    t, hq, d = q.shape
    k = a["k"] if kind != "paged" else a["k_cache"]
    v = a["v"] if kind != "paged" else a["v_cache"]
    hkv = k.shape[1]
    g = hq // hkv
    cu = a["cu_seqlens"] if kind == "ordinary" else a["cu_seqlens_q"]
    rows = jnp.arange(t, dtype=jnp.int32)
    req = jnp.searchsorted(cu[1:], rows, side="right").astype(jnp.int32)
    bound = (cu[1:] - cu[:-1])[req] if kind == "ordinary" else a["kv_lens"][req]
    base = {"ordinary": lambda: cu[req], "chunk": lambda: a["cu_seqlens_k"][req],
            "paged": lambda: jnp.zeros_like(req)}[kind]()
    idx = a["indices"]
    idx = idx if idx.ndim == 3 else jnp.broadcast_to(idx[:, None, :], (t, hkv, idx.shape[-1]))
    scale = (d ** -0.5 if softmax_scale is None else softmax_scale) * k_scale
    st = a.get("slot_table")
    heads = jnp.arange(hkv)[None, :, None]
    hi = jax.lax.Precision.HIGHEST

    @jax.jit
    def part(qc, ic, bc, basec, reqc):
        ok = (ic >= 0) & (ic < bc[:, None, None])
        pos = jnp.where(ok, ic, 0)
        phys = st[reqc[:, None, None], pos] if kind == "paged" else basec[:, None, None] + pos
        phys = jnp.where(ok, phys, 0)
        kk = jnp.where(ok[..., None], k[phys, heads].astype(jnp.float32), 0.0)
        vv = jnp.where(ok[..., None], v[phys, heads].astype(jnp.float32), 0.0)
        qq = qc.astype(jnp.float32).reshape(qc.shape[0], hkv, g, d)
        sc = jnp.einsum("nhgd,nhwd->nhgw", qq, kk, precision=hi) * scale
        sc = jnp.where(ok[:, :, None, :], sc, -jnp.inf)
        m = jnp.max(sc, -1, keepdims=True)
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        p = jnp.exp(sc - m)
        l_ = jnp.sum(p, -1, keepdims=True)
        p = p / jnp.where(l_ > 0, l_, 1.0)
        o = jnp.einsum("nhgw,nhwd->nhgd", p, vv, precision=hi) * v_scale
        return o.reshape(qc.shape[0], hq, d)

    outs = [part(q[s:s + chunk], idx[s:s + chunk], bound[s:s + chunk], base[s:s + chunk],
                 req[s:s + chunk]) for s in range(0, t, chunk)]
    return jnp.concatenate(outs, 0)


def _gpu_or_skip():
    if jax.default_backend() != "gpu":
        pytest.skip(f"needs a CUDA GPU for jax (backend: {jax.default_backend()})")


@pytest.mark.gpu
@pytest.mark.parametrize("kind,kv_len,hq,hkv,kv_dtype", GPU_CASES,
                         ids=[f"{c[0]}-kv{c[1] // 1024}k-{c[2]}x{c[3]}-{c[4]}" for c in GPU_CASES])
def test_gpu_8192_rows_finite_deterministic_and_correct(kind, kv_len, hq, hkv, kv_dtype):
    _gpu_or_skip()
    a, max_q, ks, vs = gpu_case(kind, kv_len, hq, hkv, kv_dtype)
    out1 = run_pallas(kind, a, max_q, None, ks, vs).block_until_ready()
    out2 = run_pallas(kind, a, max_q, None, ks, vs).block_until_ready()
    assert bool(jnp.isfinite(out1.astype(jnp.float32)).all()), "non-finite output"
    assert bool(jnp.array_equal(out1, out2)), "second run not bitwise equal"
    ref = np.asarray(jax_reference_f32(kind, a, ks, vs))
    assert_matches(np.asarray(out1.astype(jnp.float32)), ref,
                   what=f"{kind} kv={kv_len} {hq}/{hkv} {kv_dtype}")
    assert (np.asarray(out1.astype(jnp.float32))[[0, 5, GPU_T - 1]] == 0).all()


@pytest.mark.gpu
def test_gpu_jit_new_lengths_no_retrace():
    """On the GPU: one jitted chunk call, lengths/indices changed between calls (same shapes)."""
    _gpu_or_skip()
    traces = []

    @jax.jit
    def f(q, k, v, idx, cu_q, cu_k, kv_lens):
        traces.append(1)
        return sparse_prefill_chunk(q, k, v, idx, cu_q, cu_k, kv_lens, 3072)

    for q_lens, kv_lens in (([2048, 2048], [4096, 8192]), ([1024, 3072], [9000, 3272])):
        ql, kl = np.array(q_lens), np.array(kv_lens)
        lay = qidx.prefill_layout("chunk", ql, kl)
        idx = qidx.prefill_indices(ql, kl, width=2051, junk="mixed", seed=3)
        key = jax.random.split(jax.random.PRNGKey(1), 3)
        q = jax.random.normal(key[0], (4096, 12, 256), jnp.bfloat16)
        k = jax.random.normal(key[1], (12288, 1, 256), jnp.bfloat16)
        v = jax.random.normal(key[2], (12288, 1, 256), jnp.bfloat16)
        a = dict(q=q, k=k, v=v, indices=jnp.asarray(idx), cu_seqlens_q=jnp.asarray(lay.cu_seqlens_q),
                 cu_seqlens_k=jnp.asarray(lay.cu_seqlens_k), kv_lens=jnp.asarray(lay.kv_lens))
        out = f(a["q"], a["k"], a["v"], a["indices"], a["cu_seqlens_q"], a["cu_seqlens_k"],
                a["kv_lens"])
        assert_matches(np.asarray(out.astype(jnp.float32)),
                       np.asarray(jax_reference_f32("chunk", a)), what=f"jit {q_lens} {kv_lens}")
    assert len(traces) == 1
