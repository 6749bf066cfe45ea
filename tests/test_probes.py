"""Order probes: the equivariance table and the shuffled-context probe on models whose
answer is known."""

from __future__ import annotations

import torch
from torch import nn

from core.catalog.encodings import REGISTRY
from worker.data.base import Batch, Task
from worker.encodings import build
from worker.probes import equivariance_error, equivariance_table, order_probe

LENGTH = 32


class Periodic(Task):
    """Windows of a random sequence repeated with period LENGTH // 2."""

    name = "periodic"
    metric = "perplexity"

    def eval_batches(self, length, *, protocol, batch_size, tokens, examples, stride=None):
        generator = torch.Generator().manual_seed(0)
        for _ in range(tokens // (batch_size * length)):
            period = torch.randint(0, 256, (batch_size, length // 2), generator=generator)
            sequence = torch.cat([period, period, period[:, :1]], dim=1)
            yield Batch(sequence[:, :-1], sequence[:, 1:])


class BagOfPrefix(nn.Module):
    """Predicts from the mean of every byte read so far: blind to their order."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, 256)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        summed = self.embed(tokens).cumsum(dim=1)
        return summed / torch.arange(1, tokens.shape[1] + 1)[None, :, None]


class LookBack(nn.Module):
    """Predicts the byte half a window back: all of its skill is in the order."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        half = tokens.shape[1] // 2
        source = torch.roll(tokens, shifts=half - 1, dims=1)
        return 10.0 * nn.functional.one_hot(source, 256).float()


def probe(model: nn.Module):
    return order_probe(
        model, Periodic(), LENGTH, tokens=4096, batch_size=16, device=torch.device("cpu")
    )


def test_a_model_blind_to_order_is_not_moved_by_the_shuffle() -> None:
    torch.manual_seed(0)
    result = probe(BagOfPrefix())
    assert result.tokens == 4096 // 2
    assert abs(result.sensitivity) < 1e-5
    assert result.ordered_loss > 1.0  # it is a poor model, but a consistent one


def test_a_model_that_reads_order_loses_it_to_the_shuffle() -> None:
    result = probe(LookBack())
    assert result.ordered_loss < 0.02  # x[t+1] = x[t+1-half]: right with logit 10 every time
    assert result.shuffled_loss > 5.0
    assert result.as_summaries()["order_sensitivity"] == result.sensitivity > 5.0


def test_order_probe_is_deterministic_for_a_seed() -> None:
    torch.manual_seed(0)
    model = BagOfPrefix()
    task = Periodic()
    kwargs = {"tokens": 2048, "batch_size": 8, "device": torch.device("cpu")}
    first = order_probe(model, task, LENGTH, seed=3, **kwargs)
    assert first == order_probe(model, task, LENGTH, seed=3, **kwargs)


def test_equivariance_table_separates_order_blind_attention_from_the_rest() -> None:
    rows = {row["encoding"]: row for row in equivariance_table(list(REGISTRY), seeds=2)}
    assert set(rows) == set(REGISTRY)
    # No position signal, no mask: attention is a function of a set.
    assert rows["nope"]["bidirectional"] < 1e-5
    # The causal mask alone breaks the symmetry, and so does every encoding.
    assert all(row["causal"] > 0.05 for row in rows.values())
    # CoPE starts with a zero table (as its paper and x-transformers do): NoPE until it
    # learns one; with one, the counted positions break the symmetry both ways too.
    assert rows["cope"]["bidirectional"] < 1e-5
    assert all(rows[name]["bidirectional"] > 0.005 for name in set(REGISTRY) - {"nope", "cope"})
    cope = build("cope", n_heads=4, head_dim=16, d_model=64, train_length=16)
    with torch.no_grad():
        cope.pos_emb.normal_(generator=torch.Generator().manual_seed(0))
    assert equivariance_error(cope, 16, causal=False) > 0.005


class RandomPositions(nn.Module):
    """Ignores the bytes; its output depends on a random draw, as randomized positions do."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        draw = torch.rand(tokens.shape[0], tokens.shape[1], 1)
        return draw * torch.arange(256.0)


def test_both_passes_of_the_order_probe_see_the_same_random_positions() -> None:
    assert probe(RandomPositions()).sensitivity == 0.0
