"""QSA sparse attention as Triton kernels for PyTorch callers.

Never imports jax. Every entry point runs ``interop.contract`` checks before any launch.
"""

from interop.contract import ContractError  # noqa: F401

__all__ = ["ContractError"]
