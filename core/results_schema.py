"""The records a run produces, shared by whoever writes them and whoever reads them.

A worker builds these while it trains and evaluates; the store writes them to the
database, ``posbench run`` writes them into ``results.json`` (``StudyResults``) and
``posbench import`` reads them back from it (``parse_results``). One declaration, so
the format cannot drift between writer and reader. Torch-free: the importer and the CLI
load it without the engine.

The records are plain dataclasses: the writer builds them without checks (a run's
numbers are what they are), and the reader validates a file against the same classes
with pydantic, as strict JSON: no strings for numbers, no NaN or infinities.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from functools import cache
from typing import Annotated, Any

from pydantic import AfterValidator, ConfigDict, Field, TypeAdapter, with_config

# The largest results.json read back (``posbench import``, an earlier run in --out): a
# spec's largest study writes far less (64 runs, each with its curves and at most 1,024
# evaluation points); a larger file is refused before it is read.
MAX_RESULTS_BYTES = 256 << 20

# JSON as posbench run writes it: no strings for numbers, no NaN or infinities.
STRICT = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


# Every free string of a results.json is one printable line of at most MAX_TEXT
# characters (audit G6: a 5 MB not_applicable reason was imported, and every Compare
# page of its study sent it to the viewer). A test finds any str field without it.
MAX_TEXT = 500


def _one_printable_line(value: str) -> str:
    if not value.isprintable():
        raise ValueError("must be one line of printable characters")
    return value


Text = Annotated[str, Field(max_length=MAX_TEXT), AfterValidator(_one_printable_line)]


def bounded_text(value: str) -> str:
    """``value`` as the schema's ``Text`` takes it: its first line, control and other
    non-printable characters as "?", at most MAX_TEXT characters (what the engine writes
    of a message it did not compose, such as an exception's)."""
    line = value.splitlines()[0] if value else ""
    line = "".join(ch if ch.isprintable() else "?" for ch in line)
    return line if len(line) <= MAX_TEXT else line[: MAX_TEXT - 3] + "..."


@dataclass(frozen=True)
class TrainPoint:
    """One point of a training curve."""

    step: int
    loss: float
    lr: float
    tokens_per_second: float
    elapsed: float
    val_loss: float | None = None  # held-out loss at the training length, when validated


@dataclass
class PositionBin:
    """The mean loss of the targets at positions [start, end) of the windows."""

    start: int  # inclusive
    end: int  # exclusive
    loss: float
    tokens: int


@dataclass
class Evaluation:
    """One point of an extrapolation curve: (variant, protocol, length) -> metrics."""

    variant: Text
    protocol: Text
    length: int
    loss: float | None = None
    perplexity: float | None = None
    bits_per_byte: float | None = None
    accuracy: float | None = None
    token_accuracy: float | None = None
    string_match_all: float | None = None
    string_match_part: float | None = None
    # Key tokens (eval.key_tokens; None without it): worker.key_tokens.
    key_token_fraction: float | None = None
    key_token_perplexity: float | None = None
    key_token_gain: float | None = None
    # Attention diagnostics (eval.diagnostics; None without it): worker.diagnostics.
    attn_entropy: float | None = None
    attn_entropy_norm: float | None = None
    attn_distance: float | None = None
    attn_sink_mass: float | None = None
    attn_beyond_mass: float | None = None
    attn_max_logit: float | None = None
    tokens: int = 0
    tokens_per_second: float | None = None
    peak_memory_bytes: int | None = None
    not_applicable: Text | None = None
    # The decode protocol's: tokens decoded one at a time per second, and the most bytes
    # of keys and values one sequence's cache held (None under the other protocols).
    decode_tokens_per_second: float | None = None
    kv_cache_bytes: int | None = None
    factor: float | None = None
    position_bins: list[PositionBin] = field(default_factory=list)
    groups: dict[str, float] = field(default_factory=dict)
    # The diagnostics per layer ({"layers": {metric: [per layer]}, "heads": {metric:
    # [[per head] per layer]}, "queries": sampled queries per layer}); None without them.
    attention: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---------------------------------------------------------------------------------------
# results.json: what posbench run writes and posbench import reads


@dataclass(kw_only=True)
class TrainRecord:
    """A run's training: the steps it trained and its curve."""

    steps: Annotated[int, Field(ge=0)]
    final_loss: float | None = None
    resumed_from: int = 0  # the step it resumed from a checkpoint at (0: from scratch)
    seconds: float | None = None
    curve: list[TrainPoint] = field(default_factory=list)


# A ratio over an accuracy of 0 is infinite: a summary may be, and the reader checks
# the ones it takes (the order probe's) itself.
@with_config(ConfigDict(extra="ignore", strict=True, allow_inf_nan=True))
@dataclass
class SummaryRecord:
    """One number a run's curve (or its order probe) is turned into."""

    variant: Text
    protocol: Text
    name: Annotated[Text, Field(max_length=40)]
    value: float | None


@dataclass(kw_only=True)
class RunRecord:
    """One run of the study: who it is, its training, its evaluations and summaries."""

    label: Text
    encoding: Text = ""
    params: dict[str, Any] = field(default_factory=dict)
    seed: int
    config_hash: Text
    train: TrainRecord
    evaluations: list[Evaluation]
    summaries: list[SummaryRecord] = field(default_factory=list)
    provenance: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunRecord:
        """The record of the engine's own dict (no checks; an unknown or missing key is a
        bug and raises TypeError)."""
        train = dict(data["train"])
        train["curve"] = [TrainPoint(**point) for point in train.get("curve", [])]
        evaluations = []
        for values in data["evaluations"]:
            values = dict(values)
            values["position_bins"] = [PositionBin(**b) for b in values.get("position_bins", [])]
            evaluations.append(Evaluation(**values))
        return cls(
            **{
                **data,
                "train": TrainRecord(**train),
                "evaluations": evaluations,
                "summaries": [SummaryRecord(**s) for s in data.get("summaries", [])],
            }
        )


@with_config(STRICT)
@dataclass(kw_only=True)
class StudyResults:
    """``results.json``: the study's spec, its metric and every run."""

    spec: dict[str, Any]
    metric: Text | None = None
    runs: Annotated[list[RunRecord], Field(min_length=1)]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StudyResults:
        """The document of the engine's own dict (``worker.run.StudyResult.to_dict``)."""
        return cls(**{**data, "runs": [RunRecord.from_dict(run) for run in data["runs"]]})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self, indent: int | None = None) -> str:
        """The file's text (``indent=1`` in results.json, one line on stdout)."""
        return json.dumps(self.to_dict(), indent=indent)


@cache
def _reader() -> TypeAdapter[StudyResults]:
    return TypeAdapter(StudyResults)  # built on first use: the engine never reads a file


def parse_results(text: str | bytes) -> StudyResults:
    """A results.json validated against the declaration (pydantic's ValidationError
    when it does not conform)."""
    return _reader().validate_json(text)
