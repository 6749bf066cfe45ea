"""Attention logit soft-capping (``model.attn_softcap``, Gemma 2): cap x tanh(logit / cap)
on every layer's logits, their bias included, before the mask and the softmax, as
x-transformers' ``softclamp_logits`` and transformers' Gemma 2 eager attention compute it.
Every path (written out, the block paths' fallback from SDPA, xPos's block decay, the KV
cache, the probe, FlexAttention's score_mod) against a dense reference."""

from __future__ import annotations

import pytest
import torch
from conftest import loss_gradients
from dense import dense_logits

from core.catalog.encodings import REGISTRY
from core.spec import SpecError, parse_spec
from worker.attention import choose, softcapped
from worker.decode import decode_logits
from worker.diagnostics import AttentionProbe
from worker.fused import FLEX_AVAILABLE
from worker.layers import ModelConfig
from worker.model import build_model

TINY = ModelConfig(d_model=32, n_layers=2, n_heads=2)
TRAIN = 32
CAP = 0.5  # small enough that the cap changes every logit of these random models
PLAIN = sorted(name for name, entry in REGISTRY.items() if not entry.recipe)


def _tokens(length: int) -> torch.Tensor:
    return torch.randint(0, 256, (2, length), generator=torch.Generator().manual_seed(4))


def test_softcapped_is_the_formula_and_keeps_hidden_keys_hidden() -> None:
    scores = torch.tensor([-1e9, -3.0, 0.0, 2.0, float("-inf")])
    capped = softcapped(scores, 2.0)
    torch.testing.assert_close(capped[:4], 2.0 * torch.tanh(scores[:4] / 2.0))
    assert capped[4] == float("-inf") and softcapped(scores, None) is scores


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("encoding", PLAIN)
def test_each_encoding_with_a_cap_equals_the_dense_reference(
    encoding: str, implementation: str
) -> None:
    length = TRAIN if encoding == "learned" else 3 * TRAIN
    model = build_model(TINY, encoding, train_length=TRAIN, seed=3, attn_softcap=CAP).eval()
    model.attn_implementation = implementation
    model.attention_score_budget = 2 * TINY.n_heads * length * 12  # query blocks of 12
    tokens = _tokens(length)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        fast = model(tokens)
        torch.manual_seed(0)
        reference = dense_logits(model, tokens, CAP)
    torch.testing.assert_close(fast, reference, rtol=1e-5, atol=2e-5)
    # SDPA has no cap: asked for, it ran written out, and said so.
    assert model.attention_ran["eval"] == ["eager"]


def test_the_cap_changes_the_model_and_trains_with_the_references_gradients() -> None:
    plain = build_model(TINY, "alibi", train_length=TRAIN, seed=5)
    capped = build_model(TINY, "alibi", train_length=TRAIN, seed=5, attn_softcap=CAP)
    tokens = _tokens(TRAIN)
    with torch.no_grad():
        assert not torch.allclose(plain(tokens), capped(tokens), atol=1e-3)
    grads = [
        loss_gradients(capped, forward, tokens)
        for forward in (capped, lambda t: dense_logits(capped, t, CAP))
    ]
    for name, grad in grads[0].items():
        torch.testing.assert_close(grad, grads[1][name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("encoding", ["rope", "alibi", "xpos", "t5"])
def test_decoding_with_a_cap_equals_the_one_pass_forward(encoding: str) -> None:
    model = build_model(TINY, encoding, train_length=TRAIN, seed=6, attn_softcap=CAP).eval()
    tokens = _tokens(2 * TRAIN)
    with torch.no_grad():
        torch.testing.assert_close(
            decode_logits(model, tokens, 20), model(tokens), rtol=1e-4, atol=2e-5
        )


def test_the_probe_writes_out_the_capped_logits() -> None:
    """The probe's largest logit never exceeds the cap: it records what the softmax saw."""
    model = build_model(TINY, "nope", train_length=TRAIN, seed=7, attn_softcap=CAP).eval()
    probe = AttentionProbe(TRAIN)
    model.probe = probe
    with torch.no_grad():
        model(_tokens(2 * TRAIN))
    model.probe = None
    assert probe.result().summary()["max_logit"] <= CAP


def test_flex_carries_the_cap_in_its_score_mod() -> None:
    """On CUDA auto picks flex for a capped model; on the CPU the cap is written out; SDPA
    asked for runs written out with a note, never silently uncapped. The pass's score_mod
    is cap x tanh((score + bias) / cap)."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    common = {"has_bias": False, "fusable": False, "backward": False, "softcap": True}
    if FLEX_AVAILABLE:  # torch >= 2.5
        assert choose("auto", device=cuda, **common).implementation == "flex_attention"
    assert choose("auto", device=cpu, **common).implementation == "eager"
    sdpa = choose("sdpa", device=cpu, **common)
    assert sdpa.implementation == "eager" and "no SDPA form" in sdpa.note
    model = build_model(
        TINY, "alibi", train_length=TRAIN, attn_softcap=CAP, attn_implementation="flex_attention"
    )
    with torch.no_grad():  # evaluation: flex on the CPU too
        kernel = model.attention_kernel(1, TRAIN, cpu, torch.float32)
    assert kernel.implementation == "flex_attention"
    heads = torch.arange(TINY.n_heads)[:, None, None]
    queries, keys = torch.arange(TRAIN)[:, None], torch.arange(TRAIN)[None, :]
    score = torch.randn(TINY.n_heads, TRAIN, TRAIN, generator=torch.Generator().manual_seed(2))
    got = kernel.score_mod(score, torch.tensor(0), heads, queries, keys)
    bias = model.encoding.bias(TRAIN, TRAIN)
    visible = torch.ones(TRAIN, TRAIN, dtype=torch.bool).tril()
    expected = CAP * torch.tanh((score + bias) / CAP)
    torch.testing.assert_close(got[:, visible], expected[:, visible], rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # compiles FlexAttention (about a minute on the CPU)
def test_flex_with_a_cap_equals_the_reference() -> None:
    model = build_model(TINY, "alibi", train_length=TRAIN, seed=8, attn_softcap=CAP).eval()
    model.attn_implementation = "flex_attention"
    tokens = _tokens(2 * TRAIN)[:1]
    with torch.no_grad():
        fused = model(tokens)
        reference = dense_logits(model, tokens, CAP)
    assert model.attention_ran["eval"] == ["flex_attention"]
    torch.testing.assert_close(fused, reference, rtol=1e-5, atol=2e-5)


def test_a_bad_cap_is_refused_in_one_line_and_a_cap_enters_the_hash() -> None:
    base = {"train": {"length": 32, "steps": 2}, "encodings": ["rope"]}
    for value, wording in ((0, "greater than 0"), (-1.0, "greater than 0"), ("big", "number")):
        with pytest.raises(SpecError) as refused:
            parse_spec({**base, "model": {"preset": "tiny", "attn_softcap": value}})
        assert "attn_softcap" in str(refused.value) and wording in str(refused.value)
    plain = parse_spec({**base, "model": "tiny"})
    capped = parse_spec({**base, "model": {"preset": "tiny", "attn_softcap": 50}})
    assert plain.model.identity() == {"d_model": 64, "n_layers": 2, "n_heads": 4}
    encoding = plain.encodings[0]
    assert plain.train_hash(encoding, 0) != capped.train_hash(encoding, 0)
