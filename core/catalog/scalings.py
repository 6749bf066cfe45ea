"""The catalogue of RoPE inference-time scalings: changes to the frequencies (and the
attention temperature) of a model trained with plain RoPE, made at evaluation, without
retraining.

Torch-free like the whole catalogue; ``worker/encodings/rope_scaling.py`` implements
them. The parameters carry the names HF transformers gives them in a model's
``rope_parameters`` (``beta_fast``, ``original_max_position_embeddings``, ...), and each
entry says which HF ``rope_parameters`` it corresponds to (``hf``), so a loader of HF
models can map a variant onto one. An entry that computes what another computes names it
(``same_as``): ``linear`` is ``pi``, ``dynamic_ntk`` is ``dynamic`` with a factor of 1.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from core.catalog.params import EncodingConfigError, Param, short_repr
from core.catalog.scaling_entry import NO_SCALING, ORIGINAL, Rotary, ScalingInfo

__all__ = ["NO_SCALING", "ORIGINAL", "SCALINGS", "Rotary", "ScalingInfo", "scaling_info"]

# -- rules and notes ---------------------------------------------------------------------


def _same_as_ntk_auto(
    label: str, params: Mapping[str, Any], train_length: int, labels: set[str]
) -> list[str]:
    if "ntk:auto" not in labels:
        return []
    return [
        "eval.variants: dynamic_ntk and ntk:auto give the same numbers: a window is "
        "read in one pass, so dynamic NTK's scale is max(1, length / L) for all of "
        "it, ntk:auto's factor (as in HF transformers and the YaRN authors' "
        "evaluation); list one, or a fixed factor (ntk:8) to compare with"
    ]


def _same_as_pi(
    label: str, params: Mapping[str, Any], train_length: int, labels: set[str]
) -> list[str]:
    twin = "pi" + label.removeprefix("linear")
    # Fine-tuned twins read their windows in orders of their own (seeded by the label).
    if twin not in labels or "+" in label:
        return []
    return [
        f"eval.variants: {short_repr(label)} and {short_repr(twin)} give the same numbers "
        "(linear is HF transformers' name for position interpolation); list one"
    ]


def _dynamic_at_one(
    label: str, params: Mapping[str, Any], train_length: int, labels: set[str]
) -> list[str]:
    if label != "dynamic:1" or "dynamic_ntk" not in labels:
        return []
    return [
        "eval.variants: 'dynamic:1' and 'dynamic_ntk' give the same numbers (dynamic NTK "
        "is HF's dynamic with a factor of 1); list one, or a larger factor (dynamic:4)"
    ]


def _yarn_at_short_lengths(
    label: str, params: Mapping[str, Any], train_length: int, labels: set[str]
) -> list[str]:
    original = params.get(ORIGINAL) or train_length
    turns = original / (2 * math.pi)  # RoPE's fastest pair, over L tokens
    beta = params["beta_fast"]
    if turns >= beta:
        return []
    return [
        f"eval.variants: {short_repr(label)}: over the original length "
        f"{original} RoPE's fastest pair turns {turns:.0f} times, "
        f"fewer than beta_fast = {beta:g}, so no pair keeps its frequency and YaRN is "
        "close to PI here; the paper's beta_slow = 1, beta_fast = 32 are for 4096 tokens "
        f"(scaled to this length: beta_slow = {original / 4096:.3g}, "
        f"beta_fast = {32 * original / 4096:.3g})"
    ]


def _yarn_rules(params: Mapping[str, Any]) -> list[str]:
    problems = []
    if params["beta_fast"] <= params["beta_slow"]:
        problems.append(
            "needs beta_fast > beta_slow (beta > alpha in the older names), got "
            f"beta_slow = {params['beta_slow']:g} and beta_fast = {params['beta_fast']:g}"
        )
    mscales = [name for name in ("mscale", "mscale_all_dim") if params[name] is not None]
    if len(mscales) == 1:
        problems.append(
            "takes mscale and mscale_all_dim together (the attention factor is their "
            f"ratio); only {mscales[0]} was given"
        )
    setters = ["attention_factor"] if params["attention_factor"] is not None else []
    setters += [] if params["temperature"] else ["temperature: false"]
    setters += ["mscale and mscale_all_dim"] if len(mscales) == 2 else []
    if len(setters) > 1:
        problems.append(f"{' and '.join(setters)} each set the attention factor; give one")
    return problems


def _llama3_band(params: Mapping[str, Any]) -> list[str]:
    if params["high_freq_factor"] > params["low_freq_factor"]:
        return []
    return [
        "needs high_freq_factor > low_freq_factor, got "
        f"{params['low_freq_factor']:g} and {params['high_freq_factor']:g}"
    ]


def _longrope_lists(params: Mapping[str, Any], width: int) -> list[str]:
    pairs = width // 2
    return [
        f"{name} has {len(params[name])} values; a model rotating {width} dimensions "
        f"has {pairs} pairs and needs {pairs}, one per pair"
        for name in ("short_factor", "long_factor")
        if params[name] is not None and len(params[name]) != pairs
    ]


# -- HF transformers' rope_parameters ----------------------------------------------------


def _hf_linear(factor: float, params: Mapping[str, Any], rotary: Rotary) -> dict[str, Any]:
    return {"rope_type": "linear", "factor": factor}


def _hf_ntk(factor: float, params: Mapping[str, Any], rotary: Rotary) -> dict[str, Any]:
    # HF has no fixed NTK type: plain RoPE with the raised base computes it.
    r = rotary.rotary_dim
    return {"rope_type": "default", "rope_theta": rotary.base * factor ** (r / (r - 2))}


def _hf_dynamic(factor: float, params: Mapping[str, Any], rotary: Rotary) -> dict[str, Any]:
    return {"rope_type": "dynamic", "factor": factor}


def _hf_yarn(factor: float, params: Mapping[str, Any], rotary: Rotary) -> dict[str, Any]:
    out = {
        "rope_type": "yarn",
        "factor": factor,
        "beta_fast": params["beta_fast"],
        "beta_slow": params["beta_slow"],
        "truncate": params["truncate"],
        ORIGINAL: rotary.original_length,
    }
    if not params["temperature"]:
        out["attention_factor"] = 1.0
    for name in ("attention_factor", "mscale", "mscale_all_dim"):
        if params[name] is not None:
            out[name] = params[name]
    return out


def _hf_longrope(factor: float, params: Mapping[str, Any], rotary: Rotary) -> dict[str, Any]:
    pairs = rotary.rotary_dim // 2
    out = {
        "rope_type": "longrope",
        "factor": factor,
        "short_factor": list(params["short_factor"] or [1.0] * pairs),
        "long_factor": list(params["long_factor"] or [factor] * pairs),
        ORIGINAL: rotary.original_length,
    }
    if params["attention_factor"] is not None:
        out["attention_factor"] = params["attention_factor"]
    return out


def _hf_llama3(factor: float, params: Mapping[str, Any], rotary: Rotary) -> dict[str, Any]:
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": params["low_freq_factor"],
        "high_freq_factor": params["high_freq_factor"],
        ORIGINAL: rotary.original_length,
    }


# -- the parameters ----------------------------------------------------------------------

_ORIGINAL = Param(
    ORIGINAL,
    int,
    None,
    "the length the model was trained at, which the scaling measures rotations (and an "
    "'auto' factor) from (default: train.length)",
    low=2,
    high=float(1 << 22),
    derived="train_length",
)


def _attention_factor(default: str) -> Param:
    return Param(
        "attention_factor",
        float,
        None,
        f"multiplies q and k (logits by its square) instead of the default {default}",
        low=0.1,
        high=10.0,
        derived=default,
    )


def _mscale(which: str) -> Param:
    return Param(
        which,
        float,
        None,
        f"DeepSeek's attention factor is (0.1 mscale ln s + 1) / (0.1 mscale_all_dim ln s "
        f"+ 1); this is its {'numerator' if which == 'mscale' else 'denominator'}'s "
        "coefficient (given with the other one)",
        low=0.01,
        high=10.0,
    )


_YARN_PARAMS = (
    Param(
        "beta_fast",
        float,
        32.0,
        "pairs turning more than beta_fast times over the original length keep their "
        "frequency (the paper's beta; alias: beta)",
        low=0.01,
        high=1e6,
    ),
    Param(
        "beta_slow",
        float,
        1.0,
        "pairs turning fewer than beta_slow times are interpolated (the paper's alpha; "
        "alias: alpha)",
        low=0.01,
        high=1e6,
    ),
    Param(
        "truncate",
        bool,
        True,
        "round the ramp's ends to whole pairs, floor and ceil, as the YaRN authors' code "
        "does; false: the exact fractional pairs (gpt-oss)",
    ),
    _attention_factor("0.1 ln(s) + 1"),
    _mscale("mscale"),
    _mscale("mscale_all_dim"),
    Param(
        "temperature",
        bool,
        True,
        "apply the attention factor; false: the ramp alone, the paper's 'NTK-by-parts' "
        "(section 3.2), the same as attention_factor 1",
    ),
    _ORIGINAL,
)


def _factors(which: str, default: str, when: str) -> Param:
    return Param(
        which,
        list,
        None,
        f"one factor per rotated pair (rotary_dim / 2 of them) that divides the pair's "
        f"frequency {when} (default: {default} for every pair)",
        low=1.0,
        high=1024.0,
        derived=f"{default} per pair",
    )


_LONGROPE_PARAMS = (
    _factors("short_factor", "1", "at lengths up to the original length"),
    _factors("long_factor", "the factor s", "past the original length"),
    _attention_factor("sqrt(1 + ln(s) / ln(original length))"),
    _ORIGINAL,
)


_LLAMA3_PARAMS = (
    Param(
        "low_freq_factor",
        float,
        1.0,
        "pairs turning fewer than low_freq_factor times over the original length are "
        "divided by s (wavelength above L / low_freq_factor)",
        low=0.01,
        high=1e6,
    ),
    Param(
        "high_freq_factor",
        float,
        4.0,
        "pairs turning more than high_freq_factor times keep their frequency; in "
        "between, a blend linear in the turn count",
        low=0.01,
        high=1e6,
    ),
    _ORIGINAL,
)


SCALINGS: dict[str, ScalingInfo] = {
    info.name: info
    for info in (
        ScalingInfo(
            name="pi",
            summary="Position interpolation: positions multiplied by L/L' = 1/factor.",
            reference="Chen et al. 2023, Extending Context Window of Large Language Models via "
            "Positional Interpolation (arXiv:2306.15595)",
            needs_factor=True,
            hf=_hf_linear,
        ),
        ScalingInfo(
            name="linear",
            summary="HF transformers' name for position interpolation: pi, the same numbers.",
            reference="kaiokendev 2023, SuperHOT; HF transformers' rope_type 'linear'",
            needs_factor=True,
            same_as="pi",
            notes=_same_as_pi,
            hf=_hf_linear,
        ),
        ScalingInfo(
            name="ntk",
            summary="NTK-aware: RoPE base multiplied by factor^(d/(d-2)).",
            reference="bloc97 2023, NTK-Aware Scaled RoPE; Peng et al. 2023 "
            "(arXiv:2309.00071) §3.1",
            needs_factor=True,
            min_rotary_width=4,
            hf=_hf_ntk,
        ),
        ScalingInfo(
            name="dynamic_ntk",
            summary="NTK-aware with factor = max(1, length / L) recomputed for each length "
            "(dynamic with F = 1).",
            reference="emozilla 2023, Dynamically Scaled RoPE; Peng et al. 2023 §3.3",
            needs_factor=False,
            min_rotary_width=4,
            notes=_same_as_ntk_auto,
            same_as="dynamic",
            hf=_hf_dynamic,
        ),
        ScalingInfo(
            name="dynamic",
            summary="HF's dynamic NTK with a factor F: base x (F·length/L - (F - 1))^(d/(d-2)) "
            "past L, recomputed for each length.",
            reference="emozilla 2023, Dynamically Scaled RoPE; HF transformers' rope_type "
            "'dynamic'",
            needs_factor=True,
            auto_factor=False,
            min_rotary_width=4,
            notes=_dynamic_at_one,
            hf=_hf_dynamic,
        ),
        ScalingInfo(
            name="yarn",
            summary="Per-dimension ramp between interpolation and extrapolation (beta_slow=1, "
            "beta_fast=32) plus attention factor sqrt(1/t) = 0.1·ln(factor) + 1.",
            reference="Peng et al. 2023, YaRN: Efficient Context Window Extension of Large "
            "Language Models (arXiv:2309.00071)",
            needs_factor=True,
            params=_YARN_PARAMS,
            aliases=(("alpha", "beta_slow"), ("beta", "beta_fast")),
            check=_yarn_rules,
            notes=_yarn_at_short_lengths,
            hf=_hf_yarn,
        ),
        ScalingInfo(
            name="longrope",
            summary="Per-pair frequency divisors, short_factor up to L and long_factor past it, "
            "plus attention factor sqrt(1 + ln(factor) / ln(L)).",
            reference="Ding et al. 2024, LongRoPE: Extending LLM Context Window Beyond 2 Million "
            "Tokens (arXiv:2402.13753); Phi-3",
            needs_factor=True,
            params=_LONGROPE_PARAMS,
            fits=_longrope_lists,
            hf=_hf_longrope,
        ),
        ScalingInfo(
            name="llama3",
            summary="Llama 3.1: pairs turning fewer than low_freq_factor times over L divided "
            "by factor, more than high_freq_factor kept, a blend in between.",
            reference="Meta 2024, The Llama 3 Herd of Models (arXiv:2407.21783); HF "
            "transformers' rope_type 'llama3'",
            needs_factor=True,
            params=_LLAMA3_PARAMS,
            check=_llama3_band,
            hf=_hf_llama3,
        ),
    )
}


def scaling_info(name: str) -> ScalingInfo:
    try:
        return SCALINGS[name]
    except KeyError:
        raise EncodingConfigError(
            f"unknown RoPE scaling {short_repr(name)} (available: {', '.join(SCALINGS)})"
        ) from None
