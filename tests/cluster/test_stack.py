"""The cluster as a user brings it up: the image built by the classic builder, the
CPU-only stack healthy, the smoke preset through it with the defaults, a study on a
queue without workers flagged, and a CPU worker stopped with `docker stop` mid-run."""

from __future__ import annotations

import csv
import io
import json
import re

import pytest

from tests.cluster.conftest import CPU_WORKERS, IMAGE, Stack, wait_for
from tests.cluster.engine import COMPOSE_V1

pytestmark = pytest.mark.cluster

LONG_RUN = """\
name: stop-a-worker
model: tiny
train: {length: 32, steps: 2000, batch_size: 8, lr: 0.003, checkpoint_every: 50,
        progress_every: 10}
encodings: [rope]
eval: {lengths: [32, 64], tokens: 2048, variants: [none]}
"""


def submitted(done) -> int:
    """The study id `posbench submit --json` printed (its first line of output)."""
    return json.loads(done.stdout.splitlines()[0])["study"]


def container_host(worker: str) -> str:
    """The container a run's worker ran in: its hostname (the container's short id), from
    ``celery@HOST:THREAD``."""
    return worker.split("@", 1)[1].rsplit(":", 1)[0]


def test_the_classic_builder_builds_slim_without_the_cuda_stages(stack: Stack) -> None:
    steps = re.findall(r"^Step \d+/\d+ : (.*)$", stack.build_log, re.MULTILINE)
    assert any(step.startswith("FROM base AS deps-cpu") for step in steps), steps
    assert not any("deps-cuda" in step or "AS worker" in step for step in steps), steps
    # And the image holds a CPU build of torch, with no CUDA libraries beside it.
    probe = (
        "import importlib.metadata as m, torch; "
        "print(torch.version.cuda, sorted(d.name for d in m.distributions() "
        "if d.name.startswith('nvidia')))"
    )
    shown = stack.engine.docker("run", "--rm", "--entrypoint", "python", IMAGE, "-c", probe)
    assert shown.stdout.split() == ["None", "[]"], shown.stdout


def test_the_cpu_only_stack_is_healthy(stack: Stack) -> None:
    containers = {c["Name"]: c for c in stack.containers()}
    by_service: dict[str, list[dict]] = {}
    for container in containers.values():
        by_service.setdefault(container["Service"], []).append(container)
    # The GPU worker is only under --profile gpu.
    assert set(by_service) == {"redis", "postgres", "migrate", "dashboard", "worker-cpu"}
    assert len(by_service["worker-cpu"]) == CPU_WORKERS
    for service in ("redis", "postgres", "dashboard", "worker-cpu"):
        for container in by_service[service]:
            assert container["Health"] == "healthy", container
    (migrate,) = by_service["migrate"]
    assert migrate["State"] == "exited" and migrate["ExitCode"] == 0, migrate
    # The stand-in database is UTF8, as `posbench db upgrade` needs.
    assert stack.sql("SHOW server_encoding") == [["UTF8"]]


def test_the_smoke_preset_runs_through_the_stack_with_the_defaults(stack: Stack) -> None:
    done = stack.posbench("submit", "--preset", "smoke", "--wait", "--json", timeout=600)
    study = submitted(done)
    # No --queue: the study went to the queue that has workers, and said so.
    assert "queue 'cpu'" in done.stderr
    assert "no live worker" not in done.stderr
    table = stack.posbench("results", "--study", str(study), "--format", "csv").stdout
    rows = list(csv.DictReader(io.StringIO(table)))
    points = {(row["label"], int(row["eval_length"])) for row in rows}
    assert points == {(e, n) for e in ("nope", "rope", "alibi") for n in (32, 64, 128)}, rows
    # The same results with SQL, in the PostgreSQL container: one row per point.
    statuses = stack.sql(f"SELECT status, count(*) FROM runs WHERE study_id = {study} GROUP BY 1")
    assert statuses == [["done", "3"]]
    (counts,) = stack.sql(
        "SELECT count(*), count(DISTINCT (e.run_id, e.variant, e.protocol, e.eval_length)) "
        f"FROM evaluations e JOIN runs r ON r.id = e.run_id WHERE r.study_id = {study}"
    )
    assert counts == ["9", "9"]


def test_a_study_sent_to_a_queue_without_workers_is_flagged(stack: Stack) -> None:
    done = stack.posbench("submit", "--preset", "smoke", "--queue", "gpu", "--force", "--json")
    assert (
        "no live worker serves queue 'gpu'" in done.stderr
        and f"cpu ({CPU_WORKERS} workers)" in done.stderr
    ), done.stderr
    stack.posbench("cancel", str(submitted(done)))


def test_a_cpu_worker_stopped_mid_run_hands_it_to_the_other(stack: Stack) -> None:
    done = stack.compose(
        "exec",
        "-T",
        "dashboard",
        "sh",
        "-c",
        "cat > /tmp/long.yaml && posbench submit /tmp/long.yaml --json",
        input=LONG_RUN,
    )
    study = submitted(done)

    def running() -> list[str] | None:
        rows = stack.sql(f"SELECT id, status, step, worker FROM runs WHERE study_id = {study}")
        (row,) = rows
        return row if row[1] == "running" and int(row[2]) >= 100 else None

    run_id, _, _, first_worker = wait_for(running, "the run trains past a checkpoint", 300, 0.5)
    host = container_host(first_worker)
    workers = [c for c in stack.containers() if c["Service"] == "worker-cpu"]
    (stopped,) = [c for c in workers if c["ID"].startswith(host)]
    stack.engine.docker("stop", stopped["ID"], timeout=200)

    def finished() -> list[str] | None:
        (row,) = stack.sql(
            f"SELECT status, worker, attempts, step, total_steps FROM runs WHERE id = {run_id}"
        )
        return row if row[0] in ("done", "failed", "cancelled") else None

    status, last_worker, attempts, final_step, total = wait_for(finished, "the run ends", 600)
    assert status == "done"
    assert container_host(last_worker) != host
    # Handed back on SIGTERM, not taken over as stale: a hand-back is not counted
    # against the run's attempts (a crash would be: 2).
    assert int(attempts) == 1 and final_step == total == "2000"
    # Exactly once: one evaluation per point, one training point per logged step.
    (evaluations,) = stack.sql(
        "SELECT count(*), count(DISTINCT (variant, protocol, eval_length)) FROM evaluations "
        f"WHERE run_id = {run_id}"
    )
    assert evaluations == ["2", "2"]
    (missing,) = stack.sql(
        "SELECT count(*) FROM generate_series(10, 2000, 10) AS s(step) WHERE s.step NOT IN "
        f"(SELECT step FROM train_points WHERE run_id = {run_id})"
    )
    assert missing == ["0"]  # no progress lost across the hand-over
    (exited,) = [c for c in stack.containers() if c["ID"] == stopped["ID"]]
    assert exited["State"] == "exited"


def test_debian_docker_compose_1_29_reads_the_file_and_creates_the_gpu_worker(
    stack: Stack,
) -> None:
    # Before: 1.29 refused the top-level `name:` and crashed on `count: ${...}`, a string.
    version = stack.compose("version", "--short", program=(COMPOSE_V1,)).stdout
    assert version.startswith("1.29"), version
    stack.compose("config", "--quiet", program=(COMPOSE_V1,))
    gpu = ("--profile", "gpu")
    stack.compose(
        *gpu, "up", "--no-start", "--no-deps", "--no-build", "worker", program=(COMPOSE_V1,)
    )
    (worker,) = [c for c in stack.containers() if c["Service"] == "worker"]
    assert worker["State"] == "created"
    stack.engine.docker("rm", worker["ID"])
