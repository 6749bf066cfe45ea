"""The metric registry, the results.json schema and the curve table: one declaration
each, read by every writer and reader."""

from __future__ import annotations

import dataclasses
import json
import math

import pandas as pd
import pytest
from pydantic import ValidationError
from rich.console import Console

from core.analysis import LOWER_IS_BETTER
from core.catalog.tasks import TASKS
from core.metrics import (
    METRICS,
    Kind,
    diagnostics,
    headline,
    measured,
    metric_named,
    reported,
    shown_with,
)
from core.results_schema import Evaluation, StudyResults, parse_results
from core.tables import curve_table, markdown_rows, seed_means, seed_summary_table
from db.models import Evaluation as StoredEvaluation


def test_every_metric_has_its_columns_and_every_task_a_registered_metric() -> None:
    stored = {column.name for column in StoredEvaluation.__table__.columns}
    recorded = {f.name for f in dataclasses.fields(Evaluation)}
    for metric in METRICS.values():
        assert metric.column in stored and metric.column in recorded
    assert {task.metric for task in TASKS.values()} == {
        m.name for m in METRICS.values() if m.headline
    }
    assert {TASKS["lm"].kind, TASKS["copy"].kind} == set(Kind)
    assert LOWER_IS_BETTER == {
        "loss": True,
        "perplexity": True,
        "bits_per_byte": True,
        "accuracy": False,
        "token_accuracy": False,
        "string_match_all": False,
        "string_match_part": False,
        "key_token_fraction": False,
        "key_token_perplexity": True,
        "key_token_gain": False,
        "attn_entropy": True,
        "attn_entropy_norm": True,
        "attn_distance": False,
        "attn_sink_mass": True,
        "attn_beyond_mass": True,
        "attn_max_logit": True,
    }


def test_the_registry_answers_what_the_views_ask() -> None:
    assert headline(Kind.LANGUAGE_MODELLING).name == "perplexity"
    assert headline(Kind.ANSWER).name == "accuracy"
    keys = ["key_token_fraction", "key_token_perplexity", "key_token_gain"]
    assert [m.name for m in shown_with("perplexity")] == [
        "perplexity",
        "loss",
        "bits_per_byte",
        *keys,
    ]
    ruler = ["string_match_all", "string_match_part"]
    assert [m.name for m in shown_with("accuracy")] == ["accuracy", "token_accuracy", *ruler]
    attention = [
        "attn_entropy",
        "attn_entropy_norm",
        "attn_distance",
        "attn_sink_mass",
        "attn_beyond_mass",
        "attn_max_logit",
    ]
    # Any task may carry the attention diagnostics; none is a score a picker offers.
    assert [m.name for m in measured(Kind.ANSWER)] == [
        "loss",
        "accuracy",
        "token_accuracy",
        *ruler,
        *attention,
    ]
    assert [m.name for m in diagnostics()] == attention
    assert [m.name for m in reported(Kind.ANSWER)] == ["accuracy", "token_accuracy"]
    assert [m.name for m in reported(Kind.LANGUAGE_MODELLING)] == ["perplexity"]
    assert [m.name for m in METRICS.values() if m.log_scale] == [
        "perplexity",
        "key_token_perplexity",
    ]
    assert metric_named("perplexity").to_loss(math.e) == pytest.approx(1.0)
    assert metric_named("bits_per_byte").to_loss(1 / math.log(2)) == pytest.approx(1.0)
    assert metric_named("accuracy").format(0.5) == "0.500"
    assert metric_named("loss").format(None) == "n/a"
    with pytest.raises(ValueError, match="unknown metric 'ppl'"):
        metric_named("ppl")


def _payload() -> dict:
    evaluation = Evaluation("none", "nonoverlapping", 16, loss=1.0, perplexity=math.e)
    return {
        "spec": {"name": "s", "train": {"length": 16}},
        "metric": "perplexity",
        "runs": [
            {
                "label": "rope",
                "encoding": "rope",
                "params": {"base": 10000.0},
                "seed": 0,
                "config_hash": "abc",
                "train": {
                    "steps": 2,
                    "final_loss": 1.5,
                    "resumed_from": 0,
                    "seconds": 0.25,
                    "curve": [
                        {
                            "step": 2,
                            "loss": 1.5,
                            "lr": 0.001,
                            "tokens_per_second": 10.0,
                            "elapsed": 0.25,
                            "val_loss": None,
                        }
                    ],
                },
                "evaluations": [
                    {
                        **evaluation.to_dict(),
                        "position_bins": [{"start": 0, "end": 16, "loss": 1.0, "tokens": 16}],
                        "groups": {},
                    }
                ],
                "summaries": [
                    {
                        "variant": "none",
                        "protocol": "nonoverlapping",
                        "name": "ratio_2x",
                        "value": None,
                    },
                    {
                        "variant": "none",
                        "protocol": "any",
                        "name": "order_sensitivity",
                        "value": 0.1,
                    },
                ],
                "provenance": {"torch_version": "2", "finetune": {"yarn:2+ft2": {"curve": [1.0]}}},
            }
        ],
    }


def test_results_json_is_written_and_read_through_one_declaration() -> None:
    payload = _payload()
    document = StudyResults.from_dict(payload)
    # Byte for byte what posbench run wrote before the schema: old files still import.
    assert document.to_json(indent=1) == json.dumps(payload, indent=1)
    assert document.to_json() == json.dumps(payload)
    assert parse_results(document.to_json(indent=1)) == document
    with pytest.raises(TypeError):  # the writer cannot drift from the declaration
        StudyResults.from_dict({**payload, "unknown": 1})
    payload["runs"][0]["evaluations"][0]["loss"] = float("inf")
    assert StudyResults.from_dict(payload).to_json()  # written as measured, not refused
    with pytest.raises(ValidationError, match="Input should be a finite number"):
        parse_results(json.dumps(payload))


CURVES = {"rope": {16: 2.5, 32: None}, "alibi": {16: 2.0, 32: 2.125}}


def test_the_curve_table_as_markdown_and_on_the_terminal() -> None:
    table = curve_table(CURVES, "perplexity", 16)
    assert table.markdown() == markdown_rows(
        ["perplexity by length", "16 (L)", "32 (2x)"],
        [["rope", "2.50", "n/a"], ["alibi", "2.00", "2.12"]],
    )
    console = Console(width=120, record=True)
    console.print(table.rich("perplexity by evaluation length"))
    text = console.export_text()
    assert "encoding" in text and "32 (2x)" in text and "2.12" in text
    assert "16 (" not in text  # the training length is plain on the terminal
    accuracy = curve_table({"copy": {8: 0.5}}, "token_accuracy", 8).markdown()
    assert "| token_accuracy by length | 8 (L) |" in accuracy and "| copy | 0.500 |" in accuracy


def test_the_curve_table_of_stored_points_and_of_seed_means() -> None:
    frame = pd.DataFrame(
        {
            "label": ["rope", "rope", "rope", "alibi"],
            "variant": ["none"] * 4,
            "protocol": ["nonoverlapping"] * 4,
            "seed": [0, 1, 0, 0],
            "eval_length": [16, 16, 32, 16],
            "perplexity": [2.0, 3.0, float("nan"), 4.0],
        }
    )
    table = seed_means(frame, "perplexity", 16)
    assert table.keys == ("encoding", "variant", "protocol", "seeds")
    assert table.cells() == [
        ["rope", "none", "nonoverlapping", "2", "2.50", "n/a"],
        ["alibi", "none", "nonoverlapping", "1", "4.00", "n/a"],
    ]
    summary = pd.DataFrame(
        {"line": ["b", "a", "a"], "eval_length": [16, 16, 64], "mean": [2.0, 1.0, 3.0]}
    )
    shown = seed_summary_table(summary, "perplexity").frame()
    expected = summary.pivot_table(index="line", columns="eval_length", values="mean")
    pd.testing.assert_frame_equal(shown, expected)
