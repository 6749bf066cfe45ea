"""Idempotent writes: INSERT ... ON CONFLICT DO UPDATE on SQLite and PostgreSQL alike."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Table
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session


def upsert(
    session: Session,
    table: Table,
    values: dict[str, Any],
    keys: Sequence[str],
    returning: str | None = "id",
) -> Any:
    """Insert ``values`` or, when a row with the same ``keys`` exists, update it in place.

    Returns the row's ``returning`` column (its id by default).
    """
    dialect = session.get_bind().dialect.name
    insert = {"sqlite": sqlite.insert, "postgresql": postgresql.insert}[dialect]
    statement = insert(table).values(**values)
    changes = {k: statement.excluded[k] for k in values if k not in keys}
    statement = statement.on_conflict_do_update(index_elements=list(keys), set_=changes)
    if returning is None:
        session.execute(statement)
        return None
    return session.execute(statement.returning(table.c[returning])).scalar_one()
