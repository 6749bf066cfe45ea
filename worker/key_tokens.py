"""Key tokens (LongPPL, Fang et al. 2024): the targets that long context helps.

Every scored target of a window is scored twice by the same model under the same
variant: with its full context (what the protocol already computes) and with its
context cut to ``short_context`` tokens. The difference of the two losses is the
target's *gain* (LongPPL's log-probability gain); a target is a *key token* when its
gain exceeds ``alpha`` and, with ``beta`` given, its full-context log-probability
exceeds ``beta`` (LongPPL's second criterion: the model must also get it right).

The short-context scores come from sub-windows of exactly ``short_context`` tokens cut
from the window: the sub-window ending at ``e`` scores the targets ``[e - stride, e)``,
each with between ``short_context - stride + 1`` and ``short_context`` tokens of context
(itself included), so no short-context score reads more than ``short_context`` tokens.
A target at a position below ``short_context`` sees the same tokens either way: its gain
is 0 and it is not scored again.

Which targets are key tokens is the finder's choice. ``model`` (LongPPL's criterion): the
gain above, per run. ``repeats``: the text alone - a target that repeats what followed the
most recent earlier occurrence of its ``ngram`` preceding tokens, where that occurrence
starts before the short context does (so no short-context score can read it). The repeats
finder marks the same targets for every run, so runs are compared on one set of key
tokens, as LongPPL compares models under one evaluator; a model that cannot use context
past its training length shows it as a key-token perplexity that rises with length.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from core.spec.key_tokens import KeyTokenSpec

Forward = Callable[[torch.Tensor], torch.Tensor]


def sub_windows(
    length: int, short_context: int, stride: int, first: int = 0
) -> list[tuple[int, int, int]]:
    """``(start, begin, end)`` of each sub-window scoring the targets from ``first`` on of
    a ``length``-token window: it reads inputs ``[start, end)`` (``short_context`` of
    them) and scores targets ``[begin, end)``. Targets below ``short_context`` are left
    out (their context is already short)."""
    out = []
    begin = max(first, short_context)
    while begin < length:
        end = min(length, begin + stride)
        out.append((end - short_context, begin, end))
        begin = end
    return out


def short_context_loss(
    forward: Forward,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    short_context: int,
    stride: int,
    first: int = 0,
) -> torch.Tensor:
    """``[B, T]`` losses of ``targets`` with context cut to ``short_context`` tokens, NaN
    where not rescored (below ``short_context`` or ``first``). Sub-windows are stacked
    into batches of at most the window's own token count (the memory the caller sized
    its batches for)."""
    rows, length = inputs.shape
    loss = torch.full((rows, length), math.nan, dtype=torch.float32, device=inputs.device)
    pieces = sub_windows(length, short_context, stride, first)
    per_pass = max(1, length // short_context)
    for at in range(0, len(pieces), per_pass):
        group = pieces[at : at + per_pass]
        stacked = torch.cat([inputs[:, start:end] for start, _, end in group])
        logits = forward(stacked).float()
        for i, (start, begin, end) in enumerate(group):
            part = logits[i * rows : (i + 1) * rows, begin - start :]
            loss[:, begin:end] = F.cross_entropy(
                part.flatten(0, 1), targets[:, begin:end].flatten(), reduction="none"
            ).view(rows, end - begin)
    return loss


def repeat_keys(
    inputs: torch.Tensor, targets: torch.Tensor, short_context: int, ngram: int
) -> torch.Tensor:
    """``[B, T]`` booleans: target ``t`` continues the most recent earlier occurrence of
    ``inputs[t - ngram + 1 : t + 1]`` (the occurrence ending at ``s < t`` whose next
    target ``targets[s]`` equals ``targets[t]``), and that occurrence starts before the
    short context of ``t`` (position ``t - short_context + 1``) does."""
    rows, length = inputs.shape
    keys = np.zeros((rows, length), dtype=bool)
    if length <= ngram:
        return torch.from_numpy(keys).to(inputs.device)
    tokens = inputs.cpu().numpy().astype(np.uint64)
    after = targets.cpu().numpy()
    grams = np.lib.stride_tricks.sliding_window_view(tokens, ngram, axis=1)  # [B, T-n+1, n]
    digest = np.zeros(grams.shape[:2], dtype=np.uint64)
    with np.errstate(over="ignore"):
        for i in range(ngram):  # a polynomial hash, wrapping; equal grams are checked below
            digest = digest * np.uint64(1_000_003) + grams[:, :, i] + np.uint64(1)
    ends = np.arange(ngram - 1, length)
    for row in range(rows):
        order = np.lexsort((ends, digest[row]))  # by hash, then position
        same = digest[row][order[1:]] == digest[row][order[:-1]]
        later, earlier = order[1:][same], order[:-1][same]
        equal = (grams[row, later] == grams[row, earlier]).all(axis=1)
        later, earlier = later[equal], earlier[equal]
        t, s = ends[later], ends[earlier]
        beyond = s - ngram + 1 < t - short_context + 1
        repeats = after[row, s] == after[row, t]
        keys[row, t[beyond & repeats]] = True
    return torch.from_numpy(keys).to(inputs.device)


@dataclass
class KeyTokenTally:
    """The key-token sums of one evaluation point, batch by batch."""

    short_context: int
    stride: int
    alpha: float
    beta: float | None = None
    ngram: int | None = None  # the repeats finder's; None: the model finder
    targets: int = 0  # scored targets
    keys: int = 0
    key_loss: float = 0.0  # the key tokens' full-context loss
    gain: float = 0.0  # summed over every scored target (0 for the short ones)

    @classmethod
    def of(cls, spec: KeyTokenSpec | None, train_length: int) -> KeyTokenTally | None:
        """The tally ``eval.key_tokens`` asks for (None: none asked for)."""
        if spec is None:
            return None
        short, stride = spec.resolved(train_length)
        ngram = spec.ngram if spec.finder == "repeats" else None
        return cls(short, stride, spec.alpha, spec.beta, ngram)

    def reset(self) -> None:
        """Forget the sums (a retried attempt with smaller batches counts afresh)."""
        self.targets = self.keys = 0
        self.key_loss = self.gain = 0.0

    def add(
        self,
        forward: Forward,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        logits: torch.Tensor,
        scored: torch.Tensor | None,
    ) -> torch.Tensor:
        """Add a batch whose full-context ``logits`` are given; returns its ``[B, T]``
        gains (0 where the context is short anyway, and where not scored)."""
        if scored is None:
            scored = torch.ones_like(targets, dtype=torch.bool)
        full = F.cross_entropy(
            logits.float().flatten(0, 1), targets.flatten(), reduction="none"
        ).view_as(targets)
        gains = torch.zeros_like(full)
        columns = scored.any(0).nonzero()
        if len(columns) and targets.shape[1] > self.short_context:
            first = int(columns[0])
            short = short_context_loss(
                forward, inputs, targets, self.short_context, self.stride, first
            )
            rescored = ~short.isnan()
            gains[rescored] = short[rescored] - full[rescored]
        gains = gains * scored
        if self.ngram is not None:
            key = scored & repeat_keys(inputs, targets, self.short_context, self.ngram)
        else:
            key = scored & (gains > self.alpha)
            if self.beta is not None:
                key &= -full > self.beta  # the full-context log-probability
        self.targets += int(scored.sum())
        self.keys += int(key.sum())
        self.key_loss += float((full * key).sum(dtype=torch.float64))
        self.gain += float(gains.sum(dtype=torch.float64))
        return gains

    @property
    def fraction(self) -> float:
        return self.keys / max(1, self.targets)

    @property
    def perplexity(self) -> float | None:
        """exp of the key tokens' mean full-context loss; None without key tokens."""
        return math.exp(self.key_loss / self.keys) if self.keys else None

    @property
    def mean_gain(self) -> float:
        return self.gain / max(1, self.targets)
