"""RULER's string_match_all and string_match_part (Hsieh et al., 2024) on the parts of an
answer: which tasks have several, the fractions on batches made by hand, an evaluation
through ``evaluate_length`` against fractions worked out on the answer strings, a real
small evaluation, and the summaries and pairwise claims on them."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pandas as pd
import pytest
import torch
from conftest import two_encodings_frame

import worker.evaluate
from core.analysis import claim, pairwise_table, seed_summary, summarize_run
from core.catalog.ruler import SEPARATOR
from core.metrics import METRICS
from core.settings import get_settings
from core.spec import parse_spec
from worker.data import build_task
from worker.data.synthetic import SyntheticTask, answer_batch, part_mask, parts_of
from worker.evaluate import _Accumulator, evaluate_in_distribution
from worker.run import prepared_task, resolve_device, run_one

CPU = torch.device("cpu")


def synthetic(name: str, **params: Any) -> SyntheticTask:
    task = build_task(name, **params)
    assert isinstance(task, SyntheticTask)
    return task


def answer_parts(example: tuple[Any, ...]) -> list[str]:
    """The parts as the example writes them; the answer is them joined by ``, ``."""
    data = bytes(example[0])
    answer = data[len(data) - example[1] :].decode()
    parts = list(parts_of(example)) or [answer]
    assert SEPARATOR.join(parts) == answer
    return parts


@pytest.mark.parametrize(
    ("name", "params", "count"),
    [
        ("niah", {}, 1),
        ("niah", {"num_values": 3}, 3),
        ("niah", {"num_keys": 2, "num_queries": 2}, 2),
        ("niah", {"num_keys": 2, "num_queries": 2, "num_values": 2}, 4),
        ("variable_tracking", {}, 5),  # a chain of four copies: five variables
        ("variable_tracking", {"num_hops": 2, "num_chains": 3}, 3),
        ("common_words", {}, 4),
        ("frequent_words", {"num_top": 2}, 2),
        ("passkey", {}, 1),
        ("assoc_recall", {}, 1),
    ],
)
def test_which_answers_have_several_parts(name: str, params: dict, count: int) -> None:
    task = synthetic(name, **params)
    drawn = task.eval_examples(1024, 1)
    assert all(len(answer_parts(example)) == count for example in drawn)
    batch = task._batch(drawn)
    if count == 1:
        assert batch.parts is None  # scored as exact match
        return
    assert batch.parts.shape == (len(drawn), 1024, count)
    for row, example in enumerate(drawn):
        # Each part's targets are its bytes, the separators in none, all of them scored.
        for index, part in enumerate(answer_parts(example)):
            inside = batch.parts[row, :, index]
            assert bytes(batch.targets[row][inside].tolist()) == part.encode()
        assert not (batch.parts[row].any(-1) & ~batch.scored[row]).any()


def _logits(batch: Any, wrong: torch.Tensor) -> torch.Tensor:
    """Logits whose argmax is every target, except where ``wrong`` is set."""
    predicted = torch.where(wrong, (batch.targets + 1) % 256, batch.targets)
    return torch.nn.functional.one_hot(predicted, 256).float()


def test_parts_partly_right_give_the_exact_fractions() -> None:
    task = synthetic("niah", num_values=3)
    drawn = task.eval_examples(256, 1)[:5]
    batch = task._batch(drawn)

    def byte_of(row: int, part: int) -> torch.Tensor:  # the last byte of one part
        return batch.parts[row, :, part].nonzero()[-1]

    wrong = torch.zeros_like(batch.targets, dtype=torch.bool)
    # Row 0 all right; row 1 part 2 wrong; row 2 parts 0 and 1; row 3 every part; row 4
    # only a separator (each part right, the answer not).
    wrong[1, byte_of(1, 2)] = True
    wrong[2, byte_of(2, 0)] = wrong[2, byte_of(2, 1)] = True
    for part in range(3):
        wrong[3, byte_of(3, part)] = True
    wrong[4, byte_of(4, 0) + 1] = True
    assert not batch.parts[4, byte_of(4, 0) + 1].any() and batch.scored[4, byte_of(4, 0) + 1]
    accumulator = _Accumulator(256)
    accumulator.add(_logits(batch, wrong), batch)
    assert (accumulator.exact, accumulator.examples) == (1, 5)
    assert accumulator.parts_all == pytest.approx(1 + 1 / 3 + 2 / 3 + 0 + 1)
    assert accumulator.parts_any == 4


def test_a_token_carrying_two_parts_counts_for_both() -> None:
    # An hf: model's answer in tokens: parts as token ranges, token 2 carries the end of
    # part 0 and the start of part 1.
    sequences = torch.tensor([[7, 8, 300, 301, 302, 303, 304]])
    mask = part_mask(sequences, [5], [((0, 3), (2, 5))])
    assert mask[0, :, 0].tolist() == [False, True, True, True, False, False]
    assert mask[0, :, 1].tolist() == [False, False, False, True, True, True]
    batch = answer_batch(sequences, [5], [""], [((0, 3), (2, 5))])
    for at, fraction, anyone in ((3, 0.0, 0), (2, 0.5, 1), (5, 0.5, 1)):
        wrong = torch.zeros_like(batch.targets, dtype=torch.bool)
        wrong[0, at] = True
        accumulator = _Accumulator(6)
        accumulator.add(
            torch.nn.functional.one_hot(torch.where(wrong, 0, batch.targets), 400).float(), batch
        )
        assert (accumulator.parts_all, accumulator.parts_any) == (fraction, anyone)


class Oracle(torch.nn.Module):
    """A stand-in model that answers every example it knows, but for the parts ``forget``
    says: ``forget(row)`` is the set of part indices it gets wrong in example ``row``."""

    encoding = SimpleNamespace(max_length=None, name="oracle")
    config = None  # eval_batch_size is replaced

    def __init__(self, drawn: list[tuple[Any, ...]], forget: Any) -> None:
        super().__init__()
        self.known = {bytes(example[0])[:-1]: row for row, example in enumerate(drawn)}
        self.drawn, self.forget = drawn, forget

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        out = []
        for sequence in inputs.tolist():
            row = self.known[bytes(sequence)]
            example = self.drawn[row]
            data = bytearray(bytes(example[0])[1:])
            answer = bytes(example[0])[-example[1] :]
            start, found = len(data) - example[1], 0
            for index, part in enumerate(answer_parts(example)):
                at = answer.index(part.encode(), found)
                found = at + len(part.encode())
                if index in self.forget(row):  # its first byte wrong
                    data[start + at] = (data[start + at] + 1) % 256
            out.append(list(data))
        return torch.nn.functional.one_hot(torch.tensor(out), 256).float()


def evaluated(task: SyntheticTask, length: int, examples: int, forget: Any, monkeypatch) -> Any:
    monkeypatch.setattr(worker.evaluate, "eval_batch_size", lambda *_: 4)
    drawn = task.eval_examples(length, task.per_group(examples))
    return drawn, evaluate_in_distribution(Oracle(drawn, forget), task, length, examples=examples)


def test_an_evaluation_reports_the_fractions_worked_out_on_the_strings(monkeypatch) -> None:
    def forget(row: int) -> set[int]:  # 0, 1, 2 or 3 of the 3 parts wrong in turn
        return set(range(row % 4))

    drawn, row = evaluated(synthetic("niah", num_values=3), 512, 20, forget, monkeypatch)
    assert len(drawn) == 20
    counts = [3 - len(forget(i)) for i in range(len(drawn))]
    assert row.accuracy == sum(c == 3 for c in counts) / 20 == 0.25
    assert row.string_match_all == pytest.approx(sum(c / 3 for c in counts) / 20)
    assert row.string_match_part == sum(c > 0 for c in counts) / 20 == 0.75
    assert row.accuracy <= row.string_match_all <= row.string_match_part
    # One part: each of RULER's metrics is exact match.
    drawn, single = evaluated(
        synthetic("passkey"), 256, 20, lambda i: {0} if i % 3 else set(), monkeypatch
    )
    assert single.accuracy == single.string_match_all == single.string_match_part == 7 / 20


def test_a_small_real_evaluation() -> None:
    settings = get_settings()
    for params in ({"num_values": 3}, {}):
        spec = parse_spec(
            {
                "model": "tiny",
                "task": {"name": "niah", "params": params},
                "train": {"length": 256, "steps": 4, "batch_size": 2},
                "encodings": ["alibi"],
                "eval": {"lengths": [256, 320], "examples": 10, "order_probe": False},
            }
        )
        run = spec.runs()[0]
        task = prepared_task(spec, settings.corpus_cache)
        rows = run_one(spec, run, task=task, device=resolve_device(default=settings.device))
        assert len(rows.evaluations) == 2
        for row in rows.evaluations:
            assert 0.0 <= row.accuracy <= row.string_match_all <= row.string_match_part <= 1.0
            if not params:  # one value: one part
                assert row.string_match_all == row.string_match_part == row.accuracy


def frame(metric: str) -> pd.DataFrame:
    """Three seeds of two encodings; alibi retrieves more parts at every length."""
    return two_encodings_frame(
        metric,
        lambda label, seed, length: (
            (0.9 if label == "alibi" else 0.4) - 0.1 * math.log2(length / 128) + 0.01 * seed
        ),
    )


@pytest.mark.parametrize("metric", ["string_match_all", "string_match_part"])
def test_summaries_and_pairwise_claims_work_for_them(metric: str) -> None:
    assert not METRICS[metric].lower_is_better
    data = frame(metric)
    summary = seed_summary(data, metric).set_index(["line", "eval_length"])
    assert summary.loc[("alibi", 128), "mean"] == pytest.approx(0.91)
    assert summary.loc[("rope", 512), "seeds"] == 3
    table = pairwise_table(data, metric)
    assert len(table) == 3 and (table["p_a_wins"] == 1.0).all()  # higher is better
    assert claim(table.iloc[0], 128).startswith("alibi beats rope at 1x")
    curve = {128: 0.9, 256: 0.8, 512: 0.45}
    summaries = summarize_run(curve, 128, metric)
    assert summaries["ratio_2x"] == pytest.approx(0.8 / 0.9)
    assert summaries["ratio_4x"] == pytest.approx(0.5)
    assert summaries["log_ppl_area"] is None  # not a perplexity


def test_results_json_import_csv_and_mlflow_carry_them(tmp_path) -> None:
    import json

    from conftest import isolated_env, posbench_cli
    from sqlalchemy import select

    from core.settings import Settings
    from db import queries
    from db.engine import transaction
    from db.migrate import upgrade
    from db.models import Evaluation, Run
    from jobs.transfer.importer import import_results
    from jobs.transfer.mlflow_export import run_metrics
    from worker.run import run_study

    spec = parse_spec(
        {
            "name": "parts",
            "model": "tiny",
            "task": {"name": "niah", "params": {"num_values": 2}},
            "train": {"length": 256, "steps": 2, "batch_size": 2},
            "encodings": ["alibi"],
            "eval": {"lengths": [256], "examples": 5, "order_probe": False},
        }
    )
    local = get_settings()
    task = prepared_task(spec, local.corpus_cache)
    payload = run_study(spec, task=task, device=resolve_device(default=local.device)).to_dict()
    (row,) = payload["runs"][0]["evaluations"]
    assert row["string_match_all"] is not None and row["string_match_part"] is not None
    # Numbers a reader can tell apart (a two-step model gets next to nothing right).
    row.update(accuracy=0.2, string_match_all=0.5, string_match_part=0.8)
    path = tmp_path / "results.json"
    path.write_text(json.dumps(payload))
    settings = Settings(home=tmp_path / "home")
    upgrade(settings.database)
    import_results(path, actor="tester", settings=settings)
    curves = queries.curves(settings.database)
    assert curves[["string_match_all", "string_match_part"]].values.tolist() == [[0.5, 0.8]]
    shown = posbench_cli(
        "results", "--study", "1", "--format", "csv", env=isolated_env(settings.home)
    )
    assert shown.returncode == 0, shown.stderr
    header, values = shown.stdout.splitlines()[:2]
    columns = dict(zip(header.split(","), values.split(","), strict=True))
    assert (columns["string_match_all"], columns["string_match_part"]) == ("0.5", "0.8")
    with transaction(settings.database) as session:
        run = session.scalars(select(Run)).one()
        points = session.scalars(select(Evaluation).where(Evaluation.run_id == run.id)).all()
        metrics = {name: value for name, value, *_ in run_metrics(session, run, points, [], 0, 0)}
    assert metrics["eval/string_match_all/none/nonoverlapping"] == 0.5
    assert metrics["eval/string_match_part/none/nonoverlapping"] == 0.8
