"""The project's own code, for the checks that read it: its root and its folders of Python
(every one, so that a folder moved or added is checked without a word anywhere)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(
    path.name
    for path in ROOT.iterdir()
    if path.is_dir()
    and not path.name.startswith(".")
    and path.name not in {"tests", "docs"}
    and any(path.glob("*.py"))
)


def python_files(arguments: list[str], default: list[Path]) -> list[Path]:
    """The Python files a check reads: the files and folders named, or ``default``."""
    files: list[Path] = []
    for root in [Path(a) for a in arguments] or default:
        files += [root] if root.is_file() else sorted(root.rglob("*.py"))
    return files


def report(findings: Callable[[Path], Iterable[str]], files: list[Path]) -> int:
    """Print every finding of ``findings`` in ``files``: exit status 1 when there is one."""
    found = [finding for path in files for finding in findings(path)]
    for finding in found:
        print(finding)
    return 1 if found else 0
