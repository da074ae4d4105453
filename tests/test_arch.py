"""interop.arch facts and interop.contract.route (qsa-contract.md §5)."""

from __future__ import annotations

import pytest

from interop.arch import (CI_ARCHS, KNOWN_ARCHS, KNOWN_PARTS, DeviceFacts, arch_name, capability,
                          device_kind, parse_arch)
from interop.contract import route

PREFILL_OPS = ("prefill", "prefill_chunk", "prefill_paged")


def test_known_archs_table():
    assert set(KNOWN_ARCHS) >= {"sm_90", "sm_100", "sm_120", "sm_121"}
    assert KNOWN_ARCHS["sm_90"].smem_per_block == KNOWN_ARCHS["sm_100"].smem_per_block == 232_448
    assert KNOWN_ARCHS["sm_120"].smem_per_block == KNOWN_ARCHS["sm_121"].smem_per_block == 101_376
    assert KNOWN_ARCHS["sm_120"].tensor_cores == KNOWN_ARCHS["sm_121"].tensor_cores == "mma.sync"
    assert "wgmma" in KNOWN_ARCHS["sm_90"].tensor_cores
    assert KNOWN_ARCHS["sm_100"].tensor_cores == "tcgen05"


@pytest.mark.parametrize("text,cc", [("sm_90", (9, 0)), ("sm_121", (12, 1)), ("120", (12, 0)),
                                     ("12.1", (12, 1)), ("SM_100", (10, 0))])
def test_parse_arch(text, cc):
    assert parse_arch(text) == cc
    assert parse_arch(arch_name(cc)) == cc


def test_parse_arch_errors():
    with pytest.raises(ValueError):
        parse_arch("hopper")
    with pytest.raises(ValueError):
        DeviceFacts.for_arch("sm_75")


def test_for_arch_and_device_kind():
    f = DeviceFacts.for_arch("sm_121", triton_version="3.6.0")
    assert f.cc == (12, 1) and f.smem_per_block == 101_376 and f.triton_tuple == (3, 6)
    assert f.arch == "sm_121" and f.info is KNOWN_ARCHS["sm_121"]
    h = DeviceFacts.from_device_kind("NVIDIA H200")
    assert h.cc == (9, 0) and h.sm_count == 132 and h.smem_per_block == 232_448
    b = DeviceFacts.from_device_kind("NVIDIA RTX PRO 6000 Blackwell Workstation Edition")
    assert b.cc == (12, 0) and b.sm_count == 188
    assert DeviceFacts.from_device_kind("NVIDIA GB10").cc == (12, 1)
    assert DeviceFacts("x", (9, 0), 1, 1).triton_tuple == (0, 0)


def test_parts_table_is_the_one_source():
    """Every part names a known arch; each arch's first part is the device kind it is lowered
    for; SM counts and shared memory come from the two tables only."""
    assert all(arch in KNOWN_ARCHS and sms > 0 for arch, sms in KNOWN_PARTS.values())
    assert [device_kind(a) for a in CI_ARCHS] == [
        "NVIDIA H200", "NVIDIA RTX PRO 6000 Blackwell Workstation Edition", "NVIDIA GB10"]
    assert [capability(a) for a in CI_ARCHS] == [90, 120, 121]
    for part, (arch, sms) in KNOWN_PARTS.items():
        f = DeviceFacts.from_device_kind(part)
        assert (f.arch, f.sm_count, f.smem_per_block) == (arch, sms, KNOWN_ARCHS[arch].smem_per_block)
        assert part in KNOWN_ARCHS[arch].example_parts
    with pytest.raises(ValueError):
        device_kind("sm_75")
    with pytest.raises(ValueError):
        DeviceFacts.from_device_kind("Some Other Accelerator")


def test_from_torch_refuses_a_cpu_device():
    torch = pytest.importorskip("torch")
    with pytest.raises(RuntimeError, match="not a CUDA device"):
        DeviceFacts.from_torch(torch.device("cpu"))
    if not torch.cuda.is_available():  # the default device: RuntimeError, not torch's assert
        with pytest.raises(RuntimeError, match="no CUDA device"):
            DeviceFacts.from_torch()


def test_route_sm121_decode_exact_only():
    r = route(DeviceFacts.for_arch("sm_121"), "decode")
    assert r.exact_contract and "sm_121" in r.reason
    # the exact gate is sm_121 only: not a "SM12x" family gate (upstream's corruption story)
    assert not route(DeviceFacts.for_arch("sm_120"), "decode").exact_contract
    assert not route(DeviceFacts.for_arch("sm_90"), "decode").exact_contract
    for op in PREFILL_OPS:
        p = route(DeviceFacts.for_arch("sm_121"), op)
        assert not p.exact_contract and p.geometry == "l20-table"


def test_route_sm120_tuned_only_on_188_sm_part():
    pro = DeviceFacts.for_arch("sm_120", name="NVIDIA RTX PRO 6000 Blackwell Server Edition")
    assert pro.sm_count == 188
    rtx = DeviceFacts.for_arch("sm_120", name="NVIDIA GeForce RTX 5090")
    assert rtx.sm_count == 170
    for op in PREFILL_OPS:
        assert route(pro, op).geometry == "sm120-tuned-or-table"
        assert route(rtx, op).geometry == "l20-table"
        assert "188" in route(rtx, op).reason
    # a hand-built 188-SM sm_120 routes tuned whatever its name
    assert route(DeviceFacts("custom", (12, 0), 188, 101_376), "prefill").geometry == "sm120-tuned-or-table"


def test_route_sm90_table_and_others():
    for name in ("NVIDIA H200", "NVIDIA H100 80GB HBM3"):
        f = DeviceFacts.for_arch("sm_90", name=name)
        for op in PREFILL_OPS:
            assert route(f, op).geometry == "sm90-table"
    assert route(DeviceFacts.for_arch("sm_100"), "prefill").geometry == "l20-table"
    # the H20 is sm_90 too: upstream's H20 table, by name (not the H200)
    h20 = DeviceFacts("NVIDIA H20", (9, 0), 78, 232_448)
    assert route(h20, "prefill").geometry == "h20-table"
    assert route(DeviceFacts.for_arch("sm_90", name="NVIDIA H200"), "prefill").geometry == "sm90-table"
    with pytest.raises(ValueError):
        route(DeviceFacts.for_arch("sm_90"), "attention")
    assert route(DeviceFacts.for_arch("sm_90"), "decode").kernel == "qsa.decode.splitkv"
