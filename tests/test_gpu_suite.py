"""``python -m benchmarks.gpu_suite --tiny``: the prepared GPU run, every part on the CPU
with tiny shapes, so that the script works before a device is lent (no figure is
asserted, only that each part ran and reported)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.gpu_suite import FINISHED, PARTS, STUDY_ENCODINGS, one_per_family
from jobs.results_schema import parse_results
from worker.catalog.encodings import REGISTRY

ROOT = Path(__file__).resolve().parents[1]


def suite(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_suite", "--tiny", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_every_part_runs_tiny_on_the_cpu_and_reports(tmp_path: Path) -> None:
    done = suite("--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("plan (budget 480 s on cpu): train ~")
    report = json.loads((tmp_path / "report.json").read_text())
    assert [p["part"] for p in report["parts"]] == [p.name for p in PARTS]
    assert all(p["status"] == FINISHED for p in report["parts"]), report["parts"]
    assert report["facts"]["torch"] and report["seconds"] < 120
    figures = {p["part"]: p["figures"] for p in report["parts"]}
    # Training: one encoding of each family of the catalogue.
    trained = [row["encoding"] for row in figures["train"]["rows"]]
    assert trained == one_per_family()
    assert {REGISTRY[name].family for name in trained} == {e.family for e in REGISTRY.values()}
    assert all(row["eager_tokens_per_s"] > 0 for row in figures["train"]["rows"])
    assert all(row["eager_ratio"] > 0 for row in figures["train"]["rows"])  # x-transformers
    # The study: a results.json posbench import reads, every encoding and rope + yarn.
    results = parse_results(Path(figures["study"]["results"]).read_bytes())
    assert [run.label for run in results.runs] == STUDY_ENCODINGS
    lines_of_study = {(row["encoding"], row["variant"]) for row in figures["study"]["rows"]}
    assert ("rope", "yarn:auto") in lines_of_study and len(lines_of_study) == 6
    assert all(row["loss_agrees"] for row in figures["hf"]["rows"])
    assert all(row["tokens_per_s"] > 0 for row in figures["decode"]["rows"])
    markdown = (tmp_path / "report.md").read_text()
    for title in ("# GPU suite on cpu", "## train", "## study", "## hf", "## decode"):
        assert title in markdown


def test_a_part_that_does_not_fit_the_budget_is_skipped_with_the_reason(tmp_path: Path) -> None:
    done = suite("--budget-s", "1", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "report.json").read_text())
    for part in report["parts"]:
        assert part["status"].startswith("skipped: needs about "), part
    assert "skipped: needs about" in (tmp_path / "report.md").read_text()
