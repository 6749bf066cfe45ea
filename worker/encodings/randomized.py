"""Randomized positional encodings (Ruoss et al. 2023).

For every sequence, in training and in evaluation, positions are a sorted
uniform sample without replacement from [0, max_position), and the base
encoding (sinusoidal or RoPE) sees those instead of 0..T-1. Training then
covers the whole position range a long evaluation will use, while keeping the
order: only the gaps are random. max_position must exceed the longest
evaluated length.
"""

from __future__ import annotations

import torch
from torch import Tensor

from worker.encodings.base import PositionEncoding
from worker.encodings.rope import Rope
from worker.encodings.rotary import RotaryTables
from worker.encodings.sinusoidal import Sinusoidal


def sorted_random_positions(
    batch_size: int, length: int, max_position: int, device: torch.device
) -> Tensor:
    """``[B, T]`` int64: per row, a sorted sample of T distinct integers in [0, max_position)."""
    keys = torch.rand(batch_size, max_position, device=device)
    chosen = keys.topk(length, dim=-1, sorted=False).indices
    return chosen.sort(dim=-1).values


class Randomized(PositionEncoding):
    name = "randomized"

    def __init__(
        self, *, base_encoding: str = "rope", max_position: int | None = None, **dims: int
    ) -> None:
        super().__init__(**dims)
        self.base_encoding = base_encoding
        self.max_position = max_position or 64 * self.train_length
        self.inner = Rope(**dims) if base_encoding == "rope" else Sinusoidal(**dims)

    @property
    def max_length(self) -> int:
        return self.max_position

    def positions(self, batch_size: int, length: int, device: torch.device) -> Tensor:
        self.check_length(length)
        return sorted_random_positions(batch_size, length, self.max_position, device)

    def embed(self, x: Tensor, positions: Tensor) -> Tensor:
        return self.inner.embed(x, positions)

    def rotary_tables(self, positions: Tensor) -> RotaryTables | None:
        return self.inner.rotary_tables(positions)
