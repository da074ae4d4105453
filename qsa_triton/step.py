"""The end-to-end QSA attention step for PyTorch: indexer -> expansion -> sparse attention from
the pool (``qsa-contract.md`` §4b, §4, §2b, §3), composed of this package's entry points.

* decode: ``indexer_select_decode`` (score, exact top-k, fused expansion to the 2051-wide token
  row), then ``sparse_decode_paged`` through ``req_to_token``;
* prefill: ``prefill_step_rows`` (each row's indexer metadata, on the device),
  ``indexer_select_prefill``, then ``sparse_prefill_paged``.

Both halves are checked before the first launch (``check_decode_step`` / ``check_prefill_step``).
CUDA-graph and ``torch.compile(fullgraph=True)`` safe (no host read of device data; the halves
are ``torch.ops.qsa`` custom ops). Tensor parallel: a rank passes its own query heads, their KV
heads (``r // (TP / Hkv)`` at TP > Hkv) and every indexer input whole (``interop.validate.tp``).
Sources: upstream sglang 0.5.23 ``srt/layers/attention/qsa/`` (``qsa_indexer.py`` metadata,
``mqa.py`` scoring, ``kernel.py`` expansion).
"""

from __future__ import annotations

import torch

from interop.contract import (DECODE_STEP_DOC, PREFILL_STEP_DOC, ContractError, check_decode_step,
                              check_prefill_step, check_prefill_step_rows)

from ._interp_guard import check_device, check_interpreter_dtype, check_torch_tensors, interpreting
from .decode_paged import _exact_contract_device, sparse_decode_paged
from .indexer import _default_plan, indexer_select_decode, indexer_select_prefill
from .prefill import sparse_prefill_paged

__all__ = ["qsa_decode_step", "qsa_prefill_step", "prefill_step_rows"]

_DECODE_NAMES = ("q", "k_cache", "v_cache", "req_to_token", "req_indices", "index_q",
                 "index_k_cache", "index_page_table", "seq_lens")
_PREFILL_NAMES = ("q", "k_cache", "v_cache", "req_to_token", "req_indices", "index_q", "index_k",
                  "index_cu_seqlens_k", "cu_seqlens_q", "kv_lens")


def _backend_checks(fn: str, q: torch.Tensor, attention, indexer) -> None:
    check_interpreter_dtype(fn, attention.dtype)
    check_interpreter_dtype(fn, indexer.compute_dtype, indexer.dtype, arg="index_q")
    check_device(fn, q.device.type)
    if q.device.type != "cuda" and not interpreting():
        raise ContractError(fn, "q", "a CUDA tensor (CPU tensors run only under Triton's "
                            "interpreter, TRITON_INTERPRET=1)", str(q.device))


def qsa_decode_step(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    req_to_token: torch.Tensor, req_indices: torch.Tensor, index_q: torch.Tensor,
                    index_k_cache: torch.Tensor, index_page_table: torch.Tensor,
                    seq_lens: torch.Tensor, softmax_scale: float | None = None,
                    k_scale: float = 1.0, v_scale: float = 1.0, *, topk: int = 512,
                    compress_ratio: int = 4, batch_invariant: bool = False,
                    strict: bool = False) -> torch.Tensor:
    """One QSA decode attention step: indexer (score + exact top-k) -> expansion -> paged decode.

    STEP_DOC

    Raises:
      ContractError: before any launch (``interop.contract.check_decode_step``, naming the
        step's argument); non-torch arguments; bf16 under an unpatched Triton interpreter; CPU
        tensors without the interpreter.
    """
    fn = "qsa_decode_step"
    args = (q, k_cache, v_cache, req_to_token, req_indices, index_q, index_k_cache,
            index_page_table, seq_lens)
    if not torch.compiler.is_compiling():
        check_torch_tensors(fn, **dict(zip(_DECODE_NAMES, args)))
        ap, ip = check_decode_step(
            *args, softmax_scale, k_scale, v_scale, topk=topk, compress_ratio=compress_ratio,
            batch_invariant=batch_invariant, strict=strict,
            attention_strict=_exact_contract_device(q.device.type, q.device.index), fn=fn,
            indexer_plan=lambda p: _default_plan(p, q.device))
        _backend_checks(fn, q, ap, ip)
    indices = indexer_select_decode(index_q, index_k_cache, index_page_table, seq_lens, topk=topk,
                                    compress_ratio=compress_ratio, strict=strict)
    return sparse_decode_paged(q, k_cache, v_cache, req_to_token, req_indices, indices, seq_lens,
                               softmax_scale, k_scale, v_scale, batch_invariant=batch_invariant,
                               strict=strict)


def prefill_step_rows(cu_seqlens_q: torch.Tensor, kv_lens: torch.Tensor,
                      index_cu_seqlens_k: torch.Tensor, total_rows: int, *,
                      compress_ratio: int = 4):
    """Each prefill row's indexer metadata from the request tables, on their device (no host
    read), by ``interop.indices.prefill_step_rows``'s rule: row t of request b sits at position
    ``p = kv_lens[b] - q_len_b + (t - cu_seqlens_q[b])``, scores the first
    ``floor((p + 1) / ratio)`` of the request's compressed keys ``index_cu_seqlens_k[b] ..``
    and has bound ``kv_lens[b]``; rows outside every request: empty range, position -1, bound 0.

    int32 ``cu_seqlens_q`` [B + 1], ``kv_lens`` [B], ``index_cu_seqlens_k`` [B + 1]; host ints
    ``total_rows`` (T), ``compress_ratio``. Returns ``(row_starts, row_ends, positions,
    seq_lens)``, int32 [T] each: ``indexer_select_prefill``'s arguments. Raises ContractError
    (``interop.contract.check_prefill_step_rows``) before anything runs.
    """
    if not torch.compiler.is_compiling():  # as the entry points: checked where eager
        check_prefill_step_rows(cu_seqlens_q, kv_lens, index_cu_seqlens_k, total_rows,
                                compress_ratio)
    return _step_rows(cu_seqlens_q, kv_lens, index_cu_seqlens_k, total_rows, compress_ratio)


def _step_rows(cu_seqlens_q, kv_lens, index_cu_seqlens_k, total_rows, compress_ratio):
    """``prefill_step_rows`` on checked arguments (``qsa_prefill_step`` checked them already)."""
    ratio = int(compress_ratio)
    cu = cu_seqlens_q.long()
    kl = kv_lens.long()
    ck = index_cu_seqlens_k.long()
    b = kl.shape[0]
    rows = torch.arange(int(total_rows), device=cu.device, dtype=torch.long)
    req = torch.searchsorted(cu[1:].contiguous(), rows, right=True)
    inside = (req < b) & (rows >= cu[0])
    rq = req.clamp(max=b - 1)
    pos = kl[rq] - (cu[rq + 1] - cu[rq]) + rows - cu[rq]
    start = ck[rq]
    end = start + torch.minimum(torch.div((pos + 1).clamp(min=0), ratio, rounding_mode="floor"),
                                (ck[rq + 1] - start).clamp(min=0))
    zero = torch.zeros_like(rows)
    i32 = torch.int32
    return (torch.where(inside, start, zero).to(i32), torch.where(inside, end, zero).to(i32),
            torch.where(inside, pos, zero - 1).to(i32), torch.where(inside, kl[rq], zero).to(i32))


def qsa_prefill_step(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     req_to_token: torch.Tensor, req_indices: torch.Tensor, index_q: torch.Tensor,
                     index_k: torch.Tensor, index_cu_seqlens_k: torch.Tensor,
                     cu_seqlens_q: torch.Tensor, kv_lens: torch.Tensor, max_seqlen_q: int,
                     softmax_scale: float | None = None, k_scale: float = 1.0,
                     v_scale: float = 1.0, *, topk: int = 512, compress_ratio: int = 4,
                     strict: bool = False) -> torch.Tensor:
    """One QSA prefill attention step: row metadata -> indexer over packed compressed keys ->
    expansion -> paged sparse prefill from the pool.

    STEP_DOC

    Raises:
      ContractError: before any launch (``interop.contract.check_prefill_step``); as
        ``qsa_decode_step`` otherwise.
    """
    fn = "qsa_prefill_step"
    args = (q, k_cache, v_cache, req_to_token, req_indices, index_q, index_k, index_cu_seqlens_k,
            cu_seqlens_q, kv_lens)
    if not torch.compiler.is_compiling():
        check_torch_tensors(fn, **dict(zip(_PREFILL_NAMES, args)))
        ap, ip = check_prefill_step(*args, max_seqlen_q, softmax_scale, k_scale, v_scale,
                                    topk=topk, compress_ratio=compress_ratio, strict=strict, fn=fn,
                                    indexer_plan=lambda p: _default_plan(p, q.device))
        _backend_checks(fn, q, ap, ip)
    rs, re, pos, bound = _step_rows(cu_seqlens_q, kv_lens, index_cu_seqlens_k, q.shape[0],
                                    compress_ratio)
    indices = indexer_select_prefill(index_q, index_k, rs, re, pos, bound, topk=topk,
                                     compress_ratio=compress_ratio, strict=strict)
    return sparse_prefill_paged(q, k_cache, v_cache, req_to_token, req_indices, indices,
                                cu_seqlens_q, kv_lens, max_seqlen_q, softmax_scale, k_scale,
                                v_scale, strict=strict)


qsa_decode_step.__doc__ = qsa_decode_step.__doc__.replace("STEP_DOC", DECODE_STEP_DOC)
qsa_prefill_step.__doc__ = qsa_prefill_step.__doc__.replace("STEP_DOC", PREFILL_STEP_DOC)
