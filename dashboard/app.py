"""posbench dashboard: `streamlit run dashboard/app.py` (posbench up starts it)."""

from __future__ import annotations

import streamlit as st

from dashboard import auth, compare_page, explore_page, queue_page, submit_page
from dashboard.common import page_errors

st.set_page_config(page_title="posbench", page_icon="📐", layout="wide")

if auth.gate():
    operator = auth.can_operate()
    submit = st.Page(submit_page.render, title="Submit", url_path="submit")
    queue = st.Page(queue_page.render, title="Queue", url_path="queue")
    first = submit if operator else queue  # a viewer has no Submit page

    def landing() -> None:
        st.switch_page(first, query_params=st.query_params.to_dict())

    pages = [
        # Streamlit serves the default page at "/" and ignores its url_path, so a default
        # Submit page would answer "Page not found" at /submit. A hidden landing page
        # owns "/" instead and hands over to Submit (the sidebar then marks Submit).
        st.Page(landing, title="posbench", url_path="home", default=True, visibility="hidden"),
        *([submit] if operator else []),
        queue,
        st.Page(compare_page.render, title="Compare", url_path="compare"),
        st.Page(explore_page.render, title="Explore", url_path="explore"),
    ]
    with page_errors():
        st.navigation(pages).run()
