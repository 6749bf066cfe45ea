"""``posbench run``: a study in this process, with progress bars and a report."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pandas as pd
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from jobs import analysis
from jobs.report import format_value, markdown_frame, markdown_table, plot_curves
from jobs.spec import StudySpec


def _table(curves: dict[str, dict[int, float | None]], metric: str, train_length: int) -> Table:
    lengths = sorted({n for points in curves.values() for n in points})
    table = Table(title=f"{metric} by evaluation length (train length {train_length})")
    table.add_column("encoding")
    for n in lengths:
        table.add_column(
            f"{n}" + ("" if n == train_length else f" ({n / train_length:g}x)"), justify="right"
        )
    for label, points in curves.items():
        table.add_row(label, *(format_value(points.get(n), metric) for n in lengths))
    return table


def _summary_grid(result) -> pd.DataFrame:
    """The runs' summaries aggregated across seeds, one line per label (+ variant)."""
    rows = [
        {"label": run.label, "study_id": 0, **summary._asdict()}
        for run in result.runs
        for summary in run.summarize(result.spec.train.length, result.metric)
        if analysis.holds_for(summary.protocol, result.spec.eval.protocols[0])
    ]
    if not rows:
        return pd.DataFrame()
    frame = analysis.with_lines(pd.DataFrame(rows).rename(columns={"name": "summary"}))
    return analysis.summary_grid(analysis.summary_statistics(frame), analysis.KEY_SUMMARIES)


def run_in_process(spec: StudySpec, *, as_json: bool, out: Path | None, device: str | None) -> None:
    from worker.data.registry import TaskConfigError
    from worker.study import resolve_device, run_study
    from worker.train import TrainingDiverged

    console = Console(stderr=as_json)
    out = out or Path(".posbench") / "runs" / f"{spec.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    runs = spec.runs()
    torch_device = resolve_device(device)
    console.print(
        f"study [bold]{spec.name}[/]: {len(runs)} runs x {spec.train.steps} steps on "
        f"{torch_device}, evaluated at {', '.join(map(str, spec.eval.lengths))}"
    )
    progress = Progress(
        TextColumn("{task.description:<28}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        console=console,
    )
    bars = {
        run.config_hash: progress.add_task(
            f"{run.encoding.label} seed {run.seed}", total=spec.train.steps, status="queued"
        )
        for run in runs
    }
    try:
        with progress:
            result = run_study(
                spec,
                device=torch_device,
                checkpoint_dir=out / "checkpoints",
                on_progress=lambda run, p: progress.update(
                    bars[run.config_hash],
                    completed=p.step,
                    status=f"loss {p.loss:.3f}  {p.tokens_per_second:,.0f} tok/s",
                ),
                on_evaluation=lambda run, row: progress.update(
                    bars[run.config_hash], status=f"evaluated {row.variant} @ {row.length}"
                ),
            )
    except TaskConfigError as err:
        Console(stderr=True).print(f"[bold red]error:[/] {err}")
        raise typer.Exit(2) from None
    except TrainingDiverged as err:
        Console(stderr=True).print(f"[bold red]run failed:[/] {err}")
        raise typer.Exit(1) from None
    curves = result.curves()
    payload = result.to_dict()
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(payload, indent=1))
    (out / "table.md").write_text(markdown_table(curves, result.metric, spec.train.length) + "\n")
    plot_curves(curves, result.metric, spec.train.length, out / "curves.png", spec.name)
    grid = _summary_grid(result)
    if not grid.empty:
        with (out / "table.md").open("a") as table:
            table.write("\n" + markdown_frame(grid.reset_index()) + "\n")
    if as_json:
        sys.stdout.write(json.dumps(payload) + "\n")
        return
    console.print(_table(curves, result.metric, spec.train.length))
    if not grid.empty:
        from jobs.watch import frame_table

        console.print(frame_table(grid.reset_index(), "summaries across seeds"))
    console.print(f"results: {out / 'results.json'}  curves: {out / 'curves.png'}")
