"""Byte-level language modelling and its corpora.

Corpora:
- ``pystdlib``: the running interpreter's standard library sources (``*.py``
  outside site-packages) - a real, multi-megabyte corpus on every machine, no
  download;
- ``text:<path>``: a UTF-8 file or a folder of them, inside the corpus roots;
- ``hf:<name>[:<config>[:<column>]]``: a HuggingFace dataset (the optional
  ``datasets`` package, never running a dataset's own code), hub name or local folder
  inside the roots, where the operator turned them on; the text is the named column, else
  ``text``, else the only string column. Rows that are lines (WikiText) are joined as
  one stream; other rows (PG-19's books) are documents.

The rules (``core.catalog.corpora.SourcePolicy``) are the caller's argument: the
engine reads no settings, and without rules it reads pystdlib only. Byte caps are
enforced while reading: a file or corpus over them is refused, never truncated.

Documents are read in a fixed order and split into train and validation by a
hash of their path (a lone document is split by position), joined with a NUL
byte, and written once to uint8 files named by the content's hash; later runs
memory-map them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sysconfig
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from core.catalog.corpora import SourcePolicy
from core.files import private_folder, write_atomic
from core.metrics import Kind, headline
from worker.data import corpus_cache
from worker.data.base import NO_SOURCES, Batch, Task, from_sequences
from worker.data.sources import CorpusError, Document, huggingface, text_documents

if TYPE_CHECKING:
    from core.spec import EvalSpec

VALID_PERCENT = 5
DOC_SEPARATOR = b"\x00"


def is_validation(path: str) -> bool:
    """Deterministic split: a stable hash of the document's path, 5% to validation."""
    digest = hashlib.sha1(path.encode()).digest()
    return int.from_bytes(digest[:4], "big") % 100 < VALID_PERCENT


def _pystdlib() -> list[Document]:
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file())
    return [Document(p.relative_to(root).as_posix(), p.read_bytes()) for p in paths]


def read_documents(
    corpus: str, sources: SourcePolicy = NO_SOURCES
) -> tuple[list[Document], list[Document]]:
    """The corpus' train and validation documents, in their fixed order, read under the
    operator's rules (``sources``: the corpus roots, byte caps and HuggingFace; by
    default only pystdlib)."""
    kind, _, rest = corpus.partition(":")
    if corpus == "pystdlib":
        docs = _pystdlib()
    elif kind == "text" and rest:
        docs = text_documents(rest, sources)
    elif kind == "hf" and rest:
        return huggingface(rest, sources)
    else:
        raise CorpusError(
            f"unknown corpus {corpus!r} (allowed: pystdlib, text:<path>, "
            "hf:<name>[:<config>[:<column>]])"
        )
    train = [d for d in docs if not is_validation(d.path)]
    valid = [d for d in docs if is_validation(d.path)]
    if not train or not valid:
        # Too few documents for a hash split: cut the stream by position instead.
        joined = DOC_SEPARATOR.join(d.content for d in docs)
        cut = len(joined) * (100 - VALID_PERCENT) // 100
        train, valid = [Document("head", joined[:cut])], [Document("tail", joined[cut:])]
    return train, valid


@dataclass(frozen=True)
class Corpus:
    name: str
    fingerprint: str
    train: np.ndarray
    valid: np.ndarray

    @cached_property
    def documents(self) -> np.ndarray:
        """``[n, 2]`` (start, end) of each validation document: the split scanned for
        separators once, not at every length the document protocol scores."""
        return document_spans(self.valid, DOC_SEPARATOR[0])


def _content_hash(train: list[Document], valid: list[Document]) -> str:
    digest = hashlib.sha256()
    for label, docs in (("train", train), ("valid", valid)):
        for doc in docs:
            digest.update(f"{label}\0{doc.path}\0{len(doc.content)}\0".encode())
            digest.update(doc.content)
    return digest.hexdigest()[:20]


def load_corpus(corpus: str, cache_dir: Path, sources: SourcePolicy = NO_SOURCES) -> Corpus:
    """Read (under ``sources``), hash, and (once per content) write the corpus as two
    uint8 files; memory-map them. A refused corpus writes nothing. Past the cache's
    bound (``sources.max_cache_bytes``) the least recently used other corpora are
    evicted (``worker.data.corpus_cache``)."""
    train_docs, valid_docs = read_documents(corpus, sources)
    fingerprint = _content_hash(train_docs, valid_docs)
    folder = Path(cache_dir) / "corpora" / fingerprint
    for attempt in range(3):
        if not (folder / "meta.json").exists():
            _write_entry(folder, corpus, train_docs, valid_docs)
        try:
            train = np.memmap(folder / "train.u8", dtype=np.uint8, mode="r")
            valid = np.memmap(folder / "valid.u8", dtype=np.uint8, mode="r")
            break
        except FileNotFoundError:  # evicted by another process meanwhile: write it again
            if attempt == 2:
                raise
    corpus_cache.touch(folder)
    if sources.max_cache_bytes is not None:
        corpus_cache.evict(folder.parent, sources.max_cache_bytes, keep=folder)
    return Corpus(corpus, fingerprint, train, valid)


def _write_entry(
    folder: Path, corpus: str, train_docs: list[Document], valid_docs: list[Document]
) -> None:
    """The corpus' cache entry, written in a staging folder and renamed into place;
    owner-only, like everything under $POSBENCH_HOME (a text: corpus may be private)."""
    private_folder(folder.parent)
    staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".staging-"))  # 0o700
    try:
        for label, docs in (("train", train_docs), ("valid", valid_docs)):
            content = DOC_SEPARATOR.join(d.content for d in docs)
            write_atomic(staging / f"{label}.u8", content, private=True)
        meta = {"corpus": corpus, "train_docs": len(train_docs), "valid_docs": len(valid_docs)}
        write_atomic(staging / "meta.json", json.dumps(meta).encode(), private=True)
        try:
            os.replace(staging, folder)  # atomic: concurrent workers agree on one copy
        except OSError:
            if not (folder / "meta.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _windows(stream: np.ndarray, starts: np.ndarray, length: int) -> torch.Tensor:
    """``[len(starts), length]`` int64 windows of a uint8 stream."""
    index = starts[:, None] + np.arange(length)[None, :]
    return torch.from_numpy(np.asarray(stream[index], dtype=np.int64))


@dataclass(frozen=True)
class WindowPlan:
    """Evaluation windows of one length: where each starts in the validation stream and
    which of its targets count. Every length of a study scores the same targets."""

    starts: np.ndarray  # stream offsets; a window holds length + 1 bytes
    first_scored: int  # index of the first scored target in a window
    scored: np.ndarray  # scored targets per window, from first_scored on

    @property
    def total(self) -> int:
        return int(self.scored.sum())


MAX_BLOCKS = 64  # scored stretches of the validation stream, spread over all of it


def scored_blocks(valid_bytes: int, longest: int, tokens: int, first: int) -> list[tuple[int, int]]:
    """``(first target, count)`` of each stretch of validation targets a study scores.

    The ``min(tokens, valid_bytes - longest)`` targets are cut into up to MAX_BLOCKS
    stretches of whole ``longest``-byte windows (the remainder ends the last one),
    spread evenly from target ``first`` to target ``first + valid_bytes - longest - 1``,
    so a study measures the whole validation split, not its first few documents.
    """
    usable = valid_bytes - longest
    total = min(tokens, usable)
    units = total // longest
    count = max(1, min(MAX_BLOCKS, units))
    sizes = [longest * (units // count + (k < units % count)) for k in range(count)]
    sizes[-1] += total - sum(sizes)
    gap = usable - total  # unscored targets, shared out between the stretches
    blocks, offset = [], first
    for k, size in enumerate(sizes):
        shift = gap * k // (count - 1) if count > 1 else 0
        blocks.append((offset + shift, size))
        offset += size
    return blocks


def window_plan(
    valid_bytes: int,
    length: int,
    protocol: str,
    tokens: int,
    stride: int | None,
    longest: int | None = None,
) -> WindowPlan:
    """The windows that score the same ``tokens`` targets at every length up to
    ``longest`` (the study's longest evaluation length; this one by default): the
    stretches of ``scored_blocks``, each scored by windows of this length.

    - ``nonoverlapping``: disjoint windows from the start of each stretch, every target
      scored (the last window's tail is not, when ``length`` does not divide the
      stretch).
    - ``sliding``: windows every ``stride`` bytes, the last ``stride`` targets of each
      scored, so every scored byte sees ``length - stride`` or more bytes of context;
      the stretches start at target ``longest - stride + 1`` or later, where the
      longest window first fits.

    When the validation split cannot hold ``tokens`` targets at the longest length,
    every length scores the same smaller number: ``valid_bytes - longest``.
    """
    longest = max(length, longest or length)
    if valid_bytes - longest < 1:
        raise CorpusError(
            f"the validation split has {valid_bytes} bytes; evaluating at length {longest} "
            f"needs at least {longest + 1}"
        )
    if protocol == "nonoverlapping":
        step, first_scored, first = length, 0, 1
    elif protocol == "sliding":
        if stride is None or not 1 <= stride <= length:
            raise ValueError(f"sliding needs 1 <= stride <= length, got stride={stride}")
        step, first_scored, first = stride, length - stride, longest - stride + 1
    else:
        raise ValueError(f"unknown protocol {protocol!r}")
    starts, scored = [], []
    for target, size in scored_blocks(valid_bytes, longest, tokens, first):
        # A window starting at w holds bytes w..w+length; its targets are w+1..w+length,
        # and it scores from target w + 1 + first_scored on.
        count = -(-size // step)
        starts.append(target - 1 - first_scored + np.arange(count, dtype=np.int64) * step)
        block = np.full(count, step, dtype=np.int64)
        block[-1] = size - (count - 1) * step
        scored.append(block)
    return WindowPlan(np.concatenate(starts), first_scored, np.concatenate(scored))


def document_spans(stream: np.ndarray, separator: int) -> np.ndarray:
    """``[n, 2]`` (start, end) of each document of ``stream``, split at ``separator``."""
    cuts = np.flatnonzero(np.asarray(stream) == separator)
    starts = np.concatenate([[0], cuts + 1]).astype(np.int64)
    ends = np.concatenate([cuts, [len(stream)]]).astype(np.int64)
    return np.stack([starts, ends], 1)


def scored_documents(
    spans: np.ndarray,
    sizes: np.ndarray,
    *,
    longest: int,
    tokens: int,
    prefixed: bool,
    min_bytes: int | None = None,
) -> np.ndarray:
    """Where the documents the ``document`` protocol scores start: documents that hold a
    window of the longest length (``longest`` targets after a prefix token, else
    ``longest + 1`` tokens) and are at least ``min_bytes`` bytes of text (``sizes``),
    ``tokens // longest`` of them (at least one), spread evenly over the split in its
    order - the same documents at every length."""
    need = longest + (0 if prefixed else 1)
    fits = (spans[:, 1] - spans[:, 0] >= need) & (sizes >= (min_bytes or 0))
    eligible = spans[fits, 0]
    if not len(eligible):
        bound = f" and {min_bytes} bytes" if min_bytes else ""
        raise CorpusError(
            f"the 'document' protocol scores documents of at least {need} tokens{bound}; "
            f"the validation split has none (its longest is "
            f"{int((spans[:, 1] - spans[:, 0]).max(initial=0))}): evaluate shorter lengths "
            "or use a corpus of longer documents"
        )
    count = min(len(eligible), max(1, tokens // longest))
    return eligible[(np.arange(count) * len(eligible)) // count]


def document_windows(stream: np.ndarray, starts: np.ndarray, length: int, prefix: int | None):
    """``[len(starts), length + 1]`` windows from each document's start: after the
    ``prefix`` token (the separator, or a model's BOS), so every one of the ``length``
    targets is the document's own, from its first token; without one, the first token
    is context only."""
    if prefix is None:
        return _windows(stream, starts, length + 1)
    body = _windows(stream, starts, length)
    return torch.cat([torch.full((len(starts), 1), prefix, dtype=body.dtype), body], 1)


class LanguageModelling(Task):
    name = "lm"
    metric = headline(Kind.LANGUAGE_MODELLING).name
    protocols = ("nonoverlapping", "sliding", "document")

    def __init__(self, corpus: str = "pystdlib") -> None:
        self.corpus_name = corpus
        self.corpus: Corpus | None = None

    def prepare(self, cache_dir: Path, sources: SourcePolicy = NO_SOURCES) -> None:
        if self.corpus is None:
            self.corpus = load_corpus(self.corpus_name, cache_dir, sources)

    @property
    def data(self) -> Corpus:
        if self.corpus is None:
            raise RuntimeError("call prepare() before drawing batches")
        return self.corpus

    @property
    def fingerprint(self) -> str:
        return f"lm:{self.corpus_name}:{self.data.fingerprint}"

    def train_batch(self, batch_size: int, length: int, generator: torch.Generator) -> Batch:
        train = self.data.train
        if len(train) < length + 1:
            raise CorpusError(
                f"the training split has {len(train)} bytes; length {length} needs more"
            )
        # A window holds length + 1 bytes: it may start anywhere up to len - length - 1.
        starts = torch.randint(0, len(train) - length, (batch_size,), generator=generator)
        inputs, targets = from_sequences(_windows(train, starts.numpy(), length + 1))
        return Batch(inputs, targets)

    def eval_batches(
        self,
        length: int,
        *,
        protocol: str,
        batch_size: int,
        tokens: int,
        examples: int,
        stride: int | None = None,
        longest: int | None = None,
        min_document_bytes: int | None = None,
    ) -> Iterator[Batch]:
        if protocol == "document":
            starts = self._documents(longest or length, tokens, min_document_bytes)
            for first in range(0, len(starts), batch_size):
                chunk = starts[first : first + batch_size]
                windows = document_windows(self.data.valid, chunk, length, DOC_SEPARATOR[0])
                yield Batch(*from_sequences(windows))
            return
        plan = window_plan(len(self.data.valid), length, protocol, tokens, stride, longest)
        position = torch.arange(length)
        for first in range(0, len(plan.starts), batch_size):
            chunk = plan.starts[first : first + batch_size]
            inputs, targets = from_sequences(_windows(self.data.valid, chunk, length + 1))
            counts = torch.from_numpy(plan.scored[first : first + batch_size])[:, None]
            begin = plan.first_scored
            scored = (position >= begin) & (position < begin + counts)
            yield Batch(inputs, targets, None if bool(scored.all()) else scored)

    def _documents(self, longest: int, tokens: int, min_bytes: int | None) -> np.ndarray:
        spans = self.data.documents
        sizes = spans[:, 1] - spans[:, 0]
        return scored_documents(
            spans, sizes, longest=longest, tokens=tokens, prefixed=True, min_bytes=min_bytes
        )

    def check_plan(self, spec: EvalSpec) -> None:
        # Before training: the longest length must fit the validation split.
        window_plan(len(self.data.valid), max(spec.lengths), "nonoverlapping", spec.tokens, None)
        if "document" in spec.protocols:
            self._documents(max(spec.lengths), spec.tokens, spec.min_document_bytes)
