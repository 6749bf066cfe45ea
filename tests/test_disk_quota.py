"""The disk (DESIGN.md, Security contract): a run's checkpoint and a study's checkpoints
are bounded at submit, the artifacts folder's budget on the worker, a finished run keeps
one checkpoint, and the prepared-corpus cache evicts the least recently used corpora."""

from __future__ import annotations

import datetime as dt
import logging
import os
import time
from pathlib import Path

import pytest
import torch
from conftest import service_settings, worker_environment
from pydantic import ValidationError
from sqlalchemy import func, select, update

from core.catalog.corpora import SourcePolicy
from core.files import folder_bytes, shown_bytes
from core.settings import Settings
from core.spec import TrainSpec, parse_spec
from core.status import RunStatus
from db.engine import transaction
from db.models import Evaluation, Run, Study, utcnow
from jobs import lifecycle
from jobs.service import Refused, retry, submit
from worker.data import build_task
from worker.data.lm import load_corpus
from worker.model import build_model
from worker.training import Checkpointer, DiskBudget, Trainer

MiB = 1 << 20
SPEC = {
    "model": "tiny",  # 114,688 parameters: a checkpoint of about 1.31 MiB
    "train": {"length": 16, "steps": 4, "batch_size": 2},
    "encodings": ["rope", "alibi"],
    "seeds": [0, 1],
    "eval": {"lengths": [16, 32]},
}


def send(run_id: int) -> None:
    """A broker that accepts every message."""


def stored(config: Settings, model: type) -> int:
    with transaction(config.database) as session:
        return session.scalar(select(func.count()).select_from(model))


# --- at submit ------------------------------------------------------------------------------


def test_the_checkpoint_estimate_is_twelve_bytes_per_parameter_and_close_to_the_real_one(
    tmp_path: Path,
) -> None:
    spec = parse_spec(SPEC)
    assert spec.model.parameters == 114_688
    assert spec.estimated_checkpoint_bytes() == 12 * 114_688 == 1_376_256
    # A real checkpoint of that model (weights, AdamW's moments, RNG states, curve).
    task = build_task("lm")
    task.prepare(tmp_path / "cache")
    trainer = Trainer(
        build_model("tiny", "rope", train_length=16),
        task,
        TrainSpec(length=16, steps=1, batch_size=2),
        seed=0,
        device=torch.device("cpu"),
        checkpointer=Checkpointer(tmp_path / "run.pt"),
    )
    trainer.fit()
    written = (tmp_path / "run.pt").stat().st_size
    assert spec.estimated_checkpoint_bytes() < written < 1.05 * spec.estimated_checkpoint_bytes()
    assert spec.estimated_checkpoint_bytes() <= trainer.state_bytes() < written


def test_a_study_whose_checkpoint_is_over_the_quota_is_refused_before_anything_is_written(
    tmp_path: Path,
) -> None:
    config = service_settings(tmp_path, max_checkpoint_bytes=MiB)
    with pytest.raises(Refused) as refused:
        submit(parse_spec(SPEC), actor="tester", settings=config, send=send)
    assert str(refused.value) == (
        "quota POSBENCH_MAX_CHECKPOINT_BYTES exceeded: a run's checkpoint needs about "
        "1.31 MiB (12 bytes x 114,688 parameters: weights and AdamW's two moments), over "
        "the limit of 1 MiB (1,048,576 bytes) by 320 KiB; train a smaller model"
    )
    assert stored(config, Study) == 0 and stored(config, Run) == 0
    # At the limit: accepted.
    fits = service_settings(tmp_path, max_checkpoint_bytes=1_376_256)
    assert len(submit(parse_spec(SPEC), actor="tester", settings=fits, send=send).queued) == 4


def test_a_study_whose_checkpoints_exceed_the_artifacts_budget_is_refused(tmp_path: Path) -> None:
    config = service_settings(tmp_path, max_artifacts_bytes=4 * MiB)
    with pytest.raises(Refused) as refused:
        submit(parse_spec(SPEC), actor="tester", settings=config, send=send)
    # 4 runs x 1,376,256 bytes = 5,505,024 bytes, 1,310,720 over.
    assert str(refused.value) == (
        "quota POSBENCH_MAX_ARTIFACTS_BYTES exceeded: the study's 4 runs keep a checkpoint "
        "of about 1.31 MiB each, 5.25 MiB in all, over the artifacts budget of 4 MiB "
        "(4,194,304 bytes) by 1.25 MiB; run fewer encodings or seeds, or a smaller model"
    )
    assert stored(config, Study) == 0
    # Three runs fit; no budget (0) bounds nothing.
    fewer = parse_spec({**SPEC, "seeds": [0], "encodings": ["rope", "alibi", "nope"]})
    assert len(submit(fewer, actor="tester", settings=config, send=send).queued) == 3
    unbounded = service_settings(tmp_path, max_artifacts_bytes=0, max_active_runs=100)
    assert len(submit(parse_spec(SPEC), actor="tester", settings=unbounded, send=send).queued) == 4


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"max_checkpoint_bytes": 0}, "greater than or equal to 1048576"),
        ({"max_checkpoint_bytes": 1 << 41}, "less than or equal to 1099511627776"),
        ({"max_artifacts_bytes": -1}, "greater than or equal to 0"),
        ({"max_cache_bytes": 1 << 51}, "less than or equal to 1125899906842624"),
    ],
)
def test_the_disk_settings_are_bounded(values: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        Settings(**values)


def test_the_defaults_and_the_corpus_rules_carry_the_cache_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    defaults = Settings()
    assert defaults.max_checkpoint_bytes == 4 << 30
    assert defaults.max_artifacts_bytes == 200 << 30
    assert defaults.sources.max_cache_bytes == defaults.max_cache_bytes == 16 << 30
    assert Settings(max_cache_bytes=0).sources.max_cache_bytes is None  # 0: unbounded
    monkeypatch.setenv("POSBENCH_MAX_CHECKPOINT_BYTES", "1048576")
    monkeypatch.setenv("POSBENCH_MAX_ARTIFACTS_BYTES", "0")
    from_environment = Settings()
    assert (from_environment.max_checkpoint_bytes, from_environment.max_artifacts_bytes) == (
        1 << 20,
        0,
    )


# --- the artifacts budget on the worker -------------------------------------------------------


def test_the_folder_is_measured_once_per_file_without_following_links(tmp_path: Path) -> None:
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "1.pt").write_bytes(b"x" * 1000)
    os.link(tmp_path / "runs" / "1.pt", tmp_path / "runs" / "2.pt")  # a model taken
    (tmp_path / "runs" / ".1.pt.ab.tmp").write_bytes(b"x" * 24)
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.write_bytes(b"x" * 5000)
    (tmp_path / "link").symlink_to(outside)
    assert folder_bytes(tmp_path) == 1024
    assert folder_bytes(tmp_path / "missing") == 0
    assert shown_bytes(1024) == "1 KiB" and shown_bytes(1000) == "1000 bytes"


def test_the_budget_says_by_how_much_a_checkpoint_would_exceed_it(tmp_path: Path) -> None:
    (tmp_path / "filler").write_bytes(b"x" * 3 * MiB)
    budget = DiskBudget(tmp_path, 4 * MiB)
    assert budget.problem(MiB) is None  # exactly full
    assert budget.problem(MiB + 512 * 1024) == (
        "the artifacts folder holds 3 MiB and a checkpoint of 1.5 MiB would take it past "
        "POSBENCH_MAX_ARTIFACTS_BYTES (4 MiB) by 512 KiB"
    )


class CountingCheckpointer:
    """A checkpointer that records the step of every save."""

    def __init__(self, path: Path) -> None:
        self.inner = Checkpointer(path, fingerprint="f", data="d")
        self.saved: list[int] = []

    def load(self, device):
        return self.inner.load(device)

    def save(self, state) -> None:
        self.saved.append(int(state["step"]))
        self.inner.save(state)


@pytest.mark.parametrize(("budget", "saved"), [(64 * MiB, [1, 2, 3, 4, 5, 6]), (2 * MiB, [6])])
def test_periodic_checkpoints_past_the_budget_are_skipped_and_the_last_is_written(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, budget: int, saved: list[int]
) -> None:
    task = build_task("lm")
    task.prepare(tmp_path / "cache")
    artifacts = tmp_path / "artifacts"
    artifacts.mkdir()
    (artifacts / "other-run.pt").write_bytes(b"x" * MiB)  # with a 1.3 MiB checkpoint: over 2
    checkpointer = CountingCheckpointer(artifacts / "run.pt")
    trainer = Trainer(
        build_model("tiny", "rope", train_length=16),
        task,
        TrainSpec(length=16, steps=6, batch_size=2, checkpoint_every=1),
        seed=0,
        device=torch.device("cpu"),
        checkpointer=checkpointer,
        disk_budget=DiskBudget(artifacts, budget),
    )
    with caplog.at_level(logging.WARNING, logger="worker.training.trainer"):
        result = trainer.fit()
    assert result.steps == 6  # training goes on
    assert checkpointer.saved == saved
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 6 - len(saved)
    if skipped:
        assert skipped[0].startswith(
            "periodic checkpoint at step 1 skipped: the artifacts folder holds 1 MiB and a "
            "checkpoint of 1.3"
        )


# --- a finished run keeps one checkpoint ------------------------------------------------------

FINE_TUNED = {
    "model": "tiny",
    "train": {"length": 16, "steps": 4, "batch_size": 2, "checkpoint_every": 1},
    "encodings": ["rope"],
    "eval": {"lengths": [16, 32], "tokens": 256, "variants": ["yarn:2+ft2", "pi:2+ft2"]},
}


@pytest.fixture
def worker_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    """The settings the worker runtime reads (get_settings), on a fresh database."""
    yield from worker_environment(tmp_path, monkeypatch, POSBENCH_MIN_CHECKPOINT_SECONDS="0")


def claim(config: Settings, spec: dict) -> lifecycle.ClaimedRun:
    run_id = submit(parse_spec(spec), actor="tester", settings=config, send=send).queued[0]
    return lifecycle.claim(config.database, run_id, "node")


def planted(folder: Path, run_id: int) -> set[str]:
    """Leftovers of earlier attempts of run ``run_id``, and files of other runs whose
    names begin alike (which must stay)."""
    folder.mkdir(parents=True, exist_ok=True)
    mine = [f"{run_id}.pt.1a2b3c4d.stale", f"{run_id}.pt.5e6f7a8b.tmp"]
    mine += [f".{run_id}.pt.0123456789abcdef.tmp", f"{run_id}.pt.ft-0123456789ab"]
    others = [f"{run_id}0.pt", f"{run_id}0.pt.ft-0123456789ab", f".{run_id}0.pt.01.tmp"]
    for name in mine + others:
        (folder / name).write_bytes(b"x")
    return set(others)


def files(folder: Path) -> set[str]:
    return {path.name for path in folder.iterdir()}


def stored_points(config: Settings, run_id: int) -> list[tuple[str, str, int, float | None]]:
    with transaction(config.database) as session:
        rows = session.execute(
            select(Evaluation.variant, Evaluation.protocol, Evaluation.eval_length, Evaluation.loss)
            .where(Evaluation.run_id == run_id)
            .order_by(Evaluation.id)
        )
        return [tuple(row) for row in rows]


def test_a_done_run_keeps_its_checkpoint_alone_and_each_fine_tuning_goes_once_evaluated(
    worker_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    from worker.runtime import execute, store
    from worker.training.finetune import finetune_checkpoint

    claimed = claim(worker_settings, FINE_TUNED)
    folder = worker_settings.artifacts_dir / "runs"
    others = planted(folder, claimed.run_id)
    seen: list[tuple[str, list[str]]] = []  # (variant, fine-tuned checkpoints) per point
    record = store.record_evaluation

    def watched(claimed_run, row) -> None:
        tuned = sorted(p.name for p in folder.glob(f"{claimed.run_id}.pt.ft-*"))
        seen.append((row.variant, tuned))
        record(claimed_run, row)

    monkeypatch.setattr(store, "record_evaluation", watched)
    assert execute.execute(claimed, "node") == "done"
    assert files(folder) == {f"{claimed.run_id}.pt", *others}
    # A fine-tuned variant's checkpoint lives while its points are evaluated and is gone
    # when the evaluation moves on (the planted one, of no variant, goes when it is done).
    checkpoint = folder / f"{claimed.run_id}.pt"
    tuned = {
        variant.label: finetune_checkpoint(checkpoint, variant).name
        for variant in parse_spec(FINE_TUNED).eval.variants
        if variant.finetune is not None
    }
    kept = f"{claimed.run_id}.pt.ft-0123456789ab"
    assert seen == [
        ("none", [kept]),
        ("none", [kept]),
        ("yarn:2+ft2", sorted([kept, tuned["yarn:2+ft2"]])),
        ("yarn:2+ft2", sorted([kept, tuned["yarn:2+ft2"]])),
        ("pi:2+ft2", sorted([kept, tuned["pi:2+ft2"]])),
        ("pi:2+ft2", sorted([kept, tuned["pi:2+ft2"]])),
    ]
    assert len(stored_points(worker_settings, claimed.run_id)) == 6


@pytest.mark.slow
def test_a_failed_run_keeps_its_last_checkpoint_and_a_retry_resumes_from_it(
    worker_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    from worker.runtime import execute as runtime

    calls = []

    def clock() -> float:  # the deadline passes at the check after the third step
        calls.append(1)
        return 0.0 if len(calls) <= 3 else 10.0 * 3600

    monkeypatch.setattr(runtime, "monotonic", clock)
    claimed = claim(worker_settings, {**SPEC, "encodings": ["rope"], "seeds": [0]})
    folder = worker_settings.artifacts_dir / "runs"
    others = planted(folder, claimed.run_id)
    assert runtime.execute(claimed, "node").startswith("failed: wall-clock deadline")
    assert files(folder) == {f"{claimed.run_id}.pt", *others}
    monkeypatch.setattr(runtime, "monotonic", time.monotonic)
    assert retry(run_id=claimed.run_id, actor="tester", settings=worker_settings, send=send)
    again = lifecycle.claim(worker_settings.database, claimed.run_id, "node")
    assert runtime.execute(again, "node") == "done"
    with transaction(worker_settings.database) as session:
        assert session.get(Run, claimed.run_id).provenance["resumed_from_step"] == 3
    assert files(folder) == {f"{claimed.run_id}.pt", *others}


@pytest.mark.slow
def test_a_run_cancelled_while_fine_tuning_keeps_one_checkpoint_and_its_retry_loses_nothing(
    worker_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    from worker.run import prepared_task, run_one
    from worker.runtime import execute as runtime

    spec = {**FINE_TUNED, "eval": {**FINE_TUNED["eval"], "variants": ["yarn:2+ft2"]}}
    claimed = claim(worker_settings, spec)
    folder = worker_settings.artifacts_dir / "runs"
    on_progress = runtime.StoreHooks.on_finetune_progress

    def cancel_when_tuned(self, label, point, steps) -> None:
        on_progress(self, label, point, steps)
        if point.step == steps:  # its final checkpoint is written, then the run stops
            self.asked = True  # as a cancel asked now would

    monkeypatch.setattr(runtime.StoreHooks, "on_finetune_progress", cancel_when_tuned)
    assert runtime.execute(claimed, "node") == "cancelled"
    assert files(folder) == {f"{claimed.run_id}.pt"}  # the fine-tuning's is not kept
    before = stored_points(worker_settings, claimed.run_id)
    assert [point[0] for point in before] == ["none", "none"]
    monkeypatch.setattr(runtime.StoreHooks, "on_finetune_progress", on_progress)
    assert retry(run_id=claimed.run_id, actor="tester", settings=worker_settings, send=send)
    again = lifecycle.claim(worker_settings.database, claimed.run_id, "node")
    assert runtime.execute(again, "node") == "done"
    after = stored_points(worker_settings, claimed.run_id)
    assert after[:2] == before and [point[0] for point in after[2:]] == ["yarn:2+ft2"] * 2
    # Fine-tuned again from the trained model: the numbers of an uninterrupted run.
    parsed = parse_spec(spec)
    task = prepared_task(parsed, worker_settings.corpus_cache)
    straight = run_one(parsed, parsed.runs()[0], task=task, device=torch.device("cpu"))
    assert [row.loss for row in straight.evaluations] == [point[3] for point in after]
    assert files(folder) == {f"{claimed.run_id}.pt"}


def test_a_run_claimed_past_its_deadline_fails_and_keeps_no_leftovers(
    worker_settings: Settings,
) -> None:
    from worker.runtime.execute import execute

    claimed = claim(worker_settings, {**SPEC, "seeds": [0]})
    folder = worker_settings.artifacts_dir / "runs"
    others = planted(folder, claimed.run_id)
    with transaction(worker_settings.database) as session:
        started = utcnow() - dt.timedelta(hours=2)
        session.execute(update(Run).where(Run.id == claimed.run_id).values(started_at=started))
        claimed.run.started_at = started
    assert execute(claimed, "node") == "failed: wall-clock deadline of 1 h reached"
    assert files(folder) == others


def test_a_run_whose_lease_was_lost_leaves_the_files_to_their_new_owner(
    worker_settings: Settings,
) -> None:
    from worker.runtime.execute import end

    claimed = claim(worker_settings, {**SPEC, "seeds": [0]})
    folder = worker_settings.artifacts_dir / "runs"
    planted(folder, claimed.run_id)
    with transaction(worker_settings.database) as session:
        session.execute(update(Run).where(Run.id == claimed.run_id).values(lease="another"))
    before = files(folder)
    assert not end(claimed, RunStatus.FAILED, reason="x")
    assert files(folder) == before


def test_a_run_released_at_shutdown_keeps_everything_to_resume(
    worker_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    from jobs import service
    from worker.runtime.execute import release_for_shutdown

    monkeypatch.setattr(service, "celery_send", lambda run_id, **options: None)

    claimed = claim(worker_settings, {**SPEC, "seeds": [0]})
    folder = worker_settings.artifacts_dir / "runs"
    planted(folder, claimed.run_id)
    before = files(folder)
    assert release_for_shutdown(claimed, "cancelled at step 2 of 4").startswith("released")
    assert files(folder) == before


# --- the prepared-corpus cache ----------------------------------------------------------------


def corpus_file(root: Path, name: str, size: int) -> str:
    path = root / f"{name}.txt"
    path.write_text((name + " ") * (size // (len(name) + 1)))
    return f"text:{path}"


def age(entry: Path, seconds_ago: float) -> None:
    """Mark a cache entry last used ``seconds_ago``."""
    moment = time.time() - seconds_ago
    os.utime(entry / "meta.json", (moment, moment))


def test_the_corpus_cache_evicts_the_least_recently_used_corpora(tmp_path: Path) -> None:
    roots = tmp_path / "corpora"
    roots.mkdir()
    cache = tmp_path / "cache"
    first, second, third = (corpus_file(roots, name, 100_000) for name in ("a", "b", "c"))
    unbounded = SourcePolicy(roots=(roots.resolve(),))
    a = load_corpus(first, cache, unbounded)
    b = load_corpus(second, cache, unbounded)
    entries = cache / "corpora"
    age(entries / a.fingerprint, 60)  # a used a minute ago, b an hour ago
    age(entries / b.fingerprint, 3600)
    abandoned = entries / ".staging-killed"  # a preparation killed long ago
    abandoned.mkdir()
    (abandoned / "train.u8").write_bytes(b"x" * 1000)
    os.utime(abandoned, (time.time() - 2 * 86_400,) * 2)
    # Room for two corpora: c comes in, b (the least recently used) goes.
    bounded = SourcePolicy(roots=(roots.resolve(),), max_cache_bytes=250_000)
    c = load_corpus(third, cache, bounded)
    assert files(entries) == {a.fingerprint, c.fingerprint}
    assert folder_bytes(entries) <= 250_000
    # b's arrays, mapped before, still read (POSIX keeps an unlinked file's data).
    assert bytes(b.train[:4]) == b"b b "
    # Used again, b is prepared again, and now a is the oldest.
    age(entries / c.fingerprint, 10)
    again = load_corpus(second, cache, bounded)
    assert again.fingerprint == b.fingerprint
    assert files(entries) == {b.fingerprint, c.fingerprint}
    # A bound smaller than one corpus keeps the one in use.
    alone = load_corpus(first, cache, SourcePolicy(roots=(roots.resolve(),), max_cache_bytes=1))
    assert files(entries) == {alone.fingerprint} and len(alone.train) > 0


def test_a_corpus_evicted_between_its_check_and_its_mapping_is_prepared_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import numpy as np

    from worker.data import corpus_cache, lm

    roots = tmp_path / "corpora"
    roots.mkdir()
    policy = SourcePolicy(roots=(roots.resolve(),))
    name = corpus_file(roots, "a", 10_000)
    corpus = load_corpus(name, tmp_path / "cache", policy)
    entry = tmp_path / "cache" / "corpora" / corpus.fingerprint
    real = np.memmap
    evicted = []

    def evicting_memmap(path, *args, **kwargs):
        if not evicted:  # another worker evicts the entry just before it is mapped
            evicted.append(1)
            corpus_cache.remove(entry)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(lm.np, "memmap", evicting_memmap)
    again = load_corpus(name, tmp_path / "cache", policy)
    assert evicted and again.fingerprint == corpus.fingerprint
    assert bytes(again.train[:4]) == b"a a " and (entry / "meta.json").exists()
