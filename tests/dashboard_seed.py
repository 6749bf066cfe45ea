"""Seed a results database with a finished study, a running run and a failed one."""

from __future__ import annotations

import math

from core.analysis import summarize_points
from core.results_schema import Evaluation, PositionBin, TrainPoint
from core.settings import Settings
from core.spec import parse_spec
from core.status import RunStatus
from jobs import lifecycle
from jobs.service import submit
from worker.probes import OrderProbe
from worker.runtime import store

LENGTHS = [32, 64, 128]


SEEDED_SPEC = parse_spec(
    {
        "name": "seeded",
        "model": "tiny",
        "train": {"length": 32, "steps": 40, "batch_size": 4},
        "encodings": ["rope", "alibi", "t5"],
        "seeds": [0, 1],
        "eval": {"lengths": LENGTHS},
    }
)


def _diagnostics(length: int, spreads: bool, layers: int = 2) -> dict:
    """Attention diagnostics as eval.diagnostics stores them: rope's attention spreads
    past the training length (32), alibi's stays local."""
    past = max(0.0, math.log(length / 32))
    entropy = [2.0 + layer * 0.3 + (0.8 if spreads else 0.05) * past for layer in range(layers)]
    beyond = [(0.2 if spreads else 0.01) * past / (1 + layer) for layer in range(layers)]
    per_layer = {
        "attn_entropy": entropy,
        "attn_entropy_norm": [e / math.log(length) for e in entropy],
        "attn_distance": [length / (4 if spreads else 16)] * layers,
        "attn_sink_mass": [0.1 + 0.05 * layer for layer in range(layers)],
        "attn_beyond_mass": beyond,
        "attn_max_logit": [4.0 - 0.2 * layer for layer in range(layers)],
    }
    means = {name: sum(values) / layers for name, values in per_layer.items()}
    return means | {"attention": {"queries": 512, "layers": per_layer, "heads": None}}


def seed_study(settings: Settings) -> int:
    submitted = submit(SEEDED_SPEC, settings=settings, send=lambda run_id: None, actor="tester")
    url = settings.database
    for index, run_id in enumerate(submitted.queued):
        claimed = lifecycle.claim(url, run_id, "seed")
        if index == 4:  # t5 seed 0: still running, halfway
            lifecycle.progress(claimed, TrainPoint(20, 2.9, 1e-3, 5000.0, 3.0))
            continue
        if index == 5:  # t5 seed 1: failed
            lifecycle.finish(
                claimed,
                RunStatus.FAILED,
                reason="the training loss became nan "
                "between steps 11 and 15 (lr 0.003); try a lower learning rate",
            )
            continue
        halfway = TrainPoint(20, 3.0 + 0.2 * (index % 2), 1e-3, 5000.0, 3.0)  # seeds differ
        lifecycle.progress(claimed, halfway)
        validated = TrainPoint(40, 2.5, 1e-4, 6000.0, 6.0, val_loss=2.6 + 0.1 * (index % 2))
        lifecycle.progress(claimed, validated)
        growth = 0.02 if index < 2 else 0.0005  # rope degrades, alibi stays flat
        for length in LENGTHS:
            loss = 2.5 + growth * (length - 32) + 0.01 * (index % 2)
            store.record_evaluation(
                claimed,
                Evaluation(
                    "none",
                    "nonoverlapping",
                    length,
                    loss=loss,
                    perplexity=math.exp(loss),
                    bits_per_byte=loss / math.log(2),
                    tokens=512,
                    tokens_per_second=1e5,
                    position_bins=[
                        PositionBin(0, 1, loss + 0.5, 8),
                        PositionBin(1, length, loss, 504),
                    ],
                    **_diagnostics(length, spreads=index < 2),
                ),
            )
        # As a worker does at the end of a run: summaries from every stored point.
        order = OrderProbe(32, ordered_loss=2.5, shuffled_loss=2.9 if index < 2 else 2.6, tokens=64)
        summaries = summarize_points(
            store.stored_points(url, run_id, "perplexity"),
            train_length=32,
            metric="perplexity",
            extra=order.as_summaries(),
        )
        store.record_summaries(claimed, summaries)
        lifecycle.finish(claimed, RunStatus.DONE, provenance={"torch_version": "2.13.0"})
    return submitted.study_id
