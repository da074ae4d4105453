"""Both packages' ``__all__`` (what ``from qsa_triton import *`` and API docs list) name every
public entry point the package imports, and the same ones in both, apart from the documented
framework-only extras (``qsa_triton.flash_attn_varlen_func``; ``qsa_pallas.replicate_kv_heads``
and ``shard_step``, the JAX tensor-parallel helpers). Import-only, no kernel runs."""

from __future__ import annotations

import inspect

import pytest

ONLY = {"qsa_triton": {"flash_attn_varlen_func"},
        "qsa_pallas": {"replicate_kv_heads", "shard_step"}}


def _public(mod):
    return {n for n, v in vars(mod).items()
            if not n.startswith("_") and (inspect.isfunction(v) or inspect.isclass(v))}


@pytest.mark.parametrize("pkg", ["qsa_triton", "qsa_pallas"])
def test_all_lists_every_public_entry_point(pkg):
    mod = pytest.importorskip(pkg)
    assert set(mod.__all__) == _public(mod)
    assert all(hasattr(mod, n) for n in mod.__all__)


def test_both_packages_export_the_same_names():
    t = pytest.importorskip("qsa_triton")
    p = pytest.importorskip("qsa_pallas")
    assert set(t.__all__) - ONLY["qsa_triton"] == set(p.__all__) - ONLY["qsa_pallas"]


#: qsa_pallas entry points whose float inputs can carry a tangent (the rest take int arrays or
#: are wrappers of these: ``shard_step``, ``replicate_kv_heads``)
_DIFFERENTIABLE = ["sparse_decode", "sparse_decode_paged", "sparse_prefill", "sparse_prefill_chunk",
                   "sparse_prefill_paged", "indexer_topk_decode", "indexer_select_decode",
                   "indexer_topk_prefill", "indexer_select_prefill", "qsa_decode_step",
                   "qsa_prefill_step"]


@pytest.mark.parametrize("name", _DIFFERENTIABLE)
def test_pallas_differentiation_is_refused_with_a_contract_error(name):
    """Forward-only in JAX too: ``jax.jvp`` / ``jax.grad`` through an entry point raise a
    ContractError naming the argument with a tangent (Pallas' own jvp rule used to fail with a
    bare AssertionError). The refusal comes at trace time: no kernel runs."""
    jax = pytest.importorskip("jax")
    qp = pytest.importorskip("qsa_pallas")
    fn = getattr(qp, name)
    required = [p for p in inspect.signature(fn).parameters.values()
                if p.default is inspect.Parameter.empty and p.kind == p.POSITIONAL_OR_KEYWORD]
    assert required[0].name == "q"
    rest = [jax.numpy.zeros((1,), jax.numpy.int32) for _ in required[1:]]
    q = jax.numpy.zeros((2, 4, 8), jax.numpy.bfloat16)
    with pytest.raises(qp.ContractError, match="forward-only") as info:
        jax.jvp(lambda x: fn(x, *rest), (q,), (q,))
    assert info.value.arg == "q"
    with pytest.raises(qp.ContractError, match="forward-only"):
        jax.grad(lambda x: fn(q, x, *rest[1:])[0].astype(float).sum())(
            jax.numpy.zeros((4, 1, 8), jax.numpy.float32))
