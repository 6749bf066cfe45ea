"""What an hf: model's ``config.json`` says: its family, how it tells a token where it
sits, and its size (parameters, blocks, width) counted from the config alone. Torch-free
like the whole catalogue: the spec's check at submit reads the config as JSON, and the
loader on the worker reads the loaded config with the same rules (``hf_models`` holds
where a model may come from)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from core.catalog.encodings import REGISTRY
from core.catalog.scaling_entry import Rotary
from core.errors import UserError


class HfModelError(UserError, ValueError):
    """An hf: model that may not or cannot be evaluated here: one readable line."""


# The model families posbench evaluates (their config's ``model_type``), each with the
# catalogue entry its positions correspond to, and how much of a head RoPE rotates when
# the config does not say (GPT-NeoX's default is a quarter).
@dataclass(frozen=True)
class HfFamily:
    model_type: str
    encoding: str  # the catalogue's name for what the family does: learned or rope
    summary: str
    rotary_fraction: float = 1.0
    gated_mlp: bool = True  # three matrices in each MLP (gate, up, down), not two
    ties_embeddings: bool = False  # tie_word_embeddings when the config does not say
    # Its attention logits are soft-capped (attn_logit_softcapping): SDPA cannot run it.
    softcaps: bool = False


HF_FAMILIES: dict[str, HfFamily] = {
    family.model_type: family
    for family in (
        HfFamily(
            "gpt2",
            "learned",
            "GPT-2: a learned table of n_positions positions",
            gated_mlp=False,
            ties_embeddings=True,
        ),
        HfFamily(
            "gpt_neox",
            "rope",
            "GPT-NeoX / Pythia: RoPE on part of each head",
            rotary_fraction=0.25,
            gated_mlp=False,
        ),
        HfFamily("llama", "rope", "Llama: RoPE, rope_parameters / rope_scaling"),
        HfFamily("mistral", "rope", "Mistral: RoPE"),
        HfFamily("qwen2", "rope", "Qwen2: RoPE"),
        HfFamily("qwen3", "rope", "Qwen3: RoPE (1e6), YaRN for long contexts"),
        HfFamily(
            "gemma2",
            "rope",
            "Gemma 2: sliding-window and global layers in turn, soft-capped logits",
            ties_embeddings=True,
            softcaps=True,
        ),
        HfFamily(
            "gemma3_text",
            "rope",
            "Gemma 3: 5 sliding-window layers (RoPE 10k) per global one (RoPE 1M)",
            ties_embeddings=True,
        ),
        HfFamily("phi3", "rope", "Phi-3 / 3.5 / 4-mini: RoPE, longrope's short and long factors"),
        HfFamily(
            "cohere2",
            "rope",
            "Cohere2 (Command R7B, A): 3 sliding-window RoPE layers per global NoPE one",
            ties_embeddings=True,
        ),
        HfFamily("olmo2", "rope", "OLMo 2: RoPE"),
        HfFamily("smollm3", "rope", "SmolLM3: RoPE with NoPE every 4th layer"),
        HfFamily(
            "llama4_text",
            "rope",
            "Llama 4 (text): chunked RoPE layers, a NoPE layer every 4th with a query "
            "temperature; mixture-of-experts MLPs",
        ),
    )
}

# What posbench reads of a config's RoPE parameters (transformers' ``rope_parameters``,
# or the older ``rope_scaling``) and of its ``layer_types``: anything else refuses the
# model with a message naming it, never a silent wrong number.
ROPE_KEYS = frozenset(
    {
        "rope_type",
        "type",
        "rope_theta",
        "factor",
        "original_max_position_embeddings",
        "partial_rotary_factor",
        "beta_fast",
        "beta_slow",
        "truncate",
        "short_factor",
        "long_factor",
        "low_freq_factor",
        "high_freq_factor",
        "attention_factor",
        "mscale",
        "mscale_all_dim",
    }
)
ROPE_TYPES = frozenset({"default", "linear", "dynamic", "yarn", "longrope", "llama3"})
LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention"})
# The layers a RoPE scaling changes in a config with RoPE parameters per layer type (Gemma
# 3's rope_scaling applies to its global layers).
GLOBAL_LAYERS = "full_attention"


@dataclass(frozen=True)
class ModelFacts:
    """What a model's config says about its positions."""

    model_type: str
    encoding: str  # learned or rope (HF_FAMILIES)
    context: int  # the length it was trained at (its original context)
    context_key: str  # the config key that says so
    max_positions: int | None  # the last position + 1 it can represent (None: no end)
    rotary: Rotary | None  # base, rotated dimensions, original length (RoPE models)
    partial_rotary_factor: float = 1.0
    # Its layers' kinds (transformers' layer_types; empty: every layer alike), and whether
    # its RoPE parameters are given per layer type (a scaling then changes the global ones).
    layer_types: tuple[str, ...] = ()
    rope_per_layer_type: bool = False
    parameters: int = 0  # what the config describes (config_parameters); 0: not counted
    layers: int = 0  # its transformer blocks
    width: int = 0  # its hidden size

    @property
    def sizes(self) -> tuple[int, int, int]:
        """(parameters, layers, width): what a study's compute is estimated from."""
        return self.parameters, self.layers, self.width

    @property
    def scalable(self) -> bool:
        return REGISTRY[self.encoding].scalable

    @property
    def described(self) -> str:
        return f"{self.model_type} ({HF_FAMILIES[self.model_type].summary})"


def _positive_int(config: Mapping[str, Any], key: str) -> int | None:
    value = config.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _text(value: Any) -> str:
    return repr(str(value)[:40])


def _checked_rope(model_type: str, where: str, rope: Mapping[str, Any]) -> Mapping[str, Any]:
    unknown = sorted(str(key) for key in rope if key not in ROPE_KEYS)
    if unknown:
        raise HfModelError(
            f"the {model_type} config's {where} has {_text(unknown[0])}, which posbench does "
            f"not read (it reads: {', '.join(sorted(ROPE_KEYS))})"
        )
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise HfModelError(
            f"the {model_type} config's {where}.rope_type is {_text(kind)}, which posbench "
            f"does not read (it reads: {', '.join(sorted(ROPE_TYPES))})"
        )
    return rope


def _rope_parameters(model_type: str, config: Mapping[str, Any]) -> tuple[Mapping[str, Any], bool]:
    """The config's RoPE parameters - transformers 5's ``rope_parameters``, or the older
    ``rope_scaling`` - and whether they are given per layer type (Gemma 3: the global
    layers' are returned, those a scaling changes)."""
    for key in ("rope_parameters", "rope_scaling"):
        value = config.get(key)
        if not isinstance(value, Mapping):
            continue
        if value and all(isinstance(entry, Mapping) for entry in value.values()):
            kinds = sorted(str(kind) for kind in value if kind not in LAYER_TYPES)
            if kinds:
                raise HfModelError(
                    f"the {model_type} config's {key} names layer type {_text(kinds[0])}, "
                    f"which posbench does not read (it reads: {', '.join(sorted(LAYER_TYPES))})"
                )
            for kind, entry in value.items():
                _checked_rope(model_type, f"{key}.{kind}", entry)
            chosen = value.get(GLOBAL_LAYERS) or next(iter(value.values()))
            return chosen, True
        return _checked_rope(model_type, key, value), False
    return {}, False


def _layer_types(model_type: str, config: Mapping[str, Any]) -> tuple[str, ...]:
    value = config.get("layer_types")
    if value is None:
        return ()
    if not isinstance(value, list | tuple):
        raise HfModelError(f"the {model_type} config's layer_types is not a list")
    for kind in value:
        if kind not in LAYER_TYPES:
            raise HfModelError(
                f"the {model_type} config's layer_types has {_text(kind)}, which posbench "
                f"does not read (it reads: {', '.join(sorted(LAYER_TYPES))})"
            )
    return tuple(value)


def _number(*values: Any) -> float | None:
    return next(
        (float(v) for v in values if isinstance(v, int | float) and not isinstance(v, bool)), None
    )


def model_facts(config: Mapping[str, Any]) -> ModelFacts:
    """The facts of a config (``config.json`` as read, or a loaded config's ``to_dict``);
    HfModelError for a family posbench does not evaluate or a config it cannot read."""
    model_type = config.get("model_type")
    family = HF_FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise HfModelError(
            f"model_type {str(model_type)[:40]!r} is not one posbench evaluates "
            f"(supported: {', '.join(HF_FAMILIES)})"
        )
    if family.encoding == "learned":
        positions = _positive_int(config, "n_positions")
        if positions is None:
            raise HfModelError(f"the {model_type} config has no n_positions")
        parameters, layers, width = config_parameters(config, family)
        return ModelFacts(
            model_type,
            family.encoding,
            positions,
            "n_positions",
            positions,
            None,
            parameters=parameters,
            layers=layers,
            width=width,
        )
    rope, per_layer_type = _rope_parameters(model_type, config)
    layer_types = _layer_types(model_type, config)
    heads = _positive_int(config, "num_attention_heads")
    hidden = _positive_int(config, "hidden_size")
    head_dim = _positive_int(config, "head_dim") or (hidden // heads if hidden and heads else None)
    longest = _positive_int(config, "max_position_embeddings")
    if head_dim is None or longest is None:
        raise HfModelError(
            f"the {model_type} config lacks hidden_size / num_attention_heads (or head_dim) "
            "or max_position_embeddings"
        )
    fraction = _number(
        rope.get("partial_rotary_factor"),
        config.get("partial_rotary_factor"),
        config.get("rotary_pct"),
        family.rotary_fraction,
    )
    base = _number(rope.get("rope_theta"), config.get("rope_theta"), config.get("rotary_emb_base"))
    original = _positive_int(rope, "original_max_position_embeddings")
    context_key = "original_max_position_embeddings" if original else "max_position_embeddings"
    context = original or longest
    rotary = Rotary(base or 10000.0, int(head_dim * (fraction or 1.0)), context)
    parameters, layers, width = config_parameters(config, family)
    return ModelFacts(
        model_type,
        family.encoding,
        context,
        context_key,
        None,
        rotary,
        fraction or 1.0,
        parameters=parameters,
        layers=layers,
        width=width,
        layer_types=layer_types,
        rope_per_layer_type=per_layer_type,
    )


def _size(config: Mapping[str, Any], *keys: str) -> int | None:
    return next((v for v in (_positive_int(config, k) for k in keys) if v is not None), None)


def config_parameters(config: Mapping[str, Any], family: HfFamily) -> tuple[int, int, int]:
    """The parameters (the matrices: embeddings, attention, MLP; norms and biases left
    out) and the blocks a config describes, from its sizes alone: read before anything
    is loaded, so that ``n_layer: 1000000`` is refused, not allocated; and the layers and
    the width (hidden size). Zeros for a config that does not give them all."""
    hidden = _size(config, "hidden_size", "n_embd")
    layers = _size(config, "num_hidden_layers", "n_layer")
    vocab = _size(config, "vocab_size")
    heads = _size(config, "num_attention_heads", "n_head")
    if not (hidden and layers and vocab and heads):
        return 0, 0, 0  # not counted: checked_folder refuses a folder's config without them
    kv_heads = _size(config, "num_key_value_heads") or heads
    head_dim = _size(config, "head_dim") or max(1, hidden // heads)
    inner = _size(config, "intermediate_size", "n_inner") or 4 * hidden
    inner = max(inner, _size(config, "intermediate_size_mlp") or 0)
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q, k, v and the output
    # A mixture of experts: every expert and a shared one in every layer (an upper bound).
    experts = (_size(config, "num_local_experts") or 0) + 1
    mlp = (3 if family.gated_mlp else 2) * hidden * inner * experts
    tied = config.get("tie_word_embeddings", family.ties_embeddings)
    embeddings = vocab * hidden * (1 if tied is True else 2)
    positions = (_size(config, "n_positions") or 0) * hidden if family.encoding == "learned" else 0
    return embeddings + positions + layers * (attention + mlp), layers, hidden
