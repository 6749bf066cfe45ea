"""The model's forward written out densely, the one reference of the attention paths'
tests (tests/test_window.py, tests/test_softcap.py, tests/test_fope.py): every score of
the sequence, each layer's own kind's rotation (a recipe's, FoPE's per-layer tables),
what multiplies its queries (SSMax's s log n, a recipe's temperature: their formulas are
pinned in tests/test_ssmax.py and tests/test_recipes.py), the encoding's bias over the
whole square, an optional soft cap (Gemma 2: before the mask), and the causal, window and
chunk masks as one matrix."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from worker.encodings.rope import Rope
from worker.encodings.rotary import decay_scale, scale_pairs
from worker.encodings.xpos import XPos
from worker.model import Transformer


def dense_logits(
    model: Transformer, tokens: torch.Tensor, cap: float | None = None
) -> torch.Tensor:
    enc, config = model.encoding, model.config
    batch, length = tokens.shape
    heads, head_dim = config.n_heads, config.head_dim
    positions = enc.positions(batch, length, tokens.device)
    x = enc.embed(model.token_embedding(tokens) * math.sqrt(config.d_model), positions)
    kinds = model.kinds
    bias = enc.bias(length, length)
    query = torch.arange(length)[:, None]
    key = torch.arange(length)[None, :]
    for layer, (block, kind) in enumerate(zip(model.blocks, model.layer_kinds, strict=True)):
        attn = block.attn
        qkv = attn.qkv(block.attn_norm(x)).view(batch, length, 3, heads, head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        tables = kinds[kind].rotary_tables(positions)
        if tables is not None and tables.decay is not None:
            q, k = _xpos_in_float64(kinds[kind], positions, q, k)
        elif tables is not None:
            q, k = tables.rotate(q, k)
        every = model.kind_factors(kind, torch.arange(length), None)
        scale = model.layer_factors(layer, torch.arange(length), every)
        if scale is not None:
            q = q * scale[..., None]
        scores = (q @ k.transpose(-1, -2) / math.sqrt(head_dim)).float()
        future = key > query
        hidden = future
        if bias is not None:
            scores = scores + bias.masked_fill(future, 0.0)
        if cap is not None:
            scores = cap * torch.tanh(scores / cap)
        if attn.reach.window is not None:
            hidden = hidden | (query - key >= attn.reach.window)
        if attn.reach.chunk is not None:
            hidden = hidden | (query // attn.reach.chunk != key // attn.reach.chunk)
        scores = scores.masked_fill(hidden, float("-inf"))
        if attn.terms is not None and attn.terms.contextual is not None:
            # CoPE's counted positions (pinned to x-transformers in tests/test_cope.py).
            scores = scores + attn.terms.contextual(q, scores)
        y = torch.softmax(scores, -1) @ v
        x = x + attn.proj(y.transpose(1, 2).reshape(batch, length, -1))
        x = x + block.mlp(block.mlp_norm(x))
    return F.linear(model.final_norm(x), model.token_embedding.weight)


def _xpos_in_float64(
    enc: XPos, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """xPos's q zeta^(n / scale_base) and k zeta^(-m / scale_base), rotated, in float64,
    where one float32 table past its span would overflow (the model decays per block)."""
    q, k = Rope.rotary_tables(enc, positions).rotate(q, k)
    zeta, at = enc.zeta.double(), positions.double()
    return (
        scale_pairs(q.double(), decay_scale(zeta, at, enc.scale_base)),
        scale_pairs(k.double(), decay_scale(zeta, -at, enc.scale_base)),
    )
