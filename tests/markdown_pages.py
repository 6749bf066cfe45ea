"""Reading the Markdown of README.md and docs/: code blocks, headings and their anchors,
sections, tables, and the commands of a shell block (for tests/test_docs.py)."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Block:
    """A fenced code block: its page, the line of its opening fence, its language."""

    page: Path
    line: int
    lang: str
    text: str

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def fenced_blocks(page: Path) -> list[Block]:
    found, lang, start, body = [], None, 0, []
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if lang is None and line.startswith("```"):
            lang, start, body = line[3:].strip().split(" ")[0].lower(), number, []
        elif lang is not None and line.strip() == "```":
            found.append(Block(page, start, lang, "\n".join(body) + "\n"))
            lang = None
        elif lang is not None:
            body.append(line)
    assert lang is None, f"{page.relative_to(ROOT)}:{start}: a code block is never closed"
    return found


def prose_lines(page: Path) -> list[tuple[int, str]]:
    """The page's lines outside code blocks, inline code removed."""
    out, fenced = [], False
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            out.append((number, re.sub(r"`[^`]*`", "", line)))
    return out


def headings(page: Path) -> list[tuple[int, str]]:
    """(level, text) of every heading outside code blocks."""
    found, fenced = [], False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (match := re.match(r"(#{1,6}) (.*)", line)):
            found.append((len(match[1]), match[2].strip()))
    return found


def anchors(page: Path) -> set[str]:
    """GitHub's anchors for the page's headings: lower case, punctuation dropped,
    spaces to hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    out = set()
    for _, text in headings(page):
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        out.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return out


def section(page: Path, title: str) -> str:
    """The text under the one heading that contains ``title``, up to the next heading."""
    text = page.read_text()
    starts = [m for m in re.finditer(r"^#{1,6} .*$", text, re.M) if title in m[0]]
    assert len(starts) == 1, f"{page.relative_to(ROOT)}: one heading must name {title}"
    rest = text[starts[0].end() :]
    following = re.search(r"^#{1,6} ", rest, re.M)
    return rest[: following.start()] if following else rest


def table_rows(text: str) -> list[dict[str, str]]:
    """The first Markdown table in ``text``: one dict per row, keyed by the header."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    assert len(lines) >= 2, "no table found"

    def cells(line: str) -> list[str]:
        return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]

    header = cells(lines[0])
    return [dict(zip(header, cells(line), strict=True)) for line in lines[2:]]


def ticked(cell: str) -> str:
    """The first `backticked` name in a cell."""
    match = re.search(r"`([^`]+)`", cell)
    assert match, f"no `name` in {cell!r}"
    return match[1]


def shell_commands(block: Block) -> list[list[str]]:
    """Each simple command of a shell block, as argv: comments, redirections and leading
    environment assignments dropped, pipelines and lists split into their commands."""
    lines = block.text.splitlines()
    if block.lang == "console":
        lines = [line[2:] for line in lines if line.startswith("$ ")]
    commands = []
    for line in "\n".join(lines).replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        argv: list[str] = []
        redirected = False
        for token in [*lexer, ";"]:
            if token and set(token) <= set("();<>|&"):
                redirected = token in (">", ">>", "<")
                if not redirected:  # a pipe or a list operator ends a command
                    commands.append(argv)
                    argv = []
            elif redirected:  # the file name a redirection names
                redirected = False
            else:
                argv.append(token)
    for argv in commands:
        while argv and re.match(r"\w+=", argv[0]):
            argv.pop(0)
    return [argv for argv in commands if argv]
