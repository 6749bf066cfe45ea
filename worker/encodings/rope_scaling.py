"""The formulas of RoPE's inference-time scalings (the catalogue entries, with their
parameters and rules, are in ``core/catalog/scalings.py``).

A scaling changes the frequencies of a model trained with plain RoPE over L tokens (the
original length: the training length unless the variant says otherwise), and some add
an attention factor that multiplies q and k (so logits by its square). With s the factor
and r the rotated width:

- ``pi`` (HF's ``linear``): positions multiplied by 1/s (Chen et al. 2023);
- ``ntk``: base multiplied by s^(r/(r-2)) (bloc97);
- ``dynamic``: the base raised for each evaluated length l, to base x (F l / L - (F - 1))
  ^(r/(r-2)) once l > L (HF's formula; ``dynamic_ntk`` is its F = 1 case, emozilla's
  s = max(1, l / L));
- ``yarn``: per-pair blend of interpolation and extrapolation by how many rotations a
  pair makes over L (pairs turning more than beta_fast = 32 times keep their frequency,
  fewer than beta_slow = 1 times are divided by s, a ramp linear in the pair index in
  between, as in the authors' code), plus the attention factor 0.1 ln(s) + 1 (Peng et
  al. 2023), or DeepSeek's ratio of two such factors (``mscale``, ``mscale_all_dim``);
- ``longrope``: pair j's frequency divided by short_factor[j] at lengths up to L and by
  long_factor[j] past it, plus the attention factor sqrt(1 + ln(s) / ln(L)) (Ding et al.
  2024, Phi-3);
- ``llama3``: pairs turning fewer than low_freq_factor times over L divided by s, more
  than high_freq_factor times kept, a blend linear in the turn count in between (Llama
  3.1).

Each is pinned against HF transformers' ``ROPE_INIT_FUNCTIONS`` in
``tests/test_rope_scalings_hf.py``. With ``rotary_fraction < 1`` they act on the rotated
dimensions only, as in HF's partial-rotary models.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

MAX_SCALING_FACTOR = 1024.0


def rope_inv_freq(base: float, rotary_dim: int) -> Tensor:
    """``[rotary_dim / 2]`` float32 frequencies base^(-2j/r)."""
    return _ladder(base, rotary_dim).to(torch.float32)


def _ladder(base: float, rotary_dim: int) -> Tensor:
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
    return base**-exponent


def ntk_base(base: float, factor: float, rotary_dim: int) -> float:
    """NTK-aware scaling's base: base x s^(r/(r-2)), which divides the slowest pair's
    frequency by s and leaves the fastest one's."""
    return base * factor ** (rotary_dim / (rotary_dim - 2))


def dynamic_base(
    base: float, factor: float, rotary_dim: int, length: int, original_length: int
) -> float:
    """Dynamic NTK's base for a sequence of ``length`` tokens: NTK's with the scale
    F l / L - (F - 1), where l = max(length, L), so the base is the trained one up to L
    and grows with the length past it (F = 1: s = l / L)."""
    longest = max(length, original_length)
    return ntk_base(base, factor * longest / original_length - (factor - 1), rotary_dim)


def yarn_correction_pair(rotations: float, base: float, rotary_dim: int, length: int) -> float:
    """The (fractional) pair index whose frequency base^(-2j/r) turns ``rotations`` times
    over ``length`` positions: j = r ln(length / (2 pi rotations)) / (2 ln base)."""
    return rotary_dim * math.log(length / (2 * math.pi * rotations)) / (2 * math.log(base))


def yarn_inv_freq(
    base: float,
    rotary_dim: int,
    factor: float,
    original_length: int,
    beta_slow: float,
    beta_fast: float,
    truncate: bool = True,
) -> Tensor:
    """YaRN's "NTK-by-parts" frequencies: keep the pairs that turn more than beta_fast
    times over the original length, interpolate (divide by s) those that turn fewer
    than beta_slow times, and blend in between along a ramp that is linear in the pair
    index, from j(beta_fast) to j(beta_slow), rounded outwards to whole pairs unless
    ``truncate`` is false.

    That is the ramp of the YaRN authors' code (jquesnelle/yarn), which produced the
    paper's tables and which HF transformers and vLLM follow. The paper's text writes
    the blend as linear in the rotation count, (r - alpha) / (beta - alpha); rotations
    fall geometrically with the pair index, so the two differ inside the ramp.

    Where every pair turns more than beta_fast times (a tiny base over a long original
    length, j(beta_fast) past the last pair), every pair keeps its frequency, as YaRN
    says; HF transformers' ramp runs backwards there and divides them all by s."""
    pairs = rotary_dim // 2
    low = yarn_correction_pair(beta_fast, base, rotary_dim, original_length)
    high = yarn_correction_pair(beta_slow, base, rotary_dim, original_length)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    # Clamped to rotary_dim - 1 (not pairs - 1) like the reference code.
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if high <= low:
        high = low + 1e-3  # a step instead of a ramp, as in the reference code
    # 0 keeps a pair's frequency (extrapolation), 1 divides it by s (interpolation).
    ramp = ((torch.arange(pairs, dtype=torch.float64) - low) / (high - low)).clamp(0.0, 1.0)
    extrapolated = rope_inv_freq(base, rotary_dim).double()
    blended = ramp * extrapolated / factor + (1 - ramp) * extrapolated
    return blended.to(torch.float32)


def yarn_attention_factor(factor: float, mscale: float = 1.0) -> float:
    """sqrt(1/t) of YaRN: 0.1 mscale ln(s) + 1, and exactly 1 without extension."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def llama3_inv_freq(
    base: float,
    rotary_dim: int,
    factor: float,
    original_length: int,
    low_freq_factor: float,
    high_freq_factor: float,
) -> Tensor:
    """Llama 3.1's frequencies: a pair turning fewer than ``low_freq_factor`` times over
    the original length (a wavelength above L / low_freq_factor) is divided by s, one
    turning more than ``high_freq_factor`` times keeps its frequency, and in between the
    weight on keeping it is linear in the turn count, (turns - low) / (high - low)."""
    trained = _ladder(base, rotary_dim)
    turns = original_length * trained / (2 * math.pi)
    keep = ((turns - low_freq_factor) / (high_freq_factor - low_freq_factor)).clamp(0.0, 1.0)
    return ((1 - keep) * trained / factor + keep * trained).to(torch.float32)


def longrope_attention_factor(factor: float, original_length: int) -> float:
    """LongRoPE's attention factor sqrt(1 + ln(s) / ln(L)), and 1 without extension."""
    if factor <= 1:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(original_length))


@dataclass(frozen=True)
class RopeScaling:
    """A scaling in force: the formula (the entry's own, or the one its catalogue entry
    is the same as: ``linear`` computes ``pi``), the factor s, the original length L and
    the entry's resolved parameters."""

    method: str
    factor: float
    original_length: int
    params: Mapping[str, Any] = field(default_factory=dict)

    @property
    def follows_length(self) -> bool:
        """Whether the frequencies depend on the evaluated length."""
        return self.method in ("dynamic", "longrope")

    @property
    def position_divisor(self) -> float | None:
        """What positions are divided by (PI), or None."""
        return self.factor if self.method == "pi" else None

    def inv_freq(self, base: float, rotary_dim: int, length: int = 0) -> Tensor:
        """The float32 frequencies in force for a sequence of ``length`` tokens (PI's
        division of positions not folded in)."""
        params, s, original = self.params, self.factor, self.original_length
        if self.method == "ntk":
            return rope_inv_freq(ntk_base(base, s, rotary_dim), rotary_dim)
        if self.method == "dynamic":
            return rope_inv_freq(dynamic_base(base, s, rotary_dim, length, original), rotary_dim)
        if self.method == "yarn":
            return yarn_inv_freq(
                base,
                rotary_dim,
                s,
                original,
                params["beta_slow"],
                params["beta_fast"],
                params["truncate"],
            )
        if self.method == "longrope":
            which = "long_factor" if length > original else "short_factor"
            default = s if which == "long_factor" else 1.0
            divisors = params[which] or [default] * (rotary_dim // 2)
            ladder = _ladder(base, rotary_dim)
            return (ladder / torch.tensor(divisors, dtype=torch.float64)).to(torch.float32)
        if self.method == "llama3":
            low, high = params["low_freq_factor"], params["high_freq_factor"]
            return llama3_inv_freq(base, rotary_dim, s, original, low, high)
        return rope_inv_freq(base, rotary_dim)

    @property
    def attention_factor(self) -> float:
        """The multiplier of q and k (YaRN's temperature, LongRoPE's factor); 1 otherwise."""
        params = self.params
        if self.method == "yarn":
            if not params["temperature"]:
                return 1.0
            if params["attention_factor"] is not None:
                return params["attention_factor"]
            if params["mscale"] is not None:
                return yarn_attention_factor(self.factor, params["mscale"]) / (
                    yarn_attention_factor(self.factor, params["mscale_all_dim"])
                )
            return yarn_attention_factor(self.factor)
        if self.method == "longrope":
            if params["attention_factor"] is not None:
                return params["attention_factor"]
            return longrope_attention_factor(self.factor, self.original_length)
        return 1.0
