"""The catalogue of tasks, free of torch like the encodings registry.

An entry carries its own rules: ``check`` on its resolved parameters (a corpus name's
form) and ``fits`` on the longest length it will be built at; no other module names
a task."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from core.catalog.algorithmic import ALGORITHMIC
from core.catalog.corpora import corpus_access_problem
from core.catalog.params import Param
from core.catalog.ruler import (
    HAYSTACKS,
    SYMBOL_SIZES,
    common_fits,
    frequent_fits,
    niah_fits,
    niah_problem,
    tracking_fits,
)
from core.catalog.task_entry import TaskConfigError, TaskInfo
from core.metrics import Kind

CORPORA = (
    "pystdlib, text:<path> (a UTF-8 file or folder in a corpus root) or "
    "hf:<name>[:<config>[:<column>]]"
)


def corpus_problem(corpus: str) -> str | None:
    """What is wrong with the form of a corpus name, or None. Where it may be read from
    is the entry's ``sources`` hook (core.catalog.corpora); whether a text: path
    exists is checked where the corpus is read (a worker's file system, not the
    submitter's)."""
    kind, _, rest = corpus.partition(":")
    if not corpus.isprintable():
        # A path that would reach a terminal or a log line as control codes.
        return (
            f"corpus {corpus!r} holds a control or separator character; a corpus is a "
            "printable name or path"
        )
    if corpus == "pystdlib":
        return None
    if kind in ("text", "hf") and rest.strip():
        if kind == "hf" and not rest.split(":")[0].strip():
            return f"corpus {corpus!r} names no dataset (hf:<name>[:<config>[:<column>]])"
        return None
    return f"corpus {corpus!r} is not one of {CORPORA}"


def assoc_recall_pairs(key_length: int, length: int) -> int:
    """How many ``key=vv;`` pairs an assoc_recall example of ``length`` bytes holds,
    after room for the ``?key=vv`` query (both are key_length + 4 bytes)."""
    size = key_length + 4
    return (length + 1 - size) // size


def _distinct_keys(params: Mapping[str, Any], longest: int) -> list[str]:
    key_length = params["key_length"]
    pairs = assoc_recall_pairs(key_length, longest)
    if pairs > 26**key_length:
        return [
            f"task 'assoc_recall' with key_length={key_length} has {26**key_length} "
            f"distinct keys; length {longest} needs {pairs} (raise key_length)"
        ]
    return []


TASKS: dict[str, TaskInfo] = {
    info.name: info
    for info in (
        TaskInfo(
            name="lm",
            kind=Kind.LANGUAGE_MODELLING,
            summary="Byte-level language modelling; loss, perplexity and bits per byte.",
            reference="Press et al. 2022 (ALiBi) evaluate extrapolation this way on WikiText-103",
            implementation="worker.data.lm:LanguageModelling",
            min_length=2,
            params=(
                Param(
                    "corpus",
                    str,
                    "pystdlib",
                    "pystdlib (the interpreter's own standard library sources), "
                    "text:<path> (a UTF-8 file or folder inside a corpus root) or "
                    "hf:<name>[:<config>[:<column>]] (where an operator turned them on)",
                ),
            ),
            check=lambda params: corpus_problem(params["corpus"]),
            sources=lambda params, policy: corpus_access_problem(params["corpus"], policy),
            text=True,
        ),
        TaskInfo(
            name="passkey",
            kind=Kind.ANSWER,
            summary="Retrieve a 5-digit pass key hidden at some depth in filler text.",
            reference="Mohtashami & Jaggi 2023, Landmark Attention (arXiv:2305.16300)",
            implementation="worker.data.synthetic:Passkey",
            min_length=128,
            params=(Param("digits", int, 5, "digits in the pass key", low=1, high=12),),
            text=True,
        ),
        TaskInfo(
            name="copy",
            kind=Kind.ANSWER,
            summary="Copy a random string after a separator; exact match of the copy.",
            reference="Ruoss et al. 2023; Delétang et al. 2023, Neural Networks and the Chomsky "
            "Hierarchy (arXiv:2207.02098)",
            implementation="worker.data.synthetic:Copy",
            min_length=8,
            # Letters, digits, '+' and '/': the symbols are text.
            params=(Param("alphabet", int, 26, "distinct symbols in the string", low=2, high=64),),
            text=True,
        ),
        TaskInfo(
            name="assoc_recall",
            kind=Kind.ANSWER,
            summary="Key-value pairs, then a query key; answer its value.",
            reference="Ba et al. 2016, Using Fast Weights to Attend to the Recent Past; "
            "Arora et al. 2023, Zoology (arXiv:2312.04927)",
            implementation="worker.data.synthetic:AssociativeRecall",
            min_length=32,
            params=(Param("key_length", int, 3, "letters per key", low=1, high=8),),
            fits=_distinct_keys,
            text=True,
        ),
        TaskInfo(
            name="sov_tr",
            kind=Kind.ANSWER,
            summary="Who gave what to whom in a Turkish sentence among distractors: roles from "
            "case suffixes (scrambled order) or from position (bare nouns, fixed SOV).",
            reference="Göksel & Kerslake 2005, Turkish: A Comprehensive Grammar; word-order "
            "probing as in Sinha et al. 2021 (arXiv:2104.06644)",
            implementation="worker.data.turkish:TurkishWordOrder",
            # worker.data.turkish.min_length(): the longest target sentence, question and answer.
            min_length=89,
            params=(
                Param(
                    "variant",
                    str,
                    "both",
                    "marked (case suffixes, scrambled order), bare (no suffixes, fixed "
                    "S-IO-DO-V order) or both (half each, reported per variant)",
                    choices=("marked", "bare", "both"),
                ),
            ),
            text=True,
        ),
        TaskInfo(
            name="niah",
            kind=Kind.ANSWER,
            summary="Needles 'key is value.' in a haystack, then a key is asked: its values. "
            "Distractor keys, several values and several keys asked as in RULER.",
            reference="Hsieh et al. 2024, RULER (arXiv:2404.06654); Kamradt 2023, "
            "needle in a haystack",
            implementation="worker.data.ruler:NeedleInAHaystack",
            # The defaults' needle, question and answer (core.catalog.ruler.niah_bytes).
            min_length=64,
            params=(
                Param(
                    "haystack",
                    str,
                    "repeat",
                    "repeat (the pass key's filler sentences), needles (needles of other "
                    "keys, the distractors) or text (lines of the corpus `corpus`)",
                    choices=HAYSTACKS,
                ),
                Param(
                    "corpus",
                    str,
                    "pystdlib",
                    "the corpus of haystack text, as the lm task's: pystdlib, text:<path> "
                    "or hf:<name>[:<config>[:<column>]]",
                ),
                Param("keys", str, "words", "what keys are", choices=tuple(SYMBOL_SIZES)),
                Param("values", str, "numbers", "what values are", choices=tuple(SYMBOL_SIZES)),
                Param(
                    "num_keys",
                    int,
                    1,
                    "keys with needles (one asked, the rest distract)",
                    low=1,
                    high=16,
                ),
                Param("num_values", int, 1, "needles (values) of each key", low=1, high=8),
                Param("num_queries", int, 1, "keys asked (at most num_keys)", low=1, high=8),
            ),
            check=lambda params: niah_problem(params) or corpus_problem(params["corpus"]),
            sources=lambda params, policy: (
                corpus_access_problem(params["corpus"], policy)
                if params["haystack"] == "text"
                else None
            ),
            fits=niah_fits,
            text=True,
        ),
        TaskInfo(
            name="variable_tracking",
            kind=Kind.ANSWER,
            summary="Chains VAR B = VAR A through filler; which variables hold a value?",
            reference="Hsieh et al. 2024, RULER (arXiv:2404.06654)",
            implementation="worker.data.ruler:VariableTracking",
            min_length=256,
            params=(
                Param(
                    "num_chains", int, 1, "chains (one asked, the rest distract)", low=1, high=16
                ),
                Param("num_hops", int, 4, "copies along each chain", low=1, high=16),
            ),
            fits=tracking_fits,
            text=True,
        ),
        TaskInfo(
            name="common_words",
            kind=Kind.ANSWER,
            summary="A shuffled list of words: which occur most often? Aggregation over the "
            "whole context.",
            reference="Hsieh et al. 2024, RULER (arXiv:2404.06654)",
            implementation="worker.data.aggregation:CommonWords",
            # The defaults' common words, question and answer (common_bytes).
            min_length=300,
            params=(
                Param("num_common", int, 4, "common words (the answer)", low=1, high=32),
                Param("freq_common", int, 8, "occurrences of each common word", low=2, high=100),
                Param("freq_rare", int, 2, "most occurrences of any other word", low=1, high=99),
            ),
            check=lambda params: (
                f"freq_rare = {params['freq_rare']} must be below freq_common = "
                f"{params['freq_common']}"
                if params["freq_rare"] >= params["freq_common"]
                else None
            ),
            fits=common_fits,
            text=True,
        ),
        TaskInfo(
            name="frequent_words",
            kind=Kind.ANSWER,
            summary="Words drawn by Zipf's law: which are the most frequent? Aggregation over "
            "the whole context.",
            reference="Hsieh et al. 2024, RULER (arXiv:2404.06654)",
            implementation="worker.data.aggregation:FrequentWords",
            # Where the defaults' top words first each outnumber the next (frequent_fits).
            min_length=256,
            params=(
                Param("alpha", float, 2.0, "Zipf exponent of the words' counts", low=1.0, high=3.0),
                Param("num_top", int, 3, "most frequent words (the answer)", low=1, high=8),
            ),
            fits=frequent_fits,
            # Its counts (so its words) change with the length: no byte budget comes near a
            # count of an hf: model's tokens, so it is offered to byte-level models only.
            text=False,
        ),
        *ALGORITHMIC,
    )
}


# The task of a spec that names none.
DEFAULT_TASK = "lm"


def task_info(name: str) -> TaskInfo:
    try:
        return TASKS[name]
    except KeyError:
        raise TaskConfigError(f"unknown task {name!r} (available: {', '.join(TASKS)})") from None
