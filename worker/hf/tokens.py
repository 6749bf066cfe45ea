"""The language-modelling task in an hf: model's tokens.

The study's corpus is prepared as for posbench's models (``worker.data.lm``: the same
documents, the same validation split). Its validation documents are tokenized with the
model's tokenizer (no special tokens added), joined by the tokenizer's end-of-text token
where it has one (the NUL byte that separates them in the byte stream), and windows of
``length`` *tokens* are cut from that stream by the same plans as bytes are
(``worker.data.lm.window_plan``): the protocols, the scored stretches and the budget
(``eval.tokens``, now the model's tokens) mean what they mean for byte-level models.

Each token carries the bytes of text it covers (from the tokenizer's offsets: the bytes
after the previous token's end up to its own, UTF-8), so that bits per byte divides the
scored tokens' nats by the bytes they cover and models with different tokenizers compare
on one chart. A separator token covers its one byte.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from worker.data.base import Batch, Task, from_sequences
from worker.data.lm import (
    DOC_SEPARATOR,
    LanguageModelling,
    _windows,
    document_windows,
    scored_documents,
    window_plan,
)
from worker.data.sources import CorpusError

if TYPE_CHECKING:
    from core.spec import EvalSpec


def byte_ends(text: str, char_ends: np.ndarray) -> tuple[np.ndarray, int]:
    """The UTF-8 byte offsets of character offsets ``char_ends`` into ``text``, and the
    text's length in bytes."""
    raw = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    # A character starts at every byte that is not a continuation byte (10xxxxxx).
    starts = np.flatnonzero((raw & 0xC0) != 0x80)
    offsets = np.append(starts, len(raw))
    return offsets[np.clip(char_ends, 0, len(offsets) - 1)], len(raw)


def token_bytes(text: str, offsets: list[tuple[int, int]]) -> np.ndarray:
    """The bytes each token of ``text`` covers: from the previous token's end to its own
    (the first from the start, the last to the end of the text), so the tokens share out
    every byte. Tokens that end where the previous one did (a character split over
    several byte tokens) cover nothing more."""
    if not offsets:
        return np.zeros(0, dtype=np.int64)
    ends, total = byte_ends(text, np.array([end for _, end in offsets], dtype=np.int64))
    ends = np.maximum.accumulate(ends)
    ends[-1] = total
    return np.diff(ends, prepend=0).astype(np.int64)


def tokenize_documents(
    tokenizer: Any, documents: list[str]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(token ids, bytes per token, each document's (start, end) in the ids) of
    ``documents`` joined by the tokenizer's end-of-text token (its beginning-of-text where
    it has no end; nothing where it has neither)."""
    backend = tokenizer.backend_tokenizer
    encodings = backend.encode_batch(documents, add_special_tokens=False)
    separator = tokenizer.eos_token_id
    if separator is None:
        separator = tokenizer.bos_token_id
    ids: list[np.ndarray] = []
    sizes: list[np.ndarray] = []
    spans: list[tuple[int, int]] = []
    at = 0
    for index, (text, encoding) in enumerate(zip(documents, encodings, strict=True)):
        if index and separator is not None:
            ids.append(np.array([separator], dtype=np.int64))
            sizes.append(np.array([len(DOC_SEPARATOR)], dtype=np.int64))
            at += 1
        ids.append(np.asarray(encoding.ids, dtype=np.int64))
        sizes.append(token_bytes(text, encoding.offsets))
        spans.append((at, at + len(encoding.ids)))
        at += len(encoding.ids)
    if not ids:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, np.zeros((0, 2), dtype=np.int64)
    return np.concatenate(ids), np.concatenate(sizes), np.array(spans, dtype=np.int64)


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A hash of the tokenizer's definition (its tokenizer.json), for provenance."""
    definition = tokenizer.backend_tokenizer.to_str()
    return hashlib.sha256(definition.encode()).hexdigest()[:16]


class TokenizedLanguageModelling(Task):
    """``task`` (prepared) with its validation split in ``tokenizer``'s tokens."""

    name = LanguageModelling.name
    metric = LanguageModelling.metric
    protocols = LanguageModelling.protocols

    def __init__(self, task: LanguageModelling, tokenizer: Any, bos: bool = False) -> None:
        self.task = task
        valid = bytes(task.data.valid)
        parts = valid.split(DOC_SEPARATOR)
        documents = [doc.decode("utf-8", errors="replace") for doc in parts]
        self.ids, self.bytes, self.spans = tokenize_documents(tokenizer, documents)
        self.document_bytes = np.array([len(doc) for doc in parts], dtype=np.int64)
        self.tokenizer = tokenizer_fingerprint(tokenizer)
        # The document protocol's windows start with the tokenizer's BOS when asked.
        self.bos = tokenizer.bos_token_id if bos else None
        if bos and self.bos is None:
            raise CorpusError(
                "eval.bos: the model's tokenizer has no beginning-of-sequence token; "
                "remove eval.bos (each document's first token is then context only)"
            )

    @property
    def fingerprint(self) -> str:
        return f"{self.task.fingerprint}:tokens:{self.tokenizer}"

    def describe(self) -> dict[str, Any]:
        """The tokenized split, for provenance."""
        return {
            "tokenizer_sha256": self.tokenizer,
            "validation_tokens": len(self.ids),
            "validation_bytes": int(self.bytes.sum()),
        }

    def train_batch(self, batch_size: int, length: int, generator: torch.Generator) -> Batch:
        raise CorpusError("an hf: model is evaluated, never trained, on its tokens")

    def _plan(self, length: int, protocol: str, tokens: int, stride, longest):
        needed = max(length, longest or length) + 1
        if len(self.ids) < needed:
            raise CorpusError(
                f"the validation split is {len(self.ids)} tokens of the model's tokenizer; "
                f"evaluating at length {needed - 1} needs at least {needed}"
            )
        return window_plan(len(self.ids), length, protocol, tokens, stride, longest)

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
            yield from self._document_batches(
                length, batch_size, tokens, longest, min_document_bytes
            )
            return
        plan = self._plan(length, protocol, tokens, stride, longest)
        position = torch.arange(length)
        for first in range(0, len(plan.starts), batch_size):
            chunk = plan.starts[first : first + batch_size]
            inputs, targets = from_sequences(_windows(self.ids, chunk, length + 1))
            covered = _windows(self.bytes, chunk + 1, length)
            counts = torch.from_numpy(plan.scored[first : first + batch_size])[:, None]
            begin = plan.first_scored
            scored = (position >= begin) & (position < begin + counts)
            yield Batch(inputs, targets, None if bool(scored.all()) else scored, None, covered)

    def _documents(self, longest: int, tokens: int, min_bytes: int | None) -> np.ndarray:
        return scored_documents(
            self.spans,
            self.document_bytes,
            longest=longest,
            tokens=tokens,
            prefixed=self.bos is not None,
            min_bytes=min_bytes,
        )

    def _document_batches(
        self, length: int, batch_size: int, tokens: int, longest: int | None, min_bytes
    ) -> Iterator[Batch]:
        """Each scored document from its start: after the BOS (every target the
        document's own), or from its first token (the first target its second token)."""
        starts = self._documents(longest or length, tokens, min_bytes)
        first_target = 0 if self.bos is not None else 1
        for first in range(0, len(starts), batch_size):
            chunk = starts[first : first + batch_size]
            windows = document_windows(self.ids, chunk, length, self.bos)
            covered = _windows(self.bytes, chunk + first_target, length)
            yield Batch(*from_sequences(windows), None, None, covered)

    def check_plan(self, spec: EvalSpec, probe_length: int | None = None) -> None:
        """Before the first evaluation: the longest length (and the order probe's,
        ``probe_length``: the model's context) must fit the split in tokens."""
        self._plan(max(spec.lengths), "nonoverlapping", spec.tokens, None, None)
        if "document" in spec.protocols:
            self._documents(max(spec.lengths), spec.tokens, spec.min_document_bytes)
        if probe_length is not None and len(self.ids) < probe_length + 1:
            raise CorpusError(
                f"the validation split is {len(self.ids)} tokens of the model's tokenizer; "
                f"the order probe scores windows of train.length = {probe_length} tokens "
                "(give a larger corpus, or eval.order_probe: false)"
            )


def tokenized(task: Task, tokenizer: Any, bos: bool = False) -> TokenizedLanguageModelling:
    """The study's language-modelling task, prepared, in the model's tokens (a synthetic
    task's are ``worker.hf.answers``)."""
    if not isinstance(task, LanguageModelling):
        raise CorpusError(f"task {task.name!r} is not language modelling")
    return TokenizedLanguageModelling(task, tokenizer, bos)
