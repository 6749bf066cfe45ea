"""HF transformers' RoPE scalings (linear, dynamic, yarn, longrope, llama3) as posbench
evaluation variants: each one's frequencies and attention factor against the installed
transformers' ROPE_INIT_FUNCTIONS, values computed by hand, tiny models evaluated under
every variant, and the spec's refusals."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import posbench_cli
from transformers import GPTNeoXConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding

from core.catalog.scalings import SCALINGS, Rotary
from core.spec import SpecError, parse_spec
from worker.encodings import EncodingConfigError, build
from worker.encodings.rope import Rope, rope_inv_freq
from worker.encodings.rope_scaling import (
    dynamic_base,
    longrope_attention_factor,
    yarn_attention_factor,
)
from worker.model import build_model


def rope(head_dim: int, train_length: int, base: float = 10000.0, fraction: float = 1.0) -> Rope:
    encoding = build(
        "rope",
        n_heads=1,
        head_dim=head_dim,
        d_model=head_dim,
        train_length=train_length,
        base=base,
        rotary_fraction=fraction,
    )
    assert isinstance(encoding, Rope)
    return encoding


def hf_frequencies(
    rope_parameters: dict[str, Any], head_dim: int, fraction: float, length: int, max_position: int
) -> tuple[torch.Tensor, float]:
    """HF transformers' frequencies and attention factor for ``rope_parameters`` on a
    GPT-NeoX-like config (partial rotary) at a sequence of ``length`` tokens; its
    ``max_position_embeddings`` is the original length (HF's dynamic measures from it)."""
    config = GPTNeoXConfig(
        hidden_size=2 * head_dim,
        num_attention_heads=2,
        max_position_embeddings=max_position,
        rope_parameters={**rope_parameters, "partial_rotary_factor": fraction},
    )
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":
        return GPTNeoXRotaryEmbedding.compute_default_rope_parameters(config)
    return ROPE_INIT_FUNCTIONS[rope_type](config, None, seq_len=length)


def pair_factors(pairs: int, seed: int, top: float) -> list[float]:
    """LongRoPE-like per-pair factors: rising from about 1 to about ``top``."""
    generator = torch.Generator().manual_seed(seed)
    ramp = torch.linspace(0, 1, pairs, dtype=torch.float64) ** 2
    jitter = torch.rand(pairs, generator=generator, dtype=torch.float64) * 0.05
    return [float(x) for x in 1.0 + (top - 1.0) * ramp + jitter]


# (method, factor, params, base, head_dim, rotary_fraction, train_length, lengths)
CASES = [
    ("pi", 4.0, {}, 1e4, 64, 1.0, 256, [256]),
    ("linear", 8.0, {}, 1e4, 64, 0.25, 256, [256]),
    ("ntk", 16.0, {}, 1e4, 64, 1.0, 256, [256]),
    ("ntk", 4.0, {}, 5e5, 64, 0.5, 256, [256]),
    ("dynamic_ntk", None, {}, 1e4, 64, 1.0, 256, [64, 256, 300, 1024, 4096]),
    ("dynamic", 1.0, {}, 1e4, 64, 0.25, 256, [100, 256, 257, 2048]),
    ("dynamic", 2.0, {}, 1e4, 128, 1.0, 512, [512, 1000, 2048, 9999]),
    ("dynamic", 8.0, {}, 5e5, 64, 0.5, 64, [32, 64, 65, 640]),
    ("yarn", 4.0, {}, 1e4, 128, 1.0, 4096, [4096]),
    ("yarn", 16.0, {}, 1e4, 128, 0.25, 4096, [4096]),
    ("yarn", 32.0, {"beta_fast": 16.0, "beta_slow": 2.0}, 1e4, 64, 1.0, 2048, [2048]),
    ("yarn", 8.0, {"alpha": 0.5, "beta": 24.0}, 1e4, 64, 1.0, 2048, [2048]),
    ("yarn", 8.0, {"truncate": False}, 1e4, 128, 1.0, 4096, [4096]),
    ("yarn", 40.0, {"mscale": 0.707, "mscale_all_dim": 1.0}, 1e4, 128, 1.0, 4096, [4096]),
    ("yarn", 4.0, {"attention_factor": 1.3}, 1e4, 64, 1.0, 2048, [2048]),
    ("yarn", 4.0, {"temperature": False}, 1e4, 64, 1.0, 2048, [2048]),
    ("yarn", 4.0, {"original_max_position_embeddings": 1024}, 1e4, 64, 1.0, 256, [256]),
    ("yarn", 2.5, {}, 5e5, 64, 0.5, 8192, [8192]),
    ("longrope", 8.0, {"pairs": 32}, 1e4, 64, 1.0, 256, [128, 256, 257, 2048]),
    ("longrope", 32.0, {"pairs": 8}, 1e4, 64, 0.25, 4096, [4096, 4097]),
    ("longrope", 4.0, {"pairs": 32, "attention_factor": 1.1}, 1e4, 64, 1.0, 256, [512]),
    ("longrope", 4.0, {}, 1e4, 64, 1.0, 256, [200, 1024]),
    ("llama3", 8.0, {}, 5e5, 128, 1.0, 8192, [8192]),
    ("llama3", 4.0, {"low_freq_factor": 2.0, "high_freq_factor": 8.0}, 1e4, 64, 0.25, 512, [512]),
    ("llama3", 16.0, {"original_max_position_embeddings": 2048}, 1e4, 64, 1.0, 256, [256]),
]


@pytest.mark.parametrize(
    ("method", "factor", "params", "base", "head_dim", "fraction", "train_length", "lengths"),
    CASES,
)
def test_frequencies_and_attention_factor_match_hf_transformers(
    method: str,
    factor: float | None,
    params: dict[str, Any],
    base: float,
    head_dim: int,
    fraction: float,
    train_length: int,
    lengths: list[int],
) -> None:
    trained = rope(head_dim, train_length, base, fraction)
    params = dict(params)
    if pairs := params.pop("pairs", None):
        assert pairs == trained.rotary_dim // 2
        params["short_factor"] = pair_factors(pairs, seed=1, top=1.5)
        params["long_factor"] = pair_factors(pairs, seed=2, top=factor or 1.0)
    scaled = trained.with_scaling(method, factor, **params)
    rotary = Rotary(base, trained.rotary_dim, train_length)
    rope_parameters = SCALINGS[method].hf_rope_parameters(factor, params, rotary)
    for length in lengths:
        theirs, their_factor = hf_frequencies(
            rope_parameters, head_dim, fraction, length, train_length
        )
        ours = scaled.angular_speeds(length)
        assert ours.shape == theirs.shape == (trained.rotary_dim // 2,)
        # To 1e-7, or two float32 steps: HF rounds the base's powers (and LongRoPE's
        # factors) to float32 before dividing, where posbench rounds once at the end.
        torch.testing.assert_close(ours.double(), theirs.double(), atol=1e-7, rtol=2.5e-7)
        assert scaled.attention_factor == pytest.approx(their_factor, abs=1e-7)


def test_hf_rope_parameters_name_what_each_variant_computes() -> None:
    rotary = Rotary(10000.0, 64, 2048)
    assert SCALINGS["linear"].hf_rope_parameters(4.0, {}, rotary) == {
        "rope_theta": 10000.0,
        "rope_type": "linear",
        "factor": 4.0,
    }
    assert SCALINGS["dynamic_ntk"].hf_rope_parameters(None, {}, rotary)["factor"] == 1.0
    ntk = SCALINGS["ntk"].hf_rope_parameters(4.0, {}, rotary)
    assert ntk == {"rope_theta": pytest.approx(10000.0 * 4 ** (64 / 62)), "rope_type": "default"}
    by_parts = SCALINGS["yarn"].hf_rope_parameters(8.0, {"alpha": 2, "temperature": False}, rotary)
    assert by_parts == {
        "rope_theta": 10000.0,
        "rope_type": "yarn",
        "factor": 8.0,
        "beta_fast": 32.0,
        "beta_slow": 2.0,
        "truncate": True,
        "original_max_position_embeddings": 2048,
        "attention_factor": 1.0,
    }
    longrope = SCALINGS["longrope"].hf_rope_parameters(4.0, {}, Rotary(1e4, 8, 512))
    assert longrope["short_factor"] == [1.0] * 4 and longrope["long_factor"] == [4.0] * 4
    llama3 = SCALINGS["llama3"].hf_rope_parameters(
        8.0, {"original_max_position_embeddings": 8192}, rotary
    )
    assert (llama3["low_freq_factor"], llama3["high_freq_factor"]) == (1.0, 4.0)
    assert llama3["original_max_position_embeddings"] == 8192


# -- values computed by hand --------------------------------------------------------------


def test_yarn_temperature_by_hand() -> None:
    # sqrt(1/t) = 0.1 ln s + 1
    expected = {2: 1.0693, 4: 1.1386, 8: 1.2079, 16: 1.2773, 32: 1.3466}
    trained = rope(64, 2048)
    for s, value in expected.items():
        assert yarn_attention_factor(s) == pytest.approx(value, abs=5e-5)
        assert trained.with_scaling("yarn", float(s)).attention_factor == pytest.approx(
            value, abs=5e-5
        )
    # DeepSeek's ratio: mscale = mscale_all_dim gives 1; mscale 1 over 0 would be YaRN's.
    same = trained.with_scaling("yarn", 40.0, mscale=0.707, mscale_all_dim=0.707)
    assert same.attention_factor == 1.0


def test_llama3_keeps_divides_and_smooths_by_hand() -> None:
    # Llama 3.1: base 500000, head dim 128, s = 8, low 1, high 4, L = 8192. Pair j's
    # wavelength 2 pi 500000^(j/64) is below L/4 = 2048 (kept) for j <= 28, above
    # L/1 = 8192 (divided by 8) for j >= 35, and smoothed for j = 29..34.
    trained = rope(128, 8192, base=500000.0)
    llama = trained.with_scaling("llama3", 8.0).inv_freq.double()
    original = rope_inv_freq(500000.0, 128).double()
    kept = torch.isclose(llama, original, rtol=1e-6, atol=0)
    divided = torch.isclose(llama, original / 8, rtol=1e-6, atol=0)
    smoothed = ~kept & ~divided
    assert (int(kept.sum()), int(divided.sum()), int(smoothed.sum())) == (29, 29, 6)
    assert kept[:29].all() and divided[35:].all() and smoothed[29:35].all()
    # Smoothed: the weight on keeping is linear in the turns over L, (turns - 1) / 3.
    turns = 8192 * original[30] / (2 * math.pi)
    weight = (turns - 1) / 3
    expected = weight * original[30] + (1 - weight) * original[30] / 8
    assert float(llama[30]) == pytest.approx(float(expected), rel=1e-6)


def test_longrope_attention_factor_by_hand() -> None:
    # s = 32, L = 4096: sqrt(1 + ln 32 / ln 4096) = sqrt(1 + 5/12)
    assert longrope_attention_factor(32.0, 4096) == pytest.approx(1.19024, abs=5e-6)
    assert longrope_attention_factor(1.0, 4096) == 1.0
    scaled = rope(64, 4096).with_scaling("longrope", 32.0)
    assert scaled.attention_factor == pytest.approx(math.sqrt(17 / 12))


def test_longrope_chooses_its_factors_by_the_length() -> None:
    trained = rope(16, 64)
    short, long = [1.0, 1.5, 2.0, 3.0, 1.0, 1.0, 1.0, 1.0], [2.0] * 8
    scaled = trained.with_scaling("longrope", 4.0, short_factor=short, long_factor=long)
    expected_short = trained.inv_freq.double() / torch.tensor(short, dtype=torch.float64)
    torch.testing.assert_close(scaled.frequencies(64).double(), expected_short)
    torch.testing.assert_close(scaled.frequencies(65), trained.inv_freq / 2)
    # Defaults: the trained frequencies up to L, PI by the factor past it.
    plain = trained.with_scaling("longrope", 4.0)
    torch.testing.assert_close(plain.frequencies(64), trained.inv_freq)
    torch.testing.assert_close(plain.frequencies(256), trained.inv_freq / 4)


def test_hf_dynamic_with_factor_2_at_4x_by_hand() -> None:
    # base x (F x 4L / L - (F - 1))^(d / (d - 2)) = base x 7^(128/126) = base x 7.2196
    assert dynamic_base(1e4, 2.0, 128, 4 * 512, 512) / 1e4 == pytest.approx(7.2196, abs=5e-5)
    scaled = rope(128, 512).with_scaling("dynamic", 2.0)
    torch.testing.assert_close(scaled.frequencies(2048), rope_inv_freq(1e4 * 7 ** (128 / 126), 128))
    torch.testing.assert_close(scaled.frequencies(512), rope(128, 512).inv_freq)


# -- the variants on posbench models ------------------------------------------------------


def variants_for(width: int) -> list[tuple[str, float | None, dict[str, Any]]]:
    """Every scaling at a factor of 4, LongRoPE also with per-pair lists for ``width``."""
    pairs = width // 2
    out = [(name, 4.0 if s.needs_factor else None, {}) for name, s in SCALINGS.items()]
    lists = {"short_factor": [1.0] * pairs, "long_factor": pair_factors(pairs, 0, 4.0)}
    deepseek = {"beta_fast": 8.0, "mscale": 1.0, "mscale_all_dim": 0.5}
    return [*out, ("longrope", 4.0, lists), ("yarn", 4.0, deepseek)]


@pytest.mark.parametrize(
    ("name", "params"),
    [("rope", {}), ("rope", {"rotary_fraction": 0.25}), ("xpos", {})],
)
def test_tiny_models_evaluate_under_every_variant(name: str, params: dict[str, Any]) -> None:
    model = build_model("tiny", name, train_length=16, seed=0, **params).eval()
    tokens = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        trained = model(tokens)
        for method, factor, scaling_params in variants_for(model.encoding.rotary_dim):
            with model.scaled(method, factor, 16, **scaling_params) as scaled:
                logits = scaled(tokens)
                assert logits.shape == (1, 64, 256) and torch.isfinite(logits).all()
                # Past L every scaling changes the numbers (dynamic NTK, LongRoPE: at 64).
                assert not torch.equal(logits, trained), method
            assert model.encoding.scaling is None  # the trained model is back


def test_dynamic_ntk_is_dynamic_at_1_and_linear_is_pi() -> None:
    for name in ("rope", "xpos"):
        model = build_model("tiny", name, train_length=16, seed=0).eval()
        tokens = torch.randint(0, 256, (2, 80), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            for (a, fa), (b, fb) in [
                (("dynamic_ntk", None), ("dynamic", 1.0)),
                (("linear", 3.0), ("pi", 3.0)),
            ]:
                with model.scaled(a, fa, 16):
                    first = model(tokens)
                with model.scaled(b, fb, 16):
                    second = model(tokens)
                assert torch.equal(first, second), (a, b)
    dynamic_ntk = rope(16, 32).with_scaling("dynamic_ntk")
    dynamic = rope(16, 32).with_scaling("dynamic", 1.0)
    for length in (16, 32, 48, 128):
        assert torch.equal(dynamic_ntk.frequencies(length), dynamic.frequencies(length))


def test_yarn_older_parameter_names_give_the_same_numbers() -> None:
    trained = rope(64, 2048)
    older = trained.with_scaling("yarn", 8.0, alpha=2.0, beta=16.0)
    newer = trained.with_scaling("yarn", 8.0, beta_slow=2.0, beta_fast=16.0)
    assert torch.equal(older.inv_freq, newer.inv_freq)
    assert older.attention_factor == newer.attention_factor


def test_refused_scaling_parameters() -> None:
    trained = rope(16, 64, fraction=0.5)  # 8 rotated dimensions, 4 pairs
    for method, params, message in [
        ("longrope", {"short_factor": [1.0] * 8}, "short_factor has 8 values; .* needs 4"),
        ("longrope", {"long_factor": [0.5] * 4}, r"value 0 must be float in \[1, 1024\], got 0.5"),
        ("longrope", {"long_factor": [1, "x"]}, r"value 1 must be a number"),
        ("longrope", {"short_factor": []}, r"must be a non-empty list \(list of numbers, each"),
        ("llama3", {"low_freq_factor": 4.0}, "needs high_freq_factor > low_freq_factor"),
        ("yarn", {"mscale": 0.7}, "takes mscale and mscale_all_dim together"),
        ("yarn", {"attention_factor": 1.2, "temperature": False}, "each set the attention"),
        ("yarn", {"attention_factor": 50.0}, r"'attention_factor' must be float in \[0.1, 10\]"),
    ]:
        with pytest.raises(EncodingConfigError, match=message):
            trained.with_scaling(method, 4.0, **params)
    with pytest.raises(EncodingConfigError, match="needs a rotary width r >= 4"):
        rope(8, 64, fraction=0.25).with_scaling("dynamic", 2.0)  # 2 rotated dimensions


# -- specs --------------------------------------------------------------------------------


def spec(variants: list[Any], encodings: list[Any] | None = None) -> dict[str, Any]:
    return {
        "model": "tiny",
        "encodings": encodings or ["rope"],
        "train": {"length": 16, "steps": 2, "batch_size": 2},
        "eval": {"lengths": [16, 64], "tokens": 64, "order_probe": False, "variants": variants},
    }


def test_spec_labels_and_auto_factors() -> None:
    lists = {"short_factor": [1.0] * 8, "long_factor": [2.0] * 7 + [4.0]}
    parsed = parse_spec(
        spec(
            [
                "linear:4",
                "dynamic:2",
                {"method": "yarn", "factor": 8, "alpha": 2, "beta_fast": 16},
                {"method": "longrope", **lists},
                {"method": "llama3", "factor": "auto", "original_max_position_embeddings": 8},
            ]
        )
    )
    labels = [v.label for v in parsed.eval.variants]
    assert labels[:4] == ["none", "linear:4", "dynamic:2", "yarn:8(alpha=2, beta_fast=16)"]
    assert labels[4].startswith("longrope:auto(short_factor=8#") and "long_factor=8#" in labels[4]
    assert labels[5] == "llama3:auto(original_max_position_embeddings=8)"
    # 'auto' measures from the variant's original length: 64 / 8, not 64 / 16.
    assert parsed.eval.variants[5].factor_at(64, 16) == 8.0
    assert parsed.eval.variants[4].factor_at(64, 16) == 4.0
    assert parsed.eval.variants[1].factor_at(64, 16) == 4.0
    other = parse_spec(spec([{"method": "longrope", **lists, "long_factor": [2.0] * 8}]))
    assert other.eval.variants[1].label != labels[4]  # another list, another label


def test_spec_notes_name_variants_that_give_the_same_numbers() -> None:
    notes = parse_spec(spec(["pi:4", "linear:4", "dynamic_ntk", "dynamic:1"])).notes()
    assert any("'linear:4' and 'pi:4' give the same numbers" in n for n in notes)
    assert any("'dynamic:1' and 'dynamic_ntk' give the same numbers" in n for n in notes)
    # Fine-tuned twins read their windows in orders of their own: nothing to say.
    tuned = parse_spec(spec(["pi:4+ft10", "linear:4+ft10", "linear:2", "dynamic:2"])).notes()
    assert not any("same numbers" in n for n in tuned)


@pytest.mark.parametrize(
    ("variants", "encodings", "message"),
    [
        (
            ["llama3:4"],
            ["alibi"],
            "'llama3:4' scales RoPE and applies to rope, xpos, ssmax, fope, local_global, irope",
        ),
        (
            [{"method": "longrope", "short_factor": [1.0] * 8}],
            [{"name": "rope", "rotary_fraction": 0.25}],
            "short_factor has 8 values; a model rotating 4 dimensions has 2 pairs and needs 2",
        ),
        (["dynamic:auto"], None, "variant 'dynamic' needs a number factor"),
        (["dynamic"], None, "variant 'dynamic' needs a number factor"),
        (
            [{"method": "llama3", "low_freq_factor": 8}],
            None,
            "needs high_freq_factor > low_freq_factor",
        ),
        ([{"method": "yarn", "mscale_all_dim": 1}], None, "takes mscale and mscale_all_dim"),
        ([{"method": "yarn", "beta": 8, "beta_fast": 8}], None, "name the same parameter"),
        ([{"method": "longrope", "long_factor": "big"}], None, "must be a non-empty list"),
    ],
)
def test_invalid_variants_are_refused_with_exit_2(
    tmp_path: Path, variants: list[Any], encodings: list[Any] | None, message: str
) -> None:
    with pytest.raises(SpecError, match=message):
        parse_spec(spec(variants, encodings))
    path = tmp_path / "study.json"
    path.write_text(json.dumps(spec(variants, encodings)))
    done = posbench_cli("run", str(path), "--out", str(tmp_path / "out"))
    assert done.returncode == 2, done.stderr
    assert message in " ".join(done.stderr.split()) and "Traceback" not in done.stderr


def test_a_study_runs_every_new_variant_end_to_end(tmp_path: Path) -> None:
    variants = [
        "linear:2",
        "dynamic:2",
        {"method": "yarn", "factor": "auto", "beta_fast": 4, "beta_slow": 0.5},
        {"method": "longrope", "short_factor": [1.0] * 2, "long_factor": [1.0, 4.0]},
        "llama3:4",
    ]
    path = tmp_path / "study.json"
    study = spec(variants, [{"name": "rope", "rotary_fraction": 0.25}, "xpos"])
    path.write_text(json.dumps(study))
    done = posbench_cli("run", str(path), "--json", "--out", str(tmp_path / "out"), timeout=600)
    assert done.returncode == 2 and "short_factor has 2 values" in done.stderr  # xpos: 8 pairs
    study["encodings"] = [{"name": "rope", "rotary_fraction": 0.25}]
    path.write_text(json.dumps(study))
    done = posbench_cli("run", str(path), "--json", "--out", str(tmp_path / "out"), timeout=600)
    assert done.returncode == 0, done.stderr
    (run,) = json.loads(done.stdout)["runs"]
    points = {(e["variant"], e["length"]): e for e in run["evaluations"]}
    labels = {variant for variant, _ in points}
    assert {"none", "linear:2", "dynamic:2", "llama3:4"} <= labels and len(labels) == 6
    assert all(math.isfinite(e["perplexity"]) for e in points.values())
    assert points[("llama3:4", 64)]["factor"] == 4.0
    assert points[("yarn:auto(beta_fast=4, beta_slow=0.5)", 64)]["factor"] == 4.0
