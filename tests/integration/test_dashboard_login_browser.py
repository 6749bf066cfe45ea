"""Dashboard access with real processes (docs/security.md, issue 18 findings 1 and 5): a
`posbench dashboard` with an operator and a viewer password, on a seeded database, driven
in headless Chromium: only a login before a password, wrong passwords slowed down per
session and per address, what a viewer and an operator may do, logout, session expiry;
and a bare `streamlit run` with no login (Streamlit's default binds every interface)
showing nothing but why it is closed."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from dashboard_seed import seed_study
from sqlalchemy import update

from core.settings import Settings
from db.engine import transaction
from db.migrate import upgrade
from db.models import Run
from jobs.access import FREE_ATTEMPTS

from .browser import SCREENSHOTS, free_port, launch, require_chromium, wait_http
from .conftest import ROOT

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page

OPERATOR_PASSWORD = "operator-pw-7Qx"
VIEWER_PASSWORD = "viewer-pw-3Kd"
STUDY = "seeded"  # the seeded study's name: nothing shows it before a login
FAILED = "dashboard login failed from"  # the server's log, one line per wrong password
REFUSED = "dashboard login refused from"  # one per attempt refused while backing off
CLOSED = (
    "The dashboard is closed: it is served on all interfaces without a login; "
    "set POSBENCH_DASHBOARD_PASSWORD or bind 127.0.0.1."
)
SESSION_HOURS = 0.0015  # 5.4 s: the expiry test waits this out
BURST = 10


@dataclass
class Dashboard:
    base: str
    log: Path
    process: subprocess.Popen[bytes]
    database: str

    def said(self, text: str) -> int:
        """How many times the server's log says ``text``."""
        return self.log.read_text(errors="replace").count(text)


def _seeded(home: Path) -> str:
    """A database holding the seeded study with nothing left running (it may be deleted)."""
    url = f"sqlite:///{home}/posbench.db"
    upgrade(url)
    seed_study(Settings(home=home, database_url=url))
    with transaction(url) as session:
        session.execute(update(Run).where(Run.status == "running").values(status="cancelled"))
    return url


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Dashboard]]:
    """Start a dashboard process: `posbench dashboard` on loopback, or (``bare``) a plain
    `streamlit run dashboard/app.py` with no address, as someone might start it by hand.
    Its home, working directory and HOME are empty folders (no secrets file)."""
    started: list[Dashboard] = []

    def start(name: str, *, bare: bool = False, **settings: str) -> Dashboard:
        home = tmp_path_factory.mktemp(name)
        port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("POSBENCH_", "STREAMLIT_"))}
        database = _seeded(home)
        env.update(
            {
                "HOME": str(home),
                "POSBENCH_HOME": str(home),
                "POSBENCH_DATABASE_URL": database,
                "PYTHONPATH": str(ROOT),  # the dashboard of this checkout
                "PYTHONUNBUFFERED": "1",
                **settings,
            }
        )
        if bare:
            command = [sys.executable, "-m", "streamlit", "run", str(ROOT / "dashboard" / "app.py")]
            command += ["--server.port", str(port), "--server.headless", "true"]
            command += ["--browser.gatherUsageStats", "false"]
        else:
            command = [sys.executable, "-m", "cli", "dashboard", "--port", str(port)]
        log = home / "dashboard.log"
        with log.open("wb") as out:
            process = subprocess.Popen(command, cwd=home, env=env, stdout=out, stderr=out)
        dashboard = Dashboard(f"http://127.0.0.1:{port}", log, process, database)
        started.append(dashboard)
        try:
            wait_http(f"{dashboard.base}/_stcore/health", timeout=60)
        except TimeoutError as err:
            raise TimeoutError(f"{name}: {log.read_text(errors='replace')[-2000:]}") from err
        return dashboard

    yield start
    for dashboard in started:
        dashboard.process.send_signal(signal.SIGINT)
        try:
            dashboard.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            dashboard.process.kill()
            dashboard.process.wait(timeout=30)


def _with_passwords(**more: str) -> dict[str, str]:
    return {
        "POSBENCH_DASHBOARD_PASSWORD": OPERATOR_PASSWORD,
        "POSBENCH_DASHBOARD_VIEWER_PASSWORD": VIEWER_PASSWORD,
        **more,
    }


@pytest.fixture(scope="module")
def roles(serve: Callable[..., Dashboard]) -> Dashboard:
    return serve("roles", **_with_passwords())


@pytest.fixture(scope="module")
def backoff(serve: Callable[..., Dashboard]) -> Dashboard:
    # A process of its own: its throttle (per address) does not hold up the other tests.
    return serve("backoff", **_with_passwords())


@pytest.fixture(scope="module")
def expiring(serve: Callable[..., Dashboard]) -> Dashboard:
    return serve("expiring", **_with_passwords(POSBENCH_DASHBOARD_SESSION_HOURS=str(SESSION_HOURS)))


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    browser_path = require_chromium()
    from playwright.sync_api import expect, sync_playwright

    # Assertions wait as long as actions: a loaded 2-core machine is slow to render.
    expect.set_options(timeout=30_000)
    with sync_playwright() as playwright:
        launched = launch(playwright, browser_path)
        yield launched
        launched.close()
    expect.set_options(timeout=5_000)


@pytest.fixture
def new_page(browser: Browser, request: pytest.FixtureRequest) -> Iterator[Callable[[], Page]]:
    """A fresh browser context (a new session, the same client address) per call, with
    Playwright's context ``options`` (headers sent with every request, the WebSocket's
    included); their screenshots go to .posbench/screenshots when the test fails."""
    contexts = []
    failed_before = request.session.testsfailed

    def make(**options) -> Page:
        context = browser.new_context(viewport={"width": 1400, "height": 1000}, **options)
        contexts.append(context)
        page = context.new_page()
        page.set_default_timeout(30_000)
        return page

    yield make
    if request.session.testsfailed > failed_before:
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        for index, context in enumerate(contexts):
            for page in context.pages:
                name = f"login-{request.node.name}-{index}.png"
                page.screenshot(path=SCREENSHOTS / name, full_page=True)
    for context in contexts:
        context.close()


# --- what the browser sees ---


def _settled(page: Page) -> None:
    from playwright.sync_api import expect

    expect(page.get_by_test_id("stApp")).to_have_attribute("data-test-script-state", "notRunning")


def _login_only(page: Page, *, fresh: bool = True) -> None:
    """The page offers a password and nothing of the service; in a ``fresh`` session no
    navigation either (after a logout the browser keeps the links it was sent: following
    one leads to the login again)."""
    from playwright.sync_api import expect

    expect(page.get_by_label("Password", exact=True)).to_be_visible()
    _settled(page)
    expect(page.locator("body")).not_to_contain_text(STUDY)
    expect(page.get_by_text("signed in as")).to_have_count(0)
    expect(page.get_by_role("heading", name="Submit a study")).to_have_count(0)
    expect(page.get_by_role("heading", name="Queue")).to_have_count(0)
    if fresh:
        expect(page.get_by_test_id("stSidebarNav")).to_have_count(0)


def _log_in(page: Page, password: str) -> None:
    page.get_by_label("Password", exact=True).fill(password)
    page.get_by_role("button", name="Log in").click()


def _navigation(page: Page):
    return page.get_by_test_id("stSidebarNav").get_by_role("link")


def _to_the_queue(page: Page) -> None:
    """From an operator's landing page (Submit, once it has rendered) to the Queue."""
    from playwright.sync_api import expect

    expect(page.get_by_role("heading", name="Submit a study")).to_be_visible()
    _settled(page)
    _navigation(page).get_by_text("Queue").click()
    expect(page.get_by_role("main")).to_contain_text(f"{STUDY} · task lm")


def _attempt(page: Page, dashboard: Dashboard, password: str) -> str:
    """One login attempt, returned once decided: "failed" (the password was checked, and
    wrong: the server logs it), "refused" (not checked, backing off: logged too) or "in"."""
    failed, refused = dashboard.said(FAILED), dashboard.said(REFUSED)
    _log_in(page, password)
    signed_in = page.get_by_text("signed in as")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if dashboard.said(FAILED) > failed:
            return "failed"
        if dashboard.said(REFUSED) > refused:
            return "refused"
        if signed_in.count():
            return "in"
        time.sleep(0.02)
    raise TimeoutError(f"no decision; the server's log:\n{dashboard.log.read_text()[-2000:]}")


def _wait_shown(page: Page) -> int:
    """The N of the "try again in N s" the page shows."""
    from playwright.sync_api import expect

    error = page.get_by_text(re.compile(r"Too many wrong passwords: try again in \d+ s\."))
    expect(error).to_be_visible()
    found = re.search(r"in (\d+) s", error.inner_text())
    assert found is not None
    return int(found.group(1))


# --- finding 5: a login before anything, slowed down after wrong passwords ---


def test_only_a_login_shows_before_a_password(roles: Dashboard, new_page) -> None:
    page = new_page()
    for path in ("/", "/queue", "/submit", "/queue?study=1"):
        page.goto(roles.base + path)
        _login_only(page)


def test_wrong_passwords_are_slowed_down_per_session_and_per_address(
    backoff: Dashboard, new_page
) -> None:
    from playwright.sync_api import expect

    page = new_page()
    page.goto(backoff.base)
    _login_only(page)
    for _ in range(FREE_ATTEMPTS):
        assert _attempt(page, backoff, "wrong") == "failed"
        expect(page.get_by_text("Wrong password.")).to_be_visible()
    third = time.monotonic()
    # Backing off (1 s now), even the right password is not checked.
    assert _attempt(page, backoff, OPERATOR_PASSWORD) == "refused"
    assert _wait_shown(page) == 1
    _login_only(page)
    # A burst from a new session at the same address: only the attempts the back-off lets
    # through are checked at all, k of them needing 1 + 2 + ... + 2**(k-1) = 2**k - 1
    # seconds after the third wrong password (it was 40 checked in 0.4 s).
    other = new_page()
    other.goto(backoff.base)
    _login_only(other)
    outcomes = [_attempt(other, backoff, f"guess-{n}") for n in range(BURST)]
    elapsed = time.monotonic() - third
    checked = outcomes.count("failed")
    assert backoff.said(FAILED) == FREE_ATTEMPTS + checked
    assert checked <= math.log2(elapsed + 1) + 1, (outcomes, elapsed)
    assert outcomes.count("refused") > BURST // 2, (outcomes, elapsed)
    # Per address: this session had its own free attempts left when it was first refused.
    assert outcomes[: outcomes.index("refused")].count("failed") < FREE_ATTEMPTS, outcomes
    _login_only(other)
    # The right password opens it once the back-off is over.
    for _ in range(3):
        outcome = _attempt(other, backoff, OPERATOR_PASSWORD)
        if outcome != "refused":
            break
        wait = _wait_shown(other)
        assert 1 <= wait <= 2**checked
        _login_only(other)
        time.sleep(wait + 0.2)
    assert outcome == "in"
    expect(other.get_by_role("heading", name="Submit a study")).to_be_visible()
    print(f"burst of {BURST}: {outcomes} in {elapsed:.1f} s after the third wrong password")


# --- the fourth audit's G2: a client address named in X-Forwarded-For ---

FORGED = "203.0.113."  # the documentation range the claimed addresses come from
CEILING = 3  # wrong passwords per minute, all clients together, behind the trusted proxy


@pytest.fixture(scope="module")
def forged(serve: Callable[..., Dashboard]) -> Dashboard:
    return serve("forged", **_with_passwords())


@pytest.fixture(scope="module")
def proxied(serve: Callable[..., Dashboard]) -> Dashboard:
    # Behind a proxy on this machine that it trusts: X-Forwarded-For names the client.
    return serve(
        "proxied",
        **_with_passwords(
            POSBENCH_DASHBOARD_TRUSTED_PROXIES="127.0.0.1",
            POSBENCH_DASHBOARD_WRONG_PASSWORDS_PER_MINUTE=str(CEILING),
        ),
    )


def _claiming(new_page, dashboard: Dashboard, address: str) -> Page:
    """A fresh session whose every request (the WebSocket's too) says it forwards for
    ``address``, at the login."""
    page = new_page(extra_http_headers={"X-Forwarded-For": address})
    page.goto(dashboard.base)
    _login_only(page)
    return page


def _newest_event(dashboard: Dashboard) -> tuple[str, str]:
    from db import queries

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        newest = queries.events(dashboard.database, None, 1).to_dict("records")
        if newest and newest[0]["action"] != "submit":  # the seeded study's
            return newest[0]["actor"], newest[0]["action"]
        time.sleep(0.2)
    raise TimeoutError("no event recorded")


def test_a_client_address_claimed_in_a_header_is_not_believed(forged: Dashboard, new_page) -> None:
    # The audit: uvicorn believed X-Forwarded-For from any loopback peer; 30 wrong
    # passwords, each under an address of its own, were all checked, and the right one
    # logged in as "dashboard operator from 203.0.113.99".
    from playwright.sync_api import expect

    pages = [_claiming(new_page, forged, f"{FORGED}{n}") for n in range(FREE_ATTEMPTS + 1)]
    outcomes = [_attempt(page, forged, "wrong") for page in pages]
    # One client (this machine), whatever each session claims: its address backs off.
    assert outcomes == ["failed"] * FREE_ATTEMPTS + ["refused"], outcomes
    page = pages[-1]
    time.sleep(_wait_shown(page) + 0.2)
    assert _attempt(page, forged, OPERATOR_PASSWORD) == "in"
    expect(page.get_by_text("signed in as operator")).to_be_visible()
    _to_the_queue(page)
    page.get_by_role("button", name="Cancel study").click()
    assert _newest_event(forged) == ("dashboard operator", "cancel")  # the role, no address
    assert forged.said(f"{FAILED} local (") == FREE_ATTEMPTS
    assert FORGED not in forged.log.read_text()


def test_behind_a_trusted_proxy_clients_are_named_and_share_a_ceiling(
    proxied: Dashboard, new_page
) -> None:
    from playwright.sync_api import expect

    pages = [_claiming(new_page, proxied, f"{FORGED}{n}") for n in range(CEILING + 1)]
    outcomes = [_attempt(page, proxied, "wrong") for page in pages]
    # Every session and every address had its free attempts left: the ceiling refused.
    assert outcomes == ["failed"] * CEILING + ["refused"], outcomes
    everyone = re.compile(
        r"Too many wrong passwords on this dashboard in the last minute, from everyone: "
        r"try again in \d+ s\."
    )
    expect(pages[-1].get_by_text(everyone)).to_be_visible()
    for n in range(CEILING):
        assert proxied.said(f"{FAILED} {FORGED}{n} (1 wrong in a row)") == 1
    refused = f"{REFUSED} {FORGED}{CEILING}: {CEILING} wrong passwords in the last minute"
    assert proxied.said(refused) == 1


# --- roles: a viewer reads, an operator acts ---

OPERATOR_BUTTONS = ("Cancel study", "Retry failed / cancelled", "Cancel run", "Retry run")


def test_a_viewer_reads_the_queue_but_has_no_actions(roles: Dashboard, new_page) -> None:
    from playwright.sync_api import expect

    page = new_page()
    page.goto(roles.base)
    _log_in(page, VIEWER_PASSWORD)
    expect(page.get_by_role("heading", name="Queue", level=1)).to_be_visible()
    expect(page.get_by_role("main")).to_contain_text(f"{STUDY} · task lm")
    _settled(page)
    expect(page.get_by_text("signed in as viewer")).to_be_visible()
    expect(_navigation(page)).to_have_text(["Queue", "Compare", "Explore"])  # no Submit
    for label in (*OPERATOR_BUTTONS, "Delete study"):
        expect(page.get_by_role("button", name=label)).to_have_count(0)
    expect(page.get_by_text("Delete study")).to_have_count(0)  # nor its expander
    # The Submit page's own URL offers no form to a viewer either.
    page.goto(f"{roles.base}/submit")
    _login_only(page)
    _log_in(page, VIEWER_PASSWORD)
    expect(page.get_by_role("heading", name="Queue", level=1)).to_be_visible()
    _settled(page)
    expect(page.get_by_role("heading", name="Submit a study")).to_have_count(0)
    expect(page.get_by_role("button", name="Submit")).to_have_count(0)
    expect(page.get_by_role("combobox", name="Start from")).to_have_count(0)


def test_an_operator_may_delete(roles: Dashboard, new_page) -> None:
    from playwright.sync_api import expect

    page = new_page()
    page.goto(roles.base)
    _log_in(page, OPERATOR_PASSWORD)
    expect(page.get_by_role("heading", name="Submit a study")).to_be_visible()
    expect(_navigation(page)).to_have_text(["Submit", "Queue", "Compare", "Explore"])
    _navigation(page).get_by_text("Queue").click()
    expect(page.get_by_role("main")).to_contain_text(f"{STUDY} · task lm")
    for label in OPERATOR_BUTTONS[:2]:
        expect(page.get_by_role("button", name=label)).to_be_visible()
    page.get_by_text("Delete study", exact=True).first.click()  # open the expander
    delete = page.get_by_role("button", name="Delete study")
    expect(delete).to_be_disabled()  # not without the tick
    page.get_by_text("Delete study 1 with its", exact=False).click()
    expect(delete).to_be_enabled()


# --- logout and expiry ---


def test_logging_out_returns_to_the_login_for_good(roles: Dashboard, new_page) -> None:
    from playwright.sync_api import expect

    page = new_page()
    page.goto(f"{roles.base}/queue")
    _log_in(page, OPERATOR_PASSWORD)
    expect(page.get_by_text("signed in as operator")).to_be_visible()
    page.get_by_role("button", name="Log out").click()
    _login_only(page, fresh=False)
    _navigation(page).get_by_text("Queue").click()
    _login_only(page, fresh=False)
    page.reload()
    _login_only(page)
    page.goto(f"{roles.base}/queue")
    _login_only(page)


def test_an_expired_session_asks_for_the_password_again(expiring: Dashboard, new_page) -> None:
    from playwright.sync_api import expect

    warm = new_page()  # the first render of a fresh process is slow: not the timed one
    warm.goto(expiring.base)
    _log_in(warm, OPERATOR_PASSWORD)
    expect(warm.get_by_role("heading", name="Submit a study")).to_be_visible()
    page = new_page()
    page.goto(expiring.base)
    _login_only(page)
    _log_in(page, OPERATOR_PASSWORD)
    expect(page.get_by_role("heading", name="Submit a study")).to_be_visible()  # logged in
    time.sleep(SESSION_HOURS * 3600 + 0.3)  # the login is older than that now
    _navigation(page).get_by_text("Queue").click()  # the next interaction, same session
    expect(page.get_by_text("Your session expired: log in again.")).to_be_visible()
    _login_only(page, fresh=False)


# --- the fourth audit's G4: the Queue's live runs rerun without the page's gate ---


@pytest.fixture(scope="module")
def ending(serve: Callable[..., Dashboard]) -> Dashboard:
    # Long enough to see the live runs first on a loaded machine, short enough to wait.
    return serve("ending", **_with_passwords(POSBENCH_DASHBOARD_SESSION_HOURS="0.004"))


def test_the_live_runs_end_with_the_login(ending: Dashboard, new_page) -> None:
    from playwright.sync_api import expect

    from dashboard.auth import SESSION_ENDED

    page = new_page()
    page.goto(ending.base)
    _log_in(page, OPERATOR_PASSWORD)
    _to_the_queue(page)
    live = page.get_by_text(re.compile(r"refreshed every 2s"))  # the fragment's caption
    expect(live).to_be_visible()
    logged_in = time.monotonic()
    # Nothing more is done on the page: only the fragment's own reruns reach the server.
    expect(page.get_by_text(SESSION_ENDED)).to_be_visible()
    assert time.monotonic() - logged_in < 0.004 * 3600 + 2 * 5  # its first rerun past it
    expect(live).to_have_count(0)
    expect(page.get_by_text("Provenance")).to_have_count(0)
    expect(page.get_by_role("heading", name="Queue", level=1)).to_be_visible()  # the page's


# --- audit F10: a login bound to a cookie that no script and no replayed header holds ---

BINDING = "posbench_browser"
# Streamlit's WebSocket opened as a reconnect opens it, but with the session id given:
# its subprotocols are "streamlit", the XSRF cookie's value and the session id.
REPLAY = """
(() => {
  const Native = window.WebSocket;
  window.WebSocket = class extends Native {
    constructor(url, protocols) { super(url, [...protocols.slice(0, 2), %s]); }
  };
})();
"""


def _session_ids(page: Page) -> list[str]:
    """The Streamlit session ids the server gives ``page`` (in its NewSession
    messages), filled in as they come."""
    from streamlit.proto.ForwardMsg_pb2 import ForwardMsg

    ids: list[str] = []

    def watch(socket) -> None:
        def received(payload: bytes | str) -> None:
            if isinstance(payload, bytes):
                message = ForwardMsg.FromString(payload)
                if message.HasField("new_session"):
                    ids.append(message.new_session.initialize.session_id)

        socket.on("framereceived", received)

    page.on("websocket", watch)
    return ids


def _replaying(new_page, dashboard: Dashboard, session: str, agent: str, cookies) -> Page:
    """Another browser with the User-Agent ``agent`` and ``cookies`` (Playwright's
    cookie records) that opens the dashboard with Streamlit session ``session``."""
    page = new_page(user_agent=agent)
    page.context.add_cookies(cookies)
    page.context.add_init_script(REPLAY % json.dumps(session))
    page.goto(dashboard.base)
    return page


def test_a_session_replayed_without_the_binding_cookie_is_logged_out(
    roles: Dashboard, new_page
) -> None:
    # The audit: the XSRF cookie (readable by the page's scripts, and sent in the
    # WebSocket's header beside the session id) and the User-Agent were the binding;
    # replaying them with the session id gave "signed in as operator".
    from playwright.sync_api import expect

    victim = new_page()
    sessions = _session_ids(victim)
    victim.goto(roles.base)
    _log_in(victim, OPERATOR_PASSWORD)
    expect(victim.get_by_text("signed in as operator")).to_be_visible()
    held = {cookie["name"]: cookie for cookie in victim.context.cookies()}
    assert held[BINDING]["httpOnly"] and held[BINDING]["sameSite"] == "Strict"
    scripts_see = victim.evaluate("document.cookie")
    assert "_streamlit_xsrf=" in scripts_see and BINDING not in scripts_see
    agent = victim.evaluate("navigator.userAgent")
    (session,) = set(sessions)
    # With every cookie the victim's browser holds, the replay resumes the login: what
    # remains (docs/security.md), and the proof that the replay itself works.
    thief = _replaying(new_page, roles, session, agent, list(held.values()))
    expect(thief.get_by_text("signed in as operator")).to_be_visible()
    # With what the page's scripts and the WebSocket's header give away, it does not.
    replay = _replaying(new_page, roles, session, agent, [held["_streamlit_xsrf"]])
    _login_only(replay, fresh=False)
    assert roles.said("dashboard session used from another browser than its login") >= 1
    thief.reload()
    _login_only(thief, fresh=False)  # the login it rode on is over


# --- finding 1: `streamlit run` by hand, no login ---


def test_a_bare_streamlit_run_without_a_login_shows_only_why_it_is_closed(
    serve: Callable[..., Dashboard], new_page
) -> None:
    from playwright.sync_api import expect

    open_ = serve("bare", bare=True)
    page = new_page()
    for path in ("/", "/queue", "/submit"):
        page.goto(open_.base + path)
        expect(page.get_by_text(CLOSED)).to_be_visible()
        _settled(page)
        expect(page.locator("body")).not_to_contain_text(STUDY)
        expect(page.get_by_test_id("stSidebarNav")).to_have_count(0)
        expect(page.get_by_role("main").get_by_role("button")).to_have_count(0)  # no login
        expect(page.get_by_label("Password", exact=True)).to_have_count(0)
    assert open_.said(CLOSED) >= 3  # logged, once per visit
