"""Heatmaps for the Compare page: a line's accuracy by group as a grid of coloured cells
(``core.analysis.group_grid``), one Plotly figure per line (no Streamlit here).

A figure's title and axes are the page's own words; the line it belongs to is shown
beside it as escaped text. Every text that enters a figure (titles, axis labels, cell
labels, the hover template) goes through ``core.safe_text.plot_text``, since Plotly
reads tags and ``%{...}`` in all of them.
"""

from __future__ import annotations

import math
from numbers import Real

import pandas as pd
import plotly.graph_objects as go

from core.metrics import Kind, headline
from core.safe_text import plot_text

COLOR_SCALE = "Viridis"  # perceptually uniform, readable without colour vision
CELL_PIXELS = 34


def heatmap_figure(
    table: pd.DataFrame,
    title: str,
    x_title: str,
    y_title: str,
    train_length: int | None = None,
    reverse_y: bool = False,
    value: str | None = None,
    bounds: tuple[float, float] | None = (0.0, 1.0),
) -> go.Figure:
    """``table`` (rows on y, columns on x, accuracies in [0, 1] or NaN) as a heatmap on
    a fixed colour scale from 0 to 1, each cell's value written in it and an empty cell
    where the table has none. With ``train_length`` the columns are evaluation lengths:
    the training length's column is named so and a dashed line marks its right edge
    (cells right of it are past training). ``reverse_y`` puts the first row at the top
    (depth 0, the start of the context). ``value`` names another quantity than accuracy
    (an attention diagnostic), with its own ``bounds`` (None: the data's range)."""
    accuracy = value or headline(Kind.ANSWER).name
    low, high = bounds if bounds is not None else (None, None)
    z = [[None if math.isnan(value) else float(value) for value in row] for row in table.to_numpy()]
    x = [
        plot_text(_tick(value) + (" (train)" if value == train_length else ""))
        for value in table.columns
    ]
    y = [plot_text(_tick(value)) for value in table.index]
    figure = go.Figure(
        go.Heatmap(
            z=z,
            x=x,
            y=y,
            zmin=low,
            zmax=high,
            colorscale=COLOR_SCALE,
            colorbar={"title": {"text": plot_text(accuracy)}},
            texttemplate="%{z:.3g}" if bounds is None else "%{z:.2f}",
            xgap=1,
            ygap=1,
            hovertemplate=f"{plot_text(y_title)} %{{y}}<br>{plot_text(x_title)} %{{x}}<br>"
            f"{plot_text(accuracy)} %{{z:.3f}}"
            "<extra></extra>",
        )
    )
    figure.update_xaxes(type="category", title=plot_text(x_title))
    figure.update_yaxes(
        type="category", title=plot_text(y_title), autorange="reversed" if reverse_y else True
    )
    if train_length is not None:
        # Category axes count cells from 0: the edge after the last length <= training.
        edge = sum(1 for value in table.columns if value <= train_length) - 0.5
        figure.add_shape(
            type="line",
            x0=edge,
            x1=edge,
            y0=0,
            y1=1,
            yref="paper",
            line={"color": "#d62728", "dash": "dash", "width": 2},
        )
    figure.update_layout(
        title=plot_text(title),
        height=160 + CELL_PIXELS * len(y),
        margin={"l": 60, "r": 20, "t": 50, "b": 50},
    )
    return figure


def _tick(value: object) -> str:
    """A cell's coordinate as its label reads: 0.5, 1, 10 (no trailing zeros)."""
    return f"{value:g}" if isinstance(value, Real) else str(value)
