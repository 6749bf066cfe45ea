"""Rotary position embedding (Su et al. 2021) and its inference-time scalings.

Convention: "rotate half" (GPT-NeoX, LLaMA): dimension j of the rotated part is
paired with dimension j + r/2, where r is the rotated width, and the pair is
rotated by the angle ``position * base^(-2j/r)``. With ``rotary_fraction < 1``
only the first r = fraction x head_dim dimensions rotate (GPT-NeoX, GPT-J).

``proportional`` RoPE (transformers' ``rope_type: proportional``, Gemma 4's global
layers) keeps the whole head in the layout (pairs j and j + d/2) and the ladder over
the whole head dimension, base^(-2j/d), but only the fastest fraction of the pairs
turns: pairs j >= int(fraction x d) / 2 get frequency 0. The fraction that rotates is
the high-frequency end of the full ladder, not a ladder of its own squeezed into
fewer dimensions as GPT-NeoX's partial RoPE is.

Phases and the rotation itself run in float32 whatever the autocast dtype:
bf16 has 8 mantissa bits, so ``position * inv_freq`` would be wrong by whole
radians at positions in the thousands.

Inference-time scalings (PI, NTK, YaRN, LongRoPE, Llama 3.1, ...) change the
frequencies of a model trained with plain RoPE, at evaluation time only, without
retraining: ``Rope.with_scaling`` makes a scaled copy; the formulas are in
``worker/encodings/rope_scaling.py``.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor

from core.catalog.params import EncodingConfigError
from core.catalog.scalings import ORIGINAL, scaling_info
from worker.encodings.base import PositionEncoding, check_even
from worker.encodings.rope_scaling import (
    MAX_SCALING_FACTOR,
    RopeScaling,
    rope_inv_freq,
    yarn_attention_factor,
    yarn_inv_freq,
)
from worker.encodings.rotary import RotaryTables

__all__ = [
    "MAX_SCALING_FACTOR",
    "Rope",
    "RopeScaling",
    "rope_inv_freq",
    "yarn_attention_factor",
    "yarn_inv_freq",
]


class Rope(PositionEncoding):
    name = "rope"

    def __init__(
        self,
        *,
        base: float = 10000.0,
        rotary_fraction: float = 1.0,
        proportional: bool = False,
        **dims: int,
    ) -> None:
        super().__init__(**dims)
        rotary_dim = int(self.head_dim * rotary_fraction) // 2 * 2
        if rotary_dim < 2:
            raise EncodingConfigError(
                f"encoding {self.name!r}: rotary_fraction={rotary_fraction} of head_dim="
                f"{self.head_dim} leaves fewer than 2 dimensions to rotate"
            )
        check_even(self.name, "head_dim", self.head_dim)
        self.base = base
        self.rotary_fraction = rotary_fraction
        self.proportional = proportional
        self.scaling: RopeScaling | None = None
        if proportional:
            # The whole head is laid out in pairs; the slow end of the ladder stands still.
            turning = int(rotary_fraction * self.head_dim // 2)
            inv_freq = rope_inv_freq(base, self.head_dim)
            inv_freq[turning:] = 0.0
            rotary_dim = self.head_dim
        else:
            inv_freq = rope_inv_freq(base, rotary_dim)
        self.rotary_dim = rotary_dim
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    # -- scalings ---------------------------------------------------------------------------

    def with_scaling(
        self,
        method: str,
        factor: float | None = None,
        original_length: int | None = None,
        **params: object,
    ) -> Rope:
        """A copy of this encoding with an inference-time scaling; this one is unchanged.
        ``original_length`` defaults to the training length; a scaling's own
        ``original_max_position_embeddings`` overrides it."""
        spec = scaling_info(method)
        if self.proportional:
            raise EncodingConfigError(
                f"RoPE scaling {method!r}: proportional RoPE takes no scaling yet (its "
                "still pairs have no frequency to scale)"
            )
        if spec.needs_factor:
            if factor is None:
                raise EncodingConfigError(f"RoPE scaling {method!r} needs a factor (e.g. 4.0)")
            if not 1.0 <= factor <= MAX_SCALING_FACTOR:
                raise EncodingConfigError(
                    f"RoPE scaling {method!r}: factor must be in [1, {MAX_SCALING_FACTOR:g}], "
                    f"got {factor}"
                )
        elif factor is not None and factor != "auto":
            raise EncodingConfigError(
                f"RoPE scaling {method!r} takes no factor: it derives one from each length"
            )
        else:
            factor = 1.0
        owner = f"RoPE scaling {method!r}"
        resolved = spec.resolve(params, owner)
        problems = spec.width_problems(resolved, self.rotary_dim, "this model")
        if problems:
            raise EncodingConfigError(f"{owner}: {'; '.join(problems)}")
        original = resolved.get(ORIGINAL) or original_length or self.train_length
        scaled = copy.deepcopy(self)
        scaled.scaling = RopeScaling(spec.same_as or method, float(factor), int(original), resolved)
        # Always derive from the trained frequencies, never stack scalings.
        device = self.inv_freq.device
        scaled.inv_freq = scaled.scaling.inv_freq(self.base, self.rotary_dim).to(device)
        return scaled

    def frequencies(self, length: int) -> Tensor:
        """The frequencies in force for a sequence of ``length`` tokens."""
        scaling = self.scaling
        if scaling is not None and scaling.follows_length:
            inv_freq = scaling.inv_freq(self.base, self.rotary_dim, length)
            return inv_freq.to(self.inv_freq.device)
        return self.inv_freq

    def angular_speeds(self, length: int) -> Tensor:
        """The angle each pair turns per token at ``length``: the frequencies in force,
        with PI's division of positions folded in (what the Explore page draws)."""
        frequencies = self.frequencies(length)
        divisor = self.scaling.position_divisor if self.scaling is not None else None
        return frequencies if divisor is None else frequencies / divisor

    @property
    def attention_factor(self) -> float:
        """Multiplier applied to both q and k (YaRN's temperature, LongRoPE's); 1 otherwise."""
        return 1.0 if self.scaling is None else self.scaling.attention_factor

    # -- the hook ---------------------------------------------------------------------------

    def phases(self, positions: Tensor) -> Tensor:
        """``[..., T, r/2]`` float32 rotation angles of ``positions`` (``[T]`` or ``[B, T]``)."""
        inv_freq = self.inv_freq
        if self.scaling is not None and self.scaling.follows_length:
            # Only dynamic NTK and LongRoPE need the length (a host sync; a graph break
            # under compile).
            inv_freq = self.frequencies(int(positions.max()) + 1)
        pos = positions.to(torch.float32)
        divisor = self.scaling.position_divisor if self.scaling is not None else None
        if divisor is not None:
            pos = pos / divisor
        # Elementwise product, never a matmul: autocast leaves it in float32.
        return pos[..., None] * inv_freq

    def rotary_tables(self, positions: Tensor) -> RotaryTables:
        with torch.autocast(positions.device.type, enabled=False):
            angle = self.phases(positions)
            if angle.dim() == 3:
                angle = angle[:, None]
            factor = self.attention_factor
            cos, sin = angle.cos(), angle.sin()
            if factor != 1.0:
                cos, sin = cos * factor, sin * factor
            return RotaryTables(cos, sin, cos, sin)

    def extra_repr(self) -> str:
        text = f"{super().extra_repr()}, base={self.base:g}, rotary_dim={self.rotary_dim}"
        if self.proportional:
            text += f", proportional (fraction {self.rotary_fraction:g} turns)"
        if self.scaling is not None:
            text += f", scaling={self.scaling}"
        return text
