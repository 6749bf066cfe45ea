"""Terminal views of the database: tables of studies and runs, curves, live progress."""

from __future__ import annotations

import time

import pandas as pd
from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderResult
from rich.padding import Padding
from rich.table import Table

from core.safe_text import text
from core.settings import get_settings
from core.status import FINISHED, RunStatus
from core.tables import seed_means
from core.terminal import run_progress
from db import queries


def frame_table(frame: pd.DataFrame, title: str) -> FrameView:
    """``frame`` as a terminal table; its title, headers and cells are text (a study's
    name, a label or a failure reason is never read as Rich markup). Where the table
    cannot fit the terminal without breaking words, each row is printed as a block of
    ``column  value`` lines instead (``FrameView``)."""
    table = Table(title=text(title))
    needed = 1  # the left border; each column adds its padding and border (3)
    for column in frame.columns:
        # A sentence (the pairwise claim) keeps room to read; no column is narrower than
        # its longest word, so a word is never cut or folded.
        cells = [str(column), *(_cell(v) for v in frame[column])]
        least = max(SENTENCE_WIDTH if column == "claim" else 0, *map(_longest_word, cells))
        table.add_column(text(column), min_width=least)
        needed += 4 + least  # its padding and border (3), and a cell of slack Rich may take
    for row in frame.itertuples(index=False):
        table.add_row(*(text(_cell(v)) for v in row))
    return FrameView(frame, title, table, needed)


SENTENCE_WIDTH = 36


def _longest_word(cell: str) -> int:
    return max((cell_len(word) for word in cell.split()), default=0)


class FrameView:
    """A frame's table where it fits the console's width (each column at least as wide
    as its longest word, so no word is folded), else one block per row: the column
    names down the left, the values beside them, wrapped at spaces."""

    def __init__(self, frame: pd.DataFrame, title: str, table: Table, needed: int) -> None:
        self.frame, self.title, self.table = frame, title, table
        self.needed = needed  # the width at which no column breaks a word

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        if self.needed <= options.max_width:
            yield self.table
            return
        yield text(self.title)
        for row in self.frame.itertuples(index=False):
            block = Table.grid(padding=(0, 2))
            block.add_column(no_wrap=True)
            block.add_column()
            for column, value in zip(self.frame.columns, row, strict=True):
                block.add_row(text(str(column)), text(_cell(value)))
            yield Padding(block, (1, 0, 0, 0))


def _cell(value: object) -> str:
    if isinstance(value, float):
        return "" if pd.isna(value) else f"{value:.4g}"
    return "" if value is None or value is pd.NaT else str(value)


def curve_table(frame: pd.DataFrame, study: pd.Series) -> Table:
    """A study's metric by length (``db.queries.curves`` of it): one row per (encoding
    label, variant, protocol), mean over seeds (``core.tables.seed_means``)."""
    metric = study["metric"]
    table = seed_means(frame, metric, int(study["train_length"]))
    return table.rich(f"study {study['id']} ({study['name']}): {metric} by evaluation length")


def progress(runs: pd.DataFrame, spec: dict | None) -> pd.DataFrame:
    """Each run's progress (``runs``: ``db.queries.runs`` of one study, whose stored spec
    is ``spec``) as ``completed``, ``total`` and ``progress`` ("120/600 steps"): training steps,
    or, for a run that trains nothing (an hf: model), the points of its curve stored out
    of those its evaluation plan has."""
    from core.spec import EvalSpec

    try:
        planned = len(EvalSpec.model_validate((spec or {}).get("eval") or {}).plan(True))
    except ValueError:  # a spec stored under older, looser rules
        planned = 0
    evaluates = runs["total_steps"] == 0
    done = runs["points"].where(evaluates, runs["step"]).fillna(0).astype(int)
    total = runs["total_steps"].where(~evaluates, planned).astype(int)
    unit = evaluates.map({True: "points", False: "steps"})
    text_ = done.astype(str) + "/" + total.astype(str) + " " + unit
    text_ = text_.where(total > 0, done.astype(str) + " " + unit)  # no plan to count against
    return pd.DataFrame({"completed": done, "total": total, "progress": text_}, index=runs.index)


def watch(study_id: int, *, console: Console, every: float = 1.0) -> int:
    """Live progress bars until every run of the study has finished; exit code 0 when all
    are done, 1 when any failed or was cancelled."""

    url = get_settings().database
    spec = queries.study_spec(url, study_id)
    bars_view = run_progress(console, label_width=30)
    bars: dict[int, int] = {}
    with bars_view:
        while True:
            runs = queries.runs(url, study_id=study_id)
            counts = progress(runs, spec)
            for run, done, total in zip(
                runs.itertuples(index=False), counts["completed"], counts["total"], strict=True
            ):
                if run.id not in bars:
                    bars[run.id] = bars_view.add_task(
                        f"{run.label} seed {run.seed}", total=total, status=""
                    )
                note = run.status
                if run.status == RunStatus.RUNNING and not pd.isna(run.latest_loss):
                    note = f"running  loss {run.latest_loss:.3f}"
                if run.status == RunStatus.FAILED:
                    note = f"failed: {run.failure_reason}"
                bars_view.update(bars[run.id], completed=done, status=note)
            if len(runs) and runs["status"].isin(FINISHED).all():
                break
            time.sleep(every)
    return 0 if (runs["status"] == RunStatus.DONE).all() else 1
