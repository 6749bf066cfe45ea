"""The one way posbench prints to a terminal: consoles and progress bars that never read
what they print as Rich markup or emoji codes.

A study's name, a label, a failure reason, a path or a URL is printed exactly as it is,
whatever it holds (``oops [/] x``, ``[link=file:///etc]b[/link]``, ``:warning:``), in a
line, a table's cells and title, or a progress bar. Style comes from the code, never
from the text: ``console.print(line, style="bold")``, or ``styled(("error:", "bold red"),
" ", message)`` for a line whose parts differ. `make lint` (``lint/terminal_output.py``)
refuses a Console, a progress bar or markup built anywhere else, and any other way of
writing to the terminal (``print``, ``typer.echo``, ``sys.stdout.write``) in the command
line's code.

Nor does a terminal ever receive a control character it did not write itself: ESC (colour,
screen clearing, OSC titles and hyperlinks), carriage returns and every other C0 or C1
control but newline and tab, and the Unicode bidi controls that reorder a line, become a
visible character of the same width in whatever is printed (``visible``): a stored name
holding ``ESC[2J`` shows as ``␛[2J``. The consoles' own styles and cursor movements pass;
what they print does not.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.segment import Segment
from rich.text import Text

# C0 controls but tab and newline, DEL, C1 controls, and the bidi controls (LRM, RLM, ALM,
# the embeddings, overrides and isolates).
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
REPLACEMENT = "\ufffd"


def _picture(match: re.Match[str]) -> str:
    code = ord(match.group())
    if code < 0x20:
        return chr(0x2400 + code)  # the control pictures: ␛ for ESC, ␍ for CR
    return "\u2421" if code == 0x7F else REPLACEMENT


def visible(text: str) -> str:
    """``text`` with every control character but newline and tab shown as one visible
    character in its place (the Unicode control pictures for C0 and DEL, U+FFFD for C1
    and the bidi controls): the same length, so styled spans still line up."""
    return _CONTROL.sub(_picture, text)


class _Console(Console):
    """Rich's console, showing the control characters of what it prints (every table cell,
    title, progress label and line), not sending them; its own control segments (cursor
    movement) and the styles it adds stay as they are."""

    def _render_buffer(self, buffer: Iterable[Segment]) -> str:
        return super()._render_buffer(
            Segment(visible(segment.text), segment.style, segment.control)
            if not segment.control
            else segment
            for segment in buffer
        )


def console(*, stderr: bool = False) -> Console:
    """A console with markup and emoji codes off: every string it prints is literal, its
    control characters shown."""
    return _Console(stderr=stderr, markup=False, emoji=False)


def echo(text: str, *, err: bool = False, end: str = "\n") -> None:
    """``text`` written as it is to stdout (or stderr), its control characters shown: the
    way to print a line, a JSON document or a CSV table without a console."""
    stream = sys.stderr if err else sys.stdout
    stream.write(visible(text) + end)
    stream.flush()


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
        echo(f"note: {line}", err=True)
