"""What every page shares: the database URL, query-parameter helpers, figure styling."""

from __future__ import annotations

import re

import streamlit as st

from jobs.settings import get_settings


def database() -> str:
    return get_settings().database


def query_ints(name: str) -> list[int]:
    """Integers from a comma-separated query parameter (ignoring anything malformed)."""
    raw = st.query_params.get(name, "")
    # ASCII digits only ('²'.isdigit() is true, int() refuses it), and ids fit the
    # database's 64-bit integers.
    digits = (part.strip() for part in raw.split(","))
    return [int(part) for part in digits if re.fullmatch(r"[0-9]{1,18}", part)]


def set_query(name: str, values: list[int] | list[str] | str | None) -> None:
    if not values:
        st.query_params.pop(name, None)
    elif isinstance(values, str):
        st.query_params[name] = values
    else:
        st.query_params[name] = ",".join(str(v) for v in values)


def schema_ready() -> bool:
    """False (with a message) when the database has no schema yet."""
    from db.migrate import current

    try:
        if current(database()) is not None:
            return True
    except Exception as err:
        st.error(f"cannot reach the database: {err}")
        return False
    st.warning("The database has no schema yet: run `posbench db upgrade` (posbench up does it).")
    return False
