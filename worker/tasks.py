"""Celery tasks. ``train_run(run_id)`` is the only message the system sends.

A run is idempotent: the task claims the run (a duplicate message finds it taken
and does nothing), resumes from the last checkpoint, skips evaluations already
stored, and upserts the rest. A NaN loss, an out-of-memory error or a bad config
ends the run as ``failed`` with a readable reason.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import traceback

from celery import bootsteps
from celery.signals import worker_init, worker_process_init

from jobs.celery_app import TRAIN_RUN, app
from jobs.settings import get_settings
from worker.training.hooks import BaseHooks

log = logging.getLogger(__name__)

# Set in a pool process when its worker begins a warm shutdown (SIGTERM from
# ``docker stop``, Ctrl-C): the run checkpoints, goes back to the queue, and another
# worker resumes it at once instead of after the stale window.
SHUTDOWN_SIGNAL = signal.SIGUSR2
shutting_down = threading.Event()


@app.task(name=TRAIN_RUN, bind=True, acks_late=True, reject_on_worker_lost=True)
def train_run(self, run_id: int) -> str:
    settings = get_settings()
    url = settings.database
    from jobs.spec import parse_spec
    from worker import store
    from worker.cpu import flush_denormals

    flush_denormals()  # in this pool process, before torch starts its CPU threads

    node = self.request.hostname or socket.gethostname()
    claimed = store.claim(url, run_id, worker=f"{node}:{threading.get_native_id()}")
    if claimed is None:
        return "not claimed: the run is not queued (done, cancelled, or another worker has it)"
    lease, spec_json, run = claimed
    _listen_for_shutdown()  # again here: whatever the pool type reset at fork
    spec = parse_spec(spec_json)
    twin = _twin_training(url, run, node, settings.artifacts_dir / "runs", spec.train.steps)
    if twin is not None:
        return _wait_for_twin(url, run_id, lease, twin, settings.stale_after_seconds / 2)
    watchdog = {"hang_seconds": settings.hang_seconds, "on_hang": _hung, "hard_deadline": True}
    with store.Heartbeat(url, run_id, lease, settings.heartbeat_seconds, **watchdog) as beat:
        try:
            outcome = _train_and_evaluate(url, run_id, lease, spec, run, beat)
        except store.LeaseLost:
            return "lease lost: another worker owns the run now"
        except Exception as err:  # anything else is a failure the user must be able to read
            reason = _reason(err)
            log.exception("run %s failed", run_id)
            store.finish(url, run_id, lease, "failed", reason=reason)
            outcome = f"failed: {reason}"
    if not outcome.startswith("released"):
        _wake_twins(url, run)  # finished or failed: a waiting twin adopts or trains now
    return outcome


def _train_and_evaluate(url: str, run_id: int, lease: str, spec, run, beat) -> str:
    import torch

    from jobs.analysis import summarize_points
    from worker import store
    from worker.run import prepared_task, resolve_device, run_one
    from worker.training import RunCancelled

    settings = get_settings()
    run_spec = matching_run(spec, run)
    checkpoint = settings.artifacts_dir / "runs" / f"{run_id}.pt"
    # First: a trained model is adopted only on the same data.
    task = prepared_task(spec, settings.corpus_cache)
    # The run's provenance as stored: a model an earlier attempt adopted, fine-tuned
    # variants' records of earlier attempts.
    noted: dict = dict(run.provenance) if isinstance(run.provenance, dict) else {}
    # A model trained by another run: adopted now, or by an earlier attempt of this one.
    adopted = dict(noted)
    if run.train_hash is not None and not checkpoint.exists() and not adopted.get("train_afresh"):
        trained = (run.train_hash, spec.train.steps, task.fingerprint)
        adopted = _adopt(url, run_id, lease, *trained, checkpoint) or {}
    hooks = _StoreHooks(url, run_id, lease, run, beat, noted)
    try:
        result = run_one(
            spec,
            run_spec,
            task=task,
            device=resolve_device(settings.device),
            checkpoint=checkpoint,
            hooks=hooks,
            skip_evaluations=store.stored_evaluations(url, run_id),
        )
    except RunCancelled as err:
        if beat.lost:
            raise store.LeaseLost(str(err)) from None
        if shutting_down.is_set() and not hooks.cancel_asked():
            return _release(url, run_id, lease, str(err))
        store.finish(url, run_id, lease, "cancelled", reason=str(err))
        return "cancelled"
    except torch.OutOfMemoryError as err:
        raise MemoryError(f"out of memory: {str(err).splitlines()[0]}") from err
    # Summaries from every stored point: a resumed attempt evaluated only the rest.
    metric = spec.task.metric
    summaries = summarize_points(
        store.stored_points(url, run_id, metric),
        train_length=spec.train.length,
        metric=metric,
        extra=result.order.as_summaries() if result.order else None,
    )
    store.record_summaries(url, run_id, lease, summaries)
    provenance = {**result.provenance, "resumed_from_step": result.train.resumed_from}
    provenance.update({k: adopted[k] for k in ("trained_by_run", "training") if k in adopted})
    if "trained_by_run" in adopted and not adopted.get("training"):
        # Adopted from a twin still evaluating: its provenance, if it has finished since.
        provenance["training"] = store.finished_provenance(url, adopted["trained_by_run"])
    if noted.get("finetune"):  # every attempt's fine-tunings, not only this one's
        provenance["finetune"] = {**noted["finetune"], **provenance.get("finetune", {})}
    store.finish(
        url, run_id, lease, "done", provenance=provenance, checkpoint_uri=checkpoint.as_uri()
    )
    return "done"


class _StoreHooks(BaseHooks):
    """The engine's hooks for a run this worker holds:
    reports go to the database under the lease; the run stops when a cancel is asked
    (by a progress report's answer or by the heartbeat's), when the lease is lost, or
    when the worker shuts down."""

    def __init__(self, url: str, run_id: int, lease: str, run, beat, noted: dict) -> None:
        from worker import store

        self.store, self.url, self.run_id, self.lease = store, url, run_id, lease
        self.run, self.beat = run, beat
        self.noted = noted  # the run's provenance as stored, kept up to date
        self.asked = False

    def cancel_asked(self) -> bool:
        return self.asked or self.beat.cancel_asked

    def on_progress(self, point) -> None:
        self.asked = self.store.record_progress(self.url, self.run_id, self.lease, point)

    def on_trained(self) -> None:
        _wake_twins(self.url, self.run)  # they adopt the model now

    def on_finetune_progress(self, label: str, point, steps: int) -> None:
        phase = f"fine-tuning {label}: step {point.step} of {steps}, loss {point.loss:.3f}"
        self.store.note_phase(self.url, self.run_id, self.lease, phase)

    def on_finetuned(self, label: str, record: dict) -> None:
        kept = self.store.note_provenance(
            self.url, self.run_id, self.lease, "finetune", label, record
        )
        self.noted.update(kept)
        self.store.note_phase(self.url, self.run_id, self.lease, None)  # evaluating it now

    def on_evaluation(self, row) -> None:
        self.store.record_evaluation(self.url, self.run_id, self.lease, row)

    def should_stop(self) -> bool:
        return self.cancel_asked() or self.beat.lost or shutting_down.is_set()

    def may_write(self) -> bool:
        return not self.beat.lost


def _adopt(
    url: str, run_id: int, lease: str, train_hash: str, steps: int, data: str, checkpoint
) -> dict | None:
    """Use the trained model of another run with the same train hash (a study that only
    evaluates differently): its final checkpoint becomes this run's (a hard link, or a
    copy across file systems), so training resumes at its last step and only the
    evaluation runs. The donor may have finished, or still be evaluating (or have
    failed there): a checkpoint is taken only when it is final, stamped with this train
    hash, and trained on the same data (``data``: the task's fingerprint, compared with
    the donor's stored one or the checkpoint's stamp; an edited text: corpus under the
    same path has another). Returns the provenance marker (``store.adopt_training``),
    or None when no such checkpoint is on this machine."""
    import shutil
    import uuid
    from pathlib import Path
    from urllib.parse import unquote, urlparse

    from worker import store

    for donor, uri, donor_data, _ in store.trained_models(url, train_hash, run_id):
        if donor_data is not None and donor_data != data:
            continue
        source = Path(unquote(urlparse(uri).path)) if uri else checkpoint.with_name(f"{donor}.pt")
        # The data by the donor's stored fingerprint, or (not finished yet) by its stamp.
        stamp = data if donor_data is None else None
        if not _final_checkpoint(source, train_hash, steps, stamp):
            continue  # on another machine, partial, of another configuration or data
        checkpoint.parent.mkdir(parents=True, exist_ok=True)
        temporary = checkpoint.with_name(f"{checkpoint.name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            try:
                os.link(source, temporary)
            except OSError:
                shutil.copyfile(source, temporary)
        except OSError:  # deleted meanwhile
            temporary.unlink(missing_ok=True)
            continue
        try:
            marker = store.adopt_training(url, run_id, lease, donor)  # the database first
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
        if marker is None:
            temporary.unlink(missing_ok=True)
            continue
        os.replace(temporary, checkpoint)
        log.info("run %s uses the model trained by run %s", run_id, donor)
        return marker
    return None


def _twin_training(url: str, run, node: str, folder, steps: int) -> int | None:
    """The run that is training this run's model right now (same train hash: a study that
    only evaluates differently, submitted while the first trains), when this run should
    wait for it and adopt its model rather than train the same weights a second time;
    else None. Only a run that has no checkpoint of its own, no adopted model and no
    finished donor waits, and only for a twin whose checkpoint it will be able to read:
    one whose checkpoint is already in this machine's artifacts folder, or one on this
    node, when that twin is the older run (so two twins never wait for each other).
    A twin whose training is over (its checkpoint is final) is adopted at once."""
    from worker import store

    provenance = run.provenance if isinstance(run.provenance, dict) else {}
    if (
        run.train_hash is None
        or (folder / f"{run.id}.pt").exists()
        or provenance.get("train_afresh")
        or provenance.get("trained_by_run")
        or any(
            uri and status == "done"
            for _, uri, _, status in store.trained_models(url, run.train_hash, run.id)
        )
    ):
        return None
    for twin, worker in store.training_twins(url, run.train_hash, run.id):
        path = folder / f"{twin}.pt"
        if path.exists() and _final_checkpoint(path, run.train_hash, steps):
            return None  # trained, evaluating: adopt it now
        same_node = (worker or "").rpartition(":")[0] == node
        if path.exists() or (same_node and twin < run.id):
            return twin
    return None


def _wait_for_twin(url: str, run_id: int, lease: str, twin: int, seconds: float) -> str:
    """Give the run back to the queue, to be delivered again in about ``seconds`` (and at
    once when the twin's training ends: ``_wake_twins``): by then its twin may have
    finished training (the run adopts its model), or stopped (the run trains)."""
    import functools
    import random

    from jobs.service import celery_send, enqueue
    from worker import store

    outcome = store.release(url, run_id, lease, waiting_for=twin)
    if outcome is None:
        return "lease lost: another worker owns the run now"
    if outcome == "cancelled":
        return "cancelled"
    seconds *= random.uniform(0.8, 1.2)  # twins released together come back apart
    enqueue([run_id], send=functools.partial(celery_send, countdown=seconds))
    log.info("run %s waits for run %s, which trains the same model", run_id, twin)
    return f"waiting: run {twin} trains the same model; queued again in {seconds:.0f} s"


def _wake_twins(url: str, run) -> None:
    """Send the queued runs that share this run's train hash again, now: its training is
    over (they adopt the model) or the run has ended (they adopt it or train). A
    duplicate message is harmless; a failure to send is the reconciler's to retry."""
    from jobs.service import enqueue
    from worker import store

    if run.train_hash is None:
        return
    try:
        waiting = store.queued_twins(url, run.train_hash, run.id)
        if waiting:
            enqueue(waiting)
    except Exception as err:  # never fail the run for it: they come back on their own
        log.warning("could not wake the runs waiting for run %s: %s", run.id, err)


def _final_checkpoint(path, train_hash: str, steps: int, data: str | None = None) -> bool:
    """Whether ``path`` holds the final checkpoint of this train hash; with ``data``, also
    trained on that data by its stamp (a checkpoint written before checkpoints carried
    one passes on the donor's stored fingerprint alone: ``data`` None)."""
    import torch

    from worker.training import checkpoint_problem

    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # missing, unreadable, not a checkpoint
        return False
    if data is not None and state.get("data") != data:
        return False
    return checkpoint_problem(state, train_hash) is None and int(state.get("step", -1)) == steps


def _hung(idle: float) -> None:
    """The watchdog's verdict: the run's thread made no progress for ``idle`` seconds (a
    hung device or file system). Write every thread's stack for the post-mortem, then
    end this pool process: the heartbeat has stopped, so the reconciler requeues the
    run (a death, counted against POSBENCH_MAX_ATTEMPTS) and it resumes elsewhere.
    No logging module here: the stuck thread may hold its lock."""
    import faulthandler

    note = f"no progress for {idle:.0f} s: the run is hung; this pool process exits\n"
    os.write(2, note.encode())
    faulthandler.dump_traceback(file=2, all_threads=True)  # fd 2: Celery replaced sys.stderr
    os._exit(75)


def _release(url: str, run_id: int, lease: str, where: str) -> str:
    """The worker is shutting down: the checkpoint is saved; queue the run again (or end
    it cancelled, when a cancel arrived that the run had not yet seen)."""
    from jobs.service import enqueue
    from worker import store

    outcome = store.release(url, run_id, lease)
    if outcome is None:
        return "lease lost: another worker owns the run now"
    if outcome == "cancelled":
        return "cancelled"
    enqueue([run_id])  # a failed send is retried by the reconciler (never sent)
    stopped = where.removeprefix("cancelled ")
    log.info("run %s released to the queue (worker shutting down, %s)", run_id, stopped)
    return f"released: the worker is shutting down ({stopped}); the run is queued again"


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


def _reason(err: BaseException) -> str:
    from worker.training import TrainingDiverged

    if isinstance(err, TrainingDiverged | MemoryError | ValueError):
        return str(err)
    last = traceback.extract_tb(err.__traceback__)[-1:]
    where = f" at {last[0].filename}:{last[0].lineno}" if last else ""
    return f"internal error: {type(err).__name__}: {err}{where}"


def gpu_for_pool_process(index: int, visible: str | None) -> str:
    """The device a pool process owns: the index-th of the GPUs the node exposes."""
    devices = [d for d in (visible or "").split(",") if d.strip()]
    return devices[index % len(devices)] if devices else str(index)


@worker_init.connect
def _init_worker(**_: object) -> None:
    """Before the pool forks: pool processes ignore the shutdown signal until they
    install their handler (its default action would kill them)."""
    signal.signal(SHUTDOWN_SIGNAL, signal.SIG_IGN)


def _listen_for_shutdown() -> None:
    signal.signal(SHUTDOWN_SIGNAL, lambda *_: shutting_down.set())


class HandBack(bootsteps.StartStopStep):
    """A worker step that stops before the pool does, on every warm shutdown (SIGTERM,
    the first Ctrl-C, ``celery control shutdown``, a SIGHUP restart): it asks every pool
    process to hand its run back, and the pool's own stop then waits for them. A cold
    shutdown terminates the pool instead (``terminate``, a no-op here): the reconciler
    requeues those runs."""

    requires = ("celery.worker.components:Pool",)

    def stop(self, worker: object) -> None:
        from billiard.process import active_children

        for child in active_children():
            try:
                os.kill(child.pid, SHUTDOWN_SIGNAL)
            except (ProcessLookupError, TypeError):  # already gone, or never started
                continue


app.steps["worker"].add(HandBack)


@worker_process_init.connect
def _init_pool_process(**_: object) -> None:
    """A forked pool process must not share the parent's database connections, and with
    POSBENCH_PIN_GPUS it sees exactly one GPU: its own (before torch touches CUDA).
    Nothing heavy here (torch is not imported): Celery kills a pool process that does
    not report itself up within seconds."""
    from billiard.process import current_process

    from db.engine import dispose_after_fork

    _listen_for_shutdown()
    dispose_after_fork()
    index = getattr(current_process(), "index", None)
    if get_settings().pin_gpus and index is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu_for_pool_process(
            index, os.environ.get("CUDA_VISIBLE_DEVICES")
        )
