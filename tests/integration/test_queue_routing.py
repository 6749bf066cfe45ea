"""`posbench submit` against a real broker and a real worker that serves the cpu queue
only: a spec that names no queue goes there and runs; one sent to gpu is flagged."""

from __future__ import annotations

import json
from collections.abc import Callable

from sqlalchemy import select

from core.status import RunStatus
from db.engine import transaction
from db.models import Study
from jobs.routing import live_queues
from tests.integration.conftest import Cluster


def test_submit_routes_to_the_served_queue_and_flags_an_unserved_one(
    cluster_factory: Callable[[str], Cluster], sqlite_url: str
) -> None:
    cluster = cluster_factory(sqlite_url)
    assert live_queues(cluster.settings) == {}  # a broker, no worker yet
    cluster.start_worker("cpu-only", queues="cpu")
    assert live_queues(cluster.settings) == {"cpu": 1}

    done = cluster.cli("submit", "--preset", "smoke", "--json")
    assert done.returncode == 0, done.stderr
    payload = json.loads(done.stdout)
    assert payload["queue"] == "cpu"
    assert "note: queue 'cpu'" in done.stderr and "warning" not in done.stderr
    with transaction(sqlite_url) as session:
        stored = session.scalar(select(Study.spec).where(Study.id == payload["study"]))
    assert stored["queue"] == "cpu"
    cluster.wait_for(
        lambda runs: runs and all(r.status == RunStatus.DONE for r in runs),
        timeout=300,
        what="the smoke study done on the cpu worker",
    )

    flagged = cluster.cli("submit", "--preset", "smoke", "--queue", "gpu", "--force")
    assert flagged.returncode == 0, flagged.stderr
    assert (
        "warning: no live worker serves queue 'gpu': its runs wait there until one does; "
        "queues with live workers: cpu (1 worker)"
    ) in flagged.stderr
