"""The transformer every encoding plugs into.

A pre-norm, decoder-only, byte-level transformer. Its one variation point is the
position encoding (``worker.encodings``): everything else is fixed and boring so
that two curves differ only by how the model is told where a token sits.

Reading order: config and presets, splitting the heads, attention, MLP, block, the
model, then ``build_model``; the attention kernels (written out, SDPA, FlexAttention)
and the choice between them live in ``worker.attention``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from core.catalog.models import MODEL_PRESETS
from core.catalog.params import is_positive_int
from worker.attention import (
    MAX_BLOCK_ROWS,
    MAX_FLEX_SHAPES,
    SCORE_BUDGET,
    AttentionBias,
    Choice,
    Kernel,
    Notes,
    biased_attention,
    block_mask,
    check_implementation,
    choose,
    decayed_attention,
    fits_compiled,
    flex,
    score_mod,
    written_out_causal_attention,
)
from worker.diagnostics import AttentionProbe, LayerProbe, logn_factors, scale_rows
from worker.encodings import build
from worker.encodings.base import PositionEncoding
from worker.encodings.rotary import RotaryTables, rotate_pairs, rotate_pairs_into, rotated


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


# tiny: tests (seconds); small: CPU (minutes); base and large: one GPU.
PRESETS: dict[str, ModelConfig] = {
    name: ModelConfig(**dims) for name, dims in MODEL_PRESETS.items()
}


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
            )
        written = attn_bias.written if attn_bias is not None else None
        if decay is not None:
            if not causal:
                raise ValueError("xPos's decay beyond one table's span is causal only")
            y = decayed_attention(q, k, v, decay)
        elif kernel is not None and kernel.implementation == "flex_attention":
            y = flex(
                q, k, v, kernel.score_mod, mask=kernel.block_mask, causal=causal, tiles=kernel.tiles
            )
        elif attn_bias is None:
            if kernel is not None and kernel.implementation == "eager":
                y = written_out_causal_attention(q, k, v, causal)
            else:  # no bias: the fused causal kernel (flash) serves
                y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        elif not causal:
            y = biased_attention(q, k, v, attn_bias.full, written)
        else:
            # Queries in blocks; block [s, e) only needs keys up to e.
            blocks = []
            for start in range(0, length, attn_bias.block_rows):
                end = min(length, start + attn_bias.block_rows)
                bias = attn_bias.rows(start, end)
                if factors is not None:
                    bias = scale_rows(bias, factors[start:end])
                blocks.append(
                    biased_attention(
                        q[:, :, start:end], k[:, :, :end], v[:, :, :end], bias, written
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


class Transformer(nn.Module):
    """``forward(tokens [B, T]) -> logits [B, T, vocab]``."""

    def __init__(self, config: ModelConfig, encoding: PositionEncoding, seed: int = 0) -> None:
        super().__init__()
        if (encoding.n_heads, encoding.head_dim, encoding.d_model) != (
            config.n_heads,
            config.head_dim,
            config.d_model,
        ):
            raise ValueError("the encoding was built for a different model shape")
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.final_norm = nn.LayerNorm(config.d_model, bias=False)
        self.encoding = encoding
        # Tests lower this to exercise the query-block path on short sequences.
        self.attention_score_budget = SCORE_BUDGET
        # Log-n scaling past this length, and the attention probe (worker.diagnostics).
        self.logn_length: int | None = None
        self.probe: AttentionProbe | None = None
        # Which attention implementation to run (worker.attention), what ran in training
        # and in evaluation (a run's provenance), and the fallbacks already told.
        self.attn_implementation = "auto"
        self.attention_ran: dict[str, list[str]] = {"train": [], "eval": []}
        self.attention_notes = Notes()
        self._init_weights(seed)

    def _init_weights(self, seed: int) -> None:
        # A private generator: the model's own weights depend on the seed alone,
        # never on how many random numbers the encoding drew. Same seed, same
        # starting point for every encoding.
        generator = torch.Generator().manual_seed(seed)
        d = self.config.d_model
        # Embeddings with std d^-1/2, multiplied by sqrt(d) in forward (Vaswani
        # §3.4): tokens enter at unit RMS, the scale of the sinusoidal table, and
        # the tied output layer starts with unit-scale logits.
        self._normal(self.token_embedding.weight, d**-0.5, generator)
        # Residual projections are scaled down by depth (GPT-2) so the residual
        # stream's variance does not grow with the number of layers.
        residual_scale = (2 * self.config.n_layers) ** -0.5
        for block in self.blocks:
            for linear in (block.attn.qkv, block.mlp.up):
                self._normal(linear.weight, linear.in_features**-0.5, generator)
            for linear in (block.attn.proj, block.mlp.down):
                self._normal(linear.weight, linear.in_features**-0.5 * residual_scale, generator)

    @staticmethod
    def _normal(weight: Tensor, std: float, generator: torch.Generator) -> None:
        with torch.no_grad():
            values = torch.randn(weight.shape, generator=generator) * std
            weight.copy_(values.to(weight.device, weight.dtype))

    def forward(self, tokens: Tensor) -> Tensor:
        batch, length = tokens.shape
        positions = self.encoding.positions(batch, length, tokens.device)
        x = self.token_embedding(tokens) * math.sqrt(self.config.d_model)
        x = self.encoding.embed(x, positions)
        # Rotary tables, like the bias, are built once per pass and shared by the layers.
        tables = self.encoding.rotary_tables(positions)
        if tables is not None and tables.decay is not None:
            # Blocks of xPos's decay hold batch x heads x rows x keys scores at most.
            rows = max(1, self.attention_score_budget // (batch * self.config.n_heads * length))
            decay = replace(tables.decay, max_rows=min(tables.decay.max_rows, rows))
            tables = replace(tables, decay=decay)
        factors = None
        if self.logn_length is not None:
            factors = logn_factors(length, self.logn_length, tokens.device)
        dtype = (
            torch.get_autocast_dtype(tokens.device.type)
            if torch.is_autocast_enabled(tokens.device.type)
            else x.dtype
        )
        decaying = tables is not None and tables.decay is not None
        kernel = self.attention_kernel(batch, length, tokens.device, dtype, factors, decaying)
        attn_bias = None
        # The probe reads bias rows beside the fused kernel too.
        if self.encoding.has_bias and (
            kernel.implementation != "flex_attention" or self.probe is not None
        ):
            attn_bias = AttentionBias(
                self.encoding,
                length,
                batch,
                dtype,
                tokens.device,
                self.attention_score_budget,
                written=kernel.implementation == "eager",
            )
        for i, block in enumerate(self.blocks):
            probe = LayerProbe(self.probe, i) if self.probe is not None else None
            x = block(x, tables, attn_bias, factors, probe, kernel)
        x = self.final_norm(x)
        # Weight tying: the output layer is the token embedding (Press & Wolf 2017). In
        # float32 even under bf16 autocast: bf16 logits bias the loss (by up to 6e-4
        # nats per byte), and with 256 bytes the head is a tiny matmul.
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.float(), self.token_embedding.weight.float())

    def attention_choice(
        self, device: torch.device, decaying: bool = False, backward: bool | None = None
    ) -> Choice:
        """What ``attn_implementation`` runs as for this encoding on ``device``, with a
        backward to follow (default: whether gradients are on) or not."""
        encoding = self.encoding
        return choose(
            self.attn_implementation,
            device=device,
            has_bias=encoding.has_bias,
            fusable=encoding.fusable,
            backward=torch.is_grad_enabled() if backward is None else backward,
            learned=any(p.requires_grad for p in encoding.parameters()),
            decay=decaying,
        )

    def attention_kernel(
        self,
        batch: int,
        length: int,
        device: torch.device,
        dtype: torch.dtype,
        factors: Tensor | None = None,
        decaying: bool = False,
    ) -> Kernel:
        """This pass's attention: the implementation (recorded, its fallback told once)
        and, for flex, the encoding's bias as a score_mod built for ``length``."""
        choice = self.attention_choice(device, decaying)
        encoding = self.encoding
        compiling = torch.compiler.is_compiling()
        if choice.implementation == "flex_attention" and not compiling:
            bias_form = type(encoding).__name__ if encoding.has_bias else None
            shape = (batch, encoding.n_heads, length, encoding.head_dim, dtype, device.type)
            if not fits_compiled((*shape, bias_form, factors is not None)):
                note = f"over {MAX_FLEX_SHAPES} flex_attention shapes compiled: this one on sdpa"
                choice = Choice("sdpa", note)
        if not compiling:
            self.note_attention(choice, backward=torch.is_grad_enabled())
        if choice.implementation != "flex_attention":
            return Kernel(choice.implementation)
        if not encoding.has_bias:
            return Kernel(choice.implementation, None, block_mask(length, str(device)))
        mod = score_mod(encoding.bias_mod(length), factors)
        mask = block_mask(length, str(device))
        return Kernel(choice.implementation, mod, mask, encoding.flex_tiles)

    def note_attention(self, choice: Choice, backward: bool) -> None:
        """Record what ran (training: a pass with a backward) and tell its note once."""
        ran = self.attention_ran["train" if backward and self.training else "eval"]
        if choice.implementation not in ran:
            ran.append(choice.implementation)
        self.attention_notes.tell(choice.note)

    def attention_record(self) -> dict[str, str | None]:
        """What the provenance says: the requested implementation and what trained and
        evaluated this model (several, comma-separated, where lengths differed)."""
        return {
            "requested": self.attn_implementation,
            **{phase: ", ".join(ran) or None for phase, ran in self.attention_ran.items()},
        }

    @contextlib.contextmanager
    def scaled(
        self,
        method: str,
        factor: float | None = None,
        original_length: int | None = None,
        **params: object,
    ) -> Iterator[Transformer]:
        """Evaluate with a RoPE inference-time scaling (PI, NTK, YaRN, LongRoPE, ...) for
        the duration; ``params`` are the scaling's own (YaRN's ``beta_fast``, ...)."""
        if factor is not None and (isinstance(factor, bool) or not isinstance(factor, int | float)):
            raise ValueError(f"factor must be a number, got {factor!r}")
        if original_length is not None and not is_positive_int(original_length):
            raise ValueError(f"original_length must be a positive integer, got {original_length!r}")
        with_scaling = getattr(self.encoding, "with_scaling", None)
        if with_scaling is None:
            raise ValueError(
                f"RoPE scalings apply to rotary encodings only, not {self.encoding.name!r}"
            )
        trained = self.encoding
        self.encoding = with_scaling(method, factor, original_length, **params)
        try:
            yield self
        finally:
            self.encoding = trained

    def num_parameters(self, include_embedding: bool = True) -> int:
        total = sum(p.numel() for p in self.parameters())
        if not include_embedding:
            total -= self.token_embedding.weight.numel()
        return total

    def flops_per_token(self, length: int) -> float:
        """Training FLOPs per token: 6 x the weights of every matmul (the tied output
        layer included) plus attention scores (PaLM appendix B: 6N + 12 L d T, causal
        halving ignored as usual)."""
        cfg = self.config
        matmul = sum(
            module.weight.numel()
            for module in self.blocks.modules()
            if isinstance(module, nn.Linear)
        )
        matmul += self.token_embedding.weight.numel()
        return 6 * matmul + 12 * cfg.n_layers * cfg.d_model * length


def build_model(
    config: ModelConfig | str,
    encoding: str,
    *,
    train_length: int,
    seed: int = 0,
    attn_implementation: str = "auto",
    **encoding_params: object,
) -> Transformer:
    """A model with ``encoding``; weights the encoding does not own depend on ``seed`` only;
    ``attn_implementation`` (worker.attention) says how its attention runs."""
    check_implementation(attn_implementation)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(f"seed must be an integer in [0, 2^63), got {seed!r}")
    if isinstance(config, str):
        try:
            config = PRESETS[config]
        except KeyError:
            raise ValueError(
                f"unknown model preset {config!r} (available: {', '.join(PRESETS)})"
            ) from None
    with torch.random.fork_rng(devices=[]):
        # The encoding's own parameters get a stream of their own, derived from the seed.
        torch.manual_seed(seed + 0x5EED)
        position_encoding = build(
            encoding,
            n_heads=config.n_heads,
            head_dim=config.head_dim,
            d_model=config.d_model,
            train_length=train_length,
            **encoding_params,
        )
    model = Transformer(config, position_encoding, seed=seed)
    model.attn_implementation = attn_implementation
    return model
