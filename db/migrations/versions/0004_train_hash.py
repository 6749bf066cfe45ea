"""runs.train_hash: what the trained model depends on (the config hash less the
evaluation settings), so a study that only evaluates differently reuses trained models

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30 07:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Nullable: runs stored before it have none and are never used as a trained model.
    # Plain ALTERs (no table copy): the encoding_summaries view reads runs.
    op.add_column("runs", sa.Column("train_hash", sa.String(length=32), nullable=True))
    op.create_index("ix_runs_train_hash", "runs", ["train_hash"])


def downgrade() -> None:
    op.drop_index("ix_runs_train_hash", table_name="runs")
    op.drop_column("runs", "train_hash")
