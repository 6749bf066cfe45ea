"""Rotary tables and the rotation of query and key pairs by them: what every rotary
encoding (RoPE and its scalings, xPos, randomized positions) and a Hugging Face model's
rotary layer apply, below the encodings' base class (``worker.encodings.base`` names
``RotaryTables`` as a rotary encoding's product, so it cannot live beside ``Rope``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class RotaryTables:
    """Half-width float32 cos and sin tables for queries and keys, ``[T, r/2]`` for shared
    positions or ``[B, 1, T, r/2]`` for per-sequence ones (broadcast against
    ``[B, H, T, r/2]``). Pair j of a head is (j, j + r/2); RoPE uses one table for
    both q and k, xPos scales the query's up and the key's down."""

    cos_q: Tensor
    sin_q: Tensor
    cos_k: Tensor
    sin_k: Tensor
    # xPos over more positions than one float32 table can scale: the tables are plain
    # rotations and attention applies this decay one block of queries at a time.
    decay: BlockDecay | None = None

    def __post_init__(self) -> None:
        _check_no_gradient(self.cos_q, self.sin_q, self.cos_k, self.sin_k)

    def rotate(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        if self.decay is not None:
            raise ValueError(
                f"xPos over {self.decay.positions.shape[-1]} positions has no float32 q and k "
                "for the whole sequence; attention applies its decay block by block"
            )
        return rotate_pairs(q, self.cos_q, self.sin_q), rotate_pairs(k, self.cos_k, self.sin_k)


@dataclass(frozen=True)
class BlockDecay:
    """xPos's decay zeta_j^((n - m) / scale_base) for query n and key m, applied per block
    of queries: the queries [s, e) are scaled by zeta^((n - c) / scale_base) and the keys
    [0, e) by zeta^((c - m) / scale_base), centred on the block's last query c. Both
    exponents stay small for the queries; the keys' only shrink with distance (far keys
    underflow to 0, where the exact product is below float32's resolution anyway), so
    no length overflows, where one table for the whole sequence overflows float32 past
    about 141 x scale_base positions."""

    zeta: Tensor  # [r/2]
    scale_base: float
    positions: Tensor  # [T] or [B, T]
    max_rows: int  # queries per block, so that zeta^(-rows / scale_base) stays in range

    def scales(self, start: int, end: int) -> tuple[Tensor, Tensor]:
        """Float32 per-pair scales: queries ``[..., end-start, r/2]``, keys ``[..., end, r/2]``
        (with a heads axis for per-sequence positions)."""
        pos = self.positions.to(torch.float32)
        centre = pos[..., end - 1 : end]
        return (
            decay_scale(self.zeta, pos[..., start:end] - centre, self.scale_base),
            decay_scale(self.zeta, centre - pos[..., :end], self.scale_base),
        )


def decay_scale(zeta: Tensor, offsets: Tensor, scale_base: float) -> Tensor:
    """xPos's per-pair scale zeta^(offset / scale_base), ``[..., T, r/2]`` for offsets
    ``[T]``, or ``[B, 1, T, r/2]`` (a heads axis) for per-sequence offsets ``[B, T]``."""
    scale = zeta ** (offsets / scale_base)[..., None]
    return scale[:, None] if scale.dim() == 3 else scale


def scale_pairs(x: Tensor, scale: Tensor) -> Tensor:
    """x with both members of rotated pair j multiplied by ``scale[..., j]`` (computed in
    float32, rounded once); dimensions past the rotated ones unchanged."""
    half = scale.shape[-1]
    out = x.to(torch.promote_types(x.dtype, torch.float32), copy=True)
    out[..., :half] *= scale
    out[..., half : 2 * half] *= scale
    return out.to(x.dtype)


def _check_no_gradient(*tables: Tensor) -> None:
    # The custom backward passes return no gradient for the tables.
    if any(table.requires_grad for table in tables):
        raise ValueError("rotary tables are functions of positions; they take no gradient")


def rotate_pairs_into(
    out: Tensor, x: Tensor, cos: Tensor, sin: Tensor, inverse: bool = False
) -> Tensor:
    """Write x with pair (x1, x2) turned to (x1 cos - x2 sin, x2 cos + x1 sin) into ``out``
    (any strides, float32 or wider); dimensions past the tables' 2 x width pass through.
    ``inverse`` turns by the opposite angle: the transpose, which is the backward pass.

    Four passes over half the width, against the six full-width ops (and their six
    backward ops) of ``x * cos + rotate_half(x) * sin``."""
    half = cos.shape[-1]
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    o1, o2 = out[..., :half], out[..., half : 2 * half]
    turn = 1.0 if inverse else -1.0
    torch.mul(x1, cos, out=o1).addcmul_(x2, sin, value=turn)
    torch.mul(x2, cos, out=o2).addcmul_(x1, sin, value=-turn)
    if out.shape[-1] > 2 * half:
        out[..., 2 * half :] = x[..., 2 * half :]
    return out


def rotated(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool = False) -> Tensor:
    """A new tensor: x rotated in float32 (bf16 would be wrong at long positions), then
    back to x's dtype."""
    wide = torch.promote_types(x.dtype, torch.float32)
    out = rotate_pairs_into(torch.empty(x.shape, dtype=wide, device=x.device), x, cos, sin, inverse)
    return out.to(x.dtype)


class _RotatePairs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:  # type: ignore[override]
        ctx.tables = (cos, sin)
        return rotated(x, cos, sin)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        cos, sin = ctx.tables
        return rotated(grad, cos, sin, inverse=True), None, None


def rotate_pairs_traced(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The same rotation in out-of-place ops, for torch.compile: Dynamo cannot trace
    ``out=`` into strided views, and Inductor fuses these ops into one kernel itself."""
    half = cos.shape[-1]
    x1, x2 = x[..., :half].float(), x[..., half : 2 * half].float()
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
    return out if x.shape[-1] == 2 * half else torch.cat((out, x[..., 2 * half :]), dim=-1)


def rotate_pairs(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE's rotation of ``x [..., T, head_dim]`` by half-width tables (a rotation is
    linear, so the backward pass is the opposite rotation: no saved activations)."""
    _check_no_gradient(cos, sin)
    if torch.compiler.is_compiling():
        return rotate_pairs_traced(x, cos, sin)
    return _RotatePairs.apply(x, cos, sin)
