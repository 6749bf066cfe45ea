"""Quotas: what one accepted spec may cost the service, checked at submit before
anything is written (``jobs.service.submit`` raises its ``Refused`` with the line
these return).

- ``POSBENCH_MAX_STUDY_FLOPS``: the study's estimated compute
  (``StudySpec.estimated_flops``: training, 6 x parameters x tokens, and evaluation,
  every window, key-token sub-window and probe; an hf: model at the size its config
  describes);
- ``POSBENCH_MAX_ACTIVE_RUNS``: runs queued or running across the service, the new
  study's included;
- ``POSBENCH_MAX_ACTIVE_RUNS_PER_SUBMITTER``: the same, counting only the runs of the
  studies the same submitter submitted (``studies.submitted_by``: the audit trail's
  actor), so that one submitter cannot take the whole service;
- ``POSBENCH_MAX_CHECKPOINT_BYTES``: one run's checkpoint
  (``StudySpec.estimated_checkpoint_bytes``, 12 bytes per parameter);
- ``POSBENCH_MAX_ARTIFACTS_BYTES``: the checkpoints the study's runs keep once done (one
  each), against the artifacts folder's whole budget.

The worker bounds a run's wall time (``POSBENCH_RUN_DEADLINE_HOURS``, see
``worker.runtime.execute`` and ``jobs.lifecycle.reconcile``), spaces its checkpoints
(``POSBENCH_MIN_CHECKPOINT_SECONDS``), skips a periodic checkpoint that would take the
artifacts folder past POSBENCH_MAX_ARTIFACTS_BYTES (``worker.training.DiskBudget``), and
leaves a finished run one checkpoint (``worker.runtime.artifacts``). ``posbench run``
trains on the user's own machine and is bound by none of these.
"""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from core.files import shown_bytes
from core.settings import Settings
from core.spec import StudySpec
from core.status import ACTIVE
from db.models import Run, Study
from jobs.lifecycle import reusable


def model_sizes(spec: StudySpec, settings: Settings) -> tuple[int, int, int] | None:
    """An hf: model's (parameters, layers, width) as its config describes them (a folder's
    read here; a hub id's known only on a worker, so counted at POSBENCH_MAX_HF_PARAMETERS
    with no attention term); None for posbench's own models (the spec's sizes)."""
    if spec.model.hf is None:
        return None
    from core.catalog.hf_models import local_facts

    _, facts = local_facts(spec.model.hf, settings.models)
    return facts.sizes if facts is not None else (settings.max_hf_parameters, 0, 0)


def flops_problem(spec: StudySpec, settings: Settings) -> str | None:
    """The refusal of a study whose estimated compute exceeds the quota (None: within),
    with the figures: training and evaluation."""
    sizes = model_sizes(spec, settings)
    training, evaluation = spec.training_flops(), spec.eval_flops(sizes)
    flops, limit = training + evaluation, settings.max_study_flops
    if flops <= limit:
        return None
    return (
        f"quota POSBENCH_MAX_STUDY_FLOPS exceeded: the study needs about {flops:.3g} FLOPs "
        f"(training {training:.3g}: 6 x parameters x tokens; evaluation {evaluation:.3g}: "
        "every window, key-token sub-window and probe), over the limit of "
        f"{limit:.3g} by {flops - limit:.3g} ({flops / limit:.3g} x the limit); train "
        "fewer steps or parameters, or evaluate fewer runs, variants, lengths or tokens"
    )


def disk_problem(spec: StudySpec, settings: Settings) -> str | None:
    """The refusal of a study whose checkpoints would not fit the disk quotas (None:
    within): one run's over POSBENCH_MAX_CHECKPOINT_BYTES, or the ones its runs keep once
    done over POSBENCH_MAX_ARTIFACTS_BYTES even in an empty artifacts folder. What the
    folder holds already is the workers' to count: the submitter may not see it (the
    dashboard does not mount the artifacts volume)."""
    size, limit = spec.estimated_checkpoint_bytes(), settings.max_checkpoint_bytes
    if size > limit:
        return (
            "quota POSBENCH_MAX_CHECKPOINT_BYTES exceeded: a run's checkpoint needs about "
            f"{shown_bytes(size)} (12 bytes x {spec.model.parameters:,} parameters: weights "
            f"and AdamW's two moments), over the limit of {shown_bytes(limit)} ({limit:,} "
            f"bytes) by {shown_bytes(size - limit)}; train a smaller model"
        )
    runs, budget = len(spec.runs()), settings.max_artifacts_bytes
    if budget and runs * size > budget:
        return (
            f"quota POSBENCH_MAX_ARTIFACTS_BYTES exceeded: the study's {runs} runs keep a "
            f"checkpoint of about {shown_bytes(size)} each, {shown_bytes(runs * size)} in all, "
            f"over the artifacts budget of {shown_bytes(budget)} ({budget:,} bytes) by "
            f"{shown_bytes(runs * size - budget)}; run fewer encodings or seeds, or a smaller "
            "model"
        )
    return None


def new_active_runs(
    session: Session, spec: StudySpec, *, force: bool, reuse_imported: bool = False
) -> int:
    """How many of the study's runs would be queued: all with ``force``, otherwise those
    the result cache cannot serve (imported results serve only with ``reuse_imported``)."""
    hashes = [run.config_hash for run in spec.runs()]
    if force:
        return len(hashes)
    statement = select(Run.config_hash).where(
        Run.config_hash.in_(set(hashes)), *reusable(reuse_imported=reuse_imported)
    )
    done = set(session.scalars(statement))
    return sum(value not in done for value in hashes)


def active_runs_problem(
    session: Session,
    spec: StudySpec,
    settings: Settings,
    *,
    force: bool,
    reuse_imported: bool = False,
    submitter: str | None = None,
) -> str | None:
    """The refusal of a study that would leave more runs queued or running than the
    quota, across the service or of ``submitter``'s studies (None: within both)."""
    adding = new_active_runs(session, spec, force=force, reuse_imported=reuse_imported)
    if not adding:
        return None
    active = session.scalar(select(func.count()).select_from(Run).where(Run.status.in_(ACTIVE)))
    total, limit = int(active or 0) + adding, settings.max_active_runs
    if total > limit:
        return (
            f"quota POSBENCH_MAX_ACTIVE_RUNS exceeded: {active} runs are queued or running "
            f"and this study adds {adding}, {total} in all, over the limit of {limit} by "
            f"{total - limit}; wait for runs to finish or cancel some"
        )
    if submitter is None:
        return None
    mine = session.scalar(
        select(func.count())
        .select_from(Run)
        .join(Study, Study.id == Run.study_id)
        .where(Run.status.in_(ACTIVE), Study.submitted_by == submitter)
    )
    total, limit = int(mine or 0) + adding, settings.max_active_runs_per_submitter
    if total <= limit:
        return None
    return (
        f"quota POSBENCH_MAX_ACTIVE_RUNS_PER_SUBMITTER exceeded: {submitter} has {mine} runs "
        f"queued or running and this study adds {adding}, {total} in all, over the limit of "
        f"{limit} by {total - limit}; wait for your runs to finish or cancel some"
    )


def deadline_reason(hours: float) -> str:
    """The failure reason of a run past POSBENCH_RUN_DEADLINE_HOURS."""
    return f"wall-clock deadline of {hours:g} h reached"
