"""Paged sparse decode (``qsa-contract.md`` §2b, §2c; issue 16) in both packages.

CPU (default; Triton interpreter in fp16, Pallas interpret mode, D = 64, W ~ 70): both packages
against ``interop.reference.decode_paged_reference`` (float64) and each other, for (24,2) (with
per-KV-head indices), (12,1), (6,1), (3,1); every case carries junk entries (-1, -7, seq_len,
seq_len + 19) at the front, middle and end of its rows, duplicates, an empty row (exact zeros),
MTP verify rows sharing a request, NaN / Inf in every pool slot no valid entry names, and lying
metadata (a seq_len past the table's width with an entry there, table slots past the pool and
negative, a request index past the table): such entries are invalid, never read. Also: FP8
pools with k_scale / v_scale, forced plans (one split, many splits with empty ones),
batch-invariant bits across batch compositions and row orders, jit with new device metadata and
no retrace, torch.library opcheck and torch.compile tracing, contract errors (identical text in
both packages), zero-size inputs, the Pallas FP8 offset limit, the benchmark sweep's ``ahead``
launch variant (the base kernel's bits), and the pool-mode bench smoke path. A NaN in a slot a
valid entry names (K, V, a q element, a V element in splits whose merge weight underflows)
gives NaN exactly where the reference does with one split, the default plan's several and the
batch-invariant plan's (slots no valid entry names, free or owned, hold NaN / Inf and never
reach the output). The packed decode's batch-invariant mode: both packages against the
reference and each other, the flag through the torch.library op (opcheck) and torch.compile,
and under jax.jit (its bitwise tests are in ``tests/conformance.py``).
(``max_seqlen_k`` does not exist in the paged API: nothing there to vary.)

GPU (``-m gpu``, the H200): production shapes (D = 256, W = 2051, bf16, TP1/TP2/TP4, R 1/16/128)
vs the reference, FP8 pools, a pool past 4.2M slots at Hkv = 2 (int32 offsets overflow),
CUDA-graph replay with changed indices / seq_lens / req_indices, graphs for every R in 1..128
captured in sequence then replayed, every launch variant of the sweep bitwise equal to the base
kernel (eager and graphed), torch.compile(fullgraph=True), lying metadata giving the same output
from both implementations, batch invariance at production shapes, attended NaN in the paged and
the packed decode on compiled kernels (one split, many, the in-launch merge, batch-invariant),
the packed decode's batch-invariant mode under CUDA-graph replay with new lengths and
torch.compile, and ``memcheck`` cases to run under compute-sanitizer.

Acceptance (qsa-contract.md §6): rtol = atol = 2e-2 elementwise and relative L2 <= 5e-3.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import qsa_pallas  # noqa: E402
import qsa_triton  # noqa: E402
from interop.contract import ContractError, check_decode, check_decode_paged  # noqa: E402
from interop.plan import (BATCH_INVARIANT_SPLIT_COLS, PagedDecodePlan,  # noqa: E402
                                 paged_smem_bytes, plan_decode_paged)
from interop.indices import (PAGED_JUNK, PAGED_JUNK_AT, paged_decode_case,  # noqa: E402
                             resolve_paged_slots)
from interop.reference import decode_paged_reference, rel_l2  # noqa: E402
from qsa_pallas import decode_paged as pdp  # noqa: E402
from qsa_triton import decode_paged as tdp  # noqa: E402

RTOL = ATOL = 2e-2
REL_L2 = 5e-3
ON_GPU = torch.cuda.is_available()
FP8 = torch.float8_e4m3fn


# ---------------------------------------------------------------------------------------------
# helpers
@dataclasses.dataclass
class Inputs:
    """numpy inputs of one call (pool already holding NaN/Inf where nothing valid points)."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    table: np.ndarray
    req: np.ndarray
    idx: np.ndarray
    seq: np.ndarray
    empty: tuple  # rows that must come out exactly 0

    def args(self):
        return (self.q, self.k, self.v, self.table, self.req, self.idx, self.seq)


def make_inputs(pair, *, d=64, width=70, contexts=(40, 90, 13), rows_per_request=2,
                per_head=False, seed=0, lying=True) -> Inputs:
    hq, hkv = pair
    c = paged_decode_case(contexts, width=width, rows_per_request=rows_per_request,
                          junk=PAGED_JUNK, junk_at=PAGED_JUNK_AT, n_junk=2, duplicates=2,
                          empty_rows=[1], num_kv_heads=hkv if per_head else None, seed=seed)
    table, req, seq, idx = (x.copy() for x in (c.req_to_token, c.req_indices, c.seq_lens,
                                               c.indices))
    empty = [1]
    if lying:
        r0 = 0
        # a seq_len past the table's width, with an entry between the width and seq_len (the
        # last column): invalid, never read from the table. (Row 0's junk at or past its old
        # length becomes -7 first: under the new length it would be a valid entry naming the
        # padding slot, which holds NaN.)
        row0 = idx[r0]
        row0[row0 >= c.seq_lens[r0]] = -7
        seq[r0] = table.shape[1] + 40
        idx[r0, ..., -1] = table.shape[1] + 3
        # two valid entries of row 0 whose slots lie outside the pool: invalid, never read
        first = idx[r0] if idx.ndim == 2 else idx[r0, 0]
        pos = np.unique(first[(first >= 0) & (first < c.seq_lens[r0])])[:2]
        table[req[r0], pos[0]] = c.pool_slots + 5
        table[req[r0], pos[1]] = -3
        # the last row names a request past the table: no valid entry at all
        req[-1] = table.shape[0] + 1
        empty.append(len(req) - 1)
    rng = np.random.default_rng(seed + 100)
    q = rng.standard_normal((len(req), hq, d), np.float32).astype(np.float16)
    k = rng.standard_normal((c.pool_slots, hkv, d), np.float32).astype(np.float16)
    v = rng.standard_normal((c.pool_slots, hkv, d), np.float32).astype(np.float16)
    k[~c.owned] = np.nan  # slot 0 (padding) and every slot no request owns
    v[~c.owned] = np.inf
    return Inputs(q, k, v, table, req, idx, seq, tuple(empty))


def reference(x: Inputs, k_scale=1.0, v_scale=1.0, k=None, v=None):
    k = x.k if k is None else k
    v = x.v if v is None else v
    return decode_paged_reference(x.q.astype(np.float32), np.asarray(k, np.float32),
                                  np.asarray(v, np.float32), x.table, x.req, x.idx, x.seq,
                                  None, k_scale, v_scale)


def assert_close(out, ref, empty=()):
    out = np.asarray(out, np.float64)
    assert np.isfinite(out).all(), "non-finite output"
    err = np.abs(out - ref)
    assert (err <= ATOL + RTOL * np.abs(ref)).all(), f"max abs err {err.max():.3e}"
    assert rel_l2(out, ref) <= REL_L2, rel_l2(out, ref)
    for r in empty:
        assert (out[r] == 0).all(), f"row {r} not exactly 0"


def t_args(x: Inputs, kv_dtype=None):
    a = [torch.from_numpy(np.ascontiguousarray(t)) for t in x.args()]
    if kv_dtype is not None:
        a[1], a[2] = a[1].to(kv_dtype), a[2].to(kv_dtype)
    return a


def j_args(x: Inputs, kv_dtype=None):
    a = [jnp.asarray(t) for t in x.args()]
    if kv_dtype is not None:
        a[1], a[2] = a[1].astype(kv_dtype), a[2].astype(kv_dtype)
    return a


def run_triton(x: Inputs, *extra, plan=None, **kw):
    if plan is not None:
        return tdp.decode_paged_with_plan(*t_args(x), *extra, plan=plan).float().numpy()
    return qsa_triton.sparse_decode_paged(*t_args(x), *extra, **kw).float().numpy()


def run_pallas(x: Inputs, *extra, plan=None, **kw):
    if plan is not None:
        return np.asarray(pdp.decode_paged_with_plan(*j_args(x), *extra, plan=plan), np.float32)
    return np.asarray(qsa_pallas.sparse_decode_paged(*j_args(x), *extra, **kw), np.float32)


def bits(a) -> np.ndarray:
    if isinstance(a, torch.Tensor):
        return a.view(torch.int16).numpy()
    return np.asarray(a).view(np.uint16)


def test_plan_for_twins_share_one_signature():
    """Both packages' paged ``plan_for`` take the packed decodes' shape-based form (R, Hkv, G,
    D, W, device; dtypes and batch_invariant by keyword) and return the shared planner's plan
    for their backend (on a CPU: the H200's 132 SMs)."""
    import inspect

    from qsa_pallas import decode as pd
    from qsa_triton import decode as td

    names = lambda f: list(inspect.signature(f).parameters)  # noqa: E731
    assert names(tdp.plan_for) == names(pdp.plan_for) == [
        "rows", "num_kv_heads", "group", "head_dim", "width", "device", "q_dtype", "kv_dtype",
        "batch_invariant"]
    assert names(td.plan_for) == names(pd.plan_for)
    assert tdp.plan_for(4, 2, 12, 256, 2051, "cpu") == plan_decode_paged(4, 2, 12, 256, 2051, 132)
    assert pdp.plan_for(4, 2, 12, 256, 2051) == plan_decode_paged(4, 2, 12, 256, 2051, 132,
                                                                 backend="pallas")
    # stages (H200: two programs an SM): 7 where every program streams >= 2 chunks; programs of
    # one or two chunks (B = 1, 65 splits of 65 chunks; R x Hkv = 8, 33 splits) none in Triton,
    # 3 in Pallas (its splits are capped at 16: a deep pipeline there, fitted to sm_12x)
    h200 = dict(device_smem=232_448)
    stages = lambda *a, **k: (lambda p: (p.num_splits, p.num_stages))(  # noqa: E731
        plan_decode_paged(*a, 132, **h200, **k))
    assert stages(1, 2, 12, 256, 2051) == (65, 1)
    assert stages(4, 2, 12, 256, 2051) == (33, 1)
    assert stages(8, 2, 12, 256, 2051) == (16, 7)
    splits, deep = stages(1, 2, 12, 256, 2051, backend="pallas")
    assert splits == 16 and deep > 3
    assert stages(1, 2, 12, 64, 70, backend="pallas") == (2, 3)  # 2 chunks, 2 splits
    assert stages(1, 2, 12, 64, 70) == (2, 1)
    fp8 = dict(q_bytes=2, kv_bytes=1, batch_invariant=True)
    assert (tdp.plan_for(3, 1, 12, 256, 2051, q_dtype=torch.float16,
                         kv_dtype=torch.float8_e4m3fn, batch_invariant=True)
            == plan_decode_paged(3, 1, 12, 256, 2051, 132, **fp8))



# ---------------------------------------------------------------------------------------------
# CPU: values
@pytest.mark.parametrize("pair", [(24, 2), (12, 1), (6, 1), (3, 1)])
def test_both_packages_match_reference(pair):
    """Junk at front/middle/end, duplicates, an empty row, verify rows sharing a request,
    NaN/Inf free slots, lying metadata; per-KV-head indices for (24,2); the default plan
    (2 splits of W = 70 here: the merge runs)."""
    x = make_inputs(pair, per_head=pair == (24, 2), seed=sum(pair))
    assert len(set(x.req[:-1].tolist())) < len(x.req) - 1  # verify rows share requests
    assert plan_decode_paged(len(x.req), pair[1], pair[0] // pair[1], 64, 70).num_splits == 2
    ref = reference(x)
    out_t, out_p = run_triton(x), run_pallas(x)
    assert_close(out_t, ref, x.empty)
    assert_close(out_p, ref, x.empty)
    assert np.abs(out_t - out_p).max() <= 2e-3  # the two packages agree


@pytest.mark.parametrize("pkg", ["triton", "pallas"])
def test_fp8_pool_with_scales(pkg):
    """FP8 e4m3 pools: tiles converted to q's dtype; k_scale on the scores, v_scale on P·V."""
    x = make_inputs((24, 2), seed=7)
    kf = torch.from_numpy(x.k).to(FP8)
    vf = torch.from_numpy(x.v).to(FP8)
    ref = reference(x, 0.5, 2.0, k=kf.float().numpy(), v=vf.float().numpy())
    if pkg == "triton":
        a = t_args(x, FP8)
        out = qsa_triton.sparse_decode_paged(*a, None, 0.5, 2.0).float().numpy()
    else:
        a = j_args(x, jnp.float8_e4m3fn)
        out = np.asarray(qsa_pallas.sparse_decode_paged(*a, None, 0.5, 2.0), np.float32)
    assert_close(out, ref, x.empty)


@pytest.mark.parametrize("splits", [1, 5])
def test_forced_plans(splits):
    """BLOCK_N 16 over W = 70: one split (the split kernel writes the output) and 5 splits of
    one chunk each (splits holding only junk write empty partials the merge weighs 0)."""
    x = make_inputs((12, 1), seed=11)
    plan = PagedDecodePlan(16, 16, splits, 4, 2)
    ref = reference(x)
    out_t, out_p = run_triton(x, plan=plan), run_pallas(x, plan=plan)
    assert_close(out_t, ref, x.empty)
    assert_close(out_p, ref, x.empty)


# ---------------------------------------------------------------------------------------------
# CPU: batch-invariant mode
def _bi_pool(seed=3):
    """A pool and table for 6 requests; rows are picked from them by the test."""
    c = paged_decode_case((300, 290, 150, 40, 310, 0), width=300, junk=("-1", "len"),
                          junk_at=("middle",), duplicates=1, seed=seed)
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((6, 24, 64), np.float32).astype(np.float16)
    k = rng.standard_normal((c.pool_slots, 2, 64), np.float32).astype(np.float16)
    v = rng.standard_normal((c.pool_slots, 2, 64), np.float32).astype(np.float16)
    k[~c.owned] = np.nan
    return c, q, k, v


@pytest.mark.parametrize("pkg", ["triton", "pallas"])
def test_batch_invariant_bits(pkg):
    """batch_invariant=True: a row's bits are the same in a batch of 6, in a permuted batch of 6
    and in a batch of 4 with other neighbours (an empty row among them); the plan has 2 splits
    at W = 300 (the merge runs) whatever R is; values match the reference."""
    c, q, k, v = _bi_pool()
    assert plan_decode_paged(6, 2, 12, 64, 300, batch_invariant=True).num_splits == \
        plan_decode_paged(1, 2, 12, 64, 300, batch_invariant=True).num_splits == \
        -(-300 // BATCH_INVARIANT_SPLIT_COLS) == 2

    def call(rows):
        rows = np.asarray(rows)
        x = Inputs(q[rows], k, v, c.req_to_token, c.req_indices[rows], c.indices[rows],
                   c.seq_lens[rows], ())
        if pkg == "triton":
            out = qsa_triton.sparse_decode_paged(*t_args(x), batch_invariant=True)
        else:
            out = qsa_pallas.sparse_decode_paged(*j_args(x), batch_invariant=True)
        return x, out

    x_all, base = call(range(6))
    assert_close(np.asarray(base.float() if pkg == "triton" else base, np.float32),
                 reference(x_all), (5,))
    perm = [5, 3, 0, 1, 4, 2]
    _, permuted = call(perm)
    sub = [2, 5, 0, 4]
    _, subset = call(sub)
    bb = bits(base)
    for i, r in enumerate(perm):
        assert np.array_equal(bits(permuted)[i], bb[r]), f"row {r} at position {i}"
    for i, r in enumerate(sub):
        assert np.array_equal(bits(subset)[i], bb[r]), f"row {r} in the 4-row batch"


# ---------------------------------------------------------------------------------------------
# CPU: an attended NaN reaches the output whatever the split count (qsa-contract.md §2b)
def _nan_inputs():
    """(24, 2) with per-KV-head indices, W = 300 (5 chunks of 64 columns), make_inputs' junk,
    lying metadata and NaN / Inf in every slot no request owns; then NaN / Inf also in owned
    slots no valid entry names, and NaN where valid entries point:
      * row 3 (request 1), KV head 0: one K element of a slot named past column 128 (every
        query head of the group scores NaN there);
      * row 4 (request 2, 13 tokens), KV head 1: one V element (column 9) of a named slot;
      * row 0, query head 20: one q element (every split of that head gets a NaN LSE);
      * row 2 (request 1), KV head 1: q = 4 everywhere and K = +4 on the slots named in columns
        < 64 only, K = -4 on the rest, so its splits past column 128 score 256 below (their
        merge weight underflows to 0 in FP32, not in the FP64 reference), and a NaN V element
        (column 11) of a slot named there.
    Returns (Inputs, the reference, its NaN mask)."""
    x = make_inputs((24, 2), width=300, contexts=(40, 330, 13), per_head=True, seed=23)
    slots = resolve_paged_slots(x.table, x.req, x.idx, x.seq, x.k.shape[0])  # [R, Hkv, W]
    named = np.zeros(x.k.shape[0], bool)
    named[slots[slots >= 0]] = True
    x.k[~named], x.v[~named] = np.nan, np.inf  # owned slots too, when nothing valid names them
    s2 = slots[2, 1]
    hi = np.setdiff1d(s2[:64][s2[:64] >= 0], s2[128:][s2[128:] >= 0])
    lo = np.setdiff1d(s2[s2 >= 0], hi)
    assert hi.size and lo.size
    x.q[2, 12:] = 4.0
    x.k[hi, 1], x.k[lo, 1] = 4.0, -4.0
    x.v[s2[128:][s2[128:] >= 0][0], 1, 11] = np.nan
    s3 = slots[3, 0, 128:]
    x.k[s3[s3 >= 0][3], 0, 5] = np.nan
    s4 = slots[4, 1]
    x.v[s4[s4 >= 0][2], 1, 9] = np.nan
    x.q[0, 20, 3] = np.nan
    ref = reference(x)
    nan = np.isnan(ref)
    assert nan[3, :12].all() and nan[4, 12:, 9].all() and nan[0, 20].all() and nan[2, 12:, 11].all()
    assert (~nan).sum() > nan.sum()  # most of the output stays finite
    return x, ref, nan


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreters' NaN arithmetic
@pytest.mark.parametrize("mode", ["one-split", "default", "batch-invariant"])
@pytest.mark.parametrize("pkg", ["triton", "pallas"])
def test_attended_nan_reaches_output(pkg, mode):
    """NaN in a pool slot a valid entry names (K, V, a q element, and a V element in splits
    whose merge weight underflows) gives NaN exactly where the FP64 reference does: with one
    split (``plan_decode_paged`` for one SM), with the default plan (5 splits here) and with the
    batch-invariant plan (2 splits); NaN / Inf in slots no valid entry names (free or owned) never
    reach the output, which matches the reference everywhere else."""
    x, ref, nan = _nan_inputs()
    r, hkv = len(x.req), 2
    if mode == "one-split":
        plan = plan_decode_paged(r, hkv, 12, 64, 300, sm_count=1,
                                 backend="pallas" if pkg == "pallas" else "triton")
        assert plan.num_splits == 1
        out = (run_triton if pkg == "triton" else run_pallas)(x, plan=plan)
    else:
        bi = mode == "batch-invariant"
        assert plan_decode_paged(r, hkv, 12, 64, 300, batch_invariant=bi).num_splits == \
            (2 if bi else 5)
        out = (run_triton if pkg == "triton" else run_pallas)(x, batch_invariant=bi)
    assert np.array_equal(np.isnan(out), nan), np.argwhere(np.isnan(out) != nan)[:4].tolist()
    fin = ~nan
    out64 = np.asarray(out, np.float64)
    assert np.isfinite(out64[fin]).all()
    err = np.abs(out64[fin] - ref[fin])
    assert (err <= ATOL + RTOL * np.abs(ref[fin])).all(), err.max()
    for e in x.empty:
        assert (out[e] == 0).all()


# ---------------------------------------------------------------------------------------------
# CPU: frameworks
def test_pallas_jit_new_metadata_no_retrace():
    """Under jax.jit the lengths, positions and request indices are device data: new values
    reuse the compiled function and give the new answer."""
    x = make_inputs((6, 1), seed=21, lying=False)
    perm = np.array([3, 5, 0, 2, 4, 1])  # other rows' requests, positions and lengths
    y = dataclasses.replace(x, req=x.req[perm], idx=x.idx[perm],
                            seq=np.maximum(x.seq[perm] - 3, 0).astype(np.int32), empty=(5,))
    traces = []

    def f(*a):
        traces.append(1)
        return qsa_pallas.sparse_decode_paged(*a)

    jf = jax.jit(f)
    for inp in (x, y):
        assert_close(np.asarray(jf(*j_args(inp)), np.float32), reference(inp), inp.empty)
    assert len(traces) == 1


def test_triton_opcheck_and_compile_trace():
    x = make_inputs((12, 1), d=32, width=20, contexts=(12, 30), rows_per_request=1, seed=5,
                    lying=False)
    a = t_args(x)
    torch.library.opcheck(torch.ops.qsa.sparse_decode_paged.default,
                          (*a, 32 ** -0.5, 1.0, 1.0, False))

    def f(*t):
        return qsa_triton.sparse_decode_paged(*t) * 2.0

    torch._dynamo.reset()
    assert torch.equal(torch.compile(f, fullgraph=True, backend="aot_eager")(*a), f(*a))


# ---------------------------------------------------------------------------------------------
# CPU: the packed decode's batch-invariant mode (issue 16 item 2) across packages and frameworks
# (its bitwise tests per package: tests/conformance.py, test_batch_invariant_bits)
def _packed_case(lens, hq=12, hkv=1, d=64, seed=31):
    """Packed decode inputs (numpy: q, k, v, cu_seqlens_q, cu_seqlens_k); the query rows in
    reverse order (cu_seqlens_q), two K/V rows after the last key no row names."""
    rng = np.random.default_rng(seed)
    cu_k = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    cap = int(cu_k[-1]) + 2
    q = rng.standard_normal((len(lens), hq, d), np.float32).astype(np.float16)
    k = rng.standard_normal((cap, hkv, d), np.float32).astype(np.float16)
    v = rng.standard_normal((cap, hkv, d), np.float32).astype(np.float16)
    cu_q = np.append(np.arange(len(lens))[::-1], len(lens)).astype(np.int32)
    return q, k, v, cu_q, cu_k


def test_packed_batch_invariant_packages_agree():
    """``sparse_decode(..., batch_invariant=True)``: both packages match the FP64 reference and
    each other (rows of 1..3 splits of 256 keys, an empty row, query rows read out of order)."""
    from interop.reference import decode_reference  # noqa: PLC0415

    case = _packed_case([600, 0, 300, 17, 257])
    ref = decode_reference(*case)
    out_t = qsa_triton.sparse_decode(*[torch.from_numpy(a) for a in case], 600,
                                     batch_invariant=True).float().numpy()
    out_p = np.asarray(qsa_pallas.sparse_decode(*[jnp.asarray(a) for a in case], 600,
                                                batch_invariant=True), np.float32)
    assert_close(out_t, ref, (1,))
    assert_close(out_p, ref, (1,))
    assert np.abs(out_t - out_p).max() <= 2e-3


def test_packed_batch_invariant_op_and_compile():
    """The flag travels through the registered op (opcheck: schema, fake impl, both values of the
    flag) and a torch.compile(fullgraph=True) trace gives the eager bits."""
    a = [torch.from_numpy(x) for x in _packed_case([70, 0, 300])]
    for bi in (False, True):
        torch.library.opcheck(torch.ops.qsa.sparse_decode.default, (*a, 300, 0.125, bi))

    def f(*t):
        return qsa_triton.sparse_decode(*t, 300, batch_invariant=True) * 2.0

    torch._dynamo.reset()
    assert torch.equal(torch.compile(f, fullgraph=True, backend="aot_eager")(*a), f(*a))
    with pytest.raises(ContractError, match="batch_invariant"):
        qsa_triton.sparse_decode(*a, 300, batch_invariant=1)
    with pytest.raises(ContractError, match="batch_invariant"):
        qsa_pallas.sparse_decode(*[jnp.asarray(t.numpy()) for t in a], 300, batch_invariant=1)


def test_pallas_packed_batch_invariant_jit():
    """Under jax.jit (``batch_invariant`` and ``max_seqlen_k`` static) new lengths reuse the
    compiled function and give each row the bits it has alone."""
    import functools  # noqa: PLC0415

    q, k, v, cu_q, cu_k = (jnp.asarray(x) for x in _packed_case([300, 0, 40]))
    traces = []

    def f(*t):
        traces.append(1)
        return qsa_pallas.sparse_decode(*t, 512, batch_invariant=True)

    jf = jax.jit(f)
    first = np.asarray(jf(q, k, v, cu_q, cu_k))
    cu_k2 = jnp.asarray(np.array([0, 0, 300, 340], np.int32))  # row 0 <-> row 1 lengths
    second = np.asarray(jf(q, k, v, cu_q, cu_k2))
    assert len(traces) == 1
    alone = functools.partial(qsa_pallas.sparse_decode, max_seqlen_k=300, batch_invariant=True)
    for out, cu in ((first, cu_k), (second, cu_k2)):
        for s in range(3):  # row s alone: its q row, its keys, nothing else
            lo, hi = int(cu[s]), int(cu[s + 1])
            one = alone(q[int(cu_q[s])][None], k[lo:hi + 1], v[lo:hi + 1],
                        jnp.asarray([0, 1], jnp.int32), jnp.asarray([0, hi - lo], jnp.int32))
            assert np.array_equal(bits(out[s]), bits(np.asarray(one)[0])), s


# ---------------------------------------------------------------------------------------------
# CPU: contract
def _small():
    return make_inputs((12, 1), d=32, width=20, contexts=(12, 30), rows_per_request=1, seed=9,
                       lying=False)


@pytest.mark.parametrize("mutate, arg", [
    (lambda a: a.__setitem__(5, a[5].astype(np.int16)), "indices"),
    (lambda a: a.__setitem__(3, a[3][None]), "req_to_token"),
    (lambda a: a.__setitem__(4, a[4][:1]), "req_indices"),
    (lambda a: a.__setitem__(6, a[6].astype(np.float32)), "seq_lens"),
    (lambda a: a.__setitem__(2, a[2][:, :, :16]), "v_cache"),
    (lambda a: a.__setitem__(1, a[1].astype(np.float32)), "k_cache"),
    (lambda a: a.__setitem__(5, np.repeat(a[5][:, None], 3, 1)), "indices"),
])
def test_bad_calls_same_error_in_both_packages(mutate, arg):
    a = list(_small().args())
    mutate(a)
    msgs = []
    with pytest.raises(ContractError) as e:
        qsa_triton.sparse_decode_paged(*[torch.from_numpy(np.ascontiguousarray(t)) for t in a])
    msgs.append(str(e.value))
    with pytest.raises(ContractError) as e:
        qsa_pallas.sparse_decode_paged(*[jnp.asarray(t) for t in a])
    msgs.append(str(e.value))
    assert e.value.arg == arg and "Qualified envelope" in msgs[0]
    assert msgs[0].replace("cpu", "") == msgs[1].replace("cpu", ""), msgs


def test_contract_scales_grad_strict():
    x = _small()
    a = t_args(x)
    with pytest.raises(ContractError, match="k_scale"):
        qsa_triton.sparse_decode_paged(*a, None, 2.0, 1.0)  # scales only with an FP8 pool
    q = a[0].clone().requires_grad_()
    with pytest.raises(ContractError, match="requires_grad") as e:
        qsa_triton.sparse_decode_paged(q, *a[1:])
    assert e.value.arg == "q"
    with pytest.raises(ContractError, match="head dim D = 256"):
        qsa_triton.sparse_decode_paged(*a, strict=True)
    with pytest.raises(ContractError, match="batch_invariant"):
        check_decode_paged(*a, batch_invariant=1)
    # (3,1): default mode yes, strict no; R and W envelopes in strict mode
    q3 = np.zeros((2, 3, 256), np.float16)
    k3 = np.zeros((10, 1, 256), np.float16)
    meta = (np.zeros((2, 8), np.int32), np.zeros(2, np.int32), np.zeros((2, 5), np.int32),
            np.zeros(2, np.int32))
    check_decode_paged(q3, k3, k3, *meta)
    with pytest.raises(ContractError, match=r"\(Hq, Hkv\)"):
        check_decode_paged(q3, k3, k3, *meta, strict=True)
    q24, k24 = np.zeros((513, 24, 256), np.float16), np.zeros((10, 2, 256), np.float16)
    big = (np.zeros((2, 8), np.int32), np.zeros(513, np.int32), np.zeros((513, 5), np.int32),
           np.zeros(513, np.int32))
    check_decode_paged(q24, k24, k24, *big)
    with pytest.raises(ContractError, match="R query rows"):
        check_decode_paged(q24, k24, k24, *big, strict=True)
    wide = (meta[0], meta[1], np.zeros((2, 2056), np.int32), meta[3])
    with pytest.raises(ContractError, match="W in"):
        check_decode_paged(q24[:2], k24, k24, *wide, strict=True)


def test_zero_size_inputs():
    """An empty pool: every row is empty (zeros, no launch); zero-size tensors pass the stride
    checks whatever their strides (issue 16 item 4), in the packed decode too. W = 0 index
    columns are refused as in the prefill (the contract's W >= 1)."""
    x = _small()
    a = t_args(x)
    w0 = torch.empty((a[0].shape[0], 0), dtype=torch.int32)
    with pytest.raises(qsa_triton.ContractError, match="W >= 1") as info:
        qsa_triton.sparse_decode_paged(*a[:5], w0, a[6])
    assert info.value.arg == "indices"
    ja = j_args(x)
    with pytest.raises(qsa_pallas.ContractError, match="W >= 1"):
        qsa_pallas.sparse_decode_paged(*ja[:5], jnp.asarray(w0.numpy()), ja[6])
    k0 = torch.empty_strided((0, 1, 32), (0, 0, 0), dtype=torch.float16)
    assert (qsa_triton.sparse_decode_paged(a[0], k0, k0, *a[3:]) == 0).all()
    k0j = jnp.zeros((0, 1, 32), jnp.float16)
    assert (np.asarray(qsa_pallas.sparse_decode_paged(ja[0], k0j, k0j, *ja[3:])) == 0).all()
    # a T = 0 array from numpy with strides [0, 0, 0] (packed decode, C = 0)
    knp = np.lib.stride_tricks.as_strided(np.zeros(1, np.float16), (0, 1, 32), (0, 0, 0))
    q = np.zeros((2, 12, 32), np.float16)
    cu = np.zeros(3, np.int32)
    check_decode(q, knp, knp, np.arange(3, dtype=np.int32), cu, 1)
    check_decode_paged(q, knp, knp, *x.args()[3:])


def test_pallas_stop_gradient_inputs_make_a_constant():
    """Inside a differentiated function, inputs under ``jax.lax.stop_gradient`` make the call a
    constant (zero tangent) with the forward result; a live tangent is refused
    (tests/test_package_api.py)."""
    ja = j_args(_small())
    out = qsa_pallas.sparse_decode_paged(*ja)

    def f(q):
        y = qsa_pallas.sparse_decode_paged(jax.lax.stop_gradient(q), *ja[1:])
        return y.astype(jnp.float32).sum() * 0 + (q.astype(jnp.float32) ** 2).sum(), y

    (val, y), grad = jax.value_and_grad(f, has_aux=True)(ja[0])
    assert np.array_equal(np.asarray(y), np.asarray(out))
    np.testing.assert_allclose(np.asarray(grad, np.float32),
                               2 * np.asarray(ja[0], np.float32), rtol=1e-2)


def test_pallas_fp8_pool_int32_offset_limit():
    """An FP8 pool of more than 2**31 elements (up to 2**32 bytes) would wrap the lowering's
    int32 offsets: refused; exactly 2**31 elements still fit (shape-only, under jax.eval_shape:
    nothing is allocated)."""
    sds = jax.ShapeDtypeStruct
    meta = (sds((1, 64), jnp.int32), sds((1,), jnp.int32), sds((1, 64), jnp.int32),
            sds((1,), jnp.int32))
    q = sds((1, 24, 256), jnp.bfloat16)
    big = sds((4_200_000, 2, 256), jnp.float8_e4m3fn)  # 2.15e9 elements, 2.15 GB
    with pytest.raises(ContractError, match="at most 2\\*\\*31") as e:
        jax.eval_shape(qsa_pallas.sparse_decode_paged, q, big, big, *meta)
    assert e.value.arg == "k_cache"
    edge = sds((2**31 // 512, 2, 256), jnp.float8_e4m3fn)  # 2**31 elements exactly
    assert jax.eval_shape(qsa_pallas.sparse_decode_paged, q, edge, edge, *meta).shape == q.shape


def test_plan_rules():
    sms = 132
    assert plan_decode_paged(1, 2, 12, 256, 2051, sms).num_splits == 65  # one chunk per split
    assert plan_decode_paged(16, 2, 12, 256, 2051, sms).num_splits == 4
    assert plan_decode_paged(66, 2, 12, 256, 2051, sms).num_splits == 1  # R x Hkv >= SMs
    for r in (1, 7, 128, 512):
        p = plan_decode_paged(r, 2, 12, 256, 2051, sms, batch_invariant=True)
        assert (p.num_splits, p.block_n) == (9, 32)
        assert p == plan_decode_paged(r, 2, 12, 256, 2051, 48, batch_invariant=True)
    for kb in (1, 2):
        for r in range(1, 513, 37):
            p = plan_decode_paged(r, 1, 12, 256, 2051, 188, kv_bytes=kb)
            assert paged_smem_bytes(p, 256, 2, kb) <= 101_376
    p = plan_decode_paged(1, 2, 12, 256, 2051)
    ranges = [p.chunk_range(2051, j) for j in range(p.num_splits)]
    assert ranges[0][0] == 0 and ranges[-1][1] == 65
    assert all(a[1] == b[0] and a[1] > a[0] for a, b in zip(ranges, ranges[1:]))


def test_reference_rule_against_slots():
    """The reference's validity rule (``resolve_paged_slots``): the lying entries are invalid."""
    x = make_inputs((12, 1), seed=2)
    s = resolve_paged_slots(x.table, x.req, x.idx, x.seq, x.k.shape[0])
    assert (s[-1] < 0).all() and (s[1] < 0).all()
    assert ((s < 0) | np.isfinite(x.k[np.maximum(s, 0), 0, 0])).all()  # never a NaN slot
    assert (s[0] >= 0).sum() < (x.idx[0] >= 0).sum()


def test_bench_smoke_cpu(tmp_path):
    """``bench.decode --mode pool --smoke-cpu``: junk rows, NaN free slots, a bf16 and an FP8
    pool, MTP rows; every provider that can run here passes its check against the pool
    reference (upstream's need the peer)."""
    from bench import decode  # noqa: PLC0415

    path = tmp_path / "pool.json"
    rc = decode.main(["--mode", "pool", "--smoke-cpu", "--json", str(path),
                      "--providers", "upstream-step,jax-step,paged,pallas-paged"])
    rep = json.loads(path.read_text())
    assert rc == 0 and rep["ran"][-3:] == ["jax-step", "paged", "pallas-paged"]
    assert {c["kv"] for c in rep["cases"]} == {"bf16", "fp8"}
    for case in rep["cases"]:
        assert case["valid_entries"] > 0 and case["bytes"] > 0
        for name in rep["ran"]:
            assert case["providers"][name]["ok"], (name, case["providers"][name])


# =============================================================================================
# GPU tests (H200): pytest -m gpu tests/test_paged_decode.py
def gpu(fn):
    return pytest.mark.gpu(pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")(fn))


CUDA = torch.device("cuda") if ON_GPU else None
TP = {"TP1": (24, 2), "TP2": (12, 1), "TP4": (6, 1)}


def gpu_case(tp, rows, *, page_size=64, pool_slots=None, junk=True, seed=0, per_head=False,
             rows_per_request=1, high_slots=False):
    """Production-shape inputs on the GPU: (torch args, rows that must be exactly 0) with bf16 q/pool of D = 256,
    W = 2051 rows, NaN in every slot no request owns. ``high_slots``: the requests' pages sit at
    the top of a pool past 4.2M slots (offsets past 2**31 elements)."""
    hq, hkv = TP[tp]
    rng = np.random.default_rng(seed)
    contexts = rng.integers(2100, 9000, size=max(1, rows // rows_per_request))
    kw = dict(junk=PAGED_JUNK, junk_at=PAGED_JUNK_AT) if junk else {}
    empty = (0,) if junk and rows > 1 else ()
    c = paged_decode_case(contexts, rows_per_request=rows_per_request, page_size=page_size,
                          pool_slots=pool_slots, num_kv_heads=hkv if per_head else None,
                          empty_rows=empty, seed=seed, **kw)
    table = c.req_to_token.copy()
    if high_slots:  # move every used page to the top of the pool
        shift = c.pool_slots - 1 - int(table.max())
        table = np.where(table > 0, table + shift, 0)
        owned = np.zeros(c.pool_slots, bool)
        owned[table[table > 0]] = True
    else:
        owned = c.owned
    g = torch.Generator(device=CUDA).manual_seed(seed)
    r = len(c.req_indices)
    q = torch.randn(r, hq, 256, generator=g, device=CUDA).to(torch.bfloat16)
    k = torch.randn(c.pool_slots, hkv, 256, generator=g, device=CUDA, dtype=torch.bfloat16)
    v = torch.randn(c.pool_slots, hkv, 256, generator=g, device=CUDA, dtype=torch.bfloat16)
    free = torch.from_numpy(~owned).to(CUDA)
    k[free] = float("nan")
    v[free] = float("inf")
    meta = [torch.from_numpy(t).to(CUDA) for t in (table, c.req_indices, c.indices, c.seq_lens)]
    return [q, k, v, meta[0], meta[1], meta[2], meta[3]], empty


def compact_reference(args, k_scale=1.0, v_scale=1.0):
    """decode_paged_reference on the rows the call names only (the pool may be gigabytes)."""
    q, k, v, table, req, idx, seq = args
    table_n, req_n, idx_n, seq_n = (t.cpu().numpy() for t in (table, req, idx, seq))
    slots = resolve_paged_slots(table_n, req_n, idx_n, seq_n, k.shape[0])
    used, inv = np.unique(slots[slots >= 0], return_inverse=True)
    new_idx = np.full(slots.shape, -1, np.int64)
    new_idx[slots >= 0] = inv
    sel = torch.from_numpy(used).to(k.device)
    kk, vv = k.index_select(0, sel).float().cpu().numpy(), v.index_select(0, sel).float().cpu().numpy()
    r = q.shape[0]
    return decode_paged_reference(q.float().cpu().numpy(), kk, vv,
                                  np.arange(max(1, used.size), dtype=np.int64)[None],
                                  np.zeros(r, np.int64), new_idx, np.full(r, used.size),
                                  None, k_scale, v_scale)


def to_jax_args(args):
    from interop.dlpack import to_jax  # noqa: PLC0415

    return [to_jax(t.contiguous()) for t in args]


@gpu
@pytest.mark.parametrize("tp", list(TP))
@pytest.mark.parametrize("rows", [1, 16, 128])
def test_gpu_production_shapes(tp, rows):
    args, empty = gpu_case(tp, rows, per_head=tp == "TP1", seed=rows)
    ref = compact_reference(args)
    out_t = qsa_triton.sparse_decode_paged(*args)
    out_p = qsa_pallas.sparse_decode_paged(*to_jax_args(args))
    assert_close(out_t.float().cpu().numpy(), ref, empty)
    assert_close(np.asarray(out_p, np.float32), ref, empty)
    bi_t = qsa_triton.sparse_decode_paged(*args, batch_invariant=True)
    bi_p = qsa_pallas.sparse_decode_paged(*to_jax_args(args), batch_invariant=True)
    assert_close(bi_t.float().cpu().numpy(), ref, empty)
    assert_close(np.asarray(bi_p, np.float32), ref, empty)


@gpu
@pytest.mark.parametrize("page_size", [64, 1])
def test_gpu_fp8_pool(page_size):
    args, empty = gpu_case("TP1", 32, page_size=page_size, seed=3)
    args[1], args[2] = args[1].to(FP8), args[2].to(FP8)
    ref = compact_reference(args, 0.5, 1.5)
    assert_close(qsa_triton.sparse_decode_paged(*args, None, 0.5, 1.5).float().cpu().numpy(),
                 ref, empty)
    out_p = qsa_pallas.sparse_decode_paged(*to_jax_args(args), None, 0.5, 1.5)
    assert_close(np.asarray(out_p, np.float32), ref, empty)


@gpu
def test_gpu_pool_past_int32_offsets():
    """A bf16 pool of 4.4M slots at Hkv = 2, D = 256 (2.25e9 elements per tensor): the requests'
    pages sit at its top, past 2**31 elements. Both packages; then an FP8 pool of 8.6M slots
    (past 2**32 bytes: 64-bit offsets in the Pallas lowering too)."""
    for dtype, slots in ((torch.bfloat16, 4_400_000), (FP8, 8_600_000)):
        args, empty = gpu_case("TP1", 8, pool_slots=slots, high_slots=True, seed=5)
        if dtype is FP8:
            args[1], args[2] = args[1].to(FP8), args[2].to(FP8)
        assert int(args[3].max()) * 2 * 256 > 2**31
        ref = compact_reference(args)
        assert_close(qsa_triton.sparse_decode_paged(*args).float().cpu().numpy(), ref, empty)
        out_p = qsa_pallas.sparse_decode_paged(*to_jax_args(args))
        assert_close(np.asarray(out_p, np.float32), ref, empty)
        del args
        torch.cuda.empty_cache()


@gpu
def test_gpu_cuda_graph_replay_new_metadata():
    """One captured call; then new indices (reversed rows: valid entries at the end), new
    seq_lens and new req_indices copied into its buffers: the replay equals eager."""
    static, _ = gpu_case("TP1", 16, seed=7)
    r = static[0].shape[0]
    new_meta = {
        5: torch.flip(static[5], dims=[1]),
        6: torch.clamp(static[6] - torch.arange(r, device=CUDA, dtype=torch.int32) * 13, min=0),
        4: torch.roll(static[4], 5),
    }
    for bi in (False, True):
        qsa_triton.sparse_decode_paged(*static, batch_invariant=bi)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            out = qsa_triton.sparse_decode_paged(*static, batch_invariant=bi)
        old = {i: static[i].clone() for i in new_meta}
        for meta in (new_meta, old):
            for i, t in meta.items():
                static[i].copy_(t)
            graph.replay()
            torch.cuda.synchronize()
            # bitwise, NaN where eager has NaN: a rolled request may be shorter than the row's
            # length, so valid entries name its padding slots (NaN here), legally attended
            torch.testing.assert_close(
                out, qsa_triton.sparse_decode_paged(*static, batch_invariant=bi), rtol=0,
                atol=0, equal_nan=True)


@gpu
def test_gpu_graphs_every_r_1_to_128():
    """Capture one graph per R = 1..128 in sequence on one shared graph pool (views of shared
    buffers; on the H200 at Hkv = 1 the plan has splits + merge up to R = 66, one split from 67),
    then change the metadata in place (reversed index rows, shorter lengths, every row moved to
    another request) and replay them all in capture order: each equals eager on the new data,
    and the R = 128 output matches the reference.

    The new lengths are capped by the new request's context: a length past it would make valid
    entries name SGLang's padding slot 0 (NaN here), a legal call whose NaN output no equality
    can compare (NaN != NaN; the first one-split graph, R = 67, failed that way)."""
    args, _ = gpu_case("TP2", 128, junk=False, seed=9)
    q, k, v, table, req, idx, seq = args
    context = seq.clone()  # one row per request: row r's length is its request's context
    pool = torch.cuda.graph_pool_handle()
    graphs = []
    for r in range(1, 129):
        a = (q[:r], k, v, table, req[:r], idx[:r], seq[:r])
        qsa_triton.sparse_decode_paged(*a)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool, capture_error_mode="thread_local"):
            out = qsa_triton.sparse_decode_paged(*a)
        graphs.append((g, out, a))
    shorter = torch.clamp(seq - torch.arange(128, device=CUDA, dtype=torch.int32) * 7, min=0)
    seq.copy_(torch.minimum(shorter, torch.roll(context, 3)))
    idx.copy_(torch.flip(idx, dims=[1]))
    req.copy_(torch.roll(req, 3))
    for g, out, a in graphs:
        g.replay()
    torch.cuda.synchronize()
    for g, out, a in graphs:
        assert torch.isfinite(out).all(), a[0].shape[0]
        assert torch.equal(out, qsa_triton.sparse_decode_paged(*a)), a[0].shape[0]
    assert_close(graphs[-1][1].float().cpu().numpy(), compact_reference(list(graphs[-1][2])))


@gpu
@pytest.mark.parametrize("tp, rows", [("TP1", 1), ("TP2", 1), ("TP2", 2), ("TP1", 16), ("TP1", 64)])
def test_gpu_pdl_on_off_bitwise_and_chained_graph(tp, rows):
    """Programmatic Dependent Launch (by default at R x Hkv == 1: TP2 R = 1): with and without
    it the bits are the same; then a CUDA graph of 20 chained calls (each call's q is the
    previous output, so every split grid depends on the previous merge grid) replays to the eager
    chain's bits, with the metadata changed before the replay."""
    from qsa_triton import decode_paged as P  # noqa: PLC0415

    args, _ = gpu_case(tp, rows, seed=12)
    plan = P._plan_of(args[0], args[1], args[5], False)
    if not P._pdl_supported(args[0].device):
        pytest.skip("no PDL on this device / Triton")
    on = P.decode_paged_with_plan(*args, plan=plan, pdl=True)
    off = P.decode_paged_with_plan(*args, plan=plan, pdl=False)
    torch.testing.assert_close(on, off, rtol=0, atol=0, equal_nan=True)
    q0 = args[0].clone()

    def chain():
        x = q0
        for _ in range(20):
            x = qsa_triton.sparse_decode_paged(x, *args[1:])
        return x

    chain()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = chain()
    args[5].copy_(torch.flip(args[5], dims=[1]))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, chain(), rtol=0, atol=0, equal_nan=True)


@gpu
def test_gpu_torch_compile_fullgraph():
    args, _ = gpu_case("TP4", 8, seed=10)

    def f(*t):
        return qsa_triton.sparse_decode_paged(*t)

    torch._dynamo.reset()
    assert torch.equal(torch.compile(f, fullgraph=True)(*args), f(*args))


@gpu
@pytest.mark.parametrize("tp", ["TP1", "TP2"])
def test_gpu_lying_metadata_same_in_both(tp):
    args, _ = gpu_case(tp, 16, seed=12, junk=False)
    table, req, seq, idx = (args[i].clone() for i in (3, 4, 6, 5))
    seq[1] = table.shape[1] + 100  # past the table's width ...
    idx[1, ..., -5:] = table.shape[1] + 7  # ... with entries there (invalid)
    table[req[2], :50] = args[1].shape[0] + 11  # slots past the pool
    table[req[3], 10:20] = -4  # negative slots
    req[4] = table.shape[0] + 2  # a request past the table: row 4 is empty
    req[5] = -1  # and row 5
    args[3], args[4], args[5], args[6] = table, req, idx, seq
    ref = compact_reference(args)
    out_t = qsa_triton.sparse_decode_paged(*args).float().cpu().numpy()
    out_p = np.asarray(qsa_pallas.sparse_decode_paged(*to_jax_args(args)), np.float32)
    assert_close(out_t, ref, (4, 5))
    assert_close(out_p, ref, (4, 5))
    assert np.abs(out_t - out_p).max() <= 2e-2


@gpu
@pytest.mark.parametrize("pkg", ["triton", "pallas"])
def test_gpu_batch_invariant(pkg):
    args, _ = gpu_case("TP1", 128, junk=False, seed=13)

    def call(rows):
        rows_t = torch.as_tensor(rows, device=CUDA)
        a = [args[0][rows_t], args[1], args[2], args[3], args[4][rows_t], args[5][rows_t],
             args[6][rows_t]]
        if pkg == "triton":
            return qsa_triton.sparse_decode_paged(*a, batch_invariant=True).view(torch.int16).cpu()
        out = qsa_pallas.sparse_decode_paged(*to_jax_args(a), batch_invariant=True)
        return torch.from_numpy(np.asarray(out).view(np.int16).copy())

    full = call(list(range(128)))
    rng = np.random.default_rng(0)
    for rows in ([77], list(rng.permutation(128)[:37]), list(rng.permutation(128))):
        part = call(rows)
        assert torch.equal(part, full[torch.as_tensor(rows)]), len(rows)


@gpu
@pytest.mark.parametrize("tp, rows, bi", [("TP1", 1, False), ("TP2", 128, False),
                                          ("TP1", 16, True)])
@pytest.mark.parametrize("pkg", ["triton", "pallas"])
def test_gpu_attended_nan_paged(pkg, tp, rows, bi):
    """Compiled kernels (tl.max / the Pallas lowering's max skip NaN on the GPU, unlike the CPU
    interpreters): a NaN K element and a NaN V element in slots valid entries name give NaN
    exactly where the FP64 reference does, with 65 splits (TP1 R = 1), one split (TP2 R = 128)
    and the batch-invariant plan's 9 (TP1 R = 16); the rest matches the reference."""
    args, empty = gpu_case(tp, rows, seed=40 + rows)
    table, req, idx, seq = (a.cpu().numpy() for a in (args[3], args[4], args[5], args[6]))
    slots = resolve_paged_slots(table, req, idx, seq, args[1].shape[0])
    slots = slots if slots.ndim == 3 else slots[:, None]
    hkv = args[1].shape[1]
    rk, rv = (0, 0) if rows == 1 else (1, rows - 1)
    sk = slots[rk, 0][slots[rk, 0] >= 0]
    sv = slots[rv, -1][slots[rv, -1] >= 0]
    args[1][int(sk[len(sk) * 3 // 4]), 0, 5] = float("nan")
    args[2][int(sv[len(sv) // 2]), hkv - 1, 9] = float("nan")
    ref = compact_reference(args)
    nan = np.isnan(ref)
    g = args[0].shape[1] // hkv
    assert nan[rk, :g].all() and nan[rv, -g:, 9].all()
    if pkg == "triton":
        out = qsa_triton.sparse_decode_paged(*args, batch_invariant=bi).float().cpu().numpy()
    else:
        out = np.asarray(qsa_pallas.sparse_decode_paged(*to_jax_args(args), batch_invariant=bi),
                         np.float32)
    assert np.array_equal(np.isnan(out), nan), np.argwhere(np.isnan(out) != nan)[:4].tolist()
    err = np.abs(out[~nan] - ref[~nan])
    assert (err <= ATOL + RTOL * np.abs(ref[~nan])).all(), err.max()


def _gpu_packed(tp, lens, seed):
    """Packed decode inputs on the GPU (bf16, D = 256): torch tensors, and float64 copies."""
    hq, hkv = TP[tp]
    rng = np.random.default_rng(seed)
    cu_k = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    cap = int(cu_k[-1]) + 2
    t = [torch.from_numpy(rng.standard_normal(shape, np.float32)).to(CUDA).to(torch.bfloat16)
         for shape in ((len(lens), hq, 256), (cap, hkv, 256), (cap, hkv, 256))]
    t += [torch.arange(len(lens) + 1, dtype=torch.int32, device=CUDA),
          torch.from_numpy(cu_k).to(CUDA)]
    return t


def _packed_ref(t):
    from interop.reference import decode_reference  # noqa: PLC0415

    return decode_reference(*(x.float().cpu().numpy() if x.is_floating_point() else
                              x.cpu().numpy() for x in t))


@gpu
@pytest.mark.parametrize("tp, b, bi", [("TP1", 1, False), ("TP1", 128, False), ("TP2", 16, True)])
@pytest.mark.parametrize("pkg", ["triton", "pallas"])
def test_gpu_attended_nan_packed(pkg, tp, b, bi):
    """The packed decode on compiled kernels: a NaN key element (row 0), a NaN value element
    (the last row) and a NaN query element give NaN exactly where the FP64 reference does, at
    B = 1 (33 splits, the merge kernel), B = 128 (TP1: rows 0 and 127 of 2051 keys among rows of
    300 get the plan's max_splits (2) each from the device-side balance, merged in-launch;
    Pallas: one split)
    and in batch-invariant mode (9 splits); the rest matches the reference."""
    lens = [2051] * b if b < 128 else [2051] + [300] * 126 + [2051]
    if b == 128 and pkg == "triton":  # the in-launch merge runs for rows 0 and 127 on the H200
        from interop.plan import plan_decode  # noqa: PLC0415

        plan = plan_decode(b, 2, 12, 256, 2051, 132, balance=True, one_block_splits=True)
        share = 2051 * plan.balance_slots // (sum(lens) * 2)
        assert 2 * b * 2 >= 132 and min(share, plan.max_splits) == plan.max_splits >= 2
    t = _gpu_packed(tp, lens, seed=50 + b)
    hkv = t[1].shape[1]
    g = t[0].shape[1] // hkv
    t[1][1500, 0, 5] = float("nan")  # row 0, KV head 0
    t[2][int(t[4][-2]) + 100, hkv - 1, 9] = float("nan")  # the last row, last KV head
    t[0][b // 2, 1, 3] = float("nan")  # a query element of head 1
    ref = _packed_ref(t)
    nan = np.isnan(ref)
    assert nan[0, :g].all() and nan[b - 1, -g:, 9].all() and nan[b // 2, 1].all()
    if pkg == "triton":
        out = qsa_triton.sparse_decode(*t, 2051, batch_invariant=bi).float().cpu().numpy()
    else:
        out = np.asarray(qsa_pallas.sparse_decode(*to_jax_args(t), 2051, batch_invariant=bi),
                         np.float32)
    assert np.array_equal(np.isnan(out), nan), np.argwhere(np.isnan(out) != nan)[:4].tolist()
    err = np.abs(out[~nan] - ref[~nan])
    assert (err <= ATOL + RTOL * np.abs(ref[~nan])).all(), err.max()


@gpu
def test_gpu_packed_batch_invariant_graph_and_compile():
    """``qsa_triton.sparse_decode(..., batch_invariant=True)`` at TP1, B = 16: a CUDA graph
    captured once and replayed with other lengths in ``cu_seqlens_k`` equals eager, and every
    row equals its bits alone (B = 1, a tight ``max_seqlen_k``); torch.compile(fullgraph=True)
    equals eager."""
    rng = np.random.default_rng(60)
    lens = [int(x) for x in rng.integers(0, 2052, 16)]
    t = _gpu_packed("TP1", lens, seed=60)
    cap = t[1].shape[0] - 2
    qsa_triton.sparse_decode(*t, 2051, batch_invariant=True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = qsa_triton.sparse_decode(*t, 2051, batch_invariant=True)
    new_lens = np.roll(np.asarray(lens), 5)  # other lengths per row, no more keys in all
    new_lens[3] = 0
    new_cu = np.concatenate([[0], np.cumsum(new_lens)])
    assert new_cu[-1] <= cap and (new_lens != np.asarray(lens)).any()
    t[4].copy_(torch.from_numpy(new_cu.astype(np.int32)))
    graph.replay()
    torch.cuda.synchronize()
    eager = qsa_triton.sparse_decode(*t, 2051, batch_invariant=True)
    assert torch.equal(out.view(torch.int16), eager.view(torch.int16))
    for s in range(16):
        lo, n = int(new_cu[s]), int(new_lens[s])
        one = qsa_triton.sparse_decode(t[0][s:s + 1], t[1][lo:lo + n + 1], t[2][lo:lo + n + 1],
                                       t[3][:2], torch.tensor([0, n], dtype=torch.int32,
                                                              device=CUDA),
                                       max(n, 1), batch_invariant=True)
        assert torch.equal(one[0].view(torch.int16), eager[s].view(torch.int16)), s
    assert_close(eager.float().cpu().numpy(), _packed_ref(t), tuple(np.flatnonzero(new_lens == 0)))

    def f(*a):
        return qsa_triton.sparse_decode(*a, 2051, batch_invariant=True)

    torch._dynamo.reset()
    assert torch.equal(torch.compile(f, fullgraph=True)(*t), eager)


def _memcheck_case(tp="TP1"):
    args, _ = gpu_case(tp, 8, page_size=1, seed=14)  # junk everywhere, NaN/Inf free slots
    args[3][args[4][2], :64] = args[1].shape[0] + 1  # lying slots
    args[6][3] = args[3].shape[1] + 50  # lying length
    args[4][5] = -1  # lying request
    return args


def _assert_memcheck_output(out, args):
    """The memcheck case against the reference from the pool: the lying length makes row 3's
    valid entries reach table columns past its request's context (SGLang's padding slot 0,
    NaN/Inf here), which the row attends, so the non-finite (row, head) pairs must be the
    reference's and every other value must match it."""
    ref = compact_reference(args)
    out = np.asarray(out, np.float32)
    fin = np.isfinite(ref)
    np.testing.assert_array_equal(np.isfinite(out), fin)
    np.testing.assert_allclose(out[fin], ref[fin], rtol=2e-2, atol=2e-2)


@gpu
def test_gpu_memcheck_triton():
    """Run under compute-sanitizer --tool memcheck; values as the reference's."""
    for bi in (False, True):
        args = _memcheck_case()
        out = qsa_triton.sparse_decode_paged(*args, batch_invariant=bi)
        torch.cuda.synchronize()
        _assert_memcheck_output(out.float().cpu().numpy(), args)


@gpu
def test_gpu_memcheck_pallas():
    for bi in (False, True):
        args = _memcheck_case()
        out = qsa_pallas.sparse_decode_paged(*to_jax_args(args), batch_invariant=bi)
        _assert_memcheck_output(out, args)
