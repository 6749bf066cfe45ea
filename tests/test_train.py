"""The training loop: schedule, exact resume, divergence, cancellation."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from jobs.spec import TrainSpec
from worker.data import build_task
from worker.model import build_model
from worker.train import (
    RunCancelled,
    TrainingDiverged,
    load_checkpoint,
    lr_at,
    make_optimizer,
    train,
)

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory):
    lm = build_task("lm")
    lm.prepare(tmp_path_factory.mktemp("cache"))
    return lm


def test_warmup_then_cosine_to_the_floor() -> None:
    spec = TrainSpec(steps=100, lr=1e-3, warmup=0.1, min_lr_ratio=0.1)
    assert lr_at(0, spec) == pytest.approx(1e-4)
    assert lr_at(9, spec) == pytest.approx(1e-3)
    assert lr_at(10, spec) == pytest.approx(1e-3)
    assert lr_at(55, spec) == pytest.approx(1e-4 + 0.9e-3 * 0.5)
    assert lr_at(100, spec) == pytest.approx(1e-4)
    lrs = [lr_at(s, spec) for s in range(10, 100)]
    assert all(a >= b for a, b in itertools.pairwise(lrs))


def test_weight_decay_applies_to_matrices_only() -> None:
    model = build_model("tiny", "alibi", train_length=16)
    decayed, kept = make_optimizer(model, TrainSpec()).param_groups
    assert all(p.dim() >= 2 for p in decayed["params"]) and decayed["weight_decay"] == 0.1
    assert all(p.dim() < 2 for p in kept["params"]) and kept["weight_decay"] == 0.0
    assert len(kept["params"]) == 2 * 2 + 1  # the LayerNorm gains


@pytest.mark.parametrize("encoding", ["rope", "randomized", "t5"])
def test_resume_continues_exactly(encoding: str, task, tmp_path: Path) -> None:
    spec = TrainSpec(length=32, steps=12, batch_size=4, checkpoint_every=3, progress_every=2)

    def fresh():
        return build_model("tiny", encoding, train_length=32, seed=3)

    straight = fresh()
    train(straight, task, spec, seed=3, device=CPU)

    checkpoint = tmp_path / "run.pt"
    first = fresh()
    result = train(first, task, spec, seed=3, device=CPU, checkpoint=checkpoint, stop_after=6)
    assert result.steps == 6 and load_checkpoint(checkpoint, CPU)["step"] == 6
    resumed = fresh()
    result = train(resumed, task, spec, seed=3, device=CPU, checkpoint=checkpoint)
    assert result.resumed_from == 6 and result.steps == 12
    assert [p.step for p in result.curve] == [2, 4, 6, 8, 10, 12]
    for key, value in straight.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[key]), key


def test_checkpoints_are_written_atomically(task, tmp_path: Path) -> None:
    spec = TrainSpec(length=16, steps=4, batch_size=2, checkpoint_every=2)
    checkpoint = tmp_path / "ckpt" / "run.pt"
    train(
        build_model("tiny", "nope", train_length=16),
        task,
        spec,
        seed=0,
        device=CPU,
        checkpoint=checkpoint,
    )
    assert [p.name for p in checkpoint.parent.iterdir()] == ["run.pt"]  # no temporary left
    state = torch.load(checkpoint, weights_only=True)
    assert state["step"] == 4 and set(state) >= {"model", "optimizer", "cpu_rng", "data_rng"}


def test_same_seed_same_batches_for_every_encoding(task) -> None:
    seen: dict[str, list[torch.Tensor]] = {}
    for encoding in ("nope", "alibi"):
        generator = torch.Generator().manual_seed(5)
        seen[encoding] = [task.train_batch(2, 16, generator).inputs for _ in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(seen["nope"], seen["alibi"], strict=True))


def test_nan_loss_fails_the_run_with_a_reason(task) -> None:
    model = build_model("tiny", "rope", train_length=16)
    spec = TrainSpec(length=16, steps=20, batch_size=2, progress_every=4)

    def poison(point) -> None:
        if point.step == 4:
            with torch.no_grad():
                model.final_norm.weight.fill_(float("nan"))

    with pytest.raises(TrainingDiverged, match=r"became nan between steps 5 and 8"):
        train(model, task, spec, seed=0, device=CPU, on_progress=poison)


def test_cancel_stops_at_the_next_progress_interval(task, tmp_path: Path) -> None:
    model = build_model("tiny", "nope", train_length=16)
    spec = TrainSpec(length=16, steps=50, batch_size=2, progress_every=5, checkpoint_every=100)
    checkpoint = tmp_path / "c.pt"
    calls = []

    def stop() -> bool:
        calls.append(1)
        return len(calls) >= 2

    with pytest.raises(RunCancelled, match="cancelled at step 10 of 50"):
        train(model, task, spec, seed=0, device=CPU, checkpoint=checkpoint, should_stop=stop)
    assert load_checkpoint(checkpoint, CPU)["step"] == 10  # a retry resumes from here


def test_progress_reports_loss_lr_and_throughput(task) -> None:
    points = []
    spec = TrainSpec(length=16, steps=10, batch_size=2, progress_every=5)
    train(
        build_model("tiny", "alibi", train_length=16),
        task,
        spec,
        seed=0,
        device=CPU,
        on_progress=points.append,
    )
    assert [p.step for p in points] == [5, 10]
    assert all(p.loss > 0 and p.tokens_per_second > 0 and p.lr > 0 for p in points)
