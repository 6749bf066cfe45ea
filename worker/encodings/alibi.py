"""ALiBi (Press et al. 2022): add -m_h * distance to head h's attention logits.

Slopes are geometric, starting at 2^(-8/n) with that same ratio, for n heads a
power of two (8 heads: 1/2, 1/4, ..., 1/256). For other head counts the paper
takes the slopes of the closest power of two below, then every other slope of
the next power of two up (12 heads: the 8 above, then 2^-0.5, 2^-1.5, 2^-2.5,
2^-3.5). No position embedding anywhere, and the bias is added after the
1/sqrt(d) scaling of q.k, not scaled by it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from worker.encodings.base import BiasMod, PositionEncoding, relative_distance


def alibi_slopes(n_heads: int) -> list[float]:
    def geometric(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    if n_heads & (n_heads - 1) == 0:
        return geometric(n_heads)
    lower = 1 << (n_heads.bit_length() - 1)
    return geometric(lower) + geometric(2 * lower)[0::2][: n_heads - lower]


class ALiBi(PositionEncoding):
    name = "alibi"
    has_bias = True

    def __init__(self, **dims: int) -> None:
        super().__init__(**dims)
        self.register_buffer(
            "slopes",
            torch.tensor(alibi_slopes(self.n_heads), dtype=torch.float32),
            persistent=False,
        )

    def bias(self, q_len: int, k_len: int) -> Tensor:
        distance = relative_distance(q_len, k_len, self.slopes.device).abs()
        return -self.slopes[:, None, None] * distance

    def distance_bias(self, length: int) -> Tensor:
        """``[heads, length]``: the bias at distance 0..length-1 (a Toeplitz encoding)."""
        distance = torch.arange(length, device=self.slopes.device, dtype=torch.float32)
        return -self.slopes[:, None] * distance

    def bias_mod(self, length: int, causal: bool = True) -> BiasMod:
        """-m_h |i - j| computed in the kernel: nothing to read but the slopes."""
        slopes = self.slopes

        def alibi(h: Tensor, q: Tensor, k: Tensor) -> Tensor:
            return -slopes[h] * (q - k).abs()

        return alibi
