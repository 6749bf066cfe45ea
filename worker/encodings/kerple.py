"""KERPLE (Chi et al. 2022): conditionally positive definite kernels of distance.

- ``kerple_log``:   bias = -r1 * log(1 + r2 * |m - n|)
- ``kerple_power``: bias = -r1 * |m - n|^r2, with 0 < r2 <= 2

r1 and r2 are learned per head (one set shared by every layer) and must stay
positive for the kernel to be valid. The reference implementation clamps them
to at least 0.01 after each step; here they are reparametrised as
0.01 + softplus (and 0.01 + 1.99 sigmoid for the power, so r2 <= 2), which keeps
them in range without a hook in the optimiser. The initial values follow the
reference code (chijames/KERPLE, ``ParallelKerpleLog`` / ``ParallelKerplePower``), per
head: for the log kernel r1 ~ U(0, 2) outside the log and r2 ~ U(0, 1) inside it; for
the power kernel the coefficient r1 ~ U(0, 1) and the exponent r2 ~ U(0, 2).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from worker.encodings.base import (
    ONE_READ_TILES,
    BiasMod,
    PositionEncoding,
    distance_mod,
    relative_distance,
)

EPS = 1e-2  # the floor the reference implementation clamps to
POWER_MAX = 2.0


def _positive(raw: Tensor) -> Tensor:
    return EPS + F.softplus(raw)


def _raw_positive(value: Tensor) -> Tensor:
    shifted = value - EPS
    return shifted + torch.log(-torch.expm1(-shifted))


def _initial(n_heads: int, high: float) -> Tensor:
    # Keep the draw a little above the floor, where the inverse is finite.
    return torch.rand(n_heads).mul(high).clamp(min=2 * EPS)


class _Kerple(PositionEncoding):
    has_bias = True
    flex_tiles = ONE_READ_TILES
    R1_INIT_HIGH = 2.0  # r1 ~ U(0, R1_INIT_HIGH) at initialisation

    def kernel(self, distance: Tensor) -> Tensor:
        raise NotImplementedError

    def bias(self, q_len: int, k_len: int) -> Tensor:
        return self.kernel(relative_distance(q_len, k_len, self.raw_r1.device).abs())

    def distance_bias(self, length: int) -> Tensor:
        """``[heads, length]``: the bias at distance 0..length-1 (a Toeplitz encoding)."""
        distance = torch.arange(length, device=self.raw_r1.device, dtype=torch.float32)
        return self.kernel(distance[None, :])[:, 0]

    def bias_mod(self, length: int, causal: bool = True) -> BiasMod:
        """The kernel at every distance, computed once per pass (its gradient reaches r1
        and r2 through it) and read per pair."""
        return distance_mod(self.distance_bias(length), mirror_future=True)

    def __init__(self, **dims: int) -> None:
        super().__init__(**dims)
        self.raw_r1 = nn.Parameter(_raw_positive(_initial(self.n_heads, self.R1_INIT_HIGH)))

    @property
    def r1(self) -> Tensor:
        return _positive(self.raw_r1)


class KerpleLog(_Kerple):
    name = "kerple_log"

    def __init__(self, **dims: int) -> None:
        super().__init__(**dims)
        self.raw_r2 = nn.Parameter(_raw_positive(_initial(self.n_heads, 1.0)))

    @property
    def r2(self) -> Tensor:
        return _positive(self.raw_r2)

    def kernel(self, distance: Tensor) -> Tensor:
        return -self.r1[:, None, None] * torch.log1p(self.r2[:, None, None] * distance)


class KerplePower(_Kerple):
    name = "kerple_power"
    R1_INIT_HIGH = 1.0

    def __init__(self, **dims: int) -> None:
        super().__init__(**dims)
        # The exponent starts in (0, 2), kept off 2 where the inverse sigmoid is infinite.
        r2 = _initial(self.n_heads, POWER_MAX).clamp(max=POWER_MAX - 2 * EPS)
        self.raw_r2 = nn.Parameter(torch.logit((r2 - EPS) / (POWER_MAX - EPS)))

    @property
    def r2(self) -> Tensor:
        return EPS + (POWER_MAX - EPS) * torch.sigmoid(self.raw_r2)

    def kernel(self, distance: Tensor) -> Tensor:
        # d^r2 at d = 0 has an infinite derivative in r2 (log 0); evaluate at 1 and mask.
        safe = torch.where(distance > 0, distance, torch.ones_like(distance))
        power = safe ** self.r2[:, None, None]
        return -self.r1[:, None, None] * torch.where(distance > 0, power, torch.zeros_like(power))
