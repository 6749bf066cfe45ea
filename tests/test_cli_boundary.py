"""The CLI's one error boundary (``cli.common.run``): what a person caused is one
line and exit 2 (1 for what failed around them), a bug is a traceback without passwords
and a request to report it; and every command, given hostile names and values, answers
without a traceback and without reading them as markup."""

from __future__ import annotations

import pytest

from cli.common import run
from core.errors import UnavailableError
from core.spec import SpecError


def _raising(err: BaseException):
    def raise_it(*args, **kwargs):
        raise err

    return raise_it


def _ran(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exited:
        run(argv)
    return exited.value.code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("err", "code", "line"),
    [
        (SpecError(["model: no such preset\n'x'"]), 2, "error: model: no such preset 'x'"),
        (
            UnavailableError("the broker at redis://:s3cret@b/0 did not answer"),
            1,
            "redis://:***@b/0",
        ),
        (
            FileNotFoundError(2, "No such file or directory", "spec.yaml"),
            2,
            "error: No such file or directory: spec.yaml",
        ),
        (
            PermissionError(13, "Permission denied", "/root/x"),
            2,
            "error: Permission denied: /root/x",
        ),
        (
            OSError(28, "No space left on device"),
            1,
            "error: OSError: [Errno 28] No space left on device",
        ),
    ],
)
def test_what_a_person_caused_is_one_line(
    err: BaseException, code: int, line: str, monkeypatch, capsys
) -> None:
    monkeypatch.setattr("cli.render.catalog.encoding_rows", _raising(err))
    exit_code, stderr = _ran(["encodings"], capsys)
    assert exit_code == code
    assert len(stderr.strip().splitlines()) == 1 and line in stderr
    assert "Traceback" not in stderr and "s3cret" not in stderr


def test_an_unreachable_database_is_one_line(monkeypatch, capsys) -> None:
    from sqlalchemy.exc import OperationalError

    err = OperationalError(
        "SELECT 1", {}, Exception("connection to postgresql://me:pw@db/x refused")
    )
    monkeypatch.setattr("cli.render.catalog.encoding_rows", _raising(err))
    exit_code, stderr = _ran(["encodings"], capsys)
    assert exit_code == 1 and stderr.startswith("error: cannot reach or read the database: ")
    assert len(stderr.strip().splitlines()) == 1 and "pw@" not in stderr


def test_a_bug_is_a_traceback_without_passwords_and_a_request_to_report_it(
    monkeypatch, capsys
) -> None:
    err = KeyError("postgresql://me:s3cret@db/posbench")
    monkeypatch.setattr("cli.render.catalog.encoding_rows", _raising(err))
    exit_code, stderr = _ran(["encodings"], capsys)
    assert exit_code == 1
    assert (
        "Traceback (most recent call last)" in stderr
        and "encoding_rows" not in stderr.splitlines()[-1]
    )
    assert stderr.splitlines()[-1] == (
        "error: this is a bug in posbench (KeyError); please report it with the command and "
        "the traceback above"
    )
    assert "s3cret" not in stderr and "postgresql://me:***@db/posbench" in stderr


# -- every command, hostile values -------------------------------------------------------

HOSTILE = {
    "markup": "oops [/] x [link=file:///etc]b[/link]",
    "html": "<script>alert(1)</script><a href=x>y</a>",
    "bidi": "\u202eevil\u202c.yaml",
    "ansi": "\x1b]8;;http://evil\x1b\\x\x1b[31m",
    "huge-number": "9" * 5000,
    "hex-number": "0x" + "f" * 4000,
    "negative": "-1",
    "nul": "a\x00b",
    "megabyte": "x" * 1_000_000,
    "path-escape": "../../../../etc/passwd",
}


def commands() -> list[tuple[list[str], list]]:
    """Every leaf command of `posbench` with its parameters."""
    import typer

    from cli import app

    root = typer.main.get_command(app)
    context = type(root).context_class(root)
    found = []

    def walk(command, path: list[str]) -> None:
        if hasattr(command, "list_commands"):
            for name in command.list_commands(context):
                walk(command.get_command(context, name), [*path, name])
        else:
            found.append((path, [p for p in command.params if p.name != "help"]))

    walk(root, [])
    return found


def hostile_argv(path: list[str], params: list, value: str) -> list[str]:
    """``path`` with ``value`` in every parameter that takes one (flags left off)."""
    argv = list(path)
    for param in params:
        if getattr(param, "is_flag", False):
            continue
        argv += (
            [value]
            if not getattr(param, "opts", None) or param.opts[0][0] != "-"
            else [
                param.opts[0],
                value,
            ]
        )
    return argv


# Deeper slots: a valid command around one hostile value, where it reaches the checks
# behind the parser.
DEEP = [
    ["submit", "--preset", "smoke", "--queue", "{}"],
    ["run", "--preset", "{}"],
    ["status", "--limit", "{}"],
    ["results", "--study", "1", "--format", "{}"],
    ["results", "--study", "1", "--view", "{}"],
    ["results", "--study", "1", "--protocol", "{}"],
    ["results", "--study", "1", "--factor", "{}"],
    ["tasks", "sample", "{}", "--length", "64"],
    ["tasks", "sample", "niah", "--length", "256", "--param", "num_keys={}"],
    ["tasks", "sample", "passkey", "--length", "128", "--param", "digits={}"],
    ["tasks", "sample", "passkey", "--length", "64", "--seed", "{}"],
    ["export", "1", "--to", "{}"],
    ["worker", "--queues", "{}"],
    ["dashboard", "--address", "{}"],
    ["import", "{}"],
    ["db", "restore", "{}"],
]


@pytest.fixture
def home(tmp_path, monkeypatch):
    """An empty service home with a migrated SQLite database, as the working folder."""
    from core.settings import get_settings
    from db.migrate import upgrade

    for name in [n for n in __import__("os").environ if n.startswith("POSBENCH_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("POSBENCH_HOME", str(tmp_path))
    monkeypatch.setenv("POSBENCH_DATABASE_URL", f"sqlite:///{tmp_path}/posbench.db")
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.chdir(tmp_path)
    get_settings.cache_clear()
    upgrade(get_settings().database)
    yield tmp_path
    get_settings.cache_clear()


def _answered(argv: list[str], capsys) -> tuple[int, str]:
    try:
        run(argv)
        code = 0
    except SystemExit as exited:
        code = exited.code if isinstance(exited.code, int) else 1
    out = capsys.readouterr()
    return code, out.out + out.err


def _assert_handled(argv: list[str], code: int, output: str) -> None:
    shown = " ".join(a[:40] for a in argv)
    assert code in (0, 1, 2), (shown, code, output[-2000:])
    assert "Traceback" not in output and "bug in posbench" not in output, (shown, output[-3000:])
    assert "\x1b]8;;http://evil" not in output.replace(HOSTILE["ansi"], ""), shown


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_every_command_answers_hostile_values_without_a_traceback(home, capsys, kind) -> None:
    value = HOSTILE[kind]
    for path, params in commands():
        if not any(not getattr(p, "is_flag", False) for p in params):
            continue  # nothing to put a value in
        argv = hostile_argv(path, params, value)
        _assert_handled(argv, *_answered(argv, capsys))


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_hostile_values_behind_the_parser_get_one_line(home, capsys, kind) -> None:
    for template in DEEP:
        argv = [part.replace("{}", HOSTILE[kind]) for part in template]
        code, output = _answered(argv, capsys)
        _assert_handled(argv, code, output)
        assert code == 2, (argv[:4], output[-2000:])


# -- the worker's recorded failure reasons -----------------------------------------------


def test_a_failed_run_records_one_line_without_passwords() -> None:
    from jobs.service import Refused
    from worker.runtime.execute import MAX_REASON_CHARS, failure_reason

    assert failure_reason(Refused("model.hf 'x':\nits tokenizer is slow")) == (
        "model.hf 'x': its tokenizer is slow"
    )
    try:
        {}["postgresql://me:s3cret@db/x"]
    except KeyError as err:
        bug = failure_reason(err)
    assert bug.startswith("a bug in posbench: KeyError: 'postgresql://me:***@db/x' at ")
    assert bug.endswith("(please report it; the worker's log has the traceback)")
    assert len(failure_reason(ValueError("x" * 10**6))) == MAX_REASON_CHARS
