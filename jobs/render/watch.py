"""Terminal views of the database: tables of studies and runs, curves, live progress."""

from __future__ import annotations

import time

import pandas as pd
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from jobs.render.report import format_value

FINISHED = ("done", "failed", "cancelled")


def frame_table(frame: pd.DataFrame, title: str) -> Table:
    table = Table(title=title)
    for column in frame.columns:
        # A sentence (the pairwise claim) keeps room to read; numbers give way.
        table.add_column(str(column), min_width=36 if column == "claim" else None)
    for row in frame.itertuples(index=False):
        table.add_row(*(_cell(v) for v in row))
    return table


def _cell(value: object) -> str:
    if isinstance(value, float):
        return "" if pd.isna(value) else f"{value:.4g}"
    return "" if value is None or value is pd.NaT else str(value)


def curve_table(frame: pd.DataFrame, study: pd.Series) -> Table:
    """Metric by length: one row per (encoding label, variant, protocol), mean over seeds."""
    metric = study["metric"]
    train_length = int(study["train_length"])
    lengths = sorted(frame["eval_length"].unique()) if not frame.empty else []
    table = Table(title=f"study {study['id']} ({study['name']}): {metric} by evaluation length")
    for column in ("encoding", "variant", "protocol", "seeds"):
        table.add_column(column)
    for n in lengths:
        table.add_column(
            str(n) + ("" if n == train_length else f" ({n / train_length:g}x)"), justify="right"
        )
    for (label, variant, protocol), group in frame.groupby(
        ["label", "variant", "protocol"], sort=False
    ):
        cells = []
        for n in lengths:
            values = group.loc[group["eval_length"] == n, metric].dropna()
            cells.append(format_value(values.mean() if len(values) else None, metric))
        table.add_row(label, variant, protocol, str(group["seed"].nunique()), *cells)
    return table


def watch(study_id: int, *, console: Console, every: float = 1.0) -> int:
    """Live progress bars until every run of the study has finished; exit code 0 when all
    are done, 1 when any failed or was cancelled."""
    from db import queries
    from jobs.settings import get_settings

    url = get_settings().database
    progress = Progress(
        TextColumn("{task.description:<30}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        console=console,
    )
    bars: dict[int, int] = {}
    with progress:
        while True:
            runs = queries.runs(url, study_id=study_id)
            for run in runs.itertuples(index=False):
                if run.id not in bars:
                    bars[run.id] = progress.add_task(
                        f"{run.label} seed {run.seed}", total=run.total_steps, status=""
                    )
                note = run.status
                if run.status == "running" and not pd.isna(run.latest_loss):
                    note = f"running  loss {run.latest_loss:.3f}"
                if run.status == "failed":
                    note = f"failed: {run.failure_reason}"
                progress.update(bars[run.id], completed=run.step, status=note)
            if len(runs) and runs["status"].isin(FINISHED).all():
                break
            time.sleep(every)
    return 0 if (runs["status"] == "done").all() else 1
