"""Nothing under $POSBENCH_HOME is open to group or others, whatever the user's umask:
the corpus cache, a home an older posbench left open, a database backup. (The embedded
stack as a whole, Redis's files and socket included: tests/integration/test_up.py.)"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from test_data import rooted

from jobs.embedded import owner_only
from worker.data.lm import load_corpus

PERMISSIVE = 0o022  # the usual default: files 0644, folders 0755


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def exposed(root: Path) -> list[str]:
    """Every file, folder and socket under ``root`` (``root`` too) that group or others
    may read, write or enter, with its mode; links are skipped (their own mode means
    nothing) and never followed."""
    found = []
    for folder, folders, files in os.walk(root):
        for name in [".", *folders, *files]:
            path = Path(folder) / name
            info = path.lstat()
            if not stat.S_ISLNK(info.st_mode) and info.st_mode & 0o077:
                found.append(f"{path} {stat.filemode(info.st_mode)}")
    return sorted(set(found))


def test_exposed_lists_what_group_or_others_may_reach(tmp_path: Path) -> None:
    with umask(PERMISSIVE):
        (tmp_path / "open").mkdir()
        (tmp_path / "open" / "file").write_text("")
    tmp_path.chmod(0o700)
    (tmp_path / "link").symlink_to("/etc/passwd")
    assert exposed(tmp_path) == [
        f"{tmp_path / 'open'} drwxr-xr-x",
        f"{tmp_path / 'open' / 'file'} -rw-r--r--",
    ]


def test_the_corpus_cache_is_owner_only_whatever_the_umask(tmp_path: Path) -> None:
    corpus = tmp_path / "corpora" / "notes.txt"
    corpus.parent.mkdir()
    corpus.write_text("a private corpus " * 500)
    cache = tmp_path / "home" / "cache"
    cache.mkdir(parents=True, mode=0o700)
    with umask(PERMISSIVE):
        loaded = load_corpus(f"text:{corpus}", cache, rooted(tmp_path / "corpora"))
    assert len(loaded.train) > 0
    written = sorted(p.name for p in cache.rglob("*"))
    assert {"corpora", "meta.json", "train.u8", "valid.u8"} <= set(written), written
    assert exposed(cache) == []


def test_up_closes_a_home_an_older_posbench_left_open(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    home.chmod(0o755)
    assert owner_only(home) == 0o755
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    assert owner_only(home) is None  # closed already: nothing to say
