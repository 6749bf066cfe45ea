"""`posbench up` (what `make run` starts): the embedded service end to end."""

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

from .conftest import ROOT


def test_up_serves_submit_and_stops_cleanly_on_ctrl_c() -> None:
    home = Path(tempfile.mkdtemp(prefix="pb-up-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("POSBENCH_")}
    env.update({"POSBENCH_HOME": str(home), "POSBENCH_DEVICE": "cpu", "PYTHONUNBUFFERED": "1"})
    up = subprocess.Popen(
        [sys.executable, "-m", "jobs.cli", "up", "--no-dashboard"],
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
            [sys.executable, "-m", "jobs.cli", "submit", "--preset", "smoke", "--wait", "--json"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=400,
        )
        assert done.returncode == 0, done.stderr
        study = json.loads(done.stdout.splitlines()[0])["study"]
        status = subprocess.run(
            [sys.executable, "-m", "jobs.cli", "status", str(study), "--json"],
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
