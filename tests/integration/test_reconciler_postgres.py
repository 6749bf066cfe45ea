"""The reconciler on PostgreSQL when another transaction holds a stranded run's row: a
worker cut off in the middle of a write leaves its backend holding the row's lock until
the server notices the client is gone. The pass goes on without that run (and finds it
once the lock is let go), and every session asks the server to notice a vanished client
in seconds (db.engine.POSTGRES_SERVER_SIDE). The whole scenario, with a cut link between
hosts, is tests/faults/test_worker_hosts.py's 'a write in flight' case."""

from __future__ import annotations

import datetime as dt
import threading
from pathlib import Path

import psycopg
from conftest import FOUR_RUNS
from sqlalchemy import text, update

from core.settings import Settings
from core.spec import parse_spec
from core.status import RunStatus
from db.engine import engine_for, transaction
from db.migrate import upgrade
from db.models import Run, utcnow
from jobs import lifecycle
from jobs.reconciler import reconcile
from jobs.service import submit

from .conftest import _postgres_database


def test_every_session_asks_the_server_to_drop_a_vanished_client(postgres_server: str) -> None:
    url = _postgres_database(postgres_server)
    with engine_for(url).connect() as connection:
        shown = {
            name: connection.execute(text(f"SHOW {name}")).scalar_one()
            for name in ("idle_in_transaction_session_timeout", "tcp_keepalives_idle")
        }
    assert shown["idle_in_transaction_session_timeout"] == "1min"
    # Over a unix socket (the embedded server's) the TCP settings read 0: nothing to probe.
    tcp = "host=/" not in url and "@/" not in url and "%2F" not in url
    assert shown["tcp_keepalives_idle"] == ("5" if tcp else "0")


def test_a_locked_stranded_run_does_not_stall_the_reconciler(
    postgres_server: str, tmp_path: Path
) -> None:
    url = _postgres_database(postgres_server)
    upgrade(url)
    config = Settings(home=tmp_path, database_url=url, stale_after_seconds=30)
    submitted = submit(
        parse_spec({**FOUR_RUNS, "seeds": [0]}), settings=config, send=lambda _: None, actor="t"
    )
    stranded, other = (lifecycle.claim(url, run_id, "node").run_id for run_id in submitted.queued)
    long_ago = utcnow() - dt.timedelta(minutes=5)
    with transaction(url) as session:
        both = [stranded, other]
        session.execute(update(Run).where(Run.id.in_(both)).values(heartbeat_at=long_ago))
    # A cut-off worker's write in flight: its transaction holds the row and never ends.
    raw = url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(raw) as holder:
        holder.execute("UPDATE runs SET step = step WHERE id = %s", (stranded,))
        passes: list[dict] = []
        thread = threading.Thread(
            target=lambda: passes.append(
                reconcile(settings=config, send=lambda _: None, queue_empty=lambda q: True)
            ),
            daemon=True,
        )
        thread.start()
        thread.join(timeout=30)
        assert not thread.is_alive(), "the reconciler waited for the held row"
        assert passes[0]["revived"] == [other]  # the other stranded run is not held up
        holder.rollback()  # the server drops the vanished client's transaction
    later = reconcile(settings=config, send=lambda _: None, queue_empty=lambda q: True)
    assert later["revived"] == [stranded]
    with transaction(url) as session:
        statuses = {run.id: run.status for run in session.query(Run).filter(Run.id.in_(both))}
    assert statuses == {stranded: RunStatus.QUEUED, other: RunStatus.QUEUED}
