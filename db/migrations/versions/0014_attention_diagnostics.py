"""evaluations.attn_*: attention diagnostics, and evaluations.attention per layer and head

With ``eval.diagnostics`` every point records what attention does at its length, from a
sample of queries per window (worker.diagnostics): entropy (nats, and normalised by the
log of the keys seen), mean distance, the mass on the first 4 tokens, the mass past the
training length and the largest logit, averaged over layers and heads, and in
``attention`` (JSON) per layer and per head. NULL without ``eval.diagnostics`` and for
every point evaluated before; the downgrade drops them.

Revision ID: 0014
Revises: 0013
Create Date: 2027-03-01 09:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

COLUMNS = (
    "attn_entropy",
    "attn_entropy_norm",
    "attn_distance",
    "attn_sink_mass",
    "attn_beyond_mass",
    "attn_max_logit",
)


def upgrade() -> None:
    for column in COLUMNS:
        op.add_column("evaluations", sa.Column(column, sa.Double(), nullable=True))
    op.add_column("evaluations", sa.Column("attention", sa.JSON(), nullable=True))


def downgrade() -> None:
    op.drop_column("evaluations", "attention")
    for column in reversed(COLUMNS):
        op.drop_column("evaluations", column)
