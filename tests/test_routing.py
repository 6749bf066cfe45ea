"""Which queue a study goes to, and the word when no live worker serves it: the rule
(``jobs.routing``) and the Submit page. The CLI against a real worker is in
tests/integration/test_queue_routing.py, the compose stack in tests/cluster."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import dashboard_settings
from streamlit.testing.v1 import AppTest

from core.settings import Settings
from core.spec import parse_spec, preset_spec
from jobs.routing import live_queues, preferred_queue, route

APP = str(Path(__file__).resolve().parents[1] / "dashboard" / "app.py")


def test_a_spec_that_names_no_queue_goes_to_one_with_live_workers() -> None:
    spec = preset_spec("smoke")
    assert "queue" not in spec.model_fields_set
    cpu_only = route(spec, {"cpu": 2})
    assert (cpu_only.queue, cpu_only.chosen) == ("cpu", True)
    assert cpu_only.apply(spec).queue == "cpu" and spec.queue == "gpu"
    assert "queue 'cpu'" in cpu_only.note() and cpu_only.warning() is None
    assert route(spec, {"gpu": 1, "cpu": 2}).queue == "gpu"  # gpu first
    # Nothing known, or no worker anywhere: the default, and no choice claimed.
    for served in (None, {}):
        routing = route(spec, served)
        assert (routing.queue, routing.chosen, routing.note()) == ("gpu", False, None)


def test_a_named_queue_is_kept_and_flagged_when_no_live_worker_serves_it() -> None:
    spec = parse_spec({"name": "named", "model": "tiny", "encodings": ["rope"], "queue": "gpu"})
    routing = route(spec, {"cpu": 2})
    assert (routing.queue, routing.chosen, routing.note()) == ("gpu", False, None)
    assert routing.warning() == (
        "no live worker serves queue 'gpu': its runs wait there until one does; "
        "queues with live workers: cpu (2 workers)"
    )
    assert "cpu (1 worker)" in route(spec, {"cpu": 1}).warning()
    assert "no worker answered on any queue" in route(spec, {}).warning()
    assert route(spec, None).warning() is None  # the broker could not be asked
    assert route(spec, {"gpu": 1}).warning() is None


def test_preferred_queue_follows_the_queue_order() -> None:
    assert preferred_queue({"cpu": 1}) == "cpu"
    assert preferred_queue({"gpu": 3, "cpu": 1}) == "gpu"
    assert preferred_queue(None) == preferred_queue({}) == "gpu"
    assert preferred_queue({}, default="cpu") == "cpu"


@pytest.mark.slow
def test_an_unreachable_broker_is_not_known_rather_than_empty(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path, broker_url="redis://127.0.0.1:1/0")
    assert live_queues(settings) is None


@pytest.fixture
def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The Submit page with live workers on the cpu queue only."""
    from dashboard.common import served_queues

    yield from dashboard_settings(tmp_path, monkeypatch)
    served_queues.clear()


def test_the_submit_page_picks_a_served_queue_and_flags_one_without_workers(
    served, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dashboard.common import served_queues

    served_queues.clear()
    monkeypatch.setattr("jobs.routing.live_queues", lambda: {"cpu": 2})
    app = AppTest.from_file(APP, default_timeout=60).run()
    assert not app.exception
    assert app.selectbox(key="custom:queue").value == "cpu"
    assert not app.warning
    app.selectbox(key="custom:queue").set_value("gpu").run()
    # The markdown's escapes undone: the text a viewer reads.
    (warning,) = [re.sub(r"\\(.)", r"\1", w.value) for w in app.warning]
    assert "queue 'gpu'" in warning and "cpu (2 workers)" in warning
