"""The dashboard as `posbench dashboard` and `posbench up` serve it: `streamlit run
dashboard/serve.py` finds ``app`` below and serves dashboard/app.py through uvicorn, with
the same ``--server.*`` options, behind posbench's binding cookie
(``dashboard.binding``), which a password login needs."""

from __future__ import annotations

from pathlib import Path

import streamlit as st
from starlette.middleware import Middleware

from dashboard.binding import BindingCookie

app = st.App(Path(__file__).with_name("app.py"), middleware=[Middleware(BindingCookie)])
