"""A HuggingFace causal LM as the evaluation sees a posbench model: ``model(tokens)``
gives float32 logits, ``encoding`` says where its positions end, ``config`` sizes its
batches (``worker.memory``) and ``scaled(...)`` applies a RoPE scaling for a while, by
setting the model's rope parameters (HF transformers' ``rope_parameters``, from the
catalogue's ``hf_rope_parameters``) and rebuilding its rotary embedding.

Every forward pass is the one a freshly loaded model makes on its input: HF's ``dynamic``
rope keeps the frequencies of the longest sequence it has seen (while shorter ones stay
past the original length), so a rotary embedding with state is rebuilt from its config
before each pass, and a window's loss does not depend on the windows, lengths or
protocols evaluated before it.

The model runs as HF transformers runs it (``attn_implementation="sdpa"``, no KV cache,
positions 0..T-1); only the output layer's logits are float32 under bf16 autocast, as
posbench's own models' are (bf16 logits bias the loss), from bf16 operands accumulated in
float32 where PyTorch can (``float32_logits``).
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from core.catalog.hf_configs import GLOBAL_LAYERS
from core.catalog.hf_models import HfModelError, ModelFacts
from core.catalog.params import is_positive_int
from core.catalog.scalings import SCALINGS, Rotary
from worker.diagnostics import AttentionProbe, logn_factors
from worker.hf.attention import attending, attention_modules
from worker.layers import ModelConfig


@dataclass(frozen=True)
class HfPositions:
    """The model's own position encoding, as the evaluation reads an encoding: its name
    in a 'not applicable' reason and the last position + 1 it represents (a learned
    table's length; None: no end)."""

    name: str
    max_length: int | None


def _device(module: nn.Module) -> torch.device:
    """Where a rotary embedding's tables are."""
    return next(module.buffers()).device


def _size(config) -> ModelConfig:
    """The sizes ``worker.memory.eval_batch_size`` estimates a forward pass from."""
    hidden = getattr(config, "hidden_size", None) or config.n_embd
    heads = getattr(config, "num_attention_heads", None) or config.n_head
    layers = getattr(config, "num_hidden_layers", None) or config.n_layer
    return ModelConfig(d_model=hidden, n_layers=layers, n_heads=heads, vocab_size=config.vocab_size)


@functools.cache
def _products_into_float32(device_type: str, dtype: torch.dtype) -> bool:
    """Whether this PyTorch multiplies ``dtype`` matrices into float32 on ``device_type``
    (``torch.mm(out_dtype=)``: CUDA, recent PyTorch)."""
    if device_type != "cuda":
        return False
    probe = torch.ones(2, 2, dtype=dtype, device=device_type)
    try:
        return torch.mm(probe, probe, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def float32_logits(hidden: Tensor, head: nn.Linear) -> Tensor:
    """The output layer's logits, in float32. Under CUDA autocast its operands are in the
    autocast dtype like every other product of the model, accumulated and returned in
    float32 (``torch.mm(out_dtype=)``): logits rounded to bf16 would bias the loss, and a
    float32 product over a vocabulary of 32k and more runs off the tensor cores (a 134M
    Llama on an H200: posbench's evaluation at 0.63-0.67x a plain transformers loop's
    speed, 1.00-1.02x this way; ``benchmarks/hf_eval.py``). Elsewhere in float32."""
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    bias = None if head.bias is None else head.bias.float()
    with torch.autocast(device, enabled=False):
        if dtype is not None and _products_into_float32(device, dtype):
            flat = hidden.flatten(0, -2).to(dtype)
            logits = torch.mm(flat, head.weight.to(dtype).t(), out_dtype=torch.float32)
            if bias is not None:
                logits += bias
            return logits.view(*hidden.shape[:-1], logits.shape[-1])
        return F.linear(hidden.float(), head.weight.float(), bias)


class HfCausalLM(nn.Module):
    """``model`` (an ``AutoModelForCausalLM``) with the facts its config gives."""

    def __init__(self, model: nn.Module, facts: ModelFacts) -> None:
        super().__init__()
        self.hf = model
        self.facts = facts
        self.encoding = HfPositions(f"{facts.model_type} {facts.encoding}", facts.max_positions)
        self.config = _size(model.config)
        self._rotary_names = [name for name, _ in self._rotary_modules()]
        self._attention = attention_modules(model)  # what log-n and the probe reach
        # Log-n scaling past this length, and the attention probe (worker.hf.attention).
        self.logn_length: int | None = None
        self.probe: AttentionProbe | None = None

    def _fresh_rotary(self) -> None:
        """Each rotary embedding that holds the frequencies of a longer sequence than its
        original length (HF's ``dynamic_rope_update`` records the longest it has seen in
        ``max_seq_len_cached``) rebuilt from its own config, as a freshly loaded model
        has it. The others keep no state between passes (longrope picks its short or
        long factors from each input alone)."""
        for name in self._rotary_names:
            module = self.hf.get_submodule(name)
            cached = getattr(module, "max_seq_len_cached", None)
            if cached is not None and bool(cached != module.original_max_seq_len):
                fresh = type(module)(module.config).to(_device(module))
                self.hf.set_submodule(name, fresh)

    def forward(self, tokens: Tensor) -> Tensor:
        limit = self.facts.max_positions
        if limit is not None and tokens.shape[-1] > limit:
            raise HfModelError(
                f"{self.facts.model_type}'s learned positions end at {limit} "
                f"({self.facts.context_key}); a window of {tokens.shape[-1]} tokens does not "
                "fit (recorded as not applicable by the evaluation)"
            )
        self._fresh_rotary()
        if (self.logn_length is not None or self.probe is not None) and self.softcap:
            raise HfModelError(
                f"{self.facts.model_type} soft-caps its attention logits "
                f"(attn_logit_softcapping={self.softcap:g}) and runs eager attention; log-n "
                "scaling and the attention diagnostics run through SDPA, which has no cap"
            )
        factors = None
        if self.logn_length is not None:
            factors = logn_factors(tokens.shape[-1], self.logn_length, tokens.device)
        with attending(self.hf, self._attention, factors, self.probe):
            outputs = self._decoder(input_ids=tokens, use_cache=False)
        logits = float32_logits(outputs.last_hidden_state, self.hf.get_output_embeddings())
        return self._finished(logits)

    @property
    def _decoder(self) -> nn.Module:
        """The stack of blocks without the output layer (Llama 4's causal LM names its
        base model after the multimodal one's and keeps the text one as ``model``)."""
        base = self.hf.base_model
        return self.hf.model if base is self.hf else base

    def _finished(self, logits: Tensor) -> Tensor:
        """What the family's causal LM does to its output layer's logits: Cohere's
        ``logit_scale``, Gemma's ``final_logit_softcapping`` (cap x tanh(logits / cap))."""
        config = self.hf.config
        scale = getattr(config, "logit_scale", None)
        if scale is not None:
            logits = logits * scale
        cap = getattr(config, "final_logit_softcapping", None)
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    @property
    def softcap(self) -> float | None:
        """The attention logits' soft cap the model's config sets (Gemma 2), or None."""
        return getattr(self.hf.config, "attn_logit_softcapping", None)

    def _rotary_modules(self) -> list[tuple[str, nn.Module]]:
        """The rotary embeddings: one table (``inv_freq``), or one per layer type (Gemma
        3's ``full_attention_inv_freq`` and ``sliding_attention_inv_freq``)."""
        return [
            (name, module)
            for name, module in self.hf.named_modules()
            if hasattr(module, "rope_type")
            and any(
                buffer == "inv_freq" or buffer.endswith("_inv_freq")
                for buffer, _ in module.named_buffers(recurse=False)
            )
        ]

    def scaled_config(self, method: str, factor: float | None, original_length: int, **params):
        """A copy of the model's config with the rope parameters of ``method`` at
        ``factor``: the catalogue's for this model's base and rotary width, plus its
        partial_rotary_factor; ``max_position_embeddings`` is the original length, which
        HF's ``dynamic`` measures lengths from."""
        rotary = self.facts.rotary
        if rotary is None:
            raise HfModelError(
                f"RoPE scalings apply to RoPE models; {self.facts.described} has none"
            )
        scaling = SCALINGS[method]
        rope = scaling.hf_rope_parameters(
            factor, params, Rotary(rotary.base, rotary.rotary_dim, original_length)
        )
        rope["partial_rotary_factor"] = self.facts.partial_rotary_factor
        config = copy.deepcopy(self.hf.config)
        if self.facts.rope_per_layer_type:
            # Per layer type (Gemma 3): the global layers take the scaling, as the model's
            # own rope_scaling does; the sliding-window layers keep theirs.
            rope = {"rope_theta": rotary.base, **rope}
            config.rope_parameters = {**config.rope_parameters, GLOBAL_LAYERS: rope}
        else:
            config.rope_parameters = rope
        config.max_position_embeddings = scaling.original_length(params, original_length)
        return config

    @contextlib.contextmanager
    def scaled(
        self,
        method: str,
        factor: float | None = None,
        original_length: int | None = None,
        **params: object,
    ) -> Iterator[HfCausalLM]:
        """Evaluate with a RoPE scaling for the duration: each rotary embedding of the
        model is rebuilt from the scaled config, and put back afterwards."""
        if original_length is None or not is_positive_int(original_length):
            raise ValueError(f"original_length must be a positive integer, got {original_length}")
        config = self.scaled_config(method, factor, original_length, **params)
        modules = self._rotary_modules()
        if not modules:
            raise HfModelError(f"{self.facts.described}: no rotary embedding module found")
        for name, module in modules:
            self.hf.set_submodule(name, type(module)(config).to(_device(module)))
        try:
            yield self
        finally:
            for name, module in modules:
                self.hf.set_submodule(name, module)
