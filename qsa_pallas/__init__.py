"""QSA sparse attention as Pallas (Triton lowering) kernels for JAX callers.

Forward-only: ``jax.grad`` / ``jax.jvp`` through an entry point raise ``ContractError``
(``_compat.forward_only``). Never imports torch. Every entry point runs ``interop.contract``
checks before any launch.
"""

from interop.contract import ContractError  # noqa: F401

from .decode import sparse_decode  # noqa: F401
from .decode_paged import sparse_decode_paged  # noqa: F401
from .prefill import sparse_prefill, sparse_prefill_chunk, sparse_prefill_paged  # noqa: F401
from .indexer import (expand_block_indices, indexer_select_decode, indexer_select_prefill,  # noqa: F401,E501
                       indexer_topk_decode, indexer_topk_prefill)
from .step import (prefill_step_rows, qsa_decode_step, qsa_prefill_step,  # noqa: F401
                   replicate_kv_heads, shard_step)

__all__ = ["ContractError", "sparse_decode", "sparse_prefill", "sparse_prefill_chunk",
           "sparse_prefill_paged", "sparse_decode_paged", "qsa_decode_step", "qsa_prefill_step",
           "prefill_step_rows", "indexer_topk_decode", "indexer_topk_prefill",
           "indexer_select_decode", "indexer_select_prefill", "expand_block_indices",
           "replicate_kv_heads", "shard_step"]
