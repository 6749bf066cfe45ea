"""evaluations.key_token_fraction, key_token_perplexity, key_token_gain: the key-token
metrics of language modelling

With ``eval.key_tokens`` (LongPPL, Fang et al. 2024) every scored target is scored again
with its context cut short; a point records the fraction of targets whose loss the full
context lowers by more than the threshold (key tokens), the perplexity over them and the
mean loss gain. NULL without ``eval.key_tokens`` and for every point evaluated before;
the downgrade drops them.

Revision ID: 0013
Revises: 0012
Create Date: 2027-02-01 09:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

COLUMNS = ("key_token_fraction", "key_token_perplexity", "key_token_gain")


def upgrade() -> None:
    for column in COLUMNS:
        op.add_column("evaluations", sa.Column(column, sa.Double(), nullable=True))


def downgrade() -> None:
    for column in reversed(COLUMNS):
        op.drop_column("evaluations", column)
