"""No import cycle between the package's modules, counting every import wherever it sits: a function-local
import is a tie at run time too, and hiding one in a function only defers the cycle. The graph is built from the
source (``ast``), as ``/work/shared/tools/import_cycles.py`` builds it: ``from pkg import name`` ties to the
submodule ``pkg.name`` when there is one; a name a package's ``__init__`` only re-exports ties to the module
that defines it (``nanovllm``'s lazy ``_EXPORTS`` included), not to the package."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

tomllib = pytest.importorskip("tomllib", reason="reads pyproject.toml with Python 3.11's tomllib")

ROOT = Path(__file__).resolve().parents[2]
ROOT_PACKAGES = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["root_packages"]
# Function-local imports of the package's own modules, at most: each defers a heavy or optional dependency
# (torch, transformers, Hydra, the harness behind a front door), with a comment saying so. Lower it when one goes.
MAX_FUNCTION_LOCAL_IMPORTS = 55


def _modules() -> dict[str, Path]:
    modules = {}
    for package in ROOT_PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imported(module: str, path: Path, node: ast.Import | ast.ImportFrom) -> list[tuple[str, str | None]]:
    """(module, name imported from it or None) for each thing ``node`` imports, relative imports resolved."""
    if isinstance(node, ast.Import):
        return [(alias.name, None) for alias in node.names]
    base = node.module or ""
    if node.level:
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        package = package[:len(package) - (node.level - 1)]
        base = ".".join(package + ([base] if base else []))
    return [(base, alias.name) for alias in node.names]


def _reexports(modules: dict[str, Path]) -> dict[str, dict[str, str]]:
    """Package -> {name: the module defining it} for the names its ``__init__`` imports from its modules."""
    exports: dict[str, dict[str, str]] = {}
    for module, path in modules.items():
        if path.name != "__init__.py":
            continue
        tree = ast.parse(path.read_text())
        names = exports.setdefault(module, {})
        for node in tree.body:
            if isinstance(node, ast.ImportFrom):
                for target, name in _imported(module, path, node):
                    if target in modules and name:
                        names[name] = target
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_EXPORTS" for t in node.targets):
                names.update(ast.literal_eval(node.value))
    return exports


def _resolve(target: str, name: str | None, modules: dict[str, Path], exports: dict[str, dict[str, str]]) -> str | None:
    if name is not None and f"{target}.{name}" in modules:
        return f"{target}.{name}"
    if name is not None and name in exports.get(target, {}):
        return exports[target][name]
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target or None


def _graph() -> tuple[nx.DiGraph, list[str]]:
    """The module graph, and the function-local imports of the package's own modules (``file:line``)."""
    modules = _modules()
    exports = _reexports(modules)
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    local = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text())
        in_functions = {id(node) for function in ast.walk(tree)
                        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
                        for node in ast.walk(function)}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            targets = {_resolve(target, name, modules, exports) for target, name in _imported(module, path, node)}
            targets = {t for t in targets if t is not None and t != module and not module.startswith(f"{t}.")}
            graph.add_edges_from((module, target) for target in targets)
            if targets and id(node) in in_functions:
                local.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return graph, local


def test_no_import_cycle_between_the_package_s_modules():
    graph, _ = _graph()
    cycles = sorted((sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1), key=len)
    assert not cycles, "import cycles: " + " | ".join(", ".join(c) for c in cycles)


def test_the_graph_sees_function_local_and_re_exported_imports():
    graph, local = _graph()
    # runner=tp's worker process imports the loader inside its entry point; LLM re-exported by nanovllm.
    assert graph.has_edge("nanovllm.engine.tp.worker", "nanovllm.models.loader")
    assert graph.has_edge("nanovllm.validate", "nanovllm.llm")
    assert graph.has_edge("policies.fcfs", "nanovllm.policy")
    assert any(entry.startswith("nanovllm/engine/tp/worker.py:") for entry in local)


def test_function_local_imports_of_the_package_do_not_grow():
    _, local = _graph()
    print(f"{len(local)} function-local imports of the package's own modules")
    assert len(local) <= MAX_FUNCTION_LOCAL_IMPORTS, "\n".join(local)
