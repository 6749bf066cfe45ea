"""CoPE, contextual position encoding (Golovneva et al. 2024, arXiv:2405.18719).

Positions are counted by the content, not by the tokens: query i opens a gate on every
earlier key j, g_ij = sigmoid(z_ij), z_ij its (scaled, masked) logit, and the position of
key j seen from i is the number of open gates from j to i,

    p_ij = sum_{t = j..i} g_it   (clamped to max_pos - 1),

fractional, so the position term interpolates a learned table e[0..max_pos) between its
two nearest entries: q_i . ((1 - w) e[floor p_ij] + w e[ceil p_ij]), w = p_ij - floor
p_ij. That term is added to the logit before the softmax. One table [max_pos, head_dim]
per layer, shared by the heads, starting at zero (so a fresh model is NoPE). As in
x-transformers' CoPE (its Appendix B form): the gates read the logits after the causal
mask (a hidden key's gate is 0), and the table is dotted with the unscaled query.

The term depends on the scores, so no fused kernel computes it: attention is written out
(``worker.attention.LogitTerms``), on every path. The two-way probes have no CoPE: it
counts gates over the past, causal by construction.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from worker.encodings.base import PositionEncoding


class CoPE(PositionEncoding):
    name = "cope"

    def __init__(self, *, max_pos: int = 64, **dims: int) -> None:
        super().__init__(**dims)
        self.max_pos = max_pos
        self.pos_emb = nn.Parameter(torch.zeros(1, max_pos, self.head_dim))

    def bind_layers(self, n_layers: int) -> None:
        """One table per layer, each starting at zero."""
        if self.pos_emb.shape[0] != n_layers:
            device = self.pos_emb.device
            shape = (n_layers, self.max_pos, self.head_dim)
            self.pos_emb = nn.Parameter(torch.zeros(shape, device=device))

    def contextual(self, layer: int, q: Tensor, scores: Tensor) -> Tensor:
        """The position term of ``scores [..., Q, K]`` (masked logits: -inf where hidden)
        for the queries ``q [..., Q, d]`` (not divided by sqrt(d)) of ``layer``; the keys
        are the block's, in order, its last query's own key at most at K - 1."""
        gates = torch.sigmoid(scores)
        positions = gates.flip(-1).cumsum(-1).flip(-1).clamp(max=self.max_pos - 1)
        table = self.pos_emb[layer].to(q.dtype)
        by_position = torch.matmul(q, table.transpose(0, 1))  # [..., Q, max_pos]
        floor = positions.floor()
        weight = (positions - floor).to(by_position.dtype)
        low = by_position.gather(-1, floor.long())
        high = by_position.gather(-1, positions.ceil().long())
        return low * (1.0 - weight) + high * weight

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, max_pos={self.max_pos}"
