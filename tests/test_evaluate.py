"""Extrapolation evaluation through the study runner, on the tiny model."""

from __future__ import annotations

import math

import pytest
import torch

from core.settings import get_settings
from core.spec import parse_spec
from worker.encodings import REGISTRY
from worker.evaluate import evaluate
from worker.layers import ModelConfig
from worker.model import build_model
from worker.run import prepared_task, resolve_device, run_one
from worker.training import BaseHooks

TINY = {"model": "tiny", "train": {"length": 16, "steps": 6, "batch_size": 4}}


def run_here(spec, run):
    """``run_one`` as this machine runs it: the settings' device and corpus cache."""
    settings = get_settings()
    task = prepared_task(spec, settings.corpus_cache)
    return run_one(spec, run, task=task, device=resolve_device(default=settings.device))


def test_learned_beyond_its_table_is_not_applicable_never_a_crash() -> None:
    spec = parse_spec(
        {
            **TINY,
            "encodings": ["learned"],
            "eval": {
                "lengths": [16, 32],
                "protocols": ["nonoverlapping", "sliding"],
                "stride": 8,
                "tokens": 256,
            },
        }
    )
    result = run_here(spec, spec.runs()[0])
    rows = {(r.protocol, r.length): r for r in result.evaluations}
    assert set(rows) == {
        ("nonoverlapping", 16),
        ("nonoverlapping", 32),
        ("sliding", 16),
        ("sliding", 32),
    }
    for protocol in ("nonoverlapping", "sliding"):
        assert rows[protocol, 16].not_applicable is None
        assert math.isfinite(rows[protocol, 16].perplexity)
        assert rows[protocol, 32].not_applicable == (
            "not applicable: learned positions end at 16 (L=16)"
        )
        assert rows[protocol, 32].perplexity is None
    assert rows["nonoverlapping", 16].tokens == 256
    assert rows["sliding", 16].tokens == 256  # 32 windows x stride 8


def test_lm_metrics_are_consistent() -> None:
    spec = parse_spec(
        {**TINY, "encodings": ["alibi"], "eval": {"lengths": [16, 64], "tokens": 512}}
    )
    rows = run_here(spec, spec.runs()[0]).evaluations
    for row in rows:
        assert row.perplexity == pytest.approx(math.exp(row.loss))
        assert row.bits_per_byte == pytest.approx(row.loss / math.log(2))
        assert row.tokens == 512 and row.tokens_per_second > 0 and row.peak_memory_bytes > 0
        assert row.position_bins[0].start == 0 and row.position_bins[-1].end == row.length
        assert sum(b.tokens for b in row.position_bins) == 512
        weighted = sum(b.loss * b.tokens for b in row.position_bins) / 512
        assert weighted == pytest.approx(row.loss, rel=1e-4)


def test_rope_variants_are_evaluated_for_rotary_encodings_only() -> None:
    spec = parse_spec(
        {
            **TINY,
            "encodings": ["rope", "alibi"],
            "eval": {
                "lengths": [16, 64],
                "tokens": 256,
                "variants": ["pi", "yarn:4", "dynamic_ntk"],
            },
        }
    )
    rope_run, alibi_run = spec.runs()
    rope = {(r.variant, r.length): r for r in run_here(spec, rope_run).evaluations}
    assert set(rope) == {
        (v, n) for v in ("none", "pi:auto", "yarn:4", "dynamic_ntk") for n in (16, 64)
    }
    assert rope["pi:auto", 64].factor == 4.0 and rope["pi:auto", 16].factor == 1.0
    # At the training length, auto interpolation and dynamic NTK are the trained model.
    assert rope["pi:auto", 16].loss == pytest.approx(rope["none", 16].loss, rel=1e-6)
    assert rope["dynamic_ntk", 16].loss == pytest.approx(rope["none", 16].loss, rel=1e-6)
    assert rope["pi:auto", 64].loss != pytest.approx(rope["none", 64].loss, rel=1e-6)
    alibi = run_here(spec, alibi_run).evaluations
    assert {r.variant for r in alibi} == {"none"}


def test_passkey_accuracy_by_depth() -> None:
    spec = parse_spec(
        {
            "model": "tiny",
            "task": "passkey",
            "train": {"length": 128, "steps": 3, "batch_size": 2},
            "encodings": ["alibi"],
            "eval": {"lengths": [128, 256], "examples": 10},
        }
    )
    rows = run_here(spec, spec.runs()[0]).evaluations
    for row in rows:
        assert 0.0 <= row.accuracy <= 1.0 and row.perplexity is None
        # An exact answer has every byte right: per-byte accuracy is never below it.
        assert row.accuracy <= row.token_accuracy <= 1.0
        assert set(row.groups) == {"depth=0", "depth=0.25", "depth=0.5", "depth=0.75", "depth=1"}
        assert row.tokens == 10 * 5  # 5 digits per example


def test_plan_orders_variants_protocols_and_lengths() -> None:
    spec = parse_spec(
        {**TINY, "encodings": ["rope"], "eval": {"lengths": [64, 16], "variants": ["ntk:2"]}}
    )
    plan = [(v.label, p, n) for v, p, n in spec.eval.plan(scalable=True)]
    assert plan == [
        ("none", "nonoverlapping", 16),
        ("none", "nonoverlapping", 64),
        ("ntk:2", "nonoverlapping", 16),
        ("ntk:2", "nonoverlapping", 64),
    ]
    assert len(spec.eval.plan(scalable=False)) == 2


SMALL_FITS = {"local_global": {"pattern": 3}}


@pytest.mark.slow
@pytest.mark.parametrize("encoding", sorted(REGISTRY))
def test_every_encoding_evaluates_the_small_model_at_32x(encoding: str) -> None:
    spec = parse_spec(
        {
            "model": "small",
            "train": {"length": 128, "steps": 1, "batch_size": 1},
            # local_global's default 5 : 1 needs 6 layers; small has 4
            "encodings": [{"name": encoding, **SMALL_FITS.get(encoding, {})}],
            "eval": {"lengths": [4096], "tokens": 4096},
        }
    )
    row = run_here(spec, spec.runs()[0]).evaluations[0]
    if encoding == "learned":
        assert row.not_applicable is not None
    else:
        assert row.tokens == 4096 and math.isfinite(row.loss)


def test_randomized_positions_evaluate_reproducibly_per_run_seed() -> None:
    # Randomized positions are drawn at evaluation too; the draws are seeded by the
    # run's seed and the point of the plan, never by whatever the global RNG holds.
    spec = parse_spec(
        {**TINY, "encodings": ["randomized"], "eval": {"lengths": [16, 32], "tokens": 256}}
    )
    task = prepared_task(spec, get_settings().corpus_cache)
    model = build_model(ModelConfig(**spec.model.dims()), "randomized", train_length=16)

    def losses(seed: int, global_seed: int) -> list[float]:
        torch.manual_seed(global_seed)
        rows = evaluate(
            model,
            task,
            spec.eval,
            train_length=16,
            scalable=True,
            device=torch.device("cpu"),
            seed=seed,
        )
        return [row.loss for row in rows]

    first = losses(seed=0, global_seed=1)
    assert losses(seed=0, global_seed=2) == first
    assert losses(seed=1, global_seed=1) != first


def _evaluate_nope_until(evaluation: dict, should_stop, message: str) -> list:
    """Evaluate an untrained NoPE model with ``should_stop`` until it raises RunCancelled
    with ``message``; the points stored before."""
    from worker.training import RunCancelled

    spec = parse_spec({**TINY, "encodings": ["nope"], "eval": evaluation})
    model = build_model(ModelConfig(**spec.model.dims()), "nope", train_length=16)
    stored: list = []

    class Hooks(BaseHooks):
        def on_evaluation(self, row) -> None:
            stored.append(row)

        def should_stop(self) -> bool:
            return should_stop(stored)

    with pytest.raises(RunCancelled, match=message):
        evaluate(
            model,
            prepared_task(spec, get_settings().corpus_cache),
            spec.eval,
            train_length=16,
            scalable=False,
            device=torch.device("cpu"),
            hooks=Hooks(),
        )
    return stored


def test_a_cancel_stops_evaluation_between_points() -> None:
    stored = _evaluate_nope_until(
        {"lengths": [16, 32], "tokens": 64},
        lambda stored: bool(stored),  # asked once the first point is stored
        "cancelled while evaluating, before none @ 32",
    )
    assert [row.length for row in stored] == [16]  # the point before the cancel stays


def test_a_cancel_stops_a_long_length_between_its_batches() -> None:
    calls = []

    def asked(stored: list) -> bool:  # once the third batch of the length is reached
        calls.append(1)
        return len(calls) > 3

    stored = _evaluate_nope_until(
        {"lengths": [16], "tokens": 1024, "batch_tokens": 256},
        asked,
        "cancelled while evaluating at length 16",
    )
    assert stored == [] and len(calls) == 4  # 1 before the point, then 1 per batch of 4


def test_provenance_names_the_commit_in_a_checkout_and_in_an_image(monkeypatch) -> None:
    import subprocess

    from worker import outcome as engine

    engine._git_commit.cache_clear()
    commit = engine.provenance(torch.device("cpu"), 0, "lm")["git_commit"]
    assert commit and len(commit.removesuffix("+dirty")) == 40
    # In an image there is no .git: the commit comes from the build argument.
    monkeypatch.setenv("POSBENCH_GIT_COMMIT", "abc123")

    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(subprocess, "run", no_git)
    engine._git_commit.cache_clear()
    assert engine.provenance(torch.device("cpu"), 0, "lm")["git_commit"] == "abc123"
    engine._git_commit.cache_clear()
