"""Turn curves into a picture: a PNG of extrapolation curves, with the seeds' bands.

Works on plain ``{line: {length: value}}`` dictionaries; no torch. The curve table
is ``core.tables``.
"""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

from core.analysis import bootstrap_interval
from core.metrics import metric_named

Curves = dict[str, dict[int, float | None]]
Bands = dict[str, dict[int, tuple[float, float]]]  # line -> length -> (low, high)


def seed_bands(values: dict[str, dict[int, list[float]]]) -> Bands:
    """The 95% bootstrap interval of the mean at every point with two seeds or more (the
    dashboard's and ``posbench results``' interval)."""

    bands: Bands = {}
    for label, points in values.items():
        for length, seeds in points.items():
            if len(seeds) >= 2:
                _, low, high = bootstrap_interval(seeds)
                bands.setdefault(label, {})[length] = (low, high)
    return bands


def _palette(count: int) -> list:
    """``count`` distinguishable colours: tab10, then tab20's dark shades before its light
    ones (its neighbours are two shades of one hue), then repeating."""
    import matplotlib

    if count <= 10:
        return [matplotlib.colormaps["tab10"](i) for i in range(count)]
    tab20 = matplotlib.colormaps["tab20"]
    order = [*range(0, 20, 2), *range(1, 20, 2)]
    return [tab20(order[i % 20]) for i in range(count)]


# The trained model solid with circles; each variant (a scaling) a dashed kind of its own.
STYLES = ("-", "--", ":", "-.", (0, (5, 1, 1, 1, 1, 1)), (0, (8, 2)), (0, (1, 3)))
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def plot_curves(
    curves: Curves,
    metric: str,
    train_length: int,
    path: Path | BinaryIO,
    title: str,
    bands: Bands | None = None,
) -> Path | BinaryIO:
    """Metric against evaluation length (log2 axis; a log scale for a metric the registry
    puts on one, perplexity). One colour
    per encoding, one line style and marker per variant ("rope + yarn:4" is rope's colour,
    dashed), the seeds' 95% interval as a band where ``bands`` has one, the legend
    beside the plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    encodings = list(dict.fromkeys(label.split(" + ")[0] for label in curves))
    variants = list(dict.fromkeys(["", *(label.partition(" + ")[2] for label in curves)]))
    colours = dict(zip(encodings, _palette(len(encodings)), strict=True))
    figure, axis = plt.subplots(figsize=(10, 5.5), dpi=120)
    for label, points in curves.items():
        encoding, _, variant = label.partition(" + ")
        k = variants.index(variant)  # 0: the trained model
        style = STYLES[0] if k == 0 else STYLES[1 + (k - 1) % (len(STYLES) - 1)]
        xs = [n for n, v in sorted(points.items()) if v is not None]
        ys = [points[n] for n in xs]
        if not xs:
            continue
        colour = colours[encoding]
        axis.plot(
            xs,
            ys,
            color=colour,
            linestyle=style,
            marker=MARKERS[k % len(MARKERS)],
            markersize=4,
            label=label,
        )
        band = (bands or {}).get(label, {})
        spans = [(n, *band[n]) for n in xs if n in band]
        if spans:
            at, low, high = zip(*spans, strict=True)
            axis.fill_between(at, low, high, color=colour, alpha=0.15, linewidth=0)
    axis.set_xscale("log", base=2)
    lengths = sorted({n for points in curves.values() for n in points})
    axis.set_xticks(lengths, [str(n) for n in lengths])
    axis.minorticks_off()
    if metric_named(metric).log_scale:
        from matplotlib.ticker import FuncFormatter

        axis.set_yscale("log")
        plain = FuncFormatter(lambda value, _: f"{value:g}")  # 12, not 1.2 x 10^1
        axis.yaxis.set_major_formatter(plain)
        axis.yaxis.set_minor_formatter(plain)
    axis.axvline(train_length, color="grey", linestyle="--", linewidth=1)
    axis.text(train_length, axis.get_ylim()[1], " train length", va="top", color="grey")
    axis.set_xlabel("evaluation length (bytes)")
    axis.set_ylabel(metric + (" (mean and 95% interval over seeds)" if bands else ""))
    axis.set_title(title)
    axis.grid(True, alpha=0.3)
    axis.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0)
    figure.tight_layout()
    if isinstance(path, Path):
        path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png")  # a path, or a handle of the file written whole
    plt.close(figure)
    return path
