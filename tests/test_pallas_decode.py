"""qsa_pallas.sparse_decode against the float64 reference (qsa-contract.md §2).

CPU (default): Pallas interpret mode, tiny shapes: head pairs (24,2), (12,1), (6,1), (3,1); lengths
0, 1, BLOCK_N-1, BLOCK_N, BLOCK_N+1 and mixed; forced multi-split; rows longer than max_seqlen_k;
zero rows exact zeros; NaN/Inf outside every row never leak; contract errors identical to the torch
path; building blocks: jax.jit with traced lengths (no recompilation), lax.scan over layers,
shard_map over 2 host devices (TP2 12/1 from 24/2, TP4-style 6/1 with the KV head replicated), a
jitted multi-layer decode step with donated KV buffers.

GPU (``-m gpu``, the H200): the decode shape suite (B in 1, 3, 4, 16, 17, 32, 48, 64, 128 x
short / medium / saturated rows x TP1 / TP2 / TP4, bf16, D = 256, one K/V capacity per TP so each
(B, TP) compiles once) and replay with new lengths without recompiling.

Acceptance (qsa-contract.md §6): rtol = atol = 2e-2 elementwise and relative L2 <= 5e-3.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest

jax = pytest.importorskip("jax")  # on demand beside torch (tests/conftest.py)
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import qsa_pallas  # noqa: E402
from interop.contract import ContractError, check_decode  # noqa: E402
from interop.plan import DecodePlan  # noqa: E402
from interop.reference import decode_reference, rel_l2  # noqa: E402
from qsa_pallas import _compat as C  # noqa: E402
from qsa_pallas import decode as dec  # noqa: E402

RTOL = ATOL = 2e-2
REL_L2 = 5e-3
ON_GPU = jax.default_backend() == "gpu"


# ---------------------------------------------------------------------------------------------
def make_case(rng, lens, hq, hkv, d, dtype=np.float16, *, extra_rows=7, poison=None,
              permute_q=False):
    """Packed decode inputs as numpy arrays.

    poison: None, or a value (nan / inf) written into every K/V row past cu_k[B] (the capacity
    tail), which the last BLOCK_N tile of a row overlaps.
    """
    lens = np.asarray(lens, np.int64)
    b = len(lens)
    ck = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    cap = int(ck[-1]) + extra_rows
    q = rng.standard_normal((b, hq, d), np.float32).astype(dtype)
    k = rng.standard_normal((cap, hkv, d), np.float32).astype(dtype)
    v = rng.standard_normal((cap, hkv, d), np.float32).astype(dtype)
    rows = rng.permutation(b) if permute_q else np.arange(b)
    cq = np.concatenate([rows, [b]]).astype(np.int32)
    if poison is not None:
        k[ck[-1]:] = poison
        v[ck[-1]:] = -poison if np.isinf(poison) else poison
    return q, k, v, cq, ck


def reference(q, k, v, cq, ck, scale=None):
    f = lambda x: np.asarray(x, np.float32)  # noqa: E731
    return decode_reference(f(q), f(k), f(v), cq, ck, scale)


def assert_close(out, ref):
    out = np.asarray(jnp.asarray(out, jnp.float32))
    assert np.isfinite(out).all(), "non-finite output"
    np.testing.assert_allclose(out, ref, rtol=RTOL, atol=ATOL)
    err = rel_l2(out, ref)
    assert err <= REL_L2, f"relative L2 {err:.2e} > {REL_L2}"


def run(q, k, v, cq, ck, msk, scale=None, *, plan=None, **kw):
    """``sparse_decode`` (``plan``: a forced plan, through the private ``_sparse_decode``)."""
    fn = qsa_pallas.sparse_decode if plan is None else functools.partial(dec._sparse_decode,
                                                                         plan=plan)
    return fn(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(cq), jnp.asarray(ck),
              msk, scale, **kw)


def edge_lengths(rng, bn):
    """0, 1, BLOCK_N-1, BLOCK_N, BLOCK_N+1 and two mixed lengths."""
    return [0, 1, bn - 1, bn, bn + 1, int(rng.integers(2, 3 * bn)), 3 * bn + 5]


# ---------------------------------------------------------------------------------------------
# CPU: values
def test_interpret_default_on_cpu():
    if ON_GPU:
        pytest.skip("CPU-only check")
    assert C.resolve_interpret(None) is True


@pytest.mark.parametrize("hq,hkv", [(24, 2), (12, 1), (6, 1), (3, 1)])
def test_head_pairs_edge_lengths(hq, hkv):
    rng = np.random.default_rng(hq * 10 + hkv)
    d = 64
    bn = dec.plan_for(7, hkv, hq // hkv, d, 200)[0].block_n
    lens = edge_lengths(rng, bn)
    q, k, v, cq, ck = make_case(rng, lens, hq, hkv, d, permute_q=True)
    msk = max(lens)
    out = run(q, k, v, cq, ck, msk)
    assert out.shape == (len(lens), hq, d) and out.dtype == jnp.float16
    assert_close(out, reference(q, k, v, cq, ck))
    assert (np.asarray(out[0]) == 0).all(), "zero-length row must be exact zeros"


def test_head_dim_256_bf16():
    rng = np.random.default_rng(256)
    import ml_dtypes  # noqa: PLC0415

    lens = [33, 0, 70]
    q, k, v, cq, ck = make_case(rng, lens, 12, 1, 256, ml_dtypes.bfloat16)
    out = run(q, k, v, cq, ck, 2051, 0.0625)
    assert out.dtype == jnp.bfloat16
    assert_close(out, reference(q, k, v, cq, ck, 0.0625))
    assert (np.asarray(out[1].astype(jnp.float32)) == 0).all()


@pytest.mark.parametrize("max_splits,block_n", [(1, 16), (8, 16)])
def test_forced_splits_and_rows_longer_than_bound(max_splits, block_n):
    """max_splits = 1 (no merge) and 8 (merge with empty splits); rows up to 3x max_seqlen_k are
    still attended completely (the bound only sizes the grid)."""
    rng = np.random.default_rng(max_splits)
    lens = [150, 5, 0, 16, 47]
    q, k, v, cq, ck = make_case(rng, lens, 6, 1, 64)
    plan = DecodePlan(16, block_n, max_splits, 1, 4, 2)
    out = run(q, k, v, cq, ck, 50, plan=plan)
    assert_close(out, reference(q, k, v, cq, ck))
    assert (np.asarray(out[2]) == 0).all()


@pytest.mark.parametrize("hq,hkv", [(24, 2), (6, 1), (3, 1)])
def test_one_split_plan_runs_the_direct_path(hq, hkv):
    """A one-split plan (the shipped choice where B x Hkv >= SMs): the split kernel writes
    [B, Hq, D] itself (padding lanes first, masked), no merge kernel; edge lengths incl. 0, a
    permuted q order, NaN past the rows."""
    rng = np.random.default_rng(hq + 50)
    bn = 16
    lens = edge_lengths(rng, bn)
    q, k, v, cq, ck = make_case(rng, lens, hq, hkv, 64, permute_q=True, poison=np.nan)
    plan = DecodePlan(16, bn, 1, 1, 4, 2)
    out = run(q, k, v, cq, ck, 3 * bn + 5, plan=plan)
    assert_close(out, reference(q, k, v, cq, ck))
    assert (np.asarray(out)[np.asarray(lens) == 0] == 0).all()
    sds = jax.ShapeDtypeStruct
    args = (sds(q.shape, jnp.float16), sds(k.shape, jnp.float16), sds(v.shape, jnp.float16),
            sds(cq.shape, jnp.int32), sds(ck.shape, jnp.int32))
    lowered = C.lower_for_device_kind(
        lambda *a: dec._sparse_decode(*a, 3 * bn + 5, interpret=False, plan=plan), args,
        "NVIDIA H200")
    assert [m.name for m in C.triton_modules(lowered)] == ["qsa_decode_direct"]
    # the shipped plan picks it where B x Hkv fills the SMs
    assert dec.plan_for(132, 1, 12, 64, 2051)[1] == "direct"
    assert dec.plan_for(4, 1, 12, 64, 2051)[1] == "kernel"


def test_all_rows_empty_and_zero_capacity():
    rng = np.random.default_rng(3)
    q, k, v, cq, ck = make_case(rng, [0, 0, 0], 12, 1, 64)
    out = np.asarray(run(q, k, v, cq, ck, 8))
    assert (out == 0).all()
    # capacity 0: no key anywhere
    out0 = np.asarray(run(q, k[:0], v[:0], cq, ck, 8))
    assert (out0 == 0).all()


@pytest.mark.parametrize("poison", [np.nan, np.inf])
def test_poison_outside_rows_never_leaks(poison):
    """NaN / Inf in every K/V row outside [cu_k[s], cu_k[s+1]) of every sequence (the capacity
    tail, which the last BLOCK_N tile of each row overlaps) and in the unread padding of a
    partially filled block; output must be finite and equal to the reference of the clean data."""
    rng = np.random.default_rng(11)
    lens = [5, 0, 63, 1, 64, 65]
    q, k, v, cq, ck = make_case(rng, lens, 24, 2, 64, extra_rows=200, poison=poison)
    ref = reference(q, k[:ck[-1]], v[:ck[-1]], cq, ck)
    out = run(q, k, v, cq, ck, 65, plan=DecodePlan(16, 64, 4, 1, 4, 2))
    assert_close(out, ref)
    # Rows *between* sequences: shift every row's keys into a buffer whose gaps hold poison, by
    # giving each sequence its own region and reading it through a per-sequence call.
    kk = np.full((len(lens) * 80, 2, 64), poison, np.float16)
    vv = np.full_like(kk, poison)
    for s, n in enumerate(lens):
        kk[s * 80 + 8: s * 80 + 8 + n] = k[ck[s]:ck[s + 1]]
        vv[s * 80 + 8: s * 80 + 8 + n] = v[ck[s]:ck[s + 1]]
    for s, n in enumerate(lens):
        cks = np.array([s * 80 + 8, s * 80 + 8 + n], np.int32)
        o = run(q[cq[s]:cq[s] + 1], kk, vv, np.array([0, 1], np.int32), cks, 80,
                plan=DecodePlan(16, 16, 4, 1, 4, 2))
        assert_close(o, ref[s:s + 1])


# ---------------------------------------------------------------------------------------------
# CPU: contract errors identical to the torch path
def _torch_decode():
    try:
        import qsa_triton  # noqa: PLC0415

        return qsa_triton.sparse_decode
    except (ImportError, AttributeError):
        return check_decode  # the torch entry point's first statement


BAD_CALLS = {
    "q_float32": dict(qdt="float32"),
    "head_pair": dict(hq=10, hkv=4),
    "head_dim_96": dict(d=96),
    "cu_k_length": dict(cuk_len=-1),
    "cu_q_float": dict(cuq_dt="float32"),
    "max_seqlen_k_0": dict(msk=0),
    "bad_scale": dict(scale=-1.0),
    "v_shape": dict(v_rows=-1),
    "k_dtype": dict(kdt="float32"),
    "q_rank": dict(q2d=True),
}


def _bad_args(lib, *, qdt="float16", kdt=None, hq=12, hkv=1, d=64, cuk_len=0, cuq_dt="int32",
              msk=16, scale=None, v_rows=0, q2d=False):
    b, cap = 3, 20
    rng = np.random.default_rng(0)
    q = rng.standard_normal((b, hq, d)).astype(qdt)
    if q2d:
        q = q[:, 0]
    k = rng.standard_normal((cap, hkv, d)).astype(kdt or qdt)
    v = rng.standard_normal((cap + v_rows, hkv, d)).astype(kdt or qdt)
    cq = np.arange(b + 1).astype(cuq_dt)
    ck = np.array([0, 4, 9, 15][: b + 1 + cuk_len], np.int32)
    if lib == "torch":
        import torch  # noqa: PLC0415

        dev = "cuda" if ON_GPU and torch.cuda.is_available() else "cpu"  # jax arrays' device
        t = lambda a: torch.from_numpy(a).to(dev)  # noqa: E731
        return (t(q), t(k), t(v), t(cq), t(ck), msk, scale)
    return (jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(cq), jnp.asarray(ck), msk,
            scale)


@pytest.mark.parametrize("case", sorted(BAD_CALLS))
def test_contract_errors_match_torch(case):
    pytest.importorskip("torch")
    with pytest.raises(ContractError) as et:
        _torch_decode()(*_bad_args("torch", **BAD_CALLS[case]))
    with pytest.raises(ContractError) as ej:
        qsa_pallas.sparse_decode(*_bad_args("jax", **BAD_CALLS[case]))
    assert str(ej.value) == str(et.value)


def test_traced_max_seqlen_k_rejected():
    q, k, v, cq, ck = make_case(np.random.default_rng(0), [3, 4], 6, 1, 64)
    with pytest.raises(ContractError, match="max_seqlen_k"):
        jax.jit(lambda m: run(q, k, v, cq, ck, m))(jnp.int32(8))


@pytest.mark.parametrize("flag", ["strict", "interpret"])
def test_traced_or_non_bool_flags_rejected(flag):
    """``strict`` / ``interpret`` traced under jit, or a truthy string: a ContractError naming
    the flag before tracing (not jax's TracerBoolConversionError, not interpret mode switched
    on by "no"), in the packed and the paged decode."""
    q, k, v, cq, ck = make_case(np.random.default_rng(0), [3, 4], 6, 1, 64)
    r2t = jnp.arange(8, dtype=jnp.int32)[None]
    rows, idx = jnp.zeros(2, jnp.int32), jnp.zeros((2, 4), jnp.int32)
    calls = (lambda f: run(q, k, v, cq, ck, 8, **{flag: f}),
             lambda f: qsa_pallas.sparse_decode_paged(q, k, v, r2t, rows, idx, cq[1:], **{flag: f}))
    for call in calls:
        with pytest.raises(ContractError, match=f"'{flag}': expected .*host bool"):
            jax.jit(call)(True)
        with pytest.raises(ContractError, match=f"'{flag}'.*got str"):
            call("no")


# ---------------------------------------------------------------------------------------------
# CPU: building blocks
def test_jit_traced_lengths_no_recompile():
    """max_seqlen_k static, lengths traced: new lengths replay the same executable."""
    rng = np.random.default_rng(5)
    hq, hkv, d, cap, msk = 12, 1, 64, 160, 64
    f = jax.jit(qsa_pallas.sparse_decode, static_argnames=("max_seqlen_k",))
    q = rng.standard_normal((4, hq, d)).astype(np.float16)
    k = rng.standard_normal((cap, hkv, d)).astype(np.float16)
    v = rng.standard_normal((cap, hkv, d)).astype(np.float16)
    cq = np.arange(5, dtype=np.int32)
    sizes = []
    for lens in ([3, 0, 64, 17], [64, 64, 1, 0], [0, 0, 0, 0], [40, 41, 42, 30]):
        ck = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        out = f(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(cq), jnp.asarray(ck),
                max_seqlen_k=msk)
        assert_close(out, reference(q, k, v, cq, ck))
        sizes.append(f._cache_size())  # (shared by every jit wrapper of sparse_decode)
    assert len(set(sizes)) == 1, f"recompiled for new lengths: cache sizes {sizes}"


def test_first_calls_in_a_fresh_process_do_not_recompile():
    """In a new process the first Pallas lowering must not change jax's trace context (jax 0.11
    registers a config lazily there; ``qsa_pallas._compat`` preloads it): call 1 and call 2 with
    new lengths share one executable."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415
    import textwrap  # noqa: PLC0415

    code = textwrap.dedent("""
        import numpy as np, jax, jax.numpy as jnp, qsa_pallas
        f = jax.jit(qsa_pallas.sparse_decode, static_argnames=("max_seqlen_k",))
        q = jnp.ones((2, 6, 64), jnp.float16); k = jnp.ones((40, 1, 64), jnp.float16)
        cq = jnp.arange(3, dtype=jnp.int32)
        sizes = []
        for ck in ([0, 3, 9], [0, 20, 21], [0, 0, 40]):
            f(q, k, k, cq, jnp.asarray(np.array(ck, np.int32)), max_seqlen_k=32).block_until_ready()
            sizes.append(f._cache_size())
        print(sizes)
        assert sizes == [1, 1, 1], sizes
    """)
    env = dict(os.environ)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]


def test_scan_over_layers():
    rng = np.random.default_rng(6)
    nl, lens, hq, hkv, d = 3, [9, 0, 70], 24, 2, 64
    cases = [make_case(rng, lens, hq, hkv, d) for _ in range(nl)]
    qs, ks, vs = (np.stack([c[i] for c in cases]) for i in range(3))
    cq, ck = cases[0][3], cases[0][4]

    @jax.jit
    def layers(qs, ks, vs, cq, ck):
        def body(carry, x):
            q, k, v = x
            return carry, qsa_pallas.sparse_decode(q, k, v, cq, ck, 96)
        return jax.lax.scan(body, 0, (qs, ks, vs))[1]

    out = layers(*(jnp.asarray(a) for a in (qs, ks, vs, cq, ck)))
    for i in range(nl):
        assert_close(out[i], reference(qs[i], ks[i], vs[i], cq, ck))


@pytest.mark.parametrize("hq,hkv,kv_spec", [(24, 2, "tp"), (12, 1, None)],
                         ids=["TP2-12/1-from-24/2", "TP4-like-6/1-kv-replicated"])
def test_shard_map_heads(hq, hkv, kv_spec):
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices (conftest forces 2 host devices on CPU)")
    rng = np.random.default_rng(7)
    lens = [30, 0, 65, 2]
    q, k, v, cq, ck = make_case(rng, lens, hq, hkv, 64)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("tp",))
    seen = []

    def local(q, k, v, cq, ck):
        seen.append((q.shape[1], k.shape[1]))
        return qsa_pallas.sparse_decode(q, k, v, cq, ck, 80)

    f = jax.jit(C.shard_map(local, mesh=mesh,
                            in_specs=(P(None, "tp", None), P(None, kv_spec, None),
                                      P(None, kv_spec, None), P(), P()),
                            out_specs=P(None, "tp", None)))
    out = f(*(jnp.asarray(a) for a in (q, k, v, cq, ck)))
    assert seen[0] == (hq // 2, hkv // 2 if kv_spec else hkv)
    assert_close(out, reference(q, k, v, cq, ck))


# ---------------------------------------------------------------------------------------------
# CPU: a jitted multi-layer decode step with donated KV buffers
class TinyModel:
    """L layers; per layer x -> q, k_new, v_new; KV cache [L, B, R, Hkv, D] (sequence s owns the
    region [s*R, (s+1)*R)). A step appends one token per sequence to its region, compacts every
    sequence's rows into a packed buffer (the upstream decode pipeline: counts -> exclusive prefix
    sum -> gather) and attends with sparse_decode; x += out @ Wo."""

    def __init__(self, rng, nl=2, b=3, r=24, hq=6, hkv=1, d=64, e=32):
        self.nl, self.b, self.r, self.hq, self.hkv, self.d, self.e = nl, b, r, hq, hkv, d, e
        w = lambda *s: (rng.standard_normal(s) / np.sqrt(s[-2])).astype(np.float16)  # noqa: E731
        self.wq, self.wk, self.wv = w(nl, e, hq * d), w(nl, e, hkv * d), w(nl, e, hkv * d)
        self.wo = w(nl, hq * d, e)

    def step_jax(self, x, kc, vc, lens):
        b, r, hq, hkv, d = self.b, self.r, self.hq, self.hkv, self.d
        new_lens = lens + 1
        ck = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(new_lens).astype(jnp.int32)])
        cq = jnp.arange(b + 1, dtype=jnp.int32)
        cap = b * r
        p = jnp.arange(cap, dtype=jnp.int32)
        seq = jnp.clip(jnp.searchsorted(ck, p, side="right") - 1, 0, b - 1)
        src = seq * r + jnp.clip(p - ck[seq], 0, r - 1)  # packed row -> region row

        def layer(x, ws):
            wq, wk, wv, wo, kc_l, vc_l = ws
            q = (x @ wq).reshape(b, hq, d)
            kn = (x @ wk).reshape(b, hkv, d)
            vn = (x @ wv).reshape(b, hkv, d)
            kc_l = kc_l.at[jnp.arange(b), lens].set(kn)
            vc_l = vc_l.at[jnp.arange(b), lens].set(vn)
            kp = kc_l.reshape(cap, hkv, d)[src]
            vp = vc_l.reshape(cap, hkv, d)[src]
            o = qsa_pallas.sparse_decode(q, kp, vp, cq, ck, r)
            x = x + (o.reshape(b, hq * d) @ wo).astype(x.dtype)
            return x, (kc_l, vc_l, o)

        x, (kc, vc, outs) = jax.lax.scan(layer, x, (self.wq, self.wk, self.wv, self.wo, kc, vc))
        return x, kc, vc, new_lens, outs

    def step_ref(self, x, kc, vc, lens):
        """float64 numpy model of one step."""
        x = np.asarray(x, np.float64)
        kc, vc = np.array(kc, np.float64), np.array(vc, np.float64)
        b, hq, hkv, d = self.b, self.hq, self.hkv, self.d
        new_lens = lens + 1
        ck = np.concatenate([[0], np.cumsum(new_lens)])
        outs = []
        for li in range(self.nl):
            q = (x @ self.wq[li]).reshape(b, hq, d)
            kc[li, np.arange(b), lens] = (x @ self.wk[li]).reshape(b, hkv, d)
            vc[li, np.arange(b), lens] = (x @ self.wv[li]).reshape(b, hkv, d)
            kp = np.concatenate([kc[li, s, :new_lens[s]] for s in range(b)])
            vp = np.concatenate([vc[li, s, :new_lens[s]] for s in range(b)])
            o = decode_reference(q, kp, vp, np.arange(b + 1), ck)
            outs.append(o)
            x = x + o.reshape(b, hq * d) @ self.wo[li]
        return x, kc, vc, new_lens, np.stack(outs)


def test_jitted_multilayer_decode_step_donated_kv():
    rng = np.random.default_rng(8)
    m = TinyModel(rng)
    lens = np.array([0, 5, 17], np.int32)
    kc = np.zeros((m.nl, m.b, m.r, m.hkv, m.d), np.float16)
    vc = np.zeros_like(kc)
    for s, n in enumerate(lens):  # a prompt already in the cache
        kc[:, s, :n] = rng.standard_normal((m.nl, n, m.hkv, m.d))
        vc[:, s, :n] = rng.standard_normal((m.nl, n, m.hkv, m.d))
    x = (rng.standard_normal((m.b, m.e)) * 0.5).astype(np.float16)
    step = jax.jit(m.step_jax, donate_argnums=(1, 2))
    xj, kj, vj, lj = jnp.asarray(x), jnp.asarray(kc), jnp.asarray(vc), jnp.asarray(lens)
    xr, kr, vr, lr = x, kc, vc, lens
    for _ in range(2):  # two decode steps: the second replays with new lengths
        xj, kj, vj, lj, outs = step(xj, kj, vj, lj)
        xr, kr, vr, lr, outs_r = m.step_ref(xr, kr, vr, lr)
        for li in range(m.nl):
            assert_close(outs[li], outs_r[li])
        assert_close(xj, xr)
        np.testing.assert_array_equal(np.asarray(lj), lr)
    assert step._cache_size() == 1


# ---------------------------------------------------------------------------------------------
# GPU (the H200): shape suite and replay without recompiling.
# Budget (< 120 s for this file and tests/test_cross_decode.py with -m gpu): one jit compile per
# (B, TP) case and nothing else — q is [B, Hq, D] so B is a static shape, but K/V use ONE capacity
# per TP (C = 128 x MSK + 64 rows, generated once on the device) and only cu_seqlens (traced)
# change, so the three length kinds and the replays reuse the compiled executable. Every output row
# is checked against a device FP32 reference (bench.pallas_decode_provider._f32_reference, itself
# checked against interop.reference in tests/test_cross_decode.py) and a sample of rows against the
# float64 interop.reference (converting all of K/V to float64 on the host for every case was the
# slow part of the first H200 run).
# B is a static shape, so each B costs one compile: the test keeps a sample that covers the plan's
# boundaries (3, 17, 48); `qsa check --full` runs every B in 1..16, 17, 24, 32, 48, 64, 96, 128.
SUITE_B = [1, 3, 4, 16, 17, 32, 48, 64, 128]
TP = {"TP1": (24, 2), "TP2": (12, 1), "TP4": (6, 1)}
MSK = 2051
GPU_D = 256
SAMPLE_ROWS = 6  # sequences per case checked against the float64 reference


def suite_lengths(rng, b, kind, msk=None):
    msk = msk or MSK
    if kind == "short":
        return rng.integers(1, min(65, msk + 1), b)
    if kind == "medium":
        return rng.integers(min(256, msk // 2), min(1025, msk) + 1, b)
    return np.full(b, msk)


_POOLS: dict = {}


def device_pool(tp, d=None, msk=None, max_b=None, dtype=None):
    """(q_all [max_B, Hq, D], k, v [C, Hkv, D]) on the device (bf16 by default), C = max_B * MSK
    + 64, plus their host copies (numpy, same dtype), made once per (TP, D, MSK): every B of the
    suite slices q and shares K/V (one capacity, one shape)."""
    d, msk, max_b = d or GPU_D, msk or MSK, max_b or max(SUITE_B)
    key = (tp, d, msk, max_b)
    if key not in _POOLS:
        if len(_POOLS) >= 3:  # the three TPs stay alive (about 1 GB on the device in all)
            _POOLS.clear()
        hq, hkv = TP[tp]
        kq, kk, kv = jax.random.split(jax.random.PRNGKey(hq * 7 + hkv), 3)
        dt = dtype or jnp.bfloat16
        cap = max_b * msk + 64
        dev = (jax.random.normal(kq, (max_b, hq, d), dt), jax.random.normal(kk, (cap, hkv, d), dt),
               jax.random.normal(kv, (cap, hkv, d), dt))
        _POOLS[key] = dev + tuple(np.asarray(a) for a in dev)
    return _POOLS[key]


@functools.partial(jax.jit, static_argnames=("width",))
def _device_reference(q, k, v, cq, ck, *, width):
    """FP32 packed decode on the device, ``decode_reference``'s semantics (row s attends
    q[cq[s]] over its rows, zeros for an empty row), rows padded to ``width`` (static: one compile
    per B) and masked; HIGHEST precision (no TF32)."""
    b, hq, d = q.shape
    hkv = k.shape[1]
    lens = ck[1:] - ck[:-1]
    pos = jnp.arange(width)[None, :]
    valid = pos < lens[:, None]  # [B, W]
    src = jnp.clip(ck[:-1, None] + pos, 0, k.shape[0] - 1)
    kg, vg = k[src].astype(jnp.float32), v[src].astype(jnp.float32)  # [B, W, Hkv, D]
    qg = q[cq[:-1]].astype(jnp.float32).reshape(b, hkv, hq // hkv, d)
    hi = jax.lax.Precision.HIGHEST
    sc = jnp.einsum("bhgd,bwhd->bhgw", qg, kg, precision=hi) * d ** -0.5
    mk = valid[:, None, None, :]
    sc = jnp.where(mk, sc, -jnp.inf)
    m = jnp.max(sc, axis=-1, keepdims=True)
    p = jnp.where(mk, jnp.exp(sc - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    den = p.sum(-1, keepdims=True)
    o = jnp.einsum("bhgw,bwhd->bhgd", p / jnp.where(den > 0, den, 1.0), vg, precision=hi)
    return o.reshape(b, hq, d)


def check_against_references(out, q, pool, cq, ck, rng, msk, sample=SAMPLE_ROWS):
    """All rows vs the device FP32 reference; ``sample`` sequences (first, last, longest, random)
    vs the float64 ``interop.reference.decode_reference`` on host copies of just their K/V rows.
    No eager jax op: nothing compiles per call except ``_device_reference`` once per B."""
    _, k, v, _, kh, vh = pool
    b = q.shape[0]
    o = np.asarray(out).astype(np.float32)
    ref32 = np.asarray(_device_reference(q, k, v, cq, ck, width=msk))
    assert_close(o, ref32)
    lens = np.diff(ck)
    pick = {0, b - 1, int(lens.argmax())} | set(rng.choice(b, min(b, sample), replace=False).tolist())
    pick = sorted(pick)
    qh = np.asarray(q)[cq[pick]].astype(np.float32)
    sub_ck = np.concatenate([[0], np.cumsum(lens[pick])]).astype(np.int64)
    rows = np.concatenate([np.arange(ck[s], ck[s + 1]) for s in pick]).astype(np.int64)
    ref64 = decode_reference(qh, kh[rows].astype(np.float32), vh[rows].astype(np.float32),
                             np.arange(len(pick) + 1), sub_ck)
    assert_close(o[pick], ref64)


@pytest.mark.gpu
@pytest.mark.parametrize("b", SUITE_B)
@pytest.mark.parametrize("tp", sorted(TP))
def test_gpu_decode_suite(b, tp):
    if not ON_GPU:
        pytest.skip("needs jax on a CUDA GPU")
    run_suite_case(b, tp)


def run_suite_case(b, tp, *, d=None, msk=None, max_b=None, dtype=None):
    """One (B, TP) case: short / medium / saturated rows on the shared pool, a permuted q row
    order, a second run bitwise equal, no recompilation for new lengths (also run by the CPU
    dry run that counts compiles, with small d / msk)."""
    msk = msk or MSK
    rng = np.random.default_rng(1000 * b + TP[tp][0])
    pool = device_pool(tp, d, msk, max_b, dtype)
    q_all, k, v = pool[:3]
    q = q_all[:b]
    cq = np.concatenate([rng.permutation(b), [b]]).astype(np.int32)
    f = jax.jit(qsa_pallas.sparse_decode, static_argnames=("max_seqlen_k",))
    compiled = None
    for kind in ("short", "medium", "saturated"):
        lens = suite_lengths(rng, b, kind, msk)
        ck = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        out = f(q, k, v, jnp.asarray(cq), jnp.asarray(ck), max_seqlen_k=msk)
        # jit caches are shared by wrappers of one function: count entries after the first call
        compiled = f._cache_size() if compiled is None else compiled
        check_against_references(out, q, pool, cq, ck, rng, msk)
        again = f(q, k, v, jnp.asarray(cq), jnp.asarray(ck), max_seqlen_k=msk)
        assert np.array_equal(np.asarray(again), np.asarray(out)), "second run not bitwise equal"
    assert f._cache_size() == compiled, "new lengths must not recompile"


@pytest.mark.gpu
def test_gpu_replay_new_lengths_no_recompile():
    if not ON_GPU:
        pytest.skip("needs jax on a CUDA GPU")
    run_replay_case()


def run_replay_case(*, d=None, msk=None, max_b=None, dtype=None):
    """B = 16, TP1 on the shared pool: 5 launches with new lengths (incl. 0 and MSK), one
    compile."""
    msk = msk or MSK
    rng = np.random.default_rng(99)
    b = 16
    pool = device_pool("TP1", d, msk, max_b, dtype)
    q_all, k, v = pool[:3]
    q = q_all[:b]
    cq = np.arange(b + 1, dtype=np.int32)
    f = jax.jit(lambda q, k, v, cq, ck: qsa_pallas.sparse_decode(q, k, v, cq, ck, msk))
    for trial in range(5):
        lens = rng.integers(0, msk + 1, b) if trial else np.full(b, msk)
        ck = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        out = f(q, k, v, jnp.asarray(cq), jnp.asarray(ck))
        check_against_references(out, q, pool, cq, ck, rng, msk)
    assert f._cache_size() == 1  # a fresh lambda: its own cache


def test_torch_tensors_and_compiled_mode_on_cpu_are_contract_errors():
    """What JAX/Pallas would reject deep inside (a torch tensor; interpret=False without a GPU
    backend) is a ContractError naming the argument, before any tracing."""
    torch = pytest.importorskip("torch")
    from interop.contract import ContractError

    q = np.zeros((2, 12, 64), np.float16)
    k = np.zeros((5, 1, 64), np.float16)
    cu = np.array([0, 1, 2], np.int32)
    ck = np.array([0, 2, 5], np.int32)
    with pytest.raises(ContractError, match="'k'.*jax.Array or numpy"):
        qsa_pallas.sparse_decode(q, torch.zeros(5, 1, 64, dtype=torch.float16), k, cu, ck, 4)
    # a shape without data used to pass the checks and fail in the launcher with a TypeError
    with pytest.raises(ContractError, match="'q'.*ShapeDtypeStruct has no data"):
        qsa_pallas.sparse_decode(jax.ShapeDtypeStruct(q.shape, q.dtype), k, k, cu, ck, 4)
    # a list names only what this package takes (the shared checker lists torch tensors too)
    with pytest.raises(ContractError, match=r"'cu_seqlens_q'.*expected a jax.Array or numpy "
                                            r"array; got builtins.list"):
        qsa_pallas.sparse_decode(q, k, k, [0, 1, 2], ck, 4)
    if jax.default_backend() == "cpu":
        with pytest.raises(ContractError, match="'interpret'"):
            qsa_pallas.sparse_decode(q, k, k, cu, ck, 4, interpret=False)
        # under jax.jit too (only a lowering for an abstract CUDA device may ask for kernels)
        with pytest.raises(ContractError, match="'interpret'"):
            jax.jit(lambda *a: qsa_pallas.sparse_decode(*a, 4, interpret=False))(q, k, k, cu, ck)
