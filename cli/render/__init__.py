"""Rendering results for people: tables and plots for the terminal, markdown files and
the watch view."""
