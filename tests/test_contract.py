"""Every rejection path of every ``interop.contract.check_*`` raises ContractError naming the
argument, and the same bad call made with torch tensors and with jax arrays gives the same
message. Also: the debug validators (``validate_*``) and the accepted calls."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from interop.arch import DeviceFacts
from interop.contract import (ContractError, TensorSpec, check_decode, check_prefill,
                              check_prefill_chunk, check_prefill_paged, exact_contract, spec_of,
                              validate_decode_metadata, validate_prefill_metadata)

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jnp = jax.numpy

CHECKS = {
    "decode": check_decode,
    "prefill": check_prefill,
    "chunk": check_prefill_chunk,
    "paged": check_prefill_paged,
}


def T(shape, dtype="bfloat16"):
    """A tensor placeholder realised per framework."""
    return ("tensor", tuple(shape), dtype)


class Strided:
    """A torch-only non-contiguous tensor (jax arrays have no strides)."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype = shape, dtype


CUDA_SPEC = lambda shape, dtype="int32": TensorSpec(tuple(shape), dtype, "cuda", 0)  # noqa: E731

# (Hq, Hkv, D) of the base calls: the qualified TP2 shape so strict calls pass the base case.
HQ, HKV, D = 12, 1, 256


def base(op: str, b: int = 2, t: int = 8, w: int = 16) -> tuple[list, dict]:
    """Arguments of a call that passes in strict mode."""
    if op == "decode":
        return [T((b, HQ, D)), T((32, HKV, D)), T((32, HKV, D)), T((b + 1,), "int32"),
                T((b + 1,), "int32"), 2051], {}
    if op == "prefill":
        return [T((t, HQ, D)), T((t, HKV, D)), T((t, HKV, D)), T((t, w), "int32"),
                T((3,), "int32"), 4], {}
    if op == "chunk":
        return [T((t, HQ, D)), T((40, HKV, D)), T((40, HKV, D)), T((t, w), "int32"),
                T((3,), "int32"), T((3,), "int32"), T((2,), "int32"), 4], {}
    if op == "paged":
        return [T((t, HQ, D)), T((64, HKV, D)), T((64, HKV, D)), T((5, 30), "int32"),
                T((2,), "int32"), T((t, w), "int32"), T((3,), "int32"), T((2,), "int32"), 4], {}
    raise AssertionError(op)


ARGPOS = {
    "decode": ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_k", "softmax_scale"],
    "prefill": ["q", "k", "v", "indices", "cu_seqlens", "max_seqlen_q", "softmax_scale"],
    "chunk": ["q", "k", "v", "indices", "cu_seqlens_q", "cu_seqlens_k", "kv_lens", "max_seqlen_q",
              "softmax_scale", "k_scale", "v_scale"],
    "paged": ["q", "k_cache", "v_cache", "req_to_token", "req_indices", "indices", "cu_seqlens_q",
              "kv_lens", "max_seqlen_q", "softmax_scale", "k_scale", "v_scale"],
}


def call_args(op, overrides: dict, **base_kw):
    args, kw = base(op, **base_kw)
    names = ARGPOS[op]
    for name, value in overrides.items():
        if name in names[:len(args)]:
            args[names.index(name)] = value
        else:
            kw[name] = value
    return args, kw


def realise(x, fw: str):
    if isinstance(x, Strided):
        full = torch.zeros(x.shape[:-1] + (x.shape[-1] * 2,), dtype=getattr(torch, x.dtype))
        return full[..., ::2]
    if not (isinstance(x, tuple) and len(x) == 3 and x[0] == "tensor"):
        return x
    _, shape, dtype = x
    if fw == "torch":
        return torch.zeros(shape, dtype=getattr(torch, dtype))
    return jnp.zeros(shape, dtype=getattr(jnp, dtype))


@contextlib.contextmanager
def jax_x64():
    old = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", old)


def run(op, overrides, fw, strict=False, **base_kw):
    args, kw = call_args(op, overrides, **base_kw)
    args = [realise(a, fw) for a in args]
    kw = {k: realise(v, fw) for k, v in kw.items()}
    return CHECKS[op](*args, strict=strict, **kw)


# (op, overrides, strict, argument named, base kwargs)
REJECT = [
    # ---- decode
    ("decode", {"q": T((0, HQ, D))}, False, "q", {"b": 0}),
    ("decode", {"q": T((129, HQ, D))}, True, "q", {"b": 129}),
    ("decode", {"q": T((2, 16, D)), "k": T((32, 2, D)), "v": T((32, 2, D))}, True, "q", {}),
    ("decode", {"q": T((2, 12, D)), "k": T((32, 5, D)), "v": T((32, 5, D))}, False, "k", {}),
    ("decode", {"q": T((2, 34, D)), "k": T((32, 2, D)), "v": T((32, 2, D))}, False, "q", {}),
    ("decode", {"q": T((2, 0, D))}, False, "q", {}),  # Hq = 0 divides by any Hkv
    ("decode", {"max_seqlen_k": 0}, False, "max_seqlen_k", {}),
    ("decode", {"max_seqlen_k": 2056}, True, "max_seqlen_k", {}),
    ("decode", {"max_seqlen_k": 5.0}, False, "max_seqlen_k", {}),
    ("decode", {"max_seqlen_q": 2}, False, "max_seqlen_q", {}),
    ("decode", {"cu_seqlens_q": T((3,), "int64")}, False, "cu_seqlens_q", {}),
    ("decode", {"cu_seqlens_k": T((3,), "int64")}, False, "cu_seqlens_k", {}),
    ("decode", {"cu_seqlens_k": T((4,), "int32")}, False, "cu_seqlens_k", {}),
    ("decode", {"cu_seqlens_q": T((2,), "int32")}, False, "cu_seqlens_q", {}),
    ("decode", {"cu_seqlens_k": T((3, 1), "int32")}, False, "cu_seqlens_k", {}),
    ("decode", {"cu_seqlens_k": CUDA_SPEC((3,))}, False, "cu_seqlens_k", {}),
    ("decode", {"k": CUDA_SPEC((32, HKV, D), "bfloat16")}, False, "k", {}),
    ("decode", {"v": T((31, HKV, D))}, False, "v", {}),
    ("decode", {"k": T((32, HKV, 128)), "v": T((32, HKV, 128))}, False, "k", {}),
    ("decode", {"k": T((32, HKV, D), "float16")}, False, "k", {}),
    ("decode", {"v": T((32, HKV, D), "float16")}, False, "v", {}),
    ("decode", {"k": T((32, HKV, D), "float8_e4m3fn"), "v": T((32, HKV, D), "float8_e4m3fn")},
     False, "k", {}),
    ("decode", {"q": T((2, HQ, D), "float32")}, False, "q", {}),
    ("decode", {"q": T((2, HQ))}, False, "q", {}),
    ("decode", {"q": T((2, HQ, 48)), "k": T((32, HKV, 48)), "v": T((32, HKV, 48))}, False, "q", {}),
    ("decode", {"q": T((2, HQ, 128)), "k": T((32, HKV, 128)), "v": T((32, HKV, 128))}, True, "q", {}),
    ("decode", {"softmax_scale": -1.0}, False, "softmax_scale", {}),
    ("decode", {"softmax_scale": float("nan")}, False, "softmax_scale", {}),
    ("decode", {"softmax_scale": "0.06"}, False, "softmax_scale", {}),
    ("decode", {"q": [1, 2]}, False, "q", {}),
    # ---- ordinary prefill
    ("prefill", {"k": T((7, HKV, D)), "v": T((7, HKV, D))}, False, "k", {}),
    ("prefill", {"k": T((10, HKV, D))}, False, "k", {}),  # a wrong K is named, not its twin V
    ("prefill", {"q": T((8, 0, D))}, False, "q", {}),
    ("prefill", {"indices": T((8, 16), "float32")}, False, "indices", {}),
    ("prefill", {"indices": T((8, 16), "int64")}, False, "indices", {}),
    ("prefill", {"indices": T((8,), "int32")}, False, "indices", {}),
    ("prefill", {"indices": T((7, 16), "int32")}, False, "indices", {}),
    ("prefill", {"indices": T((8, 3, 16), "int32")}, False, "indices", {}),
    ("prefill", {"indices": T((8, 0), "int32")}, False, "indices", {}),
    ("prefill", {"indices": CUDA_SPEC((8, 16))}, False, "indices", {}),
    ("prefill", {"cu_seqlens": T((1,), "int32")}, False, "cu_seqlens", {}),
    ("prefill", {"cu_seqlens": T((3,), "int64")}, False, "cu_seqlens", {}),
    ("prefill", {"cu_seqlens": CUDA_SPEC((3,))}, False, "cu_seqlens", {}),
    ("prefill", {"max_seqlen_q": 0}, False, "max_seqlen_q", {}),
    ("prefill", {"k": T((8, HKV, D), "float8_e4m3fn"), "v": T((8, HKV, D), "float8_e4m3fn")},
     False, "k", {}),
    ("prefill", {"q": T((8, 24, D)), "k": T((8, 4, D)), "v": T((8, 4, D))}, True, "q", {}),
    ("prefill", {"q": T((8, 12, D)), "k": T((8, 5, D)), "v": T((8, 5, D))}, False, "k", {}),
    # ---- chunk prefill
    ("chunk", {"cu_seqlens_k": T((4,), "int32")}, False, "cu_seqlens_k", {}),
    ("chunk", {"kv_lens": T((3,), "int32")}, False, "kv_lens", {}),
    ("chunk", {"kv_lens": T((2,), "int64")}, False, "kv_lens", {}),
    ("chunk", {"kv_lens": CUDA_SPEC((2,))}, False, "kv_lens", {}),
    ("chunk", {"cu_seqlens_q": T((3,), "int64")}, False, "cu_seqlens_q", {}),
    ("chunk", {"k_scale": 2.0}, False, "k_scale", {}),
    ("chunk", {"k": T((40, HKV, D), "float8_e4m3fn"), "v": T((40, HKV, D), "float8_e4m3fn"),
               "k_scale": 0.0}, False, "k_scale", {}),
    ("chunk", {"k": T((40, HKV, D), "float8_e4m3fn"), "v": T((40, HKV, D), "float8_e4m3fn"),
               "v_scale": float("inf")}, False, "v_scale", {}),
    ("chunk", {"k": T((40, HKV, D), "float8_e4m3fn")}, False, "v", {}),
    ("chunk", {"v": T((41, HKV, D))}, False, "v", {}),
    ("chunk", {"k": T((40, HKV, 128))}, False, "k", {}),
    ("chunk", {"indices": T((8, 16), "int16")}, False, "indices", {}),
    ("chunk", {"max_seqlen_q": -3}, False, "max_seqlen_q", {}),
    ("chunk", {"q": T((8, 0, D))}, False, "q", {}),
    # ---- paged prefill
    ("paged", {"req_to_token": T((2,), "int32")}, False, "req_to_token", {}),
    ("paged", {"req_to_token": T((5, 30), "int64")}, False, "req_to_token", {}),
    ("paged", {"req_to_token": CUDA_SPEC((5, 30))}, False, "req_to_token", {}),
    ("paged", {"req_indices": T((3,), "int32")}, False, "req_indices", {}),
    ("paged", {"req_indices": T((2,), "int64")}, False, "req_indices", {}),
    ("paged", {"kv_lens": T((1,), "int32")}, False, "kv_lens", {}),
    ("paged", {"v_cache": T((63, HKV, D))}, False, "v_cache", {}),
    ("paged", {"k_cache": T((64, HKV, D), "float32"), "v_cache": T((64, HKV, D), "float32")},
     False, "k_cache", {}),
    ("paged", {"indices": T((8, 2, 16), "int32")}, False, "indices", {}),
    ("paged", {"cu_seqlens_q": T((1,), "int32")}, False, "cu_seqlens_q", {}),
    ("paged", {"q": T((8, 0, D))}, False, "q", {}),
]


def _id(case):
    op, over, strict, arg, _ = case
    desc = ",".join(f"{k}={v[1:] if isinstance(v, tuple) else v}" for k, v in over.items())
    return f"{op}-{arg}-{'strict' if strict else 'default'}-{desc}"[:90]


@pytest.mark.parametrize("case", REJECT, ids=[_id(c) for c in REJECT])
def test_rejected_same_message_torch_and_jax(case):
    op, over, strict, arg, bkw = case
    needs_x64 = any(isinstance(v, tuple) and len(v) == 3 and v[2] == "int64" for v in over.values())
    messages = []
    for fw in ("torch", "jax"):
        ctx = jax_x64() if (fw == "jax" and needs_x64) else contextlib.nullcontext()
        with ctx, pytest.raises(ContractError) as info:
            run(op, over, fw, strict=strict, **bkw)
        err = info.value
        assert isinstance(err, ValueError)
        assert err.arg == arg, f"{fw}: named {err.arg!r}, expected {arg!r}: {err}"
        msg = str(err)
        assert f"'{arg}'" in msg and "expected" in msg and "got" in msg and "Qualified envelope" in msg
        messages.append(msg)
    assert messages[0] == messages[1]


@pytest.mark.parametrize("op", list(CHECKS))
@pytest.mark.parametrize("fw", ["torch", "jax"])
def test_base_calls_pass_strict(op, fw):
    prob = run(op, {}, fw, strict=True)
    assert prob.num_q_heads == HQ and prob.num_kv_heads == HKV and prob.head_dim == D
    assert prob.softmax_scale == pytest.approx(D ** -0.5)


def test_strict_only_limits_pass_in_default_mode():
    # the qualified envelope is not a correctness limit: default mode accepts these
    run("decode", {"q": T((129, HQ, D))}, "torch", b=129)
    run("decode", {"max_seqlen_k": 5000}, "torch")
    run("decode", {"q": T((2, 16, 64)), "k": T((32, 2, 64)), "v": T((32, 2, 64))}, "torch")
    run("prefill", {"q": T((8, 24, D)), "k": T((8, 4, D)), "v": T((8, 4, D))}, "torch")
    prob = run("chunk", {"k": T((40, HKV, D), "float8_e4m3fn"), "v": T((40, HKV, D), "float8_e4m3fn"),
                         "k_scale": 0.5, "v_scale": 2.0}, "jax")
    assert (prob.k_scale, prob.v_scale, prob.kv_dtype) == (0.5, 2.0, "float8_e4m3fn")


def test_decode_strict_b128_and_max_seqlen_2055_pass():
    prob = run("decode", {"q": T((128, HQ, D)), "max_seqlen_k": 2055}, "jax", strict=True, b=128)
    assert prob.batch == 128 and prob.max_seqlen_k == 2055


def test_torch_only_stride_rejections():
    # last dimension not unit-stride (only torch exposes strides)
    with pytest.raises(ContractError) as info:
        run("decode", {"q": Strided((2, HQ, D), "bfloat16")}, "torch")
    assert info.value.arg == "q" and "unit stride" in str(info.value)
    with pytest.raises(ContractError) as info:
        run("decode", {"cu_seqlens_k": Strided((3,), "int32")}, "torch")
    assert info.value.arg == "cu_seqlens_k" and "contiguous" in str(info.value)


@pytest.mark.parametrize("op", list(CHECKS))
def test_requires_grad_refused_by_every_check(op):
    """Forward-only: a torch tensor that requires grad is refused by the shared checker, naming
    the argument; the spec records the flag (jax / numpy arrays never have it)."""
    t = torch.zeros(base(op)[0][0][1], dtype=torch.bfloat16, requires_grad=True)
    assert TensorSpec.from_torch(t).requires_grad and not spec_of(jnp.zeros(3)).requires_grad
    with pytest.raises(ContractError, match="forward-only") as info:
        run(op, {"q": t}, "torch")
    assert info.value.arg == "q"
    for mode in (torch.no_grad, torch.inference_mode):  # nothing records a graph there
        with mode():
            run(op, {"q": t}, "torch")


@pytest.mark.parametrize("op", list(CHECKS))
@pytest.mark.parametrize("strict", ["no", 1, None])
def test_strict_must_be_a_bool_for_every_check(op, strict):
    """``strict`` is a host bool wherever it is taken (a truthy string used to switch strict mode
    on and then fail on an unrelated envelope limit)."""
    with pytest.raises(ContractError, match="a host bool") as info:
        run(op, {}, "torch", strict=strict)
    assert info.value.arg == "strict"


def test_messages_read_as_written():
    """A fixed value reads as one (not "1 <= max_seqlen_q <= 1"); a non-tensor names every
    framework's array type (a list handed to qsa_pallas used to read "a torch tensor")."""
    with pytest.raises(ContractError, match=r"expected max_seqlen_q = 1 \(decode") as info:
        run("decode", {"max_seqlen_q": 2}, "jax")
    assert "<=" not in str(info.value).split("[")[0]
    with pytest.raises(ContractError, match=r"\(torch.Tensor, jax.Array or numpy array\); got list"):
        run("decode", {"cu_seqlens_k": [0, 1, 2]}, "jax")
    # a length that follows from cu_seqlens_q's says so (a wrong cu_seqlens_q is named there)
    with pytest.raises(ContractError, match=r"B = 3 requests: the length of cu_seqlens_q - 1; "
                       r"the two lengths disagree") as info:
        run("chunk", {"cu_seqlens_q": T((4,), "int32")}, "torch")
    assert info.value.arg == "cu_seqlens_k"


def test_exact_contract_only_for_sm121_decode():
    assert exact_contract(DeviceFacts.for_arch("sm_121"))
    assert not exact_contract(DeviceFacts.for_arch("sm_121"), "prefill")
    assert not any(exact_contract(DeviceFacts.for_arch(a)) for a in ("sm_90", "sm_100", "sm_120"))
    assert not exact_contract(None)  # no GPU (interpreters)


def test_per_head_indices_and_spec_of():
    prob = run("chunk", {"indices": T((8, HKV, 16), "int32")}, "torch")
    assert prob.per_head_indices and prob.width == 16
    s = spec_of(np.zeros((3, 4), np.int32))
    assert s.dtype == "int32" and s.strides == (4, 1) and s.device == "cpu"
    assert spec_of(torch.zeros(3, 4, dtype=torch.bfloat16)).dtype == spec_of(
        jnp.zeros((3, 4), jnp.bfloat16)).dtype == "bfloat16"
    with pytest.raises(TypeError):
        spec_of([1, 2])


def test_jax_arrays_on_two_host_devices_refused_before_launch():
    """One call's JAX arrays on two host devices (conftest forces 4): a ContractError naming the
    argument and both devices, as on GPUs (jax's own error came first before)."""
    import qsa_pallas

    devs = jax.devices()
    if len(devs) < 2:
        pytest.skip(f"needs 2 host devices, have {len(devs)}")
    q = jax.device_put(jnp.zeros((2, 6, 32), jnp.float16), devs[0])
    k = jax.device_put(jnp.zeros((9, 1, 32), jnp.float16), devs[1])
    cu_q = jax.device_put(jnp.array([0, 1, 2], jnp.int32), devs[0])
    cu_k = jax.device_put(jnp.array([0, 4, 9], jnp.int32), devs[0])
    assert spec_of(k).index == devs[1].id and spec_of(k).where == "cpu"
    with pytest.raises(ContractError, match=r"'k'.*q's device \(cpu:0\).*cpu:1"):
        qsa_pallas.sparse_decode(q, k, k, cu_q, cu_k, 9)
    # uncommitted arrays follow the committed ones (jax moves them): no ordinal, no error
    free = [jnp.zeros((2, 6, 32), jnp.float16), jnp.array([0, 1, 2], jnp.int32),
            jnp.array([0, 4, 9], jnp.int32)]
    assert spec_of(free[0]).index is None and spec_of(torch.zeros(3)).index is None
    out = qsa_pallas.sparse_decode(free[0], k, k, free[1], free[2], 9)
    assert out.devices() == {devs[1]} and not np.asarray(out).any()


# --------------------------------------------------------------------------------------------
# Debug validators.
def test_validate_decode_metadata():
    validate_decode_metadata(np.arange(4), np.array([0, 3, 3, 9]), capacity=9, max_seqlen_k=6, batch=3)
    bad = [
        (dict(cu_seqlens_q=np.arange(4) + 1, cu_seqlens_k=np.array([0, 3, 3, 9])), "cu_seqlens_q"),
        (dict(cu_seqlens_q=np.arange(4), cu_seqlens_k=np.array([0, 3, 2, 9])), "cu_seqlens_k"),
        (dict(cu_seqlens_q=np.arange(4), cu_seqlens_k=np.array([0, 3, 3, 10])), "cu_seqlens_k"),
    ]
    for kw, arg in bad:
        with pytest.raises(ContractError) as info:
            validate_decode_metadata(capacity=9, max_seqlen_k=7, **kw)
        assert info.value.arg == arg
    with pytest.raises(ContractError, match="max_seqlen_k=5"):  # row of 6 keys > max 5
        validate_decode_metadata(np.arange(4), np.array([0, 3, 3, 9]), capacity=9, max_seqlen_k=5)
    with pytest.raises(ContractError) as info:  # query row 3 out of a batch of 3
        validate_decode_metadata(np.array([0, 1, 3, 3]), np.array([0, 3, 3, 9]), capacity=9,
                                 max_seqlen_k=9, batch=3)
    assert info.value.arg == "cu_seqlens_q"
    # torch inputs are read too
    validate_decode_metadata(torch.arange(4, dtype=torch.int32), torch.tensor([0, 1, 2, 3]), 3, 1)
    # lengths: cu_seqlens_q as long as cu_seqlens_k, both B + 1 long
    for kw, arg in ((dict(cu_seqlens_q=np.arange(3), batch=None), "cu_seqlens_q"),
                    (dict(cu_seqlens_q=np.arange(4), batch=4), "cu_seqlens_k")):
        with pytest.raises(ContractError) as info:
            validate_decode_metadata(cu_seqlens_k=np.array([0, 3, 3, 9]), capacity=9,
                                     max_seqlen_k=9, **kw)
        assert info.value.arg == arg
    with pytest.raises(ContractError, match="query rows < 3"):  # B inferred from cu_seqlens_k
        validate_decode_metadata(np.array([0, 1, 3, 3]), np.array([0, 3, 3, 9]), 9, 9)


def test_validators_refuse_misuse_of_their_own_arguments():
    """The entry points' argument order (q, k, v, ...) passed to a validator, a float array, a
    tensor where a host int belongs and an unknown prefill kind are refused by name, never
    truncated or reported under an invented entry point."""
    cq, ck = np.arange(4), np.array([0, 3, 3, 9])
    with pytest.raises(TypeError):  # batch and fn are keyword-only
        validate_decode_metadata(cq, ck, 9, 9, 3)
    for kw, arg in ((dict(cu_seqlens_k=ck.astype(np.float32)), "cu_seqlens_k"),
                    (dict(capacity=torch.tensor(9)), "capacity"),
                    (dict(max_seqlen_k=9.0), "max_seqlen_k")):
        args = dict(cu_seqlens_q=cq, cu_seqlens_k=ck, capacity=9, max_seqlen_k=9) | kw
        with pytest.raises(ContractError) as info:
            validate_decode_metadata(**args)
        assert info.value.arg == arg and info.value.fn == "sparse_decode", str(info.value)
    idx = np.array([[0, -1], [1, 0]])
    with pytest.raises(ContractError) as info:
        validate_prefill_metadata(idx, np.array([0, 2]), None, "bogus")
    assert info.value.arg == "kind" and "'ordinary', 'chunk', 'paged'" in str(info.value)
    with pytest.raises(ContractError) as info:
        validate_prefill_metadata(idx.astype(np.float64), np.array([0, 2]), None, "ordinary")
    assert info.value.arg == "indices" and info.value.fn == "sparse_prefill"


def test_validators_refuse_wrong_ranks_lengths_and_dtypes_by_name():
    """A break trial's list: a torch bf16 array, wrong ranks, lengths that disagree, values past
    int32, an empty batch, arguments that would be ignored; each is a ContractError naming the
    argument, never an IndexError / TypeError from numpy or a silent pass."""
    from interop.contract import (validate_decode_paged_metadata,
                                  validate_indexer_decode_metadata,
                                  validate_indexer_prefill_metadata)

    i32 = lambda *v: np.array(v, np.int32)  # noqa: E731
    idx = np.array([[0, -1], [1, 0], [0, -1]], np.int32)
    rt = np.arange(16, dtype=np.int32).reshape(2, 8)
    calls = [
        (lambda: validate_decode_metadata(i32(0, 1, 2), torch.tensor([0, 3, 5]).bfloat16(), 5, 3),
         "cu_seqlens_k"),
        (lambda: validate_decode_metadata(i32(0, 1, 2), i32(0, 3), 5, 3, batch=2), "cu_seqlens_k"),
        (lambda: validate_decode_metadata(i32(), i32(), 5, 3), "cu_seqlens_k"),
        (lambda: validate_decode_metadata(i32(0, 1), i32(0, 1), 5, 3, batch=True), "batch"),
        (lambda: validate_decode_metadata(i32(0, 1), i32(0, 1), 5, 0), "max_seqlen_k"),
        (lambda: validate_decode_metadata(i32(0, 1), np.array([0, 2**31]), 5, 3),
         "cu_seqlens_k"),
        (lambda: validate_prefill_metadata(np.int32(0), i32(0, 2, 3), None, "ordinary"),
         "indices"),
        (lambda: validate_prefill_metadata(idx.reshape(-1), i32(0, 2, 3), None, "ordinary"),
         "indices"),
        (lambda: validate_prefill_metadata(idx, i32(0, 2, 3), i32(1, 1), "ordinary"), "kv_lens"),
        (lambda: validate_prefill_metadata(idx, i32(0, 2, 3), None, "chunk"), "kv_lens"),
        (lambda: validate_prefill_metadata(idx, i32(0, 2, 3), i32(4, 3), "paged",
                                           req_to_token=rt, req_indices=i32(1)), "req_indices"),
        (lambda: validate_prefill_metadata(idx, i32(0, 2, 3), i32(4, 3), "paged",
                                           req_to_token=rt[:, :, None], req_indices=i32(1, 0)),
         "req_to_token"),
        (lambda: validate_prefill_metadata(idx, i32(0, 2, 3), i32(4, 3), "paged",
                                           req_indices=i32(1, 0)), "req_to_token"),
        (lambda: validate_decode_paged_metadata(rt, i32(0), idx, i32(1, 1, 1), 64),
         "req_indices"),
        (lambda: validate_decode_paged_metadata(rt[0], i32(0, 0, 0), idx, i32(1, 1, 1), 64),
         "req_to_token"),
        (lambda: validate_indexer_decode_metadata(rt[0], i32(16, 8), 4, 2), "page_table"),
        (lambda: validate_indexer_decode_metadata(rt, i32(16, 8, 16), 16, 2), "seq_lens"),
        (lambda: validate_indexer_decode_metadata(rt, i32(16, 8), 16, 2, compress_ratio=1),
         "compress_ratio"),
        (lambda: validate_indexer_prefill_metadata(i32(0), i32(1, 3, 5), 5), "row_ends"),
        (lambda: validate_indexer_prefill_metadata(i32(0), i32(9), 5), "row_ends"),
    ]
    for i, (call, arg) in enumerate(calls):
        with pytest.raises(ContractError) as info:
            call()
        assert info.value.arg == arg, (i, str(info.value))
    with pytest.raises(ContractError, match="^None: argument"):  # fn=None still an error
        validate_decode_metadata(i32(0, 1), i32(0, 9), 5, 3, fn=None)


def test_dtype_mismatch_names_the_tensor_it_must_match():
    """k in another dtype than q is named against q's dtype (the FP8 alternative listed where
    the variant takes it), v against k's."""
    q = torch.zeros(2, 12, 256, dtype=torch.float16)
    k = torch.zeros(9, 1, 256)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    with pytest.raises(ContractError, match=r"argument 'k': expected q's dtype \(float16\); "
                       r"got float32"):
        check_decode(q, k, k, cu, cu, 9)
    kv = torch.zeros(9, 1, 256, dtype=torch.float16)
    with pytest.raises(ContractError, match=r"argument 'v': expected k's dtype \(float16\)"):
        check_decode(q, kv, k, cu, cu, 9)
    with pytest.raises(ContractError, match=r"q's dtype \(float16\) or float8_e4m3fn"):
        check_prefill_chunk(torch.zeros(2, 12, 256, dtype=torch.float16), k, k,
                            torch.zeros(2, 8, dtype=torch.int32), cu, cu, cu[1:], 1)


def test_validate_prefill_metadata():
    cu = np.array([0, 3, 5])
    idx = np.array([[0, -1, -1], [1, 0, -1], [2, 1, 0], [0, 9, -1], [1, 0, 44]])
    out = validate_prefill_metadata(idx, cu, None, "ordinary")
    assert out == {"rows": 5, "valid": 9, "duplicates": 0}
    # chunk: bound = kv_lens, visible = r + kv - q + 1
    validate_prefill_metadata(idx, cu, np.array([3, 10]), "chunk")
    with pytest.raises(ContractError, match="after padding"):
        validate_prefill_metadata(np.array([[-1, 0, -1]] + [[0, -1, -1]] * 2), np.array([0, 3]),
                                  None, "ordinary")
    with pytest.raises(ContractError, match="visible"):  # row 0 may see 1 token, has 2
        validate_prefill_metadata(np.array([[0, 1, -1], [0, -1, -1]]), np.array([0, 2]), None,
                                  "ordinary")
    with pytest.raises(ContractError) as info:
        validate_prefill_metadata(idx, cu, np.array([2, 10]), "chunk")
    assert info.value.arg == "kv_lens" and info.value.fn == "sparse_prefill_chunk"
    with pytest.raises(ContractError) as info:
        validate_prefill_metadata(idx, np.array([0, 3, 2]), None, "ordinary")
    assert info.value.arg == "cu_seqlens_q"
    # cu_seqlens_q past the T rows of indices; one length per request; kv_lens within the
    # request's cu_seqlens_k rows (chunk)
    with pytest.raises(ContractError, match="T = 5") as info:
        validate_prefill_metadata(idx, np.array([0, 3, 7]), None, "ordinary")
    assert info.value.arg == "cu_seqlens_q"
    with pytest.raises(ContractError) as info:
        validate_prefill_metadata(idx, cu, np.array([10]), "chunk")
    assert info.value.arg == "kv_lens"
    validate_prefill_metadata(idx, cu, np.array([3, 10]), "chunk", cu_seqlens_k=np.array([0, 3, 13]))
    for ck, arg in ((np.array([0, 3, 12]), "kv_lens"), (np.array([0, 3]), "cu_seqlens_k"),
                    (np.array([0, 13, 3]), "cu_seqlens_k")):
        with pytest.raises(ContractError) as info:
            validate_prefill_metadata(idx, cu, np.array([3, 10]), "chunk", cu_seqlens_k=ck)
        assert info.value.arg == arg
    validate_prefill_metadata(np.vstack([idx, [[-1, -1, -1]]]), cu, None, "ordinary")  # T padded
    dup = validate_prefill_metadata(np.array([[0, 0, -1]]), np.array([0, 1]), np.array([2]),
                                    "chunk", flag_duplicates=True)
    assert dup["duplicates"] == 1
    # paged: the request's row of req_to_token, its columns and the pool range
    rt = np.array([[1, 2, 3], [5, 6, 7]])
    paged = lambda **kw: validate_prefill_metadata(idx[:3], np.array([0, 3]), np.array([3]),  # noqa: E731
                                                   "paged", **kw)
    paged(req_to_token=rt, req_indices=np.array([1]), pool_slots=8)
    for kw, arg in ((dict(req_to_token=rt, req_indices=np.array([1]), pool_slots=7), "req_to_token"),
                    (dict(req_to_token=rt[:, :2], req_indices=np.array([1])), "req_to_token"),
                    (dict(req_to_token=rt, req_indices=np.array([2])), "req_indices")):
        with pytest.raises(ContractError) as info:
            paged(**kw)
        assert info.value.arg == arg


@pytest.mark.parametrize("op", ["prefill", "chunk", "paged"])
def test_prefill_max_seqlen_q_hint_is_capped_at_t(op):
    """max_seqlen_q is a grid-size hint: the checked problem carries min(hint, T), so both
    backends plan (and Triton launches) with the same value whatever a huge hint says."""
    assert run(op, {"max_seqlen_q": 10**9}, "jax").max_seqlen_q == 8  # base(): T = 8
    assert run(op, {"max_seqlen_q": 3}, "torch").max_seqlen_q == 3
