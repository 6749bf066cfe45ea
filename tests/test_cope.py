"""CoPE (Golovneva et al. 2024, arXiv:2405.18719) against x-transformers' CoPE on the same
weights, the whole model against the dense reference, and through every path a study
takes (training, evaluation, the KV cache, the probe)."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
from conftest import loss_gradients
from dense import dense_logits
from x_transformers.attend import Attend
from x_transformers.x_transformers import CoPE as TheirCoPE

from core.spec import parse_spec
from tests.test_evaluate import run_here
from worker.attention import LogitTerms, causal_attention
from worker.decode import decode_logits
from worker.encodings import build
from worker.layers import ModelConfig
from worker.model import build_model

TINY = ModelConfig(d_model=32, n_layers=2, n_heads=2)
TRAIN = 32


def _qkv(length: int, heads: int = 2, dim: int = 16, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(2, heads, length, dim, generator=generator) for _ in range(3)]


@pytest.mark.parametrize("max_pos", [4, 16, 64])
def test_one_layer_equals_x_transformers_cope_with_its_gradients(max_pos: int) -> None:
    ours = build("cope", n_heads=2, head_dim=16, d_model=32, train_length=TRAIN, max_pos=max_pos)
    theirs = TheirCoPE(dim=16, heads=2, max_pos=max_pos)
    with torch.no_grad():
        table = torch.randn(max_pos, 16, generator=torch.Generator().manual_seed(1))
        ours.pos_emb.copy_(table[None])
        theirs.pos_emb.copy_(table)
    attend = Attend(causal=True, cope=theirs)
    q, k, v = (t.requires_grad_() for t in _qkv(40))
    expected, _ = attend(q, k, v)
    terms = LogitTerms(contextual=partial(ours.contextual, 0))
    # One block of queries, and blocks of 7 (each over the keys it reaches).
    got = causal_attention(q, k, v, written=True, terms=terms)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    ours_grad = torch.autograd.grad(got.square().sum(), (q, k, v, ours.pos_emb))
    their_grad = torch.autograd.grad(expected.square().sum(), (q, k, v, theirs.pos_emb))
    for a, b in zip(ours_grad[:3], their_grad[:3], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ours_grad[3][0], their_grad[3], rtol=1e-4, atol=1e-5)


def test_positions_are_counted_gates_clamped_to_the_table() -> None:
    enc = build("cope", n_heads=1, head_dim=2, d_model=2, train_length=TRAIN, max_pos=3)
    with torch.no_grad():  # e[p] = (p, 0): the term reads the position back (q = (1, 0))
        enc.pos_emb.copy_(torch.tensor([[[0.0, 0.0], [1.0, 0.0], [2.0, 0.0]]]))
    q = torch.tensor([[[[1.0, 0.0]]]])
    # One query, four keys: gates sigmoid(0) = 1/2 each, the last key hidden (-inf).
    scores = torch.tensor([[[[0.0, 0.0, 0.0, float("-inf")]]]])
    term = enc.contextual(0, q, scores)
    # Positions from each key to the end: 1.5, 1.0, 0.5, 0 -> clamped at max_pos - 1 = 2.
    torch.testing.assert_close(term[0, 0, 0], torch.tensor([1.5, 1.0, 0.5, 0.0]))
    loud = torch.full((1, 1, 1, 6), 30.0)  # every gate open: 6, 5, ... clamped to 2
    assert enc.contextual(0, q, loud)[0, 0, 0].tolist() == [2.0, 2.0, 2.0, 2.0, 2.0, 1.0]


def _model(seed: int = 3, **params) -> torch.nn.Module:
    model = build_model(TINY, "cope", train_length=TRAIN, seed=seed, max_pos=16, **params)
    with torch.no_grad():  # away from zero (a fresh table is NoPE), different per layer
        model.encoding.pos_emb.normal_(generator=torch.Generator().manual_seed(seed))
    return model


def test_the_model_equals_the_dense_reference_on_every_path() -> None:
    model = _model().eval()
    assert model.encoding.pos_emb.shape == (TINY.n_layers, 16, TINY.head_dim)
    tokens = torch.randint(0, 256, (2, 3 * TRAIN), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        reference = dense_logits(model, tokens)
        for implementation in ("auto", "sdpa", "eager"):
            model.attn_implementation = implementation
            torch.testing.assert_close(model(tokens), reference, rtol=1e-5, atol=2e-5)
        assert set(model.attention_ran["eval"]) == {"eager"}
        model.attention_score_budget = 2 * TINY.n_heads * 3 * TRAIN * 8  # query blocks
        torch.testing.assert_close(model(tokens), reference, rtol=1e-5, atol=2e-5)
        cached = decode_logits(model, tokens, prompt=40)
        torch.testing.assert_close(cached, reference, rtol=1e-4, atol=1e-4)
    grads = [
        loss_gradients(model.train(), forward, tokens[:, :TRAIN])
        for forward in (model, lambda t: dense_logits(model, t))
    ]
    assert "encoding.pos_emb" in grads[0]
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-4, atol=1e-6)


def test_a_fresh_cope_is_nope_and_a_window_applies() -> None:
    tokens = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(5))
    fresh = build_model(TINY, "cope", train_length=TRAIN, seed=2).eval()
    nope = build_model(TINY, "nope", train_length=TRAIN, seed=2).eval()
    windowed = _model(window=8).eval()
    with torch.no_grad():
        torch.testing.assert_close(fresh(tokens), nope(tokens), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(windowed(tokens), dense_logits(windowed, tokens))


def test_a_cope_study_trains_and_evaluates_finite_curves() -> None:
    spec = parse_spec(
        {
            "model": {"d_model": 32, "n_layers": 2, "n_heads": 2},
            "train": {"length": 16, "steps": 6, "batch_size": 4},
            "encodings": [{"name": "cope", "max_pos": 16}],
            "eval": {"lengths": [16, 32, 64, 128], "tokens": 512, "diagnostics": True},
        }
    )
    (run,) = spec.runs()
    evaluations = run_here(spec, run).evaluations
    assert [e.length for e in evaluations] == [16, 32, 64, 128]
    assert all(math.isfinite(e.loss) for e in evaluations)
