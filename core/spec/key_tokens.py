"""Key-token settings of an evaluation (``eval.key_tokens``; LongPPL, Fang et al. 2024):
which targets are key tokens and how their short context is cut. The engine's side is
``worker.key_tokens``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from core.catalog.params import short_repr
from core.metrics import Kind
from core.spec.base import MAX_EVAL_LENGTH, _Strict

KeyTokenFinder = Literal["model", "repeats"]


class KeyTokenSpec(_Strict):
    """Key-token metrics (LongPPL, Fang et al. 2024; worker.key_tokens): each scored
    target is scored again with its context cut to ``short_context`` tokens. With the
    ``model`` finder a key token is one whose loss drops by more than ``alpha`` with the
    full context (and, with ``beta``, whose full-context log-probability is above
    ``beta``): each run finds its own. With the ``repeats`` finder a key token is one that
    continues the most recent earlier occurrence of its ``ngram`` preceding tokens, that
    occurrence out of the short context's reach: found in the text alone, the same for
    every run (LongPPL's reason for one evaluator model)."""

    finder: KeyTokenFinder = Field(
        "model",
        description="model: the evaluated model's own gains pick the key tokens "
        "(LongPPL's criterion); repeats: the text picks them, the same for every run - "
        "targets that repeat what followed an earlier occurrence of their preceding "
        "ngram tokens, beyond the short context",
    )
    ngram: int = Field(
        4, ge=1, le=64, description="repeats finder: tokens of context a repeat must match"
    )

    short_context: int | None = Field(
        None,
        ge=1,
        le=MAX_EVAL_LENGTH,
        description="tokens of context the short score keeps (absent: the training length)",
    )
    alpha: float = Field(
        2.0,
        ge=0,
        le=100,
        allow_inf_nan=False,
        description="a key token's least gain: short-context loss minus full-context loss, "
        "in nats (LongPPL's 2)",
    )
    beta: float | None = Field(
        None,
        ge=-100,
        lt=0,
        allow_inf_nan=False,
        description="LongPPL's second criterion: a key token's full-context log-probability "
        "must also exceed beta, i.e. its loss be below -beta (LongPPL uses -2; absent: off)",
    )
    stride: int | None = Field(
        None,
        ge=1,
        le=MAX_EVAL_LENGTH,
        description="targets each short-context sub-window scores, so their context runs "
        "from short_context - stride + 1 to short_context (absent: short_context / 4, "
        "LongPPL's ratio)",
    )

    def label(self) -> str:
        """The settings in words, as every number they produced is labelled."""
        if self.finder == "repeats":
            found = [f"repeats finder, {self.ngram}-gram"]
        else:
            found = [
                f"alpha {self.alpha:g}",
                *([f"beta {self.beta:g}"] if self.beta is not None else []),
            ]
        parts = [
            f"short context {self.short_context or 'L'}",
            *found,
            *([f"stride {self.stride}"] if self.stride is not None else []),
        ]
        return f"key tokens: {', '.join(parts)}"

    @model_validator(mode="after")
    def _finder_settings(self) -> KeyTokenSpec:
        # Compared with the defaults, not with what was spelled: a stored spec spells
        # every field.
        fields = type(self).model_fields
        if self.finder == "repeats":
            given = [
                name for name in ("alpha", "beta") if getattr(self, name) != fields[name].default
            ]
            if given:
                raise ValueError(
                    f"eval.key_tokens.{given[0]} applies to finder 'model' (the model's own "
                    "gains pick the key tokens); finder 'repeats' picks them from the text "
                    "(eval.key_tokens.ngram); remove it or use finder 'model'"
                )
        elif self.ngram != fields["ngram"].default:
            raise ValueError(
                "eval.key_tokens.ngram applies to finder 'repeats'; add finder: repeats or "
                "remove ngram"
            )
        return self

    @model_validator(mode="after")
    def _stride_fits(self) -> KeyTokenSpec:
        if (
            self.stride is not None
            and self.short_context is not None
            and self.stride > self.short_context
        ):
            raise ValueError(
                f"eval.key_tokens.stride ({self.stride}) must be at most "
                f"eval.key_tokens.short_context ({self.short_context}): each sub-window "
                "holds short_context tokens and scores its last stride targets"
            )
        return self

    def resolved(self, train_length: int) -> tuple[int, int]:
        """(short_context, stride), the defaults filled in for ``train_length``."""
        short = self.short_context or train_length
        return short, self.stride or max(1, short // 4)


def key_token_problems(keys: KeyTokenSpec | None, task: Any, train_length: int) -> list[str]:
    """What the study's other settings rule out of ``eval.key_tokens``: a task that is
    not language modelling (``task``: its catalogue entry), or a stride longer than the
    default short context (the training length)."""
    if keys is None:
        return []
    if task.kind is not Kind.LANGUAGE_MODELLING:
        return [
            f"eval.key_tokens applies to language modelling (a loss at every target), "
            f"not {short_repr(task.name)}; remove eval.key_tokens"
        ]
    short, stride = keys.resolved(train_length)
    if stride > short:
        return [
            f"eval.key_tokens.stride ({stride}) must be at most the short context, here "
            f"train.length = {short}; give a smaller stride or a short_context"
        ]
    return []
