"""The dashboard and HuggingFace model folders: the Submit page lists the folders under
the models roots (bounded, never through a link out of them), makes a ``model: {hf:
NAME}`` study from the chosen one and submits it; Compare says what the lengths of a
view that mixes an hf: model and posbench's models count."""

from __future__ import annotations

import base64
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import dashboard_settings
from dashboard_seed import seed_study
from hf_models import CONTEXT, save_model
from sqlalchemy import select
from streamlit.testing.v1 import AppTest

from core.catalog import hf_models
from core.catalog.hf_models import ModelPolicy, locate_model, model_folders
from core.catalog.tasks import TASKS
from core.settings import get_settings
from core.spec import parse_spec
from db import queries
from db.engine import transaction
from db.models import Study

APP = str(Path(__file__).resolve().parents[1] / "dashboard" / "app.py")
TEXT_TASKS = [name for name, task in TASKS.items() if task.text]


@pytest.fixture(scope="module")
def models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A models root with a tiny Llama (RoPE) and a tiny GPT-2 (learned positions)."""
    root = tmp_path_factory.mktemp("models")
    save_model(root / "tiny-llama", "llama")
    save_model(root / "tiny-gpt2", "gpt2")
    return root


@pytest.fixture
def settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, models_root: Path):
    for _ in dashboard_settings(tmp_path, monkeypatch):
        monkeypatch.setenv("POSBENCH_MODELS_ROOTS", str(models_root))
        get_settings.cache_clear()
        yield get_settings()


def numbers(values: list | dict) -> list[float]:
    """A Plotly trace's x or y as a list: the figure's JSON writes arrays as typed bytes."""
    if isinstance(values, list):
        return values
    return np.frombuffer(base64.b64decode(values["bdata"]), dtype=values["dtype"]).tolist()


def plain(markdown: str) -> str:
    return re.sub(r"\\(.)", r"\1", markdown)


def hf_submit_page() -> AppTest:
    app = AppTest.from_file(APP, default_timeout=60).run()
    app.radio(key="source").set_value("hf").run()
    assert not app.exception, app.exception
    return app


# -- the listing ----------------------------------------------------------------------------


def _config(folder: Path, model_type: str = "llama") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    return folder


def test_the_listing_is_the_folders_with_a_config_inside_the_roots(tmp_path: Path) -> None:
    first, second, outside = tmp_path / "first", tmp_path / "second", tmp_path / "outside"
    _config(first / "alpha")
    (first / "beta").mkdir()  # no config.json
    (first / "notes.txt").write_text("not a folder")
    _config(first / ".cache")  # hidden
    _config(first / "bad\x1bname")  # not printable: model.hf could not name it
    (first / "away").symlink_to(_config(outside / "model"))  # a link out of the roots
    _config(outside / "leak")
    (first / "leaky").mkdir()
    (first / "leaky" / "config.json").symlink_to(outside / "leak" / "config.json")
    (first / "gamma").symlink_to(first / "alpha")  # inside: the same folder, listed once
    _config(second / "alpha")  # the name an earlier root holds: listed by its path
    _config(second / "delta")
    policy = ModelPolicy(roots=(first.resolve(), second.resolve()))
    folders, more = model_folders(policy)
    assert not more
    assert [(f.name, f.spec_name) for f in folders] == [
        ("alpha", "alpha"),
        ("alpha", str(second.resolve() / "alpha")),
        ("delta", "delta"),
    ]
    # What model.hf says finds the folder listed, as submit and the worker will.
    for folder in folders:
        assert locate_model(folder.spec_name, policy).folder == folder.folder
    # At most `limit` folders, and at most MAX_SCANNED entries of one root looked at.
    assert model_folders(policy, limit=2) == (folders[:2], True)
    assert model_folders(ModelPolicy(roots=(second.resolve(),)), limit=2)[1] is False
    many = tmp_path / "many"
    for name in ("one", "two", "three"):
        _config(many / name)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hf_models, "MAX_SCANNED", 2)
        listed, more = model_folders(ModelPolicy(roots=(many.resolve(),)))
        assert len(listed) == 2 and more
    # A root that does not exist lists nothing.
    assert model_folders(ModelPolicy(roots=(tmp_path / "missing",))) == ([], False)


# -- the Submit page ------------------------------------------------------------------------


def test_submit_lists_the_model_folders_and_submits_an_hf_study(
    settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: list[int] = []
    monkeypatch.setattr(
        "jobs.service.celery_send", lambda run_id, settings=None: sent.append(run_id)
    )
    app = hf_submit_page()
    folder = app.selectbox(key="hf:folder")
    assert folder.options == ["tiny-gpt2", "tiny-llama"]
    folder.set_value(1).run()
    assert not app.error and not app.exception
    captions = [plain(c.value) for c in app.caption]
    assert any(
        f"original context {CONTEXT} tokens (max_position_embeddings)" in c for c in captions
    )
    # RoPE: the scalings its rotary width (16) allows are offered.
    variants = app.multiselect(key="hf:tiny-llama:variants")
    assert "yarn:auto" in variants.options and "ntk:auto" in variants.options
    assert app.text_input(key="hf:tiny-llama:lm.corpus").value == "pystdlib"
    # Every task whose examples are text, language modelling first (the default).
    tasks = app.selectbox(key="hf:tiny-llama:task")
    assert [o.partition(":")[0] for o in tasks.options] == TEXT_TASKS and tasks.value == "lm"
    variants.set_value(["yarn:auto"]).run()
    app.multiselect(key="hf:tiny-llama:lengths").set_value([CONTEXT, 2 * CONTEXT]).run()
    app.number_input(key="hf:tiny-llama:tokens").set_value(256).run()
    yaml_view = app.code[0].value
    assert "model:\n  hf: tiny-llama\n" in yaml_view and f"length: {CONTEXT}" in yaml_view
    assert "encodings" not in yaml_view and "steps" not in yaml_view
    assert "1 run: hf:tiny-llama evaluated as it is (no training)" in app.info[0].value
    app.button(key="submit").click().run()
    assert not app.exception and not app.error
    assert app.success[0].value == "Study 1 submitted: 1 runs queued."
    (run,) = queries.runs(settings.database, study_id=1).to_dict("records")
    assert (run["label"], run["status"]) == ("hf:tiny-llama", "queued")
    assert sent == [run["id"]]
    with transaction(settings.database) as session:
        stored = session.scalars(select(Study)).one().spec
    assert stored["model"]["hf"] == "tiny-llama" and stored["train"]["length"] == CONTEXT
    study = parse_spec(stored)
    assert study.train.steps == 0 and study.encodings == [] and study.eval.lengths == [32, 64]
    assert [v.label for v in study.eval.variants] == ["none", "yarn:auto"]


def test_a_synthetic_task_is_submitted_for_an_hf_model(
    settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: list[int] = []
    monkeypatch.setattr(
        "jobs.service.celery_send", lambda run_id, settings=None: sent.append(run_id)
    )
    app = hf_submit_page()
    app.selectbox(key="hf:folder").set_value(1).run()
    app.selectbox(key="hf:tiny-llama:task").set_value("passkey").run()
    assert "hf:tiny-llama:lm.corpus" not in [t.key for t in app.text_input]
    # The spec's own rules on the form: a pass key needs room (the tiny model's L is 32).
    (error,) = app.error
    assert "passkey' needs sequences of at least 128 tokens" in plain(error.value)
    app.multiselect(key="hf:tiny-llama:lengths").set_value([4 * CONTEXT, 8 * CONTEXT]).run()
    assert not app.error and not app.exception
    assert "task:\n  name: passkey\n" in app.code[0].value
    app.button(key="submit").click().run()
    assert not app.exception and not app.error
    assert app.success[0].value == "Study 1 submitted: 1 runs queued."
    (run,) = queries.runs(settings.database, study_id=1).to_dict("records")
    assert (run["label"], run["status"]) == ("hf:tiny-llama", "queued") and sent == [run["id"]]
    with transaction(settings.database) as session:
        study = parse_spec(session.scalars(select(Study)).one().spec)
    assert (study.task.name, study.model.hf, study.train.length) == ("passkey", "tiny-llama", 32)
    assert study.eval.lengths == [4 * CONTEXT, 8 * CONTEXT] and study.train.steps == 0


def test_a_model_without_rope_is_offered_no_scalings(settings) -> None:
    app = hf_submit_page()
    app.selectbox(key="hf:folder").set_value(0).run()
    assert not app.error and app.button(key="submit").disabled is False
    assert "hf:tiny-gpt2:variants" not in [m.key for m in app.multiselect]
    assert any(plain(c.value) == "No RoPE scalings: gpt2 has no RoPE." for c in app.caption)
    assert "hf: tiny-gpt2" in app.code[0].value


def test_a_folder_posbench_cannot_evaluate_is_refused_on_the_form(
    settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "other-models"
    _config(root / "a-bert", model_type="bert")
    monkeypatch.setenv("POSBENCH_MODELS_ROOTS", str(root))
    get_settings.cache_clear()
    app = hf_submit_page()
    assert app.selectbox(key="hf:folder").options == ["a-bert"]
    assert "model_type 'bert' is not one posbench evaluates" in plain(app.error[0].value)
    assert app.button(key="submit").disabled is True
    assert not app.code  # no spec to show


def test_without_model_folders_it_says_where_to_put_them(
    settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    empty = tmp_path / "empty-models"
    empty.mkdir()
    monkeypatch.setenv("POSBENCH_MODELS_ROOTS", str(empty))
    get_settings.cache_clear()
    app = hf_submit_page()
    (line,) = [plain(i.value) for i in app.info]
    assert line == (
        "No HuggingFace model folder found: put one (config.json, safetensors weights, "
        f"tokenizer) directly under a models root (POSBENCH_MODELS_ROOTS: {empty.resolve()})."
    )
    assert not app.button and not app.code
    # Back to posbench's own models: the usual form.
    app.radio(key="source").set_value("posbench").run()
    assert app.button(key="submit").disabled is False


# -- Compare --------------------------------------------------------------------------------


def _stored_hf_study(settings) -> int:
    """An hf: study submitted and finished as a worker records it (bits per byte below
    the loss / ln 2: a token covers more than a byte)."""
    from core.results_schema import Evaluation
    from core.status import RunStatus
    from jobs import lifecycle
    from jobs.service import submit
    from worker.runtime import store

    spec = parse_spec(
        {
            "name": "hf",
            "model": {"hf": "tiny-llama"},
            "train": {"length": CONTEXT},
            "eval": {"lengths": [32, 64, 128], "order_probe": False},
        }
    )
    submitted = submit(spec, settings=settings, send=lambda run_id: None, actor="tester")
    claimed = lifecycle.claim(settings.database, submitted.queued[0], "seed")
    for length, loss in ((32, 4.0), (64, 4.5)):
        evaluation = Evaluation(
            "none",
            "nonoverlapping",
            length,
            loss=loss,
            perplexity=math.exp(loss),
            bits_per_byte=loss / math.log(2) / 3,
            tokens=512,
        )
        store.record_evaluation(claimed, evaluation)
    far = Evaluation("none", "nonoverlapping", 128, not_applicable="past the model's limit")
    store.record_evaluation(claimed, far)
    lifecycle.finish(claimed, RunStatus.DONE)
    return submitted.study_id


def test_compare_says_what_the_lengths_of_each_model_count(settings) -> None:
    own, hf = seed_study(settings), _stored_hf_study(settings)

    def script() -> None:
        from dashboard import compare_page

        compare_page.render()

    app = AppTest.from_function(script, default_timeout=60)
    app.query_params["studies"] = f"{own},{hf}"
    app.query_params["metric"] = "bits_per_byte"
    app.run()
    assert not app.exception
    curves = json.loads(app.get("plotly_chart")[0].proto.spec)
    axis = curves["layout"]["xaxis"]["title"]["text"]
    assert axis == (
        "evaluation length (tokens of each model: bytes for posbench's, its tokenizer's "
        "for an hf: model)"
    )
    lines = {t["name"]: t for t in curves["data"] if t.get("mode") == "lines+markers"}
    assert numbers(lines[f"hf:tiny-llama [study {hf}]"]["x"]) == [32, 64]
    assert numbers(lines[f"hf:tiny-llama [study {hf}]"]["y"]) == pytest.approx(
        [4.0 / math.log(2) / 3, 4.5 / math.log(2) / 3]
    )
    assert numbers(lines[f"rope [study {own}]"]["x"]) == [32, 64, 128]
    assert any("Bits per byte divides by the bytes of text" in c.value for c in app.caption)
    assert any(
        plain(c.value) == "Not applicable: hf:tiny-llama at 128: past the model's limit"
        for c in app.caption
    )
    positions = json.loads(app.get("plotly_chart")[1].proto.spec)
    assert positions["layout"]["yaxis"]["title"]["text"] == "loss (nats / token of each model)"
    # posbench's models alone: their lengths are bytes, and no note.
    alone = AppTest.from_function(script, default_timeout=60)
    alone.query_params["studies"] = str(own)
    alone.run()
    spec = json.loads(alone.get("plotly_chart")[0].proto.spec)
    assert spec["layout"]["xaxis"]["title"]["text"] == "evaluation length (bytes)"
    assert not any("Bits per byte divides" in c.value for c in alone.caption)
    positions = json.loads(alone.get("plotly_chart")[1].proto.spec)
    assert positions["layout"]["yaxis"]["title"]["text"] == "loss (nats / byte)"


def test_a_spec_the_service_would_refuse_shows_its_refusal_not_its_notes(settings) -> None:
    # A corpus outside the corpus roots: refused at submit, so the form says so at once,
    # without the spec's note (no length at 1x), and the button stays off.
    app = hf_submit_page()
    app.selectbox(key="hf:folder").set_value(1).run()
    app.multiselect(key="hf:tiny-llama:lengths").set_value([2 * CONTEXT]).run()
    assert any("Note" in w.value for w in app.warning)  # while the spec may run
    app.text_input(key="hf:tiny-llama:lm.corpus").set_value("text:/etc/hostname").run()
    assert not app.exception, app.exception
    errors = [plain(e.value) for e in app.error]
    assert any("not inside the corpus roots" in e for e in errors), errors
    assert not any("Note" in w.value for w in app.warning)
    assert app.button(key="submit").disabled
