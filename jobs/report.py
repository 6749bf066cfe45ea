"""Turn curves into what a person reads: a table and a PNG of extrapolation curves.

Works on plain ``{line: {length: value}}`` dictionaries; no torch.
"""

from __future__ import annotations

from pathlib import Path

Curves = dict[str, dict[int, float | None]]


def format_value(value: float | None, metric: str) -> str:
    if value is None:
        return "n/a"
    return f"{value:.3f}" if metric == "accuracy" else f"{value:.2f}"


def markdown_table(curves: Curves, metric: str, train_length: int) -> str:
    lengths = sorted({length for points in curves.values() for length in points})
    header = [f"{metric} by length"] + [
        f"{n}" + (" (L)" if n == train_length else f" ({n / train_length:g}x)") for n in lengths
    ]
    rows = [
        [label, *(format_value(points.get(n), metric) for n in lengths)]
        for label, points in curves.items()
    ]
    return markdown_rows(header, rows)


def markdown_frame(frame) -> str:
    """A DataFrame of short cells as a markdown table (the index is not shown)."""
    return markdown_rows(list(frame.columns), list(frame.itertuples(index=False)))


def markdown_rows(header: list, rows: list) -> str:
    """A markdown table: a header row, the separator, then one row per sequence of cells."""
    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    return "\n".join(lines)


def plot_curves(curves: Curves, metric: str, train_length: int, path: Path, title: str) -> Path:
    """Metric against evaluation length (log2 axis; log scale for perplexity)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 5), dpi=120)
    for label, points in curves.items():
        xs = [n for n, v in sorted(points.items()) if v is not None]
        ys = [points[n] for n in xs]
        if xs:
            axis.plot(xs, ys, marker="o", label=label)
    axis.set_xscale("log", base=2)
    lengths = sorted({n for points in curves.values() for n in points})
    axis.set_xticks(lengths, [str(n) for n in lengths])
    axis.minorticks_off()
    if metric == "perplexity":
        axis.set_yscale("log")
    axis.axvline(train_length, color="grey", linestyle="--", linewidth=1)
    axis.text(train_length, axis.get_ylim()[1], " train length", va="top", color="grey")
    axis.set_xlabel("evaluation length (bytes)")
    axis.set_ylabel(metric)
    axis.set_title(title)
    axis.grid(True, alpha=0.3)
    axis.legend(fontsize="small")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    return path
