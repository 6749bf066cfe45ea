"""The reconciler: stranded runs back in the queue (``reconcile``: a dead worker's run
requeued, a lost message sent again), and its loop, as its own process, which also purges
deleted studies once their retention period is over (``jobs.retention``).

``posbench worker`` starts one next to every Celery worker, so no extra service is
needed, and it runs outside the worker's process: a thread in a process that
forks pool children could be holding a lock at the moment of the fork and
deadlock the child.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable

from sqlalchemy import select

from core.settings import Settings, get_settings
from core.status import RunStatus
from db.engine import transaction, with_retry
from db.models import Run, Study, utcnow
from jobs import lifecycle, quotas
from jobs.celery_app import producer
from jobs.retention import purge
from jobs.service import enqueue, study_queue

log = logging.getLogger("posbench.reconciler")


def queue_is_empty(queue: str = "gpu") -> bool | None:
    """Whether the broker's queue holds no message (None when it cannot tell)."""
    from amqp.exceptions import ChannelError

    try:
        with producer().connection_for_write() as connection:
            declared = connection.default_channel.queue_declare(queue=queue, passive=True)
            return declared.message_count == 0
    except ChannelError as err:
        # NOT_FOUND: the queue was never bound, so nothing was ever sent to it.
        return True if "NOT_FOUND" in str(err) else None
    except Exception:  # the broker is down: no conclusion
        return None


def database_steady(settings: Settings | None = None) -> bool:
    """Whether the database answers at the first try (False: it answered only after
    retries, so it was away a moment ago; raises if it does not answer at all)."""
    settings = settings or get_settings()
    retried: list[int] = []

    def probe() -> None:
        with transaction(settings.database) as session:
            session.execute(select(1))

    with_retry(probe, on_retry=lambda: retried.append(1))
    return not retried


def reconcile(
    *,
    settings: Settings | None = None,
    send: Callable[[int], None] | None = None,
    queue_empty: Callable[[str], bool | None] = queue_is_empty,
    revive_stale: bool = True,
) -> dict[str, list[int]]:
    """Put stranded runs back in the queue.

    - running, but no heartbeat for ``stale_after_seconds``: its worker died (kill -9,
      OOM, lost node); requeue it, it resumes from its checkpoint;
    - queued, but never sent, or sent long ago while the queue is empty: its message
      was lost; send it again (a duplicate is harmless, the claim is atomic).

    ``revive_stale=False`` skips the first: right after the database was unreachable,
    every heartbeat looks stale though the workers are alive (see jobs.reconciler).
    """
    settings = settings or get_settings()
    now = utcnow()
    stale_before = now - dt.timedelta(seconds=settings.stale_after_seconds)
    if revive_stale:
        # Past the deadline, a run whose worker died fails instead of being requeued.
        started_before = now - dt.timedelta(seconds=settings.run_deadline_seconds)
        expired = lifecycle.expire(
            settings.database,
            started_before=started_before,
            stale_before=stale_before,
            overdue_before=started_before - dt.timedelta(seconds=settings.stale_after_seconds),
            reason=quotas.deadline_reason(settings.run_deadline_hours),
        )
        stale = lifecycle.reconcile(
            settings.database, stale_before=stale_before, max_attempts=settings.max_attempts
        )
        stale = dataclasses.replace(stale, expired=expired)
    else:
        stale = lifecycle.Reconciled([], [], [])
    with transaction(settings.database) as session:
        never_sent = list(
            session.scalars(
                select(Run.id).where(Run.status == RunStatus.QUEUED, Run.enqueued_at.is_(None))
            )
        )
        waiting = session.execute(
            select(Run.id, Study.spec)
            .join(Study, Study.id == Run.study_id)
            .where(Run.status == RunStatus.QUEUED, Run.enqueued_at < stale_before)
        ).all()
    # A message is lost when its run still waits but its own queue is empty.
    empty: dict[str, bool | None] = {}
    lost = []
    for run_id, spec in waiting:
        queue = study_queue(spec)
        if queue not in empty:
            empty[queue] = queue_empty(queue)
        if empty[queue]:
            lost.append(run_id)
    resent = sorted(set(never_sent) | set(lost))
    enqueue(resent, settings=settings, send=send)
    return {**dataclasses.asdict(stale), "resent": resent}


def loop(stop: threading.Event) -> None:
    settings = get_settings()
    failed_at: float | None = None
    while not stop.wait(settings.reconcile_seconds):
        # After the database was away, heartbeats could not be written either: wait one
        # stale window of successful passes before calling a silent run dead.
        try:
            if not database_steady(settings):  # it answered, but only after retries
                failed_at = time.monotonic()
            trusting = (
                failed_at is None or time.monotonic() - failed_at > settings.stale_after_seconds
            )
            changed = reconcile(settings=settings, revive_stale=trusting)
        except Exception:  # the database or broker is briefly away: try again next pass
            log.exception("reconciler pass failed; trying again later")
            failed_at = time.monotonic()
            continue
        if any(changed.values()):
            log.warning("reconciler: %s", changed)
        _purge(settings)


def _purge(settings: Settings) -> None:
    """Purge the studies deleted longer ago than the retention period. A failure (a
    checkpoint that cannot be removed, the database away) is logged and tried again at
    the next pass; it says nothing about the workers' heartbeats."""
    try:
        purged = purge(settings)
    except Exception:
        log.exception("reconciler: purging deleted studies failed; trying again later")
        return
    if purged.studies:
        log.warning(
            "reconciler: purged studies %s, deleted longer ago than "
            "POSBENCH_DELETE_RETENTION_DAYS (%g): %d runs, %d checkpoint files",
            purged.studies,
            settings.delete_retention_days,
            purged.runs,
            purged.checkpoints,
        )


def main() -> None:
    logging.basicConfig(
        level=logging.INFO, format="[%(asctime)s: %(levelname)s/reconciler] %(message)s"
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    loop(stop)
    sys.exit(0)


if __name__ == "__main__":
    main()
