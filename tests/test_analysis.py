"""core.analysis on hand-checkable curves: every number here can be worked out on paper."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.analysis import (
    PAIRWISE_COLUMNS,
    SUMMARY_COLUMNS,
    bootstrap_interval,
    claim,
    effective_context_length,
    encoding_summaries,
    extrapolation_ratio,
    group_accuracy,
    log_perplexity_area,
    mean_log_perplexity,
    pairwise_table,
    run_summaries,
    seed_summary,
    summarize_run,
    summary_grid,
    summary_keys,
    summary_statistics,
    win_probability,
    with_lines,
)

TOY = {128: 5.0, 256: 6.0, 1024: 10.0}
TRAIN = 128
LENGTHS = [128, 256, 512, 1024]


# ---------------------------------------------------------------------------------------
# Per-curve summaries


def test_ratio_on_toy_curve():
    assert extrapolation_ratio(TOY, TRAIN, 2) == pytest.approx(1.2)
    assert extrapolation_ratio(TOY, TRAIN, 8) == pytest.approx(2.0)
    assert extrapolation_ratio(TOY, TRAIN, 4) is None  # 512 was not evaluated


def test_ratio_accepts_pairs_and_series_and_skips_missing_values():
    assert extrapolation_ratio(list(TOY.items()), TRAIN, 2) == pytest.approx(1.2)
    assert extrapolation_ratio(pd.Series(TOY), TRAIN, 8) == pytest.approx(2.0)
    assert extrapolation_ratio({**TOY, 512: float("nan")}, TRAIN, 4) is None
    assert extrapolation_ratio({**TOY, 128: None}, TRAIN, 2) is None
    assert extrapolation_ratio(TOY, 100, 2) is None  # training length not evaluated


def test_ratio_undefined_cases():
    assert extrapolation_ratio(TOY, TRAIN, 1.5) is None  # 192 not evaluated
    assert extrapolation_ratio({128: 0.0, 256: 0.5}, TRAIN, 2) is None  # accuracy 0 at 1x
    assert extrapolation_ratio({64: 4.0, 128: 5.0}, TRAIN, 0.5) == pytest.approx(0.8)


def test_curve_with_a_repeated_length_is_refused():
    with pytest.raises(ValueError, match="twice"):
        extrapolation_ratio([(128, 5.0), (128, 6.0)], TRAIN, 1)


def test_effective_length_is_the_contiguous_end():
    # Bound is 1.1 * 10 = 11: 256 and 512 stay within, 1024 leaves, 2048 comes back.
    curve = {64: 50.0, 128: 10.0, 256: 10.5, 512: 10.9, 1024: 12.0, 2048: 10.2}
    assert effective_context_length(curve, TRAIN, "perplexity") == 512
    assert effective_context_length(curve, TRAIN, "perplexity", tolerance=0.25) == 2048
    assert effective_context_length(curve, TRAIN, "perplexity", tolerance=0.01) == 128


def test_effective_length_is_censored_by_the_grid_and_needs_the_training_length():
    flat = {128: 10.0, 256: 10.0, 512: 10.0}
    assert effective_context_length(flat, TRAIN, "perplexity") == 512
    assert effective_context_length({256: 10.0, 512: 10.0}, TRAIN, "perplexity") is None


def test_effective_length_for_accuracy_uses_the_threshold():
    curve = {128: 0.9, 256: 0.7, 512: 0.4, 1024: 0.6}
    assert effective_context_length(curve, TRAIN, "accuracy") == 256
    assert effective_context_length(curve, TRAIN, "accuracy", accuracy_threshold=0.3) == 1024
    assert effective_context_length(curve, TRAIN, "accuracy", accuracy_threshold=0.95) is None


def test_effective_length_refuses_other_metrics():
    with pytest.raises(ValueError, match="perplexity or accuracy"):
        effective_context_length(TOY, TRAIN, "loss")


def test_area_when_log_perplexity_is_linear_in_log_length():
    # ln ppl = a + b ln L: the trapezoid rule is exact, even on an uneven grid.
    a, b = math.log(2.0), 0.5
    lengths = [128, 256, 1000, 4096]
    curve = {n: math.exp(a) * n**b for n in lengths}
    x0, x1 = math.log(128), math.log(4096)
    area = a * (x1 - x0) + b / 2 * (x1**2 - x0**2)
    assert log_perplexity_area(curve) == pytest.approx(area)
    assert mean_log_perplexity(curve) == pytest.approx(a + b * (x0 + x1) / 2)


def test_area_of_a_constant_curve():
    curve = {n: 7.0 for n in [128, 256, 512, 1024, 2048]}
    assert log_perplexity_area(curve) == pytest.approx(math.log(7.0) * math.log(2048 / 128))
    assert log_perplexity_area(curve, 256, 1024) == pytest.approx(math.log(7.0) * math.log(4))
    # Bounds between grid points: the integral spans the evaluated lengths inside them.
    assert log_perplexity_area(curve, 200, 1500) == pytest.approx(math.log(7.0) * math.log(4))
    assert mean_log_perplexity(curve, 256, 2048) == pytest.approx(math.log(7.0))


def test_area_needs_two_points():
    assert log_perplexity_area({128: 5.0}) is None
    assert mean_log_perplexity({128: 5.0, 256: float("nan")}) is None
    assert log_perplexity_area(TOY, 300, 1000) is None


def test_summarize_run_has_stable_keys():
    curve = {128: 10.0, 256: 10.5, 512: 20.0}
    summary = summarize_run(iter(curve.items()), TRAIN, "perplexity")  # read once, used 4x
    assert list(summary) == summary_keys()
    assert summary["ratio_2x"] == pytest.approx(1.05)
    assert summary["ratio_4x"] == pytest.approx(2.0)
    assert summary["ratio_8x"] is None
    assert summary["effective_length"] == 256
    assert summary["effective_length_censored"] == 0.0  # it failed at 512
    assert summary["mean_log_ppl"] == pytest.approx(summary["log_ppl_area"] / math.log(4))


def test_a_curve_cut_short_by_its_encoding_is_not_censored():
    # A learned table past its end: it did not hold at 256, whatever the grid.
    cut = summarize_run({128: 2.0, 256: None, 512: None}, TRAIN, "perplexity")
    assert cut["effective_length"] == 128 and cut["effective_length_censored"] == 0.0
    held = summarize_run({128: 2.0, 256: 2.1}, TRAIN, "perplexity")
    assert held["effective_length"] == 256 and held["effective_length_censored"] == 1.0


def test_summarize_run_leaves_inapplicable_keys_empty():
    accuracy = summarize_run({128: 0.8, 256: 0.6}, TRAIN, "accuracy", factors=(2,))
    assert accuracy == {
        "ratio_2x": pytest.approx(0.75),
        "effective_length": 256,
        "effective_length_censored": 1.0,  # 256 is the end of the grid: a lower bound
        "log_ppl_area": None,
        "mean_log_ppl": None,
        "beyond_training": pytest.approx(0.6),
    }
    loss = summarize_run({128: 2.0, 256: 3.0}, TRAIN, "loss", factors=(2,))
    assert loss["ratio_2x"] == pytest.approx(1.5)
    assert loss["effective_length"] is None and loss["beyond_training"] is None


def test_beyond_training_is_the_mean_accuracy_past_the_training_length():
    # Lengths up to the training length (64 and 128) are left out; 256, 512, 1024 count.
    curve = {64: 1.0, 128: 0.9, 256: 0.5, 512: 0.25, 1024: 0.0}
    assert summarize_run(curve, TRAIN, "accuracy")["beyond_training"] == pytest.approx(0.25)
    assert summarize_run(curve, 512, "accuracy")["beyond_training"] == pytest.approx(0.0)
    # Nothing past the training length, a length without a value, or not an answer task.
    assert summarize_run(curve, 1024, "accuracy")["beyond_training"] is None
    cut = {128: 0.9, 256: 0.5, 512: None}
    assert summarize_run(cut, TRAIN, "accuracy")["beyond_training"] is None
    assert summarize_run({128: 5.0, 256: 9.0}, TRAIN, "perplexity")["beyond_training"] is None
    # token_accuracy is measured by answer tasks but is not their headline.
    assert summarize_run(curve, TRAIN, "token_accuracy")["beyond_training"] is None


# ---------------------------------------------------------------------------------------
# Bootstrap statistics


def test_bootstrap_of_identical_values_has_zero_width():
    assert bootstrap_interval([3.0, 3.0, 3.0, 3.0]) == (3.0, 3.0, 3.0)


def test_bootstrap_of_two_values_is_their_range():
    # Resampled means are 1, 2, 3 with probability 1/4, 1/2, 1/4: the 2.5% and 97.5%
    # quantiles are the two values themselves.
    assert bootstrap_interval([1.0, 3.0]) == (2.0, 1.0, 3.0)


def test_bootstrap_interval_contains_the_mean_within_the_range():
    values = [1.0, 2.0, 3.0, 4.0, 10.0]
    mean, low, high = bootstrap_interval(values)
    assert mean == 4.0
    assert 1.0 <= low < mean < high <= 10.0
    narrower = bootstrap_interval(values, level=0.5)
    assert low <= narrower[1] <= narrower[2] <= high


def test_bootstrap_is_deterministic_in_its_seed():
    values = [1.0, 2.5, 2.0, 7.0, 3.0]
    assert bootstrap_interval(values, seed=3) == bootstrap_interval(values, seed=3)
    assert bootstrap_interval(values, seed=3) != bootstrap_interval(values, seed=4)


def test_bootstrap_edge_cases():
    assert bootstrap_interval([5.0]) == (5.0, 5.0, 5.0)
    assert all(math.isnan(v) for v in bootstrap_interval([]))
    assert all(math.isnan(v) for v in bootstrap_interval([None, float("nan")]))
    assert bootstrap_interval([1.0, float("nan"), 3.0, None]) == bootstrap_interval([1.0, 3.0])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=12), st.integers(0, 2**32 - 1))
def test_bootstrap_interval_is_ordered_and_bounded(values, seed):
    mean, low, high = bootstrap_interval(values, resamples=200, seed=seed)
    slack = 1e-9 * (1 + max(abs(v) for v in values))  # the mean itself is rounded
    assert low <= mean <= high
    assert min(values) - slack <= low and high <= max(values) + slack


def test_win_probability_when_every_a_is_better():
    a, b = [1.0, 1.5, 2.0], [3.0, 4.0, 5.0]
    assert win_probability(a, b, lower_is_better=True) == 1.0
    assert win_probability(a, b, lower_is_better=False) == 0.0


def test_win_probability_of_identical_distributions():
    assert win_probability([2.0, 2.0], [2.0, 2.0, 2.0], lower_is_better=True) == 0.5
    # Rounding must not break a tie: 0.1 + 0.2 is 0.30000000000000004 in floats.
    assert win_probability([0.3], [0.1 + 0.2], lower_is_better=True) == 0.5
    p = win_probability([1.0, 2.0, 3.0], [1.0, 2.0, 3.0], lower_is_better=True)
    assert p == pytest.approx(0.5, abs=0.05)


def test_win_probability_is_deterministic_and_drops_missing_values():
    a, b = [1.0, 2.0, 4.0], [1.5, 3.0, 3.5]
    assert win_probability(a, b, True, seed=7) == win_probability(a, b, True, seed=7)
    assert win_probability([*a, None], [*b, float("nan")], True) == win_probability(a, b, True)
    assert math.isnan(win_probability([], b, True))


# ---------------------------------------------------------------------------------------
# Frames shaped like db.queries.curves()


def ppl_alibi(seed: int, length: int) -> float:
    return 10.0 + seed  # flat: ratio 1, holds over the whole grid


def ppl_rope(seed: int, length: int) -> float:
    return (20.0 + seed) * (length / TRAIN) ** 0.5  # ratio sqrt(factor) for every seed


def curves_frame(variants: tuple[str, ...] = ("none",)) -> pd.DataFrame:
    """Three seeds of alibi, rope and learned (absolute, no positions beyond 256)."""
    rows = []
    run_id = 0
    for label, ppl in (("alibi", ppl_alibi), ("rope", ppl_rope), ("learned", ppl_alibi)):
        for seed in range(3):
            run_id += 1
            for variant in variants:
                for length in LENGTHS:
                    beyond = label == "learned" and length > 256
                    rows.append(
                        {
                            "study_id": 1,
                            "run_id": run_id,
                            "label": label,
                            "encoding": label,
                            "seed": seed,
                            "variant": variant,
                            "protocol": "nonoverlapping",
                            "eval_length": length,
                            "perplexity": math.nan if beyond else ppl(seed, length),
                            "not_applicable": "positions end at 256" if beyond else None,
                        }
                    )
    return pd.DataFrame(rows)


def test_seed_summary_mirrors_the_dashboard_columns():
    summary = seed_summary(curves_frame(), "perplexity")
    assert list(summary.columns) == SUMMARY_COLUMNS
    assert len(summary) == 4 + 4 + 2  # learned stops at 256
    assert set(summary.loc[summary["line"] == "learned", "eval_length"]) == {128, 256}
    alibi = summary[summary["line"] == "alibi"].set_index("eval_length")
    assert (alibi["mean"] == 11.0).all()  # 10, 11, 12
    assert (alibi["seeds"] == 3).all()
    assert (alibi["low"] >= 10.0).all() and (alibi["high"] <= 12.0).all()


def test_the_dashboard_summary_is_the_bootstrap_over_named_lines():
    from dashboard.curves import summarize

    frame = curves_frame(variants=("none", "yarn"))
    summary = summarize(frame, "perplexity")
    assert set(summary["line"]) == {"alibi", "alibi + yarn", "rope", "rope + yarn"} | {
        "learned",
        "learned + yarn",
    }
    means = frame.groupby(["label", "variant", "eval_length"])["perplexity"].mean()
    row = summary[(summary["line"] == "alibi + yarn") & (summary["eval_length"] == 256)].iloc[0]
    assert row["mean"] == pytest.approx(means["alibi", "yarn", 256])
    assert row["low"] <= row["mean"] <= row["high"]


def test_seed_summary_drops_missing_values_and_handles_an_empty_frame():
    frame = curves_frame()
    frame.loc[(frame["label"] == "alibi") & (frame["seed"] == 2), "perplexity"] = math.nan
    alibi = seed_summary(frame, "perplexity").query("line == 'alibi'")
    assert (alibi["seeds"] == 2).all() and (alibi["mean"] == 10.5).all()
    empty = seed_summary(frame[frame["label"] == "nobody"], "perplexity")
    assert empty.empty and list(empty.columns) == SUMMARY_COLUMNS


def test_variants_under_one_line_are_not_pooled_as_seeds():
    frame = curves_frame(variants=("none", "yarn"))
    with pytest.raises(ValueError, match="filter to one variant"):
        seed_summary(frame, "perplexity")
    frame["line"] = frame["label"] + " + " + frame["variant"]
    summary = seed_summary(frame, "perplexity", line="line")
    assert len(summary) == 2 * (4 + 4 + 2)
    assert (summary["seeds"] == 3).all()


def test_pairwise_table_shape_and_order():
    table = pairwise_table(curves_frame(), "perplexity")
    assert list(table.columns) == PAIRWISE_COLUMNS
    # alibi-rope at 4 lengths; every pair with learned only where it has values.
    assert len(table) == 4 + 2 + 2
    assert (table["a"] < table["b"]).all()
    assert not table.duplicated(["a", "b", "eval_length"]).any()
    pairs = table.groupby(["a", "b"]).size().to_dict()
    assert pairs == {("alibi", "learned"): 2, ("alibi", "rope"): 4, ("learned", "rope"): 2}
    assert (table["seeds_a"] == 3).all() and (table["seeds_b"] == 3).all()


def test_pairwise_table_values():
    table = pairwise_table(curves_frame(), "perplexity").set_index(["a", "b", "eval_length"])
    row = table.loc[("alibi", "rope", 1024)]
    assert row["mean_a"] == 11.0 and row["mean_b"] == pytest.approx(21.0 * 8**0.5)
    assert row["p_a_wins"] == 1.0  # every alibi seed beats every rope seed
    # Same seeds, same values: paired, every draw is a tie.
    assert table.loc[("alibi", "learned", 128), "p_a_wins"] == 0.5
    assert table["paired"].all()
    higher = pairwise_table(curves_frame(), "perplexity", lower_is_better=False)
    assert higher.set_index(["a", "b", "eval_length"]).loc[("alibi", "rope", 1024), "p_a_wins"] == 0


def test_pairing_by_seed_sees_a_small_consistent_gap_through_seed_noise():
    # The seed moves both encodings by far more than the gap between them; on every
    # seed "rope" is 0.1 worse. Paired, that decides every draw; unpaired it cannot.
    rows = [
        {"study_id": 1, "run_id": 10 * s + k, "label": label, "seed": s, "eval_length": 512}
        | {"perplexity": base + extra, "not_applicable": None}
        for s, base in enumerate((10.0, 20.0, 30.0, 40.0))
        for k, (label, extra) in enumerate((("alibi", 0.0), ("rope", 0.1)))
    ]
    frame = pd.DataFrame(rows)
    (row,) = pairwise_table(frame, "perplexity").to_dict("records")
    assert row["paired"] and row["p_a_wins"] == 1.0
    # Pairs are matched by seed, not by row order.
    shuffled = frame.sample(frac=1.0, random_state=3)
    assert pairwise_table(shuffled, "perplexity")["p_a_wins"].tolist() == [1.0]
    assert claim(row, 128) == "alibi beats rope at 4x with probability 1.00 (4 paired seeds)"
    # One rope seed missing (a failed run): the sides are resampled independently.
    unpaired = frame[~((frame["label"] == "rope") & (frame["seed"] == 3))]
    (row,) = pairwise_table(unpaired, "perplexity").to_dict("records")
    assert not row["paired"] and (row["seeds_a"], row["seeds_b"]) == (4, 3)
    assert 0.05 < row["p_a_wins"] < 0.95  # the seed noise leaves it undecided
    # The same seed numbers in different studies are different units.
    moved = frame.copy()
    moved.loc[(moved["label"] == "rope") & (moved["seed"] == 0), "study_id"] = 2
    assert not pairwise_table(moved, "perplexity")["paired"].any()


def test_paired_win_probability_needs_matched_values():
    assert win_probability([1.0, 2.0], [1.5, 2.5], True, paired=True) == 1.0
    with pytest.raises(ValueError, match="equal counts"):
        win_probability([1.0, 2.0], [1.5], True, paired=True)
    with pytest.raises(ValueError, match="no missing"):
        win_probability([1.0, math.nan], [1.5, 2.5], True, paired=True)


def test_pairwise_table_is_symmetric_under_renaming():
    rng = np.random.default_rng(0)
    frame = curves_frame()
    frame = frame[frame["label"] != "learned"].copy()
    frame["perplexity"] = 10 + rng.normal(0, 1, len(frame))  # overlapping seeds
    before = pairwise_table(frame, "perplexity")
    frame["label"] = frame["label"].replace({"alibi": "zeta"})  # now a = rope, b = zeta
    after = pairwise_table(frame, "perplexity")
    assert (after["a"] == "rope").all()
    assert np.allclose(after["p_a_wins"], 1 - before["p_a_wins"], atol=0.05)


def test_claim_names_the_likely_winner():
    row = {"a": "alibi", "b": "rope", "eval_length": 512, "p_a_wins": 0.97}
    assert claim(row, TRAIN) == "alibi beats rope at 4x with probability 0.97"
    row = {"a": "alibi", "b": "rope", "eval_length": 192, "p_a_wins": 0.2}
    assert claim(pd.Series(row), TRAIN) == "rope beats alibi at 1.5x with probability 0.80"


def test_run_summaries_one_row_per_run():
    runs = run_summaries(curves_frame(), "perplexity", {1: TRAIN}, factors=(2, 4))
    assert list(runs.columns) == ["line", "study_id", "run_id", "seed", *summary_keys((2, 4))]
    assert len(runs) == 9
    learned = runs[runs["line"] == "learned"]
    assert learned["ratio_4x"].isna().all()  # 512 is beyond its positions
    assert (learned["effective_length"] == 256).all()


def test_encoding_summaries_aggregate_runs_across_seeds():
    table = encoding_summaries(curves_frame(), "perplexity", {1: TRAIN}, factors=(2, 8))
    assert list(table.columns) == ["line", "study_id", "summary", "mean", "low", "high", "seeds"]
    cell = table.set_index(["line", "summary"])
    assert cell.loc[("rope", "ratio_8x"), "mean"] == pytest.approx(8**0.5)
    assert cell.loc[("rope", "ratio_8x"), "high"] - cell.loc[("rope", "ratio_8x"), "low"] < 1e-9
    assert cell.loc[("rope", "effective_length"), "mean"] == 128  # sqrt 2 > 1.1 at 256
    assert cell.loc[("alibi", "effective_length"), "mean"] == 1024  # the end of the grid
    expected = np.mean([math.log(10.0), math.log(11.0), math.log(12.0)])
    assert cell.loc[("alibi", "mean_log_ppl"), "mean"] == pytest.approx(expected)
    assert cell.loc[("alibi", "mean_log_ppl"), "seeds"] == 3
    assert ("learned", "ratio_8x") not in cell.index  # no run of it reached 1024


def test_lines_name_the_variant_and_the_study_only_when_needed():
    frame = curves_frame(variants=("none", "yarn"))
    assert set(with_lines(frame)["line"]) == {
        f"{label}{suffix}" for label in ("alibi", "rope", "learned") for suffix in ("", " + yarn")
    }
    two = pd.concat([frame, frame.assign(study_id=2)])
    assert "rope + yarn [study 2]" in set(with_lines(two)["line"])


def test_claims_without_a_common_training_length_name_the_length():
    row = {"a": "alibi", "b": "rope", "eval_length": 512, "p_a_wins": 0.2}
    assert claim(row, None) == "rope beats alibi at length 512 with probability 0.80"
    assert claim(row, 128) == "rope beats alibi at 4x with probability 0.80"
    with_seeds = {**row, "seeds_a": 5, "seeds_b": 3}
    assert claim(with_seeds, 128) == "rope beats alibi at 4x with probability 0.80 (3 vs 5 seeds)"


def test_an_infinite_value_gives_an_infinite_bound_not_nan():
    mean, low, high = bootstrap_interval([10.0, math.inf, 11.0])
    assert mean == math.inf and low == pytest.approx(10.0) and high == math.inf


def stored_summaries() -> pd.DataFrame:
    """Long rows as the run_summaries table holds them: three seeds of two lines."""
    rows = []
    for run, (line, ratio, length) in enumerate(
        [("alibi", 1.0, 1024), ("alibi", 1.1, 1024), ("alibi", 1.2, 512), *[("rope", 3.0, 256)] * 3]
    ):
        rows.append((line, 1, run, "ratio_4x", ratio))
        rows.append((line, 1, run, "effective_length", length))
        rows.append((line, 1, run, "ratio_32x", None))  # never evaluated
    return pd.DataFrame(rows, columns=["line", "study_id", "run_id", "summary", "value"])


def test_summary_statistics_bootstrap_each_summary_across_runs():
    stats = summary_statistics(stored_summaries()).set_index(["line", "summary"])
    assert ("alibi", "ratio_32x") not in stats.index  # no run defines it
    alibi = stats.loc["alibi", "ratio_4x"]
    assert alibi["mean"] == pytest.approx(1.1) and alibi["seeds"] == 3
    assert 1.0 <= alibi["low"] < 1.1 < alibi["high"] <= 1.2
    rope = stats.loc["rope", "effective_length"]
    assert (rope["mean"], rope["low"], rope["high"]) == (256, 256, 256)


def test_summary_grid_has_a_cell_per_line_and_summary_in_a_fixed_order():
    grid = summary_grid(summary_statistics(stored_summaries()))
    assert list(grid.index) == ["alibi", "rope"]
    assert list(grid.columns) == ["seeds", "ratio 4x", "effective length"]
    assert grid.loc["rope", "ratio 4x"] == "3 [3, 3]"
    # 1024, 1024 and 512: the geometric mean 2^(29/3) = 813, not 853
    assert grid.loc["alibi", "effective length"].startswith("813 [")
    single = summary_statistics(stored_summaries().query("run_id in (0, 3)"))
    assert summary_grid(single).loc["alibi", "effective length"] == "1024"
    assert summary_grid(single.iloc[:0]).empty


def test_group_accuracy_averages_each_key_over_the_others_then_over_seeds():
    groups = [
        {"variant=marked depth=0": 1.0, "variant=marked depth=1": 0.5, "variant=bare depth=0": 0.0},
        {"variant=marked depth=0": 0.5, "variant=marked depth=1": 0.5, "variant=bare depth=0": 1.0},
    ]
    frame = pd.DataFrame(
        {"line": "rope", "run_id": run, "eval_length": 256, "groups": g}
        for run, g in enumerate(groups)
    )
    table = group_accuracy(frame).set_index(["key", "value"])
    assert table.loc[("variant", "marked"), "accuracy"] == pytest.approx((0.75 + 0.5) / 2)
    assert table.loc[("variant", "bare"), "accuracy"] == pytest.approx(0.5)
    assert table.loc[("depth", "0"), "accuracy"] == pytest.approx((0.5 + 0.75) / 2)
    assert (table["seeds"] == 2).all()
    no_groups = frame.assign(groups=None)
    assert group_accuracy(no_groups).empty


def test_claims_call_a_tie_a_tie_and_give_no_probability_from_one_seed():
    tie = {"a": "rope + dynamic_ntk", "b": "rope + ntk:auto", "eval_length": 512}
    tie |= {"mean_a": 2.3313, "mean_b": 2.3313, "p_a_wins": 0.5, "seeds_a": 3, "seeds_b": 3}
    assert claim({**tie, "paired": True}, 128) == (
        "rope + dynamic_ntk and rope + ntk:auto tie at 4x: the same mean"
    )
    assert claim(tie, 128).endswith("tie at 4x: the same mean")
    one = {"a": "alibi", "b": "nope", "eval_length": 128, "mean_a": 3.0, "mean_b": 3.5}
    one |= {"p_a_wins": 1.0, "seeds_a": 1, "seeds_b": 1, "paired": True}
    assert claim(one, 128) == (
        "alibi is better than nope at 1x on the one seed each (no probability)"
    )
    # Equal means from different seeds' values still tie; close but unequal ones do not.
    frame = pd.DataFrame(
        [
            {"label": label, "study_id": 1, "seed": s, "eval_length": 512, "perplexity": value}
            | {"not_applicable": None, "run_id": 10 * s + ord(label)}
            for label, values in (("a", (10.0, 12.0)), ("b", (12.0, 10.0)), ("c", (11.0, 11.1)))
            for s, value in enumerate(values)
        ]
    )
    claims = {
        (r["a"], r["b"]): claim(r, 128)
        for r in pairwise_table(frame, "perplexity").to_dict("records")
    }
    assert claims[("a", "b")] == "a and b tie at 4x: the same mean"
    assert "beats" in claims[("a", "c")]


def test_curve_plots_give_every_encoding_its_own_colour_and_seeds_a_band(tmp_path):
    from cli.render.report import _palette, plot_curves, seed_bands

    for count in (3, 10, 11, 20):
        assert len(set(_palette(count))) == count
    values = {"rope": {32: [10.0, 12.0, 11.0], 64: [20.0]}, "alibi": {32: [9.0], 64: [9.5]}}
    bands = seed_bands(values)
    assert list(bands) == ["rope"] and list(bands["rope"]) == [32]  # one seed: no band
    low, high = bands["rope"][32]
    assert 10.0 <= low < 11.0 < high <= 12.0
    curves = {
        label: {n: sum(v) / len(v) for n, v in points.items()} for label, points in values.items()
    }
    path = plot_curves(curves, "perplexity", 32, tmp_path / "c.png", "t", bands)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_effective_length_is_averaged_on_the_log_scale_of_its_grid():
    summaries = pd.DataFrame(
        [
            {"line": "rope", "study_id": 1, "summary": name, "value": value}
            for name, values in (("effective_length", (128, 512)), ("ratio_2x", (1.0, 2.0)))
            for value in values
        ]
    )
    table = summary_statistics(summaries).set_index("summary")
    assert table.loc["effective_length", "mean"] == pytest.approx(256)  # not 320
    assert table.loc["effective_length", ["low", "high"]].tolist() == pytest.approx([128, 512])
    assert table.loc["ratio_2x", "mean"] == pytest.approx(1.5)  # other summaries: arithmetic
