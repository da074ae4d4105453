"""interop.dlpack: zero-copy round trips (same data pointer) for bf16/fp16/fp32/int32, zero-size
and transposed tensors, strided views refused with a clear message (copied on request), fp8
bit-exact. GPU variants (stream ordering) are marked ``gpu``."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jnp = jax.numpy

from interop.dlpack import DLPackLayoutError, is_compact, to_jax, to_torch  # noqa: E402

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int32]


def jptr(a) -> int:
    return a.unsafe_buffer_pointer()


def _tensor(dtype, shape=(5, 7), device="cpu"):
    if dtype == torch.int32:
        return torch.arange(int(np.prod(shape)), dtype=dtype, device=device).reshape(shape)
    return torch.randn(shape, device=device).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_zero_copy(dtype):
    t = _tensor(dtype)
    a = to_jax(t)
    assert str(a.dtype) == str(dtype).removeprefix("torch.")
    assert jptr(a) == t.data_ptr()
    back = to_torch(a)
    assert back.dtype == dtype and back.data_ptr() == t.data_ptr()
    assert torch.equal(back, t)
    # jax -> torch -> jax keeps the pointer too
    a2 = jnp.arange(12, dtype=jnp.int32).reshape(3, 4) if dtype == torch.int32 else \
        jnp.ones((3, 4), str(dtype).removeprefix("torch."))
    t2 = to_torch(a2)
    assert t2.data_ptr() == jptr(a2) and jptr(to_jax(t2)) == jptr(a2)


def test_zero_size():
    t = torch.empty((0, 3, 8), dtype=torch.bfloat16)
    a = to_jax(t)
    assert a.shape == (0, 3, 8) and a.dtype == jnp.bfloat16
    assert to_torch(a).shape == (0, 3, 8)
    assert to_torch(jnp.zeros((4, 0), jnp.int32)).shape == (4, 0)


def test_transposed_is_shared():
    t = _tensor(torch.float32, (6, 4)).T  # dense, transposed strides
    assert not t.is_contiguous() and is_compact(t.shape, t.stride())
    a = to_jax(t)
    assert a.shape == (4, 6) and jptr(a) == t.data_ptr()
    np.testing.assert_array_equal(np.asarray(a), t.numpy())
    p = _tensor(torch.float16, (2, 3, 4)).permute(2, 0, 1)
    np.testing.assert_array_equal(np.asarray(to_jax(p)).astype(np.float32), p.float().numpy())


@pytest.mark.parametrize("make", [lambda t: t[:, ::2], lambda t: t[1:, :3],
                                  lambda t: t[:1].expand(5, 8)],
                         ids=["step", "slice-gap", "broadcast"])
def test_strided_view_refused_unless_copy(make):
    view = make(_tensor(torch.float32, (5, 8)))
    assert not is_compact(view.shape, view.stride())
    with pytest.raises(DLPackLayoutError) as info:
        to_jax(view)
    msg = str(info.value)
    assert "to_jax" in msg and "'tensor'" in msg and "strides" in msg and "copy=True" in msg
    assert isinstance(info.value, ValueError)
    a = to_jax(view, copy=True)
    np.testing.assert_array_equal(np.asarray(a), view.numpy())


@pytest.mark.parametrize("dtype,narrow", [(torch.int64, "int32"), (torch.uint64, "uint32"),
                                          (torch.float64, "float32")], ids=str)
def test_64_bit_refused_without_x64(dtype, narrow):
    """jax would narrow them silently (1e300 became inf, 2**40 became 0), and copy."""
    with pytest.raises(DLPackLayoutError, match=f"narrowed to {narrow}"):
        to_jax(torch.ones(4, dtype=dtype))


@pytest.mark.parametrize("make", [lambda: torch._neg_view(torch.ones(3)),
                                  lambda: torch.ones(3, dtype=torch.complex64).conj()],
                         ids=["neg", "conj"])
def test_lazy_sign_or_conjugate_bit_refused_unless_copy(make):
    """DLPack carries the buffer, not torch's lazy bit: -1 used to arrive as +1."""
    with pytest.raises(DLPackLayoutError, match="lazy sign or conjugate bit"):
        to_jax(make())
    np.testing.assert_array_equal(np.asarray(to_jax(make(), copy=True)),
                                  make().resolve_neg().resolve_conj().numpy())


def test_sparse_meta_and_traced_refused():
    for t in (torch.ones(3).to_sparse(), torch.empty(3, device="meta")):
        with pytest.raises(DLPackLayoutError, match="dense"):
            to_jax(t)
    with pytest.raises(DLPackLayoutError, match="concrete jax.Array"):
        jax.jit(to_torch)(jnp.ones(3))


@pytest.mark.parametrize("copy", [False, True])
def test_requires_grad_refused_naming_detach(copy):
    """Not torch's bare BufferError: the same kind of error as every other refusal here."""
    with pytest.raises(DLPackLayoutError, match=r"requires_grad=True\. Pass tensor\.detach\(\)"):
        to_jax(torch.zeros(3, requires_grad=True), copy=copy)
    assert to_jax(torch.ones(3, requires_grad=True).detach()).tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("via_uint8", [None, True])
def test_fp8_bit_exact(via_uint8):
    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(16, 16)
    t = bits.view(torch.float8_e4m3fn)
    a = to_jax(t, fp8_via_uint8=via_uint8)
    assert a.dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8)),
                                  bits.numpy())
    back = to_torch(a, fp8_via_uint8=via_uint8)
    assert back.dtype == torch.float8_e4m3fn
    assert torch.equal(back.view(torch.uint8), bits)


def test_copy_true_is_a_copy():
    t = _tensor(torch.float32)
    a = to_jax(t, copy=True)
    assert jptr(a) != t.data_ptr()
    b = to_torch(jnp.ones(3), copy=True)
    assert b.tolist() == [1.0, 1.0, 1.0]


def test_type_errors():
    with pytest.raises(TypeError):
        to_jax(np.zeros(3))
    with pytest.raises(TypeError):
        to_torch(np.zeros(3))


def test_is_compact_cases():
    assert is_compact((3, 4), (4, 1)) and is_compact((3, 4), (1, 3))
    assert is_compact((1, 4), (99, 1)) and is_compact((0, 4), (7, 3))
    assert not is_compact((3, 4), (8, 1)) and not is_compact((3, 4), (0, 1))


@pytest.mark.gpu
def test_gpu_zero_copy_and_stream_order():
    """On a GPU: pointers kept, and a tensor written on a side stream is seen complete by jax
    when exported while that stream is current."""
    assert torch.cuda.is_available()
    for dtype in DTYPES:
        t = _tensor(dtype, (64, 256), "cuda")
        a = to_jax(t)
        assert jptr(a) == t.data_ptr()
        assert to_torch(a).data_ptr() == t.data_ptr()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        big = torch.empty((4096, 4096), device="cuda")
        for _ in range(20):
            big.fill_(3.0)
            big.mul_(1.0)
        a = to_jax(big)
    assert float(jnp.min(a)) == 3.0 and float(jnp.max(a)) == 3.0
    s2 = torch.cuda.Stream()
    with torch.cuda.stream(s2):
        other = torch.full((4096, 4096), 5.0, device="cuda")
        for _ in range(20):
            other.mul_(1.0)
    b = to_jax(other, stream=s2)  # export named explicitly, from the default stream
    assert float(jnp.min(b)) == 5.0
    out = to_torch(jnp.full((2048, 2048), 7.0, jnp.float32) * 2)
    assert out.device.type == "cuda" and float(out.min()) == 14.0
    f8 = torch.randn(128, 256, device="cuda").to(torch.float8_e4m3fn)
    assert torch.equal(to_torch(to_jax(f8)).view(torch.uint8), f8.view(torch.uint8))
