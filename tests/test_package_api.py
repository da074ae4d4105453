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
