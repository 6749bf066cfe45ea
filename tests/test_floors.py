"""The folders are the floors (docs/architecture.md): computed from the code, every import
between our folders runs down or stays on its floor, the folders make no circle, and no
module imports itself back through others (the two circles cut in issue 44:
``worker.encodings.base`` <-> ``rope``, ``worker.run`` <-> ``worker.hf.run``).

Every import counts here, one inside a function or a type-checking block included: a
circle of annotations is a circle a reader follows too. The check finds an import that
runs up, shown on a toy tree."""

from __future__ import annotations

import ast
from pathlib import Path

import tomllib

from lint.project import PACKAGES, ROOT


def floors() -> dict[str, int]:
    """Each folder's floor, from the floors contract (bottom 1); the folders that are not
    packages (benchmarks, studies, lint) stand with the top one."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    layers = next(c for c in config["contracts"] if c["id"] == "floors")["layers"]
    floor = {name.strip(): len(layers) - i for i, name in enumerate(layers)}
    return {name: floor.get(name, len(layers)) for name in PACKAGES}


def modules(root: Path, packages: list[str]) -> dict[str, Path]:
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imports(root: Path, packages: list[str]) -> dict[str, set[str]]:
    """Module -> the modules of ours it imports (any import statement, anywhere in it)."""
    known = modules(root, packages)

    def owner(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            targets |= {t for n in names if n.split(".")[0] in packages and (t := owner(n))}
        graph[name] = targets - {name}
    return graph


def upward(graph: dict[str, set[str]], floor: dict[str, int]) -> list[str]:
    return sorted(
        f"{source} -> {target}"
        for source, targets in graph.items()
        for target in targets
        if floor[target.split(".")[0]] > floor[source.split(".")[0]]
    )


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while (member := stack.pop()) != node:
                group.append(member)
            group.append(node)
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    folders: dict[str, set[str]] = {}
    for source, targets in graph.items():
        top = source.split(".")[0]
        folders.setdefault(top, set()).update(t.split(".")[0] for t in targets)
        folders[top].discard(top)
    return folders


def test_every_import_runs_down_the_floors_and_the_folders_make_no_circle() -> None:
    graph = imports(ROOT, PACKAGES)
    assert {"core", "db", "jobs", "worker", "cli", "dashboard"} <= set(PACKAGES)
    assert upward(graph, floors()) == []
    assert circles(folder_graph(graph)) == []


def test_no_module_imports_itself_back_through_others() -> None:
    """The specs' parts annotate the spec they are parts of (a mixin's ``self:
    StudySpec``, a check's ``spec: StudySpec``) under TYPE_CHECKING: one package's own
    typing, the only group allowed."""
    groups = circles(imports(ROOT, PACKAGES))
    assert groups == [["core.spec.cost", "core.spec.hf", "core.spec.study"]]


def test_the_check_finds_an_import_that_runs_up_and_a_circle(tmp_path: Path) -> None:
    files = {
        "low/__init__.py": "",
        "low/a.py": "def f():\n    from high.b import g\n",  # inside a function: counted
        "high/__init__.py": "",
        "high/b.py": "from low.a import f\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = imports(tmp_path, ["low", "high"])
    assert upward(graph, {"low": 1, "high": 2}) == ["low.a -> high.b"]
    assert circles(graph) == [["high.b", "low.a"]]
    assert circles(folder_graph(graph)) == [["high", "low"]]
