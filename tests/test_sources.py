"""Corpora only from where the operator allows (security finding 2): text: paths inside
the corpus roots, read under byte caps; hf: only where turned on; refusals at submit
(exit 2, nothing written) that never name a path outside the roots."""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import pytest
import tomllib
from conftest import isolated_env, posbench_cli
from sqlalchemy import func, select

from core.catalog.corpora import SourcePolicy, corpus_access_problem, scrub
from core.settings import Settings
from core.spec import parse_spec
from db.engine import transaction
from db.migrate import upgrade
from db.models import Run, Study
from worker.data import sources
from worker.data.lm import CorpusError, load_corpus

SECRET = "outside-secret-4711"  # a name that must never appear in a reason


@pytest.fixture
def layout(tmp_path: Path) -> dict[str, Path]:
    """A corpus root with a good file, and a secret folder outside it, linked from inside."""
    root = tmp_path / "corpora"
    root.mkdir()
    (root / "good.txt").write_text("some text " * 300)
    outside = tmp_path / SECRET
    outside.mkdir()
    (outside / "passwords.txt").write_text("hunter2 " * 300)
    (root / "link").symlink_to(outside / "passwords.txt")
    (root / "folder").mkdir()
    (root / "folder" / "a.txt").write_text("inside " * 300)
    return {"root": root, "outside": outside}


def bad_corpora(layout: dict[str, Path]) -> list[str]:
    root = layout["root"]
    return [
        "text:/proc/self/environ",
        "text:/",
        f"text:{root}/../{SECRET}/passwords.txt",
        f"text:{root}/link",
    ]


def policy(root: Path, **rules) -> SourcePolicy:
    return SourcePolicy(roots=(root.resolve(),), **rules)


def test_paths_outside_the_roots_are_refused_without_naming_them(layout) -> None:
    rules = policy(layout["root"])
    for corpus in bad_corpora(layout):
        problem = corpus_access_problem(corpus, rules)
        assert problem and SECRET not in problem and "environ" not in problem, corpus
        assert "\n" not in problem
    # The same words whether the outside path exists or not: no oracle.
    gone = corpus_access_problem("text:/no/such/place", rules)
    assert gone == corpus_access_problem("text:/etc/passwd", rules)
    # /proc, /sys and /dev are never read, even under a root that holds them.
    everything = SourcePolicy(roots=(Path("/"),))
    assert corpus_access_problem("text:/proc/self/environ", everything)
    assert corpus_access_problem("text:/dev/zero", everything)
    # Inside: absolute, or relative to a root.
    assert corpus_access_problem(f"text:{layout['root']}/good.txt", rules) is None
    assert corpus_access_problem("text:good.txt", rules) is None
    assert corpus_access_problem("text:folder", rules) is None
    # No rules (the engine's default): no local path at all.
    assert "none is set" in corpus_access_problem("text:good.txt", SourcePolicy())


def test_the_reader_refuses_the_same_and_caches_nothing(layout, tmp_path: Path) -> None:
    rules = policy(layout["root"])
    cache = tmp_path / "cache"
    for corpus in bad_corpora(layout):
        with pytest.raises(CorpusError) as refused:
            load_corpus(corpus, cache, rules)
        assert SECRET not in str(refused.value) and "environ" not in str(refused.value)
    # A folder holding a link out of the roots: refused by the link's name, not its target.
    (layout["root"] / "folder" / "escape.txt").symlink_to(layout["outside"] / "passwords.txt")
    with pytest.raises(CorpusError, match=r"escape\.txt links outside the corpus roots") as link:
        load_corpus("text:folder", cache, rules)
    assert SECRET not in str(link.value)
    assert not cache.exists()  # nothing copied into the corpus cache
    assert load_corpus("text:good.txt", cache, rules).train.size > 0


def test_reading_stops_at_the_byte_caps(layout, tmp_path: Path) -> None:
    root = layout["root"]
    huge = root / "huge.txt"
    with huge.open("wb") as handle:  # a sparse terabyte: reading it all would never end
        handle.truncate(1 << 40)
    rules = policy(root, max_file_bytes=1 << 20, max_total_bytes=8 << 20)
    started = time.monotonic()
    with pytest.raises(CorpusError, match=r"huge.txt: the file is over 1,048,576 bytes"):
        load_corpus("text:huge.txt", tmp_path / "cache", rules)
    assert time.monotonic() - started < 10
    # The total cap, over several files each under the file cap.
    many = root / "many"
    many.mkdir()
    for i in range(5):
        (many / f"{i}.txt").write_text("x" * 3000)
    with pytest.raises(CorpusError, match=r"the corpus is over 10,000 bytes"):
        load_corpus("text:many", tmp_path / "cache", policy(root, max_total_bytes=10_000))
    # A FIFO (or a device) inside a root is not a file: refused, without blocking.
    os.mkfifo(root / "pipe")
    with pytest.raises(CorpusError, match="pipe is not a regular file"):
        load_corpus("text:pipe", tmp_path / "cache", rules)


def test_huggingface_only_where_an_operator_turned_it_on(layout) -> None:
    root = layout["root"]
    off = corpus_access_problem("hf:wikitext:wikitext-103-raw-v1", policy(root))
    assert "POSBENCH_HF_DATASETS=true" in off and "paper preset" in off
    on = policy(root, hf_enabled=True)
    assert corpus_access_problem("hf:wikitext:wikitext-103-raw-v1", on) is None
    listed = policy(root, hf_enabled=True, hf_allow=("wikitext",))
    assert corpus_access_problem("hf:wikitext", listed) is None
    assert "not in the operator's allow-list" in corpus_access_problem("hf:pg19", listed)
    # A local dataset folder follows the text: rules.
    outside = corpus_access_problem(f"hf:{layout['outside']}", on)
    assert outside and SECRET not in outside
    # A library's error is shown without paths outside the roots.
    message = f"no file at {layout['outside']}/x.py nor at {root}/y, see https://hf.co/a/b"
    assert scrub(message, on) == f"no file at <path> nor at {root}/y, see https://hf.co/a/b"


def test_a_hub_dataset_runs_no_code_and_is_sized_before_download(monkeypatch) -> None:
    from types import SimpleNamespace

    calls = []

    def load_dataset_builder(path, name=None, trust_remote_code=None):
        calls.append(("builder", trust_remote_code))
        return SimpleNamespace(info=SimpleNamespace(download_size=5_000, dataset_size=None))

    def load_dataset(path, name=None, **kwargs):
        calls.append(("load", kwargs))
        return {"train": [], "validation": []}

    fake = SimpleNamespace(load_dataset_builder=load_dataset_builder, load_dataset=load_dataset)
    small = SourcePolicy(hf_enabled=True, max_total_bytes=1_000)
    with pytest.raises(CorpusError, match=r"5,000 bytes, over 1,000"):
        sources._load_dataset(fake, "wikitext", "", small)
    assert calls == [("builder", False)]  # refused before anything was downloaded
    sources._load_dataset(fake, "wikitext", "raw", SourcePolicy(hf_enabled=True))
    assert calls[-1] == ("load", {"trust_remote_code": False})


def _fake_datasets(calls: list, download_size=None, dataset_size=None):
    """A ``datasets`` module that records what is asked of it and downloads nothing."""
    from types import SimpleNamespace

    def load_dataset_builder(path, name=None, trust_remote_code=None):
        calls.append(("builder", path))
        info = SimpleNamespace(download_size=download_size, dataset_size=dataset_size)
        return SimpleNamespace(info=info)

    def load_dataset(path, name=None, **kwargs):
        calls.append(("load", path))
        return {"train": [], "validation": []}

    return SimpleNamespace(load_dataset_builder=load_dataset_builder, load_dataset=load_dataset)


def test_a_hub_dataset_of_no_stated_size_is_refused_before_download(
    tmp_path: Path, monkeypatch
) -> None:
    calls: list = []
    monkeypatch.setitem(sys.modules, "datasets", _fake_datasets(calls))
    with pytest.raises(CorpusError) as refused:
        load_corpus("hf:wikitext:raw", tmp_path / "cache", SourcePolicy(hf_enabled=True))
    message = str(refused.value)
    assert message.startswith("corpus hf:wikitext:raw: the hub states no size for the dataset")
    assert "POSBENCH_CORPUS_MAX_TOTAL_BYTES" in message and "corpus root" in message
    assert calls == [("builder", "wikitext")] and not (tmp_path / "cache").exists()
    # A stated size under the cap downloads.
    sized = _fake_datasets(calls, dataset_size=5_000)
    sources._load_dataset(sized, "wikitext", "raw", SourcePolicy(hf_enabled=True))
    assert calls[-1] == ("load", "wikitext")


def test_a_local_dataset_is_sized_by_its_files_before_it_is_loaded(
    layout, tmp_path: Path, monkeypatch
) -> None:
    root = layout["root"]
    dataset = root / "ds"
    dataset.mkdir()
    (dataset / "train.jsonl").write_text("x" * 6_000)
    (dataset / "validation.jsonl").write_text("x" * 6_000)
    calls: list = []
    monkeypatch.setitem(sys.modules, "datasets", _fake_datasets(calls))
    cache = tmp_path / "cache"
    rules = policy(root, hf_enabled=True, max_total_bytes=10_000)
    with pytest.raises(CorpusError) as refused:
        load_corpus("hf:./ds", cache, rules)
    assert str(refused.value) == (
        "corpus hf:./ds: the dataset's files are over 10,000 bytes "
        "(POSBENCH_CORPUS_MAX_TOTAL_BYTES); it is not loaded"
    )
    # A link out of the roots is refused by its name, not its target.
    (dataset / "validation.jsonl").unlink()
    (dataset / "escape.jsonl").symlink_to(layout["outside"] / "passwords.txt")
    with pytest.raises(CorpusError, match=r"escape\.jsonl links outside the corpus roots") as out:
        load_corpus("hf:./ds", cache, rules)
    assert SECRET not in str(out.value)
    assert calls == [] and not cache.exists()  # nothing loaded, nothing cached
    (dataset / "escape.jsonl").unlink()
    sources._load_dataset(sys.modules["datasets"], str(dataset.resolve()), "", rules)
    assert calls == [("load", str(dataset.resolve()))]


def test_pyproject_requires_datasets_that_runs_no_loading_script() -> None:
    # datasets < 2.20 runs a dataset's loading script whatever it is told.
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())

    def strings(value):
        if isinstance(value, str):
            yield value
        elif isinstance(value, dict | list):
            for item in value.values() if isinstance(value, dict) else value:
                yield from strings(item)

    named = [s for s in strings(pyproject) if re.match(r"datasets\b(?![-.])", s.strip())]
    assert len(named) >= 2  # the hf and dev extras
    assert all(s.replace(" ", "") == "datasets>=2.20" for s in named), named


def test_settings_give_the_rules(tmp_path: Path, monkeypatch) -> None:
    settings = Settings(home=tmp_path)
    assert settings.sources.roots == ((tmp_path / "corpora").resolve(),)
    assert not settings.sources.hf_enabled and settings.sources.max_file_bytes == 256 << 20
    monkeypatch.setenv("POSBENCH_CORPUS_ROOTS", f"{tmp_path}/a{os.pathsep}{tmp_path}/b")
    monkeypatch.setenv("POSBENCH_HF_ALLOW", "wikitext, pg19")
    settings = Settings(home=tmp_path)
    assert [r.name for r in settings.sources.roots] == ["a", "b"]
    assert settings.sources.hf_allow == ("wikitext", "pg19")
    for bad in ("/", "/proc", "/sys/kernel"):
        monkeypatch.setenv("POSBENCH_CORPUS_ROOTS", bad)
        with pytest.raises(ValueError, match="must not be the file system's root"):
            Settings(home=tmp_path)


def _spec_file(folder: Path, corpus: str, name: str) -> Path:
    path = folder / f"{name}.yaml"
    path.write_text(
        f"name: refused\nmodel: tiny\ntask: {{name: lm, corpus: {corpus!r}}}\n"
        "train: {length: 16, steps: 2, batch_size: 2}\nencodings: [nope]\n"
        "eval: {lengths: [16], tokens: 64, order_probe: false}\n"
    )
    return path


def test_submit_and_run_refuse_with_exit_2_and_write_nothing(layout, tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    url = f"sqlite:///{home}/posbench.db"
    upgrade(url)
    env = isolated_env(home, POSBENCH_DATABASE_URL=url, POSBENCH_CORPUS_ROOTS=str(layout["root"]))
    corpora = [*bad_corpora(layout), "hf:wikitext"]
    for i, corpus in enumerate(corpora):
        spec = _spec_file(tmp_path, corpus, f"s{i}")
        # The spec itself is well formed: only the service's rules refuse it.
        assert parse_spec({"encodings": ["nope"], "task": {"name": "lm", "corpus": corpus}})
        for command in (["submit", str(spec)], ["run", str(spec), "--out", str(tmp_path / "o")]):
            done = posbench_cli(*command, env=env, timeout=300)
            reason = done.stderr.strip()
            assert done.returncode == 2, (corpus, command, done.stdout, done.stderr)
            assert len(reason.splitlines()) == 1, reason
            assert SECRET not in reason and "environ" not in reason and "passwords" not in reason
            if corpus.startswith("hf:"):
                assert "POSBENCH_HF_DATASETS=true" in reason
            else:
                assert "corpus roots" in reason or "'..'" in reason, reason
    with transaction(url) as session:
        assert session.scalar(select(func.count()).select_from(Study)) == 0
        assert session.scalar(select(func.count()).select_from(Run)) == 0
    assert not (tmp_path / "o").exists() and not (home / "runs").exists()
    assert not (home / "cache").exists()
