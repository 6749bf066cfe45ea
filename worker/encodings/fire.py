"""FIRE (Li et al. 2023): a learned function of the *normalised* relative distance.

    bias(i, j) = f( psi(i - j) / psi(max(L, i)) ),   psi(x) = log(c x + 1)

f is a small MLP (1 -> width -> heads, ReLU) shared by every layer, c > 0 and
the threshold L are learned. Dividing by the log query position maps every
query's context into [0, 1], so a longer sequence interpolates inside the range
seen in training instead of extrapolating past it; L keeps the normaliser from
blowing up short-range distances for early queries. Initial values follow the
paper's code: c = 0.1, and L = 512 at its training length of 2048, i.e. a quarter of
the training length (the default here): with a fixed 512, a model trained at 128 or
256 would never see a query normalised by its own position in training, and the
progressive interpolation would first act at evaluation.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from worker.encodings.base import (
    INTERPOLATED_TILES,
    BiasMod,
    PositionEncoding,
    relative_distance,
)

# Cells of the grid on which the fused kernel reads f (``FIRE.bias_mod``): f is linear
# inside a cell holding no knot and off by at most |slope change| x cell / 4 in the <= width
# cells holding one (about 4e-6 for a slope change of 1 over [0, 1]).
GRID_CELLS = 1 << 16


class FIRE(PositionEncoding):
    name = "fire"
    has_bias = True
    flex_tiles = INTERPOLATED_TILES
    eps = 1e-6

    def __init__(
        self,
        *,
        mlp_width: int = 32,
        init_c: float = 0.1,
        init_threshold: float | None = None,
        **dims: int,
    ) -> None:
        super().__init__(**dims)
        if init_threshold is None:
            init_threshold = self.train_length / 4
        self.mlp = nn.Sequential(
            nn.Linear(1, mlp_width), nn.ReLU(), nn.Linear(mlp_width, self.n_heads)
        )
        self.c = nn.Parameter(torch.tensor(float(init_c)))
        # L = |multiplier| * init_threshold: a learned multiplier keeps the gradient
        # well scaled whatever the initial threshold is.
        self.register_buffer("init_threshold", torch.tensor(float(init_threshold)))
        self.threshold_multiplier = nn.Parameter(torch.tensor(1.0))

    @property
    def threshold(self) -> Tensor:
        return (self.threshold_multiplier * self.init_threshold).abs()

    def psi(self, x: Tensor) -> Tensor:
        return torch.log(torch.abs(self.c * x) + 1)

    def normalized_distance(self, q_len: int, k_len: int) -> Tensor:
        """``[q_len, k_len]``: psi(i - j) / psi(max(L, i)), in [0, 1] for past keys;
        psi(x) = log(|c x| + 1) is symmetric, so future keys (only the two-way probes
        see them) get psi(|i - j|), as in the reference, not psi(0)."""
        distance = relative_distance(q_len, k_len, self.c.device)
        query_pos = torch.arange(k_len - q_len, k_len, device=self.c.device, dtype=torch.float32)
        normaliser = self.psi(torch.maximum(query_pos, self.threshold)) + self.eps
        return self.psi(distance) / normaliser[:, None]

    def bias(self, q_len: int, k_len: int) -> Tensor:
        return self.piecewise_bias(self.normalized_distance(q_len, k_len))

    def bias_mod(self, length: int, causal: bool = True) -> BiasMod:
        """f read off a grid: per pass, f at ``GRID_CELLS + 1`` evenly spaced points of the
        normalised distances a key can have ([0, 1] for past keys; the two-way probes'
        future keys reach psi(T - 1) / psi(L)), and per pair the normalised distance from
        two per-position tables (psi of the distance, the query's normaliser), then a linear
        interpolation between the two grid points around it. An MLP per pair would cost
        width multiply-adds and, in training, width atomic adds per score; the grid costs
        two reads, and its gradient reaches the MLP through the grid values, c and L
        through the two tables."""
        position = torch.arange(length, device=self.c.device, dtype=torch.float32)
        normaliser = self.psi(torch.maximum(position, self.threshold)) + self.eps
        psi_distance = self.psi(position)
        # Cells of the same width over a longer span for the probes' future keys.
        span = 1 if causal else math.ceil(float(psi_distance[-1] / normaliser[0]))
        cells = GRID_CELLS * span
        grid = torch.linspace(0.0, span, cells + 1, device=self.c.device)
        values = self.piecewise_bias(grid[None, :])[:, 0, :]  # [H, cells + 1]
        rise = values[:, 1:] - values[:, :-1]  # [H, cells]: f's change across each cell
        in_cells = psi_distance * (cells / span)  # the distance's psi, in cells

        def fire(h: Tensor, q: Tensor, k: Tensor) -> Tensor:
            t = in_cells[(q - k).abs()] / normaliser[q]
            cell = t.floor().clamp(0, cells - 1).to(torch.int64)
            return values[h, cell] + rise[h, cell] * (t - cell)

        return fire

    def pieces(self) -> tuple[Tensor, Tensor]:
        """f as the piecewise-linear function it is: ``(knots [m], table [m+1, 2H])``,
        where row p of the table holds the slopes then the intercepts of piece p =
        searchsorted(knots, x): f(x) = slopes[p] x + intercepts[p].

        A scalar input through Linear(1, width), ReLU, Linear(width, heads) bends only
        where a hidden unit crosses zero, at x = -b_k / w_k: at most ``width`` knots.
        Between two knots the set of active units is fixed, so f is exactly linear
        there, with a slope and intercept summed once over the active units."""
        first, second = self.mlp[0], self.mlp[2]
        wide = torch.promote_types(first.weight.dtype, torch.float32)
        w, b = first.weight[:, 0].to(wide), first.bias.to(wide)
        # A unit with w = 0 never bends: its knot is at infinity, sorted last, past every
        # x (static shapes: no selection whose size depends on the weights, so a compiled
        # step neither breaks nor waits for the device here).
        bends = w != 0
        at = -b / torch.where(bends, w, 1.0)
        knots = torch.sort(torch.where(bends, at, torch.inf)).values
        # One point inside each piece decides which units are active; the knots at
        # infinity count as one past the last finite knot there (pieces beyond it are
        # never looked up, the one just past it is).
        last = torch.where(bends, at, -torch.inf).amax()
        last = torch.where(bends.any(), last, torch.zeros_like(last))
        capped = torch.minimum(knots, last + 1)
        inside = torch.cat((capped[:1] - 1, (capped[:-1] + capped[1:]) / 2, capped[-1:] + 1))
        active = ((inside[:, None] * w + b) > 0).to(w.dtype)  # [m+1, width]
        with torch.autocast(w.device.type, enabled=False):  # a tiny table: keep it fp32
            out = second.weight.to(wide).T
            slopes = (active * w) @ out  # [m+1, H]
            intercepts = (active * b) @ out + second.bias.to(wide)
        return knots, torch.cat((slopes, intercepts), dim=1)

    def piecewise_bias(self, normalized: Tensor) -> Tensor:
        """``[heads, q, k]``: f at every normalised distance from its pieces, one row
        lookup and one multiply-add per head instead of a width-wide MLP per pair.

        Training too: the piece index is constant between knots, so the gradient
        reaches the MLP's weights through the table (slopes and intercepts are sums
        over the active units) and c and the threshold through ``normalized``; it is
        the MLP's own gradient wherever ReLU's is defined (the bias's forward and
        backward at T=256: 5.3-8.7 ms against 10.8-17.1 ms through the MLP, two runs)."""
        knots, table = self.pieces()
        heads = table.shape[1] // 2
        rows = lookup_rows(torch.searchsorted(knots, normalized.detach()), table)  # [q, k, 2H]
        out = torch.addcmul(rows[..., heads:], rows[..., :heads], normalized[..., None])
        return out.permute(2, 0, 1)


class _LookupRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, index: Tensor, table: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(index)
        ctx.table_rows = table.shape[0]
        return table.index_select(0, index.flatten()).view(*index.shape, table.shape[1])

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[None, Tensor]:  # type: ignore[override]
        (index,) = ctx.saved_tensors
        index, grad = index.flatten(), grad.reshape(index.numel(), -1)
        columns = [
            torch.bincount(index, weights=grad[:, column], minlength=ctx.table_rows)
            for column in range(grad.shape[1])
        ]
        return None, torch.stack(columns, dim=1).to(grad.dtype)


def lookup_rows(index: Tensor, table: Tensor) -> Tensor:
    """``table[index]`` whose backward sums the gradient per table row with one weighted
    bincount per column: a few dozen rows receive every pair's gradient, where
    embedding's and index_select's backward (a serial index_add) took 3x as long."""
    return _LookupRows.apply(index, table)
