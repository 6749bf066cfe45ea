"""`posbench tasks` lists every task of the catalogue; `posbench tasks sample` prints
a task's examples as the task's own code draws them: the evaluation's by default (the
answer is the span evaluation scores), seeded draws alike in every process, every
bad argument refused at the edge, and prompts shown as text, never as markup."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, isolated_env, posbench_cli
from typer.testing import CliRunner

from cli import app
from core.catalog.tasks import TASKS
from worker.data import build_task
from worker.data.samples import Sample
from worker.data.synthetic import SyntheticTask


def synthetic() -> list[str]:
    """The catalogue's tasks with answers (whatever tasks it holds)."""
    return [name for name in TASKS if isinstance(build_task(name), SyntheticTask)]


def length_of(name: str) -> int:
    return max(TASKS[name].min_length, 96)


def invoke(*args: str) -> Any:
    return CliRunner().invoke(app, list(args))


def lines(output: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in output.splitlines()]


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return isolated_env(tmp_path / ".posbench")


def test_the_listing_names_every_task_with_its_parameters(env: dict[str, str]) -> None:
    listed = json.loads(posbench_cli("tasks", "--json", env=env).stdout)
    assert [t["name"] for t in listed] == list(TASKS)
    for entry in listed:
        info = TASKS[entry["name"]]
        assert entry["min_length"] == info.min_length and entry["metric"] == info.metric
        assert [p["name"] for p in entry["params"]] == [p.name for p in info.params]
    table = invoke("tasks")
    assert table.exit_code == 0
    names = [line.split("│")[1].strip() for line in table.stdout.splitlines() if "│" in line]
    assert set(TASKS) <= set(names)  # whole, however narrow the terminal


def test_sampling_is_the_same_in_every_process(env: dict[str, str]) -> None:
    name = synthetic()[0]
    args = ("tasks", "sample", name, "--length", str(length_of(name)), "--n", "3", "--seed", "5")
    first, second = (posbench_cli(*args, "--json", env=env) for _ in range(2))
    assert first.returncode == second.returncode == 0, first.stderr
    assert first.stdout == second.stdout and len(lines(first.stdout)) == 3


@pytest.mark.parametrize("name", synthetic())
def test_the_default_samples_are_what_evaluation_scores(name: str) -> None:
    length, n = length_of(name), 1
    shown = invoke("tasks", "sample", name, "--length", str(length), "--n", str(n), "--json")
    assert shown.exit_code == 0, shown.stderr
    task = build_task(name)
    scored = task.eval_examples(length, task.per_group(n))
    samples = lines(shown.stdout)
    assert len(samples) == len(scored)
    for sample, (sequence, answer, label, *_) in zip(samples, scored, strict=True):
        prompt, whole = sample["prompt"].encode(), sample["answer"].encode()
        assert len(prompt) + len(whole) == length + 1
        assert whole == bytes(sequence)[-answer:]
        assert prompt + whole == bytes(sequence)
        # The parts (RULER's references) are found in the answer in turn, and fill it
        # but for the separators between them.
        found = 0
        for part in (a.encode() for a in sample["answers"]):
            found = whole.index(part, found) + len(part)
        assert found == len(whole)
        assert sample["group"] == (label or None)


@pytest.mark.parametrize("name", synthetic())
def test_seeded_samples_are_training_like_draws_of_the_length(name: str) -> None:
    length = length_of(name)
    args = ("tasks", "sample", name, "--length", str(length), "--n", "4", "--seed", "11")
    samples = lines(invoke(*args, "--json").stdout)
    assert len(samples) == 4 and all(s["group"] is None for s in samples)
    for s in samples:
        assert len(s["prompt"].encode()) + len(s["answer"].encode()) == length + 1
    assert samples == lines(invoke(*args, "--json").stdout)
    assert samples != lines(invoke(*args[:-1], "12", "--json").stdout)


def test_a_parameter_is_read_as_its_type() -> None:
    name = next(n for n in synthetic() if any(p.type is int for p in TASKS[n].params))
    param = next(p for p in TASKS[name].params if p.type is int)
    value = int(param.low or 1)
    args = ("tasks", "sample", name, "--length", str(length_of(name)), "--seed", "1")
    shown = invoke(*args, "--param", f"{param.name}={value}", "--json")
    assert shown.exit_code == 0, shown.stderr


def refusals() -> list[tuple[str, ...]]:
    name = synthetic()[0]
    info, ok = TASKS[name], str(length_of(synthetic()[0]))
    bounded = next((p for p in info.params if p.high is not None), None)
    out = [
        ("no-such-task", "--length", "64"),
        (name, "--length", ok, "--param", "no_such_param=1"),
        (name, "--length", ok, "--param", "no_equals_sign"),
        (name, "--length", str(info.min_length - 1)),
        (name, "--length", "65537"),
        (name, "--length", ok, "--n", "0"),
        (name, "--length", ok, "--n", "1001"),
        (name, "--length", ok, "--seed", "-1"),
        (name, "--length", ok, "--seed", "soon"),
    ]
    if bounded:
        out.append((name, "--length", ok, "--param", f"{bounded.name}={bounded.high + 1:g}"))
    out += [(n, "--length", "64") for n in TASKS if n not in synthetic()]  # no answers
    return out


@pytest.mark.parametrize("args", refusals(), ids=" ".join)
def test_a_bad_argument_exits_2_with_one_line_and_nothing_on_stdout(args: tuple[str]) -> None:
    done = invoke("tasks", "sample", *args)
    assert done.exit_code == 2
    assert done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1 and done.stderr.startswith("error: ")


def test_a_refusal_in_a_real_process(env: dict[str, str]) -> None:
    done = posbench_cli("tasks", "sample", "no-such-task", "--length", "64", env=env)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        f"error: unknown task 'no-such-task' (available: {', '.join(TASKS)})"
    ]


HOSTILE = "[bold]x[/bold] [link=http://evil]y[/link] [/]"


def test_prompts_answers_and_groups_are_shown_as_text(monkeypatch: pytest.MonkeyPatch) -> None:
    import worker.data.samples

    def draw(*_: Any, **__: Any) -> list[Sample]:
        return [Sample(HOSTILE, HOSTILE + "[red]b", [HOSTILE, "[red]b"], HOSTILE)]

    monkeypatch.setattr(worker.data.samples, "draw", draw)
    name = synthetic()[0]
    args = ("tasks", "sample", name, "--length", str(length_of(name)))
    shown = invoke(*args)
    assert shown.exit_code == 0, shown.stderr
    assert shown.stdout.count(HOSTILE) == 3 and "answer: [red]b" in shown.stdout
    as_json = lines(invoke(*args, "--json").stdout)
    assert as_json == [
        {
            "prompt": HOSTILE,
            "answer": HOSTILE + "[red]b",
            "answers": [HOSTILE, "[red]b"],
            "group": HOSTILE,
        }
    ]


def test_listing_tasks_does_not_load_torch() -> None:
    script = (
        "import sys; from typer.testing import CliRunner; from cli import app; "
        "runs = [CliRunner().invoke(app, a) for a in (['--help'], ['tasks'], "
        "['tasks', '--json'], ['tasks', 'sample', '--help'])]; "
        "print([r.exit_code for r in runs], 'torch' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "[0, 0, 0, 0] False"


def test_a_task_may_give_its_answer_in_parts() -> None:
    from worker.data.samples import as_sample

    sequence = b"keys? 12, 34"
    assert as_sample((sequence, 6, "")).answers == ["12, 34"]
    assert as_sample((sequence, 6, "", ((0, 2), (4, 6)))).answers == ["12", "34"]
    assert as_sample((sequence, 6, "n=2", ("12", "34"))) == Sample(
        "keys? ", "12, 34", ["12", "34"], "n=2"
    )
    # The parts are found in turn: a part before the one before it is not there.
    with pytest.raises(ValueError, match="not in the answer"):
        as_sample((sequence, 6, "", ("34", "12")))
    with pytest.raises(ValueError, match="outside the answer"):
        as_sample((sequence, 6, "", ((0, 2), (4, 7))))
