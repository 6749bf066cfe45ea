"""The metric registry: every number an evaluation point carries, declared once.

A ``Metric`` says which kind of task measures it, which way is better, how a table
prints it, the column that holds it (the ``evaluations`` table, ``results.json``,
``db.queries.curves``), the range a measured value lies in and how it follows from the
loss. Analysis, the import checks, the MLflow export, the renderers, the dashboard and
the read queries all read it instead of naming metrics. Adding a metric is an entry
here, its column (``db/models.py`` and a migration, ``core/results_schema.py``) and the
code that computes it (``worker/evaluate.py``).

The lowest layer: the standard library only, so that the task catalogue can say which
metric a task is scored by.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum


class Kind(str, Enum):
    """What a task is scored on, and so which metrics an evaluation of it carries."""

    LANGUAGE_MODELLING = "language_modelling"  # every next byte of a corpus
    ANSWER = "answer"  # the answer bytes of a synthetic example, right or wrong


@dataclass(frozen=True)
class Metric:
    name: str
    kind: Kind
    lower_is_better: bool
    fmt: str  # a table cell's format spec
    column: str  # the Evaluation column / results.json field that holds it
    description: str
    # The metric a task of its kind is scored by: its study's metric, its curves'
    # summaries (effective length), the first choice of every view.
    headline: bool = False
    # Measured by every task whatever its kind (the loss of the scored bytes).
    every_task: bool = False
    # Shown in posbench run's tables (beside the headline, when not it).
    reported: bool = False
    # Spans orders of magnitude: drawn on a log axis, summarised by the area under its
    # logarithm over log-length (``mean_log_ppl``).
    log_scale: bool = False
    low: float = 0.0  # the range a measured value lies in
    high: float = math.inf
    # The loss a value implies, where the metric is a function of the loss (checked
    # on import), and that function in words.
    to_loss: Callable[[float], float] | None = None
    from_loss: str = ""
    # Whether ``to_loss`` holds only where the loss is per byte (posbench's byte-level
    # models): an hf: model's loss is per token of its tokenizer.
    per_byte: bool = False
    # An attention diagnostic (eval.diagnostics): the statistic of worker.diagnostics it
    # stores. Any task may carry one, none needs to; not a score (no metric picker).
    diagnostic: str = ""

    def format(self, value: float | None) -> str:
        """A table cell: the value in the metric's format, ``n/a`` without one."""
        return "n/a" if value is None else f"{value:{self.fmt}}"

    def measured_by(self, kind: Kind) -> bool:
        """Whether an evaluation of a task of ``kind`` carries this metric."""
        return self.every_task or bool(self.diagnostic) or self.kind is kind

    def range_text(self) -> str:
        if self.high == math.inf:
            return f">= {self.low:g}"
        return f"within {self.low:g}..{self.high:g}"


METRICS: dict[str, Metric] = {
    metric.name: metric
    for metric in (
        Metric(
            name="loss",
            kind=Kind.LANGUAGE_MODELLING,
            lower_is_better=True,
            fmt=".2f",
            column="loss",
            description="mean next-byte cross-entropy of the scored bytes (nats per byte; "
            "per token of its tokenizer for an hf: model)",
            every_task=True,
        ),
        Metric(
            name="perplexity",
            kind=Kind.LANGUAGE_MODELLING,
            lower_is_better=True,
            fmt=".2f",
            column="perplexity",
            description="exp(loss): the effective number of equally likely next bytes",
            headline=True,
            reported=True,
            log_scale=True,
            low=1.0,
            to_loss=math.log,
            from_loss="exp(loss)",
        ),
        Metric(
            name="bits_per_byte",
            kind=Kind.LANGUAGE_MODELLING,
            lower_is_better=True,
            fmt=".2f",
            column="bits_per_byte",
            description="the bits a byte of text costs to encode: loss / ln 2 for byte-level "
            "models; the scored tokens' nats / (ln 2 x the bytes they cover) for an hf: "
            "model, so models with different tokenizers compare",
            to_loss=lambda value: value * math.log(2),
            from_loss="loss / ln 2",
            per_byte=True,
        ),
        Metric(
            name="accuracy",
            kind=Kind.ANSWER,
            lower_is_better=False,
            fmt=".3f",
            column="accuracy",
            description="the fraction of examples whose whole answer is right (exact match)",
            headline=True,
            reported=True,
            high=1.0,
        ),
        Metric(
            name="token_accuracy",
            kind=Kind.ANSWER,
            lower_is_better=False,
            fmt=".3f",
            column="token_accuracy",
            description="the fraction of answer bytes that are right (partial success)",
            reported=True,
            high=1.0,
        ),
        Metric(
            name="string_match_all",
            kind=Kind.ANSWER,
            lower_is_better=False,
            fmt=".3f",
            column="string_match_all",
            description="RULER's string_match_all (Hsieh et al., 2024): the fraction of an "
            "example's answer parts (needles' values, variables, words) whose every byte is "
            "predicted right under teacher forcing, averaged over examples; for an answer of "
            "one part it equals exact match",
            high=1.0,
        ),
        Metric(
            name="string_match_part",
            kind=Kind.ANSWER,
            lower_is_better=False,
            fmt=".3f",
            column="string_match_part",
            description="RULER's string_match_part (Hsieh et al., 2024): the fraction of "
            "examples with at least one answer part right (every byte of it, under teacher "
            "forcing); for an answer of one part it equals exact match",
            high=1.0,
        ),
        # Key tokens (LongPPL, Fang et al. 2024; eval.key_tokens, worker.key_tokens).
        Metric(
            name="key_token_fraction",
            kind=Kind.LANGUAGE_MODELLING,
            lower_is_better=False,
            fmt=".4f",
            column="key_token_fraction",
            description="the fraction of scored targets that are key tokens: with the "
            "model finder, those whose loss drops by more than eval.key_tokens.alpha with "
            "the full context instead of short_context tokens of it (LongPPL's criterion); "
            "with the repeats finder, those repeating what followed an earlier occurrence of "
            "their context beyond short_context (the same targets for every run)",
            high=1.0,
        ),
        Metric(
            name="key_token_perplexity",
            kind=Kind.LANGUAGE_MODELLING,
            lower_is_better=True,
            fmt=".2f",
            column="key_token_perplexity",
            description="exp of the key tokens' mean full-context loss (LongPPL); none "
            "without key tokens",
            log_scale=True,
            low=1.0,
        ),
        Metric(
            name="key_token_gain",
            kind=Kind.LANGUAGE_MODELLING,
            lower_is_better=False,
            fmt=".4f",
            column="key_token_gain",
            description="the mean over scored targets of the short-context loss minus the "
            "full-context loss (nats; 0 for targets within short_context of the window's "
            "start)",
            low=-math.inf,
        ),
        # Attention diagnostics (eval.diagnostics, worker.diagnostics): averaged over the
        # sampled queries of every window, the heads and the layers.
        Metric(
            name="attn_entropy",
            kind=Kind.LANGUAGE_MODELLING,
            lower_is_better=True,
            fmt=".3f",
            column="attn_entropy",
            description="attention entropy in nats, -sum p log p over the keys a query sees",
            diagnostic="entropy",
        ),
        Metric(
            name="attn_entropy_norm",
            kind=Kind.LANGUAGE_MODELLING,
            lower_is_better=True,
            fmt=".3f",
            column="attn_entropy_norm",
            description="attention entropy over log(number of keys the query sees): 1 is "
            "uniform attention, 0 attention on one key",
            high=1.0 + 1e-6,
            diagnostic="normalised_entropy",
        ),
        Metric(
            name="attn_distance",
            kind=Kind.LANGUAGE_MODELLING,
            lower_is_better=False,
            fmt=".1f",
            column="attn_distance",
            description="mean attention distance sum p (i - j), in tokens",
            diagnostic="distance",
        ),
        Metric(
            name="attn_sink_mass",
            kind=Kind.LANGUAGE_MODELLING,
            lower_is_better=True,
            fmt=".3f",
            column="attn_sink_mass",
            description="the attention on the first 4 tokens (attention sinks)",
            high=1.0 + 1e-6,
            diagnostic="sink_mass",
        ),
        Metric(
            name="attn_beyond_mass",
            kind=Kind.LANGUAGE_MODELLING,
            lower_is_better=True,
            fmt=".3f",
            column="attn_beyond_mass",
            description="the attention on keys at distances >= the training length L, "
            "farther than any query saw in training (0 up to 1x)",
            high=1.0 + 1e-6,
            diagnostic="beyond_mass",
        ),
        Metric(
            name="attn_max_logit",
            kind=Kind.LANGUAGE_MODELLING,
            lower_is_better=True,
            fmt=".2f",
            column="attn_max_logit",
            description="the largest pre-softmax attention logit of a query (bias and "
            "log-n scaling included)",
            low=-math.inf,
            diagnostic="max_logit",
        ),
    )
}


# The diagnostic each curve's growth from 1x to its longest length is summarised by
# (``attn_entropy_growth``, core.analysis).
GROWTH_DIAGNOSTIC = "attn_entropy"


def metric_named(name: str) -> Metric:
    """The registered metric called ``name``; ValueError for an unknown one."""
    try:
        return METRICS[name]
    except KeyError:
        raise ValueError(f"unknown metric {name!r}; expected one of {sorted(METRICS)}") from None


def headline(kind: Kind) -> Metric:
    """The metric tasks of ``kind`` are scored by."""
    return next(m for m in METRICS.values() if m.kind is kind and m.headline)


def headlines() -> tuple[Metric, ...]:
    return tuple(m for m in METRICS.values() if m.headline)


def kind_of(name: str) -> Kind:
    """The kind of task scored by (or measuring) the metric ``name``."""
    return metric_named(name).kind


def shown_with(name: str) -> tuple[Metric, ...]:
    """The metrics a view of a study scored by ``name`` offers: that one first, then the
    others of its kind in registry order."""
    first = metric_named(name)
    return (
        first,
        *(
            m
            for m in METRICS.values()
            if m.kind is first.kind and m is not first and not m.diagnostic
        ),
    )


def diagnostics() -> tuple[Metric, ...]:
    """The attention diagnostics (eval.diagnostics), in registry order."""
    return tuple(m for m in METRICS.values() if m.diagnostic)


def measured(kind: Kind) -> tuple[Metric, ...]:
    """Every metric an evaluation of a task of ``kind`` carries, in registry order."""
    return tuple(m for m in METRICS.values() if m.measured_by(kind))


def reported(kind: Kind) -> tuple[Metric, ...]:
    """What posbench run's tables show for a task of ``kind``: the headline first."""
    first = headline(kind)
    return (
        first,
        *(m for m in METRICS.values() if m.reported and m.kind is kind and not m.headline),
    )
