"""The package's layout: stages import only the stages below them, and no module imports itself round a circle."""

from __future__ import annotations

import ast
import pathlib

import networkx as nx

import fxplan

PACKAGE = pathlib.Path(fxplan.__file__).parent
#: Bottom first: a stage may import the stages before it in this list, never one after it.
ORDER = ["errors", "common", "solvers", "bptt", "capture", "measure", "costs", "rewriter", "planner", "apply",
         "api", "compare", "cli", "__init__", "__main__"]


def _imports() -> nx.DiGraph:
    """Module -> the fxplan modules it imports (anywhere in its code, lazy imports included)."""
    graph = nx.DiGraph()
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        graph.add_node(module)
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fxplan"):
                names = [f"{node.module}.{alias.name}" for alias in node.names]
                names = [n if (PACKAGE.parent / (n.replace(".", "/") + ".py")).exists() else node.module
                         for n in names]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names if alias.name.startswith("fxplan")]
            graph.add_edges_from((module, name) for name in names if name != module)
    return graph


def _stage(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_no_module_imports_itself_round_a_circle():
    graph = _imports()
    packages = {m for m in graph if (PACKAGE.parent / m.replace(".", "/") / "__init__.py").exists()}
    modules = graph.subgraph(m for m in graph if m not in packages)  # a package re-exports its modules
    assert list(nx.simple_cycles(modules)) == []


def test_stages_import_only_the_stages_below_them():
    upward = sorted({(_stage(a), _stage(b)) for a, b in _imports().edges
                     if ORDER.index(_stage(b)) > ORDER.index(_stage(a))})
    assert upward == []


def test_no_private_name_is_imported_from_another_module():
    """A name with a leading underscore belongs to its module: another module that needs it gets a public name."""
    private = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fxplan"):
                private += [f"{path.relative_to(PACKAGE)}: {node.module}.{alias.name}" for alias in node.names
                            if alias.name.startswith("_") and not alias.name.startswith("__")]
    assert not private, private
