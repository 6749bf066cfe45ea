"""xPos (Sun et al. 2022): RoPE whose q.k also decays exponentially with distance.

Each rotated pair j carries zeta_j = (2j/r + 0.4) / 1.4; the query at position n
is scaled by zeta^(n/scale_base) and the key at m by zeta^(-m/scale_base), so the
logit picks up zeta^((n-m)/scale_base): low frequencies decay fastest.

Only the difference n-m matters, so positions are centred on the middle of the
sequence before exponentiation; the raw zeta^(n/512) would overflow float32 long
before the lengths posbench evaluates.
"""

from __future__ import annotations

import torch
from torch import Tensor

from worker.encodings.rope import Rope, RotaryTables


def xpos_zeta(rotary_dim: int) -> Tensor:
    """``[rotary_dim / 2]`` float32 per-pair decay bases (2j/r + 0.4) / 1.4."""
    return (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim + 0.4) / 1.4


class XPos(Rope):
    name = "xpos"

    def __init__(self, *, scale_base: float = 512.0, **kwargs: float) -> None:
        super().__init__(**kwargs)
        self.scale_base = scale_base
        self.register_buffer("zeta", xpos_zeta(self.rotary_dim), persistent=False)

    def decay(self, positions: Tensor) -> Tensor:
        """``[..., T, r/2]`` float32 query scales per pair; keys use the reciprocal."""
        pos = positions.to(torch.float32)
        centre = torch.floor((pos.amax(dim=-1, keepdim=True) + pos.amin(dim=-1, keepdim=True)) / 2)
        power = (pos - centre) / self.scale_base
        scale = self.zeta ** power[..., None]
        return scale[:, None] if scale.dim() == 3 else scale

    def rotary_tables(self, positions: Tensor) -> RotaryTables:
        tables = super().rotary_tables(positions)
        with torch.autocast(positions.device.type, enabled=False):
            scale = self.decay(positions)
            cos, sin = tables.cos_q, tables.sin_q
            return RotaryTables(cos * scale, sin * scale, cos / scale, sin / scale)
