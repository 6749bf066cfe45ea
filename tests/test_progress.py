"""A run's progress as the CLI (status, --wait) and the Queue page show it: training
steps, or, for an hf: model that trains nothing, the points of its curve."""

from __future__ import annotations

import pandas as pd

from jobs.watch import progress

SPEC = {
    "eval": {
        "lengths": [32, 64, 128],
        "protocols": ["nonoverlapping", "sliding"],
        "variants": ["none", "yarn:auto"],
    }
}


def test_trained_runs_count_steps_and_hf_runs_count_points() -> None:
    runs = pd.DataFrame({"total_steps": [600, 0, 0], "step": [120, 0, 0], "points": [0, 5, 12]})
    shown = progress(runs, SPEC)
    # 2 variants x 2 protocols x 3 lengths = 12 points for the model evaluated as it is.
    assert shown["progress"].tolist() == ["120/600 steps", "5/12 points", "12/12 points"]
    assert shown["completed"].tolist() == [120, 5, 12] and shown["total"].tolist() == [600, 12, 12]


def test_a_stored_spec_that_no_longer_reads_still_shows() -> None:
    runs = pd.DataFrame({"total_steps": [0], "step": [0], "points": [3]})
    assert progress(runs, {"eval": {"lengths": "not a list"}})["progress"].tolist() == ["3 points"]
