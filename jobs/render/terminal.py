"""The one way posbench prints to a terminal: consoles and progress bars that never read
what they print as Rich markup or emoji codes.

A study's name, a label, a failure reason, a path or a URL is printed exactly as it is,
whatever it holds (``oops [/] x``, ``[link=file:///etc]b[/link]``, ``:warning:``), in a
line, a table's cells and title, or a progress bar. Style comes from the code, never
from the text: ``console.print(line, style="bold")``, or ``styled(("error:", "bold red"),
" ", message)`` for a line whose parts differ. `make lint` (``lint/terminal_output.py``)
refuses a Console, a progress bar or markup built anywhere else.
"""

from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text


def console(*, stderr: bool = False) -> Console:
    """A console with markup and emoji codes off: every string it prints is literal."""
    return Console(stderr=stderr, markup=False, emoji=False)


def styled(*parts: str | tuple[str, str]) -> Text:
    """One line of ``parts``: a plain string, or ``(string, style)``; never parsed."""
    return Text.assemble(*parts)


def run_progress(out: Console, label_width: int) -> Progress:
    """One bar per run: its label, steps done of all, a status, the time so far (the
    label and the status are shown as written)."""
    return Progress(
        TextColumn(f"{{task.description:<{label_width}}}", markup=False),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}", markup=False),
        TimeElapsedColumn(),
        console=out,
    )


def notes(lines: list[str]) -> None:
    """A spec's notes (``StudySpec.notes``) on stderr, one plain line each. Printed once
    every check has passed: a spec that is refused shows its refusal alone."""
    for line in lines:
        sys.stderr.write(f"note: {line}\n")
    sys.stderr.flush()
