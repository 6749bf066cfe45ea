"""evaluations.string_match_all, string_match_part: RULER's metrics of multi-answer
synthetic tasks (Hsieh et al., 2024), the fraction of expected answers right and whether
any is; old rows keep NULL

Revision ID: 0011
Revises: 0010
Create Date: 2027-02-01 09:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("evaluations", sa.Column("string_match_all", sa.Double(), nullable=True))
    op.add_column("evaluations", sa.Column("string_match_part", sa.Double(), nullable=True))


def downgrade() -> None:
    op.drop_column("evaluations", "string_match_part")
    op.drop_column("evaluations", "string_match_all")
