"""interop.validate.capture (format qsa-capture/1) and ``qsa replay`` / ``qsa capture``: round trips of
every dtype and metadata field, capture_call, replay of a CPU capture made by the real kernels
and of a bf16 capture (as the GPU produces), the paged decode (BF16 and FP8 pools,
batch-invariant mode), failures named, bad files refused."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from interop.validate import capture as CAP  # noqa: E402
from interop.validate import cli  # noqa: E402
from interop.validate import crosscheck as X  # noqa: E402
from interop import reference as R  # noqa: E402
from tests.test_crosscheck import _oracle, fakes  # noqa: E402


def _case(name):
    return next(s for s in X.quick_matrix() if s.name == name)


def test_save_load_round_trip_every_dtype(tmp_path):
    spec = _case("prefill/paged/fp8+empty/G6xHkv2")
    inp = X.build_inputs(spec)
    pos, kws = X.PARAMS[inp.entry]
    values = dict(zip(pos, inp.args)) | inp.kwargs
    out = torch.randn(inp.args[0].shape).to(torch.bfloat16)
    path = CAP.save_capture(tmp_path / "sub" / "c.safetensors", inp.entry, values, expected=out,
                            model_revision="rev-123", producer="unit", note="hello")
    cap = CAP.load_capture(path)
    assert cap.entry == "sparse_prefill_paged" and cap.op == "prefill"
    for name, t in zip(pos, inp.args):
        if isinstance(t, torch.Tensor):
            got = cap.tensors[name]
            assert got.dtype == t.dtype and got.shape == t.shape
            assert torch.equal(got.view(torch.uint8) if got.dtype == torch.float8_e4m3fn else got,
                               t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t)
        else:
            assert cap.scalars[name] == t
    assert cap.scalars["k_scale"] == spec.k_scale and cap.scalars["softmax_scale"] is None
    assert torch.equal(cap.expected, out)
    m = cap.metadata
    assert m["format"] == "qsa-capture/1" and m["arch"] == "cpu" and m["model_revision"] == "rev-123"
    assert m["rank_shape"] == "Hq=12 Hkv=2 D=64" and m["producer"] == "unit" and m["note"] == "hello"
    assert json.loads(m["fp8_tensors"]) == [["k_cache", "float8_e4m3fn"], ["v_cache", "float8_e4m3fn"]]
    assert "torch" in json.loads(m["versions"]) and m["created"].endswith("+00:00")
    # numpy-only readers can open it (FP8 stored as raw bytes)
    from safetensors.numpy import load_file

    raw = load_file(str(path))
    assert raw["k_cache"].dtype == np.uint8 and raw["q"].dtype == np.float16
    # the inputs rebuilt for the runner are the same call
    again = cap.inputs("cpu")
    assert again.entry == inp.entry and again.kwargs == inp.kwargs
    assert all(torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
               if isinstance(a, torch.Tensor) else a == b for a, b in zip(again.args, inp.args))


def test_capture_call_and_errors(tmp_path):
    spec = _case("decode/TP1/B4/medium")
    inp = X.build_inputs(spec)
    fn = _oracle("sparse_decode")
    fn.__name__ = "sparse_decode"
    out = CAP.capture_call(fn, *inp.args, path=tmp_path / "d.safetensors", softmax_scale=0.1,
                           model_revision="m")
    cap = CAP.load_capture(tmp_path / "d.safetensors")
    assert torch.equal(cap.expected, out) and cap.scalars == {"max_seqlen_k": 67,
                                                              "softmax_scale": 0.1}
    assert cap.metadata["rank_shape"] == "TP1 Hq=24 Hkv=2 D=64"
    with pytest.raises(ValueError, match="entry"):
        CAP.capture_call(lambda *a: None, *inp.args, path=tmp_path / "x.safetensors")
    with pytest.raises(ValueError, match="missing"):
        CAP.save_capture(tmp_path / "y.safetensors", "sparse_decode", {"q": inp.args[0]})
    with pytest.raises(ValueError, match="unknown entry"):
        CAP.save_capture(tmp_path / "y.safetensors", "sparse_attention", {})
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="not a qsa-capture/1"):
        CAP.load_capture(tmp_path / "other.safetensors")


def test_replay_cpu_capture_made_by_the_real_kernels(tmp_path, capsys):
    """`qsa capture` on the CPU (interpret mode), then `qsa replay` with both implementations."""
    impls = X.load_implementations(interpret=True)
    if "sparse_prefill_chunk" not in impls[0].fns or "sparse_prefill_chunk" not in impls[1].fns:
        pytest.skip("kernels not written yet")
    f1, f2 = tmp_path / "dec.safetensors", tmp_path / "chunk.safetensors"
    assert cli.main(["capture", "--case", "decode/TP2/B4/saturated+poison", "--out", str(f1),
                     "--interpret"]) == 0
    assert cli.main(["capture", "--case", "prefill/chunk/fp8/G12xHkv1", "--impl", "pallas",
                     "--out", str(f2), "--interpret"]) == 0
    rc = cli.main(["replay", str(f1), str(f2), "--interpret", "--json", str(tmp_path / "r.json")])
    text = capsys.readouterr().out
    assert rc == 0, text
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["passed"] and len(doc["files"]) == 2
    for f in doc["files"]:
        assert f["stored"]["within_tolerance"]
        for name in ("triton", "pallas"):
            r = f["result"]["impl"][name]
            assert r["passed"] and r["rel_l2"] <= X.REL_L2 and r["rel_l2_vs_expected"] < 5e-3
    # the implementation that produced the stored output reproduces it exactly
    assert doc["files"][0]["result"]["impl"]["triton"]["rel_l2_vs_expected"] == 0.0
    assert doc["files"][1]["result"]["impl"]["pallas"]["rel_l2_vs_expected"] == 0.0


def _bf16_capture(path):
    """A bf16 call as the GPU captures it (stored output = reference rounded to bf16)."""
    spec = X.DecodeSpec("gpu-like", 12, 1, 64, 3, "mixed", max_len=40, dtype="bfloat16", seed=9)
    inp = X.build_inputs(spec)
    ref = X.numpy_reference(spec, inp)
    pos, _ = X.PARAMS[inp.entry]
    CAP.save_capture(path, inp.entry, dict(zip(pos, inp.args)),
                     expected=torch.as_tensor(ref).to(torch.bfloat16), model_revision="gpu-sim")
    return inp, ref


def test_replay_bf16_capture_with_fakes_and_stored_output(tmp_path, monkeypatch, capsys):
    path = tmp_path / "bf16.safetensors"
    _bf16_capture(path)
    monkeypatch.setattr(cli, "load_check_implementations", lambda interpret: fakes())
    assert cli.main(["replay", str(path), "--interpret"]) == 0
    text = capsys.readouterr().out
    assert "all files passed" in text and "gpu-sim" in text


def test_replay_bf16_capture_real_kernels(tmp_path):
    """Pallas runs bf16 in interpret mode; Triton's interpreter only with the test patch (else the
    case is skipped with the reason, not failed)."""
    path = tmp_path / "bf16.safetensors"
    _bf16_capture(path)
    impls = X.load_implementations(interpret=True)
    [(cap, res, stored)] = CAP.replay([path], impls, device="cpu")
    assert stored["within_tolerance"] and stored["rel_l2_vs_reference"] < 5e-3
    assert res.impl["pallas"]["passed"], res.failures
    tri = res.impl["triton"]
    assert tri.get("skipped") or tri["passed"], res.failures
    assert res.passed


def test_replay_fails_on_a_wrong_kernel_and_refuses_bad_files(tmp_path, monkeypatch, capsys):
    path = tmp_path / "bf16.safetensors"
    _bf16_capture(path)
    good = fakes()
    bad_fn = _oracle("sparse_decode")
    wrong = X.Implementation("triton", "torch",
                             {"sparse_decode": lambda *a, **k: bad_fn(*a, **k) * 1.5})
    monkeypatch.setattr(cli, "load_check_implementations", lambda interpret: [wrong, good[1]])
    assert cli.main(["replay", str(path), "--interpret"]) == 1
    text = capsys.readouterr().out
    assert f"FAIL {path}" in text and "triton: " in text
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    assert cli.main(["replay", str(tmp_path / "junk.safetensors"), "--interpret"]) == 2
    assert cli.main(["capture", "--case", "no/such/case", "--out", str(tmp_path / "x"),
                     "--interpret"]) == 2


def test_stored_output_outside_tolerance_is_reported_not_judged(tmp_path, monkeypatch):
    spec = _case("decode/TP4/B1/short")
    inp = X.build_inputs(spec)
    pos, _ = X.PARAMS[inp.entry]
    ref = X.numpy_reference(spec, inp)
    CAP.save_capture(tmp_path / "s.safetensors", inp.entry, dict(zip(pos, inp.args)),
                     expected=torch.as_tensor(ref * 2).half())
    [(cap, res, stored)] = CAP.replay([tmp_path / "s.safetensors"], fakes(), device="cpu")
    assert not stored["within_tolerance"] and res.passed
    assert res.impl["triton"]["rel_l2_vs_expected"] == pytest.approx(0.5, rel=1e-2)
    assert R.rel_l2(ref * 2, ref) == pytest.approx(1.0)
    # the CLI warns by default and fails with --fail-on-stored
    f = str(tmp_path / "s.safetensors")
    assert cli.main(["replay", "--interpret", f]) == 0
    assert cli.main(["replay", "--interpret", "--fail-on-stored", f]) == 1


# --------------------------------------------------------------------------------------------
# sparse_decode_paged: the pool stored as given (NaN in free slots, FP8 as raw bytes)
def _fp8_bytes(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def test_paged_decode_round_trip_fp8_pool_and_batch_invariant(tmp_path):
    spec = _case("paged/G6xHkv2/fp8+per-head+empty/W35")
    inp = X.build_inputs(spec)
    pos, kws = X.PARAMS[inp.entry]
    values = dict(zip(pos, inp.args)) | {"k_scale": spec.k_scale, "batch_invariant": True}
    path = CAP.save_capture(tmp_path / "p.safetensors", inp.entry, values,
                            expected=torch.zeros(inp.args[0].shape, dtype=torch.float16))
    cap = CAP.load_capture(path)
    assert cap.entry == "sparse_decode_paged" and cap.op == "paged"
    assert cap.metadata["op"] == "paged" and cap.metadata["rank_shape"] == "Hq=12 Hkv=2 D=64"
    for name, t in zip(pos, inp.args):  # every tensor bit-exact, the whole pool included
        assert cap.tensors[name].dtype == t.dtype and cap.tensors[name].shape == t.shape
        assert torch.equal(_fp8_bytes(cap.tensors[name]), _fp8_bytes(t)), name
    pool = cap.tensors["k_cache"].float()
    assert pool.isnan().any() and pool.isnan().sum() == inp.args[1].float().isnan().sum()
    # keyword parameters: given ones kept (a bool stays a bool), missing ones at their defaults
    assert cap.scalars == {"softmax_scale": None, "k_scale": spec.k_scale, "v_scale": 1.0,
                           "batch_invariant": True}
    assert json.loads(cap.metadata["fp8_tensors"]) == [["k_cache", "float8_e4m3fn"],
                                                       ["v_cache", "float8_e4m3fn"]]
    again = cap.inputs("cpu")
    assert again.entry == inp.entry and again.kwargs["batch_invariant"] is True
    assert [n for n in kws] == ["softmax_scale", "k_scale", "v_scale", "batch_invariant"]
    s = CAP.spec_for(cap, "p")
    assert isinstance(s, X.PagedSpec) and s.kv_dtype == "float8_e4m3fn" and s.per_head
    assert s.batch_invariant and s.pool_slots == inp.args[1].shape[0]
    assert s.size == inp.args[0].shape[0] * inp.args[5].shape[-1] * 12 * 64


def test_replay_paged_decode_cpu_captures_made_by_the_real_kernels(tmp_path, capsys):
    """`qsa capture` of two paged-decode cases (FP8 pool by Pallas, batch-invariant fp16 pool by
    Triton), then `qsa replay` with both implementations against the FP64 reference."""
    f1, f2 = tmp_path / "fp8.safetensors", tmp_path / "bi.safetensors"
    assert cli.main(["capture", "--case", "paged/G6xHkv2/fp8+per-head+empty/W35", "--impl",
                     "pallas", "--out", str(f1), "--interpret"]) == 0
    assert cli.main(["capture", "--case", "paged/TP1/batch-invariant/W35", "--out", str(f2),
                     "--interpret"]) == 0
    assert CAP.load_capture(f2).scalars["batch_invariant"] is True
    rc = cli.main(["replay", str(f1), str(f2), "--interpret", "--json", str(tmp_path / "r.json")])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "sparse_decode_paged" in text and "all files passed" in text
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["passed"] and [f["metadata"]["op"] for f in doc["files"]] == ["paged", "paged"]
    for f, producer in zip(doc["files"], ("pallas", "triton")):
        assert f["stored"]["within_tolerance"]
        for name in ("triton", "pallas"):
            r = f["result"]["impl"][name]
            assert r["passed"] and r["rel_l2"] <= X.REL_L2 and r["zeros_ok"]
        assert f["result"]["impl"][producer]["rel_l2_vs_expected"] == 0.0


def test_replay_bf16_paged_capture_and_a_wrong_paged_kernel(tmp_path, monkeypatch, capsys):
    """A BF16 pool captured through ``capture_call`` (as an engine would wrap the call) replays
    with both real kernels; a paged kernel 1.5x off fails by name, and the file's keyword
    arguments reach the implementations."""
    import qsa_triton

    spec = X.PagedSpec("bf16-pool", 12, 1, 64, (30, 9), width=35, dtype="bfloat16", seed=3)
    inp = X.build_inputs(spec)
    path = tmp_path / "bf16.safetensors"
    out = CAP.capture_call(qsa_triton.sparse_decode_paged, *inp.args, path=path,
                           batch_invariant=True)
    cap = CAP.load_capture(path)
    assert cap.tensors["k_cache"].dtype == torch.bfloat16 and cap.scalars["batch_invariant"]
    assert cap.metadata["producer"] == "qsa_triton.decode_paged.sparse_decode_paged"
    [(_, res, stored)] = CAP.replay([path], X.load_implementations(interpret=True))
    assert res.passed and stored["within_tolerance"], res.failures
    assert res.impl["triton"]["rel_l2_vs_expected"] == 0.0 and torch.equal(cap.expected, out)

    seen = []
    good = _oracle("sparse_decode_paged")

    def wrong(*a, **kw):
        seen.append(kw)
        return good(*a, **kw) * 1.5

    monkeypatch.setattr(cli, "load_check_implementations", lambda interpret: [
        X.Implementation("triton", "torch", {"sparse_decode_paged": wrong}), fakes()[1]])
    assert cli.main(["replay", str(path), "--interpret"]) == 1
    assert f"FAIL {path}: triton: rel L2" in capsys.readouterr().out
    assert seen == [{"softmax_scale": None, "k_scale": 1.0, "v_scale": 1.0,
                     "batch_invariant": True}]


@pytest.mark.gpu
def test_gpu_capture_and_replay(tmp_path):
    """On the GPU: capture full-size calls with the Triton kernels (packed decode, FP8 chunk
    prefill, paged decode from an FP8 pool and in batch-invariant mode) and replay them with
    both implementations and the peer (when installed)."""
    files = []
    for case in ("decode/TP1/B16/saturated", "prefill/chunk/fp8/G12xHkv1/kv32k",
                 "paged/TP2/fp8+per-head/B16", "paged/TP1/batch-invariant/B32"):
        f = tmp_path / (case.replace("/", "_") + ".safetensors")
        assert cli.main(["capture", "--case", case, "--out", str(f)]) == 0
        files.append(str(f))
    assert cli.main(["replay", *files, "--peer", "sglang", "--json", str(tmp_path / "r.json")]) == 0


def test_replay_of_a_capture_made_on_the_h200(capsys):
    """A file captured on the H200 (`qsa capture` of Triton's compiled paged prefill, sm_90)
    replays here on CPU: both implementations match the stored
    GPU output and the FP64 reference; the metadata names the GPU."""
    from pathlib import Path

    path = Path(__file__).parent / "data" / "h200_paged_capture.safetensors"
    cap = CAP.load_capture(path)
    assert cap.entry == "sparse_prefill_paged" and cap.metadata["arch"] == "sm_90"
    assert "H200" in cap.metadata["device"]
    assert cli.main(["replay", "--interpret", str(path)]) == 0
    out = capsys.readouterr().out
    assert "qsa replay: all files passed" in out and "H200" in out


def test_block_form_capture_round_trip(tmp_path):
    """A prefill call in the block form (``indices=None, block_indices=``) is captured as
    ``block_indices`` (no ``indices`` tensor) and replays in that form: both implementations
    against the FP64 reference of its expansion, the capturing one reproducing its output."""
    impls = X.load_implementations(interpret=True)
    spec = _case("prefill/chunk/blocks+dup/per-head/G12xHkv2")
    inp = X.build_inputs(spec)
    triton = next(i for i in impls if i.name == "triton")
    fn = triton.fns[inp.entry]
    path = tmp_path / "blocks.safetensors"
    out = CAP.capture_call(fn, *inp.args, path=path, entry=inp.entry, **inp.kwargs)
    cap = CAP.load_capture(path)
    assert "indices" not in cap.tensors and cap.scalars["indices"] is None
    assert torch.equal(cap.tensors["block_indices"], inp.kwargs["block_indices"])
    assert CAP.spec_for(cap, "f").blocks and CAP.spec_for(cap, "f").width == spec.width
    (_, res, stored), = CAP.replay([path], impls)
    assert res.passed, res.failures
    assert stored["within_tolerance"] and torch.equal(cap.expected, out)
    assert res.impl["triton"]["rel_l2_vs_expected"] == 0.0
