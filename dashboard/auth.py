"""Access control: when POSBENCH_DASHBOARD_PASSWORD is set, nothing shows before login.

An OIDC provider configured in ``.streamlit/secrets.toml`` (``[auth]``) is used through
``st.login`` instead.
"""

from __future__ import annotations

import hmac

import streamlit as st

from jobs.settings import get_settings


def _oidc_configured() -> bool:
    try:
        return "auth" in st.secrets
    except Exception:  # no secrets file at all
        return False


def gate() -> bool:
    """True when the visitor may see the dashboard; otherwise render a login and stop."""
    if _oidc_configured():
        if not st.user.is_logged_in:
            st.title("posbench")
            st.button("Log in", on_click=st.login)
            return False
        return True
    password = get_settings().dashboard_password
    if password is None or st.session_state.get("authenticated"):
        return True
    st.title("posbench")
    with st.form("login"):
        given = st.text_input("Password", type="password")
        if st.form_submit_button("Log in"):
            if hmac.compare_digest(given.encode(), password.get_secret_value().encode()):
                st.session_state["authenticated"] = True
                st.rerun()
            st.error("Wrong password.")
    return False
