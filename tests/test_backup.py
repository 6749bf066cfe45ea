"""`posbench db backup` and `posbench db restore` on SQLite: a backup taken while another
connection writes holds what was committed when it began, restores to the same rows
after the original is gone, and every refusal exits 2 with one line and writes nothing."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import pytest
from conftest import isolated_env, posbench_cli
from dashboard_seed import seed_study
from test_audit import finish_every_run

from core.settings import Settings
from db import queries
from db.engine import forget, transaction
from db.migrate import head, upgrade
from db.models import RunSummary
from db.upsert import upsert
from jobs.backup.postgres import libpq
from jobs.retention import delete_study

PASSWORD = "pw-never-shown"


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """A home whose database holds the seeded study 1 (finished, running and failed runs,
    curves, summaries, training points)."""
    home = tmp_path / "home"
    settings = Settings(home=home)
    upgrade(settings.database)
    assert seed_study(settings) == 1
    return home


def database(path: Path) -> contextlib.closing[sqlite3.Connection]:
    """A plain connection to a SQLite file, committed and closed when the block ends."""
    return contextlib.closing(sqlite3.connect(path, isolation_level=None, timeout=30))


def url_of(home: Path) -> str:
    return Settings(home=home).database


def cli(home: Path, *args: str, **extra: str):
    return posbench_cli(*args, env=isolated_env(home, COLUMNS="300", **extra), timeout=60)


def refused(done, *words: str) -> None:
    """Exit 2 with one line on stderr saying why."""
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    for word in words:
        assert word in lines[0], lines[0]


def contents(url: str) -> dict[str, pd.DataFrame]:
    """What a user reads back: the studies, runs, curves, summaries and training points."""
    runs = queries.runs(url)
    return {
        "studies": queries.studies(url),
        "runs": runs,
        "curves": queries.curves(url, study_ids=[1]),
        "summaries": queries.run_summaries(url, study_ids=[1]),
        "train_points": queries.train_points(url, runs.id.tolist()),
    }


def assert_same(before: dict[str, pd.DataFrame], after: dict[str, pd.DataFrame]) -> None:
    for name, frame in before.items():
        assert not frame.empty, name
        pd.testing.assert_frame_equal(frame, after[name], obj=name)


def remove_database(home: Path) -> None:
    """The original gone: the file, its write-ahead log and index, and this process'
    pooled connections to it."""
    forget(url_of(home))
    for name in ("posbench.db", "posbench.db-wal", "posbench.db-shm"):
        (home / name).unlink(missing_ok=True)


def private(path: Path) -> bool:
    return stat.S_IMODE(path.stat().st_mode) == 0o600


@pytest.mark.slow
def test_a_backup_during_an_open_write_transaction_restores_what_was_committed(
    home: Path, tmp_path: Path
) -> None:
    url = url_of(home)
    before = contents(url)
    writer = sqlite3.connect(home / "posbench.db", isolation_level=None)
    writer.execute("BEGIN IMMEDIATE")  # holds the write lock through the backup
    writer.execute("UPDATE studies SET name = 'not committed yet'")
    writer.execute("DELETE FROM train_points")
    out = tmp_path / "posbench-backup.db"
    try:
        done = cli(home, "db", "backup", "--out", str(out))
    finally:
        writer.execute("COMMIT")
        writer.close()
    assert done.returncode == 0, done.stderr
    assert f"(schema {head()}) to {out}" in done.stdout
    assert "1 studies" in done.stdout and "6 runs" in done.stdout
    assert private(out)
    assert queries.studies(url).name.tolist() == ["not committed yet"]  # the write went on

    remove_database(home)
    done = cli(home, "db", "restore", str(out))
    assert done.returncode == 0, done.stderr
    assert f"now at {head()}" in done.stdout
    assert_same(before, contents(url))
    assert private(home / "posbench.db")


@pytest.mark.slow
def test_a_backup_while_a_writer_commits_is_one_consistent_snapshot(
    home: Path, tmp_path: Path
) -> None:
    """Short transactions commit throughout the backup: the copy holds all the rows of a
    moment between its start and its end, never half a transaction."""
    url = url_of(home)
    stop = threading.Event()
    written = [0]

    def write() -> None:
        step = 1000
        with database(home / "posbench.db") as connection:
            while not stop.is_set():
                step += 1
                connection.execute("BEGIN IMMEDIATE")
                for sign in (1, -1):  # two rows a transaction: an odd count is half of one
                    connection.execute(
                        "INSERT INTO train_points (run_id, step, loss, lr, tokens_per_second, "
                        "elapsed) VALUES (1, ?, 1.0, 0.001, 1.0, 1.0)",
                        (sign * step,),
                    )
                connection.execute("COMMIT")
                written[0] += 2
                time.sleep(0.001)

    with database(home / "posbench.db") as connection:
        at_start = connection.execute("SELECT COUNT(*) FROM train_points").fetchone()[0]
    writer = threading.Thread(target=write)
    writer.start()
    out = tmp_path / "during.db"
    try:
        while written[0] < 10:
            time.sleep(0.01)
        done = cli(home, "db", "backup", "--out", str(out))
    finally:
        stop.set()
        writer.join()
    assert done.returncode == 0, done.stderr
    with database(out) as copy:
        assert copy.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        copied = copy.execute("SELECT COUNT(*) FROM train_points").fetchone()[0]
    assert at_start < copied <= at_start + written[0] and (copied - at_start) % 2 == 0
    remove_database(home)
    assert cli(home, "db", "restore", str(out)).returncode == 0
    assert len(queries.train_points(url, queries.runs(url).id.tolist())) > 0


def test_restore_force_replaces_a_changed_database_and_its_write_ahead_log(
    home: Path, tmp_path: Path
) -> None:
    """The database changed since the backup, and the change is still in its write-ahead
    log (a process died before a checkpoint): the restore must not let that log replay
    over the restored file."""
    url = url_of(home)
    before = contents(url)
    out = tmp_path / "backup.db"
    assert cli(home, "db", "backup", "--out", str(out)).returncode == 0
    forget(url)  # posbench stopped
    died = subprocess.run(
        [sys.executable, "-c", DIES_AFTER_A_COMMIT, str(home / "posbench.db")], timeout=30
    )
    assert died.returncode == 0 and (home / "posbench.db-wal").stat().st_size > 0
    refused(cli(home, "db", "restore", str(out)), "posbench.db exists", "--force")
    done = cli(home, "db", "restore", str(out), "--force")
    assert done.returncode == 0, done.stderr
    assert_same(before, contents(url))


DIES_AFTER_A_COMMIT = """
import os, sqlite3, sys
connection = sqlite3.connect(sys.argv[1], isolation_level=None)
connection.execute("PRAGMA journal_mode=WAL")
connection.execute("PRAGMA wal_autocheckpoint=0")
connection.execute("DELETE FROM evaluations")
os._exit(0)  # no close, no checkpoint: the deletion lives in the -wal file only
"""


@pytest.mark.parametrize("case", ["exists", "link", "no folder", "a folder"])
def test_backup_refuses_an_out_it_must_not_write(home: Path, tmp_path: Path, case: str) -> None:
    out = tmp_path / "backup.db"
    target = tmp_path / "precious.txt"
    target.write_text("mine")
    args: list[str] = []
    if case == "exists":
        out.write_text("an earlier backup")
        expected = ("backup.db exists", "--force")
    elif case == "link":
        out.symlink_to(target)
        args, expected = ["--force"], ("backup.db is a symbolic link",)
    elif case == "no folder":
        out = tmp_path / "missing" / "backup.db"
        expected = (f"no folder {out.parent}",)
    else:
        out.mkdir()
        args, expected = ["--force"], ("backup.db exists and is not a regular file",)
    listed = sorted(p.name for p in tmp_path.iterdir())
    refused(cli(home, "db", "backup", "--out", str(out), *args), *expected)
    assert sorted(p.name for p in tmp_path.iterdir()) == listed  # nothing written
    assert target.read_text() == "mine"
    assert {
        "exists": lambda: out.read_text() == "an earlier backup",
        "link": lambda: out.is_symlink(),
        "no folder": lambda: not out.parent.exists(),
        "a folder": lambda: out.is_dir() and not any(out.iterdir()),
    }[case](), f"{out} changed"


def test_backup_force_replaces_an_earlier_backup_owner_only(home: Path, tmp_path: Path) -> None:
    out = tmp_path / "backup.db"
    out.write_text("an earlier backup")
    out.chmod(0o644)
    old = os.umask(0o022)
    try:
        done = cli(home, "db", "backup", "--out", str(out), "--force")
    finally:
        os.umask(old)
    assert done.returncode == 0, done.stderr
    assert out.read_bytes().startswith(b"SQLite format 3\x00") and private(out)


def test_backup_of_no_database_says_so(tmp_path: Path) -> None:
    done = cli(tmp_path / "home", "db", "backup", "--out", str(tmp_path / "b.db"))
    assert done.returncode == 1 and "nothing to back up" in done.stderr
    assert not (tmp_path / "b.db").exists() and not (tmp_path / "home").exists()


def _backup_at(home: Path, tmp_path: Path, revision: str) -> Path:
    out = tmp_path / f"at-{revision}.db"
    assert cli(home, "db", "backup", "--out", str(out)).returncode == 0
    with database(out) as connection:
        connection.execute("UPDATE alembic_version SET version_num = ?", (revision,))
    return out


def _plain_sqlite(tmp_path: Path) -> Path:
    path = tmp_path / "other.db"
    with database(path) as connection:
        connection.execute("CREATE TABLE notes (text TEXT)")
    return path


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda home, tmp: tmp / "missing.db", ("cannot read", "missing.db")),
        (lambda home, tmp: _text(tmp), ("notes.txt is not a SQLite database",)),
        (lambda home, tmp: _fifo(tmp), ("pipe is not a regular file",)),
        (lambda home, tmp: _plain_sqlite(tmp), ("not a posbench database (no table alembic",)),
        (
            lambda home, tmp: _backup_at(home, tmp, "f00d"),
            ("schema revision 'f00d', which this posbench does not know", "the posbench that"),
        ),
        (lambda home, tmp: _pg_dump(tmp), ("is a PostgreSQL dump",)),
        (  # audit F5: it restored, and later rewrote imported perplexities to 1.0
            lambda home, tmp: _planted(home, tmp, PLANTED_TRIGGER),
            ("schema objects posbench's migrations did not create (trigger 'rewrite')",),
        ),
        (
            lambda home, tmp: _planted(home, tmp, "CREATE VIEW shown AS SELECT 1"),
            ("(view 'shown')",),
        ),
        (
            lambda home, tmp: _planted(
                home, tmp, "CREATE TABLE notes (x); CREATE INDEX n ON notes (x)"
            ),
            ("(index 'n', table 'notes')",),
        ),
        (  # the F5 residue: tables made again under their own names, rows that do not fit
            lambda home, tmp: _planted(
                home, tmp, "ALTER TABLE evaluations ADD COLUMN planted DOUBLE DEFAULT 1.0"
            ),
            (
                "its table evaluations has columns posbench's evaluations does not ('planted')",
                "a restore takes only rows, into the tables posbench's migrations make",
            ),
        ),
        (
            lambda home, tmp: _planted(home, tmp, "ALTER TABLE runs DROP COLUMN imported_from"),
            ("its table runs lacks columns posbench's runs has ('imported_from')",),
        ),
        (
            lambda home, tmp: _planted(
                home, tmp, remade_summaries("GENERATED ALWAYS AS (1.0) VIRTUAL")
            ),
            ("its table run_summaries computes columns instead of storing them ('value')",),
        ),
        (
            lambda home, tmp: _planted(home, tmp, "DELETE FROM studies"),
            ("a row of its table runs (rowid 1) refers to a row of studies that it does not",),
        ),
    ],
    ids=[
        "missing",
        "text",
        "fifo",
        "other schema",
        "unknown revision",
        "postgres dump",
        "trigger",
        "view",
        "table and index",
        "extra column",
        "missing column",
        "computed column",
        "dangling reference",
    ],
)
def test_restore_refuses_what_is_no_posbench_backup_and_writes_nothing(
    home: Path, tmp_path: Path, make, expected: tuple[str, ...]
) -> None:
    source = make(home, tmp_path)
    remove_database(home)
    done = cli(home, "db", "restore", str(source))
    refused(done, *expected)
    assert list(home.iterdir()) == []  # no database, no half copy


PLANTED_TRIGGER = (
    "CREATE TRIGGER rewrite AFTER INSERT ON evaluations BEGIN "
    "UPDATE evaluations SET perplexity = 1.0 WHERE id = NEW.id; END"
)


def remade_summaries(value: str) -> str:
    """SQL that makes run_summaries again under its own name, without its unique key and
    with ``value`` for the definition of its value column (its rows kept, their values
    too unless the column is computed). legacy_alter_table: the rename leaves the view
    that reads the table alone."""
    columns = "id, run_id, variant, protocol, name" + ("" if "GENERATED" in value else ", value")
    return f"""
        PRAGMA legacy_alter_table = ON;
        CREATE TABLE remade (id INTEGER NOT NULL PRIMARY KEY,
            run_id INTEGER NOT NULL REFERENCES runs (id), variant VARCHAR(120) NOT NULL,
            protocol VARCHAR(20) NOT NULL, name VARCHAR(40) NOT NULL, value DOUBLE {value});
        INSERT INTO remade ({columns}) SELECT {columns} FROM run_summaries;
        DROP TABLE run_summaries;
        ALTER TABLE remade RENAME TO run_summaries;
    """


# encoding_summaries made again under its own name, as the fourth audit's F5 residue had it:
# every mean 1.0, and the deleted studies' rows shown.
REMADE_VIEW = """
DROP VIEW encoding_summaries;
CREATE VIEW encoding_summaries AS
    SELECT r.study_id, r.label, r.encoding, m.variant, m.protocol, m.name,
           1.0 AS mean, MIN(m.value) AS min, MAX(m.value) AS max, COUNT(m.value) AS seeds
    FROM run_summaries m JOIN runs r ON r.id = m.run_id
    GROUP BY r.study_id, r.label, r.encoding, m.variant, m.protocol, m.name;
"""


def _planted(home: Path, tmp_path: Path, statements: str) -> Path:
    """A real backup of the seeded database with schema objects of someone else's."""
    out = tmp_path / "planted.db"
    assert cli(home, "db", "backup", "--out", str(out)).returncode == 0
    with database(out) as connection:
        connection.executescript(statements)
    return out


def _text(tmp_path: Path) -> Path:
    path = tmp_path / "notes.txt"
    path.write_text("not a database\n" * 20)
    return path


def _fifo(tmp_path: Path) -> Path:
    path = tmp_path / "pipe"
    os.mkfifo(path)  # no writer: reading it would hang
    return path


def _pg_dump(tmp_path: Path) -> Path:
    path = tmp_path / "cluster.dump"
    path.write_bytes(b"PGDMP\x01\x10\x00" + b"\x00" * 100)
    return path


def test_a_backup_at_an_earlier_revision_restores_its_rows_and_migrates(tmp_path: Path) -> None:
    """The new database is made at the backup's revision (0009: before the audit
    columns and the events table), takes its rows, then migrates to the latest."""
    old = tmp_path / "old"
    upgrade(url_of(old), "0009")
    forget(url_of(old))
    with database(old / "posbench.db") as connection:
        connection.execute(
            "INSERT INTO studies (id, name, task, metric, train_length, spec, created_at) "
            "VALUES (7, 'from 0009', 'lm', 'perplexity', 32, '{}', '2026-01-01 00:00:00')"
        )
    out = tmp_path / "at-0009.db"
    assert cli(old, "db", "backup", "--out", str(out)).returncode == 0
    home = tmp_path / "home"
    done = cli(home, "db", "restore", str(out))
    assert done.returncode == 0, done.stderr
    assert f"(schema 0009, now at {head()})" in done.stdout and "1 studies" in done.stdout
    assert schema_of(home / "posbench.db") == migrations_schema(tmp_path)
    assert queries.studies(url_of(home)).name.tolist() == ["from 0009"]


def schema_of(path: Path) -> dict[tuple[str, str], str | None]:
    """Every schema object of a SQLite database and its definition."""
    with database(path) as connection:
        rows = connection.execute("SELECT type, name, sql FROM sqlite_master")
        return {(kind, name): definition for kind, name, definition in rows}


def migrations_schema(tmp_path: Path) -> dict[tuple[str, str], str | None]:
    """The schema of a new database the migrations made."""
    url = f"sqlite:///{tmp_path / 'fresh.db'}"
    upgrade(url)
    forget(url)
    return schema_of(tmp_path / "fresh.db")


def summaries_view(home: Path) -> list[tuple]:
    """What the encoding_summaries view shows to SQL."""
    with database(home / "posbench.db") as connection:
        return connection.execute(
            "SELECT study_id, label, variant, protocol, name, mean, min, max, seeds "
            "FROM encoding_summaries ORDER BY study_id, label, variant, protocol, name"
        ).fetchall()


def test_a_view_made_again_under_its_own_name_restores_as_the_migrations_make_it(
    home: Path, tmp_path: Path
) -> None:
    """The fourth audit's F5 residue: encoding_summaries made again under its own name
    (every mean 1.0, the deleted studies shown) passed a check by name and was restored
    as it stood. The restore takes the backup's rows only, into the migrations' schema."""
    settings = Settings(home=home)
    finish_every_run(settings)
    delete_study(1, actor="alice", settings=settings)
    assert seed_study(settings) == 2  # study 1 deleted, study 2 live
    url = url_of(home)
    shown = summaries_view(home)
    assert {row[0] for row in shown} == {2} and {row[5] for row in shown} != {1.0}
    summaries, studies = queries.run_summaries(url), queries.studies(url)
    out = _planted(home, tmp_path, REMADE_VIEW)
    with database(out) as connection:  # the backup's own view: what the auditor saw
        planted = connection.execute("SELECT study_id, mean FROM encoding_summaries").fetchall()
    assert {study for study, _ in planted} == {1, 2} and {mean for _, mean in planted} == {1.0}

    remove_database(home)
    done = cli(home, "db", "restore", str(out))
    assert done.returncode == 0, done.stderr
    assert schema_of(home / "posbench.db") == migrations_schema(tmp_path)
    assert summaries_view(home) == shown  # the true means, study 1 left out
    pd.testing.assert_frame_equal(queries.run_summaries(url), summaries)
    pd.testing.assert_frame_equal(queries.studies(url), studies)
    assert queries.deleted_studies(url).id.tolist() == [1]


def test_a_table_made_again_under_its_own_name_restores_as_the_migrations_make_it(
    home: Path, tmp_path: Path
) -> None:
    """run_summaries made again without its unique key and with a default value of 1.0:
    a summary written twice would count twice in every mean, and the worker's upsert
    (ON CONFLICT on that key) would fail. Its rows come back in the migrations' table."""
    url = url_of(home)
    before = contents(url)
    out = _planted(home, tmp_path, remade_summaries("DEFAULT 1.0"))
    remove_database(home)
    done = cli(home, "db", "restore", str(out))
    assert done.returncode == 0, done.stderr
    assert schema_of(home / "posbench.db") == migrations_schema(tmp_path)
    assert_same(before, contents(url))
    first = queries.run_summaries(url).iloc[0]
    key = {
        "run_id": int(first.run_id),
        "variant": first.variant,
        "protocol": first.protocol,
        "name": first.summary,
    }
    with transaction(url) as session:  # as worker.runtime.store.record_summaries writes
        upsert(
            session, RunSummary.__table__, {**key, "value": 5.0}, keys=tuple(key), returning=None
        )
    again = queries.run_summaries(url)
    assert len(again) == len(before["summaries"])  # updated in place, not added
    assert 5.0 in again.value.tolist()
    with database(home / "posbench.db") as connection, pytest.raises(sqlite3.IntegrityError):
        connection.execute(
            "INSERT INTO run_summaries (run_id, variant, protocol, name) VALUES (?, ?, ?, ?)",
            tuple(key.values()),
        )


@pytest.mark.slow
def test_without_pg_dump_the_postgresql_backup_says_how_and_never_shows_the_password(
    tmp_path: Path,
) -> None:
    url = f"postgresql://posbench:{PASSWORD}@db.example:5432/posbench"
    empty = tmp_path / "bin"
    empty.mkdir()
    out = tmp_path / "cluster.dump"
    done = cli(
        tmp_path, "db", "backup", "--out", str(out), POSBENCH_DATABASE_URL=url, PATH=str(empty)
    )
    refused(done, "pg_dump is not on PATH", "pg_dump --format=custom", "PGPASSWORD")
    assert PASSWORD not in done.stderr and not out.exists()
    done = cli(
        tmp_path,
        "db",
        "restore",
        str(_pg_dump(tmp_path)),
        POSBENCH_DATABASE_URL=url,
        PATH=str(empty),
    )
    refused(done, "pg_restore is not on PATH", "pg_restore --no-owner")
    assert PASSWORD not in done.stderr
    plain_sql = tmp_path / "backup.sql"
    plain_sql.write_text("CREATE TABLE studies (id integer);\n")
    done = cli(tmp_path, "db", "restore", str(plain_sql), POSBENCH_DATABASE_URL=url)
    refused(done, "backup.sql is not a pg_dump --format=custom file", "psql")


def test_the_password_reaches_pg_tools_in_the_environment_only() -> None:
    target, env = libpq(f"postgres://posbench:{PASSWORD}%40x@db.example:5433/pb?sslmode=require")
    assert target == "postgresql://posbench@db.example:5433/pb?sslmode=require"
    assert env["PGPASSWORD"] == PASSWORD + "@x"
    target, env = libpq("postgresql://posbench@/pb?host=/run/postgresql")  # no password
    assert target == "postgresql://posbench@/pb?host=%2Frun%2Fpostgresql"  # libpq decodes it
    assert env.get("PGPASSWORD") == os.environ.get("PGPASSWORD")
