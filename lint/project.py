"""The project's own code, for the checks that read it: its root and its folders of Python
(every one, so that a folder moved or added is checked without a word anywhere)."""

from __future__ import annotations

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
