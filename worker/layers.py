"""The layers the transformer stacks (``worker.model``), built to its dimensions
(``ModelConfig``).

A pre-norm block: LayerNorm, causal self-attention and a residual, then LayerNorm, a
GELU MLP and a residual. Attention takes q, k and v out of one fused projection
(``split_heads``: q and k rotated where the encoding has rotary tables, the gradient
written straight back into the projection's layout) and runs the kernel the model
chose for the pass (``worker.attention``: written out, SDPA, FlexAttention), with what
the encoding and the evaluation add: a bias in blocks of query rows, xPos's decay,
log-n factors, the attention probe. No layer knows which encoding it serves.

Reading order: the config, splitting the heads, attention, MLP, block.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from core.catalog.params import is_positive_int
from worker.attention import (
    MAX_BLOCK_ROWS,
    AttentionBias,
    LogitTerms,
    biased_attention,
    causal_attention,
    decayed_attention,
    reached_bias,
    written_out_causal_attention,
)
from worker.diagnostics import LayerProbe, scale_rows
from worker.encodings.rotary import RotaryTables, rotate_pairs, rotate_pairs_into, rotated
from worker.fused import Kernel, flex
from worker.reach import CAUSAL, Reach


@dataclass(frozen=True)
class ModelConfig:
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    vocab_size: int = 256  # bytes
    mlp_ratio: int = 4

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def __post_init__(self) -> None:
        for name, value in self.as_dict().items():
            if not is_positive_int(value):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class _SplitHeads(torch.autograd.Function):
    """``qkv [B, T, 3 x d_model]`` -> q, k, v ``[B, H, T, head_dim]``, q and k rotated when
    there are rotary tables. Backward writes the three gradients straight into one
    qkv-shaped tensor, where autograd's unbind would stack them and copy the stack
    back into qkv's layout (two extra passes per layer), and a rotation's gradient is
    the opposite rotation written in place (no q / k saved)."""

    @staticmethod
    def forward(ctx, qkv: Tensor, n_heads: int, tables: RotaryTables | None):  # type: ignore[override]
        batch, length, width = qkv.shape
        q, k, v = qkv.view(batch, length, 3, n_heads, width // (3 * n_heads)).permute(2, 0, 3, 1, 4)
        ctx.tables, ctx.dtype, ctx.device = tables, qkv.dtype, qkv.device
        if tables is not None:
            q = rotated(q, tables.cos_q, tables.sin_q)
            k = rotated(k, tables.cos_k, tables.sin_k)
        return q, k, v

    @staticmethod
    def backward(ctx, *grads: Tensor | None):  # type: ignore[override]
        tables: RotaryTables | None = ctx.tables
        batch, heads, length, head_dim = next(g for g in grads if g is not None).shape
        grad = torch.empty(batch, length, 3, heads, head_dim, dtype=ctx.dtype, device=ctx.device)
        parts = grad.permute(2, 0, 3, 1, 4)
        turns = (
            ((tables.cos_q, tables.sin_q), (tables.cos_k, tables.sin_k), None)
            if tables is not None
            else (None, None, None)
        )
        wide = torch.promote_types(grad.dtype, torch.float32) == grad.dtype
        for part, g, turn in zip(parts, grads, turns, strict=True):
            if g is None:
                part.zero_()
            elif turn is None:
                part.copy_(g)
            elif wide:
                rotate_pairs_into(part, g, *turn, inverse=True)
            else:
                part.copy_(rotated(g, *turn, inverse=True))
        return grad.view(batch, length, 3 * heads * head_dim), None, None


def split_heads(
    qkv: Tensor, n_heads: int, tables: RotaryTables | None
) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v ``[B, H, T, head_dim]`` out of the fused projection, q and k rotated
    (``RotaryTables`` refuses tables that need a gradient when it is built)."""
    if torch.compiler.is_compiling():
        # Plain ops under torch.compile (see rotate_pairs_traced); autograd does the rest.
        batch, length, _ = qkv.shape
        q, k, v = qkv.view(batch, length, 3, n_heads, -1).permute(2, 0, 3, 1, 4)
        if tables is None:
            return q, k, v
        return (
            rotate_pairs(q, tables.cos_q, tables.sin_q),
            rotate_pairs(k, tables.cos_k, tables.sin_k),
            v,
        )
    return _SplitHeads.apply(qkv, n_heads, tables)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.head_dim = config.head_dim
        # One fused projection for q, k and v: a single matmul instead of three.
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=False)
        self.proj = nn.Linear(config.d_model, config.d_model, bias=False)
        # Which earlier keys its queries see (worker.attention.Reach: a sliding window,
        # chunks; plain causal by default). Set by the model from its encoding.
        self.reach: Reach = CAUSAL
        # What it does to its logits beyond the bias (worker.attention.LogitTerms: Gemma
        # 2's soft cap, CoPE's contextual positions; None: nothing).
        self.terms: LogitTerms | None = None

    def forward(
        self,
        x: Tensor,
        tables: RotaryTables | None,
        attn_bias: AttentionBias | None,
        causal: bool = True,
        factors: Tensor | None = None,
        probe: LayerProbe | None = None,
        kernel: Kernel | None = None,
    ) -> Tensor:
        """Causal self-attention; ``causal=False`` (probes only) attends both ways,
        with ``attn_bias`` built non-causal to match. ``factors`` (log-n scaling) multiply
        each query's logits; ``probe`` reads the attention of sampled queries; ``kernel``
        says which implementation runs (default: sdpa, or the bias's own choice)."""
        batch, length, d_model = x.shape
        q, k, v = split_heads(self.qkv(x), self.n_heads, tables)  # each [B, H, T, head_dim]
        q = scale_rows(q, factors)
        decay = tables.decay if tables is not None else None
        if probe is not None:
            rows = attn_bias.rows if attn_bias is not None else None
            block = attn_bias.block_rows if attn_bias is not None else MAX_BLOCK_ROWS
            if decay is not None:
                block = min(block, decay.max_rows)
            probe.record(
                q,
                k,
                block_rows=block,
                bias_rows=rows,
                decay=decay,
                factors=factors,
                source=attn_bias if attn_bias is not None else tables,
                reach=self.reach,
                terms=self.terms,
            )
        written = attn_bias.written if attn_bias is not None else None
        reach = self.reach if causal else CAUSAL  # the two-way probes see every key
        eager = kernel is not None and kernel.implementation == "eager"
        terms = self.terms
        if decay is not None:
            if not causal:
                raise ValueError("xPos's decay beyond one table's span is causal only")
            y = decayed_attention(q, k, v, decay, reach, terms)
        elif kernel is not None and kernel.implementation == "flex_attention":
            mask = kernel.block_mask(reach) if causal else None
            y = flex(
                q,
                k,
                v,
                kernel.score_mod,
                mask=mask,
                causal=causal,
                reach=reach,
                tiles=kernel.tiles,
            )
        elif attn_bias is None:
            if causal:  # no bias: the fused causal kernel (flash) serves, unlimited
                y = causal_attention(q, k, v, written=eager, reach=reach, terms=terms)
            elif eager or terms is not None:
                y = written_out_causal_attention(q, k, v, causal, terms)
            else:
                y = F.scaled_dot_product_attention(q, k, v)
        elif not causal:
            y = biased_attention(q, k, v, attn_bias.full, written, terms)
        else:
            # Queries in blocks; block [s, e) only needs keys [reach.first_key(s), e).
            blocks = []
            for start in range(0, length, attn_bias.block_rows):
                end = min(length, start + attn_bias.block_rows)
                lo = reach.first_key(start)
                bias = reached_bias(attn_bias.rows(start, end), start, end, reach)
                if factors is not None:
                    bias = scale_rows(bias, factors[..., start:end])
                blocks.append(
                    biased_attention(
                        q[:, :, start:end], k[:, :, lo:end], v[:, :, lo:end], bias, written, terms
                    )
                )
            y = torch.cat(blocks, dim=2)
        y = y.transpose(1, 2).reshape(batch, length, d_model)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden = config.mlp_ratio * config.d_model
        self.up = nn.Linear(config.d_model, hidden, bias=False)
        self.down = nn.Linear(hidden, config.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(config.d_model, bias=False)
        self.attn = CausalSelfAttention(config)
        self.mlp_norm = nn.LayerNorm(config.d_model, bias=False)
        self.mlp = MLP(config)

    def forward(
        self,
        x: Tensor,
        tables: RotaryTables | None,
        attn_bias: AttentionBias | None,
        factors: Tensor | None = None,
        probe: LayerProbe | None = None,
        kernel: Kernel | None = None,
    ) -> Tensor:
        x = x + self.attn(self.attn_norm(x), tables, attn_bias, True, factors, probe, kernel)
        return x + self.mlp(self.mlp_norm(x))
