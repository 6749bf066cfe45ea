"""runs.skip_cache, runs.waiting_for, runs.phase: a run's control state in columns of its
own, taken out of runs.provenance (which keeps the audit record only)

Until now ``provenance`` held three control flags beside the audit record:
``train_afresh`` (``submit --force``), ``waiting_for`` (the run whose training a queued
run waits for) and ``phase`` (what a running run does that its step does not show).
They move to columns, with their values, and leave ``provenance``; the downgrade puts
them back.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-14 09:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

# provenance key -> column
MOVED = {"train_afresh": "skip_cache", "waiting_for": "waiting_for", "phase": "phase"}

RUNS = sa.table(
    "runs",
    sa.column("id", sa.Integer),
    sa.column("provenance", sa.JSON),
    sa.column("skip_cache", sa.Boolean),
    sa.column("waiting_for", sa.Integer),
    sa.column("phase", sa.Text),
)


def _noted(provenance: object) -> bool:
    return isinstance(provenance, dict) and any(key in provenance for key in MOVED)


def upgrade() -> None:
    # Plain ALTERs (no table copy): the encoding_summaries view reads runs.
    op.add_column(
        "runs",
        sa.Column("skip_cache", sa.Boolean(), nullable=False, server_default=sa.false()),
    )
    op.add_column("runs", sa.Column("waiting_for", sa.Integer(), nullable=True))
    op.add_column("runs", sa.Column("phase", sa.Text(), nullable=True))
    connection = op.get_bind()
    rows = connection.execute(sa.select(RUNS.c.id, RUNS.c.provenance)).all()
    for run_id, provenance in rows:
        if not _noted(provenance):
            continue
        audit = {k: v for k, v in provenance.items() if k not in MOVED}
        waiting_for = provenance.get("waiting_for")
        phase = provenance.get("phase")
        connection.execute(
            sa.update(RUNS)
            .where(RUNS.c.id == run_id)
            .values(
                skip_cache=bool(provenance.get("train_afresh")),
                waiting_for=int(waiting_for) if waiting_for is not None else None,
                phase=str(phase) if phase else None,
                # A provenance that held only control flags was none (NULL) before them.
                provenance=audit or None,
            )
        )


def downgrade() -> None:
    connection = op.get_bind()
    rows = connection.execute(
        sa.select(
            RUNS.c.id, RUNS.c.provenance, RUNS.c.skip_cache, RUNS.c.waiting_for, RUNS.c.phase
        ).where(
            sa.or_(
                RUNS.c.skip_cache.is_(True),
                RUNS.c.waiting_for.is_not(None),
                RUNS.c.phase.is_not(None),
            )
        )
    ).all()
    for run_id, provenance, skip_cache, waiting_for, phase in rows:
        restored = dict(provenance) if isinstance(provenance, dict) else {}
        if skip_cache:
            restored["train_afresh"] = True
        if waiting_for is not None:
            restored["waiting_for"] = waiting_for
        if phase is not None:
            restored["phase"] = phase
        connection.execute(sa.update(RUNS).where(RUNS.c.id == run_id).values(provenance=restored))
    for column in ("phase", "waiting_for", "skip_cache"):
        op.drop_column("runs", column)
