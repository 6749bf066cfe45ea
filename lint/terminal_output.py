"""`make lint`'s check that no terminal output reads user text as markup.

posbench prints through ``core.terminal`` only: consoles and progress bars with
markup and emoji codes off. This check refuses, in the project's own code, whatever
would bring markup back:

- a Rich ``Console``, ``Progress``, ``TextColumn``, ``Live`` or ``Status`` built outside
  ``core/terminal.py``;
- ``markup=True`` or ``emoji=True`` given to anything;
- Rich's markup readers: ``rich.print``, ``rich.markup``, ``Text.from_markup``;
- in the vocabulary's, the database's, the queue's and the command line's code
  (``core/``, ``db/``, ``jobs/``, ``cli/``), any other way to
  the terminal: ``print``, ``typer.echo`` / ``click.echo``, ``sys.stdout.write`` and
  ``sys.stderr.write``; ``core.terminal.echo`` writes a line with its control
  characters shown.

Run: ``python -m lint.terminal_output [PATH ...]`` (default: the project's packages);
it prints one line per finding and exits 1 when there is any.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

from lint.project import PACKAGES, ROOT, python_files, report

THE_LAYER = ROOT / "core" / "terminal.py"
BUILT_THERE_ONLY = {"Console", "Progress", "TextColumn", "Live", "Status"}
# Where printing goes through the layer only, and the writers it replaces.
ECHO_THROUGH_THE_LAYER = [ROOT / "core", ROOT / "db", ROOT / "jobs", ROOT / "cli"]
RAW_WRITERS = {("typer", "echo"), ("click", "echo"), ("stdout", "write"), ("stderr", "write")}
MARKUP_READERS = {"from_markup", "render_markup"}


def _called_name(node: ast.Call) -> str | None:
    function = node.func
    if isinstance(function, ast.Name):
        return function.id
    if isinstance(function, ast.Attribute):
        return function.attr
    return None


def _raw_writer(node: ast.Call) -> str | None:
    """``print``, ``typer.echo``, ``sys.stdout.write`` and the like, by name; else None."""
    function = node.func
    if isinstance(function, ast.Name) and function.id == "print":
        return "print"
    if isinstance(function, ast.Attribute):
        owner = function.value
        owner_name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
        if (owner_name, function.attr) in RAW_WRITERS:
            return f"{owner_name}.{function.attr}"
    return None


def _echoes_through_the_layer(path: Path) -> bool:
    resolved = path.resolve()
    return resolved != THE_LAYER and any(resolved.is_relative_to(r) for r in ECHO_THROUGH_THE_LAYER)


def findings(path: Path) -> Iterator[str]:
    """What in ``path`` could print user text as markup, one line each."""
    tree = ast.parse(path.read_text(), filename=str(path))
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    for node in ast.walk(tree):
        line = f"{where}:{getattr(node, 'lineno', 0)}"
        writer = _raw_writer(node) if isinstance(node, ast.Call) else None
        if writer and _echoes_through_the_layer(path):
            yield f"{line}: {writer}(...) writes to the terminal outside core.terminal"
        if isinstance(node, ast.Call):
            name = _called_name(node)
            if name in BUILT_THERE_ONLY and path.resolve() != THE_LAYER:
                yield f"{line}: {name}(...) built outside core/terminal.py"
            if name in MARKUP_READERS:
                yield f"{line}: {name}(...) reads markup"
            for keyword in node.keywords:
                off = isinstance(keyword.value, ast.Constant) and keyword.value.value is False
                if keyword.arg in ("markup", "emoji") and not off:
                    yield f"{line}: {keyword.arg}= other than False"
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = {alias.name for alias in node.names}
            if node.module == "rich" and "print" in names:
                yield f"{line}: rich's print reads markup"
            if node.module == "rich.markup" or (node.module == "rich" and "markup" in names):
                yield f"{line}: rich.markup"
        elif (
            isinstance(node, ast.Attribute)
            and node.attr == "print"
            and isinstance(node.value, ast.Name)
            and node.value.id == "rich"
        ):
            yield f"{line}: rich.print reads markup"


def sources(arguments: list[str]) -> list[Path]:
    return python_files(arguments, [ROOT / package for package in PACKAGES])


def main(arguments: list[str]) -> int:
    return report(findings, sources(arguments))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
