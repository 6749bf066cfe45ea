"""Showing what others wrote, safely: every user string (a study's name, a label, a
failure reason, a parameter) as text, never as Rich markup or Markdown, and every URL
without its password (DESIGN.md, the security contract).

The one place the dashboard and the services escape and redact: torch-free and
Streamlit-free, so any layer above may use it. The terminal needs no escaping: its
consoles never read markup (``core.terminal``).
"""

from __future__ import annotations

import re
import string
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.text import Text

HIDDEN = "***"

# Any ASCII punctuation may be backslash-escaped in CommonMark, and an escaped one is
# always literal: no emphasis, link, image, code, heading, list, table or HTML (and no
# Streamlit directive such as :red[...] or $math$).
_MARKDOWN_SPECIAL = re.compile("([" + re.escape(string.punctuation) + "])")

# scheme://user:password@ inside any text (an error message quoting a URL); the password
# runs to the token's last "@", so one containing "@" is hidden whole.
_USERINFO = re.compile(
    r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.\-]*://)(?P<user>[^\s:/@]*):(?P<password>\S*)@"
)

# A password in the query string: libpq takes ?password= (and ?sslpassword=, the TLS key's),
# redis-py ?password= (and ?ssl_password=). Hidden up to the next parameter or fragment
# (in text also up to a quote or a space), whatever it holds; ?passfile= names a file.
_QUERY_KEY = r"(?P<key>[?&][A-Za-z0-9_.\-]*pass(?:word|wd)?=)"
_QUERY_PASSWORD = re.compile(_QUERY_KEY + r"[^&#]*", re.IGNORECASE)
_QUERY_PASSWORD_IN_TEXT = re.compile(_QUERY_KEY + r"[^&#\s'\"]*", re.IGNORECASE)


def text(value: object) -> Text:
    """``value`` as a Rich ``Text``: a table cell or a renderable that is never parsed
    as markup."""
    from rich.text import Text

    return Text(str(value))


def markdown(value: object) -> str:
    """``value`` escaped for a Markdown element (``st.markdown``, ``st.caption``,
    ``st.error``, ``st.toast``, ``st.write``): shown exactly as written. Line breaks
    become spaces (a user string is one line)."""
    one_line = " ".join(str(value).splitlines())
    return _MARKDOWN_SPECIAL.sub(r"\\\1", one_line)


def plot_text(value: object) -> str:
    """``value`` for any text of a Plotly figure (a trace's name, a title, an axis label,
    a hover template): Plotly reads ``<a href>``, ``<b>`` and the like in all of them, and
    ``%{...}`` in a hover template. Escaped as entities, which it shows as the characters
    they stand for: the text exactly as written."""
    return (
        str(value)
        .replace("&", "&amp;")
        .replace("<", "&lt;")
        .replace(">", "&gt;")
        .replace("%", "&#37;")
    )


def redact_url(url: str) -> str:
    """``url`` with its password hidden: ``redis://:secret@host/0`` ->
    ``redis://:***@host/0``, ``postgresql://me:secret@db/x`` -> ``postgresql://me:***@db/x``,
    ``postgresql://me@db/x?password=secret`` -> ``postgresql://me@db/x?password=***``.
    A URL without a password is returned as it is."""
    url = _QUERY_PASSWORD.sub(rf"\g<key>{HIDDEN}", url)
    scheme, separator, rest = url.partition("://")
    userinfo, at, host = rest.rpartition("@")
    if not separator or not at or ":" not in userinfo:
        return url
    user = userinfo.split(":", 1)[0]
    return f"{scheme}://{user}:{HIDDEN}@{host}"


def redact_urls(message: str) -> str:
    """``message`` (an error, a log line) with the password of every URL in it hidden."""
    message = _QUERY_PASSWORD_IN_TEXT.sub(rf"\g<key>{HIDDEN}", message)
    return _USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:{HIDDEN}@", message)


def error_summary(err: BaseException, what: str = "the database") -> str:
    """A line a viewer may read about a failure of ``what``: its kind, never its text
    (which names hosts, users and sometimes passwords; log that instead)."""
    return (
        f"{what} could not be reached or read ({type(err).__name__}); the server log has "
        "the details"
    )
