"""`posbench db backup` and `posbench db restore` on PostgreSQL: ``pg_dump
--format=custom`` for the one; for the other, the dump's rows read with ``pg_restore
--data-only`` into the tables the migrations make, in one transaction on the database.
The password goes to the tools in PGPASSWORD, never on a command line anyone can list."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError

from core.files import replacing
from core.safe_text import redact_url, redact_urls
from db.backup_rows import (
    RowsRefused,
    drop_relations,
    load_order,
    load_postgres,
    postgres_relations,
)
from db.engine import engine_for, normalize_url
from db.migrate import DatabaseEncodingError, check_encoding, head, upgrade_in
from jobs.backup.checks import (
    ROWS_ONLY,
    BackupFailed,
    BackupRefused,
    Copied,
    check_revision,
    first_line,
    migrated_objects,
    refuse_foreign,
)


def libpq(url: str) -> tuple[str, dict[str, str]]:
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


def backup_postgres(url: str, out: Path) -> Copied:
    pg_dump = _tool(
        "pg_dump",
        "install the PostgreSQL client tools (the server's version or newer), or run "
        f"`pg_dump --format=custom --file {out} 'postgresql://USER@HOST/DATABASE'` with "
        "the password in PGPASSWORD",
    )
    target, env = libpq(url)
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


def restore_postgres(url: str, source: Path, *, force: bool) -> Copied:
    """Replace posbench's schema in the database at ``url`` (refused while it holds one,
    unless ``force``) with the migrations' own at the dump's revision, holding the dump's
    rows, then migrate it to the latest: one transaction, so a refusal or a failure half
    way changes nothing."""
    import psycopg  # its errors: the rows go in through the driver's COPY

    pg_restore = _tool(
        "pg_restore",
        "install the PostgreSQL client tools (posbench reads the dump's rows with it); only "
        "for a dump you made yourself and trust as it stands, `pg_restore --no-owner "
        f"--single-transaction --dbname 'postgresql://USER@HOST/DATABASE' {source}` with the "
        "password in PGPASSWORD, then `posbench db upgrade`, takes its schema as it is",
    )
    _, env = libpq(url)
    # What the dump holds, read from the file before the database is touched: its
    # alembic_version (without it, no posbench database; at an unknown revision, one that
    # cannot be migrated) and its table of contents.
    listing = _run(
        [pg_restore, "--data-only", "--table=alembic_version", "--file=-", str(source)],
        env,
        f"reading {source}",
        BackupRefused,  # the file's fault: a damaged or foreign archive
    )
    found = re.search(r"^COPY \S*alembic_version .*;\n(\S+)\n", listing, re.M)
    if found is None:
        raise BackupRefused(f"{source} is not a posbench database (no alembic_version)")
    revision = found[1]
    check_revision(revision, source)
    contents = _run([pg_restore, "--list", str(source)], env, f"reading {source}", BackupRefused)
    refuse_foreign(_foreign_in_archive(contents, revision), source)
    tables = _migrated_tables(revision)
    schema, entries = _table_data(contents, tables, source)
    engine = engine_for(normalize_url(url))
    try:
        check_encoding(engine)
        with engine.begin() as connection:  # one transaction: all of it, or nothing
            existing = postgres_relations(connection, _posbench_relations(revision))
            if existing and not force:
                raise BackupRefused(
                    f"the database {redact_url(url)} already holds posbench's schema: stop "
                    "posbench, or pass --force to replace its contents"
                )
            drop_relations(connection, existing)
            upgrade_in(connection, revision)
            order = load_order(connection, tables)
            with _archive_rows(pg_restore, source, [entries[t] for t in order], env) as lines:
                rows = load_postgres(connection, schema, order, lines)
            upgrade_in(connection, "head")
    except RowsRefused as err:
        raise BackupRefused(f"{source}: {err}; {ROWS_ONLY}") from None
    except (SQLAlchemyError, psycopg.Error, DatabaseEncodingError) as err:
        target = redact_url(url)
        raise BackupFailed(
            f"restoring {source} into {target} failed, and changed nothing: {first_line(err)}"
        ) from None
    return Copied(source, source.stat().st_size, revision, rows)


def _migrated_tables(revision: str) -> set[str]:
    """The tables the migrations make up to ``revision`` whose rows a backup gives (not
    alembic_version: the migrations write it)."""
    made = migrated_objects(revision)
    return {name for kind, name in made if kind == "table"} - {"alembic_version"}


def _posbench_relations(revision: str) -> set[str]:
    """The tables and views of posbench's a database may hold, whatever revision it is
    at: those of the latest schema and of the backup's (the migrations rename none)."""
    made = migrated_objects(head()) | migrated_objects(revision)
    return {name for kind, name in made if kind in ("table", "view")}


def _table_data(listing: str, tables: set[str], source: Path) -> tuple[str, dict[str, str]]:
    """The schema of the dump's posbench tables and the ``pg_restore --list`` line of each
    table's rows (TABLE DATA); BackupRefused for rows of any other table, or none for one
    of ``tables``."""
    entries: dict[str, str] = {}
    schemas: set[str] = set()
    for line in listing.splitlines():
        # "2656; 0 16409 TABLE DATA public runs posbench": id; oids, schema, name, owner
        entry = re.match(r"^\d+; \d+ \d+ TABLE DATA (\S+) (\S+)", line)
        if entry is None:
            continue
        schema, table = entry[1], entry[2]
        known = table in tables or table == "alembic_version"
        if not known or table in entries:
            raise BackupRefused(
                f"{source} holds rows of table {schema}.{table}, which posbench's migrations "
                f"do not make; {ROWS_ONLY}"
            )
        schemas.add(schema)
        if table != "alembic_version":
            entries[table] = line
    missing = sorted(tables - set(entries))
    if missing:
        raise BackupRefused(f"{source} holds no rows of table {missing[0]}; {ROWS_ONLY}")
    if len(schemas) != 1:
        raise BackupRefused(f"{source} holds posbench's tables in several schemas; {ROWS_ONLY}")
    return schemas.pop(), entries


@contextlib.contextmanager
def _archive_rows(
    pg_restore: str, source: Path, entries: list[str], env: dict[str, str]
) -> Iterator[IO[bytes]]:
    """The lines ``pg_restore --data-only`` writes for ``entries`` (lines of its --list),
    in that order, as it writes them; BackupRefused when it fails."""
    with tempfile.TemporaryDirectory(prefix="posbench-restore-") as folder:
        use_list = Path(folder) / "rows.list"
        use_list.write_text("".join(entry + "\n" for entry in entries))
        with (Path(folder) / "errors").open("w+b") as errors:
            command = [pg_restore, "--data-only", f"--use-list={use_list}", "--file=-"]
            process = subprocess.Popen(
                [*command, str(source)], env=env, stdout=subprocess.PIPE, stderr=errors
            )
            assert process.stdout is not None
            try:
                yield process.stdout
                process.stdout.read()  # whatever follows the last block, to its end
            except BaseException:
                process.kill()  # refused half-way: the rest is not needed
                raise
            finally:
                process.stdout.close()
                process.wait()
            if process.returncode != 0:
                errors.seek(0)
                written = errors.read().decode(errors="replace").splitlines()
                lines = [line for line in written if line.strip()]
                reason = redact_urls(lines[-1]) if lines else f"exit status {process.returncode}"
                raise BackupRefused(f"reading {source} failed: {reason}")


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
