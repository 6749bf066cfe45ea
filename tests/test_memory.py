"""The heap policy for long evaluations."""

from __future__ import annotations

import platform

from worker.memory import LONG_SEQUENCE, bound_heap_for


def test_short_sequences_keep_the_default_policy() -> None:
    assert bound_heap_for(LONG_SEQUENCE - 1) is False


def test_long_sequences_fix_the_mmap_threshold_on_glibc() -> None:
    applied = bound_heap_for(LONG_SEQUENCE)
    assert applied is (platform.libc_ver()[0] == "glibc")
