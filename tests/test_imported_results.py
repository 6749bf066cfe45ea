"""Results imported with `posbench import` are marked as such everywhere they are shown,
and the result cache never passes them off as trained runs unless a submitter asks."""

from __future__ import annotations

import json
import os
import pwd
from pathlib import Path

import pytest
import sqlalchemy as sa
from conftest import dashboard_settings, isolated_env, posbench_cli, study_results
from dashboard_seed import seed_study
from sqlalchemy import update
from test_dashboard import page, plain
from test_import import SPEC

from core.settings import Settings
from core.spec import parse_spec
from db import queries
from db.engine import engine_for, normalize_url, transaction
from db.migrate import current, downgrade, head, upgrade
from db.models import Run
from worker.runtime.cache import cached_models

NOTE = "imported from a results.json (posbench import), not trained by this service's workers"


@pytest.fixture(scope="module")
def payload() -> dict:
    return study_results(SPEC)


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    config = Settings(home=tmp_path / "home")
    upgrade(config.database)
    return config


def posbench(settings: Settings, *args: str):
    # A broker that refuses at once: the submitted runs stay queued, unsent.
    env = isolated_env(settings.home, COLUMNS="250", POSBENCH_BROKER_URL="redis://127.0.0.1:1/0")
    return posbench_cli(*args, env=env)


def test_imported_numbers_are_not_reused_as_trained_unless_asked(
    settings: Settings, payload: dict, tmp_path: Path
) -> None:
    """The finding, as written: import made-up but self-consistent numbers, then
    submit the same spec."""
    results = tmp_path / "results.json"
    results.write_text(json.dumps(payload))
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(SPEC))
    imported = posbench(settings, "import", str(results))
    assert imported.returncode == 0, imported.stderr
    assert "marked imported" in imported.stdout and "--reuse-imported" in imported.stdout
    # The audit trail: who imported it (the OS user running the CLI), and from where.
    (event,) = queries.events(settings.database).to_dict("records")
    me = pwd.getpwuid(os.getuid()).pw_name
    assert (event["actor"], event["action"]) == (f"{me} (cli)", "import")
    assert event["detail"].startswith(f"{parse_spec(SPEC).name}: 2 runs, ")
    assert event["detail"].endswith(f" evaluations from {results}")

    # The same spec, submitted: its runs are queued to train, none reused.
    submitted = posbench(settings, "submit", str(spec), "--json")
    assert submitted.returncode == 0, submitted.stderr
    plain_submit = json.loads(submitted.stdout)
    assert len(plain_submit["queued"]) == 2 and plain_submit["reused"] == []
    study = plain_submit["study"]
    runs = queries.runs(settings.database, study_id=study)
    assert set(runs["status"]) == {"queued"} and runs["imported_from"].isna().all()
    assert runs["reused_from_run_id"].isna().all()

    # Asked explicitly: reused, and marked imported.
    asked = posbench(settings, "submit", str(spec), "--reuse-imported", "--json")
    assert asked.returncode == 0, asked.stderr
    reused = json.loads(asked.stdout)
    assert reused["queued"] == [] and len(reused["reused"]) == 2
    assert reused["imported"] == reused["reused"]
    runs = queries.runs(settings.database, study_id=reused["study"])
    assert set(runs["status"]) == {"done"} and set(runs["imported_from"]) == {str(results)}
    told = posbench(settings, "submit", str(spec), "--reuse-imported")
    assert "2 reused from earlier results (2 of them imported, not trained here)" in told.stdout

    # status: an imported count per study, a note per run.
    listed = posbench(settings, "status", "--json")
    counts = {row["id"]: row["imported"] for row in json.loads(listed.stdout)}
    assert counts == {1: 2, study: 0, reused["study"]: 2, reused["study"] + 1: 2}
    for shown in (1, reused["study"]):
        detail = posbench(settings, "status", str(shown))
        assert detail.returncode == 0, detail.stderr
        assert detail.stdout.count("imported from") == 2 and "not trained here" in detail.stdout
    assert "imported" not in posbench(settings, "status", str(study)).stdout

    # results: a note under the table; csv and json gain a column, the note on stderr.
    table = posbench(settings, "results", "--study", str(reused["study"]))
    assert table.returncode == 0, table.stderr
    assert f"study {reused['study']}: all its runs were {NOTE}" in " ".join(table.stdout.split())
    csv = posbench(settings, "results", "--study", "1", "--format", "csv")
    header, *rows = csv.stdout.splitlines()
    assert header.split(",")[-1] == "imported" and all(r.endswith(",True") for r in rows)
    assert NOTE in csv.stderr
    train = posbench(settings, "results", "--study", "1", "--view", "train", "--format", "json")
    assert {row["imported"] for row in json.loads(train.stdout)} == {True}
    trained = posbench(settings, "results", "--study", str(study), "--format", "json")
    assert trained.returncode == 0 and "imported" not in trained.stderr


def test_an_imported_run_lends_no_model(settings: Settings) -> None:
    """The model cache (train hash) never takes an imported run's training."""
    study = seed_study(settings)
    runs = queries.runs(settings.database, study_id=study)
    first, second = (int(i) for i in runs["id"][:2])
    with transaction(settings.database) as session:
        session.execute(update(Run).values(train_hash="t" * 32))
        session.execute(update(Run).where(Run.id == first).values(imported_from="/r.json"))
    sources = [row[0] for row in cached_models(settings.database, "t" * 32, second)]
    assert first not in sources and sources


@pytest.fixture
def dashboard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    yield from dashboard_settings(tmp_path, monkeypatch)


def test_the_dashboard_says_which_runs_were_imported(dashboard: Settings) -> None:
    study = seed_study(dashboard)
    runs = queries.runs(dashboard.database, study_id=study)
    done = [int(i) for i in runs["id"][runs["status"] == "done"]]
    with transaction(dashboard.database) as session:
        session.execute(update(Run).where(Run.id.in_(done)).values(imported_from="/r.json"))
    queue = page("queue")
    queue.query_params["study"] = str(study)
    queue.run()
    assert not queue.exception, queue.exception
    captions = [plain(c.value) for c in queue.caption]
    assert f"study {study}: 4 of its 6 runs were {NOTE}" in captions
    notes = list(queue.dataframe[0].value["note"])
    assert notes[:4] == ["imported from /r.json (not trained here)"] * 4
    compare = page("compare")
    compare.query_params["studies"] = str(study)
    compare.run()
    assert not compare.exception, compare.exception
    assert f"study {study}: 4 of its 6 runs were {NOTE}" in [
        plain(c.value) for c in compare.caption
    ]


def test_the_mlflow_export_tags_imported_runs(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    tracking = (tmp_path / "mlruns").as_uri()
    study = seed_study(settings)
    runs = queries.runs(settings.database, study_id=study)
    first = int(runs["id"][runs["status"] == "done"].iloc[0])
    with transaction(settings.database) as session:
        session.execute(update(Run).where(Run.id == first).values(imported_from="/r.json"))
    env = isolated_env(settings.home, MLFLOW_ALLOW_FILE_STORE="true")
    done = posbench_cli("export", str(study), "--tracking-uri", tracking, env=env)
    assert done.returncode == 0, done.stderr
    client = MlflowClient(tracking_uri=tracking)
    experiment = client.get_experiment_by_name("seeded")
    tags = {
        int(r.data.tags["posbench.run_id"]): r.data.tags
        for r in client.search_runs([experiment.experiment_id])
    }
    assert tags[first]["posbench.imported"] == "true"
    assert tags[first]["posbench.imported_from"] == "/r.json"
    others = [t for run_id, t in tags.items() if run_id != first]
    assert others and {t["posbench.imported"] for t in others} == {"false"}


def test_0009_marks_the_runs_a_database_at_0008_holds_as_imported(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/old.db"
    upgrade(url, "0008")
    engine = engine_for(normalize_url(url))
    tables = sa.MetaData()
    tables.reflect(engine, only=["studies", "runs"])
    studies, runs = tables.tables["studies"], tables.tables["runs"]
    stored = {
        1: {"seed": 0, "imported_from": "/laptop/results.json"},  # imported
        2: {"seed": 0, "imported_from": "/laptop/results.json"},  # reused one: a copy
        3: {"seed": 0, "trained_by_run": 1},  # trained here
        4: None,
    }
    with engine.begin() as connection:
        connection.execute(
            studies.insert().values(
                id=1, name="old", task="lm", metric="perplexity", train_length=16, spec={}
            )
        )
        for run_id, provenance in stored.items():
            connection.execute(
                runs.insert().values(
                    id=run_id,
                    study_id=1,
                    encoding="rope",
                    label="rope",
                    params={},
                    seed=run_id,
                    config_hash="c" * 32,
                    status="done",
                    step=4,
                    total_steps=4,
                    cancel_requested=False,
                    attempts=1,
                    skip_cache=False,
                    provenance=provenance,
                )
            )
    upgrade(url)
    assert current(url) == head()
    marked = queries.runs(url, study_id=1).set_index("id")["imported_from"]
    assert marked[1] == marked[2] == "/laptop/results.json"
    assert marked[[3, 4]].isna().all()
    assert queries.imported_runs(url) == {1: 2}
    # Those runs are no longer reused as trained; a submitter may still ask.
    from jobs.service import _cached_run

    with transaction(url) as session:
        assert _cached_run(session, "c" * 32, reuse_imported=False).id in (3, 4)
        assert _cached_run(session, "c" * 32, reuse_imported=True).imported_from is None
    downgrade(url, "0008")
    assert "imported_from" not in sa.Table("runs", sa.MetaData(), autoload_with=engine).c
