"""`posbench db backup` and `posbench db restore`: a copy of the results database that
can be taken while workers write, and put back.

SQLite: the online backup API copies a consistent snapshot (WAL readers never wait for
the writer, and a writer never waits for the copy), into a new owner-only file renamed
over ``--out`` only once it is whole. A restore checks first that the file is a SQLite
database with posbench's schema at a revision these migrations know, copies it into
place the same way and migrates it to the latest schema. PostgreSQL: ``pg_dump
--format=custom`` and ``pg_restore`` when they are on PATH (the password goes to them in
PGPASSWORD, never on a command line anyone can list), and how to run them otherwise.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import sqlite3
import stat
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy.engine import make_url

from core.errors import UnavailableError, UserError
from core.files import private_folder, replacing
from core.safe_text import redact_url, redact_urls
from db.engine import SQLITE_BUSY_TIMEOUT_S, forget, normalize_url
from db.migrate import current, head, known_revisions, upgrade

SQLITE_MAGIC = b"SQLite format 3\x00"
PG_DUMP_MAGIC = b"PGDMP"
POSBENCH_TABLES = ("alembic_version", "studies", "runs", "evaluations")
COPY_CHUNK = 1 << 20


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


def backup(url: str, out: Path, *, force: bool = False) -> Copied:
    """Copy the database at ``url`` to ``out`` (owner-only, written whole): BackupRefused
    for an ``out`` that exists (unless ``force``), is a link or has no folder,
    BackupFailed when the database or pg_dump fails."""
    _check_out(out, force=force)
    if _is_sqlite(url):
        return _backup_sqlite(_sqlite_path(url), out)
    return _backup_postgres(url, out)


def restore(url: str, source: Path, *, force: bool = False) -> tuple[Copied, str]:
    """Put the backup ``source`` back as the database at ``url`` and migrate it to the
    latest schema: what was restored and the revision it is at now. BackupRefused for a
    file that is no posbench backup at a known revision, or a database that exists
    (unless ``force``); nothing is changed then."""
    header = _header(source)
    if _is_sqlite(url):
        if header.startswith(PG_DUMP_MAGIC):
            raise BackupRefused(
                f"{source} is a PostgreSQL dump: restore it with POSBENCH_DATABASE_URL "
                "set to a PostgreSQL database"
            )
        restored = _restore_sqlite(source, _sqlite_path(url), force=force)
        forget(url)
    else:
        if header.startswith(SQLITE_MAGIC):
            raise BackupRefused(
                f"{source} is a SQLite database: restore it with POSBENCH_DATABASE_URL "
                "set to a SQLite file (the default)"
            )
        if not header.startswith(PG_DUMP_MAGIC):
            raise BackupRefused(
                f"{source} is not a pg_dump --format=custom file (what posbench db backup "
                "writes; a plain SQL dump restores with psql)"
            )
        restored = _restore_postgres(url, source, force=force)
    try:
        upgrade(url)
    except Exception as err:
        raise BackupFailed(f"restored, but migrating it failed: {_line(err)}") from None
    return restored, current(url) or "none"


# -- SQLite ---------------------------------------------------------------------------------


def _is_sqlite(url: str) -> bool:
    return make_url(normalize_url(url)).get_backend_name() == "sqlite"


def _sqlite_path(url: str) -> Path:
    return Path(make_url(url).database or "").expanduser()


def _check_out(out: Path, *, force: bool) -> None:
    if out.is_symlink():
        raise BackupRefused(f"{out} is a symbolic link; posbench never writes through one")
    if out.exists() and not out.is_file():
        raise BackupRefused(f"{out} exists and is not a regular file")
    if out.exists() and not force:
        raise BackupRefused(f"{out} exists: give another --out, or --force to replace it")
    if not out.parent.is_dir():
        raise BackupRefused(f"no folder {out.parent} to write {out.name} in")


def _backup_sqlite(database: Path, out: Path) -> Copied:
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


def _header(source: Path) -> bytes:
    """The first bytes of the regular file ``source`` (BackupRefused for anything else)."""
    try:
        with _opened(source) as handle:
            return handle.read(100)
    except OSError as err:
        raise BackupRefused(f"cannot read {source}: {err.strerror or err}") from None


@contextlib.contextmanager
def _opened(source: Path):
    # O_NONBLOCK: a FIFO with no writer is refused at once instead of waited on.
    fd = os.open(source, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise BackupRefused(f"{source} is not a regular file")
    os.set_blocking(fd, True)
    with os.fdopen(fd, "rb") as handle:
        yield handle


def _restore_sqlite(source: Path, database: Path, *, force: bool) -> Copied:
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
    with replacing(database) as temporary:
        with _opened(source) as handle, temporary.open("wb") as copy:
            shutil.copyfileobj(handle, copy, COPY_CHUNK)
        restored = _checked(temporary, source)
        # The replaced database's write-ahead log and index belong to it, not to this one.
        for leftover in ("-wal", "-shm", "-journal"):
            database.with_name(database.name + leftover).unlink(missing_ok=True)
    return Copied(database, restored.size, restored.revision, restored.rows)


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
    _check_revision(contents.revision, source)
    connection = sqlite3.connect(_existing(copy), uri=True)
    try:
        objects = _sqlite_objects(connection)
    finally:
        connection.close()
    _refuse_foreign(objects - migrated_objects(contents.revision), source)
    return contents


def _sqlite_objects(connection: sqlite3.Connection) -> set[tuple[str, str]]:
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
                _MIGRATED[key] = frozenset(_sqlite_objects(connection))
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    return _MIGRATED[key]


def _refuse_foreign(extra: set[tuple[str, str]], source: Path) -> None:
    """Audit F5: a backup with a trigger restored fine, and the trigger rewrote results
    later. Whatever the migrations did not create is refused, named."""
    if extra:
        shown = ", ".join(f"{kind} {name!r}" for kind, name in sorted(extra)[:3])
        more = f" and {len(extra) - 3} more" if len(extra) > 3 else ""
        raise BackupRefused(
            f"{source} holds schema objects posbench's migrations did not create ({shown}"
            f"{more}): triggers, views, tables and indexes of its own could rewrite or hide "
            "results; restore only a backup posbench wrote"
        )


def _check_revision(revision: str | None, source: Path) -> None:
    if revision not in known_revisions():
        raise BackupRefused(
            f"{source} is at schema revision {revision!r}, which this posbench does not know "
            f"(its latest is {head()}): restore it with the posbench that wrote it"
        )


# -- PostgreSQL -----------------------------------------------------------------------------


def _libpq(url: str) -> tuple[str, dict[str, str]]:
    """``url`` as a libpq URI without its password, and the environment that carries the
    password to pg_dump / pg_restore (PGPASSWORD: not on a command line, which any user
    of the machine can list)."""
    parsed = make_url(normalize_url(url))
    query = dict(parsed.query)
    password = query.pop("password", None) or parsed.password
    # URL.set leaves a password given as None as it was: the tuple's own _replace drops it.
    plain = parsed.set(drivername="postgresql", query=query)._replace(password=None)
    env = dict(os.environ)
    if password:
        env["PGPASSWORD"] = str(password)
    return plain.render_as_string(hide_password=False), env


def _tool(name: str, guidance: str) -> str:
    found = shutil.which(name)
    if found is None:
        raise BackupRefused(f"{name} is not on PATH: {guidance}")
    return found


def _run(
    command: list[str], env: dict[str, str], what: str, failure: type[Exception] = BackupFailed
) -> str:
    """The tool's output; ``failure`` with its last line of errors when it fails."""
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
        reason = redact_urls(lines[-1]) if lines else f"exit status {done.returncode}"
        raise failure(f"{what} failed: {reason}")
    return done.stdout


def _backup_postgres(url: str, out: Path) -> Copied:
    pg_dump = _tool(
        "pg_dump",
        "install the PostgreSQL client tools (the server's version or newer), or run "
        f"`pg_dump --format=custom --file {out} 'postgresql://USER@HOST/DATABASE'` with "
        "the password in PGPASSWORD",
    )
    target, env = _libpq(url)
    with replacing(out) as temporary:
        _run(
            [
                pg_dump,
                "--format=custom",
                "--no-password",
                f"--file={temporary}",
                f"--dbname={target}",
            ],
            env,
            f"pg_dump of {redact_url(url)}",
        )
    return Copied(out, out.stat().st_size, None)


def _restore_postgres(url: str, source: Path, *, force: bool) -> Copied:
    pg_restore = _tool(
        "pg_restore",
        "install the PostgreSQL client tools, or run `pg_restore --no-owner "
        f"--single-transaction --dbname 'postgresql://USER@HOST/DATABASE' {source}` with the "
        "password in PGPASSWORD, then `posbench db upgrade`",
    )
    target, env = _libpq(url)
    # What the dump holds of alembic_version, read from the file before the database is
    # touched: a dump without it is no posbench database, and one at an unknown revision
    # cannot be migrated.
    listing = _run(
        [pg_restore, "--data-only", "--table=alembic_version", "--file=-", str(source)],
        env,
        f"reading {source}",
        BackupRefused,  # the file's fault: a damaged or foreign archive
    )
    found = re.search(r"^COPY \S*alembic_version .*;\n(\S+)\n", listing, re.M)
    if found is None:
        raise BackupRefused(f"{source} is not a posbench database (no alembic_version)")
    _check_revision(found[1], source)
    contents = _run([pg_restore, "--list", str(source)], env, f"reading {source}", BackupRefused)
    _refuse_foreign(_foreign_in_archive(contents, found[1]), source)
    try:
        existing = current(url)
    except Exception as err:
        raise BackupFailed(f"cannot reach the database {redact_url(url)}: {_line(err)}") from None
    if existing is not None and not force:
        raise BackupRefused(
            f"the database {redact_url(url)} already holds posbench's schema: stop posbench, "
            "or pass --force to replace its contents"
        )
    forget(url)  # its pooled connections would hold locks pg_restore --clean waits on
    command = [pg_restore, "--no-owner", "--no-password", "--single-transaction"]
    command += ["--clean", "--if-exists"] if existing is not None else []
    _run([*command, f"--dbname={target}", str(source)], env, f"pg_restore into {redact_url(url)}")
    return Copied(source, source.stat().st_size, found[1])


# What a dump of posbench's schema holds besides its tables and indexes: their data,
# the sequences behind integer keys, defaults and constraints (of posbench's tables).
_ARCHIVE_KINDS = {
    "TABLE",
    "TABLE DATA",
    "VIEW",
    "INDEX",
    "SEQUENCE",
    "SEQUENCE OWNED BY",
    "SEQUENCE SET",
    "DEFAULT",
    "CONSTRAINT",
    "FK CONSTRAINT",
    "SCHEMA",
    "COMMENT",
}


def _foreign_in_archive(listing: str, revision: str) -> set[tuple[str, str]]:
    """The entries of ``pg_restore --list`` that posbench's migrations did not create:
    any kind but the above (TRIGGER, FUNCTION, VIEW, RULE, POLICY, ...), a table or an
    index of another name, and a constraint of another table."""
    migrated = migrated_objects(revision)
    tables = {name for kind, name in migrated if kind == "table"}
    indexes = {name for kind, name in migrated if kind == "index"}
    views = {name for kind, name in migrated if kind == "view"}
    kinds = sorted(_ARCHIVE_KINDS, key=len, reverse=True)  # "TABLE DATA" before "TABLE"
    foreign: set[tuple[str, str]] = set()
    for line in listing.splitlines():
        # "215; 1259 16386 TABLE public runs posbench": id; catalog oid, KIND schema NAME owner
        entry = re.match(r"^\d+; \d+ \d+ (.+)$", line)
        if entry is None:
            continue
        rest = entry[1]
        kind = next((k for k in kinds if rest.startswith(k + " ")), None)
        if kind is None:
            foreign.add((rest.split()[0].lower(), " ".join(rest.split()[1:-1])))
            continue
        words = rest[len(kind) :].split()  # schema, the name (for a constraint: its table
        name = words[1] if len(words) > 2 else ""  # first), owner
        if kind in ("TABLE", "TABLE DATA", "CONSTRAINT", "FK CONSTRAINT") and name not in tables:
            foreign.add((kind.lower(), " ".join(words[1:-1])))
        elif kind == "INDEX" and name not in indexes:
            foreign.add(("index", name))
        elif kind == "VIEW" and name not in views:
            foreign.add(("view", name))
    return foreign


def _line(err: BaseException) -> str:
    text = str(getattr(err, "orig", None) or err).strip()
    return redact_urls(text.splitlines()[0]) if text else type(err).__name__
