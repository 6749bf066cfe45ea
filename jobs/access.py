"""Who may use the dashboard, and how: the decisions behind its login, free of Streamlit
so that the CLI (`posbench dashboard` refuses to serve the network open) and the
dashboard's gate share them and tests can call them directly.

- a bind is safe without a login only on loopback (or a unix socket): `posbench dashboard`
  refuses the others, and the dashboard itself shows nothing when started by other
  means (`streamlit run`, whose default binds every interface);
- a secrets file that exists but cannot be parsed closes the dashboard (it may be the
  file that configures the login);
- a password gives the operator or the viewer role; wrong ones slow the next attempt
  down exponentially, per session and per client address, and past
  ``POSBENCH_DASHBOARD_WRONG_PASSWORDS_PER_MINUTE`` in a minute from all clients together
  no password is checked until the minute has passed;
- an OIDC account gets a role only from the allow-lists (e-mails or domains);
- a login lasts ``POSBENCH_DASHBOARD_SESSION_HOURS``.
"""

from __future__ import annotations

import hmac
import ipaddress
import socket
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import tomllib

from core.settings import Settings

Role = Literal["operator", "viewer"]
OPERATOR: Role = "operator"
VIEWER: Role = "viewer"

FREE_ATTEMPTS = 3  # wrong passwords before the back-off starts
MAX_BACKOFF_SECONDS = 300.0  # the longest wait between two attempts
FORGET_AFTER_SECONDS = 86_400.0  # a key silent this long starts afresh
MAX_KEYS = 10_000  # the oldest keys are forgotten beyond this (bounded memory)
MINUTE = 60.0  # the window of the dashboard-wide ceiling on wrong passwords

DASHBOARD_DIR = Path(__file__).resolve().parent.parent / "dashboard"


def is_loopback(address: str) -> bool:
    """True when every address ``address`` resolves to is a loopback one (127.0.0.0/8,
    ::1); ``0.0.0.0``, ``::`` and ``""`` (all interfaces) are not."""
    if not address.strip():
        return False
    try:
        infos = socket.getaddrinfo(address, None)
    except (socket.gaierror, UnicodeError):
        return False
    hosts = {info[4][0] for info in infos}
    try:
        return bool(hosts) and all(
            ipaddress.ip_address(h.split("%", 1)[0]).is_loopback for h in hosts
        )
    except ValueError:
        return False


UNIX_SOCKET = "unix://"  # Streamlit's prefix for a server.address that is a unix socket


def served_openly(address: str | None) -> bool:
    """Whether a Streamlit server whose ``server.address`` option is ``address`` can be
    reached from other machines: unset or empty (Streamlit's default) binds every
    interface; a unix socket and a loopback address do not leave this machine."""
    if address is None or not address.strip():
        return True
    if address.startswith(UNIX_SOCKET):
        return False
    return not is_loopback(address)


def closed_open_message(address: str | None) -> str:
    """The one line an open dashboard without a login shows instead of anything else."""
    everywhere = address is None or address.strip() in ("", "0.0.0.0", "::")
    return (
        f"The dashboard is closed: it is served on {'all interfaces' if everywhere else address} "
        "without a login; set POSBENCH_DASHBOARD_PASSWORD or bind 127.0.0.1."
    )


# --- the secrets file (Streamlit's .streamlit/secrets.toml, where OIDC is configured) ---


@dataclass(frozen=True)
class Secrets:
    oidc: bool  # an [auth] section exists
    broken: Path | None = None  # a file that exists but cannot be parsed
    error: str = ""


def secrets_files(cwd: Path | None = None) -> list[Path]:
    """Where Streamlit looks for secrets when `posbench dashboard` starts it: the user's,
    the working directory's, and the one beside the dashboard's script."""
    cwd = Path.cwd() if cwd is None else cwd
    paths = [
        Path.home() / ".streamlit" / "secrets.toml",
        cwd / ".streamlit" / "secrets.toml",
        DASHBOARD_DIR / ".streamlit" / "secrets.toml",
    ]
    return list(dict.fromkeys(p.absolute() for p in paths))


def read_secrets(paths: Iterable[str | Path]) -> Secrets:
    """Whether OIDC is configured; a file that exists but is not TOML (or not readable)
    is reported as broken, so the caller fails closed rather than serving open."""
    oidc = False
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            continue
        if path.is_dir():  # Kubernetes-style secrets: one folder per section
            oidc = oidc or (path / "auth").is_dir()
            continue
        try:
            parsed = tomllib.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
            return Secrets(oidc=False, broken=path, error=str(err).splitlines()[0][:200])
        oidc = oidc or isinstance(parsed.get("auth"), dict)
    return Secrets(oidc=oidc)


def password_configured(settings: Settings) -> bool:
    return settings.dashboard_password is not None or settings.dashboard_viewer_password is not None


def serving_problem(address: str, settings: Settings, secrets: Secrets) -> str | None:
    """Why the dashboard must not be served at ``address`` (one line), or None."""
    if secrets.broken is not None:
        return (
            f"the secrets file {secrets.broken} cannot be parsed ({secrets.error}); fix or "
            "remove it: the dashboard does not start without the login it may configure"
        )
    if secrets.oidc and not (settings.dashboard_operators or settings.dashboard_viewers):
        return (
            "OIDC is configured ([auth] in secrets.toml) but nobody is allowed in: set "
            "POSBENCH_DASHBOARD_OPERATORS and/or POSBENCH_DASHBOARD_VIEWERS (e-mails or @domains)"
        )
    if not is_loopback(address) and not (password_configured(settings) or secrets.oidc):
        return (
            f"--address {address} serves the dashboard to the network without a login: set "
            "POSBENCH_DASHBOARD_PASSWORD (or configure OIDC, see docs/security.md), "
            "or bind --address 127.0.0.1"
        )
    return None


# --- roles ---


def password_role(given: str, settings: Settings) -> Role | None:
    """The role a password gives (the operator password first), or None. Both are compared
    in constant time, whichever matches."""
    found: Role | None = None
    for role, secret in (
        (VIEWER, settings.dashboard_viewer_password),
        (OPERATOR, settings.dashboard_password),
    ):
        if secret is not None and hmac.compare_digest(
            given.encode(), secret.get_secret_value().encode()
        ):
            found = role
    return found


def _matches(email: str, entries: Iterable[str]) -> bool:
    domain = email.rpartition("@")[2]
    for entry in entries:
        entry = entry.strip().lower()
        if not entry:
            continue
        if "@" not in entry or entry.startswith("@"):
            if domain == entry.lstrip("@"):
                return True
        elif email == entry:
            return True
    return False


def oidc_role(user: Mapping[str, object], settings: Settings) -> Role | None:
    """The role of an account the OIDC provider vouched for: only an e-mail (verified,
    when the provider says) on an allow-list gets one; operators first."""
    email = user.get("email")
    if not isinstance(email, str) or email.count("@") != 1 or user.get("email_verified") is False:
        return None
    email = email.strip().lower()
    if _matches(email, settings.dashboard_operators):
        return OPERATOR
    if _matches(email, settings.dashboard_viewers):
        return VIEWER
    return None


def session_expired(
    logged_in_at: float | None, settings: Settings, now: float | None = None
) -> bool:
    if logged_in_at is None:
        return True
    now = time.time() if now is None else now
    return now - logged_in_at >= settings.dashboard_session_hours * 3600


# --- back-off after wrong passwords ---


def backoff_seconds(failures: int) -> float:
    """How long after the last wrong password the next attempt waits: nothing for the
    first ``FREE_ATTEMPTS``, then 1, 2, 4, ... seconds, at most ``MAX_BACKOFF_SECONDS``."""
    if failures < FREE_ATTEMPTS:
        return 0.0
    return min(MAX_BACKOFF_SECONDS, 2.0 ** (failures - FREE_ATTEMPTS))


class Throttle:
    """Wrong-password counts by key ("session:<id>", "address:<ip>"), and the times of the
    last minute's wrong passwords from every client: shared by every session of the
    dashboard's process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._failures: dict[str, tuple[int, float]] = {}
        self._recent: deque[float] = deque(maxlen=MAX_KEYS)

    def wait(self, keys: Iterable[str], now: float | None = None) -> float:
        """Seconds before any of ``keys`` may try again (0: now)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            waits = [0.0]
            for key in keys:
                failures, last = self._failures.get(key, (0, now))
                waits.append(last + backoff_seconds(failures) - now)
            return max(waits)

    def crowded(self, per_minute: int, now: float | None = None) -> float:
        """Seconds before the dashboard checks another password, from anyone, when
        ``per_minute`` wrong ones came in the last minute (0: now). The ceiling that
        clients the keys cannot tell apart (many sessions, many machines, addresses a
        trusted proxy was told) do not pass together (the fourth audit's G2)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self._forget_recent(now)
            if len(self._recent) < per_minute:
                return 0.0
            return self._recent[-per_minute] + MINUTE - now

    def failed(self, keys: Iterable[str], now: float | None = None) -> int:
        """Count a wrong password for each key and for the dashboard; the most failures
        of any key."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self._forget(now)
            self._recent.append(now)
            counts = [0]
            for key in keys:
                failures = self._failures.get(key, (0, now))[0] + 1
                self._failures[key] = (failures, now)
                counts.append(failures)
            return max(counts)

    def succeeded(self, keys: Iterable[str]) -> None:
        with self._lock:
            for key in keys:
                self._failures.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._failures.clear()
            self._recent.clear()

    def _forget(self, now: float) -> None:
        self._forget_recent(now)
        stale = [k for k, (_, last) in self._failures.items() if now - last > FORGET_AFTER_SECONDS]
        for key in stale:
            del self._failures[key]
        while len(self._failures) >= MAX_KEYS:
            oldest = min(self._failures, key=lambda k: self._failures[k][1])
            del self._failures[oldest]

    def _forget_recent(self, now: float) -> None:
        while self._recent and now - self._recent[0] >= MINUTE:
            self._recent.popleft()


THROTTLE = Throttle()


def login_forgets_failures(role: Role) -> bool:
    """Whether logging in as ``role`` forgets the wrong passwords before it: only the
    operator's, the highest role. A viewer who knows the viewer password must not reset
    the back-off on guesses at the operator's (or the guesses would run unthrottled)."""
    return role == OPERATOR
