"""Every number carries the protocol that scored it, with the settings that change what
it scores (issue 21): ``EvalSpec.protocol_label``, and the label in `posbench results`
(table and CSV), the MLflow tags and the Compare page's axis titles."""

from __future__ import annotations

import csv
import io
import json
import os

import pytest
from conftest import isolated_env, posbench_cli
from sqlalchemy import select
from streamlit.testing.v1 import AppTest

from core.spec import EvalSpec, parse_spec, protocol_title


def test_each_protocol_is_labelled_with_what_changes_its_numbers() -> None:
    spec = EvalSpec(
        lengths=[64, 128],
        protocols=["nonoverlapping", "sliding", "document", "decode"],
        stride=16,
        min_document_bytes=4096,
        window=48,
        sinks=4,
    )
    assert spec.protocol_label("nonoverlapping") == "nonoverlapping"
    assert spec.protocol_label("sliding") == "sliding (stride 16)"
    assert spec.protocol_label("document") == "document (documents >= 4096 bytes)"
    assert spec.protocol_label("decode") == "decode (keep cache, window 48, 4 sinks)"
    exact = EvalSpec(protocols=["decode"], cache_policy="rerotate")
    assert exact.protocol_label("decode") == "decode (rerotate cache)"
    keyed = EvalSpec(key_tokens={"short_context": 64, "beta": -2}, protocols=["sliding"], stride=8)
    assert keyed.protocol_label("sliding") == (
        "sliding (stride 8); key tokens: short context 64, alpha 2, beta -2"
    )
    assert EvalSpec(key_tokens={}).protocol_label("nonoverlapping") == (
        "nonoverlapping; key tokens: short context L, alpha 2"
    )
    plain = EvalSpec(protocols=["document", "decode"])
    assert plain.protocol_label("document") == "document"
    assert plain.protocol_label("decode") == "decode (keep cache)"


def test_studies_share_a_label_or_each_is_named() -> None:
    one = {"eval": {"protocols": ["sliding"], "stride": 16}}
    other = {"eval": {"protocols": ["sliding"], "stride": 32}}
    assert protocol_title([one, one], "sliding") == "sliding (stride 16)"
    assert protocol_title([one, other], "sliding") == (
        "sliding (settings differ by study: sliding (stride 16); sliding (stride 32))"
    )
    # A stored spec that no longer reads as one is the bare protocol, never an error.
    assert protocol_title([{"eval": {"lengths": "oops"}}], "sliding") == "sliding"
    assert protocol_title([None], "nonoverlapping") == "nonoverlapping"


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory):
    """A two-step lm study scored by three protocols, imported into a fresh home."""
    from core.settings import Settings, get_settings
    from db.migrate import upgrade
    from jobs.transfer.importer import import_results
    from worker.run import prepared_task, resolve_device, run_study

    spec = parse_spec(
        {
            "name": "labels",
            "model": "tiny",
            "train": {"length": 32, "steps": 2, "batch_size": 2},
            "encodings": ["alibi"],
            "eval": {
                "lengths": [32, 64],
                "protocols": ["nonoverlapping", "sliding", "document"],
                "stride": 16,
                "tokens": 512,
                "order_probe": False,
            },
        }
    )
    local = get_settings()
    task = prepared_task(spec, local.corpus_cache)
    payload = run_study(spec, task=task, device=resolve_device(default=local.device)).to_dict()
    folder = tmp_path_factory.mktemp("labels")
    path = folder / "results.json"
    path.write_text(json.dumps(payload))
    settings = Settings(home=folder / "home")
    upgrade(settings.database)
    import_results(path, actor="tester", settings=settings)
    return settings


def test_results_name_each_protocol_with_its_settings(imported) -> None:
    env = isolated_env(imported.home)
    shown = posbench_cli("results", "--study", "1", "--format", "csv", env=env)
    assert shown.returncode == 0, shown.stderr
    labels = {row["protocol_label"] for row in csv.DictReader(io.StringIO(shown.stdout))}
    assert labels == {"nonoverlapping", "sliding (stride 16)", "document"}
    table = posbench_cli("results", "--study", "1", env={**env, "COLUMNS": "200"})
    assert table.returncode == 0, table.stderr
    assert "sliding (stride 16)" in table.stdout


def test_mlflow_tags_name_each_protocol_with_its_settings(imported) -> None:
    from db.engine import transaction
    from db.models import Run, Study
    from jobs.transfer.mlflow_export import run_tags

    with transaction(imported.database) as session:
        study = session.scalars(select(Study)).one()
        run = session.scalars(select(Run)).one()
        tags = run_tags(study, run, ["none"])
    assert tags["posbench.protocol.sliding"] == "sliding (stride 16)"
    assert tags["posbench.protocol.document"] == "document"
    assert tags["posbench.protocol.nonoverlapping"] == "nonoverlapping"


def test_compare_titles_its_axis_with_the_protocol_and_its_settings(
    imported, monkeypatch: pytest.MonkeyPatch
) -> None:
    from core.settings import get_settings

    for name in list(os.environ):
        if name.startswith("POSBENCH_DASHBOARD_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("POSBENCH_HOME", str(imported.home))
    monkeypatch.setenv("POSBENCH_DATABASE_URL", imported.database)
    get_settings.cache_clear()

    def script() -> None:
        from dashboard import compare_page

        compare_page.render()

    try:
        app = AppTest.from_function(script, default_timeout=60)
        app.query_params["studies"] = "1"
        app.query_params["protocol"] = "sliding"
        app.run()
    finally:
        get_settings.cache_clear()
    assert not app.exception, app.exception
    curves = json.loads(app.get("plotly_chart")[0].proto.spec)
    assert curves["layout"]["yaxis"]["title"]["text"] == "perplexity (sliding (stride 16))"
    assert curves["layout"]["title"]["text"] == (
        "perplexity against evaluation length (sliding (stride 16))"
    )
