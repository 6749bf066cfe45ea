"""The Celery application: configuration and routing, no task code.

Producers (the CLI, the dashboard) send tasks by name and never import the
worker's code (or torch). Workers import ``worker.tasks``, which registers them.
"""

from __future__ import annotations

from celery import Celery
from kombu import Exchange, Queue

from core.settings import Settings, get_settings
from core.spec import QUEUES

TRAIN_RUN = "posbench.train_run"


def make_celery(settings: Settings | None = None) -> Celery:
    settings = settings or get_settings()
    app = Celery("posbench", broker=settings.broker, include=["worker.tasks"])
    app.conf.update(
        # JSON only: a message can never carry code to execute.
        task_serializer="json",
        accept_content=["json"],
        result_serializer="json",
        task_ignore_result=True,  # the database, not a result backend, holds every result
        # Acknowledge after the task, and put the message back when the worker dies.
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        broker_transport_options={"visibility_timeout": settings.visibility_timeout},
        broker_connection_retry_on_startup=True,
        task_queues=[Queue(name, Exchange(name), routing_key=name) for name in QUEUES],
        task_default_queue="gpu",
        task_default_exchange="gpu",
        task_default_routing_key="gpu",
        task_routes={TRAIN_RUN: {"queue": "gpu", "routing_key": "gpu"}},
        # A fresh process per run: CUDA is never initialised in a forked parent,
        # and memory fragmentation does not accumulate across runs.
        worker_max_tasks_per_child=1,
    )
    return app


app = make_celery()
_producers: dict[str, Celery] = {}


def producer(settings: Settings | None = None) -> Celery:
    """A Celery app for sending to the broker the current settings name (one per URL)."""
    settings = settings or get_settings()
    if settings.broker == app.conf.broker_url:
        return app
    if settings.broker not in _producers:
        _producers[settings.broker] = make_celery(settings)
    return _producers[settings.broker]
