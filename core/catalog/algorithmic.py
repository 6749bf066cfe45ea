"""The algorithmic length-generalisation tasks (after Delétang et al. 2023, Ruoss et al.
2023 and Zhou et al. 2023): their formats and problem sizes, free of torch, and their
catalogue entries. The implementations (``worker.data.algorithmic``) write their
examples with these helpers, so the sizes the catalogue promises are the sizes built.

A task's sequence length L is its byte length: the problem at L is the largest that
fits in ``L + 1`` bytes (the bytes left over are spaces before it, as ``copy`` pads), so
training with ``train.min_length`` below ``train.length`` covers a range of problem
sizes and each evaluated length is a bucket of one problem size.
"""

from __future__ import annotations

import string

from core.catalog.params import Param
from core.catalog.task_entry import TaskInfo
from core.metrics import Kind

# The symbols of reverse, duplicate and sort (those of copy): the first ``alphabet`` ones.
SYMBOLS = string.ascii_lowercase + string.ascii_uppercase + string.digits + "+/"
# Between a string and what the task makes of it (reverse, duplicate, sort).
ARROW = "|"
# Between a bit string and its parity, and between a sum and its result.
EQUALS = "="
PLUS = "+"
# Index hints (Zhou et al. 2023): the hint of the digit of significance s (10^s) is
# HINTS[(offset + s) % len(HINTS)], the offset drawn per example.
HINTS = string.ascii_lowercase + string.ascii_uppercase
# An evaluation length's operand lengths: GRID x GRID cells, the operands of cell (a, b)
# ceil(a * n / GRID) and ceil(b * n / GRID) digits long, n the longest that fits.
GRID = 4
ADDITION_CELLS = tuple((a, b) for a in range(1, GRID + 1) for b in range(1, GRID + 1))


def addition_digits(length: int, index_hints: bool) -> int:
    """The longest operands (both n digits) whose sum fits in ``length + 1`` bytes: two
    operands, their result of n + 1 digits, ``+`` and ``=`` (each digit preceded by its
    hint with ``index_hints``)."""
    width = 2 if index_hints else 1
    return (length + 1 - 2 - width) // (3 * width)


def cell_digits(cell: int, largest: int) -> int:
    """The operand length of grid step ``cell`` (1..GRID) when ``largest`` digits fit."""
    return max(1, -(-cell * largest // GRID))


def parity_bits(length: int) -> int:
    """Bits of a parity example: the bits, ``=`` and the parity bit."""
    return length - 1


def source_symbols(task: str, length: int) -> int:
    """Symbols of the string w of reverse, sort (w | w') or duplicate (w | ww)."""
    return length // 3 if task == "duplicate" else length // 2


def _alphabet(default: int) -> Param:
    return Param(
        "alphabet", int, default, "distinct symbols in the string (letters, digits, +, /)", 2, 64
    )


def _addition_params() -> tuple[Param, ...]:
    return (
        Param("reverse", bool, False, "operands and result written least significant digit first"),
        Param(
            "index_hints",
            bool,
            False,
            "a letter before each digit naming its significance (Zhou et al. 2023)",
        ),
    )


DELETANG = "Delétang et al. 2023, Neural Networks and the Chomsky Hierarchy (arXiv:2207.02098)"
RUOSS = "Ruoss et al. 2023, Randomized Positional Encodings (arXiv:2305.16843)"
ZHOU = "Zhou et al. 2023, What Algorithms can Transformers Learn? (arXiv:2310.16028)"

ALGORITHMIC: tuple[TaskInfo, ...] = (
    TaskInfo(
        name="addition",
        kind=Kind.ANSWER,
        summary="Decimal addition of an i-digit and a j-digit number; the sum zero-padded to "
        "max(i, j) + 1 digits. Evaluated on a 4 x 4 grid of operand lengths (groups i, j).",
        reference=f"{ZHOU}; Lee et al. 2023, Teaching Arithmetic to Small Transformers",
        implementation="worker.data.algorithmic:Addition",
        # Two-digit operands with index hints (6 * 2 + 4 bytes); four without.
        min_length=16,
        params=_addition_params(),
        text=True,
    ),
    TaskInfo(
        name="binary_addition",
        kind=Kind.ANSWER,
        summary="Addition of an i-bit and a j-bit binary number, as addition (grid groups i, j).",
        reference=f"{DELETANG}; {RUOSS}",
        implementation="worker.data.algorithmic:BinaryAddition",
        min_length=16,
        params=_addition_params(),
        text=True,
    ),
    TaskInfo(
        name="parity",
        kind=Kind.ANSWER,
        summary="A bit string, then its parity (1 when it holds an odd number of ones).",
        reference=f"{DELETANG}; {RUOSS}",
        implementation="worker.data.algorithmic:Parity",
        min_length=4,
        text=True,
    ),
    TaskInfo(
        name="reverse",
        kind=Kind.ANSWER,
        summary="A random string, a separator, then the string reversed.",
        reference=f"{DELETANG}; {RUOSS}",
        implementation="worker.data.algorithmic:Reverse",
        min_length=8,
        params=(_alphabet(26),),
        text=True,
    ),
    TaskInfo(
        name="duplicate",
        kind=Kind.ANSWER,
        summary="A random string w, a separator, then ww.",
        reference=f"{DELETANG}; {RUOSS}",
        implementation="worker.data.algorithmic:Duplicate",
        min_length=8,
        params=(_alphabet(26),),
        text=True,
    ),
    TaskInfo(
        name="sort",
        kind=Kind.ANSWER,
        summary="A random string, a separator, then its symbols sorted by byte value.",
        reference=f"{DELETANG}; {RUOSS}",
        implementation="worker.data.algorithmic:Sort",
        min_length=8,
        params=(_alphabet(10),),
        text=True,
    ),
)
