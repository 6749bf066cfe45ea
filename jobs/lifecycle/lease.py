"""A worker's hold on a run: the lease that guards its every write, from the claim to
the finish or the release.

A worker *claims* a queued run by writing a fresh lease token in the same UPDATE that
moves it to running; only one claimant can win, and the claim is a ``ClaimedRun``.
Every later write of that worker (heartbeat, progress, phase, results, the finish)
names the lease, so a worker that lost its run to the reconciler can no longer
touch it. Each opens its own transaction and, while the database is away, tries again
for as long as the lease may still be the worker's (``under_lease``, timed by its
``LeaseClock``); past the stale window the worker presumes it lost (``LeaseLost``) and
writes nothing more. ``hold`` takes the run's row inside a write of the caller's own
(the results ``worker.runtime`` stores).

Part of the run's lifecycle: callers name these through ``jobs.lifecycle``, the only
code that changes a run's status.
"""

from __future__ import annotations

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
from core.status import FINISHED, RunStatus
from db.engine import is_transient, transaction, with_retry
from db.models import Run, Study, TrainPoint, utcnow
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
