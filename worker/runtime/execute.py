"""Execute a claimed run: train it (or take its model from the result cache), evaluate
it, summarise it, and finish it.

A run is idempotent: a duplicate message finds it claimed and does nothing
(``jobs.lifecycle.claim``), and an execution resumes from the last checkpoint, skips
evaluations already stored, and upserts the rest. A NaN loss, an out-of-memory error
or a bad config ends the run as failed with a readable reason. A run that ends here
keeps one checkpoint (``worker.runtime.artifacts``).
"""

from __future__ import annotations

import datetime as dt
import errno
import logging
import traceback
from collections.abc import Callable
from time import monotonic, sleep
from typing import TYPE_CHECKING

from sqlalchemy.exc import OperationalError

from core.errors import UserError
from core.files import private_folder
from core.metrics import GROWTH_DIAGNOSTIC
from core.safe_text import redact_urls
from core.settings import Settings, get_settings
from core.status import RunStatus
from db.engine import is_transient
from db.models import as_utc, utcnow
from jobs import lifecycle
from jobs.lifecycle import ClaimedRun, LeaseLost
from jobs.quotas import deadline_reason
from worker.runtime import artifacts, cache, store
from worker.runtime.heartbeat import Heartbeat, exit_hung
from worker.runtime.shutdown import shutting_down
from worker.training.hooks import BaseHooks

if TYPE_CHECKING:
    from worker.training import DiskBudget

log = logging.getLogger(__name__)


def execute(claimed: ClaimedRun, node: str) -> str:
    """Run ``claimed`` to its end on this worker (``node``: its host name); returns what
    became of it, for the task's result."""
    from core.spec import parse_spec

    settings = get_settings()
    url, run = claimed.url, claimed.run
    left = seconds_left(run.started_at, settings.run_deadline_seconds)
    if left <= 0:  # requeued or released after its deadline: it ends here
        reason = deadline_reason(settings.run_deadline_hours)
        end(claimed, RunStatus.FAILED, reason=reason)
        cache.wake_waiting(url, run)
        return f"failed: {reason}"
    spec = parse_spec(claimed.spec)
    trainer = cache.training_run(url, run, node, settings.artifacts_dir / "runs", spec.train.steps)
    if trainer is not None:
        return cache.wait_for(claimed, trainer, settings.stale_after_seconds / 2)
    watchdog = {"hang_seconds": settings.hang_seconds, "on_hang": exit_hung, "hard_deadline": True}
    with Heartbeat(claimed, settings.heartbeat_seconds, **watchdog) as beat:
        try:
            outcome = _train_and_evaluate(claimed, spec, run, beat)
        except LeaseLost:
            return "lease lost: another worker owns the run now"
        except Exception as err:  # anything else is a failure the user must be able to read
            if isinstance(err, OperationalError) and is_transient(err):
                # The database is away (a read outside the lease gave up): not the run's
                # fault. Its heartbeat stops with this attempt; the reconciler requeues it.
                log.warning("run %s: the database is unreachable; left to the reconciler", run.id)
                return "database unreachable: the run is left to the reconciler"
            reason = failure_reason(err)
            log.exception("run %s failed", claimed.run_id)
            try:
                end(claimed, RunStatus.FAILED, reason=reason)
            except LeaseLost:
                return "lease lost: another worker owns the run now"
            outcome = f"failed: {reason}"
    if not outcome.startswith("released"):
        cache.wake_waiting(url, run)  # finished or failed: a waiting run takes or trains now
    return outcome


def _train_and_evaluate(claimed: ClaimedRun, spec, run, beat) -> str:
    import torch

    from core.analysis import effective_setting, summarize_points
    from worker.run import prepared_task, resolve_device, run_one
    from worker.training import RunCancelled

    settings = get_settings()
    url, run_id = claimed.url, claimed.run_id
    run_spec = matching_run(spec, run)
    checkpoint = settings.artifacts_dir / "runs" / f"{run_id}.pt"
    # First: a model is taken from the result cache only on the same data.
    task = prepared_task(spec, private_folder(settings.corpus_cache), settings.sources)
    # The run's provenance as stored: a model an earlier attempt took from the cache, fine-tuned
    # variants' records of earlier attempts.
    noted: dict = dict(run.provenance) if isinstance(run.provenance, dict) else {}
    # A model trained by another run: taken from the cache now, or by an earlier attempt.
    taken = dict(noted)
    if run.train_hash is not None and not checkpoint.exists() and not run.skip_cache:
        trained = (run.train_hash, spec.train.steps, task.fingerprint)
        taken = cache.take_model(claimed, *trained, checkpoint) or {}
    deadline = monotonic() + seconds_left(run.started_at, settings.run_deadline_seconds)
    hooks = StoreHooks(claimed, run, beat, noted, deadline=deadline)
    try:
        result = run_one(
            spec,
            run_spec,
            task=task,
            device=resolve_device(settings.device),
            checkpoint=checkpoint,
            hooks=hooks,
            skip_evaluations=store.stored_evaluations(url, run_id),
            min_checkpoint_seconds=settings.min_checkpoint_seconds,
            disk_budget=artifacts_budget(settings),
            models=settings.models,
        )
    except RunCancelled as err:
        if beat.lost:
            raise LeaseLost(str(err)) from None
        if hooks.expired:
            stopped = str(err).removeprefix("cancelled ")
            reason = f"{deadline_reason(settings.run_deadline_hours)}; stopped {stopped}"
            end(claimed, RunStatus.FAILED, reason=reason)
            return f"failed: {reason}"
        if shutting_down.is_set() and not hooks.cancel_asked():
            return release_for_shutdown(claimed, str(err))
        end(claimed, RunStatus.CANCELLED, reason=str(err))
        return RunStatus.CANCELLED.value
    except torch.OutOfMemoryError as err:
        raise MemoryError(f"out of memory: {str(err).splitlines()[0]}") from err
    # Summaries from every stored point: a resumed attempt evaluated only the rest.
    metric = spec.task.metric
    summaries = summarize_points(
        store.stored_points(url, run_id, metric),
        train_length=spec.train.length,
        metric=metric,
        extra=result.order.as_summaries() if result.order else None,
        effective=effective_setting(spec),
        growth=store.stored_points(url, run_id, GROWTH_DIAGNOSTIC)
        if spec.eval.diagnostics
        else None,
    )
    store.record_summaries(claimed, summaries)
    provenance = {**result.provenance, "resumed_from_step": result.train.resumed_from}
    provenance.update({k: taken[k] for k in ("trained_by_run", "training") if k in taken})
    if "trained_by_run" in taken and not taken.get("training"):
        # Taken from a run still evaluating: its provenance, if it has finished since.
        provenance["training"] = cache.finished_provenance(url, taken["trained_by_run"])
    if noted.get("finetune"):  # every attempt's fine-tunings, not only this one's
        provenance["finetune"] = {**noted["finetune"], **provenance.get("finetune", {})}
    # An hf: model trains nothing and writes no checkpoint.
    uri = None if spec.model.hf is not None else checkpoint.as_uri()
    end(claimed, RunStatus.DONE, provenance=provenance, checkpoint_uri=uri)
    return RunStatus.DONE.value


def end(claimed: ClaimedRun, status: RunStatus, **values) -> bool:
    """Finish the run as ``status`` (``jobs.lifecycle.finish``) and, when it ended under
    this worker's lease, leave it its checkpoint alone (``worker.runtime.artifacts``);
    False when the lease was lost: another worker may own the run's files now."""
    if not lifecycle.finish(claimed, status, **values):
        return False
    artifacts.tidy(get_settings().artifacts_dir / "runs", claimed.run_id)
    return True


def artifacts_budget(settings: Settings) -> DiskBudget | None:
    """POSBENCH_MAX_ARTIFACTS_BYTES as the engine takes it (None: no bound)."""
    from worker.training import DiskBudget  # torch: a pool process starts without it

    if not settings.max_artifacts_bytes:
        return None
    return DiskBudget(settings.artifacts_dir, settings.max_artifacts_bytes)


class StoreHooks(BaseHooks):
    """The engine's hooks for a run this worker holds: reports go to the database under
    the lease; the run stops when a cancel is asked (by a progress report's answer or
    by the heartbeat's), when the lease is lost, when the worker shuts down, or when
    the run's wall-clock ``deadline`` (a ``clock`` instant) has passed."""

    def __init__(
        self,
        claimed: ClaimedRun,
        run,
        beat,
        noted: dict,
        *,
        deadline: float = float("inf"),
        clock: Callable[[], float] | None = None,
        write_wait: float | None = None,
    ) -> None:
        self.claimed, self.run, self.beat = claimed, run, beat
        # How long a checkpoint waits for the lease to be confirmed again (None: until no
        # other worker could hold the run by now, the stale window after the last beat).
        self.write_wait = write_wait
        self.noted = noted  # the run's provenance as stored, kept up to date
        self.asked = False
        self.deadline, self.clock = deadline, clock or monotonic
        self.expired = False  # the deadline passed: the run fails with its reason

    def cancel_asked(self) -> bool:
        return self.asked or self.beat.cancel_asked

    def on_progress(self, point) -> None:
        self.asked = lifecycle.progress(self.claimed, point)

    def on_trained(self) -> None:
        cache.wake_waiting(self.claimed.url, self.run)  # they take the model now

    def on_finetune_progress(self, label: str, point, steps: int) -> None:
        phase = f"fine-tuning {label}: step {point.step} of {steps}, loss {point.loss:.3f}"
        lifecycle.set_phase(self.claimed, phase)

    def on_finetuned(self, label: str, record: dict) -> None:
        self.noted.update(store.note_provenance(self.claimed, "finetune", label, record))
        lifecycle.set_phase(self.claimed, None)  # evaluating it now, as usual

    def on_evaluation(self, row) -> None:
        store.record_evaluation(self.claimed, row)

    def should_stop(self) -> bool:
        self.expired = self.expired or self.clock() >= self.deadline
        return self.cancel_asked() or self.beat.lost or shutting_down.is_set() or self.expired

    def may_write(self) -> bool:
        """Files (checkpoints) are not fenced by the database: write them only while no
        other worker can hold the run yet (the lease confirmed within half the window).
        A lease the heartbeat has not confirmed lately (a busy database) is waited for,
        as long as no other worker could hold the run yet, rather than the checkpoint
        dropped: a run whose last checkpoint was dropped so finished with a model that
        was not final, which no study sharing its training could take (it trained
        again)."""
        lease = self.claimed.clock
        wait = lease.patience - lease.silent() if self.write_wait is None else self.write_wait
        until = monotonic() + wait
        while not self.beat.lost and not lease.fresh() and monotonic() < until:
            sleep(min(0.05, max(0.0, until - monotonic())))
        return not self.beat.lost and lease.fresh()


def release_for_shutdown(claimed: ClaimedRun, where: str) -> str:
    """The worker is shutting down: the checkpoint is saved; queue the run again (or end
    it cancelled, when a cancel arrived that the run had not yet seen)."""
    from jobs.service import enqueue

    outcome = lifecycle.release(claimed)
    if outcome is None:
        return "lease lost: another worker owns the run now"
    if outcome == RunStatus.CANCELLED:  # ended under our lease: one checkpoint stays
        artifacts.tidy(get_settings().artifacts_dir / "runs", claimed.run_id)
        return outcome.value
    enqueue([claimed.run_id])  # a failed send is retried by the reconciler (never sent)
    stopped = where.removeprefix("cancelled ")
    log.info("run %s released to the queue (worker shutting down, %s)", claimed.run_id, stopped)
    return f"released: the worker is shutting down ({stopped}); the run is queued again"


def seconds_left(started_at: dt.datetime | None, deadline_seconds: float) -> float:
    """Seconds a run started at ``started_at`` has left before its wall-clock deadline
    (the whole deadline when it has not started)."""
    if started_at is None:
        return deadline_seconds
    return deadline_seconds - (utcnow() - as_utc(started_at)).total_seconds()


def matching_run(spec, run):
    """The RunSpec of the stored ``run``: by config hash, or (a study stored by an
    earlier version, whose hash or label format differed) by encoding, resolved
    parameters and seed."""
    runs = spec.runs()
    for candidate in runs:
        if candidate.config_hash == run.config_hash:
            return candidate
    for candidate in runs:
        if (
            candidate.seed == run.seed
            and candidate.encoding.name == run.encoding
            and candidate.encoding.resolved_params == run.params
        ):
            return candidate
    raise ValueError(f"run {run.id} ({run.label}, seed {run.seed}) is not in its study's spec")


# OSErrors of the storage a run writes to, said in the operator's words.
STORAGE_ERRNOS = {
    errno.ENOSPC: "the disk is full: free space, or point POSBENCH_ARTIFACTS elsewhere, then retry",
    errno.EDQUOT: "the disk quota is spent: free space, or raise the quota, then retry",
    errno.EROFS: "the file system is read-only: make POSBENCH_ARTIFACTS writable, then retry",
    errno.EIO: "the device reported an I/O error: check the disk, then retry",
}

# A failure reason is shown in tables and on the dashboard: one line, this long at most.
MAX_REASON_CHARS = 2000


def failure_reason(err: BaseException) -> str:
    """The reason a failed run shows, one line without passwords: the error's own words
    for what a user can cause (``core.errors.UserError``, a diverged loss, memory, a bad
    value), and for the rest (bugs) that it is one, what and where, to be reported."""
    from worker.training import TrainingDiverged

    if isinstance(err, UserError | TrainingDiverged | MemoryError | ValueError):
        reason = str(err)
    elif isinstance(err, OSError) and err.errno in STORAGE_ERRNOS:
        # The operator's storage, not a bug: a full or read-only disk, a quota.
        reason = f"{err.strerror} writing {err.filename or 'a file'} ({STORAGE_ERRNOS[err.errno]})"
    else:
        last = traceback.extract_tb(err.__traceback__)[-1:]
        where = f" at {last[0].filename}:{last[0].lineno}" if last else ""
        reason = (
            f"a bug in posbench: {type(err).__name__}: {err}{where} (please report it; the "
            "worker's log has the traceback)"
        )
    return " ".join(redact_urls(reason).split())[:MAX_REASON_CHARS]
