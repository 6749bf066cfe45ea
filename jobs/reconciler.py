"""The reconciler loop, as its own process: stranded runs back in the queue, and deleted
studies purged once their retention period is over (``jobs.retention``).

``posbench worker`` starts one next to every Celery worker, so no extra service is
needed, and it runs outside the worker's process: a thread in a process that
forks pool children could be holding a lock at the moment of the fork and
deadlock the child.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time

from core.settings import Settings, get_settings
from jobs.retention import purge
from jobs.service import database_steady, reconcile

log = logging.getLogger("posbench.reconciler")


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
