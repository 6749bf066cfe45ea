"""Reading corpora under the operator's rules (``SourcePolicy``, the caller's argument):
``text:`` files and folders inside the corpus roots, and HuggingFace datasets where
they are turned on. Byte caps are enforced while reading; a reason never names a path
outside the roots."""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from pathlib import Path

from core.catalog.corpora import (
    FILE_CAP_SETTING,
    TOTAL_CAP_SETTING,
    SourcePolicy,
    forbidden,
    hf_problem,
    inside,
    is_local,
    locate,
    scrub,
)
from core.catalog.tasks import TaskConfigError
from core.files import NotRegularFile, TooLarge, read_at_most


class CorpusError(TaskConfigError):
    """A corpus that cannot be read: missing, not UTF-8, empty, or an unusable dataset."""


@dataclass(frozen=True)
class Document:
    path: str
    content: bytes


def _read_capped(path: Path, cap: int) -> bytes | None:
    """The bytes of the regular file ``path``, or None when it holds more than ``cap``
    (by its stated size, or once read: a file may grow). Named by its file name only."""
    try:
        return read_at_most(path, cap, follow_links=False)
    except NotRegularFile:
        raise CorpusError(f"{path.name} is not a regular file") from None
    except TooLarge:
        return None


def _files(folder: Path, root: Path) -> list[tuple[str, Path]]:
    """The files of ``folder`` (name in it, resolved path), in a fixed order; a link out
    of the roots is refused (by its name in the folder, never its target); links to
    folders are not followed."""
    files = []
    for parent, folders, names in os.walk(folder, followlinks=False):
        folders.sort()
        for name in names:
            path = Path(parent) / name
            shown = path.relative_to(folder).as_posix()
            target = path.resolve()
            if not inside(target, root) or forbidden(target):
                raise CorpusError(f"{shown} links outside the corpus roots")
            files.append((shown, target))
    return sorted(files)


def text_documents(location: str, policy: SourcePolicy) -> list[Document]:
    """The documents of a file or folder inside the corpus roots, read under the byte caps."""
    located = locate(location, policy)
    if isinstance(located, str):
        raise CorpusError(located)
    root_path, root = located
    label = f"corpus text:{root_path}"
    if not root_path.exists():
        raise CorpusError(f"{label}: no such file or folder")
    try:
        single = not root_path.is_dir()  # a file, or something else that is refused
        files = [(root_path.name, root_path)] if single else _files(root_path, root)
        docs, total = [], 0
        for name, path in files:
            cap = min(policy.max_file_bytes, policy.max_total_bytes - total)
            content = _read_capped(path, cap)
            if content is None:
                which, limit = (
                    (FILE_CAP_SETTING, policy.max_file_bytes)
                    if cap == policy.max_file_bytes
                    else (TOTAL_CAP_SETTING, policy.max_total_bytes)
                )
                scope = "file" if which == FILE_CAP_SETTING else "corpus"
                raise CorpusError(
                    f"{name}: the {scope} is over {limit:,} bytes ({which}); "
                    "it is not read past that"
                )
            total += len(content)
            try:
                content.decode("utf-8")
            except UnicodeDecodeError as err:
                raise CorpusError(
                    f"{name} is not UTF-8 (byte {err.start}); text corpora must be UTF-8"
                ) from None
            docs.append(Document(name, content))
    except CorpusError as err:
        raise CorpusError(f"{label}: {err}") from None
    except OSError as err:
        raise CorpusError(f"{label}: could not be read ({err.strerror or 'error'})") from None
    if not docs:
        raise CorpusError(f"{label}: the folder holds no files")
    return docs


def _text_column(table, spec: str, split: str, wanted: str) -> str:
    """The column to read: ``wanted`` if given, else ``text``, else the only string
    column (PG-19's first string column is the book's title, not its text)."""
    strings = [c for c, f in table.features.items() if getattr(f, "dtype", None) == "string"]
    if wanted:
        if wanted not in strings:
            raise CorpusError(
                f"corpus hf:{spec}: split {split!r} has no text column {wanted!r} "
                f"(its text columns: {', '.join(strings) or 'none'})"
            )
        return wanted
    if "text" in strings:
        return "text"
    if len(strings) == 1:
        return strings[0]
    if not strings:
        raise CorpusError(f"corpus hf:{spec}: split {split!r} has no text column")
    raise CorpusError(
        f"corpus hf:{spec}: split {split!r} has several text columns ({', '.join(strings)}) "
        "and none is called 'text': name one, hf:<name>:<config>:<column>"
    )


def _rows_to_documents(rows: list[str], split: str, budget: int) -> list[Document]:
    """Rows that are lines of one text (every non-empty row ends with a newline, as in
    WikiText) are joined as they are, one stream as in the ALiBi paper's evaluation;
    other rows are documents (PG-19's books), separated by DOC_SEPARATOR later. More
    than ``budget`` bytes in all is refused, counted as the rows are encoded."""
    encoded, size = [], 0
    for row in rows:
        encoded.append(row.encode("utf-8"))
        size += len(encoded[-1])
        if size > budget:
            raise CorpusError(
                f"the dataset is over {budget:,} bytes of text ({TOTAL_CAP_SETTING}); "
                "reading stopped there"
            )
    filled = [row for row in encoded if row]
    if filled and all(row.endswith(b"\n") for row in filled):
        return [Document(split, b"".join(filled))]
    return [Document(f"{split}/{i}", row) for i, row in enumerate(encoded)]


def _hf_location(name: str, policy: SourcePolicy) -> str:
    """What to give ``datasets.load_dataset``: a local folder, resolved inside the roots,
    or a hub name that no local path shadows."""
    problem = hf_problem(name, policy)
    if problem:
        raise CorpusError(problem)
    if is_local(name):
        located = locate(name, policy, kind="hf")
        assert not isinstance(located, str)  # hf_problem refused it otherwise
        return str(located[0])
    if Path(name).exists():  # load_dataset would read the worker's own folder
        raise CorpusError(
            f"corpus hf:{name} is also a local path here; give a local dataset as a path "
            "inside the corpus roots, starting with / or ./"
        )
    return name


def _local_size(location: str, policy: SourcePolicy) -> None:
    """A local dataset is sized before it is loaded: its files' sizes summed (links out
    of the roots and anything not a regular file refused), over the total cap refused."""
    located = locate(location, policy, kind="hf")
    if isinstance(located, str):
        raise CorpusError(located)
    path, root = located
    if not path.exists():
        raise CorpusError("no such file or folder")
    total = 0
    for name, target in _files(path, root) if path.is_dir() else [(path.name, path)]:
        if not target.is_file():
            raise CorpusError(f"{name} is not a regular file")
        total += target.stat().st_size
        if total > policy.max_total_bytes:
            raise CorpusError(
                f"the dataset's files are over {policy.max_total_bytes:,} bytes "
                f"({TOTAL_CAP_SETTING}); it is not loaded"
            )


def _load_dataset(datasets, location: str, config: str, policy: SourcePolicy):
    """The dataset, loaded without running any code of its own; sized before it is
    loaded: a local one by its files, a hub one by the size the hub states (one that
    states none, or over the total cap, is refused before anything is downloaded)."""
    config_name = config or None
    if is_local(location):
        _local_size(location, policy)
    else:
        # datasets < 4 runs a loading script unless told not to; later versions run
        # none and refuse the argument here.
        builder_args = inspect.signature(datasets.load_dataset_builder).parameters
        no_code = {"trust_remote_code": False} if "trust_remote_code" in builder_args else {}
        builder = datasets.load_dataset_builder(location, config_name, **no_code)
        info = builder.info
        stated = max(info.download_size or 0, info.dataset_size or 0)
        if not stated:
            raise CorpusError(
                "the hub states no size for the dataset, so it cannot be checked against "
                f"{TOTAL_CAP_SETTING} before download; an operator can put its files in a "
                "corpus root and name that folder instead"
            )
        if stated > policy.max_total_bytes:
            raise CorpusError(
                f"the dataset is {stated:,} bytes, over {policy.max_total_bytes:,} "
                f"({TOTAL_CAP_SETTING})"
            )
    return datasets.load_dataset(location, config_name, trust_remote_code=False)


def huggingface(spec: str, policy: SourcePolicy) -> tuple[list[Document], list[Document]]:
    name, _, rest = spec.partition(":")
    config, _, column = rest.partition(":")
    location = _hf_location(name, policy)
    try:
        import datasets
    except ImportError:
        raise CorpusError(
            f"corpus hf:{spec} needs the optional 'datasets' package: pip install 'posbench[hf]'"
        ) from None
    try:
        loaded = _load_dataset(datasets, location, config, policy)
    except CorpusError as err:
        raise CorpusError(f"corpus hf:{spec}: {err}") from None
    except Exception as err:  # the library raises many types; report any of them plainly
        reason = scrub(str(err).splitlines()[0] if str(err) else type(err).__name__, policy)
        raise CorpusError(f"corpus hf:{spec}: could not load the dataset ({reason})") from None
    splits, budget = {}, policy.max_total_bytes
    for wanted in (("train",), ("validation", "valid", "test")):
        split = next((s for s in wanted if s in loaded), None)
        if split is None:
            raise CorpusError(
                f"corpus hf:{spec}: needs a {wanted[0]!r} split and one of "
                f"{', '.join(wanted if len(wanted) > 1 else ())} (has {', '.join(loaded)})"
            )
        table = loaded[split]
        rows = table[_text_column(table, spec, split, column)]
        try:
            docs = _rows_to_documents([row or "" for row in rows], split, budget)
        except CorpusError as err:
            raise CorpusError(f"corpus hf:{spec}: {err}") from None
        budget -= sum(len(doc.content) for doc in docs)
        splits[wanted[0]] = docs
    return splits["train"], splits["validation"]
