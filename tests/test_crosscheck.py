"""interop.validate.crosscheck and ``qsa check``: the matrix as data, the batched float64 torch reference
against interop.reference, the runner's verdicts with injected (fake) kernels, the CLI's exit
status / JSON / error messages, and a few real quick cases through both kernel families."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jnp = jax.numpy

from interop.validate import cli  # noqa: E402
from interop.validate import crosscheck as X  # noqa: E402
from interop import cases as C  # noqa: E402
from interop import indices as I  # noqa: E402
from interop import reference as R  # noqa: E402
from interop.contract import (TensorSpec, check_decode, check_decode_paged,  # noqa: E402
                              check_decode_step, check_indexer_decode, check_indexer_prefill,
                              check_prefill, check_prefill_chunk, check_prefill_paged,
                              check_prefill_step)


# --------------------------------------------------------------------------------------------
# The matrix.
def test_full_matrix_covers_the_issue():
    full = X.full_matrix()
    names = X.iter_names(full)
    assert len(names) == len(set(names))
    dec = [s for s in full if s.op == "decode"]
    for tp, (hq, hkv) in X.TP_SHAPES.items():
        for b in list(range(1, 17)) + [17, 24, 32, 48, 64, 96, 128]:
            for pattern in ("short", "medium", "saturated"):
                assert any(s.hq == hq and s.hkv == hkv and s.batch == b and s.pattern == pattern
                           and s.d == 256 and s.max_len == 2051 for s in dec), (tp, b, pattern)
    assert any(s.zero_rows for s in dec) and any(s.poison for s in dec)
    pre = [s for s in full if s.op == "prefill"]
    for kind in ("ordinary", "chunk", "paged"):
        for g in (3, 6, 12):
            for hkv in (1, 2):
                kvs = [8192] if kind == "ordinary" else [8192, 32768, 131072]
                for kv in kvs:
                    assert any(s.kind == kind and s.hq == g * hkv and s.hkv == hkv
                               and s.q_lens == (8192,) and (s.kv_lens or s.q_lens)[0] == kv
                               and s.width == 2051 for s in pre), (kind, g, hkv, kv)
        assert any(s.kind == kind and len(s.q_lens) > 2 for s in pre)  # ragged
        assert any(s.kind == kind and s.junk == "mixed" and s.empty_rows for s in pre)
    assert {s.kind for s in pre if s.kv_dtype == "float8_e4m3fn"} == {"chunk", "paged"}
    # block selections at the indexer's width, sized for the tile-union kernel on an H200
    from interop.arch import DeviceFacts
    from interop.geometry import select_prefill_blocks

    facts = DeviceFacts.for_arch("sm_90")
    blocks = [s for s in pre if s.blocks]
    assert {s.kind for s in blocks} == {"ordinary", "chunk", "paged"}
    assert {s.kind for s in blocks if s.kv_dtype} == {"chunk", "paged"}
    for s in blocks:
        geo = select_prefill_blocks(facts, s.kind, total_q=sum(s.q_lens), requests=len(s.q_lens),
                                    max_q=max(s.q_lens), group=s.hq // s.hkv, num_kv_heads=s.hkv,
                                    head_dim=s.d, block_width=s.width)
        assert s.width == 512 and geo.kind == "union", (s.name, geo)
    assert all(s.dtype == "bfloat16" for s in full)
    assert X.full_matrix(["decode"]) == dec


def _spec_call(s, strict):
    """Check a spec's call against the contract with TensorSpecs (no allocation); the full
    matrix in strict mode (the qualified envelope)."""
    T = lambda shape, dt="int32": TensorSpec(tuple(shape), dt)  # noqa: E731
    if s.op in ("paged", "indexer", "step"):
        d = C.case_data(s)
        named = {n: T(shape, dt) for n, (shape, dt) in d.floats.items()}
        named.update({n: T(a.shape) for n, a in d.ints.items()})
        args, kwargs = d.arguments(named)
        check = {"sparse_decode_paged": check_decode_paged,
                 "indexer_select_decode": check_indexer_decode,
                 "qsa_decode_step": check_decode_step, "qsa_prefill_step": check_prefill_step}
        if d.entry == "indexer_select_prefill":
            return check_indexer_prefill(*args[:4], positions=args[4], seq_lens=args[5],
                                         strict=strict, **kwargs)
        return check[d.entry](*args, **kwargs, strict=strict)
    if s.op == "decode":
        return check_decode(T((s.batch, s.hq, s.d), s.dtype), T((10, s.hkv, s.d), s.dtype),
                            T((10, s.hkv, s.d), s.dtype), T((s.batch + 1,)), T((s.batch + 1,)),
                            s.max_len, strict=strict)
    t, b = sum(s.q_lens), len(s.q_lens)
    kvd = s.kv_dtype or s.dtype
    idx = T((t, s.hkv, s.width) if s.per_head else (t, s.width))
    if s.kind == "ordinary":
        return check_prefill(T((t, s.hq, s.d), s.dtype), T((t, s.hkv, s.d), kvd),
                             T((t, s.hkv, s.d), kvd), idx, T((b + 1,)), max(s.q_lens))
    if s.kind == "chunk":
        return check_prefill_chunk(T((t, s.hq, s.d), s.dtype), T((99, s.hkv, s.d), kvd),
                                   T((99, s.hkv, s.d), kvd), idx, T((b + 1,)), T((b + 1,)), T((b,)),
                                   max(s.q_lens), None, s.k_scale, s.v_scale)
    return check_prefill_paged(T((t, s.hq, s.d), s.dtype), T((99, s.hkv, s.d), kvd),
                               T((99, s.hkv, s.d), kvd), T((b + 2, 5)), T((b,)), idx,
                               T((b + 1,)), T((b,)),
                               max(s.q_lens), None, s.k_scale, s.v_scale)


@pytest.mark.parametrize("matrix", ["quick", "full"])
def test_every_case_is_inside_the_contract(matrix):
    specs = X.quick_matrix() if matrix == "quick" else X.full_matrix()
    for s in specs:
        _spec_call(s, strict=matrix == "full")


def test_quick_matrix_is_small_and_fp16():
    quick = X.quick_matrix()
    names = X.iter_names(quick)
    assert len(names) == len(set(names)) and 20 <= len(quick) <= 90
    assert all(s.dtype == "float16" for s in quick)
    assert sum(s.size for s in quick) < 2e8
    assert {s.kind for s in quick if s.op == "prefill"} == {"ordinary", "chunk", "paged"}
    assert any(getattr(s, "kv_dtype", None) for s in quick)
    assert X.quick_matrix(["prefill"]) == [s for s in quick if s.op == "prefill"]


def _window(data):
    """Per row: (cap, validity bound, indices [H, W]) from a prefill CaseData."""
    spec = data.spec
    kv = None if spec.kind == "ordinary" else spec.kv_lens
    _, _, visible, bound = I.row_layout(spec.q_lens, kv)
    idx = data.ints["indices"]
    idx3 = idx if idx.ndim == 3 else idx[:, None, :]
    return np.minimum(idx.shape[-1], visible), bound, idx3


def test_edge_cases_are_what_their_names_say():
    edge = C.by_name(C.edge_cases())
    assert set(edge) <= set(C.by_name(C.quick_matrix())) and set(edge) <= set(
        C.by_name(C.conformance_matrix()))
    d = C.case_data(edge["decode/TP2/B3/all-empty"])
    assert d.empty.all() and d.poison[int(d.ints["cu_seqlens_k"][-1]):].all()
    for name in ("prefill/chunk/junk-inside/G6xHkv1",
                 "prefill/ordinary/junk-inside/per-head/G3xHkv2"):
        cap, bound, idx = _window(C.case_data(edge[name]))
        seen = set()
        for t in range(idx.shape[0]):
            for col in {0, cap[t] // 2, cap[t] - 1}:
                v = idx[t, :, col]
                assert ((v < 0) | (v >= bound[t])).all(), (name, t, col)
                seen |= {int(x) - int(bound[t]) if x >= 0 else int(x) for x in v}
        assert seen == {-1, -7, 0, 19}  # -1, -7, len, len + 19
    for name in ("prefill/paged/duplicates/G12xHkv1",
                 "prefill/chunk/duplicates+junk-inside/per-head/G12xHkv2"):
        cap, bound, idx = _window(C.case_data(edge[name]))
        dup = 0
        for t in range(idx.shape[0]):
            src = idx[t, :, min(1, cap[t] - 1)]
            for col in {min(2, cap[t] - 1), max(cap[t] - 2, 0)}:
                assert (idx[t, :, col] == src).all()
            dup += int(cap[t] >= 6 and ((src >= 0) & (src < bound[t])).all())
        assert dup >= 3  # rows where a valid position really is attended three times
    for name in ("prefill/paged/poison/G12xHkv1", "prefill/chunk/poison+fp8/per-head/G6xHkv2"):
        data = C.case_data(edge[name])
        cap, bound, idx = _window(data)
        spec = data.spec
        assert data.poison.any() and not data.poison.all()
        if spec.kind == "paged":  # table entries past kv_len name slots past the pool
            st, kv_rows = C.slot_table_of(data.ints), data.floats["k_cache"][0][0]
            past = np.arange(st.shape[1])[None, :] >= np.asarray(spec.kv_lens)[:, None]
            assert past.any() and (st[past] >= kv_rows).all() and (st[~past] < kv_rows).all()
        for t, (req, _, _, _) in enumerate(zip(*I.row_layout(spec.q_lens, spec.kv_lens))):
            for h in range(spec.hkv):
                sel = idx[t, h if idx.shape[1] > 1 else 0, :cap[t]]
                sel = sel[(sel >= 0) & (sel < bound[t])]
                rows = (C.slot_table_of(data.ints)[req, sel] if spec.kind == "paged"
                        else data.ints["cu_seqlens_k"][req] + sel)
                assert not data.poison[rows, h].any(), (name, t, h)
    for name in ("prefill/chunk/max_seqlen_q-hint-2/G12xHkv1",
                 "prefill/paged/max_seqlen_q-hint-1/G6xHkv1",
                 "prefill/ordinary/max_seqlen_q-hint-3/G3xHkv1"):
        spec = edge[name]
        assert C.case_data(spec).scalars["max_seqlen_q"] == spec.max_q_hint < max(spec.q_lens)


def test_select_ops():
    assert X.select_ops(None) == ("decode", "prefill", "paged", "indexer", "step")
    assert X.select_ops("prefill, decode,prefill") == ("prefill", "decode")
    assert X.select_ops("paged,indexer,step") == ("paged", "indexer", "step")
    for bad in ("decodes", "decode,attention", ",", ""):
        with pytest.raises(ValueError, match="allowed: decode, prefill, paged, indexer, step"):
            X.select_ops(bad)


# --------------------------------------------------------------------------------------------
# The paged decode, indexer and step cases (issue 18 item 4).
def test_new_ops_in_both_matrices():
    """Quick (CPU): every new op, the indexer and the step in decode and prefill form, with a
    top-k small enough that rows really drop blocks. Full (GPU): production shapes (topk 512,
    D 256, the TP rank shapes, B up to 128, 32k context), FP8, MTP rows, junk."""
    quick, full = X.quick_matrix(), X.full_matrix()
    for specs, topk in ((quick, 16), (full, 512)):
        by_op = {op: [s for s in specs if s.op == op] for op in ("paged", "indexer", "step")}
        assert all(by_op.values())
        for op in ("indexer", "step"):
            assert {s.kind for s in by_op[op]} == {"decode", "prefill"}
            assert all(s.topk == topk for s in by_op[op])
            for s in by_op[op]:
                lens = getattr(s, "seq_lens", ()) or getattr(s, "kv_lens", ()) or s.context_lens
                if s.kind == "decode":
                    assert max(lens) // 4 > s.topk, s.name  # some row drops blocks
        assert any(getattr(s, "kv_dtype", None) == "float8_e4m3fn" for s in by_op["step"])
    full_step = [s for s in full if s.op == "step"]
    assert {s.hq for s in full_step} >= {24, 12, 6} and all(s.d == 256 for s in full_step)
    assert max(s.rows for s in full_step if s.kind == "decode") == 128
    assert max(max(s.context_lens) for s in full_step) >= 32768
    assert any(s.rows_per_request > 1 for s in full if s.op == "paged")
    assert X.full_matrix(["step"]) == full_step


@pytest.mark.parametrize("name", ["indexer/decode/topk16", "indexer/prefill/topk16",
                                  "step/decode/TP1/fp8/shared-pages/topk16"])
def test_new_case_data_is_what_it_claims(name):
    spec = C.by_name(X.quick_matrix())[name]
    d = C.case_data(spec)
    v = d.values()
    if spec.op == "indexer":
        assert set(d.integer_valued) == set(d.floats)  # exact FP32 logits
        for n in d.floats:
            assert np.array_equal(v[n], np.round(v[n])) and np.abs(v[n]).max() <= 2
        assert (v["q"][list(spec.zero_q_rows)] == 0).all()
        ref = C.reference(d.entry, {**d.scalars, **d.ints, **v})
        assert ref.dtype == np.int32 and ref.shape == (spec.rows, 4 * spec.topk + 3)
        return
    # the step: shared pages (pool smaller than the requests), poison on every unowned slot,
    # the index page table naming the KV pages of each request's visible blocks
    assert d.ints["index_page_table"].shape[0] == len(spec.context_lens)
    assert d.floats["k_cache"][0][0] == spec.pool_pages * 64
    assert np.isnan(v["k_cache"][d.poison]).all() and not np.isnan(v["k_cache"][~d.poison]).any()
    rt, req = d.ints["req_to_token"], d.ints["req_indices"]
    for r, ctx in enumerate(spec.context_lens):
        need = -(-(ctx // 4) // 16)
        np.testing.assert_array_equal(d.ints["index_page_table"][r, :need],
                                      rt[req[r], np.arange(need) * 64] // 64)


def test_integer_ref_is_judged_exactly():
    ref = np.array([[0, 1, 2, -1], [4, 5, -1, -1]], np.int32)
    assert C.compare(ref.astype(np.float64), ref)["passed"]
    off = ref.astype(np.float64)
    off[1, 1] = 6
    r = C.compare(off, ref)
    assert not r["passed"] and r["mismatched_rows"] == 1 and r["rel_l2"] == 0.5


# --------------------------------------------------------------------------------------------
# References.
_EDGE = [s for s in C.edge_cases(("prefill",))]
SMALL = [s for s in X.quick_matrix() if s.op == "prefill" and s.d == 64 and s not in _EDGE][::3] + _EDGE + [
    X.PrefillSpec("p/paged/per-head/fp8", "paged", 6, 2, 32, (5, 4), (40, 9), width=11,
                  dtype="float16", kv_dtype="float8_e4m3fn", k_scale=0.5, v_scale=2.0,
                  per_head=True, junk="mixed", empty_rows=(2,)),
]


@pytest.mark.parametrize("spec", SMALL, ids=lambda s: s.name)
def test_torch_reference_matches_numpy_reference(spec):
    inp = X.build_inputs(spec)
    ref = X.numpy_reference(spec, inp)
    got = X.torch_reference(spec, inp, budget_bytes=200_000).numpy()  # several row chunks
    np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-12)
    assert np.all(ref[inp.empty] == 0) and np.isfinite(ref).all()
    # the empty-row mask recomputed from the device metadata matches the generator's
    np.testing.assert_array_equal(X.empty_mask(inp), inp.empty)


def test_build_inputs_shapes_and_poison():
    s = X.DecodeSpec("d", 12, 1, 32, 3, "saturated", max_len=9, dtype="float16", slack=4,
                     poison=True, zero_rows=1)
    inp = X.build_inputs(s)
    q, k, v, cq, ck, msk = inp.args
    assert q.shape == (3, 12, 32) and q.dtype == torch.float16
    assert cq.dtype == ck.dtype == torch.int32 and msk == 9
    assert int(ck[-1]) == 18 and k.shape[0] == 3 * 9 + 4  # padded capacity: B x max_len + slack
    assert torch.isnan(k[18:]).all() and not torch.isnan(k[:18]).any()
    assert inp.empty.sum() == 12  # one empty sequence x 12 heads
    np.testing.assert_array_equal(X.empty_mask(inp), inp.empty)
    # seeded: the same spec gives the same inputs
    assert torch.equal(X.build_inputs(s).args[0], q)
    p = X.PrefillSpec("p", "paged", 12, 2, 32, (3, 2), (30, 8), width=11, dtype="float16",
                      kv_dtype="float8_e4m3fn", k_scale=0.5)
    inp = X.build_inputs(p)
    assert inp.entry == "sparse_prefill_paged" and inp.args[1].dtype == torch.float8_e4m3fn
    assert inp.args[3].shape == (4, 30) and inp.args[4].shape == (2,)  # req_to_token, req_indices
    assert inp.kwargs["k_scale"] == 0.5


# --------------------------------------------------------------------------------------------
# Fake kernels: the reference itself (correct), and broken variants.
def _np(t):
    return t.detach().float().cpu().numpy().astype(np.float64)


def _oracle(entry):
    if entry not in ("sparse_decode", "sparse_prefill", "sparse_prefill_chunk",
                     "sparse_prefill_paged"):
        return _generic_oracle(entry)

    def fn(*a, softmax_scale=None, k_scale=1.0, v_scale=1.0, **_):
        q = a[0]
        if entry == "sparse_decode":
            out = R.decode_reference(_np(a[0]), _np(a[1]), _np(a[2]), a[3].numpy(), a[4].numpy(),
                                     softmax_scale)
        elif entry == "sparse_prefill":
            out = R.prefill_reference(_np(a[0]), _np(a[1]), _np(a[2]), a[3].numpy(), a[4].numpy(),
                                      softmax_scale)
        elif entry == "sparse_prefill_chunk":
            out = R.prefill_chunk_reference(_np(a[0]), _np(a[1]), _np(a[2]), a[3].numpy(),
                                            a[4].numpy(), a[5].numpy(), a[6].numpy(),
                                            softmax_scale, k_scale, v_scale)
        else:
            out = R.prefill_paged_reference(_np(a[0]), _np(a[1]), _np(a[2]), a[3].numpy(),
                                            a[4].numpy(), a[5].numpy(), a[6].numpy(),
                                            a[7].numpy(), softmax_scale, k_scale, v_scale)
        return torch.as_tensor(out).to(q.dtype)
    return fn


def _generic_oracle(entry):
    """``interop.cases.reference`` on the torch arguments (paged decode, indexer, step)."""
    def fn(*a, **kw):
        pos, _ = X.PARAMS[entry]
        named = {n: (x.detach().float().numpy().astype(np.float64) if x.is_floating_point()
                     else x.numpy()) if isinstance(x, torch.Tensor) else x
                 for n, x in zip(pos, a)}
        out = C.reference(entry, {**named, **kw})
        return torch.as_tensor(out).to(a[0].dtype if out.dtype.kind == "f" else torch.int32)
    return fn


def _jax_oracle(entry):
    """The oracle behind a jax-framework implementation (inputs arrive as jax arrays)."""
    base = _oracle(entry)

    def fn(*a, interpret=None, **kw):
        assert interpret is True
        targs = [torch.from_numpy(np.array(x.astype(jnp.float32) if x.dtype not in (jnp.int32,)
                                           else x)) if isinstance(x, jax.Array) else x for x in a]
        dt = a[0].dtype
        out = base(*targs, **kw)
        if not out.is_floating_point():
            return jnp.asarray(out.numpy())
        return jnp.asarray(out.float().numpy()).astype(dt)
    return fn


def fakes(wrong_case: str | None = None, how: str = "offset"):  # noqa: C901
    """Correct torch + jax implementations; with ``wrong_case``, the torch one is broken on the
    case whose first query value matches (identified through the runner's seeded inputs)."""
    target = None
    if wrong_case is not None:
        spec = next(s for s in X.quick_matrix() if s.name == wrong_case)
        target = X.build_inputs(spec).args

    def breaking(entry):
        ok = _oracle(entry)

        def fn(*a, **kw):
            out = ok(*a, **kw)
            same = target is not None and len(a) == len(target) and all(
                (x.shape == y.shape and torch.equal(x.float().nan_to_num(7.0), y.float().nan_to_num(7.0)))
                if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, target))
            if same:
                if how == "offset" and not out.is_floating_point():  # one token position off
                    out = out.clone()
                    out[0, 0] += 1
                elif how == "offset":
                    out = out + 0.25
                elif how == "nan":
                    out[0, 0, 0] = float("nan")
                elif how == "crash":
                    raise RuntimeError("kernel exploded")
            return out
        return fn

    entries = list(X.ENTRY.values())
    return [X.Implementation("triton", "torch", {e: breaking(e) for e in entries}),
            X.Implementation("pallas", "jax", {e: _jax_oracle(e) for e in entries},
                             {"interpret": True})]


@pytest.mark.parametrize("spec", [X.quick_matrix(["decode"])[3], X.quick_matrix(["prefill"])[-3]],
                         ids=lambda s: s.name)
def test_runner_passes_with_correct_fakes(spec):
    r = X.run_case(spec, fakes())
    assert r.passed, r.failures
    assert r.pair_ok and r.pair_max_abs is not None
    assert r.impl["triton"]["rel_l2"] < 1e-3 and r.impl["pallas"]["rel_l2"] < 1e-3


@pytest.mark.parametrize("how,needle", [("offset", "rel L2"), ("nan", "non-finite"),
                                        ("crash", "RuntimeError: kernel exploded")])
def test_runner_names_a_wrong_result(how, needle):
    name = "decode/TP2/B4/short"
    spec = next(s for s in X.quick_matrix() if s.name == name)
    r = X.run_case(spec, fakes(name, how))
    assert not r.passed and r.name == name
    assert any(needle in f and f.startswith("triton") for f in r.failures), r.failures
    assert r.impl["pallas"]["passed"]
    summary = X.summarize([r], ["triton", "pallas"])
    assert summary["decode"]["failed"] == [name] and summary["decode"]["worst_case"] == name


@pytest.mark.parametrize("name", ["paged/TP2/mtp2+junk+dup/W35", "indexer/prefill/topk16",
                                  "step/prefill/G6xHkv1/topk16"])
def test_runner_new_ops_pass_with_correct_fakes(name):
    spec = C.by_name(X.quick_matrix())[name]
    r = X.run_case(spec, fakes())
    assert r.passed, r.failures
    assert r.pair_ok and r.impl["triton"]["rel_l2"] < 1e-3
    if spec.op == "indexer":
        assert r.pair_max_abs == 0.0 and r.impl["pallas"]["mismatched_rows"] == 0


def test_runner_names_a_wrong_selection():
    """One token position off in one row: the indexer case fails by exact comparison (a float
    tolerance would have let a difference of 1 pass), and Pallas vs Triton is reported too."""
    name = "indexer/decode/fp8-keys/topk16"
    r = X.run_case(C.by_name(X.quick_matrix())[name], fakes(name, "offset"))
    assert not r.passed and r.impl["pallas"]["passed"]
    assert any(f.startswith("triton: 1 of 3 rows differ") for f in r.failures), r.failures
    assert "pallas vs triton: different token positions" in r.failures
    assert X.summarize([r], ["triton", "pallas"])["indexer"]["failed"] == [name]


def test_runner_checks_exact_zeros_on_empty_rows():
    spec = X.DecodeSpec("d/empty", 6, 1, 32, 3, "short", max_len=9, dtype="float16", zero_rows=1)
    ok = _oracle("sparse_decode")

    def leaky(*a, **kw):
        out = ok(*a, **kw)
        return out + 1e-4  # tiny everywhere: within tolerance, but empty rows are not exactly 0

    impls = [X.Implementation("triton", "torch", {"sparse_decode": leaky})]
    r = X.run_case(spec, impls)
    assert not r.passed and "exactly 0" in r.failures[0]


def test_skipped_implementation_does_not_fail():
    spec = X.quick_matrix(["decode"])[0]
    impls = fakes() + [X.Implementation("peer:x", "torch", {}, supports=lambda s: "not here")]
    r = X.run_case(spec, impls)
    assert r.passed and r.impl["peer:x"]["skipped"] == "not here"
    assert X.summarize([r], ["triton", "pallas", "peer:x"])["decode"]["skipped[peer:x]"] == 1


def test_peer_on_cpu_is_skipped_or_unavailable():
    try:
        peer = X.load_peer("sglang", device="cpu")
    except Exception as e:  # noqa: BLE001 - files absent on this machine
        pytest.skip(f"peer unavailable: {e}")
    spec = X.quick_matrix(["prefill"])[0]
    assert "CUDA" in peer.supports(spec)
    with pytest.raises(ValueError, match="allowed: sglang"):
        X.load_peer("vllm")


# --------------------------------------------------------------------------------------------
# The command.
def _check(monkeypatch, capsys, json_path, *args, wrong_case=None):
    """``qsa check --quick ARGS --json JSON_PATH --interpret`` on the fake implementations (the
    torch one wrong on ``wrong_case``): (exit status, stdout, the JSON report)."""
    monkeypatch.setattr(cli, "load_check_implementations", lambda interpret: fakes(wrong_case))
    rc = cli.main(["check", "--quick", *args, "--json", str(json_path), "--interpret"])
    return rc, capsys.readouterr().out, json.loads(json_path.read_text())


def test_cli_check_passes_and_writes_json(monkeypatch, tmp_path, capsys):
    rc, text, doc = _check(monkeypatch, capsys, tmp_path / "res" / "check.json", "--ops",
                           "decode", "--filter", "TP2/B1/,TP4/B4/short")
    assert rc == 0, text
    assert "decode: 4/4 passed" in text and "all cases passed" in text
    assert doc["passed"] and doc["complete"] and doc["matrix"] == "quick" and doc["ops"] == ["decode"]
    assert len(doc["cases"]) == 4 and doc["summary"]["decode"]["passed"] == 4
    assert doc["cases"][0]["impl"]["triton"]["rel_l2"] < 1e-3
    # one implementation alone
    assert cli.main(["check", "--quick", "--ops", "prefill", "--filter", "paged/G3xHkv1",
                     "--impls", "pallas", "--interpret"]) == 0
    assert "rel L2 pallas" in capsys.readouterr().out


def test_cli_check_new_ops(monkeypatch, tmp_path, capsys):
    rc, text, doc = _check(monkeypatch, capsys, tmp_path / "new.json", "--ops", "indexer,step",
                           "--filter", "decode")
    assert rc == 0, text
    assert "indexer: 2/2 passed" in text and "step: 2/2 passed" in text
    assert doc["ops"] == ["indexer", "step"] and doc["summary"]["indexer"]["passed"] == 2
    # capture files hold attention calls only: a step case is refused with the reason
    assert cli.main(["capture", "--case", "step/decode/TP2/topk16", "--out",
                     str(tmp_path / "c.safetensors"), "--interpret"]) == 2
    assert "attention entry points" in capsys.readouterr().err


def test_cli_check_fails_and_names_the_case(monkeypatch, capsys, tmp_path):
    name = "decode/TP2/B4/short"
    rc, text, doc = _check(monkeypatch, capsys, tmp_path / "c.json", "--ops", "decode",
                           "--filter", "TP2/B4/,TP2/B1/short", wrong_case=name)
    assert rc == 1
    assert f"FAIL {name}" in text and "FAILED" in text and name in text.splitlines()[-1]
    assert not doc["passed"] and doc["summary"]["decode"]["failed"] == [name]


def test_cli_check_with_every_implementation_skipped_fails(monkeypatch, capsys, tmp_path):
    """A run whose implementations all skipped every case checked nothing: exit 1, not a pass
    (e.g. ``--impls triton`` where the interpreter skips bf16 cases: a CI gate must not pass on
    it); a run where some cases were checked passes and names the others."""
    skip = "TP2/B1/short"
    monkeypatch.setattr(cli, "load_check_implementations", lambda interpret: [
        dataclasses.replace(i, supports=lambda spec: "not here" if skip in spec.name else None)
        for i in fakes()])
    for flt, rc_want, unchecked in ((skip, 1, [f"decode/{skip}"]),
                                    (f"{skip},TP2/B1/medium", 0, [f"decode/{skip}"])):
        path = tmp_path / "skip.json"
        rc = cli.main(["check", "--quick", "--ops", "decode", "--filter", flt, "--interpret",
                       "--json", str(path)])
        text = capsys.readouterr().out
        doc = json.loads(path.read_text())
        assert rc == rc_want, text
        assert f"skip decode/{skip}" in text and doc["unchecked"] == unchecked
        assert doc["passed"] == (rc == 0)
        assert ("nothing was checked" in text) == (rc == 1)
        assert rc == 1 or "1 of 2 not checked" in text


def test_cli_check_bad_ops_and_filter(capsys):
    assert cli.main(["check", "--ops", "decode,attention"]) == 2
    err = capsys.readouterr().err
    assert "--ops" in err and "attention" in err and "allowed: decode, prefill" in err
    assert cli.main(["check", "--quick", "--filter", "no-such-case", "--interpret"]) == 2
    assert cli.main(["check", "--quick", "--impls", "cuda", "--interpret"]) == 2
    assert "allowed: triton, pallas" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["check", "--quick", "--full"])


# --------------------------------------------------------------------------------------------
# Real kernels (interpret mode): a few quick cases through both families.
# the runner's real path (torch inputs, zero-copy into jax); the kernels' correctness over the
# cases is tests/conformance.py
REAL = ["decode/TP2/B4/saturated+poison", "prefill/paged/fp8+empty/G6xHkv2",
        "prefill/paged/blocks+fp8+empty/G6xHkv1", "paged/TP2/mtp2+junk+dup/W35",
        "indexer/decode/fp8-keys/topk16", "step/decode/TP2/topk16"]


@pytest.mark.parametrize("name", REAL)
def test_real_kernels_quick_cases(name):
    impls = X.load_implementations(interpret=True)
    spec = next(s for s in X.quick_matrix() if s.name == name)
    entry = C.case_data(spec).entry
    if not all(entry in i.fns for i in impls):
        pytest.skip("an entry point is not written yet")
    r = X.run_case(spec, impls)
    assert r.passed, r.failures
    assert r.impl["triton"]["rel_l2"] <= X.REL_L2 and r.impl["pallas"]["rel_l2"] <= X.REL_L2


@pytest.mark.gpu
def test_gpu_full_matrix_new_ops_sample(tmp_path):
    """On the GPU: a slice of the full matrix's paged decode, indexer and step cases (the lead
    runs them all with ``qsa check --full --ops paged,indexer,step``)."""
    rc = cli.main(["check", "--full", "--ops", "paged,indexer,step", "--filter",
                   "paged/TP2/B64,indexer/decode/edges,step/decode/TP2/B16",
                   "--json", str(tmp_path / "new_ops.json")])
    assert rc == 0


@pytest.mark.gpu
def test_gpu_full_matrix_sample(tmp_path):
    """On the GPU: a slice of the full matrix on compiled kernels (the lead runs the whole
    matrix with ``qsa check --full --peer sglang --json $OUT/check_full.json``)."""
    rc = cli.main(["check", "--full", "--filter",
                   "TP1/B1/,TP2/B128/saturated,kv32k/T8k,chunk/blocks+junk",
                   "--json", str(tmp_path / "c.json")])
    assert rc == 0


def test_cli_check_defaults_to_quick_interpret_on_cpu(monkeypatch, capsys):
    if X.has_cuda():
        pytest.skip("GPU machine: the default is the full matrix")
    monkeypatch.setattr(cli, "load_check_implementations", lambda interpret: fakes())
    assert cli.main(["check", "--ops", "decode", "--filter", "TP2/B1/short"]) == 0
    out = capsys.readouterr().out
    assert "quick matrix, 1 case(s)" in out and "interpret mode (CPU)" in out


def test_a_case_whose_inputs_fail_is_reported_not_raised():
    bad = X.PrefillSpec("p/bad", "chunk", 6, 1, 64, (8,), (4,), width=35, dtype="float16")  # kv < q
    r = X.run_case(bad, fakes())
    assert not r.passed and r.failures[0].startswith("inputs/reference: ValueError")
    assert X.summarize([r], ["triton", "pallas"])["prefill"]["failed"] == ["p/bad"]


def test_peer_indices_maps_every_invalid_entry_to_minus_one():
    """The peer adapter hands upstream only its own padding value (-1) for entries outside
    [0, len): junk -7, len, len+19 and huge values all become -1, valid entries are untouched,
    per request (ragged) and per KV head."""
    import torch

    from interop.validate.crosscheck import peer_indices

    cu_q = torch.tensor([0, 2, 5], dtype=torch.int32)
    lens = torch.tensor([4, 10], dtype=torch.int32)
    idx = torch.tensor([[0, 3, 4, -1, 23], [1, -7, 2, 3, 2**30],  # request 0: len 4
                        [9, 10, 29, 0, -1], [5, 6, 7, 8, 9], [-3, 11, 4, 4, 100]],
                       dtype=torch.int32)
    got = peer_indices(idx, cu_q, lens)
    req = np.repeat([0, 1], [2, 3])
    bound = lens.numpy()[req][:, None]
    want = np.where((idx.numpy() >= 0) & (idx.numpy() < bound), idx.numpy(), -1)
    np.testing.assert_array_equal(got.numpy(), want)
    assert got.dtype == idx.dtype and got[0, 2] == -1 and got[2, 0] == 9 and got[2, 1] == -1
    per_head = torch.stack([idx, idx.flip(-1)], 1)  # [T, Hkv=2, W]
    got3 = peer_indices(per_head, cu_q, lens)
    np.testing.assert_array_equal(got3[:, 0].numpy(), want)
    np.testing.assert_array_equal(got3[:, 1].numpy(), np.flip(want, -1))


def test_peer_prefill_skip_reasons():
    """The upstream oracle sits out exactly the full-matrix cases outside its own contract (rows
    with no valid entry; per-head paged indices), with the reason printed; junk values alone
    never exclude a case (they are mapped to -1)."""
    from interop.validate.crosscheck import peer_prefill_skip

    reasons = {s.name: peer_prefill_skip(s) for s in X.full_matrix(("prefill",))}
    skipped = {n for n, r in reasons.items() if r}
    assert skipped == {"prefill/ordinary/junk-mixed+empty/G6xHkv1",
                       "prefill/chunk/junk-mixed+empty/G6xHkv1",
                       "prefill/paged/junk-mixed+empty/G6xHkv1",
                       "prefill/paged/junk-len+19/per-head/G12xHkv2",
                       "prefill/paged/blocks/per-head/G12xHkv2/ragged"}
    assert "NaN" in reasons["prefill/chunk/junk-mixed+empty/G6xHkv1"]
    assert "ndim == 2" in reasons["prefill/paged/junk-len+19/per-head/G12xHkv2"]
    assert reasons["prefill/chunk/junk-len+19/per-head/G12xHkv2"] is None


def test_missing_peer_names_where_its_files_go(monkeypatch):
    """The install hint names the repository's .peer/sglang as an absolute path (".peer/" read
    as relative to wherever the command ran)."""
    from interop.validate import peer

    monkeypatch.setattr(peer, "sglang_root", lambda: None)
    with pytest.raises(peer.PeerUnavailable) as info:
        peer.load_sparse_attn.__wrapped__()
    assert str(peer._PEER_DIR) in str(info.value) and peer._PEER_DIR.is_absolute()


def test_peer_takes_a_block_selection_as_its_expansion(monkeypatch):
    """The upstream oracle has token interfaces only: a block-form call reaches it as the
    expansion (``interop.cases.token_indices``), the rest of the call unchanged. Upstream is
    faked by the FP64 reference on the token indices it receives."""
    from interop.validate import peer

    class FakeUpstream:
        def sparse_gqa_fwd_interface_triton_ck(self, q, k, v, indices, cu_q, cu_k, kv_lens,
                                               scale, max_q):
            named = {"q": q, "k": k, "v": v, "indices": indices, "cu_seqlens_q": cu_q,
                     "cu_seqlens_k": cu_k, "kv_lens": kv_lens, "softmax_scale": scale}
            return torch.as_tensor(C.reference("sparse_prefill_chunk", {
                n: x.double().numpy() if x.is_floating_point() else x.numpy()
                for n, x in named.items() if hasattr(x, "numpy")} | {"softmax_scale": scale}))

    monkeypatch.setattr(peer, "load_sm121_decode", lambda: None)
    monkeypatch.setattr(peer, "load_sparse_attn", FakeUpstream)
    spec = C.by_name(X.quick_matrix())["prefill/chunk/blocks+dup/per-head/G12xHkv2"]
    inp = X.build_inputs(spec)
    assert inp.named()["indices"] is None and "block_indices" in inp.kwargs
    got = X.load_peer("sglang", device="cpu").fns[inp.entry](*inp.args, **inp.kwargs)
    np.testing.assert_allclose(got.numpy(), X.numpy_reference(spec, inp), rtol=1e-12, atol=1e-12)
