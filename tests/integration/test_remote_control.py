"""Audit F7: whoever holds the broker may ask a real worker what it serves, but cannot
shut it down, restart its pool or have it run anything but posbench's own task."""

from __future__ import annotations

import time
from collections.abc import Callable

from jobs.celery_app import make_celery
from tests.integration.conftest import Cluster


def test_the_broker_can_ask_a_worker_but_not_command_it(
    cluster_factory: Callable[[str], Cluster], sqlite_url: str
) -> None:
    cluster = cluster_factory(sqlite_url)
    worker = cluster.start_worker("w1", queues="cpu")
    app = make_celery(cluster.settings)
    inspect = app.control.inspect(timeout=2)
    assert [q["name"] for q in next(iter(inspect.active_queues().values()))] == ["cpu"]
    # Only posbench's task is registered: Celery's built-ins are refused like any name.
    assert list(inspect.registered().values()) == [["posbench.train_run"]]

    for command in ("shutdown", "pool_restart", "add_consumer", "dump_conf", "rate_limit"):
        replies = app.control.broadcast(command, reply=True, timeout=2)
        assert all("error" in next(iter(r.values())) for r in replies), (command, replies)
    app.send_task("celery.accumulate", args=[1, 2], queue="cpu")
    time.sleep(3)
    assert worker.poll() is None, cluster.logs()[-3000:]  # still up
    assert inspect.ping(), "the worker stopped answering"
    assert "unregistered task of type 'celery.accumulate'" in cluster.logs()
