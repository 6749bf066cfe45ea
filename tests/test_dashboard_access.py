"""Dashboard access (docs/security.md): nothing is served to the network without a login,
wrong passwords are slowed down and logged, logout and session expiry work, a broken
secrets file closes the dashboard, OIDC accounts need an allow-list, viewers only read."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, dashboard_settings, isolated_env, oidc_login, oidc_secrets
from dashboard_seed import seed_study
from pydantic import SecretStr
from streamlit.testing.v1 import AppTest
from typer.testing import CliRunner

from core.safe_text import markdown
from core.settings import Settings, get_settings
from jobs import access
from jobs.access import (
    FREE_ATTEMPTS,
    MAX_BACKOFF_SECONDS,
    OPERATOR,
    VIEWER,
    Secrets,
    Throttle,
    backoff_seconds,
    closed_open_message,
    is_loopback,
    login_forgets_failures,
    oidc_role,
    password_role,
    read_secrets,
    served_openly,
    serving_problem,
    session_expired,
)
from jobs.embedded import dashboard_command

APP = str(ROOT / "dashboard" / "app.py")
BROKEN_TOML = '[auth]\nclient_id = "posbench\n'


@pytest.fixture(autouse=True)
def fresh_throttle():
    access.THROTTLE.clear()
    yield
    access.THROTTLE.clear()


@pytest.fixture
def settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    yield from dashboard_settings(tmp_path, monkeypatch)


def passwords(monkeypatch: pytest.MonkeyPatch, operator: str | None, viewer: str | None = None):
    for name, value in (("PASSWORD", operator), ("VIEWER_PASSWORD", viewer)):
        if value is not None:
            monkeypatch.setenv(f"POSBENCH_DASHBOARD_{name}", value)
    get_settings.cache_clear()


def dashboard_cli(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`posbench dashboard ARGS` in a real subprocess, in an empty folder with an empty home
    (no secrets file but the test's)."""
    environment = isolated_env(tmp_path, HOME=str(tmp_path), **env)
    environment["PYTHONPATH"] = os.pathsep.join([str(ROOT), environment.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "cli", "dashboard", *args],
        cwd=tmp_path,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )


# --- finding 1: the open dashboard ---


@pytest.mark.parametrize("address", ["0.0.0.0", "::", "192.0.2.1"])
def test_a_network_bind_without_a_login_is_refused(tmp_path: Path, address: str) -> None:
    done = dashboard_cli(tmp_path, "--address", address)
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert "set POSBENCH_DASHBOARD_PASSWORD" in done.stderr
    assert f"--address {address} serves the dashboard to the network" in done.stderr


def dashboard_exec(monkeypatch: pytest.MonkeyPatch, *args: str) -> tuple[list[str], dict[str, str]]:
    """What `posbench dashboard ARGS` would exec, and with which environment (in-process;
    nothing is started)."""
    from cli import app, serving

    started: list[tuple[list[str], dict[str, str]]] = []

    def execvpe(_: str, command: list[str], env: dict[str, str]) -> None:
        started.append((command, env))

    monkeypatch.setattr(serving.os, "execvpe", execvpe)
    result = CliRunner().invoke(app, ["dashboard", *args])
    assert result.exit_code == 0, result.output
    (done,) = started
    return done


def test_the_dashboard_binds_loopback_by_default(
    settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    command, _ = dashboard_exec(monkeypatch)
    assert command[command.index("--server.address") + 1] == "127.0.0.1"


def test_a_network_bind_with_a_password_is_served(
    settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    passwords(monkeypatch, "s3cret")
    command, _ = dashboard_exec(monkeypatch, "--address", "0.0.0.0")
    assert command[command.index("--server.address") + 1] == "0.0.0.0"


# --- the fourth audit's G2: whose X-Forwarded-For is believed ---


def test_the_dashboard_believes_no_proxy_unless_one_is_set(
    settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FORWARDED_ALLOW_IPS", "*")  # uvicorn's own variable does not win
    _, env = dashboard_exec(monkeypatch)
    assert env["FORWARDED_ALLOW_IPS"] == ""
    monkeypatch.setenv("POSBENCH_DASHBOARD_TRUSTED_PROXIES", " 10.0.0.5, fd00::/64 ,")
    get_settings.cache_clear()
    _, env = dashboard_exec(monkeypatch)
    assert env["FORWARDED_ALLOW_IPS"] == "10.0.0.5,fd00::/64"
    assert env["POSBENCH_DASHBOARD_TRUSTED_PROXIES"] == " 10.0.0.5, fd00::/64 ,"  # the rest kept


def test_an_empty_list_of_proxies_is_one_uvicorn_trusts_nobody_by() -> None:
    # What dashboard_environment relies on: uvicorn reads an empty FORWARDED_ALLOW_IPS as
    # no trusted peer (its default, when the variable is absent, is loopback).
    from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

    def client_seen(trusted: str) -> tuple[str, int]:
        seen = {}

        async def app(scope, receive, send) -> None:
            seen.update(scope)

        scope = {
            "type": "http",
            "client": ("127.0.0.1", 5000),
            "headers": [(b"x-forwarded-for", b"203.0.113.99")],
        }
        asyncio.run(ProxyHeadersMiddleware(app, trusted_hosts=trusted)(scope, None, None))
        return seen["client"]

    assert client_seen("") == ("127.0.0.1", 5000)
    assert client_seen("127.0.0.1") == ("203.0.113.99", 0)


@pytest.mark.parametrize("value", ["*", "localhost", "10.0.0.1/24", "10.0.0.300", "::1, nope"])
def test_trusted_proxies_must_be_addresses_or_networks(value: str) -> None:
    from pydantic import ValidationError

    from core.settings import describe_settings_error

    with pytest.raises(ValidationError) as refused:
        Settings(dashboard_trusted_proxies=value)
    line = describe_settings_error(refused.value)
    assert line.startswith(f"POSBENCH_DASHBOARD_TRUSTED_PROXIES = {value!r}: ")
    assert "is not an IP address or network (e.g. 10.0.0.5, 10.0.0.0/24" in line
    assert Settings(dashboard_trusted_proxies="10.0.0.0/24,::1").dashboard_trusted_proxies == [
        "10.0.0.0/24",
        "::1",
    ]


def test_only_loopback_addresses_count_as_loopback() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not any(is_loopback(a) for a in ("0.0.0.0", "::", "", "192.0.2.1", "no such host!"))


def test_serving_needs_a_login_beyond_loopback() -> None:
    open_ = Settings()
    assert serving_problem("127.0.0.1", open_, Secrets(oidc=False)) is None
    assert "POSBENCH_DASHBOARD_PASSWORD" in serving_problem("0.0.0.0", open_, Secrets(oidc=False))
    viewer_only = Settings(dashboard_viewer_password=SecretStr("v"))
    assert serving_problem("0.0.0.0", viewer_only, Secrets(oidc=False)) is None
    oidc = Settings(dashboard_viewers=["@example.org"])
    assert serving_problem("0.0.0.0", oidc, Secrets(oidc=True)) is None
    nobody = serving_problem("0.0.0.0", open_, Secrets(oidc=True))
    assert "POSBENCH_DASHBOARD_OPERATORS" in nobody


# --- finding 1: `streamlit run` by hand (its default binds every interface) ---


def bind(address: str | None) -> None:
    """Streamlit's server.address as a server started with it would read it (the root
    conftest puts 127.0.0.1 back after the test)."""
    from streamlit import config

    config.set_option("server.address", address)


def unescaped(markdown: str) -> str:
    return re.sub(r"\\(.)", r"\1", markdown)


def test_only_loopback_and_unix_sockets_are_served_privately() -> None:
    assert not any(served_openly(a) for a in ("127.0.0.1", "::1", "localhost", "unix:///tmp/s"))
    assert all(served_openly(a) for a in (None, "", " ", "0.0.0.0", "::", "192.0.2.1"))
    assert "all interfaces" in closed_open_message(None)
    assert "served on 192.0.2.1 without a login" in closed_open_message("192.0.2.1")


@pytest.mark.parametrize("address", [None, "0.0.0.0", "192.0.2.1"])
def test_an_open_dashboard_without_a_login_shows_only_why_it_is_closed(
    settings, address: str | None, caplog
) -> None:
    bind(address)
    with caplog.at_level(logging.ERROR, logger="posbench.dashboard.auth"):
        app = AppTest.from_file(APP, default_timeout=60).run()
    assert not app.exception
    assert [t.value for t in app.title] == ["posbench"]
    where = address if address == "192.0.2.1" else "all interfaces"
    assert [unescaped(e.value) for e in app.error] == [
        f"The dashboard is closed: it is served on {where} without a login; "
        "set POSBENCH_DASHBOARD_PASSWORD or bind 127.0.0.1."
    ]
    assert not app.text_input and not app.button and not app.selectbox
    assert f"served on {where} without a login" in caplog.text


def test_pages_rendered_past_the_gate_of_an_open_dashboard_allow_nothing(settings) -> None:
    seed_study(get_settings())
    bind(None)

    def script() -> None:
        from dashboard import queue_page, submit_page

        queue_page.render()
        submit_page.render()

    app = AppTest.from_function(script, default_timeout=60).run()
    assert not app.exception
    assert not {b.key for b in app.button} & {"cancel", "retry", "delete", "submit"}
    assert [i.value for i in app.info] == [  # the live runs (a fragment) show nothing either
        "Your session ended: reload the page to log in again.",
        "Submitting needs the operator role.",
    ]


@pytest.mark.parametrize("address", ["::1", "unix:///tmp/posbench-dashboard.sock"])
def test_a_private_dashboard_without_a_login_is_the_operators(settings, address: str) -> None:
    bind(address)
    app = AppTest.from_file(APP, default_timeout=60).run()
    assert not app.exception
    assert "Submit a study" in [t.value for t in app.title]


def test_an_open_dashboard_with_a_password_asks_for_it(
    settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    passwords(monkeypatch, "s3cret")
    bind("0.0.0.0")
    app = AppTest.from_file(APP, default_timeout=60).run()
    assert not app.exception and not app.error
    assert app.text_input[0].label == "Password"
    assert "Submit a study" in [t.value for t in log_in(app, "s3cret").title]


def test_the_launchers_bind_loopback() -> None:
    # `posbench up` and `posbench dashboard` (whose default is tested above) pass it.
    command = dashboard_command(8501)
    assert command[command.index("--server.address") + 1] == "127.0.0.1"


# --- finding 5: the malformed secrets file fails closed ---


def test_a_malformed_secrets_file_refuses_to_serve(tmp_path: Path) -> None:
    (tmp_path / ".streamlit").mkdir()
    secrets = tmp_path / ".streamlit" / "secrets.toml"
    secrets.write_text(BROKEN_TOML)
    for address in ("127.0.0.1", "0.0.0.0"):
        done = dashboard_cli(tmp_path, "--address", address, POSBENCH_DASHBOARD_PASSWORD="pw")
        assert done.returncode == 2, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1
        assert f"the secrets file {secrets} cannot be parsed" in done.stderr


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize("address", ["127.0.0.1", "0.0.0.0"])
def test_oidc_with_nobody_allowed_in_refuses_to_serve(tmp_path: Path, address: str) -> None:
    oidc_secrets(tmp_path)
    port = free_port()
    # Empty allow-lists count as none (the environment has no other POSBENCH_ setting).
    done = dashboard_cli(
        tmp_path,
        "--address",
        address,
        "--port",
        str(port),
        POSBENCH_DASHBOARD_OPERATORS="",
        POSBENCH_DASHBOARD_VIEWERS=" , ",
    )
    # Streamlit would still be serving (exec'd in its place): the run would time out.
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "error: OIDC is configured ([auth] in secrets.toml) but nobody is allowed in: set "
        "POSBENCH_DASHBOARD_OPERATORS and/or POSBENCH_DASHBOARD_VIEWERS (e-mails or @domains)"
    ]
    assert "Streamlit" not in done.stdout and "URL" not in done.stdout
    with socket.socket() as probe, pytest.raises(ConnectionRefusedError):
        probe.connect(("127.0.0.1", port))  # nothing was left listening either


def test_read_secrets_tells_oidc_absent_and_broken_apart(tmp_path: Path) -> None:
    good, broken = tmp_path / "good.toml", tmp_path / "broken.toml"
    good.write_text('[auth]\nclient_id = "posbench"\n')
    broken.write_text(BROKEN_TOML)
    assert read_secrets([tmp_path / "absent.toml"]) == Secrets(oidc=False)
    assert read_secrets([good]) == Secrets(oidc=True)
    found = read_secrets([good, broken])
    assert found.broken == broken and not found.oidc


def test_the_dashboard_stays_closed_with_a_malformed_secrets_file(
    settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    (tmp_path / ".streamlit").mkdir()
    (tmp_path / ".streamlit" / "secrets.toml").write_text(BROKEN_TOML)
    monkeypatch.chdir(tmp_path)  # Streamlit reads ./.streamlit/secrets.toml
    with caplog.at_level(logging.ERROR, logger="posbench.dashboard.auth"):
        app = AppTest.from_file(APP, default_timeout=60).run()
    assert not app.exception
    assert [t.value for t in app.title] == ["posbench"]
    assert "cannot be parsed" in app.error[0].value
    assert not app.text_input and not app.button  # no login to get around it either
    assert "cannot parse" in caplog.text


# --- finding 5: OIDC allow-lists ---


def test_an_oidc_account_needs_the_allow_list() -> None:
    config = Settings(dashboard_operators=["alice@lab.example"], dashboard_viewers=["@example.org"])
    assert oidc_role({"email": "Alice@Lab.Example"}, config) == OPERATOR
    assert oidc_role({"email": "bob@example.org", "email_verified": True}, config) == VIEWER
    for refused in (
        {"email": "mallory@gmail.com"},
        {"email": "bob@example.org", "email_verified": False},
        {"email": "eve@sub.example.org"},
        {"email": "eve@notexample.org"},
        {"email": "alice@lab.example@evil.test"},
        {"name": "no e-mail"},
    ):
        assert oidc_role(refused, config) is None, refused
    assert oidc_role({"email": "alice@lab.example"}, Settings()) is None  # empty: nobody


def test_allow_lists_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POSBENCH_DASHBOARD_OPERATORS", "Alice@Lab.example, @ops.example")
    monkeypatch.setenv("POSBENCH_DASHBOARD_VIEWERS", '["@example.org"]')
    config = Settings()
    assert config.dashboard_operators == ["alice@lab.example", "@ops.example"]
    assert config.dashboard_viewers == ["@example.org"]


# --- finding 5: the OIDC gate (st.user as the provider's callback leaves it) ---

OPERATORS = "alice@lab.example, @ops.example"
VIEWERS = "@example.org"
REFUSED = (
    "This account is not allowed here: an administrator adds it (or its domain) to "
    "POSBENCH_DASHBOARD_OPERATORS or POSBENCH_DASHBOARD_VIEWERS."
)


@pytest.fixture
def oidc(settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The dashboard behind an OIDC login: alice and @ops.example operate, @example.org
    reads. ``signed_in(email, ...)`` is the full dashboard for that account."""
    yield from oidc_login(tmp_path, monkeypatch, operators=OPERATORS, viewers=VIEWERS)


def signed_in(email: str, **claims: object) -> AppTest:
    app = AppTest.from_file(APP, default_timeout=60)
    app.user = {
        "is_logged_in": True,
        "email": email,
        "email_verified": True,
        "iat": int(time.time()),
        **claims,
    }
    return app.run()


def page_paths(app: AppTest) -> set[str]:
    """The url paths of the pages the dashboard registered (st.navigation) for this run."""
    return {info.get("url_pathname") for info in app._registered_pages.values()}


def test_oidc_asks_a_visitor_to_log_in_first(oidc) -> None:
    app = AppTest.from_file(APP, default_timeout=60)
    app.user = {"is_logged_in": False}
    app.run()
    assert not app.exception
    assert [t.value for t in app.title] == ["posbench"]
    assert [b.label for b in app.button] == ["Log in"]
    assert not app.error and not app.text_input  # no password form in OIDC mode


@pytest.mark.parametrize(
    ("claims", "logged"),
    [
        ({"email": "mallory@gmail.com"}, "'mallory@gmail.com' is on no allow-list"),
        # On the operators' list, but the provider has not verified that it is hers.
        ({"email": "alice@lab.example", "email_verified": False}, "'alice@lab.example'"),
        ({"email": "eve@sub.example.org"}, "'eve@sub.example.org' is on no allow-list"),
    ],
    ids=["no-allow-list", "unverified", "subdomain"],
)
def test_oidc_refuses_an_account_the_allow_lists_do_not_vouch_for(
    oidc, claims: dict[str, object], logged: str, caplog
) -> None:
    with caplog.at_level(logging.WARNING, logger="posbench.dashboard.auth"):
        app = signed_in(**claims)
    assert not app.exception
    assert [t.value for t in app.title] == ["posbench"]
    assert [e.value for e in app.error] == [REFUSED]
    assert [b.label for b in app.button] == ["Log out"]  # and nothing else
    refused = [r.getMessage() for r in caplog.records if "login refused" in r.getMessage()]
    assert len(refused) == 1 and logged in refused[0], caplog.text
    assert "posbench_role" not in app.session_state and "posbench_actor" not in app.session_state


@pytest.mark.parametrize("email", ["alice@lab.example", "Bob@Ops.Example"])
def test_oidc_operators_by_e_mail_or_domain_get_every_page(oidc, email: str) -> None:
    app = signed_in(email)
    assert not app.exception and not app.error
    assert "Submit a study" in [t.value for t in app.title]
    assert {"submit", "queue", "compare", "explore"} <= page_paths(app)
    assert app.session_state["posbench_role"] == OPERATOR
    assert app.session_state["posbench_actor"] == email  # as the provider gave it
    assert [c.value for c in app.sidebar.caption] == [
        f"signed in as {markdown(f'{email} (operator)')}"
    ]


def test_an_oidc_viewer_reads_but_cannot_submit_cancel_retry_or_delete(oidc) -> None:
    seed_study(get_settings())
    app = signed_in("bob@example.org")
    assert not app.exception
    # The one error shown is the seeded run's failure, not a refusal.
    assert [e.value.split(" failed:")[0] for e in app.error] == ["run 6 (t5, seed 1)"]
    assert "Queue" in [t.value for t in app.title]  # a viewer lands on the Queue
    assert "submit" not in page_paths(app) and "queue" in page_paths(app)
    assert app.session_state["posbench_role"] == VIEWER
    assert [b.label for b in app.button] == ["Log out"]  # no cancel, retry or delete
    assert not {b.key for b in app.button} & {"cancel", "retry", "delete", "cancel-run"}


def test_an_expired_oidc_login_is_logged_out(oidc, monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    monkeypatch.setenv("POSBENCH_DASHBOARD_SESSION_HOURS", "2")
    get_settings.cache_clear()
    fresh = signed_in("alice@lab.example", iat=int(time.time()) - 2 * 3600 + 60)
    assert "Submit a study" in [t.value for t in fresh.title]
    assert fresh.user["is_logged_in"] is True
    with caplog.at_level(logging.INFO, logger="posbench.dashboard.auth"):
        stale = signed_in("alice@lab.example", iat=int(time.time()) - 2 * 3600 - 1)
    assert not stale.exception
    assert stale.user == {"is_logged_in": False}  # st.logout() emptied st.user
    assert not stale.title and not stale.button  # nothing of the dashboard showed
    assert "posbench_role" not in stale.session_state
    assert "dashboard session of 'alice@lab.example' expired" in caplog.text


# --- finding 5: back-off, logging, logout, expiry ---


def test_wrong_passwords_back_off_exponentially() -> None:
    assert [backoff_seconds(n) for n in range(FREE_ATTEMPTS + 4)] == [0] * FREE_ATTEMPTS + [
        1,
        2,
        4,
        8,
    ]
    assert backoff_seconds(100) == MAX_BACKOFF_SECONDS
    throttle, keys = Throttle(), ["session:a", "address:192.0.2.7"]
    for _ in range(FREE_ATTEMPTS + 3):
        throttle.failed(keys, now=1000.0)
    assert throttle.wait(keys, now=1000.0) == 8
    assert throttle.wait(["session:new", "address:192.0.2.7"], now=1004.0) == 4  # same client
    assert throttle.wait(["session:b", "address:192.0.2.8"], now=1000.0) == 0  # someone else
    throttle.succeeded(keys)
    assert throttle.wait(keys, now=1000.0) == 0


def test_wrong_passwords_from_everyone_together_have_a_ceiling_per_minute() -> None:
    # The fourth audit's G2: 30 wrong passwords, each under an address of its own, were
    # all checked; keys per client cannot stop clients that look different each time.
    throttle = Throttle()
    for n in range(5):
        throttle.failed([f"session:{n}", f"address:192.0.2.{n}"], now=1000.0 + n)
    assert throttle.crowded(6, now=1005.0) == 0  # under the ceiling
    assert throttle.crowded(5, now=1005.0) == 55  # until the first is a minute old
    assert throttle.crowded(2, now=1005.0) == 58  # until all but one of the last two are
    assert throttle.wait(["session:new", "address:198.51.100.1"], now=1005.0) == 0
    assert throttle.crowded(5, now=1060.0) == 0
    throttle.succeeded(["session:0", "address:192.0.2.0"])  # an operator's login
    assert throttle.crowded(4, now=1060.0) == 1  # the other four count on


def test_past_the_ceiling_no_password_is_checked_for_anyone(
    settings, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    passwords(monkeypatch, "s3cret")
    monkeypatch.setenv("POSBENCH_DASHBOARD_WRONG_PASSWORDS_PER_MINUTE", "2")
    get_settings.cache_clear()
    from dashboard import auth

    for n in range(2):  # two clients, one wrong password each: no key backs off
        monkeypatch.setattr(auth, "client_address", lambda n=n: f"192.0.2.{n}")
        app = AppTest.from_file(APP, default_timeout=60).run()
        assert [e.value for e in log_in(app, "wrong").error] == ["Wrong password."]
    monkeypatch.setattr(auth, "client_address", lambda: "198.51.100.1")
    with caplog.at_level(logging.WARNING, logger="posbench.dashboard.auth"):
        app = log_in(AppTest.from_file(APP, default_timeout=60).run(), "s3cret")
    (error,) = [e.value for e in app.error]
    assert re.fullmatch(
        r"Too many wrong passwords on this dashboard in the last minute, from everyone: "
        r"try again in (59|60) s\.",
        error,
    ), error
    assert "Submit a study" not in [t.value for t in app.title]
    assert "refused from 198.51.100.1: 2 wrong passwords in the last minute" in caplog.text


def log_in(app: AppTest, password: str) -> AppTest:
    app.text_input[0].set_value(password)
    return app.button[0].click().run()


def test_repeated_wrong_passwords_are_slowed_and_logged(
    settings, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    passwords(monkeypatch, "s3cret")
    app = AppTest.from_file(APP, default_timeout=60).run()
    with caplog.at_level(logging.INFO, logger="posbench.dashboard.auth"):
        for _ in range(FREE_ATTEMPTS):
            assert [e.value for e in log_in(app, "wrong").error] == ["Wrong password."]
        # Now even the right password waits: nothing is checked during the back-off.
        assert [e.value for e in log_in(app, "s3cret").error] == [
            "Too many wrong passwords: try again in 1 s."
        ]
        assert "Submit a study" not in [t.value for t in app.title]
        # A fresh session from the same address waits too.
        other = AppTest.from_file(APP, default_timeout=60).run()
        assert log_in(other, "s3cret").error[0].value.startswith("Too many wrong passwords")
    time.sleep(1.1)  # the back-off over, the right password opens it
    assert "Submit a study" in [t.value for t in log_in(app, "s3cret").title]
    failed = [r for r in caplog.records if "login failed" in r.getMessage()]
    assert len(failed) == FREE_ATTEMPTS
    assert "backing off" in caplog.text


def test_a_viewer_login_does_not_reset_the_back_off_on_operator_guesses(
    settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Audit F2: two wrong operator guesses, then the viewer password, repeated, gave 30
    # operator guesses and no back-off in 37 s.
    passwords(monkeypatch, "op-s3cret", viewer="view-pass")
    guesses = 0
    for _ in range(3):
        app = AppTest.from_file(APP, default_timeout=60).run()
        for _ in range(FREE_ATTEMPTS - 1):
            errors = [e.value for e in log_in(app, "guess").error]
            if errors and errors[0].startswith("Too many wrong passwords"):
                break
            guesses += 1
        else:
            log_in(app, "view-pass")
            continue
        break
    # The back-off started at the third guess, as for one client guessing alone.
    assert guesses == FREE_ATTEMPTS
    assert not login_forgets_failures(VIEWER) and login_forgets_failures(OPERATOR)


def test_a_session_replayed_from_another_browser_is_logged_out(
    settings, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    # Audit F10: a Streamlit session id replayed elsewhere resumed an operator's session.
    from dashboard import auth

    passwords(monkeypatch, "s3cret")
    seen = {"browser": "the operator's browser"}
    monkeypatch.setattr(auth, "browser", lambda: seen["browser"])
    app = log_in(AppTest.from_file(APP, default_timeout=60).run(), "s3cret")
    assert "Submit a study" in [t.value for t in app.title]
    app.run()  # the same browser: still in
    assert "Submit a study" in [t.value for t in app.title]
    seen["browser"] = "another browser with the session id"
    with caplog.at_level(logging.WARNING, logger="posbench.dashboard.auth"):
        app.run()
    assert [t.value for t in app.title] == ["posbench"] and "posbench_role" not in app.session_state
    assert "used from another browser than its login" in caplog.text
    seen["browser"] = "the operator's browser"  # and the stolen id is worth nothing more
    assert [t.value for t in app.run().title] == ["posbench"]


def test_a_script_run_without_a_connection_is_bound_to_nothing() -> None:
    from dashboard import auth

    assert auth.browser() is None  # an AppTest run: no request, no cookie to bind to


def test_a_connection_without_the_binding_cookie_cannot_log_in(
    settings, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    from dashboard import auth

    passwords(monkeypatch, "s3cret")
    monkeypatch.setattr(auth, "browser", lambda: "")  # a request that brought no cookie
    with caplog.at_level(logging.WARNING, logger="posbench.dashboard.auth"):
        app = log_in(AppTest.from_file(APP, default_timeout=60).run(), "s3cret")
    assert [e.value for e in app.error] == [
        "This browser did not keep the dashboard's cookie, which a login needs: allow "
        "cookies for this site and reload the page."
    ]
    assert "posbench_role" not in app.session_state
    assert "the connection brought no posbench_browser cookie" in caplog.text


def asgi_response(scope: dict) -> list[tuple[bytes, bytes]]:
    """The headers ``BindingCookie`` lets through for a request of ``scope`` to an app
    that answers 200 with one header of its own."""
    from dashboard.binding import BindingCookie

    sent: list[dict] = []

    async def app(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"x-app", b"1")]})
        await send({"type": "http.response.body", "body": b"ok"})

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(BindingCookie(app)({"type": "http", "scheme": "http", **scope}, None, send))
    assert sent[1]["body"] == b"ok"
    return sent[0]["headers"]


def test_the_binding_cookie_is_set_once_random_and_out_of_scripts_reach() -> None:
    from dashboard.binding import COOKIE, well_formed

    first, second = (dict(asgi_response({"headers": []})) for _ in range(2))
    assert first[b"x-app"] == b"1"  # the app's own headers kept
    name, _, attributes = first[b"set-cookie"].decode().partition("; ")
    token = name.removeprefix(f"{COOKIE}=")
    assert well_formed(token) and token not in second[b"set-cookie"].decode()
    assert attributes == "Path=/; HttpOnly; SameSite=Strict"
    secure = dict(asgi_response({"headers": [], "scheme": "https"}))[b"set-cookie"]
    assert secure.endswith(b"; SameSite=Strict; Secure")
    kept = [(b"cookie", f"_streamlit_xsrf=x; {COOKIE}={token}".encode())]
    assert b"set-cookie" not in dict(asgi_response({"headers": kept}))
    for malformed in ("short", token + "x", token[:-1] + "!"):
        replaced = [(b"cookie", f"{COOKIE}={malformed}".encode())]
        assert b"set-cookie" in dict(asgi_response({"headers": replaced})), malformed


def test_the_dashboard_is_served_behind_the_binding_cookie() -> None:
    from streamlit.web.server.app_discovery import discover_asgi_app

    command = dashboard_command(8501)
    served = Path(command[command.index("run") + 1])
    assert served == ROOT / "dashboard" / "serve.py"
    assert discover_asgi_app(served).import_string == "serve:app"  # what streamlit run finds


def test_a_fragment_checks_the_login_before_each_of_its_runs(
    settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The fourth audit's G4: the Queue's live runs (a fragment) rerun without the page and
    # its gate; a client with only the session id got them, and past the login's expiry
    # an open tab kept refreshing them. The page is rendered here without the gate.
    from dashboard import auth

    passwords(monkeypatch, "s3cret")
    seed_study(get_settings())
    seen = {"browser": None}
    monkeypatch.setattr(auth, "browser", lambda: seen["browser"])

    def script() -> None:
        from dashboard import queue_page

        queue_page.render()

    def queue(**state: object) -> AppTest:
        app = AppTest.from_function(script, default_timeout=60)
        for key, value in state.items():
            app.session_state[key] = value
        app.run()
        assert not app.exception, app.exception
        assert "Queue" in [t.value for t in app.title]  # the page around the fragment
        return app

    def runs(app: AppTest) -> list:
        return [f.value for f in app.dataframe if "ETA" in f.value.columns]

    login = {
        "posbench_role": OPERATOR,
        "posbench_logged_in_at": time.time(),
        "posbench_browser": None,
    }
    fresh = queue(**login)
    assert len(runs(fresh)) == 1 and auth.SESSION_ENDED not in [i.value for i in fresh.info]
    expired = queue(**{**login, "posbench_logged_in_at": time.time() - 12 * 3600 - 1})
    assert runs(expired) == [] and auth.SESSION_ENDED in [i.value for i in expired.info]
    assert "posbench_role" not in expired.session_state  # the login is over
    seen["browser"] = "another browser's cookie"
    elsewhere = queue(**login)
    assert runs(elsewhere) == [] and auth.SESSION_ENDED in [i.value for i in elsewhere.info]
    assert runs(queue()) == []  # and a session that never logged in


PLANTED_FRAGMENTS = """\
import streamlit
import streamlit as st
from streamlit import fragment


@st.fragment(run_every=2)
def live() -> None: ...


@st.fragment
def plain() -> None: ...


refresh = streamlit.fragment(plain)
"""


def test_the_lint_refuses_a_fragment_without_the_login_check(tmp_path: Path) -> None:
    from lint import fragments

    planted = tmp_path / "planted.py"
    planted.write_text(PLANTED_FRAGMENTS)
    found = [line.split(": ", 1)[1] for line in fragments.findings(planted)]
    assert found == [
        "streamlit's fragment imported: use dashboard.auth.fragment",
        "st.fragment without the login's check: use dashboard.auth.fragment",
        "st.fragment without the login's check: use dashboard.auth.fragment",
        "streamlit.fragment without the login's check: use dashboard.auth.fragment",
    ]
    assert fragments.main([str(planted)]) == 1
    assert fragments.main([]) == 0  # the dashboard's own code: its one fragment is guarded
    assert list(fragments.findings(ROOT / "dashboard" / "auth.py")) == []  # the guard itself


def test_logout_returns_to_the_login(settings, monkeypatch: pytest.MonkeyPatch) -> None:
    passwords(monkeypatch, "s3cret")
    app = log_in(AppTest.from_file(APP, default_timeout=60).run(), "s3cret")
    assert "Submit a study" in [t.value for t in app.title]
    app.button(key="logout").click().run()
    assert [t.value for t in app.title] == ["posbench"]
    assert app.text_input[0].label == "Password"


def test_an_expired_session_asks_for_the_password_again(
    settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    passwords(monkeypatch, "s3cret")
    monkeypatch.setenv("POSBENCH_DASHBOARD_SESSION_HOURS", "2")
    get_settings.cache_clear()
    app = log_in(AppTest.from_file(APP, default_timeout=60).run(), "s3cret")
    assert "Submit a study" in [t.value for t in app.title]
    app.session_state["posbench_logged_in_at"] = time.time() - 2 * 3600 - 1
    app.run()
    assert [t.value for t in app.title] == ["posbench"]
    assert app.info[0].value == "Your session expired: log in again."
    assert app.text_input[0].label == "Password"
    assert session_expired(time.time() - 60, Settings(dashboard_session_hours=2)) is False
    assert session_expired(None, Settings()) is True


# --- roles ---


def test_passwords_give_roles() -> None:
    config = Settings(
        dashboard_password=SecretStr("op"), dashboard_viewer_password=SecretStr("view")
    )
    assert password_role("op", config) == OPERATOR
    assert password_role("view", config) == VIEWER
    assert password_role("", config) is None and password_role("opx", config) is None


def test_a_viewer_reads_but_cannot_submit_cancel_retry_or_delete(
    settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    passwords(monkeypatch, "op", viewer="view")
    seed_study(get_settings())
    app = log_in(AppTest.from_file(APP, default_timeout=60).run(), "view")
    assert not app.exception
    assert "Queue" in [t.value for t in app.title]  # a viewer lands on the Queue
    labels = [b.label for b in app.button]
    assert labels == ["Log out"], labels  # no cancel, retry or delete
    operator = log_in(AppTest.from_file(APP, default_timeout=60).run(), "op")
    assert "Submit a study" in [t.value for t in operator.title]


def test_the_queue_shows_operator_actions_only_to_operators(
    settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    passwords(monkeypatch, "op", viewer="view")
    seed_study(get_settings())

    def script() -> None:
        from dashboard import queue_page, submit_page

        queue_page.render()
        submit_page.render()

    for role, expected in ((VIEWER, set()), (OPERATOR, {"cancel", "retry", "cancel-run"})):
        app = AppTest.from_function(script, default_timeout=60)
        app.session_state["posbench_role"] = role  # as a password login leaves it
        app.session_state["posbench_logged_in_at"] = time.time()
        app.session_state["posbench_browser"] = None
        app.run()
        assert not app.exception
        keys = {b.key for b in app.button}
        assert expected <= keys and (role == OPERATOR or not keys & {"cancel", "delete"})
        refused = [i.value for i in app.info] == ["Submitting needs the operator role."]
        assert refused == (role == VIEWER)
