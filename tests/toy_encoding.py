"""A rotary encoding that is not in the catalogue, for the test that a new entry is picked
up by the registry checks and the docs table without further edits: RoPE whose angles
run at half the speed (positions halved), a real if pointless member of the family."""

from __future__ import annotations

from torch import Tensor

from worker.encodings.rope import Rope


class HalfSpeedRope(Rope):
    name = "half_speed_rope"

    def rotary_tables(self, positions: Tensor):  # type: ignore[override]
        return super().rotary_tables(positions / 2)
