"""Process-wide heap policy for long evaluations.

glibc raises its mmap threshold each time a large block is freed, after which
large tensors of varying sizes (one per query block) come from the heap and
fragment it: the resident set grows far past what is live. For long sequences,
a fixed threshold puts every large tensor in its own mapping, returned to the
system when freed; measured on the 2-core CPU, ALiBi at 16k tokens peaks at
1.2x NoPE's memory instead of 5x. It costs page faults, so short sequences keep
the default (dynamic) policy.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

M_MMAP_THRESHOLD = -3
LONG_SEQUENCE = 8192
FIXED_THRESHOLD = 128 * 1024


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        library = ctypes.CDLL(name)
        library.mallopt  # noqa: B018 - glibc only; absent elsewhere
    except (OSError, AttributeError):
        return None
    return library


def bound_heap_for(length: int) -> bool:
    """Fix glibc's mmap threshold before working on ``length``-token sequences that
    are long; returns whether the policy is in force (False off glibc)."""
    if length < LONG_SEQUENCE:
        return False
    libc = _libc()
    return bool(libc is not None and libc.mallopt(M_MMAP_THRESHOLD, FIXED_THRESHOLD))
