"""FoPE (Hua et al. 2024, arXiv:2412.17739) against its formula and the authors' form of it.

The reference below is written from the authors' FourierEmbedding (their OLMo fork) and
vLLM's FourierRotaryEmbedding, which agree: frequencies below 2 pi / L dropped, cos and
sin caches as einsum("htD,hDd->thd") of RoPE's over the kept frequencies with per-head
matrices, both caches padded with ones to head_dim / 2 and repeated for the two halves,
then ``x cos + rotate_half(x) sin`` for queries and keys alike."""

from __future__ import annotations

import math

import pytest
import torch
from dense import dense_logits

from core.spec import SpecError, parse_spec
from tests.test_evaluate import run_here
from worker.encodings import build
from worker.encodings.fope import FoPE, FourierLayer, harmonic_std, kept_frequencies
from worker.layers import ModelConfig
from worker.model import build_model

TINY = ModelConfig(d_model=64, n_layers=3, n_heads=4)  # head_dim 16
TRAIN = 64


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def authors_fope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos_coef: torch.Tensor,
    sin_coef: torch.Tensor,
    base: float,
    train_length: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k ``[B, H, T, D]`` at positions 0..T-1, in float64, as the authors compute it."""
    head_dim, length = q.shape[-1], q.shape[-2]
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    inv_freq = inv_freq[inv_freq >= 2 * math.pi / train_length]
    t = torch.arange(length, dtype=torch.float64)
    freqs = torch.einsum("t,d->td", t, inv_freq)
    heads = cos_coef.shape[0]
    pos_cos = freqs.cos().expand(heads, -1, -1)
    pos_sin = freqs.sin().expand(heads, -1, -1)
    cos = torch.einsum("htD,hDd->htd", pos_cos, cos_coef.double())
    sin = torch.einsum("htD,hDd->htd", pos_sin, sin_coef.double())
    pad = head_dim // 2 - cos.shape[-1]
    cos = torch.nn.functional.pad(cos, (0, pad), value=1.0)
    sin = torch.nn.functional.pad(sin, (0, pad), value=1.0)
    cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    q, k = q.double(), k.double()
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def _dims(train_length: int = TRAIN, heads: int = 4, head_dim: int = 16) -> dict[str, int]:
    return {
        "n_heads": heads,
        "head_dim": head_dim,
        "d_model": heads * head_dim,
        "train_length": train_length,
    }


def test_each_layer_equals_the_authors_fope_on_the_same_coefficients() -> None:
    model = build_model(TINY, "fope", train_length=TRAIN, seed=3, sigma=0.6)
    layers = model.encoding.kinds
    assert len(layers) == TINY.n_layers and model.layer_kinds == [0, 1, 2]
    generator = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 4, 3 * TRAIN, 16, generator=generator) for _ in range(2))
    for layer in layers:
        assert layer.kept == 3  # w = 1, 0.316, 0.1 >= 2 pi / 64 = 0.098; 0.0316 is not
        ours = layer.rotary_tables(torch.arange(3 * TRAIN)).rotate(q, k)
        theirs = authors_fope(q, k, layer.cos_coef, layer.sin_coef, 10000.0, TRAIN)
        for a, b in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)
    # Each layer draws its own harmonics; the same seed draws the same ones.
    assert not torch.equal(layers[0].cos_coef, layers[1].cos_coef)
    again = build_model(TINY, "fope", train_length=TRAIN, seed=3, sigma=0.6).encoding.kinds
    other = build_model(TINY, "fope", train_length=TRAIN, seed=4, sigma=0.6).encoding.kinds
    assert all(torch.equal(a.sin_coef, b.sin_coef) for a, b in zip(layers, again, strict=True))
    assert not torch.equal(layers[0].sin_coef, other[0].sin_coef)


def test_the_floor_keeps_the_frequencies_that_complete_a_period() -> None:
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16)
    for length in (7, 64, 512, 20000):
        keep = kept_frequencies(inv_freq, length)
        periods = 2 * math.pi / inv_freq
        assert torch.equal(keep, periods <= length), length
    # The shortest training length a spec allows (8) keeps RoPE's fastest pair (period
    # 2 pi): FoPE never clips every frequency.
    with pytest.raises(SpecError, match=r"train\.length = 6: must be greater than or equal to 8"):
        parse_spec({"model": "tiny", "train": {"length": 6}, "encodings": ["fope"]})
    assert kept_frequencies(inv_freq, 8).sum() == 1


def test_sigma_zero_with_nothing_clipped_is_rope_bit_for_bit() -> None:
    long = 20000  # the slowest of 8 pairs (period 19,869 tokens) completes a period
    tokens = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    fope = build_model(TINY, "fope", train_length=long, seed=2, sigma=0.0).eval()
    rope = build_model(TINY, "rope", train_length=long, seed=2).eval()
    assert fope.encoding.kinds[0].kept == 8
    with torch.no_grad():
        assert torch.equal(fope(tokens), rope(tokens))


def test_the_clipped_pairs_carry_no_position() -> None:
    layer = FourierLayer(sigma=0.3, generator=torch.Generator().manual_seed(0), **_dims())
    clipped = slice(layer.kept, 8)  # pairs (j, j + 8) for j >= kept
    generator = torch.Generator().manual_seed(1)
    q, k = (torch.randn(1, 4, 100, 16, generator=generator) for _ in range(2))
    rq, rk = layer.rotary_tables(torch.arange(100)).rotate(q, k)

    def part(x: torch.Tensor) -> torch.Tensor:
        return torch.cat((x[..., clipped], x[..., 8:][..., clipped]), -1)

    # At every position, twice the plain product (a fixed 45-degree turn times sqrt 2).
    torch.testing.assert_close((part(rq) * part(rk)).sum(-1), 2 * (part(q) * part(k)).sum(-1))


def test_the_harmonics_have_the_authors_spread() -> None:
    layer = FourierLayer(
        sigma=0.6, generator=torch.Generator().manual_seed(0), **_dims(4096, 16, 128)
    )
    heads, kept = 16, layer.kept
    assert kept == int((2 * math.pi / layer.inv_freq <= 4096).sum())
    eye = torch.eye(kept, dtype=torch.bool).expand(heads, kept, kept)
    for coef in (layer.cos_coef, layer.sin_coef):
        noise = torch.where(eye, coef - 1.0, coef)
        std = harmonic_std(0.6, heads, kept)
        assert std == pytest.approx(0.6 * math.sqrt(2 / (kept * kept + heads * kept)))
        assert noise.std().item() == pytest.approx(std, rel=0.1)
        assert noise.mean().abs().item() < std / 5


def test_a_checkpoint_carries_the_harmonics() -> None:
    tokens = torch.randint(0, 256, (2, 96), generator=torch.Generator().manual_seed(2))
    trained = build_model(TINY, "fope", train_length=TRAIN, seed=5).eval()
    restored = build_model(TINY, "fope", train_length=TRAIN, seed=6).eval()
    assert any("kinds.2.cos_coef" in key for key in trained.state_dict())
    restored.load_state_dict(trained.state_dict())
    with torch.no_grad():
        assert torch.equal(trained(tokens), restored(tokens))
        torch.testing.assert_close(trained(tokens), dense_logits(trained, tokens))


def test_a_scaling_moves_the_kept_frequencies_of_every_layer() -> None:
    encoding = build("fope", **_dims())
    assert isinstance(encoding, FoPE)
    encoding.bind_layers(2)
    scaled = encoding.with_scaling("pi", 4.0)
    positions = torch.arange(200)
    for plain, pi in zip(encoding.kinds, scaled.kinds, strict=True):
        assert torch.equal(plain.cos_coef, pi.cos_coef) and pi.kept == plain.kept
        # PI: position n reads the phases of n / 4.
        quarter = plain.rotary_tables(positions.float() / 4)
        torch.testing.assert_close(pi.rotary_tables(positions).cos_q, quarter.cos_q)
    assert encoding.kinds[0].scaling is None  # the trained encoding is unchanged


def test_a_fope_study_trains_and_evaluates_finite_curves() -> None:
    spec = parse_spec(
        {
            "model": {"d_model": 32, "n_layers": 2, "n_heads": 2},
            "train": {"length": 16, "steps": 6, "batch_size": 4},
            "encodings": [{"name": "fope", "sigma": 0.4}],
            "eval": {
                "lengths": [16, 32, 64, 128],
                "tokens": 512,
                "variants": ["none", "yarn:auto"],
                "diagnostics": True,
            },
        }
    )
    (run,) = spec.runs()
    evaluations = run_here(spec, run).evaluations
    assert {e.length for e in evaluations} == {16, 32, 64, 128}
    assert {e.variant for e in evaluations} == {"none", "yarn:auto"}
    assert all(math.isfinite(e.loss) for e in evaluations)
