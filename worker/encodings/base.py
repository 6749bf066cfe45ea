"""The position-encoding protocol: the three places an encoding may touch the model.

- ``embed(x, positions)``: absolute encodings add to the token embedding;
- ``rotary_tables(positions)``: RoPE-family encodings give cos / sin tables that
  rotate queries and keys (built once per forward pass, shared by every layer;
  ``rotate(q, k, positions)`` applies them);
- ``bias(q_len, k_len)``: relative encodings return an additive attention bias
  ``[heads, q_len, k_len]`` for queries that are the *last* ``q_len`` of
  ``k_len`` positions, so the model can ask for one block of query rows at a time;
  ``bias_mod(length)`` says the same bias once more as a function of (head, query,
  key) index tensors, the form a fused kernel takes (FlexAttention's ``score_mod``).

Every hook defaults to "do nothing"; a family overrides only what it needs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor, nn

from core.catalog.params import EncodingConfigError, is_positive_int, short_repr

if TYPE_CHECKING:
    from worker.encodings.rotary import RotaryTables


# (head, query, key) index tensors -> the bias of those pairs (the score_mod's addend).
BiasMod = Callable[[Tensor, Tensor, Tensor], Tensor]

# FlexAttention's tiles on a GPU for a bias that reads a table per (query, key) pair.
# PyTorch's default on an H100 / H200 (bf16, head size 64: 128 x 128 tiles, 3 stages)
# needs 240 KiB of shared memory with such a read (the limit is 227 KiB) and does not
# compile; a per-head read (ALiBi's slope) fits. Measured with benchmarks/flex_probe.py
# on an H200 (docs/performance.md, "Kernel tiles"): 64 x 64 tiles compile forward and
# backward and were the fastest tried for one read per pair; FIRE's interpolation (two
# reads and a division) ran 3.6x faster forward on 32 x 32 tiles, one stage.
ONE_READ_TILES: dict[str, int] = {
    "fwd_BLOCK_M": 64,
    "fwd_BLOCK_N": 64,
    "bwd_BLOCK_M1": 32,
    "bwd_BLOCK_N1": 64,
    "bwd_BLOCK_M2": 64,
    "bwd_BLOCK_N2": 32,
}
INTERPOLATED_TILES: dict[str, int] = {
    "fwd_BLOCK_M": 32,
    "fwd_BLOCK_N": 32,
    "num_stages": 1,
    "bwd_BLOCK_M1": 16,
    "bwd_BLOCK_N1": 32,
    "bwd_BLOCK_M2": 32,
    "bwd_BLOCK_N2": 16,
}


class PositionOutOfRange(ValueError):
    """A sequence is longer than an encoding can represent (e.g. a learned table)."""


class PositionEncoding(nn.Module):
    """Base class: the identity on every hook. ``positions`` are ``[T]`` or ``[B, T]``."""

    name: ClassVar[str] = ""
    has_bias: ClassVar[bool] = False
    # FlexAttention's kernel options on a GPU for this encoding's ``bias_mod`` (None:
    # PyTorch's defaults); what the bias reads per pair decides what fits.
    flex_tiles: ClassVar[dict[str, int] | None] = None

    def __init__(self, *, n_heads: int, head_dim: int, d_model: int, train_length: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = head_dim
        self.d_model = d_model
        self.train_length = train_length

    @property
    def max_length(self) -> int | None:
        """The longest sequence this encoding can represent; None when unbounded."""
        return None

    def positions(self, batch_size: int, length: int, device: torch.device) -> Tensor:
        """Integer positions of a batch of sequences: ``[T]`` shared, or ``[B, T]``."""
        self.check_length(length)
        return torch.arange(length, device=device)

    def check_length(self, length: int) -> None:
        limit = self.max_length
        if limit is not None and length > limit:
            raise PositionOutOfRange(
                f"encoding {self.name!r} represents positions 0..{limit - 1} only "
                f"(max_length={limit}); a sequence of {length} tokens does not fit"
            )

    def embed(self, x: Tensor, positions: Tensor) -> Tensor:
        return x

    def rotary_tables(self, positions: Tensor) -> RotaryTables | None:
        return None

    def rotate(self, q: Tensor, k: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """q and k ``[B, H, T, head_dim]`` rotated by ``rotary_tables`` (unchanged without)."""
        tables = self.rotary_tables(positions)
        return (q, k) if tables is None else tables.rotate(q, k)

    def bias(self, q_len: int, k_len: int) -> Tensor | None:
        return None

    @property
    def fusable(self) -> bool:
        """Whether the bias has a fused form (``bias_mod``)."""
        return type(self).bias_mod is not PositionEncoding.bias_mod

    def bias_mod(self, length: int, causal: bool = True) -> BiasMod | None:
        """``bias`` of a sequence of ``length`` as a function of (head, query, key) index
        tensors, evaluated inside the fused kernel: whatever it reads is built here, once
        per pass, as per-head or per-distance tensors (never 0-d; learned ones get their
        gradient through the kernel). The kernel also evaluates it above the diagonal,
        where the causal mask drops it: indices stay in range there. ``causal=False``:
        the two-way probes' bias. None: no bias, or no fused form."""
        return None

    def extra_repr(self) -> str:
        return f"n_heads={self.n_heads}, head_dim={self.head_dim}, train_length={self.train_length}"


def relative_distance(q_len: int, k_len: int, device: torch.device) -> Tensor:
    """``[q_len, k_len]`` float distances i - j for queries at the last q_len of k_len positions.

    Positive for keys in the past; the causal mask hides the negative (future) half.
    """
    for name, value in (("q_len", q_len), ("k_len", k_len)):
        if not is_positive_int(value):
            raise ValueError(f"{name} must be a positive integer, got {short_repr(value)}")
    if q_len > k_len:
        raise ValueError(f"q_len={q_len} cannot exceed k_len={k_len}")
    q_pos = torch.arange(k_len - q_len, k_len, device=device, dtype=torch.float32)
    k_pos = torch.arange(k_len, device=device, dtype=torch.float32)
    return q_pos[:, None] - k_pos[None, :]


def distance_mod(by_distance: Tensor, mirror_future: bool) -> BiasMod:
    """The bias of a Toeplitz encoding, ``by_distance[h, i - j]`` for query i and key j. A
    future key (j > i) reads distance |i - j| when ``mirror_future`` (ALiBi, KERPLE both
    ways; every causal pass, where the mask drops it: one compiled kernel serves them all)
    and 0 otherwise (T5's two-way probes put it in bucket 0)."""
    table = by_distance.contiguous()
    if mirror_future:

        def mirrored(h: Tensor, q: Tensor, k: Tensor) -> Tensor:
            return table[h, (q - k).abs()]

        return mirrored

    def past_only(h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        return table[h, (q - k).clamp(min=0)]

    return past_only


def check_even(owner: str, what: str, value: int) -> None:
    if value % 2:
        raise EncodingConfigError(f"encoding {owner!r} needs an even {what}, got {value}")


def causal_toeplitz(by_distance: Tensor, start: int, end: int) -> Tensor:
    """``[heads, end-start, end]`` with ``by_distance[h, i - j]`` at query i, key j, and
    -inf where j > i.

    Every row is a window of one line: [f(end-1), ..., f(1), f(0), -inf, ...]. Read
    with query order reversed, row ``end-1-i`` starts at offset ``end-1-i`` of that
    line, an overlapping strided view; one flip writes the matrix out. This costs
    one pass over the output, where gathering by a distance index costs several.
    """
    heads = by_distance.shape[0]
    rows = end - start
    line = torch.cat(
        (
            by_distance[:, :end].flip(-1),
            by_distance.new_full((heads, rows - 1), float("-inf")),
        ),
        dim=-1,
    )
    windows = line.as_strided((heads, rows, end), (line.stride(0), 1, 1))
    return windows.flip(1)
