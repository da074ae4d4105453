"""The import graph (architecture.md, "Layers and the one rule about imports").

Static part (every ``import`` statement of every project module, parsed with ``ast``, including
imports inside functions):
  * the core (``interop/*.py``) imports, at import time, only the standard library, numpy and other
    core modules; nowhere (not even lazily) a backend (``qsa_triton``, ``qsa_pallas``), the tooling
    (``interop.validate``), ``bench`` or ``tests``;
  * ``qsa_triton`` never imports jax, ``qsa_pallas`` never torch; neither imports the other,
    ``interop.validate``, ``bench`` or ``tests``;
  * ``interop.validate`` imports the backends and the frameworks lazily (inside functions) only;
  * no import cycle among project modules.
Dynamic part (a fresh interpreter each): ``import qsa_pallas`` loads no torch, ``import
qsa_triton`` no jax, and ``import interop.validate.cli`` neither framework (what the static check
cannot see: third-party packages that import a framework themselves).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("interop", "qsa_triton", "qsa_pallas")
STDLIB = set(sys.stdlib_module_names) | {"__future__"}
FRAMEWORKS = {"torch", "triton", "jax", "jaxlib"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(name: str) -> list[tuple[str, bool, int]]:
    """(imported module, at import time?, line) for every import statement of module ``name``.

    ``from . import x`` names the submodule ``x`` when it is one, else the package; relative
    imports are resolved against the module's package. Imports inside a function body or under
    ``if TYPE_CHECKING:`` do not run at import time."""
    path = MODULES[name]
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[str, bool, int]] = []

    def visit(node, import_time: bool):
        for child in ast.iter_child_nodes(node):
            now = import_time
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                now = False
            elif isinstance(child, ast.If) and _is_type_checking(child):
                now = False
            if isinstance(child, ast.Import):
                found.extend((a.name, now, child.lineno) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = pkg.split(".")
                    base = base[:len(base) - (child.level - 1)]
                    mod = ".".join(base + ([child.module] if child.module else []))
                else:
                    mod = child.module
                for a in child.names:
                    sub = f"{mod}.{a.name}"
                    found.append((sub if sub in MODULES else mod, now, child.lineno))
            visit(child, now)

    visit(ast.parse(path.read_text(), str(path)), True)
    return found


def _root(mod: str) -> str:
    return mod.split(".")[0]


def _is_tooling(mod: str) -> bool:
    return mod == "interop.validate" or mod.startswith("interop.validate.")


def _is_core(mod: str) -> bool:
    return _root(mod) == "interop" and not _is_tooling(mod)


def _project(mod: str) -> str | None:
    """The project module ``mod`` refers to (itself or the package holding the name), or None."""
    while mod:
        if mod in MODULES:
            return mod
        mod = mod.rpartition(".")[0]
    return None


def _violations(pred) -> list[str]:
    out = []
    for name in MODULES:
        for mod, import_time, line in _imports(name):
            why = pred(name, mod, import_time)
            if why:
                out.append(f"{MODULES[name].relative_to(ROOT)}:{line}: imports {mod} ({why})")
    return list(dict.fromkeys(out))


def test_the_graph_sees_every_package():
    assert {"interop", "interop.contract", "interop.reference", "interop.cases",
            "interop.validate", "interop.validate.cli", "interop.validate.crosscheck",
            "qsa_triton", "qsa_pallas"} <= set(MODULES)
    imports = {m for m, _, _ in _imports("interop.validate.crosscheck")}
    assert {"interop.reference", "interop.cases", "interop.validate.peer", "numpy"} <= imports


# The rules: (importing module, imported module, at import time?) -> why it is forbidden, or None.
def _core_rule(name, mod, import_time):
    if not _is_core(name):
        return None
    r = _root(mod)
    if r in ("qsa_triton", "qsa_pallas", "bench", "tests") or _is_tooling(mod):
        return "the core never imports a backend, the tooling, bench or tests"
    if import_time and not (r in STDLIB or r == "numpy" or _is_core(mod)):
        return "at import time the core needs numpy and the standard library only"
    return None


def _backend_rule(backend: str, forbidden: set[str]):
    def rule(name, mod, import_time):
        if _root(name) != backend:
            return None
        if _root(mod) in forbidden | {"bench", "tests"}:
            return f"{backend} never imports {_root(mod)}"
        return "a backend never imports the tooling" if _is_tooling(mod) else None

    return rule


def _tooling_rule(name, mod, import_time):
    lazy_only = FRAMEWORKS | {"qsa_triton", "qsa_pallas", "bench"}
    if _is_tooling(name) and import_time and _root(mod) in lazy_only:
        return "interop.validate imports backends and frameworks inside functions only"
    return None


def _existing_rule(name, mod, import_time):
    """A stale import of a moved or deleted module (lazy ones are only found when they run)."""
    return "no such module" if _root(mod) in PACKAGES and mod not in MODULES else None


RULES = {
    "core_imports_only_numpy_stdlib_and_core": _core_rule,
    "qsa_triton_imports_torch_triton_and_the_core_only": _backend_rule(
        "qsa_triton", {"jax", "jaxlib", "qsa_pallas"}),
    "qsa_pallas_imports_jax_and_the_core_only": _backend_rule("qsa_pallas",
                                                              {"torch", "qsa_triton"}),
    "tooling_imports_backends_and_frameworks_lazily": _tooling_rule,
    "every_project_import_names_an_existing_module": _existing_rule,
}


@pytest.mark.parametrize("rule", list(RULES.values()), ids=list(RULES))
def test_import_rule(rule):
    bad = _violations(rule)
    assert not bad, "\n".join(bad)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (or a self-loop), Tarjan."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def strong(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in edges.get(v, ()):
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            strong(v)
    return out


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_among_project_modules():
    """Every import counts, lazy ones too: a cycle hidden behind a function-level import is still
    two modules that need each other. Importing a submodule runs its package's ``__init__``
    first, but that is not an edge (the package is already in ``sys.modules`` then)."""
    edges = {name: {p for mod, _, _ in _imports(name) if (p := _project(mod)) and p != name}
             for name in MODULES}
    cycles = _cycles(edges)
    assert not cycles, f"import cycles: {cycles}"


# --------------------------------------------------------------------------------------------
# Dynamic checks: what a fresh interpreter has loaded after one import.
def _modules_after(stmt: str) -> set[str]:
    code = f"{stmt}\nimport sys\nprint(' '.join(sorted(m.split('.')[0] for m in sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return set(proc.stdout.split())


def test_qsa_pallas_does_not_load_torch():
    pytest.importorskip("jax")
    mods = _modules_after("import qsa_pallas")
    assert "qsa_pallas" in mods and "torch" not in mods


def test_qsa_triton_does_not_load_jax():
    pytest.importorskip("torch")
    mods = _modules_after("import qsa_triton")
    assert "qsa_triton" in mods
    assert "jax" not in mods and "jaxlib" not in mods


def test_the_command_and_the_core_load_no_framework():
    mods = _modules_after("import interop, interop.reference, interop.cases, interop.indices, "
                          "interop.validate.cli, interop.validate.crosscheck, "
                          "interop.validate.capture, interop.validate.peer")
    assert not mods & FRAMEWORKS, mods & FRAMEWORKS
