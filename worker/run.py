"""Run a study in-process: train every (encoding, seed), evaluate each at every length.

``run_one`` is the unit the Celery worker wraps; ``run_study`` loops it for
``posbench run``, notebooks and demos (no broker, no database). The engine reads no
settings: its callers give the device, the prepared task (its cache folder) and the
hooks a run reports to.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from core import analysis
from core.catalog.corpora import SourcePolicy
from core.catalog.encodings import REGISTRY
from core.catalog.hf_models import NO_MODELS, ModelPolicy
from core.errors import UserError
from core.spec import RunSpec, StudySpec
from worker.data import build_task
from worker.data.base import NO_SOURCES, Task
from worker.evaluate import evaluate, validation_loss
from worker.layers import ModelConfig
from worker.model import Transformer, build_model
from worker.outcome import RunResult, probe_order, provenance
from worker.training import (
    NO_HOOKS,
    Checkpointer,
    DiskBudget,
    RunCancelled,
    RunHooks,
    Trainer,
    TrainResult,
)
from worker.training.finetune import FineTuner


class DeviceError(UserError, ValueError):
    """A device that is not a torch device, or not on this machine."""


def resolve_device(requested: str | None = None, default: str | None = None) -> torch.device:
    """The requested device (or ``default``: the caller's setting, POSBENCH_DEVICE),
    checked against this machine; CUDA when there is one otherwise."""
    if requested is not None and not requested.strip():
        raise DeviceError("device '' is empty: give cpu, cuda, cuda:N or mps (or leave it out)")
    name = requested or default
    if not name:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise DeviceError(f"device {name!r} is not one of cpu, cuda, cuda:N, mps") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise DeviceError(f"device {name!r}: this machine's torch sees no CUDA device")
        if device.index is not None and device.index >= count:
            raise DeviceError(f"device {name!r}: this machine has CUDA devices 0..{count - 1}")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise DeviceError(f"device {name!r}: MPS is not available on this machine")
    elif device.type not in ("cpu", "cuda", "mps"):
        raise DeviceError(f"device {name!r} is not one of cpu, cuda, cuda:N, mps")
    return device


def prepared_task(spec: StudySpec, cache: Path, sources: SourcePolicy = NO_SOURCES) -> Task:
    """The study's task with its data loaded (a corpus is read and hashed once, and
    prepared into the ``cache`` folder) from where ``sources`` allow: the caller's
    settings (corpus roots, byte caps, HuggingFace); by default no text: or hf: corpus."""
    task = build_task(spec.task.name, **spec.task.params)
    task.prepare(cache, sources)
    task.check_plan(spec.eval)
    return task


def build_run_model(spec: StudySpec, run: RunSpec) -> Transformer:
    """The untrained model of one (encoding, seed) of ``spec``."""
    config = ModelConfig(**spec.model.dims())
    return build_model(
        config,
        run.encoding.name,
        train_length=spec.train.length,
        seed=run.seed,
        attn_implementation=spec.model.attn_implementation,
        attn_softcap=spec.model.attn_softcap,
        **run.encoding.params,
    )


def train_run_model(
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
) -> TrainResult:
    """Train ``model`` (resuming from ``checkpoint``, saving it no more often than every
    ``min_checkpoint_seconds`` and, periodically, only within ``disk_budget``),
    validating on held-out data at the training length with the stretches the
    evaluation scores."""
    checkpointer = None
    if checkpoint is not None:
        checkpointer = Checkpointer(checkpoint, fingerprint=run.train_hash, data=task.fingerprint)
    validate = partial(
        validation_loss,
        model,
        task,
        length=spec.train.length,
        tokens=spec.train.val_tokens,
        batch_tokens=spec.eval.batch_tokens,
        device=device,
        seed=run.seed,
        longest=max(spec.eval.lengths),
    )
    trainer = Trainer(
        model,
        task,
        spec.train,
        seed=run.seed,
        device=device,
        checkpointer=checkpointer,
        validate=validate,
        hooks=hooks,
        min_checkpoint_seconds=min_checkpoint_seconds,
        disk_budget=disk_budget,
    )
    return trainer.fit()


def run_one(
    spec: StudySpec,
    run: RunSpec,
    *,
    task: Task,
    device: torch.device,
    checkpoint: Path | None = None,
    hooks: RunHooks = NO_HOOKS,
    skip_evaluations: set[tuple[str, str, int]] | None = None,
    min_checkpoint_seconds: float = 0.0,
    disk_budget: DiskBudget | None = None,
    models: ModelPolicy = NO_MODELS,
) -> RunResult:
    """Train one (encoding, seed) of ``spec`` and evaluate it at every planned point but
    those in ``skip_evaluations`` (stored by an earlier attempt); ``task`` is the
    study's task, prepared (``prepared_task``); ``hooks`` hear the run's progress and
    may stop it; ``min_checkpoint_seconds`` spaces the periodic checkpoints (the
    service's floor; 0: every ``checkpoint_every`` steps) and ``disk_budget`` skips
    those that would not fit (the service's artifacts budget; None: no bound). A study
    of an hf: model trains nothing and evaluates that model, loaded from where
    ``models`` (the operator's rules) allow (``worker.hf.run``)."""
    if spec.model.hf is not None:
        from worker.hf.run import run_hf

        skip = skip_evaluations
        return run_hf(
            spec, run, task=task, device=device, hooks=hooks, skip_evaluations=skip, models=models
        )
    model = build_run_model(spec, run)
    spacing = {"min_checkpoint_seconds": min_checkpoint_seconds, "disk_budget": disk_budget}
    trained = train_run_model(
        model, task, spec, run, device=device, checkpoint=checkpoint, hooks=hooks, **spacing
    )
    hooks.on_trained()
    tuner = FineTuner(
        model, task, spec, run, device=device, checkpoint=checkpoint, hooks=hooks, **spacing
    )
    rows = evaluate(
        model,
        task,
        spec.eval,
        train_length=spec.train.length,
        scalable=REGISTRY[run.encoding.name].scalable,
        device=device,
        hooks=hooks,
        skip=skip_evaluations,
        seed=run.seed,
        model_for=tuner.model_for,
    )
    tuner.close()  # every point is stored
    if hooks.should_stop():
        raise RunCancelled("cancelled after evaluation, before the order probe")
    order = probe_order(model, task, spec, run, device)
    return RunResult(
        label=run.encoding.label,
        encoding=run.encoding.name,
        params=run.encoding.resolved_params,
        seed=run.seed,
        config_hash=run.config_hash,
        train=trained,
        evaluations=rows,
        provenance=provenance(device, run.seed, task.fingerprint)
        | {"attn_implementation": model.attention_record()}
        | ({"finetune": tuner.records} if tuner.records else {}),
        order=order,
    )


@dataclass
class StudyResult:
    spec: StudySpec
    runs: list[RunResult] = field(default_factory=list)

    @property
    def metric(self) -> str:
        return self.spec.task.metric

    def seed_values(
        self, protocol: str | None = None, metric: str | None = None
    ) -> dict[str, dict[int, list[float]]]:
        """``{line label: {length: the metric of each seed that has one}}`` (``metric``:
        the study's, or another field of an evaluation, e.g. token_accuracy)."""
        protocol = protocol or self.spec.eval.protocols[0]
        metric = metric or self.metric
        values: dict[str, dict[int, list[float]]] = {}
        for run in self.runs:
            for row in run.evaluations:
                if row.protocol != protocol:
                    continue
                label = analysis.line_name(run.label, row.variant)
                value = getattr(row, metric)
                bucket = values.setdefault(label, {}).setdefault(row.length, [])
                if value is not None:
                    bucket.append(value)
        return {label: dict(sorted(points.items())) for label, points in values.items()}

    def curves(
        self, protocol: str | None = None, metric: str | None = None
    ) -> dict[str, dict[int, float | None]]:
        """``{line label: {length: metric averaged over seeds}}``; None where not applicable."""
        return {
            label: {length: (sum(v) / len(v) if v else None) for length, v in points.items()}
            for label, points in self.seed_values(protocol, metric).items()
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "spec": self.spec.model_dump(mode="json"),
            "metric": self.metric,
            "runs": [
                run.to_dict(
                    self.spec.train.length, self.metric, analysis.effective_setting(self.spec)
                )
                for run in self.runs
            ],
        }


def run_study(
    spec: StudySpec,
    *,
    task: Task,
    device: torch.device,
    checkpoint_dir: Path | None = None,
    hooks_for: Callable[[RunSpec], RunHooks] | None = None,
    models: ModelPolicy = NO_MODELS,
) -> StudyResult:
    """Every run of ``spec``, one after another, in this process (``task``: the study's
    task, prepared). ``hooks_for(run)`` gives the hooks of each run, asked as it starts;
    ``models`` says where an hf: model may be loaded from."""
    result = StudyResult(spec)
    data = hashlib.sha256(task.fingerprint.encode()).hexdigest()[:12]
    for run in spec.runs():
        hooks = hooks_for(run) if hooks_for is not None else NO_HOOKS
        # Named by what was trained, on which data: a study that only evaluates
        # differently (another stride, a new length or variant) finds the trained model
        # and trains nothing; an edited corpus file has another fingerprint.
        checkpoint = (
            checkpoint_dir / f"{run.train_hash}-{data}.pt"
            if checkpoint_dir and run.train_hash
            else None
        )
        result.runs.append(
            run_one(
                spec,
                run,
                task=task,
                device=device,
                checkpoint=checkpoint,
                hooks=hooks,
                models=models,
            )
        )
    return result
