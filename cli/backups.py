"""`posbench db backup` and `posbench db restore` (the logic is ``jobs.backup``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, TypeVar

import typer

from cli.common import console, fail
from cli.serving import db_app
from core.safe_text import redact_url

T = TypeVar("T")


def _carried_out(action: Callable[[], T]) -> T:
    """``action``'s result; a refusal (the user's to fix) exits 2, a failure 1."""
    from jobs.backup import BackupFailed, BackupRefused

    try:
        return action()
    except BackupRefused as err:
        fail(str(err), code=2)
    except BackupFailed as err:
        fail(str(err), code=1)


@db_app.command("backup")
def db_backup(
    out: Annotated[
        Path, typer.Option("--out", show_default=False, help="The file to write (owner-only).")
    ],
    force: Annotated[bool, typer.Option("--force", help="Replace --out if it exists.")] = False,
) -> None:
    """Copy the results database to a file while workers keep writing: SQLite's online
    backup, or pg_dump --format=custom for PostgreSQL."""
    from core.settings import get_settings
    from jobs.backup import backup

    url = get_settings().database
    copied = _carried_out(lambda: backup(url, out, force=force))
    revision = f" (schema {copied.revision})" if copied.revision else ""
    console.print(
        f"backed up {redact_url(url)}{revision} to {copied.path}: {copied.describe()}",
        soft_wrap=True,
    )


@db_app.command("restore")
def db_restore(
    backup_file: Annotated[
        Path, typer.Argument(show_default=False, help="A file `posbench db backup` wrote.")
    ],
    force: Annotated[
        bool, typer.Option("--force", help="Replace a database that exists (stop posbench first).")
    ] = False,
) -> None:
    """Put a backup back as the results database and migrate it to the latest schema;
    refuses while the database exists, unless --force."""
    from core.settings import get_settings
    from jobs.backup import restore

    url = get_settings().database
    restored, revision = _carried_out(lambda: restore(url, backup_file, force=force))
    schema = f"schema {restored.revision}" if restored.revision else "its schema"
    console.print(
        f"restored {backup_file} into {redact_url(url)} ({schema}, now at "
        f"{revision}): {restored.describe()}",
        soft_wrap=True,
    )
