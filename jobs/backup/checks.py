"""What a backup command answers (``Copied``, or one of its two errors) and what it
checks before it writes: the file it writes, the backup it is given (a regular file, of
the right kind), the backup's schema revision, and its schema objects against those the
migrations make."""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from core.errors import UnavailableError, UserError
from core.safe_text import redact_urls
from db.engine import forget
from db.migrate import head, known_revisions, upgrade

SQLITE_MAGIC = b"SQLite format 3\x00"
PG_DUMP_MAGIC = b"PGDMP"
# What a restore takes from a backup, said after each refusal of one that does not fit.
ROWS_ONLY = (
    "a restore takes only rows, into the tables posbench's migrations make, column for column"
)


class BackupRefused(UserError, ValueError):
    """Bad input (an out file that exists, a link, a file that is no posbench backup):
    one line saying why; nothing was written."""


class BackupFailed(UnavailableError, RuntimeError):
    """The database or a tool failed: one line saying why (every URL without its password)."""


@dataclass(frozen=True)
class Copied:
    """What a backup wrote or a restore put back: the file, its size, the schema revision
    (before migrating, for a restore) and the rows of each table where they were counted."""

    path: Path
    size: int
    revision: str | None
    rows: dict[str, int] = field(default_factory=dict)

    def describe(self) -> str:
        counted = ", ".join(f"{count:,} {table}" for table, count in self.rows.items())
        return f"{self.size:,} bytes" + (f"; {counted}" if counted else "")


def check_out(out: Path, *, force: bool) -> None:
    if out.is_symlink():
        raise BackupRefused(f"{out} is a symbolic link; posbench never writes through one")
    if out.exists() and not out.is_file():
        raise BackupRefused(f"{out} exists and is not a regular file")
    if out.exists() and not force:
        raise BackupRefused(f"{out} exists: give another --out, or --force to replace it")
    if not out.parent.is_dir():
        raise BackupRefused(f"no folder {out.parent} to write {out.name} in")


def first_bytes(source: Path) -> bytes:
    """The first bytes of the regular file ``source`` (BackupRefused for anything else)."""
    try:
        with opened(source) as handle:
            return handle.read(100)
    except OSError as err:
        raise BackupRefused(f"cannot read {source}: {err.strerror or err}") from None


@contextlib.contextmanager
def opened(source: Path):
    # O_NONBLOCK: a FIFO with no writer is refused at once instead of waited on.
    fd = os.open(source, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise BackupRefused(f"{source} is not a regular file")
    os.set_blocking(fd, True)
    with os.fdopen(fd, "rb") as handle:
        yield handle


def check_revision(revision: str | None, source: Path) -> None:
    if revision not in known_revisions():
        raise BackupRefused(
            f"{source} is at schema revision {revision!r}, which this posbench does not know "
            f"(its latest is {head()}): restore it with the posbench that wrote it"
        )


def sqlite_objects(connection: sqlite3.Connection) -> set[tuple[str, str]]:
    """(type, name) of every table, index, view and trigger a SQLite database defines
    (SQLite's own, sqlite_*, left out)."""
    rows = connection.execute("SELECT type, name FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'")
    return {(kind, name) for kind, name in rows}


_MIGRATED: dict[str, frozenset[tuple[str, str]]] = {}


def migrated_objects(revision: str | None) -> frozenset[tuple[str, str]]:
    """What posbench's migrations create, up to ``revision``: (type, name) of each table
    and index of a new SQLite database migrated there (made once per revision)."""
    key = revision or "base"
    if key not in _MIGRATED:
        folder = Path(tempfile.mkdtemp(prefix="posbench-schema-"))
        try:
            url = f"sqlite:///{folder / 'schema.db'}"
            if revision:
                upgrade(url, revision)
            forget(url)
            with contextlib.closing(sqlite3.connect(folder / "schema.db")) as connection:
                _MIGRATED[key] = frozenset(sqlite_objects(connection))
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    return _MIGRATED[key]


def refuse_foreign(extra: set[tuple[str, str]], source: Path) -> None:
    """Audit F5: a backup with a trigger restored fine, and the trigger rewrote results
    later. A restore now takes rows only and never runs the file's own objects; one the
    migrations did not create still says the file is no backup posbench wrote, so it is
    refused, named, rather than left out in silence."""
    if extra:
        shown = ", ".join(f"{kind} {name!r}" for kind, name in sorted(extra)[:3])
        more = f" and {len(extra) - 3} more" if len(extra) > 3 else ""
        raise BackupRefused(
            f"{source} holds schema objects posbench's migrations did not create ({shown}"
            f"{more}): triggers, views, tables and indexes of its own could rewrite or hide "
            "results; restore only a backup posbench wrote"
        )


def first_line(err: BaseException) -> str:
    text = str(getattr(err, "orig", None) or err).strip()
    return redact_urls(text.splitlines()[0]) if text else type(err).__name__
