"""What a RoPE inference-time scaling is in the catalogue (:class:`ScalingInfo`) and what
a model brings to one (:class:`Rotary`); the entries are in :mod:`core.catalog.scalings`.
Torch-free like the whole catalogue."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from core.catalog.params import EncodingConfigError, Param, short_repr

# The variant label of the trained model itself, evaluated without a scaling.
NO_SCALING = "none"

# The parameter that moves the length a scaling measures from (default: the training length).
ORIGINAL = "original_max_position_embeddings"


@dataclass(frozen=True)
class Rotary:
    """What a RoPE model brings to a scaling: the base of its frequency ladder, how many
    of a head's dimensions it rotates, and the length it was trained at (the original
    length, unless a variant's ``original_max_position_embeddings`` says otherwise)."""

    base: float
    rotary_dim: int
    original_length: int


# (factor, resolved parameters, the model) -> HF transformers' rope_parameters.
HfParameters = Callable[[float, Mapping[str, Any], Rotary], dict[str, Any]]


@dataclass(frozen=True)
class ScalingInfo:
    """A RoPE inference-time scaling: applied to an already trained model, no retraining."""

    name: str
    summary: str
    reference: str
    needs_factor: bool
    params: tuple[Param, ...] = ()
    # The narrowest rotary width the scaling works on (NTK raises the base to r/(r-2)).
    min_rotary_width: int = 2
    # The scaling's own rule on its resolved parameters: the problems, or none.
    check: Callable[[Mapping[str, Any]], list[str]] | None = None
    # What a researcher would want to know before a study runs a variant of it as
    # written: (its label, its resolved parameters, the training length, every variant
    # label of the study) -> notes.
    notes: Callable[[str, Mapping[str, Any], int, set[str]], list[str]] | None = None
    # Older names still accepted for a parameter: (older name, the parameter it names).
    aliases: tuple[tuple[str, str], ...] = ()
    # The entry whose formula computes this one (with this one's factor and parameters).
    same_as: str | None = None
    # Whether the factor may be 'auto' (s = max(1, length / L) at each length).
    auto_factor: bool = True
    # Rules against the model's rotary width r: (resolved parameters, r) -> problems.
    fits: Callable[[Mapping[str, Any], int], list[str]] | None = None
    hf: HfParameters | None = None

    def param(self, name: str) -> Param:
        return next(p for p in self.params if p.name == name)

    def canonical(self, name: str) -> str:
        """The parameter ``name`` sets (an older name gives the parameter it names)."""
        return dict(self.aliases).get(name, name)

    def _allowed(self) -> str:
        names = [p.name for p in self.params]
        names += [f"{old} (= {new})" for old, new in self.aliases]
        return ", ".join(names) or "none"

    def resolve(self, params: Mapping[str, Any], owner: str) -> dict[str, Any]:
        """Every parameter of this scaling under its own name: the given ones checked, the
        rest at their defaults; ``owner`` names the caller in errors (a spec's variant,
        the model)."""
        resolved = {p.name: p.default for p in self.params}
        given: dict[str, str] = {}
        for name, value in params.items():
            target = self.canonical(name)
            if target not in resolved:
                raise EncodingConfigError(
                    f"{owner} has no parameter {short_repr(name)} (allowed: {self._allowed()})"
                )
            if target in given:
                raise EncodingConfigError(
                    f"{owner}: {short_repr(given[target])} and {short_repr(name)} name the "
                    "same parameter; give one"
                )
            given[target] = name
            resolved[target] = self.param(target).check(owner, value)
        problems = self.check(resolved) if self.check else []
        if problems:
            raise EncodingConfigError(f"{owner} {'; '.join(problems)}")
        return resolved

    def original_length(self, params: Mapping[str, Any], train_length: int) -> int:
        """The length the scaling measures from: the variant's own, or the training length."""
        return self.resolve(params, f"RoPE scaling {self.name!r}").get(ORIGINAL) or train_length

    def width_problems(
        self, params: Mapping[str, Any], width: int, rotating: str = "the model"
    ) -> list[str]:
        """What keeps this scaling with resolved ``params`` from ``rotating`` (who rotates,
        for the message) a rotary width of ``width`` dimensions: the narrowest width it
        needs, then its own rule."""
        problems = []
        if width < self.min_rotary_width:
            problems.append(
                f"raises the base to the power r/(r-2) and needs a rotary width r >= "
                f"{self.min_rotary_width}; {rotating} rotates {width}"
            )
        return problems + (self.fits(params, width) if self.fits else [])

    def hf_rope_parameters(
        self, factor: float | None, params: Mapping[str, Any], rotary: Rotary
    ) -> dict[str, Any]:
        """HF transformers' ``rope_parameters`` that compute what this scaling computes
        for ``rotary`` at ``factor`` (for an 'auto' factor: the one at the length).

        With ``rope_theta`` set (NTK's is the raised base); the caller adds the model's
        ``partial_rotary_factor``. HF's ``dynamic`` measures lengths from the config's
        ``max_position_embeddings``, which must then be the original length."""
        owner = f"RoPE scaling {self.name!r}"
        if self.hf is None:
            raise EncodingConfigError(f"{owner} has no HF rope_parameters")
        if self.needs_factor and factor is None:
            raise EncodingConfigError(f"{owner} needs its factor (at the length, for 'auto')")
        resolved = self.resolve(params, owner)
        original = resolved.get(ORIGINAL) or rotary.original_length
        rotary = Rotary(rotary.base, rotary.rotary_dim, original)
        factor = float(factor) if self.needs_factor and factor is not None else 1.0
        return {"rope_theta": rotary.base, **self.hf(factor, resolved, rotary)}

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "summary": self.summary,
            "reference": self.reference,
            "needs_factor": self.needs_factor,
            "auto_factor": self.needs_factor and self.auto_factor,
            "same_as": self.same_as,
            "params": [p.to_json() for p in self.params],
            "aliases": dict(self.aliases),
        }


@dataclass(frozen=True)
class TemperatureInfo:
    """An inference-time change to the attention logits of any encoding (not only
    RoPE's): a variant adds it with ``+NAME`` (``ntk:auto+logn``), or alone (``logn``)."""

    name: str
    summary: str
    reference: str
    formula: str


# The variant's log-n scaling, as variants are written ("ntk:auto+logn", "logn").
LOGN = "logn"
TEMPERATURES: dict[str, TemperatureInfo] = {
    LOGN: TemperatureInfo(
        name=LOGN,
        summary="log-n attention scaling: each query's logits multiplied by max(1, log n / "
        "log L), n the keys it sees, L the training length; keeps attention entropy from "
        "growing with the number of keys; composes with every encoding and RoPE scaling",
        reference="Chiang & Cholak 2022, arXiv:2202.12172 (Overcoming a Theoretical "
        "Limitation of Self-Attention); Qwen's use_logn_attn; Scalable-Softmax, Nakanishi "
        "2025, arXiv:2501.19399",
        formula="logits(n, j) * max(1, ln n / ln L); with an additive bias (ALiBi, T5, KERPLE, "
        "FIRE) the bias too: a temperature on the whole logit",
    ),
}
