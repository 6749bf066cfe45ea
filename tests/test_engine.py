"""Which database errors are retried: transient ones only, with real drivers' errors."""

from __future__ import annotations

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.exc import OperationalError

from db.engine import is_transient, with_retry


def real_error(url: str, statement: str = "SELECT 1") -> OperationalError:
    try:
        with create_engine(url).connect() as connection:
            connection.execute(text(statement))
    except OperationalError as err:
        return err
    raise AssertionError("no error")


def test_a_refused_postgresql_connection_is_retried_until_it_works() -> None:
    refused = real_error("postgresql+psycopg://user@127.0.0.1:1/none?connect_timeout=2")
    assert is_transient(refused)
    calls = []

    def work() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise refused
        return "written"

    assert with_retry(work, max_wait=0.01) == "written" and len(calls) == 3


def test_a_wrong_statement_is_not_retried(tmp_path) -> None:
    missing = real_error(f"sqlite:///{tmp_path}/x.db", "SELECT * FROM nowhere")
    assert not is_transient(missing)
    calls = []

    def work() -> None:
        calls.append(1)
        raise missing

    with pytest.raises(OperationalError):
        with_retry(work, max_wait=0.01)
    assert len(calls) == 1


def test_a_database_that_answers_only_after_retries_is_not_steady(tmp_path, monkeypatch) -> None:
    # The reconciler waits a stale window after such a pass before calling runs dead.
    from core.settings import Settings
    from jobs import reconciler

    settings = Settings(home=tmp_path, database_url=f"sqlite:///{tmp_path}/x.db")
    assert reconciler.database_steady(settings)
    refused = real_error("postgresql+psycopg://user@127.0.0.1:1/none?connect_timeout=2")
    real = reconciler.transaction
    failures = [refused]

    def flaky(url):
        if failures:
            raise failures.pop()
        return real(url)

    monkeypatch.setattr(reconciler, "transaction", flaky)
    monkeypatch.setattr("db.engine.time.sleep", lambda seconds: None)
    assert not reconciler.database_steady(settings)
