"""Synthetic retrieval tasks: the model must find something at a distance.

Every example is exactly ``length + 1`` bytes so that inputs have the evaluated
length; only the answer bytes are trained on and scored. Evaluation examples
come from a generator seeded by the task and the length alone, so every
encoding and seed is scored on the same examples.
"""

from __future__ import annotations

import string
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from core.catalog.tasks import assoc_recall_pairs
from core.metrics import Kind, headline
from worker.data.base import Batch, Task, from_sequences

FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)
QUESTION = "What is the pass key? The pass key is "
PASSKEY_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


def _eval_generator(task: str, length: int) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(f"{task}:{length}".encode()))


def _digits(count: int, generator: torch.Generator) -> str:
    return "".join(str(int(d)) for d in torch.randint(0, 10, (count,), generator=generator))


# One example: its sequence (bytes, or an hf: model's token ids), how many of its last
# tokens are the answer, and its group label; a task whose answer has several parts
# (RULER's multi-answer tasks: several needles' values, a chain's variables, the top
# words) adds a fourth element, the parts, so RULER's string_match_all and
# string_match_part score them apart. A part is a string, found in the answer's bytes
# after the part before it (what a byte-level task gives: a separator between parts
# belongs to none), or a (start, end) range of the answer's tokens (what an hf: model's
# rendering gives; two ranges share a token that carries bytes of both).
Example = tuple[Any, ...]
# What draws one example: (length, generator, group) -> Example.
ExampleMaker = Callable[[int, torch.Generator, Any], Example]


def parts_of(example: Example) -> tuple[Any, ...]:
    """The example's answer parts (empty: the answer is one)."""
    return tuple(example[3]) if len(example) > 3 and example[3] else ()


def part_spans(answer: Sequence[int], parts: Sequence[Any]) -> list[tuple[int, int]]:
    """Where each part lies in the ``answer`` (its bytes, or its token ids): a string is
    looked for in the bytes after the part before it; a range is taken as it is."""
    spans, start = [], 0
    for part in parts:
        if isinstance(part, str):
            data = part.encode()
            found = bytes(answer).find(data, start)
            if found < 0:
                raise ValueError(f"answer part {part!r} is not in the answer {bytes(answer)!r}")
            spans.append((found, found + len(data)))
        else:
            low, high = (int(end) for end in part)
            if not 0 <= low < high <= len(answer):
                raise ValueError(f"answer part {part!r} is outside the answer's {len(answer)}")
            spans.append((low, high))
        start = spans[-1][1]
    return spans


def part_mask(
    sequences: Tensor, answers: list[int], parts: Sequence[Sequence[Any]]
) -> Tensor | None:
    """``[B, T, P]``: whether target t of row b carries a byte of part p of its answer
    (``parts[b]``; a row without parts has its whole answer as part 0). None where no
    row has several parts: each answer is then one part, right when it all is."""
    if all(len(split) <= 1 for split in parts):
        return None
    width = sequences.shape[1] - 1
    mask = torch.zeros((len(answers), width, max(map(len, parts))), dtype=torch.bool)
    for row, (answer, split) in enumerate(zip(answers, parts, strict=True)):
        offset = width - answer
        tokens = sequences[row, -answer:].tolist()
        spans = part_spans(tokens, split) if split else [(0, answer)]
        for index, (start, end) in enumerate(spans):
            mask[row, offset + start : offset + end, index] = True
    return mask


def answer_batch(
    sequences: Tensor,
    answers: list[int],
    labels: list[str],
    parts: Sequence[Sequence[Any]] | None = None,
) -> Batch:
    """``[B, T+1]`` sequences whose last ``answers[i]`` tokens are row i's answer: inputs,
    targets, and only the answer's targets scored; with ``parts`` (row i's answer parts,
    as an example gives them) the targets each part covers."""
    inputs, targets = from_sequences(sequences)
    scored = torch.zeros_like(targets, dtype=torch.bool)
    for row, answer in enumerate(answers):
        scored[row, -answer:] = True
    mask = None if parts is None else part_mask(sequences, answers, parts)
    return Batch(inputs, targets, scored, labels, parts=mask)


class SyntheticTask(Task):
    """A task of examples that end in an answer scored by exact match. Its examples are
    drawn by ``example`` alone, so a model that reads tokens instead of bytes (an hf:
    model: ``worker.hf.answers``) is scored on the same examples, rendered in its tokens."""

    metric = headline(Kind.ANSWER).name

    def example(self, length: int, generator: torch.Generator, group: int | None) -> Example:
        """One sequence of ``length + 1`` bytes, the size of its answer, its group label
        and, where the answer has several parts, the parts (see ``Example``)."""
        raise NotImplementedError

    def groups(self) -> tuple[int | None, ...]:
        return (None,)

    def _batch(self, rows: list[Example]) -> Batch:
        sequences = torch.tensor([list(row[0]) for row in rows], dtype=torch.uint8)
        return answer_batch(
            sequences,
            [row[1] for row in rows],
            [row[2] for row in rows],
            [parts_of(row) for row in rows],
        )

    def train_batch(self, batch_size: int, length: int, generator: torch.Generator) -> Batch:
        # Training draws every free choice (a pass key's depth too) at random.
        return self._batch([self.example(length, generator, None) for _ in range(batch_size)])

    def eval_batches(
        self,
        length: int,
        *,
        protocol: str,
        batch_size: int,
        tokens: int,
        examples: int,
        stride: int | None = None,
        longest: int | None = None,
    ) -> Iterator[Batch]:
        rows = self.eval_examples(length, self.per_group(examples))
        for start in range(0, len(rows), batch_size):
            yield self._batch(rows[start : start + batch_size])

    def per_group(self, examples: int) -> int:
        """Examples of each group an evaluation of ``examples`` examples scores."""
        return max(1, examples // len(self.groups()))

    def eval_examples(
        self, length: int, per_group: int, make: ExampleMaker | None = None
    ) -> list[Example]:
        """``per_group`` examples of every group, in group order: by default drawn one
        after another from one generator seeded by the task and the length, each by
        ``make`` (by default ``example``; an hf: model's renders it in its tokens)."""
        make = make or self.example
        generator = _eval_generator(self.name, length)
        return [make(length, generator, g) for g in self.groups() for _ in range(per_group)]


class Passkey(SyntheticTask):
    """Filler sentences, "The pass key is NNNNN. Remember it. NNNNN is the pass key.",
    more filler, then "What is the pass key? The pass key is " and the digits."""

    name = "passkey"

    def __init__(self, digits: int = 5) -> None:
        self.digits = digits

    def groups(self) -> tuple[float | None, ...]:
        return PASSKEY_DEPTHS

    def example(
        self, length: int, generator: torch.Generator, group: float | None
    ) -> tuple[bytes, int, str]:
        key = _digits(self.digits, generator)
        needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
        filler_bytes = length + 1 - len(needle) - len(QUESTION) - self.digits
        if filler_bytes < 0:
            raise ValueError(f"passkey needs sequences of at least {length - filler_bytes} bytes")
        depth = float(torch.rand((), generator=generator)) if group is None else group
        filler = (FILLER * (filler_bytes // len(FILLER) + 1))[:filler_bytes]
        # Insert at the sentence boundary nearest below the requested depth.
        cut = round(depth * filler_bytes)
        if 0 < cut < filler_bytes:
            boundary = filler.rfind(". ", 0, cut + 1)
            cut = 0 if boundary < 0 else boundary + 2
        text = filler[:cut] + needle + filler[cut:] + QUESTION + key
        return text.encode(), self.digits, f"depth={depth:g}" if group is not None else ""


class Copy(SyntheticTask):
    """A random string, a separator, then the same string again."""

    name = "copy"

    def __init__(self, alphabet: int = 26) -> None:
        symbols = string.ascii_lowercase + string.ascii_uppercase + string.digits + "+/"
        self.symbols = symbols[:alphabet]

    def example(
        self, length: int, generator: torch.Generator, group: int | None
    ) -> tuple[bytes, int, str]:
        half = length // 2
        picks = torch.randint(0, len(self.symbols), (half,), generator=generator)
        source = "".join(self.symbols[int(i)] for i in picks)
        pad = " " * (length + 1 - (2 * half + 1))
        return (pad + source + "|" + source).encode(), half, ""


# Up to this many keys (key_length <= 4), a permutation of them all is drawn, as
# before; beyond it, that permutation would not fit in memory (26^8 keys).
PERMUTED_KEY_SPACE = 1 << 20


def distinct_codes(space: int, count: int, generator: torch.Generator) -> list[int]:
    """``count`` distinct integers of [0, space), in random order."""
    if space <= PERMUTED_KEY_SPACE:
        return [int(code) for code in torch.randperm(space, generator=generator)[:count]]
    codes: dict[int, None] = {}
    while len(codes) < count:
        for code in torch.randint(0, space, (2 * (count - len(codes)),), generator=generator):
            codes.setdefault(int(code))
            if len(codes) == count:
                break
    return list(codes)


class AssociativeRecall(SyntheticTask):
    """``key=vv;`` pairs with distinct keys, then ``?key=`` and the key's two-digit value."""

    name = "assoc_recall"

    def __init__(self, key_length: int = 3) -> None:
        self.key_length = key_length

    def _key(self, code: int) -> str:
        letters = (string.ascii_lowercase[(code // 26**i) % 26] for i in range(self.key_length))
        return "".join(letters)

    def example(
        self, length: int, generator: torch.Generator, group: int | None
    ) -> tuple[bytes, int, str]:
        pair = self.key_length + 4  # key, '=', two digits, ';'
        query = self.key_length + 4  # '?', key, '=', two digits
        count = assoc_recall_pairs(self.key_length, length)
        space = 26**self.key_length
        if count < 1:
            raise ValueError(f"assoc_recall needs sequences of at least {pair + query} bytes")
        if count > space:
            raise ValueError(
                f"assoc_recall with key_length={self.key_length} has only {space} distinct keys; "
                f"length {length} needs {count}"
            )
        keys = [self._key(code) for code in distinct_codes(space, count, generator)]
        values = [_digits(2, generator) for _ in keys]
        asked = int(torch.randint(0, count, (1,), generator=generator))
        body = "".join(f"{k}={v};" for k, v in zip(keys, values, strict=True))
        pad = " " * (length + 1 - len(body) - query)
        return (pad + body + f"?{keys[asked]}={values[asked]}").encode(), 2, ""
