"""The run lifecycle's status values and the migration that gave its control state
columns of their own (0008), on a database built at the schema before it (0007)."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa

from core.analysis import run_notes
from core.status import ACTIVE, FINISHED, RUN_STATUSES, RunStatus
from db import queries
from db.engine import engine_for, normalize_url
from db.migrate import current, downgrade, head, upgrade
from jobs import lifecycle
from jobs.lifecycle import ClaimedRun

FINETUNE = {"yarn:4+ft9": {"steps": 9, "loss": 2.1}}
AUDIT = {"seed": 0, "torch_version": "2.13.0", "data": "lm:pystdlib:abc"}
# What the current release writes into runs.provenance, control flags and audit mixed:
# (status, provenance as stored at 0007), by run.
STORED = {
    1: ("done", {**AUDIT, "resumed_from_step": 0}),
    2: ("queued", {"train_afresh": True}),  # submit --force, before its claim
    3: ("queued", {"waiting_for": 1, "finetune": FINETUNE}),  # waits for run 1
    4: ("running", {"phase": "fine-tuning pi:4+ft9: step 5 of 9, loss 2.100"}),
    5: ("failed", {"phase": None, "finetune": FINETUNE, "train_afresh": True}),
    6: ("done", {**AUDIT, "trained_by_run": 1, "training": AUDIT}),
    7: ("queued", None),
}
# After 0008: (skip_cache, waiting_for, phase, provenance).
EXPECTED = {
    1: (False, None, None, {**AUDIT, "resumed_from_step": 0}),
    2: (True, None, None, None),
    3: (False, 1, None, {"finetune": FINETUNE}),
    4: (False, None, "fine-tuning pi:4+ft9: step 5 of 9, loss 2.100", None),
    5: (True, None, None, {"finetune": FINETUNE}),
    6: (False, None, None, {**AUDIT, "trained_by_run": 1, "training": AUDIT}),
    7: (False, None, None, None),
}


def _fill_at_0007(url: str) -> None:
    """A study, its runs (provenance as the current release writes it) and one
    evaluation each, written with the 0007 schema as the database has it."""
    engine = engine_for(normalize_url(url))
    tables = sa.MetaData()
    tables.reflect(engine, only=["studies", "runs", "evaluations"])
    studies, runs, evaluations = (tables.tables[n] for n in ("studies", "runs", "evaluations"))
    with engine.begin() as connection:
        connection.execute(
            studies.insert().values(
                id=1, name="old", task="lm", metric="perplexity", train_length=16, spec={}
            )
        )
        for run_id, (status, provenance) in STORED.items():
            connection.execute(
                runs.insert().values(
                    id=run_id,
                    study_id=1,
                    encoding="rope",
                    label="rope",
                    params={},
                    seed=run_id,
                    config_hash=f"{run_id:032x}",
                    train_hash="t" * 32,
                    status=status,
                    step=4,
                    total_steps=4,
                    cancel_requested=False,
                    attempts=1,
                    provenance=provenance,
                )
            )
            connection.execute(
                evaluations.insert().values(
                    run_id=run_id,
                    variant="none",
                    protocol="nonoverlapping",
                    eval_length=16,
                    loss=2.0,
                    perplexity=7.39,
                    tokens=64,
                )
            )


def _stored(url: str) -> dict[int, tuple]:
    engine = engine_for(normalize_url(url))
    runs = sa.Table("runs", sa.MetaData(), autoload_with=engine)
    with engine.connect() as connection:
        rows = connection.execute(
            sa.select(runs.c.id, runs.c.skip_cache, runs.c.waiting_for, runs.c.phase)
            .add_columns(runs.c.provenance)
            .order_by(runs.c.id)
        ).all()
    return {
        run_id: (bool(skip), waiting, phase, audit) for run_id, skip, waiting, phase, audit in rows
    }


def test_a_database_of_the_release_before_upgrades_and_reads_the_same(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/old.db"
    upgrade(url, "0007")
    _fill_at_0007(url)
    upgrade(url)
    assert current(url) == head()
    # The flags are columns now, with their values; provenance keeps the audit only.
    assert _stored(url) == EXPECTED
    # The same results, counts and curves as were written (today's queries read the
    # latest schema only, so they are checked against what _fill_at_0007 wrote).
    (study,) = queries.studies(url).to_dict("records")
    counts = {k: study[k] for k in ("id", "name", "runs", *RUN_STATUSES)}
    statuses = [status for status, _ in STORED.values()]
    expected = {status: statuses.count(status) for status in RUN_STATUSES}
    assert counts == {"id": 1, "name": "old", "runs": 7, **expected}
    curves = queries.curves(url, study_ids=[1])
    assert list(curves["run_id"]) == list(STORED)
    assert set(zip(curves["eval_length"], curves["perplexity"], strict=True)) == {(16, 7.39)}
    # The notes people read come from the columns: run 3 waits, run 4 fine-tunes.
    notes = run_notes(queries.runs(url, study_id=1))
    assert notes == [
        "",
        "",
        "waiting for run 1, which trains the same model",
        "fine-tuning pi:4+ft9: step 5 of 9, loss 2.100",
        "",
        "",
        "",
    ]
    # And back: the downgrade puts the flags into provenance again.
    downgrade(url, "0007")
    engine = engine_for(normalize_url(url))
    runs = sa.Table("runs", sa.MetaData(), autoload_with=engine)
    assert "skip_cache" not in runs.c and "phase" not in runs.c
    with engine.connect() as connection:
        restored = dict(connection.execute(sa.select(runs.c.id, runs.c.provenance)).all())
    for run_id, (_, provenance) in STORED.items():
        # A phase of None said nothing; it is not restored.
        kept = {k: v for k, v in (provenance or {}).items() if not (k == "phase" and v is None)}
        assert restored[run_id] == (kept or None), run_id


def test_the_statuses_are_the_columns_values() -> None:
    assert [str(s) for s in RUN_STATUSES] == ["queued", "running", "done", "failed", "cancelled"]
    assert RunStatus.DONE == "done" and RunStatus("cancelled") is RunStatus.CANCELLED
    assert set(ACTIVE) | set(FINISHED) == set(RUN_STATUSES) and not set(ACTIVE) & set(FINISHED)


def test_a_run_finishes_only_as_a_finished_status() -> None:
    claimed = ClaimedRun("sqlite://", 1, "lease")
    with pytest.raises(ValueError, match="not 'running'"):
        lifecycle.finish(claimed, RunStatus.RUNNING)
