"""Audit F6: user strings in Plotly figures are text. Plotly reads tags (``<a href>``,
``<b>``) in a trace's name, titles and axis labels, and ``%{...}`` in a hover template,
so every text placed into a figure goes through one helper, ``core.safe_text.plot_text``
(checked here for every figure the dashboard builds)."""

from __future__ import annotations

import ast
from pathlib import Path

import pandas as pd

from core.safe_text import plot_text
from lint.project import PACKAGES

ROOT = Path(__file__).resolve().parents[1]
HOSTILE = "<a href=https://evil.example>click</a> %{x} &amp;"
# Plotly's keywords that show text (a dict's keys too: title={"text": ...}).
TEXT_KEYWORDS = {"name", "title", "text", "hovertemplate", "ticktext", "legendgrouptitle"}
# Plotly's constructors and updaters (our own functions escape inside: curve_figure's
# title is the page's text until curve_figure places it).
PLOTLY_CALLS = {
    "Scatter",
    "Heatmap",
    "Bar",
    "Box",
    "Histogram",
    "Figure",
    "Layout",
    "add_annotation",
    "update_layout",
    "update_xaxes",
    "update_yaxes",
    "update_traces",
    "add_hline",
    "add_vline",
}


def _safe(node: ast.AST) -> bool:
    """A literal, plot_text(...), or text built only of those."""
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, ast.Call):
        return isinstance(node.func, ast.Name) and node.func.id == "plot_text"
    if isinstance(node, ast.JoinedStr):
        return all(isinstance(part, ast.Constant) or _safe(part.value) for part in node.values)
    if isinstance(node, ast.BinOp):
        return _safe(node.left) and _safe(node.right)
    if isinstance(node, ast.Dict):
        return all(
            _safe(value)
            for key, value in zip(node.keys, node.values, strict=True)
            if isinstance(key, ast.Constant) and key.value in TEXT_KEYWORDS
        )
    if isinstance(node, ast.ListComp | ast.List):
        elements = [node.elt] if isinstance(node, ast.ListComp) else node.elts
        return all(_safe(element) for element in elements)
    return False


def unsafe_figure_text(source: str, where: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        function = node.func
        called = (
            function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", "")
        )
        if called not in PLOTLY_CALLS:
            continue
        for keyword in node.keywords:
            shows_text = keyword.arg in TEXT_KEYWORDS or isinstance(keyword.value, ast.Dict)
            if shows_text and not _safe(keyword.value):
                found.append(f"{where}:{node.lineno}: {keyword.arg}={ast.unparse(keyword.value)}")
    return found


def plotly_sources() -> list[Path]:
    return [
        path
        for folder in PACKAGES
        for path in sorted((ROOT / folder).rglob("*.py"))
        if "plotly" in path.read_text()
    ]


def test_every_text_in_every_figure_goes_through_plot_text() -> None:
    sources = plotly_sources()
    assert {p.name for p in sources} >= {"curves.py", "heatmaps.py", "explore_page.py"}
    found = [f for path in sources for f in unsafe_figure_text(path.read_text(), path.name)]
    assert not found, "\n".join(found)


def test_the_check_finds_a_raw_name_title_or_template() -> None:
    planted = (
        "go.Scatter(name=line, hovertemplate=f'{line} %{{x}}')\n"
        "figure.update_layout(title=title, legend={'title': {'text': name}})\n"
        "go.Heatmap(colorbar={'title': heading}, ticktext=[str(n) for n in ns])\n"
        "go.Scatter(name=plot_text(line), hovertemplate=f'{plot_text(line)} %{{x}}')\n"
    )
    found = unsafe_figure_text(planted, "planted.py")
    assert [f.split(": ", 1)[1].split("=")[0] for f in found] == [
        "name",
        "hovertemplate",
        "title",
        "legend",
        "colorbar",
        "ticktext",
    ]


def test_plot_text_is_shown_as_written() -> None:
    shown = plot_text(HOSTILE)
    assert "<" not in shown and ">" not in shown and "%{" not in shown
    # The entities Plotly turns back into the characters they stand for.
    entities = {"&lt;": "<", "&gt;": ">", "&#37;": "%", "&amp;": "&"}
    decoded, i = "", 0
    while i < len(shown):
        entity = next((e for e in entities if shown.startswith(e, i)), None)
        decoded += entities[entity] if entity else shown[i]
        i += len(entity) if entity else 1
    assert decoded == HOSTILE


def test_a_hostile_line_name_reaches_the_figure_as_text() -> None:
    from dashboard.curves import curve_figure, training_figure

    summary = pd.DataFrame(
        {
            "line": [HOSTILE] * 2,
            "study_id": [1, 1],
            "eval_length": [32, 64],
            "mean": [2.0, 3.0],
            "low": [1.9, 2.9],
            "high": [2.1, 3.1],
            "seeds": [2, 2],
        }
    )
    figure = curve_figure(summary, "perplexity", [32], False, title=f"study {HOSTILE}")
    trace = next(t for t in figure.data if t.mode == "lines+markers")
    assert trace.name == plot_text(HOSTILE)
    assert trace.hovertemplate.startswith(plot_text(HOSTILE) + "<br>length %{x}")
    assert figure.layout.title.text == plot_text(f"study {HOSTILE}")
    curves = pd.DataFrame(
        {"line": [HOSTILE] * 2, "step": [1, 2], "loss": [3.0, 2.0], "val_loss": [None, 2.5]}
    )
    names = {t.name for t in training_figure(curves, {}).data}
    assert names == {plot_text(HOSTILE), plot_text(f"{HOSTILE} (validation)")}
