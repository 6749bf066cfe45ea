"""When this process's run last made progress (a training step, an evaluation batch).

The heartbeat thread keeps beating while the run's own thread is stuck (a hung device,
a dead network mount), so a beat alone does not prove the run is moving; the heartbeat
reads this clock too (``worker.runtime.heartbeat.Heartbeat``).
"""

from __future__ import annotations

import time

_last = time.monotonic()


def touch() -> None:
    global _last
    _last = time.monotonic()


def idle_seconds() -> float:
    return time.monotonic() - _last
