"""What a catalogue entry of a position encoding is (``EncodingInfo``): its name, family,
reference, parameters and rules, and the model it is checked against (``Fit``), with the
parameters every encoding takes (``SHARED_PARAMS``). The entries themselves are in
:mod:`core.catalog.encodings`. Free of torch, like the whole catalogue."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from core.catalog.params import EncodingConfigError, Param, short_repr
from core.catalog.scalings import Rotary

# RoPE's default base, which an export states when a spec leaves it implicit.
ROPE_BASE = 10000.0

# Every encoding takes these: how its attention is masked, which the model applies
# (worker.model.build_model), not the encoding.
WINDOW = Param(
    "window",
    int,
    None,
    "sliding-window attention on every layer: each query attends to itself and the "
    "window - 1 keys before it, as in Longformer, Mistral and Gemma's local layers",
    low=1,
    high=1 << 22,
    derived="none, every earlier key",
    optional=True,
)
SHARED_PARAMS: tuple[Param, ...] = (WINDOW,)

Family = Literal["none", "absolute", "rotary", "bias", "contextual"]


@dataclass(frozen=True)
class Fit:
    """The model an encoding is checked against: its head size, its training length, the
    longest length it will be evaluated at and (where known) its number of layers."""

    head_dim: int
    train_length: int
    longest: int
    n_layers: int | None = None


# An entry's own rule: what keeps resolved parameters from fitting a model (torch-free).
Check = Callable[[Mapping[str, Any], Fit], list[str]]
# Why the RoPE scalings do not apply to an encoding with these resolved parameters.
ScalingCheck = Callable[[Mapping[str, Any]], str | None]


@dataclass(frozen=True)
class EncodingInfo:
    """A registry entry: what an encoding is, where it comes from and what it takes."""

    name: str
    family: Family
    summary: str
    reference: str
    implementation: str
    params: tuple[Param, ...] = ()
    # Whether RoPE inference-time scalings (PI, NTK, YaRN) apply to a trained model.
    scalable: bool = False
    # Whether the encoding's own length limit is the training length.
    bounded_by_train_length: bool = False
    check: Check | None = None
    # Whether a GPT-NeoX model of HF transformers computes what this encoding computes
    # (no position signal, or RoPE over the first rotary dimensions of each head), so
    # `posbench export-hf` can write a trained model as one (``hf_rotary``).
    hf_export: bool = False
    # What its attention runs on where that is not its family's rule (``attention``).
    attention_note: str | None = None
    # Why a scalable encoding takes no RoPE scaling with some parameters.
    scaling_check: ScalingCheck | None = None
    # A layer recipe (worker.encodings.layered): kinds of layers, each an encoding with its
    # own attention reach, rather than one encoding in every layer.
    recipe: bool = False

    @property
    def attention(self) -> str:
        """The attention kernel this encoding runs on (worker.attention), for the docs and
        `posbench encodings`."""
        if self.attention_note is not None:
            return self.attention_note
        if self.family == "bias":
            return "flex score_mod on CUDA; elsewhere sdpa blocks (CPU training: written out)"
        return "sdpa (flash on CUDA)"

    @property
    def all_params(self) -> tuple[Param, ...]:
        """Its own parameters, then those every encoding takes (``SHARED_PARAMS``) that it
        does not define itself (a recipe's ``window`` is its local layers')."""
        own = {p.name for p in self.params}
        return self.params + tuple(p for p in SHARED_PARAMS if p.name not in own)

    def param(self, name: str) -> Param:
        for p in self.all_params:
            if p.name == name:
                return p
        raise KeyError(name)

    def resolve(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """Validate user parameters and fill in defaults (derived defaults stay None; an
        optional parameter not given stays out)."""
        known = {p.name for p in self.all_params}
        unknown = sorted(set(params) - known)
        if unknown:
            allowed = ", ".join(sorted(known)) or "none"
            raise EncodingConfigError(
                f"encoding {short_repr(self.name)} has no parameter "
                f"{short_repr(unknown[0])} (allowed: {allowed})"
            )
        out: dict[str, Any] = {}
        for p in self.all_params:
            if p.name in params and params[p.name] is not None:
                out[p.name] = p.check(self.name, params[p.name])
            elif not p.optional:
                out[p.name] = p.default
        return out

    def rotary_width(self, head_dim: int, params: Mapping[str, Any]) -> int:
        """How many of a head's dimensions this encoding rotates (an even number; 0 for
        encodings that rotate nothing; proportional RoPE: the turning pairs' dimensions)."""
        if self.family != "rotary":
            return 0
        return int(head_dim * params.get("rotary_fraction", 1.0)) // 2 * 2

    def scaling_problem(self, params: Mapping[str, Any]) -> str | None:
        """Why the RoPE scalings do not apply to this encoding with ``params`` (None: they
        do, or it is not scalable at all)."""
        if self.scalable and self.scaling_check is not None:
            return self.scaling_check(params)
        return None

    def hf_rotary(self, params: Mapping[str, Any], head_dim: int, train_length: int) -> Rotary:
        """The rotary part a GPT-NeoX export of this encoding with resolved ``params`` states:
        its base, how many dimensions it rotates (0: none, no position signal) and the
        training length; refused for an encoding no HF architecture computes."""
        if self.recipe:
            raise EncodingConfigError(
                f"{self.name} mixes kinds of layers: GPT-NeoX, the transformers family that "
                "computes posbench's block, has one rotary setting for every layer and no "
                "window, and the families that mix layers (Gemma 3, Cohere2, SmolLM3, "
                "Llama 4) compute another block (RMSNorm, gated MLPs)"
            )
        if not self.hf_export:
            raise EncodingConfigError(
                f"encoding {short_repr(self.name)} has no HF transformers form (those with "
                "one: `posbench encodings --json`, hf_export)"
            )
        if params.get("proportional"):
            raise EncodingConfigError(
                "proportional RoPE: GPT-NeoX's partial RoPE spreads its ladder over the "
                "rotated dimensions only, so it computes another model"
            )
        if params.get(WINDOW.name) is not None:
            raise EncodingConfigError(
                f"window={params[WINDOW.name]}: GPT-NeoX attends to every earlier key; a "
                "sliding window has no form there yet"
            )
        base = float(params.get("base", ROPE_BASE))
        return Rotary(base, self.rotary_width(head_dim, params), train_length)

    def problems(self, params: Mapping[str, Any], fit: Fit) -> list[str]:
        """What keeps this encoding with resolved ``params`` from fitting the model
        (for the spec; ``worker.encodings.build`` raises the same)."""
        problems = []
        if self.family == "rotary" and self.rotary_width(fit.head_dim, params) < 2:
            problems.append(
                f"rotary_fraction={params['rotary_fraction']} of head_dim={fit.head_dim} "
                "leaves fewer than 2 dimensions to rotate"
            )
        return problems + (self.check(params, fit) if self.check else [])

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "family": self.family,
            "summary": self.summary,
            "reference": self.reference,
            "params": [p.to_json() for p in self.all_params],
            "scalable": self.scalable,
            "max_length": "train_length" if self.bounded_by_train_length else None,
        }
