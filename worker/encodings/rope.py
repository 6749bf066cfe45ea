"""Rotary position embedding (Su et al. 2021) and its inference-time scalings.

Convention: "rotate half" (GPT-NeoX, LLaMA): dimension j of the rotated part is
paired with dimension j + r/2, where r is the rotated width, and the pair is
rotated by the angle ``position * base^(-2j/r)``. With ``rotary_fraction < 1``
only the first r = fraction x head_dim dimensions rotate (GPT-NeoX, GPT-J).

Phases and the rotation itself run in float32 whatever the autocast dtype:
bf16 has 8 mantissa bits, so ``position * inv_freq`` would be wrong by whole
radians at positions in the thousands.

Inference-time scalings (PI, NTK, YaRN, LongRoPE, Llama 3.1, ...) change the
frequencies of a model trained with plain RoPE, at evaluation time only, without
retraining: ``Rope.with_scaling`` makes a scaled copy; the formulas are in
``worker/encodings/rope_scaling.py``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import Tensor

from worker.catalog.params import EncodingConfigError
from worker.catalog.scalings import ORIGINAL, scaling_info
from worker.encodings.base import PositionEncoding, check_even
from worker.encodings.rope_scaling import (
    MAX_SCALING_FACTOR,
    RopeScaling,
    rope_inv_freq,
    yarn_attention_factor,
    yarn_inv_freq,
)

__all__ = [
    "MAX_SCALING_FACTOR",
    "BlockDecay",
    "Rope",
    "RopeScaling",
    "RotaryTables",
    "rope_inv_freq",
    "rotate_pairs",
    "yarn_attention_factor",
    "yarn_inv_freq",
]


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


class Rope(PositionEncoding):
    name = "rope"

    def __init__(self, *, base: float = 10000.0, rotary_fraction: float = 1.0, **dims: int) -> None:
        super().__init__(**dims)
        rotary_dim = int(self.head_dim * rotary_fraction) // 2 * 2
        if rotary_dim < 2:
            raise EncodingConfigError(
                f"encoding {self.name!r}: rotary_fraction={rotary_fraction} of head_dim="
                f"{self.head_dim} leaves fewer than 2 dimensions to rotate"
            )
        check_even(self.name, "head_dim", self.head_dim)
        self.base = base
        self.rotary_fraction = rotary_fraction
        self.rotary_dim = rotary_dim
        self.scaling: RopeScaling | None = None
        self.register_buffer("inv_freq", rope_inv_freq(base, rotary_dim), persistent=False)

    # -- scalings ---------------------------------------------------------------------------

    def with_scaling(
        self,
        method: str,
        factor: float | None = None,
        original_length: int | None = None,
        **params: object,
    ) -> Rope:
        """A copy of this encoding with an inference-time scaling; this one is unchanged.
        ``original_length`` defaults to the training length; a scaling's own
        ``original_max_position_embeddings`` overrides it."""
        spec = scaling_info(method)
        if spec.needs_factor:
            if factor is None:
                raise EncodingConfigError(f"RoPE scaling {method!r} needs a factor (e.g. 4.0)")
            if not 1.0 <= factor <= MAX_SCALING_FACTOR:
                raise EncodingConfigError(
                    f"RoPE scaling {method!r}: factor must be in [1, {MAX_SCALING_FACTOR:g}], "
                    f"got {factor}"
                )
        elif factor is not None and factor != "auto":
            raise EncodingConfigError(
                f"RoPE scaling {method!r} takes no factor: it derives one from each length"
            )
        else:
            factor = 1.0
        owner = f"RoPE scaling {method!r}"
        resolved = spec.resolve(params, owner)
        problems = spec.width_problems(resolved, self.rotary_dim, "this model")
        if problems:
            raise EncodingConfigError(f"{owner}: {'; '.join(problems)}")
        original = resolved.get(ORIGINAL) or original_length or self.train_length
        scaled = copy.deepcopy(self)
        scaled.scaling = RopeScaling(spec.same_as or method, float(factor), int(original), resolved)
        # Always derive from the trained frequencies, never stack scalings.
        device = self.inv_freq.device
        scaled.inv_freq = scaled.scaling.inv_freq(self.base, self.rotary_dim).to(device)
        return scaled

    def frequencies(self, length: int) -> Tensor:
        """The frequencies in force for a sequence of ``length`` tokens."""
        scaling = self.scaling
        if scaling is not None and scaling.follows_length:
            inv_freq = scaling.inv_freq(self.base, self.rotary_dim, length)
            return inv_freq.to(self.inv_freq.device)
        return self.inv_freq

    def angular_speeds(self, length: int) -> Tensor:
        """The angle each pair turns per token at ``length``: the frequencies in force,
        with PI's division of positions folded in (what the Explore page draws)."""
        frequencies = self.frequencies(length)
        divisor = self.scaling.position_divisor if self.scaling is not None else None
        return frequencies if divisor is None else frequencies / divisor

    @property
    def attention_factor(self) -> float:
        """Multiplier applied to both q and k (YaRN's temperature, LongRoPE's); 1 otherwise."""
        return 1.0 if self.scaling is None else self.scaling.attention_factor

    # -- the hook ---------------------------------------------------------------------------

    def phases(self, positions: Tensor) -> Tensor:
        """``[..., T, r/2]`` float32 rotation angles of ``positions`` (``[T]`` or ``[B, T]``)."""
        inv_freq = self.inv_freq
        if self.scaling is not None and self.scaling.follows_length:
            # Only dynamic NTK and LongRoPE need the length (a host sync; a graph break
            # under compile).
            inv_freq = self.frequencies(int(positions.max()) + 1)
        pos = positions.to(torch.float32)
        divisor = self.scaling.position_divisor if self.scaling is not None else None
        if divisor is not None:
            pos = pos / divisor
        # Elementwise product, never a matmul: autocast leaves it in float32.
        return pos[..., None] * inv_freq

    def rotary_tables(self, positions: Tensor) -> RotaryTables:
        with torch.autocast(positions.device.type, enabled=False):
            angle = self.phases(positions)
            if angle.dim() == 3:
                angle = angle[:, None]
            factor = self.attention_factor
            cos, sin = angle.cos(), angle.sin()
            if factor != 1.0:
                cos, sin = cos * factor, sin * factor
            return RotaryTables(cos, sin, cos, sin)

    def extra_repr(self) -> str:
        text = f"{super().extra_repr()}, base={self.base:g}, rotary_dim={self.rotary_dim}"
        if self.scaling is not None:
            text += f", scaling={self.scaling}"
        return text
