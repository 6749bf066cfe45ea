"""A study per task family - retrieval, tracing, aggregation - through the real queue
(Redis), one real worker process and the database, then on the Compare page in a real
headless Chromium: each study's accuracy curve, and the heatmaps of the tasks whose
examples are grouped (a retrieval task's needle depth against the evaluation length).

The models are tiny and train a few steps: accuracy does not matter here, only that
every family goes from Submit's spec to a chart someone can read.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

from core.spec import parse_spec
from jobs.service import submit

from .browser import SCREENSHOTS, free_port, patient_page, require_chromium, wait_http
from .conftest import ROOT


class Family(NamedTuple):
    """One study: its task and parameters, its training length (evaluated at 1x and 2x),
    the title of the heatmap Compare draws for it (None: no grouped examples), and more
    training settings where the task needs them (``train.min_length``)."""

    task: str
    params: dict[str, Any]
    length: int
    heatmap: str | None = None
    train: Mapping[str, Any] = MappingProxyType({})


# One study per task (a study has one task): retrieval, tracing, aggregation and
# algorithmic (addition trained over a range of lengths, its operand grid on Compare).
FAMILIES = [
    Family(
        "niah",
        {"haystack": "needles", "num_keys": 2},
        128,
        "accuracy by depth and evaluation length",
    ),
    Family("variable_tracking", {}, 256),
    Family("common_words", {}, 320),
    Family("addition", {"reverse": True}, 64, "accuracy by operand lengths", {"min_length": 16}),
]


def study(family: Family) -> dict[str, Any]:
    return {
        "name": f"family {family.task}",
        "model": "tiny",
        "task": {"name": family.task, "params": family.params},
        "encodings": ["rope"],
        "train": {
            "length": family.length,
            "steps": 4,
            "batch_size": 2,
            "val_every": 4,
            **family.train,
        },
        "eval": {"lengths": [family.length, 2 * family.length], "examples": 8},
    }


def test_a_study_per_family_through_the_queue_onto_compare(
    cluster_factory, sqlite_url: str
) -> None:
    browser_path = require_chromium()
    from playwright.sync_api import expect

    started = time.monotonic()
    cluster = cluster_factory(sqlite_url)
    # Submitted together before the worker starts: one worker takes them in turn.
    ids = [
        submit(
            parse_spec(study(f)), settings=cluster.settings, send=cluster.send, actor="tester"
        ).study_id
        for f in FAMILIES
    ]
    port = free_port()
    env = {**cluster.env, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "cli", "dashboard", "--port", str(port)]
    dashboard = subprocess.Popen(
        [*command, "--address", "127.0.0.1"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    try:
        cluster.start_worker()
        cluster.wait_for(
            lambda runs: len(runs) == len(FAMILIES) and all(r.status == "done" for r in runs),
            timeout=240,
            what="every family's run done",
        )
        trained = time.monotonic()
        wait_http(f"{base}/_stcore/health", timeout=90)
        with patient_page(browser_path) as page:
            for family, study_id in zip(FAMILIES, ids, strict=True):
                page.goto(f"{base}/compare?studies={study_id}")
                expect(page.get_by_test_id("stApp")).to_have_attribute(
                    "data-test-script-state", "notRunning"
                )
                titles = page.locator(".js-plotly-plot .gtitle")
                expect(titles.filter(has_text="accuracy against evaluation length")).to_have_count(
                    1
                )
                if family.heatmap is not None:
                    heatmap = page.locator(".js-plotly-plot").filter(
                        has=page.locator(".gtitle", has_text=family.heatmap)
                    )
                    expect(heatmap).to_have_count(1)  # one line: rope
                    heatmap.scroll_into_view_if_needed()
                    # Plotly draws a heatmap's cells as an image, their values as text.
                    expect(heatmap.locator("g.hm image")).to_have_count(1)
                    expect(heatmap.locator(".colorbar")).to_have_count(1)
                    cells = heatmap.locator("g.heatmap-label text")
                    expect(cells.first).to_be_visible()
                    values = cells.all_text_contents()
                    # A cell per (row, length) at least; each an accuracy in [0, 1].
                    assert len(values) >= 2 * 2, values
                    assert all(re.fullmatch(r"0\.\d\d|1\.00", v) for v in values), values
                page.screenshot(path=SCREENSHOTS / f"compare-{family.task}.png", full_page=True)
    finally:
        dashboard.send_signal(signal.SIGINT)
        dashboard.wait(timeout=60)
    print(
        f"{len(FAMILIES)} studies: trained and evaluated in {trained - started:.0f} s, "
        f"test {time.monotonic() - started:.0f} s"
    )
