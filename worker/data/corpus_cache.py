"""The prepared-corpus cache's bound: least recently used corpora are evicted, whole.

Each corpus is prepared once into ``<cache>/corpora/<content hash>/`` (two uint8 files
and ``meta.json``, written in a staging folder then renamed into place), and every use
touches its ``meta.json``: that time is the entry's last use. Without a bound the cache
grows by one entry (up to POSBENCH_CORPUS_MAX_TOTAL_BYTES) per corpus ever read, and an
edited corpus file is a new one. Past the bound, the reader evicts the least recently
used entries until the rest fit, never the one it has just loaded.

Eviction is safe while another process reads the entry: the entry is first renamed
aside in one step (a reader sees it whole or not at all), then removed, and a process
that has the files memory-mapped keeps reading them (POSIX frees a file's data only
once its last mapping closes). A reader that finds its entry gone before it maps the
files prepares it again (``worker.data.lm.load_corpus``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
import uuid
from pathlib import Path

from core.files import folder_bytes

log = logging.getLogger(__name__)

META = "meta.json"
# A staging folder this old was left by a process killed while preparing: no preparation
# takes a day (a corpus is at most POSBENCH_CORPUS_MAX_TOTAL_BYTES).
ABANDONED_SECONDS = 86_400.0


def touch(entry: Path) -> None:
    """Mark ``entry`` used now (its last use orders the eviction)."""
    with contextlib.suppress(FileNotFoundError):  # evicted meanwhile: written again
        os.utime(entry / META)


def last_use(entry: Path) -> float | None:
    """When ``entry`` was last used, or None when it is not a whole entry."""
    try:
        return (entry / META).stat().st_mtime
    except (FileNotFoundError, NotADirectoryError):
        return None


def remove(entry: Path) -> None:
    """Rename ``entry`` aside in one step, then delete it."""
    aside = entry.with_name(f".evicted-{uuid.uuid4().hex[:12]}")
    try:
        os.replace(entry, aside)
    except FileNotFoundError:  # another process evicted it first
        return
    shutil.rmtree(aside, ignore_errors=True)


def evict(folder: Path, max_bytes: int, keep: Path) -> list[str]:
    """Evict whole entries of ``folder`` (``<cache>/corpora``), least recently used first,
    until it holds at most ``max_bytes``; ``keep`` (the entry just loaded) stays even when
    it alone is larger. Leftovers of killed processes go first: folders set aside for
    removal, and staging folders older than a day. Returns the evicted entries' names."""
    now = time.time()
    entries: list[tuple[float, Path]] = []
    for path in folder.iterdir() if folder.is_dir() else ():
        if path.name.startswith(".evicted-"):
            shutil.rmtree(path, ignore_errors=True)
        elif path.name.startswith(".staging-"):
            try:
                if now - path.stat().st_mtime > ABANDONED_SECONDS:
                    shutil.rmtree(path, ignore_errors=True)
            except FileNotFoundError:
                pass
        elif path.name != keep.name and (used := last_use(path)) is not None:
            entries.append((used, path))
    total, evicted = folder_bytes(folder), []
    for _, entry in sorted(entries):
        if total <= max_bytes:
            break
        size = folder_bytes(entry)
        remove(entry)
        total -= size
        evicted.append(entry.name)
    if evicted:
        log.info(
            "corpus cache over %s bytes: evicted %s (least recently used)",
            f"{max_bytes:,}",
            ", ".join(evicted),
        )
    return evicted
