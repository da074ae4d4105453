"""The end-to-end QSA attention step for JAX: indexer -> expansion -> sparse attention from the pool.

A composition of this package's public entry points (no kernel of its own), the way a JAX model
runs one QSA attention layer (``qsa-contract.md`` §4b, §4, §2b, §3):

* decode: ``indexer_select_decode`` scores every visible compressed block of the row through the
  compressed-K page table (``sum_h ReLU(index_q[r, h] . k[n])``), keeps the exact top-k (512,
  ties to the smaller block id) and expands them, fused, to the 2051-wide token row (4 tokens per
  block plus the 0-3 token causal tail, valid first); ``sparse_decode_paged`` attends to those
  positions in the KV pool through ``req_to_token``;
* prefill: ``prefill_step_rows`` derives each query row's request, position, bound and
  compressed-key range from the request tables (device arrays, plain ``jnp``);
  ``indexer_select_prefill`` selects and expands over the packed per-request compressed keys;
  ``sparse_prefill_paged`` attends from the pool.

Both steps check every argument of both halves before anything is traced
(``interop.contract.check_decode_step`` / ``check_prefill_step``: the same ``ContractError`` as
``qsa_triton.step``), then run as one jitted function: every length, position, page id and slot
is a traced device array, only shapes, dtypes and the scales are static, so a new batch of
lengths never recompiles and nothing is read back to the host. The step works under
``jax.jit``, inside ``lax.scan`` over layers (per-layer pools and caches as the scan's ``xs``)
and under ``jax.shard_map`` with the query and KV heads split across devices: the indexer
inputs are then replicated and every device runs the (cheap, head-independent) indexer itself,
as upstream's tensor-parallel layers do; shard_map needs its VMA check off around
``pallas_call`` (``_compat.shard_map``).

Sources: upstream sglang 0.5.23 ``srt/layers/attention/qsa/`` (``qsa_indexer.py`` decode/prefill
metadata, ``mqa.py`` scoring, ``kernel.py`` expansion); the algorithms are in the modules named.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from interop.contract import check_decode_step, check_prefill_step

from . import _compat as C
from .decode_paged import _exact_contract_backend, sparse_decode_paged
from .indexer import indexer_select_decode, indexer_select_prefill
from .prefill import sparse_prefill_paged

__all__ = ["qsa_decode_step", "qsa_prefill_step", "prefill_step_rows"]


def qsa_decode_step(q, k_cache, v_cache, req_to_token, req_indices, index_q, index_k_cache,
                    index_page_table, seq_lens, softmax_scale=None, k_scale=1.0, v_scale=1.0, *,
                    topk: int = 512, compress_ratio: int = 4, batch_invariant: bool = False,
                    strict: bool = False, interpret: bool | None = None):
    """One QSA decode attention step: indexer (score + exact top-k) -> expansion -> paged decode.

    ``sparse_decode_paged``'s arguments with its ``indices`` replaced by the indexer's inputs
    (``index_q``, ``index_k_cache``, ``index_page_table``), same order and meaning as
    ``qsa_triton.qsa_decode_step``. Row r is one decode query (MTP verify rows are rows too) of
    request ``req_indices[r]`` with ``seq_lens[r]`` tokens of context, its own token included.

    Args:
      q: [R, Hq, D] bfloat16|float16, the attention query rows.
      k_cache, v_cache: [slots, Hkv, D] the KV pool, q's dtype or float8_e4m3fn (then
        ``k_scale`` multiplies the FP32 scores and ``v_scale`` the P·V result).
      req_to_token: int32 [max_reqs, max_context], token position -> pool slot (SGLang's table).
      req_indices: int32 [R], the table row of each query row's request.
      index_q: [R, H, Di] bfloat16|float16|float8_e4m3fn, the indexer query (H = 4, Di = 128 in
        the model: rotated, weight-free scoring).
      index_k_cache: [pages, P, 1, Di] the paged compressed keys (one per block of
        ``compress_ratio`` tokens: mean of 4 keys, normed, rotated; P = 16 blocks = one 64-token
        KV page), index_q's dtype or float8_e4m3fn.
      index_page_table: int32 [R, max_pages]; block n of row r lives at
        ``index_k_cache[index_page_table[r, n // P], n % P, 0]``; entries past the row's
        ``floor(seq_lens[r] / compress_ratio)`` blocks are never read.
      seq_lens: int32 [R] tokens of context per row (positions ``0 .. seq_lens[r] - 1``; the
        row's own position is ``seq_lens[r] - 1``).
      softmax_scale: host float > 0 (applied to FP32 scores), default D ** -0.5.
      k_scale, v_scale: host floats > 0, 1.0 unless the pool is FP8.
      topk: blocks kept per row (512); compress_ratio: tokens per block (4). The attention then
        reads ``topk * ratio + ratio - 1`` (2051) index columns per row.
      batch_invariant: a row's output bits depend only on its own inputs (``qsa-contract.md``
        §2c; the indexer is row-local anyway).
      strict: the qualified envelopes of both halves; always on for the attention where
        ``interop.contract.route`` sends decode to the exact contract (sm_121).
      interpret: None -> Pallas interpret mode on a CPU backend, the compiled kernels on a GPU.

    Returns:
      [R, Hq, D] in q's dtype: ``softmax(scale · k_scale · q[r, h] · Kᵀ) · V · v_scale`` over
      the tokens the indexer selected for row r (KV head h // G); exact zeros for a row with no
      context (``seq_lens[r] <= 0``). Equal to ``interop.reference.decode_step_reference``
      within the attention tolerance.

    Raises:
      ContractError: before anything is traced or run (``interop.contract.check_decode_step``,
        naming the step's argument); torch tensors; ``interpret=False`` on a CPU-only JAX.
    """
    fn = "qsa_decode_step"
    args = (q, k_cache, v_cache, req_to_token, req_indices, index_q, index_k_cache,
            index_page_table, seq_lens)
    C.check_inputs(fn, interpret, **dict(zip(_DECODE_NAMES, args)))
    interp = C.resolve_interpret(interpret)
    ap, _ = check_decode_step(*args, softmax_scale, k_scale, v_scale, topk=topk,
                              compress_ratio=compress_ratio, batch_invariant=batch_invariant,
                              strict=strict,
                              attention_strict=not interp and _exact_contract_backend(), fn=fn)
    C.check_backend(fn, interpret, *args)
    return _decode_step(*args, softmax_scale=ap.softmax_scale, k_scale=ap.k_scale,
                        v_scale=ap.v_scale, topk=int(topk), ratio=int(compress_ratio),
                        batch_invariant=bool(batch_invariant), strict=bool(strict),
                        interpret=interp)


_DECODE_NAMES = ("q", "k_cache", "v_cache", "req_to_token", "req_indices", "index_q",
                 "index_k_cache", "index_page_table", "seq_lens")
_PREFILL_NAMES = ("q", "k_cache", "v_cache", "req_to_token", "req_indices", "index_q", "index_k",
                  "index_cu_seqlens_k", "cu_seqlens_q", "kv_lens")


# One jit around both halves: the halves' own checks run while tracing, i.e. before either runs.
@functools.partial(jax.jit, static_argnames=("softmax_scale", "k_scale", "v_scale", "topk",
                                             "ratio", "batch_invariant", "strict", "interpret"))
def _decode_step(q, k_cache, v_cache, req_to_token, req_indices, index_q, index_k_cache,
                 index_page_table, seq_lens, *, softmax_scale, k_scale, v_scale, topk, ratio,
                 batch_invariant, strict, interpret):
    indices = indexer_select_decode(index_q, index_k_cache, index_page_table, seq_lens,
                                    topk=topk, compress_ratio=ratio, strict=strict,
                                    interpret=interpret)
    return sparse_decode_paged(q, k_cache, v_cache, req_to_token, req_indices, indices, seq_lens,
                               softmax_scale, k_scale, v_scale, batch_invariant=batch_invariant,
                               strict=strict, interpret=interpret)


def prefill_step_rows(cu_seqlens_q, kv_lens, index_cu_seqlens_k, total_rows: int, *,
                      compress_ratio: int = 4):
    """Each prefill row's indexer metadata from the request tables, in plain ``jnp`` (traced
    inputs welcome: nothing is read on the host). The rule is
    ``interop.indices.prefill_step_rows`` (its docstring): row t of request b sits at position
    ``kv_lens[b] - q_len_b + (t - cu_seqlens_q[b])``, scores the first
    ``floor((p + 1) / ratio)`` of its request's packed compressed keys
    ``index_cu_seqlens_k[b] ..``, and has validity bound ``kv_lens[b]``; rows outside every
    request get an empty range, position -1 and bound 0.

    Args:
      cu_seqlens_q: int32 [B + 1]; kv_lens: int32 [B]; index_cu_seqlens_k: int32 [B + 1];
      total_rows: host int T; compress_ratio: tokens per block.

    Returns:
      (row_starts, row_ends, positions, seq_lens), int32 [T] each: the arguments of
      ``indexer_select_prefill``.
    """
    ratio = int(compress_ratio)
    cu = cu_seqlens_q.astype(jnp.int32)
    kl = kv_lens.astype(jnp.int32)
    ck = index_cu_seqlens_k.astype(jnp.int32)
    b = kl.shape[0]
    rows = jnp.arange(int(total_rows), dtype=jnp.int32)
    req = jnp.searchsorted(cu[1:], rows, side="right").astype(jnp.int32)
    inside = (req < b) & (rows >= cu[0])
    rq = jnp.minimum(req, b - 1)
    pos = kl[rq] - (cu[rq + 1] - cu[rq]) + rows - cu[rq]
    start = ck[rq]
    end = start + jnp.minimum(jnp.maximum(pos + 1, 0) // ratio, jnp.maximum(ck[rq + 1] - start, 0))
    zero = jnp.zeros_like(rows)
    return (jnp.where(inside, start, zero), jnp.where(inside, end, zero),
            jnp.where(inside, pos, zero - 1), jnp.where(inside, kl[rq], zero))


def qsa_prefill_step(q, k_cache, v_cache, req_to_token, req_indices, index_q, index_k,
                     index_cu_seqlens_k, cu_seqlens_q, kv_lens, max_seqlen_q, softmax_scale=None,
                     k_scale=1.0, v_scale=1.0, *, topk: int = 512, compress_ratio: int = 4,
                     strict: bool = False, interpret: bool | None = None):
    """One QSA prefill attention step: row metadata -> indexer over packed compressed keys ->
    expansion -> paged sparse prefill from the pool.

    ``sparse_prefill_paged``'s arguments with its ``indices`` replaced by the indexer's inputs
    (``index_q``, ``index_k``, ``index_cu_seqlens_k``), same order and meaning as
    ``qsa_triton.qsa_prefill_step``. Request b has ``kv_lens[b]`` tokens of context (cached
    prefix + this chunk); its ``q_len_b = cu_seqlens_q[b + 1] - cu_seqlens_q[b]`` new rows are the
    last ones (bottom-right causal).

    Args:
      q: [T, Hq, D] bfloat16|float16, the new rows of all requests packed.
      k_cache, v_cache: [slots, Hkv, D] the KV pool (this chunk's K/V already written), q's
        dtype or float8_e4m3fn (with ``k_scale`` / ``v_scale``).
      req_to_token: int32 [max_reqs, max_context]; req_indices: int32 [B] (as
        ``sparse_prefill_paged``).
      index_q: [T, H, Di] the indexer query of every row.
      index_k: [N, 1, Di] the compressed keys of every request packed: request b's
        ``floor(kv_lens[b] / ratio)`` blocks (at least all a row may see) are rows
        ``index_cu_seqlens_k[b] .. index_cu_seqlens_k[b + 1] - 1``; index_q's dtype or FP8.
      index_cu_seqlens_k: int32 [B + 1].
      cu_seqlens_q: int32 [B + 1]; kv_lens: int32 [B].
      max_seqlen_q: host int >= 1 (a grid-size hint, as ``sparse_prefill_paged``).
      softmax_scale, k_scale, v_scale, topk, compress_ratio, strict, interpret: as
        ``qsa_decode_step``.

    Returns:
      [T, Hq, D] in q's dtype: each row attends to the tokens its indexer row selected (at most
      ``topk`` blocks of its visible ``floor((p + 1) / ratio)`` plus the causal tail); zeros for
      rows outside every request. Equal to ``interop.reference.prefill_step_reference`` within
      the attention tolerance.

    Raises:
      ContractError: before anything is traced or run (``interop.contract.check_prefill_step``);
        torch tensors; ``interpret=False`` on a CPU-only JAX.
    """
    fn = "qsa_prefill_step"
    args = (q, k_cache, v_cache, req_to_token, req_indices, index_q, index_k, index_cu_seqlens_k,
            cu_seqlens_q, kv_lens)
    C.check_inputs(fn, interpret, **dict(zip(_PREFILL_NAMES, args)))
    interp = C.resolve_interpret(interpret)
    ap, _ = check_prefill_step(*args, max_seqlen_q, softmax_scale, k_scale, v_scale, topk=topk,
                               compress_ratio=compress_ratio, strict=strict, fn=fn)
    C.check_backend(fn, interpret, *args)
    return _prefill_step(*args, max_seqlen_q=ap.max_seqlen_q, softmax_scale=ap.softmax_scale,
                         k_scale=ap.k_scale, v_scale=ap.v_scale, topk=int(topk),
                         ratio=int(compress_ratio), strict=bool(strict), interpret=interp)


@functools.partial(jax.jit, static_argnames=("max_seqlen_q", "softmax_scale", "k_scale",
                                             "v_scale", "topk", "ratio", "strict", "interpret"))
def _prefill_step(q, k_cache, v_cache, req_to_token, req_indices, index_q, index_k,
                  index_cu_seqlens_k, cu_seqlens_q, kv_lens, *, max_seqlen_q, softmax_scale,
                  k_scale, v_scale, topk, ratio, strict, interpret):
    rs, re, pos, bound = prefill_step_rows(cu_seqlens_q, kv_lens, index_cu_seqlens_k, q.shape[0],
                                           compress_ratio=ratio)
    indices = indexer_select_prefill(index_q, index_k, rs, re, pos, bound, topk=topk,
                                     compress_ratio=ratio, strict=strict, interpret=interpret)
    return sparse_prefill_paged(q, k_cache, v_cache, req_to_token, req_indices, indices,
                                cu_seqlens_q, kv_lens, max_seqlen_q, softmax_scale, k_scale,
                                v_scale, strict=strict, interpret=interpret)
