"""eval.effective_length: a configurable bound for the effective context length."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from core.analysis import effective_context_length, summarize_points, summarize_run
from core.spec import SpecError, parse_spec

BASE: dict[str, Any] = {"encodings": ["rope"], "model": "tiny", "train": {"length": 32}}
ACC = {32: 0.9, 64: 0.8, 128: 0.6, 256: 0.4}
PPL = {32: 10.0, 64: 10.5, 128: 11.5, 256: 13.0}


def _spec(evaluation: dict[str, Any], task: str | None = None):
    spec = copy.deepcopy(BASE)
    spec["eval"] = {"lengths": [32, 64], **evaluation}
    if task:
        spec["task"] = task
    return parse_spec(spec)


def test_default_is_unchanged() -> None:
    assert summarize_run(ACC, 32, "accuracy")["effective_length"] == 128
    assert summarize_run(PPL, 32, "perplexity")["effective_length"] == 64
    plain = summarize_points(
        [("none", "p", n, v) for n, v in PPL.items()], train_length=32, metric="perplexity"
    )
    assert {s.name for s in plain} == set(summarize_run(PPL, 32, "perplexity"))


def test_absolute_and_relative_thresholds() -> None:
    assert effective_context_length(ACC, 32, "accuracy", threshold=0.7) == 64
    assert effective_context_length(ACC, 32, "accuracy", threshold=0.3) == 256
    assert effective_context_length(ACC, 32, "accuracy", threshold=0.95) is None
    assert effective_context_length(ACC, 32, "accuracy", relative=0.65) == 128  # >= 0.585
    assert effective_context_length(PPL, 32, "perplexity", threshold=12.0) == 128
    assert effective_context_length(PPL, 32, "perplexity", relative=0.8) == 128  # <= 12.5


def test_censoring_and_bound_rows() -> None:
    held = summarize_run(ACC, 32, "accuracy", effective={"threshold": 0.3, "relative": None})
    assert held["effective_length"] == 256 and held["effective_length_censored"] == 1.0
    failed = summarize_run(ACC, 32, "accuracy", effective={"threshold": 0.7})
    assert failed["effective_length"] == 64 and failed["effective_length_censored"] == 0.0
    rows = summarize_points(
        [("none", "p", n, v) for n, v in ACC.items()],
        train_length=32,
        metric="accuracy",
        effective={"threshold": None, "relative": 0.5},
    )
    named = {s.name: s.value for s in rows}
    assert named["effective_length"] == 128
    assert named["effective_length_bound"] == pytest.approx(0.45)


def test_spec_field_and_hash() -> None:
    plain = _spec({})
    chosen = _spec({"effective_length": {"relative": 0.9}})
    assert chosen.eval.effective_length.relative == 0.9
    assert plain.eval.effective_length is None
    assert plain.runs()[0].config_hash != chosen.runs()[0].config_hash
    again = parse_spec(plain.model_dump(mode="json"))
    assert again.runs()[0].config_hash == plain.runs()[0].config_hash


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({}, "exactly one"),
        ({"threshold": 0.5, "relative": 0.9}, "exactly one"),
        ({"relative": 1.5}, "relative"),
        ({"relative": 0}, "relative"),
        ({"threshold": -1}, "threshold"),
        ({"threshold": 0.5, "other": 1}, "other"),
    ],
)
def test_refusals(value: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError) as caught:
        _spec({"effective_length": value})
    assert message in str(caught.value)


def test_accuracy_threshold_at_most_one() -> None:
    with pytest.raises(SpecError, match="at most 1"):
        _spec({"effective_length": {"threshold": 2}}, task="passkey")
    assert _spec({"effective_length": {"threshold": 20}}).eval.effective_length.threshold == 20
