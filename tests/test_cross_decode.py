"""Cross-framework decode: the same inputs through qsa_pallas (JAX) and qsa_triton (PyTorch),
exchanged zero-copy with interop.dlpack, agree with each other and with the float64 reference
(rtol = atol = 2e-2, relative L2 <= 5e-3). The Pallas side goes through the benchmark provider
(``bench.decode.PROVIDERS["pallas"]``) so the benchmark path is what gets checked.

CPU: Triton interpreter + Pallas interpret mode, tiny shapes. GPU (``-m gpu``): the H200, bf16,
D = 256, TP1/TP2/TP4, saturated and mixed rows.
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
try:
    from interop.dlpack import to_jax, to_torch  # noqa: F401
except ImportError as e:  # pragma: no cover - written in parallel by another helper
    pytest.skip(f"interop.dlpack not importable yet: {e}", allow_module_level=True)
try:
    from qsa_triton import sparse_decode as triton_decode
except ImportError as e:  # pragma: no cover
    pytest.skip(f"qsa_triton.sparse_decode not importable yet: {e}", allow_module_level=True)

import jax.numpy as jnp  # noqa: E402

import qsa_pallas  # noqa: E402
from bench.common import jax_chain, unrolled  # noqa: E402
from bench.decode import PROVIDERS, DecodeInputs  # noqa: E402
from interop.reference import decode_reference, rel_l2  # noqa: E402

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


def _cross(q, k, v, cq, ck, msk, scale=None, sample=None):
    """Pallas (through the benchmark provider) vs Triton on every row; both vs the float64
    reference on every row, or on ``sample`` sequences (first, last, longest, random) when given:
    converting a B = 128 x 2051-row K/V to float64 on the host for every GPU case was the slow
    part of the first H200 run."""
    out_t = triton_decode(q, k, v, cq, ck, msk, scale)
    pallas = make_provider(q, k, v, cq, ck, msk, scale)
    out_p = pallas.once()
    assert isinstance(out_p, torch.Tensor) and out_p.device == q.device
    assert out_p.dtype == q.dtype and out_p.shape == q.shape
    a, b = _np(out_p), _np(out_t)
    _close(a, b, "pallas vs triton")
    cqh, ckh = _np(cq).astype(np.int64), _np(ck).astype(np.int64)
    nb = q.shape[0]
    if sample is None or sample >= nb:
        ref = decode_reference(_np(q), _np(k), _np(v), cqh, ckh, scale)
        pick = np.arange(nb)
    else:
        lens = np.diff(ckh)
        rng = np.random.default_rng(nb)
        pick = np.array(sorted({0, nb - 1, int(lens.argmax())}
                               | set(rng.choice(nb, sample, replace=False).tolist())))
        rows = torch.as_tensor(np.concatenate([np.arange(ckh[s], ckh[s + 1]) for s in pick]),
                               device=k.device)
        sub_ck = np.concatenate([[0], np.cumsum(lens[pick])])
        ref = decode_reference(_np(q[torch.as_tensor(cqh[pick], device=q.device)]),
                               _np(k[rows]), _np(v[rows]), np.arange(len(pick) + 1), sub_ck, scale)
    _close(a[pick], ref, "pallas vs reference")
    _close(b[pick], ref, "triton vs reference")
    empty = (ck[1:] == ck[:-1]).cpu().numpy()
    assert (a[empty] == 0).all() and (b[empty] == 0).all(), "empty rows must be exact zeros"
    return a, b


@pytest.mark.parametrize("hq,hkv", [(24, 2), (12, 1), (6, 1)])
def test_cross_cpu_fp16(hq, hkv):
    if ON_GPU:
        pytest.skip("CPU variant")
    _cross(*_case(hq, [0, 1, 63, 64, 65, 130], hq, hkv, 64, torch.float16, "cpu"), 130)


def test_cross_cpu_bf16_d256():
    if ON_GPU:
        pytest.skip("CPU variant")
    pytest.importorskip("tests.triton_interp_patch", reason="bf16 Triton interpreter patch")
    _cross(*_case(7, [40, 0, 3], 12, 1, 256, torch.bfloat16, "cpu"), 2051, 0.0625)


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


# ---------------------------------------------------------------------------------------------
TP = {"TP1": (24, 2), "TP2": (12, 1), "TP4": (6, 1)}


@pytest.mark.gpu
@pytest.mark.parametrize("rows", ["saturated", "mixed"])
@pytest.mark.parametrize("b", [1, 16, 128])
@pytest.mark.parametrize("tp", sorted(TP))
def test_cross_gpu(tp, b, rows):
    if not ON_GPU:
        pytest.skip("needs torch and jax on a CUDA GPU")
    hq, hkv = TP[tp]
    rng = np.random.default_rng(b)
    lens = [2051] * b if rows == "saturated" else rng.integers(0, 2052, b).tolist()
    _cross(*_case(b, lens, hq, hkv, 256, torch.bfloat16, "cuda"), 2051, sample=6)


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
