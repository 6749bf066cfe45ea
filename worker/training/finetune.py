"""Fine-tuned variants (``yarn:4+ft200``, ``none+ft200@512``): the PI and YaRN papers'
recipe. A copy of the trained model is trained a few more steps at a longer length
under the variant's scaling, then evaluated under the same scaling again.

A copy is made when evaluation first needs it and held one at a time (the plan is
variant by variant). Its checkpoint lies next to the run's own, so a stopped run
resumes the fine-tuning too, and is removed once its variant's points are evaluated
(the evaluation has moved on to the next variant, or every point of the run is done):
a run holds at most one fine-tuned checkpoint besides its own.
A copy that cannot be made (a learned table shorter than the tuning length) or whose
training diverged is *not applicable*, with the reason; the run's other results stand.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import zlib
from pathlib import Path
from typing import Any

import torch

from core.results_schema import TrainPoint
from core.spec import RunSpec, StudySpec, VariantSpec
from worker.data.base import Task
from worker.encodings.base import PositionOutOfRange
from worker.model import Transformer
from worker.training.checkpoint import Checkpointer, DiskBudget
from worker.training.hooks import BaseHooks, RunHooks
from worker.training.trainer import RunCancelled, Trainer, TrainingDiverged


def finetune_checkpoint(checkpoint: Path | None, variant: VariantSpec) -> Path | None:
    """Where a fine-tuned variant's checkpoint lives: next to its run's, named by a hash
    of the variant's label (``<run>.pt.ft-<hash>``); removed once its points are
    evaluated."""
    if checkpoint is None or variant.finetune is None:
        return None
    return checkpoint.with_name(
        f"{checkpoint.name}.ft-{hashlib.sha256(variant.label.encode()).hexdigest()[:12]}"
    )


class _TuningHooks(BaseHooks):
    """The run's hooks as one fine-tuning's trainer sees them: its reports are the run's
    fine-tuning progress."""

    def __init__(self, hooks: RunHooks, label: str, steps: int) -> None:
        self.hooks, self.label, self.steps = hooks, label, steps

    def on_progress(self, point: TrainPoint) -> None:
        self.hooks.on_finetune_progress(self.label, point, self.steps)

    def should_stop(self) -> bool:
        return self.hooks.should_stop()

    def may_write(self) -> bool:
        return self.hooks.may_write()


class FineTuner:
    """The models one run's variants evaluate: its trained ``model``, or a fine-tuned
    copy of it. ``records`` holds how each copy was made (the run's provenance)."""

    def __init__(
        self,
        model: Transformer,
        task: Task,
        spec: StudySpec,
        run: RunSpec,
        *,
        device: torch.device,
        checkpoint: Path | None,
        hooks: RunHooks,
        min_checkpoint_seconds: float = 0.0,
        disk_budget: DiskBudget | None = None,
    ) -> None:
        self.model, self.task, self.spec, self.run = model, task, spec, run
        self.min_checkpoint_seconds, self.disk_budget = min_checkpoint_seconds, disk_budget
        self.device, self.checkpoint, self.hooks = device, checkpoint, hooks
        self.records: dict[str, dict[str, Any]] = {}
        # The variant held, and its copy or why it has none.
        self._held: tuple[VariantSpec, Transformer | str] | None = None

    def model_for(self, variant: VariantSpec) -> Transformer | str:
        """The model ``variant`` evaluates, or why a fine-tuned variant has none (a
        sentence that begins 'not applicable')."""
        if variant.finetune is None:
            self.release()
            return self.model
        if self._held is None or self._held[0].label != variant.label:
            self.release()  # one copy at a time
            self._held = (variant, self._tuned_or_why(variant))
        return self._held[1]

    def _tuned_or_why(self, variant: VariantSpec) -> Transformer | str:
        try:
            return self.tune(variant).to(self.device).eval()
        except PositionOutOfRange as err:  # a learned table shorter than the tuning
            return f"not applicable: cannot fine-tune: {err}"
        except TrainingDiverged as err:
            # Deterministic, so recorded: the run's other results stand, and this
            # variant says why it has none. (Out of memory depends on the device: it
            # fails the run, whose retry resumes here on another.)
            reason = str(err).splitlines()[0]
            return f"not applicable: fine-tuning failed: {reason}"

    def tune(self, variant: VariantSpec) -> Transformer:
        """A copy of the trained model, fine-tuned under the variant's scaling (evaluation
        applies the same scaling to it again), checkpointed next to the run's own."""
        spec, run, tuning = self.spec, self.run, self.spec.finetune_spec(variant)
        self.model.encoding.check_length(tuning.length)  # a learned table: not applicable
        tuned = copy.deepcopy(self.model)
        scaling = (
            contextlib.nullcontext()  # 'none+ft...': fine-tuned at the length, unscaled
            if variant.method == "none"
            else tuned.scaled(
                variant.method, float(variant.factor), spec.train.length, **variant.params
            )
        )
        path = finetune_checkpoint(self.checkpoint, variant)
        checkpointer = None
        if path is not None:
            fingerprint = f"{run.train_hash}+{variant.label}"
            checkpointer = Checkpointer(path, fingerprint=fingerprint, data=self.task.fingerprint)
        try:
            with scaling:
                trainer = Trainer(
                    tuned,
                    self.task,
                    tuning,
                    # Windows of its own: not the first ones the training read.
                    seed=zlib.crc32(f"{run.seed}/finetune/{variant.label}".encode()),
                    device=self.device,
                    checkpointer=checkpointer,
                    hooks=_TuningHooks(self.hooks, variant.label, tuning.steps),
                    min_checkpoint_seconds=self.min_checkpoint_seconds,
                    disk_budget=self.disk_budget,
                )
                result = trainer.fit()
        except RunCancelled as err:
            raise RunCancelled(f"{err} (fine-tuning {variant.label})") from None
        self.records[variant.label] = {
            "steps": tuning.steps,
            "length": tuning.length,
            "lr": tuning.lr,
            "batch_size": tuning.batch_size,
            "final_loss": result.final_loss,
            # Over every attempt (a resumed fine-tuning's own time is only the rest).
            "seconds": result.curve[-1].elapsed if result.curve else result.seconds,
            "resumed_from": result.resumed_from,
            # The fine-tuning's loss curve: did it converge in its steps?
            "curve": [[point.step, point.loss] for point in result.curve],
        }
        self.hooks.on_finetuned(variant.label, self.records[variant.label])
        return tuned

    def release(self) -> None:
        """Forget the fine-tuned copy, and give its memory back to the device. It is
        released when the evaluation moves on to another variant (the plan is variant by
        variant, each point told to the hooks before the next: a worker has stored them)
        or is done: its checkpoint is done with too. A run stopped before has not
        released it, and resumes its fine-tuning."""
        if self._held is not None:
            variant, self._held = self._held[0], None
            path = finetune_checkpoint(self.checkpoint, variant)
            if path is not None:
                path.unlink(missing_ok=True)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def close(self) -> None:
        """Every point of the run is stored: the copies and their checkpoints are done
        with (those of variants an earlier attempt evaluated too)."""
        self.release()
        for variant in self.spec.eval.variants:
            path = finetune_checkpoint(self.checkpoint, variant)  # None: not fine-tuned
            if path is not None:
                path.unlink(missing_ok=True)
