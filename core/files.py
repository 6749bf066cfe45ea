"""Files from users and files for them, read and written safely (the security contract's
files): a file posbench is given (a spec, a results.json to import) must be a regular
file and is read with a bound, so a device (/dev/zero), a FIFO or a huge file can neither
exhaust memory nor hang a command; a file posbench writes appears whole (a temporary file
in the same folder, then ``os.replace``) and never through a symbolic link; a folder it
creates under ``$POSBENCH_HOME`` is its owner's alone. Torch-free, and below every layer
that reads or writes such files."""

from __future__ import annotations

import contextlib
import os
import stat
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from core.errors import UserError

PRIVATE_FOLDER = 0o700
PRIVATE_FILE = 0o600
# The umask of the processes `posbench up` starts (Redis, the worker, the dashboard):
# whatever they or the libraries they use create is their owner's alone, explicit mode
# or not.
PRIVATE_UMASK = 0o077

_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISLNK, "a symbolic link"),
)


class FileRefused(UserError, ValueError):
    """A file posbench will not read or write: one line saying why."""


def kind_of(mode: int) -> str:
    """What a file that is not a regular file is, in words."""
    return next((words for test, words in _KINDS if test(mode)), "not a regular file")


class NotRegularFile(FileRefused):
    """A path that is not a regular file: ``kind`` says what it is (a device, a FIFO...)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        super().__init__(kind)


class TooLarge(FileRefused):
    """A file over a byte limit: ``size`` is its stated size, or None when it grew past the
    limit while it was read."""

    def __init__(self, size: int | None) -> None:
        self.size = size
        super().__init__("too large")


def read_at_most(path: str | Path, limit: int, *, follow_links: bool = True) -> bytes:
    """The bytes of the regular file at ``path``, at most ``limit`` of them: NotRegularFile
    for anything else (a device, a FIFO, a folder; ``follow_links`` False: a link too) and
    TooLarge for a larger file, before reading it, and never more than ``limit + 1`` bytes
    read (a file that grows meanwhile). OSError as ``open`` raises it (a missing or
    unreadable file). Callers word the refusal: the path is theirs to show or not."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    if not follow_links:
        flags |= os.O_NOFOLLOW
    # O_NONBLOCK: opening a FIFO with no writer returns at once instead of waiting.
    fd = os.open(path, flags)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotRegularFile(kind_of(info.st_mode))
        if info.st_size > limit:
            raise TooLarge(info.st_size)
        os.set_blocking(fd, True)
        chunks, left = [], limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > limit:
        raise TooLarge(None)
    return data


def read_bounded(path: str | Path, limit: int, what: str = "the file") -> bytes:
    """``read_at_most`` for a file a user gave: its refusals name the path and ``what``
    (e.g. "a spec") it is at most."""
    try:
        return read_at_most(path, limit)
    except NotRegularFile as err:
        raise FileRefused(f"{path} is not a regular file ({err.kind})") from None
    except TooLarge as err:
        size = f"more than {limit:,}" if err.size is None else f"{err.size:,}"
        raise FileRefused(f"{path} is {size} bytes; {what} is at most {limit:,}") from None


def write_atomic(
    path: Path, content: bytes | Callable[[BinaryIO], object], *, private: bool = False
) -> Path:
    """Write ``content`` (bytes, or a function writing to a binary handle) to ``path``
    whole: into a new temporary file beside it (created exclusively, never through a
    link), then renamed over ``path``; a link at ``path`` is replaced, its target left
    untouched. ``private``: the file is its owner's alone (0o600)."""
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(temporary, flags, PRIVATE_FILE if private else 0o666)
    try:
        with os.fdopen(fd, "wb") as handle:
            if callable(content):
                content(handle)
            else:
                handle.write(content)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return path


@contextlib.contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """For a tool that writes a file by name (SQLite, pg_dump): a new, empty, owner-only
    (0o600) temporary file beside ``path``, created exclusively and never through a link,
    to be filled inside the block; renamed over ``path`` when the block ends, removed
    (with any journal SQLite left beside it) when it raises. ``write_atomic`` for a
    writer that wants a path, not a handle."""
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    os.close(os.open(temporary, flags, PRIVATE_FILE))
    try:
        yield temporary
        fd = os.open(temporary, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, path)
    except BaseException:
        for leftover in ("", "-journal", "-wal", "-shm"):
            temporary.with_name(temporary.name + leftover).unlink(missing_ok=True)
        raise
    _sync_folder(path.parent)


def _sync_folder(folder: Path) -> None:
    """Make a rename in ``folder`` durable (where the system allows it)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def private_folder(path: Path) -> Path:
    """``path`` as a folder, each part of it that does not exist yet created owner-only
    (0o700); folders that exist are left as they are."""
    missing = []
    folder = Path(path)
    while not folder.exists() and not folder.is_symlink() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    for part in reversed(missing):
        with contextlib.suppress(FileExistsError):  # made meanwhile by another process
            part.mkdir(mode=PRIVATE_FOLDER)
    if not path.is_dir():
        path.mkdir()  # raises FileExistsError / NotADirectoryError, as mkdir does
    return path


def private_file(path: Path) -> Path:
    """Create ``path`` empty and owner-only (0o600) if it does not exist yet."""
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE))
    return path


def open_private_log(path: Path) -> BinaryIO:
    """``path`` opened for appending, created owner-only (0o600) if missing."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags, PRIVATE_FILE)
    return os.fdopen(fd, "ab")


def folder_bytes(path: Path) -> int:
    """Bytes held by the regular files under ``path`` (0 when it does not exist), for the
    disk budgets: links are not followed, a file linked twice (a checkpoint a run took
    from the cache is a hard link) counts once, and a file removed while it is counted
    is skipped."""
    seen: set[tuple[int, int]] = set()
    total, folders = 0, [Path(path)]
    while folders:
        try:
            with os.scandir(folders.pop()) as found:
                entries = list(found)
        except (FileNotFoundError, NotADirectoryError):
            continue
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    folders.append(Path(entry.path))
                    continue
                if not entry.is_file(follow_symlinks=False):
                    continue
                info = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if (info.st_dev, info.st_ino) not in seen:
                seen.add((info.st_dev, info.st_ino))
                total += info.st_size
    return total


def shown_bytes(count: int) -> str:
    """``count`` bytes in the largest binary unit that keeps it at least 1, three
    significant digits (``1.5 GiB``), for the messages of the disk quotas."""
    units = ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB")
    power = 0
    while power < len(units) - 1 and abs(count) >= 1024 ** (power + 1):
        power += 1
    return f"{count / 1024**power:.3g} {units[power]}" if power else f"{count} bytes"
