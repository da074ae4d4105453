"""Framework-free core of qsa: the shared contract, device facts, launch geometry, FP64
references, index helpers, and (lazily importing both frameworks) the DLPack bridge, the
cross-checker and the ``qsa`` command."""

from .contract import ContractError, TensorSpec, spec_of  # noqa: F401

__all__ = ["ContractError", "TensorSpec", "spec_of"]
