"""T5 relative position bias (Raffel et al. 2020), causal variant.

A learned scalar per (bucket, head), one table shared by every layer. The
distance n = i - j >= 0 falls in its own bucket while n < num_buckets/2; from
there buckets are log-spaced so that max_distance would start bucket num_buckets;
the index is clamped to the last bucket, which with the defaults (32, 128) is
reached at n = 113 (HF transformers' formula, pinned in the tests). Every distance
past it shares that bucket, which is why T5 extrapolates: far-away tokens all look
alike.

The bias added to the logits is ``scale * table[bucket]``, ``scale`` = sqrt(head_dim) by
default, as in x-transformers (its ``RelativePositionBias(scale=dim_head ** 0.5)``). The
factor matters for learning, not for what the table can express: under Adam an entry moves
about one learning rate per step whatever its gradient's size, so the bias moves ``scale``
times faster than the raw table would. Without it a short run barely learns locality
(posbench before 2026-12 added the raw table: see docs/encodings.md). The table starts at
std d_model^-0.5 / scale, so the initial bias is T5's std d_model^-0.5 either way.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from worker.encodings.base import (
    ONE_READ_TILES,
    BiasMod,
    PositionEncoding,
    distance_mod,
    relative_distance,
)


def t5_bucket(distance: Tensor, num_buckets: int = 32, max_distance: int = 128) -> Tensor:
    """Causal bucket of each ``distance`` (i - j; future keys, negative, go to bucket 0)."""
    n = distance.clamp(min=0)
    max_exact = num_buckets // 2
    # Log-spaced between max_exact and max_distance; clamped into the last bucket.
    log_ratio = torch.log(n.float().clamp(min=1) / max_exact) / math.log(max_distance / max_exact)
    large = max_exact + (log_ratio * (num_buckets - max_exact)).to(torch.long)
    large = large.clamp(max=num_buckets - 1)
    return torch.where(n < max_exact, n.to(torch.long), large)


class T5Bias(PositionEncoding):
    name = "t5"
    has_bias = True
    flex_tiles = ONE_READ_TILES

    def __init__(
        self,
        *,
        num_buckets: int = 32,
        max_distance: int = 128,
        scale: float | None = None,
        **dims: int,
    ) -> None:
        super().__init__(**dims)
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        self.scale = math.sqrt(self.head_dim) if scale is None else float(scale)
        # T5 initialises the bias with std d_model^-0.5; the table holds it over ``scale``.
        initial = torch.randn(num_buckets, self.n_heads) * self.d_model**-0.5 / self.scale
        self.table = nn.Parameter(initial)

    def bias(self, q_len: int, k_len: int) -> Tensor:
        distance = relative_distance(q_len, k_len, self.table.device).to(torch.long)
        bucket = t5_bucket(distance, self.num_buckets, self.max_distance)
        return (self.table * self.scale)[bucket].permute(2, 0, 1)

    def distance_bias(self, length: int) -> Tensor:
        """``[heads, length]``: the bias at distance 0..length-1 (a Toeplitz encoding)."""
        distance = torch.arange(length, device=self.table.device)
        bucket = t5_bucket(distance, self.num_buckets, self.max_distance)
        return (self.table * self.scale)[bucket].T

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scale={self.scale:g}"

    def bias_mod(self, length: int, causal: bool = True) -> BiasMod:
        """The table read per distance (``distance_bias``); two ways, future keys fall in
        bucket 0, as in ``t5_bucket``. The gradient reaches the table through the gather."""
        return distance_mod(self.distance_bias(length), mirror_future=causal)
