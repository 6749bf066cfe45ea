"""summaries not read off a curve (the order probe's) are stored under protocol 'any'

Revision 0002 stored them under 'nonoverlapping', and readers recognised them by the
name prefix 'order_'. This moves them to the protocol-free marker
``core.analysis.ANY_PROTOCOL``.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30 01:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

# Fixed here: a migration keeps meaning what it meant when it was written.
ORDER_PROBE = ("order_ordered_loss", "order_shuffled_loss", "order_sensitivity")


def _move(old: str, new: str) -> None:
    summaries = sa.table("run_summaries", sa.column("protocol"), sa.column("name"))
    op.execute(
        summaries.update()
        .where(summaries.c.name.in_(ORDER_PROBE), summaries.c.protocol == old)
        .values(protocol=new)
    )


def upgrade() -> None:
    _move("nonoverlapping", "any")


def downgrade() -> None:
    _move("any", "nonoverlapping")
