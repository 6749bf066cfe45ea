"""The benchmark harness's bookkeeping (no timing is asserted): each encoding's two
implementations run back to back every round, and ratios are paired per round."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.harness import Contender, flops_per_token, interleave, report


def test_interleave_runs_each_pair_back_to_back_every_round(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("benchmarks.harness.matmul_flops_per_second", lambda: 1e9)
    calls: list[str] = []

    def work(name: str):
        def unit() -> int:
            calls.append(name)
            return 10

        return unit

    contenders = [
        Contender(f"{impl}:{enc}", enc, impl, work(f"{impl}:{enc}"))
        for enc in ("nope", "rope", "alibi")
        for impl in ("posbench", "x-transformers")
    ]
    reference = interleave(contenders, rounds=4, units=2, flops=1e5)
    assert reference == 1e9
    timed = calls[len(contenders) :]  # after one warm-up call each
    assert len(timed) == 4 * 6 * 2
    # Every 4 calls (2 units x 2 implementations) belong to one encoding.
    for start in range(0, len(timed), 4):
        encodings = {name.split(":")[1] for name in timed[start : start + 4]}
        assert len(encodings) == 1
    for contender in contenders:
        assert len(contender.samples) == len(contender.utilisation) == 4


def test_report_gives_the_median_of_per_round_ratios(tmp_path: Path) -> None:
    ours = Contender("posbench:nope", "nope", "posbench", lambda: 0)
    theirs = Contender("x-transformers:nope", "nope", "x-transformers", lambda: 0)
    # Round 3 was slow for both: paired, its ratio is still 1.5.
    ours.samples, theirs.samples = [300.0, 330.0, 60.0, 280.0], [200.0, 200.0, 40.0, 220.0]
    ours.utilisation = theirs.utilisation = [0.5] * 4
    out = tmp_path / "bench.json"
    (row,) = report([ours, theirs], 1e9, "test", out)
    ratios = sorted([1.5, 1.65, 1.5, 280 / 220])
    assert row["ratio"] == pytest.approx((ratios[1] + ratios[2]) / 2)
    assert row["ratio_q1"] <= row["ratio"] <= row["ratio_q3"]
    assert row["ratio_q3"] == pytest.approx(1.5 + 0.25 * (1.65 - 1.5))
    assert json.loads(out.read_text())["rows"][0]["ratio"] == pytest.approx(row["ratio"])


def test_model_flops_count_the_full_attention_square() -> None:
    # 6N + 12 L d T (PaLM appendix B), N = 4 layers x 12 d^2 + the tied 256 x d output layer;
    # the same count the GPU benchmark takes from Transformer.flops_per_token.
    weights = 4 * 12 * 128 * 128 + 256 * 128
    assert flops_per_token(256, True) == 6 * weights + 12 * 4 * 128 * 256
    assert flops_per_token(2048, False) == (6 * weights + 12 * 4 * 128 * 2048) / 3


def _run_benchmark(module: str, args: list[str], out: Path) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", module, *args, "--out", str(out)],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert "| encoding |" in done.stdout  # the markdown table
    return json.loads(out.read_text())


@pytest.mark.slow
def test_the_cpu_benchmarks_run_and_report_every_promised_column(tmp_path: Path) -> None:
    # One round, both implementations, real models: what docs/performance.md's tables come from.
    train = _run_benchmark(
        "benchmarks.train_step",
        ["--rounds", "1", "--steps", "1", "--encodings", "alibi"],
        tmp_path / "train.json",
    )
    (row,) = train["rows"]
    assert row["encoding"] == "alibi" and train["matmul_flops_per_s"] > 0
    for side in ("posbench", "x-transformers"):
        # One round: utilisation is that round's rate x model FLOPs / its matmul rate (no
        # bound on its size: on a loaded machine the reference matmul can be the slower).
        rate = row[f"{side}_tokens_per_s"]
        flops = flops_per_token(256, True)
        assert rate > 0
        assert row[f"{side}_utilisation"] == pytest.approx(
            rate * flops / train["matmul_flops_per_s"]
        )
        # Activations, gradients and AdamW state of a 0.8M-parameter model: MiBs, not bytes.
        assert 10 < row[f"{side}_peak_MiB"] < 4096
    assert row["ratio"] > 0
    evaluation = _run_benchmark(
        "benchmarks.eval_length",
        [
            "--length",
            "512",
            "--batch",
            "1",
            "--rounds",
            "1",
            "--encodings",
            "alibi",
            "--memory",
            "1024",
        ],
        tmp_path / "eval.json",
    )
    (row,) = evaluation["rows"]
    assert row["posbench_tokens_per_s"] > 0 and row["ratio"] > 0
    assert 0 < row["peak_MiB_at_1024"] < 1024
