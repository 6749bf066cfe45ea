"""submit -> broker -> worker -> database -> query, with real processes, on SQLite and
PostgreSQL; and the faults the reliability contract promises to survive."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from sqlalchemy import func, select

from core.spec import parse_spec
from db import queries
from db.engine import transaction
from db.models import Evaluation, Study, TrainPoint
from jobs.service import cancel, submit

from .conftest import Cluster

LENGTHS = [32, 64]


def spec(
    encodings: list[str],
    steps: int = 30,
    seeds: list[int] | None = None,
    variants: list[str] | None = None,
    **train: int,
):
    return parse_spec(
        {
            "name": "e2e",
            "model": "tiny",
            "train": {
                "length": 32,
                "steps": steps,
                "batch_size": 4,
                "progress_every": 5,
                "checkpoint_every": 10,
                **train,
            },
            "encodings": encodings,
            "seeds": seeds or [0],
            "eval": {"lengths": LENGTHS, "tokens": 512, "variants": variants or ["none"]},
        }
    )


def evaluation_keys(cluster: Cluster) -> list[tuple[int, str, str, int]]:
    with transaction(cluster.settings.database) as session:
        rows = session.execute(
            select(
                Evaluation.run_id, Evaluation.variant, Evaluation.protocol, Evaluation.eval_length
            )
        )
        return sorted(tuple(r) for r in rows)


def all_done(runs) -> bool:
    return bool(runs) and all(r.status == "done" for r in runs)


def test_submit_train_evaluate_query(cluster_factory, database_url: str) -> None:
    cluster = cluster_factory(database_url)
    cluster.start_worker()
    study_spec = spec(["rope", "alibi"], variants=["pi:2+ft10"], val_every=20, val_tokens=256)
    submitted = submit(study_spec, settings=cluster.settings, send=cluster.send, actor="tester")
    runs = cluster.wait_for(all_done, what="both runs done")
    assert [r.attempts for r in runs] == [1, 1]
    assert all(
        r.provenance["torch_version"] and r.provenance["data"].startswith("lm:pystdlib")
        for r in runs
    )
    rope, alibi = runs
    keys = evaluation_keys(cluster)
    # Every run's trained model; rope's fine-tuned at 2 x 32 tokens under PI as well
    # (its checkpoint, next to the run's, removed once its points are stored).
    planned = [(r.id, "none", "nonoverlapping", n) for r in runs for n in LENGTHS]
    planned += [(rope.id, "pi:2+ft10", "nonoverlapping", n) for n in LENGTHS]
    assert keys == sorted(planned)
    assert rope.provenance["finetune"]["pi:2+ft10"]["length"] == 64
    assert "finetune" not in alibi.provenance
    # The note while it fine-tuned (its phase), gone at the end; never in its provenance.
    assert rope.phase is None and "phase" not in rope.provenance
    folder = cluster.settings.artifacts_dir / "runs"
    assert (folder / f"{rope.id}.pt").exists() and not list(folder.glob(f"{rope.id}.pt.ft-*"))
    curves = queries.curves(database_url, study_ids=[submitted.study_id])
    assert len(curves) == 6 and curves["perplexity"].gt(1).all()
    bins = queries.position_bins(database_url, curves["evaluation_id"].tolist())
    assert set(bins["evaluation_id"]) == set(curves["evaluation_id"])
    points = queries.train_points(database_url, [r.id for r in runs])
    assert sorted(points["step"].unique()) == [5, 10, 15, 20, 25, 30]
    # The held-out loss every val_every steps and at the last one, stored with its point.
    validated = points.dropna(subset=["val_loss"])
    assert sorted(validated["step"]) == [20, 20, 30, 30]
    assert validated["val_loss"].between(0.5, 6).all()
    study = queries.studies(database_url, [submitted.study_id]).iloc[0]
    assert (study["done"], study["runs"]) == (2, 2)
    done = cluster.cli("results", "--study", str(submitted.study_id), "--format", "json")
    assert done.returncode == 0, done.stderr
    assert {row["label"] for row in json.loads(done.stdout)} == {"rope", "alibi"}


def test_a_cpu_study_goes_to_the_cpu_queue(cluster_factory, sqlite_url: str) -> None:
    # posbench submit routes each run to its study's queue; a worker that listens to
    # 'cpu' only trains it (the default, 'gpu', would never reach that worker).
    cluster = cluster_factory(sqlite_url)
    cluster.start_worker(queues="cpu")
    path = cluster.home / "cpu.json"
    path.write_text(
        json.dumps({**spec(["nope"], steps=10).model_dump(mode="json"), "queue": "cpu"})
    )
    done = cluster.cli("submit", str(path))
    assert done.returncode == 0, done.stderr
    (run,) = cluster.wait_for(all_done, what="the cpu run done")
    assert run.worker.startswith("w1@")


def test_kill_9_mid_training_resumes_from_the_checkpoint(cluster_factory, sqlite_url: str) -> None:
    cluster = cluster_factory(sqlite_url)
    worker = cluster.start_worker("first")
    submit(
        spec(["rope"], steps=400, checkpoint_every=20),
        settings=cluster.settings,
        send=cluster.send,
        actor="tester",
    )
    cluster.wait_for(lambda runs: runs[0].step >= 60, what="60 steps")
    cluster.kill(worker)  # kill -9 the whole worker: parent and pool process
    killed_at = cluster.runs()[0].step
    assert cluster.runs()[0].status == "running"  # stranded until the reconciler notices
    cluster.start_worker("second")
    runs = cluster.wait_for(all_done, timeout=300, what="resumed run done")
    run = runs[0]
    assert run.attempts == 2
    # It continued from its last checkpoint (a multiple of 20 at or below the kill),
    # not from scratch.
    resumed = run.provenance["resumed_from_step"]
    assert resumed % 20 == 0 and 40 <= resumed <= killed_at
    assert evaluation_keys(cluster) == [(run.id, "none", "nonoverlapping", n) for n in LENGTHS]
    with transaction(sqlite_url) as session:
        steps = session.scalars(select(TrainPoint.step).where(TrainPoint.run_id == run.id)).all()
    assert sorted(steps) == list(range(5, 401, 5))  # every point exactly once


def test_sigterm_hands_the_run_back_and_another_worker_resumes_it_at_once(
    cluster_factory, sqlite_url: str
) -> None:
    # What `docker stop` does: SIGTERM to the worker's main process only. The run saves
    # a checkpoint, goes back to the queue (without waiting for the stale window), and
    # the claim it gave back is not counted as a worker death.
    cluster = cluster_factory(sqlite_url)
    cluster.settings.stale_after_seconds = 3600  # a revival by the reconciler would be too late
    first = cluster.start_worker("first")
    submit(
        spec(["rope"], steps=2000, checkpoint_every=1000),
        settings=cluster.settings,
        send=cluster.send,
        actor="tester",
    )
    cluster.wait_for(lambda runs: runs[0].step >= 30, what="30 steps")
    os.kill(first.pid, signal.SIGTERM)
    first.wait(timeout=60)  # the warm shutdown waits for the run to be handed back
    (run,) = cluster.runs()
    assert (run.status, run.lease, run.attempts) == ("queued", None, 0), run.failure_reason
    assert run.enqueued_at is not None  # the worker sent it again itself
    released_at = run.step
    assert "released to the queue" in cluster.logs()
    cluster.start_worker("second")
    (run,) = cluster.wait_for(all_done, timeout=300, what="resumed run done")
    assert run.attempts == 1 and run.worker.startswith("second@")
    # The checkpoint written at the release: resumed where it stopped (the run's step
    # is the last progress report, every 5 steps), not from the last periodic
    # checkpoint (none before step 1000).
    assert released_at <= run.provenance["resumed_from_step"] < released_at + 5
    with transaction(sqlite_url) as session:
        steps = session.scalars(select(TrainPoint.step).where(TrainPoint.run_id == run.id)).all()
    assert sorted(steps) == list(range(5, 2001, 5))


def test_a_study_that_only_evaluates_differently_trains_nothing_again(
    cluster_factory, sqlite_url: str
) -> None:
    cluster = cluster_factory(sqlite_url)
    cluster.start_worker()
    first = submit(spec(["rope"]), settings=cluster.settings, send=cluster.send, actor="tester")
    cluster.wait_for(all_done, what="the first study done")
    longer = spec(["rope"]).model_dump(mode="json")
    longer["eval"]["lengths"] = [32, 64, 128]  # another config hash, the same training
    second = submit(
        parse_spec(longer), settings=cluster.settings, send=cluster.send, actor="tester"
    )
    assert second.reused == []  # not the same results: it must evaluate at 128
    runs = cluster.wait_for(lambda runs: len(runs) == 2 and all_done(runs), what="both done")
    trained, adopted = runs
    assert adopted.provenance["trained_by_run"] == trained.id == first.queued[0]
    assert adopted.provenance["resumed_from_step"] == 30  # no step trained again
    with transaction(sqlite_url) as session:
        points = {
            run_id: session.execute(
                select(TrainPoint.step, TrainPoint.loss).where(TrainPoint.run_id == run_id)
            ).all()
            for run_id in (trained.id, adopted.id)
        }
    assert sorted(points[adopted.id]) == sorted(points[trained.id]) and points[trained.id]
    keys = [k for k in evaluation_keys(cluster) if k[0] == adopted.id]
    assert [k[3] for k in keys] == [32, 64, 128]
    # The same model: one checkpoint file, linked. (Its numbers at 32 and 64 differ from
    # the first study's: a study's scored bytes depend on its longest length.)
    folder = cluster.settings.artifacts_dir / "runs"
    assert (folder / f"{adopted.id}.pt").stat().st_ino == (
        folder / f"{trained.id}.pt"
    ).stat().st_ino


def test_a_study_submitted_while_its_twin_trains_waits_and_trains_nothing(
    cluster_factory, sqlite_url: str
) -> None:
    # The second study differs only in its evaluation and is submitted while the first
    # still trains: its run waits for the first (given back to the queue, delivered again
    # later) and adopts the trained model, instead of training the same weights at once
    # on a second worker.
    cluster = cluster_factory(sqlite_url)
    cluster.start_worker("w1")
    cluster.start_worker("w2")  # idle while the first trains: free to train the second
    # Long enough that the twin is submitted while the first still trains, on a loaded
    # machine too (600 steps were sometimes done before the twin was submitted).
    first = spec(["rope"], steps=3000, checkpoint_every=20)
    submit(first, settings=cluster.settings, send=cluster.send, actor="tester")
    # A run on another worker waits only for a checkpoint it will be able to read: one in
    # this machine's artifacts folder already (worker.runtime.cache.training_run). The
    # step is reported before that step's checkpoint is written, so the twin goes in once
    # the file is there (submitted in between, it would train itself, and never wait).
    checkpoints = cluster.settings.artifacts_dir / "runs"
    cluster.wait_for(
        lambda runs: (
            runs
            and runs[0].step >= 20
            and runs[0].status == "running"
            and (checkpoints / f"{runs[0].id}.pt").exists()
        ),
        what="first trained 20 steps and wrote its first checkpoint",
    )
    longer = first.model_dump(mode="json")
    longer["eval"]["lengths"] = [32, 64, 128]
    twin = submit(parse_spec(longer), settings=cluster.settings, send=cluster.send, actor="tester")
    assert twin.queued and not twin.reused, "the first finished before its twin was submitted"
    runs = cluster.wait_for(
        lambda runs: len(runs) == 2 and all_done(runs), timeout=300, what="both done"
    )
    trained, waited = runs
    assert "trains the same model" in cluster.logs()
    assert waited.provenance["trained_by_run"] == trained.id
    assert waited.provenance["resumed_from_step"] == 3000  # no step trained again
    assert waited.attempts == 1  # waiting spends no attempt
    # The note while it waited, gone at the end; never in its provenance.
    assert waited.waiting_for is None and "waiting_for" not in waited.provenance
    assert [k[3] for k in evaluation_keys(cluster) if k[0] == waited.id] == [32, 64, 128]


def test_a_duplicated_message_never_duplicates_rows(cluster_factory, sqlite_url: str) -> None:
    cluster = cluster_factory(sqlite_url)
    submitted = submit(
        spec(["alibi"]), settings=cluster.settings, send=cluster.send, actor="tester"
    )
    run_id = submitted.queued[0]
    cluster.send(run_id)  # the same message, delivered twice more
    cluster.send(run_id)
    cluster.start_worker()
    cluster.wait_for(all_done, what="run done")
    # Let the worker consume the duplicates too.
    import redis

    client = redis.Redis(unix_socket_path=cluster.settings.broker.removeprefix("redis+socket://"))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and client.llen("gpu"):
        time.sleep(0.5)
    time.sleep(2)
    runs = cluster.runs()
    assert runs[0].attempts == 1
    assert evaluation_keys(cluster) == [(run_id, "none", "nonoverlapping", n) for n in LENGTHS]
    assert "not claimed" in cluster.logs()


def test_cancel_stops_a_running_run_within_one_progress_interval(
    cluster_factory, sqlite_url: str
) -> None:
    cluster = cluster_factory(sqlite_url)
    cluster.start_worker()
    submitted = submit(
        spec(["nope"], steps=5000), settings=cluster.settings, send=cluster.send, actor="tester"
    )
    cluster.wait_for(lambda runs: runs[0].step >= 10, what="training under way")
    asked_at = cluster.runs()[0].step
    started = time.monotonic()
    assert (
        cancel(study_id=submitted.study_id, settings=cluster.settings, actor="tester")["stopping"]
        == 1
    )
    runs = cluster.wait_for(
        lambda runs: runs[0].status == "cancelled", timeout=60, what="cancelled"
    )
    assert time.monotonic() - started < 30
    # The flag is read at each progress report (every 5 steps).
    assert runs[0].step <= asked_at + 2 * 5
    assert "cancelled at step" in runs[0].failure_reason


def test_four_workers_on_one_sqlite_file(cluster_factory, sqlite_url: str) -> None:
    cluster = cluster_factory(sqlite_url)
    for index in range(4):
        cluster.start_worker(f"w{index}")
    submitted = submit(
        spec(["nope", "rope", "alibi", "t5"], steps=20, seeds=[0, 1]),
        settings=cluster.settings,
        send=cluster.send,
        actor="tester",
    )
    runs = cluster.wait_for(all_done, timeout=300, what="8 runs done")
    assert len(runs) == 8 and len({r.worker.split(":")[0] for r in runs}) >= 1
    assert len(evaluation_keys(cluster)) == 8 * len(LENGTHS)
    with transaction(sqlite_url) as session:
        points = session.scalar(select(func.count()).select_from(TrainPoint))
    assert points == 8 * 4  # progress every 5 of 20 steps, no row lost
    assert "database is locked" not in cluster.logs()
    assert submitted.study_id == 1


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("encodings: [rope\n", "is not valid YAML"),
        ("encodings: [rotary]\n", "unknown encoding 'rotary'"),
        ("encodings: [rope]\neval: {lengths: [1000000]}\n", "must be less than or equal to 131072"),
        (
            "encodings: [nope, rope, alibi, t5, fire]\nseeds: [0,1,2,3,4,5,6,7,8,9,10,11,12,13]\n",
            "5 x 14 = 70 runs; at most 64",
        ),
    ],
)
def test_bad_input_exits_2_and_writes_nothing(
    cluster_factory, sqlite_url: str, tmp_path: Path, content: str, message: str
) -> None:
    cluster = cluster_factory(sqlite_url)
    path = tmp_path / "spec.yaml"
    path.write_text(content)
    done = cluster.cli("submit", str(path))
    assert done.returncode == 2 and message in done.stderr, done.stderr
    with transaction(sqlite_url) as session:
        assert session.scalar(select(func.count()).select_from(Study)) == 0
    import redis

    client = redis.Redis(unix_socket_path=cluster.settings.broker.removeprefix("redis+socket://"))
    assert client.llen("gpu") == 0 and client.dbsize() == 0


def test_a_message_written_before_the_move_is_taken_by_a_worker_of_this_layout(
    cluster_factory, sqlite_url: str
) -> None:
    """Messages already in a queue when workers are upgraded (issue 44 moved the modules
    into floors): a Celery protocol-2 message for ``posbench.train_run``, written by hand
    with kombu byte for byte as the producers before the move wrote it (task name in the
    headers, the run id as the only argument, JSON), is taken and the run finishes."""
    import uuid

    from kombu import Connection, Exchange, Queue

    cluster = cluster_factory(sqlite_url)
    published = []

    def as_before(run_id: int) -> None:
        task_id = str(uuid.uuid4())
        headers = {
            "lang": "py",
            "task": "posbench.train_run",
            "id": task_id,
            "shadow": None,
            "eta": None,
            "expires": None,
            "group": None,
            "group_index": None,
            "retries": 0,
            "timelimit": [None, None],
            "root_id": task_id,
            "parent_id": None,
            "argsrepr": f"({run_id},)",
            "kwargsrepr": "{}",
            "origin": "gen1@before",
            "ignore_result": False,
        }
        body = [[run_id], {}, {"callbacks": None, "errbacks": None, "chain": None, "chord": None}]
        queue = Queue("gpu", Exchange("gpu"), routing_key="gpu")
        with Connection(cluster.settings.broker) as connection:
            connection.Producer().publish(
                json.dumps(body),
                exchange=queue.exchange,
                routing_key="gpu",
                declare=[queue],
                headers=headers,
                content_type="application/json",
                content_encoding="utf-8",
                delivery_mode=2,
            )
        published.append(run_id)

    submitted = submit(spec(["rope"]), settings=cluster.settings, send=as_before, actor="tester")
    assert published == submitted.queued and not submitted.unsent
    cluster.start_worker()
    (run,) = cluster.wait_for(all_done, what="the run of the old message done")
    assert run.attempts == 1
    assert evaluation_keys(cluster) == [(run.id, "none", "nonoverlapping", n) for n in LENGTHS]
