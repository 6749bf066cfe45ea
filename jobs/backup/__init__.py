"""`posbench db backup` and `posbench db restore`: a copy of the results database that
can be taken while workers write, and its rows put back.

SQLite (``jobs.backup.sqlite``): the online backup API copies a consistent snapshot (WAL
readers never wait for the writer, and a writer never waits for the copy), into a new
owner-only file renamed over ``--out`` only once it is whole. PostgreSQL
(``jobs.backup.postgres``): ``pg_dump --format=custom`` when it is on PATH (the password
goes to it in PGPASSWORD, never on a command line anyone can list), and how to run it
otherwise.

A restore checks first that the file is a posbench database at a revision these
migrations know, holding no schema object of its own (``jobs.backup.checks``); then it
makes the schema with the migrations, up to the backup's revision, takes only the file's
rows into it (``db.backup_rows``: the file's own views, triggers and table definitions
are never used), and migrates the result to the latest schema. SQLite's is a new file
renamed over the database once whole; PostgreSQL's is one transaction on the database,
its rows read with ``pg_restore --data-only``.
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy.engine import make_url

from db.engine import forget, normalize_url
from db.migrate import current, upgrade
from jobs.backup.checks import (
    PG_DUMP_MAGIC,
    SQLITE_MAGIC,
    BackupFailed,
    BackupRefused,
    Copied,
    check_out,
    first_bytes,
    first_line,
)
from jobs.backup.postgres import backup_postgres, restore_postgres
from jobs.backup.sqlite import backup_sqlite, restore_sqlite, sqlite_path

__all__ = ["BackupFailed", "BackupRefused", "Copied", "backup", "restore"]


def backup(url: str, out: Path, *, force: bool = False) -> Copied:
    """Copy the database at ``url`` to ``out`` (owner-only, written whole): BackupRefused
    for an ``out`` that exists (unless ``force``), is a link or has no folder,
    BackupFailed when the database or pg_dump fails."""
    check_out(out, force=force)
    if is_sqlite(url):
        return backup_sqlite(sqlite_path(url), out)
    return backup_postgres(url, out)


def restore(url: str, source: Path, *, force: bool = False) -> tuple[Copied, str]:
    """Put the backup ``source`` back as the database at ``url`` and migrate it to the
    latest schema: what was restored and the revision it is at now. BackupRefused for a
    file that is no posbench backup at a known revision, or a database that exists
    (unless ``force``); nothing is changed then."""
    start = first_bytes(source)
    if is_sqlite(url):
        if start.startswith(PG_DUMP_MAGIC):
            raise BackupRefused(
                f"{source} is a PostgreSQL dump: restore it with POSBENCH_DATABASE_URL "
                "set to a PostgreSQL database"
            )
        restored = restore_sqlite(url, source, force=force)
        forget(url)
    else:
        if start.startswith(SQLITE_MAGIC):
            raise BackupRefused(
                f"{source} is a SQLite database: restore it with POSBENCH_DATABASE_URL "
                "set to a SQLite file (the default)"
            )
        if not start.startswith(PG_DUMP_MAGIC):
            raise BackupRefused(
                f"{source} is not a pg_dump --format=custom file (what posbench db backup "
                "writes; a plain SQL dump restores with psql)"
            )
        restored = restore_postgres(url, source, force=force)
    try:
        upgrade(url)
    except Exception as err:
        raise BackupFailed(f"restored, but migrating it failed: {first_line(err)}") from None
    return restored, current(url) or "none"


def is_sqlite(url: str) -> bool:
    return make_url(normalize_url(url)).get_backend_name() == "sqlite"
