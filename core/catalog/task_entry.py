"""What a task is in the catalogue (:class:`TaskInfo`) and the error a bad choice of one
raises; the entries are in :mod:`core.catalog.tasks` (and, for the algorithmic tasks,
:mod:`core.catalog.algorithmic`). Torch-free like the whole catalogue."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from core.catalog.corpora import SourcePolicy
from core.catalog.params import EncodingConfigError, Param
from core.metrics import Kind, headline


class TaskConfigError(EncodingConfigError):
    """A user asked for a task or task parameter that does not exist or is out of range."""


@dataclass(frozen=True)
class TaskInfo:
    name: str
    kind: Kind  # what it is scored on: its metric is that kind's headline (core.metrics)
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

    def first_misfit(
        self, params: Mapping[str, Any], lengths: Iterable[int]
    ) -> tuple[int, list[str]] | None:
        """The first of ``lengths`` (in their order) whose examples cannot be built, with
        what keeps them from it; None when every one fits. Below the task's
        ``min_length`` is the caller's to say (in bytes, or an hf: model's tokens)."""
        for length in lengths:
            if problems := self.length_problems(params, length):
                return length, problems
        return None

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
