"""xPos (Sun et al. 2022): RoPE whose q.k also decays exponentially with distance.

Each rotated pair j carries zeta_j = (2j/r + 0.4) / 1.4; the query at position n
is scaled by zeta^(n/scale_base) and the key at m by zeta^(-m/scale_base), so the
logit picks up zeta^((n-m)/scale_base): pair 0, the highest frequency, has the
smallest zeta (0.29) and decays fastest.

Only the difference n-m matters, so positions are centred on the middle of the
sequence before exponentiation; the raw zeta^(n/512) would overflow float32 long
before the lengths posbench evaluates. Centred, one table still spans
zeta^(+-T / (2 scale_base)): past ``table_span`` positions (about 96 x scale_base,
49k tokens at the default 512, where the largest scale reaches e^60) the tables
hold plain rotations and attention applies the decay per block of queries, centred
on each block (``BlockDecay``), so evaluation at any length stays finite and exact.
x-transformers and the paper's code use one table and return inf / NaN past about
72k tokens.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import Tensor

from worker.encodings.rope import Rope
from worker.encodings.rotary import BlockDecay, RotaryTables, decay_scale

# The largest scale a table may hold, as a natural log: e^60 = 1e26 leaves float32
# (max 3.4e38) room for the q and k values it multiplies.
MAX_LOG_SCALE = 60.0


def xpos_zeta(rotary_dim: int) -> Tensor:
    """``[rotary_dim / 2]`` float32 per-pair decay bases (2j/r + 0.4) / 1.4."""
    return (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim + 0.4) / 1.4


class XPos(Rope):
    name = "xpos"

    def __init__(self, *, scale_base: float = 512.0, **kwargs: float) -> None:
        super().__init__(**kwargs)
        self.scale_base = scale_base
        zeta = xpos_zeta(self.rotary_dim)
        self.register_buffer("zeta", zeta, persistent=False)
        # The most positions one pair of scaled tables covers: the scale at either end,
        # zeta_0^(-T / (2 scale_base)), stays below e^MAX_LOG_SCALE (a plain int, so
        # torch.compile reads no tensor to decide).
        self.table_span = int(2 * MAX_LOG_SCALE * scale_base / -math.log(float(zeta.min())))

    def decay(self, positions: Tensor) -> Tensor:
        """``[..., T, r/2]`` float32 query scales per pair; keys use the reciprocal."""
        pos = positions.to(torch.float32)
        centre = torch.floor((pos.amax(dim=-1, keepdim=True) + pos.amin(dim=-1, keepdim=True)) / 2)
        return decay_scale(self.zeta, pos - centre, self.scale_base)

    def rotary_tables(self, positions: Tensor) -> RotaryTables:
        tables = super().rotary_tables(positions)
        if positions.shape[-1] > self.table_span:
            # Positions are 0..T-1 here (Rope's positions), so the span is the length.
            decay = BlockDecay(self.zeta, self.scale_base, positions, self.table_span // 2)
            return replace(tables, decay=decay)
        with torch.autocast(positions.device.type, enabled=False):
            scale = self.decay(positions)
            cos, sin = tables.cos_q, tables.sin_q
            return RotaryTables(cos * scale, sin * scale, cos / scale, sin / scale)
