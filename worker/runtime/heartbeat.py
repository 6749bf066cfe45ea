"""The heartbeat of a claimed run, and its watchdog's verdict on a hung one."""

from __future__ import annotations

import faulthandler
import os
import threading
from collections.abc import Callable

from jobs import lifecycle
from jobs.lifecycle import ClaimedRun
from worker import liveness


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
        claimed: ClaimedRun,
        every: float,
        *,
        hang_seconds: float = 0.0,
        on_hang: Callable[[float], None] | None = None,
        hard_deadline: bool = False,
    ) -> None:
        self.claimed, self.every = claimed, every
        self.hang_seconds, self.on_hang = hang_seconds, on_hang
        self.hard_deadline = hard_deadline and hang_seconds > 0
        self.lost = False
        self.hung = False
        self.cancel_asked = False
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._beat, daemon=True, name=f"heartbeat-{claimed.run_id}"
        )

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
                ours, asked = lifecycle.heartbeat(self.claimed)
            except lifecycle.LeaseLost:  # the database was away past the stale window
                ours, asked = False, False
            except Exception:  # any other database error; try again next beat
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


def exit_hung(idle: float) -> None:
    """The watchdog's verdict in a worker: the run's thread made no progress for
    ``idle`` seconds (a hung device or file system). Write every thread's stack for the
    post-mortem, then end this pool process: the heartbeat has stopped, so the
    reconciler requeues the run (a death, counted against POSBENCH_MAX_ATTEMPTS) and it
    resumes elsewhere. No logging module here: the stuck thread may hold its lock."""
    note = f"no progress for {idle:.0f} s: the run is hung; this pool process exits\n"
    os.write(2, note.encode())
    faulthandler.dump_traceback(file=2, all_threads=True)  # fd 2: Celery replaced sys.stderr
    os._exit(75)
