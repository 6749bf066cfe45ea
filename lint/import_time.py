"""An import-linter contract: some modules must not load a package *when imported*.

The stock ``forbidden`` contract counts every import statement, including those inside
functions, which run only when called. posbench's rule is narrower and is the one that
matters for start-up: importing the CLI, the dashboard, the database layer or the
catalogue must not load torch (seconds of start-up and hundreds of MB), while a command
that trains may import the engine inside its function. This contract keeps the import
graph's edges that execute at import time - module-level statements, class bodies,
``try`` / ``if`` blocks at module level, but not function bodies nor ``if TYPE_CHECKING``
blocks - adds the implicit edge from a module to its parent package (importing
``a.b.c`` runs ``a/__init__.py`` and ``a/b/__init__.py``), and looks for a chain from a
source module to a forbidden one.
"""

from __future__ import annotations

import ast
import importlib.util
import itertools
from collections import deque
from functools import cache
from pathlib import Path

from grimp import ImportGraph
from importlinter import Contract, ContractCheck, fields, output


@cache
def _root_folder(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _source_file(module: str) -> Path | None:
    root, *rest = module.split(".")
    folder = _root_folder(root)
    if folder is None:
        return None
    base = folder.joinpath(*rest)
    for candidate in (base / "__init__.py", base.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


@cache
def import_time_lines(module: str) -> frozenset[int]:
    """The line numbers of the import statements that run when ``module`` is imported."""
    path = _source_file(module)
    if path is None:
        return frozenset()
    lines: set[int] = set()
    pending: list[ast.AST] = [ast.parse(path.read_text(encoding="utf-8"))]
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            lines.add(node.lineno)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue  # runs when called, not when imported
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            pending.extend(node.orelse)
            continue
        pending.extend(ast.iter_child_nodes(node))
    return frozenset(lines)


def _import_time_edges(graph: ImportGraph, module: str) -> set[str]:
    """The modules that importing ``module`` imports in turn (its parent package too)."""
    targets = set()
    if "." in module:
        targets.add(module.rsplit(".", 1)[0])
    lines = import_time_lines(module)
    for imported in graph.find_modules_directly_imported_by(module):
        details = graph.get_import_details(importer=module, imported=imported)
        if any(detail["line_number"] in lines for detail in details):
            targets.add(imported)
    return targets


def _in(module: str, packages: list[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


class ImportTimeContract(Contract):
    """``source_modules`` (and their descendants) must not load ``forbidden_modules``
    (and their descendants) when imported."""

    source_modules = fields.ListField(subfield=fields.ModuleField())
    forbidden_modules = fields.ListField(subfield=fields.ModuleField())

    def check(self, graph: ImportGraph, verbose: bool) -> ContractCheck:
        forbidden = [m.name for m in self.forbidden_modules]
        sources = sorted(
            {
                name
                for source in self.source_modules
                for name in (source.name, *graph.find_descendants(source.name))
            }
        )
        chains = [chain for source in sources if (chain := self._chain(graph, source, forbidden))]
        return ContractCheck(kept=not chains, metadata={"chains": chains})

    def _chain(self, graph: ImportGraph, source: str, forbidden: list[str]) -> list[str] | None:
        """The shortest import-time chain from ``source`` to a forbidden module, or None."""
        came_from: dict[str, str | None] = {source: None}
        queue = deque([source])
        while queue:
            module = queue.popleft()
            if _in(module, forbidden):
                chain = [module]
                while (step := came_from[chain[-1]]) is not None:
                    chain.append(step)
                return chain[::-1]
            for target in sorted(_import_time_edges(graph, module)):
                if target not in came_from and target in graph.modules:
                    came_from[target] = module
                    queue.append(target)
        return None

    def render_broken_contract(self, check: ContractCheck) -> None:
        for chain in check.metadata["chains"]:
            output.print_error(f"{chain[0]} loads {chain[-1]} when imported:")
            output.new_line()
            for importer, imported in itertools.pairwise(chain):
                output.indent_cursor()
                output.print_error(f"{importer} -> {imported}", bold=False)
            output.new_line()
