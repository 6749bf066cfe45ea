"""Memory for long evaluations: the heap policy and the batch size."""

from __future__ import annotations

import platform

import pytest
import torch

from core.settings import get_settings
from core.spec import parse_spec
from worker import evaluate
from worker.layers import ModelConfig
from worker.memory import (
    LONG_SEQUENCE,
    available_bytes,
    bound_heap_for,
    eval_batch_size,
    halving_on_oom,
)
from worker.run import prepared_task, resolve_device, run_one


def run_here(spec, run):
    """``run_one`` as this machine runs it: the settings' device and corpus cache."""
    settings = get_settings()
    task = prepared_task(spec, settings.corpus_cache)
    return run_one(spec, run, task=task, device=resolve_device(default=settings.device))


def test_short_sequences_keep_the_default_policy() -> None:
    assert bound_heap_for(LONG_SEQUENCE - 1) is False


def test_long_sequences_fix_the_mmap_threshold_on_glibc() -> None:
    applied = bound_heap_for(LONG_SEQUENCE)
    assert applied is (platform.libc_ver()[0] == "glibc")


def test_eval_batch_size_is_the_token_budget_capped_by_memory() -> None:
    config = ModelConfig(d_model=128, vocab_size=256)
    per_token = 2 * 4 * (14 * 128 + 3 * 256)  # 20 KiB
    assert eval_batch_size(config, 1024, 16_384, available=1 << 40) == 16  # the token budget
    # Half of 100 MiB holds 2 sequences of 1024 tokens at 20 KiB a token.
    assert eval_batch_size(config, 1024, 16_384, available=100 << 20) == 2
    assert 2 * per_token * 1024 <= (100 << 20) // 2 < 3 * per_token * 1024
    assert eval_batch_size(config, 32_768, 16_384, available=1 << 40) == 1  # never 0
    assert eval_batch_size(config, 1024, 16_384, available=0) == 1


def test_available_memory_is_read_from_the_system() -> None:
    available = available_bytes(torch.device("cpu"))
    assert 0 < available < 1 << 50


def test_an_evaluation_in_little_memory_gives_the_same_numbers(monkeypatch) -> None:
    spec = parse_spec(
        {
            "model": "tiny",
            "train": {"length": 16, "steps": 2, "batch_size": 2},
            "encodings": ["alibi"],
            "eval": {"lengths": [64], "tokens": 512},
        }
    )
    plenty = run_here(spec, spec.runs()[0]).evaluations[0]
    sizes = []
    original = evaluate.eval_batch_size

    def recorded(*args, **kwargs) -> int:
        sizes.append(original(*args, **kwargs))
        return sizes[-1]

    monkeypatch.setattr(evaluate, "available_bytes", lambda device: 0)
    monkeypatch.setattr(evaluate, "eval_batch_size", recorded)
    scarce = run_here(spec, spec.runs()[0]).evaluations[0]
    assert sizes == [1, 1]  # one sequence at a time: the last step's validation, the evaluation
    assert scarce.loss == pytest.approx(plenty.loss, rel=1e-5)
    assert scarce.tokens == plenty.tokens == 512


def test_out_of_memory_halves_the_batch_until_one_sequence_does_not_fit() -> None:
    tried = []

    def run(batch_size: int) -> int:
        tried.append(batch_size)
        if batch_size > 3:
            raise torch.OutOfMemoryError("too big")
        return batch_size

    assert halving_on_oom(run, 16) == 2 and tried == [16, 8, 4, 2]
    tried.clear()
    with pytest.raises(torch.OutOfMemoryError):
        halving_on_oom(lambda size: run(size * 100), 4)


def test_the_peak_resident_set_restarts_per_phase() -> None:
    # An earlier phase's peak (a 256 MiB tensor, freed) must not show in the next one.
    from worker.memory import peak_resident_bytes, reset_peak_resident, resident_bytes

    assert reset_peak_resident()
    big = torch.ones(64, 1 << 20)  # 256 MiB, touched
    del big
    assert peak_resident_bytes() >= resident_bytes() + (200 << 20)  # this phase's peak
    assert reset_peak_resident()
    assert peak_resident_bytes() < resident_bytes() + (64 << 20)  # not the next one's
