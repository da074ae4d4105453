"""CPU, no GPU: every Pallas prefill kernel lowers for CUDA under the abstract devices of the three
target archs, and the lowered Triton IR compiles (installed ``triton``, ptxas included) within the
target's shared-memory limit.

Why: interpret mode accepts things the GPU rejects (non-power-of-two tiles, out-of-range gathers),
and Triton does not check sm_120/sm_121's 101,376-byte shared-memory limit at compile time
(architecture.md). Lowering: ``qsa_pallas._compat.lower_for_device_kind`` (AbstractMesh with an
AbstractDevice of the given kind; jax 0.11 maps the kind to the compute capability, 0.10 assumes
sm_90). Compile: ``_compat.compile_ttir`` runs Triton's pipeline on the embedded TTIR.
"""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import pytest

from interop.arch import CI_ARCHS, DeviceFacts, capability, device_kind
from interop.contract import PrefillProblem
from interop.geometry import Geometry, fit_prefill
from interop.plan import smem_bytes
from qsa_pallas import _compat
from qsa_pallas import prefill as P

S = jax.ShapeDtypeStruct
FP8 = jnp.float8_e4m3fn
HAS_TRITON = importlib.util.find_spec("triton") is not None


def _args(kind, *, t=256, hq=12, hkv=1, d=256, w=2051, b=2, rows=4096, kv_dtype=jnp.bfloat16,
          per_head=False, max_context=2048):
    idx = S((t, hkv, w) if per_head else (t, w), jnp.int32)
    q = S((t, hq, d), jnp.float16 if kv_dtype == jnp.float16 else jnp.bfloat16)
    kv = S((rows, hkv, d), kv_dtype)
    cu = S((b + 1,), jnp.int32)
    if kind == "ordinary":
        kv = S((t, hkv, d), kv_dtype)
        return (q, kv, kv, idx, cu)
    if kind == "chunk":
        return (q, kv, kv, idx, cu, cu, S((b,), jnp.int32))
    return (q, kv, kv, S((b + 2, max_context), jnp.int32), S((b,), jnp.int32), idx, cu,
            S((b,), jnp.int32))


def _fn(kind, max_q=256, geometry=None, scales=(1.0, 1.0)):
    kw = dict(interpret=False)
    if kind == "ordinary":
        fn = lambda *a: P.sparse_prefill(*a, max_q, **kw)  # noqa: E731
    elif kind == "chunk":
        fn = lambda *a: P.sparse_prefill_chunk(*a, max_q, None, *scales, **kw)  # noqa: E731
    else:
        fn = lambda *a: P.sparse_prefill_paged(*a, max_q, None, *scales, **kw)  # noqa: E731
    if geometry is None:
        return fn

    def forced(*a):  # traced (lowered) inside the override
        with P._forced_geometry(geometry):
            return fn(*a)
    return forced


CASES = [  # (kind, kv dtype, per-head indices, (Hq, Hkv))
    ("ordinary", jnp.bfloat16, False, (12, 1)),
    ("ordinary", jnp.float16, True, (24, 2)),
    ("chunk", jnp.bfloat16, False, (6, 1)),
    ("chunk", FP8, True, (24, 2)),
    ("paged", jnp.bfloat16, True, (12, 2)),
    ("paged", FP8, False, (12, 1)),
]


@pytest.mark.parametrize("device_kind", [device_kind(a) for a in CI_ARCHS])
@pytest.mark.parametrize("kind,kv_dtype,per_head,heads", CASES,
                         ids=[f"{c[0]}-{jnp.dtype(c[1]).name}-{'ph' if c[2] else 'sh'}-{c[3][0]}x{c[3][1]}"
                              for c in CASES])
def test_lowers_and_compiles_for_cuda(device_kind, kind, kv_dtype, per_head, heads):
    hq, hkv = heads
    fp8 = kv_dtype == FP8
    args = _args(kind, hq=hq, hkv=hkv, kv_dtype=kv_dtype, per_head=per_head)
    lowered = _compat.lower_for_device_kind(
        _fn(kind, scales=(0.5, 2.0) if fp8 else (1.0, 1.0)), args,
        device_kind)
    mods = [m for m in _compat.triton_modules(lowered) if m.name == f"qsa_sparse_prefill_{kind}"]
    assert len(mods) == 1, [m.name for m in _compat.triton_modules(lowered)]
    mod = mods[0]
    assert mod.grid[:2] == (args[0].shape[0], hkv)  # one program per (query row, KV head)
    # the geometry the entry point picked for this device
    facts = DeviceFacts.from_device_kind(device_kind)
    prob = PrefillProblem(kind, 256, 2, hq, hkv, hq // hkv, 256, 2051, per_head, 256, 0.0625,
                          1.0, 1.0, "bfloat16", jnp.dtype(kv_dtype).name)
    geo = P.select_geometry(prob, interpret=False, facts=facts)
    assert (mod.num_warps, mod.num_stages) == (geo.num_warps, geo.num_stages)
    if not HAS_TRITON:
        pytest.skip("triton not installed: lowered only, Triton compile not checked")
    cap = capability(DeviceFacts.from_device_kind(device_kind).arch)
    res = _compile(mod, cap)
    assert res["shared"] <= facts.smem_per_block, (device_kind, geo, res)
    assert res["shared"] <= _smem(geo, 1 if fp8 else 2)


def _smem(geo, kv_bytes):
    """``interop.plan.smem_bytes``: the one shared-memory model the fit uses."""
    return smem_bytes(head_tile=geo.block_m, block_n=geo.block_n, head_dim=256,
                      num_stages=geo.num_stages, kv_bytes=kv_bytes, v_convert=True)


def _compile(mod, capability):
    """``_compat.compile_ttir``, skipping (with the reason) when the installed triton cannot parse
    the TTIR this jax emitted (a jaxlib / triton MLIR version mismatch, not a kernel bug)."""
    try:
        return _compat.compile_ttir(mod, capability)
    except Exception as e:  # noqa: BLE001
        text = str(e)
        if any(w in text.lower() for w in ("parse", "unregistered", "bytecode")):
            pytest.skip(f"installed triton cannot read this jax's TTIR: {text[:200]}")
        raise


def _configs():
    from interop import geometry  # noqa: PLC0415

    # sm_121 has sm_120's limit and table (its kernels are compiled in the per-kind test); FP8
    # tiles are smaller than bf16 ones, so sm_90's 227 KB only needs the bf16 sweep.
    out = []
    for dk, arch, dtypes in (("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", "sm_120",
                              (jnp.bfloat16, FP8)), ("NVIDIA H200", "sm_90", (jnp.bfloat16,))):
        for g in geometry.all_configs(arch):
            for kv in dtypes:
                out.append((dk, g, kv))
    return out


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed: cannot compile TTIR on CPU")
@pytest.mark.parametrize("device_kind,geo,kv_dtype", _configs(),
                         ids=lambda x: getattr(x, "key", None) and "x".join(map(str, x.key))
                         or (jnp.dtype(x).name if not isinstance(x, str) else x.split()[-1]))
def test_every_selector_geometry_fits_the_device(device_kind, geo, kv_dtype):
    """Every geometry the shared selector can return, made launchable for the device
    (``interop.geometry.fit_prefill``), compiles and fits its shared memory; the model used for
    fitting (``interop.plan.smem_bytes``) is an upper bound."""
    facts = DeviceFacts.from_device_kind(device_kind)
    kv_bytes = 1 if kv_dtype == FP8 else 2
    pg = fit_prefill(geo, backend="pallas", head_dim=256, kv_bytes=kv_bytes,
                     limit=facts.smem_per_block)
    lowered = _compat.lower_for_device_kind(
        _fn("chunk", geometry=pg), _args("chunk", kv_dtype=kv_dtype), device_kind)
    (mod,) = _compat.triton_modules(lowered)
    res = _compile(mod, capability(DeviceFacts.from_device_kind(device_kind).arch))
    assert res["shared"] <= facts.smem_per_block, (pg, res)
    assert res["shared"] <= _smem(pg, kv_bytes), (pg, res)


def test_sm12x_fit_shrinks_a_227kb_geometry():
    big = Geometry(16, 64, 4, 3, "x")
    assert _smem(big, 2) > 101_376
    fit = fit_prefill(big, backend="pallas", head_dim=256, kv_bytes=2, limit=101_376)
    assert _smem(fit, 2) <= 101_376
    assert (fit.block_n, fit.num_stages) == (64, 2) and "fit<=101376B" in fit.source
    assert fit_prefill(big, backend="pallas", head_dim=256, kv_bytes=2, limit=232_448) == big


def test_64bit_offsets_exactly_for_pools_past_4gib():
    """The lowering switches a ref's offsets to int64 when it exceeds 2**32 bytes: a 16-bit pool
    of > 2**31 elements gets i64 gather offsets; a small one stays i32."""

    def ttir(slots):
        args = _args("paged", hkv=2, rows=slots, t=64)
        lowered = _compat.lower_for_device_kind(_fn("paged"), args, "NVIDIA H200")
        (mod,) = _compat.triton_modules(lowered)
        return mod.text()

    big = 2**32 // (2 * 256 * 2) + 1  # 4.2M slots: slot * Hkv * D passes 2**31
    assert "x256xi64>" in ttir(big)
    assert "x256xi64>" not in ttir(4096)


def test_lowering_cases_cover_every_variant_and_lower():
    """``interop.validate.compile.pallas_prefill_cases`` (what ``qsa compile`` lowers): every
    variant for each fitted selector geometry, unsplit and split-KV; a sample of them lowers to
    exactly one prefill kernel with the case's launch parameters (the full set is compiled by
    ``qsa compile``)."""
    kind = "NVIDIA RTX PRO 6000 Blackwell Workstation Edition"
    from interop.validate.compile import pallas_prefill_cases  # noqa: PLC0415

    cases = pallas_prefill_cases(kind)
    names = [n for n, _, _ in cases]
    assert len(names) == len(set(names))
    for variant in ("ordinary_bf16", "chunk_bf16", "chunk_fp8", "paged_bf16", "paged_fp8"):
        assert any(f"pallas_prefill_{variant}_" in n for n in names), variant
    assert {n.endswith("_split") for n in names} == {True, False}  # unsplit and split-KV
    for name, fn, args in cases[:: max(1, len(cases) // 4)]:
        (mod,) = _compat.triton_modules(_compat.lower_for_device_kind(fn, args, kind))
        warps, stages = (int(x[1:]) for x in name.removesuffix("_split").split("_")[-2:])
        assert (mod.num_warps, mod.num_stages) == (warps, stages), name
