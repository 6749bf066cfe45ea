"""Training: the ``Trainer`` (its state, step, reports and checkpoints), the hooks a run
reports to, the checkpoint format, and the fine-tuned variants (``finetune``).

The names below load lazily, so that ``worker.training.hooks`` stays free of torch:
``posbench run`` and the Celery task module implement the hooks without importing it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from worker.training.checkpoint import (
        CHECKPOINT_VERSION,
        Checkpointer,
        DiskBudget,
        checkpoint_problem,
        load_checkpoint,
        save_checkpoint,
    )
    from worker.training.hooks import NO_HOOKS, BaseHooks, RunHooks
    from worker.training.trainer import (
        RunCancelled,
        Trainer,
        TrainingDiverged,
        TrainResult,
        batch_loss,
        lr_at,
        make_optimizer,
        warmup_steps,
    )

__all__ = [
    "CHECKPOINT_VERSION",
    "NO_HOOKS",
    "BaseHooks",
    "Checkpointer",
    "DiskBudget",
    "RunCancelled",
    "RunHooks",
    "TrainResult",
    "Trainer",
    "TrainingDiverged",
    "batch_loss",
    "checkpoint_problem",
    "load_checkpoint",
    "lr_at",
    "make_optimizer",
    "save_checkpoint",
    "warmup_steps",
]
_HOOKS = {"NO_HOOKS", "BaseHooks", "RunHooks"}
_CHECKPOINT = {
    "CHECKPOINT_VERSION",
    "Checkpointer",
    "DiskBudget",
    "checkpoint_problem",
    "load_checkpoint",
    "save_checkpoint",
}


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'worker.training' has no attribute {name!r}")
    home = "hooks" if name in _HOOKS else "checkpoint" if name in _CHECKPOINT else "trainer"
    return getattr(importlib.import_module(f"worker.training.{home}"), name)
