"""Migrations on PostgreSQL: 0008 on a database built at the schema before it (0007), the
run control flags leave provenance for their own columns and come back on downgrade;
0010's audit trail and soft delete, used, then down and up again."""

from __future__ import annotations

from test_lifecycle import EXPECTED, STORED, _fill_at_0007, _stored

from db.migrate import current, downgrade, head, upgrade

from .conftest import _postgres_database


def test_0008_carries_the_control_flags_over_on_postgresql(postgres_server: str) -> None:
    url = _postgres_database(postgres_server)
    upgrade(url, "0007")
    _fill_at_0007(url)
    upgrade(url)
    assert current(url) == head()
    assert _stored(url) == EXPECTED
    downgrade(url, "0007")
    upgrade(url)  # and up again: the same columns from the restored provenance
    assert _stored(url) == EXPECTED
    assert len(STORED) == len(EXPECTED)


def test_0010_audit_and_soft_delete_on_postgresql(postgres_server: str, tmp_path) -> None:
    """The events, the study's lock (FOR NO KEY UPDATE) and the purge's cascades on
    PostgreSQL, then 0010 down and up again."""
    from sqlalchemy import text

    from core.settings import Settings
    from core.spec import parse_spec
    from db import queries
    from db.engine import engine_for
    from jobs.retention import delete_study, purge, restore_study
    from jobs.service import cancel, submit

    url = _postgres_database(postgres_server)
    upgrade(url)
    settings = Settings(home=tmp_path, database_url=url)
    spec = parse_spec({"model": "tiny", "train": {"length": 16}, "encodings": ["rope"]})
    study = submit(spec, actor="alice", settings=settings, send=lambda run_id: None).study_id
    cancel(study_id=study, actor="bob", settings=settings)
    deleted = delete_study(study, actor="bob", settings=settings)
    assert queries.studies(url).empty and queries.runs(url).empty
    with engine_for(url).connect() as connection:
        assert not connection.execute(text("SELECT * FROM encoding_summaries")).all()
    restore_study(study, actor="carol", settings=settings)
    assert list(queries.studies(url)["id"]) == [study]
    again = delete_study(study, actor="bob", settings=settings)
    assert purge(settings, now=deleted.purge_at).studies == []  # deleted again since
    assert purge(settings, now=again.purge_at).studies == [study]
    events = queries.events(url)
    assert list(events["action"]) == ["purge", "delete", "restore", "delete", "cancel", "submit"]
    assert events["at"].dt.tz is not None  # timestamptz: aware times
    downgrade(url, "0009")
    upgrade(url)
    assert current(url) == head() and queries.events(url).empty


def test_a_database_that_is_not_utf8_is_refused_with_how_to_make_one(
    postgres_server: str, tmp_path
) -> None:
    # Before: `posbench db upgrade` failed with "cannot use a string pattern on a
    # bytes-like object" on a SQL_ASCII database.
    import psycopg

    from tests.conftest import isolated_env, posbench_cli

    name = "posbench_ascii"
    with psycopg.connect(postgres_server, autocommit=True) as connection:
        connection.execute(
            f"CREATE DATABASE {name} ENCODING 'SQL_ASCII' LC_COLLATE 'C' LC_CTYPE 'C' "
            "TEMPLATE template0"
        )
    base, _, query = postgres_server.partition("?")
    url = f"{base.rsplit('/', 1)[0]}/{name}?{query}"
    done = posbench_cli("db", "upgrade", env=isolated_env(tmp_path, POSBENCH_DATABASE_URL=url))
    assert done.returncode == 1 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert (
        f"the database {name} is encoded SQL_ASCII; posbench needs UTF8: create it with "
        f"CREATE DATABASE {name} ENCODING 'UTF8' TEMPLATE template0"
    ) in done.stderr
