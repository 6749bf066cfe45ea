"""Finding 10 (bounded dashboard): the Compare page loaded every training point of a
study. Now each study's curves come from at most ``TRAIN_POINTS_PER_STUDY`` rows, each
run downsampled in the query with its first and last point kept."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import dashboard_settings
from dashboard_seed import SEEDED_SPEC, seed_study
from sqlalchemy import insert
from streamlit.testing.v1 import AppTest

from core.settings import Settings
from db import queries
from db.engine import engine_for, normalize_url
from db.models import TrainPoint
from jobs.service import submit


@pytest.fixture
def settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    yield from dashboard_settings(tmp_path, monkeypatch)


def store_points(url: str, counts: dict[int, int]) -> None:
    rows = [
        {
            "run_id": run_id,
            "step": 10 * step + 1,
            "loss": 5.0 - step / count,
            "lr": 1e-3,
            "tokens_per_second": 1000.0,
            "elapsed": float(step),
            "val_loss": None,
        }
        for run_id, count in counts.items()
        for step in range(count)
    ]
    with engine_for(normalize_url(url)).begin() as connection:
        connection.execute(insert(TrainPoint), rows)


def test_a_study_of_100k_training_points_loads_at_most_the_cap(settings: Settings) -> None:
    runs = submit(SEEDED_SPEC, settings=settings, send=lambda run_id: None, actor="tester").queued
    counts = dict(zip(runs, [33_000, 33_000, 30_000, 3_994, 3, 3], strict=True))
    assert sum(counts.values()) == 100_000
    store_points(settings.database, counts)

    cap = 1_000
    points = queries.train_points(settings.database, runs, max_per_study=cap)
    assert 0 < len(points) <= cap
    for run_id, count in counts.items():
        steps = points.loc[points["run_id"] == run_id, "step"].tolist()
        assert steps[0] == 1 and steps[-1] == 10 * (count - 1) + 1, run_id  # first and last
        assert steps == sorted(set(steps))
        assert len(steps) <= cap // len(runs)
        if count <= cap // len(runs):
            assert len(steps) == count  # a short run is loaded whole
    long_run = points.loc[points["run_id"] == runs[0], "step"].diff().dropna()
    assert long_run.iloc[:-1].nunique() == 1  # evenly strided: the curve keeps its shape
    # Without a cap (the CLI's exports), every point still loads.
    assert len(queries.train_points(settings.database, runs)) == 100_000


def test_the_cap_is_per_study(settings: Settings) -> None:
    first = submit(SEEDED_SPEC, settings=settings, send=lambda run_id: None, actor="tester").queued
    second = submit(SEEDED_SPEC, settings=settings, send=lambda run_id: None, actor="tester").queued
    store_points(settings.database, {run_id: 2_000 for run_id in [*first, *second]})
    points = queries.train_points(settings.database, [*first, *second], max_per_study=600)
    assert len(points[points["run_id"].isin(first)]) <= 600
    assert len(points[points["run_id"].isin(second)]) <= 600
    assert len(points) > 600  # each study its own share


def test_the_compare_page_asks_for_a_bounded_load(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    study = seed_study(settings)
    asked: list[int | None] = []
    unbounded = queries.train_points

    def spy(url: str, run_ids, max_per_study: int | None = None):
        asked.append(max_per_study)
        return unbounded(url, run_ids, max_per_study=max_per_study)

    monkeypatch.setattr(queries, "train_points", spy)

    def script() -> None:
        from dashboard import compare_page

        compare_page.render()

    app = AppTest.from_function(script, default_timeout=60)
    app.query_params["studies"] = str(study)
    app.run()
    assert not app.exception
    assert asked == [queries.TRAIN_POINTS_PER_STUDY]
    charts = [json.loads(chart.proto.spec) for chart in app.get("plotly_chart")]
    # The training chart: the one with validation lines.
    training = next(
        c for c in charts if any(t.get("name") == "rope (validation)" for t in c["data"])
    )
    trained = {t["name"]: t for t in training["data"] if t.get("mode") == "lines"}
    assert trained["rope"]["x"] == [20, 40]  # short runs load whole
