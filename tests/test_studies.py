"""The measured studies' specs in ``studies/`` (issue 20's CPU study) stay runnable: each
loads as `posbench run` reads it, and the task-suite specs share one training setup and
one evaluation grid (what makes their tables comparable)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from core.spec import ModelSpec, load_spec

ROOT = Path(__file__).resolve().parent.parent
STUDIES = sorted((ROOT / "studies").glob("*.yaml"))


@pytest.mark.parametrize("path", STUDIES, ids=lambda path: path.name)
def test_the_study_specs_load(path: Path) -> None:
    spec = load_spec(path)
    # The sizes a CPU trains in minutes: a preset up to small, or dimensions no larger.
    small = ModelSpec(preset="small").parameters
    assert spec.model.preset in ("tiny", "small") or spec.model.parameters <= small
    assert spec.eval.lengths[0] == spec.train.length


def test_the_cpu_study_trains_every_task_alike() -> None:
    specs = [load_spec(path) for path in STUDIES if path.name.startswith("cpu-")]
    assert len(specs) >= 3
    assert len({spec.task.name for spec in specs}) == len(specs)
    assert len({spec.train.model_dump_json() for spec in specs}) == 1
    assert len({tuple(spec.eval.lengths) for spec in specs}) == 1


def test_the_learning_curve_script_scores_at_each_mark() -> None:
    """``studies/learning_curve.py`` (the learning studies' runs) as a user runs it: a
    line per mark, the last step included, training on another parameterisation than
    the one scored when asked, with Muon when asked; a parameter the task does not take, or
    an optimizer posbench has not, is refused."""
    command = [sys.executable, str(ROOT / "studies" / "learning_curve.py")]
    script = [*command, "niah"]
    common = ["--param", "haystack=needles", "--param", "num_keys=4", "--examples", "8"]
    done = subprocess.run(
        [*script, *common, "--steps", "5", "--every", "2", "--batch-size", "4"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    rows = [line.split() for line in done.stdout.splitlines()]
    assert [int(row[0]) for row in rows] == [2, 4, 5]
    for _, loss, score in rows:
        assert 0 < float(loss) < 10 and 0 <= float(score) <= 1
    shorter = ["--train-param", "num_keys=1", "--min-length", "64", "--optimizer", "muon"]
    done = subprocess.run(
        [*script, *common, *shorter, "--steps", "2", "--every", "2", "--batch-size", "4"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert [line.split()[0] for line in done.stdout.splitlines()] == ["2"]
    for task, wrong, named in (
        ("niah", ["--param", "depth=3"], "no parameter 'depth'"),
        ("niah", [*common, "--min-length", "64"], "--min-length (a length of 64)"),
        ("lm", ["--length", "64"], "not scored by exact match"),
        ("niah", [*common, "--warmup", "0.9"], "warmup: Input should be less than or equal to 0.5"),
        ("niah", [*common, "--optimizer", "sgd"], "optimizer: Input should be 'adamw' or 'muon'"),
        (
            "niah",
            [*common, "--examples", "0"],
            "examples: Input should be greater than or equal to 1",
        ),
    ):
        refused = subprocess.run(
            [*command, task, *wrong, "--steps", "1"], capture_output=True, text=True, timeout=300
        )
        assert refused.returncode != 0 and named in refused.stderr
