"""What a model sees: a synthetic task's examples as text (``posbench tasks sample``).

Every sample comes from the task's own ``example`` (through ``eval_examples`` for the
evaluation's examples), so what is shown is what is trained on and scored - the
task's definition stays in one place:

- **prompt**: the example's bytes before its answer, decoded as UTF-8;
- **answers**: the answer bytes (the last ``answer`` bytes of the example, the bytes
  evaluation scores by exact match), decoded. A task whose answer has several parts
  says so with a fourth element of its example: the parts as strings, or their sizes
  in bytes (consecutive, summing to the answer's size); without it the answer is one;
- **group**: the example's group label (``depth=0.5``), or None where it has none.

Which examples: with no seed, exactly those an evaluation with ``examples: n`` scores
at ``length`` (seeded by the task and the length alone, ``n // groups`` of each group
and at least one, in scoring order); with an integer seed, ``n`` training-like draws
(every free choice drawn at random, as ``train_batch`` does) from a generator seeded
by the task, the length and the seed.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from worker.catalog.tasks import TaskConfigError
from worker.data import build_task
from worker.data.synthetic import Example, SyntheticTask


@dataclass(frozen=True)
class Sample:
    prompt: str
    answers: list[str]
    group: str | None

    def to_json(self) -> dict[str, Any]:
        return {"prompt": self.prompt, "answers": self.answers, "group": self.group}


def _decode(data: bytes) -> str:
    # A text task's bytes are UTF-8 (its catalogue entry's ``text``); any other byte is
    # shown as an escape rather than refused.
    return data.decode("utf-8", errors="backslashreplace")


def _parts(answer: bytes, parts: Sequence[Any] | None) -> list[str]:
    """The answer as its parts: given as strings, as sizes in bytes, or one part."""
    if not parts:
        return [_decode(answer)]
    if all(isinstance(part, str) for part in parts):
        return list(parts)
    if sum(parts) != len(answer):
        raise ValueError(f"answer parts {list(parts)} do not add up to {len(answer)} bytes")
    out, start = [], 0
    for size in parts:
        out.append(_decode(answer[start : start + size]))
        start += size
    return out


def as_sample(example: Example | tuple[Any, ...]) -> Sample:
    """One example (``bytes``, answer size, group label[, answer parts]) as text."""
    sequence, answer, label, *rest = example
    data = bytes(sequence)
    cut = len(data) - answer
    return Sample(_decode(data[:cut]), _parts(data[cut:], rest[0] if rest else None), label or None)


def sample_generator(task: str, length: int, seed: int) -> torch.Generator:
    """The generator of the training-like draws for ``seed`` (evaluation's own is
    seeded by the task and the length alone)."""
    return torch.Generator().manual_seed(zlib.crc32(f"{task}:{length}:{seed}".encode()))


def draw(
    name: str, params: Mapping[str, Any], length: int, n: int, seed: int | None = None
) -> list[Sample]:
    """The examples of task ``name``: the evaluation's (``seed`` None) or ``n``
    training-like draws. Raises TaskConfigError for a task without answers (one scored
    on every byte of a corpus) and ValueError where an example cannot be built."""
    task = build_task(name, **params)
    if not isinstance(task, SyntheticTask):
        raise TaskConfigError(
            f"task {name!r} has no examples to sample: it is scored on every byte of "
            "windows of its corpus, not on answers"
        )
    if seed is None:
        rows: list[Any] = task.eval_examples(length, task.per_group(n))
    else:
        generator = sample_generator(name, length, seed)
        rows = [task.example(length, generator, None) for _ in range(n)]
    return [as_sample(row) for row in rows]
