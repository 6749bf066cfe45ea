"""ALiBi, T5, KERPLE and FIRE: attention biases pinned to their papers and x-transformers."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import dims
from x_transformers.x_transformers import AlibiPositionalBias, Decoder, RelativePositionBias

from worker.encodings import REGISTRY, build
from worker.encodings.alibi import alibi_slopes
from worker.encodings.fire import lookup_rows
from worker.encodings.t5 import t5_bucket

BIAS_ENCODINGS = sorted(name for name, e in REGISTRY.items() if e.family == "bias")


def test_alibi_slopes_for_8_heads_are_halvings() -> None:
    assert alibi_slopes(8) == pytest.approx([2.0**-i for i in range(1, 9)])


def test_alibi_slopes_for_12_heads_follow_the_papers_rule() -> None:
    expected = [2.0**-i for i in range(1, 9)] + [0.7071, 0.3536, 0.1768, 0.0884]
    assert alibi_slopes(12) == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize("n_heads", [1, 2, 3, 4, 5, 6, 8, 12, 16, 20, 24])
def test_alibi_matches_x_transformers(n_heads: int) -> None:
    ours = build("alibi", n_heads=n_heads, head_dim=8, d_model=8 * n_heads, train_length=16)
    reference = AlibiPositionalBias(heads=n_heads)
    torch.testing.assert_close(ours.slopes, reference.slopes.flatten())
    for q_len, k_len in [(40, 40), (7, 40), (1, 33)]:
        torch.testing.assert_close(ours.bias(q_len, k_len), reference(q_len, k_len))


def test_alibi_bias_is_minus_slope_times_distance() -> None:
    ours = build("alibi", **dims(n_heads=4))  # slopes 1/4, 1/16, 1/64, 1/256
    bias = ours.bias(5, 5)
    assert float(bias[0, 4, 0]) == pytest.approx(-4 * 0.25)
    assert float(bias[1, 3, 1]) == pytest.approx(-2 / 16)
    assert float(bias[3, 2, 2]) == 0.0


def test_t5_buckets_by_hand() -> None:
    # 32 buckets, max_distance 128: exact below 16, then 16 + floor(16 log(n/16) / log 8).
    distance = torch.tensor([0, 1, 15, 16, 22, 32, 64, 127, 128, 1000, 10**6, -5])
    expected = torch.tensor([0, 1, 15, 16, 18, 21, 26, 31, 31, 31, 31, 0])
    assert torch.equal(t5_bucket(distance), expected)


def test_t5_buckets_match_x_transformers() -> None:
    distance = torch.arange(-50, 5000)
    for num_buckets, max_distance in [(32, 128), (64, 256), (16, 64)]:
        theirs = RelativePositionBias._relative_position_bucket(
            -distance, causal=True, num_buckets=num_buckets, max_distance=max_distance
        )
        assert torch.equal(t5_bucket(distance, num_buckets, max_distance), theirs)


@pytest.mark.parametrize("head_dim", [8, 16, 64])
def test_t5_bias_matches_x_transformers_at_its_default_scale(head_dim: int) -> None:
    """x-transformers' decoder makes its T5 bias with scale = sqrt(dim_head); ours defaults
    to the same, so the same table gives the same bias (and the same gradient to it)."""
    ours = build("t5", n_heads=4, head_dim=head_dim, d_model=4 * head_dim, train_length=16)
    layers = Decoder(dim=4 * head_dim, depth=1, heads=4, attn_dim_head=head_dim, rel_pos_bias=True)
    reference = layers.rel_pos
    assert isinstance(reference, RelativePositionBias)
    assert ours.scale == reference.scale == pytest.approx(math.sqrt(head_dim))
    with torch.no_grad():
        reference.relative_attention_bias.weight.copy_(ours.table)
    for q_len, k_len in [(300, 300), (10, 300)]:
        torch.testing.assert_close(ours.bias(q_len, k_len), reference(q_len, k_len))
    ours.bias(20, 20).square().sum().backward()
    reference(20, 20).square().sum().backward()
    assert reference.relative_attention_bias.weight.grad is not None
    # Summed over many pairs in another order: float32 rounding, far below any update.
    torch.testing.assert_close(
        ours.table.grad, reference.relative_attention_bias.weight.grad, rtol=1e-5, atol=1e-6
    )


def test_t5_scale_is_a_parameter_and_leaves_the_initial_bias_as_t5_sets_it() -> None:
    torch.manual_seed(0)
    plain = build("t5", num_buckets=256, max_distance=1024, scale=1.0, **dims(n_heads=16))
    torch.manual_seed(0)
    scaled = build("t5", num_buckets=256, max_distance=1024, scale=8.0, **dims(n_heads=16))
    assert (plain.scale, scaled.scale) == (1.0, 8.0)
    # Same draws: the table is the bias over the scale, the bias is the same.
    torch.testing.assert_close(scaled.table * 8.0, plain.table)
    torch.testing.assert_close(scaled.bias(50, 50), plain.bias(50, 50))
    torch.testing.assert_close(scaled.distance_bias(50), plain.distance_bias(50))
    d_model = dims(n_heads=16)["d_model"]
    assert float(plain.table.detach().std()) == pytest.approx(d_model**-0.5, rel=0.1)


def test_t5_far_distances_share_the_last_bucket() -> None:
    ours = build("t5", **dims(n_heads=4))
    bias = ours.bias(1, 2000)[:, 0]  # one query at position 1999
    torch.testing.assert_close(bias[:, 0], ours.table[31] * ours.scale)
    torch.testing.assert_close(bias[:, 1999 - 500], ours.table[31] * ours.scale)


def test_kerple_log_formula() -> None:
    kerple = build("kerple_log", **dims(n_heads=4))
    bias = kerple.bias(6, 6).detach()
    r1, r2 = kerple.r1.detach(), kerple.r2.detach()
    for h in range(4):
        for i, j in [(5, 0), (3, 1), (2, 2)]:
            expected = -r1[h] * math.log(1 + r2[h] * (i - j))
            assert float(bias[h, i, j]) == pytest.approx(float(expected), rel=1e-5, abs=1e-7)


def test_kerple_power_formula_and_bounds() -> None:
    kerple = build("kerple_power", **dims(n_heads=4))
    bias = kerple.bias(6, 6).detach()
    r1, r2 = kerple.r1.detach(), kerple.r2.detach()
    assert bool((r2 > 0).all() and (r2 <= 2).all())
    for h in range(4):
        for i, j in [(5, 0), (3, 1)]:
            assert float(bias[h, i, j]) == pytest.approx(float(-r1[h] * (i - j) ** r2[h]), rel=1e-5)
        assert float(bias[h, 2, 2]) == 0.0


@pytest.mark.parametrize(
    ("name", "r1_high", "r2_high"),
    # chijames/KERPLE: log kernel -p log(1 + a d) with p ~ U(0, 2), a ~ U(0, 1);
    # power kernel -a d^p with a ~ U(0, 1), p ~ U(0, 2).
    [("kerple_log", 2.0, 1.0), ("kerple_power", 1.0, 2.0)],
)
def test_kerple_initial_values_follow_the_reference_ranges(
    name: str, r1_high: float, r2_high: float
) -> None:
    torch.manual_seed(0)
    kerple = build(name, **dims(n_heads=512))
    for value, high in ((kerple.r1.detach(), r1_high), (kerple.r2.detach(), r2_high)):
        assert float(value.min()) > 0 and float(value.max()) <= high
        # 512 uniform draws fill their range: the largest is above 90% of it and the
        # mean is near the middle (a range half as wide would fail both).
        assert float(value.max()) > 0.9 * high
        assert float(value.mean()) == pytest.approx(high / 2, rel=0.1)


@pytest.mark.parametrize("name", ["kerple_log", "kerple_power"])
def test_kerple_parameters_stay_positive_under_adversarial_training(name: str) -> None:
    kerple = build(name, **dims(n_heads=4))
    optimizer = torch.optim.SGD(kerple.parameters(), lr=10.0)
    for _ in range(50):
        # Minimising the bias magnitude drives r1 and r2 toward zero and beyond.
        loss = kerple.bias(8, 8).abs().sum() - kerple.r2.sum() * (1 if name == "kerple_log" else -1)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        assert all(torch.isfinite(p).all() for p in kerple.parameters())
    assert bool((kerple.r1 > 0).all() and (kerple.r2 > 0).all())
    if name == "kerple_power":
        assert bool((kerple.r2 <= 2).all())


def test_kerple_power_gradient_is_finite_at_distance_zero() -> None:
    kerple = build("kerple_power", **dims(n_heads=4))
    kerple.bias(4, 4).sum().backward()
    assert torch.isfinite(kerple.raw_r2.grad).all()


def test_fire_threshold_starts_at_a_quarter_of_the_training_length() -> None:
    # The paper's code: L = 512 at its training length 2048. At any training length,
    # the last three quarters of the training positions are normalised by their own.
    assert float(build("fire", **dims(train_length=2048)).threshold.detach()) == 512.0
    fire = build("fire", **dims(train_length=128))
    assert float(fire.threshold.detach()) == 32.0
    normalized = fire.normalized_distance(128, 128).detach()
    assert float(normalized[127, 0]) == pytest.approx(1.0, rel=1e-5)  # the full range in training
    chosen = build("fire", init_threshold=100.0, **dims(train_length=128))
    assert float(chosen.threshold.detach()) == 100


def test_fire_normalised_distance_by_hand() -> None:
    fire = build("fire", init_c=1.0, init_threshold=4.0, **dims(n_heads=4))
    normalized = fire.normalized_distance(6, 6).detach()
    # psi(x) = log(x + 1); normaliser psi(max(4, i))
    assert float(normalized[5, 1]) == pytest.approx(math.log(5) / math.log(6), rel=1e-5)
    assert float(normalized[2, 0]) == pytest.approx(math.log(3) / math.log(5), rel=1e-5)
    assert float(normalized[3, 3]) == 0.0
    # Past keys map into [0, 1] at any length: interpolation, not extrapolation.
    long = fire.normalized_distance(1, 10_000).detach()
    assert float(long.max()) <= 1.0 and float(long.min()) >= 0.0


def test_fire_bias_is_its_mlp_of_the_normalised_distance() -> None:
    fire = build("fire", **dims(n_heads=4))
    normalized = fire.normalized_distance(5, 9)
    expected = fire.mlp(normalized[..., None]).permute(2, 0, 1)
    torch.testing.assert_close(fire.bias(5, 9), expected)
    assert fire.bias(5, 9).shape == (4, 5, 9)
    # c and the threshold are learned.
    fire.bias(5, 9).sum().backward()
    assert fire.c.grad is not None and fire.threshold_multiplier.grad is not None


@pytest.mark.parametrize("seed", range(4))
def test_fire_pieces_evaluate_its_mlp_exactly(seed: int) -> None:
    # Evaluation reads f off its linear pieces; they must be the MLP itself, whatever
    # the signs of the first layer's weights, with units that never bend (w = 0) and
    # knots outside [0, 1] included.
    generator = torch.Generator().manual_seed(seed)
    fire = build("fire", mlp_width=16, **dims(n_heads=4))
    with torch.no_grad():
        for parameter in fire.mlp.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 3)
        fire.mlp[0].weight[:3] = 0  # constant units, on (b > 0) or off
        fire.mlp[0].bias[0], fire.mlp[0].bias[1] = 1.0, -1.0
        knots, table = fire.pieces()
        # A knot per unit (a static shape), those that never bend at infinity, last.
        assert len(knots) == 16 and table.shape == (17, 2 * 4)
        assert knots[:13].isfinite().all() and knots[13:].isinf().all()
        bends = knots[:13]
        # Every pair of a long sequence, plus the knots themselves and points beyond.
        normalized = fire.normalized_distance(300, 700)
        probes = torch.cat((bends, bends - 1e-3, bends + 1e-3, torch.tensor([-5.0, 5.0])))
        for x in (normalized, probes[None]):
            expected = fire.mlp(x[..., None]).permute(2, 0, 1)
            torch.testing.assert_close(fire.piecewise_bias(x), expected, atol=2e-5, rtol=1e-5)
    # Training reads the pieces too: the gradient of every parameter (the MLP's, c and
    # the threshold's) is the MLP's own, in float64 to rounding.
    fire = fire.double()
    pieces = fire.bias(40, 90)
    through_mlp = fire.mlp(fire.normalized_distance(40, 90).double()[..., None]).permute(2, 0, 1)
    torch.testing.assert_close(pieces, through_mlp)
    weight = torch.randn(pieces.shape, generator=generator, dtype=torch.float64)
    ours = torch.autograd.grad((pieces * weight).sum(), list(fire.parameters()))
    theirs = torch.autograd.grad((through_mlp * weight).sum(), list(fire.parameters()))
    for name, a, b in zip(dict(fire.named_parameters()), ours, theirs, strict=True):
        torch.testing.assert_close(a, b, msg=name)


def test_fire_lookup_sums_each_rows_gradient() -> None:
    table = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    index = torch.randint(0, 7, (5, 11))
    index[0, 0] = 6  # the last row is used; row 5 may not be: its gradient is then 0
    assert torch.autograd.gradcheck(lambda t: lookup_rows(index, t), (table,))
    torch.testing.assert_close(lookup_rows(index, table), table[index])


@pytest.mark.parametrize("name", BIAS_ENCODINGS)
def test_bias_rows_for_the_last_queries_match_the_full_matrix(name: str) -> None:
    encoding = build(name, **dims(n_heads=4))
    full = encoding.bias(50, 50)
    assert full.shape == (4, 50, 50) and full.dtype == torch.float32
    torch.testing.assert_close(encoding.bias(7, 50), full[:, -7:, :])
    torch.testing.assert_close(encoding.bias(20, 30), full[:, 10:30, :30])


@pytest.mark.parametrize("name", BIAS_ENCODINGS)
def test_bias_never_favours_distant_keys_at_init_for_fixed_kernels(name: str) -> None:
    encoding = build(name, **dims(n_heads=4))
    bias = encoding.bias(1, 64)[:, 0].detach()
    assert torch.isfinite(bias).all()
    if name in ("alibi", "kerple_log", "kerple_power"):
        # Monotone kernels: the further back, the lower the bias.
        assert bool((bias[:, 1:] >= bias[:, :-1]).all())


@pytest.mark.parametrize("name", ["fire", "alibi", "kerple_log"])
def test_attending_both_ways_the_bias_is_symmetric_in_distance(name: str) -> None:
    # Only the probes attend both ways; there these encodings treat a key d positions
    # ahead like one d positions behind (FIRE had put every future key at distance 0).
    # T5 keeps x-transformers' causal buckets (future keys in bucket 0), its oracle.
    encoding = build(name, **dims(n_heads=4, train_length=16))
    with torch.no_grad():
        row = encoding.bias(16, 16)[:, 8]  # one query; FIRE normalises by its position
    for d in (1, 3, 7):
        torch.testing.assert_close(row[:, 8 - d], row[:, 8 + d])
    assert not torch.equal(row[:, 8 + 3], row[:, 8])


@pytest.mark.parametrize("name", ["alibi", "t5", "kerple_log", "kerple_power", "fire"])
@pytest.mark.parametrize(
    ("q_len", "k_len", "message"),
    [
        (2.5, 4, "q_len must be a positive integer, got 2.5"),
        (-1, 4, "q_len must be a positive integer, got -1"),
        (2, True, "k_len must be a positive integer, got True"),
        (5, 4, "q_len=5 cannot exceed k_len=4"),
    ],
)
def test_a_bias_of_a_shape_no_attention_has_is_refused(
    name: str, q_len, k_len, message: str
) -> None:
    encoding = build(name, **dims())
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        encoding.bias(q_len, k_len)
