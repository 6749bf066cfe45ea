"""The audit trail and recovery: `posbench status --events` and `--deleted` (their
views), `posbench restore` and `posbench purge` (docs/security.md, "Audit and
recovery")."""

from __future__ import annotations

from typing import Annotated

import typer

from cli.common import _check_id, _database, app, cli_actor, console, fail
from core.terminal import echo


def _ids(values):
    """Ids as ints, or None where there is none (pandas reads a column with a gap as
    floats, 3.0 and NaN; this one keeps 3 and None, JSON 3 and null)."""
    import pandas as pd

    return pd.Series([None if pd.isna(v) else int(v) for v in values], dtype=object)


def _utc(values):
    """Stored times as aware UTC ones (SQLite's come back naive): JSON says ...Z."""
    import pandas as pd

    from db.models import as_utc

    return pd.Series([as_utc(value) for value in values], dtype="datetime64[ns, UTC]")


def _times(values) -> list[str]:
    return [value.strftime("%Y-%m-%d %H:%M:%S") for value in values]


def show_events(url: str, study: int | None, limit: int, *, as_json: bool) -> None:
    """The newest ``limit`` events (of ``study``), newest first; every string as text."""
    from db import queries
    from jobs.watch import frame_table

    frame = queries.events(url, study, limit)
    frame = frame.assign(
        at=_utc(frame["at"]), study_id=_ids(frame["study_id"]), run_id=_ids(frame["run_id"])
    )
    if as_json:
        echo(frame.to_json(orient="records", date_format="iso"))
        return
    shown = frame.assign(at=_times(frame["at"])).rename(
        columns={"at": "at (UTC)", "study_id": "study", "run_id": "run"}
    )
    title = "events" if study is None else f"events of study {study}"
    console.print(frame_table(shown.fillna(""), title=f"{title} (newest first)"))


def show_deleted(url: str, *, as_json: bool) -> None:
    """The deleted studies: who submitted and deleted each, when, and when it is purged."""
    from core.settings import get_settings
    from db import queries
    from jobs.retention import purge_at
    from jobs.watch import frame_table

    settings = get_settings()
    frame = queries.deleted_studies(url)
    frame["deleted_at"] = _utc(frame["deleted_at"])
    frame["purge_at"] = [purge_at(moment, settings) for moment in frame["deleted_at"]]
    if as_json:
        echo(frame.to_json(orient="records", date_format="iso"))
        return
    shown = frame.assign(
        deleted_at=_times(frame["deleted_at"]), purge_at=_times(frame["purge_at"])
    ).rename(
        columns={
            "submitted_by": "submitted by",
            "deleted_by": "deleted by",
            "deleted_at": "deleted at (UTC)",
            "purge_at": "purged at (UTC)",
        }
    )
    title = (
        f"deleted studies (posbench restore ID within "
        f"{settings.delete_retention_days:g} days of the delete)"
    )
    console.print(frame_table(shown.fillna(""), title=title))


@app.command()
def restore(
    study: Annotated[int, typer.Argument(show_default=False, help="The deleted study's id.")],
) -> None:
    """Bring back a deleted study, within POSBENCH_DELETE_RETENTION_DAYS of its delete."""
    from jobs.retention import restore_study
    from jobs.service import NotFound

    _check_id(study, "the study id")
    _database()
    try:
        restored = restore_study(study, actor=cli_actor())
    except NotFound as err:
        fail(str(err), code=2)
    echo(f"restored study {study} ({restored.name}): {restored.runs} runs")


@app.command()
def purge(
    study: Annotated[
        int | None,
        typer.Option(
            "--study",
            help="Purge this deleted study now, however recently it was deleted (for data "
            "that must go at once).",
        ),
    ] = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
) -> None:
    """Remove for good the studies deleted longer ago than POSBENCH_DELETE_RETENTION_DAYS
    (what the reconciler does on every pass), or one deleted study at once: its runs,
    results and this machine's checkpoints."""
    from core.settings import get_settings
    from db import queries
    from jobs.retention import purge as purge_studies
    from jobs.service import NotFound

    _check_id(study, "--study")
    url = _database()
    settings = get_settings()
    if study is not None:
        found = queries.deleted_studies(url, [study])
        name = found.iloc[0]["name"] if not found.empty else None
        if (
            name is not None
            and not yes
            and not typer.confirm(
                f"Purge deleted study {study} ({name}) for good, with its runs, results and "
                "checkpoints? This cannot be undone."
            )
        ):
            fail("nothing purged", code=1)
    try:
        purged = purge_studies(settings, study_id=study, actor=cli_actor())
    except NotFound as err:
        fail(str(err), code=2)
    if not purged.studies:
        echo(
            "nothing to purge: no study was deleted longer ago than "
            f"POSBENCH_DELETE_RETENTION_DAYS ({settings.delete_retention_days:g})"
        )
        return
    studies = "1 study" if len(purged.studies) == 1 else f"{len(purged.studies)} studies"
    echo(
        f"purged {studies} ({', '.join(map(str, purged.studies))}): "
        f"{purged.runs} runs, {purged.evaluations} evaluations, {purged.checkpoints} "
        "checkpoint files"
    )
