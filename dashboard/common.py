"""What every page shares: the database URL, query-parameter helpers, figure styling,
and the one way a page reports a database error (a summary; the full text in the log)."""

from __future__ import annotations

import contextlib
import logging
import re
import traceback
from collections.abc import Iterator

import streamlit as st

from core.safe_text import error_summary, markdown, redact_urls
from core.settings import get_settings

log = logging.getLogger("posbench.dashboard")


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
        database_error(err)
        return False
    st.warning("The database has no schema yet: run `posbench db upgrade` (posbench up does it).")
    return False


def database_error(err: BaseException) -> None:
    """Tell the viewer the database failed, without its text (hosts, users, sometimes a
    password); the server log has the full text, every URL in it without its password."""
    log.error("database error: %s", redact_urls(str(err)))
    st.error(error_summary(err))


@contextlib.contextmanager
def page_errors() -> Iterator[None]:
    """The dashboard's error boundary, around every page (and each fragment, which reruns
    on its own): a database error becomes ``database_error``'s summary, what a person
    caused (``core.errors.UserError``) its one line, and anything else a note that this
    is a bug, with the traceback in the server log only (URLs without passwords), never
    Streamlit's traceback on the page."""
    from sqlalchemy.exc import SQLAlchemyError

    from core.errors import UserError

    try:
        yield
    except SQLAlchemyError as err:
        database_error(err)
    except UserError as err:
        st.error(markdown(str(err)))
    except Exception as err:  # Streamlit's own stop and rerun are BaseExceptions
        log.error(
            "dashboard page failed: %s",
            redact_urls("".join(traceback.format_exception(err))),
        )
        st.error(
            f"This page hit a bug in posbench ({type(err).__name__}); the server log has "
            "the details. Please report it."
        )


def imported_captions(studies) -> None:
    """Under a selection of studies (``db.queries.studies`` rows): a caption for each
    one whose runs were imported (``posbench import``) rather than trained here."""
    from core.analysis import imported_note
    from db import queries

    counts = queries.imported_runs(database(), [int(i) for i in studies["id"]])
    for row in studies.itertuples():
        if counts.get(int(row.id)):
            st.caption(imported_note(int(row.id), counts[int(row.id)], int(row.runs)))


@st.cache_data(ttl=10, show_spinner=False)
def served_queues() -> dict[str, int] | None:
    """The queues live workers serve, and how many serve each (asked of the broker at
    most every 10 s: each asking waits a second for the workers' answers)."""
    from jobs.routing import live_queues

    return live_queues()


def queue_warning(queue: str) -> None:
    """A warning when no live worker serves ``queue``, naming the queues that have some."""
    from jobs.routing import Routing

    warning = Routing(queue, chosen=False, served=served_queues()).warning()
    if warning:
        st.warning(markdown(warning[0].upper() + warning[1:] + "."))


# A study picker offers at most this many studies (the newest matching its search), so a
# page stays light with 20,000 studies in the database.
PICKER_STUDIES = 200


def picker_studies(key: str, wanted: list[int]):
    """The studies a page's picker offers, newest first: the newest ``PICKER_STUDIES``
    whose name holds the text typed in a search box above it (any case), and the ones
    the page's URL names (``wanted``); a caption says how many more there are. None
    when the database holds no study at all."""
    import pandas as pd

    from db import queries

    url = database()
    total = queries.count_studies(url)
    if total == 0:
        return None
    search = st.text_input(
        "Find studies by name", key=f"{key}:find", max_chars=200, placeholder="any part of a name"
    ).strip()
    studies = queries.studies(url, limit=PICKER_STUDIES, name=search or None)
    named = [i for i in wanted if i not in set(studies["id"])]
    if named:
        studies = pd.concat([queries.studies(url, named), studies], ignore_index=True)
    matching = queries.count_studies(url, name=search) if search else total
    if matching > PICKER_STUDIES:
        which = f"whose name holds “{search}”" if search else "in all"
        st.caption(
            f"The newest {PICKER_STUDIES} of {matching:,} studies {which}; type part of a "
            "name to find the others."
        )
    elif search and matching == 0:
        st.caption(f"No study's name holds “{search}”.")
    return studies
