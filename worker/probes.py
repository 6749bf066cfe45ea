"""Probes of the permutation argument: why position encodings exist at all.

Self-attention without a position signal is permutation-equivariant: permute
the tokens and the outputs permute the same way, f(Px) = P f(x), so the layer
cannot know order. An encoding breaks that symmetry; so does a causal mask.
"""

from __future__ import annotations

import torch
from torch import Tensor

from worker.encodings.base import PositionEncoding
from worker.model import AttentionBias, CausalSelfAttention, ModelConfig


def attention_layer(
    attention: CausalSelfAttention, encoding: PositionEncoding, x: Tensor, causal: bool
) -> Tensor:
    """One attention layer with ``encoding`` applied at all three of its hooks."""
    batch, length, _ = x.shape
    positions = encoding.positions(batch, length, x.device)
    x = encoding.embed(x, positions)
    bias = None
    if encoding.has_bias:
        bias = AttentionBias(
            encoding, length, batch, x.dtype, x.device, budget=1 << 62, causal=causal
        )
    return attention(x, encoding, positions, bias, causal=causal)


def equivariance_error(
    encoding: PositionEncoding,
    length: int = 16,
    causal: bool = False,
    seed: int = 0,
) -> float:
    """Relative ||f(Px) - P f(x)|| / ||f(x)|| for a random layer, input and permutation.

    0 (up to rounding) means the layer cannot see order at all.
    """
    generator = torch.Generator().manual_seed(seed)
    config = ModelConfig(
        d_model=encoding.d_model, n_layers=1, n_heads=encoding.n_heads, vocab_size=1
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        attention = CausalSelfAttention(config)
    x = torch.randn(1, length, encoding.d_model, generator=generator)
    permutation = torch.randperm(length, generator=generator)
    with torch.no_grad():
        out = attention_layer(attention, encoding, x, causal)
        out_permuted = attention_layer(attention, encoding, x[:, permutation], causal)
    return float((out_permuted - out[:, permutation]).norm() / out.norm())
