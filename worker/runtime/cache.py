"""The result cache: a run never computes what another run has computed already.

It has two levels, both keyed by hashes of the run's spec:

- **results**, by config hash: a run whose config hash finished (done) in any study
  is done at once with a copy of those results (``jobs.service.submit``; the copy
  names its source in ``reused_from_run_id``);
- **models**, by train hash (a study that only evaluates differently): the run takes
  the final checkpoint another run trained (``take_model``; its provenance names that
  run in ``trained_by_run``) and only evaluates; while that run is still training,
  the run waits for it (``training_run``, ``wait_for``: its ``waiting_for`` column).

A run submitted with ``--force`` skips the cache (its ``skip_cache`` column): it
trains afresh, and its model serves later runs. A run imported rather than trained here
(``imported_from``) serves neither level by default: its results only when the
submitter asks (``--reuse-imported``), its model never (it has no checkpoint).
"""

from __future__ import annotations

import functools
import logging
import os
import random
import shutil
import uuid
from pathlib import Path
from urllib.parse import unquote, urlparse

from sqlalchemy import select, update

from core.files import private_folder
from core.status import RunStatus
from db.engine import transaction, with_retry
from db.models import Run, TrainPoint, in_live_study
from db.upsert import upsert
from jobs import lifecycle
from jobs.lifecycle import ClaimedRun
from worker.runtime.store import stored_provenance

log = logging.getLogger(__name__)


# --- what the cache holds (the database) ----------------------------------------------


def cached_models(
    url: str, train_hash: str, run_id: int
) -> list[tuple[int, str | None, str | None, str]]:
    """(run id, checkpoint URI, data fingerprint, status) of the other runs that train the
    model this run would train (same train hash): finished ones first, newest first,
    then the others (one may have finished training and still be evaluating). The URI
    and the fingerprint are known once a run has finished; until then its checkpoint is
    its artifacts file."""
    with transaction(url) as session:
        rows = session.execute(
            select(Run.id, Run.checkpoint_uri, Run.provenance, Run.status)
            # An imported run has no checkpoint here, and its training is not ours; a
            # deleted study's models serve no one (they go when it is purged).
            .where(
                Run.train_hash == train_hash,
                Run.id != run_id,
                Run.imported_from.is_(None),
                in_live_study(),
            )
            .order_by((Run.status == RunStatus.DONE).desc(), Run.finished_at.desc(), Run.id)
        )
        return [
            (source, uri, provenance.get("data") if isinstance(provenance, dict) else None, status)
            for source, uri, provenance, status in rows
        ]


def finished_provenance(url: str, run_id: int) -> dict | None:
    """The provenance of run ``run_id`` when it has finished (done), else None."""
    with transaction(url) as session:
        row = session.execute(
            select(Run.provenance).where(Run.id == run_id, Run.status == RunStatus.DONE)
        ).first()
        return row.provenance if row is not None else None


def waiting_runs(url: str, train_hash: str, run_id: int) -> list[int]:
    """The queued runs with this train hash (runs waiting for this one's training)."""
    with transaction(url) as session:
        return list(
            session.scalars(
                select(Run.id).where(
                    Run.train_hash == train_hash, Run.status == RunStatus.QUEUED, Run.id != run_id
                )
            )
        )


def runs_training(url: str, train_hash: str, run_id: int) -> list[tuple[int, str | None]]:
    """(run id, worker) of the other runs with this train hash that are running now: a
    study that only evaluates differently, submitted while the first one trains."""
    with transaction(url) as session:
        rows = session.execute(
            select(Run.id, Run.worker)
            .where(Run.train_hash == train_hash, Run.status == RunStatus.RUNNING, Run.id != run_id)
            .order_by(Run.id)
        )
        return [(other, worker) for other, worker in rows]


def take_training(claimed: ClaimedRun, source_id: int) -> dict | None:
    """Give this run the training curve and progress of ``source_id``, whose trained model
    it uses, and a provenance marker (``trained_by_run``, and the source's own
    provenance under ``training``), stored at once so that a resumed attempt keeps it.
    Idempotent (a redelivered run upserts the same points). None when the source run is
    gone."""

    def attempt() -> dict | None:
        with transaction(claimed.url) as session:
            lifecycle.hold(session, claimed)
            source = session.get(Run, source_id)
            if source is None:
                return None
            finished = source.status == RunStatus.DONE
            marker = {
                "trained_by_run": source_id,
                "training": source.provenance if finished else None,
            }
            points = session.scalars(select(TrainPoint).where(TrainPoint.run_id == source_id))
            for point in points:
                upsert(
                    session,
                    TrainPoint.__table__,
                    {**point.column_values(), "run_id": claimed.run_id},
                    keys=("run_id", "step"),
                    returning=None,
                )
            # Merged: notes an earlier attempt stored (its fine-tunings) stay.
            kept = stored_provenance(session, claimed.run_id)
            session.execute(
                update(Run)
                .where(Run.id == claimed.run_id)
                .values(
                    step=source.step,
                    latest_loss=source.latest_loss,
                    tokens_per_second=source.tokens_per_second,
                    provenance={**kept, **marker},
                )
            )
            return marker

    return with_retry(attempt)


# --- using it (the worker) --------------------------------------------------------------


def take_model(
    claimed: ClaimedRun, train_hash: str, steps: int, data: str, checkpoint: Path
) -> dict | None:
    """Use the trained model of another run with the same train hash (a study that only
    evaluates differently): its final checkpoint becomes this run's (a hard link, or a
    copy across file systems), so training resumes at its last step and only the
    evaluation runs. The source may have finished, or still be evaluating (or have
    failed there): a checkpoint is taken only when it is final, stamped with this train
    hash, and trained on the same data (``data``: the task's fingerprint, compared with
    the source's stored one or the checkpoint's stamp; an edited text: corpus under the
    same path has another). Returns the provenance marker (``take_training``), or None
    when no such checkpoint is on this machine."""
    for source, uri, source_data, _ in cached_models(claimed.url, train_hash, claimed.run_id):
        if source_data is not None and source_data != data:
            continue
        path = Path(unquote(urlparse(uri).path)) if uri else checkpoint.with_name(f"{source}.pt")
        # The data by the source's stored fingerprint, or (not finished yet) by its stamp.
        stamp = data if source_data is None else None
        if not final_checkpoint(path, train_hash, steps, stamp):
            continue  # on another machine, partial, of another configuration or data
        private_folder(checkpoint.parent)
        temporary = checkpoint.with_name(f"{checkpoint.name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            try:
                os.link(path, temporary)
            except OSError:
                shutil.copyfile(path, temporary)
        except OSError:  # deleted meanwhile
            temporary.unlink(missing_ok=True)
            continue
        try:
            marker = take_training(claimed, source)  # the database first
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
        if marker is None:
            temporary.unlink(missing_ok=True)
            continue
        os.replace(temporary, checkpoint)
        log.info("run %s uses the model trained by run %s", claimed.run_id, source)
        return marker
    return None


def training_run(url: str, run: Run, node: str, folder: Path, steps: int) -> int | None:
    """The run that is training this run's model right now (same train hash: a study that
    only evaluates differently, submitted while the first trains), when this run should
    wait for it and take its model rather than train the same weights a second time;
    else None. Only a run that has no checkpoint of its own, no model taken and no
    finished source waits, and only for a run whose checkpoint it will be able to read:
    one whose checkpoint is already in this machine's artifacts folder, or one on this
    node, when that run is the older one (so two runs never wait for each other). A run
    whose training is over (its checkpoint is final) is taken from at once."""
    provenance = run.provenance if isinstance(run.provenance, dict) else {}
    if (
        run.train_hash is None
        or (folder / f"{run.id}.pt").exists()
        or run.skip_cache
        or provenance.get("trained_by_run")
        or any(
            uri and status == RunStatus.DONE
            for _, uri, _, status in cached_models(url, run.train_hash, run.id)
        )
    ):
        return None
    for other, worker in runs_training(url, run.train_hash, run.id):
        path = folder / f"{other}.pt"
        if path.exists() and final_checkpoint(path, run.train_hash, steps):
            return None  # trained, evaluating: take it now
        same_node = (worker or "").rpartition(":")[0] == node
        if path.exists() or (same_node and other < run.id):
            return other
    return None


def wait_for(claimed: ClaimedRun, trainer: int, seconds: float) -> str:
    """Give the run back to the queue, to be delivered again in about ``seconds`` (and at
    once when the trainer's training ends: ``wake_waiting``): by then it may have
    finished training (the run takes its model), or stopped (the run trains)."""
    from jobs.service import celery_send, enqueue

    outcome = lifecycle.release(claimed, waiting_for=trainer)
    if outcome is None:
        return "lease lost: another worker owns the run now"
    if outcome == RunStatus.CANCELLED:
        return outcome.value
    seconds *= random.uniform(0.8, 1.2)  # runs released together come back apart
    enqueue([claimed.run_id], send=functools.partial(celery_send, countdown=seconds))
    log.info("run %s waits for run %s, which trains the same model", claimed.run_id, trainer)
    return f"waiting: run {trainer} trains the same model; queued again in {seconds:.0f} s"


def wake_waiting(url: str, run: Run) -> None:
    """Send the queued runs that share this run's train hash again, now: its training is
    over (they take the model) or the run has ended (they take it or train). A
    duplicate message is harmless; a failure to send is the reconciler's to retry."""
    from jobs.service import enqueue

    if run.train_hash is None:
        return
    try:
        waiting = waiting_runs(url, run.train_hash, run.id)
        if waiting:
            enqueue(waiting)
    except Exception as err:  # never fail the run for it: they come back on their own
        log.warning("could not wake the runs waiting for run %s: %s", run.id, err)


def final_checkpoint(path: Path, train_hash: str, steps: int, data: str | None = None) -> bool:
    """Whether ``path`` holds the final checkpoint of this train hash; with ``data``, also
    trained on that data by its stamp (a checkpoint written before checkpoints carried
    one passes on the source's stored fingerprint alone: ``data`` None)."""
    import torch

    from worker.training import checkpoint_problem

    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # missing, unreadable, not a checkpoint
        return False
    if data is not None and state.get("data") != data:
        return False
    return checkpoint_problem(state, train_hash) is None and int(state.get("step", -1)) == steps
