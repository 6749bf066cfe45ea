"""`make lint`'s check that every fragment of the dashboard is a guarded one.

A Streamlit fragment reruns alone, without the page around it and so without the
login's gate; ``dashboard.auth.fragment`` checks the session before each of its runs
(the fourth audit's G4). This check refuses, in ``dashboard/``, any other way to a
fragment: ``st.fragment`` / ``streamlit.fragment`` (called, used as a decorator or
passed around) and ``from streamlit import fragment``, outside that one function's
module, ``dashboard/auth.py``.

Run: ``python -m lint.fragments [PATH ...]`` (default: ``dashboard/``); it prints one
line per finding and exits 1 when there is any.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

from lint.project import ROOT, python_files, report

THE_GUARD = ROOT / "dashboard" / "auth.py"
FRAGMENTS = {"fragment", "experimental_fragment"}
STREAMLIT = {"st", "streamlit"}


def findings(path: Path) -> Iterator[str]:
    """Every bare Streamlit fragment in ``path``, one line each."""
    if path.resolve() == THE_GUARD:
        return
    tree = ast.parse(path.read_text(), filename=str(path))
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    for node in ast.walk(tree):
        line = f"{where}:{getattr(node, 'lineno', 0)}"
        if (
            isinstance(node, ast.Attribute)
            and node.attr in FRAGMENTS
            and isinstance(node.value, ast.Name)
            and node.value.id in STREAMLIT
        ):
            bare = f"{node.value.id}.{node.attr}"
            yield f"{line}: {bare} without the login's check: use dashboard.auth.fragment"
        elif isinstance(node, ast.ImportFrom) and node.module == "streamlit":
            for alias in node.names:
                if alias.name in FRAGMENTS:
                    yield f"{line}: streamlit's {alias.name} imported: use dashboard.auth.fragment"


def sources(arguments: list[str]) -> list[Path]:
    return python_files(arguments, [ROOT / "dashboard"])


def main(arguments: list[str]) -> int:
    return report(findings, sources(arguments))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
