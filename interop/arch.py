"""Device facts and the table of architectures QSA knows about.

Framework-free (numpy only at import time). ``DeviceFacts`` can be read from a torch device or a
jax device (both imported lazily, only when those constructors are called) or built by hand for
tests and ahead-of-time compile targets.

Sources: shared-memory limits from the CUDA C Programming Guide, "Technical Specifications per
Compute Capability" (sm_90/sm_100: 227 KB = 232,448 B opt-in per block; sm_120/sm_121:
99 KB = 101,376 B); tensor-core families from ``qsa-contract.md`` §5.
"""

from __future__ import annotations

import dataclasses
import re

__all__ = ["ArchInfo", "KNOWN_ARCHS", "DeviceFacts", "arch_name", "parse_arch"]


@dataclasses.dataclass(frozen=True)
class ArchInfo:
    """Static facts of one compute capability.

    Attributes:
      name: ``"sm_90"`` style name.
      cc: (major, minor) compute capability.
      tensor_cores: what Triton can use there (``"wgmma+mma.sync"``, ``"tcgen05"``, ``"mma.sync"``).
      smem_per_block: opt-in maximum dynamic shared memory per block, bytes.
      example_parts: marketing names of parts with this arch.
    """

    name: str
    cc: tuple[int, int]
    tensor_cores: str
    smem_per_block: int
    example_parts: tuple[str, ...]


KNOWN_ARCHS: dict[str, ArchInfo] = {
    "sm_90": ArchInfo("sm_90", (9, 0), "wgmma+mma.sync", 232_448, ("NVIDIA H100", "NVIDIA H200")),
    "sm_100": ArchInfo("sm_100", (10, 0), "tcgen05", 232_448, ("NVIDIA B200",)),
    "sm_120": ArchInfo(
        "sm_120",
        (12, 0),
        "mma.sync",
        101_376,
        ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", "NVIDIA GeForce RTX 5090"),
    ),
    "sm_121": ArchInfo("sm_121", (12, 1), "mma.sync", 101_376, ("NVIDIA GB10",)),
}

# SM counts of parts we route on (upstream's SM120 tuned family is gated on the 188-SM part).
_KNOWN_SM_COUNTS = {
    "NVIDIA H200": 132,
    "NVIDIA H100 80GB HBM3": 132,
    "NVIDIA B200": 148,
    "NVIDIA RTX PRO 6000 Blackwell Server Edition": 188,
    "NVIDIA RTX PRO 6000 Blackwell Workstation Edition": 188,
    "NVIDIA GeForce RTX 5090": 170,
    "NVIDIA GB10": 48,
}


def arch_name(cc: tuple[int, int]) -> str:
    """``(12, 1) -> "sm_121"``."""
    return f"sm_{cc[0]}{cc[1]}"


def parse_arch(name: str) -> tuple[int, int]:
    """``"sm_121"`` / ``"121"`` / ``"12.1"`` -> ``(12, 1)``.

    Raises:
      ValueError: the text is not an arch name.
    """
    text = name.strip().lower()
    m = re.fullmatch(r"(?:sm_?)?(\d+)(?:\.(\d))?", text)
    if not m:
        raise ValueError(f"not an arch name: {name!r} (expected e.g. 'sm_90', 'sm_120', 'sm_121')")
    if m.group(2) is not None:
        return int(m.group(1)), int(m.group(2))
    digits = m.group(1)
    return int(digits[:-1]), int(digits[-1])


@dataclasses.dataclass(frozen=True)
class DeviceFacts:
    """What the router and the geometry selector need to know about one GPU.

    Attributes:
      name: device name as the driver reports it (``"NVIDIA H200"``).
      cc: compute capability (major, minor).
      sm_count: number of streaming multiprocessors.
      smem_per_block: opt-in maximum shared memory per block, bytes.
      triton_version: version string of the Triton that will compile kernels, or None.
    """

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
    def for_arch(
        cls,
        arch: str,
        *,
        name: str | None = None,
        sm_count: int | None = None,
        triton_version: str | None = None,
    ) -> "DeviceFacts":
        """Hand-built facts for a known arch (tests, AOT compile targets).

        Raises:
          ValueError: ``arch`` is not in ``KNOWN_ARCHS``.
        """
        cc = parse_arch(arch)
        info = KNOWN_ARCHS.get(arch_name(cc))
        if info is None:
            raise ValueError(f"unknown arch {arch!r}; known: {sorted(KNOWN_ARCHS)}")
        name = name or info.example_parts[0]
        if sm_count is None:
            sm_count = _KNOWN_SM_COUNTS.get(name, 132)
        return cls(name, cc, sm_count, info.smem_per_block, triton_version)

    @classmethod
    def from_torch(cls, device=None) -> "DeviceFacts":
        """Facts of a CUDA device through torch (imported here, lazily).

        Raises:
          RuntimeError: torch sees no CUDA device.
        """
        import torch  # noqa: PLC0415 - lazy by design: core modules import numpy only

        if not torch.cuda.is_available():
            raise RuntimeError("DeviceFacts.from_torch: torch sees no CUDA device")
        dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        props = torch.cuda.get_device_properties(dev)
        smem = getattr(props, "shared_memory_per_block_optin", None)
        cc = (props.major, props.minor)
        if not smem:
            smem = KNOWN_ARCHS.get(arch_name(cc), KNOWN_ARCHS["sm_120"]).smem_per_block
        return cls(props.name, cc, props.multi_processor_count, int(smem), _triton_version())

    @classmethod
    def from_jax(cls, device=None) -> "DeviceFacts":
        """Facts of a jax GPU device (jax imported here, lazily).

        Raises:
          RuntimeError: the device is not a CUDA GPU.
        """
        import jax  # noqa: PLC0415

        dev = device if device is not None else jax.devices()[0]
        if dev.platform != "gpu":
            raise RuntimeError(f"DeviceFacts.from_jax: {dev} is not a CUDA GPU")
        cc_text = getattr(dev, "compute_capability", None)
        if cc_text:
            cc = tuple(int(x) for x in str(cc_text).split(".")[:2])
        else:  # name-based fallback for abstract devices
            cc = _cc_from_name(dev.device_kind)
        sm_count = getattr(dev, "core_count", None) or _KNOWN_SM_COUNTS.get(dev.device_kind, 132)
        info = KNOWN_ARCHS.get(arch_name(cc), KNOWN_ARCHS["sm_120"])
        return cls(dev.device_kind, cc, int(sm_count), info.smem_per_block, _triton_version())

    @classmethod
    def from_device_kind(cls, device_kind: str, triton_version: str | None = None) -> "DeviceFacts":
        """Facts from a device-kind string alone (jax ``AbstractDevice`` lowering)."""
        cc = _cc_from_name(device_kind)
        info = KNOWN_ARCHS[arch_name(cc)]
        return cls(device_kind, cc, _KNOWN_SM_COUNTS.get(device_kind, 132), info.smem_per_block,
                   triton_version)


def _cc_from_name(name: str) -> tuple[int, int]:
    for info in KNOWN_ARCHS.values():
        if any(part.lower() in name.lower() or name.lower() in part.lower() for part in info.example_parts):
            return info.cc
    if "H100" in name or "H200" in name or "H800" in name or "H20" in name:
        return (9, 0)
    raise ValueError(f"cannot infer the compute capability of device kind {name!r}")


def _triton_version() -> str | None:
    try:
        from importlib.metadata import version  # noqa: PLC0415

        return version("triton")
    except Exception:  # noqa: BLE001 - triton absent (JAX-only install)
        return None
