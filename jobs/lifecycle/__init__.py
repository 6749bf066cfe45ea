"""One run's life: every change of its status, as a named transition.

::

    submit ──> queued ──claim──> running ──finish──> done | failed | cancelled
      │          ^  │               │ release (worker shutting down) ──> queued
      │          │  └─cancel──> cancelled   requeue (its worker died) ──> queued
      │          └─────retry─────── failed | cancelled
      └─ reuse (the result cache has it) ──> done         import ──> done (imported)

This package is the only code that writes a run's ``status`` (``core.status``), in two
halves. The worker's, under a lease (``jobs.lifecycle.lease``): claim, heartbeat,
progress, phase, finish and release, every write naming the lease the claim wrote, so
a worker that lost its run to the reconciler can no longer touch it. The queue's, here:
a run comes into being (submit, reuse, import), a user asks (cancel, retry), the
reconciler finds runs whose worker died (requeue, expire, reconcile). Callers import
both from here.

The transitions a user asks for (cancel, retry) act on rows their caller has locked
in its own transaction (``jobs.service``); the worker's and the reconciler's open
their own.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from core.spec import RunSpec, StudySpec
from core.status import RETRYABLE, STOPPING, RunStatus
from db.engine import transaction, with_retry
from db.models import Run, Study, in_live_study, utcnow
from jobs.lifecycle.lease import (
    ClaimedRun,
    LeaseClock,
    LeaseLost,
    claim,
    finish,
    heartbeat,
    hold,
    progress,
    release,
    set_phase,
    under_lease,
)

__all__ = [
    "ClaimedRun",
    "LeaseClock",
    "LeaseLost",
    "Reconciled",
    "cancel",
    "claim",
    "expire",
    "finish",
    "heartbeat",
    "hold",
    "import_run",
    "new_run",
    "progress",
    "reconcile",
    "release",
    "requeue",
    "retry",
    "reusable",
    "reuse",
    "set_phase",
    "submit",
    "under_lease",
]


# --- submit, reuse, import: a run comes into being -------------------------------------


def new_run(study: Study, spec: StudySpec, run_spec: RunSpec, **values: object) -> Run:
    """The row of one of ``study``'s runs (``values``: its status and what else is known)."""
    return Run(
        study_id=study.id,
        encoding=run_spec.encoding.name,
        label=run_spec.encoding.label,
        params=run_spec.encoding.resolved_params,
        seed=run_spec.seed,
        config_hash=run_spec.config_hash,
        train_hash=run_spec.train_hash,
        total_steps=spec.train.steps,
        **values,
    )


def submit(study: Study, spec: StudySpec, run_spec: RunSpec, *, skip_cache: bool = False) -> Run:
    """A new queued run. ``skip_cache`` (``--force``): it trains afresh and takes no
    model from the result cache; the model it trains can serve later studies."""
    return new_run(study, spec, run_spec, status=RunStatus.QUEUED, skip_cache=skip_cache)


def reusable(*, reuse_imported: bool) -> list[Any]:
    """The conditions on a run whose results the result cache serves: finished (done),
    of a study that is not deleted, and trained here unless ``reuse_imported`` (results
    from ``posbench import``)."""
    conditions: list[Any] = [Run.status == RunStatus.DONE, in_live_study()]
    if not reuse_imported:
        conditions.append(Run.imported_from.is_(None))
    return conditions


def reuse(run: Run, cached: Run) -> None:
    """A submitted run whose results the result cache holds (``cached``: a finished run
    of the same config hash) is done at once, with that run's progress and provenance;
    its caller copies the results. Results ``cached`` imported rather than trained stay
    marked as imported (its ``imported_from``)."""
    now = utcnow()
    run.status, run.step = RunStatus.DONE, cached.step
    run.latest_loss, run.provenance = cached.latest_loss, cached.provenance
    run.imported_from = cached.imported_from
    run.reused_from_run_id = cached.reused_from_run_id or cached.id
    run.started_at, run.finished_at = now, now


def import_run(
    study: Study, spec: StudySpec, run_spec: RunSpec, source: str, **values: object
) -> Run:
    """A run imported with its results (``posbench import``) from the file ``source``:
    done as it is written, and marked imported (``imported_from``): not trained here, so
    the result cache reuses it only when a submitter asks (``--reuse-imported``)."""
    return new_run(study, spec, run_spec, status=RunStatus.DONE, imported_from=source, **values)


# --- cancel, retry: a user asks (rows locked by the caller's transaction) -------------


def cancel(run: Run) -> str | None:
    """Cancel a queued run at once (CANCELLED); ask a running one to stop (STOPPING: it
    stops within a heartbeat or a progress report); None for a finished run."""
    if run.status == RunStatus.QUEUED:
        run.status, run.finished_at = RunStatus.CANCELLED, utcnow()
        return RunStatus.CANCELLED.value
    if run.status == RunStatus.RUNNING:
        run.cancel_requested = True
        return STOPPING
    return None


def retry(run: Run) -> bool:
    """Queue a failed or cancelled run again (it resumes from its last checkpoint);
    False for any other. Its caller sends it."""
    if run.status not in RETRYABLE:
        return False
    run.status, run.cancel_requested = RunStatus.QUEUED, False
    # attempts counts claims since the user last queued it: a retry starts the
    # worker-death budget (POSBENCH_MAX_ATTEMPTS) afresh.
    run.attempts = 0
    run.failure_reason = run.finished_at = run.lease = run.enqueued_at = None
    run.started_at = None  # its wall-clock deadline (POSBENCH_RUN_DEADLINE_HOURS) starts afresh
    return True


# --- requeue, reconcile: the reconciler finds runs whose worker died --------------------


@dataclass(frozen=True)
class Reconciled:
    revived: list[int]  # requeued: they resume from their checkpoint
    failed: list[int]  # out of attempts
    cancelled: list[int]  # a cancel was asked before the worker died
    expired: list[int] = field(default_factory=list)  # failed: past their wall-clock deadline


def requeue(session: Session, run_ids: list[int], *guard: Any) -> None:
    """Put running runs back in the queue, unsent (the reconciler sends them)."""
    if run_ids:
        session.execute(
            update(Run)
            .where(Run.id.in_(run_ids), Run.status == RunStatus.RUNNING, *guard)
            .values(status=RunStatus.QUEUED, lease=None, enqueued_at=None)
        )


def _end(session: Session, run_ids: list[int], status: RunStatus, reason: str, *guard: Any) -> None:
    if run_ids:
        session.execute(
            update(Run)
            .where(Run.id.in_(run_ids), Run.status == RunStatus.RUNNING, *guard)
            .values(status=status, lease=None, finished_at=utcnow(), failure_reason=reason)
        )


def expire(
    url: str,
    *,
    started_before: dt.datetime,
    stale_before: dt.datetime,
    overdue_before: dt.datetime,
    reason: str,
) -> list[int]:
    """Fail running runs past their wall-clock deadline with ``reason``: those started
    before ``started_before`` whose worker died (no beat since ``stale_before``), and
    those started before ``overdue_before`` (a grace after the deadline) whose worker
    still beats but did not end them (it loses its lease, and stops)."""

    def attempt() -> list[int]:
        with transaction(url) as session:
            dead = (Run.started_at < started_before) & (Run.heartbeat_at < stale_before)
            guard = dead | (Run.started_at < overdue_before)
            expired = list(
                session.scalars(
                    select(Run.id)
                    .where(Run.status == RunStatus.RUNNING, guard)
                    .with_for_update(skip_locked=True)
                )
            )
            _end(session, expired, RunStatus.FAILED, reason, guard)
            return expired

    return with_retry(attempt)


def reconcile(url: str, *, stale_before: dt.datetime, max_attempts: int) -> Reconciled:
    """Runs that are running but have not beaten since ``stale_before``: their worker
    died (kill -9, OOM, lost node). Each is requeued (it resumes from its checkpoint),
    failed after ``max_attempts`` claims, or ended cancelled when a cancel was asked of
    it (honoured, not lost). Call ``expire`` first: a run past its deadline is not
    requeued.

    A run whose row another transaction holds is left for the next pass (``SKIP LOCKED``)
    rather than waited for: the holder may be a worker cut off in the middle of a write,
    whose lock the server drops only once it notices (``db.engine.POSTGRES_SERVER_SIDE``),
    and one such run must not stall the pass for every other."""

    def attempt() -> Reconciled:
        with transaction(url) as session:
            stale = session.execute(
                select(Run.id, Run.attempts, Run.cancel_requested)
                .where(Run.status == RunStatus.RUNNING, Run.heartbeat_at < stale_before)
                .with_for_update(skip_locked=True)
            ).all()
            cancelled = [run_id for run_id, _, asked in stale if asked]
            live = [(run_id, attempts) for run_id, attempts, asked in stale if not asked]
            revived = [run_id for run_id, attempts in live if attempts < max_attempts]
            exhausted = [run_id for run_id, attempts in live if attempts >= max_attempts]
            guard = Run.heartbeat_at < stale_before
            _end(
                session,
                cancelled,
                RunStatus.CANCELLED,
                "cancelled (its worker stopped before it could stop)",
                guard,
            )
            _end(
                session,
                exhausted,
                RunStatus.FAILED,
                f"the worker stopped responding {max_attempts} times while running it "
                "(killed, out of memory, or its node was lost)",
                guard,
            )
            requeue(session, revived, guard)
            return Reconciled(revived, exhausted, cancelled)

    return with_retry(attempt)
