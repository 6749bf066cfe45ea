"""The transformer every encoding plugs into.

A pre-norm, decoder-only, byte-level transformer. Its one variation point is the
position encoding (``worker.encodings``): everything else is fixed and boring so
that two curves differ only by how the model is told where a token sits.

Reading order: the presets, the model (its weights, its forward pass, which attention
kernel each pass runs, RoPE scalings at evaluation, its size), then ``build_model``.
The layers it stacks (the config, attention, MLP, block) live in ``worker.layers``;
the attention kernels (written out, SDPA, FlexAttention) and the choice between them
in ``worker.attention``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import replace
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from core.catalog.encodings import WINDOW
from core.catalog.models import MODEL_PRESETS
from core.catalog.params import is_positive_int
from worker.attention import (
    SCORE_BUDGET,
    AttentionBias,
    Choice,
    LogitTerms,
    Notes,
    check_implementation,
    choose,
)
from worker.diagnostics import AttentionProbe, LayerProbe, logn_factors
from worker.encodings import build, info
from worker.encodings.base import PositionEncoding
from worker.encodings.layered import Layered
from worker.fused import MAX_FLEX_SHAPES, Kernel, block_mask, fits_compiled, score_mod
from worker.layers import Block, ModelConfig
from worker.reach import Reach

# tiny: tests (seconds); small: CPU (minutes); base and large: one GPU.
PRESETS: dict[str, ModelConfig] = {
    name: ModelConfig(**dims) for name, dims in MODEL_PRESETS.items()
}


class Transformer(nn.Module):
    """``forward(tokens [B, T]) -> logits [B, T, vocab]``."""

    def __init__(
        self,
        config: ModelConfig,
        encoding: PositionEncoding,
        seed: int = 0,
        window: int | None = None,
        attn_softcap: float | None = None,
    ) -> None:
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
        # Which kind of layer each one is (a recipe's kinds; one kind otherwise) and what
        # its attention sees: the kind's reach, and the model's window where it has none.
        self.layer_kinds = (
            encoding.layer_kinds(config.n_layers)
            if isinstance(encoding, Layered)
            else [0] * config.n_layers
        )
        bind = getattr(encoding, "bind_layers", None)
        if bind is not None:  # parameters per layer (SSMax's s, FoPE's, CoPE's)
            bind(config.n_layers)
        contextual = getattr(encoding, "contextual", None)  # CoPE: a term of the scores
        for layer, (block, kind) in enumerate(zip(self.blocks, self.layer_kinds, strict=True)):
            reach = encoding.reach(kind) if isinstance(encoding, Layered) else Reach()
            if window is not None and reach.window is None:
                reach = replace(reach, window=window)
            block.attn.reach = reach
            term = None if contextual is None else partial(contextual, layer)
            if attn_softcap is not None or term is not None:
                block.attn.terms = LogitTerms(attn_softcap, term)
        self.attn_softcap = attn_softcap
        self.contextual = contextual is not None
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

    @property
    def kinds(self) -> list[PositionEncoding]:
        """The encoding of each kind of layer (``layer_kinds`` indexes it): a recipe's
        kinds, or the one encoding. Read at each pass: a scaling swaps the encoding."""
        encoding = self.encoding
        return list(encoding.kinds) if isinstance(encoding, Layered) else [encoding]

    def kind_factors(self, kind: int, positions: Tensor, factors: Tensor | None) -> Tensor | None:
        """What multiplies the queries of layers of ``kind`` at ``positions [T]``: the
        log-n ``factors`` and a recipe's own (Llama 4's temperature), or None."""
        encoding = self.encoding
        own = encoding.query_factors(kind, positions) if isinstance(encoding, Layered) else None
        if own is None:
            return factors
        return own if factors is None else own * factors

    def layer_factors(self, layer: int, positions: Tensor, factors: Tensor | None) -> Tensor | None:
        """A layer's query factors: its kind's (``factors``) times what the encoding
        scales that layer's queries by (SSMax: s x log of the keys each query sees), per
        head where the encoding's are."""
        scale = getattr(self.encoding, "query_scale", None)
        own = None if scale is None else scale(layer, positions, self.blocks[layer].attn.reach)
        if own is None:
            return factors
        return own if factors is None else own * factors

    def forward(self, tokens: Tensor) -> Tensor:
        batch, length = tokens.shape
        positions = self.encoding.positions(batch, length, tokens.device)
        x = self.token_embedding(tokens) * math.sqrt(self.config.d_model)
        x = self.encoding.embed(x, positions)
        # Rotary tables, like the bias, are built once per pass and shared by the layers
        # (a recipe: once per kind of layer).
        every_tables = []
        for kind in self.kinds:
            tables = kind.rotary_tables(positions)
            if tables is not None and tables.decay is not None:
                # Blocks of xPos's decay hold batch x heads x rows x keys scores at most.
                budget = self.attention_score_budget
                rows = max(1, budget // (batch * self.config.n_heads * length))
                decay = replace(tables.decay, max_rows=min(tables.decay.max_rows, rows))
                tables = replace(tables, decay=decay)
            every_tables.append(tables)
        factors = None
        if self.logn_length is not None:
            factors = logn_factors(length, self.logn_length, tokens.device)
        every_factors = [
            self.kind_factors(kind, positions, factors) for kind in range(len(every_tables))
        ]
        dtype = (
            torch.get_autocast_dtype(tokens.device.type)
            if torch.is_autocast_enabled(tokens.device.type)
            else x.dtype
        )
        decaying = any(t is not None and t.decay is not None for t in every_tables)
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
        for i, (block, kind) in enumerate(zip(self.blocks, self.layer_kinds, strict=True)):
            probe = LayerProbe(self.probe, i) if self.probe is not None else None
            layer_factors = self.layer_factors(i, positions, every_factors[kind])
            x = block(x, every_tables[kind], attn_bias, layer_factors, probe, kernel)
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
            windowed=any(reach.limited for reach in self.reaches),
            softcap=self.attn_softcap is not None,
            contextual=self.contextual,
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
            key = (*shape, bias_form, factors is not None, self.attn_softcap)
            if not fits_compiled(key):
                note = f"over {MAX_FLEX_SHAPES} flex_attention shapes compiled: this one on sdpa"
                choice = Choice("sdpa", note)
        if not compiling:
            self.note_attention(choice, backward=torch.is_grad_enabled())
        if choice.implementation != "flex_attention":
            return Kernel(choice.implementation)
        masks = {reach: block_mask(length, str(device), reach) for reach in self.reaches}
        cap = self.attn_softcap
        if not encoding.has_bias:
            return Kernel(choice.implementation, score_mod(None, None, cap), masks)
        mod = score_mod(encoding.bias_mod(length), factors, cap)
        return Kernel(choice.implementation, mod, masks, encoding.flex_tiles)

    @property
    def reaches(self) -> list[Reach]:
        """Which keys each layer's queries see (a sliding window, chunks), in layer order."""
        return [block.attn.reach for block in self.blocks]

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
    attn_softcap: float | None = None,
    **encoding_params: object,
) -> Transformer:
    """A model with ``encoding``; weights the encoding does not own depend on ``seed`` only;
    ``attn_implementation`` (worker.attention) says how its attention runs. The
    encoding's ``window`` parameter (every encoding has one) is the model's: a sliding
    window on every layer's attention, not something the encoding computes."""
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
    # Every encoding's window is the model's, unless the encoding defines one of its own
    # (a recipe's local layers).
    window = None
    if all(p.name != WINDOW.name for p in info(encoding).params):
        window = encoding_params.pop(WINDOW.name, None)
    if window is not None:
        window = WINDOW.check(encoding, window)
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
    if attn_softcap is not None and (
        isinstance(attn_softcap, bool)
        or not isinstance(attn_softcap, int | float)
        or not 0 < attn_softcap < float("inf")
    ):
        raise ValueError(f"attn_softcap must be a positive number, got {attn_softcap!r}")
    model = Transformer(
        config, position_encoding, seed=seed, window=window, attn_softcap=attn_softcap
    )
    model.attn_implementation = attn_implementation
    return model
