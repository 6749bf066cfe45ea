"""evaluations.variant and run_summaries.variant: VARCHAR(120), so a fine-tuned variant
with the papers' settings ('yarn:4(temperature=false)+ft200@128(lr=2e-05)') fits

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-30 10:50:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

TABLES = ("evaluations", "run_summaries")


# The view of 0002, as it stands: it reads run_summaries.variant, so it is dropped while
# the column changes (PostgreSQL refuses to alter a column a view uses; SQLite's table
# copy would leave the view pointing at a table that is gone) and made again.
VIEW = """
    CREATE VIEW encoding_summaries AS
    SELECT r.study_id, r.label, r.encoding, m.variant, m.protocol, m.name,
           AVG(m.value) AS mean, MIN(m.value) AS min, MAX(m.value) AS max,
           COUNT(m.value) AS seeds
    FROM run_summaries m JOIN runs r ON r.id = m.run_id
    GROUP BY r.study_id, r.label, r.encoding, m.variant, m.protocol, m.name
"""


def _resize(length_from: int, length_to: int) -> None:
    op.execute("DROP VIEW encoding_summaries")
    # batch mode: SQLite cannot alter a column's type in place (the table is copied).
    for table in TABLES:
        with op.batch_alter_table(table) as batch:
            batch.alter_column(
                "variant",
                existing_type=sa.String(length_from),
                type_=sa.String(length_to),
                existing_nullable=False,
            )
    op.execute(VIEW)


def upgrade() -> None:
    _resize(40, 120)


def downgrade() -> None:
    _resize(120, 40)
