"""The core's servers fail under a running study: PostgreSQL restarts (in the middle of a
run, and of a submit), Redis is killed (restarted with its append-only file, or empty),
the artifacts disk fills up, and the database is away while people use the CLI and the
dashboard (scenarios 3 to 6 of docs/service.md#faults)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from .checks import assert_whole, recovery
from .conftest import ROOT, Site, Stage
from .hosts import wait_until

pytestmark = pytest.mark.faults

SLOW_INSERT = """
CREATE FUNCTION fault_slow_insert() RETURNS trigger AS $$
BEGIN PERFORM pg_sleep(4); RETURN NULL; END $$ LANGUAGE plpgsql;
CREATE TRIGGER fault_slow_insert BEFORE INSERT ON runs
    FOR EACH STATEMENT EXECUTE FUNCTION fault_slow_insert();
"""


def one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    """The CLI failed as the error boundary promises: a non-zero exit, one line, no
    traceback."""
    assert done.returncode != 0, done.stdout
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    return lines[0]


@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_postgres_restarts_in_the_middle_of_a_run(stage: Stage, site: Site, mode: str) -> None:
    stage.start_worker("w1")
    stage.wait_ready("w1")
    (run_id,) = stage.submit(f"pg-{mode}", 600)
    stage.wait_run(run_id, lambda r: r["step"] >= 60, 120, "60 steps")
    site.postgres.stop(mode)
    fault_at = time.monotonic()
    time.sleep(3)
    site.postgres.start()
    step = stage.run(run_id)["step"]
    seconds = recovery(stage, run_id, fault_at, step, timeout=60)
    print(f"PostgreSQL {mode} restart (down 3 s): the run progressed again after {seconds:.1f} s")
    run = stage.wait_run(run_id, lambda r: r["status"] == "done", 300, "the run done")
    # The same worker, the same claim: no takeover, and no failure.
    assert stage.host_of(run["worker"]) == "w1" and run["attempts"] == 1
    assert_whole(stage, run_id, site.reference(600))


def test_postgres_restarts_in_the_middle_of_a_submit(stage: Stage, site: Site) -> None:
    # A trigger holds the submit's transaction open for 4 s once its runs are being
    # written; PostgreSQL goes down (immediate) in the middle of it.
    site.postgres.execute(SLOW_INSERT, stage.database)
    path = stage.spec_file("mid-submit", 100, seeds=[0, 1])
    submit = subprocess.Popen(
        [sys.executable, "-m", "cli", "submit", str(path), "--queue", "cpu"],
        cwd=ROOT,
        env=stage.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    sleeping = "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND wait_event = 'PgSleep'"
    wait_until(lambda: stage.query(sleeping, stage.database)[0][0], 60, "the submit inside")
    site.postgres.stop("immediate")
    time.sleep(2)
    site.postgres.start()
    site.postgres.execute("DROP TRIGGER fault_slow_insert ON runs", stage.database)
    out, err = submit.communicate(timeout=120)
    done = subprocess.CompletedProcess(submit.args, submit.returncode, out, err)
    studies = stage.query("SELECT id FROM studies")
    runs = stage.query("SELECT status, enqueued_at IS NOT NULL FROM runs")
    if done.returncode == 0:  # it retried once the server was back: one whole study
        assert len(studies) == 1 and runs == [("queued", True)] * 2, (studies, runs, err)
        print("PostgreSQL restart in the middle of a submit: the submit retried and succeeded")
    else:  # or it gave up: one line, and nothing written
        print(f"PostgreSQL restart in the middle of a submit: {one_line_error(done)}")
        assert studies == [] and runs == []
        assert stage.cli("submit", str(path), "--queue", "cpu").returncode == 0
    stage.start_worker("w1")
    for (run_id,) in stage.query("SELECT id FROM runs"):
        stage.wait_run(run_id, lambda r: r["status"] == "done", 180, "every run done")
    assert len(stage.query("SELECT id FROM studies")) == 1


@pytest.mark.parametrize("kept", [True, False], ids=["append-only-file", "data-lost"])
def test_redis_is_killed_while_runs_wait_in_the_queue(stage: Stage, site: Site, kept: bool) -> None:
    stage.start_worker("w1")
    stage.wait_ready("w1")
    seeds = [0, 1, 2]
    run_ids = stage.submit(f"redis-{kept}", 300, seeds=seeds)  # one trains, two wait
    stage.wait_run(run_ids[0], lambda r: r["step"] >= 60, 120, "60 steps of the first run")
    site.redis.kill()
    if not kept:
        site.redis.forget()
    time.sleep(3)
    site.redis.start()
    restarted_at = time.monotonic()
    # The runs that waited start again: from Redis' append-only file, or, their messages
    # lost, sent again by the reconciler once they have waited a stale window.
    stage.wait_run(run_ids[1], lambda r: r["status"] != "queued", 120, "the second run starts")
    seconds = time.monotonic() - restarted_at
    print(
        f"Redis killed, restarted {'with its AOF' if kept else 'empty'}: the next queued run "
        f"started {seconds:.1f} s after the restart"
    )
    for seed, run_id in zip(seeds, run_ids, strict=True):
        run = stage.wait_run(run_id, lambda r: r["status"] == "done", 300, "every run done")
        assert run["attempts"] == 1, run
        assert_whole(stage, run_id, site.reference(300, seed))


def test_the_artifacts_disk_fills_up_while_a_checkpoint_is_written(
    stage: Stage, site: Site
) -> None:
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=5m,mode=0755", "faults", str(stage.artifacts)],
        check=True,
    )
    try:
        _full_disk(stage, site)
    finally:
        subprocess.run(["umount", "-l", str(stage.artifacts)], check=False)


def _full_disk(stage: Stage, site: Site) -> None:
    # The run waits before its periodic checkpoint at step 120 (the hook in
    # tests/faults/slow) until the disk is full: however fast it trains, that checkpoint
    # and every later one meet the full disk.
    gate = stage.folder / "gate"
    stage.start_worker(
        "w1",
        slow=True,
        POSBENCH_FAULTS_GATE_STEP="120",
        POSBENCH_FAULTS_GATE_FILE=str(gate),
    )
    stage.wait_ready("w1")
    (run_id,) = stage.submit("full-disk", 600)
    folder = stage.artifacts / "runs"
    wait_until(
        lambda: b"waits at the gate" in stage.log("w1").read_bytes(),
        120,
        "the checkpoint at step 120 to wait at the gate",
    )
    filler = stage.artifacts / "filler"
    with filler.open("wb") as handle:  # all but 256 KiB: no checkpoint fits any more
        free = os.statvfs(stage.artifacts).f_bavail * os.statvfs(stage.artifacts).f_frsize
        handle.write(b"\0" * max(0, free - 256 * 1024))
    gate.touch()
    run = stage.wait_run(run_id, lambda r: r["status"] == "failed", 180, "the run to fail")
    reason = run["failure_reason"]
    print(f"a full artifacts disk: the run failed with: {reason}")
    assert "No space left on device" in reason and "the disk is full" in reason
    assert "\n" not in reason and "bug" not in reason
    assert not list(folder.glob(".*.tmp"))  # the half-written file was removed
    assert "periodic checkpoint at step" in stage.log("w1").read_text()  # skipped first
    filler.unlink()
    done = stage.cli("retry", str(_study(stage)))
    assert done.returncode == 0, done.stderr
    run = stage.wait_run(run_id, lambda r: r["status"] == "done", 180, "the retried run")
    # The last whole checkpoint: step 100, the one before the gate.
    assert run["provenance"]["resumed_from_step"] == 100
    assert_whole(stage, run_id, site.reference(600))


def _study(stage: Stage) -> int:
    return stage.query("SELECT id FROM studies")[0][0]


def test_the_cli_and_the_dashboard_during_a_database_outage(stage: Stage, site: Site) -> None:
    from tests.integration.browser import free_port, patient_page, require_chromium, wait_http

    browser_path = require_chromium()
    from playwright.sync_api import expect

    path = stage.spec_file("outage", 50)
    assert stage.cli("submit", str(path), "--queue", "cpu").returncode == 0
    port = free_port()
    dashboard = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cli",
            "dashboard",
            "--port",
            str(port),
            "--address",
            "127.0.0.1",
        ],
        cwd=ROOT,
        env={**stage.env(), "PYTHONPATH": str(ROOT)},
        stdout=(stage.folder / "dashboard.log").open("wb"),
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{base}/_stcore/health", timeout=90)
        study = str(_study(stage))
        site.postgres.stop("fast")
        try:
            for command in (["status"], ["results", "--study", study], ["submit", str(path)]):
                line = one_line_error(stage.cli(*command))
                print(f"posbench {command[0]} during the outage: {line}")
            with patient_page(browser_path) as page:
                page.goto(f"{base}/queue")
                expect(page.get_by_text("could not be reached or read")).to_be_visible()
                expect(page.get_by_text("Traceback")).to_have_count(0)
        finally:
            site.postgres.start()
        # Back: the same commands work, and the page shows the study.
        assert stage.cli("status").returncode == 0
        assert stage.cli("results", "--study", study).returncode == 0
        with patient_page(browser_path) as page:
            page.goto(f"{base}/queue")
            expect(page.get_by_text("outage").first).to_be_visible()
            expect(page.get_by_text("could not be reached or read")).to_have_count(0)
    finally:
        dashboard.terminate()
        dashboard.wait(timeout=60)
    assert len(stage.query("SELECT id FROM studies")) == 1  # the submit in the outage wrote nothing
