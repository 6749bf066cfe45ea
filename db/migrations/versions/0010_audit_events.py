"""events: the audit trail; studies.submitted_by, deleted_at, deleted_by: who submitted a
study, and a delete that can be undone

Until now nothing recorded who submitted, cancelled, retried or deleted a study, and a
delete removed the study and its results at once. The ``events`` table records every
such action (its ``study_id`` and ``run_id`` are plain columns, not foreign keys: the
record of a purge outlives the study). A deleted study keeps its rows, marked by
``deleted_at`` and ``deleted_by``, until it is restored or purged after the retention
period. The ``encoding_summaries`` view leaves deleted studies out, as every read does.
Existing studies have no submitter (NULL) and none is deleted; the downgrade removes
the columns and the table, and so forgets which studies were deleted: purge first
(``posbench purge``) if they must not come back.

Revision ID: 0010
Revises: 0009
Create Date: 2027-01-25 09:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

COLUMNS = ("submitted_by", "deleted_at", "deleted_by")

# The view of 0007, as it stands below this revision.
VIEW_0007 = """
    CREATE VIEW encoding_summaries AS
    SELECT r.study_id, r.label, r.encoding, m.variant, m.protocol, m.name,
           AVG(m.value) AS mean, MIN(m.value) AS min, MAX(m.value) AS max,
           COUNT(m.value) AS seeds
    FROM run_summaries m JOIN runs r ON r.id = m.run_id
    GROUP BY r.study_id, r.label, r.encoding, m.variant, m.protocol, m.name
"""

# The same, less the studies that are deleted.
VIEW = """
    CREATE VIEW encoding_summaries AS
    SELECT r.study_id, r.label, r.encoding, m.variant, m.protocol, m.name,
           AVG(m.value) AS mean, MIN(m.value) AS min, MAX(m.value) AS max,
           COUNT(m.value) AS seeds
    FROM run_summaries m JOIN runs r ON r.id = m.run_id JOIN studies s ON s.id = r.study_id
    WHERE s.deleted_at IS NULL
    GROUP BY r.study_id, r.label, r.encoding, m.variant, m.protocol, m.name
"""


def upgrade() -> None:
    # Plain ALTERs (no table copy): runs refers to studies, and the view is rebuilt below.
    op.add_column("studies", sa.Column("submitted_by", sa.String(length=200), nullable=True))
    op.add_column("studies", sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("studies", sa.Column("deleted_by", sa.String(length=200), nullable=True))
    op.create_table(
        "events",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column(
            "at",
            sa.DateTime(timezone=True),
            server_default=sa.text("(CURRENT_TIMESTAMP)"),
            nullable=False,
        ),
        sa.Column("actor", sa.String(length=200), nullable=False),
        sa.Column("action", sa.String(length=20), nullable=False),
        sa.Column("study_id", sa.Integer(), nullable=True),
        sa.Column("run_id", sa.Integer(), nullable=True),
        sa.Column("detail", sa.String(length=1000), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index(op.f("ix_events_study_id"), "events", ["study_id"], unique=False)
    op.execute("DROP VIEW encoding_summaries")
    op.execute(VIEW)


def downgrade() -> None:
    # The view first: it reads studies.deleted_at, which goes.
    op.execute("DROP VIEW encoding_summaries")
    op.execute(VIEW_0007)
    op.drop_index(op.f("ix_events_study_id"), table_name="events")
    op.drop_table("events")
    for column in reversed(COLUMNS):
        op.drop_column("studies", column)
