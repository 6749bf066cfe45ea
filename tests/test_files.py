"""Files posbench is given and files it writes (the security contract's files): specs and
imports are regular files read with a bound, ``--out`` is written whole and never through
a link or over a file posbench did not write, and ``$POSBENCH_HOME`` is its owner's alone."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from conftest import isolated_env, posbench_cli

from core import files
from core.files import FileRefused, private_folder, read_bounded, write_atomic
from core.results_schema import MAX_RESULTS_BYTES
from core.settings import Settings
from core.spec.loading import MAX_SPEC_BYTES
from db import queries
from db.migrate import upgrade

SPEC = (
    "name: mine\nmodel: tiny\ntrain: {length: 16, steps: 2}\nencodings: [rope]\n"
    "eval: {lengths: [16], tokens: 64, order_probe: false}\n"
)


def cli(home: Path, *args: str, timeout: float = 60):
    return posbench_cli(*args, env=isolated_env(home, COLUMNS="200"), timeout=timeout)


def refused(done, *words: str) -> None:
    """Exit 2 with one line on stderr saying why, and no traceback."""
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    for word in words:
        assert word in lines[0], lines[0]


@pytest.mark.parametrize("command", ["submit", "run"])
def test_a_device_as_spec_exits_2_at_once(tmp_path: Path, command: str) -> None:
    done = cli(tmp_path / "home", command, "/dev/zero", timeout=30)
    refused(done, "/dev/zero is not a regular file (a character device)")


@pytest.mark.parametrize("command", ["submit", "run", "import"])
def test_a_fifo_as_spec_or_import_exits_2_without_hanging(tmp_path: Path, command: str) -> None:
    fifo = tmp_path / "spec.yaml"
    os.mkfifo(fifo)
    upgrade(Settings(home=tmp_path / "home").database)
    done = cli(tmp_path / "home", command, str(fifo), timeout=30)  # no writer: would hang
    refused(done, "spec.yaml is not a regular file (a FIFO)")


def test_a_spec_just_over_its_limit_is_refused(tmp_path: Path) -> None:
    spec = tmp_path / "big.yaml"
    spec.write_text(SPEC + "#" * (MAX_SPEC_BYTES - len(SPEC)) + "\n")
    for command in ("run", "submit"):
        done = cli(tmp_path / "home", command, str(spec))
        refused(done, f"is {MAX_SPEC_BYTES + 1:,} bytes; a spec is at most {MAX_SPEC_BYTES:,}")


def test_an_import_just_over_its_limit_is_refused_unread(tmp_path: Path) -> None:
    big = tmp_path / "results.json"
    with big.open("wb") as handle:  # sparse: its size, not its bytes
        handle.truncate(MAX_RESULTS_BYTES + 1)
    upgrade(Settings(home=tmp_path / "home").database)
    done = cli(tmp_path / "home", "import", str(big))
    refused(done, f"is {MAX_RESULTS_BYTES + 1:,} bytes; an import is at most")
    assert queries.studies(Settings(home=tmp_path / "home").database).empty


def test_no_more_than_limit_plus_one_bytes_are_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file that grows after its size is taken (fstat says 10 bytes) is read up to the
    limit and one byte more, then refused."""
    path = tmp_path / "growing"
    path.write_bytes(b"x" * 100_000)
    real_fstat, real_read, read = os.fstat, os.read, []

    def small(fd: int) -> os.stat_result:
        info = list(real_fstat(fd))
        info[stat.ST_SIZE] = 10
        return os.stat_result(info)

    def counted(fd: int, n: int) -> bytes:
        chunk = real_read(fd, n)
        read.append(len(chunk))
        return chunk

    monkeypatch.setattr(files.os, "fstat", small)
    monkeypatch.setattr(files.os, "read", counted)
    with pytest.raises(FileRefused, match="more than 1,000 bytes; a spec is at most 1,000"):
        read_bounded(path, 1000, "a spec")
    assert sum(read) == 1001


def _write_spec(tmp_path: Path) -> Path:
    spec = tmp_path / "study.yaml"
    spec.write_text(SPEC)
    return spec


@pytest.mark.slow
@pytest.mark.parametrize("name", ["results.json", "table.md"])
def test_out_never_writes_through_a_symbolic_link(tmp_path: Path, name: str) -> None:
    target = tmp_path / "elsewhere" / "precious.txt"
    target.parent.mkdir()
    target.write_text("mine")
    out = tmp_path / "out"
    out.mkdir()
    (out / name).symlink_to(target)
    done = cli(tmp_path / "home", "run", str(_write_spec(tmp_path)), "--out", str(out))
    refused(done, f"{name} is a symbolic link")
    assert target.read_text() == "mine" and (out / name).is_symlink()


@pytest.mark.parametrize(
    ("name", "content"),
    [("results.json", "my notes\n"), ("results.json", '{"hello": 1}'), ("table.md", "# mine\n")],
)
def test_out_does_not_overwrite_a_file_posbench_did_not_write(
    tmp_path: Path, name: str, content: str
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / name).write_text(content)
    done = cli(tmp_path / "home", "run", str(_write_spec(tmp_path)), "--out", str(out))
    refused(done, f"{out / name} was not written by posbench run")
    assert (out / name).read_text() == content
    assert sorted(p.name for p in out.iterdir()) == [name]


@pytest.mark.slow
def test_results_are_written_whole_and_the_home_is_owner_only(tmp_path: Path) -> None:
    """A run under $POSBENCH_HOME makes its folders 0o700 and its files 0o600; a run
    again into the same folder replaces each file (a new file renamed over it), so a
    hard link elsewhere to the earlier results keeps them."""
    home = tmp_path / "fresh" / "home"
    spec = _write_spec(tmp_path)
    first = cli(home, "run", str(spec), timeout=600)
    assert first.returncode == 0, first.stderr
    (out,) = (home / "runs").iterdir()
    for folder in (tmp_path / "fresh", home, home / "runs", out, home / "checkpoints"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    assert (home / "cache").is_dir() and stat.S_IMODE((home / "cache").stat().st_mode) == 0o700
    for name in ("results.json", "table.md", "curves.png"):
        assert stat.S_IMODE((out / name).stat().st_mode) == 0o600, name
    kept = tmp_path / "kept.json"
    os.link(out / "results.json", kept)
    before = kept.read_bytes()
    again = cli(home, "run", str(spec), "--out", str(out), timeout=600)
    assert again.returncode == 0, again.stderr
    assert kept.read_bytes() == before  # not written in place
    assert not (out / "results.json").samefile(kept)
    assert json.loads((out / "results.json").read_text())["spec"]["name"] == "mine"
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]


def test_write_atomic_replaces_a_link_and_leaves_nothing_half_written(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_text("theirs")
    link = tmp_path / "link"
    link.symlink_to(target)
    write_atomic(link, b"ours")
    assert target.read_text() == "theirs" and not link.is_symlink() and link.read_text() == "ours"

    def broken(handle) -> None:
        handle.write(b"half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        write_atomic(link, broken)
    assert link.read_text() == "ours" and sorted(p.name for p in tmp_path.iterdir()) == [
        "link",
        "target",
    ]
    assert stat.S_IMODE(write_atomic(tmp_path / "own", b"", private=True).stat().st_mode) == 0o600


def test_private_folder_creates_only_what_is_missing_owner_only(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    private_folder(shared / "a" / "b")
    assert stat.S_IMODE(shared.stat().st_mode) == 0o755  # there before: left as it was
    for folder in (shared / "a", shared / "a" / "b"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    (tmp_path / "file").write_text("")
    with pytest.raises(OSError):
        private_folder(tmp_path / "file")


def test_replacing_gives_a_tool_a_private_path_and_renames_it_only_when_whole(
    tmp_path: Path,
) -> None:
    """What `posbench db backup` writes through: a new owner-only file beside the target
    (whatever the umask), renamed over it at the end; on an error the target is as it was
    and nothing is left beside it, a journal SQLite left included."""
    target = tmp_path / "copy.db"
    target.write_text("earlier")
    old = os.umask(0o022)
    try:
        with pytest.raises(RuntimeError), files.replacing(target) as temporary:
            assert stat.S_IMODE(temporary.stat().st_mode) == 0o600
            temporary.write_text("half")
            temporary.with_name(temporary.name + "-journal").write_text("")
            raise RuntimeError("disk full")
        assert target.read_text() == "earlier"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["copy.db"]
        with files.replacing(target) as temporary:
            temporary.write_text("whole")
    finally:
        os.umask(old)
    assert target.read_text() == "whole" and stat.S_IMODE(target.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy.db"]
