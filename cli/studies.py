"""Commands on studies: list encodings, run a study in-process, submit one to the
service, watch its status, cancel, retry and delete (restore and purge are in
``cli.audit``, with the audit trail's views)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from cli.common import (
    RunOption,
    StudyArgument,
    _check_id,
    _database,
    _load,
    _missing_study,
    app,
    cli_actor,
    console,
    fail,
)
from core.catalog.models import ATTN_IMPLEMENTATIONS
from core.catalog.params import short_repr
from core.status import ACTIVE, RUN_STATUSES, STOPPING, RunStatus
from core.terminal import console as terminal
from core.terminal import echo, notes, styled


@app.command()
def encodings(
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the registry as JSON (for scripts).")
    ] = False,
    markdown: Annotated[
        bool, typer.Option("--markdown", help="Print the tables as markdown (for docs).")
    ] = False,
) -> None:
    """List the registered position encodings and RoPE inference-time scalings."""
    from cli.render.catalog import (
        ENCODING_COLUMNS,
        SCALING_COLUMNS,
        catalog_markdown,
        encoding_rows,
        scalable_names,
        scaling_rows,
        shared_params_line,
    )
    from core.catalog.encodings import REGISTRY, SCALINGS

    if as_json:
        payload = {
            "encodings": [entry.to_json() for entry in REGISTRY.values()],
            "scalings": [entry.to_json() for entry in SCALINGS.values()],
        }
        echo(json.dumps(payload, indent=2))
        return
    if markdown:
        echo(catalog_markdown())
        return
    table = Table(title="position encodings")
    for column in ENCODING_COLUMNS:
        table.add_column(column)
    for row in encoding_rows():
        table.add_row(*row)
    console.print(table)
    console.print(Text(shared_params_line().replace("`", "")))  # wrapped to the terminal
    scalings = Table(title=f"RoPE inference-time scalings ({scalable_names()})")
    for column in SCALING_COLUMNS:
        scalings.add_column(column)
    for row in scaling_rows():
        scalings.add_row(*row)
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
    attn_implementation: Annotated[
        str | None,
        typer.Option(
            "--attn-implementation",
            help=f"{', '.join(ATTN_IMPLEMENTATIONS)}: how attention runs (default: the "
            "spec's model.attn_implementation, auto); no number changes beyond rounding.",
        ),
    ] = None,
) -> None:
    """Run a study in this process (no broker, no database): train, evaluate, report."""
    spec, told = _load(spec_file, preset)
    if attn_implementation is not None:
        if attn_implementation not in ATTN_IMPLEMENTATIONS:
            fail(
                f"--attn-implementation must be one of {', '.join(ATTN_IMPLEMENTATIONS)}, "
                f"got {short_repr(attn_implementation)}",
                code=2,
            )
        if spec.model.hf is not None and attn_implementation != "auto":
            fail("--attn-implementation applies to posbench's own models, not a model.hf", code=2)
        model = spec.model.model_copy(update={"attn_implementation": attn_implementation})
        spec = spec.model_copy(update={"model": model})
    from cli.runner import run_in_process

    run_in_process(spec, as_json=as_json, out=out, device=device, told=told)


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
    reuse_imported: Annotated[
        bool,
        typer.Option(
            "--reuse-imported",
            help="Also reuse results imported with posbench import (not trained by this "
            "service); they stay marked imported.",
        ),
    ] = False,
    wait: Annotated[bool, typer.Option("--wait", help="Show live progress until done.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the submission as JSON.")] = False,
    queue: Annotated[
        str | None,
        typer.Option(
            "--queue",
            help="gpu or cpu: the workers that train it (default: the spec's; a spec "
            "that names none goes to a queue with live workers, gpu first).",
        ),
    ] = None,
) -> None:
    """Queue a study on the service: its runs go to the workers through the broker."""
    spec, told = _load(spec_file, preset)
    if queue is not None:
        from core.spec import QUEUES

        if queue not in QUEUES:
            fail(f"--queue must be {' or '.join(QUEUES)}, got {queue!r}", code=2)
        spec = spec.model_copy(update={"queue": queue})
    _database()
    from jobs.routing import live_queues, route
    from jobs.service import Refused
    from jobs.service import submit as submit_study

    routing = route(spec, live_queues())
    try:
        submitted = submit_study(
            routing.apply(spec), actor=cli_actor(), force=force, reuse_imported=reuse_imported
        )
    except Refused as err:
        fail(str(err), code=2)
    notes(told + spec.notes())  # stored and queued: nothing refused it
    for prefix, line in (("note", routing.note()), ("warning", routing.warning())):
        if line:
            echo(f"{prefix}: {line}", err=True)
    payload = {
        "study": submitted.study_id,
        "queue": routing.queue,
        RunStatus.QUEUED.value: submitted.queued,
        "reused": submitted.reused,
        "unsent": submitted.unsent,
        "imported": submitted.imported,
    }
    if as_json:
        echo(json.dumps(payload))
    else:
        imported = (
            f" ({len(submitted.imported)} of them imported, not trained here)"
            if submitted.imported
            else ""
        )
        console.print(
            styled(
                "study ",
                (str(submitted.study_id), "bold"),
                f" ({spec.name}): {len(submitted.queued)} runs queued, "
                f"{len(submitted.reused)} reused from earlier results{imported}",
            )
        )
        if submitted.unsent:
            console.print(
                "the broker could not be reached; the runs stay queued and are sent when "
                "a worker's reconciler next runs",
                style="yellow",
            )
    if wait:
        from jobs.watch import watch

        code = watch(submitted.study_id, console=terminal(stderr=as_json))
        raise typer.Exit(code)


@app.command()
def status(
    study: Annotated[
        int | None,
        typer.Argument(help="A study id; all studies without it.", show_default=False),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print as JSON.")] = False,
    events: Annotated[
        bool,
        typer.Option(
            "--events",
            help="The audit trail instead: who submitted, cancelled, retried, deleted, "
            "restored, purged or imported, newest first (of STUDY only, with it).",
        ),
    ] = False,
    limit: Annotated[
        int | None,
        typer.Option(
            "--limit",
            min=1,
            max=10_000,
            help="How many, newest first: studies (default 20) or --events (default 50).",
        ),
    ] = None,
    show_all: Annotated[
        bool, typer.Option("--all", help="Every study, not only the newest 20.")
    ] = False,
    with_status: Annotated[
        str | None,
        typer.Option(
            "--status", help="Only the studies with a run in this status (queued, running, ...)."
        ),
    ] = None,
    name: Annotated[
        str | None,
        typer.Option("--name", help="Only the studies whose name holds this text (any case)."),
    ] = None,
    deleted: Annotated[
        bool,
        typer.Option(
            "--deleted",
            help="The deleted studies instead: who deleted them, when, and when they are "
            "purged (posbench restore ID brings one back until then).",
        ),
    ] = False,
) -> None:
    """Studies and their runs: status, progress, failures; or the audit trail, or the
    deleted studies."""

    _check_id(study, "the study id")
    _check_views(study, events=events, deleted=deleted, limit=limit)
    _check_listing(study is not None or events or deleted, limit, show_all, with_status, name)
    url = _database()
    if events or deleted:
        from cli.audit import show_deleted, show_events

        if events:
            show_events(url, study, limit or 50, as_json=as_json)
        else:
            show_deleted(url, as_json=as_json)
        return
    caption = None
    if study is None:
        bound = None if show_all else (limit or STUDIES_SHOWN)
        frame, caption = _studies_frame(url, bound, name, with_status)
        shown = ["id", "name", "task", "counts"]
    else:
        frame = _runs_frame(url, study)
        shown = ["id", "label", "seed", "status", "progress", "loss", "attempts", "note", "failure"]
        # A note or failure column no run has says nothing: left out of the table.
        empty = [c for c in ("note", "failure") if frame[c].fillna("").str.strip().eq("").all()]
        shown = [c for c in shown if c not in empty]
    if as_json:
        echo(
            frame.drop(columns=["counts", "loss", "failure"], errors="ignore").to_json(
                orient="records", date_format="iso"
            )
        )
        return
    from jobs.watch import frame_table

    title = "studies" if study is None else f"study {study}"
    console.print(frame_table(frame[shown].rename(columns={"counts": "runs"}), title=title))
    if caption:
        console.print(caption)


STUDIES_SHOWN = 20  # posbench status lists the newest this many by default


def _check_listing(
    one: bool, limit: int | None, show_all: bool, status: str | None, name: str | None
) -> None:
    """The list of studies' options, checked (``one``: a study, its events or the deleted
    ones are asked for instead)."""
    if one and (show_all or status is not None or name is not None):
        fail("--all, --status and --name filter the list of studies: give no study id", code=2)
    if show_all and limit is not None:
        fail("give --limit N or --all, not both", code=2)
    if status is not None and status not in RUN_STATUSES:
        fail(f"--status must be one of {', '.join(RUN_STATUSES)}, got {status[:32]!r}", code=2)
    if name is not None and len(name) > 200:
        fail("--name is at most 200 characters", code=2)


def _studies_frame(url: str, bound: int | None, name: str | None, status: str | None):
    """The newest ``bound`` studies (every one: None) matching ``name`` and ``status``,
    with their runs in words, and a caption saying how many more there are (or None)."""
    from db import queries

    frame = queries.studies(url, limit=bound, name=name, status=status)
    imported = queries.imported_runs(url, frame["id"].tolist())  # the listed ones only
    frame["imported"] = [imported.get(int(study_id), 0) for study_id in frame["id"]]
    frame["counts"] = run_counts(frame)
    total = queries.count_studies(url, name=name, status=status)
    if total <= len(frame):
        return frame, None
    more = total - len(frame)
    return frame, (
        f"the newest {len(frame)} of {total:,} studies; {more:,} more "
        "(--limit N, --all, --status S, --name TEXT)"
    )


def _runs_frame(url: str, study: int):
    """A study's runs with their progress (steps, or an hf: model's points) and notes."""
    from core.analysis import run_notes
    from db import queries
    from jobs.watch import progress

    if queries.studies(url, [study]).empty:
        _missing_study(url, study)
    frame = queries.runs(url, study_id=study)
    frame["progress"] = progress(frame, queries.study_spec(url, study))["progress"]
    frame["note"] = run_notes(frame)
    frame["imported"] = frame["imported_from"].notna()
    frame["loss"], frame["failure"] = frame["latest_loss"], frame["failure_reason"]
    return frame


def run_counts(frame) -> list[str]:
    """Each study's runs by status, in words: '6 runs: 4 done, 1 running, 1 failed'
    (and how many were imported)."""
    shown = []
    for row in frame.to_dict("records"):
        parts = [f"{int(row[s] or 0)} {s}" for s in RUN_STATUSES if int(row[s] or 0)]
        if row.get("imported"):
            parts.append(f"{int(row['imported'])} imported")
        runs = int(row["runs"] or 0)
        shown.append(f"{runs} run{'s' * (runs != 1)}" + (": " + ", ".join(parts) if parts else ""))
    return shown


def _check_views(study: int | None, *, events: bool, deleted: bool, limit: int | None) -> None:
    if events and deleted:
        fail("give --events or --deleted, not both", code=2)
    if deleted and study is not None:
        fail("--deleted lists every deleted study: give no study id", code=2)
    if limit is not None and study is not None and not events:
        fail("--limit applies to the list of studies or --events, not to a study's runs", 2)


def _on_runs(action, study: int | None, run: int | None):
    """Apply a jobs.service action to a study or one run; bad ids exit 2."""
    from jobs.service import NotFound

    if (study is None) == (run is None):
        fail("give a study id or --run ID", code=2)
    _check_id(study, "the study id")
    _check_id(run, "--run")
    _database()
    try:
        return action(study_id=study, run_id=run, actor=cli_actor())
    except NotFound as err:
        fail(str(err), code=2)


@app.command()
def cancel(study: StudyArgument = None, run: RunOption = None) -> None:
    """Cancel queued runs at once; running runs stop at their next progress report."""
    from jobs.service import cancel as cancel_runs

    counts = _on_runs(cancel_runs, study, run)
    console.print(f"{counts[RunStatus.CANCELLED]} cancelled, {counts[STOPPING]} stopping")


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
    """Delete a finished study: hidden at once, restorable (posbench restore) for
    POSBENCH_DELETE_RETENTION_DAYS, then purged with its results and checkpoints."""
    from core.settings import get_settings
    from db import queries
    from jobs.audit import stamp
    from jobs.retention import Busy, busy_message, delete_study
    from jobs.service import NotFound

    _check_id(study, "the study id")
    url = _database()
    found = queries.studies(url, [study])
    if found.empty:
        _missing_study(url, study)
    row = found.iloc[0]
    if busy := sum(int(row[status]) for status in ACTIVE):
        fail(busy_message(study, busy), code=1)
    days = get_settings().delete_retention_days
    if not yes and not typer.confirm(
        f"Delete study {study} ({row['name']}) with its {row['runs']} runs and their results? "
        f"It can be restored for {days:g} days (posbench restore {study}), then it is purged."
    ):
        fail("nothing deleted", code=1)
    try:
        deleted = delete_study(study, actor=cli_actor())
    except NotFound as err:
        fail(str(err), code=2)
    except Busy as err:
        fail(str(err), code=1)
    echo(
        f"deleted study {study} ({deleted.name}): {deleted.runs} runs, "
        f"{deleted.evaluations} evaluations; posbench restore {study} brings it back until "
        f"{stamp(deleted.purge_at)}, when it is purged with its checkpoints"
    )
