"""A worker's warm shutdown, as a pool process sees it.

Set in a pool process when its worker begins a warm shutdown (SIGTERM from ``docker
stop``, Ctrl-C; ``worker.tasks.HandBack`` sends the signal): the run checkpoints, goes
back to the queue, and another worker resumes it at once instead of after the stale
window.
"""

from __future__ import annotations

import signal
import threading

SHUTDOWN_SIGNAL = signal.SIGUSR2
shutting_down = threading.Event()


def ignore() -> None:
    """Before the pool forks: pool processes ignore the shutdown signal until they
    install their handler (its default action would kill them)."""
    signal.signal(SHUTDOWN_SIGNAL, signal.SIG_IGN)


def listen() -> None:
    """In a pool process: the shutdown signal sets ``shutting_down``."""
    signal.signal(SHUTDOWN_SIGNAL, lambda *_: shutting_down.set())
