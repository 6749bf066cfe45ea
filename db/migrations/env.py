"""Alembic environment: the URL or connection comes from posbench, never from an ini file."""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection

from db.engine import make_engine
from db.models import Base


def run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        # SQLite cannot ALTER most things in place: batch mode copies the table.
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


connection = context.config.attributes.get("connection")
if connection is not None:
    run(connection)
else:
    engine = make_engine(context.config.get_main_option("sqlalchemy.url"))
    with engine.connect() as conn:
        run(conn)
    engine.dispose()
