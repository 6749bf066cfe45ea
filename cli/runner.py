"""``posbench run``: a study in this process, with progress bars and a report."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import NoReturn

import pandas as pd
import typer
from rich.console import Console

from cli.render.report import plot_curves, seed_bands
from core import analysis
from core.catalog.params import short_repr
from core.files import private_folder, read_bounded, write_atomic
from core.metrics import kind_of, reported
from core.results_schema import MAX_RESULTS_BYTES, StudyResults
from core.spec import DEFAULT_NAME, StudySpec
from core.status import RunStatus
from core.tables import CurveTable, curve_table, markdown_frame
from core.terminal import console as terminal
from core.terminal import echo, notes, run_progress, styled
from worker.training.hooks import BaseHooks


def _title(table: CurveTable, protocol: str) -> str:
    """The terminal title of one of posbench run's curve tables."""
    return (
        f"{table.metric.name} by evaluation length ({protocol}, train length {table.train_length})"
    )


def _summary_grid(result) -> pd.DataFrame:
    """The runs' summaries aggregated across seeds, one line per label (+ variant)."""
    rows = [
        {"label": run.label, "study_id": 0, **summary._asdict()}
        for run in result.runs
        for summary in run.summarize(
            result.spec.train.length, result.metric, analysis.effective_setting(result.spec)
        )
        if analysis.holds_for(summary.protocol, result.spec.eval.protocols[0])
    ]
    if not rows:
        return pd.DataFrame()
    frame = analysis.with_lines(pd.DataFrame(rows).rename(columns={"name": "summary"}))
    return analysis.summary_grid(analysis.summary_statistics(frame), analysis.KEY_SUMMARIES)


LOG_SECONDS = 30.0  # off a terminal: at most one progress line per run this often


def folder_name(name: str) -> str:
    """A study name as one safe path component: letters, digits, '.', '-' and '_' kept,
    anything else (separators, '..', spaces) turned into '-'."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip(".-") or "study"
    return slug[:80]


def _fail(message: str) -> NoReturn:
    terminal(stderr=True).print(styled(("error:", "bold red"), " ", message), soft_wrap=True)
    raise typer.Exit(2)


def _unwritable(folder: Path, *, private: bool = False) -> str | None:
    """Why files cannot be written in ``folder`` (created if missing, owner-only when
    ``private``), or None."""
    try:
        if private:
            private_folder(folder)
        else:
            folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".posbench-write-test-{time.time_ns()}"
        write_atomic(probe, b"", private=True)
        probe.unlink()
    except OSError as err:
        return err.strerror or str(err)
    return None


def _out_names(spec: StudySpec) -> list[str]:
    """The files ``posbench run`` writes into ``--out``."""
    names = ["results.json", "table.md", "curves.png"]
    return names + [f"curves-{protocol}.png" for protocol in spec.eval.protocols]


def _check_out(spec: StudySpec, out: Path) -> None:
    """``--out`` may hold an earlier run of this study (written again), not another's,
    and no file posbench did not write: nothing there is overwritten or written through
    a symbolic link."""
    names = _out_names(spec)
    for name in names:
        if (out / name).is_symlink():
            _fail(
                f"--out {out}: {name} is a symbolic link; posbench writes its results as "
                "files of their own, never through a link (remove it, or give another folder)"
            )
        if (out / name).is_dir():
            _fail(f"--out {out}: {name} is a folder; the results are written there as a file")
    present = [name for name in names if (out / name).exists()]
    if not present:
        return
    results = out / "results.json"
    try:
        earlier = json.loads(read_bounded(results, MAX_RESULTS_BYTES, "a results.json"))["spec"]
        name = earlier["name"]
    except FileNotFoundError:
        _fail(
            f"--out {out}: {out / present[0]} was not written by posbench run (no results.json "
            "beside it); it is not overwritten: give another folder, or remove it"
        )
    except (OSError, ValueError, KeyError, TypeError):
        _fail(
            f"--out {out}: {results} was not written by posbench run; it is not overwritten: "
            "give another folder, or remove it"
        )
    if name != spec.name:
        _fail(
            f"--out {out} holds the results of study {short_repr(name)}; give another folder "
            f"(or remove them) so they are not overwritten by study {short_repr(spec.name)}"
        )
    # Unnamed studies are all "study": only the same spec is the same study.
    if name == DEFAULT_NAME and earlier != spec.model_dump(mode="json"):
        _fail(
            f"--out {out} holds the results of another unnamed study; give this one a name "
            "or another folder"
        )


class _StudyView:
    """``posbench run``'s view of a study: a progress bar per run. Not a terminal (a log
    file, nohup, Slurm, CI): the bars are not drawn, so a plain line per run says where
    it is: training at most every LOG_SECONDS and at its last step, and each evaluation."""

    def __init__(self, spec: StudySpec, runs: list, console: Console) -> None:
        self.steps, self.console, self.plain = spec.train.steps, console, not console.is_terminal
        self.progress = run_progress(console, label_width=28)
        self.bars = {
            run.config_hash: self.progress.add_task(
                f"{run.encoding.label} seed {run.seed}",
                total=spec.train.steps,
                status=RunStatus.QUEUED.value,
            )
            for run in runs
        }

    def hooks_for(self, run) -> _RunView:
        return _RunView(self, run)


class _RunView(BaseHooks):
    """One run's bar and log lines: the run's hooks."""

    def __init__(self, study: _StudyView, run) -> None:
        self.study, self.run, self.bar = study, run, study.bars[run.config_hash]
        self.last_val = ""  # the last validation loss stays on the bar
        self.logged_at = -LOG_SECONDS

    def on_progress(self, point) -> None:
        if point.val_loss is not None:
            self.last_val = f"  val {point.val_loss:.3f}"
        status = f"loss {point.loss:.3f}{self.last_val}  {point.tokens_per_second:,.0f} tok/s"
        self.study.progress.update(self.bar, completed=point.step, status=status)
        steps = self.study.steps
        self._log(f"step {point.step}/{steps}  {status}", point.step == steps)

    def on_evaluation(self, row) -> None:
        self.study.progress.update(self.bar, status=f"evaluated {row.variant} @ {row.length}")
        self._log(f"evaluated {row.variant} at {row.length}", last=True)

    def _log(self, text: str, last: bool = False) -> None:
        now = time.monotonic()
        if self.study.plain and (last or now - self.logged_at >= LOG_SECONDS):
            self.logged_at = now
            run = self.run
            self.study.console.print(
                f"{run.encoding.label} seed {run.seed}: {text}", highlight=False
            )


def _prepare(spec: StudySpec, out: Path | None, device: str | None):
    """The output folder, the checkpoint folder, the torch device and the prepared task,
    from the settings where not given: everything that can be refused is checked before
    the first progress bar."""
    from core.catalog.tasks import TaskConfigError
    from core.settings import get_settings
    from worker.run import DeviceError, prepared_task, resolve_device

    stamp = time.strftime("%Y%m%d-%H%M%S")
    settings = get_settings()
    # Before anything is written: the corpus and the hf: model, under the operator's rules.
    from jobs.service import sources_problem

    problem = sources_problem(spec, settings)
    if problem:
        _fail(problem)
    private = out is None  # under $POSBENCH_HOME: its owner's alone
    out = out or settings.home / "runs" / f"{folder_name(spec.name)}-{stamp}"
    checkpoints = settings.home / "checkpoints"
    if out.exists() and not out.is_dir():
        _fail(f"--out {out} is a file; give a folder (created if missing)")
    _check_out(spec, out)
    created = not out.exists()
    folders = ((out, "--out", private), (checkpoints, "the checkpoint folder", True))
    for folder, what, own in folders:
        problem = _unwritable(folder, private=own)
        if problem:
            _fail(f"{what} {folder} cannot be written: {problem}")
    try:
        torch_device = resolve_device(device, default=settings.device)
        task = prepared_task(spec, private_folder(settings.corpus_cache), settings.sources)
    except (DeviceError, TaskConfigError, OSError) as err:
        if created:
            out.rmdir()  # refused: leave no empty folder behind
        if isinstance(err, OSError):  # e.g. POSBENCH_CACHE_DIR is a file
            _fail(f"the task's data could not be prepared: {err}")
        _fail(str(err))
    return out, private, checkpoints, torch_device, task


def run_in_process(
    spec: StudySpec,
    *,
    as_json: bool,
    out: Path | None,
    device: str | None,
    told: list[str] | None = None,
) -> None:
    """Train, evaluate and report ``spec`` here; ``told``: lines to print with its notes."""
    from core.settings import get_settings
    from worker.cpu import flush_denormals
    from worker.run import run_study
    from worker.training import TrainingDiverged

    flush_denormals()  # before torch's first parallel operation starts its threads
    console = terminal(stderr=as_json)
    out, private, checkpoints, torch_device, task = _prepare(spec, out, device)
    notes([*(told or []), *spec.notes()])  # everything that could refuse it has passed
    runs = spec.runs()
    work = (
        f"{len(runs)} runs x {spec.train.steps} steps"
        if spec.model.hf is None
        else f"{runs[0].encoding.label} as it is (no training)"
    )
    console.print(
        styled(
            "study ",
            (spec.name, "bold"),
            f": {work} on {torch_device}, evaluated at {', '.join(map(str, spec.eval.lengths))}",
        )
    )
    view = _StudyView(spec, runs, console)
    try:
        with view.progress:
            result = run_study(
                spec,
                task=task,
                device=torch_device,
                checkpoint_dir=checkpoints,
                hooks_for=view.hooks_for,
                models=get_settings().models,
            )
    except TrainingDiverged as err:
        terminal(stderr=True).print(styled(("run failed:", "bold red"), " ", str(err)))
        raise typer.Exit(1) from None
    _report(result, out, console, as_json=as_json, private=private)


def _report(result, out: Path, console: Console, *, as_json: bool, private: bool = False) -> None:
    """Write results.json, table.md and the plots into ``out``, each whole (a temporary
    file, then renamed over the earlier one; owner-only when ``private``), then print
    the tables (or, with ``as_json``, the results on stdout)."""
    spec = result.spec
    # One table and one plot per protocol: curves.png for the first, curves-<name>.png
    # for the others (sliding windows score differently; their lines are not comparable).
    protocols = spec.eval.protocols
    curves = {protocol: result.curves(protocol) for protocol in protocols}
    plots = {
        protocol: out / ("curves.png" if i == 0 else f"curves-{protocol}.png")
        for i, protocol in enumerate(protocols)
    }
    document = StudyResults.from_dict(result.to_dict())  # the declared results.json
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "results.json", document.to_json(indent=1).encode(), private=private)
    tables = {
        protocol: curve_table(curves[protocol], result.metric, spec.train.length)
        for protocol in protocols
    }
    sections = [
        (f"## {protocol}\n\n" if len(protocols) > 1 else "") + tables[protocol].markdown()
        for protocol in protocols
    ]
    # The other metrics the registry reports for the task, for the first protocol: exact
    # match hides partial success (a copy right but for one byte scores 0), so the answer
    # bytes right, too.
    extra = [
        curve_table(partial, metric.name, spec.train.length)
        for metric in reported(kind_of(result.metric))[1:]
        if (partial := result.curves(protocols[0], metric.name))
    ]
    sections += [table.markdown() for table in extra]
    grid = _summary_grid(result)
    if not grid.empty:
        sections.append(markdown_frame(grid.reset_index()))
    write_atomic(out / "table.md", ("\n\n".join(sections) + "\n").encode(), private=private)
    for protocol in protocols:
        label = spec.eval.protocol_label(protocol)
        title = f"{spec.name} ({label})"
        bands = seed_bands(result.seed_values(protocol))

        def plot(handle, protocol=protocol, title=title, bands=bands) -> None:
            plot_curves(curves[protocol], result.metric, spec.train.length, handle, title, bands)

        write_atomic(plots[protocol], plot, private=private)
    if as_json:
        echo(document.to_json())
        return
    for protocol in protocols:
        console.print(
            tables[protocol].rich(_title(tables[protocol], spec.eval.protocol_label(protocol)))
        )
    for table in extra:
        console.print(table.rich(_title(table, spec.eval.protocol_label(protocols[0]))))
    if not grid.empty:
        from jobs.watch import frame_table

        console.print(frame_table(grid.reset_index(), "summaries across seeds"))
    shown = "  ".join(str(path) for path in plots.values())
    console.print(f"results: {out / 'results.json'}  curves: {shown}")
