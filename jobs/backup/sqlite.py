"""`posbench db backup` and `posbench db restore` on SQLite: the online backup API for
the one, and for the other the rows of a checked copy of the backup copied into a new
database the migrations make, renamed over the database once whole."""

from __future__ import annotations

import shutil
import sqlite3
import tempfile
from pathlib import Path

from sqlalchemy.engine import make_url

from core.files import private_folder, replacing
from db.backup_rows import RowsRefused, copy_sqlite
from db.engine import SQLITE_BUSY_TIMEOUT_S, forget, normalize_url
from db.migrate import upgrade
from jobs.backup.checks import (
    ROWS_ONLY,
    SQLITE_MAGIC,
    BackupFailed,
    BackupRefused,
    Copied,
    check_revision,
    migrated_objects,
    opened,
    refuse_foreign,
    sqlite_objects,
)

POSBENCH_TABLES = ("alembic_version", "studies", "runs", "evaluations")
COPY_CHUNK = 1 << 20


def sqlite_path(url: str) -> Path:
    return Path(make_url(url).database or "").expanduser()


def backup_sqlite(database: Path, out: Path) -> Copied:
    if not database.is_file():
        raise BackupFailed(f"no database at {database}: nothing to back up")
    try:
        # mode=rw: never create a database where none is.
        source = sqlite3.connect(_existing(database), uri=True, timeout=SQLITE_BUSY_TIMEOUT_S)
    except sqlite3.Error as err:
        raise BackupFailed(f"cannot open the database {database}: {err}") from None
    try:
        with replacing(out) as temporary:
            copy = sqlite3.connect(temporary)
            try:
                # One step: a snapshot as of its start, whatever the workers write meanwhile.
                source.backup(copy)
                copy.execute("PRAGMA journal_mode=DELETE")  # one self-contained file
                copied = _contents(copy, temporary)
            finally:
                copy.close()
    except sqlite3.Error as err:
        raise BackupFailed(f"cannot back up {database}: {err}") from None
    finally:
        source.close()
    return Copied(out, out.stat().st_size, copied.revision, copied.rows)


def _existing(path: Path) -> str:
    """The SQLite URI that opens the database file at ``path`` and never creates one (a
    path's '?', '#' or '%' escaped)."""
    return f"{path.resolve().as_uri()}?mode=rw"


def _contents(connection: sqlite3.Connection, path: Path) -> Copied:
    """A SQLite database's revision and row counts (the file's size at ``path``)."""
    tables = [
        name
        for (name,) in connection.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' "
            "ORDER BY name"
        )
    ]
    revision = None
    if "alembic_version" in tables:
        row = connection.execute("SELECT version_num FROM alembic_version").fetchone()
        revision = row[0] if row else None
    rows = {
        name: connection.execute(f'SELECT COUNT(*) FROM "{name}"').fetchone()[0]
        for name in tables
        if name != "alembic_version"
    }
    return Copied(path, path.stat().st_size, revision, rows)


def restore_sqlite(url: str, source: Path, *, force: bool) -> Copied:
    database = sqlite_path(url)
    if database.is_symlink():
        raise BackupRefused(
            f"the database path {database} is a symbolic link; restore into its target"
        )
    if database.exists() and not force:
        raise BackupRefused(
            f"the database {database} exists: stop posbench and move it away, or pass --force "
            "to replace it"
        )
    private_folder(database.parent)
    # The backup is checked on a private copy beside the database (no one changes it
    # meanwhile), and only its rows are taken, into a new database the migrations make.
    with tempfile.TemporaryDirectory(prefix=".posbench-restore-", dir=database.parent) as folder:
        copy = Path(folder) / "backup.db"
        with opened(source) as handle, copy.open("xb") as written:
            shutil.copyfileobj(handle, written, COPY_CHUNK)
        checked = _checked(copy, source)
        with replacing(database) as temporary:
            fresh = make_url(normalize_url(url)).set(database=str(temporary))
            rows = _rows_into_fresh(
                fresh.render_as_string(hide_password=False), checked.revision, copy, source
            )
            # The replaced database's write-ahead log and index belong to it, not to this one.
            for leftover in ("-wal", "-shm", "-journal"):
                database.with_name(database.name + leftover).unlink(missing_ok=True)
    return Copied(database, database.stat().st_size, checked.revision, rows)


def _rows_into_fresh(fresh: str, revision: str | None, copy: Path, source: Path) -> dict[str, int]:
    """Migrate the new SQLite database at the URL ``fresh`` to ``revision``, the backup's,
    and copy into it the rows of ``copy``, the checked copy of ``source``: the rows per
    table."""
    assert revision is not None, "a checked backup is at a known revision"
    try:
        upgrade(fresh, revision)
    finally:
        forget(fresh)  # its pooled connections: the rows go in through sqlite3 below
    try:
        return copy_sqlite(sqlite_path(fresh), copy)
    except RowsRefused as err:
        raise BackupRefused(f"{source}: {err}; {ROWS_ONLY}") from None
    except sqlite3.Error as err:
        raise BackupFailed(f"cannot restore {source}: {err}") from None


def _checked(copy: Path, source: Path) -> Copied:
    """The copy's contents when it is a whole SQLite database with posbench's schema at a
    known revision; BackupRefused naming ``source`` otherwise."""
    with copy.open("rb") as handle:
        magic = handle.read(len(SQLITE_MAGIC))
    if magic != SQLITE_MAGIC:
        raise BackupRefused(f"{source} is not a SQLite database")
    connection = sqlite3.connect(_existing(copy), uri=True)
    try:
        problems = [row[0] for row in connection.execute("PRAGMA quick_check")]
        if problems != ["ok"]:
            raise BackupRefused(f"{source} is a damaged SQLite database: {problems[0]}")
        contents = _contents(connection, copy)
        names = set(contents.rows) | ({"alembic_version"} if contents.revision else set())
    except sqlite3.DatabaseError as err:
        raise BackupRefused(f"{source} is not a readable SQLite database: {err}") from None
    finally:
        connection.close()
    missing = [table for table in POSBENCH_TABLES if table not in names]
    if missing:
        raise BackupRefused(f"{source} is not a posbench database (no table {missing[0]})")
    check_revision(contents.revision, source)
    connection = sqlite3.connect(_existing(copy), uri=True)
    try:
        objects = sqlite_objects(connection)
    finally:
        connection.close()
    refuse_foreign(objects - migrated_objects(contents.revision), source)
    return contents
