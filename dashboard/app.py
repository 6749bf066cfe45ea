"""posbench dashboard: `streamlit run dashboard/app.py` (posbench up starts it)."""

from __future__ import annotations

import streamlit as st

from dashboard import auth, compare_page, explore_page, queue_page, submit_page

st.set_page_config(page_title="posbench", page_icon="📐", layout="wide")

if auth.gate():
    pages = [
        st.Page(submit_page.render, title="Submit", url_path="submit", default=True),
        st.Page(queue_page.render, title="Queue", url_path="queue"),
        st.Page(compare_page.render, title="Compare", url_path="compare"),
        st.Page(explore_page.render, title="Explore", url_path="explore"),
    ]
    st.navigation(pages).run()
