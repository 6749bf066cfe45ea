"""Compare's Diagnostics view: why the curves bend (docs/diagnostics.md).

One attention diagnostic against the evaluation length per line (as the curves draw
the metric), and, for one line, the same diagnostic per layer as a layer x length
heatmap, the training length marked. Shown where the selection's studies evaluated
with ``eval.diagnostics``.
"""

from __future__ import annotations

import pandas as pd
import streamlit as st

from core import analysis
from core.metrics import diagnostics, metric_named
from core.safe_text import markdown
from dashboard.common import database
from dashboard.curves import curve_figure, summarize
from dashboard.heatmaps import heatmap_figure
from db import queries

GUIDE = (
    "Attention diagnostics from 256 sampled queries per window (at most 2,048 per "
    "point): entropy in nats and normalised by log(keys seen) (1: uniform), mean "
    "distance in tokens, the mass on the first 4 tokens (sinks), the mass at distances "
    "at or past the training length L (0 up to 1x), and the largest pre-softmax logit; "
    "the mean over layers and heads. A bend in the perplexity curve where the mass past "
    "L or the entropy jumps is explained by it. The dashed line marks L."
)


def render_diagnostics(view: pd.DataFrame, train_lengths: dict[int, int], order: list[str]) -> None:
    """The Diagnostics view of the points in ``view`` (``db.queries.curves`` rows of one
    protocol and the variants shown); ``order`` is the curves' order of lines."""
    first = diagnostics()[0].column
    measured = view[view[first].notna()]
    st.subheader("Diagnostics")
    if measured.empty:
        st.caption(
            "No attention diagnostics in this selection: a study evaluated with "
            "eval.diagnostics: true has them (docs/diagnostics.md)."
        )
        return
    st.caption(GUIDE)
    names = [m.name for m in diagnostics()]
    name = st.selectbox(
        "Diagnostic",
        names,
        key="diagnostic",
        format_func=lambda n: f"{n}: {metric_named(n).description}",
    )
    metric = metric_named(name)
    summary = summarize(measured, metric.column)
    st.plotly_chart(
        curve_figure(
            summary,
            name,
            list(train_lengths.values()),
            False,
            title=f"{name} against evaluation length",
        ),
        key="diagnostic_curves",
        width="stretch",
    )
    lines = analysis.with_lines(measured)
    available = sorted(
        lines["line"].unique(), key=lambda line: order.index(line) if line in order else len(order)
    )
    line = st.selectbox("Layer x length heatmap of", available, key="diagnostic_line")
    part = lines[lines["line"] == line]
    stored = queries.attention(database(), part["evaluation_id"].tolist())
    cells = [
        {"layer": layer, "eval_length": int(length), "value": float(value)}
        for evaluation, length in zip(part["evaluation_id"], part["eval_length"], strict=True)
        for layer, value in enumerate(
            (stored.get(int(evaluation)) or {}).get("layers", {}).get(name, [])
        )
    ]
    if not cells:
        st.caption("No per-layer values stored for this line.")
        return
    table = pd.DataFrame(cells).pivot_table(
        index="layer", columns="eval_length", values="value", aggfunc="mean"
    )
    study = int(part["study_id"].iloc[0])
    st.caption(
        markdown(line) + f": {name} per layer (rows, 0 the first) and evaluation length, "
        "mean over heads and seeds"
    )
    st.plotly_chart(
        heatmap_figure(
            table,
            f"{name} by layer and evaluation length",
            "evaluation length",
            "layer",
            train_length=train_lengths.get(study),
            reverse_y=True,
            value=name,
            bounds=(0.0, 1.0) if metric.high <= 1.0 + 1e-6 else None,
        ),
        key="diagnostic_heatmap",
        width="stretch",
    )
