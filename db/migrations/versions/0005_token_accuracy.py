"""evaluations.token_accuracy: the fraction of answer tokens predicted right (synthetic
tasks), next to the exact-match accuracy, so partial success at long lengths shows

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30 07:45:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("evaluations", sa.Column("token_accuracy", sa.Double(), nullable=True))


def downgrade() -> None:
    op.drop_column("evaluations", "token_accuracy")
