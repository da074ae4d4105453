"""The Pallas decode *benchmark provider* (``bench.pallas_decode_provider``): its timing chain,
its context peers and its FP32 check agree with ``interop.reference``, and the chain lowers to N
dependent decodes. (Pallas vs Triton vs the reference on the contract's cases is
``tests/conformance.py``.)

CPU: Triton interpreter + Pallas interpret mode, tiny shapes; the same tests run on the GPU.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
# torch shares the GPU in the same process: jax must not preallocate 75% of it (read when jax's
# GPU backend initialises, i.e. on first use, after this line)
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import qsa_pallas  # noqa: E402
from bench.pallas_decode_provider import make_context_providers, make_provider  # noqa: E402
from interop.cases import ATOL, REL_L2, RTOL  # noqa: E402
from interop.dlpack import to_jax  # noqa: E402
from interop.reference import decode_reference, rel_l2  # noqa: E402

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


def _close(a, b, what):
    assert np.isfinite(a).all(), f"{what}: non-finite"
    np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL, err_msg=what)
    err = rel_l2(a, b)
    assert err <= REL_L2, f"{what}: relative L2 {err:.2e} > {REL_L2}"


def test_provider_inner_reps_chain():
    """inner_reps = n runs n decodes back to back, each on the previous output (the timing
    path): equal to applying sparse_decode n times."""
    dev = "cuda" if ON_GPU else "cpu"
    q, k, v, cq, ck = _case(3, [20, 9, 33], 6, 1, 64, torch.float16, dev)
    # q row order must be the identity for the chain (out row s feeds q row s)
    cq = torch.arange(4, dtype=torch.int32, device=dev)
    assert make_provider(q, k, v, cq, ck, 40, inner_reps=2).inner_reps == 64  # the fair minimum
    f = make_provider(q, k, v, cq, ck, 40, inner_reps=3, min_timing_reps=0)
    assert f.inner_reps == 3 and f.cuda_graph_capturable is False
    x = to_jax(q)
    for _ in range(3):
        x = qsa_pallas.sparse_decode(x, to_jax(k), to_jax(v), to_jax(cq), to_jax(ck), 40)
    np.testing.assert_allclose(_np(f()), np.asarray(x.astype(jnp.float32)), rtol=1e-3, atol=1e-3)


def test_context_providers_match_reference():
    """The JAX context peers compute the same attention (rows with >= 1 key)."""
    dev = "cuda" if ON_GPU else "cpu"
    # XLA:CPU has no fp16 x fp16 -> fp32 dot: the CPU variant runs the peers in fp32
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    q, k, v, cq, ck = _case(5, [17, 64, 5], 12, 1, 64, dtype, dev)
    include = (("jax_pallas_gqa", "jax_dpa_xla") if not ON_GPU
               else ("jax_pallas_gqa", "jax_dpa_xla", "jax_dpa_cudnn"))
    peers = make_context_providers(q, k, v, cq, ck, 64, include=include)
    assert "jax_dpa_xla" in peers and "jax_pallas_gqa" in peers
    ref = decode_reference(_np(q), _np(k), _np(v), _np(cq).astype(np.int64),
                           _np(ck).astype(np.int64))
    for name, f in peers.items():
        # context peers return rows in sequence order: row s attends q[cu_q[s]]
        _close(_np(f()), ref, name)


def test_timing_f32_reference_matches_interop_reference():
    """The device FP32 reference of the Pallas-only timing run equals interop.reference."""
    from bench.pallas_decode_provider import _f32_reference  # noqa: PLC0415

    lens = [0, 7, 33, 1]
    q, k, v, _, ck = _case(9, lens, 24, 2, 64, torch.float32, "cpu")
    cq = np.arange(len(lens) + 1)
    ref = decode_reference(_np(q), _np(k), _np(v), cq, _np(ck).astype(np.int64), 0.1)
    got = _f32_reference(to_jax(q), to_jax(k), to_jax(v), _np(ck).astype(np.int64), 0.1)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_timing_chain_lowers_to_n_decodes():
    """The fair-timing chain (bench.pallas_decode_provider, N decodes in one jit) lowered for the
    H200 with abstract devices: N calls of the one-decode function, whose body holds the two Triton
    launches (split + merge), each call fed by the previous one's output (no CSE possible)."""
    import functools  # noqa: PLC0415
    import re  # noqa: PLC0415

    from bench.pallas_decode_provider import _chain, _pallas_step  # noqa: PLC0415
    from qsa_pallas import _compat as C  # noqa: PLC0415

    n, b, hq, hkv, d, cap = 8, 4, 24, 2, 64, 4 * 40
    sds = jax.ShapeDtypeStruct
    args = (sds((b, hq, d), jnp.bfloat16), sds((cap, hkv, d), jnp.bfloat16),
            sds((cap, hkv, d), jnp.bfloat16), sds((b + 1,), jnp.int32), sds((b + 1,), jnp.int32))
    step = functools.partial(_pallas_step, max_seqlen_k=40, scale=None, interpret=False, plan=None)
    text = C.lower_for_device_kind(jax.jit(_chain(step, n)), args, "NVIDIA H200").as_text()
    calls = re.findall(r"(%\S+) = (?:func\.)?call @_pallas_step\w*\((%\S+),", text)
    assert len(calls) == n, text[:2000]
    for (_, arg), (prev, _) in zip(calls[1:], calls[:-1]):
        assert arg == prev, "each decode must read the previous decode's output"
    bodies = re.split(r"func\.func ", text)
    for body in bodies:
        if body.startswith("private @_decode"):
            assert body.count("custom_call @__gpu$xla.gpu.triton") == 2
