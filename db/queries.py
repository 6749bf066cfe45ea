"""Read paths: every query the CLI, the dashboard and users' notebooks need, as DataFrames.

A deleted study (``studies.deleted_at``, ``jobs.retention``) is in none of them, its
runs and results neither, but in ``deleted_studies``: until it is restored or purged it
shows nowhere a live study shows. The audit trail (``events``) keeps every study's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import pandas as pd
from sqlalchemy import Select, case, func, select

from core.analysis import ANY_PROTOCOL
from core.metrics import METRICS, metric_named
from core.status import RUN_STATUSES
from db.engine import engine_for, normalize_url
from db.models import (
    Evaluation,
    Event,
    PositionBin,
    Run,
    RunSummary,
    Study,
    TrainPoint,
    in_live_study,
)


def _frame(url: str, statement: Select) -> pd.DataFrame:
    with engine_for(normalize_url(url)).connect() as connection:
        return pd.read_sql(statement, connection)


def _study_filters(name: str | None, status: str | None) -> list:
    """Live studies whose name holds ``name`` (any case) and that have a run in
    ``status``."""
    where = [Study.deleted_at.is_(None)]
    if name:
        escaped = name.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        where.append(Study.name.ilike(f"%{escaped}%", escape="\\"))
    if status:
        where.append(Study.id.in_(select(Run.study_id).where(Run.status == status)))
    return where


def count_studies(url: str, name: str | None = None, status: str | None = None) -> int:
    """How many live studies ``studies(url, name=..., status=...)`` would list unbounded."""
    statement = select(func.count(Study.id)).where(*_study_filters(name, status))
    with engine_for(normalize_url(url)).connect() as connection:
        return int(connection.scalar(statement) or 0)


def studies(
    url: str,
    study_ids: Sequence[int] | None = None,
    *,
    limit: int | None = None,
    name: str | None = None,
    status: str | None = None,
) -> pd.DataFrame:
    """One row per study with its run counts by status, newest first: every live one,
    or ``study_ids``; at most ``limit`` (the newest), those whose name holds ``name``
    (any case), those with a run in ``status``. The bounds are applied to the studies
    before their runs are counted, so a page of 20 costs the same among 20,000."""
    counts = [
        func.sum(case((Run.status == status, 1), else_=0)).label(status.value)
        for status in RUN_STATUSES
    ]
    statement = (
        select(
            Study.id,
            Study.name,
            Study.task,
            Study.metric,
            Study.train_length,
            Study.created_at,
            func.count(Run.id).label("runs"),
            *counts,
        )
        .join(Run, Run.study_id == Study.id, isouter=True)
        .group_by(Study.id)
        .order_by(Study.id.desc())
    )
    chosen = select(Study.id).where(*_study_filters(name, status))
    if study_ids:
        chosen = chosen.where(Study.id.in_(study_ids))
    if limit is not None:
        chosen = chosen.order_by(Study.id.desc()).limit(limit)
    statement = statement.where(Study.id.in_(chosen.scalar_subquery()))
    return _frame(url, statement)


def deleted_studies(url: str, study_ids: Sequence[int] | None = None) -> pd.DataFrame:
    """One row per deleted study (not yet purged), newest delete first: who submitted
    it, who deleted it and when, and its run count."""
    statement = (
        select(
            Study.id,
            Study.name,
            Study.task,
            func.count(Run.id).label("runs"),
            Study.submitted_by,
            Study.deleted_by,
            Study.deleted_at,
        )
        .join(Run, Run.study_id == Study.id, isouter=True)
        .where(Study.deleted_at.is_not(None))
        .group_by(Study.id)
        .order_by(Study.deleted_at.desc(), Study.id.desc())
    )
    if study_ids:
        statement = statement.where(Study.id.in_(study_ids))
    return _frame(url, statement)


def events(url: str, study_id: int | None = None, limit: int = 50) -> pd.DataFrame:
    """The newest ``limit`` events of the audit trail, newest first (of one study with
    ``study_id``, deleted and purged ones included)."""
    statement = select(
        Event.at, Event.actor, Event.action, Event.study_id, Event.run_id, Event.detail
    ).order_by(Event.id.desc())
    if study_id is not None:
        statement = statement.where(Event.study_id == study_id)
    return _frame(url, statement.limit(limit))


def imported_runs(url: str, study_ids: Sequence[int] | None = None) -> dict[int, int]:
    """How many runs of each study were imported rather than trained here (studies
    with none are left out): what ``posbench status``, ``posbench results`` and the
    dashboard mark."""
    statement = (
        select(Run.study_id, func.count(Run.id))
        .where(Run.imported_from.is_not(None), in_live_study())
        .group_by(Run.study_id)
    )
    if study_ids:
        statement = statement.where(Run.study_id.in_(study_ids))
    with engine_for(normalize_url(url)).connect() as connection:
        return {int(study): int(count) for study, count in connection.execute(statement)}


def study_spec(url: str, study_id: int) -> dict | None:
    """The spec a study was submitted with (as stored), or None for no such study (or a
    deleted one)."""
    statement = select(Study.spec).where(Study.id == study_id, Study.deleted_at.is_(None))
    with engine_for(normalize_url(url)).connect() as connection:
        return connection.scalar(statement)


def runs(
    url: str, study_id: int | None = None, run_ids: Sequence[int] | None = None
) -> pd.DataFrame:
    """The runs (of a study, or these), with ``points``: how many points of the curve
    each has stored (an hf: model's progress: it trains no step)."""
    points = (
        select(func.count(Evaluation.id))
        .where(Evaluation.run_id == Run.id)
        .correlate(Run)
        .scalar_subquery()
        .label("points")
    )
    statement = (
        select(
            Run.id,
            Run.study_id,
            Run.label,
            Run.encoding,
            Run.seed,
            Run.status,
            Run.step,
            Run.total_steps,
            Run.latest_loss,
            Run.tokens_per_second,
            Run.attempts,
            Run.worker,
            Run.heartbeat_at,
            Run.started_at,
            Run.finished_at,
            Run.failure_reason,
            Run.cancel_requested,
            Run.config_hash,
            Run.reused_from_run_id,
            Run.checkpoint_uri,
            Run.skip_cache,
            Run.waiting_for,
            Run.phase,
            Run.imported_from,
            Run.provenance,
            points,
        )
        .where(in_live_study())
        .order_by(Run.id)
    )
    if study_id is not None:
        statement = statement.where(Run.study_id == study_id)
    if run_ids:
        statement = statement.where(Run.id.in_(run_ids))
    return _frame(url, statement)


def downsample_lengths(lengths: Sequence[int], keep: int) -> list[int]:
    """At most ``keep`` lengths, evenly spaced on a log scale, always keeping both ends."""
    ordered = sorted(set(lengths))
    if len(ordered) <= keep or keep < 2:
        return ordered
    step = (len(ordered) - 1) / (keep - 1)
    return sorted({ordered[round(i * step)] for i in range(keep)})


def curves(
    url: str,
    study_ids: Sequence[int] | None = None,
    run_ids: Sequence[int] | None = None,
    protocol: str | None = None,
    max_lengths: int | None = None,
) -> pd.DataFrame:
    """Every evaluation point of the selected studies / runs, with its run's identity.

    ``max_lengths`` thins the lengths in the query (log-spaced, endpoints kept), so a
    view of thousands of evaluations loads only what it draws.
    """
    statement = (
        select(
            Evaluation.id.label("evaluation_id"),
            Run.study_id,
            Evaluation.run_id,
            Run.label,
            Run.encoding,
            Run.seed,
            Evaluation.variant,
            Evaluation.protocol,
            Evaluation.eval_length,
            Evaluation.factor,
            *(getattr(Evaluation, metric.column) for metric in METRICS.values()),
            Evaluation.tokens,
            Evaluation.tokens_per_second,
            Evaluation.peak_memory_bytes,
            Evaluation.decode_tokens_per_second,
            Evaluation.kv_cache_bytes,
            Evaluation.not_applicable,
            Evaluation.groups,
        )
        .join(Run, Run.id == Evaluation.run_id)
        .where(in_live_study())
        .order_by(
            Run.study_id,
            Run.label,
            Run.seed,
            Evaluation.variant,
            Evaluation.protocol,
            Evaluation.eval_length,
        )
    )
    if study_ids:
        statement = statement.where(Run.study_id.in_(study_ids))
    if run_ids:
        statement = statement.where(Evaluation.run_id.in_(run_ids))
    if protocol:
        statement = statement.where(Evaluation.protocol == protocol)
    if max_lengths:
        distinct = (
            select(Evaluation.eval_length)
            .distinct()
            .join(Run, Run.id == Evaluation.run_id)
            .where(in_live_study())
        )
        if study_ids:
            distinct = distinct.where(Run.study_id.in_(study_ids))
        if run_ids:
            distinct = distinct.where(Evaluation.run_id.in_(run_ids))
        with engine_for(normalize_url(url)).connect() as connection:
            lengths = list(connection.scalars(distinct))
        kept = downsample_lengths(lengths, max_lengths)
        if len(kept) < len(lengths):
            statement = statement.where(Evaluation.eval_length.in_(kept))
    return _frame(url, statement)


def run_points(run_id: int, metric: str) -> Select:
    """(variant, protocol, eval_length, metric) of every stored point of one run (None
    where not applicable): what its summaries are computed from, whichever attempt
    evaluated each point. A statement, for the writers to run inside their own
    transaction."""
    value = getattr(Evaluation, metric_named(metric).column)
    return select(Evaluation.variant, Evaluation.protocol, Evaluation.eval_length, value).where(
        Evaluation.run_id == run_id
    )


def position_bins(url: str, evaluation_ids: Sequence[int]) -> pd.DataFrame:
    statement = (
        select(
            PositionBin.evaluation_id,
            PositionBin.start,
            PositionBin.end,
            PositionBin.loss,
            PositionBin.tokens,
        )
        .where(PositionBin.evaluation_id.in_(evaluation_ids))
        .order_by(PositionBin.evaluation_id, PositionBin.start)
    )
    return _frame(url, statement)


def attention(url: str, evaluation_ids: Sequence[int]) -> dict[int, dict]:
    """The per-layer diagnostics (``evaluations.attention``) of the evaluations given:
    evaluation id -> the JSON, for those that have it."""
    statement = select(Evaluation.id, Evaluation.attention).where(
        Evaluation.id.in_(evaluation_ids), Evaluation.attention.is_not(None)
    )
    with engine_for(normalize_url(url)).connect() as connection:
        return {int(i): value for i, value in connection.execute(statement) if value}


TRAIN_POINTS_PER_STUDY = 5_000
"""The most training points the Compare page loads per study (the curves are drawn
from at most this many rows, however long and many the runs)."""


def train_points(
    url: str, run_ids: Sequence[int], max_per_study: int | None = None
) -> pd.DataFrame:
    """The training points of ``run_ids``, ordered by run and step.

    With ``max_per_study`` each study's runs share that many rows: a run over its share
    keeps every k-th point from its first (k chosen per run, in the query) and its last,
    so a long curve keeps its shape and ends and the load stays bounded. Every run keeps
    at least its first and last point.
    """
    columns = (
        TrainPoint.run_id,
        TrainPoint.step,
        TrainPoint.loss,
        TrainPoint.lr,
        TrainPoint.tokens_per_second,
        TrainPoint.elapsed,
        TrainPoint.val_loss,
    )
    live = select(Run.id).where(Run.id.in_(run_ids), in_live_study())
    chosen = TrainPoint.run_id.in_(live)
    strides = _train_point_strides(url, run_ids, max_per_study) if max_per_study else {}
    if not strides:
        return _frame(url, select(*columns).where(chosen).order_by(*columns[:2]))
    by_run = {"partition_by": TrainPoint.run_id}
    numbered = (
        select(
            *columns,
            func.row_number().over(**by_run, order_by=TrainPoint.step).label("position"),
            func.count().over(**by_run).label("points"),
        )
        .where(chosen)
        .subquery()
    )
    stride = case(strides, value=numbered.c.run_id, else_=1)
    kept = ((numbered.c.position - 1) % stride == 0) | (numbered.c.position == numbered.c.points)
    names = [column.key for column in columns]
    statement = (
        select(*(numbered.c[name] for name in names))
        .where(kept)
        .order_by(numbered.c.run_id, numbered.c.step)
    )
    return _frame(url, statement)


def _train_point_strides(url: str, run_ids: Sequence[int], cap: int) -> dict[int, int]:
    """run id -> k for every run over its share of ``cap`` (its study's cap over the
    study's runs, at least 2). k = ceil((n - 1) / (share - 1)) keeps at most share - 1
    of the first n - 1 points, plus the last: at most ``share``."""
    statement = (
        select(TrainPoint.run_id, Run.study_id, func.count())
        .join(Run, Run.id == TrainPoint.run_id)
        .where(TrainPoint.run_id.in_(run_ids))
        .group_by(TrainPoint.run_id, Run.study_id)
    )
    with engine_for(normalize_url(url)).connect() as connection:
        counts = connection.execute(statement).all()
    runs_per_study = Counter(study for _, study, _ in counts)
    strides = {}
    for run_id, study, points in counts:
        share = max(2, cap // runs_per_study[study])
        if points > share:
            strides[run_id] = -(-(points - 1) // (share - 1))
    return strides


def run_summaries(
    url: str, study_ids: Sequence[int] | None = None, protocol: str | None = None
) -> pd.DataFrame:
    """Every stored per-run summary (``core.analysis.summarize_run`` and the order
    probe), one row per (run, variant, protocol, summary), with its run's identity.
    With ``protocol``, the curve summaries of that protocol and the order probe's."""
    statement = (
        select(
            Run.study_id,
            RunSummary.run_id,
            Run.label,
            Run.encoding,
            Run.seed,
            RunSummary.variant,
            RunSummary.protocol,
            RunSummary.name.label("summary"),
            RunSummary.value,
        )
        .join(Run, Run.id == RunSummary.run_id)
        .where(in_live_study())
        .order_by(Run.study_id, Run.label, Run.seed, RunSummary.variant, RunSummary.name)
    )
    if study_ids:
        statement = statement.where(Run.study_id.in_(study_ids))
    if protocol:
        # Summaries not read off a curve (the order probe's) hold for every protocol.
        statement = statement.where(RunSummary.protocol.in_((protocol, ANY_PROTOCOL)))
    return _frame(url, statement)
