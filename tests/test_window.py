"""Sliding-window attention (every encoding's ``window`` parameter): each query attends to
itself and the ``window - 1`` keys before it, on every layer, on every attention path.

The reference is the model's forward written out densely: every score of the sequence,
the encoding's bias over the whole square, and the causal and window masks as one
matrix (Longformer's and Mistral's sliding window; Beltagy et al. 2020, Jiang et al.
2023). The fast paths (SDPA in query blocks that read only the keys their window
reaches, the written-out blocks, xPos's block decay, the KV cache) are held to it."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import loss_gradients
from dense import dense_logits

from core.catalog.encodings import REGISTRY, WINDOW
from core.catalog.params import EncodingConfigError
from core.spec import SpecError, parse_spec
from tests.test_evaluate import run_here
from worker.decode import decode_logits
from worker.encodings import build
from worker.layers import ModelConfig
from worker.model import build_model
from worker.reach import Reach

TINY = ModelConfig(d_model=32, n_layers=2, n_heads=2)
# One encoding in every layer; the recipes' layers are held to theirs in test_recipes.py.
PLAIN = sorted(name for name, entry in REGISTRY.items() if not entry.recipe)
TRAIN = 32


def _tokens(length: int, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(1))


def test_visible_keys_are_the_window_before_each_query() -> None:
    seen = Reach(window=3).visible(5, 9, torch.device("cpu"))  # queries 5..8 over keys 3..8
    assert Reach(window=3).first_key(5) == 3 and seen.shape == (4, 6)
    expected = [[q - 3 < j + 3 <= q for j in range(6)] for q in range(5, 9)]
    assert seen.tolist() == [[bool(x) for x in row] for row in expected]
    assert Reach(window=8).first_key(2) == 0 and Reach().first_key(7) == 0
    assert Reach(window=3).keys_seen(torch.arange(5)).tolist() == [1, 2, 3, 3, 3]


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("encoding", PLAIN)
def test_each_encoding_with_a_window_equals_the_dense_reference(
    encoding: str, implementation: str
) -> None:
    """Forward with a window of 7 keys, in query blocks of 12 rows (each reading only the
    keys its window reaches), equals the dense reference on every path."""
    length = TRAIN if encoding == "learned" else 3 * TRAIN
    model = build_model(TINY, encoding, train_length=TRAIN, seed=2, window=7).eval()
    model.attn_implementation = implementation
    model.attention_score_budget = 2 * TINY.n_heads * length * 12
    if encoding == "xpos":
        model.encoding.table_span = 32  # past it: xPos's per-block decay path
    tokens = _tokens(length)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        fast = model(tokens)
        torch.manual_seed(0)
        reference = dense_logits(model, tokens)
    torch.testing.assert_close(fast, reference, rtol=1e-5, atol=2e-5)


@pytest.mark.slow  # compiles FlexAttention for two shapes (a minute each on the CPU)
@pytest.mark.parametrize("encoding", ["nope", "alibi"])
def test_flex_skips_the_tiles_outside_the_window_and_equals_the_reference(encoding: str) -> None:
    """The fused kernel's block mask carries the window: evaluation on the CPU (forward
    only there) equals the dense reference, with and without a bias."""
    model = build_model(TINY, encoding, train_length=TRAIN, seed=7, window=11).eval()
    model.attn_implementation = "flex_attention"
    tokens = _tokens(4 * TRAIN, batch=1)
    with torch.no_grad():
        fused = model(tokens)
        reference = dense_logits(model, tokens)
    assert model.attention_ran["eval"] == ["flex_attention"]
    torch.testing.assert_close(fused, reference, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("encoding", ["rope", "t5", "fire"])
def test_training_gradients_with_a_window_equal_the_reference(encoding: str) -> None:
    """The training path (a learned bias written out on the CPU, SDPA otherwise) gives
    the reference's gradients, the encoding's own parameters included."""
    model = build_model(TINY, encoding, train_length=TRAIN, seed=4, window=5).train()
    tokens = _tokens(TRAIN)
    grads = [
        loss_gradients(model, forward, tokens)
        for forward in (model, lambda t: dense_logits(model, t))
    ]
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-4, atol=1e-6)


def test_a_window_at_least_the_length_changes_no_number() -> None:
    """A window that reaches every key is the plain causal model, bit for bit."""
    tokens = _tokens(48)
    for encoding in ("nope", "alibi", "rope"):
        plain = build_model(TINY, encoding, train_length=TRAIN, seed=5).eval()
        wide = build_model(TINY, encoding, train_length=TRAIN, seed=5, window=48).eval()
        with torch.no_grad():
            assert torch.equal(plain(tokens), wide(tokens)), encoding


def test_the_receptive_field_is_layers_times_the_window() -> None:
    """Through L layers of window W a token reaches L x (W - 1) positions ahead and no
    further: changing token 0 changes exactly the logits at positions 0..L(W-1)."""
    window, layers = 6, TINY.n_layers
    model = build_model(TINY, "nope", train_length=TRAIN, window=window).eval()
    tokens = _tokens(40)
    changed = tokens.clone()
    changed[:, 0] = (changed[:, 0] + 1) % 256
    with torch.no_grad():
        moved = (model(changed) - model(tokens)).abs().amax(dim=(0, 2))
    reach = layers * (window - 1)
    assert bool((moved[: reach + 1] > 0).all())
    assert float(moved[reach + 1 :].max()) == 0.0


@pytest.mark.parametrize("encoding", ["rope", "alibi", "xpos", "t5"])
def test_decoding_with_the_cache_follows_the_trained_window(encoding: str) -> None:
    """The KV cache masks the keys past each layer's window by their true distance: one
    token at a time equals the one-pass forward, past the training length too."""
    model = build_model(TINY, encoding, train_length=TRAIN, seed=6, window=9).eval()
    tokens = _tokens(2 * TRAIN)
    with torch.no_grad():
        torch.testing.assert_close(
            decode_logits(model, tokens, 20), model(tokens), rtol=1e-4, atol=2e-5
        )


def test_the_window_is_checked_where_it_is_given() -> None:
    assert WINDOW in REGISTRY["rope"].all_params and WINDOW not in REGISTRY["rope"].params
    with pytest.raises(ValueError, match="window"):
        build_model(TINY, "rope", train_length=TRAIN, window=0)
    with pytest.raises(EncodingConfigError, match="the model's attention"):
        build("rope", n_heads=2, head_dim=16, d_model=32, train_length=TRAIN, window=4)
    with pytest.raises(EncodingConfigError, match="sliding window"):
        REGISTRY["rope"].hf_rotary({"base": 10000.0, "window": 8}, 16, TRAIN)


def _spec(encoding: object) -> dict:
    return {"model": "tiny", "train": {"length": 32, "steps": 2}, "encodings": [encoding]}


@pytest.mark.parametrize(
    ("window", "wording"),
    [
        (0, "rope: parameter 'window' must be int in [1, 4194304], got 0"),
        (-3, "rope: parameter 'window' must be int in [1, 4194304], got -3"),
        (2.5, "rope: parameter 'window' must be an integer (int in [1, 4194304]), got 2.5"),
        ("wide", "rope: parameter 'window' must be an integer (int in [1, 4194304])"),
    ],
)
def test_a_bad_window_is_refused_in_one_line_naming_the_field(window: object, wording: str) -> None:
    with pytest.raises(SpecError) as refused:
        parse_spec(_spec({"name": "rope", "params": {"window": window}}))
    message = str(refused.value)
    assert wording in message and "\n" not in message.strip()


def test_a_window_enters_the_label_and_the_hash_only_when_set() -> None:
    """An unset window keeps every earlier run's parameters and hash (they are reused);
    a set one is part of what the model is."""
    plain, windowed = (
        parse_spec(_spec(encoding)) for encoding in ("rope", {"name": "rope", "window": 16})
    )
    (plain_encoding,), (windowed_encoding,) = plain.encodings, windowed.encodings
    assert plain_encoding.resolved_params == {"base": 10000.0, "rotary_fraction": 1.0}
    assert windowed_encoding.resolved_params["window"] == 16
    assert windowed_encoding.label == "rope(window=16)"
    assert plain.train_hash(plain_encoding, 0) != windowed.train_hash(windowed_encoding, 0)


def test_a_study_with_windowed_encodings_trains_and_evaluates_finite_curves() -> None:
    """A run of a spec with a window on a bias, a rotary and a position-free encoding:
    trained on the CPU, every point finite at 1x to 8x, with diagnostics on."""
    spec = parse_spec(
        {
            "model": "tiny",
            "train": {"length": 16, "steps": 6, "batch_size": 4},
            "encodings": [
                {"name": "alibi", "window": 6},
                {"name": "rope", "window": 6},
                {"name": "nope", "window": 6},
            ],
            "eval": {
                "lengths": [16, 32, 64, 128],
                "tokens": 512,
                "protocols": ["nonoverlapping"],
                "diagnostics": True,
            },
        }
    )
    for run in spec.runs():
        assert run.encoding.label.endswith("(window=6)")
        evaluations = run_here(spec, run).evaluations
        assert [e.length for e in evaluations] == [16, 32, 64, 128]
        assert all(e.loss is not None and math.isfinite(e.loss) for e in evaluations)
