"""Compare's Diagnostics view in a real headless Chromium: a study run with
eval.diagnostics and the logn variant (a real `posbench run`), imported, and its
diagnostics drawn against length and as a layer x length heatmap."""

from __future__ import annotations

import json
import os
from pathlib import Path

from core.catalog.models import MODEL_PRESETS
from core.settings import Settings
from core.spec import parse_spec
from db.migrate import upgrade
from jobs.transfer.importer import import_results
from worker.run import prepared_task, resolve_device, run_study

from .browser import SCREENSHOTS, patient_page, require_chromium, running_dashboard

SPEC = {
    "name": "why-curves-bend",
    "model": "tiny",
    "train": {"length": 16, "steps": 6, "batch_size": 2},
    "encodings": ["nope", "alibi"],
    "eval": {"lengths": [16, 32, 64], "tokens": 256, "diagnostics": True, "variants": ["logn"]},
}


def test_the_diagnostics_view_draws_curves_and_a_layer_by_length_heatmap(tmp_path: Path) -> None:
    browser_path = require_chromium()
    from playwright.sync_api import expect

    settings = Settings(home=tmp_path / "home", database_url=f"sqlite:///{tmp_path}/pb.db")
    upgrade(settings.database)
    spec = parse_spec(SPEC)
    task = prepared_task(spec, settings.corpus_cache)
    results = run_study(spec, task=task, device=resolve_device(default="cpu")).to_dict()
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    import_results(path, actor="tester", settings=settings)

    env = {k: v for k, v in os.environ.items() if not k.startswith("POSBENCH_")}
    env.update({"POSBENCH_HOME": str(settings.home), "POSBENCH_DATABASE_URL": settings.database})
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    with running_dashboard(env) as base, patient_page(browser_path) as page:
        page.goto(f"{base}/compare?studies=1")
        expect(page.get_by_role("heading", name="Diagnostics")).to_be_visible()
        expect(page.get_by_text("attn_entropy against evaluation length")).to_be_visible()
        heatmap = page.get_by_text("attn_entropy by layer and evaluation length")
        expect(heatmap).to_be_visible()
        # The training length's column is named; a row per layer of the model,
        # a cell per length, each an entropy (> 0).
        chart = page.locator(".js-plotly-plot").filter(has=heatmap)
        expect(chart.get_by_text("16 (train)")).to_be_visible()
        drawn = chart.evaluate("plot => ({y: plot.data[0].y, z: plot.data[0].z})")
        layers = MODEL_PRESETS["tiny"]["n_layers"]
        assert drawn["y"] == [str(layer) for layer in range(layers)]
        assert [len(row) for row in drawn["z"]] == [3] * layers  # lengths 16, 32, 64
        assert all(value > 0 for row in drawn["z"] for value in row)
        page.get_by_role("combobox", name="Diagnostic").click()
        page.keyboard.type("attn_beyond_mass")
        page.keyboard.press("Enter")
        expect(page.get_by_text("attn_beyond_mass against evaluation length")).to_be_visible()
        expect(page.get_by_text("attn_beyond_mass by layer and evaluation length")).to_be_visible()
        page.get_by_text(
            "attn_beyond_mass by layer and evaluation length"
        ).scroll_into_view_if_needed()
        page.screenshot(path=SCREENSHOTS / "diagnostics.png", full_page=True)
    assert (SCREENSHOTS / "diagnostics.png").stat().st_size > 10_000
