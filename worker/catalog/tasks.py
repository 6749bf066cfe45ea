"""The catalogue of tasks, free of torch like the encodings registry.

An entry carries its own rules: ``check`` on its resolved parameters (a corpus name's
form) and ``fits`` on the longest length it will be built at; no other module names
a task."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from jobs.metrics import Kind, headline
from worker.catalog.corpora import SourcePolicy, corpus_access_problem
from worker.catalog.params import EncodingConfigError, Param


class TaskConfigError(EncodingConfigError):
    """A user asked for a task or task parameter that does not exist or is out of range."""


@dataclass(frozen=True)
class TaskInfo:
    name: str
    kind: Kind  # what it is scored on: its metric is that kind's headline (jobs.metrics)
    summary: str
    reference: str
    implementation: str
    # The shortest training / evaluation sequence that can hold one example.
    min_length: int
    params: tuple[Param, ...] = ()
    # The entry's own rule on its resolved parameters: a problem, or None.
    check: Callable[[Mapping[str, Any]], str | None] | None = None
    # What keeps the task's examples from being built at a length (torch-free, for the
    # spec: a run must not fail after training).
    fits: Callable[[Mapping[str, Any], int], list[str]] | None = None
    # The entry's rule on where its data comes from, under the operator's rules
    # (corpus roots, HuggingFace on or off): a problem, or None. Settings are the
    # caller's: the service and ``posbench run`` at submit, the reader on the worker.
    sources: Callable[[Mapping[str, Any], SourcePolicy], str | None] | None = None
    # Its examples (or corpus) are UTF-8 text, so a model with a tokenizer of its own
    # (model.hf) can read them in its tokens; a task of other bytes is refused for one.
    text: bool = False

    @property
    def metric(self) -> str:
        """The metric the task is scored by (its study's metric)."""
        return headline(self.kind).name

    def resolve(self, params: Mapping[str, Any]) -> dict[str, Any]:
        known = {p.name for p in self.params}
        unknown = sorted(set(params) - known)
        if unknown:
            raise TaskConfigError(
                f"task {self.name!r} has no parameter {unknown[0]!r} "
                f"(allowed: {', '.join(sorted(known)) or 'none'})"
            )
        out: dict[str, Any] = {}
        for p in self.params:
            value = params.get(p.name, p.default)
            if value is None:
                raise TaskConfigError(
                    f"task {self.name!r}: parameter {p.name!r} must be {p.allowed()}, got null"
                )
            out[p.name] = p.check(f"task {self.name!r}", value)
        problem = self.check(out) if self.check else None
        if problem:
            raise TaskConfigError(f"task {self.name!r}: {problem}")
        return out

    def length_problems(self, params: Mapping[str, Any], longest: int) -> list[str]:
        """What keeps this task's examples from being built at ``longest`` bytes."""
        return self.fits(params, longest) if self.fits else []

    def source_problem(self, params: Mapping[str, Any], policy: SourcePolicy) -> str | None:
        """Why this service may not read the data ``params`` name, or None."""
        return self.sources(params, policy) if self.sources else None

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "metric": self.metric,
            "summary": self.summary,
            "reference": self.reference,
            "min_length": self.min_length,
            "params": [p.to_json() for p in self.params],
        }


CORPORA = (
    "pystdlib, text:<path> (a UTF-8 file or folder in a corpus root) or "
    "hf:<name>[:<config>[:<column>]]"
)


def corpus_problem(corpus: str) -> str | None:
    """What is wrong with the form of a corpus name, or None. Where it may be read from
    is the entry's ``sources`` hook (worker.catalog.corpora); whether a text: path
    exists is checked where the corpus is read (a worker's file system, not the
    submitter's)."""
    kind, _, rest = corpus.partition(":")
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
    )
}


# The task of a spec that names none.
DEFAULT_TASK = "lm"


def task_info(name: str) -> TaskInfo:
    try:
        return TASKS[name]
    except KeyError:
        raise TaskConfigError(f"unknown task {name!r} (available: {', '.join(TASKS)})") from None
