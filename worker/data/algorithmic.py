"""The algorithmic length-generalisation tasks: arithmetic and string transductions
whose problem size grows with the sequence length (``core.catalog.algorithmic`` holds
their formats and sizes).

- ``addition`` / ``binary_addition``: ``a+b=`` then the sum, zero-padded to one digit more
  than the longer operand, optionally least significant digit first (``reverse``) and
  with a letter before each digit naming its significance (``index_hints``).
- ``parity``: a bit string, ``=``, then its parity bit.
- ``reverse``, ``duplicate``, ``sort``: a string, ``|``, then the string reversed, twice,
  or sorted by byte value.

Every example is the largest problem that fits in ``length + 1`` bytes, padded on the
left with spaces; the answer is the output bytes alone.
"""

from __future__ import annotations

import torch

from core.catalog.algorithmic import (
    ADDITION_CELLS,
    ARROW,
    EQUALS,
    HINTS,
    PLUS,
    SYMBOLS,
    addition_digits,
    cell_digits,
    parity_bits,
    source_symbols,
)
from worker.data.synthetic import SyntheticTask

DIGITS = "0123456789"


def padded(text: str, answer: str, length: int) -> tuple[bytes, int]:
    """``text`` then ``answer``, spaces before them to ``length + 1`` bytes, and the
    answer's size."""
    whole = text + answer
    if len(whole) > length + 1:
        raise ValueError(f"an example of {len(whole)} bytes does not fit in length {length}")
    return (" " * (length + 1 - len(whole)) + whole).encode(), len(answer)


def _draw(count: int, low: int, high: int, generator: torch.Generator) -> list[int]:
    return torch.randint(low, high, (count,), generator=generator).tolist()


class Addition(SyntheticTask):
    """``a+b=`` then ``a + b``. In evaluation, the operand lengths of each group's cell of
    the grid (``core.catalog.algorithmic.GRID``), labelled ``i=<i> j=<j>``; in training,
    each drawn uniformly from 1 to the longest that fits."""

    name = "addition"
    base = 10

    def __init__(self, reverse: bool = False, index_hints: bool = False) -> None:
        self.reverse = reverse
        self.index_hints = index_hints

    def groups(self) -> tuple[tuple[int, int], ...]:
        return ADDITION_CELLS

    def _operand(self, digits: int, generator: torch.Generator) -> int:
        """A number of exactly ``digits`` digits (0 is the one-digit numbers' too)."""
        lead = _draw(1, 1 if digits > 1 else 0, self.base, generator)
        rest = _draw(digits - 1, 0, self.base, generator)
        value = 0
        for digit in lead + rest:
            value = value * self.base + digit
        return value

    def write(self, value: int, digits: int, offset: int) -> str:
        """``value`` in ``digits`` digits (zeros before it), hinted and ordered as set."""
        low_first = []
        for _ in range(digits):
            value, digit = divmod(value, self.base)
            low_first.append(DIGITS[digit])
        if self.index_hints:
            low_first = [HINTS[(offset + s) % len(HINTS)] + d for s, d in enumerate(low_first)]
        return "".join(low_first if self.reverse else reversed(low_first))

    def example(
        self, length: int, generator: torch.Generator, group: tuple[int, int] | None
    ) -> tuple[bytes, int, str]:
        largest = addition_digits(length, self.index_hints)
        if largest < 1:
            shortest = 9 if self.index_hints else 5  # one digit each
            raise ValueError(f"{self.name} needs sequences of at least {shortest} bytes")
        if group is None:
            i, j = _draw(2, 1, largest + 1, generator)
        else:
            i, j = cell_digits(group[0], largest), cell_digits(group[1], largest)
        a, b = self._operand(i, generator), self._operand(j, generator)
        offset = _draw(1, 0, len(HINTS), generator)[0] if self.index_hints else 0
        prompt = self.write(a, i, offset) + PLUS + self.write(b, j, offset) + EQUALS
        sequence, size = padded(prompt, self.write(a + b, max(i, j) + 1, offset), length)
        return sequence, size, "" if group is None else f"i={i} j={j}"


class BinaryAddition(Addition):
    """Addition in base 2."""

    name = "binary_addition"
    base = 2


class Parity(SyntheticTask):
    """Bits, ``=``, then 1 if an odd number of them are 1, else 0."""

    name = "parity"

    def example(
        self, length: int, generator: torch.Generator, group: int | None
    ) -> tuple[bytes, int, str]:
        bits = _draw(parity_bits(length), 0, 2, generator)
        if not bits:
            raise ValueError("parity needs sequences of at least 2 bytes")
        text = "".join(map(str, bits)) + EQUALS
        sequence, size = padded(text, str(sum(bits) % 2), length)
        return sequence, size, ""


class StringTransduction(SyntheticTask):
    """A random string of the first ``alphabet`` symbols, ``|``, then ``transform`` of it."""

    def __init__(self, alphabet: int = 26) -> None:
        self.symbols = SYMBOLS[:alphabet]

    def transform(self, source: str) -> str:
        raise NotImplementedError

    def example(
        self, length: int, generator: torch.Generator, group: int | None
    ) -> tuple[bytes, int, str]:
        count = source_symbols(self.name, length)
        if count < 1:
            raise ValueError(f"{self.name} needs longer sequences than {length} bytes")
        source = "".join(self.symbols[i] for i in _draw(count, 0, len(self.symbols), generator))
        sequence, size = padded(source + ARROW, self.transform(source), length)
        return sequence, size, ""


class Reverse(StringTransduction):
    name = "reverse"

    def transform(self, source: str) -> str:
        return source[::-1]


class Duplicate(StringTransduction):
    name = "duplicate"

    def transform(self, source: str) -> str:
        return source + source


class Sort(StringTransduction):
    name = "sort"

    def transform(self, source: str) -> str:
        return "".join(sorted(source))
