"""``python -m benchmarks.decode`` at its smallest settings, one round (no timing is
asserted): every promised row and column is there, the KV-cache sizes are the cache's
own, and posbench's greedy tokens equal those of transformers' ``generate`` on the
exported model; and the options are checked at the edge."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.decode import first_divergence, parse, problems

ROOT = Path(__file__).resolve().parents[1]


def test_the_benchmark_runs_and_reports_every_promised_column(tmp_path: Path) -> None:
    out = tmp_path / "decode.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.decode",
            *("--train-length", "16", "--factors", "1", "2", "--rounds", "1"),
            *("--encodings", "rope", "alibi", "learned", "--train-steps", "3"),
            *("--threads", "1", "--out", str(out)),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| encoding | length |" in done.stdout  # the markdown table
    rows = json.loads(out.read_text())["rows"]
    # learned has no positions past the training length: 1x only.
    assert sorted((r["encoding"], r["length"]) for r in rows) == [
        ("alibi", 16),
        ("alibi", 32),
        ("learned", 16),
        ("rope", 16),
        ("rope", 32),
    ]
    # tiny: 2 layers x 4 heads x 16 dims; the last generated token is never fed back.
    per_token = 2 * 2 * 4 * 16 * 4
    for row in rows:
        assert row["prompt"] == row["length"] // 2 and row["new_tokens"] == row["length"] // 2
        assert row["kv_MiB"] * 2**20 == per_token * (row["length"] - 1)
        # The same cache on both sides (alibi's reference is the rope export, same size).
        assert row["transformers_kv_MiB"] == row["kv_MiB"]
        assert row["tokens_per_s"] > 0 and row["transformers_tokens_per_s"] > 0
        assert row["ratio_q1"] == row["ratio"] == row["ratio_q3"]  # one round
        assert row["peak_MiB"] >= 0 and row["transformers_peak_MiB"] >= 0
        assert row["reference"] == "rope"
    rope = [r for r in rows if r["encoding"] == "rope"]
    # The same weights: the same greedy tokens, at least within the training length.
    assert all(r["diverges_at"] is None or r["diverges_at"] >= 16 for r in rope)
    assert all("diverges_at" not in r for r in rows if r["encoding"] != "rope")


def test_the_first_divergence_is_the_first_differing_new_token() -> None:
    ours = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    assert first_divergence(ours, ours.clone()) is None
    theirs = ours.clone()
    theirs[1, 2] = 0
    theirs[0, 3] = 0
    assert first_divergence(ours, theirs) == 2
    assert first_divergence(ours, ours[:, :3]) == 0  # fewer tokens: differ from the start


def test_a_divergence_within_the_training_length_fails_the_run() -> None:
    rows = [
        {"encoding": "rope", "length": 64, "diverges_at": 40},
        {"encoding": "rope", "length": 128, "diverges_at": 20},
        {"encoding": "rope", "length": 256, "diverges_at": None},
        {"encoding": "alibi", "length": 64},
    ]
    (found,) = problems(rows, train_length=32)
    assert found.startswith("rope at 128") and "position 20" in found


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--rounds", "0"], "--rounds must be at least 1"),
        (["--train-length", "1"], "--train-length must be at least 2"),
        (["--factors", "1", "0"], "--factors must be positive"),
        (["--prompt-fraction", "1"], "--prompt-fraction must be in (0, 1)"),
        (["--train-steps", "-1"], "--train-steps must be 0 or more"),
        (["--threads", "0"], "--threads must be at least 1"),
        (["--encodings", "no-such"], "invalid choice"),
    ],
)
def test_options_are_checked_with_the_reason(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse(args)
    assert message in capsys.readouterr().err
