"""The fault suite's site: a core host (PostgreSQL, Redis) and three worker hosts, each its
own network namespace (``tests.faults.hosts``), made once for the suite; every test gets
a fresh database, an empty broker, a shared artifacts folder and its own workers.

Every write to ``runs``, ``train_points``, ``evaluations`` and ``run_summaries`` is
recorded by a trigger with the address it came from (``inet_client_addr()``): each
worker host has its own, so a test can tell which host wrote what, and when.

Run by ``make test-faults`` (root; `.ci/run` calls it). Under CI=true a missing
component fails the suite instead of skipping it.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from . import hosts
from .hosts import Net, wait_until
from .servers import Postgres, Redis

ROOT = Path(__file__).resolve().parents[2]
IN_CI = os.environ.get("CI") == "true"
WORKER_HOSTS = ("w1", "w2", "w3")
SLOW_HOOK = Path(__file__).parent / "slow"  # sitecustomize: a deliberately slow step

AUDIT = """
CREATE TABLE fault_audit (
    id bigserial PRIMARY KEY,
    at timestamptz NOT NULL DEFAULT clock_timestamp(),
    tbl text NOT NULL,
    op text NOT NULL,
    run_id integer,
    client inet,
    lease text,
    status text,
    step integer
);
CREATE FUNCTION fault_audit_row() RETURNS trigger AS $$
DECLARE row jsonb := to_jsonb(NEW);
BEGIN
    INSERT INTO fault_audit (tbl, op, run_id, client, lease, status, step)
    VALUES (TG_TABLE_NAME, TG_OP, coalesce(row->>'run_id', row->>'id')::integer,
            inet_client_addr(), row->>'lease', row->>'status', (row->>'step')::integer);
    RETURN NEW;
END $$ LANGUAGE plpgsql;
CREATE TRIGGER audit_runs AFTER UPDATE ON runs
    FOR EACH ROW EXECUTE FUNCTION fault_audit_row();
CREATE TRIGGER audit_points AFTER INSERT OR UPDATE ON train_points
    FOR EACH ROW EXECUTE FUNCTION fault_audit_row();
CREATE TRIGGER audit_evaluations AFTER INSERT OR UPDATE ON evaluations
    FOR EACH ROW EXECUTE FUNCTION fault_audit_row();
CREATE TRIGGER audit_summaries AFTER INSERT OR UPDATE ON run_summaries
    FOR EACH ROW EXECUTE FUNCTION fault_audit_row();
"""


def spec(name: str, steps: int, seeds: list[int] | None = None) -> dict[str, Any]:
    """The suite's study: tiny RoPE runs (one per seed, 0 by default), a progress report
    every 10 steps and a checkpoint every 20, evaluated at 1x and 2x the training
    length."""
    return {
        "name": name,
        "model": "tiny",
        "train": {
            "length": 32,
            "steps": steps,
            "batch_size": 4,
            "progress_every": 10,
            "checkpoint_every": 20,
        },
        "encodings": ["rope"],
        "seeds": seeds or [0],
        "eval": {"lengths": [32, 64], "tokens": 512, "variants": ["none"]},
    }


@dataclass
class Site:
    net: Net
    postgres: Postgres
    redis: Redis
    folder: Path
    references: dict[tuple[int, int], dict[str, Any]] = field(default_factory=dict)

    def reference(self, steps: int, seed: int = 0) -> dict[str, Any]:
        """Run ``seed`` of the suite's study without any fault (``posbench run``, in this
        process' namespace, no service): its training curve and evaluations."""
        if (steps, seed) not in self.references:
            folder = self.folder / f"reference-{steps}-{seed}"
            folder.mkdir()
            path = folder / "spec.yaml"
            path.write_text(yaml.safe_dump(spec("reference", steps, seeds=[seed])))
            done = subprocess.run(
                [sys.executable, "-m", "cli", "run", str(path), "--json", "--device", "cpu"],
                cwd=ROOT,
                env=base_env(folder / "home"),
                capture_output=True,
                text=True,
                timeout=600,
                check=True,
            )
            self.references[steps, seed] = json.loads(done.stdout)["runs"][0]
        return self.references[steps, seed]


def base_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("POSBENCH_")}
    env.update(
        {
            "POSBENCH_HOME": str(home),
            "POSBENCH_DEVICE": "cpu",
            "POSBENCH_MIN_CHECKPOINT_SECONDS": "0",  # the spec's cadence
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "COLUMNS": "200",
        }
    )
    return env


@pytest.fixture(scope="package")
def site() -> Iterator[Site]:
    problem = hosts.available()
    if problem is not None:
        message = f"the fault suite cannot make hosts of its own: {problem}"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    net = Net(WORKER_HOSTS)
    net.create()
    folder = Path(tempfile.mkdtemp(prefix="pbf-"))
    folder.chmod(0o755)  # PostgreSQL's user reaches its folder through it
    try:
        postgres = Postgres(net, folder / "pg")
        postgres.init()
        postgres.start()
        redis = Redis(net, folder / "redis")
        redis.start()
        yield Site(net, postgres, redis, folder)
    finally:
        net.destroy()


@dataclass
class Stage:
    """One test's service on the site: its database, the broker flushed, its workers."""

    site: Site
    folder: Path
    database: str
    broker_db: int = 0  # the Redis database of its broker
    workers: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    # --- where things are ----------------------------------------------------------

    def url(self, seen_from: str = "driver") -> str:
        return self.site.postgres.url(seen_from, self.database)

    @property
    def artifacts(self) -> Path:
        return self.folder / "artifacts"

    def env(self, seen_from: str = "driver", **settings: str) -> dict[str, str]:
        env = base_env(self.folder / f"home-{seen_from}")
        env.update(
            {
                "POSBENCH_DATABASE_URL": self.url(seen_from),
                "POSBENCH_BROKER_URL": self.site.redis.url(seen_from, self.broker_db),
                "POSBENCH_ARTIFACTS": str(self.artifacts),
                **settings,
            }
        )
        return env

    # --- processes -----------------------------------------------------------------

    def start_worker(
        self, host: str, name: str | None = None, slow: bool = False, **settings: str
    ) -> None:
        """``posbench worker`` (with its reconciler) on ``host``, named ``name@faults``
        (``name``: the host's by default)."""
        name = name or host
        env = self.env(host, **settings)
        if slow:
            env["PYTHONPATH"] = str(SLOW_HOOK)
        self.workers[name] = self.site.net.spawn(
            host,
            [sys.executable, "-m", "cli", "worker", "--name", f"{name}@faults"],
            env=env,
            log=self.log(name),
            cwd=ROOT,
        )

    def wait_ready(self, *names: str) -> None:
        for name in names:
            wait_until(
                lambda name=name: b" ready." in self.log(name).read_bytes(),
                90,
                f"worker {name} to be ready",
            )

    def log(self, host: str) -> Path:
        return self.folder / f"{host}.log"

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}"
            for p in sorted(self.folder.glob("*.log"))
        )

    def cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """``posbench ARGS`` from the driver's namespace."""
        return subprocess.run(
            [sys.executable, "-m", "cli", *args],
            cwd=ROOT,
            env=self.env("driver"),
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def spec_file(self, name: str, steps: int, seeds: list[int] | None = None) -> Path:
        path = self.folder / f"{name}.yaml"
        path.write_text(yaml.safe_dump(spec(name, steps, seeds)))
        return path

    def submit(self, name: str, steps: int, seeds: list[int] | None = None) -> list[int]:
        """Submit the suite's study from the driver; the ids of its runs, by seed."""
        path = self.spec_file(name, steps, seeds)
        done = self.cli("submit", str(path), "--json", "--queue", "cpu")
        assert done.returncode == 0, done.stderr
        study = json.loads(done.stdout)["study"]
        return [
            run_id for (run_id,) in self.query("SELECT id FROM runs WHERE study_id = %s", study)
        ]

    # --- what the database holds ----------------------------------------------------

    def query(self, sql: str, *params: Any) -> list[tuple]:
        import psycopg

        with psycopg.connect(self.url(), connect_timeout=5) as connection:
            return connection.execute(sql, params).fetchall()

    def run(self, run_id: int) -> dict[str, Any]:
        columns = "status, worker, step, attempts, lease, failure_reason, provenance"
        (row,) = self.query(f"SELECT {columns} FROM runs WHERE id = %s", run_id)
        return dict(zip(columns.split(", "), row, strict=True))

    def wait_run(self, run_id: int, check, timeout: float, what: str) -> dict[str, Any]:
        try:
            return wait_until(
                lambda: (lambda run: run if check(run) else None)(self.run(run_id)), timeout, what
            )
        except TimeoutError as err:
            raise AssertionError(f"{err}; run: {self.run(run_id)}\n{self.logs()}") from None

    def host_of(self, worker: str | None) -> str | None:
        """The name part of a Celery node name (a host's, for the workers named after it)."""
        return worker.split("@")[0] if worker else None


def make_stage(site: Site, broker_db: int = 0) -> Stage:
    """A fresh database (migrated, with the audit trigger), the broker's Redis database
    emptied, an artifacts folder shared by the stage's worker hosts."""
    folder = Path(tempfile.mkdtemp(prefix="stage-", dir=site.folder))
    folder.chmod(0o755)
    database = f"faults_{uuid.uuid4().hex[:8]}"
    site.postgres.execute(f"CREATE DATABASE {database}")
    site.redis.flush(broker_db)
    made = Stage(site, folder, database, broker_db)
    done = made.cli("db", "upgrade")
    assert done.returncode == 0, done.stderr
    site.postgres.execute(AUDIT, database)
    (folder / "artifacts").mkdir()
    return made


def end_stage(made: Stage) -> None:
    """Kill the stage's workers (each its own process group: pool and reconciler too) and
    mend every link a test may have left cut."""
    for process in made.workers.values():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, 9)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=10)
    for host in WORKER_HOSTS:
        made.site.net.mend(host)


@pytest.fixture
def stage(site: Site) -> Iterator[Stage]:
    made = make_stage(site)
    yield made
    end_stage(made)
