"""Helpers for the tests that drive a real dashboard in headless Chromium: find the
browser (under CI=true a missing one fails the test instead of skipping it), launch it,
pick a free loopback port, wait for the server."""

from __future__ import annotations

import contextlib
import shutil
import socket
import time
import urllib.request
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from .conftest import IN_CI, ROOT

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page, Playwright

SCREENSHOTS = ROOT / ".posbench" / "screenshots"


def chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def require_chromium() -> str:
    found = chromium()
    if found is None:
        message = "no Chromium: apt-get install chromium (or run .ci/run, which installs it)"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    return found


def launch(playwright: Playwright, browser_path: str) -> Browser:
    return playwright.chromium.launch(
        executable_path=browser_path,
        headless=True,
        args=[
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--disable-background-networking",
            "--disable-component-update",
            "--no-first-run",
        ],
    )


# How long actions and assertions wait on a page: on a loaded 2-core machine the plotly
# bundle alone can take longer than expect()'s 5 s default.
PATIENCE_MS = 60_000
EXPECT_DEFAULT_MS = 5_000


@contextlib.contextmanager
def patient_page(browser_path: str) -> Iterator[Page]:
    """A 1400 x 1000 page of a headless Chromium whose actions and expect() assertions
    wait up to PATIENCE_MS; expect()'s default is restored and the browser closed after."""
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as playwright:
        browser = launch(playwright, browser_path)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(PATIENCE_MS)
            expect.set_options(timeout=PATIENCE_MS)
            yield page
        finally:
            expect.set_options(timeout=EXPECT_DEFAULT_MS)
            browser.close()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_http(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer")


@contextlib.contextmanager
def running_dashboard(env: dict[str, str]) -> Iterator[str]:
    """`posbench dashboard` of this checkout on a free loopback port with ``env`` (its
    settings; PYTHONPATH is set to the checkout), answering: its base URL. Stopped with
    SIGINT on leaving."""
    import signal
    import subprocess
    import sys

    port = free_port()
    command = ["dashboard", "--port", str(port), "--address", "127.0.0.1"]
    dashboard = subprocess.Popen(
        [sys.executable, "-m", "cli", *command],
        cwd=ROOT,
        env={**env, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{base}/_stcore/health", timeout=90)
        yield base
    finally:
        dashboard.send_signal(signal.SIGINT)
        dashboard.wait(timeout=60)
