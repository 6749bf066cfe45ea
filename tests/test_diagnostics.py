"""Attention diagnostics and log-n scaling (worker.diagnostics) on posbench's own models:
hand cases with known answers, the probe's written-out attention against what each
encoding's fast path computed, every number unchanged by the probe, and log-n scaling
against its formula and the decode engine."""

from __future__ import annotations

import math

import pytest
import torch

from core.catalog.encodings import REGISTRY
from core.metrics import diagnostics
from core.settings import get_settings
from core.spec import EvalSpec, VariantSpec, parse_spec
from worker.decode import decode_logits
from worker.diagnostics import (
    QUERY_BUDGET,
    QUERY_SAMPLE,
    STATS,
    AttentionProbe,
    logn_factors,
    sampled_queries,
)
from worker.evaluate import evaluate_length
from worker.model import build_model
from worker.run import prepared_task

CPU = torch.device("cpu")
STAT = {name: i for i, name in enumerate(STATS)}


def test_uniform_attention_has_entropy_log_n_and_normalised_entropy_1() -> None:
    probe = AttentionProbe(train_length=8)
    rows = torch.tensor([1, 7, 31])
    logits = torch.zeros(2, 3, 3, 32).masked_fill(
        torch.arange(32)[None, :] > rows[:, None], float("-inf")
    )
    for row in range(3):
        single = AttentionProbe(train_length=8)
        single.record(0, logits[:, :, row : row + 1], rows[row : row + 1])
        stats = single.result().per_head[0, 0]
        n = int(rows[row]) + 1
        assert float(stats[STAT["entropy"]]) == pytest.approx(math.log(n), abs=1e-6)
        assert float(stats[STAT["normalised_entropy"]]) == pytest.approx(1.0, abs=1e-6)
        assert float(stats[STAT["distance"]]) == pytest.approx((n - 1) / 2, abs=1e-5)
        assert float(stats[STAT["sink_mass"]]) == pytest.approx(min(4, n) / n, abs=1e-6)
        # distances 8..n-1 are past L = 8
        assert float(stats[STAT["beyond_mass"]]) == pytest.approx(max(0, n - 8) / n, abs=1e-6)
        assert float(stats[STAT["max_logit"]]) == 0.0
    probe.record(0, logits, rows)
    assert probe.result().queries == 2 * 3


@pytest.mark.parametrize("length", [64, 100, 256, 257, 1024])
def test_a_point_records_whole_windows_until_the_budget_is_reached(length: int) -> None:
    """docs/diagnostics.md: whole windows, from the first, until 2,048 queries are in; a
    window of fewer than 256 sampled queries can take the count past 2,048 by less than
    one window (2,079 at length 64)."""
    rows = sampled_queries(length)
    probe = AttentionProbe(train_length=16)
    while taken := probe.windows(0, batch=4, per_window=len(rows)):
        logits = torch.zeros(taken, 1, len(rows), length)
        probe.record(0, logits, rows)
    queries = probe.result().queries
    assert queries % len(rows) == 0
    assert QUERY_BUDGET <= queries < QUERY_BUDGET + len(rows)
    if len(rows) == QUERY_SAMPLE:
        assert queries == QUERY_BUDGET == 8 * QUERY_SAMPLE


def test_a_query_that_sees_only_the_first_token_has_sink_mass_1() -> None:
    probe = AttentionProbe(train_length=16)
    rows = sampled_queries(64)
    logits = torch.zeros(1, 2, len(rows), 64)
    logits[..., 0] = 80.0  # e^-80: every other key's weight is below float32's resolution
    logits = logits.masked_fill(torch.arange(64)[None, :] > rows[:, None], float("-inf"))
    probe.record(0, logits, rows)
    summary = probe.result().summary()
    assert summary["sink_mass"] == pytest.approx(1.0, abs=1e-6)
    assert summary["entropy"] == pytest.approx(0.0, abs=1e-4)
    assert summary["normalised_entropy"] == pytest.approx(0.0, abs=1e-4)
    assert summary["distance"] == pytest.approx(float(rows.double().mean()), rel=1e-5)
    assert summary["max_logit"] == 80.0


def _diagnosed(model, tokens: torch.Tensor, train_length: int):
    probe = AttentionProbe(train_length)
    model.probe = probe
    try:
        with torch.no_grad():
            logits = model(tokens)
    finally:
        model.probe = None
    return logits, probe.result()


def test_alibi_with_a_very_large_slope_attends_to_the_diagonal() -> None:
    model = build_model("tiny", "alibi", train_length=16).eval()
    model.encoding.slopes.fill_(1e4)
    _, found = _diagnosed(model, torch.randint(0, 256, (2, 64)), 16)
    summary = found.summary()
    assert summary["distance"] == pytest.approx(0.0, abs=1e-6)
    assert summary["entropy"] == pytest.approx(0.0, abs=1e-6)
    assert summary["beyond_mass"] == pytest.approx(0.0, abs=1e-9)
    # the sink holds only the queries at positions 1..3 (their diagonal is a sink token)
    sampled = sampled_queries(64)
    assert summary["sink_mass"] == pytest.approx(float((sampled < 4).double().mean()), abs=1e-6)


def _capture(model, monkeypatch):
    """Each layer's (logits, rows) as the probe wrote them out, its v and its attention
    output y before the output projection."""
    seen: dict[int, dict] = {}
    record = AttentionProbe.record

    def keep(self, layer, logits, rows, reach=None):
        seen.setdefault(layer, {"parts": []})["parts"].append((logits.clone(), rows.clone()))
        record(self, layer, logits, rows, reach)

    monkeypatch.setattr(AttentionProbe, "record", keep)
    hooks = []
    for i, block in enumerate(model.blocks):
        heads = model.config.n_heads

        def on_qkv(_module, _inputs, output, i=i, heads=heads):
            b, t, _ = output.shape
            seen.setdefault(i, {"parts": []})["v"] = output.view(b, t, 3, heads, -1)[:, :, 2]

        def on_proj(_module, inputs, i=i, heads=heads):
            b, t, _ = inputs[0].shape
            seen[i]["y"] = inputs[0].view(b, t, heads, -1)

        hooks.append(block.attn.qkv.register_forward_hook(on_qkv))
        hooks.append(block.attn.proj.register_forward_pre_hook(on_proj))
    return seen, hooks


@pytest.mark.parametrize(("logn", "window"), [(False, None), (True, None), (False, 20)])
@pytest.mark.parametrize("encoding", sorted(REGISTRY))
def test_the_written_out_attention_is_what_the_model_attended(
    encoding: str, logn: bool, window: int | None, monkeypatch
) -> None:
    """softmax(the probe's logits) @ v equals each layer's attention output at the sampled
    queries: the probe sees what the fast path (fused kernels, query blocks, xPos's block
    decay) computed, biases, scalings, log-n factors and a sliding window included."""
    length = 16 if encoding == "learned" else 96
    window = min(window, length // 2) if window is not None else None
    model = build_model("tiny", encoding, train_length=16, seed=3, window=window).eval()
    model.attention_score_budget = 2 * 4 * 96 * 24  # query blocks of 24 rows
    if encoding == "xpos":
        model.encoding.table_span = 32  # past it: the per-block decay path
    model.logn_length = 16 if logn else None
    seen, hooks = _capture(model, monkeypatch)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            _diagnosed(model, torch.randint(0, 256, (2, length)), 16)
    finally:
        for hook in hooks:
            hook.remove()
    assert len(seen) == model.config.n_layers
    for layer in seen.values():
        assert sum(len(rows) for _, rows in layer["parts"]) == len(sampled_queries(length))
        v, y = layer["v"].transpose(1, 2).float(), layer["y"].transpose(1, 2).float()
        for logits, rows in layer["parts"]:
            expected = torch.softmax(logits, -1) @ v[:, :, : logits.shape[-1]]
            torch.testing.assert_close(expected, y[:, :, rows], atol=2e-5, rtol=1e-4)


def _lm_task():
    spec = parse_spec({"model": "tiny", "train": {"length": 16}, "encodings": ["rope"]})
    return prepared_task(spec, get_settings().corpus_cache)


@pytest.mark.parametrize(
    ("encoding", "variant"),
    [(e, v) for e in ("rope", "alibi", "xpos", "fire") for v in ("none", "logn")]
    + [("rope", "ntk:auto"), ("rope", "yarn:auto+logn"), ("xpos", "pi:auto")],
)
def test_every_number_is_bit_identical_with_diagnostics_on_or_off(
    encoding: str, variant: str
) -> None:
    task = _lm_task()
    model = build_model("tiny", encoding, train_length=16, seed=1)
    rows = []
    for on in (False, True):
        spec = EvalSpec(lengths=[64], tokens=512, diagnostics=on)
        rows.append(
            evaluate_length(
                model,
                task,
                spec,
                length=64,
                protocol="nonoverlapping",
                variant=VariantSpec.model_validate(variant),
                train_length=16,
                device=CPU,
            )
        )
    off, on = rows
    for name in ("loss", "perplexity", "bits_per_byte", "tokens"):
        assert getattr(off, name) == getattr(on, name), name
    assert off.position_bins == on.position_bins
    names = [m.column for m in diagnostics()]
    assert all(getattr(off, column) is None for column in names) and off.attention is None
    assert all(math.isfinite(getattr(on, column)) for column in names)
    assert on.attention["queries"] == 512 // 64 * len(sampled_queries(64))
    layers = on.attention["layers"]
    assert set(layers) == {m.name for m in diagnostics()}
    for metric in diagnostics():
        assert len(layers[metric.name]) == model.config.n_layers
        per_layer = sum(layers[metric.name]) / model.config.n_layers
        assert per_layer == pytest.approx(getattr(on, metric.column), rel=1e-9, abs=1e-12)
        heads = on.attention["heads"][metric.name]
        assert [len(h) for h in heads] == [model.config.n_heads] * model.config.n_layers


def test_log_n_factors_follow_the_formula() -> None:
    assert logn_factors(16, 16, CPU) is None
    factors = logn_factors(100, 16, CPU)
    assert factors[:16].eq(1.0).all()  # n = position + 1 <= L
    for position in (16, 31, 63, 99):
        assert float(factors[position]) == pytest.approx(
            math.log(position + 1) / math.log(16), rel=1e-7
        )
    # A span of positions (the decode protocol's new queries): the same factors.
    assert torch.equal(logn_factors(100, 16, CPU, start=90), factors[90:])
    with pytest.raises(ValueError, match="training length >= 2"):
        logn_factors(4, 1, CPU)


@pytest.mark.parametrize("encoding", ["nope", "rope", "alibi", "t5", "xpos"])
def test_log_n_changes_nothing_up_to_the_training_length(encoding: str) -> None:
    model = build_model("tiny", encoding, train_length=32, seed=2).eval()
    tokens = torch.randint(0, 256, (2, 64))
    with torch.no_grad():
        plain = model(tokens)
        short = model(tokens[:, :32])
        model.logn_length = 32
        scaled = model(tokens)
        scaled_short = model(tokens[:, :32])
    assert torch.equal(short, scaled_short)  # n <= L everywhere: bit-identical
    torch.testing.assert_close(scaled[:, :32], plain[:, :32], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(scaled[:, 32:], plain[:, 32:], atol=1e-4)


@pytest.mark.parametrize("encoding", ["nope", "rope", "alibi", "xpos"])
def test_log_n_decoding_one_token_at_a_time_matches_the_one_pass_forward(
    encoding: str,
) -> None:
    model = build_model("tiny", encoding, train_length=16, seed=4).eval()
    model.logn_length = 16
    tokens = torch.randint(0, 256, (2, 48))
    with torch.no_grad():
        full = model(tokens)
        stepped = decode_logits(model, tokens, prompt=8)
    torch.testing.assert_close(stepped, full, atol=2e-4, rtol=2e-4)


def test_log_n_sharpens_attention_past_the_training_length() -> None:
    """The factor > 1 lowers the entropy of every query past L (a temperature below 1)
    and leaves the others' alone."""
    model = build_model("tiny", "nope", train_length=16, seed=5).eval()
    tokens = torch.randint(0, 256, (2, 128))
    _, plain = _diagnosed(model, tokens, 16)
    model.logn_length = 16
    _, scaled = _diagnosed(model, tokens, 16)
    assert scaled.summary()["entropy"] < plain.summary()["entropy"]
    assert scaled.summary()["max_logit"] > plain.summary()["max_logit"]
