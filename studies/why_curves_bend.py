"""Do the attention diagnostics explain the extrapolation curves? (issue 34)

    python studies/why_curves_bend.py RESULTS_JSON [--markdown]

Reads a ``posbench run`` results.json of a study evaluated with ``eval.diagnostics``
(``studies/why-curves-bend.yaml``) and prints, each number the mean over seeds:

1. per encoding and variant, at each multiple k of the training length L: the
   perplexity ratio ppl(kL) / ppl(L), the entropy growth (nats) since L, the
   normalised entropy, the mass past L and the sink mass;
2. the Spearman rank correlation, across (encoding, variant, k > 1) points, between the
   perplexity ratio and each diagnostic's change since L: over the curves without
   log-n scaling, and over every curve;
3. what log-n scaling did: at each k > 1, the entropy and the perplexity with it less
   those without it, per encoding and RoPE variant.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from core.tables import markdown_rows  # noqa: E402

DIAGNOSTICS = {
    "attn_entropy": "entropy",
    "attn_entropy_norm": "norm. entropy",
    "attn_distance": "distance",
    "attn_sink_mass": "sink mass",
    "attn_beyond_mass": "mass past L",
    "attn_max_logit": "max logit",
}
LOGN = "logn"


def points(path: Path) -> tuple[pd.DataFrame, int]:
    """One row per (encoding, variant, length): the perplexity and the diagnostics,
    means over seeds; and the training length."""
    document = json.loads(path.read_text())
    train_length = int(document["spec"]["train"]["length"])
    rows = [
        {
            "encoding": run["label"],
            "variant": row["variant"],
            "seed": run["seed"],
            "length": row["length"],
            "perplexity": row["perplexity"],
            **{name: row[name] for name in DIAGNOSTICS},
        }
        for run in document["runs"]
        for row in run["evaluations"]
        if row["not_applicable"] is None and row["protocol"] == "nonoverlapping"
    ]
    frame = pd.DataFrame(rows).groupby(["encoding", "variant", "length"], as_index=False).mean()
    return frame.drop(columns="seed"), train_length


def changes(frame: pd.DataFrame, train_length: int) -> pd.DataFrame:
    """Each curve's points past L with the perplexity ratio and each diagnostic's change
    since L."""
    base = frame[frame["length"] == train_length].set_index(["encoding", "variant"])
    past = frame[frame["length"] > train_length].copy()
    key = list(zip(past["encoding"], past["variant"], strict=True))
    past["k"] = past["length"] // train_length
    past["ppl_ratio"] = past["perplexity"].to_numpy() / base.loc[key, "perplexity"].to_numpy()
    for name in DIAGNOSTICS:
        past[f"d_{name}"] = past[name].to_numpy() - base.loc[key, name].to_numpy()
    past["logn"] = past["variant"].map(lambda v: v == LOGN or v.endswith(f"+{LOGN}"))
    return past


def spearman(x: pd.Series, y: pd.Series) -> float:
    """Spearman's rank correlation: Pearson's on the ranks (ties share their mean rank)."""
    return float(x.rank().corr(y.rank()))


def correlations(past: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for subset, part in (("without logn", past[~past["logn"]]), ("every curve", past)):
        for name, label in DIAGNOSTICS.items():
            rows.append(
                {
                    "curves": subset,
                    "points": len(part),
                    "diagnostic (change since L)": label,
                    "Spearman rho with ppl(kL)/ppl(L)": spearman(
                        part[f"d_{name}"], part["ppl_ratio"]
                    ),
                }
            )
    return pd.DataFrame(rows)


def logn_effect(frame: pd.DataFrame, train_length: int) -> pd.DataFrame:
    """Per curve with a log-n twin, at each length: entropy and perplexity with log-n
    less without it."""
    rows = []
    indexed = frame.set_index(["encoding", "variant", "length"])
    for (encoding, variant, length), row in indexed.iterrows():
        if not (variant == LOGN or variant.endswith(f"+{LOGN}")):
            continue
        plain = "none" if variant == LOGN else variant.removesuffix(f"+{LOGN}")
        if (encoding, plain, length) not in indexed.index:
            continue
        other = indexed.loc[(encoding, plain, length)]

        def moved(name: str, row=row, other=other) -> str:
            return f"{other[name]:.3f} -> {row[name]:.3f}"

        rows.append(
            {
                "curve": f"{encoding} {plain}",
                "k": length // train_length,
                "entropy": moved("attn_entropy"),
                "norm. entropy": moved("attn_entropy_norm"),
                "perplexity": moved("perplexity"),
                "ppl change %": 100 * (row["perplexity"] / other["perplexity"] - 1),
            }
        )
    return pd.DataFrame(rows)


def table(past: pd.DataFrame) -> pd.DataFrame:
    columns = [
        "curve",
        "k",
        "ppl_ratio",
        "d_attn_entropy",
        "attn_entropy_norm",
        "attn_beyond_mass",
        "attn_sink_mass",
    ]
    shown = past.assign(curve=past["encoding"] + " " + past["variant"])[columns]
    return shown.rename(
        columns={
            "ppl_ratio": "ppl(kL)/ppl(L)",
            "d_attn_entropy": "entropy growth",
            "attn_entropy_norm": "norm. entropy",
            "attn_beyond_mass": "mass past L",
            "attn_sink_mass": "sink mass",
        }
    )


def markdown(frame: pd.DataFrame) -> str:
    """The frame as a markdown table, numbers at 3 decimals."""
    cells = [
        [f"{value:.3f}" if isinstance(value, float) else str(value) for value in row]
        for row in frame.itertuples(index=False)
    ]
    return markdown_rows(list(frame.columns), cells)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path)
    args = parser.parse_args()
    frame, train_length = points(args.results)
    past = changes(frame, train_length)
    for title, part in (
        (f"Curves past L = {train_length} (means over seeds)", table(past)),
        ("Rank correlation across encodings x variants x lengths", correlations(past)),
        ("log-n scaling: without -> with", logn_effect(frame, train_length)),
    ):
        print(f"\n## {title}\n")
        print(markdown(part))


if __name__ == "__main__":
    main()
