"""What a run tells its caller, and asks of it, while it trains and evaluates.

The engine takes one hooks object instead of a callback per event: ``posbench run``
draws progress bars with it, the Celery worker writes to the database and reads the
cancel flag. Subclass ``BaseHooks`` and override what you need; every method of it
does nothing (``should_stop`` says no, ``may_write`` says yes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from core.results_schema import Evaluation, TrainPoint


class RunHooks(Protocol):
    def on_progress(self, point: TrainPoint) -> None:
        """A report of the training: every ``progress_every`` and validation step, and the
        last one."""

    def on_trained(self) -> None:
        """The final checkpoint is written (another run may take it from the result cache)."""

    def on_finetune_progress(self, label: str, point: TrainPoint, steps: int) -> None:
        """A report of the fine-tuning of variant ``label`` (``steps`` in all)."""

    def on_finetuned(self, label: str, record: dict[str, Any]) -> None:
        """Variant ``label``'s fine-tuned model is ready; ``record`` says how it was made."""

    def on_evaluation(self, row: Evaluation) -> None:
        """One point of the plan is evaluated."""

    def should_stop(self) -> bool:
        """Asked after every training step and before every evaluation point and batch:
        True ends the run with ``RunCancelled`` (after a checkpoint, when training)."""
        ...

    def may_write(self) -> bool:
        """Whether this process still owns the run: one that lost it must not overwrite
        the new owner's checkpoint."""
        ...


class BaseHooks:
    """Hooks that do nothing: the run is never stopped and always writes its checkpoints."""

    def on_progress(self, point: TrainPoint) -> None:
        pass

    def on_trained(self) -> None:
        pass

    def on_finetune_progress(self, label: str, point: TrainPoint, steps: int) -> None:
        pass

    def on_finetuned(self, label: str, record: dict[str, Any]) -> None:
        pass

    def on_evaluation(self, row: Evaluation) -> None:
        pass

    def should_stop(self) -> bool:
        return False

    def may_write(self) -> bool:
        return True


NO_HOOKS: RunHooks = BaseHooks()
