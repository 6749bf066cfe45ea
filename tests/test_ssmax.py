"""SSMax (Nakanishi 2025): softmax((s log n) z) over the n keys a query sees, s learned per
layer and head, on RoPE. Pinned to the paper's formula by a dense reference of the
whole model (every path, gradients of s included, a sliding window's n), and by its
start: s = 1 / log L, plain softmax at the training length."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import loss_gradients

from core.spec import parse_spec
from worker.decode import decode_logits
from worker.layers import ModelConfig
from worker.model import Transformer, build_model

TINY = ModelConfig(d_model=32, n_layers=3, n_heads=2)
TRAIN = 32


def reference_logits(model: Transformer, tokens: torch.Tensor, window: int | None = None):
    """Each layer l: softmax(s_lh log n_i x q_i k_j / sqrt(d)) over the n_i keys query i
    sees (i + 1, or at most ``window``), RoPE-rotated q and k."""
    enc, config = model.encoding, model.config
    batch, length = tokens.shape
    positions = torch.arange(length)
    x = model.token_embedding(tokens) * math.sqrt(config.d_model)
    tables = enc.rotary_tables(positions)
    query, key = positions[:, None], positions[None, :]
    hidden = key > query
    seen = (positions + 1).float()
    if window is not None:
        hidden |= query - key >= window
        seen = seen.clamp(max=window)
    for layer, block in enumerate(model.blocks):
        attn = block.attn
        qkv = attn.qkv(block.attn_norm(x)).view(batch, length, 3, config.n_heads, -1)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        q, k = tables.rotate(q, k)
        z = q @ k.transpose(-1, -2) / math.sqrt(config.head_dim)  # [B, H, T, T]
        temperature = enc.s[layer][:, None, None] * seen.log()[None, :, None]  # [H, T, 1]
        y = torch.softmax((temperature * z).masked_fill(hidden, float("-inf")), -1) @ v
        x = x + attn.proj(y.transpose(1, 2).reshape(batch, length, -1))
        x = x + block.mlp(block.mlp_norm(x))
    return F.linear(model.final_norm(x), model.token_embedding.weight)


def _model(seed: int = 1, **params) -> Transformer:
    model = build_model(TINY, "ssmax", train_length=TRAIN, seed=seed, **params)
    with torch.no_grad():  # s away from its start, different per layer and head
        model.encoding.s.uniform_(0.1, 0.6, generator=torch.Generator().manual_seed(seed))
    return model


def _tokens(length: int) -> torch.Tensor:
    return torch.randint(0, 256, (2, length), generator=torch.Generator().manual_seed(5))


def test_s_is_one_per_layer_and_head_and_starts_at_plain_softmax_at_l() -> None:
    model = build_model(TINY, "ssmax", train_length=TRAIN)
    s = model.encoding.s
    assert s.shape == (TINY.n_layers, TINY.n_heads) and s.requires_grad
    torch.testing.assert_close(s, torch.full_like(s, 1 / math.log(TRAIN)))
    with torch.no_grad():
        factors = model.layer_factors(0, torch.arange(2 * TRAIN), None)
    assert factors.shape == (TINY.n_heads, 2 * TRAIN)
    assert float(factors[0, TRAIN - 1]) == pytest.approx(1.0)  # n = L: s log L = 1
    assert float(factors[0, 0]) == 0.0  # one key: log 1
    custom = build_model(TINY, "ssmax", train_length=TRAIN, init_s=0.43)
    torch.testing.assert_close(custom.encoding.s, torch.full_like(s, 0.43))


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("window", [None, 9])
def test_ssmax_equals_the_papers_formula(implementation: str, window: int | None) -> None:
    params = {} if window is None else {"window": window}
    model = _model(**params).eval()
    model.attn_implementation = implementation
    tokens = _tokens(3 * TRAIN)
    with torch.no_grad():
        torch.testing.assert_close(
            model(tokens), reference_logits(model, tokens, window), rtol=1e-5, atol=2e-5
        )


def test_the_gradient_reaches_s_as_in_the_reference() -> None:
    model = _model(seed=2).train()
    tokens = _tokens(TRAIN)
    grads = [
        loss_gradients(model, forward, tokens)["encoding.s"]
        for forward in (model, lambda t: reference_logits(model, t))
    ]
    assert float(grads[0].abs().min()) > 0  # every layer's and head's s learns
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-7)


def test_decoding_with_ssmax_equals_the_one_pass_forward() -> None:
    model = _model(seed=3).eval()
    tokens = _tokens(2 * TRAIN)
    with torch.no_grad():
        torch.testing.assert_close(
            decode_logits(model, tokens, 20), model(tokens), rtol=1e-4, atol=2e-5
        )


def test_a_rope_scaling_keeps_ssmax() -> None:
    model = _model(seed=4).eval()
    tokens = _tokens(2 * TRAIN)
    with torch.no_grad(), model.scaled("yarn", 2.0):
        scaled = model(tokens)
        assert model.encoding.name == "ssmax" and model.encoding.scaling is not None
    with torch.no_grad():
        assert not torch.allclose(scaled, model(tokens))
    spec = parse_spec(
        {
            "model": "tiny",
            "train": {"length": 32, "steps": 2},
            "encodings": [{"name": "ssmax", "init_s": 0.43}],
            "eval": {"lengths": [32, 64], "variants": ["none", "yarn:auto"]},
        }
    )
    assert spec.encodings[0].label == "ssmax(init_s=0.43)"
