"""Celery tasks. ``train_run(run_id)`` is the only message the system sends.

Glue only: the task claims the run (``jobs.lifecycle``) and hands it to
``worker.runtime.execute``, plain Python that runs without a broker; the rest is the
worker's process plumbing (shutdown signal, pinned GPUs, connections after a fork).
"""

from __future__ import annotations

import os
import socket
import threading

from celery import bootsteps
from celery.signals import worker_init, worker_process_init

from core.settings import get_settings
from jobs.celery_app import TRAIN_RUN, app
from worker.runtime import shutdown


@app.task(name=TRAIN_RUN, bind=True, acks_late=True, reject_on_worker_lost=True)
def train_run(self, run_id: int) -> str:
    from jobs import lifecycle
    from worker.cpu import flush_denormals
    from worker.runtime.execute import execute

    flush_denormals()  # in this pool process, before torch starts its CPU threads
    node = self.request.hostname or socket.gethostname()
    worker = f"{node}:{threading.get_native_id()}"
    claimed = lifecycle.claim(get_settings().database, run_id, worker=worker)
    if claimed is None:
        return "not claimed: the run is not queued (done, cancelled, or another worker has it)"
    shutdown.listen()  # again here: whatever the pool type reset at fork
    return execute(claimed, node)


def gpu_for_pool_process(index: int, visible: str | None) -> str:
    """The device a pool process owns: the index-th of the GPUs the node exposes."""
    devices = [d for d in (visible or "").split(",") if d.strip()]
    return devices[index % len(devices)] if devices else str(index)


# Whoever holds the broker may ask a worker what it serves and runs (posbench submit
# asks which queues have live workers; Flower shows tasks), never tell it what to do:
# shutdown, pool restarts, consumers, rate limits, revokes and the configuration dumps
# (which hold the broker URL) are taken out of the worker's remote control (audit F7).
READ_ONLY_CONTROL = frozenset(
    {"ping", "active_queues", "active", "reserved", "scheduled", "registered", "clock"}
)


def _read_only_remote_control() -> None:
    from celery.worker.control import Panel

    for name in set(Panel.data) - READ_ONLY_CONTROL:
        del Panel.data[name]
        Panel.meta.pop(name, None)


_read_only_remote_control()


@worker_init.connect
def _init_worker(**_: object) -> None:
    shutdown.ignore()  # until a pool process installs its handler
    # Celery's built-in tasks (celery.map, celery.chord_unlock, ...) are not posbench's:
    # a message naming one is refused as unregistered, like any other name.
    app.finalize()
    for name in [name for name in app.tasks if not name.startswith("posbench.")]:
        app.tasks.unregister(name)


class HandBack(bootsteps.StartStopStep):
    """A worker step that stops before the pool does, on every warm shutdown (SIGTERM,
    the first Ctrl-C, a SIGHUP restart): it asks every pool
    process to hand its run back, and the pool's own stop then waits for them (remote
    control cannot shut a worker down: READ_ONLY_CONTROL). A cold
    shutdown terminates the pool instead (``terminate``, a no-op here): the reconciler
    requeues those runs."""

    requires = ("celery.worker.components:Pool",)

    def stop(self, worker: object) -> None:
        from billiard.process import active_children

        for child in active_children():
            try:
                os.kill(child.pid, shutdown.SHUTDOWN_SIGNAL)
            except (ProcessLookupError, TypeError):  # already gone, or never started
                continue


app.steps["worker"].add(HandBack)


@worker_process_init.connect
def _init_pool_process(**_: object) -> None:
    """A forked pool process must not share the parent's database connections, and with
    POSBENCH_PIN_GPUS it sees exactly one GPU: its own (before torch touches CUDA).
    Nothing heavy here (torch is not imported): Celery kills a pool process that does
    not report itself up within seconds."""
    from billiard.process import current_process

    from db.engine import dispose_after_fork

    shutdown.listen()
    dispose_after_fork()
    index = getattr(current_process(), "index", None)
    if get_settings().pin_gpus and index is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu_for_pool_process(
            index, os.environ.get("CUDA_VISIBLE_DEVICES")
        )
