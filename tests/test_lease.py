"""A worker's lease while the database is away (jobs.lifecycle.under_lease): writes retry
as long as the lease may still hold, then the worker presumes it lost and stops; files
are written only under a freshly confirmed lease; a full disk says so. The same across
real hosts: tests/faults."""

from __future__ import annotations

import errno
import io
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from sqlalchemy import event
from sqlalchemy.exc import OperationalError

from core.settings import Settings
from db.engine import POSTGRES_NETWORK, make_engine, server_side_options
from jobs.lifecycle import ClaimedRun, LeaseClock, LeaseLost, under_lease
from worker.runtime.execute import StoreHooks, failure_reason
from worker.training.checkpoint import _save


class Refused(Exception):
    """What psycopg raises for a refused connection (a transient error)."""

    sqlstate = "08001"


def refused() -> OperationalError:
    return OperationalError("connect", {}, Refused("connection refused"))


def claimed(patience: float, silent_for: float = 0.0) -> ClaimedRun:
    clock = LeaseClock(patience=patience, confirmed=time.monotonic() - silent_for)
    return ClaimedRun("sqlite://", 7, "lease", clock=clock)


def test_a_write_retries_while_the_lease_may_hold_and_confirms_it() -> None:
    run = claimed(patience=30, silent_for=10)
    calls: list[float] = []

    def write() -> str:
        calls.append(time.monotonic())
        if len(calls) < 3:
            raise refused()
        return "written"

    assert under_lease(run, write) == "written"
    assert len(calls) == 3
    assert run.clock.silent() < 1  # the answer confirmed the lease


def test_past_the_stale_window_the_lease_is_presumed_lost_not_the_run_failed() -> None:
    run = claimed(patience=0.5)
    started = time.monotonic()

    def write() -> None:
        raise refused()

    with pytest.raises(LeaseLost, match=r"has not answered for .* POSBENCH_STALE_AFTER_SECONDS"):
        under_lease(run, write)
    assert 0.5 <= time.monotonic() - started < 3


def test_an_error_another_try_will_not_mend_is_raised_at_once() -> None:
    run = claimed(patience=30)
    calls = []

    def write() -> None:
        calls.append(1)
        raise OperationalError("select", {}, Exception("syntax error"))

    with pytest.raises(OperationalError):
        under_lease(run, write)
    assert calls == [1]


def test_the_lease_clock_defaults_to_the_stale_window(monkeypatch) -> None:
    monkeypatch.setenv("POSBENCH_STALE_AFTER_SECONDS", "45")
    from core.settings import get_settings

    get_settings.cache_clear()
    try:
        assert ClaimedRun("sqlite://", 1, "x").clock.patience == 45
    finally:
        get_settings.cache_clear()


def test_checkpoints_are_written_only_under_a_freshly_confirmed_lease() -> None:
    beat = SimpleNamespace(lost=False, cancel_asked=False)
    fresh = StoreHooks(claimed(patience=30, silent_for=5), None, beat, {})
    stale = StoreHooks(claimed(patience=30, silent_for=16), None, beat, {}, write_wait=0.2)
    started = time.monotonic()
    assert fresh.may_write() and not stale.may_write()
    assert 0.2 <= time.monotonic() - started < 2  # waited for a confirmation, none came
    beat.lost = True
    assert not fresh.may_write()
    # Past the stale window another worker may hold the run: no wait at all.
    gone = StoreHooks(claimed(patience=1, silent_for=2), None, SimpleNamespace(lost=False), {})
    started = time.monotonic()
    assert not gone.may_write() and time.monotonic() - started < 0.5


def test_a_checkpoint_waits_for_the_heartbeat_to_confirm_the_lease() -> None:
    """A busy database delayed the heartbeat past half the window: the checkpoint (the last
    one of training, too) waits for the confirmation instead of being dropped."""
    run = claimed(patience=4, silent_for=2.5)
    beat = SimpleNamespace(lost=False, cancel_asked=False)
    hooks = StoreHooks(run, None, beat, {})

    def confirm() -> None:
        time.sleep(0.3)
        run.clock.confirmed = time.monotonic()

    threading.Thread(target=confirm).start()
    started = time.monotonic()
    assert hooks.may_write()
    assert 0.25 <= time.monotonic() - started < 1.4


def test_the_defaults_take_a_lost_worker_over_within_a_minute() -> None:
    settings = Settings()
    # Silent for a stale window after its last beat, found at the next reconciler pass.
    worst = settings.heartbeat_seconds + settings.stale_after_seconds + settings.reconcile_seconds
    assert worst <= 45 and settings.stale_after_seconds >= 2 * settings.heartbeat_seconds


class FullDisk(io.RawIOBase):
    def __init__(self, room: int) -> None:
        self.room = room

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(data)
        return len(data)


def test_a_full_disk_under_a_checkpoint_raises_the_write_s_own_error() -> None:
    # torch's zip writer would say "unexpected pos ..." (a RuntimeError) instead.
    with pytest.raises(OSError) as raised:
        _save({"w": torch.zeros(64 * 1024)}, FullDisk(room=4096))
    assert raised.value.errno == errno.ENOSPC


def test_a_full_disk_is_a_readable_failure_not_a_bug() -> None:
    err = OSError(errno.ENOSPC, "No space left on device", "/artifacts/runs/3.pt")
    reason = failure_reason(err)
    assert reason.startswith("No space left on device writing /artifacts/runs/3.pt")
    assert "the disk is full" in reason and "bug" not in reason


class Stop(Exception):
    pass


def connection_options(url: str) -> dict:
    """The options the driver would be called with for ``url`` (no server needed)."""
    engine = make_engine(url)
    seen: dict = {}

    @event.listens_for(engine, "do_connect")
    def capture(dialect, record, cargs, cparams) -> None:
        seen.update(cparams)
        raise Stop

    with pytest.raises(Stop):
        engine.connect()
    return seen


def test_postgres_connections_notice_a_cut_network_in_seconds() -> None:
    options = connection_options("postgresql://u@db.example/posbench")
    assert {k: options[k] for k in POSTGRES_NETWORK} == POSTGRES_NETWORK
    assert options["tcp_user_timeout"] <= 30_000  # well inside the 30 s stale window
    # An option the URL sets itself wins.
    own = connection_options("postgresql://u@db.example/posbench?connect_timeout=3")
    assert own["connect_timeout"] == "3" and own["keepalives_idle"] == 10
    # And the server is asked to drop a vanished client's transaction in seconds, unless
    # the URL sets the session options itself.
    assert own["options"] == server_side_options()
    assert "-c tcp_user_timeout=10000" in own["options"]
    assert "-c idle_in_transaction_session_timeout=60000" in own["options"]
    pooled = connection_options("postgresql://u@db.example/posbench?options=-cjit%3Doff")
    assert pooled["options"] == "-cjit=off"
