"""Write the planted-key corpus of the key-token study (issue 21) as a folder of text
documents, for a ``text:`` corpus.

Each document is natural text (lines of the interpreter's own standard library, a
random place of it per document) with a random 16-character key planted at its start
and planted again after at least ``3 x train_length`` bytes of text:

    KEY: <16 characters>
    <text: 3 x train_length to 3.5 x train_length bytes, whole lines>
    KEY: <the same 16 characters>
    <text: at least 1.5 x train_length bytes more>

A model trained on windows of ``train_length`` bytes never sees the two copies in one
window; evaluated at 4x, the second copy is predictable from the first. The copy
finder (``eval.key_tokens.finder: repeats``) marks it as key tokens.

    python studies/planted_keys.py OUT_FOLDER [--documents 1200] [--train-length 128] [--seed 0]
"""

from __future__ import annotations

import argparse
import random
import string
import sysconfig
from pathlib import Path

MARKER = "KEY: "
ALPHABET = string.ascii_letters + string.digits


def stdlib_lines() -> list[str]:
    """Every line of the standard library's sources, in a fixed order, ASCII only."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    lines = []
    for path in paths:
        text = path.read_bytes().decode("utf-8", errors="replace")
        lines += [line + "\n" for line in text.splitlines() if line.strip() and line.isascii()]
    return lines


def text_run(lines: list[str], at: int, least: int, most: int) -> str:
    """Whole lines from ``at`` on, at least ``least`` bytes, cut at ``most``."""
    out, size = [], 0
    while size < least:
        line = lines[at % len(lines)]
        out.append(line)
        size += len(line)
        at += 1
    return "".join(out)[:most]


def document(lines: list[str], rng: random.Random, train_length: int) -> str:
    key = "".join(rng.choice(ALPHABET) for _ in range(16))
    gap = text_run(lines, rng.randrange(len(lines)), 3 * train_length, 7 * train_length // 2)
    tail = text_run(lines, rng.randrange(len(lines)), 3 * train_length // 2, 2 * train_length)
    return f"{MARKER}{key}\n{gap}{MARKER}{key}\n{tail}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--documents", type=int, default=1200)
    parser.add_argument("--train-length", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    lines = stdlib_lines()
    args.out.mkdir(parents=True, exist_ok=True)
    for i in range(args.documents):
        (args.out / f"doc{i:05d}.txt").write_text(document(lines, rng, args.train_length))


if __name__ == "__main__":
    main()
