"""The parts of a study spec: task, model, training, encoding and fine-tuning."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    Field,
    model_validator,
)

from core.catalog.corpora import SourcePolicy
from core.catalog.encodings import REGISTRY, info
from core.catalog.hf_models import HF_ENCODING, MAX_NAME
from core.catalog.models import ATTN_IMPLEMENTATIONS, MODEL_PRESETS
from core.catalog.params import short_repr
from core.catalog.tasks import DEFAULT_TASK, TASKS, task_info
from core.metrics import Kind
from core.spec.base import (
    MAX_EVAL_LENGTH,
    MAX_PARAMETERS,
    MAX_STEPS,
    MAX_TRAIN_LENGTH,
    _Strict,
    exact,
)

# Characters no model folder name or hub id has, and markup does.
NOT_IN_MODEL_NAMES = "<>\"'`{}%|\\"


def _name_and_params(value: Any, default_name: str | None = None) -> Any:
    """The shorthands of a named entry with parameters: "rope" for {"name": "rope"}, and
    {"name": "rope", "base": 500000} for {"name": "rope", "params": {"base": 500000}}."""
    if isinstance(value, str):
        return {"name": value}
    if isinstance(value, dict) and "params" not in value:
        rest = {k: v for k, v in value.items() if k != "name"}
        if rest:
            return {"name": value.get("name", default_name), "params": rest}
    return value


class TaskSpec(_Strict):
    name: str = DEFAULT_TASK
    params: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        # "lm" or {"name": "lm", "corpus": "pystdlib"} are accepted as well.
        return _name_and_params(value, DEFAULT_TASK)

    @model_validator(mode="after")
    def _known(self) -> TaskSpec:
        entry = task_info(self.name)
        object.__setattr__(self, "params", entry.resolve(self.params))
        return self

    @property
    def metric(self) -> str:
        return TASKS[self.name].metric

    def source_problem(self, sources: SourcePolicy) -> str | None:
        """Why this service may not read the task's data (a corpus outside the roots,
        HuggingFace turned off), or None: the caller's settings, checked at submit."""
        return TASKS[self.name].source_problem(self.params, sources)

    @property
    def kind(self) -> Kind:
        return TASKS[self.name].kind


class ModelSpec(_Strict):
    d_model: int = Field(128, ge=16, le=4096)
    n_layers: int = Field(4, ge=1, le=64)
    n_heads: int = Field(4, ge=1, le=64)
    preset: str | None = None
    hf: str | None = Field(
        None,
        min_length=1,
        max_length=MAX_NAME,
        description="a HuggingFace causal LM to evaluate as it is: a folder in a models root "
        "or, where an operator allows it, a hub id (docs/evaluate-your-own-model.md)",
    )
    attn_implementation: Literal[ATTN_IMPLEMENTATIONS] = Field(  # type: ignore[valid-type]
        "auto",
        description="how attention runs: eager (scores written out), sdpa, flex_attention "
        "(the bias as a fused score_mod), or auto (flex on CUDA for an encoding with a bias, "
        "sdpa otherwise); changes no number beyond rounding and no hash, and results.json "
        "records what trained and evaluated each run (docs/attention.md)",
    )
    attn_softcap: float | None = Field(
        None,
        gt=0,
        le=10000,
        description="attention logit soft-capping, cap x tanh(logit / cap) on every layer's "
        "logits with their bias (Gemma 2: 50); unset: none. Part of what the model is (its "
        "hashes) when set",
    )

    @model_validator(mode="before")
    @classmethod
    def _preset(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = {"preset": value}
        if isinstance(value, dict) and value.get("preset") is not None:
            name = value["preset"]
            if not isinstance(name, str) or name not in MODEL_PRESETS:
                raise ValueError(
                    f"unknown model preset {short_repr(name)} "
                    f"(allowed: {', '.join(MODEL_PRESETS)}, or "
                    "d_model / n_layers / n_heads)"
                )
            dims = MODEL_PRESETS[name]
            clash = [k for k in dims if k in value and value[k] != dims[k]]
            if clash:
                raise ValueError(
                    f"preset {short_repr(name)} has "
                    f"{', '.join(f'{k}={dims[k]}' for k in clash)}; give "
                    "either a preset or dimensions, not both"
                )
            return {**value, **dims}
        return value

    @model_validator(mode="after")
    def _shape(self) -> ModelSpec:
        if self.hf is not None:
            return self._hf_only()
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError(
                f"head_dim = d_model / n_heads = {self.d_model // self.n_heads} must be even "
                "(rotary encodings rotate pairs)"
            )
        if self.parameters > MAX_PARAMETERS:
            raise ValueError(
                f"{self.parameters:,} parameters exceed the limit of {MAX_PARAMETERS:,}"
            )
        return self

    def _hf_only(self) -> ModelSpec:
        """An hf: model brings its own size: no preset, dimensions left at their defaults."""
        if not self.hf or not self.hf.strip() or any(not ch.isprintable() for ch in self.hf):
            raise ValueError("model.hf must be a printable folder name or hub id, not blank")
        markup = sorted(set(self.hf) & set(NOT_IN_MODEL_NAMES))
        if markup:
            # No folder name or hub id has them; markup does (audit F6: an imported
            # model.hf of <a href=...> became a link in Compare's figures).
            raise ValueError(
                f"model.hf may not contain {' '.join(markup)} (a folder name or a hub id has "
                f"none of {' '.join(NOT_IN_MODEL_NAMES)})"
            )
        if self.attn_implementation != "auto":
            raise ValueError(
                "model.attn_implementation applies to posbench's own models; a model.hf "
                "runs as transformers runs it (sdpa)"
            )
        given = [
            name
            for name, field in type(self).model_fields.items()
            if name != "hf" and getattr(self, name) != field.default
        ]
        if given:
            raise ValueError(
                f"model.hf brings its own size; give either hf or {', '.join(given)}, not both"
            )
        return self

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def parameters(self) -> int:
        return self.n_layers * 12 * self.d_model**2 + 256 * self.d_model

    def dims(self) -> dict[str, int]:
        return {"d_model": self.d_model, "n_layers": self.n_layers, "n_heads": self.n_heads}

    def identity(self) -> dict[str, Any]:
        """What a run's hashes know of the model: its dimensions (and its soft cap, when
        set: unset, every earlier hash stands), or its hf: name."""
        if self.hf is not None:
            return {"hf": self.hf}
        if self.attn_softcap is None:
            return self.dims()
        return {**self.dims(), "attn_softcap": self.attn_softcap}


class TrainSpec(_Strict):
    length: int = Field(
        128,
        ge=8,
        le=MAX_EVAL_LENGTH,
        description=f"training sequence length (at most {MAX_TRAIN_LENGTH} to train; a "
        "model.hf's original context, up to the longest evaluation length)",
    )
    min_length: int | None = Field(
        None,
        ge=2,
        le=MAX_TRAIN_LENGTH,
        description="each step's sequence length drawn uniformly from [min_length, length] "
        "(training on every length up to length, as in the randomized-positions and NoPE "
        "length-generalisation papers); default: every step at length",
    )
    steps: int = Field(
        600, ge=0, le=MAX_STEPS, description="optimizer steps (0, no training: model.hf only)"
    )
    batch_size: int = Field(16, ge=1, le=1024)
    grad_accum: int = Field(
        1, ge=1, le=256, description="micro-batches of batch_size per optimizer step"
    )
    lr: float = Field(2e-3, gt=0, le=1.0, description="peak learning rate")
    min_lr_ratio: float = Field(0.1, ge=0, le=1.0, description="final lr / peak lr")
    warmup: float = Field(0.05, ge=0, le=0.5, description="fraction of steps spent warming up")
    weight_decay: float = Field(0.1, ge=0, le=1.0)
    optimizer: Literal["adamw", "muon"] = Field(
        "adamw",
        description="adamw: AdamW on every parameter; muon: Muon (momentum orthogonalised by "
        "Newton-Schulz, its lr scaled to AdamW's update size) on the blocks' weight matrices "
        "and AdamW on the embedding, the gains and the encoding's own parameters",
    )
    grad_clip: float = Field(1.0, gt=0, le=100.0)
    checkpoint_every: int = Field(200, ge=1, le=MAX_STEPS)
    progress_every: int = Field(10, ge=1, le=MAX_STEPS)
    val_every: int = Field(
        100,
        ge=0,
        le=MAX_STEPS,
        description="steps between validation losses at the training length, and at the "
        "last step (0: none)",
    )
    val_tokens: int = Field(
        16_384,
        ge=1,
        le=1 << 24,
        description="held-out targets each validation scores (synthetic tasks: "
        "val_tokens / length examples)",
    )
    compile: bool = False

    @model_validator(mode="after")
    def _lengths(self) -> TrainSpec:
        if self.min_length is not None and self.min_length > self.length:
            raise ValueError(
                f"min_length = {self.min_length} exceeds length = {self.length}; steps draw "
                "their length from [min_length, length]"
            )
        return self

    @property
    def tokens_per_step(self) -> int:
        """Tokens one optimizer step reads: grad_accum micro-batches of batch_size (on
        average, when each step draws its length)."""
        mean_length = (self.length + (self.min_length or self.length)) / 2
        return round(self.batch_size * self.grad_accum * mean_length)


class EncodingSpec(_Strict):
    name: str
    params: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        return _name_and_params(value)

    @model_validator(mode="after")
    def _known(self) -> EncodingSpec:
        entry = info(self.name)
        resolved = entry.resolve(self.params)  # raises a readable error
        # Keep what was given, checked and typed (20000 -> 20000.0 for a float); a null
        # means the default, which stays implicit.
        given = {k: resolved[k] for k, v in self.params.items() if v is not None}
        object.__setattr__(self, "params", given)
        return self

    @property
    def resolved_params(self) -> dict[str, Any]:
        return REGISTRY[self.name].resolve(self.params)

    @property
    def label(self) -> str:
        """``rope`` or ``rope(base=500000)``: the name plus every non-default parameter."""
        entry = REGISTRY[self.name]
        changed = [
            f"{p.name}={_format_param(self.params[p.name])}"
            for p in entry.all_params
            if p.name in self.params and self.params[p.name] != p.default
        ]
        return f"{self.name}({', '.join(changed)})" if changed else self.name


class HfEncoding(_Strict):
    """The run's encoding when the study evaluates an hf: model: the model's own (what it
    is, learned or RoPE, its config says; core.catalog.hf_models). Named like an
    encoding (``name``, ``label``, parameters) wherever a run's encoding is."""

    model: str

    @property
    def name(self) -> str:
        return HF_ENCODING

    @property
    def params(self) -> dict[str, Any]:
        return {"model": self.model}

    @property
    def resolved_params(self) -> dict[str, Any]:
        return self.params

    @property
    def label(self) -> str:
        return f"{HF_ENCODING}:{self.model}"


def _format_param(value: Any) -> str:
    if isinstance(value, bool):  # as a spec writes it
        return "true" if value else "false"
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() and abs(value) < 1e15 else repr(value)
    return str(value)


class FinetuneSpec(_Strict):
    """Fine-tune the trained model under the variant's scaling before evaluating it: the
    recipe of the PI and YaRN papers (a few hundred steps at the longer length, AdamW
    with betas 0.9 / 0.95, no weight decay, 20 steps of linear warmup, then a constant
    learning rate), on training windows of its own (not the first ones training read)."""

    steps: int = Field(ge=1, le=MAX_STEPS)
    length: int | None = Field(
        None, ge=8, le=MAX_TRAIN_LENGTH, description="default: factor x train.length"
    )
    lr: float | None = Field(None, gt=0, le=1.0, description="default: train.lr / 10")
    batch_size: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="default: the training's tokens per step, train.batch_size x "
        "train.length / length (at least 1)",
    )
    weight_decay: float = Field(0.0, ge=0, le=1.0, description="the papers': none")
    warmup_steps: int = Field(20, ge=0, le=MAX_STEPS, description="linear warmup (at most half)")

    @model_validator(mode="before")
    @classmethod
    def _steps_only(cls, value: Any) -> Any:
        return {"steps": value} if isinstance(value, int) and not isinstance(value, bool) else value

    @property
    def label(self) -> str:
        """``ft200``, ``ft200@512``, ``ft200@512(lr=0.0002, batch=8)``."""
        name = f"ft{self.steps}" + (f"@{self.length}" if self.length is not None else "")
        extras = [f"lr={exact(self.lr)}"] if self.lr is not None else []
        extras += [f"batch={self.batch_size}"] if self.batch_size is not None else []
        extras += [f"wd={exact(self.weight_decay)}"] if self.weight_decay else []
        extras += [f"warmup={self.warmup_steps}"] if self.warmup_steps != 20 else []
        return name + (f"({', '.join(extras)})" if extras else "")
