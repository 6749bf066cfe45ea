"""The `posbench` command line.

Exit codes: 0 success, 2 bad input (one-line reason on stderr), 1 failure. The commands
live in ``studies``, ``audit``, ``results``, ``tasks``, ``serving`` and ``backups``;
importing them registers them on the one Typer ``app`` of ``common``.
"""

# The order of these imports is the order of the commands in `posbench --help`.
from cli import studies  # isort: skip
from cli import audit  # isort: skip
from cli import results  # isort: skip
from cli import tasks  # isort: skip
from cli import serving  # isort: skip
from cli import backups  # isort: skip
from cli.common import app, run  # isort: skip

__all__ = ["app", "audit", "backups", "main", "results", "serving", "studies", "tasks"]


def main() -> None:
    """The `posbench` command: every command behind one error boundary."""
    run()
