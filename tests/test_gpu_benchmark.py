"""The GPU benchmark script is prepared for a lent GPU; here it must at least run (CPU,
tiny model, eager) and report what it promises, so it does not rot before one is lent."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_training_benchmark_runs_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    args = ["--device", "cpu", "--preset", "tiny", "--length", "32", "--batch", "2"]
    args += ["--steps", "1", "--modes", "eager", "compiled", "--encodings", "nope", "alibi"]
    args += ["--compiled-encodings"]  # none: compiling is what --compiled-encodings limits
    args += ["--peak-tflops", "0.001"]  # a made-up peak: utilisation is then reported
    args += ["--xtransformers"]  # x-transformers' model of the same shape, same step
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_train", *args, "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert [row["encoding"] for row in report["rows"]] == ["nope", "alibi"]
    assert not any(key.startswith("compiled") for row in report["rows"] for key in row)
    assert all(row["eager_tokens_per_s"] > 0 for row in report["rows"])
    assert report["peak_flops"] == 1e9
    assert all(row["eager_utilisation"] > 0 for row in report["rows"])
    assert all(row["eager_xt_tokens_per_s"] > 0 for row in report["rows"])
    for row in report["rows"]:  # rounded: tokens/s to units, the ratio to 3 decimals
        ratio = row["eager_tokens_per_s"] / row["eager_xt_tokens_per_s"]
        assert abs(row["eager_ratio"] - ratio) < 0.01 * ratio


def test_evaluation_memory_is_divided_by_nopes_at_the_same_length() -> None:
    from benchmarks.gpu_eval import against_nope

    rows = [
        {"encoding": "nope", "length": 512, "posbench_peak_memory_mib": 100.0},
        {"encoding": "nope", "length": 16384, "posbench_peak_memory_mib": 400.0},
        {"encoding": "alibi", "length": 512, "posbench_peak_memory_mib": 150.0},
        {"encoding": "alibi", "length": 16384, "posbench_peak_memory_mib": 440.0},
        {"encoding": "learned", "length": 16384, "posbench_tokens_per_s": "beyond its table"},
    ]
    against_nope(rows)
    assert [row.get("memory_vs_nope") for row in rows] == [1.0, 1.0, 1.5, 1.1, None]


def test_a_length_one_side_cannot_run_is_marked_and_the_other_side_still_measured(
    tmp_path: Path,
) -> None:
    out = tmp_path / "eval.json"
    args = ["--device", "cpu", "--preset", "tiny", "--train-length", "16", "--factors", "1", "4"]
    args += ["--rounds", "1", "--encodings", "learned", "--out", str(out)]
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_eval", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    rows = {(row["encoding"], row["factor"]): row for row in json.loads(out.read_text())["rows"]}
    assert list(rows) == [("nope", 1), ("nope", 4), ("learned", 1), ("learned", 4)]
    assert rows["learned", 1]["posbench_tokens_per_s"] > 0 and rows["learned", 1]["ratio"] > 0
    # 4x is past the learned table's 16 rows: no figure made up, x-transformers' measured.
    assert rows["learned", 4]["posbench_tokens_per_s"] == "beyond its table"
    assert rows["learned", 4]["xt_tokens_per_s"] > 0 and "ratio" not in rows["learned", 4]
    assert rows["learned", 4]["batch"] == 1 and rows["nope", 1]["batch"] == 4
