"""The end-to-end QSA attention step for JAX: indexer -> expansion -> sparse attention.

Same composition, names and checks as ``qsa_triton.step`` (read its module docstring). After
the checks each step runs as one jitted function in which every length, position, page id and
slot is traced (new lengths never recompile); it works under ``jax.jit``, ``lax.scan`` over
layers and ``jax.shard_map`` over heads (``shard_step``, ``replicate_kv_heads``).
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from interop.contract import (DECODE_STEP_DOC, PREFILL_STEP_DOC, ContractError,
                              check_decode_step, check_prefill_step,
                              check_prefill_step_rows)
from interop.indices import prefill_step_rows_xp

from . import _compat as C
from .decode_paged import _exact_contract_backend, sparse_decode_paged
from .indexer import _default_plan, indexer_select_decode, indexer_select_prefill
from .prefill import sparse_prefill_paged

__all__ = ["qsa_decode_step", "qsa_prefill_step", "prefill_step_rows", "replicate_kv_heads",
           "shard_step"]


@C.forward_only
def qsa_decode_step(q, k_cache, v_cache, req_to_token, req_indices, index_q, index_k_cache,
                    index_page_table, seq_lens, softmax_scale=None, k_scale=1.0, v_scale=1.0, *,
                    topk: int = 512, compress_ratio: int = 4, batch_invariant: bool = False,
                    strict: bool = False, interpret: bool | None = None):
    """One QSA decode attention step: indexer (score + exact top-k) -> expansion -> paged decode.

    STEP_DOC

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
                              attention_strict=not interp and _exact_contract_backend(), fn=fn,
                              indexer_plan=_default_plan)
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
    """``qsa_triton.step.prefill_step_rows``'s rule in plain ``jnp``
    (``interop.indices.prefill_step_rows_xp``; traced inputs welcome): int32 ``cu_seqlens_q``
    [B + 1], ``kv_lens`` [B], ``index_cu_seqlens_k`` [B + 1], host ints ``total_rows`` (T) and
    ``compress_ratio`` -> (row_starts, row_ends, positions, seq_lens), int32 [T] each.
    Raises ContractError (``interop.contract.check_prefill_step_rows``) before anything runs."""
    check_prefill_step_rows(cu_seqlens_q, kv_lens, index_cu_seqlens_k, total_rows,
                            compress_ratio)
    return _step_rows(cu_seqlens_q, kv_lens, index_cu_seqlens_k, total_rows, compress_ratio)


def _step_rows(cu_seqlens_q, kv_lens, index_cu_seqlens_k, total_rows, compress_ratio):
    """``prefill_step_rows`` on checked arguments (``qsa_prefill_step`` checked them already)."""
    return prefill_step_rows_xp(jnp, cu_seqlens_q.astype(jnp.int32), kv_lens.astype(jnp.int32),
                                index_cu_seqlens_k.astype(jnp.int32),
                                jnp.arange(int(total_rows), dtype=jnp.int32), int(compress_ratio))


@C.forward_only
def qsa_prefill_step(q, k_cache, v_cache, req_to_token, req_indices, index_q, index_k,
                     index_cu_seqlens_k, cu_seqlens_q, kv_lens, max_seqlen_q, softmax_scale=None,
                     k_scale=1.0, v_scale=1.0, *, topk: int = 512, compress_ratio: int = 4,
                     strict: bool = False, interpret: bool | None = None):
    """One QSA prefill attention step: row metadata -> indexer over packed compressed keys ->
    expansion -> paged sparse prefill from the pool.

    STEP_DOC

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
                               compress_ratio=compress_ratio, strict=strict, fn=fn,
                               indexer_plan=_default_plan)
    C.check_backend(fn, interpret, *args)
    return _prefill_step(*args, max_seqlen_q=ap.max_seqlen_q, softmax_scale=ap.softmax_scale,
                         k_scale=ap.k_scale, v_scale=ap.v_scale, topk=int(topk),
                         ratio=int(compress_ratio), strict=bool(strict), interpret=interp)


@functools.partial(jax.jit, static_argnames=("max_seqlen_q", "softmax_scale", "k_scale",
                                             "v_scale", "topk", "ratio", "strict", "interpret"))
def _prefill_step(q, k_cache, v_cache, req_to_token, req_indices, index_q, index_k,
                  index_cu_seqlens_k, cu_seqlens_q, kv_lens, *, max_seqlen_q, softmax_scale,
                  k_scale, v_scale, topk, ratio, strict, interpret):
    rs, re, pos, bound = _step_rows(cu_seqlens_q, kv_lens, index_cu_seqlens_k, q.shape[0],
                                    ratio)
    indices = indexer_select_prefill(index_q, index_k, rs, re, pos, bound, topk=topk,
                                     compress_ratio=ratio, strict=strict, interpret=interpret)
    return sparse_prefill_paged(q, k_cache, v_cache, req_to_token, req_indices, indices,
                                cu_seqlens_q, kv_lens, max_seqlen_q, softmax_scale, k_scale,
                                v_scale, strict=strict, interpret=interpret)


# ---------------------------------------------------------------------------------------------
# Tensor parallel: the step split over the heads of one mesh axis
def replicate_kv_heads(x, tp: int, *, axis: int = 1):
    """The tensor-parallel layout of a KV-head axis, as JAX engines hold the pool when TP exceeds
    the KV heads (vLLM-TPU / sglang-jax ``get_num_kv_heads_by_tp``): ``x`` unchanged when
    ``tp`` <= Hkv, else each KV head repeated ``tp / Hkv`` times in place, so that rank r of an
    even ``tp``-way split holds KV head ``r // (tp / Hkv)``. Engines allocate the pool so; this
    converts a TP1 pool (tests).

    ``x``: a jax (or numpy) array with Hkv >= 1 heads on ``axis`` (the pool [slots, Hkv, D]);
    ``tp``: host int >= 1. Returns ``x`` with ``max(Hkv, tp)`` heads on ``axis`` (a copy when
    repeated). Raises ContractError for another type of ``x``, ``tp`` or ``axis``, an axis out
    of range, no head, ``tp`` < 1 or neither of ``tp`` and Hkv dividing the other.
    """
    fn = "replicate_kv_heads"
    if not isinstance(x, (jax.Array, np.ndarray)):
        raise ContractError(fn, "x", "a jax.Array or numpy array (torch: interop.dlpack.to_jax)",
                            type(x).__name__)
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)) \
            or not -x.ndim <= axis < x.ndim:
        raise ContractError(fn, "axis", f"a host int axis of x's {x.ndim} dimensions (the KV "
                            "heads: 1 for a pool [slots, Hkv, D])", axis)
    if isinstance(tp, bool) or not isinstance(tp, (int, np.integer)):
        raise ContractError(fn, "tp", "a host int >= 1 (the TP rank count)", type(tp).__name__)
    hkv, tp = x.shape[axis], int(tp)
    if hkv == 0:
        raise ContractError(fn, "x", f"at least one KV head on axis {axis}", f"shape {x.shape}")
    if tp < 1 or (tp % hkv and hkv % tp):
        raise ContractError(fn, "tp", f"a rank count >= 1 that divides Hkv = {hkv} or is a "
                            "multiple of it", tp)
    return x if tp <= hkv else jnp.repeat(x, tp // hkv, axis=axis)


def shard_step(step, mesh, axis: str = "tp"):
    """``qsa_decode_step`` / ``qsa_prefill_step`` as one tensor-parallel call over the mesh axis
    ``axis`` (TP ranks): each rank runs the unchanged step on its heads under ``jax.shard_map``
    (VMA check off), no collective inside. ``q``, the output and ``k_cache`` / ``v_cache``
    [slots, max(Hkv, TP), D] (``replicate_kv_heads``) are split over the heads (upstream's TP
    attention layout); every other array is replicated (each rank runs the head-independent
    indexer itself).

    Args:
      step: ``qsa_decode_step`` or ``qsa_prefill_step`` (or a function of that signature);
      mesh: a ``jax.sharding.Mesh`` with the axis ``axis`` (TP = its size).

    Returns:
      ``f(*args, **kwargs)`` with the step's signature on global arrays (any placement),
      returning the output [rows, Hq, D] sharded over the heads. Host values (scales,
      ``max_seqlen_q``, ``topk``, ...) are static: one compile per shapes and host values.
      Usable inside an outer ``jax.jit``.

    Raises (from ``f``, before anything is traced):
      ContractError: a mesh without ``axis``; arguments that do not fit the step's signature;
        an array for a host value (a defaulted parameter or a 0-d array), a non-jax tensor, or
        an unhashable host value (a list: pass an array); Hq or
        the pool's heads not a multiple of TP (at TP > Hkv: ``replicate_kv_heads``); then each
        rank's step checks its own shapes.
    """
    fn = getattr(step, "__name__", "shard_step")
    try:
        sig = inspect.signature(step)
    except (TypeError, ValueError):  # a callable without a signature: arguments taken as given
        sig = None
    # defaulted parameters are host values (the steps' scales)
    optional = set() if sig is None else {
        n for n, p in sig.parameters.items() if p.default is not inspect.Parameter.empty}

    def call(*args, **kwargs):
        if axis not in mesh.shape:
            raise ContractError(fn, "mesh", f"a jax.sharding.Mesh with the axis {axis!r} (the TP "
                                "ranks; shard_step(step, mesh, axis=...) names another)",
                                f"axes {tuple(mesh.shape)}")
        if sig is not None:  # keyword arguments become positions: one layout, one cache key
            try:
                bound = sig.bind(*args, **kwargs)
            except TypeError as e:
                # Python's text reads "got an unexpected ...": the message adds its own "got"
                raise ContractError(fn, "arguments", f"the arguments of {fn}{sig}",
                                    str(e).removeprefix("got ")) from None
            bound.apply_defaults()
            args, kwargs = bound.args, bound.kwargs
            for name, a in kwargs.items():
                if isinstance(a, (jax.Array, np.ndarray)):
                    raise ContractError(fn, name, "a host value (keyword-only arguments are "
                                        "static)", type(a).__name__)
        names = (list(sig.parameters) if sig is not None
                 else [f"args[{i}]" for i in range(len(args))])
        for name, a in [*zip(names, args), *kwargs.items()]:
            is_array = isinstance(a, (jax.Array, np.ndarray))
            if is_array and (a.ndim == 0 or name in optional):
                # a scalar array or an array for a defaulted (host) parameter would be traced
                raise ContractError(fn, name, "a host value (float(x) / int(x)): host values "
                                    "are static under shard_step", f"a {a.ndim}-d array")
            if not is_array and hasattr(a, "shape"):  # a torch tensor is hashable: not static
                raise ContractError(fn, name, "a jax.Array or numpy array (torch tensors: "
                                    "interop.dlpack.to_jax)", type(a).__name__)
            if not is_array:
                try:
                    hash(a)
                except TypeError:
                    raise ContractError(fn, name, "a jax.Array or numpy array, or a hashable host "
                                        "value (host values are static)",
                                        type(a).__name__) from None
        tp = int(mesh.shape[axis])
        for i, name in enumerate(("q", "k_cache", "v_cache")):
            shape = getattr(args[i], "shape", ()) if len(args) > i else ()
            h = shape[1] if len(shape) > 1 else None
            if h is None or h % tp:
                hint = "" if name == "q" else " (replicate_kv_heads(pool, TP) when TP > Hkv)"
                raise ContractError(fn, name, f"heads (axis 1) a multiple of TP = {tp}{hint}",
                                    None if h is None else f"{h} heads")
        arrays = tuple(i for i, a in enumerate(args) if isinstance(a, (jax.Array, np.ndarray)))
        static = tuple((i, a) for i, a in enumerate(args) if i not in arrays)
        f = _sharded(step, mesh, axis, len(args), arrays, static, tuple(sorted(kwargs.items())))
        # committed single-device inputs (DLPack imports, device_put) would be refused by the
        # mesh's jit: place every array on the mesh first (a no-op when already there)
        return f(*(jax.device_put(args[i], NamedSharding(mesh, P(None, axis, None) if i < 3
                                                          else P())) for i in arrays))

    call.__name__ = call.__qualname__ = f"shard_step({fn})"
    return call


@functools.lru_cache(maxsize=64)
def _sharded(step, mesh, axis, n_args, arrays, static, kwargs):
    """The jitted shard_map of one (step, mesh, argument layout, host values)."""
    heads = P(None, axis, None)

    def local(*xs):
        full = [None] * n_args
        for i, x in zip(arrays, xs):
            full[i] = x
        for i, a in static:
            full[i] = a
        return step(*full, **dict(kwargs))

    specs = tuple(heads if i < 3 else P() for i in arrays)
    return jax.jit(C.shard_map(local, mesh=mesh, in_specs=specs, out_specs=heads))


qsa_decode_step.__doc__ = qsa_decode_step.__doc__.replace("STEP_DOC", DECODE_STEP_DOC)
qsa_prefill_step.__doc__ = qsa_prefill_step.__doc__.replace("STEP_DOC", PREFILL_STEP_DOC)
