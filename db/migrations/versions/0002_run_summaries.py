"""run summaries: extrapolation ratios, effective length, log-perplexity area, order probe;
the encoding_summaries view aggregates them across seeds

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29 22:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "run_summaries",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("variant", sa.String(length=40), nullable=False),
        sa.Column("protocol", sa.String(length=20), nullable=False),
        sa.Column("name", sa.String(length=40), nullable=False),
        sa.Column("value", sa.Double(), nullable=True),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("run_id", "variant", "protocol", "name", name="uq_run_summaries_key"),
    )
    # Per encoding, for plain SQL: mean, range and seed count of every summary. The
    # bootstrap intervals need resampling and are computed on read (core.analysis).
    op.execute(
        """
        CREATE VIEW encoding_summaries AS
        SELECT r.study_id, r.label, r.encoding, m.variant, m.protocol, m.name,
               AVG(m.value) AS mean, MIN(m.value) AS min, MAX(m.value) AS max,
               COUNT(m.value) AS seeds
        FROM run_summaries m JOIN runs r ON r.id = m.run_id
        GROUP BY r.study_id, r.label, r.encoding, m.variant, m.protocol, m.name
        """
    )


def downgrade() -> None:
    op.execute("DROP VIEW encoding_summaries")
    op.drop_table("run_summaries")
