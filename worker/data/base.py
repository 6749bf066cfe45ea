"""What every task provides: training batches and evaluation batches of bytes."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor

from core.catalog.corpora import SourcePolicy

NO_SOURCES = SourcePolicy()  # without the caller's rules: no text: path, no hf:

if TYPE_CHECKING:
    from core.spec import EvalSpec


@dataclass
class Batch:
    """``inputs`` predict ``targets`` (the same sequences shifted by one byte).

    ``scored`` marks the target positions that count (None: all of them);
    ``groups`` labels each row for per-group accuracy (e.g. a pass key's depth);
    ``target_bytes`` holds the bytes of text each target token covers, where a token is
    not one byte (an hf: model's tokenizer; None: one byte each), for bits per byte;
    ``parts`` (``[B, T, P]``, bool) marks the targets that carry a byte of each of an
    answer's P parts, where an answer has several (None: each row's answer is one
    part), for RULER's string_match_all and string_match_part.
    """

    inputs: Tensor
    targets: Tensor
    scored: Tensor | None = None
    groups: list[str] | None = None
    target_bytes: Tensor | None = None
    parts: Tensor | None = None

    def to(self, device: torch.device) -> Batch:
        def moved(tensor: Tensor | None) -> Tensor | None:
            return None if tensor is None else tensor.to(device, non_blocking=True)

        return Batch(
            self.inputs.to(device, non_blocking=True),
            self.targets.to(device, non_blocking=True),
            moved(self.scored),
            self.groups,
            moved(self.target_bytes),
            moved(self.parts),
        )


def from_sequences(sequences: Tensor) -> tuple[Tensor, Tensor]:
    """``[B, T+1]`` byte sequences -> inputs and next-byte targets ``[B, T]``."""
    return sequences[:, :-1].long(), sequences[:, 1:].long()


class Task:
    name: ClassVar[str]
    metric: ClassVar[str]
    protocols: ClassVar[tuple[str, ...]] = ("nonoverlapping",)

    def prepare(self, cache_dir: Path, sources: SourcePolicy = NO_SOURCES) -> None:
        """Load or build whatever data the task needs (called once per run), from where
        ``sources`` (the operator's rules on corpora) allow."""

    @property
    def fingerprint(self) -> str:
        """Identifies the data, for provenance."""
        return self.name

    def train_batch(self, batch_size: int, length: int, generator: torch.Generator) -> Batch:
        raise NotImplementedError

    def check_plan(self, spec: EvalSpec) -> None:
        """Raise (a TaskConfigError) before training if the evaluation ``spec`` cannot be
        carried out on this task's data: a run must not fail after training."""

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
        raise NotImplementedError
