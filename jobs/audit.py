"""The audit trail: who submitted, cancelled, retried, deleted, restored, purged or
imported what, and when (the ``events`` table; docs/security.md, "Audit and recovery").

Each use case records its event in the transaction that makes its change, so a change
is never stored without its event, nor an event without its change. The actor is
whoever the entry point says acted: the OIDC e-mail or the password role and client
address on the dashboard (``dashboard.auth.actor``), the OS user for the CLI
(``cli.common.cli_actor``), ``posbench (retention)`` for the reconciler's purges.
It is a record of who asked, not proof of identity: anyone who holds the database's
credentials can write the table.

``db.queries.events`` reads the trail for ``posbench status --events`` and the Queue
page.
"""

from __future__ import annotations

import datetime as dt
from enum import StrEnum

from sqlalchemy.orm import Session

from db.models import ACTOR_LENGTH, DETAIL_LENGTH, Event, as_utc

RETENTION_ACTOR = "posbench (retention)"  # the reconciler, purging past the retention


class Action(StrEnum):
    SUBMIT = "submit"
    CANCEL = "cancel"
    RETRY = "retry"
    DELETE = "delete"  # soft: hidden, kept for the retention period
    RESTORE = "restore"
    PURGE = "purge"  # the study and its results removed for good
    IMPORT = "import"


def bounded(value: str, limit: int) -> str:
    """``value`` cut to ``limit`` characters (an ellipsis says it was cut): a column's
    bound is never a reason to refuse an action."""
    return value if len(value) <= limit else value[: limit - 1] + "…"


def actor_name(actor: str) -> str:
    """An actor as stored: one line, within the column's bound; never empty."""
    line = " ".join(actor.split()) or "(unknown)"
    return bounded(line, ACTOR_LENGTH)


def run_count(count: int) -> str:
    """``1 run``, ``4 runs``: a count as an event's detail says it."""
    return "1 run" if count == 1 else f"{count} runs"


def stamp(moment: dt.datetime) -> str:
    """A stored time as people read it in a message: ``2027-01-25 09:30 UTC``."""
    return as_utc(moment).astimezone(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def deleted_message(study_id: int, deleted_by: str | None, deleted_at: dt.datetime) -> str:
    """What an action on a deleted study is told: who deleted it, when, and the way back."""
    return (
        f"study {study_id} is deleted (by {deleted_by}, {stamp(deleted_at)}): "
        f"posbench restore {study_id} brings it back"
    )


def record(
    session: Session,
    actor: str,
    action: Action,
    *,
    study_id: int | None = None,
    run_id: int | None = None,
    detail: str | None = None,
) -> None:
    """Add an event to ``session``'s transaction (it is stored when the change is)."""
    session.add(
        Event(
            actor=actor_name(actor),
            action=action.value,
            study_id=study_id,
            run_id=run_id,
            detail=None if detail is None else bounded(" ".join(detail.split()), DETAIL_LENGTH),
        )
    )
