"""Access control (docs/security.md): the login before anything shows, the role of the
visitor, logout and session expiry. The decisions are ``jobs.access``'s.

- no login configured: loopback only (`posbench dashboard` refuses other binds, and
  the gate shows only "closed" when ``server.address`` is not loopback, as with a bare
  `streamlit run`), and the visitor is an operator;
- ``POSBENCH_DASHBOARD_PASSWORD`` / ``POSBENCH_DASHBOARD_VIEWER_PASSWORD``: a password
  form, slowed down after wrong passwords (per session, per client address, and past a
  ceiling per minute for all clients together);
- an OIDC provider in ``.streamlit/secrets.toml`` (``[auth]``): ``st.login``, then the
  allow-lists decide the role; a secrets file that cannot be parsed closes the dashboard.

A password login is bound to the browser's binding cookie (``dashboard.binding``),
checked on every rerun; every fragment (``fragment``) checks the login before each of
its runs, which skip the gate.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import time
import uuid
from collections.abc import Callable
from typing import ParamSpec

import streamlit as st

from core.safe_text import markdown
from core.settings import Settings, get_settings
from dashboard import binding
from dashboard.common import page_errors
from jobs.access import (
    OPERATOR,
    THROTTLE,
    Role,
    Secrets,
    closed_open_message,
    login_forgets_failures,
    oidc_role,
    password_configured,
    password_role,
    read_secrets,
    served_openly,
    session_expired,
)

log = logging.getLogger("posbench.dashboard.auth")
P = ParamSpec("P")

ROLE = "posbench_role"
LOGGED_IN_AT = "posbench_logged_in_at"
SESSION_ID = "posbench_session_id"
ACTOR = "posbench_actor"
BROWSER = "posbench_browser"  # a hash of the binding cookie of the browser that logged in


def _secrets() -> Secrets:
    return read_secrets(st.get_option("secrets.files") or ())


def gate() -> bool:
    """True when the visitor may see the dashboard (``role()`` then says what they may
    do); otherwise render a login (or the reason it is closed) and return False."""
    settings = get_settings()
    secrets = _secrets()
    if secrets.broken is not None:
        log.error("dashboard closed: cannot parse %s: %s", secrets.broken, secrets.error)
        st.title("posbench")
        st.error(
            "The dashboard is closed: its secrets file cannot be parsed "
            "(the server log says which file and why)."
        )
        return False
    if secrets.oidc:
        return _oidc_gate()
    if not password_configured(settings):
        return _open_gate()
    return _password_gate()


def _open_gate() -> bool:
    """No login configured: the visitor is an operator, but only on loopback. `posbench
    dashboard` refuses other binds; `streamlit run` started by hand (whose default binds
    every interface) is closed here."""
    address = st.get_option("server.address")
    if served_openly(address):
        message = closed_open_message(address)
        log.error("%s", message)
        st.session_state.pop(ROLE, None)
        st.title("posbench")
        st.error(markdown(message))
        return False
    st.session_state[ROLE] = OPERATOR
    return True


SESSION_ENDED = "Your session ended: reload the page to log in again."


def admitted() -> bool:
    """Whether this session may still see the dashboard, decided as ``gate`` decides but
    rendering nothing, for what reruns without the gate (a fragment): the role the gate
    gave; for a password login, its age and its browser (a login that fails them is
    ended); for OIDC, the account, its allow-list and its age; with no login, the bind."""
    settings = get_settings()
    secrets = _secrets()
    if secrets.broken is not None:
        return False
    if secrets.oidc:
        if not st.user.is_logged_in or st.session_state.get(ROLE) is None:
            return False
        user = st.user.to_dict()
        return oidc_role(user, settings) is not None and not _oidc_expired(user, settings)
    if not password_configured(settings):
        return not served_openly(st.get_option("server.address"))
    if st.session_state.get(ROLE) is None:
        return False
    if session_expired(st.session_state.get(LOGGED_IN_AT), settings) or not _same_browser():
        _logout()
        return False
    return True


def fragment(*, run_every: float | None = None) -> Callable[[Callable[P, None]], Callable[P, None]]:
    """``st.fragment`` for the dashboard, which `make lint` (lint/fragments.py) allows
    nowhere else in it: a fragment's own reruns skip the page and its gate (the fourth
    audit's G4: a client with only the session id got the Queue's runs table, and an open
    tab kept refreshing past the login's expiry), so each of its runs asks ``admitted``
    first and shows only ``SESSION_ENDED`` when not; then it runs inside the page's error
    boundary (``page_errors``)."""

    def guard(body: Callable[P, None]) -> Callable[P, None]:
        @functools.wraps(body)
        def guarded(*args: P.args, **kwargs: P.kwargs) -> None:
            if not admitted():
                st.info(SESSION_ENDED)
                return
            with page_errors():
                body(*args, **kwargs)

        return st.fragment(guarded, run_every=run_every)

    return guard


def role() -> Role | None:
    """The visitor's role; a page rendered without the gate (tests) is an operator's only
    when no login is configured and the dashboard is served on loopback."""
    given = st.session_state.get(ROLE)
    if given is not None:
        return given
    secrets = _secrets()
    if (
        secrets.broken is None
        and not secrets.oidc
        and not password_configured(get_settings())
        and not served_openly(st.get_option("server.address"))
    ):
        return OPERATOR
    return None


def actor() -> str:
    """Who acts, as the audit trail and the per-submitter quota name them: the OIDC
    e-mail; for a password, the role it gave (``dashboard operator``: whoever holds the
    operators' password shares one quota), never the client's address, which a visitor
    can choose (the fourth audit's G5) and which goes to the server's log only; the
    loopback operator when no login is configured."""
    given = st.session_state.get(ACTOR)
    if isinstance(given, str) and given:
        return given
    return f"dashboard {role() or 'visitor'} (no login)"


def can_operate() -> bool:
    """Whether the visitor may submit, cancel, retry and delete."""
    return role() == OPERATOR


def _logout() -> None:
    for key in (ROLE, LOGGED_IN_AT, ACTOR, BROWSER):
        st.session_state.pop(key, None)


def browser() -> str | None:
    """What the connection's browser holds and neither its scripts nor a replayed
    session id carry (audit F10): a hash of its binding cookie (``dashboard.binding``);
    "" when the connection brought none; None when the script runs without a connection
    (a test's AppTest, whose requests have no headers at all)."""
    try:
        headers, cookies = st.context.headers, st.context.cookies
    except Exception:  # no runtime at all
        return None
    if not headers:
        return None
    cookie = cookies.get(binding.COOKIE)
    if not binding.well_formed(cookie):
        return ""
    return hashlib.sha256(cookie.encode()).hexdigest()


def _same_browser() -> bool:
    """False, logged, when this connection's browser is not the one that logged in (a
    login is never bound to "": a connection without the cookie cannot log in)."""
    if st.session_state.get(BROWSER) == browser():
        return True
    log.warning(
        "dashboard session used from another browser than its login, from %s: logged out",
        client_address(),
    )
    return False


def _signed_in_sidebar(who: str, on_logout) -> None:
    with st.sidebar:
        st.caption(f"signed in as {markdown(who)}")
        st.button("Log out", key="logout", on_click=on_logout)


def client_address() -> str:
    """The client's address as the server saw the connection (``local`` on loopback or
    without one): for the server's log and the throttle, never for who acts."""
    try:
        address = st.context.ip_address
    except Exception:  # no request context
        address = None
    return address if isinstance(address, str) and address else "local"


def _client() -> tuple[str, list[str]]:
    """The client's address and the throttle's keys."""
    session = st.session_state.setdefault(SESSION_ID, uuid.uuid4().hex)
    address = client_address()
    return address, [f"session:{session}", f"address:{address}"]


def _password_gate() -> bool:
    settings = get_settings()
    current = st.session_state.get(ROLE)
    expired = False
    if current is not None:
        if not session_expired(st.session_state.get(LOGGED_IN_AT), settings) and _same_browser():
            _signed_in_sidebar(current, _logout)
            return True
        _logout()
        expired = True
    st.title("posbench")
    if expired:
        st.info("Your session expired: log in again.")
    address, keys = _client()
    with st.form("login"):
        given = st.text_input("Password", type="password")
        if st.form_submit_button("Log in"):
            per_minute = settings.dashboard_wrong_passwords_per_minute
            crowded = THROTTLE.crowded(per_minute)
            if crowded > 0:
                log.warning(
                    "dashboard login refused from %s: %d wrong passwords in the last minute "
                    "from all clients, backing off %d s",
                    address,
                    per_minute,
                    math.ceil(crowded),
                )
                st.error(
                    "Too many wrong passwords on this dashboard in the last minute, from "
                    f"everyone: try again in {math.ceil(crowded)} s."
                )
                return False
            wait = THROTTLE.wait(keys)
            if wait > 0:
                log.warning(
                    "dashboard login refused from %s: backing off %d s", address, math.ceil(wait)
                )
                st.error(f"Too many wrong passwords: try again in {math.ceil(wait)} s.")
                return False
            held = browser()
            if held == "":
                log.warning(
                    "dashboard login refused from %s: the connection brought no %s cookie "
                    "(cookies blocked, or a dashboard not started from dashboard/serve.py)",
                    address,
                    binding.COOKIE,
                )
                st.error(
                    "This browser did not keep the dashboard's cookie, which a login needs: "
                    "allow cookies for this site and reload the page."
                )
                return False
            found = password_role(given, settings)
            if found is None:
                failures = THROTTLE.failed(keys)
                log.warning("dashboard login failed from %s (%d wrong in a row)", address, failures)
                st.error("Wrong password.")
                return False
            if login_forgets_failures(found):
                THROTTLE.succeeded(keys)
            log.info("dashboard login from %s as %s", address, found)
            st.session_state[ROLE] = found
            st.session_state[LOGGED_IN_AT] = time.time()
            st.session_state[BROWSER] = held
            st.session_state[ACTOR] = f"dashboard {found}"
            st.rerun()
    return False


def _oidc_gate() -> bool:
    settings = get_settings()
    st.session_state.pop(ROLE, None)
    st.session_state.pop(ACTOR, None)
    if not st.user.is_logged_in:
        st.title("posbench")
        st.button("Log in", on_click=st.login)
        return False
    user = st.user.to_dict()
    found = oidc_role(user, settings)
    email = str(user.get("email", ""))
    if found is None:
        log.warning("dashboard login refused: %r is on no allow-list", email)
        st.title("posbench")
        st.error(
            "This account is not allowed here: an administrator adds it (or its domain) to "
            "POSBENCH_DASHBOARD_OPERATORS or POSBENCH_DASHBOARD_VIEWERS."
        )
        st.button("Log out", on_click=st.logout)
        return False
    if _oidc_expired(user, settings):
        log.info("dashboard session of %r expired", email)
        st.logout()
        return False
    st.session_state[ROLE] = found
    st.session_state[ACTOR] = email
    _signed_in_sidebar(f"{email} ({found})", st.logout)
    return True


def _oidc_expired(user: dict[str, object], settings: Settings) -> bool:
    """Whether an OIDC login is older than the session lasts (its ID token's ``iat``)."""
    issued = user.get("iat")
    return isinstance(issued, int | float) and session_expired(float(issued), settings)
