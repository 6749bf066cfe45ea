"""The results database: every status and every result lives here.

Tables (documented for plain SQL in docs/results-database.md):

- ``studies``: what a user submitted (the validated spec as JSON), who submitted it, and
  for a deleted study who deleted it and when (``jobs.retention``: it is hidden
  everywhere until it is restored or purged);
- ``runs``: one trained model of a study, (encoding label, seed), with its status,
  progress, heartbeat, lease, config hash, control state (skip_cache, waiting_for,
  phase), failure reason, provenance (an audit record) and, for results imported
  rather than trained here, the file they came from (``imported_from``);
- ``train_points``: the training curve (step, loss, learning rate, tokens/s, and the
  validation loss at the steps that validate);
- ``evaluations``: one point of an extrapolation curve, (run, variant, protocol,
  eval length) -> metrics;
- ``position_bins``: loss by position inside the evaluation window;
- ``run_summaries``: one run's curve turned into numbers, (run, variant, protocol,
  name) -> value: extrapolation ratios, effective context length, area under the
  log-perplexity curve, and the order probe (``core.analysis``, ``worker.probes``);
- ``events``: the audit trail, who did what to which study or run and when
  (``jobs.audit``); no foreign key, so an event outlives the study it names.

Every natural key is unique, so writes are idempotent upserts: a message
delivered twice cannot duplicate a row.
"""

from __future__ import annotations

import datetime as dt
from typing import Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    ColumnElement,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    false,
    func,
    inspect,
    select,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from core.status import RunStatus


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def as_utc(moment: dt.datetime) -> dt.datetime:
    """A stored time as an aware UTC datetime: SQLite hands back naive ones (they are UTC)."""
    return moment.replace(tzinfo=dt.timezone.utc) if moment.tzinfo is None else moment


ACTOR_LENGTH = 200  # who acted: an OIDC e-mail, a role and an address, an OS user
DETAIL_LENGTH = 1000  # what an event did, in a line


class Base(DeclarativeBase):
    type_annotation_map: ClassVar[dict[Any, Any]] = {
        dict[str, Any]: JSON,
        dt.datetime: DateTime(timezone=True),
    }

    def column_values(self, skip: tuple[str, ...] = ()) -> dict[str, Any]:
        """This row's column values by attribute, less the primary key and ``skip``: what
        a copy of it under another parent starts from."""
        return {
            attr.key: getattr(self, attr.key)
            for attr in inspect(type(self)).column_attrs
            if attr.key not in skip and not any(column.primary_key for column in attr.columns)
        }


class Study(Base):
    __tablename__ = "studies"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(120))
    task: Mapped[str] = mapped_column(String(40))
    metric: Mapped[str] = mapped_column(String(20))
    train_length: Mapped[int]
    spec: Mapped[dict[str, Any]]
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow, server_default=func.now())
    # Who submitted (or imported) it, as the audit trail names them; NULL before 0010.
    submitted_by: Mapped[str | None] = mapped_column(String(ACTOR_LENGTH))
    # Soft delete: set, the study is hidden everywhere a live study shows and its results
    # serve no cache, until it is restored or purged (``jobs.retention``).
    deleted_at: Mapped[dt.datetime | None]
    deleted_by: Mapped[str | None] = mapped_column(String(ACTOR_LENGTH))

    runs: Mapped[list[Run]] = relationship(
        back_populates="study", cascade="all, delete-orphan", order_by="Run.id"
    )


class Run(Base):
    __tablename__ = "runs"
    __table_args__ = (
        UniqueConstraint("study_id", "label", "seed", name="uq_runs_study_label_seed"),
        Index("ix_runs_status_heartbeat", "status", "heartbeat_at"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    study_id: Mapped[int] = mapped_column(ForeignKey("studies.id", ondelete="CASCADE"), index=True)
    encoding: Mapped[str] = mapped_column(String(40))
    label: Mapped[str] = mapped_column(String(200))
    params: Mapped[dict[str, Any]]
    seed: Mapped[int]
    config_hash: Mapped[str] = mapped_column(String(32), index=True)
    train_hash: Mapped[str | None] = mapped_column(String(32), index=True)
    status: Mapped[str] = mapped_column(String(16), default=RunStatus.QUEUED)
    step: Mapped[int] = mapped_column(default=0)
    total_steps: Mapped[int]
    latest_loss: Mapped[float | None]
    tokens_per_second: Mapped[float | None]
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    attempts: Mapped[int] = mapped_column(default=0)
    lease: Mapped[str | None] = mapped_column(String(40))
    worker: Mapped[str | None] = mapped_column(String(200))
    heartbeat_at: Mapped[dt.datetime | None]
    enqueued_at: Mapped[dt.datetime | None]
    started_at: Mapped[dt.datetime | None]
    finished_at: Mapped[dt.datetime | None]
    failure_reason: Mapped[str | None] = mapped_column(Text)
    checkpoint_uri: Mapped[str | None] = mapped_column(Text)
    # The run's control state (``jobs.lifecycle``), apart from its audit record below:
    # skip the result cache (``posbench submit --force``: train afresh, take no model);
    # the run whose training this queued run waits for (the same model); what the
    # running run does that its step does not show (fine-tuning a variant).
    skip_cache: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    waiting_for: Mapped[int | None]
    phase: Mapped[str | None] = mapped_column(Text)
    # Audit only: how the results came about (versions, device, data, a model taken from
    # the result cache, fine-tunings); never read to decide what the run does next.
    provenance: Mapped[dict[str, Any] | None]
    # Not trained by this service: the results.json it was imported from (``posbench
    # import``), or that of the imported run it reused. Such a run is never reused as a
    # trained one unless the submitter asks (``posbench submit --reuse-imported``).
    imported_from: Mapped[str | None] = mapped_column(Text)
    reused_from_run_id: Mapped[int | None] = mapped_column(
        ForeignKey("runs.id", ondelete="SET NULL")
    )
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow, server_default=func.now())

    study: Mapped[Study] = relationship(back_populates="runs")


class TrainPoint(Base):
    __tablename__ = "train_points"
    __table_args__ = (UniqueConstraint("run_id", "step", name="uq_train_points_run_step"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    step: Mapped[int]
    loss: Mapped[float]
    lr: Mapped[float]
    tokens_per_second: Mapped[float]
    elapsed: Mapped[float]
    # Held-out loss at the training length (train.val_every); NULL between validations.
    val_loss: Mapped[float | None]


class Evaluation(Base):
    __tablename__ = "evaluations"
    __table_args__ = (
        UniqueConstraint(
            "run_id", "variant", "protocol", "eval_length", name="uq_evaluations_point"
        ),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    variant: Mapped[str] = mapped_column(String(120))
    protocol: Mapped[str] = mapped_column(String(20))
    eval_length: Mapped[int]
    factor: Mapped[float | None]
    loss: Mapped[float | None]
    perplexity: Mapped[float | None]
    bits_per_byte: Mapped[float | None]
    accuracy: Mapped[float | None]
    token_accuracy: Mapped[float | None]
    string_match_all: Mapped[float | None]
    string_match_part: Mapped[float | None]
    key_token_fraction: Mapped[float | None]
    key_token_perplexity: Mapped[float | None]
    key_token_gain: Mapped[float | None]
    # Attention diagnostics (eval.diagnostics; NULL without): means over layers and heads,
    # and ``attention`` per layer and head.
    attn_entropy: Mapped[float | None]
    attn_entropy_norm: Mapped[float | None]
    attn_distance: Mapped[float | None]
    attn_sink_mass: Mapped[float | None]
    attn_beyond_mass: Mapped[float | None]
    attn_max_logit: Mapped[float | None]
    attention: Mapped[dict[str, Any] | None]
    tokens: Mapped[int] = mapped_column(default=0)
    tokens_per_second: Mapped[float | None]
    peak_memory_bytes: Mapped[int | None] = mapped_column(BigInteger)
    not_applicable: Mapped[str | None] = mapped_column(Text)
    groups: Mapped[dict[str, Any] | None]
    # The decode protocol's (NULL under the others): tokens decoded per second, and the
    # most bytes of keys and values one sequence's cache held.
    decode_tokens_per_second: Mapped[float | None]
    kv_cache_bytes: Mapped[int | None] = mapped_column(BigInteger)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow, server_default=func.now())


class PositionBin(Base):
    __tablename__ = "position_bins"
    __table_args__ = (
        UniqueConstraint("evaluation_id", "start", name="uq_position_bins_evaluation_start"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    evaluation_id: Mapped[int] = mapped_column(ForeignKey("evaluations.id", ondelete="CASCADE"))
    start: Mapped[int] = mapped_column(Integer)
    end: Mapped[int] = mapped_column(Integer)
    loss: Mapped[float] = mapped_column(Float)
    tokens: Mapped[int]


class RunSummary(Base):
    __tablename__ = "run_summaries"
    __table_args__ = (
        UniqueConstraint("run_id", "variant", "protocol", "name", name="uq_run_summaries_key"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    variant: Mapped[str] = mapped_column(String(120))
    protocol: Mapped[str] = mapped_column(String(20))
    name: Mapped[str] = mapped_column(String(40))
    # NULL: defined for this run's curve but not computable (e.g. 32x was not evaluated).
    value: Mapped[float | None]


class Event(Base):
    """One entry of the audit trail: who submitted, cancelled, retried, deleted,
    restored, purged or imported what. ``study_id`` and ``run_id`` are plain columns,
    not foreign keys: the record of a purge outlives the study it removed."""

    __tablename__ = "events"

    id: Mapped[int] = mapped_column(primary_key=True)
    at: Mapped[dt.datetime] = mapped_column(default=utcnow, server_default=func.now())
    actor: Mapped[str] = mapped_column(String(ACTOR_LENGTH))
    action: Mapped[str] = mapped_column(String(20))
    study_id: Mapped[int | None] = mapped_column(index=True)
    run_id: Mapped[int | None]
    detail: Mapped[str | None] = mapped_column(String(DETAIL_LENGTH))


def in_live_study() -> ColumnElement[bool]:
    """The condition on ``runs`` that keeps the runs of studies not deleted: what every
    read that shows results, and the result cache, add."""
    return Run.study_id.not_in(select(Study.id).where(Study.deleted_at.is_not(None)))
