"""``python -m benchmarks.hf_eval``'s bookkeeping at its smallest size, one round (no
timing is asserted): both sides evaluate the same windows in the same batches, their
losses agree, and every promised column is there. Also the output layer's float32
logits (``worker.hf.model.float32_logits``) off CUDA."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from benchmarks.hf_eval import SIZES, measure, prepare, problems, report, windows
from worker.hf.model import float32_logits

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    # Two lengths (1x, 2x the context of 128), two windows of the longest per length.
    root = tmp_path_factory.mktemp("hf-eval")
    return prepare(SIZES["tiny"], root, CPU, [1, 2], tokens_per_length=512)


def test_both_sides_evaluate_the_same_windows_to_the_same_loss(
    setup, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The benchmark fixes glibc's mmap threshold for its CPU memory pass: not in this process.
    monkeypatch.setattr("worker.memory.fix_mmap_threshold", lambda: False)
    rows = measure(setup, rounds=1, memory=True)
    assert [(row["length"], row["factor"], row["side"]) for row in rows] == [
        (128, 1, "posbench"),
        (256, 2, "posbench"),
    ]
    for row in rows:
        # posbench's batch is the spec's batch_tokens over the length, as a worker's.
        assert row["batch"] == 16_384 // row["length"]
        assert row["same_windows"] and row["loss_agrees"]
        assert row["loss_rel_diff"] < 1e-4  # float32 on the CPU
        assert 5 < row["loss"] < 7  # random weights: about ln(vocab) = 6.2 nats
        for column in ("tokens_per_s", "transformers_tokens_per_s", "ratio"):
            assert row[column] > 0
        assert row["ratio_q1"] == row["ratio"] == row["ratio_q3"]  # one round
        # A MiB or two of logits at this size: within the resident set's resolution, so
        # only bounded here (docs/performance-history.md's CPU run reads tens of MiB).
        assert 0 <= row["peak_MiB"] < 1024 and 0 <= row["transformers_peak_MiB"] < 1024
        if row["transformers_peak_MiB"] > 0:
            assert row["memory_ratio"] == pytest.approx(
                row["peak_MiB"] / row["transformers_peak_MiB"]
            )
        else:
            assert row["memory_ratio"] is None
    assert problems(rows) == []
    out = tmp_path / "hf.json"
    report(rows, "test", out)
    assert json.loads(out.read_text())["rows"][0]["side"] == "posbench"
    # What a wrong run would say instead of figures.
    wrong = [rows[0] | {"loss_agrees": False}, rows[1] | {"same_windows": False}]
    assert [p.split(":")[0] for p in problems(wrong)] == ["posbench at 128", "posbench at 256"]


def test_windows_refuse_a_budget_that_scores_part_of_a_window(setup) -> None:
    batches = windows(setup, 128, 4)
    assert [tuple(b.shape) for b in batches] == [(4, 129)]  # inputs and the last target
    whole = setup.spec
    setup.spec = whole.model_copy(update={"tokens": 500})  # not whole longest windows
    try:
        with pytest.raises(ValueError, match="partly scored"):
            windows(setup, 128, 4)
    finally:
        setup.spec = whole


def test_the_output_layer_gives_float32_logits_off_cuda() -> None:
    # On the CPU, under autocast too, the product is float32 throughout.
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 40, bias=True)
    hidden = torch.randn(2, 3, 16)
    expected = F.linear(hidden, head.weight, head.bias)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = float32_logits(hidden, head)
    assert logits.dtype == torch.float32 and logits.shape == (2, 3, 40)
    assert torch.equal(logits, expected)
