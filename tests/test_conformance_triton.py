"""``qsa_triton`` against the conformance base (``tests/conformance.py``): PyTorch tensors on the
GPU when there is one, else on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``, set by
``tests/conftest.py`` before ``qsa_triton`` is imported)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import qsa_triton  # noqa: E402
from tests.conformance import Conformance  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class TestTritonConformance(Conformance):
    name = "qsa_triton"

    def module(self):
        return qsa_triton

    def array(self, x, dtype):
        return torch.from_numpy(np.ascontiguousarray(x)).to(DEVICE).to(getattr(torch, dtype))

    def to_numpy(self, x):
        x = x.detach()
        return (x.double() if x.is_floating_point() else x.long()).cpu().numpy()

    def dtype_name(self, x):
        return str(x.dtype).removeprefix("torch.")

    def requiring_grad(self, x):
        return x.detach().clone().requires_grad_(True)
