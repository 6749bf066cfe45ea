"""The dashboard with real parts: a valid submit through AppTest reaches Redis, and a real
headless Chromium drives `posbench up` from the Submit form to the Compare page, and opens
every page by its own URL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import redis
from streamlit.testing.v1 import AppTest

from core.settings import get_settings
from db import queries
from db.migrate import upgrade

from .browser import (
    SCREENSHOTS,
    free_port,
    patient_page,
    require_chromium,
    running_dashboard,
    wait_http,
)
from .conftest import ROOT

APP = str(ROOT / "dashboard" / "app.py")


def test_a_valid_submit_writes_the_study_and_enqueues_its_runs(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("POSBENCH_HOME", str(tmp_path))
    monkeypatch.setenv("POSBENCH_DATABASE_URL", f"sqlite:///{tmp_path}/dash.db")
    monkeypatch.setenv("POSBENCH_BROKER_URL", redis_url)
    get_settings.cache_clear()
    try:
        upgrade(get_settings().database)
        app = AppTest.from_file(APP, default_timeout=60).run()
        app.selectbox(key="preset").set_value("smoke").run()
        app.button(key="submit").click().run()
        assert not app.exception
        assert app.success[0].value == "Study 1 submitted: 3 runs queued."
        runs = queries.runs(get_settings().database, study_id=1)
        assert list(runs["label"]) == ["nope", "rope", "alibi"]
        assert list(runs["status"]) == ["queued"] * 3
        client = redis.Redis(unix_socket_path=redis_url.removeprefix("redis+socket://"))
        assert client.llen("gpu") == 3
    finally:
        get_settings.cache_clear()


def test_browser_submit_watch_compare() -> None:
    browser_path = require_chromium()
    from playwright.sync_api import expect

    home = Path(tempfile.mkdtemp(prefix="pb-ui-"))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("POSBENCH_")}
    env.update({"POSBENCH_HOME": str(home), "POSBENCH_DEVICE": "cpu", "PYTHONUNBUFFERED": "1"})
    up = subprocess.Popen(
        [sys.executable, "-m", "cli", "up", "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{base}/_stcore/health", timeout=90)
        with patient_page(browser_path) as page:
            page.goto(base)
            expect(page.get_by_text("Submit a study")).to_be_visible()
            page.get_by_role("combobox", name="Start from").click()
            page.get_by_role("option", name="smoke").click()
            expect(page.get_by_text("3 runs x 40 steps")).to_be_visible()
            page.screenshot(path=SCREENSHOTS / "submit.png", full_page=True)
            page.get_by_role("button", name="Submit").click()
            expect(page.get_by_text("Study 1 submitted: 3 runs queued.")).to_be_visible()
            page.get_by_text("Watch study 1 on the queue").click()
            expect(page.get_by_text("3 done", exact=False)).to_be_visible(timeout=300_000)
            page.screenshot(path=SCREENSHOTS / "queue.png", full_page=True)
            page.goto(f"{base}/compare?studies=1")
            expect(page.locator(".js-plotly-plot").first).to_be_visible()
            expect(page.get_by_text("perplexity against evaluation length")).to_be_visible()
            # Summaries the workers stored, and a claim with its probability.
            expect(page.get_by_role("heading", name="Summaries")).to_be_visible()
            expect(page.get_by_role("heading", name="Pairwise")).to_be_visible()
            expect(page.get_by_text("Summaries are stored as runs finish.")).to_have_count(0)
            page.screenshot(path=SCREENSHOTS / "compare.png", full_page=True)
            page.goto(f"{base}/explore")
            expect(page.locator(".js-plotly-plot").first).to_be_visible()
            expect(page.get_by_role("heading", name="Permutation equivariance")).to_be_visible()
            page.screenshot(path=SCREENSHOTS / "explore.png", full_page=True)
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(timeout=60)
    assert (SCREENSHOTS / "compare.png").stat().st_size > 10_000


# Every page by its own URL, and the heading it shows; "/" is the Submit page too.
PAGE_URLS = {
    "/": ("Submit", "Submit a study"),
    "/submit": ("Submit", "Submit a study"),
    "/queue": ("Queue", "Queue"),
    "/compare": ("Compare", "Compare"),
    "/explore": ("Explore", "Explore"),
}


def test_every_page_answers_at_its_own_url(tmp_path: Path) -> None:
    browser_path = require_chromium()
    from playwright.sync_api import expect

    database = f"sqlite:///{tmp_path}/posbench.db"
    upgrade(database)
    env = {k: v for k, v in os.environ.items() if not k.startswith("POSBENCH_")}
    env.update({"POSBENCH_HOME": str(tmp_path), "POSBENCH_DATABASE_URL": database})
    with running_dashboard(env) as base, patient_page(browser_path) as page:
        navigation = page.get_by_test_id("stSidebarNav").get_by_role("link")
        for path, (title, heading) in PAGE_URLS.items():
            page.goto(base + path)
            expect(page.get_by_role("heading", name=heading, level=1)).to_be_visible()
            # Streamlit says "Page not found" while the page runs: wait until it ran.
            expect(page.get_by_test_id("stApp")).to_have_attribute(
                "data-test-script-state", "notRunning"
            )
            expect(page.get_by_text("Page not found")).to_have_count(0)
            expect(page).to_have_url(f"{base}/{title.lower()}")  # "/" shows /submit
            # Each page is listed once, and the one shown is marked.
            expect(navigation).to_have_text(["Submit", "Queue", "Compare", "Explore"])
            expect(navigation.and_(page.locator("[aria-current=page]"))).to_have_text(title)
