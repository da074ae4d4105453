"""Cross-framework sparse prefill: ``qsa_pallas`` and ``qsa_triton`` on the *same* buffers
(torch tensors shared with jax zero-copy through ``interop.dlpack.to_jax``) agree with each other
and with the reference within rtol = atol = 2e-2 and relative L2 <= 5e-3 (qsa-contract.md §6).

CPU: both in interpret mode on tiny cases (fp16 q: the Triton interpreter's bf16 dot is only right
with tests/triton_interp_patch.py), reference = ``interop.reference`` (float64 numpy).
GPU (``-m gpu``, H200): the issue's 8192-row ordinary/chunk cases at KV 8k/32k/128k, G 6 and 12,
plus FP8 chunk and a paged pool; reference = ``bench.prefill.reference_f32`` (float32 torch).
Skips, with the reason, while ``qsa_triton.sparse_prefill*`` or ``interop.dlpack`` is missing.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # jax shares the GPU with torch

import numpy as np  # noqa: E402
import pytest  # noqa: E402

torch = pytest.importorskip("torch", reason="torch not installed: no Triton side to compare")
try:
    import qsa_triton  # noqa: E402

    _MISSING = [n for n in ("sparse_prefill", "sparse_prefill_chunk", "sparse_prefill_paged")
                if not hasattr(qsa_triton, n)]
    _WHY = f"qsa_triton lacks {', '.join(_MISSING)}" if _MISSING else ""
except ImportError as e:  # pragma: no cover - depends on the checkout
    _WHY = f"qsa_triton not importable: {e}"
try:
    from interop.dlpack import to_jax, to_torch  # noqa: E402
except ImportError as e:  # pragma: no cover
    _WHY = _WHY or f"interop.dlpack not importable: {e}"
try:
    from bench.prefill import errors, make_case, reference_f32  # noqa: E402
except ImportError as e:  # pragma: no cover
    _WHY = _WHY or f"bench.prefill not importable: {e}"
if _WHY:
    pytest.skip(_WHY, allow_module_level=True)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from interop.reference import rel_l2  # noqa: E402
from qsa_pallas import prefill as P  # noqa: E402

RTOL = ATOL = 2e-2
REL_L2 = 5e-3


def pallas_on(c, **kw):
    """qsa_pallas on the case's torch buffers, shared zero-copy; result back as a torch tensor."""
    if c.q.is_cuda:
        torch.cuda.synchronize()  # the buffers were produced on torch's stream
    j = {n: (None if getattr(c, n) is None else to_jax(getattr(c, n)))
         for n in ("q", "k", "v", "indices", "cu_q", "cu_k", "kv_lens", "slot_table",
                   "req_indices")}
    if c.kind == "ordinary":
        out = P.sparse_prefill(j["q"], j["k"], j["v"], j["indices"], j["cu_q"], c.max_q,
                               c.softmax_scale, **kw)
    elif c.kind == "chunk":
        out = P.sparse_prefill_chunk(j["q"], j["k"], j["v"], j["indices"], j["cu_q"], j["cu_k"],
                                     j["kv_lens"], c.max_q, c.softmax_scale, c.k_scale, c.v_scale,
                                     **kw)
    else:
        out = P.sparse_prefill_paged(j["q"], j["k"], j["v"], j["slot_table"], j["req_indices"],
                                     j["indices"], j["cu_q"], j["kv_lens"], c.max_q,
                                     c.softmax_scale, c.k_scale, c.v_scale, **kw)
    return to_torch(out)


def _check(name, out, ref):
    o = out.detach().float().cpu().numpy() if isinstance(out, torch.Tensor) else np.asarray(out)
    r = ref.detach().double().cpu().numpy() if isinstance(ref, torch.Tensor) else np.asarray(ref)
    assert np.isfinite(o).all(), f"{name}: non-finite"
    np.testing.assert_allclose(o, r, rtol=RTOL, atol=ATOL, err_msg=name)
    err = rel_l2(o, r)
    assert err <= REL_L2, f"{name}: rel L2 {err:.2e} > {REL_L2}"
    return err


CPU_CASES = [  # (kind, Hq, Hkv, q_lens, kv_lens, kw)
    ("ordinary", 12, 2, [5, 6], None, dict(per_head=True, junk="mixed", empty_rows=[3])),
    ("ordinary", 3, 1, [7], None, dict(junk="len+19")),
    ("chunk", 6, 1, [3, 4], [9, 15], dict(kv_dtype="fp8", k_scale=0.5, v_scale=1.5, junk="-7")),
    ("chunk", 24, 2, [4, 2], [4, 11], dict(junk="len", empty_rows=[1])),
    ("paged", 12, 1, [4, 3], [10, 6], dict(junk="mixed", pool_slack=7)),
    ("paged", 12, 2, [3, 3], [8, 5], dict(per_head=True, kv_dtype="fp8", k_scale=0.75,
                                           v_scale=1.25, pool_slack=3)),
]


@pytest.mark.parametrize("kind,hq,hkv,q_lens,kv_lens,kw", CPU_CASES,
                         ids=[f"{c[0]}-{c[1]}x{c[2]}-{i}" for i, c in enumerate(CPU_CASES)])
def test_cpu_pallas_and_triton_agree_on_the_same_buffers(kind, hq, hkv, q_lens, kv_lens, kw):
    kw = dict(kw)
    if kw.pop("kv_dtype", None) == "fp8":
        kw["kv_dtype"] = torch.float8_e4m3fn
    c = make_case(kind, hq, hkv, 64, q_lens, kv_lens, width=24, dtype=torch.float16,
                  device="cpu", seed=len(q_lens) + hq, **kw)
    ref = c.numpy_reference()
    out_t = c.run()
    out_p = pallas_on(c, interpret=True)
    assert out_p.dtype == out_t.dtype == c.q.dtype
    _check("triton vs reference", out_t, ref)
    _check("pallas vs reference", out_p, ref)
    _check("pallas vs triton", out_p, out_t.double())
    for r in kw.get("empty_rows", []):  # rows with no valid entry: exact zeros in both
        assert float(out_p[r].abs().max()) == 0.0 and float(out_t[r].abs().max()) == 0.0


def test_cpu_inputs_are_shared_not_copied():
    """The Pallas side reads the torch buffers themselves (zero-copy DLPack): a write through
    torch after sharing shows up in jax."""
    c = make_case("chunk", 6, 1, 64, [2], [5], width=16, dtype=torch.float16, device="cpu")
    jk = to_jax(c.k)
    c.k[0, 0, 0] = 123.0
    assert float(jk[0, 0, 0]) == 123.0


GPU_CASES = [("ordinary", 8192, 6, 1, None), ("ordinary", 8192, 12, 1, None)] + [
    ("chunk", kv, hq, 1, None) for kv in (8192, 32768, 131072) for hq in (6, 12)] + [
    ("chunk", 32768, 12, 1, "fp8"), ("paged", 32768, 12, 1, None), ("paged", 32768, 24, 2, "fp8")]


@pytest.mark.gpu
@pytest.mark.parametrize("kind,kv,hq,hkv,fp8", GPU_CASES,
                         ids=[f"{c[0]}-kv{c[1] // 1024}k-{c[2]}x{c[3]}{'-fp8' if c[4] else ''}"
                              for c in GPU_CASES])
def test_gpu_pallas_and_triton_agree_8192_rows(kind, kv, hq, hkv, fp8):
    if not torch.cuda.is_available() or jax.default_backend() != "gpu":
        pytest.skip("needs CUDA for both torch and jax")
    extra = dict(kv_dtype=torch.float8_e4m3fn, k_scale=0.5, v_scale=1.5) if fp8 else {}
    c = make_case(kind, hq, hkv, 256, [8192], None if kind == "ordinary" else [kv],
                  junk="mixed", empty_rows=[0, 4096], pool_slack=1000 if kind == "paged" else 0,
                  device="cuda", seed=hq + kv % 1000, **extra)
    ref = reference_f32(c)
    out_t = c.run()
    out_p = pallas_on(c)
    out_p2 = pallas_on(c)
    torch.cuda.synchronize()
    assert torch.equal(out_p, out_p2), "Pallas: second run not bitwise equal"
    e_t = _check("triton vs reference", out_t, ref)
    e_p = _check("pallas vs reference", out_p, ref)
    _check("pallas vs triton", out_p, out_t.float())
    assert float(out_p[[0, 4096]].float().abs().max()) == 0.0
    print(f"{kind} kv={kv} {hq}/{hkv}: rel L2 triton {e_t:.2e} pallas {e_p:.2e}; "
          f"{errors(out_p.float(), out_t.float())}")
