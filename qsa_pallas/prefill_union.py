"""Tile-union sparse prefill (Pallas, Triton lowering): block-level selections, R rows a program.

The JAX twin of ``qsa_triton.prefill_union`` (read its module docstring): same selection rule,
tile numbering, union layout, per-tile switch to the per-row kernel and geometry selector;
results equal up to summation order. Differences:

* the union build (``block_union``) is plain JAX, vectorised over tiles: one sort of 30-bit keys
  ``block * R + row`` (four tiles a sort row: ``_sort_tiles``), compaction by an XLA scatter
  (every tile is sorted: XLA has no cheap per-tile skip, so there is no density test either); a
  tile where a row repeats a block gets ``interop.indices.REPEATED_TILE`` as in Triton;
* rows are packed densely: the Q tile holds R x G rows for any R (``interop.geometry.
  select_prefill_blocks`` gives this backend R = 5 at G = 12, 60 of 64 rows; Triton's in-register
  sort keeps R a power of two);
* the online softmax rescales every step and sums each row per step (no conditional
  rescaling, no deferred [M, BLOCK_N] sum: both measured slower here, bench/NOTES.md);
* the expansion (``_expand_kernel``) is a Pallas kernel, one program a row, that writes only
  the rows of tiles past the bound (pool slots for paged calls);
* the tile kernel takes the per-row kernel's output as an aliased input and writes only the
  rows of tiles within the bound; every gather index is clamped *and* masked, and in interpret
  mode masked lanes store to spare rows past the output (``_union_kernel``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from interop.contract import PrefillProblem
from interop.geometry import UnionGeometry, max_union_entries
from interop.indices import RATIO, REPEATED_TILE
from interop.plan import LOG2E, next_pow2

from . import _compat
from ._compat import pl
from ._fp8 import fp16_query, is_fp8

__all__ = ["block_union", "expand_blocks", "last_position", "pool_slot", "request_table",
           "row_runs", "union_build", "union_run", "union_slots"]

_INT32_MAX = 2**31 - 1


def last_position(base, kv_rows: int):
    """The largest position p with base + p inside k's ``kv_rows`` rows (a lying range is
    clamped into k: larger positions read row kv_rows - 1; both prefill kernels), without the
    int32 overflow of base + p (int32 arithmetic wraps; the branch that would is not taken).
    ``base``: an int32 scalar (K/V row of position 0); returns an int32 scalar. Raises nothing;
    source: qsa-contract.md §7 (lying ranges)."""
    return jnp.where(base < kv_rows - 1 - _INT32_MAX, _INT32_MAX, kv_rows - 1 - base)


def request_table(ri_ref, b, kv_len, max_reqs: int, max_context: int):
    """(req_to_token row, position bound) of request b of a paged call: a request index outside
    [0, max_reqs) has no valid position, positions stop at the table's width (qsa-contract.md
    §7); as ``qsa_triton.prefill_union.request_table``."""
    req = ri_ref[b]
    req_ok = (req >= 0) & (req < max_reqs)
    return jnp.where(req_ok, req, 0), jnp.where(req_ok, jnp.minimum(kv_len, max_context), 0)


def pool_slot(r2t_ref, req_row, tok, ok, bound, max_context: int, pool_slots: int):
    """The pool slot of positions ``tok`` (-1 where not ``ok``, outside [0, ``bound``) or mapped
    outside [0, ``pool_slots``)): the paged slot rule of every prefill kernel, as
    ``qsa_triton.prefill_union.pool_slot``."""
    ok = ok & (tok >= 0) & (tok < bound)
    sl = _compat.load(r2t_ref.at[req_row, jnp.clip(tok, 0, max_context - 1)], mask=ok, other=-1)
    return jnp.where(ok & (sl >= 0) & (sl < pool_slots), sl, -1)


def row_runs(ul_ref, q_start, b, r, h, tile_rows: int, max_union: int):
    """Whether the per-row path (expansion, per-row kernel) takes row r of request b (index or
    KV head h) of a call with a union: its tile of ``tile_rows`` rows (slot q_start // R + b +
    r // R, as ``_tiles``) has a union longer than ``max_union``; lengths ``ul_ref`` [S, H]
    (H = 1: shared selections). As ``qsa_triton.prefill_union.row_runs``."""
    slot = jnp.clip(q_start // tile_rows + b + r // tile_rows, 0, ul_ref.shape[0] - 1)
    return ul_ref[slot, h if ul_ref.shape[1] > 1 else 0] > max_union


def union_slots(total_q: int, requests: int, tile_rows: int) -> int:
    """Programs per KV head of the union grid: T // R + B (``interop.indices.tile_slots``)."""
    return total_q // tile_rows + requests


def _tiles(cu, n_req: int, tile_rows: int, slots):
    """Per slot: (request b, first row q_start, q_len, tile j, rows the tile may use: q_len or
    0)."""
    first = cu[:n_req] // tile_rows + jnp.arange(n_req, dtype=jnp.int32)
    b = jnp.sum((first[None, 1:] <= slots[:, None]).astype(jnp.int32), axis=1,
                dtype=jnp.int32)
    q_start = cu[b]
    q_len = cu[b + 1] - q_start
    jt = slots - (q_start // tile_rows + b)
    q_used = jnp.where((jt >= 0) & (jt * tile_rows < q_len), q_len, 0)
    return b, q_start, q_len, jt, q_used


_KEY_LIMIT = 2**30 - 1  # the sort key of an invalid entry: after every valid key
_SORT_GROUP = 4  # tiles a sort row holds, their number in the key's top two bits


def _sort_tiles(key):
    """Each line of int32 ``key`` [L, n] (values in [0, _KEY_LIMIT]) sorted ascending, invalid
    entries (_KEY_LIMIT) mapped to int32 max. Where _SORT_GROUP lines make a sort row of more
    than 8192 keys and there are more than 52 such rows, a sort row holds _SORT_GROUP lines,
    each tagged in the top bits: XLA's sort rewriter gives that shape to CUB's segmented radix
    sort on Hopper (its rule for 32-bit keys: more than 52 rows of more than 8192 keys), faster
    there than XLA's own sort of [L, n] (bench/NOTES.md, "Tile-union"; other GPUs follow the
    rewriter's rules for them). Smaller calls (few tiles or short rows) sort one line a row."""
    lines, n = key.shape
    rows = -(-lines // _SORT_GROUP)
    if _SORT_GROUP * n <= 8192 or rows <= 52:
        out = jnp.sort(key, axis=1)
    else:
        pad = jnp.pad(key, ((0, rows * _SORT_GROUP - lines), (0, 0)),
                      constant_values=_KEY_LIMIT).astype(jnp.uint32)
        tag = (jnp.arange(rows * _SORT_GROUP, dtype=jnp.uint32) % _SORT_GROUP) << 30
        out = jnp.sort((pad | tag[:, None]).reshape(rows, _SORT_GROUP * n), axis=1)
        out = (out.reshape(rows * _SORT_GROUP, n)[:lines] & _KEY_LIMIT).astype(jnp.int32)
    return jnp.where(out == _KEY_LIMIT, _INT32_MAX, out)


@functools.partial(jax.jit, static_argnames=("tile_rows", "ordinary"))
def _block_union(block_indices, cu_seqlens_q, kv_lens, *, tile_rows: int, ordinary: bool):
    t, nb = block_indices.shape[0], block_indices.shape[-1]
    g3 = block_indices if block_indices.ndim == 3 else block_indices[:, None, :]
    hidx = g3.shape[1]
    n_req = cu_seqlens_q.shape[0] - 1
    r = tile_rows
    s = union_slots(t, n_req, r)
    slots = jnp.arange(s, dtype=jnp.int32)
    b, q_start, q_len, jt, q_used = _tiles(cu_seqlens_q, n_req, r, slots)
    kv_len = q_len if ordinary else kv_lens[b]
    rel = jt[:, None] * r + jnp.arange(r, dtype=jnp.int32)[None, :]  # [S, R]
    row = q_start[:, None] + rel
    row_ok = (rel >= 0) & (rel < q_used[:, None]) & (row >= 0) & (row < t)
    n_vis = jnp.maximum(rel + (kv_len - q_len)[:, None] + 1, 0) // RATIO
    g = g3[jnp.clip(row, 0, t - 1)]  # [S, R, H, NB]
    g = jnp.transpose(g, (0, 2, 1, 3))  # [S, H, R, NB]
    # 30-bit sort keys block * R + row: ids at or past (2**30 - 1) // R are invalid
    # (qsa-contract.md §7); the top two bits name a tile among the _SORT_GROUP sorted together
    valid = (row_ok[:, None, :, None] & (g >= 0) & (g < n_vis[:, None, :, None])
             & (g < _KEY_LIMIT // r))
    n = r * nb
    rows = jnp.arange(r, dtype=jnp.int32)[None, None, :, None]
    key = _sort_tiles(jnp.where(valid, g * r + rows, _KEY_LIMIT).reshape(s * hidx, n))
    e = jnp.arange(n, dtype=jnp.int32)[None, :]

    def shifted(x, fill):  # x[:, i - 1], fill at i = 0
        return jnp.concatenate([jnp.full((x.shape[0], 1), fill, x.dtype), x[:, :-1]], axis=1)

    live = key < _INT32_MAX
    # a row listing a block twice: the per-row kernel's tile (module docstring)
    repeated = jnp.any(live & (key == shifted(key, -1)) & (e > 0), axis=1)
    blk, rows = key // r, key % r

    def nxt(x, fill):  # x[:, i + 1], fill at the end
        return jnp.concatenate([x[:, 1:], jnp.full((x.shape[0], 1), fill, x.dtype)], axis=1)

    first = live & ((e == 0) | (blk != shifted(blk, -1)))
    last = live & ((e == n - 1) | (blk != nxt(blk, -1)))
    pos = jnp.cumsum(first.astype(jnp.int32), axis=1, dtype=jnp.int32) - 1
    bits = jnp.where(live, jnp.left_shift(jnp.int32(1), rows), 0)
    incl = jnp.cumsum(bits, axis=1, dtype=jnp.int32)
    start = lax.cummax(jnp.where(first, incl - bits, 0), axis=1)
    dest = jnp.where(last, pos, n)  # n: out of range, dropped
    lines = jnp.arange(s * hidx, dtype=jnp.int32)[:, None]
    ublk = jnp.zeros((s * hidx, n), jnp.int32).at[lines, dest].set(blk, mode="drop")
    umem = jnp.zeros((s * hidx, n), jnp.int32).at[lines, dest].set(incl - start, mode="drop")
    ulen = jnp.where(repeated, REPEATED_TILE,
                     jnp.sum(first.astype(jnp.int32), axis=1, dtype=jnp.int32))
    return (ublk.reshape(s, hidx, n), umem.reshape(s, hidx, n), ulen.reshape(s, hidx))


def block_union(block_indices, cu_seqlens_q, kv_lens, tile_rows: int):
    """The union build alone (tests, benchmarks): as ``qsa_triton.prefill_union.
    build_block_union`` (int32 [S, H, R x NB] blocks and masks, [S, H] lengths; a tile where a
    row repeats a block: ``REPEATED_TILE``), entries past a length 0. Any R >= 1."""
    ordinary = kv_lens is None
    return _block_union(block_indices, cu_seqlens_q,
                        cu_seqlens_q[:-1] if ordinary else kv_lens, tile_rows=int(tile_rows),
                        ordinary=ordinary)


@dataclasses.dataclass(frozen=True)
class _XStatic:
    """What the expansion kernel specialises on: kind ("ordinary" | "chunk" | "paged"), the
    selection's (T, H, NB), requests B, the union's tile rows R (0: every row) and bound, the
    paged table's shape and pool size, interpret mode."""

    kind: str
    rows: int
    heads: int
    block_width: int
    requests: int
    union_rows: int
    max_union: int
    max_reqs: int
    max_context: int
    pool_slots: int
    interpret: bool


_EXPAND_TILE = 1024  # columns of -1 a fill step writes


def _expand_kernel(*refs, st: _XStatic):
    """One (row, index head): the row's valid blocks' 4 tokens each in its order, its causal
    tail, -1 after (``interop.indices.expand_prefill_blocks``); paged: their pool slots (-1
    where the table or the pool has none). With a union (``st.union_rows``) only rows of tiles
    past the bound are written (``qsa_triton.prefill_union.row_runs``'s rule); the per-row
    kernel skips the others. Every column written once; masked lanes point at the spare
    column W (interpret mode) or 0 (GPU, where they do not store)."""
    bi_ref, cu_ref, kvl_ref, *rest, o_ref = refs
    ul_ref = rest.pop(0) if st.union_rows else None
    r2t_ref, ri_ref = rest if st.kind == "paged" else (None, None)
    row = pl.program_id(0)
    h = pl.program_id(1)
    n_req, nb = st.requests, st.block_width
    w = RATIO * nb + RATIO - 1
    spare = w if st.interpret else 0
    bp = next_pow2(max(n_req, 1))
    j = lax.broadcasted_iota(jnp.int32, (bp,), 0)
    live = (j >= 1) & (j < n_req)
    cu = _compat.load(cu_ref.at[jnp.clip(j, 0, n_req)], mask=live, other=_INT32_MAX)
    b = jnp.sum((live & (cu <= row)).astype(jnp.int32), dtype=jnp.int32)
    q_start = cu_ref[b]
    q_len = cu_ref[b + 1] - q_start
    r = row - q_start
    in_req = (r >= 0) & (r < q_len)
    run = True
    if st.union_rows:
        run = row_runs(ul_ref, q_start, b, r, h, st.union_rows, st.max_union)

    def body():
        kv_len = q_len if st.kind == "ordinary" else kvl_ref[b]
        vis = jnp.where(in_req, jnp.maximum(r + kv_len - q_len + 1, 0), 0)
        n_vis = vis // RATIO
        nbp = next_pow2(nb)
        c = lax.broadcasted_iota(jnp.int32, (nbp,), 0)
        g = _compat.load(bi_ref.at[row, h, jnp.clip(c, 0, nb - 1)], mask=c < nb, other=-1)
        valid = (c < nb) & (g >= 0) & (g < n_vis)
        pos = jnp.cumsum(valid.astype(jnp.int32), axis=0) - 1
        count = jnp.sum(valid.astype(jnp.int32), dtype=jnp.int32)
        t4 = lax.broadcasted_iota(jnp.int32, (1, RATIO), 1)

        if st.kind == "paged":
            req_row, bound = request_table(ri_ref, b, kv_len, st.max_reqs, st.max_context)

        def slots(tok, ok):  # positions, or their pool slots in a paged call
            if st.kind != "paged":
                return tok
            return pool_slot(r2t_ref, req_row, tok, ok, bound, st.max_context, st.pool_slots)

        ok4 = jnp.broadcast_to(valid[:, None], (nbp, RATIO))
        tok = slots(RATIO * g[:, None] + t4, ok4)
        col = jnp.where(ok4, RATIO * pos[:, None] + t4, spare)
        _compat.store(o_ref.at[row, h, col], tok, mask=ok4)
        t1 = t4[0]
        n_tail = vis - RATIO * n_vis
        tail_ok = t1 < n_tail
        tok = slots(RATIO * n_vis + t1, tail_ok)
        _compat.store(o_ref.at[row, h, jnp.where(tail_ok, RATIO * count + t1, spare)], tok,
                      mask=tail_ok)
        end = RATIO * count + n_tail
        tile = min(_EXPAND_TILE, next_pow2(w))
        for k0 in range(0, w, tile):  # static: W is a shape
            cols = k0 + lax.broadcasted_iota(jnp.int32, (tile,), 0)
            m = (cols >= end) & (cols < w)
            _compat.store(o_ref.at[row, h, jnp.where(m, cols, spare)],
                          jnp.full((tile,), -1, jnp.int32), mask=m)

    if st.union_rows:
        pl.when(run)(body)
    else:
        body()


@functools.partial(jax.jit, static_argnames=("st",))
def _expand_launch(g3, cu, kv_lens, *rest, st: _XStatic):
    w = RATIO * st.block_width + RATIO - 1
    out = _compat.triton_call(
        functools.partial(_expand_kernel, st=st),
        out_shape=jax.ShapeDtypeStruct((st.rows, st.heads, w + (1 if st.interpret else 0)),
                                       jnp.int32),
        grid=(st.rows, st.heads), num_warps=4, num_stages=1, interpret=st.interpret,
        name=f"qsa_expand_blocks_{st.kind}",
    )(g3, cu, kv_lens, *rest)
    return out[..., :w]


def expand_blocks(block_indices, cu_seqlens_q, kv_lens, *, pool=None, skip=None,
                  interpret: bool | None = None):
    """Token indices of a block-level selection (the per-row kernel's input), a Pallas kernel
    (``_expand_kernel``): int32 [T, 4 NB + 3] (or [T, Hkv, ...]) from int32 ``block_indices``
    [T, NB] (or [T, Hkv, NB]), ``cu_seqlens_q`` [B + 1] and ``kv_lens`` [B] or None
    (ordinary); equal to ``interop.indices.expand_prefill_blocks`` (rows outside every request:
    all -1), as ``qsa_triton.prefill_union.expand_blocks``. ``pool``: None, or
    (req_to_token [max_reqs, max_context], req_indices [B], pool slots): the entries' pool
    slots instead. ``skip``: None, or (union lengths [S, H], R, max_union): a row is written
    only where its tile (``qsa_triton.prefill_union.row_runs``'s slot rule, rows outside every
    request included) is past max_union; the other rows may hold anything (the tile-union
    kernel computes them, no kernel reads rows outside every request). Raises nothing of its
    own (callers check the contract first)."""
    t, nb = block_indices.shape[0], block_indices.shape[-1]
    g3 = block_indices if block_indices.ndim == 3 else block_indices[:, None, :]
    w = RATIO * nb + RATIO - 1
    shape = (t, g3.shape[1], w) if block_indices.ndim == 3 else (t, w)
    if t == 0:
        return jnp.zeros(shape, jnp.int32)
    n_req = cu_seqlens_q.shape[0] - 1
    rest = []
    ur, max_union = 0, 0
    if skip is not None:
        rest.append(skip[0])
        ur, max_union = int(skip[1]), int(skip[2])
    max_reqs = max_context = slots = 0
    kind = "ordinary" if kv_lens is None else "chunk"
    if pool is not None:
        r2t, req_idx, slots = pool
        rest += [r2t, req_idx]
        max_reqs, max_context = (int(x) for x in r2t.shape)
        kind = "paged"
    st = _XStatic(kind, t, int(g3.shape[1]), int(nb), n_req, ur, max_union, max_reqs,
                  max_context, min(int(slots), _INT32_MAX), _compat.resolve_interpret(interpret))
    out = _expand_launch(g3, cu_seqlens_q, cu_seqlens_q if kv_lens is None else kv_lens, *rest,
                         st=st)
    return out.reshape(shape)


# --------------------------------------------------------------------------------------------
# The tile kernel
@dataclasses.dataclass(frozen=True)
class _UStatic:
    """What the kernel specialises on (the jit cache key), as ``qsa_pallas.prefill._Static``."""

    p: PrefillProblem
    geo: UnionGeometry
    union_width: int  # R x NB
    max_union: int  # interop.geometry.max_union_entries: longer unions are the per-row kernel's
    kv_rows: int
    max_reqs: int
    max_context: int
    interpret: bool


def _union_kernel(*refs, st: _UStatic):
    """One (tile, KV head) over its union (module docstring); nothing when the tile's union has
    more than ``st.max_union`` entries (the per-row kernel computed its rows)."""
    pr, geo = st.p, st.geo
    if pr.kind == "ordinary":
        q_ref, k_ref, v_ref, ub_ref, um_ref, ul_ref, cu_ref, _o_in, o_ref = refs
    elif pr.kind == "chunk":
        (q_ref, k_ref, v_ref, ub_ref, um_ref, ul_ref, cu_ref, cuk_ref, kvl_ref, _o_in,
         o_ref) = refs
    else:
        (q_ref, k_ref, v_ref, ub_ref, um_ref, ul_ref, cu_ref, kvl_ref, r2t_ref, ri_ref,
         _o_in, o_ref) = refs
    slot = pl.program_id(0)
    h = pl.program_id(1)
    g_heads = pr.num_q_heads // pr.num_kv_heads
    r, m, d, bn = geo.tile_rows, geo.head_tile, pr.head_dim, geo.block_n
    n_req = pr.requests
    qk_scale = pr.softmax_scale * pr.k_scale * LOG2E  # exp2 is the cheaper PTX path
    fp8 = is_fp8(k_ref.dtype)

    # the request of this slot (``_tiles`` with vector loads: B is static)
    bp = next_pow2(n_req + 1)
    j = lax.broadcasted_iota(jnp.int32, (bp,), 0)
    cu = _compat.load(cu_ref.at[jnp.minimum(j, n_req)], mask=j <= n_req, other=0)
    first = cu // r + j
    b = jnp.sum(((j >= 1) & (j < n_req) & (first <= slot)).astype(jnp.int32), dtype=jnp.int32)
    q_start = cu_ref[b]
    q_len = cu_ref[b + 1] - q_start
    jt = slot - (q_start // r + b)
    q_used = jnp.where((jt >= 0) & (jt * r < q_len), q_len, 0)
    if pr.kind == "ordinary":
        kv_len, base = q_len, q_start
    else:
        kv_len = kvl_ref[b]
        base = cuk_ref[b] if pr.kind == "chunk" else 0
    last_pos = last_position(base, st.kv_rows)
    bound = kv_len
    req_row = 0
    if pr.kind == "paged":
        req_row, bound = request_table(ri_ref, b, kv_len, st.max_reqs, st.max_context)

    n_out = pr.total_q * pr.num_q_heads
    d_row = lax.broadcasted_iota(jnp.int32, (1, d), 1)
    uh = h if pr.per_head_indices else 0
    n_u = jnp.where(q_used > 0, ul_ref[slot, uh], 0)
    cols = lax.broadcasted_iota(jnp.int32, (bn,), 0)
    sub = cols % RATIO
    ent = cols // RATIO
    bu = bn // RATIO

    def load_q(flat, ok, rows):
        """The [rows, D] Q tile at flat rows ``flat`` (masked by ``ok``) and its score scale
        (FP8 K/V: float16 scaled by a power of two, ``qsa_pallas._fp8``)."""
        q = _compat.load(q_ref.at[jnp.clip(flat, 0, n_out - 1)[:, None], d_row],
                         mask=jnp.broadcast_to(ok[:, None], (rows, d)), other=0.0)
        return fp16_query(q, qk_scale) if fp8 else (q, qk_scale)

    def store_out(flat, ok, lanes, acc, l_i):
        flat_out = jnp.clip(flat, 0, n_out - 1)
        if st.interpret:
            # masked-off lanes store to spare rows past the output (one per lane): interpret
            # mode writes a masked lane's old value back, which must not land on a row another
            # lane writes (on the GPU a masked lane writes nothing)
            flat_out = jnp.where(ok, flat_out, n_out + lanes)
        inv = jnp.where(l_i > 0, pr.v_scale / jnp.where(l_i > 0, l_i, 1.0), 0.0)
        _compat.store(o_ref.at[flat_out[:, None], d_row],
                      (acc * inv[:, None]).astype(o_ref.dtype),
                      mask=jnp.broadcast_to(ok[:, None], (acc.shape[0], d)))

    def step(carry, q, qk, tok, tok_ok, member):
        acc, m_i, l_i = carry
        dt = q.dtype  # q's dtype, or float16 with FP8 K/V
        ok = tok_ok & (tok >= 0) & (tok < bound)
        if pr.kind == "paged":
            sl = pool_slot(r2t_ref, req_row, tok, ok, bound, st.max_context, st.kv_rows)
            ok = sl >= 0
            kv = jnp.where(ok, sl, 0)
        else:
            kv = jnp.where(ok & (tok > last_pos), st.kv_rows - 1,
                           jnp.clip(jnp.where(ok, base + tok, 0), 0, st.kv_rows - 1))
        gmask = jnp.broadcast_to(ok[:, None], (tok.shape[0], d))
        k = _compat.load(k_ref.at[kv[:, None], h, d_row], mask=gmask, other=0.0).astype(dt)
        v = _compat.load(v_ref.at[kv[:, None], h, d_row], mask=gmask, other=0.0).astype(dt)
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32) * qk
        s = jnp.where(member & ok[None, :], s, -jnp.inf)
        m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # no -inf - -inf
        alpha = jnp.exp2(m_i - m_use)
        p = jnp.exp2(s - m_use[:, None])
        l_new = l_i * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + jnp.dot(p.astype(dt), v, preferred_element_type=jnp.float32)
        return acc, m_new, l_new

    def init(rows):
        return (jnp.zeros((rows, d), jnp.float32), jnp.full((rows,), -jnp.inf, jnp.float32),
                jnp.zeros((rows,), jnp.float32))

    def union_path():
        mi = lax.broadcasted_iota(jnp.int32, (m,), 0)
        i = mi // g_heads  # dense rows: R x G of the M lanes
        gh = mi % g_heads
        rel = jt * r + i
        row = q_start + rel
        row_ok = (i < r) & (rel >= 0) & (rel < q_used) & (row >= 0) & (row < pr.total_q)
        vis = jnp.maximum(rel + kv_len - q_len + 1, 0)
        flat = row * pr.num_q_heads + h * g_heads + gh
        q, qk = load_q(flat, row_ok, m)
        # causal tails: row i attends [4 * (vis_i // 4), vis_i); for R consecutive rows these
        # lie in one BLOCK_N chunk, walked as the loop's last step (as in qsa_triton.
        # prefill_union: a step after the loop doubles the registers of the compiled kernel)
        vis0 = jnp.maximum(jt * r + kv_len - q_len + 1, 0)
        tail_tok = (vis0 // RATIO) * RATIO + cols
        tail_member = ((tail_tok[None, :] >= ((vis // RATIO) * RATIO)[:, None])
                       & (tail_tok[None, :] < vis[:, None]) & row_ok[:, None])
        # only positions in some row's tail are gathered (4k + 3 is in none): a non-finite K/V
        # row no row names must not reach the dots (0 x NaN)
        tail_ok = jnp.max(tail_member.astype(jnp.int32), axis=0) > 0
        n_steps = (n_u + bu - 1) // bu

        def body(c, carry):
            e = c * bu + ent
            e_ok = e < n_u
            ec = jnp.clip(e, 0, st.union_width - 1)
            blk = _compat.load(ub_ref.at[slot, uh, ec], mask=e_ok, other=0)
            mem = _compat.load(um_ref.at[slot, uh, ec], mask=e_ok, other=0)
            tail = c >= n_steps
            tok = jnp.where(tail, tail_tok, blk * RATIO + sub)
            tok_ok = jnp.where(tail, tail_ok, e_ok)
            member = jnp.where(tail, tail_member, ((mem[None, :] >> i[:, None]) & 1) != 0)
            return step(carry, q, qk, tok, tok_ok, member & row_ok[:, None])

        acc, _, l_i = lax.fori_loop(0, n_steps + 1, body, init(m))
        store_out(flat, row_ok, mi, acc, l_i)

    pl.when(n_u <= st.max_union)(union_path)


def _spare_rows(st: _UStatic) -> int:
    """Rows past the output that take the masked lanes' stores in interpret mode (one per lane
    of the Q tile; none on the GPU)."""
    return st.geo.head_tile if st.interpret else 0


@functools.partial(jax.jit, static_argnames=("st",))
def _launch(q, k, v, base, ublk, umem, ulen, *meta, st: _UStatic):
    pr = st.p
    t, hq, d = q.shape
    q2 = q.reshape(t * hq, d)
    # the per-row kernel's output aliased into this kernel (tiles past the bound and rows of no
    # tile keep it); in interpret mode spare rows at the end take the masked lanes' stores
    out0 = base.reshape(t * hq, d)
    if _spare_rows(st):
        out0 = jnp.concatenate([out0, jnp.zeros((_spare_rows(st), d), q.dtype)])
    args = (q2, k, v, ublk, umem, ulen, *meta, out0)
    out = _compat.triton_call(
        functools.partial(_union_kernel, st=st),
        out_shape=jax.ShapeDtypeStruct(out0.shape, q.dtype),
        grid=(ulen.shape[0], pr.num_kv_heads),
        num_warps=st.geo.num_warps, num_stages=st.geo.num_stages,
        interpret=st.interpret, input_output_aliases={len(args) - 1: 0},
        name=f"qsa_sparse_prefill_union_{pr.kind}",
    )(*args)
    return out[: t * hq].reshape(t, hq, d)


def union_build(problem, block_indices, meta: dict, geo: UnionGeometry):
    """The union build of one checked call (``problem`` with width NB; ``meta``: the entry
    point's other arrays by name, ``cu_seqlens_q`` first) under ``geo`` ("union"): (blocks,
    masks, lengths as ``block_union``, max_union: ``interop.geometry.max_union_entries``)."""
    g = problem.group
    if geo.kind != "union" or geo.head_tile < geo.tile_rows * g or geo.block_n < geo.tile_rows + 3:
        raise ValueError(f"union geometry {geo} cannot hold {geo.tile_rows} rows x {g} heads")
    ublk, umem, ulen = block_union(block_indices, meta["cu_seqlens_q"], meta.get("kv_lens"),
                                   geo.tile_rows)
    # a union has at most R x NB entries: a larger bound means "never"
    max_union = min(max_union_entries(geo, int(block_indices.shape[-1]), max(16, next_pow2(g))),
                    REPEATED_TILE - 1)
    return ublk, umem, ulen, max_union


def union_run(problem, q, k, v, out, union, meta: dict, geo: UnionGeometry, *,
              interpret: bool):
    """The tile-union kernel of one checked call over ``out`` (the per-row kernel's output, [T,
    Hq, D] in q's dtype; rows of tiles past the bound keep it), ``union`` from ``union_build``.
    Returns [T, Hq, D] in q's dtype."""
    ublk, umem, ulen, max_union = union
    cu = meta["cu_seqlens_q"]
    kv_lens = meta.get("kv_lens")
    r2t = meta.get("req_to_token")
    st = _UStatic(dataclasses.replace(problem, max_seqlen_q=1),
                  dataclasses.replace(geo, source=""), int(ublk.shape[-1]), max_union,
                  int(k.shape[0]),
                  int(r2t.shape[0]) if r2t is not None else 0,
                  int(r2t.shape[1]) if r2t is not None else 0, bool(interpret))
    if problem.kind == "ordinary":
        rest = (cu,)
    elif problem.kind == "chunk":
        rest = (cu, meta["cu_seqlens_k"], kv_lens)
    else:
        rest = (cu, kv_lens, r2t, meta["req_indices"])
    return _launch(q, k, v, out, ublk, umem, ulen, *rest, st=st)
