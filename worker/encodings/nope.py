"""NoPE: no position signal. In a decoder the causal mask alone breaks permutation
symmetry (token t sees exactly t predecessors), which is enough to learn order."""

from __future__ import annotations

from worker.encodings.base import PositionEncoding


class NoPE(PositionEncoding):
    name = "nope"
