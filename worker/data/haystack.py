"""niah's ``text`` haystack: a window of a local corpus, the lm task's (``worker.data.lm``).

The corpus is read as the lm task reads it - the same names (``pystdlib``,
``text:<path>``, ``hf:...``), the same operator's rules on where it may come from, the
same train / validation split and cache - by ``prepare`` (a run's task is prepared);
unprepared (``posbench tasks sample``, a test) it is read in memory with no rules, so
only ``pystdlib`` can be. Training draws (no group) take their windows from the training
split and evaluation's from the validation split, as the lm task does.

A window starts at a random offset, then at the next line (within MARGIN bytes), and
ends with its last whole line; it is exactly the bytes asked for: the bytes of the line
cut short (or of a character cut, where it has no line break) are spaces before the text,
as the filler haystack is padded; a document separator is a line break. A window
holding one of the example's keys, or bytes that are not UTF-8, is drawn again (from the
same generator: deterministic), so a key occurs only in its needles.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

from core.catalog.corpora import SourcePolicy
from worker.data.base import NO_SOURCES
from worker.data.lm import DOC_SEPARATOR, load_corpus, read_documents
from worker.data.sources import CorpusError

# Bytes past a window's start within which it moves to the next line.
MARGIN = 256
# Windows tried before giving up (one holding a key, or not UTF-8, is drawn again).
MAX_TRIES = 100


@functools.lru_cache(maxsize=2)
def _in_memory(corpus: str) -> tuple[np.ndarray, np.ndarray]:
    """The corpus' training and validation streams, read with no operator's rules."""
    train, valid = read_documents(corpus)
    return tuple(  # type: ignore[return-value]
        np.frombuffer(DOC_SEPARATOR.join(d.content for d in docs), dtype=np.uint8)
        for docs in (train, valid)
    )


def whole_characters(data: bytes) -> str | None:
    """``data`` decoded, less a character cut at its end; None where it is not UTF-8."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        if err.reason != "unexpected end of data":
            return None
        return whole_characters(data[: err.start])


class TextHaystack:
    """Windows of ``corpus`` as haystacks."""

    def __init__(self, corpus: str) -> None:
        self.corpus = corpus
        self.streams: tuple[np.ndarray, np.ndarray] | None = None
        self.fingerprint = corpus  # the content's hash once prepared

    def prepare(self, cache_dir: Path, sources: SourcePolicy = NO_SOURCES) -> None:
        if self.streams is None:
            loaded = load_corpus(self.corpus, cache_dir, sources)
            self.streams = (loaded.train, loaded.valid)
            self.fingerprint = f"{self.corpus}:{loaded.fingerprint}"

    def stream(self, evaluation: bool) -> np.ndarray:
        if self.streams is None:
            self.streams = _in_memory(self.corpus)
        return self.streams[evaluation]

    def check(self, size: int, evaluation: bool) -> None:
        """Raise (a CorpusError) where the split cannot hold a haystack of ``size`` bytes."""
        stream = self.stream(evaluation)
        if len(stream) <= size + MARGIN:
            split = "validation" if evaluation else "training"
            raise CorpusError(
                f"niah's haystack corpus {self.corpus!r}: its {split} split has "
                f"{len(stream)} bytes; a haystack of {size} bytes needs more than "
                f"{size + MARGIN}"
            )

    def window(
        self, size: int, generator: torch.Generator, evaluation: bool, avoid: set[str]
    ) -> str:
        """``size`` bytes of text from the split, holding none of ``avoid``."""
        self.check(size, evaluation)
        stream = self.stream(evaluation)
        for _ in range(MAX_TRIES):
            start = int(torch.randint(0, len(stream) - size - MARGIN, (), generator=generator))
            raw = bytes(stream[start : start + size + MARGIN]).replace(DOC_SEPARATOR, b"\n")
            line = raw.find(b"\n", 0, MARGIN)
            begin = line + 1 if line >= 0 else 0
            while begin < MARGIN and raw[begin] & 0xC0 == 0x80:  # inside a character
                begin += 1
            text = whole_characters(raw[begin : begin + size])
            if text is None or any(key in text for key in avoid):
                continue
            text = text[: text.rfind("\n") + 1] or text  # whole lines, where it has one
            return " " * (size - len(text.encode())) + text
        raise CorpusError(
            f"niah's haystack corpus {self.corpus!r}: no window of {size} bytes in "
            f"{MAX_TRIES} tries is UTF-8 text without the example's keys"
        )
