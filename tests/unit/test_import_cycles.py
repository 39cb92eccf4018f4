"""The package's module-level import graph: no cycles, and agents and workers never load the controller.

Reads every module under ``src/undying`` with ``ast`` (nothing is imported). An edge is a
module-level import of another ``undying`` module; imports inside functions run later and
imports under ``if TYPE_CHECKING:`` never run, so neither counts. Importing ``undying.a.b``
from outside ``undying.a`` runs ``undying/a/__init__.py`` first, so it is an edge to both.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = "undying"
SOURCE_ROOT = Path(__file__).resolve().parents[2] / "src"
# Modules that run in agents and workers: none may load ``undying.controller``, even indirectly.
AGENT_AND_WORKER_MODULES = ("undying.agent", "undying.runtime")
CONTROLLER = "undying.controller"


def module_files() -> dict[str, Path]:
    """Dotted module name -> its file, for every module of the package (``__init__`` as the package)."""
    modules = {}
    for path in sorted((SOURCE_ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(SOURCE_ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def is_type_checking_guard(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def module_level_imports(tree: ast.Module, typing_too: bool = False) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements that run when the module is imported (``typing_too``: and those under
    ``if TYPE_CHECKING:``, which only the type checker follows)."""
    pending: list[ast.AST] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        elif isinstance(node, ast.If) and is_type_checking_guard(node.test) and not typing_too:
            pending.extend(node.orelse)
        else:
            pending.extend(ast.iter_child_nodes(node))


def resolve_from(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` names (``from ..x import y`` -> ``undying.x``)."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def with_packages(target: str, importer: str) -> set[str]:
    """``target`` and the packages whose ``__init__`` importing it runs (those the importer is not in)."""
    parts = target.split(".")
    names = {".".join(parts[:length]) for length in range(2, len(parts) + 1)}
    return {name for name in names if name == target or not importer.startswith(name + ".")}


def import_graph(typing_too: bool = False) -> dict[str, set[str]]:
    """Module -> the package modules it imports at module level (``typing_too``: or for the type checker)."""
    files = module_files()
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        is_package = path.name == "__init__.py"
        targets: set[str] = set()
        for node in module_level_imports(ast.parse(path.read_text(), filename=str(path)), typing_too):
            if isinstance(node, ast.Import):
                named = [alias.name for alias in node.names]
            else:
                source = resolve_from(module, is_package, node)
                # ``from undying.x import y`` imports the submodule y when there is one.
                named = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in files else source
                         for alias in node.names]
            for target in named:
                if target in files and target != module:
                    targets |= with_packages(target, module) & files.keys()
        graph[module] = targets - {module}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a path that returns to its start) for each strongly connected group of modules."""
    index: dict[str, int] = {}
    lowlink: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def connect(module: str) -> None:  # Tarjan's algorithm; the graph is small enough to recurse
        index[module] = lowlink[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in sorted(graph[module]):
            if target not in index:
                connect(target)
                lowlink[module] = min(lowlink[module], lowlink[target])
            elif target in on_stack:
                lowlink[module] = min(lowlink[module], index[target])
        if lowlink[module] == index[module]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == module:
                    break
            if len(group) > 1:
                groups.append(group)

    for module in sorted(graph):
        if module not in index:
            connect(module)
    return [cycle_within(graph, group) for group in groups]


def cycle_within(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest path from the group's first module back to itself, inside the group."""
    start = min(group)
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for module in frontier:
            for target in sorted(graph[module] & group):
                if target == start:
                    path = [module]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if target not in previous:
                    previous[target] = module
                    following.append(target)
        frontier = following
    raise AssertionError(f"no cycle through {start}")


def reachable(graph: dict[str, set[str]], start: str) -> dict[str, str]:
    """Every module ``start`` loads at import time -> the module that imports it (for the chain)."""
    importer = {start: ""}
    pending = [start]
    while pending:
        module = pending.pop()
        for target in sorted(graph[module]):
            if target not in importer:
                importer[target] = module
                pending.append(target)
    return importer


def test_the_graph_sees_the_package() -> None:
    graph = import_graph()
    assert "undying.agent" in graph and "undying.controller.core" in graph
    assert "undying.controller.core" in graph["undying.controller"]


def test_a_cycle_is_found_and_printed_as_a_path() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_relative_imports_resolve_against_the_importing_module() -> None:
    tree = ast.parse("from . import state\nfrom ..events import Event\nfrom .store import JobStore\n")
    froms = [node for node in tree.body if isinstance(node, ast.ImportFrom)]
    resolved = [resolve_from("undying.controller.core", False, node) for node in froms]
    assert resolved == ["undying.controller", "undying.events", "undying.controller.store"]
    assert resolve_from("undying.controller", True, froms[2]) == "undying.controller.store"


def test_only_imports_that_run_at_import_time_count() -> None:
    tree = ast.parse(
        "import a\n"
        "if TYPE_CHECKING:\n    import typed_only\nelse:\n    import b\n"
        "try:\n    import c\nexcept ImportError:\n    c = None\n"
        "def later():\n    import in_function\n"
        "class Holder:\n    import d\n")
    names = {alias.name for node in module_level_imports(tree) for alias in node.names}
    assert names == {"a", "b", "c", "d"}


def test_no_module_level_import_cycles() -> None:
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_the_controller_has_no_cycle_even_through_typing_only_imports() -> None:
    """The job machine imports the strategies; they see the job through ``controller/job.py``, which
    imports none of them, so not even the type checker goes round in a circle there."""
    graph = import_graph(typing_too=True)
    cycles = [cycle for cycle in find_cycles(graph) if any(module.startswith(CONTROLLER) for module in cycle)]
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)
    assert "undying.controller.job" in graph["undying.controller.strategies.process"]  # the typing edges are in


def test_agents_and_workers_do_not_load_the_controller() -> None:
    graph = import_graph()
    offenders = []
    for module in sorted(graph):
        if not any(module == root or module.startswith(root + ".") for root in AGENT_AND_WORKER_MODULES):
            continue
        importer = reachable(graph, module)
        for loaded in sorted(importer):
            if loaded == CONTROLLER or loaded.startswith(CONTROLLER + "."):
                chain = [loaded]
                while importer[chain[-1]]:
                    chain.append(importer[chain[-1]])
                offenders.append(" -> ".join(reversed(chain)))
                break
    assert not offenders, "agent/worker modules that load the controller:\n" + "\n".join(offenders)
