"""The end-to-end QSA attention step (issue 18 item 2): ``qsa_decode_step`` / ``qsa_prefill_step``
in both packages, indexer -> expansion -> sparse attention from the KV pool.

CPU (Triton interpreter in fp16, Pallas interpret mode): attention D = 64, the indexer at the
contract's 4 heads x 128 with topk 16 (rows with more than 16 visible blocks drop blocks, and the
tests check that the dropping changes the output), integer-valued indexer inputs (exact FP32
logits: the selection, ties included, must be the FP64 reference's), N(0, 1) attention inputs,
NaN in every pool slot no request owns. Every step output is judged against the composition of
the FP64 references: ``interop.reference`` indexer (scoring + exact top-k) ->
``interop.indices.expand_block_indices`` -> ``decode_paged_reference`` / ``prefill_paged_reference``.
The JAX step runs under ``jax.jit`` with transfers to or from the host disallowed, inside a jitted
``lax.scan`` over 2 layers (each layer's output equals that layer's reference; new lengths do
not recompile), under ``shard_map`` on 2 CPU host devices with the KV heads split (bitwise
equal to the unsharded step in batch-invariant mode), and lowers for CUDA at production shapes
without a GPU. Both packages agree; both refuse bad calls
with the same ``ContractError`` before anything runs; the Triton step traces under
``torch.compile(fullgraph=True)``.

GPU (``-m gpu``, the H200): production shapes (D = 256, TP1/TP2 rank shapes, topk 512, 32k
context, B 1..128, FP8 pool and keys), prefill at 1024 rows over 32k, both packages against the
reference, CUDA-graph replay of the Triton step with changed seq_lens, torch.compile, and the JAX
step inside a jitted layer scan.
"""

from __future__ import annotations

import dataclasses

import inspect

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import qsa_pallas  # noqa: E402
import qsa_triton  # noqa: E402
from interop import cases as C  # noqa: E402
from interop import indices as I  # noqa: E402
from interop import reference as R  # noqa: E402
from interop.contract import ContractError, check_decode_step, check_prefill_step  # noqa: E402
from qsa_pallas import _compat  # noqa: E402

ON_GPU = torch.cuda.is_available()
TOPK = 16
JD = {"float16": jnp.float16, "bfloat16": jnp.bfloat16, "float8_e4m3fn": jnp.float8_e4m3fn}
TD = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn}

# The CPU cases: TP1's head pair (24, 2) at D = 64 so that shard_map splits it into two 12/1
# ranks; decode rows with 0, 1, 17, 75 and 250 visible blocks; prefill requests with a cached
# prefix (bottom-right causal) and one whose rows see <= 16 blocks.
DECODE = C.StepSpec("test/step/decode", "decode", 24, 2, 64, (0, 5, 70, 301, 1000), topk=TOPK,
                    dtype="float16", seed=41)
PREFILL = C.StepSpec("test/step/prefill", "prefill", 12, 1, 64, (200, 3, 90), q_lens=(6, 3, 4),
                     topk=TOPK, dtype="float16", seed=42)


# ---------------------------------------------------------------------------------------------
# helpers
def jax_args(data: C.CaseData, values=None):
    values = data.values() if values is None else values
    named = {n: jnp.asarray(values[n]).astype(JD[dt]) for n, (_, dt) in data.floats.items()}
    named.update({n: jnp.asarray(a) for n, a in data.ints.items()})
    return named


def torch_args(data: C.CaseData, device="cpu", values=None):
    values = data.values() if values is None else values
    named = {n: torch.tensor(values[n], device=device).to(TD[dt])
             for n, (_, dt) in data.floats.items()}
    named.update({n: torch.tensor(a, device=device) for n, a in data.ints.items()})
    return named


def f64(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().float().cpu().numpy().astype(np.float64)
    return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


def seen(data: C.CaseData, named) -> dict:
    """The float inputs as the kernels saw them (fp16 / FP8 rounding included), float64."""
    return {n: f64(named[n]) for n in data.floats}


def composed_reference(data: C.CaseData, s: dict, *, dense: bool = False) -> np.ndarray:
    """Reference indexer (scoring + exact top-k) -> reference expansion -> reference attention,
    spelled out (not ``decode_step_reference``). ``dense``: every visible block instead of the
    top-k (what the step would compute if selection dropped nothing)."""
    n = {**data.scalars, **data.ints, **s}
    if data.entry == "qsa_decode_step":
        sl = n["seq_lens"].astype(np.int64)
        topk = max(1, int(sl.max()) // 4) if dense else n["topk"]
        blocks = R.indexer_topk_decode_reference(n["index_q"], n["index_k_cache"],
                                                 n["index_page_table"], sl, topk=topk)
        idx = I.expand_block_indices(blocks, sl - 1, sl, token_topk=4 * blocks.shape[1])
        return R.decode_paged_reference(n["q"], n["k_cache"], n["v_cache"], n["req_to_token"],
                                        n["req_indices"], idx, sl, None, n["k_scale"],
                                        n["v_scale"])
    rs, re, pos, sl = I.prefill_step_rows(n["cu_seqlens_q"], n["kv_lens"],
                                          n["index_cu_seqlens_k"], n["q"].shape[0])
    topk = max(1, int((re - rs).max())) if dense else n["topk"]
    blocks = R.indexer_topk(R.indexer_logits(n["index_q"], n["index_k"], rs, re), topk)
    idx = I.expand_block_indices(blocks, pos, sl, token_topk=4 * blocks.shape[1])
    return R.prefill_paged_reference(n["q"], n["k_cache"], n["v_cache"], n["req_to_token"],
                                     n["req_indices"], idx, n["cu_seqlens_q"], n["kv_lens"], None,
                                     n["k_scale"], n["v_scale"])


def assert_close(out: np.ndarray, ref: np.ndarray, empty: np.ndarray, what: str):
    v = C.compare(out, ref, empty)
    assert v["passed"], f"{what}: {v}"


def call(lib, data, named, **kw):
    args, kwargs = data.arguments(named)
    return getattr(lib, data.entry)(*args, **kwargs, **kw)


_RUNS: dict = {}


def run(impl: str, spec: C.StepSpec):
    """(data, output float64, inputs as seen) of one package's step on a CPU case, once per
    session (the agreement test reuses them). Pallas in batch-invariant mode (decode): the
    shard_map test compares its bits with this output."""
    key = (impl, spec.name)
    if key not in _RUNS:
        data = C.case_data(spec)
        if impl == "triton":
            named = torch_args(data)
            out = call(qsa_triton, data, named)
        else:
            named = jax_args(data)
            extra = {"batch_invariant": True} if spec.kind == "decode" else {}
            out = call(qsa_pallas, data, named, **extra)
        assert tuple(out.shape) == data.floats["q"][0]
        _RUNS[key] = (data, f64(out), seen(data, named))
    return _RUNS[key]


# ---------------------------------------------------------------------------------------------
# CPU: the step equals the composed references, in both packages
@pytest.mark.parametrize("spec", [DECODE, PREFILL], ids=lambda s: s.kind)
def test_selection_really_drops_blocks_and_that_matters(spec):
    """The cases exercise the top-k: some rows see more than topk blocks, and attending to all
    visible blocks instead gives a different output (so a step that skipped the selection, or
    selected wrongly, fails the comparison with the reference)."""
    data = C.case_data(spec)
    s = {n: v.astype(np.float64) for n, v in data.values().items()}
    if spec.kind == "decode":
        blocks = data.ints["seq_lens"] // 4
    else:
        rs, re, _, _ = I.prefill_step_rows(data.ints["cu_seqlens_q"], data.ints["kv_lens"],
                                           data.ints["index_cu_seqlens_k"],
                                           data.floats["q"][0][0])
        blocks = re - rs
    assert (blocks > TOPK).any() and (blocks <= TOPK).any()
    sparse, dense = composed_reference(data, s), composed_reference(data, s, dense=True)
    many = np.nonzero(blocks > TOPK)[0]
    assert not C.compare(sparse[many], dense[many])["allclose"]
    np.testing.assert_allclose(sparse, C.reference(data.entry, {**data.scalars, **data.ints, **s}),
                               rtol=1e-12, atol=1e-12)  # interop.reference's composition


@pytest.mark.parametrize("impl", ["triton", "pallas"])
@pytest.mark.parametrize("spec", [DECODE, PREFILL], ids=lambda s: s.kind)
def test_step_equals_reference_indexer_expansion_attention(impl, spec):
    data, out, s = run(impl, spec)
    assert_close(out, composed_reference(data, s), data.empty, f"{impl} {spec.kind} step")
    if spec.kind == "decode":
        assert data.empty.any() and (out[data.empty] == 0).all()  # the row without context


@pytest.mark.parametrize("spec", [DECODE, PREFILL], ids=lambda s: s.kind)
def test_both_packages_agree(spec):
    _, a, _ = run("triton", spec)
    _, b, _ = run("pallas", spec)
    assert np.all(np.abs(a - b) <= C.ATOL + C.RTOL * np.abs(a)), float(np.abs(a - b).max())


def test_prefill_step_rows_same_rule_in_three_frameworks():
    """Rows before cu_seqlens_q[0] and past cu_seqlens_q[B] (padding), a request with no keys,
    a request whose rows see all of its keys."""
    cu = np.array([2, 5, 5, 9], np.int32)
    kv = np.array([10, 0, 7], np.int32)
    ck = np.array([0, 2, 2, 3], np.int32)
    want = I.prefill_step_rows(cu, kv, ck, 12)
    got_t = qsa_triton.prefill_step_rows(*(torch.tensor(a) for a in (cu, kv, ck)), 12)
    got_j = jax.jit(qsa_pallas.prefill_step_rows, static_argnums=3)(
        *(jnp.asarray(a) for a in (cu, kv, ck)), 12)
    for w, t, j in zip(want, got_t, got_j):
        np.testing.assert_array_equal(t.numpy(), w)
        np.testing.assert_array_equal(np.asarray(j), w)
    rs, re, pos, sl = want
    assert (pos[:2] == -1).all() and (pos[9:] == -1).all() and (sl[9:] == 0).all()
    # bad metadata is refused before anything runs, never truncated into other rows
    for fw, arr in (("triton", torch.tensor), ("pallas", jnp.asarray)):
        f = qsa_triton.prefill_step_rows if fw == "triton" else qsa_pallas.prefill_step_rows
        good = [arr(a) for a in (cu, kv, ck)]
        for bad, total, arg in (((good[0], arr(kv[:2]), good[2]), 12, "kv_lens"),
                                ((arr(cu.astype(np.float32)), *good[1:]), 12, "cu_seqlens_q"),
                                ((good[0], good[1], arr(ck[:3])), 12, "index_cu_seqlens_k"),
                                (good, 12.5, "total_rows"), (good, -1, "total_rows")):
            with pytest.raises(ContractError) as info:
                f(*bad, total)
            assert info.value.arg == arg, (fw, arg, str(info.value))
    with pytest.raises(ContractError, match="a host int") as info:  # a traced row count
        jax.jit(qsa_pallas.prefill_step_rows)(*(jnp.asarray(a) for a in (cu, kv, ck)), 12)
    assert info.value.arg == "total_rows"
    np.testing.assert_array_equal(pos[2:5], [7, 8, 9])
    np.testing.assert_array_equal(re[2:5] - rs[2:5], [2, 2, 2])  # floor((p+1)/4) capped at 2


# ---------------------------------------------------------------------------------------------
# CPU: JAX under jit (no host transfer), lax.scan over layers, shard_map
def test_jax_step_in_jitted_layer_scan_without_host_transfers():
    """Two layers' pools, caches and queries stacked as the scan's xs, the request tables shared;
    the whole scan jitted and run with every host<->device transfer disallowed. Each layer equals
    its own reference; new seq_lens (the same shapes) reuse the compiled scan."""
    data = C.case_data(DECODE)
    rng = np.random.default_rng(5)
    layers = []
    for layer in range(2):
        v = data.values()
        for n in v:  # a different layer: fresh values, same structure (NaN poison kept)
            fresh = (rng.integers(-2, 3, v[n].shape) if n in data.integer_valued
                     else rng.standard_normal(v[n].shape))
            v[n] = np.where(np.isnan(v[n]), v[n], fresh).astype(np.float32)
        layers.append(jax_args(data, v))
    per_layer = ("q", "k_cache", "v_cache", "index_q", "index_k_cache")
    xs = tuple(jnp.stack([lay[n] for lay in layers]) for n in per_layer)
    shared = {n: layers[0][n] for n in ("req_to_token", "req_indices", "index_page_table")}

    @jax.jit
    def forward(xs, seq_lens, req_to_token, req_indices, index_page_table):
        def layer(carry, x):
            q, kc, vc, iq, ikc = x
            o = qsa_pallas.qsa_decode_step(q, kc, vc, req_to_token, req_indices, iq, ikc,
                                           index_page_table, seq_lens, topk=TOPK)
            return carry, o
        return jax.lax.scan(layer, 0, xs)[1]

    xs, seq0 = jax.device_put(xs), jax.device_put(layers[0]["seq_lens"])
    shared = jax.device_put(shared)
    seq1 = jax.device_put(jnp.asarray(np.maximum(data.ints["seq_lens"] - 37, 0).astype(np.int32)))
    with jax.transfer_guard("disallow"):
        out0 = forward(xs, seq0, **shared)
        out1 = forward(xs, seq1, **shared)
    assert forward._cache_size() == 1
    for seq, out in ((data.ints["seq_lens"], out0), (np.asarray(seq1), out1)):
        d = C.CaseData(data.spec, data.entry, data.floats, {**data.ints, "seq_lens": seq},
                       data.scalars, data.poison, np.repeat((seq <= 0)[:, None], 24, 1))
        for i, lay in enumerate(layers):
            assert_close(f64(out[i]), composed_reference(d, seen(d, lay)), d.empty,
                         f"layer {i}, seq_lens {seq.tolist()}")


def test_jax_step_under_shard_map_kv_heads_split():
    """TP2 from TP1's (24, 2): each of 2 host devices holds 12 query heads and one KV head of the
    pool; the indexer inputs and request tables are replicated (every device runs the indexer,
    as upstream's tensor-parallel layers do). Batch-invariant mode: the plan depends on the group
    and width only, so the sharded step is bitwise the unsharded one."""
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices (conftest forces 2 host devices on CPU)")
    data, unsharded, _ = run("pallas", DECODE)
    named = jax_args(data)
    args, _ = data.arguments(named)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("tp",))
    heads = P(None, "tp", None)
    in_specs = (heads, heads, heads) + (P(),) * 6  # q, k_cache, v_cache split; the rest replicated
    local_shapes = []

    def local(*a):
        local_shapes.append((a[0].shape[1], a[1].shape[1]))
        return qsa_pallas.qsa_decode_step(*a, topk=TOPK, batch_invariant=True)

    f = jax.jit(_compat.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=heads))
    out = f(*args)
    assert local_shapes[0] == (12, 1)
    assert len(out.sharding.device_set) == 2
    np.testing.assert_array_equal(f64(out), unsharded)


@pytest.mark.parametrize("kind", ["NVIDIA H200", "NVIDIA RTX PRO 6000 Blackwell Workstation Edition"])
def test_jax_steps_lower_for_cuda_at_production_shapes(kind):
    """Without a GPU: both steps trace and lower for CUDA (an abstract device of that kind) at
    production shapes (TP2, D = 256, bf16, topk 512, 32k context; prefill 1024 rows), and the
    lowered module holds exactly the indexer's kernels (decode two, prefill four) and the
    attention kernel."""
    import functools

    sds, i32, bf = jax.ShapeDtypeStruct, jnp.int32, jnp.bfloat16
    b, ctx, t, pages = 16, 32768, 1024, 2048
    pool = sds((pages * 64, 1, 256), bf)
    dec = (sds((b, 12, 256), bf), pool, pool, sds((b + 2, ctx), i32), sds((b,), i32),
           sds((b, 4, 128), bf), sds((pages, 16, 1, 128), bf), sds((b, ctx // 64), i32),
           sds((b,), i32))
    pre = (sds((t, 12, 256), bf), pool, pool, sds((3, ctx), i32), sds((1,), i32),
           sds((t, 4, 128), bf), sds((ctx // 4, 1, 128), bf), sds((2,), i32), sds((2,), i32),
           sds((1,), i32))
    for fn, args, attn in (
            (functools.partial(qsa_pallas.qsa_decode_step, interpret=False), dec,
             "qsa_decode_paged_split"),
            (functools.partial(qsa_pallas.qsa_prefill_step, max_seqlen_q=t, interpret=False), pre,
             "qsa_sparse_prefill_paged")):
        names = [m.name for m in _compat.triton_modules(
            _compat.lower_for_device_kind(fn, args, kind))]
        # prefill at 32k: the bound pass before the streamed pass 1, then its fixup
        bound = (["qsa_indexer_prefill_bound", "qsa_indexer_prefill_fixup"]
                 if attn == "qsa_sparse_prefill_paged" else [])
        chunk = [n for n in names if n.startswith("qsa_indexer_") and n.endswith("_chunk")]
        assert len(chunk) == 1, names
        assert sorted(names) == sorted(chunk + bound + ["qsa_indexer_merge", attn]), names


# ---------------------------------------------------------------------------------------------
# CPU: one interface, one contract, torch.compile
def test_same_names_same_parameters():
    """Same names, order, kinds and defaults in both packages (Pallas adds ``interpret``), and
    the step's positional parameters are ``interop.cases.PARAMS``' (what ``qsa check`` passes)."""
    for name in ("qsa_decode_step", "qsa_prefill_step", "prefill_step_rows"):
        pt = inspect.signature(getattr(qsa_triton, name)).parameters
        pj = inspect.signature(getattr(qsa_pallas, name)).parameters
        t = [(p.name, p.kind, p.default) for p in pt.values()]
        j = [(p.name, p.kind, p.default) for p in pj.values() if p.name != "interpret"]
        assert t == j, name
        if name in C.PARAMS:
            pos, kws = C.PARAMS[name]
            assert tuple(pt)[:len(pos) + 3] == pos + kws[:3], name
            assert pt["topk"].kind == pt["topk"].KEYWORD_ONLY and pt["topk"].default == 512


def _bad_decode_calls(named, f32):
    """(argument the error must name, the call's arrays with one bad change) pairs."""
    def with_(**kw):
        return {**named, **kw}

    n = named
    return [
        ("index_q", with_(index_q=n["index_q"][:-1])),                      # rows != q's rows
        ("index_q", with_(index_q=f32(n["index_q"]))),
        ("index_k_cache", with_(index_k_cache=n["index_k_cache"][..., :64])),
        ("index_page_table", with_(index_page_table=n["index_page_table"][:2])),
        ("q", with_(q=f32(n["q"]))),
        ("q", with_(q=n["q"][:0], index_q=n["index_q"][:0])),                # no rows
        ("seq_lens", with_(seq_lens=n["seq_lens"][:3])),
        ("k_cache", with_(k_cache=n["k_cache"][..., :32], v_cache=n["v_cache"][..., :32])),
    ]


def test_bad_calls_same_contract_error_before_anything_runs(monkeypatch):
    """Every refusal names the step's argument, with the same text for torch, JAX and the bare
    checker, and nothing is launched (the indexer entry points are replaced by a tripwire)."""
    data = C.case_data(DECODE)
    tn, jn = torch_args(data), jax_args(data)
    boom = lambda *a, **k: pytest.fail("launched before the contract check")  # noqa: E731
    from qsa_pallas import step as PS
    from qsa_triton import step as TS
    monkeypatch.setattr(TS, "indexer_select_decode", boom)
    monkeypatch.setattr(PS, "indexer_select_decode", boom)
    for (arg, bt), (_, bj) in zip(_bad_decode_calls(tn, lambda x: x.float()),
                                  _bad_decode_calls(jn, lambda x: x.astype(jnp.float32))):
        with pytest.raises(ContractError) as e_t:
            call(qsa_triton, data, bt)
        with pytest.raises(ContractError) as e_j:
            call(qsa_pallas, data, bj)
        a, k = data.arguments(bt)
        with pytest.raises(ContractError) as e_c:
            check_decode_step(*a, **k)
        assert e_t.value.arg == arg, (arg, str(e_t.value))
        if arg == "index_k_cache":  # the head dim it must match is index_q's, not q's
            assert "(index_q's)" in str(e_t.value), str(e_t.value)
        assert str(e_t.value) == str(e_j.value) == str(e_c.value)
        assert str(e_t.value).startswith("qsa_decode_step: argument")
        assert "attention:" in str(e_t.value) and "indexer:" in str(e_t.value)
    a, k = data.arguments(tn)
    with pytest.raises(ContractError, match="'topk'"):
        qsa_triton.qsa_decode_step(*a, **{**k, "topk": 500})
    with pytest.raises(ContractError, match="strict mode"):  # D = 64, topk 16: not qualified
        qsa_triton.qsa_decode_step(*a, **k, strict=True)
    with pytest.raises(ContractError, match="'q'"):  # torch tensors into the JAX step
        qsa_pallas.qsa_decode_step(*a, **k)


def test_prefill_bad_calls():
    data = C.case_data(PREFILL)
    tn, jn = torch_args(data), jax_args(data)
    for named, lib in ((tn, qsa_triton), (jn, qsa_pallas)):
        for arg, change in (("index_cu_seqlens_k", {"index_cu_seqlens_k":
                                                    named["index_cu_seqlens_k"][:-1]}),
                            ("index_k", {"index_k": named["index_k"][:, :, :64]}),
                            ("index_q", {"index_q": named["index_q"][1:]}),
                            ("kv_lens", {"kv_lens": named["kv_lens"][:1]})):
            with pytest.raises(ContractError) as e:
                call(lib, data, {**named, **change})
            assert e.value.arg == arg and e.value.fn == "qsa_prefill_step", str(e.value)
    a, k = data.arguments(tn)
    with pytest.raises(ContractError, match="max_seqlen_q"):
        check_prefill_step(*a[:-1], 0, **k)


def test_context_past_the_default_indexer_plan_is_refused_with_the_steps_names(monkeypatch):
    """A context past what the indexer's default plan covers (2^21 blocks a decode row, 2^20
    packed prefill keys at topk 512) is refused by the step's check, naming the step's
    argument, before the indexer entry point runs (tripwire) or anything is traced."""
    from qsa_pallas import step as PS
    from qsa_triton import step as TS

    boom = lambda *a, **k: pytest.fail("reached the indexer entry point")  # noqa: E731
    for mod in (TS, PS):
        for name in ("indexer_select_decode", "indexer_select_prefill"):
            monkeypatch.setattr(mod, name, boom)
    cases = [(dataclasses.replace(DECODE, topk=512), "index_page_table",
              lambda v: np.zeros((v.shape[0], 2**21 // 16 + 1), np.int32)),
             (dataclasses.replace(PREFILL, topk=512), "index_k",
              lambda v: np.zeros((2**20 + 1,) + v.shape[1:], np.float16))]
    for spec, arg, big in cases:
        data = C.case_data(spec)
        x = big({**data.values(), **data.ints}[arg])
        for lib, named in ((qsa_triton, {**torch_args(data), arg: torch.from_numpy(x)}),
                           (qsa_pallas, {**jax_args(data), arg: jnp.asarray(x)})):
            with pytest.raises(ContractError) as e:
                call(lib, data, named)
            assert e.value.arg == arg and e.value.fn == f"qsa_{spec.kind}_step", str(e.value)


def test_triton_step_traces_under_torch_compile():
    """fullgraph: the metadata ops and both custom ops trace (aot_eager: the kernels themselves
    run in the interpreter); same output as eager."""
    data, eager, _ = run("triton", PREFILL)
    args, kwargs = data.arguments(torch_args(data))

    def f(*a):
        return qsa_triton.qsa_prefill_step(*a, **kwargs)

    torch._dynamo.reset()
    cf = torch.compile(f, fullgraph=True, backend="aot_eager")
    np.testing.assert_array_equal(f64(cf(*args)), eager)
    # a max_seqlen_q hint that changes between calls (symbolic from the second value on)
    i = C.PARAMS["qsa_prefill_step"][0].index("max_seqlen_q")
    for hint in (args[i] + 1, args[i] + 2):
        np.testing.assert_array_equal(f64(cf(*args[:i], hint, *args[i + 1:])), eager)


# ---------------------------------------------------------------------------------------------
# GPU (H200): production shapes, CUDA graphs, torch.compile, the JAX layer scan
gpu = pytest.mark.gpu


def _gpu_inputs(spec):
    """Case data on the GPU: values drawn by torch there (crosscheck.build_inputs), torch and
    jax views of the same buffers (zero-copy)."""
    from interop.dlpack import to_jax
    from interop.validate.crosscheck import build_inputs

    inp = build_inputs(spec, "cuda")
    named = inp.named()
    torch.cuda.synchronize()
    return inp.host["case"], named, {n: to_jax(x) if isinstance(x, torch.Tensor) else x
                                     for n, x in named.items()}


def _row_reference(data, named, rows):
    """The FP64 step reference of a subset of decode rows (the pool and caches whole: the step
    cases share a 2048-page pool, 0.5 GB in float64 at TP1)."""
    rows = np.asarray(rows)
    h = {n: f64(named[n]) for n in ("k_cache", "v_cache", "index_k_cache")}
    sub = {n: data.ints[n][rows] for n in ("req_indices", "index_page_table", "seq_lens")}
    return R.decode_step_reference(f64(named["q"][rows]), h["k_cache"], h["v_cache"],
                                   data.ints["req_to_token"], sub["req_indices"],
                                   f64(named["index_q"][rows]), h["index_k_cache"],
                                   sub["index_page_table"], sub["seq_lens"], None,
                                   data.scalars["k_scale"], data.scalars["v_scale"],
                                   topk=data.scalars["topk"])


def _gpu_spec(tp, b, *, fp8=False, seed=0):
    hq, hkv = C.TP_SHAPES[tp]
    rng = np.random.default_rng(seed)
    ctx = 32768 - rng.integers(0, 300, size=b)
    ctx[-1] = 32768
    extra = dict(kv_dtype="float8_e4m3fn", k_scale=0.75, v_scale=1.5,
                 index_k_dtype="float8_e4m3fn") if fp8 else {}
    return C.StepSpec(f"gpu/step/{tp}/B{b}", "decode", hq, hkv, 256, tuple(int(c) for c in ctx),
                      dtype="bfloat16", pool_pages=2048, seed=seed, **extra)


@gpu
@pytest.mark.parametrize("tp,b,fp8", [("TP1", 1, False), ("TP1", 16, False), ("TP2", 64, False),
                                      ("TP1", 128, False), ("TP2", 128, True), ("TP4", 32, True)])
def test_gpu_decode_step_production(tp, b, fp8):
    data, tn, jn = _gpu_inputs(_gpu_spec(tp, b, fp8=fp8, seed=b))
    args_t, kw = data.arguments(tn)
    out_t = qsa_triton.qsa_decode_step(*args_t, **kw)
    args_j, _ = data.arguments(jn)
    out_j = qsa_pallas.qsa_decode_step(*args_j, **kw)
    rows = sorted({0, b // 2, b - 1})
    ref = _row_reference(data, tn, rows)
    empty = np.zeros(ref.shape[:2], bool)
    assert_close(f64(out_t)[rows], ref, empty, "triton")
    assert_close(f64(out_j)[rows], ref, empty, "pallas")
    a, c = f64(out_t), f64(out_j)
    assert np.all(np.abs(a - c) <= C.ATOL + C.RTOL * np.abs(a))
    assert torch.equal(out_t, qsa_triton.qsa_decode_step(*args_t, **kw))  # deterministic


@gpu
def test_gpu_cuda_graph_replay_with_changed_seq_lens():
    b = 16
    data, tn, _ = _gpu_inputs(_gpu_spec("TP1", b, seed=3))
    args, kw = data.arguments(tn)
    seq = tn["seq_lens"]
    qsa_triton.qsa_decode_step(*args, **kw)  # compile before capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode="thread_local"):
        out = qsa_triton.qsa_decode_step(*args, **kw)
    rng = np.random.default_rng(1)
    base = data.ints["seq_lens"].copy()
    for shrink in (np.zeros(b, int), rng.integers(0, 32768, size=b), rng.integers(0, 9, size=b)):
        new = np.maximum(base - shrink, 0).astype(np.int32)
        seq.copy_(torch.tensor(new))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, qsa_triton.qsa_decode_step(*args, **kw))
        d = C.CaseData(data.spec, data.entry, data.floats, {**data.ints, "seq_lens": new},
                       data.scalars, data.poison, data.empty)
        rows = [0, 7, 15]
        ref = _row_reference(d, tn, rows)
        assert_close(f64(out)[rows], ref, np.repeat((new[rows] <= 0)[:, None], ref.shape[1], 1),
                     f"replay seq_lens {new[rows].tolist()}")


@gpu
def test_gpu_torch_compile_fullgraph():
    data, tn, _ = _gpu_inputs(_gpu_spec("TP2", 8, seed=4))
    args, kw = data.arguments(tn)

    def f(*a):
        return qsa_triton.qsa_decode_step(*a, **kw)

    torch._dynamo.reset()
    assert torch.equal(torch.compile(f, fullgraph=True)(*args), f(*args))


@gpu
def test_gpu_prefill_step_1024_rows_over_32k():
    spec = C.StepSpec("gpu/step/prefill", "prefill", 12, 1, 256, (32768, 5000), q_lens=(1024, 77),
                      dtype="bfloat16", pool_pages=2048, seed=5)
    data, tn, jn = _gpu_inputs(spec)
    args_t, kw = data.arguments(tn)
    out_t = qsa_triton.qsa_prefill_step(*args_t, **kw)
    out_j = qsa_pallas.qsa_prefill_step(*data.arguments(jn)[0], **kw)
    ref = C.reference(data.entry, {**data.scalars, **data.ints,
                                   **{n: f64(tn[n]) for n in data.floats}})
    assert_close(f64(out_t), ref, data.empty, "triton prefill step")
    assert_close(f64(out_j), ref, data.empty, "pallas prefill step")


@gpu
def test_gpu_jax_step_in_jitted_layer_scan():
    """Two layers (the second with its query rows reversed) in a jitted scan on the GPU: each
    layer equals the direct call and the FP64 reference."""
    data, _, jn = _gpu_inputs(_gpu_spec("TP2", 16, seed=6))
    per_layer = ("q", "k_cache", "v_cache", "index_q", "index_k_cache")
    xs = tuple(jnp.stack([jn[n], jn[n][::-1] if n in ("q", "index_q") else jn[n]])
               for n in per_layer)

    @jax.jit
    def forward(xs, seq_lens, req_to_token, req_indices, index_page_table):
        def layer(c, x):
            return c, qsa_pallas.qsa_decode_step(x[0], x[1], x[2], req_to_token, req_indices,
                                                 x[3], x[4], index_page_table, seq_lens,
                                                 topk=topk)
        return jax.lax.scan(layer, 0, xs)[1]

    topk = data.scalars["topk"]
    out = forward(xs, jn["seq_lens"], jn["req_to_token"], jn["req_indices"],
                  jn["index_page_table"])
    rows = [0, 5, 15]
    for i in range(2):
        layer = {**jn, "q": xs[0][i], "index_q": xs[3][i]}
        a, k = data.arguments(layer)
        want = qsa_pallas.qsa_decode_step(*a, **k)
        a, w = f64(out[i]), f64(want)
        assert np.all(np.abs(a - w) <= C.ATOL + C.RTOL * np.abs(w)), f"layer {i}"
        ref = _row_reference(data, layer, rows)
        assert_close(a[rows], ref, np.zeros(ref.shape[:2], bool), f"layer {i}")
