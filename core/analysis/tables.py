"""The tables people read: training curves and notes, accuracy by group, per-run and
per-encoding summaries and the summary grid."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from core.analysis.base import (
    FACTORS,
    RESAMPLES,
    with_lines,
)
from core.analysis.curves import (
    summarize_run,
    summary_keys,
)
from core.analysis.statistics import (
    _clean,
    applicable,
    bootstrap_interval,
)
from core.metrics import Kind, headline
from core.status import RunStatus

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
    fine-tuning a variant after its training (its ``waiting_for`` and ``phase``,
    ``jobs.lifecycle``), a run whose results were imported, not trained here (its
    ``imported_from``)."""
    notes = []
    imported = runs["imported_from"] if "imported_from" in runs else [None] * len(runs)
    for status, waiting_for, phase, source in zip(
        runs["status"], runs["waiting_for"], runs["phase"], imported, strict=True
    ):
        if _given(source):
            notes.append(f"imported from {source} (not trained here)")
        elif status == RunStatus.QUEUED and _given(waiting_for):
            notes.append(f"waiting for run {int(waiting_for)}, which trains the same model")
        elif status == RunStatus.RUNNING and _given(phase) and phase:
            notes.append(str(phase))
        else:
            notes.append("")
    return notes


def imported_note(study_id: int, imported: int, runs: int) -> str:
    """The line that says a study's results were imported, not trained here."""
    which = "all its runs were" if imported >= runs else f"{imported} of its {runs} runs were"
    return (
        f"study {study_id}: {which} imported from a results.json (posbench import), "
        "not trained by this service's workers"
    )


def _given(value: Any) -> bool:
    """Not NULL: a DataFrame holds a missing value as None or NaN."""
    return value is not None and not (isinstance(value, float) and math.isnan(value))


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
    scored = headline(Kind.ANSWER).name  # a group's exact-match accuracy
    columns = ["line", "eval_length", "run_id", "key", "value", scored]
    data = pd.DataFrame(rows, columns=columns)
    keys = ["line", "eval_length", "key", "value"]
    per_run = data.groupby([*keys, "run_id"], sort=False)[scored].mean().reset_index()
    out = per_run.groupby(keys, sort=False)[scored].agg(["mean", "count"]).reset_index()
    return out.rename(columns={"mean": scored, "count": "seeds"})


# Group keys the Compare page draws as heatmaps: a retrieval task's needle depth, and
# the lengths of an addition's two operands. EVAL_LENGTH stands for the evaluation
# length itself, which is a row's, not a group label's.
DEPTH = "depth"
OPERANDS = ("i", "j")
EVAL_LENGTH = "eval_length"


def group_keys(frame: pd.DataFrame) -> set[str]:
    """Every key the group labels of ``frame``'s rows use (``depth``, ``variant``, ...)."""
    return {
        part.partition("=")[0]
        for groups in frame.get("groups", [])
        if isinstance(groups, Mapping)
        for label in groups
        for part in label.split()
    }


def group_grid(
    frame: pd.DataFrame,
    rows: str,
    columns: str,
    eval_length: int | None = None,
    line: str = "line",
) -> dict[str, pd.DataFrame]:
    """Per line, a table of group accuracy: one row per value of the group key ``rows``,
    one column per value of ``columns`` (a group key, or EVAL_LENGTH for the evaluation
    length). A run's accuracy in a cell is the mean over the labels that fall in it (the
    other keys, and the lengths unless ``columns`` or ``rows`` is EVAL_LENGTH or
    ``eval_length`` picks one), then the cell is the mean over runs (seeds).

    Values sort as numbers where they all are numbers (``depth=0.25`` before
    ``depth=1``), as text otherwise; every line's table has every value of the frame,
    NaN where the line has no label for it. Lines keep their first-seen order; a frame
    without such labels gives an empty dict.
    """
    if rows == columns:
        raise ValueError(f"rows and columns are both {rows!r}: a grid needs two keys")
    if eval_length is not None:
        frame = frame[frame[EVAL_LENGTH] == eval_length]
    cells = []
    for record in frame.itertuples(index=False):
        groups = getattr(record, "groups", None)
        if not isinstance(groups, Mapping):
            continue
        for label, accuracy in groups.items():
            parts = dict(part.partition("=")[::2] for part in label.split())
            parts[EVAL_LENGTH] = record.eval_length
            if rows in parts and columns in parts:
                cells.append(
                    (getattr(record, line), record.run_id, parts[rows], parts[columns], accuracy)
                )
    if not cells:
        return {}
    data = pd.DataFrame(cells, columns=["line", "run_id", "row", "column", "value"])
    data["row"] = _as_numbers(data["row"])
    data["column"] = _as_numbers(data["column"])
    per_run = data.groupby(["line", "run_id", "row", "column"], sort=False)["value"].mean()
    means = per_run.groupby(level=["line", "row", "column"], sort=False).mean()
    row_values, column_values = sorted(set(data["row"])), sorted(set(data["column"]))
    grids = {}
    for name in dict.fromkeys(data["line"]):
        table = means.xs(name, level="line").unstack("column")
        table = table.reindex(index=row_values, columns=column_values).astype(float)
        table.index.name, table.columns.name = rows, columns
        grids[name] = table
    return grids


def _as_numbers(values: pd.Series) -> pd.Series:
    """``values`` as numbers (whole numbers as int) when every one reads as a number."""
    numbers = pd.to_numeric(values, errors="coerce")
    if numbers.isna().any():
        return values.astype(str)
    integral = (numbers == numbers.round()).all()
    return numbers.astype(int) if integral else numbers.astype(float)


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
    "effective_length_bound": "effective-length bound",
    "mean_log_ppl": "mean ln ppl",
    "log_ppl_area": "ln ppl area",
    "beyond_training": "beyond training",
    "short_context_ratio": "short-context ratio",
    "order_sensitivity": "order sensitivity",
    "order_ordered_loss": "loss, ordered",
    "order_shuffled_loss": "loss, shuffled",
    "attn_entropy_growth": "entropy growth",
}


# What a terminal table shows; the rest stays in JSON / CSV and on the dashboard.
KEY_SUMMARIES = (
    *(f"ratio_{f:g}x" for f in FACTORS),
    "effective_length",
    "effective_length_bound",  # only where the study set its own threshold
    "beyond_training",
    "short_context_ratio",
    "mean_log_ppl",
    "order_sensitivity",
    "attn_entropy_growth",  # only with eval.diagnostics
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
