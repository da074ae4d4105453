"""SM121 decode runs the exact qualified contract only (qsa-contract.md §5), in both frameworks.

No GPU here: the device facts are simulated by making each backend's device lookup return a GB10
(``interop.arch.DeviceFacts.for_arch("sm_121")``); the routing and the contract are the real ones.
"""

import numpy as np
import pytest

from interop.arch import DeviceFacts
from interop.contract import ContractError, route


def test_route_sends_only_sm121_decode_to_the_exact_contract():
    assert route(DeviceFacts.for_arch("sm_121"), "decode").exact_contract
    for arch in ("sm_90", "sm_100", "sm_120"):
        assert not route(DeviceFacts.for_arch(arch), "decode").exact_contract


def _inputs(hq, hkv, d, lens):
    rng = np.random.default_rng(0)
    cu_k = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    q = rng.standard_normal((len(lens), hq, d)).astype(np.float16)
    k = rng.standard_normal((int(cu_k[-1]), hkv, d)).astype(np.float16)
    v = rng.standard_normal((int(cu_k[-1]), hkv, d)).astype(np.float16)
    return q, k, v, np.arange(len(lens) + 1, dtype=np.int32), cu_k


def test_triton_exact_contract_device_rejects_outside_envelope(monkeypatch):
    torch = pytest.importorskip("torch")
    import qsa_triton
    from qsa_triton import decode as dec

    q, k, v, cu_q, cu_k = (torch.from_numpy(x) for x in _inputs(4, 1, 64, [3, 5]))
    out = qsa_triton.sparse_decode(q, k, v, cu_q, cu_k, 8)  # default device: generic contract
    assert out.shape == q.shape
    monkeypatch.setattr(dec, "_facts", lambda device: DeviceFacts.for_arch("sm_121"))  # a GB10
    with pytest.raises(ContractError, match="strict mode"):
        qsa_triton.sparse_decode(q, k, v, cu_q, cu_k, 8)


def test_pallas_exact_contract_backend_rejects_outside_envelope(monkeypatch):
    jnp = pytest.importorskip("jax.numpy")
    import qsa_pallas
    from qsa_pallas import _compat as C

    q, k, v, cu_q, cu_k = (jnp.asarray(x) for x in _inputs(4, 1, 64, [3, 5]))
    monkeypatch.setattr(C, "target_facts", lambda: DeviceFacts.for_arch("sm_121"))  # a GB10
    # compiled path (interpret=False): the strict check runs before anything is lowered
    with pytest.raises(ContractError, match="strict mode"):
        qsa_pallas.sparse_decode(q, k, v, cu_q, cu_k, 8, interpret=False)


def test_bf16_refused_under_unpatched_interpreter(monkeypatch):
    """bf16 under Triton's CPU interpreter would be silently wrong (raw-bit dots): refused."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    from triton.runtime import interpreter

    import qsa_triton

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(interpreter, "_qsa_bf16_dot_patched", False, raising=False)
    q, k, v, cu_q, cu_k = (torch.from_numpy(x) for x in _inputs(4, 1, 64, [3, 5]))
    with pytest.raises(ContractError, match="interpreter"):
        qsa_triton.sparse_decode(q.bfloat16(), k.bfloat16(), v.bfloat16(), cu_q, cu_k, 8)
    idx = torch.zeros(q.shape[0], 4, dtype=torch.int32)
    with pytest.raises(ContractError, match="interpreter"):
        qsa_triton.sparse_prefill(q.bfloat16(), k[:2].bfloat16(), v[:2].bfloat16(), idx,
                                  torch.tensor([0, 2], dtype=torch.int32), 2)
    # an FP8 indexer query is computed in bf16: the message names what was passed and why
    f8 = torch.float8_e4m3fn
    rows = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ContractError, match=r"interpreter.*got float8_e4m3fn \(its dots run in "
                                            r"bfloat16\)"):
        qsa_triton.indexer_topk_prefill(torch.zeros(2, 4, 64).to(f8), torch.zeros(8, 1, 64).to(f8),
                                        rows, rows + 8, topk=16)
    qsa_triton.sparse_decode(q, k, v, cu_q, cu_k, 8)  # fp16 stays fine


def test_strict_keyword_same_in_both():
    """`strict=True` enforces the qualified envelope in both frameworks, with the same message."""
    torch = pytest.importorskip("torch")
    jnp = pytest.importorskip("jax.numpy")
    import qsa_pallas
    import qsa_triton

    arrays = _inputs(4, 1, 64, [3, 5])  # D = 64, (4, 1): outside the qualified envelope
    msgs = []
    for mod, conv in ((qsa_triton, torch.from_numpy), (qsa_pallas, jnp.asarray)):
        with pytest.raises(ContractError) as e:
            mod.sparse_decode(*(conv(x) for x in arrays), 8, strict=True)
        msgs.append(str(e.value))
    assert msgs[0] == msgs[1] and "strict mode" in msgs[0]


def test_pallas_prefill_strict_and_bad_geometry_env(monkeypatch):
    """qsa_pallas prefill: strict= like qsa_triton; a bad $QSA_PREFILL_GEOMETRY is refused even on
    the CPU (interpret mode, where no geometry is selected)."""
    jnp = pytest.importorskip("jax.numpy")
    import qsa_pallas

    q = jnp.zeros((2, 4, 64), jnp.float16)
    k = jnp.zeros((2, 1, 64), jnp.float16)
    idx = jnp.zeros((2, 4), jnp.int32)
    cu = jnp.array([0, 2], jnp.int32)
    with pytest.raises(ContractError, match="strict mode"):
        qsa_pallas.sparse_prefill(q, k, k, idx, cu, 2, strict=True)
    monkeypatch.setenv("QSA_PREFILL_GEOMETRY", "fast")
    with pytest.raises(ContractError, match="QSA_PREFILL_GEOMETRY"):
        qsa_pallas.sparse_prefill(q, k, k, idx, cu, 2)


def test_interpreter_set_after_import_is_a_clear_error(tmp_path):
    """TRITON_INTERPRET must be set before qsa_triton is imported; set later, a CPU call gets a
    ContractError that says so (not a crash inside Triton's driver lookup)."""
    import os
    import subprocess
    import sys

    script = tmp_path / "late.py"
    script.write_text(
        "import os, torch, qsa_triton\n"
        "os.environ['TRITON_INTERPRET'] = '1'\n"
        "q = torch.zeros(2, 4, 64, dtype=torch.float16); k = torch.zeros(3, 1, 64, dtype=torch.float16)\n"
        "cu = torch.tensor([0, 1, 2], dtype=torch.int32); ck = torch.tensor([0, 1, 3], dtype=torch.int32)\n"
        "try:\n"
        "    qsa_triton.sparse_decode(q, k, k, cu, ck, 4)\n"
        "except qsa_triton.ContractError as e:\n"
        "    print('CONTRACT', e)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                         timeout=300, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert "CONTRACT" in out.stdout and "before qsa_triton is imported" in out.stdout, out.stderr[-2000:]


def test_compiled_calls_keep_strict_and_the_interpreter_check(monkeypatch):
    """Under torch.compile the checks run in the ops' fake impls: ``strict=True`` still enforces
    the qualified envelope and bf16 under the unpatched interpreter is still refused (the error
    reaches the caller wrapped by Dynamo, its text intact), for decode, paged decode, block
    prefill and the indexer; ``flash_attn_varlen_func``'s refusals arrive the same way."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    from triton.runtime import interpreter

    import qsa_triton as T

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = torch.Generator().manual_seed(0)
    h16 = dict(dtype=torch.float16)
    i32 = dict(dtype=torch.int32)
    q, kc = torch.randn(2, 4, 32, generator=g, **h16), torch.randn(40, 2, 32, generator=g, **h16)
    rtt, ri = torch.arange(40, **i32).reshape(2, 20), torch.arange(2, **i32)
    idx, sl = torch.randint(0, 10, (2, 8), generator=g, **i32), torch.full((2,), 10, **i32)
    qp, kp = torch.randn(4, 4, 32, generator=g, **h16), torch.randn(12, 2, 32, generator=g, **h16)
    blocks = torch.randint(0, 2, (4, 3), generator=g, **i32)
    cq, ck, kl = (torch.tensor(x, **i32) for x in ([0, 4], [0, 12], [12]))
    iq, ik = torch.randn(2, 4, 64, generator=g, **h16), torch.randn(8, 16, 1, 64, generator=g, **h16)
    pt, isl = torch.arange(8, **i32).reshape(2, 4), torch.tensor([200, 150], **i32)
    calls = {
        "paged": (lambda *a, **k: T.sparse_decode_paged(*a, **k), (q, kc, kc, rtt, ri, idx, sl)),
        "decode": (lambda *a, **k: T.sparse_decode(*a, 10, **k),
                   (q, kc[:20], kc[:20], torch.arange(3, **i32), torch.tensor([0, 10, 20], **i32))),
        "blocks": (lambda q, k, v, b, *m, **kw: T.sparse_prefill_chunk(
            q, k, v, None, *m, 4, block_indices=b, **kw), (qp, kp, kp, blocks, cq, ck, kl)),
        "indexer": (lambda *a, **k: T.indexer_topk_decode(*a, topk=16, **k), (iq, ik, pt, isl)),
    }
    for name, (fn, args) in calls.items():
        torch._dynamo.reset()
        out = torch.compile(fn, fullgraph=True)(*args)  # in the default envelope: runs
        assert out.shape[0] == args[0].shape[0], name
        torch._dynamo.reset()
        with pytest.raises(Exception, match="strict mode"):
            torch.compile(lambda *a: fn(*a, strict=True), fullgraph=True)(*args)
    # arguments refused before any op runs go through qsa::contract_error's fake impl, as do
    # flash-attn-only options (in traced Python the raise would be a Dynamo error)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"'k_scale': expected a host number"):
        torch.compile(lambda *a: T.sparse_decode_paged(*a, None, torch.tensor(1.0)),
                      fullgraph=True)(*calls["paged"][1])
    torch._dynamo.reset()
    with pytest.raises(Exception, match="exactly one selection"):
        torch.compile(lambda q, k, v, b, *m: T.sparse_prefill_chunk(q, k, v, b, *m, 4,
                                                                    block_indices=b),
                      fullgraph=True)(*calls["blocks"][1])
    fa = lambda *a: T.flash_attn_varlen_func(*a, 1, 10, 0.1)  # noqa: E731 - dropout_p 0.1
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"'dropout_p': expected 0\.0"):
        torch.compile(fa, fullgraph=True)(*calls["decode"][1])
    monkeypatch.setattr(interpreter, "_qsa_bf16_dot_patched", False, raising=False)
    for name, (fn, args) in calls.items():
        torch._dynamo.reset()
        bf = tuple(a.bfloat16() if a.dtype == torch.float16 else a for a in args)
        with pytest.raises(Exception, match="interpreter"):
            torch.compile(fn, fullgraph=True)(*bf)
    torch._dynamo.reset()
