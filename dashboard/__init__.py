"""The Streamlit dashboard: submit, queue, compare, explore."""
