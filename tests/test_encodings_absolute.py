"""Sinusoidal, learned and randomized positions: formulas, limits and x-transformers."""

from __future__ import annotations

import pytest
import torch
from conftest import dims
from hypothesis import given, settings
from hypothesis import strategies as st
from x_transformers.x_transformers import ScaledSinusoidalEmbedding

from worker.encodings import build
from worker.encodings.base import PositionOutOfRange
from worker.encodings.randomized import sorted_random_positions
from worker.encodings.sinusoidal import sinusoid_table


def test_sinusoidal_table_by_hand_for_d_model_4() -> None:
    # d=4: frequencies 1/10000^(0/4) = 1 and 1/10000^(2/4) = 0.01, sin/cos interleaved.
    expected = torch.tensor(
        [
            [0.0, 1.0, 0.0, 1.0],
            [0.8414710, 0.5403023, 0.0099998, 0.9999500],
            [0.9092974, -0.4161468, 0.0199987, 0.9998000],
        ]
    )
    table = sinusoid_table(torch.arange(3), d_model=4)
    torch.testing.assert_close(table, expected, atol=1e-6, rtol=0)


def test_sinusoidal_matches_x_transformers_up_to_layout_and_scale() -> None:
    d_model, length = 64, 300
    reference = ScaledSinusoidalEmbedding(d_model)
    theirs = reference(torch.zeros(1, length, d_model)) / reference.scale
    ours = sinusoid_table(torch.arange(length), d_model)
    # x-transformers concatenates [sin | cos]; the paper interleaves sin, cos.
    torch.testing.assert_close(
        torch.cat((ours[:, 0::2], ours[:, 1::2]), dim=-1), theirs, atol=1e-5, rtol=0
    )


def test_sinusoidal_is_added_to_the_token_embedding() -> None:
    encoding = build("sinusoidal", **dims())
    x = torch.randn(2, 10, 64)
    out = encoding.embed(x, torch.arange(10))
    torch.testing.assert_close(out - x, sinusoid_table(torch.arange(10), 64).expand(2, -1, -1))


def test_learned_table_has_train_length_rows_and_refuses_beyond() -> None:
    encoding = build("learned", **dims(train_length=32))
    assert encoding.table.shape == (32, 64)
    assert encoding.max_length == 32
    x = torch.zeros(1, 32, 64)
    torch.testing.assert_close(encoding.embed(x, torch.arange(32))[0], encoding.table)
    with pytest.raises(PositionOutOfRange, match=r"32 positions .*L=32.*position 32 is beyond"):
        encoding.embed(torch.zeros(1, 33, 64), torch.arange(33))
    with pytest.raises(PositionOutOfRange, match=r"training length"):
        encoding.positions(1, 33, torch.device("cpu"))


@settings(max_examples=40, deadline=None)
@given(
    batch=st.integers(1, 4),
    length=st.integers(1, 64),
    spare=st.integers(0, 200),
    seed=st.integers(0, 2**16),
)
def test_randomized_positions_are_sorted_distinct_and_in_range(
    batch: int, length: int, spare: int, seed: int
) -> None:
    torch.manual_seed(seed)
    max_position = length + spare
    positions = sorted_random_positions(batch, length, max_position, torch.device("cpu"))
    assert positions.shape == (batch, length)
    assert bool((positions[:, 1:] > positions[:, :-1]).all())  # strictly increasing
    assert int(positions.min()) >= 0 and int(positions.max()) < max_position


def test_randomized_positions_cover_the_whole_range_and_differ_per_sequence() -> None:
    encoding = build("randomized", max_position=1024, **dims(train_length=32))
    positions = encoding.positions(64, 32, torch.device("cpu"))
    assert positions.shape == (64, 32)
    assert not torch.equal(positions[0], positions[1])
    # Training at length 32 still visits positions far beyond it.
    assert int(positions.max()) > 900


@pytest.mark.parametrize("base_encoding", ["sinusoidal", "rope"])
def test_randomized_feeds_its_positions_to_the_base_encoding(base_encoding: str) -> None:
    encoding = build("randomized", base_encoding=base_encoding, **dims())
    positions = torch.tensor([[3, 17, 40], [0, 5, 1000]])
    x, q, k = torch.randn(2, 3, 64), torch.randn(2, 4, 3, 16), torch.randn(2, 4, 3, 16)
    inner = build(base_encoding, **dims())
    torch.testing.assert_close(encoding.embed(x, positions), inner.embed(x, positions))
    for row in range(2):
        ours = encoding.rotate(q[row : row + 1], k[row : row + 1], positions[row : row + 1])
        alone = inner.rotate(q[row : row + 1], k[row : row + 1], positions[row])
        torch.testing.assert_close(ours, alone)


def test_randomized_refuses_sequences_longer_than_max_position() -> None:
    encoding = build("randomized", max_position=100, **dims())
    with pytest.raises(PositionOutOfRange, match="max_length=100"):
        encoding.positions(1, 101, torch.device("cpu"))
