"""Framework-free core of qsa (numpy only at import time): the shared contract, device facts,
launch plans and geometry, FP64 references, index helpers, the table of named shapes and the
DLPack bridge. The tooling above both backends (``qsa`` command, cross-checker, compile checks,
capture/replay, upstream peer loader) lives in ``interop.validate``; the core never imports it."""

from .contract import ContractError, TensorSpec, spec_of  # noqa: F401

__all__ = ["ContractError", "TensorSpec", "spec_of"]
