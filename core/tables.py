"""The curve table: one metric by evaluation length, one row per line.

Built once here and shown three ways: on the terminal (``posbench run``, ``posbench
results``), as markdown (``table.md``) and as a DataFrame (the dashboard's Compare
page). The columns and the cells' format come from the table and the metric registry,
so the views cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pandas as pd

from core.metrics import Metric, metric_named
from core.safe_text import text

if TYPE_CHECKING:
    from rich.table import Table

Curves = Mapping[str, Mapping[int, float | None]]  # line -> length -> value
Row = tuple[tuple[str, ...], dict[int, float | None]]  # the row's key cells, its values


@dataclass(frozen=True)
class CurveTable:
    metric: Metric
    train_length: int | None  # None: lines trained at several lengths (no multiples shown)
    keys: tuple[str, ...]  # the columns that name a row ("encoding", ...)
    rows: tuple[Row, ...]
    lengths: tuple[int, ...]  # every length any row was evaluated at, ascending

    def length_label(self, length: int, at_train: str = "") -> str:
        """A length column's header: the length, then ``at_train`` at the training
        length or its multiple of it (``32 (2x)``) elsewhere."""
        if self.train_length is None:
            return str(length)
        if length == self.train_length:
            return f"{length}{at_train}"
        return f"{length} ({length / self.train_length:g}x)"

    def cells(self) -> list[list[str]]:
        """Each row's key cells, then its values in the metric's format (``n/a``: none)."""
        return [
            [*key, *(self.metric.format(values.get(n)) for n in self.lengths)]
            for key, values in self.rows
        ]

    def markdown(self) -> str:
        """The table.md form: the metric names the first column; ``(L)`` marks the
        training length."""
        header = [f"{self.metric.name} by length", *self.keys[1:]]
        header += [self.length_label(n, " (L)") for n in self.lengths]
        return markdown_rows(header, self.cells())

    def rich(self, title: str) -> Table:
        """The terminal form, numbers right-aligned; the title and the cells are text
        (a label is never read as Rich markup)."""
        from rich.table import Table

        table = Table(title=text(title))
        for key in self.keys:
            table.add_column(text(key))
        for n in self.lengths:
            table.add_column(self.length_label(n), justify="right")
        for cells in self.cells():
            table.add_row(*map(text, cells))
        return table

    def frame(self) -> pd.DataFrame:
        """The numbers themselves (NaN where a row has none), one row per line and one
        column per length, for a view that sorts and formats them itself."""
        index = pd.Index([key[0] for key, _ in self.rows], name=self.keys[0])
        columns = pd.Index(list(self.lengths), name="eval_length")
        values = [[_number(values.get(n)) for n in self.lengths] for _, values in self.rows]
        return pd.DataFrame(values, index=index, columns=columns, dtype=float)


def curve_table(
    rows: Iterable[Row] | Curves,
    metric: str,
    train_length: int | None,
    keys: Sequence[str] = ("encoding",),
) -> CurveTable:
    """The curve table of ``rows``: ``{line: {length: value}}`` (one key column), or
    (key cells, ``{length: value}``) pairs for several key columns."""
    if isinstance(rows, Mapping):
        rows = [((str(line),), values) for line, values in rows.items()]
    built = tuple(
        (tuple(key), {int(n): value for n, value in values.items()}) for key, values in rows
    )
    lengths = tuple(sorted({n for _, values in built for n in values}))
    return CurveTable(metric_named(metric), train_length, tuple(keys), built, lengths)


def seed_means(frame: pd.DataFrame, metric: str, train_length: int) -> CurveTable:
    """The curve table of stored evaluation points (``db.queries.curves``): one row per
    (encoding label, variant, protocol) with its number of seeds, each cell the mean
    over the seeds that have a value."""
    lengths = sorted(frame["eval_length"].unique()) if not frame.empty else []
    rows = []
    for (label, variant, protocol), group in frame.groupby(
        ["label", "variant", "protocol"], sort=False
    ):
        values = {}
        for n in lengths:
            at = group.loc[group["eval_length"] == n, metric].dropna()
            values[n] = at.mean() if len(at) else None
        rows.append(((label, variant, protocol, str(group["seed"].nunique())), values))
    keys = ("encoding", "variant", "protocol", "seeds")
    return curve_table(rows, metric, train_length, keys)


def seed_summary_table(summary: pd.DataFrame, metric: str) -> CurveTable:
    """The curve table of ``core.analysis.seed_summary``'s means, lines in name order
    (studies of different training lengths may be shown together: no multiples)."""
    rows: dict[str, dict[int, float | None]] = {}
    for line, length, mean in zip(
        summary["line"], summary["eval_length"], summary["mean"], strict=True
    ):
        if not pd.isna(mean):
            rows.setdefault(line, {})[int(length)] = float(mean)
    ordered = [((line,), rows[line]) for line in sorted(rows)]
    return curve_table(ordered, metric, None, keys=("line",))


def markdown_frame(frame: pd.DataFrame) -> str:
    """A DataFrame of short cells as a markdown table (the index is not shown)."""
    return markdown_rows(list(frame.columns), list(frame.itertuples(index=False)))


def markdown_rows(header: Sequence[object], rows: Iterable[Sequence[object]]) -> str:
    """A markdown table: a header row, the separator, then one row per sequence of cells."""
    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    return "\n".join(lines)


def _number(value: float | None) -> float:
    return float("nan") if value is None else float(value)
