"""Backend-only behaviour of the Pallas sparse prefill (``qsa_pallas.prefill``).

Plain value sweeps over shapes live in the shared conformance tests (``interop.cases``); here:
paged pool addressing (scattered ``req_to_token`` rows, junk table entries, lying metadata,
poisoned pool slots, the plain-JAX slot pre-pass), rows of a batch padded to a static T, the
early stop at any BLOCK_N, jit with traced lengths, shard_map, a jitted multi-layer step that
writes the pool, the contract checks before any launch and the int32-offset gap. CPU: Pallas
interpret mode, tiny shapes; the CUDA lowering is in ``tests/test_pallas_prefill_lowering.py``.
GPU (``pytest -m gpu``, the H200): 8192-row cases, one jitted call with changing lengths.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from interop import indices as qidx
from interop import reference as R
from interop.geometry import Geometry
from qsa_pallas import ContractError, sparse_prefill, sparse_prefill_chunk, sparse_prefill_paged
from qsa_pallas import _compat
from qsa_pallas import prefill as P
from qsa_pallas.prefill import resolve_pool_slots
from tests.prefill_case import FLOATS, PARAMS, assert_matches, lying_paged_case, make_case

FN = {"ordinary": sparse_prefill, "chunk": sparse_prefill_chunk, "paged": sparse_prefill_paged}


def arrays(case) -> dict:
    """The case's arrays as jax arrays in the kernel dtypes."""
    return {n: jnp.asarray(x, case.dtype if n == "q" else case.kv_dtype) if n in FLOATS
            else jnp.asarray(x) for n, x in case.arrays.items()}


def run(case, a=None, **kw):
    a = arrays(case) if a is None else a
    args = [case.max_seqlen_q if n == "max_seqlen_q" else a[n] for n in PARAMS[case.kind]]
    return FN[case.kind](*args, *case.scales(), **kw)


def check(case, out=None, what=""):
    out = run(case) if out is None else out
    assert_matches(np.asarray(out.astype(jnp.float32)), case.reference(), what or case.kind)
    return out


# --------------------------------------------------------------------------------------------
# Paged addressing
@pytest.mark.parametrize("per_head,kv_dtype", [(False, None), (True, "float8_e4m3fn")])
def test_paged_scattered_rows_junk_table_and_poisoned_pool(per_head, kv_dtype):
    scales = dict(k_scale=0.75, v_scale=1.6, dtype="bfloat16") if kv_dtype else {}
    case = make_case("paged", 12, 2, [4, 6], [13, 2], per_head=per_head, kv_dtype=kv_dtype,
                     table_junk=True, poison=True, empty_rows=[3], seed=5, **scales)
    assert case.arrays["req_to_token"].shape[0] > 2
    check(case)


def test_paged_lying_metadata_is_masked_never_read():
    case = lying_paged_case(seed=12)
    ref = case.reference()
    assert (ref[7:] == 0).all() and not (ref[:7] == 0).all()
    check(case)


@pytest.mark.parametrize("per_head", [False, True])
def test_resolve_pool_slots_is_the_addressing_rule(per_head):
    """The pre-pass gives req_to_token[req_indices[b], idx] for entries with 0 <= idx < kv_lens[b]
    that the table and the pool bound, -1 elsewhere (the kernel masks the visible count)."""
    case = lying_paged_case(seed=61, per_head=per_head)
    a = case.arrays
    pool = a["k_cache"].shape[0]
    got = np.asarray(resolve_pool_slots(*(jnp.asarray(a[n]) for n in (
        "indices", "req_to_token", "req_indices", "cu_seqlens_q", "kv_lens")), pool))
    req, _r, _vis, bound = qidx.row_layout(np.diff(a["cu_seqlens_q"]), a["kv_lens"])
    idx = a["indices"].astype(np.int64)
    want = np.full(idx.shape, -1)
    for pos in zip(*np.nonzero((idx >= 0) & (idx < bound.reshape((-1,) + (1,) * (idx.ndim - 1))))):
        want[pos] = R.pool_slots_of(a["req_to_token"], a["req_indices"], req[pos[0]], [idx[pos]],
                                    pool)[0]
    np.testing.assert_array_equal(got, want)
    assert (got == -1).any() and (got >= 0).any()


def test_paged_empty_table_and_empty_pool_give_zeros():
    case = make_case("paged", 6, 1, [3], [4], seed=14)
    a = arrays(case)
    assert not bool(jnp.any(run(case, dict(a, req_to_token=a["req_to_token"][:, :0])) != 0))
    empty = dict(a, k_cache=a["k_cache"][:0], v_cache=a["v_cache"][:0])
    assert not bool(jnp.any(run(case, empty) != 0))


# --------------------------------------------------------------------------------------------
# Launch
@pytest.mark.parametrize("kind", ["ordinary", "chunk", "paged"])
def test_rows_past_the_last_request_give_zeros(kind):
    """A batch padded to a static T (rows past cu_seqlens[B]) is accepted: those rows are 0."""
    case = make_case(kind, 6, 1, [4, 3], None if kind == "ordinary" else [2, 5], seed=67)
    a = arrays(case)
    pad = 5
    grow = lambda x, fill=1: jnp.concatenate([x, jnp.full((pad,) + x.shape[1:], fill,  # noqa: E731
                                                          x.dtype)])
    a["q"], a["indices"] = grow(a["q"]), grow(a["indices"], 0)
    if kind == "ordinary":
        a["k"], a["v"] = grow(a["k"]), grow(a["v"])
    out = np.asarray(run(case, a).astype(jnp.float32))
    assert_matches(out[:-pad], case.reference(), f"padded {kind}")
    assert (out[-pad:] == 0).all()


def test_entries_past_the_visible_count_are_ignored_for_any_block_n():
    """The early stop masks columns >= min(W, visible) exactly (not at a BLOCK_N boundary): a
    stale in-range entry past the visible count is not attended, whatever BLOCK_N."""
    case = make_case("chunk", 12, 1, [6], [2], width=40, junk="-1", seed=59)
    ref = case.reference()
    idx = case.arrays["indices"]
    for r in range(6):
        idx[r, r + 3] = 0  # in range (< kv_len = 8), but past the row's visible count r + 3
    outs = []
    for bn in (16, 32, 64):
        with P._forced_geometry(Geometry(16, bn, 4, 2, "test")):
            outs.append(check(case, run(case), f"BLOCK_N={bn}"))
    assert np.array_equal(case.reference(), ref)
    np.testing.assert_allclose(np.asarray(outs[0], np.float32), np.asarray(outs[2], np.float32),
                               rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("kind,per_head,kv_dtype", [
    ("ordinary", False, None), ("chunk", True, "float8_e4m3fn"), ("paged", False, None)])
def test_split_kv_matches_reference_and_unsplit(kind, per_head, kv_dtype, monkeypatch):
    """Split-KV (``Geometry.splits`` > 1, the split count an sm_90 gets, here with a lowered
    ``min_split_columns``): 3 shares of the 13 BLOCK_N steps and 8 (one empty), merged by LSE
    in XLA, match the reference and the unsplit kernel to rounding, with rows without a valid
    entry (exact zeros), junk entries and poisoned unselected K/V; two runs are bitwise equal
    (qsa_triton's twin: tests/test_triton_prefill.py)."""
    from interop import geometry

    case = make_case(kind, 6, 2, [5, 1, 7], None if kind == "ordinary" else [4, 3, 60],
                     width=200, per_head=per_head, kv_dtype=kv_dtype, empty_rows=[2],
                     table_junk=kind == "paged", poison=True, seed=71)
    monkeypatch.setitem(geometry.PREFILL_SPLIT_RULES, "min_split_columns", 10**6)
    whole = check(case)
    for cols in (64, 16):
        monkeypatch.setitem(geometry.PREFILL_SPLIT_RULES, "min_split_columns", cols)
        out = check(case, run(case), f"min_split_columns={cols}")
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(whole, np.float32),
                                   rtol=2e-3, atol=2e-3)
        assert np.array_equal(np.asarray(out), np.asarray(run(case)))
    assert (np.asarray(out, np.float32)[case.empty_rows()] == 0).all()


def test_jit_traced_lengths_and_indices_one_trace():
    """Lengths and indices are traced (device data), max_seqlen_q static: two batches with the
    same shapes but different request splits reuse one trace and both match the reference."""
    traces = []

    @jax.jit
    def step(q, k, v, idx, cu_q, cu_k, kv_lens):
        traces.append(1)
        return sparse_prefill_chunk(q, k, v, idx, cu_q, cu_k, kv_lens, 8)

    for q_lens, prefix, seed in (([4, 5], [6, 2], 37), ([8, 1], [3, 5], 41)):
        case = make_case("chunk", 12, 2, q_lens, prefix, pool_slack=0, seed=seed)
        a = arrays(case)
        check(case, step(*(a[n] for n in PARAMS["chunk"][:-1])), "jit")
    assert len(traces) == 1


def test_shard_map_over_kv_heads():
    devices = jax.devices()
    if len(devices) < 2:
        pytest.skip(f"needs 2 devices (conftest forces 2 host devices), have {len(devices)}")
    from jax.sharding import Mesh, PartitionSpec as P  # noqa: PLC0415

    mesh = Mesh(np.array(devices[:2]), ("h",))
    for per_head in (False, True):
        case = make_case("paged", 12, 2, [5, 3], [4, 9], per_head=per_head, seed=43 + per_head)
        a = arrays(case)
        heads = P(None, "h", None)

        def local(q, kc, vc, rt, ri, idx, cu, kl, case=case):
            return sparse_prefill_paged(q, kc, vc, rt, ri, idx, cu, kl, case.max_seqlen_q)

        f = jax.jit(_compat.shard_map(
            local, mesh=mesh,
            in_specs=(heads, heads, heads, P(), P(), heads if per_head else P(), P(), P()),
            out_specs=heads))
        check(case, f(*(a[n] for n in PARAMS["paged"][:-1])), f"shard_map per_head={per_head}")


def _request_positions(cu_q, kv_lens, t):
    """Per packed row: request id and absolute context position (traced, plain JAX)."""
    rows = jnp.arange(t, dtype=jnp.int32)
    req = jnp.searchsorted(cu_q[1:], rows, side="right").astype(jnp.int32)
    q_len = cu_q[req + 1] - cu_q[req]
    return req, kv_lens[req] - q_len + (rows - cu_q[req])


def _f32(x) -> np.ndarray:
    return np.asarray(x).astype(np.float32)


@pytest.mark.parametrize("hq,hkv,fp8", [(12, 2, False), (6, 1, True)])
def test_jitted_two_layer_prefill_step_writes_pool_then_paged_kernel(hq, hkv, fp8):
    """A jitted prefill step of a 2-layer toy model: per layer project q/k/v, scatter the new K/V
    into the pool through req_to_token, run the paged kernel on the pool, project out, add the
    residual. Checked per layer against ``prefill_paged_reference`` on the pool the step wrote,
    and end to end against a float64 numpy re-implementation."""
    n_layers, d, e = 2, 64, 96
    q_lens, prefix = np.array([5, 4]), np.array([6, 3])
    kv_lens = q_lens + prefix
    lay = qidx.prefill_layout("paged", q_lens, kv_lens, pool_slack=7, seed=47)
    idx = qidx.prefill_indices(q_lens, kv_lens, width=24, junk="mixed", seed=48)
    t, slots = int(q_lens.sum()), lay.pool_slots
    rng = np.random.default_rng(49)
    dtype = jnp.float16  # bf16 residual-stream rounding alone would eat the end-to-end budget
    pool_dtype = jnp.float8_e4m3fn if fp8 else dtype
    k_scale, v_scale = (0.5, 0.25) if fp8 else (1.0, 1.0)
    params = [dict(wq=rng.standard_normal((e, hq * d)) / np.sqrt(e),
                   wk=rng.standard_normal((e, hkv * d)) / np.sqrt(e),
                   wv=rng.standard_normal((e, hkv * d)) / np.sqrt(e),
                   wo=rng.standard_normal((hq * d, e)) / np.sqrt(hq * d)) for _ in range(n_layers)]
    params = [{k: np.asarray(jnp.asarray(w, dtype)) for k, w in p.items()} for p in params]
    x0 = np.asarray(jnp.asarray(rng.standard_normal((t, e)), dtype))
    pools0 = [(np.asarray(jnp.asarray(rng.standard_normal((slots, hkv, d)) / k_scale, pool_dtype)),
               np.asarray(jnp.asarray(rng.standard_normal((slots, hkv, d)) / v_scale, pool_dtype)))
              for _ in range(n_layers)]
    meta = (lay.req_to_token, lay.req_indices, idx, lay.cu_seqlens_q, lay.kv_lens)

    @jax.jit
    def prefill_step(params, x, pools, req_to_token, req_indices, indices, cu_q, kv_lens_d):
        req, pos = _request_positions(cu_q, kv_lens_d, x.shape[0])
        new_slots = req_to_token[req_indices[req], pos]
        new_pools, trace = [], []
        for p, (kc, vc) in zip(params, pools):
            q = (x @ p["wq"]).reshape(t, hq, d)
            k = (x @ p["wk"]).reshape(t, hkv, d)
            v = (x @ p["wv"]).reshape(t, hkv, d)
            kc = kc.at[new_slots].set((k.astype(jnp.float32) / k_scale).astype(kc.dtype))
            vc = vc.at[new_slots].set((v.astype(jnp.float32) / v_scale).astype(vc.dtype))
            attn = sparse_prefill_paged(q, kc, vc, req_to_token, req_indices, indices, cu_q,
                                        kv_lens_d, int(q_lens.max()), None, k_scale, v_scale)
            x = x + attn.reshape(t, hq * d) @ p["wo"]
            new_pools.append((kc, vc))
            trace.append((q, attn))
        return x, new_pools, trace

    jparams = [{k: jnp.asarray(w) for k, w in p.items()} for p in params]
    jpools = [(jnp.asarray(a), jnp.asarray(b)) for a, b in pools0]
    x_out, pools_out, trace = prefill_step(jparams, jnp.asarray(x0), jpools,
                                           *(jnp.asarray(m) for m in meta))

    req, r, _vis, _bound = qidx.row_layout(q_lens, kv_lens)
    new_slots = lay.slot_table[req, kv_lens[req] - q_lens[req] + r]
    untouched = np.setdiff1d(np.arange(slots), new_slots)
    for l, ((q, attn), (kc, vc)) in enumerate(zip(trace, pools_out)):
        kc32, vc32 = _f32(kc), _f32(vc)
        np.testing.assert_array_equal(kc32[untouched], _f32(pools0[l][0])[untouched])
        ref = R.prefill_paged_reference(_f32(q), kc32, vc32, *meta, None, k_scale, v_scale)
        assert_matches(_f32(attn), ref, f"layer {l}")

    def rnd(a, dt=dtype):
        return _f32(jnp.asarray(a, dt)).astype(np.float64)

    x = rnd(x0)
    for l, p in enumerate(params):
        pf = {k: rnd(w) for k, w in p.items()}
        q = rnd(x @ pf["wq"]).reshape(t, hq, d)
        kc, vc = _f32(pools0[l][0]).copy(), _f32(pools0[l][1]).copy()
        kc[new_slots] = rnd(rnd(x @ pf["wk"]).reshape(t, hkv, d) / k_scale, pool_dtype)
        vc[new_slots] = rnd(rnd(x @ pf["wv"]).reshape(t, hkv, d) / v_scale, pool_dtype)
        attn = R.prefill_paged_reference(q, kc, vc, *meta, None, k_scale, v_scale)
        x = rnd(x + rnd(rnd(attn).reshape(t, hq * d) @ pf["wo"]))
    assert_matches(_f32(x_out), x, "end to end")


# --------------------------------------------------------------------------------------------
# Bad calls
def test_bad_calls_raise_contract_error_before_launch():
    chunk = make_case("chunk", 12, 2, [3, 2], [2, 2], seed=53)
    a = arrays(chunk)
    bad = [
        dict(indices=a["indices"].astype(jnp.float32)),
        dict(indices=a["indices"][:-1]),
        dict(cu_seqlens_q=a["cu_seqlens_q"].astype(jnp.float32)),
        dict(cu_seqlens_k=a["cu_seqlens_k"][:-1]),
        dict(kv_lens=a["kv_lens"][:1]),
        dict(k=a["k"][:, :, :16], v=a["v"][:, :, :16]),
        dict(q=a["q"][:, :5]),  # 5 heads over 2 KV heads
        dict(q=a["q"].astype(jnp.float32)),
        dict(v=a["v"].astype(jnp.bfloat16)),
    ]
    for over in bad:
        with pytest.raises(ContractError):
            run(chunk, dict(a, **over))
    for attr, value in (("max_seqlen_q", 0), ("softmax_scale", -1.0), ("k_scale", 2.0)):
        old = getattr(chunk, attr)
        setattr(chunk, attr, value)
        with pytest.raises(ContractError, match=attr):
            run(chunk, a)
        setattr(chunk, attr, old)
    paged = make_case("paged", 12, 2, [3, 2], [2, 2], seed=54)
    p = arrays(paged)
    for name, x in (("req_indices", p["req_indices"][:1]),
                    ("req_to_token", p["req_to_token"].astype(jnp.float32)),
                    ("req_to_token", p["req_to_token"][0])):
        with pytest.raises(ContractError, match=name):
            run(paged, dict(p, **{name: x}))
    with pytest.raises(ContractError):  # ordinary: k not packed like q
        sparse_prefill(a["q"], a["k"], a["v"], a["indices"], a["cu_seqlens_q"], 3)


def test_empty_batch_gives_an_empty_result_without_launch():
    q = jnp.ones((0, 6, 64), jnp.float16)
    out = sparse_prefill(q, jnp.ones((0, 1, 64), jnp.float16), jnp.ones((0, 1, 64), jnp.float16),
                         jnp.zeros((0, 8), jnp.int32), jnp.zeros((2,), jnp.int32), 1)
    assert out.shape == (0, 6, 64)


def test_fp8_pool_in_int32_offset_gap_is_rejected():
    """FP8 pools of 2**31 .. 2**32 elements would wrap the lowering's int32 offsets: rejected
    (abstract shapes: nothing is allocated); 16-bit pools that large get int64 offsets."""
    s = jax.ShapeDtypeStruct
    t, hq, hkv, d, w = 4, 12, 1, 256, 16
    args = lambda slots, dt: (s((t, hq, d), jnp.bfloat16), s((slots, hkv, d), dt),  # noqa: E731
                              s((slots, hkv, d), dt), s((3, 64), jnp.int32), s((1,), jnp.int32),
                              s((t, w), jnp.int32), s((2,), jnp.int32), s((1,), jnp.int32))
    call = lambda *x: sparse_prefill_paged(*x, 4, interpret=True)  # noqa: E731
    gap = 2**31 // (hkv * d) + 1  # just over 2**31 elements, under 2**32 bytes at 1 byte each
    with pytest.raises(ContractError, match="int32"):
        jax.eval_shape(call, *args(gap, jnp.float8_e4m3fn))
    assert jax.eval_shape(call, *args(gap, jnp.bfloat16)).shape == (t, hq, d)
    assert jax.eval_shape(call, *args(2 * gap + 16, jnp.float8_e4m3fn)).shape == (t, hq, d)


# --------------------------------------------------------------------------------------------
# GPU (H200, run by the lead: pytest -m gpu)
GPU_T = 8192
GPU_CASES = [  # (kind, kv length, Hq, Hkv, kv dtype)
    ("ordinary", 8192, 6, 1, "bfloat16"), ("ordinary", 8192, 12, 1, "bfloat16"),
    ("chunk", 8192, 6, 1, "bfloat16"), ("chunk", 8192, 12, 1, "bfloat16"),
    ("chunk", 32768, 6, 1, "bfloat16"), ("chunk", 32768, 12, 1, "bfloat16"),
    ("chunk", 131072, 6, 1, "bfloat16"), ("chunk", 131072, 12, 1, "bfloat16"),
    ("paged", 32768, 12, 1, "bfloat16"), ("paged", 32768, 24, 2, "float8_e4m3fn"),
]


def jax_reference_f32(kind, a, k_scale=1.0, v_scale=1.0, softmax_scale=None, *, chunk=128):
    """float32 JAX version of ``interop.reference`` (the paged addressing rule included), chunked
    over rows so 8192 x 2051 fits on a GPU. Dots at HIGHEST precision (no TF32)."""
    q = a["q"]
    t, hq, d = q.shape
    k, v = (a["k"], a["v"]) if kind != "paged" else (a["k_cache"], a["v_cache"])
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
    heads = jnp.arange(hkv)[None, :, None]
    hi = jax.lax.Precision.HIGHEST

    @jax.jit
    def part(qc, ic, bc, basec, reqc):
        ok = (ic >= 0) & (ic < bc[:, None, None])
        pos = jnp.where(ok, ic, 0)
        if kind == "paged":
            rt, ri = a["req_to_token"], a["req_indices"][reqc]
            ok &= ((ri >= 0) & (ri < rt.shape[0]))[:, None, None] & (pos < rt.shape[1])
            phys = rt[jnp.clip(ri, 0, rt.shape[0] - 1)[:, None, None], jnp.where(ok, pos, 0)]
            ok &= (phys >= 0) & (phys < k.shape[0])
        else:
            phys = basec[:, None, None] + pos
        phys = jnp.where(ok, phys, 0)
        kk = jnp.where(ok[..., None], k[phys, heads].astype(jnp.float32), 0.0)
        vv = jnp.where(ok[..., None], v[phys, heads].astype(jnp.float32), 0.0)
        qq = qc.astype(jnp.float32).reshape(qc.shape[0], hkv, g, d)
        sc = jnp.einsum("nhgd,nhwd->nhgw", qq, kk, precision=hi) * scale
        sc = jnp.where(ok[:, :, None, :], sc, -jnp.inf)
        m = jnp.max(sc, -1, keepdims=True)
        p = jnp.exp(sc - jnp.where(jnp.isfinite(m), m, 0.0))
        l_ = jnp.sum(p, -1, keepdims=True)
        o = jnp.einsum("nhgw,nhwd->nhgd", p / jnp.where(l_ > 0, l_, 1.0), vv, precision=hi)
        return (o * v_scale).reshape(qc.shape[0], hq, d)

    return jnp.concatenate([part(q[s:s + chunk], idx[s:s + chunk], bound[s:s + chunk],
                                 base[s:s + chunk], req[s:s + chunk])
                            for s in range(0, t, chunk)], 0)


def _gpu_or_skip():
    if jax.default_backend() != "gpu":
        pytest.skip(f"needs a CUDA GPU for jax (backend: {jax.default_backend()})")


@pytest.mark.gpu
@pytest.mark.parametrize("kind,kv_len,hq,hkv,kv_dtype", GPU_CASES,
                         ids=[f"{c[0]}-kv{c[1] // 1024}k-{c[2]}x{c[3]}-{c[4]}" for c in GPU_CASES])
def test_gpu_8192_rows_finite_deterministic_and_correct(kind, kv_len, hq, hkv, kv_dtype):
    _gpu_or_skip()
    fp8 = kv_dtype == "float8_e4m3fn"
    case = make_case(kind, hq, hkv, [GPU_T], None if kind == "ordinary" else [kv_len - GPU_T],
                     d=256, width=2051, dtype="bfloat16", kv_dtype=kv_dtype, junk="mixed",
                     empty_rows=[0, 5, GPU_T - 1], pool_slack=1000,
                     k_scale=0.5 if fp8 else 1.0, v_scale=1.5 if fp8 else 1.0, seed=hq + hkv)
    a = arrays(case)
    out1, out2 = run(case, a).block_until_ready(), run(case, a).block_until_ready()
    assert bool(jnp.array_equal(out1, out2)), "second run not bitwise equal"
    ref = np.asarray(jax_reference_f32(kind, a, case.k_scale, case.v_scale))
    assert_matches(np.asarray(out1.astype(jnp.float32)), ref, f"{kind} kv={kv_len} {hq}/{hkv}")


@pytest.mark.gpu
@pytest.mark.parametrize("kind,q_lens,hq,hkv,kv_dtype", [
    ("chunk", [4] * 32, 12, 1, None), ("paged", [4] * 32, 24, 2, "float8_e4m3fn"),
    ("chunk", [32], 6, 1, None)])
def test_gpu_split_kv_short_prefills(kind, q_lens, hq, hkv, kv_dtype):
    """The selector's split-KV on short prefills (MTP verify: 32 requests x 4 rows at 4k, a
    32-row chunk), as qsa_triton's twin: the reference, exact zeros for empty rows, bitwise
    equal runs."""
    _gpu_or_skip()
    from interop.arch import DeviceFacts
    from interop.geometry import prefill_splits

    fp8 = kv_dtype is not None
    case = make_case(kind, hq, hkv, q_lens, [4096 - n for n in q_lens], d=256, width=2051,
                     dtype="bfloat16", kv_dtype=kv_dtype, junk="mixed", empty_rows=[0, 5],
                     pool_slack=1000, k_scale=0.5 if fp8 else 1.0, v_scale=1.5 if fp8 else 1.0,
                     seed=hq + hkv)
    assert prefill_splits(DeviceFacts.from_jax(), total_q=sum(q_lens), num_kv_heads=hkv,
                          width=2051, backend="pallas") > 1
    a = arrays(case)
    out1, out2 = run(case, a).block_until_ready(), run(case, a).block_until_ready()
    assert bool(jnp.array_equal(out1, out2)), "second run not bitwise equal"
    ref = np.asarray(jax_reference_f32(kind, a, case.k_scale, case.v_scale))
    out = np.asarray(out1.astype(jnp.float32))
    assert_matches(out, ref, f"{kind} {len(q_lens)} x {q_lens[0]} rows {hq}/{hkv}")
    assert (out[[0, 5]] == 0).all()


@pytest.mark.gpu
def test_gpu_jit_new_lengths_no_retrace():
    """On the GPU: one jitted chunk call, lengths/indices changed between calls (same shapes)."""
    _gpu_or_skip()
    traces = []

    @jax.jit
    def f(q, k, v, idx, cu_q, cu_k, kv_lens):
        traces.append(1)
        return sparse_prefill_chunk(q, k, v, idx, cu_q, cu_k, kv_lens, 3072)

    key = jax.random.split(jax.random.PRNGKey(1), 3)
    q = jax.random.normal(key[0], (4096, 12, 256), jnp.bfloat16)
    k = jax.random.normal(key[1], (12288, 1, 256), jnp.bfloat16)
    v = jax.random.normal(key[2], (12288, 1, 256), jnp.bfloat16)
    for q_lens, kv_lens in (([2048, 2048], [4096, 8192]), ([1024, 3072], [9000, 3272])):
        ql, kl = np.array(q_lens), np.array(kv_lens)
        lay = qidx.prefill_layout("chunk", ql, kl)
        a = dict(q=q, k=k, v=v, indices=jnp.asarray(qidx.prefill_indices(
            ql, kl, width=2051, junk="mixed", seed=3)), cu_seqlens_q=jnp.asarray(lay.cu_seqlens_q),
            cu_seqlens_k=jnp.asarray(lay.cu_seqlens_k), kv_lens=jnp.asarray(lay.kv_lens))
        out = f(*(a[n] for n in PARAMS["chunk"][:-1]))
        assert_matches(np.asarray(out.astype(jnp.float32)),
                       np.asarray(jax_reference_f32("chunk", a)), f"jit {q_lens} {kv_lens}")
    assert len(traces) == 1


@pytest.mark.parametrize("kind,kv_dtype", [("chunk", None), ("chunk", "float8_e4m3fn"),
                                           ("paged", "float8_e4m3fn")])
def test_attended_nan_reaches_the_output(kind, kv_dtype):
    """A NaN in a selected K element and in a selected V element (FP8: converted to fp16 in the
    V tile's load layout, qsa_pallas.prefill) reaches exactly the reference's NaN positions."""
    from tests.prefill_case import assert_nan_matches, poison_selected

    case = make_case(kind, 6, 1, [5, 4], [3, 9], d=32, width=10, kv_dtype=kv_dtype, seed=31)
    poison_selected(case)
    assert_nan_matches(run(case), case.reference(), f"{kind} {kv_dtype}")
