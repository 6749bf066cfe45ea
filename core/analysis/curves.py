"""One run's curve turned into numbers: points, extrapolation ratios, the effective
context length, log-perplexity areas, and the summaries stored per run.

A *curve* is one run's metric by evaluation length: a mapping ``{eval_length: value}``,
a ``pd.Series`` indexed by length, or a sequence of ``(eval_length, value)`` pairs (an
iterator is consumed by one call). A length counts as *evaluated* when its value is not
None/NaN (inf is kept: a diverged evaluation is an evaluated, very bad, point)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

import numpy as np
import pandas as pd

from core.analysis.base import (
    FACTORS,
)
from core.metrics import METRICS, Kind, headlines

Curve = Mapping[int, float | None] | Iterable[tuple[int, float | None]]


def points(curve: Curve) -> dict[int, float]:
    """The evaluated points of a curve as ``{length: value}`` sorted by length."""
    pairs = curve.items() if hasattr(curve, "items") else curve
    out: dict[int, float] = {}
    for length, value in pairs:
        if pd.isna(value):
            continue
        if int(length) in out:
            raise ValueError(f"length {length} appears twice in one curve")
        out[int(length)] = float(value)
    return dict(sorted(out.items()))


def extrapolation_ratio(curve: Curve, train_length: int, factor: float) -> float | None:
    """``value(factor * train_length) / value(train_length)``.

    None when either length was not evaluated, or the training-length value is 0 (the
    ratio is undefined, e.g. accuracy 0). Above 1 is worse for perplexity/loss, better
    for accuracy.
    """
    values = points(curve)
    target = factor * train_length
    if target != int(target) or int(target) not in values or train_length not in values:
        return None
    base = values[train_length]
    return values[int(target)] / base if base != 0 else None


def effective_context_length(
    curve: Curve,
    train_length: int,
    metric: str,
    tolerance: float = 0.10,
    accuracy_threshold: float = 0.5,
    *,
    threshold: float | None = None,
    relative: float | None = None,
) -> int | None:
    """The longest evaluated length the model holds up to, starting from the training length.

    Defined for the metrics tasks are scored by (``core.metrics``: headline).
    Lower is better (perplexity): the longest evaluated L >= train_length such that
    every evaluated length in [train_length, L] has
    ``value <= (1 + tolerance) * value(train_length)``.
    Higher is better (accuracy): the same with ``value >= accuracy_threshold``.
    "Stays within" means contiguously: once a length fails, a later recovery does not
    count. None when train_length was not evaluated, or (accuracy) when the accuracy at
    the training length is already below the threshold. Lengths below train_length are
    ignored. Other metrics raise ValueError: the definition is about perplexity.
    The answer is censored by the grid: a run that never fails gets its longest
    evaluated length, a lower bound on the true one.

    ``threshold`` (absolute, in the metric's units) or ``relative`` (a fraction of the
    training-length score) replaces the defaults; see ``effective_bound``.
    """
    values = points(curve)
    if train_length not in values:
        return None
    scored = METRICS.get(metric)
    if scored is None or not scored.headline:
        names = " or ".join(m.name for m in headlines())
        raise ValueError(f"effective context length is defined for {names}, not {metric!r}")
    bound = effective_bound(
        values[train_length],
        scored.lower_is_better,
        tolerance=tolerance,
        accuracy_threshold=accuracy_threshold,
        threshold=threshold,
        relative=relative,
    )
    if scored.lower_is_better:
        holds = {n: v <= bound for n, v in values.items()}
    else:
        holds = {n: v >= bound for n, v in values.items()}
    longest = None
    for length in (n for n in holds if n >= train_length):
        if not holds[length]:
            break
        longest = length
    return longest


def effective_bound(
    base: float,
    lower_is_better: bool,
    *,
    tolerance: float = 0.10,
    accuracy_threshold: float = 0.5,
    threshold: float | None = None,
    relative: float | None = None,
) -> float:
    """The value a length must stay within for the effective length, ``base`` being the
    value at the training length: ``threshold`` itself when given (an upper bound for
    lower-is-better metrics, a lower bound otherwise); with ``relative`` r, ``r * base``
    for higher-is-better metrics and ``base / r`` for lower-is-better ones (keep a
    fraction r of the 1x score: r = 0.9 allows perplexity up to 1.11x its 1x value);
    otherwise the defaults, ``(1 + tolerance) * base`` or ``accuracy_threshold``."""
    if threshold is not None:
        return float(threshold)
    if relative is not None:
        return base / relative if lower_is_better else relative * base
    return (1 + tolerance) * base if lower_is_better else accuracy_threshold


def _log_points(curve: Curve, start: int | None, end: int | None) -> tuple[np.ndarray, np.ndarray]:
    """ln(length) and ln(value) of the evaluated points in [start, end]."""
    kept = [
        (n, v)
        for n, v in points(curve).items()
        if (start is None or n >= start) and (end is None or n <= end)
    ]
    return np.log([n for n, _ in kept], dtype=float), np.log([v for _, v in kept], dtype=float)


def _trapezoid(x: np.ndarray, y: np.ndarray) -> float:
    return float(np.sum((y[1:] + y[:-1]) / 2 * np.diff(x)))


def log_perplexity_area(
    curve: Curve, start: int | None = None, end: int | None = None
) -> float | None:
    """Trapezoidal integral of ln(perplexity) d ln(length) over the evaluated lengths in
    [start, end] (default: every evaluated length).

    The integral runs from the first to the last evaluated length inside the range, not
    from ``start``/``end`` themselves. It grows with the span of the grid, so compare
    areas only on the same grid; ``mean_log_perplexity`` is the grid-independent form.
    None with fewer than two points.
    """
    x, y = _log_points(curve, start, end)
    return _trapezoid(x, y) if len(x) >= 2 else None


def mean_log_perplexity(
    curve: Curve, start: int | None = None, end: int | None = None
) -> float | None:
    """``log_perplexity_area / ln(last / first)`` over the same points: the average
    ln(perplexity) per unit of log-length, comparable across grids and ranges
    (exp of it is a "typical" perplexity over the range). None with fewer than two points.
    """
    x, y = _log_points(curve, start, end)
    return _trapezoid(x, y) / float(x[-1] - x[0]) if len(x) >= 2 else None


def summary_keys(factors: Sequence[float] = FACTORS) -> list[str]:
    """The keys of ``summarize_run`` for these factors, in order (column names to store)."""
    return [f"ratio_{factor:g}x" for factor in factors] + [
        "effective_length",
        "effective_length_censored",
        "log_ppl_area",
        "mean_log_ppl",
        "beyond_training",
    ]


def beyond_training(curve: Curve, train_length: int, metric: str) -> float | None:
    """The mean of an answer task's headline metric over the evaluated lengths longer
    than ``train_length`` (Ruoss et al. 2023's score of length generalisation, over the
    lengths past the training range). None for any other metric, where no evaluated
    length is longer, or where one of them has no value (a learned table past its end:
    a mean over the lengths it can read would flatter it)."""
    scored = METRICS.get(metric)
    if scored is None or not scored.headline or scored.kind is not Kind.ANSWER:
        return None
    pairs = curve.items() if hasattr(curve, "items") else curve
    beyond = [value for length, value in pairs if int(length) > train_length]
    if not beyond or any(value is None or pd.isna(value) for value in beyond):
        return None
    return float(np.mean([float(value) for value in beyond]))


def summarize_run(
    curve: Curve,
    train_length: int,
    metric: str,
    factors: Sequence[float] = FACTORS,
    effective: Mapping[str, float | None] | None = None,
) -> dict[str, float | int | None]:
    """Every per-run summary as a flat dict with stable keys (a database row later).

    Keys: ``ratio_{f}x`` for each factor (extrapolation_ratio), ``effective_length``
    (effective_context_length with default tolerance/threshold),
    ``effective_length_censored`` (1.0 when that is the longest evaluated length, so
    only a lower bound; 0.0 when the run failed at the next length), ``log_ppl_area`` and
    ``mean_log_ppl`` (over every evaluated length), ``beyond_training`` (an answer task's
    mean score past the training length). Keys whose definition does not apply to
    ``metric`` are present with None: effective_length for metrics tasks are not scored
    by (not headline), the log-perplexity pair for metrics not on a log scale,
    beyond_training for any metric but an answer task's headline.

    A point given with value None is a length evaluated but without a value (a learned
    table past its end): the log-perplexity pair is then None too, since an average over
    only the lengths the encoding can read would not compare with curves that pay for
    the longer ones.

    ``effective`` (a study's ``eval.effective_length``: ``threshold`` or ``relative``)
    replaces the default bound of the effective length.
    """
    given = list(curve.items() if hasattr(curve, "items") else curve)
    censored = any(value is None or pd.isna(value) for _, value in given)
    values = points(given)
    out: dict[str, float | int | None] = {
        f"ratio_{factor:g}x": extrapolation_ratio(values, train_length, factor)
        for factor in factors
    }
    scored = METRICS.get(metric)
    applies = scored is not None and scored.headline
    chosen = {k: v for k, v in (effective or {}).items() if k in ("threshold", "relative")}
    effective = (
        effective_context_length(values, train_length, metric, **chosen) if applies else None
    )
    out["effective_length"] = effective
    # 1: the run held up to its longest evaluated length (one without a value counts: a
    # learned table past its end did not hold there), so its effective length is a lower
    # bound set by the grid, not a length where it failed.
    longest = max((length for length, _ in given), default=None)
    out["effective_length_censored"] = None if effective is None else float(effective == longest)
    whole = scored is not None and scored.log_scale and not censored
    out["log_ppl_area"] = log_perplexity_area(values) if whole else None
    out["mean_log_ppl"] = mean_log_perplexity(values) if whole else None
    out["beyond_training"] = beyond_training(given, train_length, metric)
    return out


class Summary(NamedTuple):
    """One number a run's curve is turned into: a row of ``run_summaries``."""

    variant: str
    protocol: str
    name: str
    value: float | None


# Extra summaries (the order probe) belong to the trained model and are not read off
# a curve: they are stored under the protocol ``ANY_PROTOCOL`` and hold whichever
# evaluation protocol a reader picks.
EXTRA_VARIANT = "none"
ANY_PROTOCOL = "any"


def holds_for(summary_protocol: str, protocol: str) -> bool:
    """Whether a summary stored under ``summary_protocol`` belongs with ``protocol``."""
    return summary_protocol in (protocol, ANY_PROTOCOL)


def summarize_points(
    points: Iterable[tuple[str, str, int, float | None]],
    *,
    train_length: int,
    metric: str,
    extra: Mapping[str, float] | None = None,
    effective: Mapping[str, float | None] | None = None,
    growth: Iterable[tuple[str, str, int, float | None]] | None = None,
) -> list[Summary]:
    """``summarize_run`` for every curve of one run, its points given as (variant,
    protocol, length, metric value or None), plus ``extra`` named values (the order
    probe's) under the trained model's variant.

    With a non-default ``effective`` (the study's ``eval.effective_length``), each curve
    also gets ``effective_length_bound``: the value its effective length was held to (the
    absolute threshold, or the relative one applied to that curve's 1x score); the
    default adds no row, so existing studies' summaries are unchanged.

    ``growth`` (the run's points of ``core.metrics.GROWTH_DIAGNOSTIC``, with
    eval.diagnostics) adds ``attn_entropy_growth`` per curve: its value at the longest
    length less its value at the training length."""
    curves: dict[tuple[str, str], dict[int, float | None]] = {}
    for variant, protocol, length, value in points:
        curves.setdefault((variant, protocol), {})[length] = value
    out = [
        Summary(variant, protocol, name, value)
        for (variant, protocol), curve in sorted(curves.items())
        for name, value in summarize_run(curve, train_length, metric, effective=effective).items()
    ]
    if effective and any(effective.get(k) is not None for k in ("threshold", "relative")):
        out += [
            Summary(variant, protocol, BOUND_SUMMARY, bound)
            for (variant, protocol), curve in sorted(curves.items())
            if (bound := _bound_of(curve, train_length, metric, effective)) is not None
        ]
    out += [
        Summary(variant, protocol, SHORT_CONTEXT_SUMMARY, ratio)
        for (variant, protocol), curve in sorted(curves.items())
        if variant != EXTRA_VARIANT
        and (
            ratio := short_context_ratio(curve, curves.get((EXTRA_VARIANT, protocol)), train_length)
        )
        is not None
    ]
    out += [Summary(EXTRA_VARIANT, ANY_PROTOCOL, k, v) for k, v in (extra or {}).items()]
    return out + growth_summaries(growth or (), train_length)


def growth_summaries(
    points: Iterable[tuple[str, str, int, float | None]], train_length: int
) -> list[Summary]:
    """Per curve of a diagnostic's points: the value at its longest length less the value
    at the training length (both measured; none otherwise)."""
    curves: dict[tuple[str, str], dict[int, float]] = {}
    for variant, protocol, length, value in points:
        if value is not None and not pd.isna(value):
            curves.setdefault((variant, protocol), {})[length] = float(value)
    return [
        Summary(variant, protocol, GROWTH_SUMMARY, curve[max(curve)] - curve[train_length])
        for (variant, protocol), curve in sorted(curves.items())
        if train_length in curve and max(curve) > train_length
    ]


GROWTH_SUMMARY = "attn_entropy_growth"
BOUND_SUMMARY = "effective_length_bound"
SHORT_CONTEXT_SUMMARY = "short_context_ratio"


def short_context_ratio(
    variant: Mapping[int, float | None],
    trained: Mapping[int, float | None] | None,
    train_length: int,
) -> float | None:
    """A variant's metric at the training length (1x) over the trained model's there:
    what a scaling or a fine-tuning costs on short texts (Qwen's warning about static
    YaRN). Above 1 is worse for perplexity, below 1 for accuracy; None where 1x was not
    evaluated, has no value, or the trained model's is 0."""
    own = variant.get(train_length)
    base = (trained or {}).get(train_length)
    if own is None or base is None or pd.isna(own) or pd.isna(base) or base == 0:
        return None
    return float(own) / float(base)


def effective_setting(spec) -> dict[str, float | None] | None:
    """A study spec's ``eval.effective_length`` as ``summarize_points`` takes it."""
    chosen = getattr(spec.eval, "effective_length", None)
    return None if chosen is None else chosen.model_dump()


def _bound_of(
    curve: Mapping[int, float | None],
    train_length: int,
    metric: str,
    effective: Mapping[str, float | None],
) -> float | None:
    """The bound ``effective`` sets for this curve: None where no effective length applies."""
    scored = METRICS.get(metric)
    base = curve.get(train_length)
    if scored is None or not scored.headline or base is None or pd.isna(base):
        return None
    return effective_bound(
        float(base),
        scored.lower_is_better,
        threshold=effective.get("threshold"),
        relative=effective.get("relative"),
    )


# ---------------------------------------------------------------------------------------
# Statistics across seeds
