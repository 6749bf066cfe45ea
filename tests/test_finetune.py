"""Fine-tuned RoPE variants: the trained model, fine-tuned under a scaling (the PI and
YaRN papers' recipe), then evaluated; resumable like training."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from core.settings import get_settings
from core.spec import parse_spec
from worker.run import prepared_task, run_one
from worker.training import BaseHooks, RunCancelled

CPU = torch.device("cpu")


class Hooks(BaseHooks):
    """Records evaluations and fine-tuning reports; stops when ``should_stop`` says so."""

    def __init__(self, on_evaluation=None, should_stop=None) -> None:
        self.evaluated, self.stop, self.reports = on_evaluation, should_stop, []

    def on_evaluation(self, row) -> None:
        if self.evaluated is not None:
            self.evaluated(row)

    def on_finetune_progress(self, label: str, point, steps: int) -> None:
        self.reports.append((label, point.step, steps))

    def should_stop(self) -> bool:
        return self.stop is not None and self.stop()


def study(variants: list) -> object:
    return parse_spec(
        {
            "model": "tiny",
            "train": {"length": 32, "steps": 30, "batch_size": 4, "val_every": 0},
            "encodings": ["rope"],
            "eval": {"lengths": [32, 128], "tokens": 512, "variants": variants},
        }
    )


@pytest.fixture(scope="module")
def task():
    return prepared_task(study(["yarn:4"]), get_settings().corpus_cache)


def losses(result, variant: str) -> list[float]:
    return [row.loss for row in result.evaluations if row.variant == variant]


def test_a_fine_tuned_variant_trains_a_copy_under_its_scaling(task) -> None:
    spec = study(["yarn:4", "yarn:4+ft20"])
    (run,) = spec.runs()
    hooks = Hooks()
    tuned = run_one(spec, run, device=CPU, task=task, hooks=hooks)
    assert hooks.reports == [("yarn:4+ft20", 10, 20), ("yarn:4+ft20", 20, 20)]  # the run's note
    plain_spec = study(["yarn:4"])
    plain = run_one(plain_spec, plain_spec.runs()[0], device=CPU, task=task)
    # The trained model and its inference-time scaling are untouched by the fine-tuning
    # of a copy: the same numbers as a study without the fine-tuned variant.
    assert losses(tuned, "none") == losses(plain, "none")
    assert losses(tuned, "yarn:4") == losses(plain, "yarn:4")
    # Fine-tuned at 4 x 32 = 128 tokens: better than the scaling alone at that length.
    record = tuned.provenance["finetune"]["yarn:4+ft20"]
    assert (record["steps"], record["length"], record["resumed_from"]) == (20, 128, 0)
    assert record["lr"] == pytest.approx(spec.train.lr / 10)
    assert [step for step, _ in record["curve"]] == [10, 20]  # its loss curve, every report
    at_128 = {row.variant: row.loss for row in tuned.evaluations if row.length == 128}
    assert at_128["yarn:4+ft20"] < at_128["yarn:4"]
    assert "finetune" not in plain.provenance


def test_a_stopped_fine_tuning_resumes_from_its_checkpoint(task, tmp_path: Path) -> None:
    spec = study(["pi:4+ft12"])
    (run,) = spec.runs()
    straight = run_one(spec, run, device=CPU, task=task)
    checkpoint = tmp_path / "7.pt"
    stored: dict[tuple[str, str, int], float] = {}
    calls = {"n": 0}

    def stop_in_fine_tuning() -> bool:
        # Training asks after each of its 30 steps; then each evaluation point and batch;
        # then the fine-tuning's steps: stop a few steps into the fine-tuning.
        calls["n"] += 1
        return len(stored) == 2 and calls["n"] > 45

    def keep(row) -> None:
        stored[(row.variant, row.protocol, row.length)] = row.loss

    with pytest.raises(RunCancelled, match=r"cancelled at step \d+ of 12"):
        run_one(
            spec,
            run,
            device=CPU,
            task=task,
            checkpoint=checkpoint,
            hooks=Hooks(on_evaluation=keep, should_stop=stop_in_fine_tuning),
        )
    tuned_files = list(tmp_path.glob("7.pt.ft-*"))
    assert len(tuned_files) == 1 and sorted(stored) == [
        ("none", "nonoverlapping", 32),
        ("none", "nonoverlapping", 128),
    ]
    resumed = run_one(
        spec,
        run,
        device=CPU,
        task=task,
        checkpoint=checkpoint,
        hooks=Hooks(on_evaluation=keep),
        skip_evaluations=set(stored),
    )
    record = resumed.provenance["finetune"]["pi:4+ft12"]
    assert 0 < record["resumed_from"] < 12
    assert [row.variant for row in resumed.evaluations] == ["pi:4+ft12", "pi:4+ft12"]
    # Bit for bit the uninterrupted run's fine-tuned model (CPU).
    assert losses(resumed, "pi:4+ft12") == losses(straight, "pi:4+ft12")
    assert not list(tmp_path.glob("7.pt.ft-*"))  # every point stored: the copy is gone
    assert (tmp_path / "7.pt").exists()  # the trained model stays (others may adopt it)
    # A rerun that finds every point stored fine-tunes nothing again.
    again = run_one(
        spec, run, device=CPU, task=task, checkpoint=checkpoint, skip_evaluations=set(stored)
    )
    assert again.evaluations == [] and "finetune" not in again.provenance


def test_scaled_fine_tuning_is_for_rotary_encodings_unscaled_for_every_one(task) -> None:
    # 'yarn:2+ft3' scales RoPE: rotary runs only. 'none+ft3@64' fine-tunes at 64 tokens
    # without a scaling (the PI paper's baseline): every encoding, and one whose learned
    # table ends at 32 is not applicable, with the reason, instead of failing the run.
    spec = parse_spec(
        {
            "model": "tiny",
            "train": {"length": 32, "steps": 4, "batch_size": 2, "val_every": 0},
            "encodings": ["alibi", "rope", "learned"],
            "eval": {
                "lengths": [32, 64],
                "tokens": 256,
                "variants": ["yarn:2+ft3", "none+ft3@64"],
            },
        }
    )
    alibi, rope, learned = (run_one(spec, r, device=CPU, task=task) for r in spec.runs())
    assert [(r.variant, r.length) for r in alibi.evaluations] == [
        ("none", 32),
        ("none", 64),
        ("none+ft3@64", 32),
        ("none+ft3@64", 64),
    ]
    assert alibi.provenance["finetune"]["none+ft3@64"]["length"] == 64
    assert losses(alibi, "none+ft3@64") != losses(alibi, "none")
    variants = [r.variant for r in rope.evaluations]
    assert variants == ["none"] * 2 + ["yarn:2+ft3"] * 2 + ["none+ft3@64"] * 2
    tuned = [r for r in learned.evaluations if r.variant == "none+ft3@64"]
    assert len(tuned) == 2 and all(r.loss is None for r in tuned)
    assert all(
        r.not_applicable.startswith("not applicable: cannot fine-tune: encoding 'learned'")
        for r in tuned
    )
    assert "finetune" not in learned.provenance


def test_a_failed_fine_tuning_leaves_the_run_and_says_why(task, monkeypatch) -> None:
    from worker.evaluate import evaluate
    from worker.model import build_model
    from worker.training import NO_HOOKS, TrainingDiverged
    from worker.training.finetune import FineTuner

    spec = study(["yarn:4", "yarn:4+ft20"])
    model = build_model("tiny", "rope", train_length=32)
    (run,) = spec.runs()
    tuner = FineTuner(model, task, spec, run, device=CPU, checkpoint=None, hooks=NO_HOOKS)

    def diverges(variant):
        raise TrainingDiverged("the training loss became nan between steps 3 and 4")

    monkeypatch.setattr(tuner, "tune", diverges)
    rows = evaluate(
        model,
        task,
        spec.eval,
        train_length=32,
        scalable=True,
        device=CPU,
        model_for=tuner.model_for,
    )
    assert [(r.variant, r.loss is not None) for r in rows] == [
        ("none", True),
        ("none", True),
        ("yarn:4", True),
        ("yarn:4", True),
        ("yarn:4+ft20", False),
        ("yarn:4+ft20", False),
    ]
    assert rows[-1].not_applicable == (
        "not applicable: fine-tuning failed: the training loss became nan between steps 3 and 4"
    )
