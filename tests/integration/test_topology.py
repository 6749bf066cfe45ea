"""The compose topology as local processes: a real Redis, a real PostgreSQL, the
migration, two workers and the dashboard, each started with the command the compose
file gives it. The smoke preset runs spread across both workers."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import yaml

from db import queries
from jobs.service import submit
from jobs.spec import preset_spec

from .conftest import ROOT, _postgres_database, make_cluster

SERVICES = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]


def command(service: str) -> list[str]:
    parts = [p.replace("${POSBENCH_GPUS_PER_NODE:-1}", "1") for p in SERVICES[service]["command"]]
    return [sys.executable, "-m", "jobs.cli", *parts]


def test_compose_topology_as_local_processes(
    tmp_path: Path, redis_url: str, postgres_server: str
) -> None:
    import socket

    database = _postgres_database(postgres_server)
    cluster = make_cluster(tmp_path, database, redis_url)
    env = cluster.env
    # migrate: one shot, must succeed before the others start
    migrate = subprocess.run(
        command("migrate"), cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert migrate.returncode == 0, migrate.stderr
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dashboard_command = command("dashboard")
    dashboard_command[dashboard_command.index("--port") + 1] = str(port)
    dashboard = subprocess.Popen(
        [*dashboard_command, "--address", "127.0.0.1"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    workers = []
    try:
        for name in ("node-a", "node-b"):
            workers.append(cluster.start_worker(name))
        assert "--queues" in SERVICES["worker"]["command"]
        submitted = submit(preset_spec("smoke"), settings=cluster.settings, send=cluster.send)
        runs = cluster.wait_for(
            lambda runs: runs and all(r.status == "done" for r in runs),
            timeout=300,
            what="smoke preset done",
        )
        nodes = {run.worker.split("@")[0] for run in runs}
        assert nodes == {"node-a", "node-b"}, nodes  # spread across both workers
        curves = queries.curves(database, study_ids=[submitted.study_id])
        assert len(curves) == 3 * 3 and curves["perplexity"].gt(1).all()
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(
                    f"http://127.0.0.1:{port}/_stcore/health", timeout=3
                ) as response:
                    assert response.read() == b"ok"
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
    finally:
        dashboard.terminate()
        dashboard.wait(timeout=30)
        for worker in workers:
            cluster.kill(worker, signal.SIGTERM)
