"""The measured studies' specs in ``studies/`` (issue 20's CPU study) stay runnable: each
loads as `posbench run` reads it, and the task-suite specs share one training setup and
one evaluation grid (what makes their tables comparable)."""

from __future__ import annotations

from pathlib import Path

import pytest

from jobs.spec import load_spec

ROOT = Path(__file__).resolve().parent.parent
STUDIES = sorted((ROOT / "studies").glob("*.yaml"))


@pytest.mark.parametrize("path", STUDIES, ids=lambda path: path.name)
def test_the_study_specs_load(path: Path) -> None:
    spec = load_spec(path)
    assert spec.model.preset == "tiny"
    assert spec.eval.lengths[0] == spec.train.length


def test_the_cpu_study_trains_every_task_alike() -> None:
    specs = [load_spec(path) for path in STUDIES if path.name.startswith("cpu-")]
    assert len(specs) >= 3
    assert len({spec.task.name for spec in specs}) == len(specs)
    assert len({spec.train.model_dump_json() for spec in specs}) == 1
    assert len({tuple(spec.eval.lengths) for spec in specs}) == 1
