"""`posbench run` end to end, in a real subprocess."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from conftest import posbench_cli


def posbench(*args: str) -> subprocess.CompletedProcess[str]:
    return posbench_cli(*args, timeout=600)


def test_run_smoke_preset_writes_json_table_and_png(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = posbench("run", "--preset", "smoke", "--json", "--out", str(out))
    assert done.returncode == 0, done.stderr
    payload = json.loads(done.stdout)
    assert [run["encoding"] for run in payload["runs"]] == ["nope", "rope", "alibi"]
    for run in payload["runs"]:
        assert [e["length"] for e in run["evaluations"]] == [32, 64, 128]
        assert all(e["perplexity"] > 1 for e in run["evaluations"])
        assert run["train"]["steps"] == 40 and run["provenance"]["torch_version"]
    assert json.loads((out / "results.json").read_text()) == payload
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (out / "table.md").read_text()
    assert "| alibi |" in table and "128 (4x)" in table
    for run in payload["runs"]:
        summaries = {s["name"]: s["value"] for s in run["summaries"] if s["variant"] == "none"}
        curve = {e["length"]: e["perplexity"] for e in run["evaluations"]}
        assert summaries["ratio_4x"] == curve[128] / curve[32]
        assert summaries["effective_length"] in (32, 64, 128)
        # The order probe ran on the trained model; shuffling cannot help it much.
        assert summaries["order_shuffled_loss"] > summaries["order_ordered_loss"] - 0.05
    assert "| line | seeds | ratio 2x | ratio 4x | effective length |" in table


def test_run_a_spec_file_and_print_the_table(tmp_path: Path) -> None:
    spec = tmp_path / "study.yaml"
    spec.write_text(
        "name: mini\nmodel: tiny\ntrain: {length: 16, steps: 4, batch_size: 2}\n"
        "encodings: [t5, {name: rope, rotary_fraction: 0.5}]\n"
        "eval: {lengths: [16, 32], tokens: 128}\n"
    )
    done = posbench("run", str(spec), "--out", str(tmp_path / "o"))
    assert done.returncode == 0, done.stderr
    assert "perplexity by evaluation length" in done.stdout
    assert "rope(rotary_fraction=0.5)" in done.stdout
    assert "summaries across seeds" in done.stdout


def test_bad_input_exits_2_with_one_readable_reason(tmp_path: Path) -> None:
    assert posbench("run").returncode == 2
    both = posbench("run", "x.yaml", "--preset", "smoke")
    assert both.returncode == 2 and "either a spec file or --preset" in both.stderr
    spec = tmp_path / "bad.yaml"
    spec.write_text("encodings: [rope]\ntrain: {steps: 999999}\n")
    bad = posbench("run", str(spec))
    assert bad.returncode == 2
    assert "train.steps = 999999: must be less than or equal to 200000" in bad.stderr
    assert "Traceback" not in bad.stderr
    corpus = tmp_path / "corpus.yaml"
    corpus.write_text("encodings: [rope]\nmodel: tiny\ntask: {name: lm, corpus: 'text:/nope'}\n")
    missing = posbench("run", str(corpus), "--out", str(tmp_path / "o"))
    assert missing.returncode == 2 and "no such file or folder" in missing.stderr
