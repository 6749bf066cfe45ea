"""Run a study in-process: train every (encoding, seed), evaluate each at every length.

``run_one`` is the unit the Celery task wraps; ``run_study`` loops it for the
CLI, notebooks and demos (no broker, no database).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import os
import platform
import subprocess
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from jobs import analysis
from jobs.metrics import Kind, kind_of
from jobs.results_schema import Evaluation, TrainPoint
from jobs.settings import get_settings
from jobs.spec import RunSpec, StudySpec, VariantSpec
from worker.data import build_task
from worker.data.base import Task
from worker.encodings import REGISTRY
from worker.evaluate import evaluate, validation_loss
from worker.memory import available_bytes, eval_batch_size
from worker.model import ModelConfig, Transformer, build_model
from worker.probes import OrderProbe, order_probe
from worker.train import RunCancelled, TrainResult, train


class DeviceError(ValueError):
    """A device that is not a torch device, or not on this machine."""


def resolve_device(requested: str | None = None) -> torch.device:
    """The requested device (or POSBENCH_DEVICE), checked against this machine; CUDA when
    there is one otherwise."""
    if requested is not None and not requested.strip():
        raise DeviceError("device '' is empty: give cpu, cuda, cuda:N or mps (or leave it out)")
    name = requested or get_settings().device
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


@lru_cache(maxsize=1)
def _git_commit() -> str | None:
    """The checkout's commit, with '+dirty' when files differ from it; in an image
    (no .git), the commit it was built from (POSBENCH_GIT_COMMIT, a build argument)."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5
        )
        if head.returncode == 0 and head.stdout.strip():
            dirty = subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"],
                cwd=root,
                capture_output=True,
                text=True,
                timeout=5,
            )
            return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.TimeoutExpired):
        pass
    return os.environ.get("POSBENCH_GIT_COMMIT") or None


def provenance(device: torch.device, seed: int, data: str) -> dict[str, Any]:
    """What produced a result: code, libraries, hardware, seed and data."""
    try:
        version = metadata.version("posbench")
    except metadata.PackageNotFoundError:
        version = "unknown"
    if device.type == "cuda":
        device_name = torch.cuda.get_device_name(device)
    else:
        device_name = platform.processor() or platform.machine() or "cpu"
    return {
        "posbench_version": version,
        "git_commit": _git_commit(),
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "python_version": sys.version.split()[0],
        "device": str(device),
        "device_name": device_name,
        # Training and evaluation precision: bf16 autocast on CUDA, float32 elsewhere.
        "autocast": "bfloat16" if device.type == "cuda" else None,
        "seed": seed,
        "data": data,
    }


@dataclass
class RunResult:
    label: str
    encoding: str
    params: dict[str, Any]
    seed: int
    config_hash: str
    train: TrainResult
    evaluations: list[Evaluation]
    provenance: dict[str, Any]
    order: OrderProbe | None = None

    def summarize(self, train_length: int, metric: str) -> list[analysis.Summary]:
        """This run's summaries from the evaluations it made and its order probe (a
        worker that resumed a run summarises every stored point instead)."""
        points = (
            (row.variant, row.protocol, row.length, getattr(row, metric))
            for row in self.evaluations
        )
        extra = self.order.as_summaries() if self.order else None
        return analysis.summarize_points(
            points, train_length=train_length, metric=metric, extra=extra
        )

    def to_dict(self, train_length: int, metric: str) -> dict[str, Any]:
        return {
            "label": self.label,
            "encoding": self.encoding,
            "params": self.params,
            "seed": self.seed,
            "config_hash": self.config_hash,
            "train": self.train.to_dict(),
            "evaluations": [e.to_dict() for e in self.evaluations],
            "summaries": [s._asdict() for s in self.summarize(train_length, metric)],
            "provenance": self.provenance,
        }


def prepared_task(spec: StudySpec) -> Task:
    """The study's task with its data loaded (a corpus is read and hashed once)."""
    task = build_task(spec.task.name, **spec.task.params)
    task.prepare(get_settings().corpus_cache)
    task.check_plan(spec.eval)
    return task


def finetune_checkpoint(checkpoint: Path | None, variant: VariantSpec) -> Path | None:
    """Where a fine-tuned variant's checkpoint lives: next to its run's, named by a hash
    of the variant's label (``<run>.pt.ft-<hash>``); removed once its points are stored."""
    if checkpoint is None or variant.finetune is None:
        return None
    return checkpoint.with_name(
        f"{checkpoint.name}.ft-{hashlib.sha256(variant.label.encode()).hexdigest()[:12]}"
    )


def run_one(
    spec: StudySpec,
    run: RunSpec,
    *,
    device: torch.device | None = None,
    checkpoint: Path | None = None,
    on_progress: Callable[[TrainPoint], None] | None = None,
    on_evaluation: Callable[[Evaluation], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    may_write: Callable[[], bool] | None = None,
    skip_evaluations: set[tuple[str, str, int]] | None = None,
    task: Task | None = None,
    on_trained: Callable[[], None] | None = None,
    on_finetuned: Callable[[str, dict[str, Any]], None] | None = None,
    on_finetune_progress: Callable[[str, TrainPoint, int], None] | None = None,
) -> RunResult:
    """Train one (encoding, seed) of ``spec`` and evaluate it at every planned point;
    ``task`` is the study's task already prepared (built and loaded here otherwise);
    ``on_trained`` is called when the trained model's final checkpoint is written, and
    ``on_finetuned(label, record)`` when a fine-tuned variant's model is ready, and
    ``on_finetune_progress(label, point, steps)`` at each of its progress reports."""
    device = device or resolve_device()
    task = task or prepared_task(spec)
    config = ModelConfig(**spec.model.dims())
    model = build_model(
        config,
        run.encoding.name,
        train_length=spec.train.length,
        seed=run.seed,
        **run.encoding.params,
    )
    trained = train(
        model,
        task,
        spec.train,
        seed=run.seed,
        device=device,
        checkpoint=checkpoint,
        fingerprint=run.train_hash,
        data=task.fingerprint,
        on_progress=on_progress,
        should_stop=should_stop,
        may_write=may_write,
        validate=lambda: validation_loss(
            model,
            task,
            length=spec.train.length,
            tokens=spec.train.val_tokens,
            batch_tokens=spec.eval.batch_tokens,
            device=device,
            seed=run.seed,
            longest=max(spec.eval.lengths),
        ),
    )
    if on_trained is not None:
        on_trained()
    tunings: dict[str, dict[str, Any]] = {}

    def finetuned(variant: VariantSpec) -> Transformer:
        # A copy of the trained model, fine-tuned under the variant's scaling; evaluation
        # applies the same scaling to it again. Checkpointed next to the run's own.
        tuning = spec.finetune_spec(variant)
        model.encoding.check_length(tuning.length)  # a learned table: not applicable
        tuned = copy.deepcopy(model)
        scaling = (
            contextlib.nullcontext()  # 'none+ft...': fine-tuned at the length, unscaled
            if variant.method == "none"
            else tuned.scaled(
                variant.method, float(variant.factor), spec.train.length, **variant.params
            )
        )
        try:
            with scaling:
                result = train(
                    tuned,
                    task,
                    tuning,
                    # Windows of its own: not the first ones the training read.
                    seed=zlib.crc32(f"{run.seed}/finetune/{variant.label}".encode()),
                    device=device,
                    checkpoint=finetune_checkpoint(checkpoint, variant),
                    fingerprint=f"{run.train_hash}+{variant.label}",
                    data=task.fingerprint,
                    should_stop=should_stop,
                    may_write=may_write,
                    on_progress=None
                    if on_finetune_progress is None
                    else lambda point: on_finetune_progress(variant.label, point, tuning.steps),
                )
        except RunCancelled as err:
            raise RunCancelled(f"{err} (fine-tuning {variant.label})") from None
        tunings[variant.label] = {
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
        if on_finetuned is not None:
            on_finetuned(variant.label, tunings[variant.label])
        return tuned

    rows = evaluate(
        model,
        task,
        spec.eval,
        train_length=spec.train.length,
        scalable=REGISTRY[run.encoding.name].scalable,
        device=device,
        on_evaluation=on_evaluation,
        skip=skip_evaluations,
        seed=run.seed,
        should_stop=should_stop,
        model_for=finetuned,
    )
    for variant in spec.eval.variants:  # every point is stored: the copies are done with
        path = finetune_checkpoint(checkpoint, variant)  # None: not fine-tuned
        if path is not None:
            path.unlink(missing_ok=True)
    order = None
    if should_stop is not None and should_stop():
        raise RunCancelled("cancelled after evaluation, before the order probe")
    if spec.eval.order_probe and kind_of(task.metric) is Kind.LANGUAGE_MODELLING:
        order = order_probe(
            model,
            task,
            spec.train.length,
            tokens=spec.eval.tokens,
            batch_size=eval_batch_size(
                config, spec.train.length, spec.eval.batch_tokens, available_bytes(device)
            ),
            device=device,
            seed=run.seed,
        )
    return RunResult(
        label=run.encoding.label,
        encoding=run.encoding.name,
        params=run.encoding.resolved_params,
        seed=run.seed,
        config_hash=run.config_hash,
        train=trained,
        evaluations=rows,
        provenance=provenance(device, run.seed, task.fingerprint)
        | ({"finetune": tunings} if tunings else {}),
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
                label = run.label if row.variant == "none" else f"{run.label} + {row.variant}"
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
            "runs": [run.to_dict(self.spec.train.length, self.metric) for run in self.runs],
        }


def run_study(
    spec: StudySpec,
    *,
    device: torch.device | None = None,
    checkpoint_dir: Path | None = None,
    on_progress: Callable[[RunSpec, TrainPoint], None] | None = None,
    on_run_start: Callable[[RunSpec], None] | None = None,
    on_evaluation: Callable[[RunSpec, Evaluation], None] | None = None,
    task: Task | None = None,
) -> StudyResult:
    """Every run of ``spec``, one after another, in this process (``task``: the study's
    task already prepared)."""
    result = StudyResult(spec)
    task = task or prepared_task(spec)
    data = hashlib.sha256(task.fingerprint.encode()).hexdigest()[:12]
    for run in spec.runs():
        if on_run_start is not None:
            on_run_start(run)
        # Named by what was trained, on which data: a study that only evaluates
        # differently (another stride, a new length or variant) finds the trained model
        # and trains nothing; an edited corpus file has another fingerprint.
        checkpoint = checkpoint_dir / f"{run.train_hash}-{data}.pt" if checkpoint_dir else None

        def progress(point: TrainPoint, run: RunSpec = run) -> None:
            if on_progress is not None:
                on_progress(run, point)

        def evaluated(row: Evaluation, run: RunSpec = run) -> None:
            if on_evaluation is not None:
                on_evaluation(run, row)

        result.runs.append(
            run_one(
                spec,
                run,
                device=device,
                checkpoint=checkpoint,
                on_progress=progress,
                on_evaluation=evaluated,
                task=task,
            )
        )
    return result
