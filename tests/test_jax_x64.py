"""``qsa_pallas`` under ``jax_enable_x64``: a JAX model that enables 64-bit types gets the same
output bits from every Pallas entry point as without it (the kernels' index arithmetic, sums and
prefix sums stay int32; a bare ``:`` or an integer ``jnp.sum`` would otherwise turn int64 and
fail to trace). The JAX examples (decode, the end-to-end step) run under x64 in
``test_examples.py``."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import qsa_pallas  # noqa: E402
from interop import geometry  # noqa: E402
from interop import indices as I  # noqa: E402

QL, KL = [9, 7], [40, 30]


def _prefill_calls():
    rng = np.random.default_rng(0)
    t, hq, d = sum(QL), 12, 64
    q = rng.standard_normal((t, hq, d)).astype(np.float16)
    k = rng.standard_normal((sum(KL), 1, d)).astype(np.float16)
    v = rng.standard_normal((sum(KL), 1, d)).astype(np.float16)
    blocks = I.prefill_block_indices(QL, KL, block_width=8, seed=1).astype(np.int32)
    tok = I.expand_prefill_blocks(blocks, QL, KL).astype(np.int32)
    cuq = np.asarray([0, 9, 16], np.int32)
    cuk = np.asarray([0, 40, 70], np.int32)
    kl = np.asarray(KL, np.int32)
    ordinary = np.minimum(tok, 6)  # positions inside each request's own rows
    rs, re, _, pos, sl = I.prefill_row_ranges(QL, KL)
    qi = rng.standard_normal((t, 4, 128)).astype(np.float16)
    ki = rng.standard_normal((int(re.max()), 1, 128)).astype(np.float16)
    return {
        "prefill": lambda: qsa_pallas.sparse_prefill(q, k[:t], v[:t], ordinary, cuq, 9),
        "chunk-tokens": lambda: qsa_pallas.sparse_prefill_chunk(q, k, v, tok, cuq, cuk, kl, 9),
        "chunk-union": lambda: qsa_pallas.sparse_prefill_chunk(q, k, v, None, cuq, cuk, kl, 9,
                                                               block_indices=blocks),
        "indexer-prefill": lambda: qsa_pallas.indexer_select_prefill(qi, ki, rs, re, pos, sl,
                                                                     topk=16),
    }


def test_pallas_entry_points_give_the_same_bits_under_x64(monkeypatch):
    monkeypatch.setitem(geometry.UNION_RULES, "min_rows_per_sm", 0)  # the union kernel here
    calls = _prefill_calls()
    base = {n: np.asarray(f()) for n, f in calls.items()}
    with jax.enable_x64(True):
        assert jnp.arange(2).dtype == jnp.int64
        for n, f in calls.items():
            got = np.asarray(f())
            assert got.dtype == base[n].dtype and np.array_equal(got.view(np.uint8),
                                                                 base[n].view(np.uint8)), n
