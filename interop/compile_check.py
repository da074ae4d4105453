"""``qsa compile``: ahead-of-time compile every shipped kernel configuration for sm_90 / sm_120 /
sm_121 on a machine without a GPU, and check each against the arch's limits.

Triton kernels: every module in ``TRITON_MODULES`` that exposes ``compile_configs(arch)`` (a list
of dicts with ``kernel`` (the JITFunction), ``name``, ``signature``, ``constexprs``,
``num_warps``, ``num_stages``: every configuration its selectors can choose on that arch) is
compiled with ``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))``.

Pallas kernels: every module in ``PALLAS_MODULES`` that exposes ``lowering_cases(device_kind)``
(a list of ``(name, fn, args)``: ``fn(*args)`` lowered under an abstract device) is used; for
``qsa_pallas.decode`` without it, the cases are enumerated here: every decode plan the shared
planner picks for the qualified head pairs and batches. Each is lowered with ``jax.jit(...).trace(...).lower(lowering_platforms=("cuda",))`` under a
``jax.sharding.AbstractMesh`` whose device kind is the arch's part, and the embedded Triton IR is
compiled for the arch's compute capability with the installed Triton.

Per configuration: shared memory (``compiled.metadata.shared``; Triton does not check the
101,376-byte limit of sm_120/sm_121 itself), registers per thread and spills (``cuobjdump
--dump-resource-usage`` on the cubin, when the tool is found). A configuration *fits* when shared
memory <= the arch's opt-in limit per block, registers <= 255 per thread and registers x threads
<= 65,536 per block. Spills are reported, not failed.

Must run with ``TRITON_INTERPRET`` off (the interpreter replaces the JIT functions): ``qsa
compile`` re-runs itself in a subprocess without it when it is set.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
import shutil
import subprocess
import tempfile
import time
from typing import Any, Callable, Iterable, Sequence

from .arch import CI_ARCHS, KNOWN_ARCHS, arch_name, device_kind, parse_arch

__all__ = ["ConfigReport", "DEFAULT_ARCHS", "DEVICE_KIND", "TRITON_MODULES", "PALLAS_MODULES",
           "resource_usage", "check_triton", "check_pallas", "run", "parse_archs"]

DEFAULT_ARCHS = CI_ARCHS
#: The abstract device each arch is lowered for (jax device kinds).
DEVICE_KIND = {arch: device_kind(arch) for arch in KNOWN_ARCHS}
# Overridable (comma-separated module names) for tests and out-of-tree kernels.
TRITON_MODULES = tuple(os.environ.get("QSA_COMPILE_TRITON_MODULES",
                                      "qsa_triton.decode,qsa_triton.prefill,"
                                      "qsa_triton.prefill_union").split(","))
PALLAS_MODULES = tuple(os.environ.get("QSA_COMPILE_PALLAS_MODULES",
                                      "qsa_pallas.decode,qsa_pallas.prefill").split(","))
MAX_REGS_PER_THREAD = 255
MAX_REGS_PER_BLOCK = 65_536


@dataclasses.dataclass
class ConfigReport:
    """One compiled configuration.

    Attributes:
      family: "triton" | "pallas". arch: "sm_120". name: configuration name.
      num_warps, num_stages: launch parameters. shared: bytes of shared memory per program.
      regs: registers per thread (None when cuobjdump is absent). spill_bytes: local/stack bytes
      per thread (None when unknown). smem_limit: the arch's opt-in limit per block.
      fits: within every limit. problems: why not. error: compile/lowering failure (fits False).
      note: e.g. "module exposes no compile_configs" (not a failure).
    """

    family: str
    arch: str
    name: str
    num_warps: int | None = None
    num_stages: int | None = None
    shared: int | None = None
    regs: int | None = None
    spill_bytes: int | None = None
    smem_limit: int | None = None
    fits: bool = True
    problems: list[str] = dataclasses.field(default_factory=list)
    error: str | None = None
    note: str | None = None
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def parse_archs(text: str | None) -> list[str]:
    """``"sm_90,sm_120"`` -> ["sm_90", "sm_120"] (default: sm_90, sm_120, sm_121).

    Raises:
      ValueError: an unknown arch (the message lists the known ones).
    """
    if not text:
        return list(DEFAULT_ARCHS)
    out = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        try:
            name = arch_name(parse_arch(part))
        except ValueError:
            name = part
        if name not in KNOWN_ARCHS or name not in DEVICE_KIND:
            raise ValueError(f"--arch: unknown arch {part!r}; known: {', '.join(DEVICE_KIND)}")
        out.append(name)
    return list(dict.fromkeys(out))


# --------------------------------------------------------------------------------------------
def _tool(name: str) -> str | None:
    """Path of a CUDA binary tool: Triton's bundled copy, then $PATH."""
    env = os.environ.get(f"TRITON_{name.upper()}_PATH")
    if env and os.path.exists(env):
        return env
    try:
        import triton  # noqa: PLC0415

        p = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
        if os.path.exists(p):
            return p
    except ImportError:
        pass
    return shutil.which(name)


def resource_usage(cubin: bytes) -> dict[str, int] | None:
    """Registers and stack/local bytes per thread of the (single) kernel in a cubin, from
    ``cuobjdump --dump-resource-usage``; None when the tool is absent or fails."""
    tool = _tool("cuobjdump")
    if tool is None or not cubin:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(cubin)
        fh.flush()
        try:
            text = subprocess.run([tool, "--dump-resource-usage", fh.name], capture_output=True,
                                  text=True, timeout=60).stdout
        except (OSError, subprocess.SubprocessError):
            return None
    m = re.search(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)", text)
    if not m:
        return None
    reg, stack, shared, local = (int(x) for x in m.groups())
    return {"regs": reg, "stack": stack, "static_shared": shared, "local": local}


def _judge(rep: ConfigReport, compiled, limit: int) -> ConfigReport:
    rep.shared = int(compiled.metadata.shared)
    rep.smem_limit = limit
    usage = resource_usage(compiled.asm.get("cubin", b"")) if hasattr(compiled, "asm") else None
    if usage is not None:
        rep.regs = usage["regs"]
        rep.spill_bytes = usage["stack"] + usage["local"]
    if rep.shared > limit:
        rep.problems.append(f"shared memory {rep.shared:,} B > {limit:,} B")
    if rep.regs is not None:
        if rep.regs > MAX_REGS_PER_THREAD:
            rep.problems.append(f"{rep.regs} registers/thread > {MAX_REGS_PER_THREAD}")
        if rep.num_warps and rep.regs * 32 * rep.num_warps > MAX_REGS_PER_BLOCK:
            rep.problems.append(f"{rep.regs} regs x {32 * rep.num_warps} threads > "
                                f"{MAX_REGS_PER_BLOCK:,} per block")
    rep.fits = not rep.problems
    return rep


def _capability(arch: str) -> int:
    major, minor = parse_arch(arch)
    return major * 10 + minor


# --------------------------------------------------------------------------------------------
# Triton.
def check_triton(arch: str, modules: Sequence[str] = TRITON_MODULES) -> list[ConfigReport]:
    """Compile every ``compile_configs(arch)`` entry of the Triton kernel modules for ``arch``."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("check_triton: TRITON_INTERPRET is set; the interpreter replaces the "
                           "JIT functions (run `qsa compile`, which re-runs itself without it)")
    out: list[ConfigReport] = []
    for mod_name in modules:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError as e:
            out.append(ConfigReport("triton", arch, mod_name, note=f"not importable: {e}"))
            continue
        fn = getattr(mod, "compile_configs", None)
        if fn is None:
            out.append(ConfigReport("triton", arch, mod_name,
                                    note="module exposes no compile_configs(arch): not checked"))
            continue
        out.extend(compile_triton_configs(arch, fn(arch), getattr(mod, "kernel_attrs", None)))
    return out


def compile_triton_configs(arch: str, configs: Iterable[dict],
                           default_attrs: Callable[[], dict] | None = None) -> list[ConfigReport]:
    """Compile ``compile_configs``-style entries for ``arch`` (no GPU) and judge each against the
    arch's limits (shared memory, registers). The one compile loop behind ``qsa compile`` and the
    kernel modules' own AOT checks.

    Args:
      arch: "sm_90" style name in ``KNOWN_ARCHS``.
      configs: dicts with kernel, name, signature, constexprs, attrs (optional), num_warps,
        num_stages, options (optional).
      default_attrs: attrs for entries without their own (16-byte divisibility as a launch
        specialises it: without it Triton neither vectorises nor pipelines, and the shared
        memory and registers reported would be wrong).

    Returns:
      one ConfigReport per entry; a config that fails to compile is reported as not fitting.
    """
    import triton  # noqa: PLC0415
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415
    from triton.compiler import ASTSource  # noqa: PLC0415

    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silence Triton 3.9's notice
    limit = KNOWN_ARCHS[arch].smem_per_block
    target = GPUTarget("cuda", _capability(arch), 32)
    out: list[ConfigReport] = []
    for cfg in configs:
        rep = ConfigReport("triton", arch, cfg["name"], cfg.get("num_warps"), cfg.get("num_stages"))
        t0 = time.perf_counter()
        try:
            attrs = cfg.get("attrs")
            if attrs is None and default_attrs is not None:
                attrs = default_attrs()
            src = ASTSource(fn=cfg["kernel"], signature=cfg["signature"],
                            constexprs=cfg.get("constexprs", {}), attrs=attrs)
            opts = {k: cfg[k] for k in ("num_warps", "num_stages") if cfg.get(k) is not None}
            opts.update(cfg.get("options", {}))
            try:
                compiled = triton.compile(src, target=target, options=opts)
            except FileNotFoundError:
                # another process pruned/rewrote the same Triton cache entry mid-compile
                # (seen with concurrent runs sharing ~/.triton/cache): compile once more
                compiled = triton.compile(src, target=target, options=opts)
            _judge(rep, compiled, limit)
        except Exception as e:  # noqa: BLE001 - a config that does not compile does not fit
            rep.fits, rep.error = False, f"{type(e).__name__}: {str(e).strip()[:400]}"
        rep.seconds = time.perf_counter() - t0
        out.append(rep)
    return out


# --------------------------------------------------------------------------------------------
# Pallas.
def _default_pallas_cases(mod_name: str, arch: str) -> list[tuple[str, Callable, tuple]]:
    """Lowering cases for the Pallas modules that expose no ``lowering_cases``."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    from .arch import DeviceFacts  # noqa: PLC0415

    sds = jax.ShapeDtypeStruct
    facts = DeviceFacts.from_device_kind(DEVICE_KIND[arch])
    cases: list[tuple[str, Callable, tuple]] = []
    if mod_name == "qsa_pallas.decode":
        from qsa_pallas.decode import decode_plan_for, sparse_decode  # noqa: PLC0415

        from .crosscheck import DECODE_BATCHES, TP_SHAPES  # noqa: PLC0415

        seen = set()
        msk, d = 2051, 256
        for tp, (hq, hkv) in TP_SHAPES.items():
            for b in DECODE_BATCHES:
                plan = decode_plan_for(b, hq, hkv, d, msk, sm_count=facts.sm_count)
                key = (hq, hkv, plan)
                if key in seen:
                    continue
                seen.add(key)
                cap = b * msk
                args = (sds((b, hq, d), jnp.bfloat16), sds((cap, hkv, d), jnp.bfloat16),
                        sds((cap, hkv, d), jnp.bfloat16), sds((b + 1,), jnp.int32),
                        sds((b + 1,), jnp.int32))
                fn = (lambda q, k, v, cq, ck, plan=plan:  # noqa: E731
                      sparse_decode(q, k, v, cq, ck, msk, interpret=False, plan=plan))
                cases.append((f"pallas_decode_{tp}_B{b}_bn{plan.block_n}_s{plan.max_splits}"
                              f"_w{plan.num_warps}_st{plan.num_stages}", fn, args))
        return cases
    return []


_TTIR_CACHE: dict[tuple, Any] = {}


def _compile_ttir_text(text: str, name: str, capability: int, num_warps: int, num_stages: int):
    """Compile Triton IR text (cached per run: several lowering cases embed the same kernel)."""
    key = (hash(text), name, capability, num_warps, num_stages)
    if key not in _TTIR_CACHE:
        _TTIR_CACHE[key] = _compile_ttir_uncached(text, name, capability, num_warps, num_stages)
    return _TTIR_CACHE[key]


def _compile_ttir_uncached(text: str, name: str, capability: int, num_warps: int, num_stages: int):
    import triton  # noqa: PLC0415
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415

    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"{re.sub(r'[^A-Za-z0-9_]', '_', name)}.ttir")
        with open(path, "w") as fh:
            fh.write(text)
        return triton.compile(path, target=GPUTarget("cuda", capability, 32),
                              options=dict(num_warps=num_warps, num_stages=num_stages))


def check_pallas(arch: str, modules: Sequence[str] = PALLAS_MODULES) -> list[ConfigReport]:
    """Lower every Pallas kernel case for ``arch``'s abstract device and compile its Triton IR."""
    try:
        from qsa_pallas import _compat as C  # noqa: PLC0415
    except ImportError as e:
        return [ConfigReport("pallas", arch, "qsa_pallas", note=f"not importable: {e}")]
    kind = DEVICE_KIND[arch]
    limit = KNOWN_ARCHS[arch].smem_per_block
    cap = _capability(arch)
    out: list[ConfigReport] = []
    for mod_name in modules:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError as e:
            out.append(ConfigReport("pallas", arch, mod_name, note=f"not importable: {e}"))
            continue
        provider = getattr(mod, "lowering_cases", None)
        cases = provider(kind) if provider is not None else _default_pallas_cases(mod_name, arch)
        for name, fn, args in cases:
            t0 = time.perf_counter()
            try:
                lowered = C.lower_for_device_kind(fn, args, kind)
                mods = C.triton_modules(lowered)
                if not mods:
                    raise RuntimeError("no Triton kernel in the lowered module")
            except Exception as e:  # noqa: BLE001
                rep = ConfigReport("pallas", arch, name, fits=False,
                                   error=f"lowering: {type(e).__name__}: {str(e).strip()[:400]}")
                rep.seconds = time.perf_counter() - t0
                out.append(rep)
                continue
            for m in mods:
                rep = ConfigReport("pallas", arch, f"{name}:{m.name}" if len(mods) > 1 else name,
                                   m.num_warps, m.num_stages)
                try:
                    compiled = _compile_ttir_text(m.text(), m.name, cap, m.num_warps, m.num_stages)
                    _judge(rep, compiled, limit)
                except Exception as e:  # noqa: BLE001
                    rep.fits, rep.error = False, f"compile: {type(e).__name__}: {str(e).strip()[:400]}"
                rep.seconds = time.perf_counter() - t0
                out.append(rep)
    return out


def _check_group(fam: str, arch: str) -> list[ConfigReport]:
    return check_triton(arch) if fam == "triton" else check_pallas(arch)


def run(archs: Sequence[str] = DEFAULT_ARCHS, families: Sequence[str] = ("triton", "pallas"),
        progress: Callable[[str], None] | None = None, jobs: int = 1) -> list[ConfigReport]:
    """Every family x arch; ``progress(message)`` before each group. ``jobs`` > 1 compiles the
    (family, arch) groups in that many worker processes (compilation is single-threaded per
    config: CI's 2 cores halve the wall time); the reports keep the serial order."""
    groups = [(fam, arch) for arch in archs for fam in families]
    if jobs <= 1 or len(groups) <= 1:
        out: list[ConfigReport] = []
        for fam, arch in groups:
            if progress:
                progress(f"compiling {fam} kernels for {arch} ({DEVICE_KIND[arch]}) ...")
            out += _check_group(fam, arch)
        return out
    import concurrent.futures as cf  # noqa: PLC0415
    import multiprocessing as mp  # noqa: PLC0415

    # spawn: a forked child would inherit JAX's / torch's threads mid-state
    with cf.ProcessPoolExecutor(max_workers=min(jobs, len(groups)),
                                mp_context=mp.get_context("spawn")) as pool:
        futs = [pool.submit(_check_group, fam, arch) for fam, arch in groups]
        if progress:
            progress(f"compiling {len(groups)} (family, arch) groups in "
                     f"{min(jobs, len(groups))} worker processes: "
                     + ", ".join(f"{fam} {arch}" for fam, arch in groups) + " ...")
        out = []
        for (fam, arch), f in zip(groups, futs):
            out += f.result()
            if progress:
                progress(f"  {fam} kernels for {arch} ({DEVICE_KIND[arch]}): done")
        return out


def summary_rows(reports: Sequence[ConfigReport]) -> list[list[Any]]:
    """Table rows: family, arch, name, warps/stages, shared vs limit, regs, spills, verdict."""
    rows = []
    for r in reports:
        if r.note:
            verdict = f"note: {r.note}"
        elif r.error:
            verdict = f"FAIL: {r.error}"
        else:
            verdict = "fits" if r.fits else "FAIL: " + "; ".join(r.problems)
        rows.append([r.family, r.arch, r.name,
                     "-" if r.num_warps is None else f"{r.num_warps}/{r.num_stages}",
                     "-" if r.shared is None else f"{r.shared:,} / {r.smem_limit:,}",
                     "-" if r.regs is None else r.regs,
                     "-" if r.spill_bytes is None else r.spill_bytes, verdict])
    return rows
