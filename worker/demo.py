"""A two-minute tour of posbench on the CPU: train a tiny model with a few
encodings on the Python standard library's own source and measure perplexity
at 1x, 2x, 4x and 8x the training length."""

from __future__ import annotations

import math
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from worker.model import build_model

DEMO_ENCODINGS = ("nope", "sinusoidal", "rope", "alibi", "t5")


def stdlib_bytes(limit: int) -> torch.Tensor:
    """The first ``limit`` bytes of the interpreter's standard library sources, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= limit:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8).long()


def demo(
    steps: int = 150,
    train_length: int = 64,
    factors: tuple[int, ...] = (1, 2, 4, 8),
    encodings: tuple[str, ...] = DEMO_ENCODINGS,
    report: Callable[[str], None] = print,
) -> dict[str, dict[int, float]]:
    data = stdlib_bytes(3_000_000)
    split = int(0.9 * len(data))
    train, valid = data[:split], data[split:]
    eval_tokens = 16 * 1024
    results: dict[str, dict[int, float]] = {}
    for name in encodings:
        model = build_model("tiny", name, train_length=train_length, seed=0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        generator = torch.Generator().manual_seed(0)
        start = time.perf_counter()
        for _ in range(steps):
            offsets = torch.randint(0, len(train) - train_length - 1, (16,), generator=generator)
            batch = torch.stack([train[o : o + train_length + 1] for o in offsets])
            logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        model.eval()
        results[name] = {}
        with torch.no_grad():
            for factor in factors:
                length = factor * train_length
                windows = valid[: eval_tokens // length * length + 1]
                inputs = windows[:-1].view(-1, length)
                targets = windows[1:].view(-1, length)
                logits = model(inputs)
                loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
                results[name][factor] = math.exp(loss.item())
        curve = "  ".join(f"{f}x: {results[name][f]:7.2f}" for f in factors)
        report(f"{name:>12}  ({time.perf_counter() - start:4.1f}s)  perplexity  {curve}")
    return results
