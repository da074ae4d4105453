"""The decode benchmark providers (``bench.decode.PROVIDERS``): the Pallas provider and its timing
chain compute what ``interop.reference`` computes, and the chain lowers to N dependent decodes.
(Pallas vs Triton vs the reference on the contract's cases is ``tests/conformance.py``.)
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")  # on demand beside torch (tests/conftest.py)
from interop.dlpack import to_jax  # noqa: E402

import jax.numpy as jnp  # noqa: E402

import qsa_pallas  # noqa: E402
from bench.common import jax_chain, unrolled  # noqa: E402
from bench.decode import PROVIDERS, DecodeInputs  # noqa: E402
from interop.reference import rel_l2  # noqa: E402

RTOL = ATOL = 2e-2
REL_L2 = 5e-3
ON_GPU = torch.cuda.is_available() and jax.default_backend() == "gpu"


def _case(seed, lens, hq, hkv, d, dtype, device, extra=5):
    g = torch.Generator(device=device).manual_seed(seed)  # generated where used (fast on GPU)
    lens = torch.as_tensor(lens, dtype=torch.int64)
    b = len(lens)
    ck = torch.zeros(b + 1, dtype=torch.int32)
    ck[1:] = torch.cumsum(lens, 0)
    cap = int(ck[-1]) + extra
    q = torch.randn(b, hq, d, generator=g, device=device).to(dtype)
    k = torch.randn(cap, hkv, d, generator=g, device=device).to(dtype)
    v = torch.randn(cap, hkv, d, generator=g, device=device).to(dtype)
    perm = torch.randperm(b, generator=g, device=device).cpu()
    cq = torch.cat([perm, torch.tensor([b])]).to(torch.int32)
    return (q, k, v, cq.to(device), ck.to(device))


def _np(t):
    return t.detach().float().cpu().numpy()


def make_provider(q, k, v, cq, ck, msk, scale=None):
    """The benchmark's Pallas provider on these buffers (``call.once()``: one decode)."""
    lens = (ck[1:] - ck[:-1]).tolist()
    return PROVIDERS["pallas"].setup(DecodeInputs(q, k, v, cq, ck, msk, scale, lens))


def _close(a, b, what):
    assert np.isfinite(a).all(), f"{what}: non-finite"
    np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL, err_msg=what)
    err = rel_l2(a, b)
    assert err <= REL_L2, f"{what}: relative L2 {err:.2e} > {REL_L2}"


def test_provider_chain():
    """The timing path: the provider runs a chain of calls, each on the previous output, in one
    jit (not capturable in a torch graph); a chain of n equals applying sparse_decode n times."""
    dev = "cuda" if ON_GPU else "cpu"
    q, k, v, cq, ck = _case(3, [20, 9, 33], 6, 1, 64, torch.float16, dev)
    # q row order must be the identity for the chain (out row s feeds q row s)
    cq = torch.arange(4, dtype=torch.int32, device=dev)
    p = make_provider(q, k, v, cq, ck, 40)
    assert p.chain == 20 and p.capturable is False
    f = jax_chain(qsa_pallas.sparse_decode, [q, k, v, cq, ck, 40, None], {}, 3)
    x = to_jax(q)
    for _ in range(3):
        x = qsa_pallas.sparse_decode(x, to_jax(k), to_jax(v), to_jax(cq), to_jax(ck), 40)
    np.testing.assert_allclose(_np(f()), np.asarray(x.astype(jnp.float32)), rtol=1e-3, atol=1e-3)


def test_timing_chain_lowers_to_n_decodes():
    """The timing chain (``bench.common.unrolled``, N decodes in one jit) lowered for the H200
    with abstract devices: N calls of the one-decode function, whose body holds the two Triton
    launches (split + merge), each call fed by the previous one's output (no CSE possible)."""
    import re  # noqa: PLC0415

    from qsa_pallas import _compat as C  # noqa: PLC0415

    def _pallas_step(q, k, v, cq, ck):
        return qsa_pallas.sparse_decode(q, k, v, cq, ck, 40, interpret=False)

    n, b, hq, hkv, d, cap = 8, 4, 24, 2, 64, 4 * 40
    sds = jax.ShapeDtypeStruct
    args = (sds((b, hq, d), jnp.bfloat16), sds((cap, hkv, d), jnp.bfloat16),
            sds((cap, hkv, d), jnp.bfloat16), sds((b + 1,), jnp.int32), sds((b + 1,), jnp.int32))
    text = C.lower_for_device_kind(jax.jit(unrolled(jax.jit(_pallas_step), n)), args,
                                   "NVIDIA H200").as_text()
    calls = re.findall(r"(%\S+) = (?:func\.)?call @_pallas_step\w*\((%\S+),", text)
    assert len(calls) == n, text[:2000]
    for (_, arg), (prev, _) in zip(calls[1:], calls[:-1]):
        assert arg == prev, "each decode must read the previous decode's output"
    from qsa_pallas.decode import plan_for  # noqa: PLC0415

    # a one-split plan runs as one launch (the split kernel writes the output), else split + merge
    launches = 1 if plan_for(b, hkv, hq // hkv, d, 40)[1] == "direct" else 2
    bodies = re.split(r"func\.func ", text)
    for body in bodies:
        if body.startswith("private @_decode"):
            assert body.count("custom_call @__gpu$xla.gpu.triton") == launches


def test_lying_cu_seqlens_k_stay_inside_kv_in_both_packages():
    """Metadata that lies (qsa-contract.md §2): cu_seqlens_k[B] past C and a decreasing pair.
    Both packages read only [min(cu_k[s], C), min(cu_k[s+1], C)) (a decreasing pair is an empty
    row), agree with the FP64 reference on those clamped rows, and never see the NaN rows that
    sit outside K/V's real rows (the buffer is a view of a larger, NaN-poisoned one)."""
    import qsa_triton  # noqa: PLC0415

    from interop.reference import decode_reference  # noqa: PLC0415

    dev = "cuda" if ON_GPU else "cpu"
    dtype = torch.bfloat16 if ON_GPU else torch.float16
    hq, hkv, d, cap = 12, 1, 64, 70
    g = torch.Generator(device=dev).manual_seed(5)
    q = torch.randn(4, hq, d, generator=g, device=dev).to(dtype)
    big_k = torch.full((cap + 40, hkv, d), float("nan"), device=dev, dtype=dtype)
    big_v = big_k.clone()
    big_k[:cap] = torch.randn(cap, hkv, d, generator=g, device=dev).to(dtype)
    big_v[:cap] = torch.randn(cap, hkv, d, generator=g, device=dev).to(dtype)
    k, v = big_k[:cap], big_v[:cap]
    cq = torch.arange(5, dtype=torch.int32, device=dev)
    ck = torch.tensor([0, 30, 20, 60, cap + 33], dtype=torch.int32, device=dev)  # lies twice
    # the reference applies the same rule (qsa-contract.md section 7) to the lying metadata
    ref = decode_reference(_np(q), _np(k), _np(v), _np(cq), _np(ck))
    clamped = np.clip(_np(ck).astype(np.int64), 0, cap)
    s = 3  # spot-check that rule on one row by hand: keys [60, cap)
    hand = decode_reference(_np(q[s:s + 1]), _np(k[clamped[s]:clamped[s + 1]]),
                            _np(v[clamped[s]:clamped[s + 1]]), np.array([0, 1]),
                            np.array([0, clamped[s + 1] - clamped[s]]))[0]
    np.testing.assert_allclose(ref[s], hand, rtol=0, atol=0)
    out_t = _np(qsa_triton.sparse_decode(q, k, v, cq, ck, 64))
    out_p = np.asarray(qsa_pallas.sparse_decode(to_jax(q), to_jax(k), to_jax(v), to_jax(cq),
                                                to_jax(ck), 64).astype(jnp.float32))
    for name, out in (("triton", out_t), ("pallas", out_p)):
        _close(out, ref, name)
        assert (out[1] == 0).all(), f"{name}: a decreasing cu_seqlens_k pair is an empty row"
    _close(out_t, out_p, "triton vs pallas")
