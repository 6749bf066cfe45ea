"""Accuracy by group as grids: ``core.analysis.group_grid`` on hand-made frames (every
mean worked out on paper), then the Compare page's heatmaps through AppTest on a real
SQLite database seeded with evaluations whose groups a retrieval task (``depth=``) and
an addition (``i= j=``) would report."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import dashboard_settings
from markdown_it import MarkdownIt
from sqlalchemy import update
from streamlit.testing.v1 import AppTest

from core.analysis import EVAL_LENGTH, group_grid, group_keys
from core.results_schema import Evaluation
from core.spec import parse_spec
from core.status import RunStatus
from db.engine import transaction
from db.models import Run
from jobs import lifecycle
from jobs.service import submit
from worker.runtime import store


def rows(*records: tuple[str, int, int, dict | None]) -> pd.DataFrame:
    return pd.DataFrame(
        {"line": line, "run_id": run, "eval_length": length, "groups": groups}
        for line, run, length, groups in records
    )


# --- group_grid ----------------------------------------------------------------------


def test_depth_by_length_averages_other_keys_then_seeds() -> None:
    frame = rows(
        # rope, seed 0 (run 1) and seed 1 (run 2); sov_tr-like labels with a second key.
        (
            "rope",
            1,
            64,
            {"variant=a depth=0": 1.0, "variant=b depth=0": 0.5, "variant=a depth=1": 0.0},
        ),
        (
            "rope",
            2,
            64,
            {"variant=a depth=0": 0.0, "variant=b depth=0": 0.0, "variant=a depth=1": 1.0},
        ),
        ("rope", 1, 128, {"variant=a depth=0.5": 0.25}),
        ("alibi", 3, 128, {"variant=a depth=1": 0.5, "variant=b depth=1": 1.0}),
    )
    grids = group_grid(frame, rows="depth", columns=EVAL_LENGTH)
    assert list(grids) == ["rope", "alibi"]  # first-seen order
    rope, alibi = grids["rope"], grids["alibi"]
    # Numeric order (0, 0.5, 1), the union of every line's values, NaN where missing.
    assert rope.index.tolist() == [0, 0.5, 1] and alibi.index.tolist() == [0, 0.5, 1]
    assert rope.columns.tolist() == [64, 128] and alibi.columns.tolist() == [64, 128]
    assert (rope.index.name, rope.columns.name) == ("depth", EVAL_LENGTH)
    # depth 0 at 64: run 1 averages its variants (0.75), run 2 (0.0); then over seeds.
    assert rope.loc[0, 64] == pytest.approx((0.75 + 0.0) / 2)
    assert rope.loc[1, 64] == pytest.approx((0.0 + 1.0) / 2)
    assert rope.loc[0.5, 128] == pytest.approx(0.25)  # one seed
    assert math.isnan(rope.loc[0.5, 64]) and math.isnan(rope.loc[0, 128])
    assert alibi.loc[1, 128] == pytest.approx(0.75)
    assert alibi.loc[[0, 0.5, 1], 64].isna().all()


def test_operands_at_one_length_ignore_the_other_lengths() -> None:
    frame = rows(
        ("rope", 1, 32, {"i=2 j=10": 1.0, "i=10 j=2": 0.0, "i=2 j=2": 0.5}),
        ("rope", 2, 32, {"i=2 j=10": 0.5, "i=10 j=2": 0.0}),
        ("rope", 1, 64, {"i=2 j=10": 0.0, "i=3 j=3": 1.0}),  # another length
        ("rope", 2, 32, None),  # an evaluation without groups
    )
    grid = group_grid(frame, rows="i", columns="j", eval_length=32)["rope"]
    assert grid.index.tolist() == [2, 10]  # as numbers: 2 before 10, and 3 left out
    assert grid.columns.tolist() == [2, 10]
    assert grid.loc[2, 10] == pytest.approx(0.75)
    assert grid.loc[10, 2] == pytest.approx(0.0)
    assert grid.loc[2, 2] == pytest.approx(0.5)  # the one seed that has it
    assert math.isnan(grid.loc[10, 10])
    # Without a length, a run's cell is its mean over the lengths, then over seeds.
    every = group_grid(frame, rows="i", columns="j")["rope"]
    assert every.loc[2, 10] == pytest.approx(((1.0 + 0.0) / 2 + 0.5) / 2)
    assert every.loc[3, 3] == pytest.approx(1.0)


def test_text_values_sort_as_text_and_absent_keys_give_nothing() -> None:
    frame = rows(("rope", 1, 32, {"variant=marked depth=0": 1.0, "variant=bare depth=0": 0.0}))
    grid = group_grid(frame, rows="variant", columns="depth")["rope"]
    assert grid.index.tolist() == ["bare", "marked"]
    assert grid[0].tolist() == [0.0, 1.0]
    assert group_grid(frame, rows="i", columns="j") == {}
    assert group_grid(frame.assign(groups=None), rows="depth", columns=EVAL_LENGTH) == {}
    assert group_keys(frame) == {"variant", "depth"}
    assert group_keys(frame.assign(groups=None)) == set()
    with pytest.raises(ValueError, match="needs two keys"):
        group_grid(frame, rows="depth", columns="depth")


# --- the Compare page ----------------------------------------------------------------

LENGTHS = [128, 256]
DEPTHS = [0.0, 0.5, 1.0]
OPERANDS = [1, 2, 10]


def depth_groups(seed: int, length: int) -> dict[str, float]:
    """A made-up retrieval run: worse deeper and longer, seed 1 a little better."""
    return {f"depth={depth:g}": 1.0 - depth * length / 512 + 0.1 * seed for depth in DEPTHS}


def operand_groups(seed: int, length: int) -> dict[str, float]:
    return {
        f"i={i} j={j}": 1.0 / (i + j) + 0.001 * length + 0.1 * seed
        for i in OPERANDS
        for j in OPERANDS
        if (i, j) != (10, 10)  # a cell no example had
    }


@pytest.fixture
def settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    yield from dashboard_settings(tmp_path, monkeypatch)


def seed_groups(settings, name: str, groups) -> int:
    """A finished study of rope and alibi (two seeds each) with ``groups`` per (seed,
    length) as each evaluation's accuracy by group; alibi's a quarter lower."""
    spec = parse_spec(
        {
            "name": name,
            "model": "tiny",
            "task": "passkey",
            "train": {"length": 128, "steps": 10, "batch_size": 4},
            "encodings": ["rope", "alibi"],
            "seeds": [0, 1],
            "eval": {"lengths": LENGTHS},
        }
    )
    submitted = submit(spec, settings=settings, send=lambda run_id: None, actor="tester")
    for index, run_id in enumerate(submitted.queued):
        seed, lower = index % 2, 0.25 * (index >= 2)
        claimed = lifecycle.claim(settings.database, run_id, "seed")
        for length in LENGTHS:
            scores = {label: value - lower for label, value in groups(seed, length).items()}
            accuracy = float(np.mean(list(scores.values())))
            store.record_evaluation(
                claimed,
                Evaluation(
                    "none", "nonoverlapping", length, accuracy=accuracy, groups=scores, tokens=8
                ),
            )
        lifecycle.finish(claimed, RunStatus.DONE)
    return submitted.study_id


def compare(study: int) -> AppTest:
    def script() -> None:
        from dashboard import compare_page

        compare_page.render()

    app = AppTest.from_function(script, default_timeout=60)
    app.query_params["studies"] = str(study)
    return app.run()


def heatmaps(app: AppTest) -> dict[str, dict]:
    """The heatmap figures by their title."""
    figures = [json.loads(chart.proto.spec) for chart in app.get("plotly_chart")]
    return {
        f["layout"]["title"]["text"]: f
        for f in figures
        if f["data"] and f["data"][0]["type"] == "heatmap"
    }


def test_a_depth_heatmap_per_line(settings) -> None:
    study = seed_groups(settings, "retrieval", depth_groups)
    app = compare(study)
    assert not app.exception
    charts = [json.loads(c.proto.spec) for c in app.get("plotly_chart")]
    maps = [f for f in charts if f["data"] and f["data"][0]["type"] == "heatmap"]
    assert len(maps) == 2  # one per line, in the curves' order
    captions = [c.value for c in app.caption]
    assert captions.index("alibi") < captions.index("rope")
    alibi, rope = maps
    for figure in maps:
        layout = figure["layout"]
        assert layout["title"]["text"] == "accuracy by depth and evaluation length"
        assert figure["data"][0]["zmin"] == 0 and figure["data"][0]["zmax"] == 1
        assert figure["data"][0]["x"] == ["128 (train)", "256"]
        assert figure["data"][0]["y"] == ["0", "0.5", "1"]
        assert figure["data"][0]["texttemplate"] == "%{z:.2f}"
        # The training length's edge: right of it is past training.
        edge = [s for s in layout["shapes"] if s["type"] == "line"]
        assert [s["x0"] for s in edge] == [0.5]
    # Cell (depth, length): the mean of the two seeds, worked out from depth_groups.
    for figure, lower in ((rope, 0.0), (alibi, 0.25)):
        expected = [[1.0 - d * n / 512 + 0.05 - lower for n in LENGTHS] for d in DEPTHS]
        assert np.array(figure["data"][0]["z"]) == pytest.approx(np.array(expected))
    assert list(heatmaps(app)) == ["accuracy by depth and evaluation length"]  # no i, j
    # The tables stay, below the heatmaps.
    assert any(frame.value.index.names == ["line", "value"] for frame in app.dataframe)


def test_an_operand_grid_at_a_chosen_length(settings) -> None:
    study = seed_groups(settings, "addition", operand_groups)
    app = compare(study)
    assert not app.exception
    assert list(heatmaps(app)) == ["accuracy by operand lengths at length 256"]  # no depth
    slider = app.select_slider(key="grid_length")
    assert slider.value == 256  # the longest length first
    grids = [f for f in app.get("plotly_chart") if "operand" in f.proto.spec]
    assert len(grids) == 2  # alibi, rope
    rope = json.loads(grids[1].proto.spec)
    assert rope["layout"]["title"]["text"] == "accuracy by operand lengths at length 256"
    assert "shapes" not in rope["layout"]  # no length axis: no training edge
    assert rope["data"][0]["x"] == ["1", "2", "10"] and rope["data"][0]["y"] == ["1", "2", "10"]
    z = rope["data"][0]["z"]
    assert z[0][2] == pytest.approx(1 / 11 + 0.256 + 0.05)  # i=1, j=10: mean of two seeds
    assert z[2][2] is None  # no example had i=10, j=10: an empty cell
    slider.set_value(128).run()
    grids = [f for f in app.get("plotly_chart") if "operand" in f.proto.spec]
    rope = json.loads(grids[1].proto.spec)
    assert rope["layout"]["title"]["text"] == "accuracy by operand lengths at length 128"
    assert rope["data"][0]["z"][0][2] == pytest.approx(1 / 11 + 0.128 + 0.05)
    alibi = json.loads(grids[0].proto.spec)
    assert alibi["data"][0]["z"][0][2] == pytest.approx(1 / 11 + 0.128 + 0.05 - 0.25)


def test_a_line_named_with_markup_is_named_as_text_beside_its_heatmap(settings) -> None:
    study = seed_groups(settings, "retrieval", depth_groups)
    hostile = "![x](http://host/beacon.png) <b>%{z}</b>"
    with transaction(settings.database) as session:
        session.execute(update(Run).where(Run.label == "rope").values(label=hostile))
    app = compare(study)
    assert not app.exception
    named = [c.value for c in app.caption if "beacon" in c.value]
    assert named and all(re.sub(r"\\(.)", r"\1", value) == hostile for value in named)
    parsed = MarkdownIt("commonmark").parse(named[0])
    assert {t.type for token in parsed for t in token.children or []} == {"text"}
    specs = [chart.proto.spec for chart in app.get("plotly_chart")]
    maps = [spec for spec in specs if json.loads(spec)["data"][0]["type"] == "heatmap"]
    assert len(maps) == 2 and not any("beacon" in spec for spec in maps)
