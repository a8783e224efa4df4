"""The checker behind test_import_graph.py: the package's import graph, read from its source.

Every ``.py`` file under ``tandem/`` is parsed with ``ast`` (nothing is imported) and each
import of the package is resolved to the file it loads: ``import tandem.a.b``,
``from tandem.a import b`` (b's own file when b is a submodule, else ``tandem/a``'s) and
relative imports. Imports inside functions count (they are real dependencies, only later);
imports under ``if TYPE_CHECKING:`` do not. An import loads its packages' ``__init__.py``
files too; those runtime edges are left out here and checked by the fresh-interpreter test.
A computed name given to ``importlib.import_module`` is not seen.
"""

from __future__ import annotations

import ast
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = "tandem"


@dataclass(frozen=True)
class Import:
    """One import statement of ``source`` (a path relative to the root) at ``line``: what it
    loads, a file of the package or (``external``) the top-level name of another library."""

    source: str
    line: int
    statement: str
    target: str
    external: bool = False

    def __str__(self) -> str:
        return f"{self.source}:{self.line} `{self.statement}`"


@dataclass
class ImportGraph:
    """Every file of the package (relative paths, sorted) and the imports of each."""

    files: list[str]
    imports: dict[str, list[Import]] = field(default_factory=dict)

    def internal(self, source: str) -> list[Import]:
        return [i for i in self.imports[source] if not i.external]

    def external(self, source: str) -> list[Import]:
        return [i for i in self.imports[source] if i.external]


def _module_files(root: Path, package: str) -> dict[str, str]:
    """Dotted module name -> file path relative to ``root``, for every file of ``package``."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        relative = path.relative_to(root)
        parts = list(relative.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = relative.as_posix()
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(node: ast.AST):
    """Import statements anywhere in ``node`` (functions included), skipping the bodies of
    ``if TYPE_CHECKING:``; ``importlib.import_module("x")`` with a literal name counts."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for orelse in child.orelse:
                yield from _import_nodes_of(orelse)
            continue
        yield from _import_nodes_of(child)


def _import_nodes_of(node: ast.AST):
    """``node`` itself when it imports, then the imports inside it."""
    if isinstance(node, ast.Import | ast.ImportFrom):
        yield node
    elif (
        isinstance(node, ast.Call)
        and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ):
        yield ast.Import(names=[ast.alias(node.args[0].value)], lineno=node.lineno)
    yield from _import_nodes(node)


def _resolve(node, source: str, modules: dict[str, str], package: str):
    """Import records of one statement: one per file of the package it loads (self-imports
    and namespace folders left out), one per other library."""
    if isinstance(node, ast.Import):
        targets = [(alias.name, f"import {alias.name}") for alias in node.names]
    else:
        module = node.module
        if node.level:  # relative: from the file's own package upward
            parts = source.removesuffix(".py").split("/")[:-1]
            base = parts[: len(parts) - (node.level - 1)]
            module = ".".join(base + ([node.module] if node.module else []))
        names: dict[str, list[str]] = {}  # target module -> the names imported from it
        for alias in node.names:
            submodule = f"{module}.{alias.name}"
            names.setdefault(submodule if submodule in modules else module, []).append(alias.name)
        prefix = f"from {'.' * node.level}{node.module or ''} import "
        targets = [(target, prefix + ", ".join(n)) for target, n in names.items()]
    for target, statement in targets:
        top = target.split(".")[0]
        if top != package:
            yield Import(source, node.lineno, statement, top, external=True)
        elif target in modules and modules[target] != source:
            yield Import(source, node.lineno, statement, modules[target])


def build_graph(root: Path, package: str = PACKAGE) -> ImportGraph:
    """Parse every file of ``root / package`` and resolve its imports."""
    modules = _module_files(root, package)
    graph = ImportGraph(files=sorted(modules.values()))
    for source in graph.files:
        tree = ast.parse((root / source).read_text(), filename=source)
        graph.imports[source] = [
            found
            for node in _import_nodes(tree)
            for found in _resolve(node, source, modules, package)
        ]
    return graph


def _components(graph: ImportGraph) -> list[list[str]]:
    """Strongly connected components (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for edge in graph.internal(node):
            if edge.target not in index:
                visit(edge.target)
                low[node] = min(low[node], low[edge.target])
            elif edge.target in on_stack:
                low[node] = min(low[node], index[edge.target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            components.append(sorted(component))

    for node in graph.files:
        if node not in index:
            visit(node)
    return components


def _path(graph: ImportGraph, start: str, goal, within=None) -> list[Import] | None:
    """The shortest chain of imports from ``start`` to a file where ``goal(file)`` holds
    (through files in ``within`` only, when given), or None."""
    parents: dict[str, Import | None] = {start: None}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for edge in graph.internal(node):
            if within is not None and edge.target not in within:
                continue
            if goal(edge.target):
                chain = [edge]
                while parents[chain[0].source] is not None:
                    chain.insert(0, parents[chain[0].source])
                return chain
            if edge.target not in parents:
                parents[edge.target] = edge
                queue.append(edge.target)
    return None


def find_circles(graph: ImportGraph) -> list[str]:
    """One report per set of files that import each other in a circle: a shortest circle
    through its first file, then every import between its files."""
    reports = []
    for component in sorted(_components(graph)):
        if len(component) < 2:
            continue
        members = set(component)
        first = component[0]
        circle = _path(graph, first, first.__eq__, members)
        lines = [f"circle: {' -> '.join([first] + [e.target for e in circle])}"]
        lines += [
            f"    {edge}"
            for source in component
            for edge in graph.internal(source)
            if edge.target in members
        ]
        reports.append("\n".join(lines))
    return reports


def torch_chains(graph: ImportGraph, roots) -> list[str]:
    """For each root that reaches torch, directly or through files of the package it
    imports: the chain of imports that does."""

    def imports_torch(file: str) -> bool:
        return any(i.target == "torch" for i in graph.external(file))

    reports = []
    for root in roots:
        chain = [] if imports_torch(root) else _path(graph, root, imports_torch)
        if chain is None:
            continue
        last = chain[-1].target if chain else root
        torch = next(i for i in graph.external(last) if i.target == "torch")
        reports.append(" -> ".join(str(edge) for edge in [*chain, torch]))
    return reports


def _covers(entry: str, file: str) -> bool:
    return file.startswith(entry) if entry.endswith("/") else file == entry


def layer_of(file: str, layers) -> tuple[int, str] | None:
    """(layer, area) of the longest entry of ``layers`` that covers ``file``."""
    matches = [(len(e), n, a) for n, a, entries in layers for e in entries if _covers(e, file)]
    return max(matches)[1:] if matches else None


def layer_violations(graph: ImportGraph, layers) -> list[str]:
    """Files without a layer, and imports of a higher layer or of a sibling area
    (``layers``: (layer, area, entries) rows, as test_import_graph.py's LAYERS)."""
    problems = [
        f"file {file} has no layer: add it to LAYERS"
        for file in graph.files
        if layer_of(file, layers) is None
    ]
    for file in graph.files:
        here = layer_of(file, layers)
        for edge in graph.internal(file):
            there = layer_of(edge.target, layers)
            if here is None or there is None or there[1] == here[1] or there[0] < here[0]:
                continue
            problems.append(
                f"{edge}: {here[1]} (layer {here[0]}) imports {edge.target}, "
                f"{there[1]} (layer {there[0]})"
            )
    return problems


def forbidden_imports(graph: ImportGraph, sources, targets) -> list[str]:
    """Imports from a file under one of ``sources`` of a file under one of ``targets``."""
    return [
        f"{edge} imports {edge.target}"
        for file in graph.files
        if any(_covers(s, file) for s in sources)
        for edge in graph.internal(file)
        if any(_covers(t, edge.target) for t in targets)
    ]
