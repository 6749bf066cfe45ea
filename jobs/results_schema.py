"""The records a run produces, shared by whoever writes them and whoever reads them.

A worker builds these while it trains and evaluates; the store writes them to the
database, ``posbench run`` writes them into ``results.json`` and ``posbench import``
reads them back from it. One declaration, so the format cannot drift between writer
and reader. Torch-free: the importer and the CLI load it without the engine.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class TrainPoint:
    """One point of a training curve."""

    step: int
    loss: float
    lr: float
    tokens_per_second: float
    elapsed: float
    val_loss: float | None = None  # held-out loss at the training length, when validated


@dataclass
class PositionBin:
    """The mean loss of the targets at positions [start, end) of the windows."""

    start: int  # inclusive
    end: int  # exclusive
    loss: float
    tokens: int


@dataclass
class Evaluation:
    """One point of an extrapolation curve: (variant, protocol, length) -> metrics."""

    variant: str
    protocol: str
    length: int
    loss: float | None = None
    perplexity: float | None = None
    bits_per_byte: float | None = None
    accuracy: float | None = None
    token_accuracy: float | None = None
    tokens: int = 0
    tokens_per_second: float | None = None
    peak_memory_bytes: int | None = None
    not_applicable: str | None = None
    factor: float | None = None
    position_bins: list[PositionBin] = field(default_factory=list)
    groups: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
