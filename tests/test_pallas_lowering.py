"""The Pallas decode kernel lowers (and compiles) for CUDA on a machine without a GPU.

Interpret mode accepts things the GPU rejects (non-power-of-two tiles, out-of-range gathers), so
CPU CI also lowers each kernel for CUDA under abstract devices (architecture.md):
``jax.sharding.AbstractMesh`` whose ``AbstractDevice`` has device_kind "NVIDIA H200", "NVIDIA RTX
PRO 6000 Blackwell Workstation Edition" or "NVIDIA GB10", then
``jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))`` (``_compat.lower_for_device_kind``).

What that checks, per jax version (see ``qsa_pallas/_compat.py``): the Pallas Triton lowering rule
builds the kernel's Triton MLIR (TTIR) in Python -- power-of-two tile shapes, supported
primitives, dtypes -- and embeds it in a ``__gpu$xla.gpu.triton`` custom call; no jaxlib CUDA
plugin is involved. jax 0.10.2 lowers every kind as sm_90 (its fallback without a GPU); jax 0.11
maps the kind to sm_90 / sm_120 / sm_121. We then take the embedded TTIR and run the rest of
Triton's pipeline with the installed ``triton`` package for the kind's compute capability
(``_compat.compile_ttir``): TTGIR, LLVM, PTX and ptxas, and check the shared memory per program
against the sm_120/sm_121 limit of 101,376 B (Triton does not check it at compile time).
"""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from interop.arch import CI_ARCHS, DeviceFacts, capability, device_kind  # noqa: E402
from interop.contract import QUALIFIED, ContractError  # noqa: E402
from interop.plan import DecodePlan  # noqa: E402
from qsa_pallas import _compat as C  # noqa: E402
from qsa_pallas import decode as dec  # noqa: E402
from qsa_pallas.decode import sparse_decode  # noqa: E402

SDS = jax.ShapeDtypeStruct
KINDS = [device_kind(a) for a in CI_ARCHS]  # H200, RTX PRO 6000 Workstation, GB10


def _cap_limit(kind):
    """(compute capability as an int, shared memory per block) of a device kind."""
    facts = DeviceFacts.from_device_kind(kind)
    return capability(facts.arch), facts.smem_per_block


def _args(b, hq, hkv, d, cap, dtype=jnp.bfloat16):
    return (SDS((b, hq, d), dtype), SDS((cap, hkv, d), dtype), SDS((cap, hkv, d), dtype),
            SDS((b + 1,), jnp.int32), SDS((b + 1,), jnp.int32))


def _lower(kind, b, hq, hkv, d, msk, plan=None, dtype=jnp.bfloat16):
    cap = b * msk + 16
    fn = lambda q, k, v, cq, ck: dec._sparse_decode(q, k, v, cq, ck, msk,  # noqa: E731
                                                   interpret=False, plan=plan)
    return C.lower_for_device_kind(fn, _args(b, hq, hkv, d, cap, dtype), kind)


def _kernel_names(plan):
    """The Pallas kernels a plan lowers to: one launch for a one-split plan, else split + merge."""
    return ["qsa_decode_direct"] if plan.max_splits == 1 else ["qsa_decode_split", "qsa_decode_merge"]


def _triton_or_skip():
    try:
        import triton  # noqa: F401, PLC0415
        from triton.backends.compiler import GPUTarget  # noqa: F401, PLC0415
    except ImportError:
        pytest.skip("triton not installed: TTIR is checked, the binary compile is not")


SHAPES = [  # (B, Hq, Hkv, D, max_seqlen_k)
    (1, 24, 2, 256, 2051),     # TP1, many splits
    (64, 12, 1, 256, 2051),    # TP2
    (128, 6, 1, 256, 2051),    # TP4
    (4, 3, 1, 256, 100),       # TP8 (optional rank shape)
    (5, 24, 2, 64, 300),       # small D
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-{}x{}-D{}-msk{}".format(*s))
def test_decode_lowers_and_compiles_for_cuda(kind, shape):
    b, hq, hkv, d, msk = shape
    if kind == "NVIDIA GB10" and ((hq, hkv) not in QUALIFIED["head_pairs"]
                                  or d != QUALIFIED["head_dim"]):
        # sm_121 decode runs the exact qualified contract only (interop.contract.exact_contract)
        with pytest.raises(ContractError, match="strict mode"):
            _lower(kind, b, hq, hkv, d, msk)
        return
    lowered = _lower(kind, b, hq, hkv, d, msk)
    text = lowered.as_text()
    assert "__gpu$xla.gpu.triton" in text
    mods = C.triton_modules(lowered)
    with jax.sharding.use_abstract_mesh(C.abstract_mesh(kind)):
        plan, merge_mode = dec.plan_for(b, hkv, hq // hkv, d, msk)
    assert [m.name for m in mods] == _kernel_names(plan)
    assert (merge_mode == "direct") is (plan.max_splits == 1)
    split = mods[0]
    assert split.grid == (b, hkv, plan.max_splits)
    assert (split.num_warps, split.num_stages) == (plan.num_warps, plan.num_stages)
    if len(mods) == 2:
        assert mods[1].grid[:2] == (b, hq) and d % mods[1].grid[2] == 0
    assert "tt.dot" in split.text(), "the QK and PV products must lower to tensor-core dots"
    for mod in mods:
        assert "atomic" not in mod.text(), "no atomics (int32 vector atomics: no-op on the H200)"
    _triton_or_skip()
    cap, limit = _cap_limit(kind)
    for mod in mods:
        try:
            res = C.compile_ttir(mod, cap)
        except Exception as e:  # noqa: BLE001
            if "parse" in str(e).lower():  # jaxlib's Triton dialect newer than the installed one
                pytest.skip(f"installed triton cannot parse this jaxlib's TTIR: {str(e)[:200]}")
            raise
        assert 0 <= res["shared"] <= limit, \
            f"{mod.name}: {res['shared']} B shared memory > {limit} B on sm_{cap}"


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_decode_lowers_both_dtypes(dtype):
    mods = C.triton_modules(_lower("NVIDIA GB10", 2, 12, 1, 256, 64, dtype=dtype))
    assert len(mods) == 2 and "tt.dot" in mods[0].text()


def test_interpret_mode_accepts_what_the_gpu_lowering_rejects():
    """A non-power-of-two head tile runs in interpret mode but fails the CUDA lowering: the reason
    these lowering tests exist. (The raw split kernel is used: ``sparse_decode`` itself refuses
    such a plan with a ContractError.)"""
    import numpy as np  # noqa: PLC0415

    from interop.contract import ContractError  # noqa: PLC0415

    bad = DecodePlan(head_tile=12, block_n=16, max_splits=2, min_blocks_per_split=1, num_warps=4,
                     num_stages=2)
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((2, 12, 64)), jnp.float16)
    k = jnp.asarray(rng.standard_normal((40, 1, 64)), jnp.float16)
    cq = jnp.arange(3, dtype=jnp.int32)
    ck = jnp.asarray([0, 17, 40], jnp.int32)
    o, lse = dec._split_call(q, k, k, cq, ck, plan=bad, softmax_scale=0.125, interpret=True,
                             direct=False)
    assert np.isfinite(np.asarray(lse)).all()
    raw = lambda q, k, v, cq, ck: dec._split_call(q, k, v, cq, ck, plan=bad,  # noqa: E731
                                                  softmax_scale=0.125, interpret=False,
                                                  direct=False)
    with pytest.raises(Exception, match="power of 2"):
        C.lower_for_device_kind(raw, _args(2, 12, 1, 64, 40, jnp.float16), "NVIDIA H200")
    with pytest.raises(ContractError, match="head_tile"):
        dec._sparse_decode(q, k, k, cq, ck, 32, interpret=True, plan=bad)


def test_oversized_plan_is_clamped_to_sm12x_shared_memory():
    """BLOCK_N = 128 with 3 stages (~260 KB) would not launch on sm_120/sm_121 (101,376 B):
    ``interop.plan.fit_shared_memory`` lowers num_stages for those limits; the compiled kernel
    fits."""
    from interop.plan import fit_shared_memory, plan_decode  # noqa: PLC0415

    for kind in KINDS[1:]:
        plan = fit_shared_memory(plan_decode(8, 1, 12, 256, 2051, block_n=128), head_dim=256,
                                 limit=_cap_limit(kind)[1])
        assert plan.num_stages < 3
        lowered = _lower(kind, 8, 12, 1, 256, 2051, plan=plan)
        _triton_or_skip()
        split = C.triton_modules(lowered)[0]
        cap, limit = _cap_limit(kind)
        res = C.compile_ttir(split, cap)
        assert res["shared"] <= limit == 101_376, res


def test_kv_buffers_past_4_gib_use_64_bit_offsets():
    """K/V buffers over 2**32 bytes (C x Hkv x D x 2 bytes): the Triton lowering must address
    them with 64-bit offsets (it switches per operand by size); smaller buffers keep 32-bit."""
    b, hq, hkv, d = 2, 12, 1, 256
    big = (1 << 32) // (hkv * d * 2) + 64  # rows: just past 4 GiB per buffer
    fn = lambda q, k, v, cq, ck: sparse_decode(q, k, v, cq, ck, 2051, interpret=False)  # noqa: E731
    split_big = C.triton_modules(
        C.lower_for_device_kind(fn, _args(b, hq, hkv, d, big), "NVIDIA H200"))[0].text()
    split_small = C.triton_modules(
        C.lower_for_device_kind(fn, _args(b, hq, hkv, d, 4096), "NVIDIA H200"))[0].text()
    assert "xi64>" in split_big, "no 64-bit offsets for a > 4 GiB K/V buffer"
    assert "xi64>" not in split_small


@pytest.mark.parametrize("kind", KINDS)
def test_every_planned_configuration_lowers(kind):
    """``interop.validate.compile.pallas_decode_cases`` (what ``qsa compile`` lowers): every
    distinct plan the shared planner picks on this
    device for TP1/TP2/TP4 x B = 1..128 lowers (both kernels, no atomics); the smallest and the
    largest batch are also compiled and checked against the shared-memory limit."""
    from interop.validate.compile import pallas_decode_cases  # noqa: PLC0415

    cases = pallas_decode_cases(kind)
    assert cases
    lowered = {}
    for name, fn, args in cases:
        mods = C.triton_modules(C.lower_for_device_kind(fn, args, kind))
        one_split = "_s1_" in name
        assert [m.name for m in mods] == _kernel_names(
            DecodePlan(16, 16, 1 if one_split else 2, 1, 4, 1)), name
        assert not any("atomic" in m.text() for m in mods), name
        lowered[name] = mods
    _triton_or_skip()
    cap, limit = _cap_limit(kind)
    for name in (cases[0][0], cases[-1][0]):
        for m in lowered[name]:
            res = C.compile_ttir(m, cap)
            assert res["shared"] <= limit, (name, m.name, res)
