"""One run's life: every change of its status, as a named transition.

::

    submit ──> queued ──claim──> running ──finish──> done | failed | cancelled
      │          ^  │               │ release (worker shutting down) ──> queued
      │          │  └─cancel──> cancelled   requeue (its worker died) ──> queued
      │          └─────retry─────── failed | cancelled
      └─ reuse (the result cache has it) ──> done         import ──> done (imported)

This module is the only code that writes a run's ``status`` (``core.status``). A
worker *claims* a queued run by writing a fresh lease token in the same UPDATE that
moves it to running; only one claimant can win, and the claim is a ``ClaimedRun``.
Every later write of that worker (heartbeat, progress, phase, results, the finish)
names the lease, so a worker that lost its run to the reconciler can no longer
touch it.

The transitions a user asks for (cancel, retry) act on rows their caller has locked
in its own transaction (``jobs.service``); the worker's and the reconciler's open
their own.
"""

from __future__ import annotations

import datetime as dt
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from sqlalchemy import select, update
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from core.results_schema import TrainPoint as Point
from core.settings import get_settings
from core.spec import RunSpec, StudySpec
from core.status import FINISHED, RETRYABLE, STOPPING, RunStatus
from db.engine import is_transient, transaction, with_retry
from db.models import Run, Study, TrainPoint, in_live_study, utcnow
from db.upsert import upsert

T = TypeVar("T")


class LeaseLost(RuntimeError):
    """Another worker owns this run now (or may: see ``LeaseClock``)."""


def _stale_after() -> float:
    return get_settings().stale_after_seconds


@dataclass
class LeaseClock:
    """When the database last confirmed a worker's lease (``time.monotonic``). The
    reconciler gives a run to another worker once it has not beaten for ``patience``
    seconds (POSBENCH_STALE_AFTER_SECONDS), so a worker cut off from the database that
    long must presume its lease lost: it stops writing, files included."""

    patience: float = field(default_factory=_stale_after)
    confirmed: float = field(default_factory=time.monotonic)

    def silent(self) -> float:
        """Seconds since the lease was last confirmed."""
        return time.monotonic() - self.confirmed

    def fresh(self) -> bool:
        """Whether the lease was confirmed recently enough (half the stale window) for
        files to be written under it: no other worker can hold the run yet."""
        return self.silent() < self.patience / 2


@dataclass(frozen=True)
class ClaimedRun:
    """A run a worker holds: where it is stored, its id, the lease that guards every
    write, the run (as claimed), its study's spec (as stored), and when the database
    last confirmed the lease."""

    url: str
    run_id: int
    lease: str
    run: Run | None = None
    spec: dict[str, Any] = field(default_factory=dict)
    clock: LeaseClock = field(default_factory=LeaseClock, compare=False)


def under_lease(claimed: ClaimedRun, work: Callable[[], T]) -> T:
    """Run ``work``, a write of the lease holder, again while the database is away (a
    restart, a network cut), backing off from 0.2 s to 2 s, for as long as the lease
    may still be its own; every answer confirms the lease. Once the database has been
    silent longer than the stale window, the reconciler may have given the run to
    another worker: LeaseLost (the worker stops and writes nothing more) rather than a
    failed run, which a network cut is not."""
    wait = 0.2
    while True:
        asked_at = time.monotonic()
        try:
            result = work()
        except OperationalError as err:
            if not is_transient(err):
                raise
            silent = claimed.clock.silent()
            if silent > claimed.clock.patience:
                raise LeaseLost(
                    f"run {claimed.run_id}: the database has not answered for {silent:.0f} s, "
                    f"longer than POSBENCH_STALE_AFTER_SECONDS ({claimed.clock.patience:g}); "
                    "another worker may hold the run now"
                ) from err
            time.sleep(wait)
            wait = min(2.0, 2 * wait)
            continue
        claimed.clock.confirmed = asked_at
        return result


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


# --- claim, heartbeat, progress, phase: a worker holds the run -------------------------


def claim(url: str, run_id: int, worker: str) -> ClaimedRun | None:
    """Atomically move a queued run to running; None when it is not queued (done,
    cancelled, or another worker has it: a duplicate message)."""
    lease = uuid.uuid4().hex

    def attempt() -> ClaimedRun | None:
        with transaction(url) as session:
            now = utcnow()
            claimed = session.execute(
                update(Run)
                .where(Run.id == run_id, Run.status == RunStatus.QUEUED)
                .values(
                    status=RunStatus.RUNNING,
                    lease=lease,
                    worker=worker,
                    heartbeat_at=now,
                    attempts=Run.attempts + 1,
                )
            ).rowcount
            if not claimed:
                return None
            run = session.get(Run, run_id)
            if run.started_at is None:
                run.started_at = now
            spec = session.scalar(select(Study.spec).where(Study.id == run.study_id))
            return ClaimedRun(url, run_id, lease, run, spec)

    return with_retry(attempt)


def hold(session: Session, claimed: ClaimedRun) -> None:
    """Inside a writing transaction: take the run's row (a write lock on PostgreSQL, so
    a requeue or a new claim cannot slip in before the commit) if the lease is still
    ours; LeaseLost otherwise."""
    changed = session.execute(
        update(Run)
        .where(Run.id == claimed.run_id, Run.lease == claimed.lease)
        .values(heartbeat_at=utcnow())
    ).rowcount
    if not changed:
        raise LeaseLost(f"run {claimed.run_id} is no longer ours")


def heartbeat(claimed: ClaimedRun) -> tuple[bool, bool]:
    """Prove the run alive: (still ours, cancel asked), so a cancel reaches the run in
    every phase (evaluation too), not only at training's progress reports."""

    def attempt() -> tuple[bool, bool]:
        with transaction(claimed.url) as session:
            try:
                hold(session, claimed)
            except LeaseLost:
                return False, False
            asked = session.scalar(select(Run.cancel_requested).where(Run.id == claimed.run_id))
            return True, bool(asked)

    return under_lease(claimed, attempt)


def progress(claimed: ClaimedRun, point: Point) -> bool:
    """Store one training point and the run's progress; return whether a cancel was asked."""

    def attempt() -> bool:
        with transaction(claimed.url) as session:
            changed = session.execute(
                update(Run)
                .where(Run.id == claimed.run_id, Run.lease == claimed.lease)
                .values(
                    step=point.step,
                    latest_loss=point.loss,
                    tokens_per_second=point.tokens_per_second,
                    heartbeat_at=utcnow(),
                )
            ).rowcount
            if not changed:
                raise LeaseLost(f"run {claimed.run_id} is no longer ours")
            upsert(
                session,
                TrainPoint.__table__,
                {"run_id": claimed.run_id, **asdict(point)},
                keys=("run_id", "step"),
                returning=None,
            )
            asked = session.scalar(select(Run.cancel_requested).where(Run.id == claimed.run_id))
            return bool(asked)

    return under_lease(claimed, attempt)


def set_phase(claimed: ClaimedRun, phase: str | None) -> None:
    """What the running run is doing that its step does not show (fine-tuning a variant,
    after training); None clears it. Its finish as done clears it too."""

    def attempt() -> None:
        with transaction(claimed.url) as session:
            hold(session, claimed)
            session.execute(update(Run).where(Run.id == claimed.run_id).values(phase=phase))

    under_lease(claimed, attempt)


# --- finish, release: a worker lets the run go -----------------------------------------


def finish(
    claimed: ClaimedRun,
    status: RunStatus,
    *,
    reason: str | None = None,
    provenance: dict | None = None,
    checkpoint_uri: str | None = None,
) -> bool:
    """End the run as ``status`` (done, failed or cancelled), by the lease holder;
    False when the lease is no longer ours. A finish with its ``provenance`` (done)
    replaces the audit record and clears the run's control state with it."""
    if status not in FINISHED:
        raise ValueError(f"a run finishes as one of {', '.join(FINISHED)}, not {str(status)!r}")
    values: dict[str, object] = {"status": status, "finished_at": utcnow(), "lease": None}
    if reason is not None:
        values["failure_reason"] = reason
    if provenance is not None:
        values.update(provenance=provenance, skip_cache=False, waiting_for=None, phase=None)
    if checkpoint_uri is not None:
        values["checkpoint_uri"] = checkpoint_uri

    def attempt() -> bool:
        with transaction(claimed.url) as session:
            changed = session.execute(
                update(Run)
                .where(Run.id == claimed.run_id, Run.lease == claimed.lease)
                .values(**values)
            ).rowcount
            return bool(changed)

    return under_lease(claimed, attempt)


def release(claimed: ClaimedRun, waiting_for: int | None = None) -> RunStatus | None:
    """Hand a running run back: its worker is shutting down (``docker stop``, Ctrl-C)
    and saved a checkpoint, or it waits for another run that trains its model. Returns
    QUEUED: back in the queue, unsent (``enqueued_at`` unset) for the caller to send
    (``jobs.service.enqueue``; if that send is lost, the reconciler sends it), the claim
    given back not counted against the worker-death budget; CANCELLED: a cancel was
    asked that the run had not yet seen, so it ends cancelled instead; None: the lease
    is no longer ours. ``waiting_for`` (that run's id) is kept in the run's
    ``waiting_for`` column (the Queue page and ``posbench status`` say so)."""

    def attempt() -> RunStatus | None:
        with transaction(claimed.url) as session:
            mine = (
                Run.id == claimed.run_id,
                Run.lease == claimed.lease,
                Run.status == RunStatus.RUNNING,
            )
            if session.execute(
                update(Run)
                .where(*mine, Run.cancel_requested.is_(True))
                .values(
                    status=RunStatus.CANCELLED,
                    lease=None,
                    finished_at=utcnow(),
                    failure_reason="cancelled (while its worker was shutting down)",
                )
            ).rowcount:
                return RunStatus.CANCELLED
            values: dict[str, object] = {
                "status": RunStatus.QUEUED,
                "lease": None,
                "enqueued_at": None,
            }
            if waiting_for is not None:
                values["waiting_for"] = waiting_for
            released = update(Run).where(*mine).values(attempts=Run.attempts - 1, **values)
            if session.execute(released).rowcount:
                return RunStatus.QUEUED
            return None

    return under_lease(claimed, attempt)


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
                session.scalars(select(Run.id).where(Run.status == RunStatus.RUNNING, guard))
            )
            _end(session, expired, RunStatus.FAILED, reason, guard)
            return expired

    return with_retry(attempt)


def reconcile(url: str, *, stale_before: dt.datetime, max_attempts: int) -> Reconciled:
    """Runs that are running but have not beaten since ``stale_before``: their worker
    died (kill -9, OOM, lost node). Each is requeued (it resumes from its checkpoint),
    failed after ``max_attempts`` claims, or ended cancelled when a cancel was asked of
    it (honoured, not lost). Call ``expire`` first: a run past its deadline is not
    requeued."""

    def attempt() -> Reconciled:
        with transaction(url) as session:
            stale = session.execute(
                select(Run.id, Run.attempts, Run.cancel_requested).where(
                    Run.status == RunStatus.RUNNING, Run.heartbeat_at < stale_before
                )
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
