"""The package's import graph has no cycle and the serving layers never import ``bench``.

Imports are read with :mod:`ast` from the source (module level and inside functions alike), so
a lazy import that closes a loop counts as much as a top-level one: a cycle is a knot a reader
cannot unpick module by module, whichever import runs first.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

import laneserve

ROOT = Path(laneserve.__file__).resolve().parent
PACKAGE = "laneserve"
LOWER_LAYERS = ("engine", "core", "policies", "sim", "runtime", "plan")


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` names (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _targets(module: str, is_package: bool, tree: ast.AST, modules: set[str]) -> set[str]:
    """The package modules ``tree`` imports, anywhere in it (a ``from pkg import name`` counts as
    importing ``pkg.name`` when that is a module, else ``pkg``)."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, is_package, node)
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:     # `import a.b.c` of a non-module attribute path
                name = name.rpartition(".")[0]
            if name.startswith(PACKAGE) and name != module:
                found.add(name)
    return found


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Each package module and the package modules it imports."""
    files = {_module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    modules = set(files)
    return {name: _targets(name, path.name == "__init__.py", ast.parse(path.read_text()), modules)
            for name, path in files.items()}


def _without_parent_package_edges(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Drop edges from a module to a package containing it: importing ``a.b.c`` runs ``a/__init__``
    and ``a/b/__init__`` first anyway, so ``a.b.c -> a.b`` is implied, not a design choice, and the
    package's re-export of its own submodule (``a.b -> a.b.c``) would otherwise read as a loop."""
    return {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in graph.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_finder_sees_function_level_and_relative_imports(tmp_path):
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("def f():\n    from . import b\n")
    (pkg / "sub" / "b.py").write_text("import laneserve.sub.a\n")
    (pkg / "c.py").write_text("from laneserve.sub.a import f\n")
    graph = _without_parent_package_edges(import_graph(pkg))
    assert graph["laneserve.sub.a"] == {"laneserve.sub.b"}
    assert graph["laneserve.c"] == {"laneserve.sub.a"}
    assert cycles(graph) == [["laneserve.sub.a", "laneserve.sub.b"]]


def test_no_import_cycles():
    found = cycles(_without_parent_package_edges(import_graph()))
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


@pytest.mark.parametrize("layer", LOWER_LAYERS)
def test_serving_layers_do_not_import_bench(layer):
    graph = import_graph()
    prefix = f"{PACKAGE}.{layer}"
    bad = sorted(f"{m} -> {t}" for m, ts in graph.items() if m == prefix or m.startswith(prefix + ".")
                 for t in ts if t == f"{PACKAGE}.bench" or t.startswith(f"{PACKAGE}.bench."))
    assert not bad, f"{layer} imports bench:\n" + "\n".join(bad)


def _registering_modules() -> set[str]:
    """Policy modules that register a policy (a ``register(...)`` / ``registry.register(...)``
    decorator on a class)."""
    found = set()
    for path in sorted((ROOT / "policies").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                for deco in node.decorator_list:
                    func = deco.func if isinstance(deco, ast.Call) else deco
                    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                    if name == "register":
                        found.add(_module_name(path, ROOT))
    return found


def test_registry_discovers_every_registering_module():
    """The registry names its policy modules instead of importing them: a fresh process that asks
    it for the policies must end up with every module that registers one loaded."""
    expected = _registering_modules()
    assert len(expected) >= 10, expected
    code = ("import sys; from laneserve.policies import registry\n"
            "for kind in ('prefill', 'decode', 'colocated', 'router'): registry.available(kind)\n"
            "print('\\n'.join(m for m in sys.modules if m.startswith('laneserve.policies')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT.parent)}).stdout.split()
    assert expected <= set(out), sorted(expected - set(out))


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_policy_package_holds_policies_and_mechanisms_hold_parts(side):
    """``policies/<side>/`` holds the policies (each module registers one; ``base`` is the scheduler
    they derive from) and ``policies/<side>/mechanisms/`` the parts they compose (none registers):
    a newcomer tells the two apart by where a module lives, not by its name."""
    registering = _registering_modules()
    package = ROOT / "policies" / side
    tops = {_module_name(p, ROOT) for p in package.glob("*.py") if p.stem not in ("__init__", "base")}
    parts = {_module_name(p, ROOT) for p in (package / "mechanisms").glob("*.py") if p.stem != "__init__"}
    assert tops and parts
    assert not tops - registering, f"not a policy, belongs in mechanisms/: {sorted(tops - registering)}"
    assert not parts & registering, f"registers a policy, belongs beside them: {sorted(parts & registering)}"
