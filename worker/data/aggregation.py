"""Aggregation over a long list of words, after RULER's common and frequent words
extraction (Hsieh et al. 2024, arXiv:2404.06654): no single place holds the answer, the
whole list must be counted.

- ``common_words``: ``num_common`` words occur ``freq_common`` times each, every other
  word at most ``freq_rare`` times; the answer is the common words in the order they
  first appear.
- ``frequent_words``: the words' counts follow Zipf's law with exponent ``alpha``; the
  answer is the ``num_top`` most frequent, most frequent first.

The list is words and spaces, shuffled; the bytes a word cannot fill are spaces before
it. The texts are the templates of ``core.catalog.ruler``.
"""

from __future__ import annotations

import torch

from core.catalog.ruler import (
    COMMON_QUESTION,
    FREQUENT_QUESTION,
    SYMBOL_SIZES,
    WORD,
    answer_bytes,
    common_bytes,
    frequent_fits,
    frequent_words,
    zipf_counts,
)
from worker.data.ruler import distinct, finish
from worker.data.synthetic import SyntheticTask


def word_list(
    length: int, counts: list[int], question: str, answer: int, generator: torch.Generator
) -> tuple[str, list[str]]:
    """The shuffled list of distinct words occurring ``counts`` times, padded in front to
    fill ``length + 1`` bytes with the question and an answer of ``answer`` bytes, then
    the question; and the words, in the order of ``counts``."""
    words = distinct("words", len(counts), generator)
    bag = [index for index, count in enumerate(counts) for _ in range(count)]
    order = torch.randperm(len(bag), generator=generator).tolist()
    spare = length + 1 - len(question) - answer - WORD * len(bag)
    body = "".join(words[bag[i]] + " " for i in order)
    return " " * spare + body + question, words


class CommonWords(SyntheticTask):
    """Common words among rare ones; which are the common words?"""

    name = "common_words"

    def __init__(self, num_common: int = 4, freq_common: int = 8, freq_rare: int = 2) -> None:
        self.num_common, self.freq_common, self.freq_rare = num_common, freq_common, freq_rare
        self.fixed = common_bytes(
            {"num_common": num_common, "freq_common": freq_common, "freq_rare": freq_rare}
        )

    def example(
        self, length: int, generator: torch.Generator, group: int | None
    ) -> tuple[bytes, int, str, list[str]]:
        if length + 1 < self.fixed:
            raise ValueError(f"common_words needs sequences of at least {self.fixed - 1} bytes")
        answer = answer_bytes(self.num_common, SYMBOL_SIZES["words"])
        rare = (length + 1 - self.fixed) // WORD  # places for rare words
        full, rest = divmod(rare, self.freq_rare)
        counts = [self.freq_common] * self.num_common + [self.freq_rare] * full
        counts += [rest] if rest else []
        question = COMMON_QUESTION.format(count=self.num_common)
        text, words = word_list(length, counts, question, answer, generator)
        common = words[: self.num_common]
        firsts = {word: text.index(word + " ") for word in common}
        answers = sorted(common, key=firsts.__getitem__)
        sequence, size = finish(text, answers, length)
        return sequence, size, "", answers


class FrequentWords(SyntheticTask):
    """Words drawn by Zipf's law; which are the most frequent?"""

    name = "frequent_words"

    def __init__(self, alpha: float = 2.0, num_top: int = 3) -> None:
        self.alpha, self.num_top = alpha, num_top

    def example(
        self, length: int, generator: torch.Generator, group: int | None
    ) -> tuple[bytes, int, str, list[str]]:
        params = {"alpha": self.alpha, "num_top": self.num_top}
        problems = frequent_fits(params, length)
        if problems:
            raise ValueError(problems[0])
        counts = zipf_counts(frequent_words(length, params), self.alpha)
        question = FREQUENT_QUESTION.format(count=self.num_top)
        answer = answer_bytes(self.num_top, SYMBOL_SIZES["words"])
        text, words = word_list(length, counts, question, answer, generator)
        sequence, size = finish(text, words[: self.num_top], length)
        return sequence, size, "", words[: self.num_top]
