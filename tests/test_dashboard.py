"""Every dashboard page through Streamlit's AppTest, on a real SQLite database."""

from __future__ import annotations

import base64
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import yaml
from annotated_types import Ge, Le
from conftest import dashboard_settings
from dashboard_seed import seed_study
from sqlalchemy import update
from streamlit.testing.v1 import AppTest

from core.settings import get_settings
from core.spec import EvalSpec, ModelSpec, TrainSpec
from dashboard.submit_form import parse_seeds, spec_bounds
from db.engine import transaction
from db.models import Run
from worker.encodings import REGISTRY

APP = str(Path(__file__).resolve().parents[1] / "dashboard" / "app.py")


@pytest.fixture
def settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    yield from dashboard_settings(tmp_path, monkeypatch)


def page(name: str) -> AppTest:
    def script() -> None:
        import importlib

        import streamlit as st

        importlib.import_module(f"dashboard.{st.session_state['page']}_page").render()

    app = AppTest.from_function(script, default_timeout=60)
    app.session_state["page"] = name
    return app


def plain(markdown: str) -> str:
    """A markdown element's text as a viewer reads it (its backslash escapes undone)."""
    return re.sub(r"\\(.)", r"\1", markdown)


def figures(app: AppTest) -> list[dict]:
    return [json.loads(chart.proto.spec) for chart in app.get("plotly_chart")]


def test_submit_form_validates_inline_and_enqueues_nothing_while_invalid(settings) -> None:
    app = AppTest.from_file(APP, default_timeout=60).run()
    assert not app.exception
    assert app.title[0].value == "Submit a study"
    assert app.button(key="submit").disabled is False
    assert "runs x 600 steps" in app.info[0].value  # the cost estimate
    assert not app.warning
    app.multiselect(key="custom:lengths").set_value([256, 512]).run()
    assert "training length 128 is not among eval.lengths" in plain(app.warning[0].value)
    app.multiselect(key="custom:lengths").set_value([128, 256, 512, 1024]).run()
    assert not app.warning
    app.text_input(key="custom:seeds").set_value("0, x").run()
    assert "seeds: '0, x' is not a comma-separated list of integers" in plain(app.error[0].value)
    assert app.button(key="submit").disabled is True
    app.text_input(key="custom:seeds").set_value("0").run()
    app.multiselect(key="custom:encodings").set_value([]).run()
    assert any("encodings: must have at least 1 item" in plain(e.value) for e in app.error)
    assert app.button(key="submit").disabled is True
    app.multiselect(key="custom:encodings").set_value(["alibi"]).run()
    app.multiselect(key="custom:variants").set_value(["yarn:auto"]).run()
    assert any(
        "scales RoPE and applies to rope, xpos, ssmax, fope, local_global, irope" in plain(e.value)
        for e in app.error
    )
    app.multiselect(key="custom:variants").set_value([]).run()
    app.multiselect(key="custom:encodings").set_value(["rope"]).run()
    app.text_input(key="custom:finetuned").set_value("yarn+ft10").run()
    assert any(
        "variant 'yarn' with finetune needs a number factor" in plain(e.value) for e in app.error
    )
    app.text_input(key="custom:finetuned").set_value("yarn:2+ft10, pi:2+ft10@512").run()
    assert not app.error and "fine-tuning tokens" in app.info[0].value
    assert "- yarn:2+ft10\n" in app.code[0].value  # the variants go into the spec
    app.text_input(key="custom:finetuned").set_value("").run()
    app.multiselect(key="custom:encodings").set_value(["alibi"]).run()
    app.multiselect(key="custom:protocols").set_value(["sliding"]).run()
    app.number_input(key="custom:stride").set_value(4096).run()
    assert any(
        "eval.stride = 4096 exceeds the shortest evaluation length 128" in plain(e.value)
        for e in app.error
    )
    yaml_view = app.code[0].value
    assert "encodings:\n- alibi" in yaml_view and "stride: 4096" in yaml_view
    from db import queries

    assert queries.studies(settings.database).empty  # nothing was submitted


def test_presets_fill_the_form(settings, monkeypatch: pytest.MonkeyPatch) -> None:
    # The paper preset reads WikiText-103 from the hub: allowed here, or the form would
    # show the operator's refusal (tests/test_dashboard_hf.py) instead.
    monkeypatch.setenv("POSBENCH_HF_DATASETS", "true")
    get_settings.cache_clear()
    app = AppTest.from_file(APP, default_timeout=60).run()
    app.selectbox(key="preset").set_value("quick").run()
    assert app.multiselect(key="quick:encodings").value == [
        "nope",
        "sinusoidal",
        "learned",
        "rope",
        "alibi",
        "t5",
    ]
    assert app.number_input(key="quick:steps").value == 600
    assert not app.error and app.button(key="submit").disabled is False
    # Every preset draws, with its own task parameters (paper: WikiText-103, and FIRE,
    # whose threshold has a derived default).
    for preset in ("smoke", "paper"):
        app.selectbox(key="preset").set_value(preset).run()
        assert not app.exception, (preset, app.exception)
        assert not app.error and app.button(key="submit").disabled is False
    assert app.text_input(key="paper:lm.corpus").value == "hf:wikitext:wikitext-103-raw-v1"
    yaml_view = app.code[0].value
    assert "corpus: hf:wikitext:wikitext-103-raw-v1" in yaml_view
    assert "init_threshold" not in yaml_view  # left to its derived default
    assert "checkpoint_every: 1000" in yaml_view  # the preset's, not shown on the form
    assert "min_length" not in yaml_view
    app.number_input(key="paper:min_length").set_value(64).run()
    assert "min_length: 64" in app.code[0].value and not app.error
    app.number_input(key="paper:min_length").set_value(4096).run()
    assert any("train: min_length = 4096 exceeds length = 512" in plain(e.value) for e in app.error)


def test_the_soft_cap_reaches_the_spec_and_a_bad_one_is_refused(settings) -> None:
    app = AppTest.from_file(APP, default_timeout=60).run()
    assert "attn_softcap" not in app.code[0].value  # unset until asked for
    app.checkbox(key="custom:softcapped").check().run()
    assert "attn_softcap: 50.0" in app.code[0].value and not app.error
    app.number_input(key="custom:attn_softcap").set_value(0.0).run()
    assert any("attn_softcap" in plain(e.value) for e in app.error)
    assert app.button(key="submit").disabled is True


def test_encoding_parameters_come_from_the_registry(settings) -> None:
    app = AppTest.from_file(APP, default_timeout=60).run()
    app.multiselect(key="custom:encodings").set_value(["rope", "t5", "alibi"]).run()
    assert app.selectbox(key="custom:rope.rotary_fraction").options == ["0.25", "0.5", "1.0"]
    assert "window" not in app.code[0].value  # every encoding's window, unset until given
    app.selectbox(key="custom:rope.rotary_fraction").set_value(0.5).run()
    app.number_input(key="custom:t5.num_buckets").set_value(64).run()
    # ALiBi has no parameters of its own; its picker offers the window every encoding takes.
    app.number_input(key="custom:alibi.window").set_value(16).run()
    yaml_view = app.code[0].value
    assert "rotary_fraction: 0.5" in yaml_view and "num_buckets: 64" in yaml_view
    assert "name: alibi" in yaml_view and "window: 16" in yaml_view
    assert not app.error


# Every bounded number input of the Submit form (its key) and the spec field it stands
# for; encoding and task parameters are bounded by their registry entries instead.
SPEC_BOUNDED = {
    "d": (ModelSpec, "d_model"),
    "layers": (ModelSpec, "n_layers"),
    "heads": (ModelSpec, "n_heads"),
    "length": (TrainSpec, "length"),
    "steps": (TrainSpec, "steps"),
    "batch": (TrainSpec, "batch_size"),
    "warmup": (TrainSpec, "warmup"),
    "val_every": (TrainSpec, "val_every"),
    "min_length": (TrainSpec, "min_length"),
    "stride": (EvalSpec, "stride"),
    "tokens": (EvalSpec, "tokens"),
    "window": (EvalSpec, "window"),
    "sinks": (EvalSpec, "sinks"),
}


def form_bounds(app: AppTest) -> dict[str, tuple[float | None, float | None]]:
    """(min, max) of every bounded number input the custom form shows, all sections open."""
    app.selectbox(key="custom:model").set_value("custom").run()
    protocols = ["nonoverlapping", "sliding", "decode"]
    app.multiselect(key="custom:protocols").set_value(protocols).run()
    app.checkbox(key="custom:windowed").check().run()
    assert not app.exception, app.exception
    return {
        widget.key.removeprefix("custom:"): (widget.min, widget.max)
        for widget in app.number_input
        if "." not in widget.key and (widget.min is not None or widget.max is not None)
    }


def test_submit_form_bounds_are_the_specs(settings) -> None:
    bounds = form_bounds(AppTest.from_file(APP, default_timeout=60).run())
    assert set(bounds) == set(SPEC_BOUNDED)
    for key, (model, name) in SPEC_BOUNDED.items():
        rules = model.model_fields[name].metadata
        low = next(rule.ge for rule in rules if isinstance(rule, Ge))
        high = next(rule.le for rule in rules if isinstance(rule, Le))
        assert bounds[key] == (low, high), (key, name)
    # The learning rate's bound is strict (> 0): a number input cannot show it, so the
    # widget stays unbounded (it is not among the bounded ones above).
    with pytest.raises(TypeError, match="strict bound"):
        spec_bounds(TrainSpec, "lr")


def test_a_bound_changed_in_the_spec_changes_the_form(
    settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(TrainSpec.model_fields["steps"], "metadata", [Ge(ge=10), Le(le=5000)])
    monkeypatch.setattr(ModelSpec.model_fields["n_heads"], "metadata", [Ge(ge=2), Le(le=32)])
    bounds = form_bounds(AppTest.from_file(APP, default_timeout=60).run())
    assert bounds["steps"] == (10, 5000) and bounds["heads"] == (2, 32)


def test_queue_shows_progress_failures_and_provenance(settings) -> None:
    study = seed_study(settings)
    app = page("queue")
    app.query_params["study"] = str(study)
    app.run()
    assert not app.exception
    table = app.dataframe[0].value
    assert list(table["status"]) == ["done"] * 4 + ["running", "failed"]
    assert list(table["progress"]) == [1.0] * 4 + [0.5, 0.0]
    assert table["step"].iloc[4] == "20/40 steps" and table["ETA"].iloc[4] != ""
    assert any("failed: the training loss became nan" in plain(e.value) for e in app.error)
    assert "4 done" in app.caption[0].value and "1 running" in app.caption[0].value


def test_queue_shows_a_study_whose_runs_are_all_still_queued(settings) -> None:
    # Every loss and throughput is null (nothing ran yet, or every run was reused).
    from core.spec import parse_spec
    from jobs.service import submit

    spec = parse_spec({"model": "tiny", "train": {"length": 16}, "encodings": ["nope", "rope"]})
    study = submit(spec, settings=settings, send=lambda run_id: None, actor="tester").study_id
    app = page("queue")
    app.query_params["study"] = str(study)
    app.run()
    assert not app.exception, app.exception
    assert list(app.dataframe[0].value["status"]) == ["queued", "queued"]


def test_seeds_may_be_separated_by_commas_or_spaces() -> None:
    assert parse_seeds("0 1") == [0, 1]
    assert parse_seeds(" 1, 2  3,4 ") == [1, 2, 3, 4]
    with pytest.raises(ValueError):
        parse_seeds("1 x")


def test_queue_cancel_button_cancels_queued_runs(settings) -> None:
    from core.spec import parse_spec
    from jobs.service import submit

    spec = parse_spec({"model": "tiny", "train": {"length": 16}, "encodings": ["nope"]})
    study = submit(spec, settings=settings, send=lambda run_id: None, actor="tester").study_id
    app = page("queue")
    app.query_params["study"] = str(study)
    app.run()
    app.button(key="cancel").click().run()
    from db import queries

    assert list(queries.runs(settings.database, study_id=study)["status"]) == ["cancelled"]


def test_queue_deletes_a_finished_study_only_after_a_tick(settings) -> None:
    from db import queries

    study = seed_study(settings)
    app = page("queue")
    app.query_params["study"] = str(study)
    app.run()
    # One run is still running: no delete button, the reason instead.
    assert not [b for b in app.button if b.key == "delete"]
    assert any("has 1 run queued or running: cancel first" in plain(c.value) for c in app.caption)
    with transaction(settings.database) as session:
        session.execute(update(Run).where(Run.status == "running").values(status="cancelled"))
    app.run()
    assert app.button(key="delete").disabled  # not without the tick
    app.checkbox(key="delete-sure").check().run()
    app.button(key="delete").click().run()
    assert not app.exception, app.exception
    assert queries.studies(settings.database, [study]).empty
    assert "No study yet" in app.info[0].value


def test_compare_draws_curves_with_seed_intervals(settings) -> None:
    study = seed_study(settings)
    app = page("compare")
    app.query_params["studies"] = str(study)
    app.run()
    assert not app.exception
    curves, positions, training, diagnosed, heatmap = figures(app)
    # The Diagnostics view: entropy against length per line, and rope's (the first line
    # in the curves' order is alibi) per layer and length, the training length named.
    assert [t["name"] for t in diagnosed["data"] if t.get("mode") == "lines+markers"] == [
        "alibi",
        "rope",
    ]
    assert diagnosed["layout"]["yaxis"]["type"] == "linear"
    cells = heatmap["data"][0]
    assert cells["y"] == ["0", "1"] and cells["x"] == ["32 (train)", "64", "128"]
    assert cells["z"][0] == pytest.approx([2.0, 2.0 + 0.05 * math.log(2), 2.0 + 0.05 * math.log(4)])
    # The training loss of the runs behind the curves: mean over seeds, seeds as a band.
    trained = {t["name"]: t for t in training["data"] if t.get("mode") == "lines"}
    assert sorted(trained) == ["alibi", "rope"]
    assert trained["rope"]["x"] == [20, 40] and trained["rope"]["y"] == pytest.approx([3.1, 2.5])
    assert len([t for t in training["data"] if t.get("fill") == "toself"]) == 2
    # The validation loss where the runs validated (step 40 only): mean over seeds, dashed.
    validated = {t["name"]: t for t in training["data"] if t.get("mode") == "lines+markers"}
    assert sorted(validated) == ["alibi (validation)", "rope (validation)"]
    assert validated["rope (validation)"]["x"] == [40]
    assert validated["rope (validation)"]["y"] == pytest.approx([2.65])
    assert validated["rope (validation)"]["line"]["dash"] == "dash"
    lines = [t for t in curves["data"] if t.get("mode") == "lines+markers"]
    marker = [t for t in curves["data"] if t.get("name") == "train length 32"]
    assert marker and marker[0]["x"] == [32, 32]
    assert [t["name"] for t in lines] == ["alibi", "rope"]  # t5 has no finished evaluation
    bands = [t for t in curves["data"] if t.get("fill") == "toself"]
    assert len(bands) == 2  # two seeds: a 95% interval per line
    assert curves["layout"]["xaxis"]["type"] == "log" and curves["layout"]["yaxis"]["type"] == "log"
    assert {t["name"] for t in positions["data"]} == {"alibi", "rope"}
    # A line keeps its colour from one figure to the next.
    colour = {t["name"]: t["line"]["color"] for t in lines}
    assert {t["name"]: t["line"]["color"] for t in positions["data"]} == colour
    table = app.dataframe[0].value
    assert list(table.columns) == [32, 64, 128]
    assert table.loc["rope", 128] > table.loc["rope", 32]
    summaries = app.dataframe[1].value
    assert list(summaries.index) == ["alibi", "rope"]
    assert {"ratio 2x", "ratio 4x", "effective length", "order sensitivity"} <= set(summaries)
    # alibi never failed up to 128, the longest length: a lower bound.
    assert summaries.loc["alibi", "effective length"].startswith("≥ 128 [128, 128]")
    assert summaries.loc["rope", "effective length"].startswith("32 [32, 32]")
    assert summaries.loc["rope", "order sensitivity"].startswith("0.4")
    assert summaries.loc["alibi", "order sensitivity"].startswith("0.1")
    pairwise = app.dataframe[2].value
    assert pairwise[["a", "b"]].values.tolist() == [["alibi", "rope"]]
    assert pairwise["P(a wins)"].tolist() == [1.0]
    assert pairwise["paired"].tolist() == [True]
    assert pairwise["claim"].tolist() == [
        "alibi beats rope at 4x with probability 1.00 (2 paired seeds)"
    ]
    app.toggle(key="normalise").set_value(True).run()
    normalised = app.dataframe[0].value
    assert normalised[32].tolist() == pytest.approx([1.0, 1.0])
    assert app.query_params["normalise"] == ["1"] or app.query_params["normalise"] == "1"


def test_compare_keeps_the_selection_in_the_url(settings) -> None:
    study = seed_study(settings)
    app = page("compare")
    app.query_params["studies"] = str(study)
    app.query_params["metric"] = "bits_per_byte"
    app.run()
    assert app.selectbox(key="metric").value == "bits_per_byte"
    app.selectbox(key="metric").set_value("loss").run()
    assert app.query_params["metric"] in ("loss", ["loss"])


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_explore_renders_every_encoding(settings, name: str) -> None:
    app = page("explore")
    app.session_state["explore_encoding"] = name
    app.session_state["explore_length"] = 64
    app.session_state["explore_head_dim"] = 4  # the smallest head on offer
    app.run()
    assert not app.exception, app.exception
    drawn = figures(app)
    assert drawn and drawn[0]["data"]
    if REGISTRY[name].family == "bias":
        assert any(t.get("type") == "heatmap" for f in drawn for t in f["data"])
    if REGISTRY[name].scalable:
        names = {t["name"] for f in drawn for t in f["data"] if "name" in t}
        assert {"trained (none)", "pi (s=8)", "ntk (s=8)", "yarn (s=8)"} <= names
    # Log-n scaling applies to every encoding: its factor against the keys a query sees,
    # 1 up to L (the length, 64) and log n / log L past it.
    logn = next(t for f in drawn for t in f["data"] if t.get("name") == "logn factor, L = 64")
    factors = _values(logn["y"])
    assert (factors[:64] == 1.0).all()
    assert factors[127] == pytest.approx(math.log(128) / math.log(64))


def _values(array: object) -> np.ndarray:
    """A trace's values as Plotly's JSON has them: a list, or a typed array (base64)."""
    if isinstance(array, dict):
        return np.frombuffer(base64.b64decode(array["bdata"]), dtype=array["dtype"])
    return np.asarray(array)


def test_explore_shows_the_equivariance_error_of_every_encoding(settings) -> None:
    app = page("explore")
    app.run()
    assert not app.exception
    table = app.dataframe[-1].value.set_index("encoding")
    assert sorted(table.index) == sorted(REGISTRY)
    assert table.loc["nope", "bidirectional"] < 1e-5  # attention alone is set-like
    assert (table["causal"] > 0.05).all()


def test_password_gate(settings, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POSBENCH_DASHBOARD_PASSWORD", "s3cret")
    get_settings.cache_clear()
    app = AppTest.from_file(APP, default_timeout=60).run()
    assert [t.value for t in app.title] == ["posbench"]  # nothing else is shown
    assert [b.label for b in app.button] == ["Log in"]
    assert app.text_input[0].label == "Password"
    app.text_input[0].set_value("wrong")
    app.button[0].click().run()
    assert [e.value for e in app.error] == ["Wrong password."]
    assert "Submit a study" not in [t.value for t in app.title]
    app.text_input[0].set_value("s3cret")
    app.button[0].click().run()
    assert "Submit a study" in [t.value for t in app.title]


@pytest.mark.parametrize("value", ["1,\u00b2", "\u00b2", "9" * 5000, "-1,abc,,"])
def test_malformed_query_parameters_are_ignored(settings, value: str) -> None:
    seed_study(settings)
    for name, key in (("compare", "studies"), ("queue", "study")):
        app = page(name)
        app.query_params[key] = value
        app.run()
        assert not app.exception, (name, app.exception)


def test_every_variant_the_submit_form_offers_is_a_valid_spec() -> None:
    from core.spec import parse_spec
    from dashboard.submit_form import VARIANTS

    spec = parse_spec({"name": "all", "encodings": ["rope"], "eval": {"variants": VARIANTS}})
    offered = [v.split(":")[0] for v in VARIANTS]
    assert [v.method for v in spec.eval.variants] == ["none", *offered]


def test_an_algorithmic_task_with_its_options_is_chosen_on_submit(settings) -> None:
    app = AppTest.from_file(APP, default_timeout=60).run()
    app.selectbox(key="custom:task").set_value("addition").run()
    app.checkbox(key="custom:addition.reverse").check().run()
    assert not app.error and app.button(key="submit").disabled is False
    yaml_view = app.code[0].value
    assert "name: addition" in yaml_view and "reverse: true" in yaml_view
    assert "index_hints" not in yaml_view  # left at its default


def test_a_retrieval_task_s_numbers_are_bounded_by_the_catalogue_on_submit(settings) -> None:
    """niah on Submit: its number inputs carry the catalogue's bounds (a value out of them
    cannot be typed), and a multikey setting reaches the spec."""
    from core.catalog.tasks import TASKS

    app = AppTest.from_file(APP, default_timeout=60).run()
    app.selectbox(key="custom:task").set_value("niah").run()
    bounds = {p.name: (p.low, p.high) for p in TASKS["niah"].params if p.type is int}
    for name, (low, high) in bounds.items():
        box = app.number_input(key=f"custom:niah.{name}")
        assert (box.min, box.max) == (low, high), name
    app.number_input(key="custom:niah.num_keys").set_value(4).run()
    assert not app.error and app.button(key="submit").disabled is False
    assert "num_keys: 4" in app.code[0].value


def test_diagnostics_and_log_n_are_chosen_on_submit(settings) -> None:
    """The Submit form's attention diagnostics and log-n scaling reach the spec: the
    trained model with logn, and each chosen RoPE variant with it too."""
    app = AppTest.from_file(APP, default_timeout=60).run()
    app.multiselect(key="custom:variants").set_value(["ntk:auto"]).run()
    app.checkbox(key="custom:diagnostics").check().run()
    app.checkbox(key="custom:logn").check().run()
    assert not app.exception, app.exception
    assert not app.error and app.button(key="submit").disabled is False
    spec = yaml.safe_load(app.code[0].value)
    assert spec["eval"]["diagnostics"] is True
    assert spec["eval"]["variants"] == ["logn", "ntk:auto", "ntk:auto+logn"]


def test_the_attention_implementation_is_chosen_on_submit(settings) -> None:
    """Submit's attention choice reaches the spec (left out at auto, the default), with a
    preset and with custom sizes."""
    app = AppTest.from_file(APP, default_timeout=60).run()
    assert app.selectbox(key="custom:attn_implementation").value == "auto"
    assert yaml.safe_load(app.code[0].value)["model"] == "small"
    app.selectbox(key="custom:attn_implementation").set_value("flex_attention").run()
    assert not app.exception and not app.error, app.exception
    spec = yaml.safe_load(app.code[0].value)
    assert spec["model"] == {"preset": "small", "attn_implementation": "flex_attention"}
    app.selectbox(key="custom:model").set_value("custom").run()
    spec = yaml.safe_load(app.code[0].value)
    assert spec["model"]["attn_implementation"] == "flex_attention"
    assert spec["model"]["d_model"] == 128
    assert app.button(key="submit").disabled is False
