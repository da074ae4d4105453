"""Device facts and the one table of GPUs QSA knows about (stdlib only at import time).

``DeviceFacts`` comes from a torch or jax device (imported lazily; cached per device), a jax
device-kind string (ahead-of-time lowering) or is built by hand; kernel modules ask it, never
the framework, for SM counts and shared-memory limits.

Sources: shared-memory limits from the CUDA C Programming Guide, "Technical Specifications per
Compute Capability" (sm_90/sm_100: 227 KB = 232,448 B opt-in per block; sm_120/sm_121:
99 KB = 101,376 B); tensor-core families from ``qsa-contract.md`` §5; SM counts from the vendors'
data sheets (as ``multi_processor_count`` reports them).
"""

from __future__ import annotations

import dataclasses
import functools
import re

__all__ = ["ArchInfo", "KNOWN_ARCHS", "KNOWN_PARTS", "CI_ARCHS", "DeviceFacts", "arch_name",
           "parse_arch", "device_kind", "capability", "triton_version"]


@dataclasses.dataclass(frozen=True)
class ArchInfo:
    """Static facts of one compute capability: ``name`` (``"sm_90"``), ``cc`` (major, minor),
    ``tensor_cores`` Triton can use (``"wgmma+mma.sync"``, ``"tcgen05"``, ``"mma.sync"``) and
    ``smem_per_block``, the opt-in maximum dynamic shared memory per block in bytes."""

    name: str
    cc: tuple[int, int]
    tensor_cores: str
    smem_per_block: int

    @property
    def example_parts(self) -> tuple[str, ...]:
        """Names of the parts in ``KNOWN_PARTS`` with this arch (the first is its representative)."""
        return tuple(p for p, (a, _) in KNOWN_PARTS.items() if a == self.name)


KNOWN_ARCHS: dict[str, ArchInfo] = {
    "sm_90": ArchInfo("sm_90", (9, 0), "wgmma+mma.sync", 232_448),
    "sm_100": ArchInfo("sm_100", (10, 0), "tcgen05", 232_448),
    "sm_120": ArchInfo("sm_120", (12, 0), "mma.sync", 101_376),
    "sm_121": ArchInfo("sm_121", (12, 1), "mma.sync", 101_376),
}

#: Known parts: device name as the driver / jax ``device_kind`` reports it -> (arch, SM count).
#: The first part of each arch is the device kind that arch is lowered for ahead of time.
#: Upstream's SM120 tuned prefill family is gated on the 188-SM parts.
KNOWN_PARTS: dict[str, tuple[str, int]] = {
    "NVIDIA H200": ("sm_90", 132),
    "NVIDIA H100 80GB HBM3": ("sm_90", 132),
    "NVIDIA B200": ("sm_100", 148),
    "NVIDIA RTX PRO 6000 Blackwell Workstation Edition": ("sm_120", 188),
    "NVIDIA RTX PRO 6000 Blackwell Server Edition": ("sm_120", 188),
    "NVIDIA GeForce RTX 5090": ("sm_120", 170),
    "NVIDIA GB10": ("sm_121", 48),
}

#: The archs CPU CI compiles and lowers every shipped kernel configuration for.
CI_ARCHS = ("sm_90", "sm_120", "sm_121")

_DEFAULT_SM_COUNT = 132  # an unknown part's SM count: the H200's (anchors.md)


def arch_name(cc: tuple[int, int]) -> str:
    """``(12, 1) -> "sm_121"``."""
    return f"sm_{cc[0]}{cc[1]}"


def parse_arch(name: str) -> tuple[int, int]:
    """``"sm_121"`` / ``"121"`` / ``"12.1"`` -> ``(12, 1)``; ValueError for anything else."""
    text = name.strip().lower()
    m = re.fullmatch(r"(?:sm_?)?(\d+)(?:\.(\d))?", text)
    if not m:
        raise ValueError(f"not an arch name: {name!r} (expected e.g. 'sm_90', 'sm_120', 'sm_121')")
    if m.group(2) is not None:
        return int(m.group(1)), int(m.group(2))
    digits = m.group(1)
    return int(digits[:-1]), int(digits[-1])


def device_kind(arch: str) -> str:
    """The representative part (jax device kind) of a known arch (``"sm_120"`` -> ``"NVIDIA RTX
    PRO 6000 Blackwell Workstation Edition"``); ValueError for an arch not in ``KNOWN_ARCHS``."""
    info = KNOWN_ARCHS.get(arch_name(parse_arch(arch)))
    if info is None:
        raise ValueError(f"unknown arch {arch!r}; known: {sorted(KNOWN_ARCHS)}")
    return info.example_parts[0]


def capability(arch: str) -> int:
    """``"sm_121"`` -> 121 (the integer ``triton.backends.compiler.GPUTarget`` takes)."""
    major, minor = parse_arch(arch)
    return major * 10 + minor


@dataclasses.dataclass(frozen=True)
class DeviceFacts:
    """What the plans, the router and the geometry selector need to know about one GPU: ``name``
    as the driver reports it (``"NVIDIA H200"``), ``cc`` (major, minor), ``sm_count``,
    ``smem_per_block`` (opt-in maximum, bytes), ``triton_version`` (the compiler's, or None)."""

    name: str
    cc: tuple[int, int]
    sm_count: int
    smem_per_block: int
    triton_version: str | None = None

    @property
    def arch(self) -> str:
        return arch_name(self.cc)

    @property
    def info(self) -> ArchInfo | None:
        return KNOWN_ARCHS.get(self.arch)

    @property
    def triton_tuple(self) -> tuple[int, int]:
        """(major, minor) of ``triton_version``; (0, 0) when unknown."""
        if not self.triton_version:
            return (0, 0)
        m = re.match(r"(\d+)\.(\d+)", self.triton_version)
        return (int(m.group(1)), int(m.group(2))) if m else (0, 0)

    @classmethod
    def for_arch(cls, arch: str, *, name: str | None = None, sm_count: int | None = None,
                 triton_version: str | None = None) -> "DeviceFacts":
        """Hand-built facts for a known arch (tests, AOT targets): its representative part and
        that part's SM count unless given; ValueError for an arch not in ``KNOWN_ARCHS``."""
        cc = parse_arch(arch)
        info = KNOWN_ARCHS.get(arch_name(cc))
        if info is None:
            raise ValueError(f"unknown arch {arch!r}; known: {sorted(KNOWN_ARCHS)}")
        name = name or info.example_parts[0]
        if sm_count is None:
            sm_count = KNOWN_PARTS.get(name, ("", _DEFAULT_SM_COUNT))[1]
        return cls(name, cc, sm_count, info.smem_per_block, triton_version)

    @classmethod
    def from_device_kind(cls, kind: str, triton_version: str | None = None) -> "DeviceFacts":
        """Facts from a device-kind string alone (jax ``AbstractDevice`` lowering); ValueError
        when the compute capability of ``kind`` cannot be inferred."""
        cc = _cc_from_name(kind)
        info = KNOWN_ARCHS[arch_name(cc)]
        sms = KNOWN_PARTS.get(kind, ("", _DEFAULT_SM_COUNT))[1]
        return cls(kind, cc, sms, info.smem_per_block, triton_version)

    @classmethod
    def from_torch(cls, device=None) -> "DeviceFacts":
        """Facts of a CUDA device (a torch device / string / ordinal; None = the current one)
        through torch, imported lazily; cached per device. RuntimeError when torch sees no CUDA
        device or ``device`` is not one."""
        import torch  # noqa: PLC0415 - lazy by design: core modules import no framework

        dev = torch.device("cuda") if device is None else torch.device(device)
        if dev.type != "cuda":
            raise RuntimeError(f"DeviceFacts.from_torch: {dev} is not a CUDA device")
        if not torch.cuda.is_available():  # before current_device(), which asserts
            raise RuntimeError("DeviceFacts.from_torch: torch sees no CUDA device")
        return _torch_facts(dev.index if dev.index is not None else torch.cuda.current_device())

    @classmethod
    def from_jax(cls, device=None) -> "DeviceFacts":
        """Facts of a jax GPU device (None = ``jax.devices()[0]``; jax imported lazily), cached
        per device; RuntimeError when it is not a CUDA GPU."""
        import jax  # noqa: PLC0415

        return _jax_facts(device if device is not None else jax.devices()[0])


def _cc_from_name(name: str) -> tuple[int, int]:
    if name in KNOWN_PARTS:
        return KNOWN_ARCHS[KNOWN_PARTS[name][0]].cc
    for part, (arch, _) in KNOWN_PARTS.items():
        if part.lower() in name.lower() or name.lower() in part.lower():
            return KNOWN_ARCHS[arch].cc
    if any(x in name for x in ("H100", "H200", "H800", "H20")):
        return (9, 0)
    raise ValueError(f"cannot infer the compute capability of device kind {name!r}")


@functools.lru_cache(maxsize=None)
def _torch_facts(index: int) -> DeviceFacts:
    import torch  # noqa: PLC0415

    if not torch.cuda.is_available():
        raise RuntimeError("DeviceFacts.from_torch: torch sees no CUDA device")
    props = torch.cuda.get_device_properties(index)
    cc = (props.major, props.minor)
    smem = getattr(props, "shared_memory_per_block_optin", None)
    if not smem:
        smem = KNOWN_ARCHS.get(arch_name(cc), KNOWN_ARCHS["sm_120"]).smem_per_block
    return DeviceFacts(props.name, cc, props.multi_processor_count, int(smem), triton_version())


@functools.lru_cache(maxsize=None)
def _jax_facts(dev) -> DeviceFacts:
    if dev.platform != "gpu":
        raise RuntimeError(f"DeviceFacts.from_jax: {dev} is not a CUDA GPU")
    cc_text = getattr(dev, "compute_capability", None)
    cc = (tuple(int(x) for x in str(cc_text).split(".")[:2]) if cc_text
          else _cc_from_name(dev.device_kind))
    sm_count = (getattr(dev, "core_count", None)
                or KNOWN_PARTS.get(dev.device_kind, ("", _DEFAULT_SM_COUNT))[1])
    # an arch we do not know: the smaller (sm_12x) limit, so a fitted plan still launches
    info = KNOWN_ARCHS.get(arch_name(cc), KNOWN_ARCHS["sm_120"])
    return DeviceFacts(dev.device_kind, cc, int(sm_count), info.smem_per_block, triton_version())


@functools.lru_cache(maxsize=1)
def triton_version() -> str | None:
    """Version of the installed ``triton`` package (None when absent: a JAX-only install)."""
    try:
        from importlib.metadata import version  # noqa: PLC0415

        return version("triton")
    except Exception:  # noqa: BLE001 - triton absent (JAX-only install)
        return None
