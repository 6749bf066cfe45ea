"""Worker hosts that die, or lose their network, in the middle of a run (scenarios 1 and 2
of docs/service.md#faults), at the default lease settings."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator

import pytest

from .checks import assert_whole, last_audit_id, recovery, writes_after
from .conftest import ROOT, Site, Stage, end_stage, make_stage
from .hosts import wait_until

pytestmark = pytest.mark.faults
STEPS = 800
# The promise at the defaults (heartbeat 5 s, stale after 30 s, reconciler every 10 s).
TAKEOVER_S = 60
SLOW_STEP_S = 180  # a deliberately slow evaluation step: 6 stale windows


@pytest.fixture(scope="module", autouse=True)
def _slow_first(slow_run) -> None:
    """The slow run starts before this module's first test and runs beside them."""


def test_a_killed_worker_host_is_taken_over_within_a_minute(stage: Stage, site: Site) -> None:
    stage.start_worker("w1")
    stage.start_worker("w2")
    stage.wait_ready("w1", "w2")
    (run_id,) = stage.submit("killed", STEPS)
    run = stage.wait_run(run_id, lambda r: r["step"] >= 60, 120, "60 steps")
    victim = stage.host_of(run["worker"])
    survivor = "w2" if victim == "w1" else "w1"
    killed = site.net.kill_host(victim)  # every process of the host: SIGKILL
    fault_at = time.monotonic()
    at_kill = stage.run(run_id)["step"]
    assert killed and stage.workers[victim].wait(timeout=10) == -9
    seconds = recovery(stage, run_id, fault_at, at_kill, timeout=TAKEOVER_S + 30)
    assert seconds <= TAKEOVER_S, f"taken over after {seconds:.1f} s"
    run = stage.wait_run(run_id, lambda r: r["status"] == "done", 300, "the run done")
    assert stage.host_of(run["worker"]) == survivor and run["attempts"] == 2
    resumed = run["provenance"]["resumed_from_step"]
    assert resumed % 20 == 0 and 0 < resumed <= at_kill  # from its last checkpoint
    assert_whole(stage, run_id, site.reference(STEPS))


# A worker cut off longer than the stale window presumes its lease lost and stops
# (jobs.lifecycle.under_lease). One that keeps trying (its clock slow, or its window
# configured longer: here 300 s on w1 alone) is stopped by the database's fence instead.
# The third: the link goes down while a transaction from w1 holds the run's row (a write
# in flight; once, by chance, the CI's 'still trying' run cut w1 there, and the row stayed
# locked past the takeover: the server kept the vanished client's transaction open).
PARTITIONS = {
    "shorter-than-the-lease": (10, {}, False),
    "longer-than-the-lease": (50, {}, False),
    "longer-and-still-trying": (50, {"POSBENCH_STALE_AFTER_SECONDS": "300"}, False),
    "longer-with-a-write-in-flight": (50, {}, True),
}
# On w1, with posbench's own connection settings: lock the run's row and never commit.
HOLD_THE_ROW = (
    "import sys, time; from sqlalchemy import text; from db.engine import engine_for; "
    "c = engine_for(sys.argv[1]).connect(); "
    "c.execute(text('UPDATE runs SET step = step WHERE id = :i'), {'i': int(sys.argv[2])}); "
    "print('holding the row', flush=True); time.sleep(3600)"
)


@pytest.mark.parametrize("case", PARTITIONS)
def test_a_partitioned_worker_host(stage: Stage, site: Site, case: str) -> None:
    down_s, w1_settings, held = PARTITIONS[case]
    stage.start_worker("w1", **w1_settings)
    stage.wait_ready("w1")
    (run_id,) = stage.submit(f"cut-{case}", STEPS * 3)
    stage.wait_run(run_id, lambda r: r["step"] >= 60, 120, "60 steps on w1")
    stage.start_worker("w2")  # idle, ready to take the run over
    stage.wait_ready("w2")
    if held:
        stage.workers["holder"] = site.net.spawn(
            "w1",
            [sys.executable, "-c", HOLD_THE_ROW, stage.url("w1"), str(run_id)],
            env=stage.env("w1"),
            log=stage.log("holder"),
            cwd=ROOT,
        )
        wait_until(lambda: b"holding" in stage.log("holder").read_bytes(), 30, "the row held")
    site.net.cut("w1")
    fault_at = time.monotonic()
    cut_at = stage.run(run_id)["step"]
    time.sleep(1)  # a write already on its way when the link went down
    before = last_audit_id(stage)
    if down_s < 30:
        time.sleep(down_s - 1)
        site.net.mend("w1")
        # The lease held: w1 carries on, nobody else claims the run.
        seconds = recovery(stage, run_id, fault_at, stage.run(run_id)["step"], timeout=60)
        run = stage.wait_run(run_id, lambda r: r["status"] == "done", 300, "the run done")
        assert stage.host_of(run["worker"]) == "w1" and run["attempts"] == 1
        print(f"link down {down_s} s: w1 wrote again {seconds:.1f} s after the cut")
    else:
        # w2 takes the run over while w1 is away (it resumes from w1's checkpoint); the
        # link stays down until then, and at least down_s seconds.
        stage.wait_run(run_id, lambda r: r["worker"].startswith("w2@"), TAKEOVER_S, "w2 has it")
        seconds = time.monotonic() - fault_at
        assert seconds <= TAKEOVER_S
        time.sleep(max(0.0, down_s - seconds))
        taken = last_audit_id(stage)
        assert not writes_after(stage, "w1", before, run_id)  # cut off: nothing came through
        by_itself = "lease lost" in stage.log("w1").read_text()
        site.net.mend("w1")
        mended_at = time.monotonic()
        stopped = lambda: "lease lost" in stage.log("w1").read_text()  # noqa: E731
        wait_until(lambda: stopped() or writes_after(stage, "w1", taken, run_id), 60, "w1 back")
        learnt = time.monotonic() - mended_at
        # The fence: back on the network, w1 wrote nothing under the lease it lost.
        assert writes_after(stage, "w1", taken, run_id) == [], stage.logs()
        assert stopped()
        run = stage.wait_run(run_id, lambda r: r["status"] == "done", 300, "the run done")
        assert stage.host_of(run["worker"]) == "w2" and run["attempts"] == 2
        when = (
            "by itself while cut off" if by_itself else f"{learnt:.1f} s after its link came back"
        )
        print(
            f"link down {mended_at - fault_at:.0f} s ({case}): w2 took the run over "
            f"{seconds:.1f} s after the cut; w1 stopped {when}"
        )
        assert cut_at > 0
    assert_whole(stage, run_id, site.reference(STEPS * 3))


@pytest.fixture(scope="module")
def slow_run(site: Site) -> Iterator[tuple[Stage, int]]:
    """A run whose evaluation at 2x takes 3 minutes more (the sitecustomize in
    tests/faults/slow), on w3 with its own database and broker, started before this
    module's other tests and checked after them."""
    slow = make_stage(site, broker_db=1)
    slow.start_worker("w3", slow=True, POSBENCH_FAULTS_SLOW_SECONDS=str(SLOW_STEP_S))
    slow.wait_ready("w3")
    (run_id,) = slow.submit("slow", 200)
    slow.wait_run(run_id, lambda r: (r["worker"] or "").startswith("w3@"), 60, "w3 has it")
    # An idle worker that would take the run if it were requeued (w3's own reconciler and
    # this one's watch it).
    slow.start_worker("w3", name="watcher")
    slow.wait_ready("watcher")
    yield slow, run_id
    end_stage(slow)


def test_a_live_worker_in_a_long_step_keeps_its_lease(slow_run: tuple[Stage, int]) -> None:
    # The heartbeat beats in its own thread while the run's thread waits in its step, so
    # neither reconciler takes the run from w3 (stale after 30 s, a step of 180 s).
    slow, run_id = slow_run
    run = slow.wait_run(run_id, lambda r: r["status"] == "done", SLOW_STEP_S + 240, "done")
    assert slow.host_of(run["worker"]) == "w3" and run["attempts"] == 1
    assert "the slow step is over" in slow.log("w3").read_text()
    leases = slow.query(
        "SELECT DISTINCT lease FROM fault_audit WHERE tbl = 'runs' AND lease IS NOT NULL"
    )
    assert len(leases) == 1  # claimed once, never taken over
    print(f"a step of {SLOW_STEP_S} s: the run kept its lease, attempts {run['attempts']}")
    assert_whole(slow, run_id, slow.site.reference(200))
