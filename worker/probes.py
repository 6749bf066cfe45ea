"""Probes of the permutation argument: why position encodings exist at all.

Self-attention without a position signal is permutation-equivariant: permute
the tokens and the outputs permute the same way, f(Px) = P f(x), so the layer
cannot know order. An encoding breaks that symmetry; so does a causal mask.

``equivariance_error`` measures the symmetry on one attention layer;
``order_probe`` measures how much a trained model relies on order.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor

from worker import liveness
from worker.attention import AttentionBias, LogitTerms
from worker.data.base import Task
from worker.encodings import build
from worker.encodings.base import PositionEncoding
from worker.layers import CausalSelfAttention, ModelConfig
from worker.memory import halving_on_oom
from worker.model import Transformer


def attention_layer(
    attention: CausalSelfAttention, encoding: PositionEncoding, x: Tensor, causal: bool
) -> Tensor:
    """One attention layer with ``encoding`` applied at all three of its hooks."""
    batch, length, _ = x.shape
    positions = encoding.positions(batch, length, x.device)
    x = encoding.embed(x, positions)
    bias = None
    if encoding.has_bias:
        bias = AttentionBias(
            encoding, length, batch, x.dtype, x.device, budget=1 << 62, causal=causal
        )
    contextual = getattr(encoding, "contextual", None)  # CoPE: its first layer's table
    attention.terms = None if contextual is None else LogitTerms(contextual=partial(contextual, 0))
    return attention(x, encoding.rotary_tables(positions), bias, causal=causal)


def equivariance_error(
    encoding: PositionEncoding,
    length: int = 16,
    causal: bool = False,
    seed: int = 0,
) -> float:
    """Relative ||f(Px) - P f(x)|| / ||f(x)|| for a random layer, input and permutation.

    0 (up to rounding) means the layer cannot see order at all.
    """
    generator = torch.Generator().manual_seed(seed)
    config = ModelConfig(
        d_model=encoding.d_model, n_layers=1, n_heads=encoding.n_heads, vocab_size=1
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        attention = CausalSelfAttention(config)
    x = torch.randn(1, length, encoding.d_model, generator=generator)
    permutation = torch.randperm(length, generator=generator)
    outputs = []
    for tokens in (x, x[:, permutation]):
        # The same random draws for both passes: randomized positions must not differ
        # between them, or the probe would measure the draw instead of the order.
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            outputs.append(attention_layer(attention, encoding, tokens, causal))
    out, out_permuted = outputs
    return float((out_permuted - out[:, permutation]).norm() / out.norm())


def equivariance_table(
    names: list[str], length: int = 16, seeds: int = 3, n_heads: int = 4, head_dim: int = 16
) -> list[dict[str, float | str]]:
    """For each encoding: the mean equivariance error of one random attention layer,
    attending both ways and causally (the Explore page's table)."""

    rows = []
    for name in names:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            encoding = build(
                name,
                n_heads=n_heads,
                head_dim=head_dim,
                d_model=n_heads * head_dim,
                train_length=length,
            )
        row: dict[str, float | str] = {"encoding": name}
        for causal in (False, True):
            errors = [equivariance_error(encoding, length, causal, seed) for seed in range(seeds)]
            row["causal" if causal else "bidirectional"] = sum(errors) / seeds
        rows.append(row)
    return rows


@dataclass
class OrderProbe:
    """Loss on the second half of each window, with the first half in order and shuffled."""

    length: int
    ordered_loss: float
    shuffled_loss: float
    tokens: int

    @property
    def sensitivity(self) -> float:
        """Nats per byte the model loses when its distant context is out of order."""
        return self.shuffled_loss - self.ordered_loss

    def as_summaries(self) -> dict[str, float]:
        return {
            "order_ordered_loss": self.ordered_loss,
            "order_shuffled_loss": self.shuffled_loss,
            "order_sensitivity": self.sensitivity,
        }


def order_probe(
    model: Transformer,
    task: Task,
    length: int,
    *,
    tokens: int,
    batch_size: int,
    device: torch.device,
    seed: int = 0,
) -> OrderProbe:
    """Shuffle the first half of every evaluation window and score the second half.

    The bytes predicted and the nearest byte of context are the same in both passes;
    only the order of the distant context changes. A model that sees no order at all
    (no encoding, no causal mask) would score both alike; the difference measures how
    much of the model's use of its context depends on where things are. Like an
    evaluation, it runs under bf16 autocast on CUDA and halves its batch when out of
    memory.
    """
    return halving_on_oom(
        lambda size: _order_probe(model, task, length, tokens, size, device, seed), batch_size
    )


def _order_probe(
    model: Transformer,
    task: Task,
    length: int,
    tokens: int,
    batch_size: int,
    device: torch.device,
    seed: int,
) -> OrderProbe:
    half = length // 2
    generator = torch.Generator().manual_seed(seed)
    totals = {"ordered": 0.0, "shuffled": 0.0}
    scored = 0
    model.eval()
    batches = task.eval_batches(
        length, protocol="nonoverlapping", batch_size=batch_size, tokens=tokens, examples=1
    )
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    with torch.inference_mode(), autocast:
        for index, batch in enumerate(batches):
            inputs, targets = batch.inputs.to(device), batch.targets.to(device)
            # A permutation of the first half per window.
            order = torch.rand(inputs.shape[0], half, generator=generator).argsort(dim=-1)
            shuffled = inputs.clone()
            shuffled[:, :half] = inputs[:, :half].gather(1, order.to(device))
            for name, window in (("ordered", inputs), ("shuffled", shuffled)):
                # Both passes draw the same random positions (randomized encodings), so
                # only the order of the tokens differs between them.
                with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                    torch.manual_seed(seed + index)
                    logits = model(window)[:, half:].float()
                totals[name] += float(
                    F.cross_entropy(
                        logits.flatten(0, 1), targets[:, half:].flatten(), reduction="sum"
                    )
                )
            scored += targets[:, half:].numel()
            liveness.touch()
    return OrderProbe(length, totals["ordered"] / scored, totals["shuffled"] / scored, scored)
