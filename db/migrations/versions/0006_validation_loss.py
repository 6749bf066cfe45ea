"""train_points.val_loss: the held-out loss at the training length every
``train.val_every`` steps, so a training curve shows generalisation, not only fit

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-30 09:45:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("train_points", sa.Column("val_loss", sa.Double(), nullable=True))


def downgrade() -> None:
    op.drop_column("train_points", "val_loss")
