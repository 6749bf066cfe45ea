"""``python -m benchmarks.gpu_suite --tiny``: the prepared GPU run, every part on the CPU
with tiny shapes, so that the script works before a device is lent (no figure is
asserted, only that each part ran and reported)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from benchmarks import gpu_targets
from benchmarks.gpu_suite import (
    FINISHED,
    PARTS,
    STUDY_ENCODINGS,
    Part,
    one_per_family,
    plan_line,
    run_part,
)
from benchmarks.harness import by_value
from core.catalog.encodings import REGISTRY
from core.results_schema import parse_results

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
    assert lines[0].startswith("plan (budget 450 s on cpu): checks ~")
    report = json.loads((tmp_path / "report.json").read_text())
    assert [p["part"] for p in report["parts"]] == [p.name for p in PARTS]
    assert all(p["status"] == FINISHED for p in report["parts"]), report["parts"]
    # The suite keeps to the budget its plan line states (the tiny run's speed is not a
    # figure: a busy machine may take minutes).
    assert report["facts"]["torch"] and 0 < report["seconds"] <= 450
    figures = {p["part"]: p["figures"] for p in report["parts"]}
    # The GPU-only checks' logic, on the CPU: every row held.
    checked = figures["checks"]["rows"]
    assert {row["encoding"] for row in checked} == {"alibi", "fire", "alibi+logn"}
    assert {row["check"] for row in checked} == {"bf16", "values", "gradients", "spread"}
    assert all(row["held"] is not False for row in checked)
    # Training: one encoding of each family of the catalogue, the bias encoding first.
    trained = [row["encoding"] for row in figures["train"]["rows"]]
    assert trained == by_value(one_per_family()) and trained[0] == "alibi"
    assert {REGISTRY[name].family for name in trained} == {e.family for e in REGISTRY.values()}
    assert all(row["eager_tokens_per_s"] > 0 for row in figures["train"]["rows"])
    assert all(row["eager_ratio"] > 0 for row in figures["train"]["rows"])  # x-transformers
    # Evaluation: NoPE first, every family at 1x, 4x and 32x, beside x-transformers.
    evaluated = figures["eval"]["rows"]
    assert [(row["encoding"], row["factor"]) for row in evaluated] == [
        (name, factor)
        for name in ["nope", *by_value(one_per_family()[1:])]
        for factor in (1, 4, 32)
    ]
    # auto on the CPU: sdpa, but CoPE's term has no fused form and is written out.
    assert {row["kernel"] for row in evaluated if row["encoding"] != "cope"} == {"sdpa"}
    assert {row["kernel"] for row in evaluated if row["encoding"] == "cope"} == {"eager"}
    assert max(row["length"] for row in evaluated) == 32 * 16
    assert all(row["posbench_tokens_per_s"] > 0 and row["ratio"] > 0 for row in evaluated)
    assert {row["batch"] for row in evaluated} == {32, 8, 1}  # the same tokens a pass
    # The study: a results.json posbench import reads, every encoding and rope + yarn.
    results = parse_results(Path(figures["study"]["results"]).read_bytes())
    assert [run.label for run in results.runs] == STUDY_ENCODINGS
    lines_of_study = {(row["encoding"], row["variant"]) for row in figures["study"]["rows"]}
    assert ("rope", "yarn:auto") in lines_of_study and len(lines_of_study) == 6
    assert figures["study"]["train"]["steps"] == 4  # the steps it was trained, reported
    assert all(row["loss_agrees"] for row in figures["hf"]["rows"])
    assert all(row["tokens_per_s"] > 0 for row in figures["decode"]["rows"])
    # The targets are read off the figures; on the CPU, MFU and memory are not measured.
    held = {row[0].split(",")[0]: row[2] for row in report["targets"]}
    assert len(report["targets"]) == 9
    assert held["bf16 MFU >= 40%"] == held["evaluation memory at 32x <= 1.2x NoPE's"]
    assert held["bf16 MFU >= 40%"] == gpu_targets.NOT_MEASURED
    assert set(held.values()) <= {"yes", "no", gpu_targets.NOT_MEASURED}
    markdown = (tmp_path / "report.md").read_text()
    for title in ("# GPU suite on cpu", "## targets", "## train", "## eval", "## study"):
        assert title in markdown
    assert "## hf" in markdown and "## decode" in markdown
    assert "only show that the checks run" in markdown
    assert "`tiny` trained 4 steps of 2 x 16; results: " in markdown


def test_a_part_that_does_not_fit_the_budget_is_skipped_with_the_reason(tmp_path: Path) -> None:
    done = suite("--budget-s", "1", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "report.json").read_text())
    for part in report["parts"]:
        assert part["status"].startswith("skipped: needs about "), part
    assert "skipped: needs about" in (tmp_path / "report.md").read_text()


def _writes_then(tmp_path: Path, then: str) -> Part:
    """A part that writes eval.json (one row), then runs ``then``."""
    out = tmp_path / "eval.json"
    code = f'open({str(out)!r}, \'w\').write(\'{{"rows": [{{"encoding": "nope"}}]}}\'); {then}'
    return Part("eval", "a stand-in", 1, 1, lambda tiny, folder, device: ["-c", code])


def test_a_part_past_its_share_of_the_budget_is_stopped_and_keeps_its_figures(
    tmp_path: Path,
) -> None:
    # Estimate 1 s: stopped at 1.5 s although the budget has 300 left.
    record = run_part(
        _writes_then(tmp_path, "import time; time.sleep(60)"), False, tmp_path, "cpu", 300
    )
    assert record["status"].startswith("stopped after 2 s; see eval.log; partial figures kept")
    assert record["seconds"] < 30
    assert record["figures"]["rows"] == [{"encoding": "nope"}]


def test_a_failed_part_reports_its_exit_and_never_an_earlier_runs_figures(tmp_path: Path) -> None:
    (tmp_path / "eval.json").write_text('{"rows": [{"encoding": "stale"}]}')
    failing = Part("eval", "a stand-in", 1, 1, lambda tiny, folder, device: ["-c", "exit(3)"])
    record = run_part(failing, False, tmp_path, "cpu", 300)
    assert record["status"] == "failed (exit 3); see eval.log"
    assert record["figures"] is None


def test_the_study_runs_again_in_a_folder_used_before(tmp_path: Path) -> None:
    """A suite run again into the same folder: the study's earlier folder goes as a whole
    (posbench run would refuse to write over a table.md whose results.json was removed)."""
    study = next(part for part in PARTS if part.name == "study")
    for _ in range(2):
        record = run_part(study, True, tmp_path, "cpu", 300)
        assert record["status"] == FINISHED, (tmp_path / "study.log").read_text()[-2000:]


def _row(encoding: str, **figures: object) -> dict[str, object]:
    return {"encoding": encoding, **figures}


def test_the_targets_hold_or_not_as_the_figures_say() -> None:
    train = [
        _row("nope", compiled_utilisation=0.35, compiled_tokens_per_s=1000, eager_ratio=1.3),
        _row("rope", compiled_utilisation=0.31, eager_ratio=1.3, compiled_ratio=1.25),
        _row("alibi", eager_ratio=1.25, compiled_ratio=1.3, compiled_tokens_per_s=850),
        _row("t5", eager_ratio=1.4, compiled_tokens_per_s=810),
    ]
    mfu = [_row("nope", compiled_utilisation=0.45), _row("rope", compiled_utilisation=0.41)]
    evaluation = [
        _row("nope", factor=1, length=512, posbench_tokens_per_s=1000, ratio=1.5),
        _row("nope", factor=32, length=16384, posbench_tokens_per_s=100, memory_vs_nope=1.0),
        _row("alibi", factor=1, length=512, posbench_tokens_per_s=900, ratio=1.1),
        _row("alibi", factor=32, length=16384, posbench_tokens_per_s=75, memory_vs_nope=1.15),
        _row("t5", factor=32, length=16384, posbench_tokens_per_s="out of memory", ratio=2.0),
    ]
    study = [
        {"encoding": "alibi", "variant": "none", "512": 10.0, "8192": 10.5},
        {"encoding": "sinusoidal", "variant": "none", "512": 10.0, "8192": 90.0},
        {"encoding": "rope", "variant": "none", "512": 10.0, "8192": 60.0},
        {"encoding": "rope", "variant": "yarn:auto", "512": 10.0, "8192": 14.0},
    ]
    parts = [
        {"part": "train", "status": FINISHED, "figures": {"rows": train}},
        {"part": "mfu", "status": FINISHED, "figures": {"rows": mfu}},
        {"part": "eval", "status": FINISHED, "figures": {"rows": evaluation}},
        {"part": "study", "status": FINISHED, "figures": {"rows": study}},
        {"part": "decode", "status": FINISHED, "figures": {"rows": [{"tokens_per_s": 1.0}]}},
    ]
    rows = gpu_targets.targets(parts)
    assert len(rows) == 9
    assert [row[2] for row in rows] == ["yes"] * 9, rows
    assert rows[0][1] == "nope 0.45, rope 0.41"
    assert rows[2][1] == "alibi 0.85, t5 0.81"
    assert rows[4][1] == "alibi 1.1, t5 2"
    assert rows[5][1] == "alibi 0.75"  # t5 ran out of memory at its only length
    assert rows[7][1] == "longest / 1x: alibi 1.05, sinusoidal 9, rope 6, rope+yarn:auto 1.4"
    # Each target fails on its own figure.
    mfu[1]["compiled_utilisation"] = 0.39
    train[1]["compiled_utilisation"] = 0.29
    train[3]["compiled_tokens_per_s"] = 790
    train[3]["eager_ratio"] = 1.19
    evaluation[2]["ratio"] = 0.99
    evaluation[3]["posbench_tokens_per_s"] = 69
    evaluation[3]["memory_vs_nope"] = 1.21
    study[3]["8192"] = 70.0  # yarn worse than unscaled rope: not between
    parts[-1]["figures"] = None  # decode without a figure
    assert [row[2] for row in gpu_targets.targets(parts)] == ["no"] * 9
    assert gpu_targets.targets(parts)[3][1:] == ["lowest t5 1.19", "no"]
    parts[-1] = {"part": "decode", "status": "stopped after 37 s", "figures": {"rows": [{}]}}
    assert gpu_targets.targets(parts)[8][1:] == ["not finished: decode", "no"]


@pytest.mark.parametrize("missing", ["train", "eval", "study"])
def test_a_target_without_its_figures_is_not_measured(missing: str) -> None:
    parts = [{"part": name, "figures": {"rows": []}} for name in ("train", "eval", "study")]
    parts = [part for part in parts if part["part"] != missing]  # none with a status yet
    assert {row[2] for row in gpu_targets.targets(parts)} == {gpu_targets.NOT_MEASURED}


def test_the_manual_shows_the_plan_the_suite_prints_on_a_gpu() -> None:
    manual = (ROOT / "docs" / "performance.md").read_text()
    assert plan_line(False, 450, "cuda") + "\n" in manual


def test_the_real_runs_command_lines_are_accepted_before_a_device_is_lent(
    tmp_path: Path,
) -> None:
    """Every part's full-size command, started on the CPU: none may stop on its arguments
    or its spec (a typo there would cost a lent GPU's run). Each has 30 seconds to fail;
    a part still working then has got past them, and is stopped."""
    started = {}
    for part in PARTS:
        folder = tmp_path / part.name
        folder.mkdir()
        started[part.name] = subprocess.Popen(
            [sys.executable, *part.command(False, folder, "cpu")],
            cwd=ROOT,
            env={**os.environ, "POSBENCH_HOME": str(folder / "home")},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
    deadline = time.monotonic() + 30
    try:
        for name, process in started.items():
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                continue  # past its arguments and its spec: working
            assert process.returncode == 0, f"{name}: {process.stderr.read()[-2000:]}"
    finally:
        for process in started.values():
            process.kill()
            process.wait()


def test_a_suite_killed_from_outside_leaves_the_report_of_the_parts_it_finished(
    tmp_path: Path,
) -> None:
    suite_process = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.gpu_suite", "--tiny", "--out", str(tmp_path)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its parts too, when it is killed
    )
    report_file = tmp_path / "report.json"
    try:
        deadline = time.monotonic() + 120
        while not report_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        os.killpg(suite_process.pid, signal.SIGKILL)
        suite_process.wait()
    report = json.loads(report_file.read_text())
    finished = [part["part"] for part in report["parts"]]
    assert finished and finished == [p.name for p in PARTS[: len(finished)]]
    assert report["not_reached"] == [p.name for p in PARTS[len(finished) :]]
    assert report["parts"][0]["status"] == FINISHED
    markdown = (tmp_path / "report.md").read_text()
    assert "Not reached yet (the suite was still running): " in markdown


PROBE = """
import atexit, os, sys

def _record():
    from importlib import metadata
    owners = metadata.packages_distributions()
    names = {d for m in list(sys.modules) for d in owners.get(m.partition(".")[0], [])}
    with open(os.environ["IMPORTED_DISTRIBUTIONS"], "a") as out:
        out.write("".join(name + "\\n" for name in names))

atexit.register(_record)
"""


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name.strip()).lower()


def _listed(path: Path) -> list[str]:
    lines = (line.partition("#")[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line]


def test_the_device_script_runs_the_suite_and_brings_back_what_the_device_tool_returns(
    tmp_path: Path,
) -> None:
    """``gpu_device.sh run --tiny`` on the CPU (no wheels): what comes back fits the device
    tool's limits, and every distribution any part imported is in the device's image or
    among the wheels ``prepare`` fetches (a probe on PYTHONPATH records them)."""
    out, probe = tmp_path / "out", tmp_path / "probe"
    out.mkdir()
    probe.mkdir()
    (probe / "sitecustomize.py").write_text(PROBE)
    imported = tmp_path / "imported.txt"
    env = {
        **os.environ,
        "OUT": str(out),
        "WHEELS": str(tmp_path / "no-wheels"),
        "SUITE_DIR": str(tmp_path / "suite"),
        "PYTHON": sys.executable,
        "PYTHONPATH": str(probe),
        "IMPORTED_DISTRIBUTIONS": str(imported),
    }
    done = subprocess.run(
        ["bash", "benchmarks/gpu_device.sh", "run", "--tiny"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    names = sorted(path.name for path in out.iterdir())
    assert names == ["gpu-suite.tar.gz", "report.json", "report.md", "study-results.json"]
    assert all(path.stat().st_size < 16 * 2**20 for path in out.iterdir())
    parse_results((out / "study-results.json").read_bytes())
    with tarfile.open(out / "gpu-suite.tar.gz") as archive:
        members = [Path(name) for name in archive.getnames()]
    assert {"train.json", "eval.json", "hf.json", "decode.json", "study.log"} <= {
        member.name for member in members
    }
    assert not [member for member in members if "home" in member.parts]  # checkpoints
    # The import closure: the image's distributions, the carried wheels, posbench itself.
    image = _listed(ROOT / "benchmarks" / "gpu_device_image.txt")
    aliases = dict(  # A = B: A's modules come from B there; A = (nothing): optional
        (_normal(a), _normal(b)) for a, sep, b in (line.partition("=") for line in image) if sep
    )
    there = {_normal(line) for line in image if "=" not in line}
    carried = {
        _normal(line.split("==")[0]) for line in _listed(ROOT / "benchmarks" / "gpu_device.txt")
    }
    seen = {_normal(name) for name in imported.read_text().split()}
    assert {"torch", "x-transformers", "sqlalchemy", "transformers"} <= seen  # it recorded
    optional = {name for name, there_as in aliases.items() if not there_as}
    missing = {name for name in seen - optional if aliases.get(name, name) not in there | carried}
    assert missing <= {"posbench"}, f"not on the device nor carried: {sorted(missing)}"


def test_the_carried_wheels_are_the_versions_the_tests_run_with() -> None:
    from importlib import metadata

    for line in _listed(ROOT / "benchmarks" / "gpu_device.txt"):
        name, _, version = line.partition("==")
        assert metadata.version(name) == version, line
