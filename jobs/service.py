"""Submit, cancel, retry and reconcile: the use cases that change runs outside the worker.

Each calls its transition in ``jobs.lifecycle``, the only code that changes a run's
status, and records who asked in the audit trail (``jobs.audit``) in the same
transaction. Deleting, restoring and purging a study are ``jobs.retention``'s.

The database is the source of truth. A submission writes the study and its runs in
one transaction and only then enqueues ``posbench.train_run(run_id)`` by name; a
message that never arrives is re-sent by the reconciler, and a duplicate is
harmless because a worker must *claim* a queued run before it trains it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from core import analysis
from core.catalog.hf_models import weights_problem
from core.errors import UserError
from core.safe_text import redact_urls
from core.settings import Settings, get_settings
from core.spec import StudySpec
from core.status import STOPPING, RunStatus
from db.engine import transaction, with_retry
from db.models import (
    Base,
    Evaluation,
    Event,
    PositionBin,
    Run,
    RunSummary,
    Study,
    TrainPoint,
    utcnow,
)
from db.queries import run_points
from jobs import audit, lifecycle, quotas
from jobs.audit import Action, actor_name, deleted_message, record, stamp
from jobs.celery_app import TRAIN_RUN, producer

log = logging.getLogger(__name__)

Send = Callable[[int], None]


class NotFound(UserError, LookupError):
    """A study or run id that does not exist, or a study that is deleted."""


class Refused(UserError, ValueError):
    """A spec this service's rules refuse: a corpus it may not read, or over a quota
    (``jobs.quotas``)."""


def sources_problem(spec: StudySpec, settings: Settings) -> str | None:
    """Why this service may not read the spec's data: its corpus and its hf: model under
    the operator's rules, and a model folder whose weights lack what its architecture
    needs (built on the meta device: no weights loaded); None when it may."""
    problem = spec.source_problem(settings.sources, settings.models)
    if problem is None and spec.model.hf is not None:
        problem = weights_problem(spec.model.hf, settings.models)
    return problem


def check_sources(spec: StudySpec, settings: Settings) -> None:
    """Refuse, before anything is stored, a spec whose data this service may not read
    (the worker checks again where it reads)."""
    problem = sources_problem(spec, settings)
    if problem:
        raise Refused(problem)


@dataclass(frozen=True)
class Submitted:
    study_id: int
    queued: list[int]
    reused: list[int]
    unsent: list[int]  # stored, but the broker could not be reached; the reconciler re-sends
    imported: list[int] = dataclasses.field(default_factory=list)  # reused imported results


def study_queue(spec: dict | None) -> str:
    """The queue a stored study spec asked for ('gpu' for studies stored before there
    was a choice)."""
    return (spec or {}).get("queue", "gpu")


def queue_of(url: str, run_id: int) -> str:
    """The queue of a run's study."""
    with transaction(url) as session:
        spec = session.scalar(
            select(Study.spec).join(Run, Run.study_id == Study.id).where(Run.id == run_id)
        )
    return study_queue(spec)


def celery_send(
    run_id: int, settings: Settings | None = None, countdown: float | None = None
) -> None:
    """Enqueue ``train_run(run_id)`` by name on its study's queue (``countdown``: not
    before that many seconds): the producer never imports the task's code."""

    settings = settings or get_settings()
    queue = queue_of(settings.database, run_id)
    producer(settings).send_task(
        TRAIN_RUN, args=[run_id], queue=queue, routing_key=queue, countdown=countdown
    )


def _copied(row: Base, *, skip: tuple[str, ...] = (), **changes: object) -> Base:
    """A new row of ``row``'s model with its column values, less the primary key and
    ``skip`` (left to their defaults), with ``changes`` applied."""
    return type(row)(**{**row.column_values(skip), **changes})


def _copy_results(session: Session, source: Run, target: Run) -> None:
    """Reuse a finished run: copy its training curve, evaluations (stamped now), position
    bins and summaries."""
    for model in (TrainPoint, RunSummary):
        for row in session.scalars(select(model).where(model.run_id == source.id)):
            session.add(_copied(row, run_id=target.id))
    for row in session.scalars(select(Evaluation).where(Evaluation.run_id == source.id)):
        copy = _copied(row, skip=("created_at",), run_id=target.id)
        session.add(copy)
        session.flush()
        for b in session.scalars(select(PositionBin).where(PositionBin.evaluation_id == row.id)):
            session.add(_copied(b, evaluation_id=copy.id))


def new_study(spec: StudySpec, submitted_by: str) -> Study:
    """The row of a study, as submitted (or imported) by ``submitted_by``."""
    return Study(
        name=spec.name,
        task=spec.task.name,
        metric=spec.task.metric,
        train_length=spec.train.length,
        spec=spec.model_dump(mode="json"),
        submitted_by=actor_name(submitted_by),
    )


def _cached_run(session: Session, config_hash: str, *, reuse_imported: bool) -> Run | None:
    """The finished run whose results a run of ``config_hash`` reuses: the newest one
    trained here; a run imported (``posbench import``, or a run that reused one) only
    with ``reuse_imported``, and then a trained one still first."""
    statement = select(Run).where(
        Run.config_hash == config_hash, *lifecycle.reusable(reuse_imported=reuse_imported)
    )
    imported_last = Run.imported_from.is_not(None)
    return session.scalars(
        statement.order_by(imported_last, Run.finished_at.desc()).limit(1)
    ).first()


def submit(
    spec: StudySpec,
    *,
    actor: str,
    force: bool = False,
    reuse_imported: bool = False,
    settings: Settings | None = None,
    send: Send | None = None,
) -> Submitted:
    """Store the study and its runs in one transaction, then enqueue the queued runs.

    The result cache: a run whose config hash already finished (status done) in any
    study reuses those results, unless ``force`` asks to train again (and to take no
    trained model from the cache either). Results imported rather than trained here
    are reused only with ``reuse_imported`` (and the run stays marked imported). A
    corpus outside the operator's rules is ``Refused`` before anything is written, and
    so is a study over a quota (its estimated compute, or the runs it would leave
    queued or running).
    """
    settings = settings or get_settings()
    check_sources(spec, settings)
    problem = quotas.flops_problem(spec, settings) or quotas.disk_problem(spec, settings)
    if problem:
        raise Refused(problem)
    queued, reused, imported = [], [], []
    with transaction(settings.database) as session:
        # In the writing transaction, before its first write: SQLite's BEGIN IMMEDIATE
        # serialises submissions, so two cannot both pass on the same count.
        problem = quotas.active_runs_problem(
            session,
            spec,
            settings,
            force=force,
            reuse_imported=reuse_imported,
            submitter=actor_name(actor),
        )
        if problem:
            raise Refused(problem)
        study = new_study(spec, actor)
        session.add(study)
        session.flush()
        for run_spec in spec.runs():
            run = lifecycle.submit(study, spec, run_spec, skip_cache=force)
            session.add(run)
            session.flush()
            previous = (
                None
                if force
                else _cached_run(session, run_spec.config_hash, reuse_imported=reuse_imported)
            )
            if previous is not None:
                lifecycle.reuse(run, previous)
                _copy_results(session, previous, run)
                reused.append(run.id)
                if previous.imported_from is not None:
                    imported.append(run.id)
            else:
                queued.append(run.id)
        study_id = study.id
        detail = f"{spec.name}: {audit.run_count(len(queued))} queued, {len(reused)} reused"
        record(session, actor, Action.SUBMIT, study_id=study_id, detail=detail)
    unsent = enqueue(queued, settings=settings, send=send)
    return Submitted(study_id, queued, reused, unsent, imported)


def enqueue(
    run_ids: Iterable[int], *, settings: Settings | None = None, send: Send | None = None
) -> list[int]:
    """Send each run to the broker and stamp ``enqueued_at``; return the ids that failed."""
    settings = settings or get_settings()
    send = send or functools.partial(celery_send, settings=settings)
    sent, unsent = [], []
    for run_id in run_ids:
        try:
            send(run_id)
        except Exception as err:  # any broker failure: the reconciler will send it later
            log.warning("could not enqueue run %s: %s", run_id, redact_urls(str(err)))
            unsent.append(run_id)
            continue
        sent.append(run_id)
    if sent:
        # One stamp for the batch; a crash before it only means a harmless re-send, and
        # so does a failure to write it: the study is stored, so never report it unsent.
        try:
            with transaction(settings.database) as session:
                session.execute(update(Run).where(Run.id.in_(sent)).values(enqueued_at=utcnow()))
        except Exception as err:
            log.warning(
                "could not stamp runs %s as sent (they will be sent again): %s",
                sent,
                redact_urls(str(err)),
            )
    return unsent


def live_study(session: Session, study_id: int) -> Study:
    """The study, locked until the transaction ends against another cancel, retry,
    delete, restore or purge of it (PostgreSQL; SQLite's BEGIN IMMEDIATE already
    serialises writers). NotFound when there is none, or it is deleted."""
    study = session.get(Study, study_id, with_for_update={"key_share": True})
    if study is None:
        raise missing_study(session, study_id)
    if study.deleted_at is not None:
        raise NotFound(deleted_message(study.id, study.deleted_by, study.deleted_at))
    return study


def missing_study(session: Session, study_id: int) -> NotFound:
    """The error for a study id with no row: purged (when, by whom: the audit trail
    says), or never stored."""
    purged = session.scalar(
        select(Event)
        .where(Event.study_id == study_id, Event.action == Action.PURGE.value)
        .order_by(Event.id.desc())
        .limit(1)
    )
    if purged is None:
        return NotFound(f"no study with id {study_id}")
    return NotFound(
        f"study {study_id} was purged ({stamp(purged.at)}, by {purged.actor}): its runs, "
        "results and checkpoints are gone and cannot be restored"
    )


def _select_runs(session: Session, study_id: int | None, run_id: int | None) -> list[Run]:
    """The runs to act on, of a study that is not deleted, locked until the transaction
    ends (PostgreSQL: a claim or a finish waits for the cancel or retry, then sees its
    result). The study is locked first, whichever was named, so that two actions on
    it always lock in the same order."""
    if run_id is not None:
        study_id = session.scalar(select(Run.study_id).where(Run.id == run_id))
        if study_id is None:
            raise NotFound(f"no run with id {run_id}")
        live_study(session, study_id)
        run = session.get(Run, run_id, with_for_update=True)
        if run is None:  # its study was purged in the meantime
            raise NotFound(f"no run with id {run_id}")
        return [run]
    live_study(session, study_id)
    runs = select(Run).where(Run.study_id == study_id).order_by(Run.id).with_for_update()
    return list(session.scalars(runs))


def _acted_on(runs: list[Run], study_id: int | None, run_id: int | None) -> dict[str, int]:
    """The study and run an event names: the run's study when a run was named."""
    return {"study_id": runs[0].study_id if run_id is not None else study_id, "run_id": run_id}


def cancel(
    *,
    actor: str,
    study_id: int | None = None,
    run_id: int | None = None,
    settings: Settings | None = None,
) -> dict[str, int]:
    """Queued runs are cancelled at once; running ones stop within a heartbeat (or a
    progress report, whichever comes first) while training, and before the next point
    while evaluating. ``actor`` (who cancels) goes to the audit trail."""
    settings = settings or get_settings()
    counts = dict.fromkeys((RunStatus.CANCELLED.value, STOPPING), 0)
    with transaction(settings.database) as session:
        runs = _select_runs(session, study_id, run_id)
        for run in runs:
            outcome = lifecycle.cancel(run)
            if outcome is not None:
                counts[outcome] += 1
        detail = ", ".join(f"{count} {outcome}" for outcome, count in counts.items())
        record(session, actor, Action.CANCEL, detail=detail, **_acted_on(runs, study_id, run_id))
    return counts


def retry(
    *,
    actor: str,
    study_id: int | None = None,
    run_id: int | None = None,
    settings: Settings | None = None,
    send: Send | None = None,
) -> list[int]:
    """Re-queue failed or cancelled runs; they resume from their last checkpoint.
    ``actor`` (who retries) goes to the audit trail."""
    settings = settings or get_settings()
    requeued = []
    with transaction(settings.database) as session:
        runs = _select_runs(session, study_id, run_id)
        for run in runs:
            if lifecycle.retry(run):
                requeued.append(run.id)
        detail = f"{audit.run_count(len(requeued))} queued again"
        record(session, actor, Action.RETRY, detail=detail, **_acted_on(runs, study_id, run_id))
    enqueue(requeued, settings=settings, send=send)
    return requeued


def backfill_summaries(url: str) -> int:
    """Summarise finished runs whose curve summaries are missing or incomplete (runs
    finished before the ``run_summaries`` table existed, or before a summary such as
    ``effective_length_censored`` was added); returns how many runs gained rows. Only
    missing rows are added: stored values stay. The order probe needs the model, so
    only the curve summaries are filled in."""
    # Here, not at the top: submitting a study need not load pandas.

    keys = analysis.summary_keys()

    def attempt() -> int:
        with transaction(url) as session:
            # Complete: every curve summary is stored (for at least one of its curves).
            complete = (
                select(RunSummary.run_id)
                .where(RunSummary.name.in_(keys))
                .group_by(RunSummary.run_id)
                .having(func.count(RunSummary.name.distinct()) == len(keys))
            )
            pending = session.execute(
                select(Run.id, Study.metric, Study.train_length, Study.spec)
                .join(Study, Study.id == Run.study_id)
                .where(Run.status == RunStatus.DONE, Run.id.not_in(complete))
            ).all()
            filled = 0
            for run_id, metric, train_length, spec in pending:
                points = session.execute(run_points(run_id, metric)).all()
                if not points:
                    continue
                stored = set(
                    session.execute(
                        select(RunSummary.variant, RunSummary.protocol, RunSummary.name).where(
                            RunSummary.run_id == run_id
                        )
                    ).all()
                )
                added = [
                    summary
                    for summary in analysis.summarize_points(
                        points,
                        train_length=train_length,
                        metric=metric,
                        # The study's own threshold (stored specs spell it; None: default).
                        effective=((spec or {}).get("eval") or {}).get("effective_length"),
                    )
                    if (summary.variant, summary.protocol, summary.name) not in stored
                ]
                for summary in added:
                    session.add(RunSummary(run_id=run_id, **summary._asdict()))
                filled += bool(added)
            return filled

    return with_retry(attempt)
