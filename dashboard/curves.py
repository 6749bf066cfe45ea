"""Curves for the Compare page: seed statistics and Plotly figures (no Streamlit here)."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from core import analysis
from core.safe_text import plot_text


def summarize(frame: pd.DataFrame, metric: str) -> pd.DataFrame:
    """Mean and bootstrap 95% interval across seeds for every (line, length)."""
    return analysis.seed_summary(analysis.with_lines(frame), metric, line="line")


def normalize(summary: pd.DataFrame, train_lengths: dict[int, int]) -> pd.DataFrame:
    """Divide each line by its value at its study's training length."""
    out = summary.copy()
    for line, group in out.groupby("line"):
        study = int(group["study_id"].iloc[0])
        at_train = group.loc[group["eval_length"] == train_lengths.get(study), "mean"]
        if len(at_train):
            mask = out["line"] == line
            out.loc[mask, ["mean", "low", "high"]] /= float(at_train.iloc[0])
    return out


def line_colors(summary: pd.DataFrame) -> dict[str, str]:
    """One colour per line, in the order the curves list them; every figure of a page
    uses the same mapping so a line keeps its colour."""
    lines = dict.fromkeys(summary["line"])
    return {line: COLORS[index % len(COLORS)] for index, line in enumerate(lines)}


def _band(figure: go.Figure, x, low, high, color: str, line: str) -> None:
    """A shaded region between ``low`` and ``high`` along ``x``, in the line's colour."""
    figure.add_trace(
        go.Scatter(
            x=list(x) + list(x)[::-1],
            y=list(high) + list(low)[::-1],
            fill="toself",
            fillcolor=color,
            opacity=0.18,
            line={"width": 0},
            hoverinfo="skip",
            showlegend=False,
            legendgroup=line,
        )
    )


def length_unit(hf_models: bool, own_models: bool) -> str:
    """What the evaluation lengths count: bytes for posbench's models (byte-level), an hf:
    model's own tokens for it; both, when a view shows both."""
    if hf_models and own_models:
        return "tokens of each model: bytes for posbench's, its tokenizer's for an hf: model"
    return "the model's tokens" if hf_models else "bytes"


def curve_figure(
    summary: pd.DataFrame,
    metric: str,
    train_lengths: list[int],
    log_y: bool,
    title: str,
    unit: str = "bytes",
) -> go.Figure:
    figure = go.Figure()
    colors = line_colors(summary)
    for line, group in summary.groupby("line", sort=False):
        group = group.sort_values("eval_length")
        color = colors[line]
        if (group["seeds"] > 1).any():
            _band(figure, group["eval_length"], group["low"], group["high"], color, line)
        figure.add_trace(
            go.Scatter(
                x=group["eval_length"],
                y=group["mean"],
                mode="lines+markers",
                name=plot_text(line),
                line={"color": color},
                legendgroup=line,
                customdata=group[["low", "high", "seeds"]],
                hovertemplate=f"{plot_text(line)}<br>length %{{x}}<br>"
                f"{plot_text(metric)} %{{y:.4g}}"
                "<br>95% bootstrap CI [%{customdata[0]:.4g}, %{customdata[1]:.4g}]"
                "<br>seeds %{customdata[2]}<extra></extra>",
            )
        )
    lengths = sorted(summary["eval_length"].unique())
    figure.update_xaxes(
        type="log",
        title=plot_text(f"evaluation length ({unit})"),
        tickvals=lengths,
        ticktext=[plot_text(n) for n in lengths],
    )
    figure.update_yaxes(type="log" if log_y else "linear", title=plot_text(metric))
    # A trace, not a layout shape: shapes on a log axis take log10 coordinates.
    low, high = summary["low"].min(), summary["high"].max()
    for length in sorted(set(train_lengths)):
        figure.add_trace(
            go.Scatter(
                x=[length, length],
                y=[low, high],
                mode="lines",
                name=plot_text(f"train length {length}"),
                line={"color": "grey", "dash": "dash", "width": 1},
                hoverinfo="name",
            )
        )
    figure.update_layout(
        title=plot_text(title),
        height=520,
        legend={"orientation": "v"},
        margin={"l": 60, "r": 20, "t": 60, "b": 50},
    )
    return figure


def position_figure(bins: pd.DataFrame, colors: dict[str, str], per: str = "byte") -> go.Figure:
    figure = go.Figure()
    for index, (line, group) in enumerate(bins.groupby("line", sort=False)):
        group = group.sort_values("start")
        middle = (group["start"] + group["end"] - 1) / 2 + 1
        figure.add_trace(
            go.Scatter(
                x=middle,
                y=group["loss"],
                mode="lines+markers",
                name=plot_text(line),
                line={"color": colors.get(line, COLORS[index % len(COLORS)])},
            )
        )
    figure.update_xaxes(type="log", title="position in the window (1-based, log bins)")
    figure.update_yaxes(title=plot_text(f"loss (nats / {per})"))
    figure.update_layout(height=420, margin={"l": 60, "r": 20, "t": 30, "b": 50})
    return figure


def training_figure(curves: pd.DataFrame, colors: dict[str, str]) -> go.Figure:
    """Training loss against step: the mean over each line's seeds, with the lowest and
    highest seed as a band; the validation loss (held out, at the training length) as a
    dashed line with markers where the runs validated."""
    figure = go.Figure()
    for index, (line, group) in enumerate(curves.groupby("line", sort=False)):
        by_step = group.groupby("step")["loss"].agg(["mean", "min", "max", "count"])
        color = colors.get(line, COLORS[index % len(COLORS)])
        if (by_step["count"] > 1).any():
            _band(figure, by_step.index, by_step["min"], by_step["max"], color, line)
        figure.add_trace(
            go.Scatter(
                x=by_step.index.tolist(),
                y=by_step["mean"].tolist(),
                mode="lines",
                name=plot_text(line),
                line={"color": color},
                legendgroup=line,
                customdata=by_step[["count"]].to_numpy().tolist(),
                hovertemplate=f"{plot_text(line)}<br>step %{{x}}<br>loss %{{y:.4g}}"
                "<br>seeds %{customdata[0]}<extra></extra>",
            )
        )
        validated = group.dropna(subset=["val_loss"])
        if len(validated):
            val = validated.groupby("step")["val_loss"].agg(["mean", "count"])
            figure.add_trace(
                go.Scatter(
                    x=val.index.tolist(),
                    y=val["mean"].tolist(),
                    mode="lines+markers",
                    name=plot_text(f"{line} (validation)"),
                    line={"color": color, "dash": "dash"},
                    legendgroup=line,
                    customdata=val[["count"]].to_numpy().tolist(),
                    hovertemplate=f"{plot_text(line)}<br>step %{{x}}<br>validation loss %{{y:.4g}}"
                    "<br>seeds %{customdata[0]}<extra></extra>",
                )
            )
    figure.update_xaxes(title="training step")
    figure.update_yaxes(type="log", title="loss (nats / byte, log scale); dashed: validation")
    figure.update_layout(height=420, margin={"l": 60, "r": 20, "t": 30, "b": 50})
    return figure


COLORS = [
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
]
