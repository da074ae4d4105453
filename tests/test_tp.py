"""Tensor parallel (issue 19): the end-to-end QSA step split over TP ranks equals the TP1 step.

CPU (in the default run): JAX TP2 and TP4 under ``jax.shard_map`` on the conftest's 4 host
devices (``qsa_pallas.shard_step``, the pool through ``replicate_kv_heads``: TP4 of 24/2 gives
ranks 0, 1 KV head 0 and ranks 2, 3 KV head 1), every device's shard against TP1: bitwise in
batch-invariant decode, else within the contract tolerance; the sharded output against the FP64
reference; a wrongly replicated pool is caught; ``qsa check --tp 2`` (JAX and two
torch.distributed gloo ranks under the Triton interpreter, the DLPack hand-off of the last
rank's tensors) end to end; the refusals (bad TP, a TP1 pool at TP4, too few devices, ``--time``
without GPUs).

GPU (``-m gpu``, needs 2 / 4 CUDA GPUs, skipped otherwise): ``interop.validate.tp.check`` at
production shapes, NCCL ranks one per GPU, the DLPack hand-off on the second GPU.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import qsa_pallas  # noqa: E402
from interop import cases as C  # noqa: E402
from interop.contract import ContractError  # noqa: E402
from interop.validate import cli  # noqa: E402
from interop.validate import tp as TP  # noqa: E402

CPU = TP.tp_cases("cpu")  # decode (batch-invariant), prefill; 24/2 heads


def _mesh(tp):
    if len(jax.devices()) < tp:
        pytest.skip(f"needs {tp} devices (conftest forces 4 host devices on CPU)")
    return Mesh(np.array(jax.devices()[:tp]), ("tp",))


# ---------------------------------------------------------------------------------------------
# the layout
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_rank_heads_give_every_query_head_its_kv_head(tp):
    """Rank r's local query head j uses local KV head j // G_local; that must be the TP1 KV head
    h // 12 of the global query head h; and the replicated pool's split is rank_heads' KV head."""
    pool = jnp.arange(2)[None, :, None] * jnp.ones((3, 1, 2), jnp.int32)  # head id as the value
    rep = qsa_pallas.replicate_kv_heads(pool, tp)
    assert rep.shape[1] == max(2, tp)
    for r in range(tp):
        qs, kvs = TP.rank_heads(24, 2, tp, r)
        g = (qs.stop - qs.start) // (kvs.stop - kvs.start)
        for j in range(qs.stop - qs.start):
            assert kvs.start + j // g == (qs.start + j) // 12
        mine = rep[:, r * rep.shape[1] // tp:(r + 1) * rep.shape[1] // tp]
        np.testing.assert_array_equal(np.asarray(mine[0, :, 0]), np.arange(kvs.start, kvs.stop))
    assert [TP.rank_heads(24, 2, 4, r)[1].start for r in range(4)] == [0, 0, 1, 1]


def test_layout_refusals_before_anything_is_traced(monkeypatch):
    with pytest.raises(ValueError, match="TP3"):
        TP.rank_heads(24, 2, 3, 0)
    with pytest.raises(ContractError, match="'tp'"):
        qsa_pallas.replicate_kv_heads(jnp.zeros((4, 2, 8)), 3)
    from qsa_pallas import step as PS

    monkeypatch.setattr(PS, "_sharded", lambda *a: pytest.fail("traced before the check"))
    data = C.case_data(CPU[0].spec)
    named = {n: jnp.zeros(s, jnp.float16) for n, (s, _) in data.floats.items()}
    named.update({n: jnp.asarray(a) for n, a in data.ints.items()})
    args, kw = data.arguments(named)
    with pytest.raises(ContractError) as e:  # a TP1 pool (2 KV heads) at TP4
        qsa_pallas.shard_step(qsa_pallas.qsa_decode_step, _mesh(4))(*args, **kw)
    assert e.value.arg == "k_cache" and "replicate_kv_heads" in str(e.value)
    with pytest.raises(TP.Unavailable, match="TP8 needs 8 devices"):
        TP.run_jax((8,), CPU)


class torch_like:  # noqa: N801 - stands for a torch tensor: hashable, has a shape, not an array
    def __init__(self, a):
        self.shape = a.shape


@pytest.mark.parametrize("call,arg", [
    (lambda r: r(jnp.zeros((4, 2, 8)), 2.5), "tp"),
    (lambda r: r(jnp.zeros((4, 2, 8)), "2"), "tp"),
    (lambda r: r(jnp.zeros((4, 2, 8)), True), "tp"),
    (lambda r: r(jnp.zeros((4, 2, 8)), 0), "tp"),
    (lambda r: r(jnp.zeros((4, 2, 8)), 2, axis=5), "axis"),
    (lambda r: r(jnp.zeros(8), 2), "axis"),
    (lambda r: r(jnp.zeros((4, 0, 8)), 2), "x"),
    (lambda r: r(torch_like(jnp.zeros((4, 2, 8))), 2), "x"),
])
def test_replicate_kv_heads_refusals(call, arg):
    """A float / str / bool rank count used to be truncated by int() (2.5 -> 2, True -> 1); a
    bad axis, no head or a non-jax tensor failed with IndexError / ZeroDivisionError /
    TypeError."""
    with pytest.raises(ContractError) as e:
        call(qsa_pallas.replicate_kv_heads)
    assert e.value.arg == arg, str(e.value)
    assert "envelope" not in str(e.value)  # no attention envelope on a layout helper


def test_shard_step_keeps_the_step_signature_and_refuses_before_tracing(monkeypatch):
    """Arrays passed by keyword give the positional call's sharded function and inputs; a list
    for an array, an array for a host value, an unknown argument, a mesh without the axis: a
    ContractError naming it before anything is traced (not a TypeError from the jit cache)."""
    from qsa_pallas import step as PS

    seen = []
    monkeypatch.setattr(PS, "_sharded", lambda *a: (seen.append(a), lambda *xs: xs)[1])
    data = C.case_data(CPU[0].spec)
    named = {n: jnp.zeros(s, jnp.float16) for n, (s, _) in data.floats.items()}
    named.update({n: jnp.asarray(a) for n, a in data.ints.items()})
    args, kw = data.arguments(named)
    a = list(args)
    a[1], a[2] = (qsa_pallas.replicate_kv_heads(x, 2) for x in args[1:3])
    step = qsa_pallas.shard_step(qsa_pallas.qsa_decode_step, _mesh(2))
    by_position = step(*a, **kw)
    names = list(C.PARAMS["qsa_decode_step"][0])
    by_name = step(*a[:3], **dict(zip(names[3:], a[3:])), **kw)
    assert seen[0] == seen[1] and len(by_position) == len(by_name) == len(names)
    for x, y in zip(by_position, by_name):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    bad = [({"seq_lens": [1, 2, 3]}, "seq_lens"), ({"topk": jnp.int32(16)}, "topk"),
           ({"top_k": 16}, "arguments"), ({"softmax_scale": jnp.float32(0.1)}, "softmax_scale"),
           ({"seq_lens": torch_like(named["seq_lens"])}, "seq_lens")]
    for change, arg in bad:
        call = dict(zip(names, a), **kw)
        call.update(change)
        with pytest.raises(ContractError) as e:
            step(**call)
        assert e.value.arg == arg and "got got" not in str(e.value), str(e.value)
    with pytest.raises(ContractError, match="host value") as e:  # positional host scalar
        step(*a, 0.1, jnp.float32(1.0), **{n: v for n, v in kw.items() if not n.endswith(
            "scale")})
    assert e.value.arg == "k_scale"
    with pytest.raises(ContractError) as e:
        qsa_pallas.shard_step(qsa_pallas.qsa_decode_step, Mesh(np.array(jax.devices()[:2]),
                                                               ("x",)))(*a, **kw)
    assert e.value.arg == "mesh" and "'tp'" in str(e.value)
    # heads that TP does not divide: the pool's error names the remedy, q's does not (a
    # replicated pool cannot fix q's head count)
    for i, name in ((0, "q"), (1, "k_cache")):
        odd = list(a)
        odd[i] = odd[i][:, :1]
        with pytest.raises(ContractError) as e:
            step(*odd, **kw)
        assert e.value.arg == name and "1 heads" in str(e.value), str(e.value)
        assert ("replicate_kv_heads" in str(e.value)) == (name != "q"), str(e.value)
    assert len(seen) == 2


# ---------------------------------------------------------------------------------------------
# JAX: TP2 and TP4 on host devices
def test_jax_tp2_and_tp4_equal_tp1():
    """Must-show: every device's shard of the TP2 and TP4 steps equals the TP1 step's heads of
    that rank; bitwise in batch-invariant decode (required), and here in the other modes too."""
    _mesh(4)
    results, _ = TP.run_jax((2, 4), CPU)
    assert len(results) == len(CPU) * (2 + 4)
    bad = [r.line() for r in results if not r.passed]
    assert not bad, "\n".join(bad)
    need = [r for r in results if r.bitwise_required]
    assert len(need) == 6 and all(r.bitwise for r in need)  # decode: 2 + 4 ranks
    assert {(r.tp, r.rank, r.kv_heads) for r in results if r.tp == 4} == {
        (4, 0, "0"), (4, 1, "0"), (4, 2, "1"), (4, 3, "1")}


@pytest.mark.parametrize("case", CPU, ids=lambda c: c.spec.kind)
def test_jax_tp4_equals_the_fp64_reference(case):
    """The gathered TP4 output against interop.reference's composition (indexer -> expansion ->
    attention) on the inputs as the kernels saw them."""
    data, args, kw = TP._jax_inputs(case, "cpu")
    a = list(args)
    a[1], a[2] = (qsa_pallas.replicate_kv_heads(x, 4) for x in args[1:3])
    out = qsa_pallas.shard_step(getattr(qsa_pallas, data.entry), _mesh(4))(*a, **kw)
    named = {**data.scalars, **data.ints,
             **{n: np.asarray(x).astype(np.float64) for n, x in zip(C.PARAMS[data.entry][0], args)
                if n in data.floats}}
    v = C.compare(np.asarray(out).astype(np.float64), C.reference(data.entry, named), data.empty)
    assert v["passed"], v


def test_a_wrongly_replicated_pool_fails_the_ranks_it_breaks():
    """``jnp.tile`` instead of ``repeat``: KV heads [0, 1, 0, 1] give ranks 1 and 2 the other
    KV head; judge must fail exactly those two ranks."""
    case = CPU[0]
    data, args, kw = TP._jax_inputs(case, "cpu")
    step = qsa_pallas.qsa_decode_step
    tp1 = step(*args, **kw)
    a = list(args)
    a[1], a[2] = (jnp.tile(x, (1, 2, 1)) for x in args[1:3])
    out = qsa_pallas.shard_step(step, _mesh(4))(*a, **kw)
    verdicts = []
    for r in range(4):
        qs, _ = TP.rank_heads(24, 2, 4, r)
        verdicts.append(TP.judge("jax", case, 4, r, out[:, qs], tp1[:, qs], data.empty[:, qs]))
    assert [v.passed for v in verdicts] == [True, False, False, True], [v.line() for v in verdicts]
    assert "NOT bitwise (required)" in verdicts[1].line()


def test_jax_timing_code_path_runs_on_host_devices():
    """The GPU timing's JAX half (``_time_jax``: chained calls in one jit, the sharded inputs
    placed on the mesh, rank 0's shard alone on one device) runs on host devices; the times
    themselves mean nothing on a CPU."""
    case = CPU[0]
    data, args, kw = TP._jax_inputs(case, "cpu")
    a = list(args)
    a[1], a[2] = (qsa_pallas.replicate_kv_heads(x, 2) for x in args[1:3])
    t = TP._time_jax(case, qsa_pallas.qsa_decode_step, a, kw, _mesh(2), 2, calls=2, rounds=1)
    assert t["single_us"] > 0 and t["rank_us"] > 0 and t["passed"] == (t["ratio"] <= 1.10)


# ---------------------------------------------------------------------------------------------
# qsa check --tp 2: JAX + torch.distributed (gloo) + DLPack, and the refusals
def test_qsa_check_tp2_jax_and_torch_distributed(tmp_path, capsys):
    path = tmp_path / "tp2.json"
    rc = cli.main(["check", "--tp", "2", "--interpret", "--json", str(path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    doc = json.loads(path.read_text())
    ranks = doc["ranks"]
    assert len(ranks) == 2 * len(CPU) * 2 and all(r["passed"] for r in ranks)
    assert {r["framework"] for r in ranks} == {"jax", "torch"}
    assert all(r["bitwise"] for r in ranks if r["bitwise_required"])
    assert sum(r["bitwise_required"] for r in ranks if r["framework"] == "torch") == 2
    dl = doc["dlpack"]
    assert dl["passed"] and dl["rank"] == 1 and dl["placed"] and dl["zero_copy"]
    for line in ("PASS torch TP2 rank 1 tp/decode/batch-invariant (q heads 12-23, KV 1)",
                 "PASS jax   TP2 rank 0 tp/prefill (q heads 0-11, KV 0)", "PASS dlpack TP2 rank 1",
                 "qsa check --tp 2: every rank passed"):
        assert line in out, out


def test_qsa_check_tp_refusals(monkeypatch, capsys):
    assert cli.main(["check", "--tp", "2", "--time", "--interpret"]) == 2
    assert "needs CUDA GPUs" in capsys.readouterr().err
    assert cli.main(["check", "--tp", "2", "--ops", "decode"]) == 2
    assert "--ops do not apply" in capsys.readouterr().err
    assert cli.main(["check", "--time"]) == 2
    with pytest.raises(SystemExit):
        cli.main(["check", "--tp", "3"])
    # a GPU machine with one GPU: a clear refusal before anything runs
    from interop.validate import crosscheck as X

    monkeypatch.setattr(X, "prepare_backends", lambda interpret=None: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(TP, "run_jax", lambda *a, **k: pytest.fail("ran"))
    assert cli.main(["check", "--tp", "2"]) == 2
    assert "needs 2 CUDA GPUs, this machine has 1" in capsys.readouterr().err
    with pytest.raises(TP.Unavailable, match="one rank per GPU"):
        TP.run_torch(2, CPU, device="cuda")


# ---------------------------------------------------------------------------------------------
# GPU: production shapes, one rank per GPU
def _gpus(n):
    if not torch.cuda.is_available() or torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} CUDA GPUs")


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [2, 4])
def test_gpu_tp_both_frameworks_equal_tp1(tp):
    """JAX shard_map over TP GPUs and TP NCCL ranks at D = 256, bf16 (and an FP8 pool), topk
    512, ~32k contexts, prefill 1101 rows: every rank against TP1 (bitwise in batch-invariant
    decode), the DLPack hand-off on the last GPU."""
    _gpus(tp)
    lines = []
    report = TP.check(tp, interpret=False, log=lines.append)
    print("\n".join(lines))
    assert report["passed"], "\n".join(lines)
    dl = report["dlpack"]
    assert dl["torch_device"] == f"cuda:{tp - 1}" and dl["zero_copy"] and dl["back_on_device"]
    assert len(report["ranks"]) == 2 * tp * len(TP.tp_cases("cuda"))
