"""``qsa_pallas`` against the conformance base (``tests/conformance.py``): JAX arrays on the
default device; on a machine without a GPU the kernels run with ``interpret=True`` (jax's
``JAX_PLATFORMS=cpu`` is set by ``tests/conftest.py``). Never imports torch."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

import qsa_pallas  # noqa: E402
from tests.conformance import Conformance  # noqa: E402

ON_GPU = jax.default_backend() == "gpu"


class TestPallasConformance(Conformance):
    name = "qsa_pallas"
    call_kwargs = {} if ON_GPU else {"interpret": True}

    def module(self):
        return qsa_pallas

    def array(self, x, dtype):
        return jnp.asarray(np.ascontiguousarray(x)).astype(jnp.dtype(dtype))

    def to_numpy(self, x):
        a = np.asarray(x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x)
        return a.astype(np.float64 if a.dtype.kind == "f" else np.int64)

    def dtype_name(self, x):
        return str(x.dtype)
