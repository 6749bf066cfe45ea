"""What every fault scenario asserts of a study once it has recovered, and the recovery
time it prints."""

from __future__ import annotations

import time
from typing import Any

from .conftest import Stage


def assert_whole(stage: Stage, run_id: int, reference: dict[str, Any]) -> None:
    """The run ended ``done`` once, with one row per training step and per (variant,
    protocol, length), and the same numbers, bit for bit, as the run without faults."""
    run = stage.run(run_id)
    assert run["status"] == "done", (run, stage.logs())
    assert run["lease"] is None
    finishes = stage.query(
        "SELECT count(*) FROM fault_audit WHERE tbl = 'runs' AND run_id = %s AND status = 'done'",
        run_id,
    )
    assert finishes == [(1,)], "the run was finished more than once"
    points = stage.query(
        "SELECT step, loss FROM train_points WHERE run_id = %s ORDER BY step", run_id
    )
    expected = [(p["step"], p["loss"]) for p in reference["train"]["curve"]]
    assert [(step, loss) for step, loss in points] == expected
    evaluations = stage.query(
        "SELECT variant, protocol, eval_length, loss FROM evaluations WHERE run_id = %s "
        "ORDER BY variant, protocol, eval_length",
        run_id,
    )
    assert evaluations == sorted(
        (e["variant"], e["protocol"], e["length"], e["loss"]) for e in reference["evaluations"]
    )


def writes_after(stage: Stage, host: str, since_id: int, run_id: int) -> list[tuple]:
    """Every write to the run's rows from ``host``'s address after audit row ``since_id``."""
    return stage.query(
        "SELECT tbl, op, step, lease, at FROM fault_audit WHERE id > %s AND run_id = %s "
        "AND host(client) = %s ORDER BY id",
        since_id,
        run_id,
        stage.site.net.address(host),
    )


def last_audit_id(stage: Stage) -> int:
    return stage.query("SELECT coalesce(max(id), 0) FROM fault_audit")[0][0]


def recovery(stage: Stage, run_id: int, fault_at: float, since_step: int, timeout: float) -> float:
    """Seconds from ``fault_at`` (a ``time.monotonic`` instant) to the run's next progress
    past ``since_step``, polled every 0.2 s; printed for the log."""
    deadline = fault_at + timeout
    while time.monotonic() < deadline:
        run = stage.run(run_id)
        if run["step"] > since_step or run["status"] == "done":
            seconds = time.monotonic() - fault_at
            print(f"recovery: run {run_id} progressed again {seconds:.1f} s after the fault")
            return seconds
        time.sleep(0.2)
    raise AssertionError(f"no progress within {timeout:g} s: {stage.run(run_id)}\n{stage.logs()}")
