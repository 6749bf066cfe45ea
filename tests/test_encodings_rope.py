"""RoPE, xPos and the inference-time scalings: formulas, properties and x-transformers."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from conftest import dims
from hypothesis import given, settings
from hypothesis import strategies as st
from x_transformers.x_transformers import RotaryEmbedding, apply_rotary_pos_emb

from worker.attention import decayed_attention
from worker.encodings import EncodingConfigError, build
from worker.encodings.rope import yarn_attention_factor
from worker.encodings.rotary import rotate_pairs
from worker.encodings.xpos import xpos_zeta
from worker.layers import ModelConfig
from worker.model import build_model


def to_interleaved(x: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """Our rotate-half layout (pairs j, j + r/2) -> GPT-J's interleaved pairs (2j, 2j+1)."""
    first, second = x[..., : rotary_dim // 2], x[..., rotary_dim // 2 : rotary_dim]
    paired = torch.stack((first, second), dim=-1).flatten(-2)
    return torch.cat((paired, x[..., rotary_dim:]), dim=-1)


def test_rope_rotates_pairs_by_position_times_frequency_by_hand() -> None:
    # head_dim 4: frequencies 1 and 10000^(-1/2) = 0.01; pairs are (0, 2) and (1, 3).
    rope = build("rope", n_heads=1, head_dim=4, d_model=4, train_length=8)
    q = torch.tensor([1.0, 0.0, 0.0, 1.0]).view(1, 1, 1, 4).repeat(1, 1, 3, 1)
    rotated, _ = rope.rotate(q, q, torch.arange(3))
    for m in range(3):
        a, b = m * 1.0, m * 0.01
        # pair (x0, x2) = (1, 0) -> (cos a, sin a); pair (x1, x3) = (0, 1) -> (-sin b, cos b)
        expected = torch.tensor([math.cos(a), -math.sin(b), math.sin(a), math.cos(b)])
        torch.testing.assert_close(rotated[0, 0, m], expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("fraction", [0.25, 0.5, 1.0])
def test_rope_matches_x_transformers_up_to_the_pair_convention(fraction: float) -> None:
    head_dim, length = 32, 200
    rope = build("rope", rotary_fraction=fraction, **dims(head_dim=head_dim))
    rotary_dim = rope.rotary_dim
    assert rotary_dim == int(head_dim * fraction)
    q, k = torch.randn(2, 4, length, head_dim), torch.randn(2, 4, length, head_dim)
    ours_q, ours_k = rope.rotate(q, k, torch.arange(length))
    reference = RotaryEmbedding(rotary_dim)
    freqs, _ = reference.forward_from_seq_len(length)
    theirs_q = apply_rotary_pos_emb(to_interleaved(q, rotary_dim), freqs)
    torch.testing.assert_close(to_interleaved(ours_q, rotary_dim), theirs_q, atol=1e-5, rtol=0)
    # Partial rotary: the dimensions past the rotated ones pass through untouched.
    torch.testing.assert_close(ours_k[..., rotary_dim:], k[..., rotary_dim:])


@settings(max_examples=50, deadline=None)
@given(
    m=st.integers(0, 5000),
    n=st.integers(0, 5000),
    shift=st.integers(0, 5000),
    seed=st.integers(0, 2**16),
)
def test_rope_dot_product_depends_only_on_the_offset(m: int, n: int, shift: int, seed: int) -> None:
    rope = build("rope", n_heads=1, head_dim=32, d_model=32, train_length=64)
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 1, 1, 32, generator=generator, dtype=torch.float64).float()
    k = torch.randn(1, 1, 1, 32, generator=generator, dtype=torch.float64).float()

    def logit(query_pos: int, key_pos: int) -> float:
        rq, _ = rope.rotate(q, q, torch.tensor([query_pos]))
        rk, _ = rope.rotate(k, k, torch.tensor([key_pos]))
        return float((rq * rk).sum())

    assert logit(m, n) == pytest.approx(logit(m + shift, n + shift), abs=2e-3)


def test_rope_phases_stay_float32_under_bf16_autocast() -> None:
    rope = build("rope", **dims())
    q = torch.randn(1, 4, 8, 16)
    positions = torch.arange(10_000, 10_008)
    exact, _ = rope.rotate(q, q, positions)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert rope.phases(positions).dtype == torch.float32
        under_autocast, _ = rope.rotate(q, q, positions)
    torch.testing.assert_close(under_autocast, exact)


def test_xpos_decay_constants() -> None:
    # zeta_j = (2j/r + 0.4) / 1.4 for r = 8: 0.4/1.4, 0.65/1.4, 0.9/1.4, 1.15/1.4
    expected = torch.tensor([0.4, 0.65, 0.9, 1.15]) / 1.4
    torch.testing.assert_close(xpos_zeta(8), expected)


def test_xpos_matches_x_transformers_logits() -> None:
    head_dim, length = 32, 100
    xpos = build("xpos", scale_base=64.0, **dims(head_dim=head_dim))
    q, k = torch.randn(1, 4, length, head_dim), torch.randn(1, 4, length, head_dim)
    ours_q, ours_k = xpos.rotate(q, k, torch.arange(length))
    reference = RotaryEmbedding(head_dim, use_xpos=True, scale_base=64)
    freqs, scale = reference.forward_from_seq_len(length)
    theirs_q = apply_rotary_pos_emb(to_interleaved(q, head_dim), freqs, scale)
    theirs_k = apply_rotary_pos_emb(to_interleaved(k, head_dim), freqs, scale**-1)
    # The centring differs by at most one position, which cancels in q.k.
    torch.testing.assert_close(
        ours_q @ ours_k.transpose(-1, -2),
        theirs_q @ theirs_k.transpose(-1, -2),
        atol=1e-3,
        rtol=1e-4,
    )


def test_xpos_logit_decays_with_distance_like_zeta_power() -> None:
    xpos = build("xpos", n_heads=1, head_dim=2, d_model=2, train_length=8, scale_base=4.0)
    q = torch.tensor([1.0, 0.0]).view(1, 1, 1, 2).repeat(1, 1, 9, 1)
    rq, rk = xpos.rotate(q, q, torch.arange(9))
    logits = (rq @ rk.transpose(-1, -2))[0, 0]
    zeta = 0.4 / 1.4
    # head_dim 2: one pair with frequency 1, so q.k = zeta^((n-m)/4) cos(n - m)
    for n, m in [(8, 0), (5, 3), (4, 4)]:
        assert float(logits[n, m]) == pytest.approx(
            zeta ** ((n - m) / 4) * math.cos(n - m), rel=1e-4
        )


def test_xpos_stays_finite_at_long_lengths() -> None:
    xpos = build("xpos", **dims(head_dim=32))
    q = torch.randn(1, 4, 32_768, 32)
    rq, rk = xpos.rotate(q, q, torch.arange(32_768))
    assert torch.isfinite(rq).all() and torch.isfinite(rk).all()


def test_xpos_applies_its_decay_per_query_block_past_one_tables_span() -> None:
    # scale_base 8 makes the span small: one table of 1500 positions would need
    # zeta_0^(-750 / 8) = e^117, past float32's e^88.7.
    xpos = build("xpos", n_heads=2, head_dim=8, d_model=16, train_length=64, scale_base=8.0)
    length = 1500
    assert xpos.table_span < length
    positions = torch.arange(length)
    assert not torch.isfinite(xpos.decay(positions) ** -1).all()  # the one-table way
    tables = xpos.rotary_tables(positions)
    assert tables.decay is not None
    with pytest.raises(ValueError, match="block by block"):
        tables.rotate(torch.zeros(1, 2, length, 8), torch.zeros(1, 2, length, 8))
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, length, 8, generator=generator) for _ in range(3))
    rq = rotate_pairs(q, tables.cos_q, tables.sin_q)
    rk = rotate_pairs(k, tables.cos_k, tables.sin_k)
    ours = decayed_attention(rq, rk, v, replace(tables.decay, max_rows=256))
    # Reference in float64, where one table centred on the sequence fits (e^59 each way):
    # logits q_n . k_m zeta^((n - m) / 8) by the paper's formula.
    scale = xpos.zeta.double() ** ((positions.double() - length // 2) / 8.0)[:, None]
    wide_q, wide_k = rq.double().clone(), rk.double().clone()
    for wide, sign in ((wide_q, 1), (wide_k, -1)):
        wide[..., :4] *= scale**sign
        wide[..., 4:] *= scale**sign
    reference = F.scaled_dot_product_attention(wide_q, wide_k, v.double(), is_causal=True)
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours.double(), reference, rtol=1e-4, atol=1e-5)


def test_an_xpos_model_past_one_tables_span_agrees_with_its_prefix() -> None:
    # Causal: a prefix short enough for one table must give the same outputs as the
    # long sequence evaluated in decay blocks.
    config = ModelConfig(d_model=16, n_layers=2, n_heads=2, vocab_size=32)
    model = build_model(config, "xpos", train_length=64, scale_base=8.0).eval()
    span = model.encoding.table_span
    tokens = torch.randint(0, 32, (2, span + 300))
    model.attention_score_budget = 2 * 2 * (span + 300) * 200  # blocks of 200 queries
    with torch.no_grad():
        whole = model(tokens)
        prefix = model(tokens[:, :span])
    assert torch.isfinite(whole).all()
    torch.testing.assert_close(whole[:, :span], prefix, rtol=1e-4, atol=1e-4)


# -- inference-time scalings -------------------------------------------------------------


def test_pi_divides_positions_by_the_factor() -> None:
    rope = build("rope", **dims())
    q = torch.randn(1, 4, 1, 16)
    pi = rope.with_scaling("pi", 4.0)
    torch.testing.assert_close(
        pi.rotate(q, q, torch.tensor([8]))[0], rope.rotate(q, q, torch.tensor([2]))[0]
    )
    # x-transformers calls the same thing interpolation_factor.
    theirs = RotaryEmbedding(16, interpolation_factor=4.0).forward(torch.arange(8))[0]
    torch.testing.assert_close(pi.phases(torch.arange(8)), theirs[0, :, 0::2])


def test_ntk_multiplies_the_base_by_factor_to_d_over_d_minus_2() -> None:
    rope = build("rope", n_heads=1, head_dim=8, d_model=8, train_length=32)
    ntk = rope.with_scaling("ntk", 4.0)
    new_base = 10000 * 4 ** (8 / 6)
    expected = torch.tensor([new_base ** (-j / 8) for j in (0, 2, 4, 6)])
    torch.testing.assert_close(ntk.inv_freq, expected)
    theirs = RotaryEmbedding(8, base_rescale_factor=4.0).inv_freq
    torch.testing.assert_close(ntk.inv_freq, theirs)
    # The trained model is untouched.
    torch.testing.assert_close(
        rope.inv_freq, torch.tensor([10000 ** (-j / 8) for j in (0, 2, 4, 6)])
    )


def test_dynamic_ntk_recomputes_the_factor_per_length() -> None:
    rope = build("rope", n_heads=1, head_dim=8, d_model=8, train_length=32)
    dynamic = rope.with_scaling("dynamic_ntk")
    torch.testing.assert_close(dynamic.frequencies(32), rope.inv_freq)  # s = 1 within L
    torch.testing.assert_close(dynamic.frequencies(16), rope.inv_freq)
    torch.testing.assert_close(dynamic.frequencies(128), rope.with_scaling("ntk", 4.0).inv_freq)
    torch.testing.assert_close(dynamic.frequencies(48), rope.with_scaling("ntk", 1.5).inv_freq)


def test_yarn_ramp_by_hand() -> None:
    # head_dim 8, base 10^4, L = 2048: frequencies 1, 0.1, 0.01, 0.001 make
    # 2048 f / 2pi = 325.9, 32.6, 3.26, 0.326 rotations over L. The pair turning r times
    # is j(r) = 8 ln(2048 / (2 pi r)) / (2 ln 10^4): j(32) = 1.008, j(1) = 2.513, so the
    # ramp runs from floor(1.008) = 1 to ceil(2.513) = 3 in the pair index (the YaRN
    # authors' code): weights 0, 0, 1/2, 1 on dividing each frequency by s = 4.
    rope = build("rope", n_heads=1, head_dim=8, d_model=8, train_length=2048)
    yarn = rope.with_scaling("yarn", 4.0)
    expected = [1.0, 0.1, 0.5 * 0.01 / 4 + 0.5 * 0.01, 0.001 / 4]
    torch.testing.assert_close(yarn.inv_freq, torch.tensor(expected), rtol=1e-5, atol=0)
    # The paper's text, linear in the rotation count, would give pair 2 the weight
    # (3.26 - 1) / 31 = 0.073 on dividing: 0.0093, not 0.00625.
    assert float(yarn.inv_freq[2]) == pytest.approx(0.00625, rel=1e-5)


def test_yarn_matches_the_reference_ramp_at_a_realistic_size() -> None:
    # head_dim 128, base 10^4, L = 4096, s = 16 (a LLaMA-like model): the ramp runs
    # from floor(j(32)) = 20 to ceil(j(1)) = 46 in the pair index.
    rope = build("rope", n_heads=1, head_dim=128, d_model=128, train_length=4096)
    yarn = rope.with_scaling("yarn", 16.0)
    j = [128 * math.log(4096 / (2 * math.pi * r)) / (2 * math.log(1e4)) for r in (32, 1)]
    low, high = math.floor(j[0]), math.ceil(j[1])
    assert (low, high) == (20, 46)
    for pair in range(64):
        f = 1e4 ** (-2 * pair / 128)
        weight = min(1.0, max(0.0, (pair - low) / (high - low)))
        assert float(yarn.inv_freq[pair]) == pytest.approx(
            weight * f / 16 + (1 - weight) * f, rel=1e-5
        )


def test_yarn_temperature_scales_logits_by_its_square() -> None:
    rope = build("rope", n_heads=1, head_dim=8, d_model=8, train_length=2048)
    yarn = rope.with_scaling("yarn", 4.0)
    factor = 0.1 * math.log(4.0) + 1
    assert yarn_attention_factor(4.0) == pytest.approx(factor)
    assert yarn_attention_factor(1.0) == 1.0
    q = torch.randn(1, 1, 1, 8)
    # At position 0 there is no rotation, so only the temperature remains.
    rq, rk = yarn.rotate(q, q, torch.tensor([0]))
    assert float((rq * rk).sum()) == pytest.approx(float((q * q).sum()) * factor**2, rel=1e-5)


def test_ntk_by_parts_is_yarn_without_its_temperature() -> None:
    # YaRN section 3.2: the ramp alone; section 3.4 adds the temperature.
    rope = build("rope", n_heads=1, head_dim=8, d_model=8, train_length=2048)
    yarn = rope.with_scaling("yarn", 4.0)
    by_parts = rope.with_scaling("yarn", 4.0, temperature=False)
    torch.testing.assert_close(by_parts.inv_freq, yarn.inv_freq)
    assert by_parts.attention_factor == 1.0 and yarn.attention_factor > 1.0
    q = torch.randn(1, 1, 1, 8)
    rq, rk = by_parts.rotate(q, q, torch.tensor([0]))
    assert float((rq * rk).sum()) == pytest.approx(float((q * q).sum()), rel=1e-5)


def test_yarn_measures_rotations_over_the_original_length() -> None:
    rope = build("rope", n_heads=1, head_dim=8, d_model=8, train_length=2048)
    assert not torch.equal(
        rope.with_scaling("yarn", 4.0, original_length=64).inv_freq,
        rope.with_scaling("yarn", 4.0).inv_freq,
    )


@pytest.mark.parametrize(
    ("method", "factor", "params", "message"),
    [
        ("stretch", 2.0, {}, r"unknown RoPE scaling 'stretch'"),
        ("pi", None, {}, r"'pi' needs a factor"),
        ("ntk", 0.5, {}, r"factor must be in \[1, 1024\]"),
        ("yarn", 4.0, {"gamma": 1.0}, r"no parameter 'gamma' \(allowed: beta_fast, beta_slow"),
        ("yarn", 4.0, {"gamma": 1.0}, r"alpha \(= beta_slow\), beta \(= beta_fast\)\)"),
        ("yarn", 4.0, {"temperature": 1}, r"'temperature' must be true or false, got 1"),
        ("yarn", 4.0, {"alpha": 40.0}, r"needs beta_fast > beta_slow \(beta > alpha"),
        ("yarn", 4.0, {"alpha": 2.0, "beta_slow": 2.0}, r"'alpha' and 'beta_slow' name the same"),
    ],
)
def test_bad_scalings_are_refused(
    method: str, factor: float | None, params: dict[str, float], message: str
) -> None:
    with pytest.raises(EncodingConfigError, match=message):
        build("rope", **dims()).with_scaling(method, factor, **params)


def test_scalings_do_not_stack() -> None:
    rope = build("rope", **dims())
    twice = rope.with_scaling("ntk", 4.0).with_scaling("pi", 2.0)
    torch.testing.assert_close(twice.inv_freq, rope.inv_freq)


def test_model_scaled_passes_yarn_parameters_through() -> None:
    config = ModelConfig(d_model=64, n_layers=1, n_heads=1, vocab_size=32)
    model = build_model(config, "rope", train_length=2048)
    with model.scaled("yarn", 4.0) as scaled:
        default = scaled.encoding.inv_freq.clone()
    with model.scaled("yarn", 4.0, beta=8.0) as scaled:
        narrower = scaled.encoding.inv_freq.clone()
    expected = model.encoding.with_scaling("yarn", 4.0, beta=8.0).inv_freq
    torch.testing.assert_close(narrower, expected)
    assert not torch.equal(default, narrower)


def test_dynamic_ntk_takes_no_factor() -> None:
    from core.catalog.params import EncodingConfigError

    rope = build("rope", **dims())
    with pytest.raises(EncodingConfigError, match="'dynamic_ntk' takes no factor"):
        rope.with_scaling("dynamic_ntk", 4.0)
    assert rope.with_scaling("dynamic_ntk").scaling.factor == 1.0


@pytest.mark.parametrize("fraction", [0.25, 0.5, 1.0])
def test_proportional_rope_equals_transformers(fraction: float) -> None:
    """``proportional: true`` is transformers' ``rope_type: proportional`` (Gemma 4's
    global layers): its frequencies (the ladder over the whole head, the slow pairs
    standing still) and q, k rotated by its ``apply_rotary_pos_emb`` at the same
    positions."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf_apply

    head_dim, base = 32, 1e6
    config = LlamaConfig(
        hidden_size=2 * head_dim,
        num_attention_heads=2,
        head_dim=head_dim,
        rope_parameters={
            "rope_type": "proportional",
            "rope_theta": base,
            "partial_rotary_factor": fraction,
        },
    )
    hf_freq, hf_factor = ROPE_INIT_FUNCTIONS["proportional"](config, "cpu")
    ours = build(
        "rope",
        **dims(n_heads=2, head_dim=head_dim),
        base=base,
        rotary_fraction=fraction,
        proportional=True,
    )
    assert hf_factor == 1.0 and ours.rotary_dim == head_dim
    torch.testing.assert_close(ours.inv_freq, hf_freq, rtol=1e-6, atol=0)
    assert int((ours.inv_freq > 0).sum()) == int(fraction * head_dim) // 2
    positions = torch.arange(300)
    q, k = torch.randn(2, 1, 2, 300, head_dim).unbind(0)
    angles = positions[:, None].float() * hf_freq
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    expected = hf_apply(q, k, cos[None], sin[None])
    got = ours.rotary_tables(positions).rotate(q, k)
    for mine, theirs in zip(got, expected, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)


def test_proportional_rope_differs_from_partial_rope_and_refuses_scalings() -> None:
    """GPT-NeoX's partial RoPE squeezes its own ladder into the rotated dimensions; the
    proportional form keeps the full ladder's fast end: the same pairs turn at other
    speeds. A RoPE scaling of it is refused, here and in a spec."""
    from core.spec import SpecError, parse_spec

    shape = dims(n_heads=2, head_dim=32)
    partial = build("rope", **shape, rotary_fraction=0.25)
    proportional = build("rope", **shape, rotary_fraction=0.25, proportional=True)
    assert partial.rotary_dim == 8 and proportional.rotary_dim == 32
    assert not torch.allclose(partial.inv_freq[:4], proportional.inv_freq[:4])
    with pytest.raises(EncodingConfigError, match="proportional RoPE takes no scaling"):
        proportional.with_scaling("yarn", 4.0)
    spec = {
        "model": "tiny",
        "train": {"length": 32},
        "encodings": [{"name": "rope", "proportional": True, "rotary_fraction": 0.25}],
        "eval": {"lengths": [32, 64], "variants": ["none", "yarn:2"]},
    }
    with pytest.raises(SpecError, match="proportional RoPE takes no scaling yet") as refused:
        parse_spec(spec)
    assert "rope(rotary_fraction=0.25, proportional=true)" in str(refused.value)
