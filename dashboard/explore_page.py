"""Explore: what each encoding does, with no training.

The sinusoidal table, the dot-product decay against offset, the attention biases of
ALiBi / T5 / KERPLE / FIRE per head, and RoPE's frequencies with and without
PI / NTK / YaRN. Torch is imported here only, lazily.
"""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
import streamlit as st

from core.catalog.encodings import LOGN, REGISTRY, SCALINGS, TEMPERATURES
from core.safe_text import markdown, plot_text


@st.cache_resource(max_entries=32)
def _encoding(name: str, n_heads: int, head_dim: int, train_length: int):
    import torch

    from worker.encodings import build

    torch.manual_seed(0)  # learned parameters at a fixed, reproducible initialisation
    return build(
        name,
        n_heads=n_heads,
        head_dim=head_dim,
        d_model=n_heads * head_dim,
        train_length=train_length,
    )


def similarity_by_offset(
    name: str, n_heads: int, head_dim: int, train_length: int, length: int
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Offsets 0..length-1 and, per curve, the score of a query at ``offset`` against a key
    at 0 (rotary, absolute) or the bias at that distance (bias encodings, one per head)."""
    import torch

    encoding = _encoding(name, n_heads, head_dim, train_length)
    offsets = np.arange(length)
    family = REGISTRY[name].family
    with torch.no_grad():
        if family == "bias":
            row = encoding.bias(1, length)[:, 0].flip(-1).float().numpy()
            return offsets, {f"head {h}": row[h] for h in range(row.shape[0])}
        if family == "rotary":
            # Every head: FoPE's tables differ by head (RoPE's are one table for all).
            ones = torch.ones(1, n_heads, length, head_dim)
            q, k = encoding.rotate(ones, ones, torch.arange(length))
            scores = torch.einsum("htd,hd->ht", q[0], k[0, :, 0]) / head_dim
            if torch.equal(scores, scores[:1].expand_as(scores)):
                return offsets, {"q·k / d (q = k = 1)": scores[0].numpy()}
            return offsets, {f"head {h} q·k / d": scores[h].numpy() for h in range(n_heads)}
        if family == "none":
            return offsets, {"no position signal": np.zeros(length)}
        if family == "contextual":  # CoPE: positions the content counts, none before it
            return offsets, {"counted from the content: no fixed curve": np.zeros(length)}
        positions = encoding.positions(1, length, torch.device("cpu"))  # randomized: a draw
        positions = positions if positions.dim() == 1 else positions[0]
        table = encoding.embed(torch.zeros(1, length, n_heads * head_dim), positions)[0]
        score = (table @ table[0]) / (table[0] @ table[0])
        return offsets, {"PE(m)·PE(0) / |PE(0)|²": score.numpy()}


def position_table(
    name: str, n_heads: int, head_dim: int, train_length: int, length: int
) -> np.ndarray | None:
    """What an absolute encoding adds to the token embedding at positions 0..length-1
    (a learned table as initialised); None for encodings that add nothing."""
    import torch

    encoding = _encoding(name, n_heads, head_dim, train_length)
    if REGISTRY[name].family != "absolute" or length > (encoding.max_length or length):
        return None
    with torch.no_grad():
        table = encoding.embed(torch.zeros(1, length, n_heads * head_dim), torch.arange(length))
    return table[0].float().numpy() if table.abs().sum() > 0 else None


def rope_frequencies(
    name: str, head_dim: int, train_length: int, factor: float
) -> dict[str, np.ndarray]:
    rope = _encoding(name, 1, head_dim, train_length)
    curves = {"trained (none)": rope.inv_freq.numpy()}
    length = int(factor * train_length)
    for method, scaling in SCALINGS.items():
        if scaling.needs_factor:
            scaled, label = rope.with_scaling(method, factor), f"{method} (s={factor:g})"
        else:  # its factor follows the length
            scaled, label = rope.with_scaling(method), f"{method} at {length}"
        curves[label] = scaled.angular_speeds(length).numpy()
    return curves


def _line_figure(
    x: np.ndarray,
    curves: dict[str, np.ndarray],
    x_title: str,
    y_title: str,
    log_x: bool = False,
    log_y: bool = False,
) -> go.Figure:
    figure = go.Figure()
    for name, values in curves.items():
        figure.add_trace(go.Scatter(x=x, y=values, mode="lines", name=plot_text(name)))
    figure.update_xaxes(title=plot_text(x_title), type="log" if log_x else "linear")
    figure.update_yaxes(title=plot_text(y_title), type="log" if log_y else "linear")
    figure.update_layout(height=420, margin={"l": 60, "r": 20, "t": 30, "b": 50})
    return figure


def render() -> None:
    import torch

    st.title("Explore")
    st.caption("Every encoding at its initialisation, no training needed.")
    names = list(REGISTRY)
    a, b, c, d = st.columns(4)
    name = a.selectbox(
        "Encoding",
        names,
        index=next(i for i, n in enumerate(names) if REGISTRY[n].scalable),
        key="explore_encoding",
        format_func=lambda n: f"{n} ({REGISTRY[n].family})",
    )
    n_heads = int(b.number_input("Heads", 1, 16, 8, key="explore_heads"))
    # Even sizes from 4: RoPE rotates pairs, and NTK's base^(r/(r-2)) needs r >= 4.
    head_dim = int(
        c.select_slider("Head dim", [4, 8, 16, 32, 64, 128, 256], value=64, key="explore_head_dim")
    )
    length = int(d.number_input("Length", 8, 4096, 256, key="explore_length"))
    train_length = length
    entry = REGISTRY[name]
    st.markdown(f"**{name}**: {entry.summary}  \n*{entry.reference}*")
    if entry.bounded_by_train_length:
        st.caption(f"The table has exactly {train_length} positions here (the training length).")

    st.subheader("Similarity against offset")
    offsets, curves = similarity_by_offset(name, n_heads, head_dim, train_length, length)
    y_title = "bias" if entry.family == "bias" else "score"
    st.plotly_chart(
        _line_figure(offsets, curves, "offset m - n", y_title), key="decay", width="stretch"
    )

    if entry.family == "bias":
        st.subheader("Bias matrix per head")
        head = st.slider("Head", 0, n_heads - 1, 0, key="explore_head")
        size = min(length, 256)
        with torch.no_grad():
            bias = _encoding(name, n_heads, head_dim, train_length).bias(size, size)[head]
        matrix = bias.float().numpy().copy()
        matrix[np.triu_indices(size, 1)] = np.nan  # the causal mask hides the future
        heat = go.Figure(go.Heatmap(z=matrix, colorscale="Viridis", colorbar={"title": "bias"}))
        heat.update_yaxes(autorange="reversed", title="query position")
        heat.update_xaxes(title="key position")
        heat.update_layout(height=520)
        st.plotly_chart(heat, key="bias", width="stretch")

    table = position_table(name, n_heads, head_dim, train_length, length)
    if table is not None:
        st.subheader("The table added to the token embedding")
        heat = go.Figure(go.Heatmap(z=table, colorscale="RdBu", zmid=0))
        heat.update_yaxes(autorange="reversed", title="position")
        heat.update_xaxes(title="dimension")
        heat.update_layout(height=520)
        st.plotly_chart(heat, key="table", width="stretch")

    if entry.scalable:
        st.subheader("RoPE frequencies and their inference-time scalings")
        factor = st.select_slider(
            "Scaling factor s", [1.0, 2.0, 4.0, 8.0, 16.0, 32.0], value=8.0, key="explore_factor"
        )
        frequencies = rope_frequencies(name, head_dim, train_length, factor)
        pairs = np.arange(len(next(iter(frequencies.values()))))
        st.plotly_chart(
            _line_figure(
                pairs,
                frequencies,
                "rotated pair j",
                "angular frequency (radians per position)",
                log_y=True,
            ),
            key="frequencies",
            width="stretch",
        )
        st.caption(" · ".join(f"**{n}**: {s.summary}" for n, s in SCALINGS.items()))

    render_logn(train_length)
    render_equivariance()


def logn_curve(train_length: int, longest: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions 1..longest (the keys a query sees) and log-n scaling's factor there,
    max(1, ln n / ln L) (worker.diagnostics.logn_factors, without torch)."""
    n = np.arange(1, longest + 1, dtype=np.float64)
    return n, np.maximum(1.0, np.log(n) / np.log(train_length))


def render_logn(train_length: int) -> None:
    entry = TEMPERATURES[LOGN]
    st.subheader("Log-n attention scaling (every encoding)")
    n, factors = logn_curve(train_length, 32 * train_length)
    st.plotly_chart(
        _line_figure(
            n,
            {f"{LOGN} factor, L = {train_length}": factors},
            "keys the query sees (n)",
            "factor on the attention logits",
            log_x=True,
        ),
        key="logn",
        width="stretch",
    )
    st.caption(
        markdown(
            f"{LOGN}: {entry.summary}. Formula: {entry.formula}. References: {entry.reference}. "
            f"At 8 x L the factor is {factors[8 * train_length - 1]:.3f}; a variant adds it "
            "as +logn (ntk:auto+logn) or alone (logn)."
        )
    )


@st.cache_data(max_entries=4)
def _equivariance(length: int) -> list[dict[str, float | str]]:
    from worker.probes import equivariance_table

    return equivariance_table(list(REGISTRY), length=length)


def render_equivariance() -> None:
    st.subheader("Permutation equivariance")
    st.caption(
        "Relative error ||f(Px) - P f(x)|| / ||f(x)|| of one random attention layer with "
        "each encoding, for a random input x of 16 tokens and a random permutation P "
        "(mean of 3 draws). 0 means the layer cannot see order: attention alone is a "
        "function of a set. Every position signal breaks the symmetry; so does a causal "
        "mask, which is why NoPE can still learn order in a decoder."
    )
    rows = _equivariance(16)
    st.dataframe(
        rows,
        width="stretch",
        height=36 * (len(rows) + 1),  # every encoding at once, no inner scrolling
        key="equivariance",
        hide_index=True,
        column_config={
            name: st.column_config.NumberColumn(format="%.2e")
            for name in ("bidirectional", "causal")
        },
    )
