"""Deleting a study, and undoing it: a delete is soft, a purge is for good.

- ``delete_study`` marks the study deleted (``studies.deleted_at``, ``deleted_by``) and
  keeps every row and checkpoint: the study is hidden everywhere a live one shows
  (``db.queries``, the MLflow export, the ``encoding_summaries`` view) and serves no
  result cache (``db.models.in_live_study``). A mistaken or malicious delete can be
  undone.
- ``restore_study`` undoes it, within ``POSBENCH_DELETE_RETENTION_DAYS`` of the delete.
- ``purge`` removes, for good, the studies deleted longer ago than that (the
  reconciler runs it on every pass, ``jobs.reconciler``), or one deleted study at once
  (``posbench purge --study``, for data that must go now): the database's cascades
  remove its runs and results, then its runs' checkpoints leave this machine's
  artifacts folder.

Each records its event in the audit trail (``jobs.audit``), a purge with what it
removed: the events outlive the study.
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from core.settings import Settings, get_settings
from core.status import ACTIVE
from db.engine import transaction
from db.models import Evaluation, Run, Study, as_utc, utcnow
from jobs.audit import RETENTION_ACTOR, Action, actor_name, record, run_count, stamp
from jobs.service import NotFound, live_study, missing_study

log = logging.getLogger(__name__)


class Busy(RuntimeError):
    """The study still has runs queued or running."""


class NotDeleted(NotFound):
    """A study that is not deleted: there is nothing to restore, and it cannot be purged."""


def busy_message(study_id: int, busy: int) -> str:
    runs = "1 run" if busy == 1 else f"{busy} runs"
    return (
        f"study {study_id} has {runs} queued or running: cancel first "
        f"(posbench cancel {study_id}) and wait until they stop"
    )


def purge_at(deleted_at: dt.datetime, settings: Settings) -> dt.datetime:
    """When a study deleted at ``deleted_at`` is purged (and can no longer be restored)."""
    return as_utc(deleted_at) + dt.timedelta(days=settings.delete_retention_days)


@dataclass(frozen=True)
class Deleted:
    name: str
    runs: int
    evaluations: int
    purge_at: dt.datetime  # restorable until then


def _evaluations(session: Session, run_ids: list[int]) -> int:
    count = select(func.count()).select_from(Evaluation).where(Evaluation.run_id.in_(run_ids))
    return int(session.scalar(count) or 0)


def delete_study(study_id: int, *, actor: str, settings: Settings | None = None) -> Deleted:
    """Delete a study: hidden at once, its rows and checkpoints kept until it is purged
    (restorable until then). Refused (Busy) while a run is queued or running: cancel
    first. NotFound for an unknown or already deleted study."""
    settings = settings or get_settings()
    with transaction(settings.database) as session:
        study = live_study(session, study_id)
        runs = list(session.scalars(select(Run).where(Run.study_id == study_id)))
        busy = sum(run.status in ACTIVE for run in runs)
        if busy:
            raise Busy(busy_message(study_id, busy))
        evaluations = _evaluations(session, [run.id for run in runs])
        study.deleted_at, study.deleted_by = utcnow(), actor_name(actor)
        until = purge_at(study.deleted_at, settings)
        detail = (
            f"{study.name}: {run_count(len(runs))}, {evaluations} evaluations; restorable until "
            f"{stamp(until)}"
        )
        record(session, actor, Action.DELETE, study_id=study_id, detail=detail)
        return Deleted(study.name, len(runs), evaluations, until)


def _deleted_study(session: Session, study_id: int, why: str) -> Study:
    """The deleted study, locked; NotFound (saying when it was purged, if it was), or
    NotDeleted (with ``why`` that matters)."""
    study = session.get(Study, study_id, with_for_update=True)
    if study is None:
        raise missing_study(session, study_id)
    if study.deleted_at is None:
        raise NotDeleted(f"study {study_id} is not deleted: {why}")
    return study


@dataclass(frozen=True)
class Restored:
    name: str
    runs: int


def restore_study(study_id: int, *, actor: str, settings: Settings | None = None) -> Restored:
    """Undo the delete of a study, within the retention period: it shows again, and its
    results serve the result cache again. NotFound once it is purged or past the
    retention (it will be purged), NotDeleted for a study that is not deleted."""
    settings = settings or get_settings()
    with transaction(settings.database) as session:
        study = _deleted_study(session, study_id, "there is nothing to restore")
        until = purge_at(study.deleted_at, settings)
        if utcnow() >= until:
            raise NotFound(
                f"study {study_id} was deleted {stamp(study.deleted_at)}, longer ago than "
                f"POSBENCH_DELETE_RETENTION_DAYS ({settings.delete_retention_days:g}): it can "
                "no longer be restored and is purged at the reconciler's next pass"
            )
        detail = f"{study.name}: deleted by {study.deleted_by}, {stamp(study.deleted_at)}"
        study.deleted_at, study.deleted_by = None, None
        record(session, actor, Action.RESTORE, study_id=study_id, detail=detail)
        runs = session.scalar(select(func.count()).select_from(Run).where(Run.study_id == study_id))
        return Restored(study.name, int(runs or 0))


@dataclass(frozen=True)
class Purged:
    studies: list[int]
    runs: int
    evaluations: int
    checkpoints: int  # checkpoint files removed from this machine's artifacts folder


def purge(
    settings: Settings | None = None,
    *,
    now: dt.datetime | None = None,
    study_id: int | None = None,
    actor: str = RETENTION_ACTOR,
) -> Purged:
    """Remove for good the studies deleted longer ago than the retention period (at
    ``now``), or only ``study_id``, a deleted study, whenever it was deleted: the study
    and everything stored for it (the database's cascades), then its runs' checkpoints.
    Runs of other studies reused from its runs keep their own copies. Each study goes in
    its own transaction, with its purge event; one another reconciler purged first is
    skipped."""
    settings = settings or get_settings()
    if study_id is None:
        cutoff = (now or utcnow()) - dt.timedelta(days=settings.delete_retention_days)
        with transaction(settings.database) as session:
            due = select(Study.id).where(Study.deleted_at <= cutoff).order_by(Study.id)
            chosen = list(session.scalars(due))
    else:
        chosen, cutoff = [study_id], None
    done, runs, evaluations, removed = [], 0, 0, 0
    for chosen_id in chosen:
        with transaction(settings.database) as session:
            try:
                why = f"only a deleted study is purged (posbench delete {chosen_id} first)"
                study = _deleted_study(session, chosen_id, why)
            except NotFound:
                if study_id is not None:
                    raise
                continue  # restored or purged meanwhile
            if cutoff is not None and as_utc(study.deleted_at) > as_utc(cutoff):
                continue  # deleted again since it was chosen
            run_ids = list(session.scalars(select(Run.id).where(Run.study_id == chosen_id)))
            counted = _evaluations(session, run_ids)
            detail = (
                f"{study.name}: {run_count(len(run_ids))}, {counted} evaluations, deleted by "
                f"{study.deleted_by}, {stamp(study.deleted_at)}"
            )
            session.execute(delete(Study).where(Study.id == chosen_id))
            record(session, actor, Action.PURGE, study_id=chosen_id, detail=detail)
        done.append(chosen_id)
        runs, evaluations = runs + len(run_ids), evaluations + counted
        removed += remove_checkpoints(settings, run_ids)
    return Purged(done, runs, evaluations, removed)


def remove_checkpoints(settings: Settings, run_ids: list[int]) -> int:
    """Remove the runs' checkpoints from this machine's artifacts folder; how many files."""
    removed = 0
    folder = settings.artifacts_dir / "runs"
    for run_id in run_ids:
        # The checkpoint, its fine-tuned variants' (.pt.ft-*), files set aside (.stale)
        # and temporaries a killed write or a cache copy left (.tmp, some hidden).
        others = [*folder.glob(f"{run_id}.pt.*"), *folder.glob(f".{run_id}.pt.*")]
        for path in [folder / f"{run_id}.pt", *others]:
            if not path.is_file():
                continue
            try:
                path.unlink(missing_ok=True)  # another reconciler may be removing it too
            except OSError as err:  # the rows are gone already: say which file stays
                log.warning("could not remove the checkpoint %s of run %s: %s", path, run_id, err)
                continue
            removed += 1
    return removed
