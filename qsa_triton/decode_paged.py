"""Paged sparse decode (``qsa-contract.md`` §2b, §2c) as Triton kernels for PyTorch: the whole
decode step reads the KV pool in place (no valid counts, prefix sum or packed copy).

Algorithm: flash-decoding split-KV over the index columns with the standard LSE merge, the online
softmax of FlashAttention-2.

* ``_paged_split_kernel``, one program per (split j, row r, KV head h) of the static plan
  ``interop.plan.plan_decode_paged``: the G query heads of h as one [head tile, D] tile (a power
  of two >= 16, masked) walk BLOCK_N chunks ``[j*nb // S, (j+1)*nb // S)`` of the row's W index
  columns. An entry is valid iff ``0 <= idx < min(seq_lens[r], max_context)``,
  ``req_indices[r]`` names a table row and the slot ``req_to_token[req, idx]`` lies in
  ``[0, slots)``; K/V rows are gathered under that mask (invalid entries read 0, never the
  pool), with 64-bit offsets where the pool needs them (``OFF64``). FP8 pools: tiles and q in
  fp16 (``qsa_triton._fp8``). FP32 scores times ``softmax_scale * k_scale * log2(e)``, online
  softmax with exp2, FP32 accumulator.
* One split: ``acc * v_scale / l`` goes straight to the output (zeros where l = 0). Otherwise
  each split writes its FP32 partial and log2 LSE (-inf when empty) to per-call scratch and
  ``_paged_merge_kernel`` (per (row, query head, D chunk)) weighs them by 2^(lse_j - max lse).
* NaN: an attended NaN reaches the row's output whatever the split count, as in
  ``interop.reference`` (a split is empty only where l == 0; the merge writes NaN where any
  split's LSE or partial is NaN, finite outputs keep their bits).
* Programmatic Dependent Launch (sm_90+, as the packed decode ``qsa_triton.decode``) where the
  call has one (row, KV head) pair, one latency chain (``pdl_enabled``; bench/NOTES.md, "Paged
  decode"): every program waits (``gdc_wait``) before its first load or store, so results are
  bitwise the same.
* Static plan, lengths/positions/slots read on the device, no atomics, no host sync: CUDA-graph
  and torch.compile safe. ``batch_invariant=True``: the plan depends on W, G, D and the dtypes
  only, so a row's bits do not depend on the batch.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

from interop.arch import DeviceFacts
from interop.contract import ContractError, check_decode_paged, route
from interop.plan import LOG2E, PAGED_MAX_SPLITS, PagedDecodePlan, next_pow2, plan_decode_paged

from ._fp8 import fp16_query
from ._interp_guard import (check_device, check_interpreter_dtype, check_torch_tensors,
                            interpreting, traced_refusal)
from .decode import _pdl_supported

__all__ = ["sparse_decode_paged", "decode_paged_with_plan", "plan_for", "pdl_enabled",
           "MERGE_TILE"]

#: floats per merge-kernel tile ([splits padded to a power of two, D chunk]): 16 per thread at 4
#: warps, as the packed decode's merge
MERGE_TILE = 2048
_OFF32_MAX = 2**31 - 1

# ---------------------------------------------------------------------------------------------
# Kernels
@triton.jit
def _chunk(q, k_head, v_head, slot, valid, offs_d, m_i, l_i, acc, qk_scale, stride_kc, stride_vc):
    """One BLOCK_N chunk of the online softmax: gather the valid entries' K/V rows (masked:
    invalid entries read 0, never the pool), convert them once to q's dtype (fp16 for an FP8
    pool), update the FP32 state. l_i is kept per column ([HT, BLOCK_N]) and reduced once after
    the loop (no cross-warp row sum per chunk, as the packed decode)."""
    kt = tl.load(k_head + slot[:, None] * stride_kc + offs_d[None, :],
                 mask=valid[:, None], other=0.0).to(q.dtype)
    s = tl.dot(q, tl.trans(kt)) * qk_scale  # FP32 [HT, BLOCK_N], log2 domain
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # no valid column yet: a finite reference point (no -inf - -inf)
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha[:, None] + p
    vt = tl.load(v_head + slot[:, None] * stride_vc + offs_d[None, :],
                 mask=valid[:, None], other=0.0).to(q.dtype)
    acc = tl.dot(p.to(q.dtype), vt, acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["R", "HQ", "HKV", "W", "MAX_REQS", "MAX_CTX", "SLOTS", "SPLITS"])
def _paged_split_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, part_ptr, table_ptr, req_ptr, idx_ptr, seqlen_ptr,
    qk_scale, v_scale,
    stride_qr, stride_qh, stride_kc, stride_kh, stride_vc, stride_vh, stride_or, stride_oh,
    stride_ir, stride_ih, stride_tr,
    R, HQ, HKV, W, MAX_REQS, MAX_CTX, SLOTS, SPLITS,
    G: tl.constexpr, D: tl.constexpr, HT: tl.constexpr, BLOCK_N: tl.constexpr,
    DIRECT: tl.constexpr, OFF64: tl.constexpr, USE_PDL: tl.constexpr,
):
    if USE_PDL:
        # launched before the previous kernel on the stream has finished: wait for it (its
        # writes visible; a previous merge may still read scratch this call reuses) before any
        # load or store. Trigger at entry: the merge grid may be scheduled now and waits in its
        # own gdc_wait until this grid completes (qsa_triton.decode, the same protocol).
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    # 1-D grid, split-major: pid = (j * R + r) * HKV + h (grid axes y/z would cap R at 65,535)
    pid = tl.program_id(0)
    h = pid % HKV
    r = (pid // HKV) % R
    j = pid // (HKV * R)
    nb = tl.cdiv(W, BLOCK_N)
    c_lo = (j * nb) // SPLITS
    c_hi = ((j + 1) * nb) // SPLITS
    req = tl.load(req_ptr + r)
    req_ok = (req >= 0) & (req < MAX_REQS)
    # valid iff 0 <= idx < bound: the row's length, never past the table's width; a row whose
    # request is not a table row has no valid entry (lying metadata reads nothing)
    bound = tl.where(req_ok, tl.minimum(tl.load(seqlen_ptr + r), MAX_CTX), 0)
    table_row = table_ptr + tl.where(req_ok, req, 0).to(tl.int64) * stride_tr
    idx_row = idx_ptr + r.to(tl.int64) * stride_ir + h * stride_ih

    offs_m = tl.arange(0, HT)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    m_ok = offs_m < G
    heads = (h * G + offs_m).to(tl.int64)
    q = tl.load(q_ptr + r.to(tl.int64) * stride_qr + heads[:, None] * stride_qh + offs_d[None, :],
                mask=m_ok[:, None], other=0.0)
    if k_ptr.dtype.element_ty == tl.float8e4nv:
        q, qk_scale = fp16_query(q, qk_scale)  # the dots in fp16 (qsa_triton._fp8)
    k_head = k_ptr + h.to(tl.int64) * stride_kh
    v_head = v_ptr + h.to(tl.int64) * stride_vh

    m_i = tl.full([HT], float("-inf"), tl.float32)
    l_i = tl.zeros([HT, BLOCK_N], tl.float32)  # softmax denominator per column, reduced once
    acc = tl.zeros([HT, D], tl.float32)
    for c in range(c_lo, c_hi):
        cols = c * BLOCK_N + offs_n
        ent = tl.load(idx_row + cols, mask=cols < W, other=-1)
        valid = (ent >= 0) & (ent < bound)
        slot = tl.load(table_row + ent, mask=valid, other=0)
        valid = valid & (slot >= 0) & (slot < SLOTS)
        if OFF64:  # slot * stride passes int32 once the pool holds >= 2**31 elements
            slot = slot.to(tl.int64)
        m_i, l_i, acc = _chunk(q, k_head, v_head, slot, valid, offs_d, m_i, l_i, acc, qk_scale,
                               stride_kc, stride_vc)
    l_row = tl.sum(l_i, 1)
    # empty (no valid entry): l == 0, exact zeros and LSE -inf. An attended NaN makes l NaN: the
    # output / partial and the LSE are NaN then, never the -inf the merge would weigh 0.
    empty = l_row == 0.0
    l_safe = tl.where(empty, 1.0, l_row)
    o = acc * tl.where(empty, 0.0, v_scale / l_safe)[:, None]
    if DIRECT:
        tl.store(out_ptr + r.to(tl.int64) * stride_or + heads[:, None] * stride_oh
                 + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=m_ok[:, None])
    else:
        part_row = (r.to(tl.int64) * HQ + heads) * SPLITS + j  # [HT]
        tl.store(lse_ptr + part_row, tl.where(empty, float("-inf"), m_i + tl.log2(l_safe)),
                 mask=m_ok)
        tl.store(part_ptr + part_row[:, None] * D + offs_d[None, :], o, mask=m_ok[:, None])


@triton.jit(do_not_specialize=["HQ", "SPLITS"])
def _paged_merge_kernel(out_ptr, lse_ptr, part_ptr, stride_or, stride_oh, HQ, SPLITS,
                        D: tl.constexpr, SPLIT_P2: tl.constexpr, D_CHUNK: tl.constexpr,
                        USE_PDL: tl.constexpr):
    # one program per (row r, query head, D chunk): every split's LSE and partial in one round
    # trip; a fixed reduction order over the splits (batch-invariant)
    if USE_PDL:
        # the split grid's partials are visible only after this wait; then the next kernel may
        # be scheduled (it waits for this grid in turn before reusing the scratch)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    n_dc: tl.constexpr = D // D_CHUNK
    row = pid // n_dc  # r * HQ + query head
    dc = pid % n_dc
    offs_j = tl.arange(0, SPLIT_P2)
    offs_d = dc * D_CHUNK + tl.arange(0, D_CHUNK)
    jm = offs_j < SPLITS
    base = row.to(tl.int64) * SPLITS
    lse = tl.load(lse_ptr + base + offs_j, mask=jm, other=float("-inf"))
    part = tl.load(part_ptr + (base + offs_j)[:, None] * D + offs_d[None, :], mask=jm[:, None],
                   other=0.0)
    mx = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(mx == float("-inf"), 0.0, mx))  # empty split: exp2(-inf) = 0
    den = tl.sum(w, 0)
    o = tl.sum(tl.where(w[:, None] > 0.0, w[:, None] * part, 0.0), 0)
    o = o / tl.where(den > 0.0, den, 1.0)  # every split empty: exact zeros
    # an attended NaN (a NaN LSE or partial; every split was written by this call) reaches the
    # output, as in the reference, even where tl.max skipped it or its weight underflowed
    nan = tl.max(((part != part) | (lse != lse)[:, None]).to(tl.int32), 0)
    o = tl.where(nan > 0, float("nan"), o)
    r = row // HQ
    hq = row % HQ
    tl.store(out_ptr + r.to(tl.int64) * stride_or + hq.to(tl.int64) * stride_oh + offs_d,
             o.to(out_ptr.dtype.element_ty))


# ---------------------------------------------------------------------------------------------
# Plan and launch
@functools.lru_cache(maxsize=64)
def _device(dev_type: str, index: int | None) -> tuple[int, int | None]:
    """(SM count, opt-in shared memory per block) of the launch's GPU (``interop.arch``, cached
    there); the H200's 132 SMs on CPU, where they only shape the interpreter's grid."""
    if dev_type != "cuda":
        return 132, None
    facts = DeviceFacts.from_torch(torch.device(dev_type, index))
    return facts.sm_count, facts.smem_per_block


def plan_for(rows: int, num_kv_heads: int, group: int, head_dim: int, width: int,
             device: torch.device | str | None = None, *, q_dtype: torch.dtype = torch.bfloat16,
             kv_dtype: torch.dtype = torch.bfloat16,
             batch_invariant: bool = False) -> PagedDecodePlan:
    """The plan (``interop.plan.plan_decode_paged``) a ``sparse_decode_paged`` call with R =
    ``rows`` query rows, Hkv, G = Hq / Hkv, D, W = ``width`` index columns, q / pool dtypes
    (torch dtypes; FP8 pools: ``torch.float8_e4m3fn``) uses on ``device`` (None: the current
    CUDA device, or the CPU, whose plans are sized for the H200's 132 SMs); cached. The same
    signature as ``qsa_pallas.decode_paged.plan_for`` and the packed decodes' ``plan_for``.
    Raises ValueError as ``plan_decode_paged`` (a size < 1, no plan fits). Source:
    ``interop.plan`` (the rules and their measurements)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    return _plan(rows, num_kv_heads, group, head_dim, max(1, width),
                 *_device(device.type, device.index), q_dtype.itemsize, kv_dtype.itemsize,
                 bool(batch_invariant))


def _plan_of(q: torch.Tensor, k_cache: torch.Tensor, indices: torch.Tensor,
             batch_invariant: bool) -> PagedDecodePlan:
    """``plan_for`` of a call's tensors."""
    r, hq, d = q.shape
    hkv = k_cache.shape[1]
    return plan_for(r, hkv, hq // hkv, d, indices.shape[-1], q.device, q_dtype=q.dtype,
                    kv_dtype=k_cache.dtype, batch_invariant=batch_invariant)


@functools.lru_cache(maxsize=4096)
def _plan(r, hkv, g, d, w, sms, smem, qb, kb, bi) -> PagedDecodePlan:
    return plan_decode_paged(r, hkv, g, d, w, sms, q_bytes=qb, kv_bytes=kb, batch_invariant=bi,
                             device_smem=smem)


def pdl_enabled(device: torch.device | str, kv_rows: int) -> bool:
    """Whether a ``sparse_decode_paged`` call uses Programmatic Dependent Launch (CUDA C++
    Programming Guide, "Programmatic Dependent Launch and Synchronization"; PTX
    ``griddepcontrol``).

    Args: ``device`` a torch device or its name; ``kv_rows`` the call's R x Hkv (row, KV head)
    pairs, an int. Returns True where PDL is supported (CUDA compute capability >= 9.0, a Triton
    with ``launch_pdl``, not the interpreter) and R x Hkv == 1, where one (row, KV head) pair
    makes the call one latency chain (the measurements: bench/NOTES.md, "Paged decode"). Raises
    nothing; the output bits are the same either way."""
    return _pdl_rule(kv_rows) and _pdl_supported(torch.device(device))


def _pdl_rule(kv_rows: int) -> bool:
    """``pdl_enabled``'s shape rule alone (R x Hkv == 1), for AOT configuration lists that know
    the part supports PDL. ``kv_rows``: int. Returns a bool; raises nothing."""
    return kv_rows == 1


def _max_offset(t: torch.Tensor) -> int:
    """Largest element offset inside ``t`` (its strides as given)."""
    return sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if s > 0)


def _merge_d_chunk(split_p2: int, head_dim: int) -> int:
    return max(16, min(head_dim, MERGE_TILE // split_p2))


def _launch(q, k_cache, v_cache, req_to_token, req_indices, indices, seq_lens, softmax_scale,
            k_scale, v_scale, plan: PagedDecodePlan, pdl: bool | None = None) -> torch.Tensor:
    r, hq, d = q.shape
    hkv = k_cache.shape[1]
    w = indices.shape[-1]
    out = torch.empty((r, hq, d), dtype=q.dtype, device=q.device)
    if k_cache.shape[0] == 0 or w == 0 or req_to_token.numel() == 0:
        return out.zero_()  # no entry can be valid: every row is empty (exact zeros)
    splits = max(1, min(int(plan.num_splits), -(-w // plan.block_n)))
    direct = splits == 1
    if direct:  # unused by the kernel (DIRECT writes the output); fp32, as qsa compile types them
        lse = part = torch.empty(1, dtype=torch.float32, device=q.device)
    else:
        lse = torch.empty(r * hq * splits, dtype=torch.float32, device=q.device)
        part = torch.empty(r * hq * splits * d, dtype=torch.float32, device=q.device)
    off64 = max(_max_offset(k_cache), _max_offset(v_cache)) > _OFF32_MAX
    stride_ih = indices.stride(1) if indices.dim() == 3 else 0
    use_pdl = pdl_enabled(q.device, r * hkv) if pdl is None else bool(pdl)
    # launch_pdl=True is passed only when on: the interpreter / older Triton never see it
    pdl_kw = {"launch_pdl": True} if use_pdl else {}
    ctx = torch.cuda.device(q.device) if q.device.type == "cuda" else contextlib.nullcontext()
    with ctx:
        _paged_split_kernel[(splits * r * hkv,)](
            q, k_cache, v_cache, out, lse, part, req_to_token, req_indices, indices, seq_lens,
            float(softmax_scale) * float(k_scale) * LOG2E, float(v_scale),
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
            v_cache.stride(1), out.stride(0), out.stride(1), indices.stride(0), stride_ih,
            req_to_token.stride(0),
            r, hq, hkv, w, req_to_token.shape[0], req_to_token.shape[1], k_cache.shape[0], splits,
            G=hq // hkv, D=d, HT=plan.head_tile, BLOCK_N=plan.block_n, DIRECT=direct, OFF64=off64,
            USE_PDL=use_pdl,
            num_warps=plan.num_warps, num_stages=plan.num_stages, **pdl_kw,
        )
        if not direct:
            sp2 = max(2, next_pow2(splits))
            dch = _merge_d_chunk(sp2, d)
            _paged_merge_kernel[(r * hq * (d // dch),)](
                out, lse, part, out.stride(0), out.stride(1), hq, splits,
                D=d, SPLIT_P2=sp2, D_CHUNK=dch, USE_PDL=use_pdl, num_warps=4, num_stages=1,
                **pdl_kw)
    return out


@functools.lru_cache(maxsize=16)
def _exact_contract_device(dev_type: str, index: int | None) -> bool:
    """True where ``interop.contract.route`` sends decode to the exact contract only (sm_121)."""
    if dev_type != "cuda":
        return False
    dev = torch.device(dev_type, index if index is not None else torch.cuda.current_device())
    return route(DeviceFacts.from_torch(dev), "decode").exact_contract


# ---------------------------------------------------------------------------------------------
# torch.library registration
@torch.library.custom_op("qsa::sparse_decode_paged", mutates_args=())
def _paged_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              req_to_token: torch.Tensor, req_indices: torch.Tensor, indices: torch.Tensor,
              seq_lens: torch.Tensor, softmax_scale: float, k_scale: float, v_scale: float,
              batch_invariant: bool, strict: bool = False) -> torch.Tensor:
    """Registered op (contract checked by the caller; ``strict`` for the fake impl's check
    under torch.compile); sm_121's exact contract (§5) here too."""
    if _exact_contract_device(q.device.type, q.device.index):
        check_decode_paged(q, k_cache, v_cache, req_to_token, req_indices, indices, seq_lens,
                           softmax_scale, k_scale, v_scale, batch_invariant=batch_invariant,
                           strict=True)
    return _launch(q, k_cache, v_cache, req_to_token, req_indices, indices, seq_lens,
                   softmax_scale, k_scale, v_scale, _plan_of(q, k_cache, indices, batch_invariant))


@_paged_op.register_fake
def _paged_fake(q, k_cache, v_cache, req_to_token, req_indices, indices, seq_lens, softmax_scale,
                k_scale, v_scale, batch_invariant, strict=False):
    prob = check_decode_paged(q, k_cache, v_cache, req_to_token, req_indices, indices, seq_lens,
                              softmax_scale, k_scale, v_scale, batch_invariant=batch_invariant,
                              strict=strict)
    check_interpreter_dtype(_FN, prob.dtype)
    return q.new_empty(q.shape)


# ---------------------------------------------------------------------------------------------
# Public entry points
_FN = "sparse_decode_paged"


def _checked(q, k_cache, v_cache, req_to_token, req_indices, indices, seq_lens, softmax_scale,
             k_scale, v_scale, batch_invariant, strict):
    """The entry checks (in the fake impl under torch.compile); returns the scales as floats."""
    if torch.compiler.is_compiling():
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        return float(scale), float(k_scale), float(v_scale)
    check_torch_tensors(_FN, q=q, k_cache=k_cache, v_cache=v_cache, req_to_token=req_to_token,
                        req_indices=req_indices, indices=indices, seq_lens=seq_lens)
    prob = check_decode_paged(q, k_cache, v_cache, req_to_token, req_indices, indices, seq_lens,
                              softmax_scale, k_scale, v_scale, batch_invariant=batch_invariant,
                              strict=strict)
    check_interpreter_dtype(_FN, prob.dtype)
    check_device(_FN, q.device.type)
    if q.device.type != "cuda" and not interpreting():
        raise ContractError(_FN, "q", "a CUDA tensor (CPU tensors run only under Triton's "
                            "interpreter, TRITON_INTERPRET=1)", str(q.device))
    return prob.softmax_scale, prob.k_scale, prob.v_scale


def sparse_decode_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        req_to_token: torch.Tensor, req_indices: torch.Tensor,
                        indices: torch.Tensor, seq_lens: torch.Tensor,
                        softmax_scale: float | None = None, k_scale: float = 1.0,
                        v_scale: float = 1.0, *, batch_invariant: bool = False,
                        strict: bool = False) -> torch.Tensor:
    """Paged sparse decode (``qsa-contract.md`` §2b): the whole decode step from the KV pool.

    Args:
      q: [R, Hq, D] bf16|fp16, one row per decode query (MTP verify rows are rows too).
      k_cache, v_cache: [slots, Hkv, D] the pool, in q's dtype or float8_e4m3fn, last dim
        contiguous (other strides free). Hq = G·Hkv, G <= 16, D a power of two in 32..256.
      req_to_token: int32 [max_reqs, max_context], last dim contiguous: logical position p of
        request b lives in pool slot ``req_to_token[b, p]`` (SGLang's table).
      req_indices: int32 [R] the request of each row; seq_lens: int32 [R] each row's length.
      indices: int32 [R, W] (shared by the KV heads) or [R, Hkv, W] logical positions.
        Entry valid iff ``0 <= idx < seq_lens[r]``, ``idx < max_context``, ``req_indices[r]``
        is a table row and the slot lies in ``[0, slots)``, wherever it stands in the row;
        invalid entries are never dereferenced. Duplicates attend once per occurrence.
      softmax_scale: host float > 0, default D ** -0.5 (applied to FP32 scores).
      k_scale, v_scale: host floats > 0 (FP8 pools: k_scale multiplies the scores, v_scale the
        P·V result; must be 1.0 for a pool in q's dtype).
      batch_invariant: a row's output bits depend only on its own inputs (§2c).
      strict: also enforce the qualified envelope; always on for a GPU that
        ``interop.contract.route`` sends to the exact contract (sm_121).

    Returns:
      [R, Hq, D] in q's dtype: ``out[r, h] = softmax(scale · k_scale · q[r, h] · Kᵀ) · V ·
      v_scale`` over the row's valid entries (KV head h // G); exact zeros for a row with none.

    Raises:
      ContractError: before any launch: ``interop.contract.check_decode_paged`` (under
        torch.compile in the op's fake impl); bf16 under an unpatched Triton interpreter; CPU
        tensors without the interpreter.

    CUDA-graph and ``torch.compile(fullgraph=True)`` safe. Algorithm: the module docstring.
    """
    if torch.compiler.is_compiling():
        refused = traced_refusal(q, _FN, dict(q=q, k_cache=k_cache, v_cache=v_cache),
                                 softmax_scale=softmax_scale, k_scale=k_scale, v_scale=v_scale)
        if refused is not None:
            return refused
    scale, ksc, vsc = _checked(q, k_cache, v_cache, req_to_token, req_indices, indices, seq_lens,
                               softmax_scale, k_scale, v_scale, batch_invariant, strict)
    return torch.ops.qsa.sparse_decode_paged(q, k_cache, v_cache, req_to_token, req_indices,
                                             indices, seq_lens, scale, ksc, vsc,
                                             bool(batch_invariant), bool(strict))


def decode_paged_with_plan(q, k_cache, v_cache, req_to_token, req_indices, indices, seq_lens,
                           softmax_scale=None, k_scale=1.0, v_scale=1.0, *,
                           plan: PagedDecodePlan, pdl: bool | None = None) -> torch.Tensor:
    """``sparse_decode_paged`` (contract checked) with an explicit plan and PDL (None:
    ``pdl_enabled``) for tests and sweeps.

    Raises:
      ContractError: as ``sparse_decode_paged``; a plan whose head tile cannot hold G, whose
        BLOCK_N is not a power of two >= 16, or with more than PAGED_MAX_SPLITS splits; ``pdl``
        True where PDL is not supported (``qsa_triton.decode``).
    """
    scale, ksc, vsc = _checked(q, k_cache, v_cache, req_to_token, req_indices, indices, seq_lens,
                               softmax_scale, k_scale, v_scale, False, False)
    g = q.shape[1] // k_cache.shape[1]
    ht, bn = plan.head_tile, plan.block_n
    if ht < max(16, g) or ht & (ht - 1) or bn < 16 or bn & (bn - 1) \
            or not 1 <= plan.num_splits <= PAGED_MAX_SPLITS:
        raise ContractError("decode_paged_with_plan", "plan", "head_tile a power of two >= "
                            f"max(16, G={g}), block_n a power of two >= 16, 1 <= num_splits <= "
                            f"{PAGED_MAX_SPLITS}", plan)
    if pdl and not _pdl_supported(q.device):
        raise ContractError("decode_paged_with_plan", "pdl", "PDL only on a CUDA device of compute "
                            "capability >= 9.0 with a Triton that has launch_pdl, never under "
                            "the interpreter", pdl)
    return _launch(q, k_cache, v_cache, req_to_token, req_indices, indices, seq_lens, scale, ksc,
                   vsc, plan, pdl)

