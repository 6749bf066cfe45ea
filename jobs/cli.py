"""The `posbench` command line.

Exit codes: 0 success, 2 bad input (one-line reason on stderr), 1 failure.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(
    name="posbench",
    help="Benchmark transformer position encodings: train, evaluate far beyond the "
    "training length, compare extrapolation curves.",
    no_args_is_help=True,
    add_completion=False,
)
console = Console()
MAX_ID = 2**63 - 1  # the database's integer ids


@app.callback()
def _settings() -> None:
    """Read the POSBENCH_* settings once, before any command: a bad one exits 2."""
    from pydantic import ValidationError

    from jobs.settings import describe_settings_error, get_settings

    try:
        get_settings()
    except ValidationError as err:
        fail("invalid settings: " + describe_settings_error(err), code=2)


@app.command()
def encodings(
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the registry as JSON (for scripts).")
    ] = False,
) -> None:
    """List the registered position encodings and RoPE inference-time scalings."""
    from worker.encodings import REGISTRY, SCALINGS

    if as_json:
        payload = {
            "encodings": [entry.to_json() for entry in REGISTRY.values()],
            "scalings": [entry.to_json() for entry in SCALINGS.values()],
        }
        typer.echo(json.dumps(payload, indent=2))
        return
    table = Table(title="position encodings")
    for column in ("name", "family", "parameters", "summary"):
        table.add_column(column)
    for entry in REGISTRY.values():
        params = ", ".join(
            f"{p.name}={p.derived if p.default is None else p.default}" for p in entry.params
        )
        table.add_row(entry.name, entry.family, params or "-", entry.summary)
    console.print(table)
    scalings = Table(title="RoPE inference-time scalings (rope, xpos)")
    for column in ("name", "summary"):
        scalings.add_column(column)
    for entry in SCALINGS.values():
        scalings.add_row(entry.name, entry.summary)
    console.print(scalings)


@app.command()
def run(
    spec_file: Annotated[
        Path | None, typer.Argument(help="A study spec (YAML or JSON).", show_default=False)
    ] = None,
    preset: Annotated[
        str | None, typer.Option("--preset", help="A named study: smoke, quick or paper.")
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print every result as JSON on stdout.")
    ] = False,
    out: Annotated[
        Path | None,
        typer.Option("--out", help="Folder for results.json, curves.png and table.md."),
    ] = None,
    device: Annotated[
        str | None, typer.Option("--device", help="cpu, cuda or cuda:N (default: auto).")
    ] = None,
) -> None:
    """Run a study in this process (no broker, no database): train, evaluate, report."""
    spec = _load(spec_file, preset)
    from jobs.runner import run_in_process

    run_in_process(spec, as_json=as_json, out=out, device=device)


def fail(message: str, code: int) -> NoReturn:
    """A readable message on stderr (never wrapped, no traceback) and a meaningful exit code:
    2 for bad input, 1 for a failure."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def _load(spec_file: Path | None, preset: str | None):
    from jobs.spec import SpecError, load_spec, preset_spec

    if (spec_file is None) == (preset is None):
        fail("give either a spec file or --preset NAME (smoke, quick, paper)", code=2)
    try:
        spec = load_spec(spec_file) if spec_file is not None else preset_spec(preset or "")
    except SpecError as err:
        fail("invalid spec: " + "; ".join(err.problems), code=2)
    for note in spec.notes():
        typer.echo(f"note: {note}", err=True)
    return spec


def _check_id(value: int | None, what: str) -> None:
    if value is not None and not 1 <= value <= MAX_ID:
        fail(f"{what} must be a positive integer below 2^63, got {value}", code=2)


def _check_port(port: int) -> None:
    if not 1 <= port <= 65535:
        fail(f"--port must be in 1..65535, got {port}", code=2)


def _database() -> str:
    from sqlalchemy.engine import make_url

    from db.migrate import current
    from jobs.settings import get_settings

    url = get_settings().database
    parsed = make_url(url)
    on_disk = parsed.get_backend_name() == "sqlite" and parsed.database not in (
        None,
        "",
        ":memory:",
    )
    # Reading must not create a database (or its folders) where none is.
    if on_disk and not Path(parsed.database or "").expanduser().is_file():
        fail(f"no database at {parsed.database}: run `posbench db upgrade`", code=1)
    try:
        revision = current(url)
    except Exception as err:
        fail(f"cannot reach the database {_redact(url)}: {_first_line(err)}", code=1)
    if revision is None:
        fail(f"the database {_redact(url)} has no schema yet: run `posbench db upgrade`", code=1)
    return url


def _redact(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


def _first_line(err: BaseException) -> str:
    text = str(getattr(err, "orig", None) or err).strip()
    return text.splitlines()[0] if text else type(err).__name__


@app.command()
def submit(
    spec_file: Annotated[
        Path | None, typer.Argument(help="A study spec (YAML or JSON).", show_default=False)
    ] = None,
    preset: Annotated[str | None, typer.Option("--preset", help="smoke, quick or paper.")] = None,
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="Train again even where a run with the same config hash already finished.",
        ),
    ] = False,
    wait: Annotated[bool, typer.Option("--wait", help="Show live progress until done.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the submission as JSON.")] = False,
    queue: Annotated[
        str | None,
        typer.Option(
            "--queue", help="gpu or cpu: the workers that train it (default: the spec's)."
        ),
    ] = None,
) -> None:
    """Queue a study on the service: its runs go to the workers through the broker."""
    spec = _load(spec_file, preset)
    if queue is not None:
        from jobs.spec import QUEUES

        if queue not in QUEUES:
            fail(f"--queue must be {' or '.join(QUEUES)}, got {queue!r}", code=2)
        spec = spec.model_copy(update={"queue": queue})
    _database()
    from jobs.service import submit as submit_study

    submitted = submit_study(spec, force=force)
    payload = {
        "study": submitted.study_id,
        "queued": submitted.queued,
        "reused": submitted.reused,
        "unsent": submitted.unsent,
    }
    if as_json:
        typer.echo(json.dumps(payload))
    else:
        console.print(
            f"study [bold]{submitted.study_id}[/] ({spec.name}): {len(submitted.queued)} runs "
            f"queued, {len(submitted.reused)} reused from earlier results"
        )
        if submitted.unsent:
            console.print(
                "[yellow]the broker could not be reached; the runs stay queued and "
                "are sent when a worker's reconciler next runs[/]"
            )
    if wait:
        from jobs.render.watch import watch

        code = watch(submitted.study_id, console=Console(stderr=as_json))
        raise typer.Exit(code)


@app.command()
def status(
    study: Annotated[
        int | None,
        typer.Argument(help="A study id; all studies without it.", show_default=False),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print as JSON.")] = False,
) -> None:
    """Studies and their runs: status, progress, failures."""
    from db import queries

    _check_id(study, "the study id")
    url = _database()
    if study is None:
        frame = queries.studies(url)
        shown = ["id", "name", "task", "runs", "queued", "running", "done", "failed", "cancelled"]
    else:
        if queries.studies(url, [study]).empty:
            fail(f"no study with id {study}", code=2)
        from jobs.analysis import run_notes

        frame = queries.runs(url, study_id=study)
        frame["note"] = run_notes(frame)
        shown = [
            "id",
            "label",
            "seed",
            "status",
            "step",
            "total_steps",
            "latest_loss",
            "attempts",
            "note",
            "failure_reason",
        ]
    if as_json:
        typer.echo(frame.to_json(orient="records", date_format="iso"))
        return
    from jobs.render.watch import frame_table

    title = "studies" if study is None else f"study {study}"
    console.print(frame_table(frame[shown], title=title))


def _on_runs(action, study: int | None, run: int | None):
    """Apply a jobs.service action to a study or one run; bad ids exit 2."""
    from jobs.service import NotFound

    if (study is None) == (run is None):
        fail("give a study id or --run ID", code=2)
    _check_id(study, "the study id")
    _check_id(run, "--run")
    _database()
    try:
        return action(study_id=study, run_id=run)
    except NotFound as err:
        fail(str(err), code=2)


StudyArgument = Annotated[int | None, typer.Argument(show_default=False)]
RunOption = Annotated[int | None, typer.Option("--run", help="One run instead of a study.")]


@app.command()
def cancel(study: StudyArgument = None, run: RunOption = None) -> None:
    """Cancel queued runs at once; running runs stop at their next progress report."""
    from jobs.service import cancel as cancel_runs

    counts = _on_runs(cancel_runs, study, run)
    console.print(f"{counts['cancelled']} cancelled, {counts['stopping']} stopping")


@app.command()
def retry(study: StudyArgument = None, run: RunOption = None) -> None:
    """Queue failed or cancelled runs again; they resume from their last checkpoint."""
    from jobs.service import retry as retry_runs

    console.print(f"{len(_on_runs(retry_runs, study, run))} runs queued again")


@app.command()
def delete(
    study: Annotated[int, typer.Argument(show_default=False, help="The study's id.")],
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
) -> None:
    """Delete a finished study: its runs, curves, evaluations, summaries and checkpoints."""
    from db import queries
    from jobs.service import Busy, NotFound, busy_message, delete_study

    _check_id(study, "the study id")
    url = _database()
    found = queries.studies(url, [study])
    if found.empty:
        fail(f"no study with id {study}", code=2)
    row = found.iloc[0]
    if row["queued"] + row["running"]:
        fail(busy_message(study, int(row["queued"] + row["running"])), code=1)
    if not yes and not typer.confirm(
        f"Delete study {study} ({row['name']}) with its {row['runs']} runs and their results?"
    ):
        fail("nothing deleted", code=1)
    try:
        deleted = delete_study(study)
    except NotFound as err:
        fail(str(err), code=2)
    except Busy as err:
        fail(str(err), code=1)
    typer.echo(
        f"deleted study {study} ({deleted.name}): {deleted.runs} runs, "
        f"{deleted.evaluations} evaluations, {deleted.checkpoints} checkpoint files"
    )


@app.command("import")
def import_(
    results_file: Annotated[
        Path, typer.Argument(show_default=False, help="results.json written by posbench run.")
    ],
    force: Annotated[
        bool, typer.Option("--force", help="Import results already in the database again.")
    ] = False,
) -> None:
    """Store the results of `posbench run` as a finished study: the dashboard compares
    it, `posbench results` and SQL query it, and later submits reuse its runs."""
    from jobs.settings import get_settings
    from jobs.transfer.importer import ImportProblem, import_results

    url = _database()
    try:
        done = import_results(results_file, settings=get_settings(), force=force)
    except ImportProblem as err:
        fail(str(err), code=2)
    typer.echo(
        f"imported study {done.study_id} ({done.name}): {done.runs} runs, "
        f"{done.evaluations} evaluations (database {_redact(url)})"
    )


@app.command()
def export(
    study: Annotated[int, typer.Argument(show_default=False, help="The study's id.")],
    to: Annotated[str, typer.Option("--to", help="Where: mlflow.")] = "mlflow",
    tracking_uri: Annotated[
        str | None,
        typer.Option(
            "--tracking-uri",
            envvar="MLFLOW_TRACKING_URI",
            help="The MLflow tracking server (http://host:5000) or store; default: "
            "MLFLOW_TRACKING_URI.",
        ),
    ] = None,
    experiment: Annotated[
        str | None,
        typer.Option("--experiment", help="MLflow experiment (default: the study's name)."),
    ] = None,
    replace: Annotated[
        bool, typer.Option("--replace", help="Write runs already exported again.")
    ] = False,
) -> None:
    """Export a study's finished runs to MLflow: parameters, tags, the training curves,
    the extrapolation curves (evaluation length as the step) and the summaries."""
    from sqlalchemy.exc import SQLAlchemyError

    from jobs.transfer.mlflow_export import ExportError, to_mlflow

    _check_id(study, "the study id")
    if to != "mlflow":
        fail(f"--to must be mlflow, got {to!r}", code=2)
    if not tracking_uri:
        fail("give --tracking-uri (e.g. http://localhost:5000) or set MLFLOW_TRACKING_URI", 2)
    url = _database()
    # An unreachable server answers in seconds, not after MLflow's minutes of retries.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
    try:
        done = to_mlflow(
            url, study, tracking_uri=tracking_uri, experiment=experiment, replace=replace
        )
    except ExportError as err:
        fail(str(err), code=2)
    except SQLAlchemyError as err:
        fail(f"the database {_redact(url)}: {_first_line(err)}", code=1)
    except Exception as err:  # the tracking server refused or is unreachable
        # No credentials in the message: MLflow's own repeats the whole URL.
        message = re.sub(r"//[^/@\s]*@", "//", f"MLflow at {tracking_uri}: {_first_line(err)}")
        fail(message, code=1)
    typer.echo(
        f"study {study} -> MLflow experiment {done.experiment!r} ({done.experiment_id}): "
        f"{len(done.written)} runs written, {len(done.skipped)} already there"
        + (f", {len(done.unfinished)} not finished (not exported)" if done.unfinished else "")
    )


@app.command()
def results(
    study: Annotated[int, typer.Option("--study", help="The study id.")],
    output: Annotated[str, typer.Option("--format", help="table, csv or json.")] = "table",
    protocol: Annotated[
        str | None,
        typer.Option(
            "--protocol",
            help="nonoverlapping or sliding (default: every protocol for curves, the first "
            "for summaries and pairwise).",
        ),
    ] = None,
    view: Annotated[
        str,
        typer.Option(
            "--view",
            help="curves (metric by length), summaries (extrapolation ratio, effective "
            "length, log-perplexity area, order probe: mean and bootstrap 95% interval "
            "across seeds), pairwise (P(A beats B) at each length), groups (synthetic "
            "tasks: accuracy by each group key, e.g. depth or word-order variant) or train "
            "(the training curves: every point with csv/json, one row per run as a table).",
        ),
    ] = "curves",
    factor: Annotated[
        float | None,
        typer.Option("--factor", help="pairwise: only this multiple of the training length."),
    ] = None,
) -> None:
    """A study's results: its curves, their summaries, or pairwise comparisons."""
    from db import queries
    from jobs import analysis

    _check_id(study, "--study")
    if output not in ("table", "csv", "json"):
        fail(f"--format must be table, csv or json, got {output!r}", code=2)
    views = ("curves", "summaries", "pairwise", "groups", "train")
    if view not in views:
        fail(f"--view must be one of {', '.join(views)}, got {view!r}", code=2)
    if factor is not None and view != "pairwise":
        fail("--factor applies to --view pairwise only", code=2)
    from jobs.spec import MAX_EVAL_LENGTH  # no evaluation is longer, so no factor larger

    if factor is not None and not (math.isfinite(factor) and 0 < factor <= MAX_EVAL_LENGTH):
        fail(f"--factor must be a number from 0 to {MAX_EVAL_LENGTH}, got {factor:g}", code=2)
    from jobs.spec import PROTOCOLS

    if protocol is not None and protocol not in PROTOCOLS:
        fail(f"--protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}", code=2)
    url = _database()
    studies = queries.studies(url, [study])
    if studies.empty:
        fail(f"no study with id {study}", code=2)
    row = studies.iloc[0]
    if protocol is not None:
        evaluated = (queries.study_spec(url, study) or {}).get("eval", {}).get("protocols", [])
        if protocol not in evaluated:
            fail(
                f"study {study} is evaluated with {', '.join(evaluated)}, not {protocol!r}",
                code=2,
            )
    if view == "groups" and row["metric"] != "accuracy":
        fail(
            f"--view groups applies to synthetic tasks; study {study} ({row['task']}) is "
            "language modelling",
            code=2,
        )
    frame = queries.curves(url, study_ids=[study], protocol=protocol)
    if view in ("summaries", "pairwise") and protocol is None and not frame.empty:
        # One protocol at a time: its curves are the ones summarised and compared.
        protocol = sorted(frame["protocol"].unique())[0]
        frame = frame[frame["protocol"] == protocol]
    if view == "summaries":
        stored = analysis.with_lines(queries.run_summaries(url, [study], protocol))
        frame = analysis.summary_statistics(stored)
        title = f"summaries across seeds ({protocol})"
    elif view == "pairwise":
        frame = _pairwise(frame, row, factor)
        title = f"pairwise ({protocol}): P(a beats b) across seeds"
    elif view == "groups":
        frame = analysis.group_accuracy(analysis.with_lines(frame))
        title = "accuracy by group"
    elif view == "train":
        runs = queries.runs(url, study_id=study)
        frame = analysis.training_curves(queries.train_points(url, runs["id"].tolist()), runs)
        title = "training (one row per run; --format csv or json for every point)"
    if output == "csv":
        typer.echo(frame.drop(columns=["groups"], errors="ignore").to_csv(index=False), nl=False)
    elif output == "json":
        typer.echo(frame.to_json(orient="records"))
    elif view == "curves":
        from jobs.render.watch import curve_table

        console.print(curve_table(frame, row))
    elif frame.empty:
        if int(row["queued"] or 0) + int(row["running"] or 0) == 0:
            console.print(
                f"study {study} ({row['name']}): no {view}: every run has ended and none "
                "could be computed (see posbench status)"
            )
        else:
            console.print(
                f"study {study} ({row['name']}): no {view} yet (they come as runs finish)"
            )
    else:
        from jobs.render.watch import frame_table

        if view == "summaries":  # the key ones; --format json has them all
            frame = analysis.summary_grid(frame, analysis.KEY_SUMMARIES).reset_index()
        elif view == "train":
            frame = analysis.training_table(frame)
        console.print(frame_table(frame, f"study {study} ({row['name']}): {title}"))


def _pairwise(frame, study, factor: float | None):
    from jobs import analysis

    frame = analysis.with_lines(frame)
    train_length = int(study["train_length"])
    if factor is not None:
        frame = frame[frame["eval_length"] == round(factor * train_length)]
        if frame.empty:
            fail(f"--factor {factor:g}: no evaluation at {factor:g} x {train_length}", code=2)
    table = analysis.pairwise_table(frame, study["metric"], line="line")
    table["claim"] = [analysis.claim(row, train_length) for _, row in table.iterrows()]
    return table


db_app = typer.Typer(help="The results database.", no_args_is_help=True)
app.add_typer(db_app, name="db")


@db_app.command("upgrade")
def db_upgrade() -> None:
    """Create or migrate the schema to the latest version (Alembic)."""
    from db.migrate import upgrade
    from jobs.service import backfill_summaries
    from jobs.settings import get_settings

    url = get_settings().database
    try:
        upgrade(url)
    except Exception as err:
        fail(f"cannot upgrade the database {_redact(url)}: {_first_line(err)}", code=1)
    console.print(f"database {_redact(url)} is at the latest schema")
    filled = backfill_summaries(url)
    if filled:
        console.print(f"summarised {filled} runs finished before summaries were stored")


@app.command()
def worker(
    queues: Annotated[str, typer.Option("--queues", help="Comma-separated queues.")] = "gpu,cpu",
    concurrency: Annotated[
        int, typer.Option("--concurrency", min=1, max=64, help="Pool processes (one per GPU).")
    ] = 1,
    name: Annotated[str | None, typer.Option("--name", help="Celery node name.")] = None,
) -> None:
    """Start a Celery worker: prefork, one run per pool process, then a fresh process."""
    from jobs.celery_app import app as celery
    from jobs.spec import QUEUES

    unknown = [q for q in queues.split(",") if q not in QUEUES]
    if unknown:
        fail(f"unknown queue {unknown[0]!r} (allowed: {', '.join(QUEUES)})", code=2)
    argv = [
        "worker",
        "--queues",
        queues,
        "--concurrency",
        str(concurrency),
        "--pool",
        "prefork",
        "--max-tasks-per-child",
        "1",
        "--loglevel",
        "INFO",
        "--without-gossip",
        "--without-mingle",
    ]
    if name:
        argv += ["--hostname", name]
    import subprocess
    import sys

    reconciler = subprocess.Popen([sys.executable, "-m", "jobs.reconciler"])
    try:
        celery.worker_main(argv)
    finally:
        reconciler.terminate()
        reconciler.wait(timeout=10)


@app.command()
def dashboard(
    port: Annotated[int, typer.Option(help="Port to serve on.")] = 8501,
    address: Annotated[str, typer.Option(help="Interface to bind.")] = "0.0.0.0",
) -> None:
    """Serve the Streamlit dashboard (health check: /_stcore/health)."""
    import os
    import socket

    from jobs.embedded import dashboard_command

    _check_port(port)
    try:
        socket.getaddrinfo(address, port)
    except (socket.gaierror, UnicodeError):
        fail(f"--address {address!r} is not an address or host name of this machine", code=2)

    command = dashboard_command(port, address)
    os.execvp(command[0], command)


@app.command()
def up(
    dashboard: Annotated[bool, typer.Option(help="Also serve the dashboard.")] = True,
    port: Annotated[int, typer.Option(help="Dashboard port.")] = 8501,
) -> None:
    """The whole service on this machine: private Redis, SQLite, one worker, dashboard."""
    from jobs.embedded import serve

    _check_port(port)
    raise typer.Exit(serve(dashboard=dashboard, port=port, console=console))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
