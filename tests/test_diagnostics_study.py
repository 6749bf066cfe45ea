"""Attention diagnostics and log-n through a whole study: `posbench run` records them,
`posbench import` stores them, `posbench results` shows them, and the summaries gain
the entropy growth."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import isolated_env, posbench_cli, service_settings, study_results

from core.metrics import diagnostics
from core.settings import Settings
from db import queries
from worker.diagnostics import AttentionProbe, sampled_queries

SPEC = {
    "name": "why-curves-bend",
    "model": "tiny",
    "train": {"length": 16, "steps": 6, "batch_size": 2},
    "encodings": ["rope", "alibi"],
    "eval": {
        "lengths": [16, 64],
        "tokens": 256,
        "diagnostics": True,
        "variants": ["logn", "ntk:auto+logn"],
    },
}


@pytest.fixture(scope="module")
def payload() -> dict:
    return study_results(SPEC)


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return service_settings(tmp_path)


def test_every_point_carries_its_diagnostics_and_logn_is_a_variant(payload: dict) -> None:
    variants = {
        run["label"]: sorted({e["variant"] for e in run["evaluations"]}) for run in payload["runs"]
    }
    # logn applies to every encoding; a RoPE scaling (with or without it) to rotary ones.
    assert variants == {"rope": ["logn", "none", "ntk:auto+logn"], "alibi": ["logn", "none"]}
    for run in payload["runs"]:
        for row in run["evaluations"]:
            for metric in diagnostics():
                assert math.isfinite(row[metric.column]), (run["label"], row, metric.name)
            assert row["attention"]["queries"] == 256 // row["length"] * len(
                sampled_queries(row["length"])
            )
            assert row["attn_beyond_mass"] == 0 or row["length"] > 16
        at = {(e["variant"], e["length"]): e for e in run["evaluations"]}
        # Up to L the factor is 1: logn's point is the trained model's, bit for bit.
        assert at["logn", 16]["loss"] == at["none", 16]["loss"]
        assert at["logn", 16]["attn_entropy"] == at["none", 16]["attn_entropy"]
        # Past L it sharpens attention: lower entropy than the trained model's.
        assert at["logn", 64]["attn_entropy"] < at["none", 64]["attn_entropy"]
        growth = {
            s["variant"]: s["value"] for s in run["summaries"] if s["name"] == "attn_entropy_growth"
        }
        assert growth["none"] == pytest.approx(
            at["none", 64]["attn_entropy"] - at["none", 16]["attn_entropy"]
        )


def test_imported_diagnostics_are_stored_and_shown(
    payload: dict, settings: Settings, tmp_path: Path
) -> None:
    path = tmp_path / "results.json"
    path.write_text(json.dumps(payload))
    env = isolated_env(settings.home, POSBENCH_DATABASE_URL=settings.database, COLUMNS="200")
    done = posbench_cli("import", str(path), env=env)
    assert done.returncode == 0, done.stderr
    curves = queries.curves(settings.database, study_ids=[1])
    assert curves["attn_entropy"].notna().all() and curves["attn_sink_mass"].notna().all()
    stored = curves.set_index(["label", "variant", "eval_length"])
    for run in payload["runs"]:
        for row in run["evaluations"]:
            point = stored.loc[(run["label"], row["variant"], row["length"])]
            assert point["attn_entropy"] == pytest.approx(row["attn_entropy"])
    summaries = queries.run_summaries(settings.database, [1])
    assert (summaries["summary"] == "attn_entropy_growth").sum() == 5  # one per curve

    table = posbench_cli("results", "--study", "1", "--metric", "attn_entropy", env=env)
    assert table.returncode == 0, table.stderr
    assert "attn_entropy by evaluation length" in table.stdout and "logn" in table.stdout
    csv = posbench_cli("results", "--study", "1", "--format", "csv", env=env)
    header = csv.stdout.splitlines()[0].split(",")
    assert {m.name for m in diagnostics()} <= set(header)
    wrong = posbench_cli("results", "--study", "1", "--metric", "accuracy", env=env)
    assert wrong.returncode == 2
    assert "--metric 'accuracy' is not a metric of study 1 (lm); allowed:" in wrong.stderr
    assert "attn_entropy" in wrong.stderr


def test_a_point_records_at_most_its_budget_of_queries() -> None:
    import torch

    from worker.model import build_model

    model = build_model("tiny", "rope", train_length=16).eval()
    probe = AttentionProbe(16, sample=8, budget=20)
    model.probe = probe
    with torch.no_grad():
        for _ in range(3):
            model(torch.randint(0, 256, (2, 64)))  # 2 windows of 8 sampled queries
    # 20 queries: the first 3 windows (24), none after
    assert probe.result().queries == 24


def test_the_study_script_prints_its_three_tables(payload: dict, tmp_path: Path) -> None:
    """studies/why_curves_bend.py as a user runs it on a results.json: the curves past
    L, the rank correlations and log-n's effect, which is none at 1x."""
    import subprocess
    import sys

    path = tmp_path / "results.json"
    path.write_text(json.dumps(payload))
    script = Path(__file__).resolve().parents[1] / "studies" / "why_curves_bend.py"
    done = subprocess.run(
        [sys.executable, str(script), str(path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "## Curves past L = 16 (means over seeds)" in out
    assert "| without logn | 2 | norm. entropy |" in out  # rope and alibi, at 4x
    assert "| every curve | 5 |" in out  # and their logn twins, and ntk:auto+logn
    at_1x = [line for line in out.splitlines() if line.startswith("| ") and " | 1 | " in line]
    assert at_1x and all(line.endswith("| 0.000 |") for line in at_1x)
