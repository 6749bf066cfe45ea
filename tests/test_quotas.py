"""Quotas (DESIGN.md, Security contract): a study's compute, the active runs (across the
service and per submitter; tests/test_audit.py has the latter's service-level test), a
run's wall-clock deadline and the spacing of its checkpoints."""

from __future__ import annotations

import datetime as dt
import os
import pwd
import re
from pathlib import Path

import pytest
import torch
import yaml
from conftest import (
    FOUR_RUNS,
    ROOT,
    dashboard_settings,
    isolated_env,
    posbench_cli,
    service_settings,
    worker_environment,
)
from pydantic import ValidationError
from sqlalchemy import func, select, update
from streamlit.testing.v1 import AppTest

from core.settings import Settings
from core.spec import TrainSpec, parse_spec
from core.status import RunStatus
from db.engine import transaction
from db.models import Run, Study, utcnow
from jobs import lifecycle
from jobs.reconciler import reconcile
from jobs.service import Refused, submit
from worker.data import build_task
from worker.model import build_model
from worker.training import Checkpointer, Trainer

SPEC = FOUR_RUNS
APP = str(ROOT / "dashboard" / "app.py")
ME = f"{pwd.getpwuid(os.getuid()).pw_name} (cli)"  # who runs these tests, as the CLI names them


class Recorder:
    def __init__(self) -> None:
        self.sent: list[int] = []

    def __call__(self, run_id: int) -> None:
        self.sent.append(run_id)


def stored(config: Settings, model: type) -> int:
    with transaction(config.database) as session:
        return session.scalar(select(func.count()).select_from(model))


# --- compute and active runs, at submit ---------------------------------------------------


def test_the_estimate_is_training_and_evaluation() -> None:
    spec = parse_spec(SPEC)
    tokens = 4 * spec.train.steps * spec.train.tokens_per_step
    assert spec.train_tokens() == tokens
    assert spec.training_flops() == 6 * spec.model.parameters * tokens
    assert spec.estimated_flops() == spec.training_flops() + spec.eval_flops()
    # Evaluation: at least 2 x parameters for every token a run reads.
    reads = spec.eval_tokens() * len(spec.runs())
    assert spec.eval_flops() > 2 * spec.model.parameters * reads


# Audit F1: a 340M-parameter model, 16 seeds, evaluated at 131,072 tokens with a sliding
# stride of 512 and 16 variants, was counted at 4.2e12 FLOPs (its training alone).
EVALUATION_HEAVY = {
    "name": "evaluation heavy",
    "model": {"d_model": 1024, "n_layers": 27, "n_heads": 16},
    "encodings": ["rope"],
    "seeds": list(range(16)),
    "train": {"length": 1024, "steps": 1, "batch_size": 1},
    "eval": {
        "lengths": [131072],
        "tokens": 131072,
        "protocols": ["sliding"],
        "stride": 512,
        "variants": [
            "none",
            *[f"{m}:{f}" for m in ("pi", "ntk", "yarn") for f in (2, 4, 8, 16, 32)],
        ],
    },
}


def test_evaluation_is_counted_and_refused_over_the_quota(tmp_path: Path) -> None:
    spec = parse_spec(EVALUATION_HEAVY)
    assert len(spec.eval.variants) == 16 and spec.model.parameters > 3.4e8
    assert spec.training_flops() < 1e14  # all that was counted before
    # 16 runs x 16 variants x 131,072 tokens, each read in 256 windows, x 2 x 340M: 5.8e18
    # for the matrices; attention over 131,072 keys costs about 12 times as much again.
    matrices = 16 * 16 * 131072 * (131072 / 512) * 2 * spec.model.parameters
    assert matrices > 5e18 and spec.eval_flops() > 10 * matrices
    config = service_settings(tmp_path)  # the default quota, 1e19
    with pytest.raises(Refused, match="quota POSBENCH_MAX_STUDY_FLOPS exceeded") as refused:
        submit(spec, settings=config, send=Recorder(), actor="tester")
    assert "evaluation 6.81e+19" in str(refused.value) and stored(config, Study) == 0


def test_key_tokens_sub_windows_and_the_order_probe_are_counted() -> None:
    base = {**SPEC, "eval": {**SPEC.get("eval", {}), "order_probe": False}}
    plain = parse_spec(base).eval_flops()
    probed = parse_spec({**base, "eval": {**base["eval"], "order_probe": True}}).eval_flops()
    keyed = {
        stride: parse_spec(
            {
                **base,
                "eval": {**base["eval"], "key_tokens": {"short_context": 128, "stride": stride}},
            }
        ).eval_flops()
        for stride in (1, 128)
    }
    assert probed > plain and keyed[128] > plain
    # A stride of 1 reads 128 tokens per scored one: about 128 x the stride 128's share.
    assert (keyed[1] - plain) / (keyed[128] - plain) > 100


def test_a_study_over_the_compute_quota_is_refused_before_anything_is_written(
    tmp_path: Path,
) -> None:
    spec = parse_spec(SPEC)
    config = service_settings(tmp_path, max_study_flops=spec.estimated_flops() / 2)
    with pytest.raises(Refused, match="quota POSBENCH_MAX_STUDY_FLOPS exceeded") as refused:
        submit(spec, settings=config, send=Recorder(), actor="tester")
    assert "over the limit of" in str(refused.value) and "2 x the limit" in str(refused.value)
    assert stored(config, Study) == 0 and stored(config, Run) == 0


def test_active_runs_count_across_the_service_and_the_cache_is_not_counted(
    tmp_path: Path,
) -> None:
    config = service_settings(tmp_path, max_active_runs=6)
    first = submit(parse_spec(SPEC), settings=config, send=Recorder(), actor="tester")
    assert len(first.queued) == 4
    with pytest.raises(Refused, match=r"4 runs are queued or running and this study adds 4"):
        submit(
            parse_spec({**SPEC, "name": "again"}), settings=config, send=Recorder(), actor="tester"
        )
    assert stored(config, Study) == 1 and stored(config, Run) == 4
    # Finished runs are not active, and a run the result cache serves adds none.
    with transaction(config.database) as session:
        session.execute(update(Run).values(status=RunStatus.DONE, finished_at=utcnow(), lease=None))
    again = submit(parse_spec(SPEC), settings=config, send=Recorder(), actor="tester")
    assert again.queued == [] and len(again.reused) == 4
    # --force trains every run again: all of them count.
    small = service_settings(tmp_path, max_active_runs=3)
    with pytest.raises(Refused, match=r"adds 4, 4 in all, over the limit of 3 by 1"):
        submit(parse_spec(SPEC), force=True, settings=small, send=Recorder(), actor="tester")


def unescaped(markdown: str) -> str:
    return re.sub(r"\\(.)", r"\1", markdown)


def write_spec(tmp_path: Path, spec: dict) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("POSBENCH_MAX_STUDY_FLOPS", "1e6", "quota POSBENCH_MAX_STUDY_FLOPS exceeded"),
        ("POSBENCH_MAX_ACTIVE_RUNS", "3", "over the limit of 3 by 1"),
        # Per submitter: the OS account, as the audit trail names them.
        ("POSBENCH_MAX_ACTIVE_RUNS_PER_SUBMITTER", "3", f"{ME} has 0 runs queued or running"),
    ],
)
def test_posbench_submit_over_a_quota_exits_2_with_one_line(
    tmp_path: Path, variable: str, value: str, message: str
) -> None:
    env = isolated_env(tmp_path, LOGNAME="alice", **{variable: value})
    assert posbench_cli("db", "upgrade", env=env).returncode == 0
    done = posbench_cli("submit", str(write_spec(tmp_path, SPEC)), env=env)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert variable in done.stderr
    listed = posbench_cli("status", "--json", env=env)
    assert listed.returncode == 0 and listed.stdout.strip() == "[]"  # nothing written


def test_a_submitter_renamed_in_the_environment_keeps_one_quota(tmp_path: Path) -> None:
    # The fourth audit's G5: the CLI named its submitter from $LOGNAME, and a second
    # name passed the per-submitter quota a second time.
    env = isolated_env(
        tmp_path,
        POSBENCH_MAX_ACTIVE_RUNS_PER_SUBMITTER="4",
        POSBENCH_BROKER_URL="redis://127.0.0.1:1/0",  # refuses at once: the runs stay queued
    )
    assert posbench_cli("db", "upgrade", env=env).returncode == 0
    spec = write_spec(tmp_path, SPEC)
    alice, bob = ({**env, "LOGNAME": name, "USER": name} for name in ("alice", "bob"))
    first = posbench_cli("submit", str(spec), env=alice)
    assert first.returncode == 0, first.stderr
    again = posbench_cli("submit", str(spec), "--force", env=bob)
    assert again.returncode == 2, again.stdout
    assert (
        f"POSBENCH_MAX_ACTIVE_RUNS_PER_SUBMITTER exceeded: {ME} has 4 runs queued or running"
        in again.stderr
    )


@pytest.fixture
def dashboard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    yield from dashboard_settings(tmp_path, monkeypatch)


def test_password_logins_from_different_addresses_share_one_quota(
    dashboard, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The fourth audit's G5: a password login was named by its client address, which a
    # visitor can choose (audit G2), and each address had a quota of its own.
    from core.settings import get_settings
    from dashboard import auth

    monkeypatch.setenv("POSBENCH_DASHBOARD_PASSWORD", "s3cret")
    monkeypatch.setenv("POSBENCH_BROKER_URL", "redis://127.0.0.1:1/0")
    monkeypatch.setenv("POSBENCH_MAX_ACTIVE_RUNS_PER_SUBMITTER", "3")  # the form's 2 runs fit
    get_settings.cache_clear()
    shown = []
    for address in ("192.0.2.7", "198.51.100.8"):
        monkeypatch.setattr(auth, "client_address", lambda address=address: address)
        page = AppTest.from_file(APP, default_timeout=60).run()
        page.text_input[0].set_value("s3cret")
        page.button[0].click().run()
        page.button(key="submit").click().run()
        assert not page.exception, page.exception
        shown += [unescaped(m.value) for m in (*page.success, *page.error)]
    assert shown == [
        "Study 1 submitted: 2 runs queued.",
        "quota POSBENCH_MAX_ACTIVE_RUNS_PER_SUBMITTER exceeded: dashboard operator has 2 runs "
        "queued or running and this study adds 2, 4 in all, over the limit of 3 by 1; wait "
        "for your runs to finish or cancel some",
    ]


# The finding as reported: one spec of 64 runs, about 1.9e22 FLOPs, each run checkpointing
# an 11.5 GB file at every step, was accepted.
FINDING = {
    "name": "the whole cluster",
    "encodings": ["nope", "rope", "alibi", "t5", "xpos", "kerple_log", "fire", "sinusoidal"],
    "seeds": list(range(8)),
    "model": {"d_model": 2048, "n_layers": 19, "n_heads": 16},
    "train": {"steps": 100_000, "batch_size": 64, "length": 8192, "checkpoint_every": 1},
}


def test_the_reported_spec_is_refused_at_the_default_quotas(tmp_path: Path) -> None:
    spec = parse_spec(FINDING)
    assert len(list(spec.runs())) == 64
    assert 1.8e22 < spec.estimated_flops() < 2.0e22
    assert 11e9 < spec.estimated_checkpoint_bytes() < 12e9
    # Each quota alone refuses it: lift the ones before it, one after the other.
    lifted: dict[str, float] = {}
    for setting, message in [
        ("max_study_flops", "POSBENCH_MAX_STUDY_FLOPS exceeded: the study needs about 1.93e+22"),
        ("max_checkpoint_bytes", "quota POSBENCH_MAX_CHECKPOINT_BYTES exceeded"),
        ("max_artifacts_bytes", "quota POSBENCH_MAX_ARTIFACTS_BYTES exceeded"),
        ("max_active_runs", "quota POSBENCH_MAX_ACTIVE_RUNS exceeded"),
        ("max_active_runs_per_submitter", "quota POSBENCH_MAX_ACTIVE_RUNS_PER_SUBMITTER exceeded"),
    ]:
        config = service_settings(tmp_path, **lifted)
        with pytest.raises(Refused, match=message.replace("+", r"\+")):
            submit(spec, settings=config, send=Recorder(), actor="tester")
        assert stored(config, Study) == 0
        lifted[setting] = Settings.model_fields[setting].metadata[-1].le
    # The checkpoint cadence of every step is spaced by the worker's floor (60 s).
    assert Settings().min_checkpoint_seconds == 60


# --- the wall-clock deadline ------------------------------------------------------------


def test_the_visibility_timeout_must_outlast_the_deadline() -> None:
    with pytest.raises(ValidationError, match="must be longer than POSBENCH_RUN_DEADLINE_HOURS"):
        Settings(visibility_timeout=24 * 3600, run_deadline_hours=24)
    assert Settings(visibility_timeout=24 * 3600 + 1, run_deadline_hours=24)


def test_a_visibility_timeout_shorter_than_the_deadline_stops_every_command(tmp_path) -> None:
    env = isolated_env(
        tmp_path, POSBENCH_VISIBILITY_TIMEOUT="7200", POSBENCH_RUN_DEADLINE_HOURS="3"
    )
    done = posbench_cli("status", env=env)
    assert done.returncode == 2
    assert "POSBENCH_VISIBILITY_TIMEOUT = 7200 s must be longer than" in done.stderr


def claimed_run(config: Settings, started_ago: dt.timedelta) -> lifecycle.ClaimedRun:
    submitted = submit(
        parse_spec({**SPEC, "seeds": [0]}), settings=config, send=Recorder(), actor="tester"
    )
    claimed = lifecycle.claim(config.database, submitted.queued[0], "node")
    with transaction(config.database) as session:
        started = utcnow() - started_ago
        session.execute(update(Run).where(Run.id == claimed.run_id).values(started_at=started))
        claimed.run.started_at = started
    return claimed


def run_row(config: Settings, run_id: int) -> Run:
    with transaction(config.database) as session:
        run = session.get(Run, run_id)
        session.expunge(run)
        return run


@pytest.fixture
def worker_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    """The settings the worker runtime reads (get_settings), on a fresh database."""
    yield from worker_environment(tmp_path, monkeypatch)


def test_a_run_claimed_after_its_deadline_fails_at_once(worker_settings: Settings) -> None:
    from worker.runtime.execute import execute

    claimed = claimed_run(worker_settings, dt.timedelta(hours=2))
    outcome = execute(claimed, "node")
    assert outcome == "failed: wall-clock deadline of 1 h reached"
    run = run_row(worker_settings, claimed.run_id)
    assert run.status == RunStatus.FAILED
    assert run.failure_reason == "wall-clock deadline of 1 h reached"


def test_a_run_past_its_deadline_stops_between_steps_and_fails(
    worker_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    from worker.runtime import execute as runtime

    # A fake clock: the deadline passes at the check after the third step.
    calls = []

    def clock() -> float:
        calls.append(1)
        return 0.0 if len(calls) <= 3 else 10.0 * 3600  # the first call sets the deadline

    monkeypatch.setattr(runtime, "monotonic", clock)
    claimed = claimed_run(worker_settings, dt.timedelta(0))
    outcome = runtime.execute(claimed, "node")
    reason = "wall-clock deadline of 1 h reached; stopped at step 3 of 4"
    assert outcome == f"failed: {reason}"
    run = run_row(worker_settings, claimed.run_id)
    assert run.status == RunStatus.FAILED and run.failure_reason == reason
    assert (Path(worker_settings.home) / "artifacts" / "runs" / f"{run.id}.pt").exists()


def test_the_reconciler_fails_a_run_past_its_deadline_instead_of_requeuing_it(
    tmp_path: Path,
) -> None:
    config = service_settings(tmp_path, run_deadline_hours=1, stale_after_seconds=60)
    dead_late = claimed_run(config, dt.timedelta(hours=2))  # its worker died after the deadline
    dead_early = claimed_run(config, dt.timedelta(minutes=10))  # died within it: requeued
    alive_overdue = claimed_run(config, dt.timedelta(hours=3))  # still beats, never stopped
    alive_late = claimed_run(config, dt.timedelta(hours=1, seconds=10))  # its worker ends it
    long_ago = utcnow() - dt.timedelta(minutes=5)
    with transaction(config.database) as session:
        dead = [dead_late.run_id, dead_early.run_id]
        session.execute(update(Run).where(Run.id.in_(dead)).values(heartbeat_at=long_ago))
    outcome = reconcile(settings=config, send=Recorder(), queue_empty=lambda queue: True)
    assert outcome["expired"] == sorted([dead_late.run_id, alive_overdue.run_id])
    assert outcome["revived"] == [dead_early.run_id]
    for claimed in (dead_late, alive_overdue):
        run = run_row(config, claimed.run_id)
        assert run.status == RunStatus.FAILED
        assert run.failure_reason == "wall-clock deadline of 1 h reached"
    assert run_row(config, alive_late.run_id).status == RunStatus.RUNNING
    # The overdue worker lost its lease: it can no longer write.
    assert lifecycle.heartbeat(alive_overdue) == (False, False)
    # A retry starts the deadline afresh.
    with transaction(config.database) as session:
        assert lifecycle.retry(session.get(Run, dead_late.run_id))
    assert run_row(config, dead_late.run_id).started_at is None


# --- checkpoint spacing -----------------------------------------------------------------


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


@pytest.mark.parametrize(("floor", "saved"), [(0.0, [1, 2, 3, 4, 5, 6]), (3600.0, [6])])
def test_the_checkpoint_floor_spaces_checkpoints(tmp_path: Path, floor, saved) -> None:
    task = build_task("lm")
    task.prepare(tmp_path / "cache")
    spec = TrainSpec(length=16, steps=6, batch_size=2, checkpoint_every=1)
    checkpointer = CountingCheckpointer(tmp_path / "run.pt")
    trainer = Trainer(
        build_model("tiny", "rope", train_length=16),
        task,
        spec,
        seed=0,
        device=torch.device("cpu"),
        checkpointer=checkpointer,
        min_checkpoint_seconds=floor,
    )
    trainer.fit()
    assert checkpointer.saved == saved  # the last step's is always written
