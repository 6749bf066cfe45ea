"""User strings are shown as text and URLs without passwords (DESIGN.md, the security
contract): in the CLI against a real SQLite database, in `posbench up`'s banner, and on
the dashboard through Streamlit's AppTest."""

from __future__ import annotations

import io
import json
import logging
import re
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, dashboard_settings, isolated_env, posbench_cli
from markdown_it import MarkdownIt
from rich.console import Console

from core.safe_text import error_summary, markdown, redact_url, redact_urls
from core.terminal import console, run_progress, styled

HOSTILE_NAMES = [
    "oops [/] x",
    "[link=http://evil]x[/link]",
    "oops [/] x [link=file:///etc]b[/link]",
]
BEACON = "![x](http://host/beacon.png)"
OSC8 = "\x1b]8;"
SGR = re.compile(r"\x1b\[[0-9;]*m")


# --- the helpers -------------------------------------------------------------------


TERMINAL_HOSTILE = [*HOSTILE_NAMES, BEACON, "**bold**", "[bold red]x[/]", ":warning: x", "[/]"]


def _terminal(out: io.StringIO):
    """The project's console, writing to ``out`` as a wide terminal would."""
    shown = console()
    shown.file, shown.width = out, 200
    shown._force_terminal = True
    return shown


@pytest.mark.parametrize("value", TERMINAL_HOSTILE)
def test_the_terminal_prints_the_string_itself(value: str) -> None:
    out = io.StringIO()
    shown = _terminal(out)
    shown.print(f"name {value}")
    shown.print(styled(("name", "bold"), f" {value}"))
    progress = run_progress(shown, label_width=30)
    progress.add_task(value, total=1, status=f"failed: {value}")
    shown.print(progress.get_renderable())
    lines = SGR.sub("", out.getvalue()).splitlines()
    assert lines[:2] == [f"name {value}"] * 2
    assert lines[2].startswith(f"{value:<30}") and f"failed: {value}" in lines[2]
    assert OSC8 not in out.getvalue()


PLANTED = """\
from rich import print
from rich.console import Console
from rich.markup import escape
from rich.text import Text
import rich

Console().print("x")
console = Console(markup=False, emoji=False)
console.print(f"study {name}", markup=True)
Text.from_markup(name)
rich.print(name)
"""


def test_the_lint_finds_every_way_back_to_markup(tmp_path: Path) -> None:
    from lint.terminal_output import findings, main

    planted = tmp_path / "planted.py"
    planted.write_text(PLANTED)
    found = [line.split(": ", 1)[1] for line in findings(planted)]
    assert found.count("Console(...) built outside core/terminal.py") == 2
    assert "markup= other than False" in found
    assert "from_markup(...) reads markup" in found
    assert "rich's print reads markup" in found and "rich.print reads markup" in found
    assert "rich.markup" in found
    assert main([str(planted)]) == 1
    assert main([]) == 0  # the project's own code


@pytest.mark.parametrize(
    "value", [BEACON, "**bold**", "[a](http://x)", "<img src=x>", "# h", "1. x", ":red[x]"]
)
def test_markdown_renders_as_the_literal_text(value: str) -> None:
    shown = markdown(value)
    assert set(_rendered(shown)) <= {"paragraph_open", "inline", "text", "paragraph_close"}
    assert "".join(t.content for t in _tokens(shown) if t.type == "text") == value


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:s3cret@broker:6379/0", "redis://:***@broker:6379/0"),
        ("postgresql://me:s3cret@db/posbench", "postgresql://me:***@db/posbench"),
        ("postgresql://me:p@ss@db/x", "postgresql://me:***@db/x"),
        ("sqlite:////tmp/posbench.db", "sqlite:////tmp/posbench.db"),
        ("redis+socket:///tmp/redis.sock", "redis+socket:///tmp/redis.sock"),
        # libpq and redis-py also take the password (and the TLS key's) as a parameter.
        ("postgresql://me@db/posbench?password=s3cret", "postgresql://me@db/posbench?password=***"),
        (
            "postgresql://me@db/x?sslmode=require&Password=p@ss;w&connect_timeout=5",
            "postgresql://me@db/x?sslmode=require&Password=***&connect_timeout=5",
        ),
        ("postgresql://me:s3cret@db/x?password=s3cret", "postgresql://me:***@db/x?password=***"),
        (
            "postgresql:///x?host=/run/pg&sslpassword=k3y",
            "postgresql:///x?host=/run/pg&sslpassword=***",
        ),
        ("redis://broker:6379/0?password=s3cret#f", "redis://broker:6379/0?password=***#f"),
        (
            "rediss://:s3cret@broker:6380/0?ssl_cert_reqs=required&ssl_password=k3y",
            "rediss://:***@broker:6380/0?ssl_cert_reqs=required&ssl_password=***",
        ),
        # A file's name is no secret.
        (
            "postgresql://me@db/x?passfile=/home/me/.pgpass",
            "postgresql://me@db/x?passfile=/home/me/.pgpass",
        ),
    ],
)
def test_urls_are_shown_without_their_password(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    assert redact_urls(f"Error connecting to '{url}': refused") == (
        f"Error connecting to '{shown}': refused"
    )


def test_every_url_in_a_message_loses_its_query_password() -> None:
    message = (
        "cannot reach postgresql://me@db/x?password=one or "
        '"redis://broker/0?password=two", giving up'
    )
    assert redact_urls(message) == (
        "cannot reach postgresql://me@db/x?password=*** or "
        '"redis://broker/0?password=***", giving up'
    )


def test_an_error_summary_names_its_kind_only() -> None:
    err = ConnectionError('connection to server at "dbhost" failed for user "me"')
    summary = error_summary(err)
    assert "ConnectionError" in summary and "dbhost" not in summary and "me" not in summary


# --- the CLI (finding 4) ----------------------------------------------------------


def _cli_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    # Wide, and a terminal as far as Rich knows: markup would emit its hyperlinks.
    return isolated_env(
        tmp_path,
        POSBENCH_DATABASE_URL=f"sqlite:///{tmp_path}/cli.db",
        COLUMNS="400",
        FORCE_COLOR="1",
        **extra,
    )


def _fail_a_run(url: str, study_id: int, reason: str) -> None:
    from core.status import RunStatus
    from db import queries
    from jobs import lifecycle

    run_id = int(queries.runs(url, study_id=study_id)["id"].iloc[0])
    lifecycle.finish(lifecycle.claim(url, run_id, "test"), RunStatus.FAILED, reason=reason)


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_a_study_named_with_markup_is_shown_literally(tmp_path: Path, name: str) -> None:
    env = _cli_env(tmp_path)
    assert posbench_cli("db", "upgrade", env=env).returncode == 0
    spec = yaml.safe_load((ROOT / "core" / "presets" / "smoke.yaml").read_text())
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump({**spec, "name": name}))

    submitted = posbench_cli("submit", str(spec_file), env=env)
    assert submitted.returncode == 0, submitted.stderr
    assert name in SGR.sub("", submitted.stdout)
    study = json.loads(posbench_cli("status", "--json", env=env).stdout)[0]["id"]
    reason = f"{name} {BEACON}"
    _fail_a_run(env["POSBENCH_DATABASE_URL"], study, reason)

    for args, shown in [
        (["status"], name),
        (["status", str(study)], reason),
        (["results", "--study", str(study)], name),
        (["results", "--study", str(study), "--view", "summaries"], name),
    ]:
        done = posbench_cli(*args, env=env)
        assert done.returncode == 0, (args, done.stderr)
        assert OSC8 not in done.stdout, args
        # A narrow table wraps its title at spaces: compare the words.
        words = " ".join(SGR.sub("", done.stdout).split())
        assert " ".join(shown.split()) in words, (args, done.stdout)


def test_posbench_run_shows_a_hostile_name_literally(tmp_path: Path) -> None:
    # Before: `posbench run` printed spec.name as markup: a MarkupError traceback, exit 1.
    name = HOSTILE_NAMES[-1]
    spec = {
        "name": name,
        "model": "tiny",
        "train": {"length": 32, "steps": 4, "batch_size": 2, "progress_every": 2},
        "encodings": ["nope"],
        "eval": {"lengths": [32], "tokens": 256, "variants": ["none"]},
    }
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(spec))
    done = posbench_cli(
        "run", str(spec_file), "--out", str(tmp_path / "out"), env=_cli_env(tmp_path)
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and OSC8 not in done.stdout
    assert f"study {name}: 1 runs x 4 steps" in SGR.sub("", done.stdout)


# --- posbench up (finding 7) ------------------------------------------------------


class _ExitedAtOnce:
    returncode = 1

    def __init__(self, *args, **kwargs) -> None:
        pass

    def poll(self) -> int:
        return self.returncode


def test_up_prints_the_broker_and_database_without_their_passwords(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import db.migrate
    import jobs.service
    from core.settings import get_settings
    from jobs import embedded

    monkeypatch.setenv("POSBENCH_HOME", str(tmp_path))
    monkeypatch.setenv("POSBENCH_BROKER_URL", "redis://:br0ker-s3cret@broker:6379/0")
    monkeypatch.setenv("POSBENCH_DATABASE_URL", "postgresql://me:db-s3cret@dbhost/posbench")
    monkeypatch.setattr(db.migrate, "upgrade", lambda url: None)
    monkeypatch.setattr(jobs.service, "backfill_summaries", lambda url: 0)
    monkeypatch.setattr(embedded.subprocess, "Popen", _ExitedAtOnce)
    monkeypatch.setattr(embedded, "stop", lambda process, timeout: None)
    get_settings.cache_clear()
    out = io.StringIO()
    try:
        code = embedded.serve(dashboard=False, port=8501, console=Console(file=out, width=300))
    finally:
        get_settings.cache_clear()
    printed = out.getvalue()
    assert code == 1  # the fake worker "exited"
    assert "s3cret" not in printed
    assert "redis://:***@broker:6379/0" in printed
    assert "postgresql://me:***@dbhost/posbench" in printed


def test_the_healthcheck_says_why_without_the_password(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from core.settings import get_settings
    from jobs import celery_app, healthcheck

    def refuse(settings):
        raise ConnectionError("cannot connect to redis://:br0ker-s3cret@broker:6379/0")

    monkeypatch.setenv("POSBENCH_HOME", str(tmp_path))
    monkeypatch.setattr(celery_app, "producer", refuse)
    get_settings.cache_clear()
    try:
        assert healthcheck.main() == 1
    finally:
        get_settings.cache_clear()
    err = capsys.readouterr().err
    assert "s3cret" not in err and "redis://:***@broker:6379/0" in err


# --- the dashboard (findings 4 and 7) ---------------------------------------------

MARKDOWN_ELEMENTS = ("markdown", "caption", "error", "warning", "info", "success", "toast")


def _markdown_values(app) -> list[str]:
    return [e.value for kind in MARKDOWN_ELEMENTS for e in app.get(kind)]


def _tokens(value: str) -> list:
    """The block and inline tokens a markdown body renders to (CommonMark with tables and
    strikethrough, as Streamlit's GFM)."""
    parsed = MarkdownIt("commonmark").enable(["table", "strikethrough"]).parse(value)
    return [t for token in parsed for t in [token, *(token.children or [])]]


def _rendered(value: str) -> list[str]:
    """The token types (heading_open, link_open, image, strong_open, text...)."""
    return [t.type for t in _tokens(value)]


def test_the_dashboard_shows_names_and_failures_as_text(settings) -> None:
    from dashboard_seed import SEEDED_SPEC
    from test_dashboard import page

    from jobs.service import submit

    name = f"{BEACON} **bold** [/] x"
    spec = SEEDED_SPEC.model_copy(update={"name": name})
    study = submit(spec, settings=settings, send=lambda run_id: None, actor="tester").study_id
    _fail_a_run(settings.database, study, f"**bold** {BEACON}")

    for which in ("queue", "compare"):
        app = page(which)
        app.query_params["study"] = str(study)
        app.query_params["studies"] = str(study)
        app.run()
        assert not app.exception, which
        values = _markdown_values(app)
        for value in values:  # the page's own bold is fine; no link or image at all
            assert not {"image", "link_open"} & set(_rendered(value)), value
        if which == "queue":
            seen = [_seen(v) for v in values if "beacon" in v]
            assert any(name in text for text in seen)  # the study's heading
            assert any("failed: **bold** " + BEACON in text for text in seen)


def _seen(value: str) -> str:
    """The text a viewer reads in a markdown body."""
    return "".join(t.content for t in _tokens(value) if t.type == "text")


def _plain(value: str) -> str:
    return re.sub(r"\\(.)", r"\1", value)


def _queue_behind_the_guard() -> None:
    from dashboard import queue_page
    from dashboard.common import page_errors

    with page_errors():  # what dashboard/app.py puts around every page
        queue_page.render()


@pytest.mark.parametrize("failing", ["db.migrate.current", "db.queries.count_studies"])
def test_a_database_error_is_summarised_on_the_dashboard_and_logged_in_full(
    settings, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, failing: str
) -> None:
    from sqlalchemy.exc import OperationalError
    from streamlit.testing.v1 import AppTest

    raw = (
        'connection to server at "dbhost" (10.0.0.5), port 5432 failed: password '
        'authentication failed for user "alice" (postgresql://alice:s3cret@dbhost/x)'
    )

    def refuse(*args, **kwargs):
        raise OperationalError("SELECT 1", {}, Exception(raw))

    monkeypatch.setattr(failing, refuse)
    with caplog.at_level(logging.ERROR, logger="posbench.dashboard"):
        app = AppTest.from_function(_queue_behind_the_guard, default_timeout=60).run()
    assert not app.exception
    errors = [e.value for e in app.error]
    assert errors
    for text in errors:
        assert "dbhost" not in text and "alice" not in text and "s3cret" not in text
        assert "OperationalError" in _plain(text)
    assert "dbhost" in caplog.text and "alice" in caplog.text
    assert "s3cret" not in caplog.text


def test_a_page_s_bug_is_a_note_on_the_page_and_a_traceback_in_the_log(
    settings, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from streamlit.testing.v1 import AppTest

    def broken(*args, **kwargs):
        raise KeyError("postgresql://alice:s3cret@dbhost/x")

    monkeypatch.setattr("db.queries.count_studies", broken)
    with caplog.at_level(logging.ERROR, logger="posbench.dashboard"):
        app = AppTest.from_function(_queue_behind_the_guard, default_timeout=60).run()
    assert not app.exception  # no Streamlit traceback on the page
    (error,) = [_plain(e.value) for e in app.error]
    assert error.startswith("This page hit a bug in posbench (KeyError)") and "s3cret" not in error
    assert "Traceback (most recent call last)" in caplog.text and "broken" in caplog.text
    assert "alice:***@dbhost" in caplog.text and "s3cret" not in caplog.text


def test_what_a_person_caused_is_its_line_on_the_page(settings, monkeypatch) -> None:
    from streamlit.testing.v1 import AppTest

    from jobs.service import Refused

    def refuse(*args, **kwargs):
        raise Refused("over the quota: **1e22** FLOPs")

    monkeypatch.setattr("db.queries.count_studies", refuse)
    app = AppTest.from_function(_queue_behind_the_guard, default_timeout=60).run()
    assert not app.exception
    assert [_plain(e.value) for e in app.error] == ["over the quota: **1e22** FLOPs"]


@pytest.fixture
def settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    yield from dashboard_settings(tmp_path, monkeypatch)
