"""Commands that run the service: the database schema, a worker, the dashboard, and
the whole embedded stack (`posbench up`)."""

from __future__ import annotations

import os
from typing import Annotated

import typer

from cli.common import (
    _check_port,
    _first_line,
    app,
    console,
    fail,
)
from core.safe_text import redact_url

db_app = typer.Typer(help="The results database.", no_args_is_help=True)
app.add_typer(db_app, name="db")


@db_app.command("upgrade")
def db_upgrade() -> None:
    """Create or migrate the schema to the latest version (Alembic)."""
    from core.settings import get_settings
    from db.migrate import upgrade
    from jobs.service import backfill_summaries

    url = get_settings().database
    try:
        upgrade(url)
    except Exception as err:
        fail(f"cannot upgrade the database {redact_url(url)}: {_first_line(err)}", code=1)
    console.print(f"database {redact_url(url)} is at the latest schema")
    filled = backfill_summaries(url)
    if filled:
        console.print(f"summarised {filled} runs finished before summaries were stored")


@app.command()
def worker(
    queues: Annotated[str, typer.Option("--queues", help="Comma-separated queues.")] = "gpu,cpu",
    concurrency: Annotated[
        int, typer.Option("--concurrency", min=1, max=64, help="Pool processes (one per GPU).")
    ] = 1,
    name: Annotated[str | None, typer.Option("--name", help="Celery node name.")] = None,
) -> None:
    """Start a Celery worker: prefork, one run per pool process, then a fresh process."""
    from core.spec import QUEUES
    from jobs.celery_app import app as celery

    unknown = [q for q in queues.split(",") if q not in QUEUES]
    if unknown:
        fail(f"unknown queue {unknown[0]!r} (allowed: {', '.join(QUEUES)})", code=2)
    argv = [
        "worker",
        "--queues",
        queues,
        "--concurrency",
        str(concurrency),
        "--pool",
        "prefork",
        "--max-tasks-per-child",
        "1",
        "--loglevel",
        "INFO",
        "--without-gossip",
        "--without-mingle",
    ]
    if name:
        argv += ["--hostname", name]
    import subprocess
    import sys

    reconciler = subprocess.Popen([sys.executable, "-m", "jobs.reconciler"])
    try:
        celery.worker_main(argv)
    finally:
        reconciler.terminate()
        reconciler.wait(timeout=10)


@app.command()
def dashboard(
    port: Annotated[int, typer.Option(help="Port to serve on.")] = 8501,
    address: Annotated[
        str,
        typer.Option(
            help="Interface to bind; beyond loopback only with a login "
            "(POSBENCH_DASHBOARD_PASSWORD or OIDC)."
        ),
    ] = "127.0.0.1",
) -> None:
    """Serve the Streamlit dashboard (health check: /_stcore/health)."""
    import socket

    from core.settings import get_settings
    from jobs.embedded import dashboard_command, dashboard_environment

    _check_port(port)
    try:
        socket.getaddrinfo(address, port)
    except (socket.gaierror, UnicodeError):
        fail(f"--address {address!r} is not an address or host name of this machine", code=2)
    _refuse_unsafe_serving(address)

    command = dashboard_command(port, address)
    os.execvpe(command[0], command, dashboard_environment(os.environ, get_settings()))


def _refuse_unsafe_serving(address: str) -> None:
    """Exit 2 with one line when serving at ``address`` would be open or half-configured."""
    from core.settings import get_settings
    from jobs.access import read_secrets, secrets_files, serving_problem

    problem = serving_problem(address, get_settings(), read_secrets(secrets_files()))
    if problem is not None:
        fail(problem, code=2)


@app.command()
def up(
    dashboard: Annotated[bool, typer.Option(help="Also serve the dashboard.")] = True,
    port: Annotated[int, typer.Option(help="Dashboard port.")] = 8501,
) -> None:
    """The whole service on this machine: private Redis, SQLite, one worker, dashboard."""
    from jobs.embedded import serve

    _check_port(port)
    if dashboard:
        _refuse_unsafe_serving("127.0.0.1")
    raise typer.Exit(serve(dashboard=dashboard, port=port, console=console))
