"""The training loop: schedule, exact resume, divergence, cancellation."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from core.spec import TrainSpec
from worker.data import build_task
from worker.data.base import Batch
from worker.model import build_model
from worker.training import (
    BaseHooks,
    Checkpointer,
    RunCancelled,
    Trainer,
    TrainingDiverged,
    load_checkpoint,
    lr_at,
    make_optimizer,
)

CPU = torch.device("cpu")


class Hooks(BaseHooks):
    """Hooks from functions: ``on_progress``, ``should_stop`` and ``may_write``."""

    def __init__(self, on_progress=None, should_stop=None, may_write=None) -> None:
        self.progress, self.stop, self.write = on_progress, should_stop, may_write

    def on_progress(self, point) -> None:
        if self.progress is not None:
            self.progress(point)

    def should_stop(self) -> bool:
        return self.stop is not None and self.stop()

    def may_write(self) -> bool:
        return self.write is None or self.write()


def train(
    model,
    task,
    spec,
    *,
    seed,
    device,
    checkpoint=None,
    fingerprint=None,
    data=None,
    validate=None,
    stop_after=None,
    **hooks,
):
    """A ``Trainer`` of these parts, fitted."""
    checkpointer = Checkpointer(checkpoint, fingerprint, data) if checkpoint else None
    trainer = Trainer(
        model,
        task,
        spec,
        seed=seed,
        device=device,
        checkpointer=checkpointer,
        validate=validate,
        hooks=Hooks(**hooks),
    )
    return trainer.fit(stop_after)


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory):
    lm = build_task("lm")
    lm.prepare(tmp_path_factory.mktemp("cache"))
    return lm


def test_warmup_then_cosine_to_the_floor() -> None:
    spec = TrainSpec(steps=100, lr=1e-3, warmup=0.1, min_lr_ratio=0.1)
    # Steps 0..9 warm up to the peak (reached once, at step 9); steps 10..99 decay, the
    # last step executed (99) at the floor.
    assert lr_at(0, spec) == pytest.approx(1e-4)
    assert lr_at(9, spec) == pytest.approx(1e-3)
    assert lr_at(10, spec) < 1e-3
    assert lr_at(54, spec) == pytest.approx(1e-4 + 0.9e-3 * 0.5)  # half way: 45 of 90
    assert lr_at(99, spec) == pytest.approx(1e-4)
    lrs = [lr_at(s, spec) for s in range(9, 100)]
    assert all(a > b for a, b in itertools.pairwise(lrs))
    # A warmup fraction shorter than one step still warms up for one step.
    short = TrainSpec(steps=10, lr=1e-3, warmup=0.05, min_lr_ratio=0.1)
    assert lr_at(0, short) == pytest.approx(1e-3) and lr_at(9, short) == pytest.approx(1e-4)


def test_weight_decay_applies_to_matrices_only() -> None:
    model = build_model("tiny", "alibi", train_length=16)
    decayed, kept = make_optimizer(model, TrainSpec()).param_groups
    assert all(p.dim() >= 2 for p in decayed["params"]) and decayed["weight_decay"] == 0.1
    assert all(p.dim() < 2 for p in kept["params"]) and kept["weight_decay"] == 0.0
    assert len(kept["params"]) == 2 * 2 + 1  # the LayerNorm gains


@pytest.mark.parametrize("encoding", ["t5", "learned", "fire", "kerple_log"])
def test_position_encoding_parameters_are_never_decayed(encoding: str) -> None:
    # T5's table, the learned table and FIRE's MLP are matrices, KERPLE's are vectors:
    # every encoding's own parameters are treated alike, without decay.
    model = build_model("tiny", encoding, train_length=16)
    decayed, kept = make_optimizer(model, TrainSpec()).param_groups
    own = {id(p) for p in model.encoding.parameters()}
    assert own and own <= {id(p) for p in kept["params"]}
    assert not own & {id(p) for p in decayed["params"]}
    assert any(p is model.token_embedding.weight for p in decayed["params"])


@pytest.mark.parametrize("encoding", ["alibi", "fire"])
def test_muon_takes_the_blocks_matrices_and_adamw_the_rest(encoding: str) -> None:
    model = build_model("tiny", encoding, train_length=16)
    optimizer = make_optimizer(model, TrainSpec(optimizer="muon", weight_decay=0.2))
    hidden = [(name, p) for name, p in model.named_parameters() if name.startswith("blocks.")]
    matrices = {id(p) for _, p in hidden if p.dim() == 2}
    assert len(matrices) == 4 * 2  # qkv, proj, up, down in each of the 2 blocks
    (muon,) = optimizer.muon.param_groups
    assert {id(p) for p in muon["params"]} == matrices and muon["weight_decay"] == 0.2
    decayed, kept = optimizer.adamw.param_groups
    assert [id(p) for p in decayed["params"]] == [id(model.token_embedding.weight)]
    assert decayed["weight_decay"] == 0.2 and kept["weight_decay"] == 0.0
    own = {id(p) for p in model.encoding.parameters()}
    assert own <= {id(p) for p in kept["params"]}  # FIRE's MLP matrices: AdamW, no decay
    # Every parameter in exactly one group.
    grouped = [id(p) for group in optimizer.param_groups for p in group["params"]]
    assert sorted(grouped) == sorted(id(p) for p in model.parameters())


def test_muon_trains_and_resumes_exactly(task, tmp_path: Path) -> None:
    spec = TrainSpec(
        length=32, steps=12, batch_size=4, checkpoint_every=3, progress_every=2, optimizer="muon"
    )

    def fresh():
        return build_model("tiny", "alibi", train_length=32, seed=3)

    straight = fresh()
    train(straight, task, spec, seed=3, device=CPU)
    untrained = fresh().blocks[0].attn.qkv.weight
    assert not torch.equal(straight.blocks[0].attn.qkv.weight, untrained)  # Muon's step
    checkpoint = tmp_path / "run.pt"
    train(fresh(), task, spec, seed=3, device=CPU, checkpoint=checkpoint, stop_after=6)
    assert set(load_checkpoint(checkpoint, CPU)["optimizer"]) == {"muon", "adamw"}
    resumed = fresh()
    assert train(resumed, task, spec, seed=3, device=CPU, checkpoint=checkpoint).resumed_from == 6
    for key, value in straight.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[key]), key


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


def test_a_checkpoint_inside_a_reporting_interval_resumes_the_same_curve(
    task, tmp_path: Path
) -> None:
    # Checkpoint at step 3 of an interval of 5: the point at step 5 must average steps
    # 1-5 after a resume too, not only the steps since it.
    spec = TrainSpec(length=16, steps=10, batch_size=2, checkpoint_every=3, progress_every=5)
    straight = train(build_model("tiny", "nope", train_length=16), task, spec, seed=1, device=CPU)
    checkpoint = tmp_path / "run.pt"
    model = build_model("tiny", "nope", train_length=16)
    train(model, task, spec, seed=1, device=CPU, checkpoint=checkpoint, stop_after=3)
    model = build_model("tiny", "nope", train_length=16)
    resumed = train(model, task, spec, seed=1, device=CPU, checkpoint=checkpoint)
    assert resumed.resumed_from == 3
    assert [p.loss for p in resumed.curve] == [p.loss for p in straight.curve]
    assert all(b.elapsed > a.elapsed for a, b in itertools.pairwise(resumed.curve))


def test_a_foreign_or_corrupt_checkpoint_is_set_aside(task, tmp_path: Path) -> None:
    spec = TrainSpec(length=16, steps=4, batch_size=2, checkpoint_every=2)
    checkpoint = tmp_path / "run.pt"
    model = build_model("tiny", "alibi", train_length=16)
    train(model, task, spec, seed=0, device=CPU, checkpoint=checkpoint, fingerprint="alibi-0")

    def nope_run():
        model = build_model("tiny", "nope", train_length=16)
        return train(
            model, task, spec, seed=0, device=CPU, checkpoint=checkpoint, fingerprint="nope-0"
        )

    # Another run's configuration: ignored (moved aside), training starts at step 0.
    other = nope_run()
    assert other.resumed_from == 0 and other.steps == 4
    assert load_checkpoint(checkpoint, CPU, "nope-0")["step"] == 4
    assert len(list(tmp_path.glob("run.pt.*.stale"))) == 1
    checkpoint.write_bytes(b"not a checkpoint")
    again = nope_run()
    assert again.resumed_from == 0 and len(list(tmp_path.glob("run.pt.*.stale"))) == 2


def test_a_checkpoint_trained_on_other_data_is_set_aside(task, tmp_path: Path) -> None:
    # The same configuration over an edited corpus file: its data fingerprint differs.
    spec = TrainSpec(length=16, steps=4, batch_size=2, checkpoint_every=2)
    checkpoint = tmp_path / "run.pt"

    def run(data: str):
        model = build_model("tiny", "alibi", train_length=16)
        return train(
            model,
            task,
            spec,
            seed=0,
            device=CPU,
            checkpoint=checkpoint,
            fingerprint="a-0",
            data=data,
        )

    assert run("corpus-v1").resumed_from == 0
    assert run("corpus-v1").resumed_from == 4  # the same data: the trained model is found
    assert run("corpus-v2").resumed_from == 0
    assert len(list(tmp_path.glob("run.pt.*.stale"))) == 1
    assert load_checkpoint(checkpoint, CPU, "a-0", "corpus-v2")["data"] == "corpus-v2"


def test_no_checkpoint_holds_a_diverged_model(task, tmp_path: Path) -> None:
    # Checkpoints every 6 steps, reports every 4: the NaN from step 5 is caught when
    # step 6 is about to be saved, not at the report of step 8 after the save.
    model = build_model("tiny", "rope", train_length=16)
    spec = TrainSpec(length=16, steps=20, batch_size=2, progress_every=4, checkpoint_every=6)
    checkpoint = tmp_path / "run.pt"

    def poison(point) -> None:
        if point.step == 4:
            with torch.no_grad():
                model.final_norm.weight.fill_(float("nan"))

    with pytest.raises(TrainingDiverged, match=r"between steps 5 and 6"):
        train(model, task, spec, seed=0, device=CPU, on_progress=poison, checkpoint=checkpoint)
    assert not checkpoint.exists()


def test_a_process_that_lost_the_run_writes_no_checkpoint(task, tmp_path: Path) -> None:
    spec = TrainSpec(length=16, steps=6, batch_size=2, progress_every=2, checkpoint_every=2)
    checkpoint = tmp_path / "run.pt"
    train(
        build_model("tiny", "nope", train_length=16),
        task,
        spec,
        seed=0,
        device=CPU,
        checkpoint=checkpoint,
        may_write=lambda: False,
    )
    assert not checkpoint.exists()


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


def test_same_seed_same_batches_for_every_encoding(task, monkeypatch: pytest.MonkeyPatch) -> None:
    # Through train() itself: randomized positions draw random numbers too, and must
    # not shift the data order.
    seen: dict[str, list[torch.Tensor]] = {}
    batch = task.train_batch
    for encoding in ("nope", "alibi", "randomized"):
        drawn: list[torch.Tensor] = []

        def recorded(*args, drawn=drawn):
            made = batch(*args)
            drawn.append(made.inputs)
            return made

        monkeypatch.setattr(task, "train_batch", recorded)
        train(
            build_model("tiny", encoding, train_length=16),
            task,
            TrainSpec(length=16, steps=3, batch_size=2),
            seed=5,
            device=CPU,
        )
        seen[encoding] = drawn
    assert len(seen["nope"]) == 3
    for encoding in ("alibi", "randomized"):
        assert all(torch.equal(a, b) for a, b in zip(seen["nope"], seen[encoding], strict=True))


def test_nan_loss_fails_the_run_with_a_reason(task) -> None:
    model = build_model("tiny", "rope", train_length=16)
    spec = TrainSpec(length=16, steps=20, batch_size=2, progress_every=4)

    def poison(point) -> None:
        if point.step == 4:
            with torch.no_grad():
                model.final_norm.weight.fill_(float("nan"))

    with pytest.raises(TrainingDiverged, match=r"became nan between steps 5 and 8"):
        train(model, task, spec, seed=0, device=CPU, on_progress=poison)


def test_cancel_stops_at_the_next_step(task, tmp_path: Path) -> None:
    # Asked after every step (the flags it reads are kept fresh by the heartbeat), not
    # only at progress reports: the cancel seen after step 7 stops the run there.
    model = build_model("tiny", "nope", train_length=16)
    spec = TrainSpec(length=16, steps=50, batch_size=2, progress_every=5, checkpoint_every=100)
    checkpoint = tmp_path / "c.pt"
    calls = []

    def stop() -> bool:
        calls.append(1)
        return len(calls) >= 7

    with pytest.raises(RunCancelled, match="cancelled at step 7 of 50"):
        train(model, task, spec, seed=0, device=CPU, checkpoint=checkpoint, should_stop=stop)
    assert load_checkpoint(checkpoint, CPU)["step"] == 7  # a retry resumes from here


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


def test_gradient_accumulation_averages_micro_batches(task, monkeypatch) -> None:
    # Two micro-batches of 2 make one step on the mean loss of their 4 sequences: the
    # same loss and update as one batch of those 4 sequences (float64; Adam's first step
    # is ~lr x sign(gradient), so entries with a near-zero gradient may differ in the
    # last bits, hence the tolerance, far below the step of 2e-3).
    spec = TrainSpec(length=16, steps=1, batch_size=2, grad_accum=2)
    drawn = []
    batch = task.train_batch

    def recorded(*args):
        made = batch(*args)
        drawn.append(made)
        return made

    monkeypatch.setattr(task, "train_batch", recorded)
    accumulated = build_model("tiny", "nope", train_length=16).double()
    first = train(accumulated, task, spec, seed=0, device=CPU)
    assert len(drawn) == 2
    whole = Batch(torch.cat([b.inputs for b in drawn]), torch.cat([b.targets for b in drawn]))
    monkeypatch.setattr(task, "train_batch", lambda *args: whole)
    single = build_model("tiny", "nope", train_length=16).double()
    second = train(single, task, TrainSpec(length=16, steps=1, batch_size=4), seed=0, device=CPU)
    # (the loss itself is taken in float32)
    assert first.curve[0].loss == pytest.approx(second.curve[0].loss, rel=1e-6)
    for key, value in single.state_dict().items():
        torch.testing.assert_close(accumulated.state_dict()[key], value, rtol=0, atol=1e-6)


def _validator(model, task, length: int, tokens: int = 256):
    from worker.evaluate import validation_loss

    return lambda: validation_loss(
        model, task, length=length, tokens=tokens, batch_tokens=4096, device=CPU, seed=3
    )


@pytest.mark.parametrize("encoding", ["randomized", "rope"])
def test_validation_changes_no_step_and_reports_at_its_steps(encoding: str, task) -> None:
    # Randomized positions draw from the global generator in training and in
    # validation: validating must leave training's draws (and its weights) as they were.
    spec = TrainSpec(length=32, steps=10, batch_size=4, progress_every=2, val_every=4)
    plain = build_model("tiny", encoding, train_length=32, seed=3)
    unvalidated = train(plain, task, spec, seed=3, device=CPU)
    model = build_model("tiny", encoding, train_length=32, seed=3)
    validated = train(model, task, spec, seed=3, device=CPU, validate=_validator(model, task, 32))
    for key, value in plain.state_dict().items():
        assert torch.equal(value, model.state_dict()[key]), key
    assert [p.loss for p in validated.curve] == [p.loss for p in unvalidated.curve]
    assert [p.step for p in validated.curve] == [2, 4, 6, 8, 10]
    assert [p.step for p in validated.curve if p.val_loss is not None] == [4, 8, 10]
    assert all(p.val_loss is None for p in unvalidated.curve)
    losses = [p.val_loss for p in validated.curve if p.val_loss is not None]
    assert all(0 < loss < 6 for loss in losses) and losses[-1] < losses[0]


def test_validation_off_and_off_cadence_steps(task) -> None:
    # val_every 0: no validation; a cadence that is not a multiple of the reports adds
    # a report at the validation step.
    spec = TrainSpec(length=16, steps=6, batch_size=2, progress_every=4, val_every=0)
    model = build_model("tiny", "nope", train_length=16)
    off = train(model, task, spec, seed=1, device=CPU, validate=_validator(model, task, 16))
    assert [(p.step, p.val_loss) for p in off.curve] == [(4, None), (6, None)]
    spec = TrainSpec(length=16, steps=6, batch_size=2, progress_every=4, val_every=3)
    model = build_model("tiny", "nope", train_length=16)
    odd = train(model, task, spec, seed=1, device=CPU, validate=_validator(model, task, 16))
    assert [(p.step, p.val_loss is not None) for p in odd.curve] == [
        (3, True),
        (4, False),
        (6, True),
    ]


def test_validation_loss_is_the_evaluation_loss_at_the_training_length(task) -> None:
    # The same held-out targets as the final evaluation at the training length when the
    # budgets match (and the study's longest length is given: the stretches are laid
    # out by it), so the last validation point and the 1x evaluation agree.
    from core.spec import EvalSpec
    from worker.evaluate import NONE, evaluate_length

    model = build_model("tiny", "rope", train_length=32, seed=2).eval()
    eval_spec = EvalSpec(lengths=[32, 128], tokens=512)
    row = evaluate_length(
        model,
        task,
        eval_spec,
        length=32,
        protocol="nonoverlapping",
        variant=NONE,
        train_length=32,
        device=CPU,
        seed=3,
    )
    model.train()
    from worker.evaluate import validation_loss

    def validate(longest: int | None) -> float:
        return validation_loss(
            model,
            task,
            length=32,
            tokens=512,
            batch_tokens=4096,
            device=CPU,
            seed=3,
            longest=longest,
        )

    value = validate(128)
    assert value == pytest.approx(row.loss, rel=1e-6)
    assert model.training and validate(128) == value
    assert validate(None) != value  # stretches laid out by 32: other targets


def test_a_resumed_run_reports_the_same_validation_curve(task, tmp_path: Path) -> None:
    spec = TrainSpec(length=16, steps=8, batch_size=2, checkpoint_every=3, val_every=2)
    model = build_model("tiny", "randomized", train_length=16, seed=1)
    straight = train(model, task, spec, seed=1, device=CPU, validate=_validator(model, task, 16))
    checkpoint = tmp_path / "run.pt"
    model = build_model("tiny", "randomized", train_length=16, seed=1)
    validate = _validator(model, task, 16)
    train(
        model,
        task,
        spec,
        seed=1,
        device=CPU,
        checkpoint=checkpoint,
        stop_after=3,
        validate=validate,
    )
    model = build_model("tiny", "randomized", train_length=16, seed=1)
    resumed = train(
        model,
        task,
        spec,
        seed=1,
        device=CPU,
        checkpoint=checkpoint,
        validate=_validator(model, task, 16),
    )
    assert resumed.resumed_from == 3
    assert [p.val_loss for p in resumed.curve] == [p.val_loss for p in straight.curve]


class _Recording:
    """A task that records the length of every training batch it gives."""

    def __init__(self, task) -> None:
        self.task, self.lengths = task, []

    def train_batch(self, batch_size: int, length: int, generator: torch.Generator) -> Batch:
        self.lengths.append(length)
        return self.task.train_batch(batch_size, length, generator)


def test_steps_may_draw_their_length_and_resume_the_same_draws(task, tmp_path: Path) -> None:
    # min_length: each step at a length drawn from [min_length, length] by the data
    # generator (one length for the step's micro-batches), so every encoding of a seed
    # sees the same lengths, and a resumed run draws the rest exactly.
    spec = TrainSpec(length=32, min_length=8, steps=12, batch_size=2, grad_accum=2, val_every=0)
    straight = _Recording(task)
    reference = build_model("tiny", "rope", train_length=32, seed=1)
    train(reference, straight, spec, seed=1, device=CPU)
    lengths = straight.lengths[::2]
    assert straight.lengths[1::2] == lengths  # micro-batches of a step share it
    assert all(8 <= n <= 32 for n in lengths) and len(set(lengths)) > 3
    other = _Recording(task)
    train(build_model("tiny", "alibi", train_length=32), other, spec, seed=1, device=CPU)
    assert other.lengths == straight.lengths
    first, rest = _Recording(task), _Recording(task)
    checkpoint = tmp_path / "run.pt"
    model = build_model("tiny", "rope", train_length=32, seed=1)
    train(model, first, spec, seed=1, device=CPU, checkpoint=checkpoint, stop_after=5)
    resumed = build_model("tiny", "rope", train_length=32, seed=1)
    train(resumed, rest, spec, seed=1, device=CPU, checkpoint=checkpoint)
    assert first.lengths + rest.lengths == straight.lengths
    for key, value in resumed.state_dict().items():
        assert torch.equal(value, reference.state_dict()[key]), key


def test_a_trainer_loaded_with_another_trainers_state_continues_exactly(task) -> None:
    # state_dict() is everything a resume needs: no checkpoint file in between.
    spec = TrainSpec(length=16, steps=8, batch_size=2, progress_every=3, val_every=0)
    straight = train(
        build_model("tiny", "randomized", train_length=16), task, spec, seed=2, device=CPU
    )
    first = Trainer(
        build_model("tiny", "randomized", train_length=16), task, spec, seed=2, device=CPU
    )
    first.fit(stop_after=4)
    state = first.state_dict()  # as a checkpoint takes it: the random generators too
    model = build_model("tiny", "randomized", train_length=16)
    second = Trainer(model, task, spec, seed=2, device=CPU)
    second.load_state_dict(state)
    result = second.fit()
    assert result.resumed_from == 4 and result.steps == 8
    assert [p.loss for p in result.curve] == [p.loss for p in straight.curve]


def test_the_checkpoint_format_is_unchanged(task, tmp_path: Path) -> None:
    # CHECKPOINT_VERSION 2: a checkpoint written by an earlier version of this code
    # resumes; its keys are the trainer's state and three stamps.
    from worker.training import CHECKPOINT_VERSION

    spec = TrainSpec(length=16, steps=2, batch_size=2, checkpoint_every=2)
    checkpoint = tmp_path / "run.pt"
    model = build_model("tiny", "nope", train_length=16)
    train(model, task, spec, seed=0, device=CPU, checkpoint=checkpoint, fingerprint="f", data="d")
    state = torch.load(checkpoint, weights_only=True)
    assert CHECKPOINT_VERSION == 2 and list(state) == [
        "version",
        "fingerprint",
        "data",
        "step",
        "interval",
        "elapsed",
        "model",
        "optimizer",
        "cpu_rng",
        "data_rng",
        "curve",
    ]
    assert (state["version"], state["fingerprint"], state["data"], state["step"]) == (
        2,
        "f",
        "d",
        2,
    )
    assert set(state["interval"]) == {"loss_sum", "steps"}


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.parametrize(("task_name", "encoding"), [("lm", "rope"), ("copy", "nope")])
def test_a_compiled_training_step_is_one_graph_that_trains_as_eager(
    task_name: str, encoding: str, tmp_path: Path
) -> None:
    """train.compile traces forward and loss as one graph (AOTAutograd compiles the
    backward with it): no graph break, so nothing waits for the device inside a step; the
    scored targets of a synthetic task are weighted, not selected. Same curve as eager."""
    from torch._dynamo.utils import counters

    chosen = build_task(task_name)
    chosen.prepare(tmp_path)
    curves = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        counters.clear()
        model = build_model("tiny", encoding, train_length=16, seed=0)
        spec = TrainSpec(length=16, steps=6, batch_size=4, progress_every=1, compile=compiled)
        curves[compiled] = [p.loss for p in train(model, chosen, spec, seed=0, device=CPU).curve]
        if compiled:
            assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
            assert counters["stats"]["unique_graphs"] >= 1
    assert curves[True] == pytest.approx(curves[False], rel=1e-4)
    torch._dynamo.reset()
