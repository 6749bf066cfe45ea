"""What every analysis shares: which way each metric is better, the factors summaries
are taken at, and how a (label, variant) pair is named as one line of a chart."""

from __future__ import annotations

import pandas as pd

from core.catalog.encodings import NO_SCALING
from core.metrics import METRICS, metric_named

LOWER_IS_BETTER = {metric.name: metric.lower_is_better for metric in METRICS.values()}
FACTORS = (2, 4, 8, 16, 32)
RESAMPLES = 2000
SUMMARY_COLUMNS = ["line", "study_id", "eval_length", "mean", "low", "high", "seeds"]
PAIRWISE_COLUMNS = [
    "a",
    "b",
    "eval_length",
    "mean_a",
    "mean_b",
    "p_a_wins",
    "seeds_a",
    "seeds_b",
    "paired",
]


def lower_is_better_for(metric: str) -> bool:
    """Whether a smaller value of ``metric`` is better (the registry's direction)."""
    return metric_named(metric).lower_is_better


def line_name(label: str, variant: str, study_id: int | None = None) -> str:
    """What a curve is called: the encoding label, its inference-time variant unless
    none, and its study when several studies are shown together."""
    name = label if variant == NO_SCALING else f"{label} + {variant}"
    return name if study_id is None else f"{name} [study {study_id}]"


def with_lines(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` (curves or stored summaries) with a ``line`` column of ``line_name``s."""
    several = frame["study_id"].nunique() > 1
    names = [
        line_name(label, variant, study if several else None)
        for label, variant, study in zip(
            frame["label"], frame["variant"], frame["study_id"], strict=True
        )
    ]
    return frame.assign(line=pd.Series(names, index=frame.index, dtype=object))


# ---------------------------------------------------------------------------------------
# Per-curve summaries
