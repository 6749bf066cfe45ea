"""What a model sees: a synthetic task's examples as text (``posbench tasks sample``).

Every sample comes from the task's own ``example`` (through ``eval_examples`` for the
evaluation's examples), so what is shown is what is trained on and scored - the
task's definition stays in one place:

- **prompt**: the example's bytes before its answer, decoded as UTF-8;
- **answer**: the answer bytes (the last ``answer`` bytes of the example, the bytes
  evaluation scores by exact match), decoded;
- **answers**: the answer's parts, RULER's references, each scored apart by
  string_match_all and string_match_part (a task whose answer has several gives them
  as the fourth element of its example, ``worker.data.synthetic.Example``: the values
  of several needles, without the ``, `` between them), or the answer alone;
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

from core.catalog.tasks import TaskConfigError
from worker.data import build_task
from worker.data.synthetic import Example, SyntheticTask, part_spans, parts_of


@dataclass(frozen=True)
class Sample:
    prompt: str
    answer: str
    answers: list[str]
    group: str | None

    def to_json(self) -> dict[str, Any]:
        return {
            "prompt": self.prompt,
            "answer": self.answer,
            "answers": self.answers,
            "group": self.group,
        }


def _decode(data: bytes) -> str:
    # A text task's bytes are UTF-8 (its catalogue entry's ``text``); any other byte is
    # shown as an escape rather than refused.
    return data.decode("utf-8", errors="backslashreplace")


def _parts(answer: bytes, parts: Sequence[Any]) -> list[str]:
    """The answer's parts as text (``Example``: strings, or byte ranges of the answer)."""
    if not parts:
        return [_decode(answer)]
    return [_decode(answer[start:end]) for start, end in part_spans(answer, parts)]


def as_sample(example: Example) -> Sample:
    """One example (``bytes``, answer size, group label[, answer parts]) as text."""
    data = bytes(example[0])
    cut = len(data) - example[1]
    answer = data[cut:]
    return Sample(
        _decode(data[:cut]), _decode(answer), _parts(answer, parts_of(example)), example[2] or None
    )


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
