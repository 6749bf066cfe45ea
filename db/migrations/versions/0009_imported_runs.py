"""runs.imported_from: a run whose results were imported (``posbench import``), not
trained by this service, is marked in a column of its own

Until now only its audit record said so (``provenance.imported_from``, the file's
path), and the result cache reused such a run as if it had been trained here. The
column is what the result cache, ``posbench status``, ``posbench results``, the
dashboard and the MLflow export read. Existing rows are carried over: a run whose
provenance names the file it was imported from (an imported run, or a run that reused
one, whose provenance is a copy of it) is marked with that path. The provenance keeps
its key, so the downgrade only drops the column.

Revision ID: 0009
Revises: 0008
Create Date: 2027-01-11 09:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

RUNS = sa.table(
    "runs",
    sa.column("id", sa.Integer),
    sa.column("provenance", sa.JSON),
    sa.column("imported_from", sa.Text),
)


def _source(provenance: object) -> str | None:
    """The file a run's provenance says it was imported from, or None."""
    if not isinstance(provenance, dict) or "imported_from" not in provenance:
        return None
    # A key with no usable value still says the run was imported.
    return str(provenance["imported_from"] or "") or "(unknown file)"


def upgrade() -> None:
    # A plain ALTER (no table copy): the encoding_summaries view reads runs.
    op.add_column("runs", sa.Column("imported_from", sa.Text(), nullable=True))
    connection = op.get_bind()
    rows = connection.execute(sa.select(RUNS.c.id, RUNS.c.provenance)).all()
    for run_id, provenance in rows:
        source = _source(provenance)
        if source is not None:
            connection.execute(
                sa.update(RUNS).where(RUNS.c.id == run_id).values(imported_from=source)
            )


def downgrade() -> None:
    # provenance.imported_from still says it (the upgrade left it there).
    op.drop_column("runs", "imported_from")
