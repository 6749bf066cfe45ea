"""A study of a local HuggingFace model and a study of a posbench-trained model, through
the real queue (Redis), a real worker process and the database, then on one Compare
chart by bits per byte: both curves, each at its lengths (an hf: model's in its own
tokens, posbench's in bytes), the axis and a note saying so."""

from __future__ import annotations

import base64
import json
import math
from pathlib import Path

import numpy as np
import pytest
from hf_models import CONTEXT, save_model
from streamlit.testing.v1 import AppTest

from core.settings import get_settings
from core.spec import parse_spec
from db import queries
from jobs.service import submit

LENGTHS = [CONTEXT, 2 * CONTEXT]
EVAL = {"lengths": LENGTHS, "tokens": 512, "order_probe": False}


def numbers(values: list | dict) -> list[float]:
    """A Plotly trace's x or y as a list: the figure's JSON writes arrays as typed bytes."""
    if isinstance(values, list):
        return values
    return np.frombuffer(base64.b64decode(values["bdata"]), dtype=values["dtype"]).tolist()


def compare_page() -> None:
    from dashboard import compare_page

    compare_page.render()


def test_an_hf_model_and_a_trained_model_on_one_compare_chart(
    cluster_factory, sqlite_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    models = tmp_path / "models"
    save_model(models / "tiny-llama", "llama")
    cluster = cluster_factory(sqlite_url)
    # The worker's models roots, and the submitter's (checked at submit).
    cluster.extra_env["POSBENCH_MODELS_ROOTS"] = str(models)
    settings = cluster.settings.model_copy(update={"models_roots": [models.resolve()]})
    # The HF study: the model's context as train.length, nothing trained; the corpus
    # and task are the defaults, as the posbench study's.
    hf_spec = parse_spec(
        {"name": "tiny-llama", "model": {"hf": "tiny-llama"}, "train": {"length": CONTEXT}}
        | {"eval": EVAL}
    )
    own_spec = parse_spec(
        {
            "name": "posbench rope",
            "model": "tiny",
            "train": {"length": CONTEXT, "steps": 30, "batch_size": 4},
            "encodings": ["rope"],
            "eval": EVAL,
        }
    )
    assert hf_spec.task == own_spec.task and hf_spec.task.params["corpus"] == "pystdlib"
    cluster.start_worker()
    hf = submit(hf_spec, settings=settings, send=cluster.send, actor="tester").study_id
    own = submit(own_spec, settings=settings, send=cluster.send, actor="tester").study_id
    runs = cluster.wait_for(
        lambda runs: len(runs) == 2 and all(r.status == "done" for r in runs),
        timeout=150,
        what="both runs done",
    )
    by_label = {run.label: run for run in runs}
    assert by_label["hf:tiny-llama"].provenance["model"]["model_type"] == "llama"
    assert by_label["hf:tiny-llama"].total_steps == 0 and by_label["rope"].total_steps == 30
    stored = queries.curves(sqlite_url, study_ids=[hf, own])
    assert sorted(stored["eval_length"]) == sorted(LENGTHS * 2)
    assert stored["bits_per_byte"].between(0, 20).all()

    # Compare, both studies selected, by bits per byte.
    monkeypatch.setenv("POSBENCH_HOME", str(cluster.home))
    monkeypatch.setenv("POSBENCH_DATABASE_URL", sqlite_url)
    get_settings.cache_clear()
    try:
        app = AppTest.from_function(compare_page, default_timeout=60)
        app.query_params["studies"] = f"{hf},{own}"
        app.query_params["metric"] = "bits_per_byte"
        app.run()
    finally:
        get_settings.cache_clear()
    assert not app.exception
    assert app.selectbox(key="metric").value == "bits_per_byte"
    curves = json.loads(app.get("plotly_chart")[0].proto.spec)
    assert (
        curves["layout"]["title"]["text"]
        == "bits_per_byte against evaluation length (nonoverlapping)"
    )
    assert curves["layout"]["xaxis"]["title"]["text"] == (
        "evaluation length (tokens of each model: bytes for posbench's, its tokenizer's "
        "for an hf: model)"
    )
    lines = {t["name"]: t for t in curves["data"] if t.get("mode") == "lines+markers"}
    assert set(lines) == {f"hf:tiny-llama [study {hf}]", f"rope [study {own}]"}
    for name, study in ((f"hf:tiny-llama [study {hf}]", hf), (f"rope [study {own}]", own)):
        assert numbers(lines[name]["x"]) == LENGTHS
        expected = stored[stored["study_id"] == study].sort_values("eval_length")
        assert numbers(lines[name]["y"]) == pytest.approx(expected["bits_per_byte"].tolist())
        assert all(math.isfinite(y) and y > 0 for y in numbers(lines[name]["y"]))
    assert any("Bits per byte divides by the bytes of text" in c.value for c in app.caption)
