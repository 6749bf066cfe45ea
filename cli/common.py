"""What every command shares: the Typer app, the console, id and port checks, the
database a command reads, who acts (for the audit trail), the one way a command fails (a
line on stderr, exit 2 for bad input, 1 for a failure), and the error boundary around
every command (``run``)."""

from __future__ import annotations

import os
import pwd
import sys
import traceback
from pathlib import Path
from typing import Annotated, NoReturn

import typer

from core.errors import UserError
from core.safe_text import redact_url, redact_urls
from core.terminal import console as terminal
from core.terminal import echo

app = typer.Typer(
    name="posbench",
    help="Benchmark transformer position encodings: train, evaluate far beyond the "
    "training length, compare extrapolation curves.",
    no_args_is_help=True,
    add_completion=False,
    # No rich tracebacks (they print local variables: settings, URLs): `run` decides.
    pretty_exceptions_enable=False,
)
console = terminal()  # markup off: core.terminal
MAX_ID = 2**63 - 1  # the database's integer ids


@app.callback()
def _settings() -> None:
    """Read the POSBENCH_* settings once, before any command: a bad one exits 2."""
    from pydantic import ValidationError

    from core.settings import describe_settings_error, get_settings

    try:
        get_settings()
    except ValidationError as err:
        fail("invalid settings: " + describe_settings_error(err), code=2)


# A file the user named that is not there or not theirs: their input (exit 2).
_INPUT_FILE_ERRORS = (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)


def run(argv: list[str] | None = None) -> None:
    """Run the command ``argv`` names (default: the process's arguments) behind the one
    error boundary: what a person caused (``core.errors.UserError``, a file they named,
    an unreachable database) is one line on stderr and exit 2 (1 for what failed around
    them); anything else is a bug, printed with its traceback (URLs without passwords)
    and a request to report it, exit 1."""
    try:
        app(args=argv, prog_name="posbench")
    except UserError as err:
        _one_line(str(err), err.exit_code)
    except _INPUT_FILE_ERRORS as err:
        _one_line(f"{err.strerror or type(err).__name__}: {err.filename or err}", 2)
    except OSError as err:
        _one_line(f"{type(err).__name__}: {err}", 1)
    except Exception as err:
        if _is_database_error(err):
            _one_line(f"cannot reach or read the database: {_first_line(err)}", 1)
        shown = redact_urls("".join(traceback.format_exception(err)))
        echo(shown, err=True, end="")
        _one_line(
            f"this is a bug in posbench ({type(err).__name__}); please report it with the "
            "command and the traceback above",
            1,
        )


def _one_line(message: str, code: int) -> NoReturn:
    echo(f"error: {' '.join(redact_urls(message).split())}", err=True)
    sys.exit(code)


def _is_database_error(err: BaseException) -> bool:
    """A driver's error (unreachable, refused, locked) that reached no command's check."""
    exc = sys.modules.get("sqlalchemy.exc")
    return exc is not None and isinstance(err, exc.DBAPIError | exc.TimeoutError)


def fail(message: str, code: int) -> NoReturn:
    """A readable message on stderr (never wrapped, no traceback) and a meaningful exit code:
    2 for bad input, 1 for a failure."""
    echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def _load(spec_file: Path | None, preset: str | None):
    """The spec of a file or a preset, and the lines to print with its notes once every
    check has passed (an hf: model's training length read from its config)."""
    from core.settings import get_settings
    from core.spec import SpecError, parse_spec, preset_spec
    from core.spec.hf import with_model_length
    from core.spec.loading import read_spec_file

    if (spec_file is None) == (preset is None):
        fail("give either a spec file or --preset NAME (smoke, quick, paper)", code=2)
    told = None
    try:
        if spec_file is not None:
            data, told = with_model_length(read_spec_file(spec_file), get_settings().models)
            spec = parse_spec(data)
        else:
            spec = preset_spec(preset or "")
    except SpecError as err:
        fail("invalid spec: " + "; ".join(err.problems), code=2)
    return spec, [told] if told else []  # printed with the notes (core.terminal)


def _check_id(value: int | None, what: str) -> None:
    if value is not None and not 1 <= value <= MAX_ID:
        fail(f"{what} must be a positive integer below 2^63, got {value}", code=2)


def _check_port(port: int) -> None:
    if not 1 <= port <= 65535:
        fail(f"--port must be in 1..65535, got {port}", code=2)


def _database() -> str:
    from sqlalchemy.engine import make_url

    from core.settings import get_settings
    from db.migrate import current

    url = get_settings().database
    parsed = make_url(url)
    on_disk = parsed.get_backend_name() == "sqlite" and parsed.database not in (
        None,
        "",
        ":memory:",
    )
    # Reading must not create a database (or its folders) where none is.
    if on_disk and not Path(parsed.database or "").expanduser().is_file():
        fail(f"no database at {parsed.database}: run `posbench db upgrade`", code=1)
    try:
        revision = current(url)
    except Exception as err:
        fail(f"cannot reach the database {redact_url(url)}: {_first_line(err)}", code=1)
    if revision is None:
        fail(f"the database {redact_url(url)} has no schema yet: run `posbench db upgrade`", code=1)
    return url


def cli_actor() -> str:
    """Who runs this command, as the audit trail and the per-submitter quota name them:
    the OS account of the process's uid (the password database, never $LOGNAME or $USER,
    which the user sets at will: the fourth audit's G5 passed the quota twice by
    changing $LOGNAME), or the uid when it has no entry, e.g. ``alice (cli)``. Not proof
    of who typed it: the database's credentials are what bounds who may act."""
    uid = os.getuid()
    try:
        user = pwd.getpwuid(uid).pw_name
    except KeyError:  # no entry for this uid (a bare container)
        user = f"uid {uid}"
    return f"{user} (cli)"


def _missing_study(url: str, study: int) -> NoReturn:
    """Exit 2 for a study id no live study has: deleted (who, when, the way back), or
    none at all."""
    from db import queries
    from jobs.audit import deleted_message

    deleted = queries.deleted_studies(url, [study])
    if deleted.empty:
        fail(f"no study with id {study}", code=2)
    row = deleted.iloc[0]
    fail(deleted_message(study, row["deleted_by"], row["deleted_at"]), code=2)


def _first_line(err: BaseException) -> str:
    """The error's first line, every URL in it without its password."""
    text = str(getattr(err, "orig", None) or err).strip()
    return redact_urls(text.splitlines()[0]) if text else type(err).__name__


StudyArgument = Annotated[int | None, typer.Argument(show_default=False)]
RunOption = Annotated[int | None, typer.Option("--run", help="One run instead of a study.")]
