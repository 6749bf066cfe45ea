"""`posbench run` end to end, in a real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import torch
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
        "eval: {lengths: [16, 32], tokens: 128, protocols: [nonoverlapping, sliding], "
        "stride: 8}\n"
    )
    out = tmp_path / "o"
    done = posbench("run", str(spec), "--out", str(out))
    assert done.returncode == 0, done.stderr
    # One table and one plot per protocol.
    assert "perplexity by evaluation length (nonoverlapping" in done.stdout
    assert "perplexity by evaluation length (sliding" in done.stdout
    assert "rope(rotary_fraction=0.5)" in done.stdout
    # Off a terminal (here, a pipe) each run logs plain lines: its last step at least.
    assert "t5 seed 0: step 4/4  loss " in done.stdout
    assert "t5 seed 0: evaluated none at 16" in done.stdout
    assert "summaries across seeds" in done.stdout
    table = (out / "table.md").read_text()
    assert "## nonoverlapping" in table and "## sliding" in table
    for plot in ("curves.png", "curves-sliding.png"):
        assert (out / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_results_go_under_posbench_home_in_a_folder_named_safely(tmp_path: Path) -> None:
    spec = tmp_path / "study.yaml"
    spec.write_text(
        "name: ../../escape me\nmodel: tiny\ntrain: {length: 16, steps: 2, batch_size: 2}\n"
        "encodings: [nope]\neval: {lengths: [16], tokens: 64, order_probe: false}\n"
    )
    home = tmp_path / "home"
    done = posbench_cli(
        "run", str(spec), env={**os.environ, "POSBENCH_HOME": str(home)}, timeout=600
    )
    assert done.returncode == 0, done.stderr
    (folder,) = (home / "runs").iterdir()
    assert folder.name.startswith("escape-me-") and (folder / "results.json").is_file()
    assert not (tmp_path / "escape me").exists()


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
    corpus.write_text("encodings: [rope]\nmodel: tiny\ntask: {name: lm, corpus: 'text:nope'}\n")
    rooted = {**os.environ, "POSBENCH_CORPUS_ROOTS": str(tmp_path)}  # nope: in no root
    missing = posbench_cli("run", str(corpus), "--out", str(tmp_path / "o"), env=rooted)
    assert missing.returncode == 2 and "no such file or folder" in missing.stderr
    assert "queued" not in missing.stdout + missing.stderr  # refused before any progress bar
    good = tmp_path / "good.yaml"
    good.write_text("encodings: [rope]\nmodel: tiny\ntrain: {length: 16, steps: 2}\n")
    empty = posbench("run", str(good), "--device", "")
    assert empty.returncode == 2 and "device '' is empty" in empty.stderr
    device = posbench("run", str(good), "--device", "bogus")
    assert device.returncode == 2 and "device 'bogus' is not one of cpu, cuda" in device.stderr
    if not torch.cuda.is_available():
        cuda = posbench("run", str(good), "--device", "cuda")
        assert cuda.returncode == 2 and "sees no CUDA device" in cuda.stderr
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    into_file = posbench("run", str(good), "--out", str(a_file))
    assert into_file.returncode == 2 and "is a file; give a folder" in into_file.stderr
    for result in (device, into_file):
        assert "Traceback" not in result.stderr


def test_a_spec_that_skips_the_training_length_runs_with_a_note(tmp_path: Path) -> None:
    spec = tmp_path / "study.yaml"
    spec.write_text(
        "model: tiny\ntrain: {length: 16, steps: 2, batch_size: 2}\nencodings: [alibi]\n"
        "eval: {lengths: [32], tokens: 64, order_probe: false}\n"
    )
    done = posbench("run", str(spec), "--out", str(tmp_path / "o"), "--json")
    assert done.returncode == 0, done.stderr
    assert "note: the training length 16 is not among eval.lengths" in done.stderr
    (run,) = json.loads(done.stdout)["runs"]
    assert [e["length"] for e in run["evaluations"]] == [32]


def test_a_study_that_only_evaluates_differently_trains_nothing_again(tmp_path: Path) -> None:
    env = {**os.environ, "POSBENCH_HOME": str(tmp_path / "home")}
    spec = tmp_path / "study.yaml"
    base = "name: s\nmodel: tiny\ntrain: {length: 16, steps: 6, batch_size: 2}\nencodings: [rope]\n"
    spec.write_text(base + "eval: {lengths: [16, 32], tokens: 64, order_probe: false}\n")
    first = posbench_cli("run", str(spec), "--json", "--out", str(tmp_path / "a"), env=env)
    assert first.returncode == 0, first.stderr
    # A variant more, into another folder: the trained model is found. (Another longest
    # length would move the stretches every length scores, so the lengths stay.)
    spec.write_text(
        base + "eval: {lengths: [16, 32], tokens: 64, order_probe: false, "
        "variants: [none, 'yarn:2']}\n"
    )
    second = posbench_cli("run", str(spec), "--json", "--out", str(tmp_path / "b"), env=env)
    assert second.returncode == 0, second.stderr
    (before,) = json.loads(first.stdout)["runs"]
    (after,) = json.loads(second.stdout)["runs"]
    assert before["train"]["resumed_from"] == 0 and after["train"]["resumed_from"] == 6
    assert after["train"]["curve"] == before["train"]["curve"]
    points = {(e["variant"], e["length"]): e["loss"] for e in after["evaluations"]}
    for row in before["evaluations"]:  # the same weights, the same numbers
        assert points[("none", row["length"])] == row["loss"]
    assert ("yarn:2", 32) in points


def test_out_is_checked_before_any_training(tmp_path: Path) -> None:
    env = {**os.environ, "POSBENCH_HOME": str(tmp_path / "home")}
    spec = tmp_path / "study.yaml"
    spec.write_text(
        "name: mine\nmodel: tiny\ntrain: {length: 16, steps: 2}\nencodings: [rope]\n"
        "eval: {lengths: [16], tokens: 64, order_probe: false}\n"
    )
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "results.json").write_text(json.dumps({"spec": {"name": "another"}, "runs": []}))
    taken = posbench_cli("run", str(spec), "--out", str(theirs), env=env)
    assert taken.returncode == 2 and "holds the results of study 'another'" in taken.stderr
    assert json.loads((theirs / "results.json").read_text())["spec"]["name"] == "another"
    folder = tmp_path / "folder"
    (folder / "results.json").mkdir(parents=True)
    clash = posbench_cli("run", str(spec), "--out", str(folder), env=env)
    assert clash.returncode == 2 and "results.json is a folder" in clash.stderr
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):  # root writes anyway: a path under a file instead
            locked = tmp_path / "a_file"
            locked.write_text("")
            locked = locked / "sub"
        denied = posbench_cli("run", str(spec), "--out", str(locked), env=env)
    finally:
        (tmp_path / "locked").chmod(0o700)
    assert denied.returncode == 2 and "cannot be written" in denied.stderr
    lm = tmp_path / "lm.yaml"
    lm.write_text(
        "name: mine\nmodel: tiny\ntrain: {length: 16, steps: 2}\nencodings: [rope]\n"
        "task: {name: lm, corpus: pystdlib}\neval: {lengths: [16], tokens: 64}\n"
    )
    (tmp_path / "cache_file").write_text("")
    cache = posbench_cli(
        "run",
        str(lm),
        "--out",
        str(tmp_path / "c"),
        env={**env, "POSBENCH_CACHE_DIR": str(tmp_path / "cache_file")},
    )
    assert cache.returncode == 2 and "the task's data could not be prepared" in cache.stderr
    assert not (tmp_path / "c").exists()  # refused after --out was made: removed again
    unnamed = tmp_path / "unnamed"
    unnamed.mkdir()
    (unnamed / "results.json").write_text(json.dumps({"spec": {"name": "study", "seeds": [9]}}))
    spec.write_text(spec.read_text().replace("name: mine\n", ""))
    other = posbench_cli("run", str(spec), "--out", str(unnamed), env=env)
    assert other.returncode == 2 and "another unnamed study; give this one a name" in other.stderr
    for result in (taken, clash, denied, cache, other):
        assert "queued" not in result.stdout + result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "home" / "checkpoints").exists() or not any(
        (tmp_path / "home" / "checkpoints").iterdir()
    )


def test_a_synthetic_task_reports_partial_success_too(tmp_path: Path) -> None:
    spec = tmp_path / "copy.yaml"
    spec.write_text(
        "name: c\nmodel: tiny\ntask: {name: copy, alphabet: 4}\n"
        "train: {length: 16, steps: 4, batch_size: 4}\nencodings: [alibi]\n"
        "eval: {lengths: [16, 32], examples: 8, order_probe: false}\n"
    )
    out = tmp_path / "o"
    done = posbench_cli(
        "run",
        str(spec),
        "--out",
        str(out),
        env={**os.environ, "POSBENCH_HOME": str(tmp_path), "COLUMNS": "200"},
    )
    assert done.returncode == 0, done.stderr
    assert "token_accuracy by evaluation" in done.stdout  # the title wraps to the table
    table = (out / "table.md").read_text()
    assert "| token_accuracy by length | 16 (L) | 32 (2x) |" in table
    (run,) = json.loads((out / "results.json").read_text())["runs"]
    curves, summaries = table.split("\n\n")[:2], table.split("\n\n")[2:]
    rows = [line for part in curves for line in part.splitlines() if line.startswith("| alibi |")]
    assert len(rows) == 2  # exact match, then the answer bytes
    # Then the summaries: beyond training, the mean accuracy past 16 bytes (of one seed).
    (grid,) = summaries
    assert "beyond training" in grid.splitlines()[0]
    accuracy = {e["length"]: e["accuracy"] for e in run["evaluations"]}
    assert grid.splitlines()[-1].endswith(f"| {accuracy[32]:g} |")
    token = {e["length"]: e["token_accuracy"] for e in run["evaluations"]}
    assert rows[1] == f"| alibi | {token[16]:.3f} | {token[32]:.3f} |"
