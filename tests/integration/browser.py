"""Helpers for the tests that drive a real dashboard in headless Chromium: find the
browser (under CI=true a missing one fails the test instead of skipping it), launch it,
pick a free loopback port, wait for the server."""

from __future__ import annotations

import shutil
import socket
import time
import urllib.request
from typing import TYPE_CHECKING

import pytest

from .conftest import IN_CI, ROOT

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Playwright

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
