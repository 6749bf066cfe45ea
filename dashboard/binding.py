"""The browser's binding cookie: a secret of posbench's own that a password login is
bound to (docs/security.md, audit F10).

Streamlit's session id is a bearer token, and what its browser sends beside it cannot
bind a login: the WebSocket's ``Sec-WebSocket-Protocol: streamlit, <xsrf cookie>,
<session id>`` header carries the ``_streamlit_xsrf`` cookie's value with the session
id on every reconnect, and the page's scripts can read that cookie. This cookie is
random, HttpOnly (no script of the page reads it, and no header but ``Cookie`` carries
it), SameSite=Strict, Secure when the page came over https, and Path=/ so that the
WebSocket's handshake brings it. ``BindingCookie`` sets it on any HTTP response to a
browser without a well-formed one; ``dashboard.auth`` keeps a hash of it at login and
compares on every rerun and every fragment.
"""

from __future__ import annotations

import re
import secrets

from starlette.datastructures import Headers
from starlette.requests import cookie_parser
from starlette.types import ASGIApp, Message, Receive, Scope, Send

COOKIE = "posbench_browser"
TOKEN_BYTES = 32
WELL_FORMED = re.compile(r"[A-Za-z0-9_-]{43}")  # secrets.token_urlsafe(TOKEN_BYTES)


def well_formed(value: object) -> bool:
    return isinstance(value, str) and WELL_FORMED.fullmatch(value) is not None


def held(scope: Scope) -> str | None:
    """The well-formed binding cookie a request brings, or None."""
    value = cookie_parser(Headers(scope=scope).get("cookie", "")).get(COOKIE)
    return value if well_formed(value) else None


def set_cookie(scope: Scope) -> bytes:
    """A ``Set-Cookie`` header value with a new random token: a session cookie (gone
    when the browser closes, like the Streamlit session it guards)."""
    token = secrets.token_urlsafe(TOKEN_BYTES)
    secure = "; Secure" if scope.get("scheme") == "https" else ""
    return f"{COOKIE}={token}; Path=/; HttpOnly; SameSite=Strict{secure}".encode("latin-1")


class BindingCookie:
    """Pure-ASGI middleware: an HTTP response to a request without a well-formed binding
    cookie sets one (the page's first load does it before its scripts open the
    WebSocket); WebSocket and lifespan traffic passes as it came."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or held(scope) is not None:
            await self.app(scope, receive, send)
            return
        cookie = set_cookie(scope)

        async def send_with_cookie(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", []), (b"set-cookie", cookie)]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_cookie)
