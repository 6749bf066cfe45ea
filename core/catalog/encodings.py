"""The catalogue of position encodings (and, from :mod:`core.catalog.scalings`, the RoPE
inference-time scalings).

This module is deliberately free of torch: the CLI, the spec validation and the
dashboard read it on their hot path. Each entry names the class that implements
it as ``"module:Class"``; :func:`worker.encodings.build` imports it on demand.

Adding an encoding = its module under ``worker/encodings/`` + one entry below + its
reference test (docs/adding-an-encoding.md). An entry carries its own rules (``check``):
no other module names an encoding.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from core.catalog.params import EncodingConfigError, Param, short_repr
from core.catalog.scaling_entry import LOGN, TEMPERATURES, TemperatureInfo
from core.catalog.scalings import NO_SCALING, SCALINGS, Rotary, ScalingInfo, scaling_info

__all__ = [
    "LOGN",
    "NO_SCALING",
    "REGISTRY",
    "SCALINGS",
    "SHARED_PARAMS",
    "TEMPERATURES",
    "WINDOW",
    "EncodingInfo",
    "Fit",
    "Param",
    "ScalingInfo",
    "TemperatureInfo",
    "hf_exportable",
    "info",
    "scaling_info",
]

Family = Literal["none", "absolute", "rotary", "bias"]


@dataclass(frozen=True)
class Fit:
    """The model an encoding is checked against: its head size, its training length and
    the longest length it will be evaluated at."""

    head_dim: int
    train_length: int
    longest: int


# An entry's own rule: what keeps resolved parameters from fitting a model (torch-free).
Check = Callable[[Mapping[str, Any], Fit], list[str]]


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
        """Its own parameters, then those every encoding takes (``SHARED_PARAMS``)."""
        return self.params + SHARED_PARAMS

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
        if self.scalable and params.get("proportional"):
            return "proportional RoPE takes no scaling yet (its still pairs have no frequency)"
        return None

    def hf_rotary(self, params: Mapping[str, Any], head_dim: int, train_length: int) -> Rotary:
        """The rotary part a GPT-NeoX export of this encoding with resolved ``params`` states:
        its base, how many dimensions it rotates (0: none, no position signal) and the
        training length; refused for an encoding no HF architecture computes."""
        if not self.hf_export:
            raise EncodingConfigError(
                f"encoding {short_repr(self.name)} has no HF transformers form (those with "
                f"one: {', '.join(hf_exportable())})"
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
        base = float(params.get("base", _ROPE_BASE.default))
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


def _t5_buckets(params: Mapping[str, Any], fit: Fit) -> list[str]:
    if params["max_distance"] > params["num_buckets"] // 2:
        return []
    return [
        f"max_distance={params['max_distance']} must exceed num_buckets / 2 = "
        f"{params['num_buckets'] // 2} (the exact buckets; log-spaced ones follow)"
    ]


def _randomized_range(params: Mapping[str, Any], fit: Fit) -> list[str]:
    limit = params["max_position"] or 64 * fit.train_length
    if limit >= max(fit.train_length, fit.longest):
        return []
    return [
        f"max_position = {limit} must be at least the training length {fit.train_length} "
        f"and the longest evaluation length {fit.longest}"
    ]


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

_ROPE_BASE = Param("base", float, 10000.0, "base of the geometric frequency ladder", low=2.0)
_ROTARY_FRACTION = Param(
    "rotary_fraction",
    float,
    1.0,
    "fraction of each head's dimensions that is rotated (GPT-NeoX uses 0.25)",
    choices=(0.25, 0.5, 1.0),
)

REGISTRY: dict[str, EncodingInfo] = {
    info.name: info
    for info in (
        EncodingInfo(
            name="nope",
            family="none",
            summary="No position signal at all; the causal mask alone breaks permutation symmetry.",
            reference="Kazemnejad et al. 2023, The Impact of Positional Encoding on Length "
            "Generalization in Transformers (arXiv:2305.19466)",
            implementation="worker.encodings.nope:NoPE",
            hf_export=True,
        ),
        EncodingInfo(
            name="sinusoidal",
            family="absolute",
            summary="Fixed sines and cosines of geometric frequencies, added to the token "
            "embedding.",
            reference="Vaswani et al. 2017, Attention Is All You Need (arXiv:1706.03762), §3.5",
            implementation="worker.encodings.sinusoidal:Sinusoidal",
            params=(Param("base", float, 10000.0, "wavelength base", low=2.0),),
        ),
        EncodingInfo(
            name="learned",
            family="absolute",
            summary="A trained table of one vector per position (GPT-2); undefined past the table.",
            reference="Radford et al. 2019, Language Models are Unsupervised Multitask Learners",
            implementation="worker.encodings.learned:Learned",
            bounded_by_train_length=True,
        ),
        EncodingInfo(
            name="rope",
            family="rotary",
            summary="Rotates query/key pairs by position-proportional angles; q·k depends on m-n.",
            reference="Su et al. 2021, RoFormer: Enhanced Transformer with Rotary Position "
            "Embedding (arXiv:2104.09864)",
            implementation="worker.encodings.rope:Rope",
            params=(
                _ROPE_BASE,
                _ROTARY_FRACTION,
                Param(
                    "proportional",
                    bool,
                    False,
                    "transformers' proportional RoPE (Gemma 4's global layers): the ladder "
                    "spans the whole head, base^(-2j/head_dim), and only the fastest "
                    "rotary_fraction of the pairs turns; the others stand still",
                    optional=True,
                ),
            ),
            scalable=True,
            hf_export=True,
        ),
        EncodingInfo(
            name="xpos",
            family="rotary",
            summary="RoPE with a per-dimension exponential decay of q·k with distance.",
            reference="Sun et al. 2022, A Length-Extrapolatable Transformer (arXiv:2212.10554)",
            implementation="worker.encodings.xpos:XPos",
            params=(
                _ROPE_BASE,
                _ROTARY_FRACTION,
                Param(
                    "scale_base",
                    float,
                    512.0,
                    "distance over which the decay acts",
                    low=1.0,
                    high=1e6,
                ),
            ),
            scalable=True,
            attention_note="sdpa (flash on CUDA); past ~96 x scale_base positions sdpa blocks "
            "(its decay overflows a score_mod)",
        ),
        EncodingInfo(
            name="alibi",
            family="bias",
            summary="Adds -slope·distance to attention logits, one geometric slope per head.",
            reference="Press et al. 2022, Train Short, Test Long: Attention with Linear Biases "
            "Enables Input Length Extrapolation (arXiv:2108.12409)",
            implementation="worker.encodings.alibi:ALiBi",
        ),
        EncodingInfo(
            name="t5",
            family="bias",
            summary="A learned scalar per (distance bucket, head); log-spaced buckets, shared "
            "across layers.",
            reference="Raffel et al. 2020, Exploring the Limits of Transfer Learning with a "
            "Unified Text-to-Text Transformer (arXiv:1910.10683)",
            implementation="worker.encodings.t5:T5Bias",
            params=(
                Param("num_buckets", int, 32, "number of distance buckets", low=4, high=1024),
                Param(
                    "max_distance",
                    int,
                    128,
                    "distance from which every pair shares the last bucket",
                    low=8,
                    high=1 << 20,
                ),
                Param(
                    "scale",
                    float,
                    None,
                    "the learned table is multiplied by this before it is added to the "
                    "logits; it sets how fast the bias learns under Adam (default: "
                    "sqrt(head_dim), as in x-transformers)",
                    low=0.01,
                    high=1000.0,
                    derived="sqrt(head_dim)",
                ),
            ),
            check=_t5_buckets,
        ),
        EncodingInfo(
            name="kerple_log",
            family="bias",
            summary="Adds -r1·log(1 + r2·distance), r1 and r2 learned per head and kept positive.",
            reference="Chi et al. 2022, KERPLE: Kernelized Relative Positional Embedding for "
            "Length Extrapolation (arXiv:2205.09921)",
            implementation="worker.encodings.kerple:KerpleLog",
        ),
        EncodingInfo(
            name="kerple_power",
            family="bias",
            summary="Adds -r1·distance^r2 with 0 < r2 <= 2, learned per head.",
            reference="Chi et al. 2022, KERPLE: Kernelized Relative Positional Embedding for "
            "Length Extrapolation (arXiv:2205.09921)",
            implementation="worker.encodings.kerple:KerplePower",
        ),
        EncodingInfo(
            name="fire",
            family="bias",
            summary="An MLP of the log distance normalised by the log query position, with a "
            "learned threshold.",
            reference="Li et al. 2023, Functional Interpolation for Relative Positions Improves "
            "Long Context Transformers (arXiv:2310.04418)",
            implementation="worker.encodings.fire:FIRE",
            params=(
                Param("mlp_width", int, 32, "hidden width of the bias MLP", low=4, high=512),
                Param(
                    "init_c", float, 0.1, "initial c of psi(x) = log(c·x + 1)", low=1e-4, high=100.0
                ),
                Param(
                    "init_threshold",
                    float,
                    None,
                    "initial threshold L of the normaliser psi(max(L, i)) (default: a quarter "
                    "of the training length, the paper's 512 at its 2048)",
                    low=1.0,
                    high=float(1 << 22),
                    derived="train_length / 4",
                ),
            ),
        ),
        EncodingInfo(
            name="randomized",
            family="absolute",
            summary="Positions are a sorted random sample of [0, max_position) for every "
            "sequence, fed to a base encoding.",
            reference="Ruoss et al. 2023, Randomized Positional Encodings Boost Length "
            "Generalization of Transformers (arXiv:2305.16843)",
            implementation="worker.encodings.randomized:Randomized",
            params=(
                Param(
                    "base_encoding",
                    str,
                    "rope",
                    "the encoding that receives the sampled positions",
                    choices=("sinusoidal", "rope"),
                ),
                Param(
                    "max_position",
                    int,
                    None,
                    "positions are drawn from [0, max_position); must exceed the longest "
                    "evaluation length (default: 64 x the training length)",
                    low=2,
                    high=1 << 22,
                    derived="64 * train_length",
                ),
            ),
            check=_randomized_range,
        ),
    )
}


def hf_exportable() -> list[str]:
    """The encodings `posbench export-hf` writes as HF transformers models."""
    return [name for name, entry in REGISTRY.items() if entry.hf_export]


def info(name: str) -> EncodingInfo:
    """The registry entry for ``name``, or a readable error listing what exists."""
    try:
        return REGISTRY[name]
    except KeyError:
        hint = (
            " (RoPE scalings are evaluation variants: eval.variants, e.g. [none, yarn:auto])"
            if name in SCALINGS
            else ""
        )
        raise EncodingConfigError(
            f"unknown encoding {short_repr(name)} (available: {', '.join(REGISTRY)}){hint}"
        ) from None
