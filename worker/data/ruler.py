"""Retrieval and tracking in long text, after RULER's synthetic tasks (Hsieh et al. 2024,
arXiv:2404.06654), byte-level like the other synthetic tasks.

- ``niah``: needles ``key is value.`` hidden at some depth in a haystack (the pass key's
  filler sentences, needles of other keys, or lines of a local corpus:
  ``worker.data.haystack``), then ``What is key?`` and the key's values. Several keys
  (distractors), several values per key and several keys asked give RULER's single,
  multikey, multivalue and multiquery settings.
- ``variable_tracking``: chains ``VAR A = 12345.``, ``VAR B = VAR A.``, ... spread through
  filler, then ``Which variables hold 12345?`` and the chain's variables.

A task with several answers writes them in a canonical order (the keys as asked, each
key's values as they appear; a chain's variables as assigned) separated by ``, ``, and
the whole span is scored. The texts are the templates of ``core.catalog.ruler``.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from core.catalog.corpora import SourcePolicy
from core.catalog.ruler import (
    DEFAULT_CORPUS,
    NIAH_NEEDLE,
    NIAH_QUESTION,
    SEPARATOR,
    SYMBOL_SIZES,
    TRACKING_COPY_LINE,
    TRACKING_NAME,
    TRACKING_QUESTION,
    TRACKING_VALUE,
    TRACKING_VALUE_LINE,
    niah_bytes,
    tracking_bytes,
)
from worker.data.base import NO_SOURCES
from worker.data.haystack import TextHaystack
from worker.data.synthetic import FILLER, PASSKEY_DEPTHS, SyntheticTask

if TYPE_CHECKING:
    from core.spec import EvalSpec

CONSONANTS = "bdfgklmnprstvz"
VOWELS = "aeiou"
DIGITS = string.digits
# The alphabet of each character of a symbol of each kind.
PATTERNS = {
    "words": (CONSONANTS, VOWELS) * (SYMBOL_SIZES["words"] // 2),
    "numbers": (DIGITS[1:], *(DIGITS,) * (SYMBOL_SIZES["numbers"] - 1)),
    "uuids": ("0123456789abcdef",) * SYMBOL_SIZES["uuids"],
    "names": (string.ascii_uppercase,) * TRACKING_NAME,
    "values": (DIGITS[1:], *(DIGITS,) * (TRACKING_VALUE - 1)),
}


def distinct(
    kind: str, count: int, generator: torch.Generator, avoid: set[str] | None = None
) -> list[str]:
    """``count`` distinct symbols of ``kind`` (none of ``avoid``), in the order drawn."""
    pattern = PATTERNS[kind]
    found: dict[str, None] = {}
    while len(found) < count:
        rows = 2 * (count - len(found))
        columns = [torch.randint(0, len(a), (rows,), generator=generator).tolist() for a in pattern]
        for picks in zip(*columns, strict=True):
            symbol = "".join(a[i] for a, i in zip(pattern, picks, strict=True))
            if not avoid or symbol not in avoid:
                found.setdefault(symbol)
            if len(found) == count:
                break
    return list(found)


SENTENCES = [sentence + ". " for sentence in FILLER.strip().removesuffix(".").split(". ")]


def filler(size: int) -> str:
    """``size`` bytes of the pass key's filler sentences, whole: the bytes the next one
    would not fit in are spaces before them."""
    sentences, used = [], 0
    while used + len(SENTENCES[len(sentences) % len(SENTENCES)]) <= size:
        sentences.append(SENTENCES[len(sentences) % len(SENTENCES)])
        used += len(sentences[-1])
    return " " * (size - used) + "".join(sentences)


def cut_at(haystack: str, depth: float, boundary: str = ". ") -> int:
    """Where a piece goes at ``depth``: the place after a ``boundary`` (the end of a
    sentence, as for the pass key's needle, or of a line), the haystack's start or its
    end, whichever is nearest ``depth`` (below on a tie). Nearest, not the one below: a
    short haystack has few boundaries, and rounding down would put a needle at its end
    (depth 1, right before the question) in training almost never."""
    target = depth * len(haystack)
    cut = round(target)
    if not 0 < cut < len(haystack):
        return max(0, min(cut, len(haystack)))
    found = haystack.rfind(boundary, 0, cut + len(boundary) - 1)
    below = 0 if found < 0 else found + len(boundary)
    found = haystack.find(boundary, cut)
    above = len(haystack) if found < 0 else found + len(boundary)
    return below if target - below <= above - target else above


def insert(
    haystack: str,
    pieces: list[tuple[float, str]],
    boundary: str = ". ",
    ties: list[int] | None = None,
) -> tuple[str, list[int]]:
    """``haystack`` with each (depth, text) piece put at its depth, and the pieces' indices
    in the order they appear. Pieces that land at one boundary keep their own order, or
    that of their ``ties`` ranks (lowest first)."""
    ties = ties if ties is not None else list(range(len(pieces)))
    cuts = sorted(
        (cut_at(haystack, depth, boundary), ties[index], index)
        for index, (depth, _) in enumerate(pieces)
    )
    cuts = [(cut, index) for cut, _, index in cuts]
    parts, previous = [], 0
    for cut, index in cuts:
        parts += [haystack[previous:cut], pieces[index][1]]
        previous = cut
    parts.append(haystack[previous:])
    return "".join(parts), [index for _, index in cuts]


def finish(prompt: str, answers: list[str], length: int) -> tuple[bytes, int]:
    """The example's bytes (``prompt`` then the answers) and the answer's size."""
    answer = SEPARATOR.join(answers)
    sequence = (prompt + answer).encode()
    assert len(sequence) == length + 1, (len(sequence), length)
    return sequence, len(answer)


class NeedleInAHaystack(SyntheticTask):
    """``num_keys`` keys with ``num_values`` needles each at random depths in the haystack
    (in evaluation, the first asked key's first needle at each depth of the grid); the
    first ``num_queries`` keys are asked."""

    name = "niah"

    def __init__(
        self,
        haystack: str = "repeat",
        keys: str = "words",
        values: str = "numbers",
        num_keys: int = 1,
        num_values: int = 1,
        num_queries: int = 1,
        corpus: str = DEFAULT_CORPUS,
    ) -> None:
        self.haystack = haystack
        # haystack text: windows of a corpus, needles at the starts of its lines.
        self.text = TextHaystack(corpus) if haystack == "text" else None
        self.boundary = "\n" if self.text is not None else ". "
        self.keys, self.values = keys, values
        self.num_keys, self.num_values, self.num_queries = num_keys, num_values, num_queries
        self.fixed = niah_bytes(
            {
                "keys": keys,
                "values": values,
                "num_keys": num_keys,
                "num_values": num_values,
                "num_queries": num_queries,
            }
        )

    def groups(self) -> tuple[float | None, ...]:
        return PASSKEY_DEPTHS

    def prepare(self, cache_dir: Path, sources: SourcePolicy = NO_SOURCES) -> None:
        if self.text is not None:
            self.text.prepare(cache_dir, sources)

    @property
    def fingerprint(self) -> str:
        return self.name if self.text is None else f"{self.name}:text:{self.text.fingerprint}"

    def check_plan(self, spec: EvalSpec) -> None:
        # Before training: the validation split must hold the longest haystack.
        if self.text is not None:
            self.text.check(max(spec.lengths) + 1 - self.fixed, evaluation=True)

    def _haystack(
        self, size: int, generator: torch.Generator, planted: set[str], evaluation: bool
    ) -> str:
        if self.haystack == "repeat":
            return filler(size)
        if self.text is not None:
            return self.text.window(size, generator, evaluation, avoid=planted)
        # Needles of other keys; the bytes a needle cannot fill are spaces before them.
        key, value = "k" * SYMBOL_SIZES[self.keys], "v" * SYMBOL_SIZES[self.values]
        needle = len(NIAH_NEEDLE.format(key=key, value=value))
        count = size // needle
        keys = distinct(self.keys, count, generator, avoid=planted)
        values = distinct(self.values, count, generator)
        needles = "".join(
            NIAH_NEEDLE.format(key=k, value=v) for k, v in zip(keys, values, strict=True)
        )
        return " " * (size - count * needle) + needles

    def example(
        self, length: int, generator: torch.Generator, group: float | None
    ) -> tuple[bytes, int, str, list[str]]:
        spare = length + 1 - self.fixed
        if spare < 0:
            raise ValueError(f"niah needs sequences of at least {self.fixed - 1} bytes")
        keys = distinct(self.keys, self.num_keys, generator)
        values = distinct(self.values, self.num_keys * self.num_values, generator)
        planted = [
            (key, values[k * self.num_values + v])
            for k, key in enumerate(keys)
            for v in range(self.num_values)
        ]
        asked = keys[: self.num_queries]
        haystack = self._haystack(spare, generator, set(keys), evaluation=group is not None)
        depths = torch.rand((len(planted),), generator=generator).tolist()
        if group is not None:
            depths[0] = group  # the first asked key's first needle
        needles = [NIAH_NEEDLE.format(key=k, value=v) for k, v in planted]
        # Needles at one boundary (a short haystack has few, and every needle may share
        # one) in a random order: in key order the asked needle would come first, a
        # shortcut a model learns instead of retrieval. The grid's needle stays first
        # among its ties, so that it sits at its depth.
        ties = torch.randperm(len(planted), generator=generator).tolist()
        if group is not None:
            ties[0] = -1
        text, order = insert(haystack, list(zip(depths, needles, strict=True)), self.boundary, ties)
        answers = [planted[i][1] for key in asked for i in order if planted[i][0] == key]
        question = NIAH_QUESTION.format(keys=SEPARATOR.join(asked))
        sequence, size = finish(text + question, answers, length)
        return sequence, size, "" if group is None else f"depth={group:g}", answers


class VariableTracking(SyntheticTask):
    """``num_chains`` chains of a value passed through ``num_hops`` variables, their lines
    spread through filler in each chain's order; one chain's value is asked."""

    name = "variable_tracking"

    def __init__(self, num_chains: int = 1, num_hops: int = 4) -> None:
        self.num_chains, self.num_hops = num_chains, num_hops
        self.fixed = tracking_bytes({"num_chains": num_chains, "num_hops": num_hops})

    def example(
        self, length: int, generator: torch.Generator, group: int | None
    ) -> tuple[bytes, int, str, list[str]]:
        spare = length + 1 - self.fixed
        if spare < 0:
            raise ValueError(
                f"variable_tracking needs sequences of at least {self.fixed - 1} bytes"
            )
        per_chain = self.num_hops + 1
        names = distinct("names", self.num_chains * per_chain, generator)
        values = distinct("values", self.num_chains, generator)
        chains = [names[c * per_chain : (c + 1) * per_chain] for c in range(self.num_chains)]
        lines = [
            [TRACKING_VALUE_LINE.format(name=chain[0], value=value)]
            + [
                TRACKING_COPY_LINE.format(name=chain[hop + 1], source=chain[hop])
                for hop in range(self.num_hops)
            ]
            for chain, value in zip(chains, values, strict=True)
        ]
        asked = int(torch.randint(0, self.num_chains, (), generator=generator))
        # Each slot (in depth order) takes the next line of a chain: a random interleaving.
        depths = sorted(torch.rand((len(names),), generator=generator).tolist())
        owners = [int(i) // per_chain for i in torch.randperm(len(names), generator=generator)]
        taken = [0] * self.num_chains
        pieces = []
        for depth, owner in zip(depths, owners, strict=True):
            pieces.append((depth, lines[owner][taken[owner]]))
            taken[owner] += 1
        text, _ = insert(filler(spare), pieces)
        question = TRACKING_QUESTION.format(value=values[asked])
        sequence, size = finish(text + question, chains[asked], length)
        return sequence, size, "", chains[asked]
