"""Turn extrapolation curves into answers: per-run summaries and statistics across seeds.

A *curve* is one run's metric by evaluation length: a mapping ``{eval_length: value}``,
a ``pd.Series`` indexed by length, or a sequence of ``(eval_length, value)`` pairs (an
iterator is consumed by one call). A length counts as *evaluated* when its value is not
None/NaN (inf is kept: a diverged evaluation is an evaluated, very bad, point). Frames
are what ``db.queries.curves`` returns; rows with ``not_applicable`` set (e.g. a learned
absolute encoding beyond its table) or a NaN metric are dropped before any statistic.

Only numpy and pandas here: the CLI, the worker and the dashboard all import this.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import pandas as pd

Curve = Mapping[int, float | None] | Iterable[tuple[int, float | None]]

LOWER_IS_BETTER = {
    "loss": True,
    "perplexity": True,
    "bits_per_byte": True,
    "accuracy": False,
    "token_accuracy": False,
}
FACTORS = (2, 4, 8, 16, 32)
RESAMPLES = 2000
SUMMARY_COLUMNS = ["line", "study_id", "eval_length", "mean", "low", "high", "seeds"]
PAIRWISE_COLUMNS = [
    "a",
    "b",
    "eval_length",
    "mean_a",
    "mean_b",
    "p_a_wins",
    "seeds_a",
    "seeds_b",
    "paired",
]


def lower_is_better_for(metric: str) -> bool:
    """Whether a smaller value of ``metric`` is better (accuracy is the only "higher")."""
    if metric not in LOWER_IS_BETTER:
        raise ValueError(f"unknown metric {metric!r}; expected one of {sorted(LOWER_IS_BETTER)}")
    return LOWER_IS_BETTER[metric]


def line_name(label: str, variant: str, study_id: int | None = None) -> str:
    """What a curve is called: the encoding label, its inference-time variant unless
    none, and its study when several studies are shown together."""
    name = label if variant == "none" else f"{label} + {variant}"
    return name if study_id is None else f"{name} [study {study_id}]"


def with_lines(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` (curves or stored summaries) with a ``line`` column of ``line_name``s."""
    several = frame["study_id"].nunique() > 1
    names = [
        line_name(label, variant, study if several else None)
        for label, variant, study in zip(
            frame["label"], frame["variant"], frame["study_id"], strict=True
        )
    ]
    return frame.assign(line=pd.Series(names, index=frame.index, dtype=object))


# ---------------------------------------------------------------------------------------
# Per-curve summaries


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
) -> int | None:
    """The longest evaluated length the model holds up to, starting from the training length.

    perplexity: the longest evaluated L >= train_length such that every evaluated length
    in [train_length, L] has ``value <= (1 + tolerance) * value(train_length)``.
    accuracy: the same with ``value >= accuracy_threshold``.
    "Stays within" means contiguously: once a length fails, a later recovery does not
    count. None when train_length was not evaluated, or (accuracy) when the accuracy at
    the training length is already below the threshold. Lengths below train_length are
    ignored. Other metrics raise ValueError: the definition is about perplexity.
    The answer is censored by the grid: a run that never fails gets its longest
    evaluated length, a lower bound on the true one.
    """
    values = points(curve)
    if train_length not in values:
        return None
    if metric == "perplexity":
        bound = (1 + tolerance) * values[train_length]
        holds = {n: v <= bound for n, v in values.items()}
    elif metric == "accuracy":
        holds = {n: v >= accuracy_threshold for n, v in values.items()}
    else:
        raise ValueError(
            f"effective context length is defined for perplexity or accuracy, not {metric!r}"
        )
    longest = None
    for length in (n for n in holds if n >= train_length):
        if not holds[length]:
            break
        longest = length
    return longest


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
    ]


def summarize_run(
    curve: Curve, train_length: int, metric: str, factors: Sequence[float] = FACTORS
) -> dict[str, float | int | None]:
    """Every per-run summary as a flat dict with stable keys (a database row later).

    Keys: ``ratio_{f}x`` for each factor (extrapolation_ratio), ``effective_length``
    (effective_context_length with default tolerance/threshold),
    ``effective_length_censored`` (1.0 when that is the longest evaluated length, so
    only a lower bound; 0.0 when the run failed at the next length), ``log_ppl_area`` and
    ``mean_log_ppl`` (over every evaluated length). Keys whose definition does not apply
    to ``metric`` are present with None: effective_length for metrics other than
    perplexity/accuracy, the log-perplexity pair for metrics other than perplexity.

    A point given with value None is a length evaluated but without a value (a learned
    table past its end): the log-perplexity pair is then None too, since an average over
    only the lengths the encoding can read would not compare with curves that pay for
    the longer ones.
    """
    given = list(curve.items() if hasattr(curve, "items") else curve)
    censored = any(value is None or pd.isna(value) for _, value in given)
    values = points(given)
    out: dict[str, float | int | None] = {
        f"ratio_{factor:g}x": extrapolation_ratio(values, train_length, factor)
        for factor in factors
    }
    applies = metric in ("perplexity", "accuracy")
    effective = effective_context_length(values, train_length, metric) if applies else None
    out["effective_length"] = effective
    # 1: the run held up to its longest evaluated length (one without a value counts: a
    # learned table past its end did not hold there), so its effective length is a lower
    # bound set by the grid, not a length where it failed.
    longest = max((length for length, _ in given), default=None)
    out["effective_length_censored"] = None if effective is None else float(effective == longest)
    whole = metric == "perplexity" and not censored
    out["log_ppl_area"] = log_perplexity_area(values) if whole else None
    out["mean_log_ppl"] = mean_log_perplexity(values) if whole else None
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
) -> list[Summary]:
    """``summarize_run`` for every curve of one run, its points given as (variant,
    protocol, length, metric value or None), plus ``extra`` named values (the order
    probe's) under the trained model's variant."""
    curves: dict[tuple[str, str], dict[int, float | None]] = {}
    for variant, protocol, length, value in points:
        curves.setdefault((variant, protocol), {})[length] = value
    out = [
        Summary(variant, protocol, name, value)
        for (variant, protocol), curve in sorted(curves.items())
        for name, value in summarize_run(curve, train_length, metric).items()
    ]
    out += [Summary(EXTRA_VARIANT, ANY_PROTOCOL, k, v) for k, v in (extra or {}).items()]
    return out


# ---------------------------------------------------------------------------------------
# Statistics across seeds


def _clean(values: Iterable[float | None]) -> np.ndarray:
    array = np.array([np.nan if v is None else v for v in values], dtype=float)
    return array[~np.isnan(array)]


def _resampled_means(values: np.ndarray, resamples: int, rng: np.random.Generator) -> np.ndarray:
    """Means of ``resamples`` draws of len(values) values with replacement."""
    return values[rng.integers(0, len(values), size=(resamples, len(values)))].mean(axis=1)


def bootstrap_interval(
    values: Iterable[float | None], level: float = 0.95, resamples: int = RESAMPLES, seed: int = 0
) -> tuple[float, float, float]:
    """``(mean, low, high)``: the mean of the values and the percentile bootstrap interval.

    low/high are the (1-level)/2 and (1+level)/2 quantiles (the order statistics below
    and above) of the means of ``resamples`` resamples (with replacement, same size)
    drawn by ``np.random.default_rng(seed)``,
    widened if needed to contain the mean (rounding can put a zero-width interval an ulp
    off it). None/NaN values are dropped. One value gives (v, v, v): callers must read
    the seed count, not the width, to know there is no spread estimate. No values give
    (nan, nan, nan).
    """
    array = _clean(values)
    if len(array) == 0:
        return math.nan, math.nan, math.nan
    mean = float(array.mean())
    if len(array) == 1:
        return mean, mean, mean
    means = _resampled_means(array, resamples, np.random.default_rng(seed))
    # Order statistics, not interpolation: conservative, and an infinite value (a
    # diverged evaluation) gives an infinite bound instead of inf - inf = nan.
    low = np.quantile(means, (1 - level) / 2, method="lower")
    high = np.quantile(means, (1 + level) / 2, method="higher")
    return mean, min(float(low), mean), max(float(high), mean)


def win_probability(
    a_values: Iterable[float | None],
    b_values: Iterable[float | None],
    lower_is_better: bool,
    resamples: int = RESAMPLES,
    seed: int = 0,
    paired: bool = False,
) -> float:
    """Fraction of bootstrap draws in which mean(a) beats mean(b); ties count half.

    Unpaired, each draw resamples a and b independently, each with replacement from its
    own seeds (one ``np.random.default_rng(seed)``, a's draws first). Paired, a[i] and
    b[i] are two measurements of one unit (the same training seed of one study: the same
    batches and evaluation windows) and each draw resamples the pairs, so the noise the
    two share cancels. Means equal to within 1e-12 relative are ties, so summation order
    cannot decide them. Unpaired, None/NaN values are dropped; NaN when either side has
    no values. Paired, the two sides must have equal lengths and no missing values.
    """
    rng = np.random.default_rng(seed)
    if paired:
        a = np.asarray(list(a_values), dtype=float)
        b = np.asarray(list(b_values), dtype=float)
        if a.shape != b.shape or np.isnan(a).any() or np.isnan(b).any():
            raise ValueError("paired values need equal counts and no missing values")
        if len(a) == 0:
            return math.nan
        picks = rng.integers(0, len(a), size=(resamples, len(a)))
        mean_a, mean_b = a[picks].mean(axis=1), b[picks].mean(axis=1)
    else:
        a, b = _clean(a_values), _clean(b_values)
        if len(a) == 0 or len(b) == 0:
            return math.nan
        mean_a, mean_b = _resampled_means(a, resamples, rng), _resampled_means(b, resamples, rng)
    tie = np.isclose(mean_a, mean_b, rtol=1e-12, atol=0)
    wins = (mean_a < mean_b) if lower_is_better else (mean_a > mean_b)
    return float(np.mean(np.where(tie, 0.5, wins)))


def applicable(frame: pd.DataFrame, metric: str, line: str) -> pd.DataFrame:
    """The rows that have a value: not_applicable unset and the metric not NaN.

    Raises ValueError when a run has two values at one length within a line (several
    variants or protocols under one label): those are not seeds, and pooling them would
    be silently wrong. Filter the frame, or build a line column that tells them apart.
    """
    data = frame[frame["not_applicable"].isna() & frame[metric].notna()]
    repeated = data.duplicated([line, "run_id", "eval_length"])
    if repeated.any():
        example = data.loc[repeated].iloc[0]
        raise ValueError(
            f"run {example['run_id']} has several {metric} values at length "
            f"{example['eval_length']} in line {example[line]!r}: filter to one variant "
            f"and protocol, or group by a column that separates them"
        )
    return data


def seed_summary(
    frame: pd.DataFrame,
    metric: str,
    line: str = "label",
    level: float = 0.95,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> pd.DataFrame:
    """Mean and bootstrap interval across seeds for every (line, study, length).

    Columns: line (the values of column ``line``; ``with_lines`` builds the names the
    dashboard and CLI use), study_id, eval_length, mean, low, high, seeds (runs with a
    value). Each point is bootstrapped
    with a fresh generator from ``seed``, so a point's interval does not depend on what
    else is in the frame.
    """
    data = applicable(frame, metric, line)
    rows = [
        (
            name,
            study,
            length,
            *bootstrap_interval(group[metric], level, resamples, seed),
            len(group),
        )
        for (name, study, length), group in data.groupby(
            [line, "study_id", "eval_length"], sort=False
        )
    ]
    return pd.DataFrame(rows, columns=SUMMARY_COLUMNS)


def _units(group: pd.DataFrame, metric: str) -> pd.Series | None:
    """One line's values at one length keyed by (study, seed), or None when a key
    repeats or the frame has no seed column (then the values cannot be paired)."""
    if "seed" not in group or "study_id" not in group:
        return None
    keyed = group.set_index(["study_id", "seed"])[metric]
    return None if keyed.index.has_duplicates else keyed.sort_index()


def pairwise_table(
    frame: pd.DataFrame,
    metric: str,
    lower_is_better: bool | None = None,
    line: str = "label",
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> pd.DataFrame:
    """Every unordered pair of lines a < b (string order) at every length both evaluated.

    p_a_wins is ``win_probability`` of a over b across their seeds (p of b winning is
    1 - p_a_wins); lower_is_better defaults to the metric's direction. When both lines
    ran exactly the same seeds of the same studies, the runs are paired by (study, seed)
    (``paired`` is True): a seed fixes the training batches whatever the encoding, and
    every run of a study is scored on the same bytes, so the paired bootstrap compares
    the encodings on the same data. Otherwise (a seed missing on one side, e.g. a
    failed run) the seeds are resampled independently. A line should name one
    configuration: runs of one line in several studies are pooled as seeds. Each cell
    uses a fresh generator from ``seed``.
    """
    lower = lower_is_better_for(metric) if lower_is_better is None else lower_is_better
    data = applicable(frame, metric, line)
    by_cell = {key: group for key, group in data.groupby([line, "eval_length"])}
    names = sorted({name for name, _ in by_cell}, key=str)
    lengths = sorted({length for _, length in by_cell})
    rows = []
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            for length in lengths:
                if (a, length) not in by_cell or (b, length) not in by_cell:
                    continue
                va, vb = by_cell[a, length][metric], by_cell[b, length][metric]
                ua, ub = _units(by_cell[a, length], metric), _units(by_cell[b, length], metric)
                paired = ua is not None and ub is not None and ua.index.equals(ub.index)
                if paired:
                    va, vb = ua, ub
                p = win_probability(va, vb, lower, resamples, seed, paired=paired)
                rows.append((a, b, int(length), va.mean(), vb.mean(), p, len(va), len(vb), paired))
    return pd.DataFrame(rows, columns=PAIRWISE_COLUMNS)


def claim(row: Mapping[str, Any] | pd.Series, train_length: int | None) -> str:
    """One pairwise row as a sentence: "alibi beats rope at 4x with probability 0.97
    (3 vs 2 seeds)", or "(3 paired seeds)" for a paired row ("at length 512" without a
    training length, e.g. across studies trained differently). The seed counts stay in
    the sentence because a bootstrap over a handful of seeds is overconfident: it never
    looks beyond the values it has seen (with one seed a side, the probability is 0, 0.5
    or 1).

    The winner is whichever side wins in at least half of the draws (a at exactly 0.5).
    Two lines with the same mean tie ("rope + ntk:auto and rope + dynamic_ntk tie at
    4x"); with one seed a side there is no probability to give, only which was better.
    """
    p = float(row["p_a_wins"])
    winner, loser = (row["a"], row["b"]) if p >= 0.5 else (row["b"], row["a"])
    length = int(row["eval_length"])
    where = f"{length / train_length:g}x" if train_length else f"length {length}"
    means = [row.get("mean_a"), row.get("mean_b")]
    if None not in means and math.isclose(*map(float, means), rel_tol=1e-12):
        return f"{row['a']} and {row['b']} tie at {where}: the same mean"
    if row.get("seeds_a") == 1 and row.get("seeds_b") == 1:
        return f"{winner} is better than {loser} at {where} on the one seed each (no probability)"
    sentence = f"{winner} beats {loser} at {where} with probability {max(p, 1 - p):.2f}"
    if "seeds_a" not in row:
        return sentence
    if bool(row.get("paired", False)):
        return f"{sentence} ({row['seeds_a']} paired seeds)"
    seeds = (row["seeds_a"], row["seeds_b"]) if p >= 0.5 else (row["seeds_b"], row["seeds_a"])
    return f"{sentence} ({seeds[0]} vs {seeds[1]} seeds)"


TRAINING_COLUMNS = [
    "line",
    "run_id",
    "seed",
    "step",
    "loss",
    "val_loss",
    "lr",
    "tokens_per_second",
    "elapsed",
]


def run_notes(runs: pd.DataFrame) -> list[str]:
    """Per run (``db.queries.runs``), what it is doing that its status does not say: a
    queued run waiting for the run that trains the same model, a running one
    fine-tuning a variant after its training (``worker.tasks``)."""
    notes = []
    for status, provenance in zip(runs["status"], runs["provenance"], strict=True):
        noted = provenance if isinstance(provenance, Mapping) else {}
        if status == "queued" and noted.get("waiting_for") is not None:
            notes.append(f"waiting for run {noted['waiting_for']}, which trains the same model")
        elif status == "running" and noted.get("phase"):
            notes.append(str(noted["phase"]))
        else:
            notes.append("")
    return notes


def training_curves(points: pd.DataFrame, runs: pd.DataFrame) -> pd.DataFrame:
    """Every stored training point (``db.queries.train_points``) with its run's line
    (``with_lines`` of the trained model; ``runs`` needs id, study_id, label, seed)."""
    if points.empty:
        return pd.DataFrame(columns=TRAINING_COLUMNS)
    named = with_lines(runs.rename(columns={"id": "run_id"}).assign(variant="none"))
    merged = points.merge(named[["run_id", "line", "seed"]], on="run_id")
    return merged[TRAINING_COLUMNS].sort_values(["line", "seed", "step"], ignore_index=True)


def training_table(curves: pd.DataFrame) -> pd.DataFrame:
    """One row per run: steps reported, the last and the lowest training loss, the last
    and the lowest validation loss (NaN for a run that never validated), the median
    throughput, and the training time (``elapsed`` at the last point)."""
    rows = []
    for (line, seed), group in curves.groupby(["line", "seed"], sort=True):
        group = group.sort_values("step")
        validated = group["val_loss"].dropna()
        rows.append(
            {
                "line": line,
                "seed": int(seed),
                "steps": int(group["step"].max()),
                "final loss": float(group["loss"].iloc[-1]),
                "lowest loss": float(group["loss"].min()),
                "final val loss": float(validated.iloc[-1]) if len(validated) else math.nan,
                "lowest val loss": float(validated.min()) if len(validated) else math.nan,
                "tokens/s": float(group["tokens_per_second"].median()),
                "seconds": float(group["elapsed"].max()),
            }
        )
    return pd.DataFrame(rows)


def group_accuracy(frame: pd.DataFrame, line: str = "line") -> pd.DataFrame:
    """Accuracy by each key of the groups synthetic tasks report (labels such as
    ``depth=0.5`` or ``variant=marked depth=0.5``): one row per (line, eval_length, key,
    value) with the accuracy averaged over the other keys, then over runs (seeds).
    """
    rows = []
    for record in frame.itertuples(index=False):
        groups = getattr(record, "groups", None)
        if not isinstance(groups, Mapping):
            continue
        for label, accuracy in groups.items():
            for part in label.split():
                key, _, value = part.partition("=")
                rows.append(
                    (getattr(record, line), record.eval_length, record.run_id, key, value, accuracy)
                )
    columns = ["line", "eval_length", "run_id", "key", "value", "accuracy"]
    data = pd.DataFrame(rows, columns=columns)
    keys = ["line", "eval_length", "key", "value"]
    per_run = data.groupby([*keys, "run_id"], sort=False)["accuracy"].mean().reset_index()
    out = per_run.groupby(keys, sort=False)["accuracy"].agg(["mean", "count"]).reset_index()
    return out.rename(columns={"mean": "accuracy", "count": "seeds"})


def run_summaries(
    frame: pd.DataFrame,
    metric: str,
    train_lengths: Mapping[int, int],
    line: str = "label",
    factors: Sequence[float] = FACTORS,
) -> pd.DataFrame:
    """One row per (line, run): line, study_id, run_id, seed, then ``summarize_run``'s keys.

    ``train_lengths`` maps study_id to the study's training length (``curves()`` rows do
    not carry it; ``queries.studies`` does).
    """
    applicable(frame, metric, line)  # refuses several values at one length of a run
    rows = []
    for (name, study, run, seed), group in frame.groupby(
        [line, "study_id", "run_id", "seed"], sort=False
    ):
        # Lengths past an encoding's end count as evaluated without a value.
        values = group[metric].where(group["not_applicable"].isna(), None)
        curve = zip(group["eval_length"], values, strict=True)
        summary = summarize_run(curve, train_lengths[study], metric, factors)
        rows.append({"line": name, "study_id": study, "run_id": run, "seed": seed, **summary})
    return pd.DataFrame(
        rows, columns=["line", "study_id", "run_id", "seed", *summary_keys(factors)]
    )


def encoding_summaries(
    frame: pd.DataFrame,
    metric: str,
    train_lengths: Mapping[int, int],
    line: str = "label",
    factors: Sequence[float] = FACTORS,
    level: float = 0.95,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> pd.DataFrame:
    """The per-run summaries of a curves frame aggregated across seeds
    (``summary_statistics`` of ``run_summaries``)."""
    runs = run_summaries(frame, metric, train_lengths, line, factors)
    long = runs.melt(
        id_vars=["line", "study_id", "run_id", "seed"],
        value_vars=summary_keys(factors),
        var_name="summary",
    )
    return summary_statistics(long, level=level, resamples=resamples, seed=seed)


GEOMETRIC = ("effective_length",)  # summaries averaged on a log scale across seeds


def summary_statistics(
    summaries: pd.DataFrame,
    line: str = "line",
    level: float = 0.95,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> pd.DataFrame:
    """Per-run summaries (long form: columns ``line``, study_id, summary, value; one row
    per run and summary, as stored in ``run_summaries``) aggregated across seeds: one
    row per (line, study, summary) with mean, low, high (``bootstrap_interval``) and
    seeds (runs where it is defined). Summaries no run of a line defines are left out.

    The effective length lives on a doubling grid of lengths, so its mean and interval
    are geometric (taken over log2 of the lengths): seeds at 128 and 512 average to
    256, an evaluated length, not to 320.
    """
    rows = []
    for (name, study, key), group in summaries.groupby([line, "study_id", "summary"], sort=False):
        values = _clean(group["value"])
        if len(values) and key in GEOMETRIC and (values > 0).all():
            logs = bootstrap_interval(np.log2(values), level, resamples, seed)
            rows.append((name, study, key, *(float(2.0**v) for v in logs), len(values)))
        elif len(values):
            stats = bootstrap_interval(values, level, resamples, seed)
            rows.append((name, study, key, *stats, len(values)))
    columns = ["line", "study_id", "summary", "mean", "low", "high", "seeds"]
    return pd.DataFrame(rows, columns=columns)


# ---------------------------------------------------------------------------------------
# Presentation shared by the CLI and the dashboard

SUMMARY_LABELS = {
    **{f"ratio_{f:g}x": f"ratio {f:g}x" for f in FACTORS},
    "effective_length": "effective length",
    "mean_log_ppl": "mean ln ppl",
    "log_ppl_area": "ln ppl area",
    "order_sensitivity": "order sensitivity",
    "order_ordered_loss": "loss, ordered",
    "order_shuffled_loss": "loss, shuffled",
}


# What a terminal table shows; the rest stays in JSON / CSV and on the dashboard.
KEY_SUMMARIES = (
    *(f"ratio_{f:g}x" for f in FACTORS),
    "effective_length",
    "mean_log_ppl",
    "order_sensitivity",
)


def summary_grid(stats: pd.DataFrame, names: Sequence[str] | None = None) -> pd.DataFrame:
    """``summary_statistics`` as one row per line and one column per summary (only
    ``names`` when given), each cell "mean [low, high]" (just the mean for one seed),
    columns in SUMMARY_LABELS order; an effective length reads "≥ ..." when some seed
    held up to the longest evaluated length (a lower bound set by the grid)."""
    # Censoring marks the effective length ("≥ 1024": some seed never failed up to the
    # end of the grid) instead of being a column of its own.
    censored = stats[stats["summary"] == "effective_length_censored"]
    bounded = set(censored.loc[censored["mean"] > 0, "line"])
    stats = stats[stats["summary"] != "effective_length_censored"]
    if names is not None:
        stats = stats[stats["summary"].isin(names)]
    if stats.empty:
        return pd.DataFrame()
    cells = stats.assign(
        cell=[
            ("≥ " if row.summary == "effective_length" and row.line in bounded else "") + _cell(row)
            for row in stats.itertuples()
        ]
    )
    grid = cells.pivot_table(index="line", columns="summary", values="cell", aggfunc="first")
    known = [key for key in SUMMARY_LABELS if key in grid.columns]
    grid = grid[known + sorted(set(grid.columns) - set(known))]
    grid = grid.rename(columns=SUMMARY_LABELS)
    seeds = stats.groupby("line")["seeds"].max()
    grid.insert(0, "seeds", seeds.reindex(grid.index).astype(int))
    return grid.reindex(list(dict.fromkeys(stats["line"]))).fillna("")


def _cell(row: Any) -> str:
    # Lengths are whole numbers of bytes; everything else reads best at 3 digits.
    form = ".0f" if row.summary == "effective_length" else ".3g"
    if row.seeds == 1:
        return f"{row.mean:{form}}"
    return f"{row.mean:{form}} [{row.low:{form}}, {row.high:{form}}]"
