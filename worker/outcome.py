"""What one run produced and where it came from: ``RunResult`` (its training, its
evaluations, its order probe) and ``provenance`` (code, libraries, hardware, seed, data),
shared by posbench's own runs (``worker.run``) and a Hugging Face model's
(``worker.hf.run``), which both import it from here."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from core import analysis
from core.metrics import GROWTH_DIAGNOSTIC, Kind, kind_of
from core.results_schema import Evaluation
from core.spec import RunSpec, StudySpec
from worker.data.base import Task
from worker.memory import available_bytes, eval_batch_size
from worker.model import Transformer
from worker.probes import OrderProbe, order_probe
from worker.training import TrainResult


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

    def summarize(
        self, train_length: int, metric: str, effective: dict | None = None
    ) -> list[analysis.Summary]:
        """This run's summaries from the evaluations it made and its order probe (a
        worker that resumed a run summarises every stored point instead)."""
        points = (
            (row.variant, row.protocol, row.length, getattr(row, metric))
            for row in self.evaluations
        )
        extra = self.order.as_summaries() if self.order else None
        growth = [
            (row.variant, row.protocol, row.length, getattr(row, GROWTH_DIAGNOSTIC))
            for row in self.evaluations
        ]
        return analysis.summarize_points(
            points,
            train_length=train_length,
            metric=metric,
            extra=extra,
            effective=effective,
            growth=growth,
        )

    def to_dict(
        self, train_length: int, metric: str, effective: dict | None = None
    ) -> dict[str, Any]:
        return {
            "label": self.label,
            "encoding": self.encoding,
            "params": self.params,
            "seed": self.seed,
            "config_hash": self.config_hash,
            "train": self.train.to_dict(),
            "evaluations": [e.to_dict() for e in self.evaluations],
            "summaries": [s._asdict() for s in self.summarize(train_length, metric, effective)],
            "provenance": self.provenance,
        }


def probe_order(
    model: Transformer, task: Task, spec: StudySpec, run: RunSpec, device: torch.device
) -> OrderProbe | None:
    """The order probe of the trained model, when the study asks for it and the task is
    language modelling."""
    if not (spec.eval.order_probe and kind_of(task.metric) is Kind.LANGUAGE_MODELLING):
        return None
    batch_size = eval_batch_size(
        model.config, spec.train.length, spec.eval.batch_tokens, available_bytes(device)
    )
    return order_probe(
        model,
        task,
        spec.train.length,
        tokens=spec.eval.tokens,
        batch_size=batch_size,
        device=device,
        seed=run.seed,
    )
