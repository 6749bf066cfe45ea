"""Migration 0008 on PostgreSQL, on a database built at the schema before it (0007): the
run control flags leave provenance for their own columns, and come back on downgrade."""

from __future__ import annotations

from test_lifecycle import EXPECTED, STORED, _fill_at_0007, _stored

from db.migrate import current, downgrade, upgrade

from .conftest import _postgres_database


def test_0008_carries_the_control_flags_over_on_postgresql(postgres_server: str) -> None:
    url = _postgres_database(postgres_server)
    upgrade(url, "0007")
    _fill_at_0007(url)
    upgrade(url)
    assert current(url) == "0010"
    assert _stored(url) == EXPECTED
    downgrade(url, "0007")
    upgrade(url)  # and up again: the same columns from the restored provenance
    assert _stored(url) == EXPECTED
    assert len(STORED) == len(EXPECTED)
