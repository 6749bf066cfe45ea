"""Sinusoidal absolute positions (Vaswani et al. 2017, §3.5).

PE(pos, 2i) = sin(pos / base^(2i/d)),  PE(pos, 2i+1) = cos(pos / base^(2i/d)),
interleaved exactly as the paper writes it, added to the token embedding.
"""

from __future__ import annotations

import torch
from torch import Tensor

from worker.encodings.base import PositionEncoding, check_even


def sinusoid_table(positions: Tensor, d_model: int, base: float = 10000.0) -> Tensor:
    """``[..., d_model]`` float32 table for integer or float ``positions`` of any shape."""
    check_even("sinusoidal", "d_model", d_model)
    exponent = torch.arange(0, d_model, 2, device=positions.device, dtype=torch.float64) / d_model
    inv_freq = (base**-exponent).to(torch.float32)
    angle = positions.to(torch.float32)[..., None] * inv_freq
    # Interleave so that even dimensions hold the sine and odd ones the cosine.
    return torch.stack((angle.sin(), angle.cos()), dim=-1).flatten(-2)


class Sinusoidal(PositionEncoding):
    name = "sinusoidal"

    def __init__(self, *, base: float = 10000.0, **dims: int) -> None:
        super().__init__(**dims)
        check_even(self.name, "d_model", self.d_model)
        self.base = base

    def embed(self, x: Tensor, positions: Tensor) -> Tensor:
        table = sinusoid_table(positions, self.d_model, self.base)
        return x + table.to(x.dtype)
