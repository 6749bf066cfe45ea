"""The writes a running run makes, each guarded by the run's lease.

A worker *claims* a queued run by writing a fresh lease token in the same UPDATE
that moves it to ``running``; only one claimant can win. Every later write
(heartbeat, progress, evaluation, final status) names that lease, so a worker
that lost its run to the reconciler can no longer touch it.
"""

from __future__ import annotations

import faulthandler
import threading
import uuid
from collections.abc import Callable
from dataclasses import asdict

from sqlalchemy import select, update

from db.engine import transaction, with_retry
from db.models import Evaluation, PositionBin, Run, RunSummary, Study, TrainPoint, utcnow
from db.queries import run_points
from db.upsert import upsert
from jobs.analysis import Summary
from jobs.results_schema import Evaluation as EvaluationRow
from jobs.results_schema import TrainPoint as Point
from worker import liveness


class LeaseLost(RuntimeError):
    """Another worker owns this run now."""


def claim(url: str, run_id: int, worker: str) -> tuple[str, dict, Run] | None:
    """Atomically move a queued run to running; return (lease, study spec, run) or None."""
    lease = uuid.uuid4().hex

    def attempt() -> tuple[str, dict, Run] | None:
        with transaction(url) as session:
            now = utcnow()
            claimed = session.execute(
                update(Run)
                .where(Run.id == run_id, Run.status == "queued")
                .values(
                    status="running",
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
            return lease, spec, run

    return with_retry(attempt)


def _guarded(url: str, run_id: int, owner: str, values: dict[str, object]) -> bool:
    def attempt() -> bool:
        with transaction(url) as session:
            changed = session.execute(
                update(Run).where(Run.id == run_id, Run.lease == owner).values(**values)
            ).rowcount
            return bool(changed)

    return with_retry(attempt)


def heartbeat(url: str, run_id: int, lease: str) -> tuple[bool, bool]:
    """Prove the run alive: (still ours, cancel asked), so a cancel reaches the run in
    every phase (evaluation too), not only at training's progress reports."""

    def attempt() -> tuple[bool, bool]:
        with transaction(url) as session:
            try:
                _hold(session, run_id, lease)
            except LeaseLost:
                return False, False
            asked = session.scalar(select(Run.cancel_requested).where(Run.id == run_id))
            return True, bool(asked)

    return with_retry(attempt)


def _hold(session, run_id: int, lease: str) -> None:
    """Inside a writing transaction: take the run's row (a write lock on PostgreSQL, so
    a requeue or a new claim cannot slip in before the commit) if the lease is still
    ours; LeaseLost otherwise."""
    changed = session.execute(
        update(Run).where(Run.id == run_id, Run.lease == lease).values(heartbeat_at=utcnow())
    ).rowcount
    if not changed:
        raise LeaseLost(f"run {run_id} is no longer ours")


def record_progress(url: str, run_id: int, lease: str, point: Point) -> bool:
    """Store one training point and the run's progress; return whether a cancel was asked."""

    def attempt() -> bool:
        with transaction(url) as session:
            changed = session.execute(
                update(Run)
                .where(Run.id == run_id, Run.lease == lease)
                .values(
                    step=point.step,
                    latest_loss=point.loss,
                    tokens_per_second=point.tokens_per_second,
                    heartbeat_at=utcnow(),
                )
            ).rowcount
            if not changed:
                raise LeaseLost(f"run {run_id} is no longer ours")
            upsert(
                session,
                TrainPoint.__table__,
                {"run_id": run_id, **asdict(point)},
                keys=("run_id", "step"),
                returning=None,
            )
            return bool(session.scalar(select(Run.cancel_requested).where(Run.id == run_id)))

    return with_retry(attempt)


def trained_models(
    url: str, train_hash: str, run_id: int
) -> list[tuple[int, str | None, str | None, str]]:
    """(run id, checkpoint URI, data fingerprint, status) of the other runs that train the
    model this run would train (same train hash: a study that only evaluates
    differently): finished ones first, newest first, then the others (one may have
    finished training and still be evaluating). The URI and the fingerprint are known
    once a run has finished; until then its checkpoint is its artifacts file."""
    with transaction(url) as session:
        rows = session.execute(
            select(Run.id, Run.checkpoint_uri, Run.provenance, Run.status)
            .where(Run.train_hash == train_hash, Run.id != run_id)
            .order_by((Run.status == "done").desc(), Run.finished_at.desc(), Run.id)
        )
        return [
            (donor, uri, provenance.get("data") if isinstance(provenance, dict) else None, status)
            for donor, uri, provenance, status in rows
        ]


def finished_provenance(url: str, run_id: int) -> dict | None:
    """The provenance of run ``run_id`` when it has finished (done), else None."""
    with transaction(url) as session:
        row = session.execute(
            select(Run.provenance).where(Run.id == run_id, Run.status == "done")
        ).first()
        return row.provenance if row is not None else None


def queued_twins(url: str, train_hash: str, run_id: int) -> list[int]:
    """The queued runs with this train hash (runs waiting for this one's training)."""
    with transaction(url) as session:
        return list(
            session.scalars(
                select(Run.id).where(
                    Run.train_hash == train_hash, Run.status == "queued", Run.id != run_id
                )
            )
        )


def training_twins(url: str, train_hash: str, run_id: int) -> list[tuple[int, str | None]]:
    """(run id, worker) of the other runs with this train hash that are running now: a
    study that only evaluates differently, submitted while the first one trains."""
    with transaction(url) as session:
        rows = session.execute(
            select(Run.id, Run.worker)
            .where(Run.train_hash == train_hash, Run.status == "running", Run.id != run_id)
            .order_by(Run.id)
        )
        return [(twin, worker) for twin, worker in rows]


def _stored_provenance(session, run_id: int) -> dict:
    """A copy of the run's provenance as stored ({} when it has none), to change and
    write back in the same transaction."""
    stored = session.scalar(select(Run.provenance).where(Run.id == run_id))
    return dict(stored) if isinstance(stored, dict) else {}


def _change_provenance(url: str, run_id: int, lease: str, change) -> dict:
    """Apply ``change`` (a function of the provenance dict) to the stored provenance, by
    the lease holder; returns the provenance after the change."""

    def attempt() -> dict:
        with transaction(url) as session:
            _hold(session, run_id, lease)
            provenance = _stored_provenance(session, run_id)
            change(provenance)
            session.execute(update(Run).where(Run.id == run_id).values(provenance=provenance))
            return provenance

    return with_retry(attempt)


def note_provenance(url: str, run_id: int, lease: str, key: str, name: str, value: dict) -> dict:
    """Store ``provenance[key][name] = value`` now (a fine-tuned variant's record), so an
    attempt that dies later keeps it; returns the run's provenance after the change."""
    return _change_provenance(
        url, run_id, lease, lambda p: p.update({key: {**p.get(key, {}), name: value}})
    )


def note_phase(url: str, run_id: int, lease: str, phase: str | None) -> None:
    """What the running run is doing that its step does not show (fine-tuning a variant,
    after training); None clears it. The finish replaces the provenance, and it."""
    _change_provenance(url, run_id, lease, lambda p: p.update(phase=phase))


def adopt_training(url: str, run_id: int, lease: str, donor_id: int) -> dict | None:
    """Give this run the training curve and progress of ``donor_id``, whose trained model
    it uses, and a provenance marker (``trained_by_run``, and the donor's own provenance
    under ``training``), stored at once so that a resumed attempt keeps it. Idempotent (a
    redelivered run upserts the same points). None when the donor run is gone."""

    def attempt() -> dict | None:
        with transaction(url) as session:
            _hold(session, run_id, lease)
            donor = session.get(Run, donor_id)
            if donor is None:
                return None
            finished = donor.status == "done"
            marker = {
                "trained_by_run": donor_id,
                "training": donor.provenance if finished else None,
            }
            points = session.scalars(select(TrainPoint).where(TrainPoint.run_id == donor_id))
            for point in points:
                upsert(
                    session,
                    TrainPoint.__table__,
                    {**point.column_values(), "run_id": run_id},
                    keys=("run_id", "step"),
                    returning=None,
                )
            # Merged: notes an earlier attempt stored (its fine-tunings) stay.
            kept = _stored_provenance(session, run_id)
            session.execute(
                update(Run)
                .where(Run.id == run_id)
                .values(
                    step=donor.step,
                    latest_loss=donor.latest_loss,
                    tokens_per_second=donor.tokens_per_second,
                    provenance={**kept, **marker},
                )
            )
            return marker

    return with_retry(attempt)


def record_evaluation(url: str, run_id: int, lease: str, row: EvaluationRow) -> None:
    """Upsert one point of the curve with its position bins (idempotent on redelivery)."""

    def attempt() -> None:
        with transaction(url) as session:
            _hold(session, run_id, lease)
            values = row.to_dict()
            bins = values.pop("position_bins")
            values["eval_length"] = values.pop("length")
            evaluation_id = upsert(
                session,
                Evaluation.__table__,
                {"run_id": run_id, **values},
                keys=("run_id", "variant", "protocol", "eval_length"),
            )
            for b in bins:
                upsert(
                    session,
                    PositionBin.__table__,
                    {"evaluation_id": evaluation_id, **b},
                    keys=("evaluation_id", "start"),
                    returning=None,
                )

    with_retry(attempt)


def stored_evaluations(url: str, run_id: int) -> set[tuple[str, str, int]]:
    with transaction(url) as session:
        rows = session.execute(
            select(Evaluation.variant, Evaluation.protocol, Evaluation.eval_length).where(
                Evaluation.run_id == run_id
            )
        )
        return {(v, p, n) for v, p, n in rows}


def stored_points(url: str, run_id: int, metric: str) -> list[tuple[str, str, int, float]]:
    """(variant, protocol, length, metric) of every stored point of a run (None where
    not applicable)."""
    with transaction(url) as session:
        return [tuple(row) for row in session.execute(run_points(run_id, metric))]


def record_summaries(url: str, run_id: int, lease: str, summaries: list[Summary]) -> None:
    """Upsert a run's summaries (idempotent: a retried finish rewrites the same rows)."""

    def attempt() -> None:
        with transaction(url) as session:
            _hold(session, run_id, lease)
            for summary in summaries:
                upsert(
                    session,
                    RunSummary.__table__,
                    {"run_id": run_id, **summary._asdict()},
                    keys=("run_id", "variant", "protocol", "name"),
                    returning=None,
                )

    with_retry(attempt)


def finish(
    url: str,
    run_id: int,
    lease: str,
    status: str,
    *,
    reason: str | None = None,
    provenance: dict | None = None,
    checkpoint_uri: str | None = None,
) -> bool:
    values: dict[str, object] = {"status": status, "finished_at": utcnow(), "lease": None}
    if reason is not None:
        values["failure_reason"] = reason
    if provenance is not None:
        values["provenance"] = provenance
    if checkpoint_uri is not None:
        values["checkpoint_uri"] = checkpoint_uri
    return _guarded(url, run_id, lease, values)


def release(url: str, run_id: int, lease: str, waiting_for: int | None = None) -> str | None:
    """Hand a running run back: its worker is shutting down (``docker stop``, Ctrl-C)
    and saved a checkpoint. Returns ``"queued"``: back in the queue, unsent
    (``enqueued_at`` unset) for the caller to send (``jobs.service.enqueue``; if that
    send is lost, the reconciler sends it), the claim given back not counted against
    the worker-death budget; ``"cancelled"``: a cancel was asked that the run had not
    yet seen, so it ends cancelled instead; None: the lease is no longer ours. With
    ``waiting_for`` (a twin's run id), the run notes in its provenance that it waits for
    that run (the Queue page and ``posbench status`` say so)."""

    def attempt() -> str | None:
        with transaction(url) as session:
            mine = (Run.id == run_id, Run.lease == lease, Run.status == "running")
            if session.execute(
                update(Run)
                .where(*mine, Run.cancel_requested.is_(True))
                .values(
                    status="cancelled",
                    lease=None,
                    finished_at=utcnow(),
                    failure_reason="cancelled (while its worker was shutting down)",
                )
            ).rowcount:
                return "cancelled"
            values = {"status": "queued", "lease": None, "enqueued_at": None}
            if waiting_for is not None:
                kept = _stored_provenance(session, run_id)
                values["provenance"] = {**kept, "waiting_for": waiting_for}
            released = update(Run).where(*mine).values(attempts=Run.attempts - 1, **values)
            if session.execute(released).rowcount:
                return "queued"
            return None

    return with_retry(attempt)


class Heartbeat:
    """A thread that proves the run alive every few seconds, training or evaluating; it
    dies with the process, which is how the reconciler notices a killed worker.

    It is also the run's watchdog: when the run's own thread has made no progress
    (``worker.liveness``) for ``hang_seconds`` (0: never), the heartbeat stops and calls
    ``on_hang(idle seconds)``, which in a worker ends the process so that the reconciler
    requeues the run like a killed one. With ``hard_deadline``, a hang that holds the
    GIL (so that no Python thread runs, this one included) is caught too:
    ``faulthandler``'s C watchdog, re-armed at every beat while the run moves, dumps the
    stacks and exits the process ``hang_seconds`` after the last re-arming."""

    def __init__(
        self,
        url: str,
        run_id: int,
        lease: str,
        every: float,
        *,
        hang_seconds: float = 0.0,
        on_hang: Callable[[float], None] | None = None,
        hard_deadline: bool = False,
    ) -> None:
        self.url, self.run_id, self.lease, self.every = url, run_id, lease, every
        self.hang_seconds, self.on_hang = hang_seconds, on_hang
        self.hard_deadline = hard_deadline and hang_seconds > 0
        self.lost = False
        self.hung = False
        self.cancel_asked = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True, name=f"heartbeat-{run_id}")

    def _arm(self) -> None:
        if self.hard_deadline:
            # fd 2 itself: a Celery pool process has replaced sys.stderr with a logger.
            faulthandler.dump_traceback_later(self.hang_seconds + 2 * self.every, exit=True, file=2)

    def _disarm(self) -> None:
        if self.hard_deadline:
            faulthandler.cancel_dump_traceback_later()

    def _beat(self) -> None:
        while not self._stop.wait(self.every):
            idle = liveness.idle_seconds()
            if self.hang_seconds and idle > self.hang_seconds:
                self.hung = True
                if self.on_hang is not None:
                    self.on_hang(idle)
                return
            self._arm()
            try:
                ours, asked = heartbeat(self.url, self.run_id, self.lease)
            except Exception:  # a transient database error; try again next beat
                continue
            self.cancel_asked = self.cancel_asked or asked
            if not ours:
                self.lost = True
                self._disarm()  # the run stops at its next step; no deadline now
                return

    def __enter__(self) -> Heartbeat:
        liveness.touch()  # the idle clock starts with the run (preparing its data included)
        self._arm()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._disarm()
