"""Learned absolute positions (GPT-2): one trained vector per position.

The table has exactly ``train_length`` rows. Past it the encoding is undefined,
and asking for such a position raises an error that names the limit; it never
clamps or wraps silently, because either would fabricate an extrapolation result.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from worker.encodings.base import PositionEncoding, PositionOutOfRange


class Learned(PositionEncoding):
    name = "learned"

    def __init__(self, **dims: int) -> None:
        super().__init__(**dims)
        # Same RMS as the sinusoidal table (1/sqrt(2)), so both absolute encodings
        # start from a position signal of equal strength.
        self.table = nn.Parameter(torch.randn(self.train_length, self.d_model) / math.sqrt(2))

    @property
    def max_length(self) -> int:
        return self.train_length

    def check_length(self, length: int) -> None:
        if length > self.train_length:
            raise PositionOutOfRange(self._beyond(length - 1))

    def _beyond(self, position: int) -> str:
        return (
            f"encoding 'learned' has a table of {self.train_length} positions "
            f"(0..{self.train_length - 1}, the training length L={self.train_length}); "
            f"position {position} is beyond it"
        )

    def embed(self, x: Tensor, positions: Tensor) -> Tensor:
        # Under torch.compile the positions come from ``positions()``, whose length is
        # checked already; reading their values back would break the graph.
        if not torch.compiler.is_compiling():
            highest = int(positions.max())
            if highest >= self.train_length or int(positions.min()) < 0:
                raise PositionOutOfRange(self._beyond(highest))
        return x + self.table[positions].to(x.dtype)
