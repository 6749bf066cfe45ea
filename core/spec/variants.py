"""How a trained model is evaluated: its inference-time variants (RoPE scalings, with
or without fine-tuning) and the evaluation settings (lengths, protocols, budget)."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from core.catalog.encodings import LOGN, NO_SCALING, SCALINGS
from core.catalog.params import short_repr
from core.spec.base import (
    MAX_EVAL_LENGTH,
    MAX_VARIANT_LABEL,
    CachePolicy,
    Protocol,
    _Strict,
    exact,
)
from core.spec.key_tokens import KeyTokenSpec
from core.spec.parts import (
    FinetuneSpec,
)

# The scalings with one fixed factor: the ones a model can be fine-tuned under.
FINETUNED = tuple(name for name, scaling in SCALINGS.items() if scaling.needs_factor)
# "none" (the trained model) or a registered scaling.
Method = Literal[(NO_SCALING, *SCALINGS)]  # type: ignore[valid-type]


class VariantSpec(_Strict):
    """An inference-time RoPE scaling applied at evaluation; ``none`` is the trained model.

    ``factor: auto`` uses s = max(1, eval_length / L) at each length, L the training
    length (or the variant's ``original_max_position_embeddings``). With
    ``finetune``, the trained model is first fine-tuned under the scaling (a fixed
    factor), and that model is evaluated.
    """

    method: Method = NO_SCALING
    factor: float | Literal["auto"] | None = None
    # The scaling's own parameters (YaRN's beta_fast, ...), checked against the registry.
    params: dict[str, Any] = Field(default_factory=dict)
    finetune: FinetuneSpec | None = None
    # Log-n scaling at evaluation (worker.diagnostics): each query's logits multiplied by
    # max(1, log n / log L), n the keys it sees, L the training length.
    logn: bool = False

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        # "yarn", "yarn:4", "pi:auto", "yarn:4+ft200", "yarn:4+ft200@512", "ntk:auto+logn"
        # or "logn" (the trained model with log-n scaling)
        if not isinstance(value, str):
            return value
        head, *tails = value.split("+")
        if head == LOGN:
            head, tails = NO_SCALING, [LOGN, *tails]
        method, _, factor = head.partition(":")
        shorthand: dict[str, Any] = {"method": method, "factor": factor or None}
        for tail in tails:
            if tail == LOGN and LOGN not in shorthand:
                shorthand[LOGN] = True
                continue
            steps, at, length = tail.removeprefix("ft").partition("@")
            digits = re.compile(r"[0-9]+")
            if not (
                tail.startswith("ft")
                and "finetune" not in shorthand
                and digits.fullmatch(steps)
                and (not at or digits.fullmatch(length))
            ):
                raise ValueError(
                    f"variant {short_repr(value)}: after '+' comes the fine-tuning (ftSTEPS or "
                    "ftSTEPS@LENGTH) or log-n scaling (logn), each once, e.g. "
                    "'yarn:4+ft200@512' or 'ntk:auto+logn'"
                )
            tuning = {"steps": int(steps)} | ({"length": int(length)} if length else {})
            shorthand["finetune"] = tuning
        return shorthand

    @field_validator("factor", mode="before")
    @classmethod
    def _number(cls, value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, str | int | float | None):
            raise ValueError(f"factor must be a number >= 1 or 'auto', got {short_repr(value)}")
        if isinstance(value, str) and value != "auto":
            try:
                return float(value)
            except ValueError:
                raise ValueError(
                    f"factor must be a number >= 1 or 'auto', got {short_repr(value)}"
                ) from None
        return value

    @model_validator(mode="before")
    @classmethod
    def _flat_params(cls, value: Any) -> Any:
        # {method: yarn, factor: 8, beta: 16} is accepted as well as params: {beta: 16}.
        if isinstance(value, dict) and "params" not in value:
            own = ("method", "factor", "finetune")
            rest = {k: v for k, v in value.items() if k not in own}
            if rest:
                kept = {k: v for k, v in value.items() if k in own}
                return {**kept, "params": rest}
        return value

    @model_validator(mode="after")
    def _factor(self) -> VariantSpec:
        if self.params:
            owner = f"variant {short_repr(self.method)}"
            if self.method not in SCALINGS:  # 'none' takes no parameter
                raise ValueError(
                    f"{owner} has no parameter {short_repr(next(iter(self.params)))} "
                    "(allowed: none)"
                )
            scaling = SCALINGS[self.method]
            resolved = scaling.resolve(self.params, owner)
            # Only what was given stays, under the name given (and names the variant);
            # defaults stay implicit.
            given = {k: resolved[scaling.canonical(k)] for k in self.params}
            object.__setattr__(self, "params", given)
        if self.finetune is not None:
            if self.method == "none":
                if self.finetune.length is None:
                    raise ValueError(
                        "variant 'none' with finetune (fine-tuning at a longer length "
                        "without a scaling) needs finetune.length, e.g. 'none+ft200@512'"
                    )
            elif self.method not in FINETUNED:
                raise ValueError(
                    f"variant {short_repr(self.method)}: fine-tuning applies to a scaling with one "
                    f"fixed factor ({', '.join(FINETUNED)}) or to none (no scaling)"
                )
            elif self.factor is None or self.factor == "auto":
                raise ValueError(
                    f"variant {short_repr(self.method)} with finetune needs a number factor "
                    "(the model "
                    f"is fine-tuned once, at one scaling), e.g. '{self.method}:4+ft200'"
                    + ("; none was given" if self.factor is None else ", not 'auto'")
                )
        if self.method == NO_SCALING or not SCALINGS[self.method].needs_factor:
            if self.factor is not None:
                raise ValueError(f"variant {short_repr(self.method)} takes no factor")
        elif not SCALINGS[self.method].auto_factor and self.factor in (None, "auto"):
            raise ValueError(
                f"variant {short_repr(self.method)} needs a number factor (it follows the "
                f"length itself), e.g. '{self.method}:2'"
                + ("; none was given" if self.factor is None else ", not 'auto'")
            )
        elif self.factor is None:
            object.__setattr__(self, "factor", "auto")
        elif self.factor != "auto" and not 1.0 <= float(self.factor) <= 1024.0:
            raise ValueError(f"factor must be in [1, 1024] or 'auto', got {self.factor}")
        if len(self.label) > MAX_VARIANT_LABEL:
            raise ValueError(
                f"the variant's label {short_repr(self.label)} is longer than {MAX_VARIANT_LABEL} "
                "characters; give its parameters (or its fine-tuning's lr) fewer digits"
            )
        return self

    @property
    def label(self) -> str:
        name = self.method
        if self.factor is not None:
            factor = self.factor if self.factor == "auto" else exact(self.factor)
            name = f"{name}:{factor}"
        if self.params:
            shown = (_shown(v) for v in self.params.values())
            name += (
                "(" + ", ".join(f"{k}={v}" for k, v in zip(self.params, shown, strict=True)) + ")"
            )
        name += f"+{self.finetune.label}" if self.finetune is not None else ""
        if self.logn:
            # The trained model with log-n scaling is 'logn', as it is written.
            return LOGN if name == NO_SCALING else f"{name}+{LOGN}"
        return name

    def factor_at(self, eval_length: int, train_length: int) -> float | None:
        """The factor at ``eval_length``: 'auto' is max(1, length / L), L the scaling's
        original length (the training length unless its parameters say otherwise)."""
        if self.factor is None:
            return None
        if self.factor == "auto":
            original = SCALINGS[self.method].original_length(self.params, train_length)
            return max(1.0, eval_length / original)
        return float(self.factor)


def _shown(value: Any) -> str:
    """A parameter's value in a label: true / false, a number, or for a list (LongRoPE's
    per-pair factors) its length and a digest of its values, which keeps labels short
    and two lists apart."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        digest = hashlib.sha256(json.dumps(value).encode()).hexdigest()[:8]
        return f"{len(value)}#{digest}"
    return exact(value)


class EffectiveLength(_Strict):
    """How the effective context length is bounded (core.analysis.effective_bound): an
    absolute ``threshold`` in the task metric's units (accuracy: the lowest that holds;
    perplexity: the highest), or ``relative`` r of the score at the training length
    (accuracy: r x the 1x accuracy; perplexity: the 1x perplexity / r). Neither: the
    default (accuracy 0.5; perplexity within 10% of its 1x value)."""

    threshold: float | None = Field(None, gt=0, le=1e6, allow_inf_nan=False)
    relative: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)

    @model_validator(mode="after")
    def _one(self) -> EffectiveLength:
        if (self.threshold is None) == (self.relative is None):
            raise ValueError(
                "eval.effective_length takes exactly one of 'threshold' (an absolute "
                "value in the metric's units) or 'relative' (a fraction of the 1x score, "
                "in (0, 1])"
            )
        return self


class EvalSpec(_Strict):
    lengths: Annotated[
        list[Annotated[int, Field(ge=2, le=MAX_EVAL_LENGTH)]], Field(min_length=1, max_length=32)
    ] = Field(default_factory=lambda: [128, 256, 512, 1024])
    protocols: Annotated[list[Protocol], Field(min_length=1, max_length=4)] = Field(
        default_factory=lambda: ["nonoverlapping"]
    )
    stride: int | None = Field(None, ge=1, le=MAX_EVAL_LENGTH, description="sliding stride")
    min_document_bytes: int | None = Field(
        None,
        ge=2,
        le=1 << 30,
        description="document protocol: score only documents of at least this many bytes "
        "(absent: every document holding the longest length)",
    )
    bos: bool = Field(
        False,
        description="document protocol, hf: models: start each document's window with the "
        "tokenizer's beginning-of-sequence token (without it the first token is context "
        "only); a posbench model's window starts with the document separator it trained on",
    )
    cache_policy: CachePolicy = Field(
        "keep",
        description="decode protocol, rotary encodings: 'keep' (a cached key keeps the "
        "rotation it was written with, as HF transformers and vLLM do) or 'rerotate' "
        "(exact: the cache rebuilt under the current length's frequencies whenever they "
        "change); they differ only under length-dependent scalings (dynamic NTK, LongRoPE)",
    )
    window: int | None = Field(
        None,
        ge=2,
        le=MAX_EVAL_LENGTH,
        description="decode protocol: keys each query attends to at most (sliding-window "
        "eviction; absent: every key)",
    )
    sinks: int = Field(
        0,
        ge=0,
        le=MAX_EVAL_LENGTH,
        description="decode protocol with a window: the first keys the window always keeps "
        "(attention sinks, StreamingLLM)",
    )
    tokens: int = Field(65_536, ge=64, le=1 << 24, description="scored tokens per length (lm)")
    examples: int = Field(100, ge=1, le=10_000, description="examples per length (synthetic)")
    variants: Annotated[list[VariantSpec], Field(min_length=1, max_length=16)] = Field(
        default_factory=lambda: [VariantSpec()]
    )
    batch_tokens: int = Field(
        16_384, ge=256, le=1 << 22, description="tokens per evaluation batch (memory bound)"
    )
    order_probe: bool = Field(
        True,
        description="language modelling: also score each window with its first half shuffled "
        "(how much the model relies on word order; worker.probes)",
    )
    effective_length: EffectiveLength | None = Field(
        None,
        description="the effective length's bound: {threshold: x} or {relative: r}; "
        "absent: accuracy 0.5, perplexity within 10% of 1x",
    )
    key_tokens: KeyTokenSpec | None = Field(
        None,
        description="language modelling: key-token metrics (LongPPL); absent: none computed",
    )
    diagnostics: bool = Field(
        False,
        description="attention diagnostics at every point (docs/diagnostics.md): entropy, "
        "mean distance, sink mass, mass past the training length and the largest logit, "
        "per layer and head, from a sample of queries written out beside the fast kernels "
        "(every other number unchanged); not under the decode protocol",
    )

    @field_validator("lengths")
    @classmethod
    def _sorted_unique(cls, lengths: list[int]) -> list[int]:
        return sorted(set(lengths))

    @field_validator("protocols")
    @classmethod
    def _unique(cls, protocols: list[str]) -> list[str]:
        return list(dict.fromkeys(protocols))

    @field_validator("variants")
    @classmethod
    def _variants(cls, variants: list[VariantSpec]) -> list[VariantSpec]:
        labels = [v.label for v in variants]
        twice = sorted({x for x in labels if labels.count(x) > 1})
        if twice:
            raise ValueError(f"listed twice: {', '.join(twice)}")
        # The trained model ('none') is always evaluated, listed or not: one canonical
        # list, so a spec with and without it is the same study (and the same runs).
        return [VariantSpec()] + [v for v in variants if v.label != "none"]

    @model_validator(mode="after")
    def _stride(self) -> EvalSpec:
        if self.stride is not None and "sliding" not in self.protocols:
            raise ValueError(
                "eval.stride applies to the 'sliding' protocol only; add 'sliding' to "
                "eval.protocols or remove the stride"
            )
        # Each protocol's own settings, refused where the protocol is not evaluated.
        settings = (
            ("cache_policy", self.cache_policy != "keep", "decode"),
            ("window", self.window is not None, "decode"),
            ("sinks", self.sinks != 0, "decode"),
            ("min_document_bytes", self.min_document_bytes is not None, "document"),
            ("bos", self.bos, "document"),
        )
        for name, given, protocol in settings:
            if given and protocol not in self.protocols:
                raise ValueError(
                    f"eval.{name} applies to the {protocol!r} protocol only; add "
                    f"{protocol!r} to eval.protocols or remove eval.{name}"
                )
        if self.window is not None and self.cache_policy == "rerotate":
            raise ValueError(
                "eval.cache_policy 'rerotate' rebuilds the cache from every token when the "
                "frequencies change, and a window has dropped some: use 'keep' with "
                "eval.window"
            )
        if self.sinks and (self.window is None or self.sinks >= self.window):
            raise ValueError(
                f"eval.sinks ({self.sinks}) must be below eval.window ({self.window}): sinks "
                "are the first keys a window keeps, and it needs room for recent ones"
            )
        return self

    def protocol_label(self, protocol: str) -> str:
        """``protocol`` with the settings that change what it scores, as every number
        evaluated with it is labelled: ``sliding (stride 64)``, ``document (documents >=
        4096 bytes, BOS)``, ``decode (rerotate cache, window 512, 4 sinks)``, and with
        key-token metrics their settings (``nonoverlapping; key tokens: short context
        64, alpha 2``; L: the training length)."""
        settings: list[str] = []
        if protocol == "sliding" and self.stride is not None:
            settings.append(f"stride {self.stride}")
        elif protocol == "document":
            if self.min_document_bytes is not None:
                settings.append(f"documents >= {self.min_document_bytes} bytes")
            if self.bos:
                settings.append("BOS")
        elif protocol == "decode":
            settings.append(f"{self.cache_policy} cache")
            if self.window is not None:
                settings.append(f"window {self.window}")
            if self.sinks:
                settings.append(f"{self.sinks} sinks")
        label = f"{protocol} ({', '.join(settings)})" if settings else protocol
        # The key-token metrics of every protocol are what their settings make them.
        return f"{label}; {self.key_tokens.label()}" if self.key_tokens else label

    def plan(self, scalable: bool) -> list[tuple[VariantSpec, str, int]]:
        """Every (variant, protocol, length) to evaluate for one run, shortest lengths
        first. The trained model itself (variant ``none``) always comes first; scalings
        apply to rotary encodings only (``scalable``)."""
        # Fine-tuning without a scaling ('none+ft...') applies to every encoding.
        variants = [v for v in self.variants if scalable or v.method == "none"]
        return [
            (variant, protocol, length)
            for variant in variants
            for protocol in self.protocols
            for length in self.lengths
        ]


def protocol_title(stored: Iterable[Mapping[str, Any] | None], protocol: str) -> str:
    """``protocol``'s label (``EvalSpec.protocol_label``) for numbers of the studies whose
    stored specs are ``stored``: their one label, or, where their settings differ, each
    study's. A stored spec that no longer reads as one counts as the bare protocol."""
    labels = set()
    for spec in stored:
        try:
            evaluation = EvalSpec.model_validate((spec or {}).get("eval") or {})
        except ValueError:
            labels.add(protocol)
            continue
        labels.add(evaluation.protocol_label(protocol))
    if len(labels) <= 1:
        return labels.pop() if labels else protocol
    return f"{protocol} (settings differ by study: {'; '.join(sorted(labels))})"
