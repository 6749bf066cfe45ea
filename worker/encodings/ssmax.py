"""SSMax, scalable softmax (Nakanishi 2025, arXiv:2501.19399), on RoPE.

Softmax over n keys flattens as n grows: its largest output falls like 1/n for logits
that stay bounded ("attention fading"). SSMax replaces softmax(z) by

    n^(s z_j) / sum_k n^(s z_k)  =  softmax((s log n) z)_j,

n the number of keys the query attends to, s a scalar learned per layer and head. Here
the factor s_lh x log n multiplies each query (the same product as multiplying its
logits), n = position + 1 in a causal layer (the keys of a sliding window or chunk where
the layer has one), over RoPE as the paper trains it. s starts at 1 / log(L), L the
training length, so that at the training length the model starts as plain softmax
(``init_s`` sets another start). Position 0 sees one key: log 1 = 0, its only key takes
everything either way.

The parameters live per layer: the model binds the encoding to its depth
(``bind_layers``) before anything trains.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from worker.encodings.rope import Rope
from worker.reach import Reach


class SSMax(Rope):
    name = "ssmax"

    def __init__(self, *, init_s: float | None = None, **params: object) -> None:
        super().__init__(**params)  # type: ignore[arg-type]
        self.init_s = init_s if init_s is not None else 1.0 / math.log(max(2, self.train_length))
        self.s = nn.Parameter(torch.full((1, self.n_heads), self.init_s))

    def bind_layers(self, n_layers: int) -> None:
        """One s per layer and head, each starting at ``init_s``."""
        if self.s.shape[0] != n_layers:
            device = self.s.device
            self.s = nn.Parameter(torch.full((n_layers, self.n_heads), self.init_s, device=device))

    def query_scale(self, layer: int, positions: Tensor, reach: Reach) -> Tensor:
        """``[H, T]`` s_lh x log n for the queries at ``positions [T]``, n the keys each
        one sees under the layer's ``reach``."""
        seen = reach.keys_seen(positions.to(torch.float32))
        return self.s[layer][:, None] * torch.log(seen)[None, :]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, init_s={self.init_s:.4g}"
