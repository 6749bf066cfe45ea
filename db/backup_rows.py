"""A backup's rows, loaded into a schema posbench's migrations made.

`posbench db restore` never adopts the schema a backup file carries. Its views, triggers,
indexes and table definitions are the file's word for what the database is: a view made
again under its own name (``1.0 AS mean``, without the deleted-study filter) or a table
made again with another default, a CHECK less or a computed column would have rewritten
or hidden results from then on (the fourth audit's F5 residue). So the schema comes from
the migrations, up to the backup's revision, and the file gives its rows only: table by
table, column by name, into the tables the migrations made, under their constraints and
foreign keys. A table whose columns are not the migrations' is refused.
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Collection, Iterable, Iterator
from pathlib import Path

from sqlalchemy import Connection, inspect, text

from core.errors import UserError


class RowsRefused(UserError, ValueError):
    """A backup whose rows do not fit the tables the migrations make: what differs, in
    words that follow the file's name ("its table runs has ...")."""


def _differences(table: str, theirs: list[str], ours: list[str]) -> None:
    """RowsRefused unless the backup's columns of ``table`` are the migrations' own, each
    once (the order may differ: rows are copied column by name)."""
    doubled = sorted({name for name in theirs if theirs.count(name) > 1})
    if doubled:
        raise RowsRefused(f"its table {table} names a column twice ({_listed(doubled)})")
    extra = [name for name in theirs if name not in ours]
    lacking = [name for name in ours if name not in theirs]
    found = []
    if extra:
        found.append(f"has columns posbench's {table} does not ({_listed(extra)})")
    if lacking:
        found.append(f"lacks columns posbench's {table} has ({_listed(lacking)})")
    if found:
        raise RowsRefused(f"its table {table} " + " and ".join(found))


def _listed(names: list[str]) -> str:
    shown = ", ".join(repr(name) for name in names[:5])
    return shown + (f" and {len(names) - 5} more" if len(names) > 5 else "")


# -- SQLite ---------------------------------------------------------------------------------


def copy_sqlite(fresh: Path, backup: Path) -> dict[str, int]:
    """Copy into ``fresh``, a new database the migrations made at the backup's revision,
    the rows of each of its tables (alembic_version is the migrations' own) from the
    SQLite file ``backup``, opened read-only; the rows copied per table. RowsRefused when
    the backup's table is not a plain table with the same columns, or when a row breaks
    a constraint or a foreign key of the migrations' schema; ``fresh`` is then left as
    it may be, for the caller to throw away."""
    connection = sqlite3.connect(_uri(fresh, "rw"), uri=True, isolation_level=None)
    try:
        # Off while the tables fill one by one, in any order; checked as a whole below.
        connection.execute("PRAGMA foreign_keys = OFF")
        # immutable: a private copy nobody writes, read without locks or a journal.
        connection.execute("ATTACH DATABASE ? AS backup", (_uri(backup, "ro") + "&immutable=1",))
        tables = [
            name
            for (name,) in connection.execute(
                "SELECT name FROM main.sqlite_master WHERE type = 'table' "
                "AND name NOT LIKE 'sqlite_%' AND name != 'alembic_version' ORDER BY name"
            )
        ]
        columns = {table: _sqlite_columns(connection, table) for table in tables}
        connection.execute("BEGIN IMMEDIATE")
        rows = {table: _copy_table(connection, table, columns[table]) for table in tables}
        _check_references(connection)
        connection.execute("COMMIT")
        connection.execute("DETACH DATABASE backup")
        connection.execute("PRAGMA journal_mode = DELETE")  # one self-contained file
    finally:
        connection.close()
    return rows


def _uri(path: Path, mode: str) -> str:
    return f"{path.resolve().as_uri()}?mode={mode}"


def _sqlite_columns(connection: sqlite3.Connection, table: str) -> list[str]:
    """The columns of the migrations' ``table``, once the backup's table of that name is
    checked to be a plain table with the same ones."""
    found = connection.execute(
        "SELECT type, sql FROM backup.sqlite_master WHERE name = ?", (table,)
    ).fetchone()
    if found is None:
        raise RowsRefused(f"it has no table {table}, which posbench's migrations make")
    kind, definition = found
    if kind != "table":
        raise RowsRefused(f"its {table} is a {kind}, not a table")
    if re.match(r"\s*CREATE\s+VIRTUAL\b", definition or "", re.IGNORECASE):
        raise RowsRefused(f"its {table} is a virtual table, not a table")
    theirs = connection.execute(
        "SELECT name, hidden FROM pragma_table_xinfo(?, 'backup')", (table,)
    ).fetchall()
    computed = [name for name, hidden in theirs if hidden]
    if computed:
        raise RowsRefused(
            f"its table {table} computes columns instead of storing them ({_listed(computed)})"
        )
    ours = [
        name
        for (name,) in connection.execute(
            "SELECT name FROM pragma_table_xinfo(?, 'main') WHERE hidden = 0", (table,)
        )
    ]
    _differences(table, [name for name, _ in theirs], ours)
    return ours


def _copy_table(connection: sqlite3.Connection, table: str, columns: list[str]) -> int:
    named, quoted = ", ".join(_quoted(column) for column in columns), _quoted(table)
    try:
        cursor = connection.execute(
            f"INSERT INTO main.{quoted} ({named}) SELECT {named} FROM backup.{quoted}"
        )
    except sqlite3.IntegrityError as err:
        raise RowsRefused(f"a row of its table {table} breaks posbench's schema ({err})") from None
    return cursor.rowcount


def _quoted(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _check_references(connection: sqlite3.Connection) -> None:
    broken = connection.execute("PRAGMA main.foreign_key_check").fetchone()
    if broken is not None:
        table, rowid, parent, _ = broken
        raise RowsRefused(
            f"a row of its table {table} (rowid {rowid}) refers to a row of {parent} "
            "that it does not hold"
        )


# -- PostgreSQL -----------------------------------------------------------------------------

_DROP = {"r": "TABLE", "p": "TABLE", "v": "VIEW", "m": "MATERIALIZED VIEW", "f": "FOREIGN TABLE"}


def postgres_relations(connection: Connection, names: Collection[str]) -> dict[str, str]:
    """Which of ``names`` the connection's current schema holds as a table or a view (any
    kind of either), with the kind ``pg_class.relkind`` gives it."""
    found = connection.execute(
        text(
            "SELECT c.relname, c.relkind FROM pg_class c "
            "JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = current_schema() AND c.relname = ANY(:names) "
            "AND c.relkind IN ('r', 'p', 'v', 'm', 'f')"
        ),
        {"names": sorted(names)},
    )
    return {name: kind for name, kind in found}


def drop_relations(connection: Connection, relations: dict[str, str]) -> None:
    """Drop the tables and views ``postgres_relations`` found, with whatever depends on
    them (CASCADE), in the caller's transaction."""
    quote = connection.dialect.identifier_preparer.quote_identifier
    for name, kind in sorted(relations.items()):
        connection.exec_driver_sql(f"DROP {_DROP[kind]} IF EXISTS {quote(name)} CASCADE")


def load_order(connection: Connection, tables: Collection[str]) -> list[str]:
    """``tables`` with each after the tables its foreign keys refer to (a table that
    refers to itself is checked at the end of its COPY)."""
    ordered = inspect(connection).get_sorted_table_and_fkc_names()
    return [name for name, _ in ordered if name in tables]


def load_postgres(
    connection: Connection, schema: str, tables: Collection[str], archive: Iterable[bytes]
) -> dict[str, int]:
    """Load, in the caller's transaction, the rows of ``archive`` (the lines ``pg_restore
    --data-only --file=-`` writes, streamed) into ``tables`` of the connection's schema,
    which the migrations made: the rows per table. Only the COPY blocks are read, each
    into one of ``tables`` (of the archive's ``schema``) with exactly its columns, once;
    any other COPY is refused, and nothing else in the archive (SET, setval) is run.
    Then each serial or identity sequence of ``tables`` goes past its largest key.
    RowsRefused for a block or a row that does not fit; the caller rolls back."""
    from psycopg import errors, sql

    raw = connection.connection.driver_connection
    assert raw is not None, "a PostgreSQL connection"
    columns = {table: _postgres_columns(connection, table) for table in tables}
    rows: dict[str, int] = {}
    lines = iter(archive)
    for line in lines:
        encoding = re.match(rb"SET client_encoding = '([^']*)';", line)
        if encoding and encoding[1].upper().replace(b"-", b"") != b"UTF8":
            named = encoding[1].decode(errors="replace")
            raise RowsRefused(f"its rows are encoded {named}, not UTF8 as posbench's database")
        if not line.startswith(b"COPY "):
            continue
        table, named = _copy_target(line, schema, columns, rows)
        statement = sql.SQL("COPY {} ({}) FROM STDIN").format(
            sql.Identifier(table), sql.SQL(", ").join(map(sql.Identifier, named))
        )
        try:
            with raw.cursor() as cursor:
                with cursor.copy(statement) as copy:
                    _copy_block(copy, lines, table)
                rows[table] = cursor.rowcount
        except (errors.IntegrityError, errors.DataError) as err:
            reason = str(err).strip().splitlines()[0]
            raise RowsRefused(
                f"a row of its table {table} breaks posbench's schema ({reason})"
            ) from None
    missing = [table for table in tables if table not in rows]
    if missing:
        raise RowsRefused(
            f"it holds no rows of table {missing[0]}, which posbench's migrations make"
        )
    _advance_sequences(connection, tables)
    return {table: rows[table] for table in sorted(rows)}


def _postgres_columns(connection: Connection, table: str) -> list[str]:
    """The stored columns of the migrations' ``table`` (not dropped, not computed)."""
    quote = connection.dialect.identifier_preparer.quote_identifier
    found = connection.execute(
        text(
            "SELECT attname FROM pg_attribute WHERE attrelid = CAST(:table AS regclass) "
            "AND attnum > 0 AND NOT attisdropped AND attgenerated = '' ORDER BY attnum"
        ),
        {"table": quote(table)},
    )
    return list(found.scalars())


# An identifier as pg_dump writes it: bare (already lower case) or in double quotes.
_IDENTIFIER = rb'"(?:[^"]|"")+"|[a-z_][a-z0-9_$]*'
_COPY = re.compile(
    rb"COPY (?P<schema>%s)\.(?P<table>%s) \((?P<columns>.*)\) FROM stdin;\r?\n?"
    % (_IDENTIFIER, _IDENTIFIER)
)
_COLUMNS = re.compile(rb"(?:%s)(?:, (?:%s))*" % (_IDENTIFIER, _IDENTIFIER))


def _copy_target(
    line: bytes, schema: str, columns: dict[str, list[str]], loaded: Collection[str]
) -> tuple[str, list[str]]:
    """The table and the columns (in the block's order) a COPY line loads, once each is
    checked to be one of ``columns``' tables with exactly its columns."""
    found = _COPY.fullmatch(line)
    if found is None or not _COLUMNS.fullmatch(found["columns"]):
        raise RowsRefused("it holds a COPY line posbench cannot read")
    where, table = _name(found["schema"]), _name(found["table"])
    if where != schema or table not in columns:
        raise RowsRefused(
            f"it copies rows into {where}.{table}, a table posbench's migrations do not make"
        )
    if table in loaded:
        raise RowsRefused(f"it copies rows into its table {table} twice")
    named = [_name(word) for word in re.findall(_IDENTIFIER, found["columns"])]
    _differences(table, named, columns[table])
    return table, named


def _name(identifier: bytes) -> str:
    word = identifier.decode("utf-8", errors="replace")
    return word[1:-1].replace('""', '"') if word.startswith('"') else word


def _copy_block(copy, lines: Iterator[bytes], table: str) -> None:
    """Send the block's lines (COPY's text format, as pg_restore wrote them) up to its
    end-of-data mark."""
    for line in lines:
        if line.rstrip(b"\r\n") == rb"\.":
            return
        copy.write(line)
    raise RowsRefused(f"its rows of table {table} end before their end-of-data mark")


def _advance_sequences(connection: Connection, tables: Collection[str]) -> None:
    """Set the sequence behind each serial or identity column of ``tables`` to its
    column's largest value (the next row takes the one after), or to start at 1 for an
    empty table: the archive's own setval lines are never run."""
    quote = connection.dialect.identifier_preparer.quote_identifier
    found = connection.execute(
        text(
            "SELECT c.relname, a.attname, pg_get_serial_sequence(quote_ident(c.relname), "
            "a.attname) FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid "
            "JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = current_schema() AND c.relname = ANY(:tables) "
            "AND a.attnum > 0 AND NOT a.attisdropped"
        ),
        {"tables": sorted(tables)},
    )
    for table, column, sequence in found:
        if sequence is None:
            continue
        connection.execute(
            text(
                f"SELECT setval(CAST(:sequence AS regclass), COALESCE(MAX({quote(column)}), 1), "
                f"MAX({quote(column)}) IS NOT NULL) FROM {quote(table)}"
            ),
            {"sequence": sequence},
        )
