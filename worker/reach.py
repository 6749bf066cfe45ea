"""Which earlier keys a layer's queries see (``Reach``): causal always, then a sliding
window (Longformer, Mistral, Gemma's local layers) and Llama 4's chunks where set. One
value that every attention path reads - the query blocks (``first_key``, ``visible``),
FlexAttention's ``mask_mod``, the KV cache (``hidden``) and the attention probe
(``keys_seen``) - so that they agree on what a layer attends to."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Reach:
    """Which earlier keys a layer's queries see. Causal always; then, where set, only the
    last ``window`` keys (itself included: Longformer's and Mistral's sliding window,
    Gemma's local layers), and only the keys in the query's own ``chunk`` of positions
    (Llama 4's chunked attention: positions [c x chunk, (c + 1) x chunk) attend among
    themselves). ``Reach()`` is plain causal attention."""

    window: int | None = None
    chunk: int | None = None

    def __post_init__(self) -> None:
        for name in ("window", "chunk"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{name} must be a positive integer (keys), got {value!r}")
            if value is not None and value < 1:
                raise ValueError(f"{name} must be a positive integer (keys), got {value!r}")

    @property
    def limited(self) -> bool:
        """Whether it hides more than the future."""
        return self.window is not None or self.chunk is not None

    def first_key(self, start: int) -> int:
        """The first key that queries from ``start`` on can see; a block of queries
        [s, e) reads keys [first_key(s), e) only."""
        first = 0
        if self.window is not None:
            first = max(first, start - self.window + 1)
        if self.chunk is not None:
            first = max(first, start // self.chunk * self.chunk)
        return first

    def hidden(self, queries: Tensor, keys: Tensor) -> Tensor:
        """True where key positions ``keys`` are hidden from query positions ``queries``
        (broadcast against each other: the future, and what the window or chunk cut)."""
        out = keys > queries
        if self.window is not None:
            out = out | (queries - keys >= self.window)
        if self.chunk is not None:
            out = out | (queries // self.chunk != keys // self.chunk)
        return out

    def visible(self, start: int, end: int, device: torch.device) -> Tensor:
        """``[end - start, end - first_key(start)]``: True where key j is visible from
        query i, for the queries [start, end) over the keys their block reads."""
        queries = torch.arange(start, end, device=device)[:, None]
        keys = torch.arange(self.first_key(start), end, device=device)[None, :]
        return ~self.hidden(queries, keys)

    def keys_seen(self, positions: Tensor) -> Tensor:
        """How many keys a query at each of ``positions`` sees."""
        seen = positions + 1
        if self.window is not None:
            seen = seen.clamp(max=self.window)
        if self.chunk is not None:
            seen = torch.minimum(seen, positions % self.chunk + 1)
        return seen

    def mask_mod(self) -> Callable[..., Tensor]:
        """The same rule as FlexAttention's ``mask_mod`` (True: attend)."""
        window, chunk = self.window, self.chunk

        def causal(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
            seen = q >= kv
            if window is not None:
                seen = seen & (q - kv < window)
            if chunk is not None:
                seen = seen & (q // chunk == kv // chunk)
            return seen

        return causal


CAUSAL = Reach()
