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
    )
}


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


def _rope_parameters(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The config's RoPE parameters: transformers 5's ``rope_parameters``, or the older
    ``rope_scaling`` (a per-layer-type mapping is not one of the supported families')."""
    for key in ("rope_parameters", "rope_scaling"):
        value = config.get(key)
        if isinstance(value, Mapping):
            return value
    return {}


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
    rope = _rope_parameters(config)
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
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q, k, v and the output
    mlp = (3 if family.gated_mlp else 2) * hidden * inner
    tied = config.get("tie_word_embeddings", family.ties_embeddings)
    embeddings = vocab * hidden * (1 if tied is True else 2)
    positions = (_size(config, "n_positions") or 0) * hidden if family.encoding == "learned" else 0
    return embeddings + positions + layers * (attention + mlp), layers, hidden
