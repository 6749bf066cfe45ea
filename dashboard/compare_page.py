"""Compare: extrapolation curves across encodings, variants, seeds and studies.

The selection lives in the URL's query parameters, so a view can be shared.
"""

from __future__ import annotations

import streamlit as st

from core import analysis
from core.catalog.hf_models import HF_ENCODING
from core.metrics import Kind, headline, kind_of, metric_named, shown_with
from core.safe_text import markdown
from core.spec import protocol_title
from core.tables import seed_summary_table
from dashboard.common import (
    database,
    imported_captions,
    picker_studies,
    query_ints,
    schema_ready,
    set_query,
)
from dashboard.curves import (
    curve_figure,
    length_unit,
    line_colors,
    normalize,
    position_figure,
    summarize,
    training_figure,
)
from dashboard.diagnostics_view import render_diagnostics
from dashboard.heatmaps import heatmap_figure
from db import queries

MAX_LENGTHS = 48
TOKENIZERS_NOTE = (
    "An hf: model's lengths count its own tokens (posbench's models read bytes): one "
    "length is a different amount of text for models with different tokenizers. Bits per "
    "byte divides by the bytes of text scored, so it compares across tokenizers; loss and "
    "perplexity are per token of each model's tokenizer."
)


def render() -> None:
    st.title("Compare")
    if not schema_ready():
        return
    studies = picker_studies("studies", query_ints("studies"))
    if studies is None:
        st.info("No study yet.")
        return
    ids = studies["id"].tolist()
    names = {row.id: f"{row.id}: {row.name}" for row in studies.itertuples()}
    wanted = [i for i in query_ints("studies") if i in ids] or ids[:1]
    selected = st.multiselect("Studies", ids, default=wanted, format_func=names.get, key="studies")
    set_query("studies", selected)
    if not selected:
        return
    chosen = studies[studies["id"].isin(selected)]
    imported_captions(chosen)
    # Each study's metric, then the others of its kind (core.metrics).
    scored_by = sorted(set(chosen["metric"]))
    metric_options = [m.name for name in scored_by for m in shown_with(name)]
    frame = queries.curves(database(), study_ids=selected, max_lengths=MAX_LENGTHS)
    if frame.empty:
        st.info("No evaluation stored yet for this selection: curves appear as runs finish.")
        return
    a, b, c, d = st.columns(4)
    metric = a.selectbox(
        "Metric",
        metric_options,
        key="metric",
        index=_index(metric_options, st.query_params.get("metric")),
    )
    protocols = sorted(frame["protocol"].unique())
    protocol = b.selectbox(
        "Protocol",
        protocols,
        key="protocol",
        index=_index(protocols, st.query_params.get("protocol")),
    )
    variants = sorted(frame["variant"].unique(), key=lambda v: (v != "none", v))
    shown = c.multiselect("Variants", variants, default=variants, key="variants")
    normalise = d.toggle(
        "Normalise by the value at the training length",
        key="normalise",
        value=st.query_params.get("normalise") == "1",
    )
    set_query("metric", metric)
    set_query("protocol", protocol)
    set_query("normalise", "1" if normalise else None)
    view = frame[(frame["protocol"] == protocol) & frame["variant"].isin(shown)]
    summary = summarize(view, metric)
    train_lengths = dict(zip(chosen["id"], chosen["train_length"], strict=True))
    if normalise:
        summary = normalize(summary, train_lengths)
    log_y = metric_named(metric).log_scale and not normalise
    scored_with = protocol_title(
        (queries.study_spec(database(), int(study)) for study in view["study_id"].unique()),
        protocol,
    )
    label = f"{metric} / value at the training length" if normalise else metric
    hf_models = bool((view["encoding"] == HF_ENCODING).any())
    own_models = bool((view["encoding"] != HF_ENCODING).any())
    st.plotly_chart(
        curve_figure(
            summary,
            f"{label} ({scored_with})",
            list(train_lengths.values()),
            log_y,
            title=f"{label} against evaluation length ({scored_with})",
            unit=length_unit(hf_models, own_models),
        ),
        key="curves",
        width="stretch",
    )
    if hf_models:
        st.caption(TOKENIZERS_NOTE)
    _not_applicable(view)
    if any(kind_of(name) is Kind.LANGUAGE_MODELLING for name in scored_by):
        per = "token of each model" if own_models else "token"
        _positions(view, line_colors(summary), per if hf_models else "byte")
    _training(view, line_colors(summary))
    render_diagnostics(view, train_lengths, list(line_colors(summary)))
    st.subheader("Results")
    table = seed_summary_table(summary, metric).frame()
    st.dataframe(table, width="stretch", key="results")
    _summaries(selected, protocol, shown)
    _pairwise(view, metric, train_lengths)
    if kind_of(metric) is Kind.ANSWER:  # synthetic tasks report accuracy by group
        _groups(view, train_lengths, list(line_colors(summary)))
    st.download_button(
        "Download CSV",
        view.drop(columns=["groups"]).to_csv(index=False),
        file_name=f"posbench-studies-{'-'.join(map(str, selected))}.csv",
        mime="text/csv",
        key="csv",
    )


def _not_applicable(view) -> None:
    """The points a model could not be scored at, and why (a few of them)."""
    not_applicable = view[view["not_applicable"].notna()]
    if not not_applicable.empty:
        reasons = {
            markdown(f"{r.label} at {r.eval_length}: {r.not_applicable}")
            for r in not_applicable.itertuples()
        }
        st.caption("Not applicable: " + "; ".join(sorted(reasons)[:6]))


def _positions(view, colors: dict[str, str], per: str) -> None:
    """The loss (nats per ``per``) by position in the window at one length (language
    modelling: every byte, or every token of an hf: model, is scored)."""
    lengths = sorted(view["eval_length"].unique())
    length = st.select_slider(
        "Loss by position at length", lengths, value=lengths[-1], key="position_length"
    )
    at_length = view[(view["eval_length"] == length) & view["not_applicable"].isna()]
    bins = queries.position_bins(database(), at_length["evaluation_id"].tolist())
    if not bins.empty:
        lines = analysis.with_lines(at_length)[["evaluation_id", "line"]]
        merged = bins.merge(lines, on="evaluation_id")
        averaged = merged.groupby(["line", "start", "end"], sort=False)["loss"].mean()
        st.plotly_chart(
            position_figure(averaged.reset_index(), colors, per),
            key="positions",
            width="stretch",
        )


def _summaries(selected: list[int], protocol: str, shown: list[str]) -> None:
    st.subheader("Summaries")
    st.caption(
        "Per run, then mean [bootstrap 95% interval] across seeds. ratio kx: the metric at "
        "k x the training length over its value at 1x. effective length: the longest "
        "length up to which perplexity stays within 10% of its training-length value "
        "(accuracy stays at or above 0.5), unless the study set its own threshold: then "
        "the effective-length bound column gives the value each curve was held to. mean "
        "ln ppl: the area under ln(perplexity) over ln(length), divided by the ln-length "
        "span. short-context ratio: a variant's metric "
        "at 1x over the trained model's at 1x (what a scaling costs on short texts). order "
        "sensitivity: how much the loss on the second half of a window rises (nats/byte) "
        "when its first half is shuffled."
    )
    stored = queries.run_summaries(database(), selected, protocol)
    stored = stored[stored["variant"].isin(shown)]
    if stored.empty:
        st.info("Summaries are stored as runs finish.")
        return
    grid = analysis.summary_grid(analysis.summary_statistics(analysis.with_lines(stored)))
    st.dataframe(grid, width="stretch", key="summaries")


def _training(view, colors: dict[str, str]) -> None:
    """The training and validation loss of the runs behind the curves (the trained
    models, so one line per encoding, not per inference variant)."""
    runs = view.drop_duplicates("run_id")[["run_id", "study_id", "label", "seed"]]
    # Bounded: a study's curves are drawn from at most TRAIN_POINTS_PER_STUDY rows
    # (each run downsampled in the query, its first and last step kept).
    points = queries.train_points(
        database(), runs["run_id"].tolist(), max_per_study=queries.TRAIN_POINTS_PER_STUDY
    )
    if points.empty:
        return
    curves = analysis.training_curves(points, runs.rename(columns={"run_id": "id"}))
    with st.expander("Training and validation loss", expanded=False):
        st.plotly_chart(training_figure(curves, colors), key="training", width="stretch")


def _pairwise(view, metric: str, train_lengths: dict[int, int]) -> None:
    st.subheader("Pairwise")
    data = analysis.with_lines(view[view["not_applicable"].isna()])
    lengths = sorted(data["eval_length"].unique())
    if data["line"].nunique() < 2 or not lengths:
        st.caption("Pairwise comparisons need at least two lines.")
        return
    length = st.select_slider(
        "At evaluation length", lengths, value=lengths[-1], key="pairwise_length"
    )
    table = analysis.pairwise_table(data[data["eval_length"] == length], metric, line="line")
    same_training = len(set(train_lengths.values())) == 1
    train_length = next(iter(train_lengths.values())) if same_training else None
    table["claim"] = [analysis.claim(row, train_length) for _, row in table.iterrows()]
    st.caption(
        "P(a wins): the fraction of 2,000 bootstrap resamples in which a's mean is better "
        "than b's (ties count half). Lines that ran the same seeds of the same studies are "
        "paired: a seed fixes the training batches (every run is scored on the same "
        "bytes), so each resample draws "
        "seeds and takes both lines' runs of them; otherwise each line's seeds are drawn "
        "independently. A bootstrap over a few seeds is "
        "overconfident (with one seed a side it is 0, 0.5 or 1); five or more seeds per "
        "line make it worth quoting."
    )
    st.dataframe(
        table.drop(columns="eval_length").rename(columns={"p_a_wins": "P(a wins)"}),
        width="stretch",
        key="pairwise",
        hide_index=True,
    )


def _groups(view, train_lengths: dict[int, int], order: list[str]) -> None:
    data = analysis.with_lines(view[view["not_applicable"].isna()])
    groups = analysis.group_accuracy(data)
    if groups.empty:
        return
    st.subheader("Accuracy by group")
    keys = analysis.group_keys(data)
    if analysis.DEPTH in keys:
        _depth_maps(data, train_lengths, order)
    if set(analysis.OPERANDS) <= keys:
        _operand_grids(data, groups, order)
    with st.expander("Accuracy by group, as tables", expanded=False):
        for key, part in groups.groupby("key", sort=False):
            st.caption(f"by {markdown(key)} (mean over the other groups and over seeds)")
            table = part.pivot_table(
                index=["line", "value"],
                columns="eval_length",
                values=headline(Kind.ANSWER).name,
                sort=False,
            )
            st.dataframe(table, width="stretch", key=f"groups_{key}")


def _depth_maps(data, train_lengths: dict[int, int], order: list[str]) -> None:
    """Per line, accuracy by needle depth (y, from the start of the context down) and
    evaluation length (x), the training length marked."""
    depth = analysis.DEPTH
    grids = analysis.group_grid(data, rows=depth, columns=analysis.EVAL_LENGTH)
    studies = dict(zip(data["line"], data["study_id"], strict=True))
    accuracy = headline(Kind.ANSWER).name
    st.caption(
        f"{accuracy} by needle {depth} (0: the start of the context) and evaluation "
        "length, mean over seeds; the dashed line is the training length's edge."
    )
    figures = {
        line: heatmap_figure(
            table,
            f"{accuracy} by {depth} and evaluation length",
            "evaluation length",
            depth,
            train_length=train_lengths.get(studies[line]),
            reverse_y=True,
        )
        for line, table in grids.items()
    }
    _draw(figures, order, "depth_map")


def _operand_grids(data, groups, order: list[str]) -> None:
    """Per line, accuracy by the two operands' lengths at one evaluation length (of
    those whose examples have operands: ``groups`` is ``group_accuracy``'s table)."""
    i, j = analysis.OPERANDS
    lengths = sorted(groups.loc[groups["key"] == i, "eval_length"].unique())
    length = lengths[-1]
    if len(lengths) > 1:
        length = st.select_slider(
            "Operand grid at evaluation length", lengths, value=length, key="grid_length"
        )
    grids = analysis.group_grid(data, rows=i, columns=j, eval_length=length)
    accuracy = headline(Kind.ANSWER).name
    st.caption(
        f"{accuracy} by the first operand's length ({i}) and the second's ({j}) at "
        f"length {length}, mean over seeds; an empty cell had no example."
    )
    figures = {
        line: heatmap_figure(table, f"{accuracy} by operand lengths at length {length}", j, i)
        for line, table in grids.items()
    }
    _draw(figures, order, "operand_grid")


def _draw(figures: dict, order: list[str], key: str) -> None:
    """One figure per line, two to a row, in the curves' order, each under its line's
    name (as text)."""
    lines = sorted(figures, key=lambda line: order.index(line) if line in order else len(order))
    columns = st.columns(2)
    for index, line in enumerate(lines):
        with columns[index % 2]:
            st.caption(markdown(line))
            st.plotly_chart(figures[line], key=f"{key}_{index}", width="stretch")


def _index(options: list[str], wanted: str | None) -> int:
    return options.index(wanted) if wanted in options else 0
