"""Engines and sessions for SQLite (the embedded default) and PostgreSQL (the cluster).

SQLite is tuned for several worker processes writing at once: WAL (readers never
block the writer), a busy timeout (writers queue instead of failing), foreign
keys on, and ``BEGIN IMMEDIATE`` so that a transaction takes the write lock when
it starts rather than failing to upgrade a read lock half-way through.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from core.files import private_file, private_folder

SQLITE_BUSY_TIMEOUT_S = 60
# libpq's connection options over TCP (ignored on a unix socket): a connect gives up after
# 10 s; an idle connection is probed after 10 s, every 5 s, and dropped after 3 unanswered
# probes; data the server has not acknowledged for 15 s drops it (TCP_USER_TIMEOUT). A
# worker whose link is cut then retries within its lease (jobs.lifecycle.under_lease).
POSTGRES_NETWORK = {
    "connect_timeout": 10,
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "tcp_user_timeout": 15_000,
}
# The same from the server's end, sent as the session's settings (libpq's ``options``):
# a backend whose client vanished in the middle of a transaction (its host cut off, or
# dead) would otherwise hold that transaction's row locks until the server's own TCP
# keepalive, two hours by default, and every other worker's write to the run, and the
# reconciler's requeue of it, would wait that long. Probed after 5 s idle, every 2 s, and
# dropped once 10 s go unanswered, it rolls back and lets go. A transaction left idle for
# a minute by a live client is ended too: none of ours waits that long between statements.
POSTGRES_SERVER_SIDE = {
    "tcp_keepalives_idle": 5,
    "tcp_keepalives_interval": 2,
    "tcp_keepalives_count": 3,
    "tcp_user_timeout": 10_000,
    "idle_in_transaction_session_timeout": 60_000,
}
T = TypeVar("T")


def normalize_url(url: str) -> str:
    """``postgresql://`` and ``postgres://`` mean psycopg 3 here."""
    for prefix in ("postgres://", "postgresql://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


def server_side_options() -> str:
    """``POSTGRES_SERVER_SIDE`` as libpq's ``options`` (``-c name=value`` each)."""
    return " ".join(f"-c {name}={value}" for name, value in POSTGRES_SERVER_SIDE.items())


def make_engine(url: str) -> Engine:
    url = normalize_url(url)
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        # Options the URL does not set itself: a server cut off by the network is noticed
        # in seconds, not after the kernel's 15 minutes of retransmissions.
        network: dict[str, Any] = {
            k: v for k, v in POSTGRES_NETWORK.items() if k not in parsed.query
        }
        if "options" not in parsed.query:  # a URL's own (say, for a pooler) wins whole
            network["options"] = server_side_options()
        return create_engine(url, pool_pre_ping=True, future=True, connect_args=network)
    if parsed.database and parsed.database != ":memory:":
        database = Path(parsed.database).expanduser()
        private_file(private_folder(database.parent) / database.name)  # owner-only when new
    engine = create_engine(
        url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_S, "check_same_thread": False}
    )

    @event.listens_for(engine, "connect")
    def _pragmas(connection: Any, _record: Any) -> None:
        # Let SQLAlchemy, not the driver, decide when transactions begin.
        connection.isolation_level = None
        cursor = connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_S * 1000}")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _begin_immediate(connection: Any) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


_ENGINES: dict[str, Engine] = {}


def engine_for(url: str) -> Engine:
    """One engine (and pool) per URL per process."""
    if url not in _ENGINES:
        _ENGINES[url] = make_engine(url)
    return _ENGINES[url]


def forget(url: str) -> None:
    """Close this process' pooled connections to ``url`` (a database file about to be
    replaced: a pooled connection would still read the old one)."""
    engine = _ENGINES.pop(normalize_url(url), None)
    if engine is not None:
        engine.dispose()


def session_factory(url: str) -> sessionmaker[Session]:
    return sessionmaker(engine_for(normalize_url(url)), expire_on_commit=False)


@contextmanager
def transaction(url: str) -> Iterator[Session]:
    """A session whose work commits on success and rolls back on any error."""
    with session_factory(url)() as session, session.begin():
        yield session


# SQLSTATE classes and codes worth another try: connection failures (08...), the
# server shutting down (57P0x), serialization failures and deadlocks.
TRANSIENT_SQLSTATES = ("40001", "40P01", "53300", "57P01", "57P02", "57P03")
# Connection failures that another try will not mend.
PERMANENT_CONNECTION_ERRORS = ("authentication failed", "does not exist", "no password")


def is_transient(err: OperationalError) -> bool:
    """Whether a database error is worth retrying: SQLite busy / locked, a dropped or
    refused PostgreSQL connection, a serialization failure or a deadlock."""
    if err.connection_invalidated or "locked" in str(err) or "busy" in str(err):
        return True
    state = getattr(err.orig, "sqlstate", None)
    if state is not None:
        return state.startswith("08") or state in TRANSIENT_SQLSTATES
    # psycopg raises connection failures (refused, reset) without a SQLSTATE; a wrong
    # password or database name among them is not worth 25 s of retries.
    if any(text in str(err) for text in PERMANENT_CONNECTION_ERRORS):
        return False
    return type(err.orig).__module__.startswith("psycopg")


def with_retry(
    work: Callable[[], T],
    attempts: int = 10,
    max_wait: float = 5.0,
    on_retry: Callable[[], None] | None = None,
) -> T:
    """Run ``work`` again while the database reports a transient error, backing off
    from 0.2 s to ``max_wait`` (about 25 s in all: a database restart, not an outage);
    ``on_retry`` is told of every retry."""
    for attempt in range(attempts):
        try:
            return work()
        except OperationalError as err:
            if not is_transient(err) or attempt == attempts - 1:
                raise
            if on_retry is not None:
                on_retry()
            time.sleep(min(max_wait, 0.2 * 2**attempt))
    raise AssertionError("unreachable")


def dispose_after_fork() -> None:
    """In a forked child: drop inherited pooled connections without closing the parent's."""
    for engine in _ENGINES.values():
        engine.dispose(close=False)
    _ENGINES.clear()
