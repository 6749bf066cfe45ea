"""Job state changes on a real SQLite database, with the broker replaced by a recorder.

The same paths run against real Redis, real workers and PostgreSQL in tests/integration.
"""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import FOUR_RUNS
from sqlalchemy import func, select, update

from core.results_schema import Evaluation as Row
from core.results_schema import PositionBin as Bin
from core.results_schema import TrainPoint as Point
from core.settings import Settings
from core.spec import parse_spec
from core.status import RunStatus
from db.engine import transaction
from db.migrate import current, head, upgrade
from db.models import Evaluation, PositionBin, Run, Study, TrainPoint
from jobs import lifecycle
from jobs.reconciler import reconcile
from jobs.retention import Busy, delete_study, purge
from jobs.service import NotFound, cancel, retry, submit
from worker import liveness
from worker.runtime import cache, store
from worker.runtime.heartbeat import Heartbeat

SPEC = FOUR_RUNS


class Recorder:
    def __init__(self, fail: bool = False) -> None:
        self.sent: list[int] = []
        self.fail = fail

    def __call__(self, run_id: int) -> None:
        if self.fail:
            raise ConnectionError("broker down")
        self.sent.append(run_id)


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    config = Settings(
        home=tmp_path,
        database_url=f"sqlite:///{tmp_path}/test.db",
        stale_after_seconds=60,
        max_attempts=2,
    )
    upgrade(config.database)
    return config


def count(settings: Settings, model: type) -> int:
    with transaction(settings.database) as session:
        return session.scalar(select(func.count()).select_from(model))


def test_migrations_create_the_schema(settings: Settings) -> None:
    assert current(settings.database) == head()
    upgrade(settings.database)  # idempotent


def test_submit_writes_study_and_runs_then_enqueues_them(settings: Settings) -> None:
    send = Recorder()
    submitted = submit(parse_spec(SPEC), settings=settings, send=send, actor="tester")
    assert send.sent == submitted.queued and len(submitted.queued) == 4
    with transaction(settings.database) as session:
        runs = session.scalars(select(Run).order_by(Run.id)).all()
        assert [(r.label, r.seed, r.status) for r in runs] == [
            ("rope", 0, "queued"),
            ("rope", 1, "queued"),
            ("alibi", 0, "queued"),
            ("alibi", 1, "queued"),
        ]
        assert all(r.enqueued_at is not None for r in runs)
        study = session.get(Study, submitted.study_id)
        assert study.spec["encodings"][0]["name"] == "rope" and study.metric == "perplexity"


def test_broker_down_keeps_the_runs_for_the_reconciler(settings: Settings) -> None:
    submitted = submit(
        parse_spec(SPEC), settings=settings, send=Recorder(fail=True), actor="tester"
    )
    assert submitted.unsent == submitted.queued
    send = Recorder()
    assert reconcile(settings=settings, send=send)["resent"] == submitted.queued
    assert send.sent == submitted.queued
    assert reconcile(settings=settings, send=Recorder())["resent"] == []  # sent once


def _finish_run(settings: Settings, run_id: int) -> None:
    claimed = lifecycle.claim(settings.database, run_id, "test")
    assert claimed is not None
    lifecycle.progress(claimed, Point(4, 2.5, 1e-3, 100.0, 1.0))
    store.record_evaluation(
        claimed,
        Row(
            "none",
            "nonoverlapping",
            16,
            loss=2.0,
            perplexity=7.4,
            tokens=64,
            position_bins=[Bin(0, 1, 2.5, 4), Bin(1, 16, 2.0, 60)],
        ),
    )
    assert lifecycle.finish(claimed, RunStatus.DONE, provenance={"seed": 0})


def test_a_finished_config_hash_is_reused_unless_forced(settings: Settings) -> None:
    first = submit(parse_spec(SPEC), settings=settings, send=Recorder(), actor="tester")
    _finish_run(settings, first.queued[0])
    again = submit(
        parse_spec({**SPEC, "name": "again"}), settings=settings, send=Recorder(), actor="tester"
    )
    assert len(again.reused) == 1 and len(again.queued) == 3
    with transaction(settings.database) as session:
        reused = session.get(Run, again.reused[0])
        assert reused.status == "done" and reused.reused_from_run_id == first.queued[0]
        rows = session.scalars(select(Evaluation).where(Evaluation.run_id == reused.id)).all()
        assert [(r.eval_length, r.perplexity) for r in rows] == [(16, 7.4)]
        bins = session.scalars(select(PositionBin).where(PositionBin.evaluation_id == rows[0].id))
        assert [(b.start, b.end) for b in bins] == [(0, 1), (1, 16)]
        # Every column of the copies but the keys equals the original's.
        (source,) = session.scalars(
            select(Evaluation).where(Evaluation.run_id == first.queued[0])
        ).all()
        own = {"id", "run_id", "created_at"}
        columns = [c.key for c in Evaluation.__table__.columns if c.key not in own]
        assert [getattr(rows[0], c) for c in columns] == [getattr(source, c) for c in columns]
        curve = session.scalars(select(TrainPoint).where(TrainPoint.run_id == reused.id)).all()
        assert [(p.step, p.loss, p.lr, p.tokens_per_second, p.elapsed) for p in curve] == [
            (4, 2.5, 1e-3, 100.0, 1.0)
        ]
    forced = submit(
        parse_spec(SPEC), settings=settings, send=Recorder(), force=True, actor="tester"
    )
    assert forced.reused == [] and len(forced.queued) == 4
    with transaction(settings.database) as session:
        run = session.get(Run, forced.queued[0])
        # It trains afresh (takes no trained model), and can serve as one later; the
        # flag is the run's control state, not its audit record.
        assert run.skip_cache is True and run.provenance is None and run.train_hash is not None
        first_run = session.get(Run, first.queued[1])
        assert first_run.skip_cache is False


def test_claim_is_exclusive_and_guards_every_write(settings: Settings) -> None:
    run_id = submit(parse_spec(SPEC), settings=settings, send=Recorder(), actor="tester").queued[0]
    first = lifecycle.claim(settings.database, run_id, "a")
    assert first is not None and (first.run_id, first.run.status) == (run_id, "running")
    assert first.spec["encodings"][0]["name"] == "rope"  # its study's spec, as stored
    assert lifecycle.claim(settings.database, run_id, "b") is None  # a duplicate message
    stolen = replace(first, lease="not-the-lease")
    assert lifecycle.heartbeat(stolen) == (False, False)
    with pytest.raises(lifecycle.LeaseLost):
        lifecycle.progress(stolen, Point(1, 1, 1, 1, 1))
    assert lifecycle.heartbeat(first) == (True, False)
    cancel(run_id=run_id, settings=settings, actor="tester")
    # The heartbeat carries a cancel to the run in every phase.
    assert lifecycle.heartbeat(first) == (True, True)


def test_a_released_run_is_queued_unsent_and_its_claim_given_back(settings: Settings) -> None:
    run_id = submit(parse_spec(SPEC), settings=settings, send=Recorder(), actor="tester").queued[0]
    claimed = lifecycle.claim(settings.database, run_id, "a")
    assert lifecycle.release(replace(claimed, lease="not-the-lease")) is None
    assert lifecycle.release(claimed) == "queued"
    assert lifecycle.release(claimed) is None  # once only
    with transaction(settings.database) as session:
        run = session.get(Run, run_id)
        assert (run.status, run.lease, run.attempts, run.enqueued_at) == ("queued", None, 0, None)
    # The reconciler sends a released run whose worker could not (never sent).
    sent = Recorder()
    assert reconcile(settings=settings, send=sent)["resent"] == [run_id]
    claimed = lifecycle.claim(settings.database, run_id, "b")
    # A cancel the run had not yet seen when its worker shut down: it ends cancelled,
    # not back in the queue.
    cancel(run_id=run_id, settings=settings, actor="tester")
    assert lifecycle.release(claimed) == "cancelled"
    with transaction(settings.database) as session:
        assert session.get(Run, run_id).status == "cancelled"


def _heartbeat_at(settings: Settings, run_id: int) -> dt.datetime:
    with transaction(settings.database) as session:
        return session.get(Run, run_id).heartbeat_at


@pytest.mark.slow
def test_the_heartbeat_stops_when_the_run_makes_no_progress(settings: Settings) -> None:
    run_id = submit(parse_spec(SPEC), settings=settings, send=Recorder(), actor="tester").queued[0]
    claimed = lifecycle.claim(settings.database, run_id, "a")
    verdicts: list[float] = []
    with Heartbeat(claimed, 0.05, hang_seconds=1.0, on_hang=verdicts.append) as beat:
        for _ in range(30):  # a run that moves: 1.5 s of steps 0.05 s apart
            time.sleep(0.05)
            liveness.touch()
        assert not beat.hung and not verdicts
        deadline = time.monotonic() + 20  # then stuck
        while not verdicts and time.monotonic() < deadline:
            time.sleep(0.05)
        assert beat.hung and len(verdicts) == 1 and verdicts[0] > 1.0
        last = _heartbeat_at(settings, run_id)
        time.sleep(0.3)
        assert _heartbeat_at(settings, run_id) == last  # it stopped beating


def test_a_hung_worker_process_dumps_its_stacks_and_exits(settings: Settings) -> None:
    # The real verdict in a real process: its main thread blocks for good.
    run_id = submit(parse_spec(SPEC), settings=settings, send=Recorder(), actor="tester").queued[0]
    lease = lifecycle.claim(settings.database, run_id, "a").lease
    script = f"""
import io, sys, threading
from jobs.lifecycle import ClaimedRun
from worker.runtime.heartbeat import Heartbeat, exit_hung

sys.stderr = io.StringIO()  # as in a Celery pool process: a logger, not a file

def stuck_in_a_device_call():
    threading.Event().wait()

with Heartbeat(ClaimedRun({settings.database!r}, {run_id}, {lease!r}), 0.1, hang_seconds=1,
               on_hang=exit_hung):
    stuck_in_a_device_call()
"""
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 75, done.stderr
    assert time.monotonic() - started < 30
    assert "no progress for 1 s: the run is hung" in done.stderr
    assert "stuck_in_a_device_call" in done.stderr  # every thread's stack, for the post-mortem


def test_a_delete_keeps_everything_and_a_purge_removes_everything_stored(
    settings: Settings,
) -> None:
    first = submit(parse_spec(SPEC), settings=settings, send=Recorder(), actor="tester")
    _finish_run(settings, first.queued[0])
    again = submit(
        parse_spec({**SPEC, "name": "again"}), settings=settings, send=Recorder(), actor="tester"
    )
    # Queued runs are refused: cancel first. Nothing is deleted.
    with pytest.raises(Busy, match="has 3 runs queued or running: cancel first"):
        delete_study(first.study_id, settings=settings, actor="tester")
    cancel(study_id=first.study_id, settings=settings, actor="tester")
    folder = settings.artifacts_dir / "runs"
    folder.mkdir(parents=True)
    run = first.queued[0]
    # Its checkpoint, a fine-tuned variant's, one set aside, a killed adoption's and a
    # killed write's temporaries; and files of other runs (999, and 1 run id prefix).
    mine = [f"{run}.pt", f"{run}.pt.ft-0123456789ab", f"{run}.pt.1a2b3c4d.stale"]
    mine += [f"{run}.pt.1a2b3c4d.tmp", f".{run}.pt.ft-0123456789ab.5e6f.tmp"]
    others = ["999.pt", f"{run}0.pt", f"{run}0.pt.ft-0123456789ab"]
    for name in mine + others:
        (folder / name).write_bytes(b"checkpoint")
    before = {model: count(settings, model) for model in (Evaluation, PositionBin, TrainPoint)}
    deleted = delete_study(first.study_id, settings=settings, actor="tester")
    assert (deleted.runs, deleted.evaluations) == (4, 1)
    # Soft: every row and every file stays, until the purge.
    assert {model: count(settings, model) for model in before} == before
    assert len(list(folder.iterdir())) == len(mine + others)
    with pytest.raises(NotFound, match=f"study {first.study_id} is deleted"):
        delete_study(first.study_id, settings=settings, actor="tester")
    purged = purge(settings, study_id=first.study_id, actor="tester")
    assert (purged.studies, purged.runs, purged.evaluations) == ([first.study_id], 4, 1)
    assert purged.checkpoints == len(mine)
    assert sorted(p.name for p in folder.iterdir()) == sorted(others)
    with transaction(settings.database) as session:
        assert session.get(Study, first.study_id) is None
        assert session.scalars(select(Run.study_id).distinct()).all() == [again.study_id]
        reused = session.get(Run, again.reused[0])
        assert reused.status == "done" and reused.reused_from_run_id is None
    # The reused run keeps its own copies; the purged run's rows are gone.
    after = {model: count(settings, model) for model in (Evaluation, PositionBin, TrainPoint)}
    assert after == {model: before[model] // 2 for model in before}
    with pytest.raises(NotFound, match=f"study {first.study_id} was purged"):
        delete_study(first.study_id, settings=settings, actor="tester")


def test_a_hang_that_holds_the_gil_is_caught_by_the_hard_deadline(settings: Settings) -> None:
    # No Python thread runs while the main thread is inside one C call that never
    # lets go of the GIL (here a regular expression that backtracks for ages), so the
    # heartbeat cannot judge; faulthandler's C watchdog does.
    run_id = submit(parse_spec(SPEC), settings=settings, send=Recorder(), actor="tester").queued[0]
    lease = lifecycle.claim(settings.database, run_id, "a").lease
    script = f"""
import io, re, sys
from jobs.lifecycle import ClaimedRun
from worker.runtime.heartbeat import Heartbeat, exit_hung

sys.stderr = io.StringIO()  # as in a Celery pool process: a logger, not a file

with Heartbeat(ClaimedRun({settings.database!r}, {run_id}, {lease!r}), 0.1, hang_seconds=1,
               on_hang=exit_hung, hard_deadline=True):
    re.match(r"(a+)+$", "a" * 64 + "b")
"""
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1, done.stderr  # faulthandler's exit
    assert time.monotonic() - started < 30
    assert "Timeout (0:00:01" in done.stderr and 'File "<string>"' in done.stderr


def test_a_trained_model_is_adopted_only_from_a_final_checkpoint_of_the_same_training(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from worker.training import CHECKPOINT_VERSION

    first = submit(parse_spec(SPEC), settings=settings, send=Recorder(), actor="tester")
    donor = first.queued[0]
    other_eval = {**SPEC, "name": "longer", "eval": {"lengths": [16, 32, 64]}}
    second = submit(parse_spec(other_eval), settings=settings, send=Recorder(), actor="tester")
    with transaction(settings.database) as session:
        hashes = {r.id: r.train_hash for r in session.scalars(select(Run))}
    run_id = second.queued[0]  # rope, seed 0: the donor's training, evaluated further
    assert hashes[run_id] == hashes[donor] and second.reused == []
    folder = settings.artifacts_dir / "runs"
    folder.mkdir(parents=True)
    source = folder / f"{donor}.pt"
    _finish_run(settings, donor)
    trained = {"seed": 0, "data": "lm:pystdlib:abc"}  # the donor's provenance
    with transaction(settings.database) as session:
        session.get(Run, donor).checkpoint_uri = source.as_uri()
        session.get(Run, donor).provenance = trained
    claimed = lifecycle.claim(settings.database, run_id, "w")
    target = folder / f"{run_id}.pt"

    def stamp(step: int, fingerprint: str) -> None:
        torch.save(
            {"version": CHECKPOINT_VERSION, "fingerprint": fingerprint, "step": step}, source
        )

    def adopt(data: str = "lm:pystdlib:abc"):
        return cache.take_model(claimed, hashes[run_id], 4, data, target)

    assert adopt() is None  # no file: trained on another machine
    stamp(2, hashes[donor])
    assert adopt() is None  # not final (4 steps)
    stamp(4, "another configuration")
    assert adopt() is None
    stamp(4, hashes[donor])
    real = cache.cached_models
    stale = [(10_000, source.as_uri(), "lm:pystdlib:abc", "done")]
    monkeypatch.setattr(cache, "cached_models", lambda *a: stale)
    assert adopt() is None  # a donor row deleted meanwhile
    monkeypatch.setattr(cache, "cached_models", real)
    assert not target.exists() and not list(folder.glob("*.tmp"))
    assert adopt(data="lm:pystdlib:edited") is None  # trained on other bytes
    marker = adopt()
    assert marker == {"trained_by_run": donor, "training": trained}
    assert target.stat().st_ino == source.stat().st_ino  # the same file, linked
    with transaction(settings.database) as session:
        run = session.get(Run, run_id)
        assert (run.step, run.provenance) == (4, marker)  # kept for a resumed attempt
        steps = session.scalars(select(TrainPoint.step).where(TrainPoint.run_id == run_id))
        assert list(steps) == [4]


def test_a_twin_still_evaluating_gives_its_final_checkpoint_by_its_data_stamp(
    settings: Settings,
) -> None:
    import torch

    from worker.training import CHECKPOINT_VERSION

    first = submit(parse_spec(SPEC), settings=settings, send=Recorder(), actor="tester")
    other_eval = {**SPEC, "name": "longer", "eval": {"lengths": [16, 32, 64]}}
    second = submit(parse_spec(other_eval), settings=settings, send=Recorder(), actor="tester")
    donor, run_id = first.queued[0], second.queued[0]
    url = settings.database
    with transaction(url) as session:
        train_hash = session.get(Run, donor).train_hash
    folder = settings.artifacts_dir / "runs"
    folder.mkdir(parents=True)
    donor_claim = lifecycle.claim(url, donor, "n1:1")  # trained, now evaluating
    lifecycle.progress(donor_claim, Point(4, 2.5, 1e-3, 100.0, 1.0))
    claimed = lifecycle.claim(url, run_id, "n1:2")
    target = folder / f"{run_id}.pt"

    def stamp(data: str | None) -> None:
        state = {"version": CHECKPOINT_VERSION, "fingerprint": train_hash, "step": 4}
        torch.save({**state, "data": data}, folder / f"{donor}.pt")

    stamp("lm:pystdlib:other")
    assert cache.take_model(claimed, train_hash, 4, "lm:pystdlib:abc", target) is None
    stamp(None)  # no stamp and no stored fingerprint: the data cannot be told
    assert cache.take_model(claimed, train_hash, 4, "lm:pystdlib:abc", target) is None
    stamp("lm:pystdlib:abc")
    marker = cache.take_model(claimed, train_hash, 4, "lm:pystdlib:abc", target)
    assert marker == {"trained_by_run": donor, "training": None}
    assert target.stat().st_ino == (folder / f"{donor}.pt").stat().st_ino
    with transaction(url) as session:
        assert session.get(Run, run_id).step == 4


def test_a_run_waits_only_for_a_twin_whose_model_it_can_adopt(settings: Settings) -> None:
    import torch

    from worker.training import CHECKPOINT_VERSION

    first = submit(parse_spec(SPEC), settings=settings, send=Recorder(), actor="tester")
    other_eval = {**SPEC, "name": "longer", "eval": {"lengths": [16, 32, 64]}}
    second = submit(parse_spec(other_eval), settings=settings, send=Recorder(), actor="tester")
    older, newer = first.queued[0], second.queued[0]  # the same training
    folder = settings.artifacts_dir / "runs"
    folder.mkdir(parents=True)
    url = settings.database
    with transaction(url) as session:
        train_hash = session.get(Run, older).train_hash

    def waits(run_id: int, node: str) -> int | None:
        with transaction(url) as session:
            run = session.get(Run, run_id)
            session.expunge(run)
        return cache.training_run(url, run, node, folder, steps=4)

    def checkpoint(run_id: int, step: int) -> None:
        state = {"version": CHECKPOINT_VERSION, "fingerprint": train_hash, "step": step}
        torch.save(state, folder / f"{run_id}.pt")

    assert waits(newer, "n1") is None  # the twin is only queued
    older_claim = lifecycle.claim(url, older, "n2:7")
    assert waits(newer, "n1") is None  # on another node, no checkpoint here: can't read it
    checkpoint(older, 2)
    assert waits(newer, "n1") == older  # its checkpoint is in this artifacts folder
    checkpoint(older, 4)
    assert waits(newer, "n1") is None  # its training is over: adopt it now, no wait
    (folder / f"{older}.pt").unlink()
    assert waits(newer, "n2") == older  # on this node, and the older run
    # Two twins that start together on one node: only the newer waits, whatever the
    # older has trained in an earlier attempt, so they never wait for each other.
    newer_claim = lifecycle.claim(url, newer, "n2:8")
    lifecycle.progress(newer_claim, Point(3, 2.5, 1e-3, 100.0, 1.0))
    assert waits(older, "n2") is None
    assert lifecycle.release(newer_claim, waiting_for=older) == "queued"
    # Said where people look: the Queue page's and `posbench status`'s note.
    from core.analysis import run_notes
    from db import queries

    notes = run_notes(queries.runs(url, run_ids=[older, newer]))  # by run id
    assert notes == ["", f"waiting for run {older}, which trains the same model"]
    with transaction(url) as session:  # control state, not the audit record
        waiting = session.get(Run, newer)
        assert waiting.waiting_for == older and waiting.provenance is None
    (folder / f"{newer}.pt").write_bytes(b"checkpoint")
    assert waits(newer, "n2") is None  # a checkpoint of its own: it resumes that
    (folder / f"{newer}.pt").unlink()
    with transaction(url) as session:
        session.get(Run, newer).skip_cache = True
    assert waits(newer, "n2") is None  # --force: trains afresh
    with transaction(url) as session:
        session.get(Run, newer).skip_cache = False
    assert cache.waiting_runs(url, train_hash, older) == [newer]  # woken when it ends
    lifecycle.finish(older_claim, RunStatus.DONE, checkpoint_uri=(folder / "x.pt").as_uri())
    assert waits(newer, "n2") is None  # a finished twin: adopted (or trained) now, no wait


def test_fine_tuning_records_are_kept_as_they_come(settings: Settings) -> None:
    # Stored when each fine-tuned model is ready, so an attempt that dies later keeps
    # them; merged under provenance.finetune; only by the lease holder.
    run_id = submit(parse_spec(SPEC), settings=settings, send=Recorder(), actor="tester").queued[0]
    url = settings.database
    claimed = lifecycle.claim(url, run_id, "w")
    store.note_provenance(claimed, "finetune", "yarn:4+ft9", {"steps": 9})
    merged = store.note_provenance(claimed, "finetune", "pi:4+ft9", {"steps": 9})
    assert merged == {"finetune": {"yarn:4+ft9": {"steps": 9}, "pi:4+ft9": {"steps": 9}}}
    with transaction(url) as session:
        assert session.get(Run, run_id).provenance == merged
    with pytest.raises(lifecycle.LeaseLost):
        store.note_provenance(replace(claimed, lease="stolen"), "finetune", "x", {})
    # While it fine-tunes, the run's note says where it is; cleared when it is done.
    from core.analysis import run_notes
    from db import queries

    lifecycle.set_phase(claimed, "fine-tuning pi:4+ft9: step 5 of 9, loss 2.100")
    assert run_notes(queries.runs(url, run_ids=[run_id])) == [
        "fine-tuning pi:4+ft9: step 5 of 9, loss 2.100"
    ]
    with pytest.raises(lifecycle.LeaseLost):
        lifecycle.set_phase(replace(claimed, lease="stolen"), None)
    lifecycle.set_phase(claimed, None)
    assert run_notes(queries.runs(url, run_ids=[run_id])) == [""]
    with transaction(url) as session:
        # The phase is the run's control state, never part of its audit record.
        assert session.get(Run, run_id).provenance == merged


def test_evaluations_are_idempotent_upserts(settings: Settings) -> None:
    run_id = submit(parse_spec(SPEC), settings=settings, send=Recorder(), actor="tester").queued[0]
    claimed = lifecycle.claim(settings.database, run_id, "a")
    row = Row(
        "none",
        "nonoverlapping",
        32,
        loss=3.0,
        perplexity=20.0,
        tokens=64,
        position_bins=[Bin(0, 32, 3.0, 64)],
    )
    for _ in range(3):
        store.record_evaluation(claimed, row)
        lifecycle.progress(claimed, Point(2, 3.0, 1e-3, 1.0, 1.0))
    assert count(settings, Evaluation) == 1 and count(settings, PositionBin) == 1
    assert count(settings, TrainPoint) == 1
    assert store.stored_evaluations(settings.database, run_id) == {("none", "nonoverlapping", 32)}


def test_cancel_is_immediate_for_queued_and_cooperative_for_running(settings: Settings) -> None:
    submitted = submit(parse_spec(SPEC), settings=settings, send=Recorder(), actor="tester")
    running = submitted.queued[0]
    claimed = lifecycle.claim(settings.database, running, "w")
    assert cancel(study_id=submitted.study_id, settings=settings, actor="tester") == {
        "cancelled": 3,
        "stopping": 1,
    }
    assert lifecycle.claim(settings.database, submitted.queued[1], "w") is None  # never trained
    asked = lifecycle.progress(claimed, Point(2, 1, 1, 1, 1))
    assert asked is True
    with pytest.raises(NotFound, match="no study with id 99"):
        cancel(study_id=99, settings=settings, actor="tester")


def test_retry_requeues_failed_and_cancelled_only(settings: Settings) -> None:
    submitted = submit(parse_spec(SPEC), settings=settings, send=Recorder(), actor="tester")
    _finish_run(settings, submitted.queued[0])
    cancel(run_id=submitted.queued[1], settings=settings, actor="tester")
    send = Recorder()
    assert retry(study_id=submitted.study_id, settings=settings, send=send, actor="tester") == [
        submitted.queued[1]
    ]
    assert send.sent == [submitted.queued[1]]
    with pytest.raises(NotFound, match="no run with id 1234"):
        retry(run_id=1234, settings=settings, actor="tester")


def test_reconciler_revives_stale_runs_and_fails_them_after_max_attempts(
    settings: Settings,
) -> None:
    run_id = submit(parse_spec(SPEC), settings=settings, send=Recorder(), actor="tester").queued[0]
    long_ago = dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=5)

    def go_silent() -> None:
        with transaction(settings.database) as session:
            session.execute(update(Run).where(Run.id == run_id).values(heartbeat_at=long_ago))

    assert lifecycle.claim(settings.database, run_id, "w1") is not None
    go_silent()
    send = Recorder()
    assert reconcile(settings=settings, send=send, queue_empty=lambda queue: True)["revived"] == [
        run_id
    ]
    assert run_id in send.sent
    assert lifecycle.claim(settings.database, run_id, "w2") is not None  # attempt 2
    go_silent()
    outcome = reconcile(settings=settings, send=Recorder(), queue_empty=lambda queue: True)
    assert outcome["failed"] == [run_id]
    with transaction(settings.database) as session:
        run = session.get(Run, run_id)
        assert run.status == "failed" and "stopped responding 2 times" in run.failure_reason


def test_reconciler_resends_lost_messages_only_when_the_queue_is_empty(settings: Settings) -> None:
    run_ids = submit(parse_spec(SPEC), settings=settings, send=Recorder(), actor="tester").queued
    long_ago = dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=5)
    with transaction(settings.database) as session:
        session.execute(update(Run).values(enqueued_at=long_ago))
    assert (
        reconcile(settings=settings, send=Recorder(), queue_empty=lambda queue: False)["resent"]
        == []
    )
    assert (
        reconcile(settings=settings, send=Recorder(), queue_empty=lambda queue: True)["resent"]
        == run_ids
    )


def test_a_lost_message_is_resent_when_its_own_queue_is_empty(settings: Settings) -> None:
    gpu = submit(parse_spec(SPEC), settings=settings, send=Recorder(), actor="tester").queued
    cpu = submit(
        parse_spec({**SPEC, "queue": "cpu"}), settings=settings, send=Recorder(), actor="tester"
    ).queued
    long_ago = dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=5)
    with transaction(settings.database) as session:
        session.execute(update(Run).values(enqueued_at=long_ago))
    asked = []

    def only_cpu_is_empty(queue: str) -> bool:
        asked.append(queue)
        return queue == "cpu"

    outcome = reconcile(settings=settings, send=Recorder(), queue_empty=only_cpu_is_empty)
    assert outcome["resent"] == cpu and not set(gpu) & set(outcome["resent"])
    assert sorted(asked) == ["cpu", "gpu"]  # each queue asked once


def test_a_retry_starts_the_worker_death_budget_afresh(settings: Settings) -> None:
    run_id = submit(parse_spec(SPEC), settings=settings, send=Recorder(), actor="tester").queued[0]
    claimed = lifecycle.claim(settings.database, run_id, "w1")
    lifecycle.finish(claimed, RunStatus.FAILED, reason="boom")
    assert retry(run_id=run_id, settings=settings, send=Recorder(), actor="tester") == [run_id]
    with transaction(settings.database) as session:
        assert session.get(Run, run_id).attempts == 0


def test_a_cancel_outlives_the_worker_that_was_asked(settings: Settings) -> None:
    # Cancel a running run, then its worker dies before reading the flag: the
    # reconciler ends it as cancelled instead of queueing it to train again.
    run_id = submit(parse_spec(SPEC), settings=settings, send=Recorder(), actor="tester").queued[0]
    assert lifecycle.claim(settings.database, run_id, "w1") is not None
    assert cancel(run_id=run_id, settings=settings, actor="tester") == {
        "cancelled": 0,
        "stopping": 1,
    }
    long_ago = dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=5)
    with transaction(settings.database) as session:
        session.execute(update(Run).where(Run.id == run_id).values(heartbeat_at=long_ago))
    # Right after the database was away, silent runs are not called dead.
    held = reconcile(settings=settings, send=Recorder(), revive_stale=False)
    assert held["cancelled"] == [] and held["revived"] == []
    outcome = reconcile(settings=settings, send=Recorder(), queue_empty=lambda queue: True)
    assert outcome["cancelled"] == [run_id] and outcome["revived"] == []
    with transaction(settings.database) as session:
        assert session.get(Run, run_id).status == "cancelled"


def test_a_worker_finds_a_run_stored_by_an_earlier_version() -> None:
    # Stored before RESULTS_VERSION changed (another hash) with the old label format
    # (rope(base=500000.0)): the worker still finds its run, by encoding, parameters
    # and seed.
    from types import SimpleNamespace

    from worker.runtime.execute import matching_run

    spec = parse_spec({**SPEC, "encodings": [{"name": "rope", "base": 500000.0}, "alibi"]})
    old = SimpleNamespace(
        id=7,
        config_hash="0" * 24,
        label="rope(base=500000.0)",
        encoding="rope",
        params={"base": 500000.0, "rotary_fraction": 1.0},
        seed=1,
    )
    found = matching_run(spec, old)
    assert (found.encoding.name, found.seed) == ("rope", 1)
    with pytest.raises(ValueError, match="not in its study's spec"):
        matching_run(spec, SimpleNamespace(**{**vars(old), "seed": 9}))


def test_a_pool_process_starts_without_importing_torch() -> None:
    # Celery kills a pool process that has not reported itself up within seconds; on a
    # loaded machine importing torch there took longer, and every new pool process was
    # killed and replaced, forever (runs stayed queued). Torch comes with the task.
    script = (
        "import sys, worker.tasks as tasks; tasks._init_pool_process(); "
        "print('torch' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "False"
