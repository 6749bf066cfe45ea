"""Export to MLflow: a study's runs, read back through MLflow's own client."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import isolated_env, posbench_cli
from dashboard_seed import LENGTHS, seed_study
from mlflow.tracking import MlflowClient  # a dev dependency: no skip

from core.settings import Settings
from db import queries
from db.engine import transaction
from db.migrate import upgrade
from db.models import Evaluation as EvaluationRow
from db.models import Run
from jobs.transfer.mlflow_export import key


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    config = Settings(home=tmp_path / "home")
    upgrade(config.database)
    return config


@pytest.fixture
def tracking(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    # MLflow's file store (kept for local use, opted into by this variable): the client
    # calls are the ones a tracking server receives.
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    return (tmp_path / "mlruns").as_uri()


def export(settings: Settings, tracking: str, *args: str):
    env = isolated_env(settings.home, MLFLOW_ALLOW_FILE_STORE="true")
    return posbench_cli("export", *args, "--tracking-uri", tracking, env=env)


def parents(client: MlflowClient, experiment_id: str) -> list:
    """The exported posbench runs (not their per-variant children)."""
    runs = client.search_runs([experiment_id])
    return [r for r in runs if "posbench.variant" not in r.data.tags]


@pytest.mark.slow
def test_a_study_exports_its_finished_runs_once(settings: Settings, tracking: str) -> None:
    study = seed_study(settings)
    stored = queries.runs(settings.database, study_id=study).set_index("id")
    rope_ids = [
        int(i) for i in stored.index[(stored["label"] == "rope") & (stored["status"] == "done")]
    ]
    with transaction(settings.database) as session:  # a YaRN point for each rope run
        for rope_id in rope_ids:
            session.add(
                EvaluationRow(
                    run_id=rope_id,
                    variant="yarn:2",
                    protocol="nonoverlapping",
                    eval_length=64,
                    loss=2.0,
                    perplexity=math.exp(2.0),
                    tokens=512,
                )
            )
    done = export(settings, tracking, str(study))
    assert done.returncode == 0, done.stderr
    assert "4 runs written, 0 already there, 2 not finished (not exported)" in done.stdout
    client = MlflowClient(tracking_uri=tracking)
    experiment = client.get_experiment_by_name("seeded")
    runs = parents(client, experiment.experiment_id)
    assert sorted(r.info.run_name for r in runs) == [
        "alibi seed 0",
        "alibi seed 1",
        "rope seed 0",
        "rope seed 1",
    ]
    rope = next(r for r in runs if r.info.run_name == "rope seed 1")
    run_id = int(rope.data.tags["posbench.run_id"])
    assert stored.loc[run_id, "label"] == "rope" and stored.loc[run_id, "seed"] == 1
    assert rope.data.tags["posbench.config_hash"] == stored.loc[run_id, "config_hash"]
    assert rope.info.status == "FINISHED"
    # Parameters: the settings the run measured with, its encoding resolved.
    params = rope.data.params
    assert (params["encoding.name"], params["encoding.base"], params["seed"]) == (
        "rope",
        "10000.0",
        "1",
    )
    assert params["train.length"] == "32" and params["model.d_model"] == "64"
    assert params["eval.lengths"] == "[32, 64, 128]"
    # The extrapolation curve, evaluation length as the step, equal to the database's.
    curve = client.get_metric_history(rope.info.run_id, "eval/perplexity/none/nonoverlapping")
    points = queries.curves(settings.database, study_ids=[study])
    mine = points[(points["run_id"] == run_id) & (points["variant"] == "none")]
    mine = mine.set_index("eval_length")["perplexity"]
    assert sorted(m.step for m in curve) == LENGTHS
    assert {m.step: m.value for m in curve} == pytest.approx(mine.to_dict())
    # The training curve by step, with the validation loss where it was measured.
    loss = client.get_metric_history(rope.info.run_id, "train/loss")
    assert sorted((m.step, m.value) for m in loss) == [(20, pytest.approx(3.2)), (40, 2.5)]
    val = client.get_metric_history(rope.info.run_id, "train/val_loss")
    assert [(m.step, m.value) for m in val] == [(40, pytest.approx(2.7))]
    assert "summary/ratio_4x/none/nonoverlapping" in rope.data.metrics
    # Children, one per variant, with keys that do not name it: one key compares
    # "rope + yarn:2" with "alibi".
    children = [
        r
        for r in client.search_runs([experiment.experiment_id])
        if r.data.tags.get("mlflow.parentRunId") == rope.info.run_id
    ]
    assert sorted(r.info.run_name for r in children) == ["rope + yarn:2 seed 1", "rope seed 1"]
    trained = next(r for r in children if r.data.tags["posbench.variant"] == "none")
    same = client.get_metric_history(trained.info.run_id, "eval/perplexity/nonoverlapping")
    assert {m.step: m.value for m in same} == pytest.approx(mine.to_dict())
    assert trained.data.metrics["summary/ratio_4x/nonoverlapping"] == pytest.approx(
        mine[128] / mine[32]
    )
    assert "summary/order_sensitivity" in trained.data.metrics  # the probe's, with the model
    yarn = next(r for r in children if r.data.tags["posbench.variant"] == "yarn:2")
    assert yarn.data.tags["posbench.line"] == "rope + yarn:2" and yarn.data.params["variant"]
    assert yarn.data.metrics["eval/perplexity/nonoverlapping"] == pytest.approx(math.exp(2.0))
    assert all(r.info.status == "FINISHED" for r in children)
    alibi = next(r for r in runs if r.info.run_name == "alibi seed 0")
    (alibi_child,) = [
        r
        for r in client.search_runs([experiment.experiment_id])
        if r.data.tags.get("mlflow.parentRunId") == alibi.info.run_id
    ]
    assert "eval/perplexity/nonoverlapping" in alibi_child.data.metrics
    # Again: nothing is duplicated; --replace writes them anew.
    again = export(settings, tracking, str(study))
    assert "0 runs written, 4 already there" in again.stdout
    assert len(client.search_runs([experiment.experiment_id])) == 4 + 4 + 2  # 2 yarn children
    replaced = export(settings, tracking, str(study), "--replace")
    assert "4 runs written, 0 already there" in replaced.stdout
    assert len(client.search_runs([experiment.experiment_id])) == 4 + 4 + 2
    spec = client.download_artifacts(rope.info.run_id, "posbench_spec.json", str(settings.home))
    assert json.loads(Path(spec).read_text())["name"] == "seeded"
    # The same ids with another configuration (another database, or ids handed out again
    # after a delete) is another run: written, and the old one left alone.
    with transaction(settings.database) as session:
        session.get(Run, run_id).config_hash = "f" * 24
    other = export(settings, tracking, str(study))
    assert "1 runs written, 3 already there" in other.stdout
    assert len(parents(client, experiment.experiment_id)) == 5


def test_export_refuses_what_it_cannot_do(settings: Settings, tracking: str) -> None:
    missing = export(settings, tracking, "99")
    assert missing.returncode == 2 and "no study with id 99" in missing.stderr
    wrong = export(settings, tracking, "1", "--to", "wandb")
    assert wrong.returncode == 2 and "--to must be mlflow, got 'wandb'" in wrong.stderr
    nowhere = posbench_cli("export", "1", env=isolated_env(settings.home))
    assert nowhere.returncode == 2
    assert "give --tracking-uri (e.g. http://localhost:5000) or set MLFLOW_TRACKING_URI" in (
        nowhere.stderr
    )


def test_keys_keep_only_what_mlflow_accepts() -> None:
    assert key("eval", "perplexity", "yarn:4+ft200@512(lr=0.0002, batch=8)", "sliding") == (
        "eval/perplexity/yarn_4_ft200_512_lr_0.0002__batch_8_/sliding"
    )


def test_without_the_mlflow_client_the_message_says_what_to_install(monkeypatch) -> None:
    import sys

    from jobs.transfer.mlflow_export import ExportError, _client

    monkeypatch.setitem(sys.modules, "mlflow.tracking", None)  # as if not installed
    with pytest.raises(ExportError, match=r"pip install 'posbench\[mlflow\]'"):
        _client("http://localhost:5000")


def test_a_cut_short_export_is_written_again(
    settings: Settings, tracking: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from jobs.transfer import mlflow_export as exporter

    study = seed_study(settings)
    client = MlflowClient(tracking_uri=tracking)
    real = MlflowClient.set_terminated
    calls = {"n": 0}

    def dies_on_the_second(self, run_id, *args, **kwargs):
        if "posbench.variant" not in self.get_run(run_id).data.tags:  # a parent, finished last
            calls["n"] += 1
            if calls["n"] == 2:
                raise ConnectionError("the server went away")
        return real(self, run_id, *args, **kwargs)

    monkeypatch.setattr(MlflowClient, "set_terminated", dies_on_the_second)
    with pytest.raises(ConnectionError):
        exporter.to_mlflow(settings.database, study, tracking_uri=tracking)
    monkeypatch.setattr(MlflowClient, "set_terminated", real)
    again = exporter.to_mlflow(settings.database, study, tracking_uri=tracking)
    # The finished one is kept; the one left RUNNING is deleted and written whole.
    assert (len(again.skipped), len(again.written)) == (1, 3)
    experiment = client.get_experiment_by_name("seeded")
    runs = client.search_runs([experiment.experiment_id])
    assert len(parents(client, experiment.experiment_id)) == 4 and len(runs) == 8
    assert {r.info.status for r in runs} == {"FINISHED"}
    assert all(r.data.metrics and r.data.params for r in runs)


def test_a_deleted_experiment_or_an_unreachable_server_is_named(
    settings: Settings, tracking: str
) -> None:
    study = seed_study(settings)
    client = MlflowClient(tracking_uri=tracking)
    client.delete_experiment(client.create_experiment("seeded"))
    deleted = export(settings, tracking, str(study))
    assert deleted.returncode == 2
    assert "the MLflow experiment 'seeded' is deleted: restore it in MLflow" in deleted.stderr
    env = isolated_env(
        settings.home, MLFLOW_HTTP_REQUEST_MAX_RETRIES="0", MLFLOW_HTTP_REQUEST_TIMEOUT="3"
    )
    secret = "http://alice:s3cret@127.0.0.1:9"  # nothing listens on port 9
    down = posbench_cli("export", str(study), "--tracking-uri", secret, env=env)
    assert down.returncode == 1 and "error: MLflow at http://127.0.0.1:9" in down.stderr
    assert "s3cret" not in down.stderr and "alice" not in down.stderr


def test_runs_exported_before_child_runs_existed_are_written_again(
    settings: Settings, tracking: str
) -> None:
    from jobs.transfer import mlflow_export as exporter

    study = seed_study(settings)
    exporter.to_mlflow(settings.database, study, tracking_uri=tracking)
    client = MlflowClient(tracking_uri=tracking)
    experiment = client.get_experiment_by_name("seeded")
    for run in client.search_runs([experiment.experiment_id]):
        if "posbench.variant" in run.data.tags:  # as an export of the previous version left it
            client.delete_run(run.info.run_id)
    again = exporter.to_mlflow(settings.database, study, tracking_uri=tracking)
    assert (len(again.written), len(again.skipped)) == (4, 0)
    assert len(client.search_runs([experiment.experiment_id])) == 8
