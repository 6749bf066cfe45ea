"""Decoding: the KV cache driven one token at a time, and the ``decode`` protocol.

The cache (``worker.kv_cache``) reads the tokens it is given and returns their logits;
this module chooses the tokens and keeps the logits:

- ``decode_logits``: teacher forcing - a prompt prefilled, every later token decoded
  alone with the true previous ones (tests/test_decode.py holds it to the one-pass
  forward);
- ``greedy``: generation - each step's argmax fed back as the next token;
- ``decode_scores``: the ``decode`` protocol's logits of an evaluation batch. Language
  modelling: the first half of each window is the prompt, the rest teacher-forced.
  Answers: everything before a row's answer is its prompt and the answer is generated
  greedily, the rows grouped by answer size (one cache per group); the scored targets
  must end each row.

A ``DecodeTally`` holds what the protocol measures besides its scores: the tokens
decoded one at a time and the seconds they took (the prefill is not counted; a GPU is
synchronized before the clock stops), and the most bytes of keys and values one
sequence's cache held (bfloat16 on a GPU, float32 on the CPU).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from worker.kv_cache import KVCache, new_cache, prefill, step
from worker.model import Transformer


def decode_logits(
    model: Transformer, tokens: Tensor, prompt: int, cache: KVCache | None = None, **options: object
) -> Tensor:
    """Teacher-forced logits ``[B, T, vocab]`` of ``tokens [B, T]``: the first ``prompt``
    tokens prefilled, every later one decoded alone (``options``: ``new_cache``'s)."""
    batch, length = tokens.shape
    if not 0 < prompt <= length:
        raise ValueError(f"prompt must be in [1, {length}], got {prompt!r}")
    cache = cache or new_cache(model, batch, length, **options)  # type: ignore[arg-type]
    out = [prefill(model, tokens[:, :prompt], cache)]
    out += [step(model, tokens[:, t], cache)[:, None] for t in range(prompt, length)]
    return torch.cat(out, dim=1)


def greedy(model: Transformer, prompt: Tensor, new_tokens: int, cache: KVCache) -> Tensor:
    """``[B, new_tokens]``: the argmax continuation of ``prompt [B, P]``, each chosen token
    fed back."""
    logits = prefill(model, prompt, cache)[:, -1]
    chosen = []
    for position in range(new_tokens):
        token = logits.argmax(dim=-1)
        chosen.append(token)
        if position + 1 < new_tokens:
            logits = step(model, token, cache)
    return torch.stack(chosen, dim=1)


# -- the decode protocol ---------------------------------------------------------------


@dataclass
class DecodeTally:
    """What the decode protocol measures besides its scores: tokens decoded one at a time
    and the seconds they took, and the most bytes one sequence's cache held."""

    tokens: int = 0
    seconds: float = 0.0
    kv_bytes: int = 0

    def reset(self) -> None:
        """Forget an attempt (one that ran out of memory and is retried smaller)."""
        self.tokens, self.seconds, self.kv_bytes = 0, 0.0, 0

    @property
    def tokens_per_second(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 else None


def _answer_size(scored: Tensor) -> Tensor:
    """Each row's answer size: its scored targets, which must be its last ones."""
    sizes = scored.sum(dim=1)
    count = scored.shape[1]
    tail = torch.arange(count, device=scored.device)[None, :] >= count - sizes[:, None]
    if not torch.equal(tail, scored) or bool((sizes == 0).any()):
        raise ValueError("the decode protocol generates answers: the scored targets must end a row")
    return sizes


def decode_scores(
    model: Transformer,
    inputs: Tensor,
    answers: Tensor | None,
    tally: DecodeTally,
    **options: object,
) -> Tensor:
    """Logits ``[B, T, vocab]`` for the decode protocol. Language modelling (``answers``
    None): the first half of each window is the prompt, read in one pass; every later
    input is decoded alone. Answers (``answers`` marks the scored targets, the last ones
    of each row): the rest
    is the prompt, and each answer byte is predicted from the bytes the model generated
    before it (greedy), so exact match is that of greedy generation."""
    batch, length = inputs.shape
    dtype = torch.bfloat16 if inputs.device.type == "cuda" else torch.float32
    if answers is None:
        cache = new_cache(model, batch, length, dtype=dtype, **options)  # type: ignore[arg-type]
        return _timed(model, inputs, max(1, length // 2), None, cache, tally)
    sizes = _answer_size(answers)
    out = torch.empty(batch, length, model.config.vocab_size, device=inputs.device)
    for size in sorted(set(sizes.tolist())):
        rows = (sizes == size).nonzero().flatten()
        cache = new_cache(model, len(rows), length, dtype=dtype, **options)  # type: ignore[arg-type]
        out[rows] = _timed(model, inputs[rows], length - size + 1, size, cache, tally)
    return out


def _timed(
    model: Transformer,
    inputs: Tensor,
    prompt: int,
    generated: int | None,
    cache: KVCache,
    tally: DecodeTally,
) -> Tensor:
    """Prefill ``prompt`` inputs, then step: teacher-forced through the rest of ``inputs``,
    or feeding back the argmax for ``generated`` - 1 steps."""
    logits = [prefill(model, inputs[:, :prompt], cache)]
    steps = inputs.shape[1] - prompt
    started = time.perf_counter()
    for t in range(prompt, prompt + steps):
        token = inputs[:, t] if generated is None else logits[-1][:, -1].argmax(-1)
        logits.append(step(model, token, cache)[:, None])
    _synchronize(inputs.device)
    tally.seconds += time.perf_counter() - started
    tally.tokens += steps * inputs.shape[0]
    tally.kv_bytes = max(tally.kv_bytes, cache.nbytes())
    return torch.cat(logits, dim=1)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
