"""``qsa compile``: ahead-of-time compile every shipped kernel configuration for sm_90 / sm_120 /
sm_121 without a GPU, and check each against the arch's limits.

One list function per kernel family and backend (``_FAMILY_LISTS``), built from the backends' own
kernels, plans and constexpr builders (imported lazily), so a list cannot drift from a launch.
Out-of-tree kernels bring their own: a module with ``compile_configs(arch)`` /
``lowering_cases(device_kind)`` (``qsa compile --triton-modules/--pallas-modules``).

Triton: ``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))``; Pallas cases
``(name, fn, args)`` are lowered for the arch's abstract device
(``qsa_pallas._compat.lower_for_device_kind``) and their Triton IR compiled. A configuration
*fits* when its shared memory (``metadata.shared``; Triton does not check sm_12x's 101,376 bytes)
<= the arch's opt-in limit per block, registers (``cuobjdump --dump-resource-usage``, when found)
<= 255 per thread and registers x threads <= 65,536 per block; spills are reported, not failed.
Needs ``TRITON_INTERPRET`` off: ``qsa compile`` re-runs itself without it.

Sibling arches (same major version and shared memory: sm_120 / sm_121) lower to the same PTX but
for its ``.target`` line, so the later one is assembled from the earlier one's PTX by ptxas alone,
skipping Triton's front end (most of a compile); a full compile checks that on the first
configuration of each kernel and every ``_SiblingPTX.CHECK_EVERY``-th, and a kernel whose PTX
differs is compiled in full from then on (``ConfigReport.assembled_from``).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import functools
import importlib
import itertools
import multiprocessing as mp
import os
import re
import shutil
import subprocess
import tempfile
import time
from typing import Any, Callable, Iterable, Sequence

from interop.arch import (CI_ARCHS, KNOWN_ARCHS, KNOWN_PARTS, arch_name, capability, device_kind,
                          parse_arch)

__all__ = ["ConfigReport", "DEFAULT_ARCHS", "DEVICE_KIND",
           "FAMILIES", "resource_usage", "check", "compile_pallas_cases", "run", "parse_archs",
           "triton_decode_configs", "triton_prefill_configs", "triton_prefill_union_configs",
           "triton_decode_paged_configs", "triton_indexer_configs", "pallas_decode_cases",
           "pallas_prefill_cases", "pallas_prefill_union_cases", "pallas_decode_paged_cases",
           "pallas_indexer_cases", "compile_triton_configs", "summary_rows"]

DEFAULT_ARCHS = CI_ARCHS
#: The abstract device each arch is lowered for (jax device kinds).
DEVICE_KIND = {arch: device_kind(arch) for arch in KNOWN_ARCHS}
#: kernel families per backend; ``run`` / ``--family`` take "triton", "pallas" or e.g.
#: "triton:decode"
_KERNEL_FAMILIES = ("decode", "prefill", "prefill_union", "decode_paged", "indexer")
FAMILIES = {"triton": _KERNEL_FAMILIES, "pallas": _KERNEL_FAMILIES}
MAX_REGS_PER_THREAD = 255
MAX_REGS_PER_BLOCK = 65_536


@dataclasses.dataclass
class ConfigReport:
    """One compiled configuration (``family`` "triton" | "pallas"): ``shared`` bytes per program
    against ``smem_limit``; ``regs`` / ``spill_bytes`` (local + stack) per thread, None without
    cuobjdump; ``fits`` within every limit, else ``problems`` say why; ``error`` a compile or
    lowering failure; ``note`` e.g. a module with no list (not a failure)."""

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
    assembled_from: str | None = None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def failed(self, e: Exception, what: str = "") -> ConfigReport:
        """Record ``e`` (a configuration that does not compile or lower does not fit)."""
        self.fits, self.error = False, f"{what}{type(e).__name__}: {str(e).strip()[:400]}"
        return self


def parse_archs(text: str | None) -> list[str]:
    """``"sm_90,121"`` -> ["sm_90", "sm_121"] (default: ``DEFAULT_ARCHS``), repeats dropped.

    Raises:
      ValueError: an unknown arch, or none in a non-empty text (the message lists the known ones).
    """
    if not text:
        return list(DEFAULT_ARCHS)
    out = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        try:
            name = arch_name(parse_arch(part))
        except ValueError:
            name = part
        if name not in DEVICE_KIND:
            raise ValueError(f"--arch: unknown arch {part!r}; known: {', '.join(DEVICE_KIND)}")
        out.append(name)
    if not out:  # "," or " ": nothing to do would read as "every configuration fits"
        raise ValueError(f"--arch: no arch in {text!r}; known: {', '.join(DEVICE_KIND)}")
    return list(dict.fromkeys(out))


# --------------------------------------------------------------------------------------------
def _tool(name: str) -> str | None:
    """``$TRITON_<NAME>_PATH``, Triton's bundled copy, then $PATH."""
    paths = [os.environ.get(f"TRITON_{name.upper()}_PATH")]
    try:
        import triton  # noqa: PLC0415

        paths.append(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                                  name))
    except ImportError:
        pass
    return next((p for p in paths if p and os.path.exists(p)), None) or shutil.which(name)


def resource_usage(cubin: bytes) -> dict[str, int] | None:
    """Registers, stack / local / static shared bytes of the kernel in a cubin (``cuobjdump
    --dump-resource-usage``); None when the tool is absent or fails."""
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


def _judge(rep: ConfigReport, shared: int, cubin: bytes | None, limit: int) -> ConfigReport:
    rep.shared, rep.smem_limit = int(shared), limit
    usage = resource_usage(cubin) if cubin else None
    if usage is not None:
        rep.regs, rep.spill_bytes = usage["regs"], usage["stack"] + usage["local"]
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


# --------------------------------------------------------------------------------------------
def _lowers_alike(base: str, arch: str) -> bool:
    """``arch`` is assembled from ``base``'s PTX: same major version and shared memory, later
    minor (sm_121 from sm_120)."""
    a, b = KNOWN_ARCHS[base], KNOWN_ARCHS[arch]
    return a.cc[0] == b.cc[0] and a.cc < b.cc and a.smem_per_block == b.smem_per_block


def _retarget(ptx: str, arch: str) -> str:
    """``ptx`` with its ``.target`` set to ``arch`` (Triton writes ``.target sm_{cc}`` and its
    arch suffix the same way)."""
    return re.sub(r"^\.target sm_\d+", f".target sm_{capability(arch)}", ptx, count=1,
                  flags=re.M)


def _same_ptx(ptx: str, base_ptx: str, arch: str) -> bool:
    """``ptx`` (compiled for ``arch``) is ``base_ptx`` retargeted, up to the source file names
    of the line info and the DWARF sections after the code (they hold paths: a Pallas kernel's
    TTIR is compiled from a temporary file, and a Triton cache shared by two checkouts returns
    the other checkout's path)."""
    def body(text):
        text = re.split(r"^\s*\.section\s+\.debug", text, maxsplit=1, flags=re.M)[0]
        return re.sub(r"^\s*\.file\s.*$", "", text, flags=re.M)
    return body(ptx) == body(_retarget(base_ptx, arch))


def _assemble(ptx: str, arch: str, options: dict) -> bytes:
    """ptxas alone (Triton's invocation and flags): ``ptx`` retargeted to ``arch``, as a cubin."""
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415
    from triton.compiler.compiler import make_backend  # noqa: PLC0415

    cap = capability(arch)
    backend = make_backend(GPUTarget("cuda", cap, 32))
    return backend.make_cubin(_retarget(ptx, arch), {}, backend.parse_options(dict(options)), cap)


class _SiblingPTX:
    """Compiles of one kernel-family list across arches, sharing PTX between sibling arches
    (module docstring). ``build`` is called per (arch, configuration), base arches first."""

    CHECK_EVERY = 8

    def __init__(self, archs: Sequence[str]):
        self.base = {b: a for b in archs for a in archs if _lowers_alike(a, b)}
        self.order = sorted(archs, key=lambda a: a in self.base)  # bases first
        self.ptx: dict[tuple, tuple[int, str]] = {}  # (arch, config key) -> (shared, ptx)
        self.same: dict[tuple, bool] = {}  # (arch, kernel) -> the last check's verdict
        self.assembled = 0

    def build(self, arch: str, key: tuple, kernel: str, full: Callable[[], tuple],
              options: dict) -> tuple[int, bytes | None, str | None]:
        """(shared, cubin, assembled_from) of one configuration; ``full()`` compiles it with
        Triton for ``arch`` -> (shared, cubin, ptx)."""
        base = self.base.get(arch)
        hit = self.ptx.get((base, key)) if base else None
        state = self.same.get((arch, kernel)) if hit else False  # None: not checked yet
        if hit and state:
            self.assembled += 1
            if self.assembled % self.CHECK_EVERY:
                try:
                    return hit[0], _assemble(hit[1], arch, options), base
                except Exception:  # noqa: BLE001 - another Triton's backend API: compile in full
                    self.same[(arch, kernel)] = state = False
        shared, cubin, ptx = full()
        if hit and state is not False:  # the kernel's first configuration, or a periodic check
            self.same[(arch, kernel)] = _same_ptx(ptx, hit[1], arch) and int(shared) == hit[0]
        if arch in self.base.values():
            self.ptx[(arch, key)] = (int(shared), ptx)
        return shared, cubin, None


# --------------------------------------------------------------------------------------------
# The shipped configurations: Triton.
_TT = {"bfloat16": "bf16", "float16": "fp16", "float8_e4m3fn": "fp8e4nv"}


def _aligned(names: Sequence[str], strides: str = "") -> list[str]:
    """Pointers and strides (``strides`` e.g. "qkvo": only those tensors', multiples of D)."""
    return [n for n in names if n.endswith("_ptr") or n.startswith("stride_")
            and (not strides or n[7] in strides)]


def _entry(kernel, name: str, types: dict, consts: dict, num_warps: int, num_stages: int,
           pdl: bool = False, *, aligned: Iterable[str] | None = None, **extra) -> dict:
    """One ``compile_triton_configs`` entry: ``types`` as given, other pointers ``*i32``, other
    arguments i32; ``aligned`` (default pointers and strides) 16-divisible as the JIT specialises
    them (else loads are neither vectorised nor pipelined and shared memory is under-counted)."""
    names = kernel.arg_names
    consts = {k: v for k, v in consts.items() if k in names}
    aligned = _aligned(names) if aligned is None else aligned
    return {"kernel": kernel, "name": name, "constexprs": consts,
            "signature": {n: types.get(n) or ("constexpr" if n in consts else
                                              "*i32" if n.endswith("_ptr") else "i32")
                          for n in names},
            "attrs": {(names.index(n),): [["tt.divisibility", 16]] for n in aligned},
            "num_warps": num_warps, "num_stages": num_stages,
            "options": {"launch_pdl": True} if pdl else {}, **extra}


def _config_key(e: dict) -> tuple:
    """What makes a ``compile_triton_configs`` entry one compiled kernel."""
    return (e["kernel"].__name__, tuple(sorted(e["signature"].items())),
            tuple(sorted((k, str(v)) for k, v in e.get("constexprs", {}).items())),
            e.get("num_warps"), e.get("num_stages"), tuple(sorted(e.get("options", {}).items())))


def _unique(entries: Iterable[dict]) -> list[dict]:
    """``entries`` without repeats of one compiled kernel; the first (and its name) stays."""
    out, seen = [], set()
    for e in entries:
        key = _config_key(e)
        if key not in seen:
            seen.add(key)
            out.append(e)
    return out


def triton_decode_configs(arch: str, *, head_dim: int = 256, dtype: str = "bfloat16") -> list[dict]:
    """Every decode kernel configuration ``qsa_triton.decode`` can launch on ``arch`` for the
    qualified shapes: the split kernel per distinct geometry of ``interop.plan.plan_decode``
    (fitted to the arch) over the qualified head pairs, B = 1..128 and every SM count of
    ``interop.arch.KNOWN_PARTS``, in every launchable combination (merge inline / kernel,
    LSE_ALL, PDL entry / late trigger), and the merge kernel per split chunk, with and without
    PDL. Returns dicts with ``kernel``, ``name``, ``signature``, ``constexprs``, ``attrs``,
    ``num_warps``, ``num_stages``, ``options`` (``launch_pdl`` for the PDL variants)."""
    from interop.contract import QUALIFIED  # noqa: PLC0415
    from interop.plan import fit_shared_memory, plan_decode  # noqa: PLC0415
    from qsa_triton import decode as dec  # noqa: PLC0415

    info = KNOWN_ARCHS[arch]
    pdl_ok = tuple(info.cc) >= (9, 0) and dec._TRITON_PDL
    dt = _TT[dtype]
    split_types = {**dict.fromkeys(("q_ptr", "k_ptr", "v_ptr", "out_ptr"), f"*{dt}"),
                   "lse_ptr": "*fp32", "part_ptr": "*fp32", "scale_log2": "fp32"}
    out = []
    lo, hi = QUALIFIED["batch"]
    for hq, hkv in QUALIFIED["head_pairs"]:
        g = hq // hkv
        plans = {fit_shared_memory(plan_decode(b, hkv, g, head_dim, QUALIFIED["max_seqlen_k"], sms,
                                               balance=True, one_block_splits=True),
                                   head_dim=head_dim, limit=info.smem_per_block)
                 for b in range(lo, hi + 1) for sms in sorted({n for _, n in KNOWN_PARTS.values()})}
        geometry = {}  # one compiled kernel per geometry
        for p in sorted(plans, key=lambda p: (p.block_n, p.max_splits)):
            geometry.setdefault((p.head_tile, p.block_n, p.num_warps, p.num_stages), p)
        for p in geometry.values():
            # (merge inline, LSE_ALL): _launch passes LSE_ALL = splits > 1 and merge == "kernel",
            # MERGE_INLINE = merge == "inline"; PDL (entry or late trigger) with either merge
            for inline, lse_all in ((False, True), (False, False), (True, False)):
                for pdl, late in ((False, False),) + (((True, False), (True, True)) if pdl_ok else ()):
                    consts = dec._split_constexprs(p, g, head_dim, inline=inline, lse_all=lse_all,
                                                   use_pdl=pdl, pdl_late=late)
                    name = (f"decode_split_G{g}_ht{p.head_tile}_bn{p.block_n}_w{p.num_warps}"
                            f"_s{p.num_stages}"
                            f"{'_inline%d' % consts['INLINE_TILE'] if inline else ''}"
                            f"{'' if inline or lse_all else '_nolse'}_{dt}"
                            f"{'_pdl' if pdl else ''}{'late' if late else ''}")
                    out.append(_entry(dec._decode_split_kernel, name, split_types, consts,
                                      p.num_warps, p.num_stages, pdl))
    merge_types = {"out_ptr": f"*{dt}", "lse_ptr": "*fp32", "part_ptr": "*fp32"}
    for pdl in (False, True) if pdl_ok else (False,):
        for splits in (2, 4, 8, 16, 32, 64, 128):
            chunk, d_chunk = dec._merge_chunks(splits, head_dim)
            consts = {"D": head_dim, "SPLIT_CHUNK": chunk, "D_CHUNK": d_chunk,
                      "N_DC": head_dim // d_chunk, "USE_PDL": pdl}
            out.append(_entry(dec._decode_merge_kernel,
                              f"decode_merge_chunk{chunk}_{dt}{'_pdl' if pdl else ''}",
                              merge_types, consts, 4, 1, pdl))
    return _unique(out)


def _attention_types(q: str, kv: str) -> dict:
    """Argument types of the attention kernels: q / output in ``q``, K/V in ``kv``."""
    return {"q_ptr": f"*{q}", "o_ptr": f"*{q}", "k_ptr": f"*{kv}", "v_ptr": f"*{kv}",
            "qk_scale": "fp32", "v_scale": "fp32"}


#: (mode, q dtype, K/V dtype or None = q's): every prefill kernel variant the entry points launch
PREFILL_VARIANTS = (("MODE_ORDINARY", "bfloat16", None), ("MODE_CHUNK", "bfloat16", None),
                    ("MODE_CHUNK", "bfloat16", "float8_e4m3fn"), ("MODE_SLOTS", "bfloat16", None),
                    ("MODE_SLOTS", "bfloat16", "float8_e4m3fn"))


#: the split-KV partials of the prefill kernels (fp32 outputs and base-2 LSEs)
_PARTIALS = {"po_ptr": "*fp32", "plse_ptr": "*fp32"}


def triton_prefill_configs(arch: str, *, head_dim: int = 256, groups=(6, 12),
                           variants=PREFILL_VARIANTS) -> list[dict]:
    """Every configuration ``qsa_triton.prefill`` can launch on ``arch``: each geometry of
    ``interop.geometry.all_configs(arch)``, unsplit and split-KV, and its tail launch x
    ``variants``; one G per BLOCK_M (G only changes masks; tuned entries keep theirs); the
    split-KV merge; the paged slot pre-pass. Dicts as ``triton_decode_configs``."""
    from interop.geometry import all_configs  # noqa: PLC0415
    from interop.plan import next_pow2  # noqa: PLC0415
    from qsa_triton import decode as dec  # noqa: PLC0415
    from qsa_triton import prefill as P  # noqa: PLC0415

    kernel = P._qsa_sparse_prefill_fwd
    aligned = _aligned(kernel.arg_names, "qkvo")  # the index row strides (W = 2051) are not
    out = []
    for geo in all_configs(arch):
        grp = next((g for g in groups if max(16, next_pow2(g)) == geo.block_m
                    or next_pow2(g) == geo.block_m), geo.block_m)
        if geo.source.startswith("sm120-tuned[G="):
            grp = int(geo.source.split("G=")[1].rstrip("]"))
        for mode_name, qd, kd in variants:
            mode = getattr(P, mode_name)
            qt, kt = _TT[qd], _TT[kd or qd]
            # tail geometries repeat across the main ones (_unique keeps one); the main launch
            # also split-KV (fp32 partials: short prefills, ``prefill_splits``); every launch
            # with PDL where Triton has it (the tail is the main grid's dependent, the main
            # grid the tile-union kernel's on the rows of tiles past the union bound)
            pdl = dec._TRITON_PDL
            for row_loop, split, g in ((False, False, geo), (False, True, geo),
                                       (True, False, P.tail_geometry(geo))):
                consts = {"HKV": 1, "G": grp, "D": head_dim, "BLOCK_M": g.block_m,
                          "BLOCK_N": g.block_n, "MODE": mode, "OFF64": mode == P.MODE_SLOTS,
                          "ROW_LOOP": row_loop, "SPLIT": split, "PDL": pdl}
                out.append(_entry(kernel, f"prefill_mode{mode}_{qt}_{kt}_G{grp}_bm{g.block_m}"
                                          f"_bn{g.block_n}_w{g.num_warps}_s{g.num_stages}"
                                          f"{'_tail' if row_loop else ''}"
                                          f"{'_split' if split else ''}"
                                          f"{'_pdl' if pdl else ''}",
                                  {**_attention_types(qt, kt), **_PARTIALS}, consts, g.num_warps,
                                  g.num_stages, pdl, aligned=aligned, geometry=g))
        merge = P._qsa_prefill_merge  # the split-KV merge, per head tile
        out.append(_entry(merge, f"prefill_merge_G{grp}_bm{geo.block_m}_bf16",
                          {"o_ptr": "*bf16", **_PARTIALS},
                          {"HKV": 1, "G": grp, "D": head_dim, "BLOCK_M": geo.block_m,
                           "SP": P.merge_split_tile()}, 4, 1,
                          aligned=_aligned(merge.arg_names, "o"), geometry=None))
    resolve = P._qsa_resolve_pool_slots  # the paged slot pre-pass, shared / per-head indices
    for hidx in (1, 2):
        out.append(_entry(resolve, f"prefill_resolve_pool_slots_hidx{hidx}_w2051", {},
                          {"HIDX": hidx, "BLOCK": 1024}, 4, 1,
                          aligned=_aligned(resolve.arg_names, "qkvo"), geometry=None))
    return _unique(out)


def triton_prefill_union_configs(arch: str, *, head_dim: int = 256) -> list[dict]:
    """Every configuration ``qsa_triton.prefill_union`` can launch on ``arch``: the block
    expansion per mode, the union build and its skip estimate per tile height R (512 block ids
    per row), the attention kernel per Triton geometry of ``interop.geometry.all_union_configs``
    x ordinary / chunk / paged with bf16 K/V and chunk / paged with FP8 K/V. Dicts as
    ``triton_decode_configs``."""
    from interop.geometry import all_union_configs  # noqa: PLC0415
    from interop.plan import next_pow2  # noqa: PLC0415
    from qsa_triton import decode as dec  # noqa: PLC0415
    from qsa_triton import prefill_union as U  # noqa: PLC0415

    geos = all_union_configs(arch, head_dim=head_dim, backend="triton")
    out = []
    build, kernel = U._qsa_block_union, U._qsa_prefill_union_fwd
    expand = U._qsa_expand_blocks  # the per-row kernel's input, every mode
    skip = U._qsa_union_skip  # the build's per-tile estimate
    for mode, ordinary, paged in (("ordinary", True, False), ("chunk", False, False),
                                  ("paged", False, True)):
        consts = {"NBP": 512, "BP": 2, "BLOCK_W": 1024, "ORDINARY": ordinary, "PAGED": paged}
        out.append(_entry(expand, f"prefill_expand_blocks_nb512_{mode}", {}, consts, 4, 1,
                          aligned=_aligned(expand.arg_names, "qkvo"), geometry=None))
    for r in sorted({geo.tile_rows for _, geo in geos}):
        consts = {"R": r, "NBP": 512, "BP": 2, "ORDINARY": False, "KEY64": False}
        out.append(_entry(build, f"prefill_union_build_R{r}_nb512", {}, consts,
                          U.build_num_warps(r, 512), 1, aligned=_aligned(build.arg_names, "qkvo"),
                          geometry=None))
        out.append(_entry(skip, f"prefill_union_skip_R{r}_nb512", {},
                          {"R": r, "NBP": 512, "BP": 2, "ORDINARY": False}, 4, 1,
                          aligned=_aligned(skip.arg_names, "qkvo"), geometry=None))
    for kv_bytes, geo in geos:
        group = geo.head_tile // geo.tile_rows  # the padded head tile per row (masks only)
        kt = "fp8e4nv" if kv_bytes == 1 else "bf16"
        for mode in (0, 1, 2) if kv_bytes == 2 else (1, 2):  # ordinary prefill has no FP8 K/V
            consts = {"PER_HEAD": False, "G": group, "HT": next_pow2(group), "R": geo.tile_rows,
                      "M": geo.head_tile, "D": head_dim, "BLOCK_N": geo.block_n, "MODE": mode,
                      "OFF64": mode == 2, "BP": 2, "TRIGGER": dec._TRITON_PDL}
            out.append(_entry(kernel, f"prefill_union_mode{mode}_bf16_{kt}_R{geo.tile_rows}"
                              f"_m{geo.head_tile}_bn{geo.block_n}"
                              f"_w{geo.num_warps}"
                              f"_s{geo.num_stages}", _attention_types("bf16", kt), consts,
                              geo.num_warps, geo.num_stages,
                              aligned=_aligned(kernel.arg_names, "qkvo"), geometry=geo))
    return out


def triton_indexer_configs(arch: str, *, batches=(1, 16, 64, 128),
                           contexts=(8192, 32768, 131072, 262144, 1 << 20),
                           prefill_contexts=(32768, 131072, 262144)) -> list[dict]:
    """The indexer configurations ``interop.indices.plan_indexer`` launches on ``arch`` (4 heads
    x 128, topk 512, ratio 4, page size 16): the pass-1 decode kernel per distinct plan over
    ``batches`` x ``contexts`` with bf16 and fp8 keys and its merge (token rows and block ids),
    with PDL (``_pdl``) where planned; the prefill kernel for 8192 rows at ``prefill_contexts``
    and its merge. Dicts as ``triton_decode_configs``."""
    import triton.language as tl  # noqa: PLC0415

    from interop.indices import plan_indexer  # noqa: PLC0415
    from qsa_triton import decode as dec  # noqa: PLC0415
    from qsa_triton import indexer as ix  # noqa: PLC0415

    info = KNOWN_ARCHS[arch]
    sms = next((n for a, n in KNOWN_PARTS.values() if a == arch), 132)
    out = []
    plans = {plan_indexer("decode", b, ctx // 4, 512, sm_count=sms,
                          smem_per_block=info.smem_per_block)
             for b in batches for ctx in contexts}
    for p in sorted(plans, key=lambda p: (p.chunk, p.splits)):
        for pdl in sorted({False, p.pdl and dec._TRITON_PDL}):
            tag = "_pdl" if pdl else ""
            for kd in ("bf16", "fp8e4nv"):
                consts = {**ix._decode_constexprs(p, 4, 128, 16, 4, tl.bfloat16), "USE_PDL": pdl}
                out.append(_entry(
                    ix._decode_chunk_kernel,
                    f"indexer_decode_C{p.chunk}_T{p.tile}_rb{p.radix_bits}_{kd}{tag}",
                    {"q_ptr": "*bf16", "k_ptr": f"*{kd}"}, consts, p.num_warps, p.num_stages))
            for expand in (True, False):
                consts = {**ix._merge_constexprs(p, prefill=False, expand=expand, ratio=4),
                          "USE_PDL": pdl}
                out.append(_entry(ix._merge_kernel, f"indexer_merge_decode_SP{p.splits_pad}_"
                                  f"{'tokens' if expand else 'ids'}{tag}", {}, consts,
                                  p.merge_warps, 1, pdl))
    for ctx in prefill_contexts:
        p = plan_indexer("prefill", 8192, ctx // 4, 512, sm_count=sms,
                         smem_per_block=info.smem_per_block)
        # the bound pass, then pass 1 (streamed and its fixup where the merge compacts)
        passes = [(True, 0)] if p.bound_chunk else []
        passes += [(False, 1), (False, 2)] if p.merge_capacity else [(False, 0)]
        for bound_pass, counts in passes:
            consts = {**ix._prefill_constexprs(p, 4, 128, tl.bfloat16, bound_pass=bound_pass),
                      "COUNTS": counts}
            out.append(_entry(ix._prefill_chunk_kernel,
                              f"indexer_prefill_C{consts['C']}_T{p.tile}_bm{consts['BM']}"
                              f"_bound{consts['BOUND']}_counts{counts}",
                              {"q_ptr": "*bf16", "k_ptr": "*bf16"}, consts, p.num_warps,
                              p.num_stages))
        out.append(_entry(ix._merge_kernel, f"indexer_merge_prefill_SP{p.splits_pad}_cap"
                          f"{p.merge_capacity}_tokens", {},
                          ix._merge_constexprs(p, prefill=True, expand=True, ratio=4),
                          p.merge_warps, 1))
    return _unique(out)


def _paged_shapes(dtype: str):
    """((Hq, Hkv), pool dtype, batch_invariant, R) of the paged decode lists."""
    from interop.contract import QUALIFIED  # noqa: PLC0415

    lo, hi = QUALIFIED["paged_rows"]
    return itertools.product((*QUALIFIED["head_pairs"], (3, 1)), (dtype, "float8_e4m3fn"),
                             (False, True), range(lo, hi + 1))


def triton_decode_paged_configs(arch: str, *, head_dim: int = 256,
                                dtype: str = "bfloat16") -> list[dict]:
    """Every configuration ``qsa_triton.decode_paged`` launches for ``_paged_shapes`` at W = 2051
    on every part of ``interop.arch.KNOWN_PARTS``: the split kernel per distinct plan with OFF64
    both ways, the merge kernel per split tile. The plans fit every arch's shared memory: one list
    for every ``arch``. Dicts as ``triton_decode_configs``."""
    from interop.contract import QUALIFIED  # noqa: PLC0415
    from interop.plan import next_pow2, plan_decode_paged  # noqa: PLC0415
    from qsa_triton import decode_paged as P  # noqa: PLC0415
    from qsa_triton.decode import _TRITON_PDL  # noqa: PLC0415

    del arch
    dt, out = _TT[dtype], []
    parts = {(sms, KNOWN_ARCHS[a].smem_per_block) for a, sms in KNOWN_PARTS.values()}
    partial = {"out_ptr": f"*{dt}", "lse_ptr": "*fp32", "part_ptr": "*fp32"}
    aligned = _aligned(P._paged_split_kernel.arg_names, "qkvot")  # index row stride: W = 2051
    # PDL as qsa_triton.decode_paged.pdl_enabled on every known part (all sm_90+)
    plans = set()
    for (hq, hkv), kv, bi, r in _paged_shapes(dtype):
        for sms, smem in parts:
            p = plan_decode_paged(r, hkv, hq // hkv, head_dim, QUALIFIED["index_width"], sms,
                                  batch_invariant=bi, kv_bytes=1 if kv == "float8_e4m3fn" else 2,
                                  device_smem=smem)
            pdl = _TRITON_PDL and P._pdl_rule(r * hkv)
            plans.add((hq // hkv, _TT[kv], p, pdl))
    merges = set()
    for g, kt, p, pdl in sorted(plans, key=lambda x: (x[0], x[1], dataclasses.astuple(x[2]),
                                                      x[3])):
        if p.num_splits > 1:
            merges.add((max(2, next_pow2(p.num_splits)), pdl))
        for off64 in (False, True):
            consts = {"G": g, "D": head_dim, "HT": p.head_tile, "BLOCK_N": p.block_n,
                      "DIRECT": p.num_splits == 1, "OFF64": off64, "USE_PDL": pdl}
            out.append(_entry(P._paged_split_kernel, f"paged_split_G{g}_ht{p.head_tile}"
                              f"_bn{p.block_n}_w{p.num_warps}_s{p.num_stages}_{dt}_kv{kt}"
                              f"{'_direct' if p.num_splits == 1 else ''}"
                              f"{'_off64' if off64 else ''}{'_pdl' if pdl else ''}",
                              {**_attention_types(dt, kt), **partial}, consts, p.num_warps,
                              p.num_stages, pdl, aligned=aligned))
    for sp2, pdl in sorted(merges):
        out.append(_entry(P._paged_merge_kernel, f"paged_merge_p{sp2}_{dt}{'_pdl' if pdl else ''}",
                          partial, {"D": head_dim, "SPLIT_P2": sp2, "USE_PDL": pdl,
                                    "D_CHUNK": P._merge_d_chunk(sp2, head_dim)}, 4, 1, pdl))
    return _unique(out)


def compile_triton_configs(arch: str, configs: Iterable[dict], *,
                           siblings: _SiblingPTX | None = None) -> list[ConfigReport]:
    """Compile ``triton_*_configs`` entries (dicts with kernel, name, signature, optional
    constexprs / attrs / num_warps / num_stages / options) for ``arch`` ("sm_90") without a GPU;
    one ConfigReport per entry, judged against the arch's limits (a compile error: not fitting).
    ``siblings``: shares PTX with a sibling arch compiled before (module docstring)."""
    import triton  # noqa: PLC0415
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415
    from triton.compiler import ASTSource  # noqa: PLC0415

    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silence Triton 3.9's notice
    limit = KNOWN_ARCHS[arch].smem_per_block
    target = GPUTarget("cuda", capability(arch), 32)
    siblings = siblings or _SiblingPTX([arch])
    out: list[ConfigReport] = []
    for cfg in configs:
        rep = ConfigReport("triton", arch, cfg["name"], cfg.get("num_warps"), cfg.get("num_stages"))
        t0 = time.perf_counter()
        src = ASTSource(fn=cfg["kernel"], signature=cfg["signature"],
                        constexprs=cfg.get("constexprs", {}), attrs=cfg.get("attrs"))
        opts = {k: cfg[k] for k in ("num_warps", "num_stages") if cfg.get(k) is not None}
        opts.update(cfg.get("options", {}))

        def full(src=src, opts=opts):
            try:
                compiled = triton.compile(src, target=target, options=opts)
            except FileNotFoundError:  # a concurrent run rewrote the cache entry: once more
                compiled = triton.compile(src, target=target, options=opts)
            return compiled.metadata.shared, compiled.asm.get("cubin"), compiled.asm.get("ptx")

        try:
            shared, cubin, rep.assembled_from = siblings.build(
                arch, _config_key(cfg), f"{cfg['kernel'].__name__}{sorted(cfg.get('options', {}))}",
                full, opts)
            _judge(rep, shared, cubin, limit)
        except Exception as e:  # noqa: BLE001 - a config that does not compile does not fit
            rep.failed(e)
        rep.seconds = time.perf_counter() - t0
        out.append(rep)
    return out


# --------------------------------------------------------------------------------------------
# Pallas.
def pallas_decode_cases(kind: str, *, head_dim: int = 256, max_seqlen_k: int = 2051,
                        dtype: str = "bfloat16") -> list[tuple[str, Callable, tuple]]:
    """Every distinct decode launch ``qsa_pallas.decode`` plans on device kind ``kind`` for the
    qualified head pairs and B = 1..128, as ``(name, fn, args)`` for
    ``qsa_pallas._compat.lower_for_device_kind`` (``args``: ``jax.ShapeDtypeStruct``). Names
    contain ``_s{max_splits}_`` (``_s1_``: the one-launch direct path)."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    from interop.cases import TP_SHAPES  # noqa: PLC0415
    from qsa_pallas import _compat as C  # noqa: PLC0415
    from qsa_pallas import decode as dec  # noqa: PLC0415

    sds, dt = jax.ShapeDtypeStruct, getattr(jnp, dtype)
    cases, seen = [], set()
    with jax.sharding.use_abstract_mesh(C.abstract_mesh(kind)):
        for tp, (hq, hkv) in TP_SHAPES.items():
            for b in range(1, 129):
                plan, _ = dec.plan_for(b, hkv, hq // hkv, head_dim, max_seqlen_k)
                if (hq, hkv, plan) in seen:
                    continue
                seen.add((hq, hkv, plan))
                kv = sds((b * max_seqlen_k, hkv, head_dim), dt)
                cu = sds((b + 1,), jnp.int32)
                fn = functools.partial(dec._sparse_decode, max_seqlen_k=max_seqlen_k,
                                       interpret=False, plan=plan)
                cases.append((f"pallas_decode_{tp}_B{b}_ht{plan.head_tile}_bn{plan.block_n}"
                              f"_s{plan.max_splits}_w{plan.num_warps}_st{plan.num_stages}",
                              fn, (sds((b, hq, head_dim), dt), kv, kv, cu, cu)))
    return cases


def pallas_prefill_cases(kind: str, *, head_dim: int = 256, width: int = 2051, group: int = 12,
                         rows: int = 64) -> list[tuple[str, Callable, tuple]]:
    """Every distinct prefill launch ``qsa_pallas.prefill`` can pick on device kind ``kind``:
    each ``interop.geometry.all_configs`` geometry of the arch fitted by ``fit_prefill``, unsplit
    and split-KV, x ordinary bf16, chunk / paged bf16 and FP8, as ``(name, fn, args)``
    (``pallas_decode_cases``).

    Raises:
      ValueError: a device kind whose arch ``interop.arch`` does not know.
    """
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    from interop.arch import DeviceFacts  # noqa: PLC0415
    from interop.geometry import all_configs, fit_prefill  # noqa: PLC0415
    from interop.plan import next_pow2  # noqa: PLC0415

    facts = DeviceFacts.from_device_kind(kind)
    geos = {}
    for kv_bytes in (2, 1):
        for cfg in all_configs(facts.arch):
            cfg = dataclasses.replace(cfg, block_m=max(next_pow2(group), cfg.block_m))
            geo = fit_prefill(cfg, backend="pallas", head_dim=head_dim, kv_bytes=kv_bytes,
                              limit=facts.smem_per_block)
            geos.setdefault((kv_bytes, *geo.key), geo)
    q = jax.ShapeDtypeStruct((rows, group, head_dim), jnp.bfloat16)
    idx = jax.ShapeDtypeStruct((rows, width), jnp.int32)
    # each unsplit and split-KV (a third grid axis, fp32 partials: ``prefill_splits``)
    return [case for (kv_bytes, *_), geo in geos.items() for splits in (1, 2)
            for case in _prefill_kind_cases(
                "pallas_prefill", f"ht{geo.block_m}_bn{geo.block_n}_w{geo.num_warps}"
                f"_s{geo.num_stages}{'_split' if splits > 1 else ''}", kv_bytes,
                dataclasses.replace(geo, splits=splits), q, idx, blocks=False)]


def pallas_prefill_union_cases(kind: str, *, head_dim: int = 256, rows: int = 64,
                               blocks: int = 512) -> list[tuple[str, Callable, tuple]]:
    """Every tile-union prefill launch (``block_indices=``) ``qsa_pallas.prefill`` can pick on
    device kind ``kind``: each ``interop.geometry.all_union_configs`` geometry x ordinary bf16,
    chunk / paged bf16 and FP8, as ``(name, fn, args)``; G fills the Q tile exactly.

    Raises:
      ValueError: a device kind whose arch ``interop.arch`` does not know.
    """
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    from interop.arch import DeviceFacts  # noqa: PLC0415
    from interop.geometry import all_union_configs  # noqa: PLC0415

    sds = jax.ShapeDtypeStruct
    bidx = sds((rows, blocks), jnp.int32)
    return [case for kv_bytes, geo in all_union_configs(DeviceFacts.from_device_kind(kind).arch,
                                                        head_dim=head_dim, backend="pallas")
            for case in _prefill_kind_cases(
                "pallas_prefill_union", f"R{geo.tile_rows}_m{geo.head_tile}_bn{geo.block_n}"
                f"_w{geo.num_warps}_s{geo.num_stages}", kv_bytes, geo,
                sds((rows, geo.head_tile // geo.tile_rows, head_dim), jnp.bfloat16), bidx,
                blocks=True)]


def _prefill_kind_cases(prefix: str, tag: str, kv_bytes: int, geo, q, ids, *,
                        blocks: bool) -> list[tuple[str, Callable, tuple]]:
    """Ordinary (bf16), chunk and paged cases of one geometry; ``ids`` as ``block_indices``
    when ``blocks``, else as token ``indices``."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    from qsa_pallas import prefill as P  # noqa: PLC0415

    def launch(fn, at: int):  # ``at``: the position of the selection among fn's arguments
        def run(*args, geometry):
            args, kw = list(args), {}
            if blocks:
                args[at], kw["block_indices"] = None, args[at]
            with P._forced_geometry(geometry):  # read while the entry point traces
                return fn(*args, args[0].shape[0], interpret=False, **kw)
        return functools.partial(run, geometry=geo)

    sds, (t, _, d) = jax.ShapeDtypeStruct, q.shape
    cu, kl = sds((3,), jnp.int32), sds((2,), jnp.int32)
    r2t, ri = sds((4, 2048), jnp.int32), sds((2,), jnp.int32)
    name = "fp8" if kv_bytes == 1 else "bf16"
    pool = sds((4096, 1, d), jnp.float8_e4m3fn if kv_bytes == 1 else jnp.bfloat16)
    cases = []
    if kv_bytes == 2:
        kv = sds((t, 1, d), jnp.bfloat16)
        cases.append((f"{prefix}_ordinary_bf16_{tag}", launch(P.sparse_prefill, 3),
                      (q, kv, kv, ids, cu)))
    return cases + [(f"{prefix}_chunk_{name}_{tag}", launch(P.sparse_prefill_chunk, 3),
                     (q, pool, pool, ids, cu, cu, kl)),
                    (f"{prefix}_paged_{name}_{tag}", launch(P.sparse_prefill_paged, 5),
                     (q, pool, pool, r2t, ri, ids, cu, kl))]


def pallas_decode_paged_cases(kind: str, *, head_dim: int = 256, width: int = 2051,
                              dtype: str = "bfloat16") -> list[tuple[str, Callable, tuple]]:
    """Every distinct paged-decode launch ``qsa_pallas.decode_paged`` plans on device kind
    ``kind`` for ``_paged_shapes`` (one or several splits), as ``(name, fn, args)``."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    from qsa_pallas import _compat as C  # noqa: PLC0415
    from qsa_pallas import decode_paged as P  # noqa: PLC0415

    sds, dt, i32 = jax.ShapeDtypeStruct, getattr(jnp, dtype), jnp.int32
    cases, seen = [], set()
    with jax.sharding.use_abstract_mesh(C.abstract_mesh(kind)):
        for (hq, hkv), kv, bi, r in _paged_shapes(dtype):
            plan = P.plan_for(r, hkv, hq // hkv, head_dim, width, q_dtype=dt,
                              kv_dtype=getattr(jnp, kv), batch_invariant=bi)
            key = (hq, hkv, kv, dataclasses.replace(plan, num_splits=min(plan.num_splits, 2)))
            if key in seen:
                continue
            seen.add(key)
            pool = sds((4096, hkv, head_dim), getattr(jnp, kv))
            cases.append((f"pallas_paged_{hq}_{hkv}_kv{kv}_R{r}_ht{plan.head_tile}"
                          f"_bn{plan.block_n}_s{plan.num_splits}_w{plan.num_warps}"
                          f"_st{plan.num_stages}{'_bi' if bi else ''}",
                          functools.partial(P.sparse_decode_paged, batch_invariant=bi,
                                            interpret=False),
                          (sds((r, hq, head_dim), dt), pool, pool, sds((r + 2, 4096), i32),
                           sds((r,), i32), sds((r, width), i32), sds((r,), i32))))
    return cases


def pallas_indexer_cases(kind: str | None = None, *, dtype: str = "bfloat16",
                         k_dtype: str | None = None) -> list[tuple[str, Callable, tuple]]:
    """Representative ``qsa_pallas.indexer`` launches (the plan follows the abstract device;
    ``kind`` is unused): decode B = 16 at 32k and B = 128 at 256k, prefill 8192 rows at 32k
    and 128k, keys in ``k_dtype`` (default ``dtype``), as ``(name, fn, args)``."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    from qsa_pallas import indexer as ix  # noqa: PLC0415

    sds, dt, i32 = jax.ShapeDtypeStruct, getattr(jnp, dtype), jnp.int32
    kd = getattr(jnp, k_dtype or dtype)
    cases = [(f"decode/B{b}/{ctx}", functools.partial(ix.indexer_select_decode, interpret=False),
              (sds((b, 4, 128), dt), sds((b * ctx // 64, 16, 1, 128), kd),
               sds((b, ctx // 64), i32), sds((b,), i32)))
             for b, ctx in ((16, 32768), (128, 262144))]
    t = 8192
    return cases + [(f"prefill/T{t}/{ctx}",
                     functools.partial(ix.indexer_select_prefill, interpret=False),
                     (sds((t, 4, 128), dt), sds((ctx // 4, 1, 128), kd), *[sds((t,), i32)] * 4))
                    for ctx in (32768, 131072)]


def compile_pallas_cases(arch: str, cases: Iterable[tuple[str, Callable, tuple]], *,
                         siblings: _SiblingPTX | None = None) -> list[ConfigReport]:
    """Lower ``(name, fn, args)`` cases for ``arch``'s abstract device and compile each Triton
    kernel in them; one ConfigReport per kernel (``name:kernel`` when a case holds several),
    judged like ``compile_triton_configs`` (a case that does not lower does not fit);
    ``siblings`` as there."""
    from qsa_pallas import _compat as C  # noqa: PLC0415

    kind, limit, cap = DEVICE_KIND[arch], KNOWN_ARCHS[arch].smem_per_block, capability(arch)
    siblings = siblings or _SiblingPTX([arch])
    out: list[ConfigReport] = []
    for name, fn, args in cases:
        t0 = time.perf_counter()
        try:
            mods = C.triton_modules(C.lower_for_device_kind(fn, args, kind))
            if not mods:
                raise RuntimeError("no Triton kernel in the lowered module")
        except Exception as e:  # noqa: BLE001
            rep = ConfigReport("pallas", arch, name, fits=False).failed(e, "lowering: ")
            rep.seconds = time.perf_counter() - t0
            out.append(rep)
            continue
        for m in mods:
            rep = ConfigReport("pallas", arch, f"{name}:{m.name}" if len(mods) > 1 else name,
                               m.num_warps, m.num_stages)
            def full(m=m):
                res = C.compile_ttir(m, cap)
                return res["shared"], res["cubin"], res["ptx"]

            try:
                shared, cubin, rep.assembled_from = siblings.build(
                    arch, (m.ttir, m.num_warps, m.num_stages), m.name, full,
                    {"num_warps": m.num_warps, "num_stages": m.num_stages})
                _judge(rep, shared, cubin, limit)
            except Exception as e:  # noqa: BLE001
                rep.failed(e, "compile: ")
            rep.seconds = time.perf_counter() - t0
            out.append(rep)
    return out


# --------------------------------------------------------------------------------------------
#: the list function an out-of-tree module exposes, per backend
_PROTOCOL = {"triton": "compile_configs", "pallas": "lowering_cases"}


class _NoList(Exception):
    """A module that exposes no ``_PROTOCOL`` function (reported as a note)."""


def _module_list(module: str, backend: str) -> Callable:
    """``module``'s own list function (``_PROTOCOL``)."""
    def cases(target):
        fn = getattr(importlib.import_module(module), _PROTOCOL[backend], None)
        if fn is None:
            raise _NoList(f"module exposes no {_PROTOCOL[backend]}(...): not checked")
        return fn(target)
    return cases


_FAMILY_LISTS = {b: {k: globals()[f"{b}_{k}_{kind}"] for k in _KERNEL_FAMILIES}
                 for b, kind in (("triton", "configs"), ("pallas", "cases"))}


def check(backend: str, archs: str | Sequence[str], modules: Sequence[str] = (),
          kernels: Sequence[str] | None = None, *, match: str | None = None,
          progress: Callable[[str], None] | None = None) -> list[ConfigReport]:
    """Compile (Triton) or lower and compile (Pallas) every shipped configuration of the kernel
    families ``kernels`` (default: ``FAMILIES[backend]``) for each of ``archs`` (sibling arches
    share PTX: module docstring), or the ``modules``' own lists (``_PROTOCOL``); a list that
    cannot be built is a note, not a failure. ``match``: only the configurations (Pallas:
    cases) whose names the regular expression finds. ``progress(message)``: a line before and
    after each (arch, list) with its count, fits and seconds.

    Raises:
      RuntimeError: Triton with ``TRITON_INTERPRET`` set (the interpreter replaces the JIT
        functions; ``qsa compile`` re-runs itself without it).
    """
    if backend == "triton" and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("check: TRITON_INTERPRET is set; the interpreter replaces the JIT "
                           "functions (run `qsa compile`, which re-runs itself without it)")
    siblings = _SiblingPTX([archs] if isinstance(archs, str) else archs)
    lists = ([(k, _FAMILY_LISTS[backend][k]) for k in kernels or FAMILIES[backend]] if not modules
             else [(m, _module_list(m, backend)) for m in modules])
    compile_all = compile_triton_configs if backend == "triton" else compile_pallas_cases
    out: list[ConfigReport] = []
    for arch in siblings.order:
        target = arch if backend == "triton" else DEVICE_KIND[arch]
        for group, entries in lists:
            try:
                items = entries(target)
            except (ImportError, _NoList) as e:
                note = f"not importable: {e}" if isinstance(e, ImportError) else str(e)
                out.append(ConfigReport(backend, arch, group, note=note))
                continue
            if match:
                items = [i for i in items
                         if re.search(match, i["name"] if backend == "triton" else i[0])]
            if progress:
                progress(f"  {arch} {backend}:{group}: compiling {len(items)} ...")
            t0 = time.perf_counter()
            reps = compile_all(arch, items, siblings=siblings)
            if progress:
                progress(f"  {arch} {backend}:{group}: {sum(r.fits for r in reps)} of "
                         f"{len(reps)} kernels fit ({time.perf_counter() - t0:.0f} s)")
            out += reps
    return out


def _check_group(fam: str, archs: Sequence[str], modules: dict[str, Sequence[str]],
                 show: bool = False) -> list[ConfigReport]:
    """``check`` of ``fam`` ("triton", or one family "triton:decode"); ``modules`` per backend;
    ``show``: its progress lines printed (a worker process shares the caller's stdout)."""
    backend, _, kernel = fam.partition(":")
    return check(backend, archs, tuple(modules.get(backend, ())), (kernel,) if kernel else None,
                 progress=functools.partial(print, flush=True) if show else None)


def run(archs: Sequence[str] = DEFAULT_ARCHS, families: Sequence[str] = ("triton", "pallas"),
        progress: Callable[[str], None] | None = None, jobs: int = 1, *,
        triton_modules: Sequence[str] = (), pallas_modules: Sequence[str] = ()
        ) -> list[ConfigReport]:
    """``check`` of every family for ``archs``, ``progress(message)`` before each group (and,
    given, ``check``'s lines per arch and list, printed to stdout); ``jobs``
    > 1 spreads the kernel families (each with every arch, so sibling arches share PTX) over
    that many worker processes, the union prefill first (the longest; reports in that order);
    ``triton_modules`` / ``pallas_modules`` replace the built-in lists (``_PROTOCOL``)."""
    modules = {"triton": tuple(triton_modules), "pallas": tuple(pallas_modules)}
    groups = [g for fam in families for g in (
        [fam] if ":" in fam or modules[fam] else [f"{fam}:{k}" for k in FAMILIES[fam]])]
    groups.sort(key=lambda g: not g.endswith("prefill_union"))  # stable: the longest first
    archs = tuple(archs)
    show = progress is not None  # the per-(arch, list) lines, printed where they run
    progress = progress or (lambda message: None)
    where = f"for {', '.join(f'{a} ({DEVICE_KIND[a]})' for a in archs)}"
    out: list[ConfigReport] = []
    if jobs <= 1 or len(groups) <= 1:
        for fam in groups:
            progress(f"compiling {fam} kernels {where} ...")
            out += _check_group(fam, archs, modules, show=show)
        return out
    # spawn: a forked child would inherit JAX's / torch's threads mid-state
    with cf.ProcessPoolExecutor(max_workers=min(jobs, len(groups)),
                                mp_context=mp.get_context("spawn")) as pool:
        futs = [pool.submit(_check_group, fam, archs, modules, show) for fam in groups]
        progress(f"compiling {len(groups)} kernel families {where} in "
                 f"{min(jobs, len(groups))} worker processes ...")
        for fam, f in zip(groups, futs):
            out += f.result()
            progress(f"  {fam}: done")
    return out


def summary_rows(reports: Sequence[ConfigReport]) -> list[list[Any]]:
    """Table rows: family, arch, name, warps/stages, shared vs limit, regs, spills, verdict."""
    def verdict(r: ConfigReport) -> str:
        if r.note:
            return f"note: {r.note}"
        return f"FAIL: {r.error}" if r.error else "fits" if r.fits else "FAIL: " + "; ".join(r.problems)

    return [[r.family, r.arch, r.name,
             "-" if r.num_warps is None else f"{r.num_warps}/{r.num_stages}",
             "-" if r.shared is None else f"{r.shared:,} / {r.smem_limit:,}",
             "-" if r.regs is None else r.regs, "-" if r.spill_bytes is None else r.spill_bytes,
             verdict(r)] for r in reports]
