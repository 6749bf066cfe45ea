"""Statistics across seeds: bootstrap intervals, win probabilities, the per-line seed
summary and the pairwise table with its plain-words claims. Frames are what
``db.queries.curves`` returns; rows with ``not_applicable`` set or a NaN metric are
dropped before any statistic."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import pandas as pd

from core.analysis.base import (
    PAIRWISE_COLUMNS,
    RESAMPLES,
    SUMMARY_COLUMNS,
    lower_is_better_for,
)


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
