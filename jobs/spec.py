"""Study specs: what a user submits, validated at the edge.

A study is one task, one model size, one training setup, a list of encodings
(with parameters), a list of seeds, and how to evaluate: lengths, protocols and
RoPE inference-time variants. Unknown keys are rejected and every size is
bounded, so one spec cannot exhaust a cluster; a violation names the field, the
value and what is allowed.

Torch-free: the CLI and the dashboard validate specs without importing it.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from worker.catalog.encodings import REGISTRY, SCALINGS, Fit, info
from worker.catalog.models import MODEL_PRESETS
from worker.catalog.params import EncodingConfigError, is_positive_int, short_repr
from worker.catalog.tasks import TASKS, task_info

# The version of what a run's numbers mean, part of every config hash: bumped when
# training or evaluation changes what a run with the same spec measures, so results of
# the old code are never reused as if they were the new code's. 2 (2026-11-30): the
# learning-rate schedule's ends, no weight decay on encodings, KERPLE-power's initial
# ranges, YaRN's ramp of the authors' code, float32 logits, and evaluation scoring the
# same bytes at every length. 3 (2026-11-30): the scored bytes spread over the whole
# validation split in up to 64 stretches (they were its first `tokens` bytes),
# training windows may end on the training split's last byte, FIRE's initial
# threshold is a quarter of the training length (it was 512 at every length), and a
# HuggingFace corpus is read from its `text` column with line rows joined as one stream.
RESULTS_VERSION = 3
MAX_VARIANT_LABEL = 120  # evaluations.variant is VARCHAR(120) (migration 0007)

# Bounds. Generous for a GPU cluster, small enough that one study cannot hog it.
DEFAULT_NAME = "study"  # a spec without a name
MAX_RUNS = 64
MAX_TRAIN_LENGTH = 16_384
MAX_EVAL_LENGTH = 131_072
MAX_STEPS = 200_000
MAX_PARAMETERS = 1_000_000_000
MAX_TRAIN_TOKENS = 1 << 36  # per run: steps x batch x length
MAX_EVAL_TOKENS = 1 << 36  # per run: tokens the evaluation feeds the model

Protocol = Literal["nonoverlapping", "sliding"]
PROTOCOLS: tuple[str, ...] = get_args(Protocol)
Queue = Literal["gpu", "cpu"]  # the broker's queues: GPU and CPU workers
QUEUES: tuple[str, ...] = get_args(Queue)


def exact(number: float) -> str:
    """A number in a label: short (4, 0.0002, 1e-05) yet never two values under one
    label (1.0000001 stays 1.0000001)."""
    short = f"{number:g}"
    return short if float(short) == float(number) else repr(float(number))


class SpecError(ValueError):
    """A spec that cannot run; the message lists every problem, one per line."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("\n".join(problems))


class _Strict(BaseModel):
    # strict: "128" is not an int, 1 is not true, true is not a seed.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class TaskSpec(_Strict):
    name: str = "lm"
    params: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        # "lm" or {"name": "lm", "corpus": "pystdlib"} are accepted as well.
        if isinstance(value, str):
            return {"name": value}
        if isinstance(value, dict) and "params" not in value:
            rest = {k: v for k, v in value.items() if k != "name"}
            return {"name": value.get("name", "lm"), "params": rest} if rest else value
        return value

    @model_validator(mode="after")
    def _known(self) -> TaskSpec:
        entry = task_info(self.name)
        object.__setattr__(self, "params", entry.resolve(self.params))
        return self

    @property
    def metric(self) -> str:
        return TASKS[self.name].metric


class ModelSpec(_Strict):
    d_model: int = Field(128, ge=16, le=4096)
    n_layers: int = Field(4, ge=1, le=64)
    n_heads: int = Field(4, ge=1, le=64)
    preset: str | None = None

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

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def parameters(self) -> int:
        return self.n_layers * 12 * self.d_model**2 + 256 * self.d_model

    def dims(self) -> dict[str, int]:
        return {"d_model": self.d_model, "n_layers": self.n_layers, "n_heads": self.n_heads}


class TrainSpec(_Strict):
    length: int = Field(128, ge=8, le=MAX_TRAIN_LENGTH, description="training sequence length")
    min_length: int | None = Field(
        None,
        ge=2,
        le=MAX_TRAIN_LENGTH,
        description="each step's sequence length drawn uniformly from [min_length, length] "
        "(training on every length up to length, as in the randomized-positions and NoPE "
        "length-generalisation papers); default: every step at length",
    )
    steps: int = Field(600, ge=1, le=MAX_STEPS)
    batch_size: int = Field(16, ge=1, le=1024)
    grad_accum: int = Field(
        1, ge=1, le=256, description="micro-batches of batch_size per optimizer step"
    )
    lr: float = Field(2e-3, gt=0, le=1.0, description="peak learning rate")
    min_lr_ratio: float = Field(0.1, ge=0, le=1.0, description="final lr / peak lr")
    warmup: float = Field(0.05, ge=0, le=0.5, description="fraction of steps spent warming up")
    weight_decay: float = Field(0.1, ge=0, le=1.0)
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
        if isinstance(value, str):
            return {"name": value}
        if isinstance(value, dict) and "params" not in value and set(value) - {"name"}:
            return {
                "name": value.get("name"),
                "params": {k: v for k, v in value.items() if k != "name"},
            }
        return value

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
            for p in entry.params
            if p.name in self.params and self.params[p.name] != p.default
        ]
        return f"{self.name}({', '.join(changed)})" if changed else self.name


def _format_param(value: Any) -> str:
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


FINETUNED = ("pi", "ntk", "yarn")  # the scalings with one fixed factor


class VariantSpec(_Strict):
    """An inference-time RoPE scaling applied at evaluation; ``none`` is the trained model.

    ``factor: auto`` uses s = max(1, eval_length / train_length) at each length. With
    ``finetune``, the trained model is first fine-tuned under the scaling (a fixed
    factor), and that model is evaluated.
    """

    method: Literal["none", "pi", "ntk", "dynamic_ntk", "yarn"] = "none"
    factor: float | Literal["auto"] | None = None
    # The scaling's own parameters (YaRN's alpha and beta), checked against the registry.
    params: dict[str, Any] = Field(default_factory=dict)
    finetune: FinetuneSpec | None = None

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        # "yarn", "yarn:4", "pi:auto", "yarn:4+ft200" or "yarn:4+ft200@512"
        if not isinstance(value, str):
            return value
        head, plus, tail = value.partition("+")
        method, _, factor = head.partition(":")
        shorthand = {"method": method, "factor": factor or None}
        if plus:
            steps, at, length = tail.removeprefix("ft").partition("@")
            digits = re.compile(r"[0-9]+")
            if not (
                tail.startswith("ft")
                and digits.fullmatch(steps)
                and (not at or digits.fullmatch(length))
            ):
                raise ValueError(
                    f"variant {short_repr(value)}: after '+' comes the fine-tuning, ftSTEPS or "
                    "ftSTEPS@LENGTH, e.g. 'yarn:4+ft200@512'"
                )
            tuning = {"steps": int(steps)} | ({"length": int(length)} if length else {})
            shorthand["finetune"] = tuning
        return shorthand

    @field_validator("factor", mode="before")
    @classmethod
    def _number(cls, value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, str | int | float | None):
            raise ValueError(f"factor must be a number >= 1 or 'auto', got {short_repr(value)}")
        if isinstance(value, str) and value != "auto":
            try:
                return float(value)
            except ValueError:
                raise ValueError(
                    f"factor must be a number >= 1 or 'auto', got {short_repr(value)}"
                ) from None
        return value

    @model_validator(mode="before")
    @classmethod
    def _flat_params(cls, value: Any) -> Any:
        # {method: yarn, factor: 8, beta: 16} is accepted as well as params: {beta: 16}.
        if isinstance(value, dict) and "params" not in value:
            own = ("method", "factor", "finetune")
            rest = {k: v for k, v in value.items() if k not in own}
            if rest:
                kept = {k: v for k, v in value.items() if k in own}
                return {**kept, "params": rest}
        return value

    @model_validator(mode="after")
    def _factor(self) -> VariantSpec:
        if self.params:
            owner = f"variant {short_repr(self.method)}"
            if self.method not in SCALINGS:  # 'none' takes no parameter
                raise ValueError(
                    f"{owner} has no parameter {short_repr(next(iter(self.params)))} "
                    "(allowed: none)"
                )
            resolved = SCALINGS[self.method].resolve(self.params, owner)
            # Only what was given stays (and names the variant); defaults stay implicit.
            object.__setattr__(self, "params", {k: resolved[k] for k in self.params})
        if self.finetune is not None:
            if self.method == "none":
                if self.finetune.length is None:
                    raise ValueError(
                        "variant 'none' with finetune (fine-tuning at a longer length "
                        "without a scaling) needs finetune.length, e.g. 'none+ft200@512'"
                    )
            elif self.method not in FINETUNED:
                raise ValueError(
                    f"variant {short_repr(self.method)}: fine-tuning applies to a scaling with one "
                    f"fixed factor ({', '.join(FINETUNED)}) or to none (no scaling)"
                )
            elif self.factor is None or self.factor == "auto":
                raise ValueError(
                    f"variant {short_repr(self.method)} with finetune needs a number factor "
                    "(the model "
                    f"is fine-tuned once, at one scaling), e.g. '{self.method}:4+ft200'"
                    + ("; none was given" if self.factor is None else ", not 'auto'")
                )
        if self.method in ("none", "dynamic_ntk"):
            if self.factor is not None:
                raise ValueError(f"variant {short_repr(self.method)} takes no factor")
        elif self.factor is None:
            object.__setattr__(self, "factor", "auto")
        elif self.factor != "auto" and not 1.0 <= float(self.factor) <= 1024.0:
            raise ValueError(f"factor must be in [1, 1024] or 'auto', got {self.factor}")
        if len(self.label) > MAX_VARIANT_LABEL:
            raise ValueError(
                f"the variant's label {short_repr(self.label)} is longer than {MAX_VARIANT_LABEL} "
                "characters; give its parameters (or its fine-tuning's lr) fewer digits"
            )
        return self

    @property
    def label(self) -> str:
        name = self.method
        if self.factor is not None:
            factor = self.factor if self.factor == "auto" else exact(self.factor)
            name = f"{name}:{factor}"
        if self.params:
            shown = (
                str(v).lower() if isinstance(v, bool) else exact(v) for v in self.params.values()
            )
            name += (
                "(" + ", ".join(f"{k}={v}" for k, v in zip(self.params, shown, strict=True)) + ")"
            )
        return name + (f"+{self.finetune.label}" if self.finetune is not None else "")

    def factor_at(self, eval_length: int, train_length: int) -> float | None:
        if self.factor is None:
            return None
        if self.factor == "auto":
            return max(1.0, eval_length / train_length)
        return float(self.factor)


class EvalSpec(_Strict):
    lengths: Annotated[
        list[Annotated[int, Field(ge=2, le=MAX_EVAL_LENGTH)]], Field(min_length=1, max_length=32)
    ] = Field(default_factory=lambda: [128, 256, 512, 1024])
    protocols: Annotated[list[Protocol], Field(min_length=1, max_length=2)] = Field(
        default_factory=lambda: ["nonoverlapping"]
    )
    stride: int | None = Field(None, ge=1, le=MAX_EVAL_LENGTH, description="sliding stride")
    tokens: int = Field(65_536, ge=64, le=1 << 24, description="scored tokens per length (lm)")
    examples: int = Field(100, ge=1, le=10_000, description="examples per length (synthetic)")
    variants: Annotated[list[VariantSpec], Field(min_length=1, max_length=16)] = Field(
        default_factory=lambda: [VariantSpec()]
    )
    batch_tokens: int = Field(
        16_384, ge=256, le=1 << 22, description="tokens per evaluation batch (memory bound)"
    )
    order_probe: bool = Field(
        True,
        description="language modelling: also score each window with its first half shuffled "
        "(how much the model relies on word order; worker.probes)",
    )

    @field_validator("lengths")
    @classmethod
    def _sorted_unique(cls, lengths: list[int]) -> list[int]:
        return sorted(set(lengths))

    @field_validator("protocols")
    @classmethod
    def _unique(cls, protocols: list[str]) -> list[str]:
        return list(dict.fromkeys(protocols))

    @field_validator("variants")
    @classmethod
    def _variants(cls, variants: list[VariantSpec]) -> list[VariantSpec]:
        labels = [v.label for v in variants]
        twice = sorted({x for x in labels if labels.count(x) > 1})
        if twice:
            raise ValueError(f"listed twice: {', '.join(twice)}")
        # The trained model ('none') is always evaluated, listed or not: one canonical
        # list, so a spec with and without it is the same study (and the same runs).
        return [VariantSpec()] + [v for v in variants if v.label != "none"]

    @model_validator(mode="after")
    def _stride(self) -> EvalSpec:
        if self.stride is not None and "sliding" not in self.protocols:
            raise ValueError(
                "eval.stride applies to the 'sliding' protocol only; add 'sliding' to "
                "eval.protocols or remove the stride"
            )
        return self

    def plan(self, scalable: bool) -> list[tuple[VariantSpec, str, int]]:
        """Every (variant, protocol, length) to evaluate for one run, shortest lengths
        first. The trained model itself (variant ``none``) always comes first; scalings
        apply to rotary encodings only (``scalable``)."""
        # Fine-tuning without a scaling ('none+ft...') applies to every encoding.
        variants = [v for v in self.variants if scalable or v.method == "none"]
        return [
            (variant, protocol, length)
            for variant in variants
            for protocol in self.protocols
            for length in self.lengths
        ]


class RunSpec(_Strict):
    """One trained model of a study: (encoding, seed), with its config hash (everything
    its results depend on) and its train hash (what the trained model depends on)."""

    encoding: EncodingSpec
    seed: int
    config_hash: str
    train_hash: str


class StudySpec(_Strict):
    name: str = Field(DEFAULT_NAME, min_length=1, max_length=120)

    @field_validator("name")
    @classmethod
    def _printable(cls, name: str) -> str:
        if not name.strip():
            raise ValueError("must not be blank")
        if any(not ch.isprintable() for ch in name):
            raise ValueError("must be printable text (no control characters or line breaks)")
        return name

    task: TaskSpec = Field(default_factory=TaskSpec)
    model: ModelSpec = Field(default_factory=lambda: ModelSpec.model_validate("small"))
    train: TrainSpec = Field(default_factory=TrainSpec)
    encodings: Annotated[list[EncodingSpec], Field(min_length=1, max_length=MAX_RUNS)]
    seeds: Annotated[
        list[Annotated[int, Field(ge=0, lt=2**31)]], Field(min_length=1, max_length=16)
    ] = Field(default_factory=lambda: [0])
    eval: EvalSpec = Field(default_factory=EvalSpec)
    queue: Queue = Field(
        "gpu",
        description="the workers that train it: 'gpu' or 'cpu' (posbench worker --queues); "
        "not part of a run's config hash",
    )

    @model_validator(mode="before")
    @classmethod
    def _default_lengths(cls, data: Any) -> Any:
        """Without eval.lengths, evaluate at 1, 2, 4 and 8 times the training length."""
        if not isinstance(data, dict):
            return data
        evaluation = data.get("eval", {})
        train = data.get("train", {})
        if not isinstance(evaluation, dict) or "lengths" in evaluation:
            return data
        if isinstance(train, dict):
            length = train.get("length", 128)
        else:  # a TrainSpec, or something the train section's own check will refuse
            length = getattr(train, "length", None)
        if not is_positive_int(length):
            return data  # the train section's own check says what is wrong
        lengths = [length * 2**k for k in range(4) if length * 2**k <= MAX_EVAL_LENGTH]
        return {**data, "eval": {**evaluation, "lengths": lengths or [length]}}

    @model_validator(mode="after")
    def _consistent(self) -> StudySpec:
        problems = []
        runs = len(self.encodings) * len(self.seeds)
        if runs > MAX_RUNS:
            problems.append(
                f"encodings x seeds = {len(self.encodings)} x {len(self.seeds)} = {runs} runs; "
                f"at most {MAX_RUNS} per study"
            )
        labels = [e.label for e in self.encodings]
        hashes = [self.config_hash(e, 0) for e in self.encodings]
        if len(set(hashes)) != len(hashes):
            twice = sorted({labels[i] for i, h in enumerate(hashes) if hashes.count(h) > 1})
            problems.append(f"encodings: the same configuration listed twice: {twice}")
        if len(set(self.seeds)) != len(self.seeds):
            problems.append("seeds: each seed may appear once")
        train_tokens = self.train.steps * self.train.tokens_per_step
        if train_tokens > MAX_TRAIN_TOKENS:
            problems.append(
                f"train: steps x batch_size x grad_accum x length = {train_tokens:,} tokens "
                "per run; "
                f"at most {MAX_TRAIN_TOKENS:,}"
            )
        tuned = [tuning for _, tuning in self.finetunings()]
        for variant, tuning in self.finetunings():
            if tuning.length < self.train.length:
                problems.append(
                    f"eval.variants: {short_repr(variant.label)} fine-tunes at "
                    f"{tuning.length} tokens, "
                    f"shorter than train.length = {self.train.length}: fine-tuning extends "
                    "the context"
                )
            if tuning.length > MAX_TRAIN_LENGTH:
                problems.append(
                    f"eval.variants: {short_repr(variant.label)} fine-tunes at "
                    f"{tuning.length} tokens; "
                    f"at most {MAX_TRAIN_LENGTH} (give finetune.length)"
                )

        tuning_tokens = sum(t.steps * t.tokens_per_step for t in tuned)
        if tuned and train_tokens + tuning_tokens > MAX_TRAIN_TOKENS:
            problems.append(
                f"eval.variants: training and fine-tuning read {train_tokens + tuning_tokens:,} "
                f"tokens per run; at most {MAX_TRAIN_TOKENS:,}"
            )
        read = self.eval_tokens()
        if read > MAX_EVAL_TOKENS:
            per = (
                "tokens x length / stride (sliding)"
                if "sliding" in self.eval.protocols
                else "tokens"
            )
            problems.append(
                f"eval: {per}, over every length, protocol and variant, reads {read:,} tokens "
                f"per run; at most {MAX_EVAL_TOKENS:,} (fewer tokens, lengths or variants, or "
                "a longer stride)"
            )
        task = TASKS[self.task.name]
        longest_read = max(self.train.length, *self.eval.lengths, *(t.length for t in tuned))
        problems += task_info(self.task.name).length_problems(self.task.params, longest_read)
        lengths = [("train.length", self.train.length), ("eval.lengths", min(self.eval.lengths))]
        if self.train.min_length is not None:
            lengths.append(("train.min_length", self.train.min_length))
        lengths += [("finetune.length", t.length) for t in tuned]
        field, shortest = min(lengths, key=lambda pair: pair[1])
        if shortest < task.min_length:
            problems.append(
                f"task {short_repr(task.name)} needs sequences of at least "
                f"{task.min_length} bytes; "
                f"{field} is {shortest}"
            )
        if "sliding" in self.eval.protocols:
            if task.metric != "perplexity":
                problems.append(
                    "eval.protocols: 'sliding' applies to language modelling, not "
                    f"{short_repr(task.name)}"
                )
            if self.eval.stride is None:
                problems.append("eval.stride is required with the 'sliding' protocol")
            elif self.eval.stride > min(self.eval.lengths):
                problems.append(
                    f"eval.stride = {self.eval.stride} exceeds the shortest evaluation length "
                    f"{min(self.eval.lengths)}"
                )
        scalings = [v for v in self.eval.variants if v.method != "none"]
        if scalings and not any(REGISTRY[e.name].scalable for e in self.encodings):
            scalable = ", ".join(n for n, e in REGISTRY.items() if e.scalable)
            problems.append(
                f"eval.variants: {short_repr(scalings[0].label)} scales RoPE and applies "
                f"to {scalable}; "
                "this study trains none of them"
            )
        fit = Fit(self.model.head_dim, self.train.length, max(self.eval.lengths))
        for encoding in self.encodings:
            entry = info(encoding.name)
            problems += [
                f"encodings: {encoding.label}: {problem}"
                for problem in entry.problems(encoding.resolved_params, fit)
            ]
            width = entry.rotary_width(self.model.head_dim, encoding.resolved_params)
            for variant in scalings if entry.scalable else []:
                if width < SCALINGS[variant.method].min_rotary_width:
                    problems.append(
                        f"eval.variants: {short_repr(variant.label)} raises the base to the "
                        f"power r/(r-2) and needs a rotary width r >= "
                        f"{SCALINGS[variant.method].min_rotary_width}; {encoding.label} "
                        f"rotates {width}"
                    )
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def finetune_spec(self, variant: VariantSpec) -> TrainSpec:
        """The training settings of ``variant``'s fine-tuning: the study's (optimizer,
        clipping, micro-batches), for ``finetune.steps`` steps at ``finetune.length``
        (default: factor x the training length) with the training's tokens per step
        (``finetune.batch_size`` otherwise), ``finetune.warmup_steps`` of warmup then a
        constant ``finetune.lr`` (default: a tenth of the training's peak), the
        fine-tuning's weight decay, and no validation."""
        tuning = variant.finetune
        if tuning is None:
            raise ValueError(f"variant {short_repr(variant.label)} is not fine-tuned")
        length = tuning.length or round(float(variant.factor) * self.train.length)
        return self.train.model_copy(
            update={
                "steps": tuning.steps,
                "length": length,
                "lr": tuning.lr if tuning.lr is not None else self.train.lr / 10,
                "min_lr_ratio": 1.0,
                "warmup": min(0.5, tuning.warmup_steps / tuning.steps),
                "weight_decay": tuning.weight_decay,
                # Default: the training's tokens per step (memory grows with the length).
                "batch_size": tuning.batch_size
                or max(1, round(self.train.batch_size * self.train.length / length)),
                "min_length": None,  # every fine-tuning step at its length
                "val_every": 0,
            }
        )

    def finetunings(self) -> list[tuple[VariantSpec, TrainSpec]]:
        """Each fine-tuned variant with the training settings of its fine-tuning."""
        return [(v, self.finetune_spec(v)) for v in self.eval.variants if v.finetune is not None]

    def notes(self) -> list[str]:
        """What the study will run as written, but a researcher would want to know first."""
        out = []
        if self.train.length not in self.eval.lengths:
            out.append(
                f"the training length {self.train.length} is not among eval.lengths: "
                "extrapolation ratios and the effective length will stay empty"
            )
        if not any(REGISTRY[e.name].scalable for e in self.encodings):
            return out
        labels = {v.label for v in self.eval.variants}
        if {"dynamic_ntk", "ntk:auto"} <= labels:
            out.append(
                "eval.variants: dynamic_ntk and ntk:auto give the same numbers: a window is "
                "read in one pass, so dynamic NTK's scale is max(1, length / L) for all of "
                "it, ntk:auto's factor (as in HF transformers and the YaRN authors' "
                "evaluation); list one, or a fixed factor (ntk:8) to compare with"
            )
        turns = self.train.length / (2 * math.pi)  # RoPE's fastest pair, over L tokens
        for variant in self.eval.variants:
            beta = variant.params.get("beta", 32.0)
            if variant.method == "yarn" and turns < beta:
                out.append(
                    f"eval.variants: {short_repr(variant.label)}: over train.length = "
                    f"{self.train.length} RoPE's fastest pair turns {turns:.0f} times, "
                    f"fewer than beta = {beta:g}, so no pair keeps its frequency and YaRN is "
                    "close to PI here; the paper's alpha = 1, beta = 32 are for 4096 tokens "
                    f"(scaled to this length: alpha = {self.train.length / 4096:.3g}, "
                    f"beta = {32 * self.train.length / 4096:.3g})"
                )
                break
        return out

    def eval_tokens(self) -> int:
        """Tokens one run's evaluation feeds the model, at most (every variant counted):
        a sliding window of ``length`` scores ``stride`` of them."""
        spec, total = self.eval, 0
        language_model = self.task.metric == "perplexity"
        for length in spec.lengths:
            scored = spec.tokens if language_model else spec.examples * length
            for protocol in spec.protocols:
                windows = length / spec.stride if protocol == "sliding" and spec.stride else 1
                total += round(scored * windows)
        return total * len(spec.variants)

    def finetune_tokens(self) -> int:
        """Tokens the fine-tuned variants read, over every run they apply to (rotary)."""
        scalable = sum(REGISTRY[e.name].scalable for e in self.encodings)
        total = 0
        for variant, tuning in self.finetunings():
            # Without a scaling, every encoding is fine-tuned; with one, rotary ones.
            encodings = len(self.encodings) if variant.method == "none" else scalable
            total += encodings * len(self.seeds) * tuning.steps * tuning.tokens_per_step
        return total

    # -- runs ---------------------------------------------------------------------------------

    def runs(self) -> list[RunSpec]:
        return [
            RunSpec(
                encoding=encoding,
                seed=seed,
                config_hash=self.config_hash(encoding, seed),
                train_hash=self.train_hash(encoding, seed),
            )
            for encoding in self.encodings
            for seed in self.seeds
        ]

    def _training_payload(self, encoding: EncodingSpec, seed: int) -> dict[str, Any]:
        # Reporting, checkpointing and validation change no weight of the trained model.
        reporting = {"checkpoint_every", "progress_every", "val_every", "val_tokens"}
        train = self.train.model_dump(exclude=reporting)
        # Fields added later enter the payload only when set away from their default,
        # so every earlier run keeps its hash (and is still reused).
        if train["grad_accum"] == 1:
            del train["grad_accum"]
        if train["min_length"] is None:
            del train["min_length"]
        return {
            "results_version": RESULTS_VERSION,
            "task": {"name": self.task.name, "params": self.task.params},
            "model": self.model.dims(),
            "train": train,
            "encoding": {"name": encoding.name, "params": encoding.resolved_params},
            "seed": seed,
        }

    @staticmethod
    def _digest(payload: dict[str, Any]) -> str:
        canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str)
        return hashlib.sha256(canonical.encode()).hexdigest()[:24]

    def config_hash(self, encoding: EncodingSpec, seed: int) -> str:
        """Stable hash of everything that changes a run's results (not the study's name,
        nor the other encodings or seeds), RESULTS_VERSION included."""
        evaluation = self.eval.model_dump(mode="json", exclude={"order_probe"})
        for variant in evaluation["variants"]:
            if not variant["params"]:
                del variant["params"]
            if variant["finetune"] is None:  # added later: absent, so old hashes hold
                del variant["finetune"]
        # The order probe adds summaries but changes no point of the curve.
        return self._digest({**self._training_payload(encoding, seed), "eval": evaluation})

    def train_hash(self, encoding: EncodingSpec, seed: int) -> str:
        """Stable hash of what the trained model depends on: the config hash less the
        evaluation settings. Runs that share it share their trained model (a study that
        only evaluates differently trains nothing again), and it stamps checkpoints."""
        return self._digest({**self._training_payload(encoding, seed), "training_only": True})

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json", exclude_defaults=False), sort_keys=False)


# -- loading and error wording ----------------------------------------------------------------


def _allowed_keys(loc: tuple[Any, ...]) -> list[str]:
    """The keys the model at ``loc`` (minus its last element) accepts."""
    model: Any = StudySpec
    for item in loc[:-1]:
        if isinstance(item, int) or model is None:
            continue
        field = model.model_fields.get(item)
        if field is None:
            return []
        annotation = field.annotation
        candidates = [annotation, *getattr(annotation, "__args__", ())]
        model = next(
            (c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None
        )
        if model is None:
            for candidate in candidates:
                inner = getattr(candidate, "__args__", ())
                model = next(
                    (c for c in inner if isinstance(c, type) and issubclass(c, BaseModel)), None
                )
                if model is not None:
                    break
    return list(model.model_fields) if model is not None else []


def _location(loc: tuple[Any, ...]) -> str:
    parts = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif not (isinstance(item, str) and ("function-" in item or item in ("str", "dict"))):
            name = str(item) if len(str(item)) <= 60 else short_repr(str(item), 60)
            parts.append(("." if parts else "") + name)
    return "".join(parts) or "spec"


def describe(error: ValidationError) -> list[str]:
    """One line per problem: the field, the value given, and what is allowed."""
    lines = []
    for problem in error.errors(include_url=False):
        where = _location(problem["loc"])
        kind = problem["type"]
        value = problem.get("input")
        message = problem["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
        if kind == "extra_forbidden":
            allowed = _allowed_keys(problem["loc"])
            hint = f" (allowed: {', '.join(allowed)})" if allowed else ""
            lines.append(f"{where}: unknown key{hint}")
        elif kind == "missing":
            lines.append(f"{where}: required")
        elif kind in ("greater_than_equal", "less_than_equal", "greater_than", "less_than"):
            lines.append(
                f"{where} = {short_repr(value)}: {message.lower().replace('input should', 'must')}"
            )
        elif kind in ("too_short", "too_long"):
            lines.append(f"{where}: {message.lower().replace('list should', 'must')}")
        elif kind == "value_error":
            lines.append(f"{where}: {message}" if where != "spec" else message)
        else:
            lines.append(f"{where} = {short_repr(value)}: {message}")
    return lines


def parse_spec(data: Any) -> StudySpec:
    """Validate a spec given as a mapping; raise :class:`SpecError` listing every problem."""
    if not isinstance(data, dict):
        raise SpecError([f"a spec is a mapping of keys to values, got {type(data).__name__}"])
    try:
        return StudySpec.model_validate(data)
    except ValidationError as err:
        raise SpecError(describe(err)) from None
    except EncodingConfigError as err:
        raise SpecError([str(err)]) from None


MAX_SPEC_BYTES = 1 << 20
MAX_SPEC_NODES = 100_000  # values in the parsed spec, counting every use of a YAML alias
MAX_SPEC_DEPTH = 16  # a spec's deepest value (an encoding's parameter) is at level 4


class _SpecLoader(yaml.SafeLoader):
    """YAML 1.1's safe loader, with two changes: a key given twice is an error (not
    last-wins), and 1e4 is a number (YAML 1.1 wants 1.0e+4; JSON, Python and people
    write 1e4)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, list | dict | set):
                mark = key_node.start_mark
                raise SpecError(
                    [f"line {mark.line + 1}: a key must be a name, not a {type(key).__name__}"]
                )
            if key in seen:
                mark = key_node.start_mark
                raise SpecError(
                    [f"line {mark.line + 1}: key {short_repr(key)} is given twice; give it once"]
                )
            seen[key] = True
        return super().construct_mapping(node, deep=deep)


_SpecLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        raise SpecError([f"key {short_repr(twice[0])} is given twice; give it once"])
    return dict(pairs)


def _count_nodes(data: Any, budget: int = MAX_SPEC_NODES) -> tuple[int, int]:
    """Values in ``data``, stopping past ``budget`` (YAML aliases can nest a tiny file
    into billions of values), and how deep they nest."""
    count, deepest, stack = 0, 0, [(data, 1)]
    while stack and count <= budget:
        item, depth = stack.pop()
        count += 1
        deepest = max(deepest, depth)
        if isinstance(item, dict):
            stack.extend((value, depth + 1) for value in item.values())
        elif isinstance(item, list):
            stack.extend((value, depth + 1) for value in item)
    return count, deepest


def load_spec(path: str | Path) -> StudySpec:
    """Read a YAML or JSON spec file."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise SpecError([f"cannot read spec file {path}: {err.strerror}"]) from None
    if len(raw) > MAX_SPEC_BYTES:
        raise SpecError([f"{path} is {len(raw):,} bytes; a spec is at most {MAX_SPEC_BYTES:,}"])
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise SpecError([f"{path} is not UTF-8 text (byte {err.start})"]) from None
    if not text.strip():
        raise SpecError([f"{path} is empty; a spec needs at least 'encodings'"])
    try:
        if path.suffix == ".json":
            data = json.loads(text, object_pairs_hook=_json_object)
        else:
            data = yaml.load(text, Loader=_SpecLoader)  # a SafeLoader subclass
    except RecursionError:
        raise SpecError(
            [f"{path} nests deeper than a spec can ({MAX_SPEC_DEPTH} levels)"]
        ) from None
    except json.JSONDecodeError as err:
        where = f"line {err.lineno}, column {err.colno}"
        raise SpecError([f"{path} is not valid JSON: {where}: {err.msg}"]) from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise SpecError([f"{path} is not valid YAML: {where}{problem}"]) from None
    except SpecError:
        raise
    except ValueError as err:
        if "Exceeds the limit" in str(err):  # an integer of more digits than Python converts
            raise SpecError([f"{path}: a number is too long ({str(err)[:80]})"]) from None
        # YAML reads 2023-13-45 as a date that does not exist, and the like.
        raise SpecError([f"{path} is not valid YAML: {short_repr(str(err))}"]) from None
    count, depth = _count_nodes(data)
    if count > MAX_SPEC_NODES:
        raise SpecError([f"{path} expands to more than {MAX_SPEC_NODES:,} values (YAML aliases?)"])
    if depth > MAX_SPEC_DEPTH:
        raise SpecError([f"{path} nests deeper than a spec can ({MAX_SPEC_DEPTH} levels)"])
    return parse_spec(data)


PRESET_SPECS: dict[str, dict[str, Any]] = {
    # Seconds on a CPU: what the tests and `make run` use.
    "smoke": {
        "name": "smoke",
        "model": "tiny",
        "train": {
            "length": 32,
            "steps": 40,
            "batch_size": 8,
            "lr": 3e-3,
            "checkpoint_every": 20,
            "progress_every": 5,
        },
        "encodings": ["nope", "rope", "alibi"],
        "eval": {"lengths": [32, 64, 128], "tokens": 4096, "variants": ["none"]},
    },
    # Minutes on 2 CPU cores: the published ordering at small scale.
    "quick": {
        "name": "quick",
        "model": "small",
        "train": {"length": 128, "steps": 600, "batch_size": 16, "lr": 2e-3, "warmup": 0.05},
        "encodings": ["nope", "sinusoidal", "learned", "rope", "alibi", "t5"],
        "eval": {"lengths": [128, 256, 512, 1024, 2048, 4096], "tokens": 65_536},
    },
    # One GPU: the ALiBi paper's setting (WikiText-103, train 512, evaluate to 16x) at a
    # smaller scale: 20k steps x 32 x 512 bytes is about 0.6 of an epoch of its 540 MB
    # (pystdlib's 30 MB would be repeated 11 times).
    "paper": {
        "name": "paper",
        "task": {"name": "lm", "corpus": "hf:wikitext:wikitext-103-raw-v1"},
        "model": "base",
        "train": {
            "length": 512,
            "steps": 20_000,
            "batch_size": 32,
            "lr": 6e-4,
            "warmup": 0.02,
            "checkpoint_every": 1000,
            "progress_every": 50,
        },
        "encodings": [
            "nope",
            "sinusoidal",
            "learned",
            "rope",
            "xpos",
            "alibi",
            "t5",
            "kerple_log",
            "fire",
        ],
        "eval": {
            "lengths": [512, 1024, 2048, 4096, 8192],
            "tokens": 262_144,
            "variants": ["none", "pi:auto", "ntk:16", "dynamic_ntk", "yarn:auto"],
        },
    },
}


def preset_spec(name: str) -> StudySpec:
    if name not in PRESET_SPECS:
        raise SpecError(
            [f"unknown preset {short_repr(name)} (available: {', '.join(PRESET_SPECS)})"]
        )
    return parse_spec(PRESET_SPECS[name])
