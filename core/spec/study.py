"""The study: a grid of encodings x seeds under one task, model and training setup,
and the runs it expands to; the checks that need the whole spec at once."""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any

import yaml
from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from core.catalog.corpora import SourcePolicy
from core.catalog.encodings import REGISTRY, SCALINGS, Fit, info
from core.catalog.hf_models import ModelPolicy
from core.catalog.params import is_positive_int, short_repr
from core.catalog.tasks import TASKS
from core.metrics import METRICS, Kind
from core.spec.base import (
    DEFAULT_NAME,
    MAX_EVAL_LENGTH,
    MAX_EVAL_TOKENS,
    MAX_RUNS,
    MAX_TRAIN_LENGTH,
    MAX_TRAIN_TOKENS,
    RESULTS_VERSION,
    Queue,
    _Strict,
)
from core.spec.cost import StudyCost
from core.spec.hf import hf_defaults, hf_problems, model_source_problem, trained_problems
from core.spec.key_tokens import key_token_problems
from core.spec.parts import (
    EncodingSpec,
    HfEncoding,
    ModelSpec,
    TaskSpec,
    TrainSpec,
)
from core.spec.variants import EvalSpec, VariantSpec


class RunSpec(_Strict):
    """One trained model of a study: (encoding, seed), with its config hash (everything
    its results depend on) and its train hash (what the trained model depends on; None
    for an hf: model, which nothing trains: the model cache has nothing to share)."""

    encoding: EncodingSpec | HfEncoding
    seed: int
    config_hash: str
    train_hash: str | None


class StudySpec(StudyCost, _Strict):
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
    # At least one, unless model.hf (then none: the model brings its own); checked below.
    encodings: Annotated[list[EncodingSpec], Field(max_length=MAX_RUNS)]
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
        """Without eval.lengths, evaluate at 1, 2, 4 and 8 times the training length (an
        hf: model's defaults first: core.spec.hf)."""
        data = hf_defaults(data)
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
        problems = (
            (hf_problems(self) if self.model.hf is not None else trained_problems(self))
            + self._grid_problems()
            + self._budget_problems()
            + self._length_problems()
            + self._protocol_problems()
            + self._threshold_problems()
            + self._encoding_problems()
        )
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def _grid_problems(self) -> list[str]:
        """The grid: how many runs, and no configuration or seed twice."""
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
        return problems

    def _budget_problems(self) -> list[str]:
        """Tokens a run reads - training, fine-tuning, evaluation - and fine-tuning lengths."""
        problems = []
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
        return problems

    def _length_problems(self) -> list[str]:
        """The task's own rules at the longest length read, and its shortest sequence. An
        hf: model reads only the evaluation's lengths, in its tokens: at least the task's
        shortest in bytes, which holds an example where each token is a byte of text or
        more (the tokenizer's own bound is checked where it is loaded)."""
        task = TASKS[self.task.name]
        tuned = [tuning for _, tuning in self.finetunings()]
        trained = [] if self.model.hf is not None else [("train.length", self.train.length)]
        longest_read = max(
            [*self.eval.lengths, *(n for _, n in trained), *(t.length for t in tuned)]
        )
        # Each length an example is built at, not only the longest: a task whose room is
        # not monotone in the length (frequent_words' strict ranking) must not fail at a
        # shorter evaluation length after training.
        read = sorted({*self.eval.lengths, *(t.length for t in tuned)}, reverse=True)
        misfit = task.first_misfit(self.task.params, [longest_read, *read])
        problems = misfit[1] if misfit else []
        if not problems and trained and self.train.min_length is not None:
            # Training draws each step's length from [min_length, length]: every one of
            # them must fit (at most 16,384 cheap checks; one second for frequent_words).
            drawn = range(max(self.train.min_length, task.min_length), self.train.length)
            if misfit := task.first_misfit(self.task.params, drawn):
                problems = [
                    f"train.min_length = {self.train.min_length}: training draws lengths "
                    f"from [{self.train.min_length}, {self.train.length}], and {misfit[1][0]}"
                ]
        lengths = [*trained, ("eval.lengths", min(self.eval.lengths))]
        if self.train.min_length is not None:
            lengths.append(("train.min_length", self.train.min_length))
        lengths += [("finetune.length", t.length) for t in tuned]
        field, shortest = min(lengths, key=lambda pair: pair[1])
        if shortest < task.min_length:
            unit = "tokens" if self.model.hf is not None else "bytes"
            problems.append(
                f"task {short_repr(task.name)} needs sequences of at least "
                f"{task.min_length} {unit}; "
                f"{field} is {shortest}"
            )
        return problems

    def _threshold_problems(self) -> list[str]:
        """An absolute effective-length threshold for an accuracy is at most 1."""
        chosen = self.eval.effective_length
        scored = METRICS.get(self.task.metric)
        if chosen is None or chosen.threshold is None or scored is None:
            return []
        if not scored.lower_is_better and chosen.threshold > 1:
            return [
                f"eval.effective_length.threshold is an {scored.name} here (task "
                f"{short_repr(self.task.name)}): at most 1, not {chosen.threshold:g}"
            ]
        return []

    def _protocol_problems(self) -> list[str]:
        """The sliding and document protocols: language modelling only; sliding with a
        stride that fits; decode: posbench models only."""
        task = TASKS[self.task.name]
        problems = [
            f"eval.protocols: {short_repr(protocol)} applies to language modelling, not "
            f"{short_repr(task.name)}"
            for protocol in self.eval.protocols
            if protocol not in ("nonoverlapping", "decode")
            and task.kind is not Kind.LANGUAGE_MODELLING
        ]
        if "decode" in self.eval.protocols and self.model.hf is not None:
            problems.append(
                "eval.protocols: 'decode' runs posbench's own KV cache (worker.decode) on "
                "posbench models; an hf: model is scored in one pass per window"
            )
        if self.eval.bos and self.model.hf is None:
            problems.append(
                "eval.bos applies to hf: models (a tokenizer's beginning-of-sequence token); "
                "a posbench model's document windows start with the document separator"
            )
        problems += key_token_problems(self.eval.key_tokens, task, self.train.length)
        if "sliding" not in self.eval.protocols:
            return problems
        if self.eval.stride is None:
            problems.append("eval.stride is required with the 'sliding' protocol")
        elif self.eval.stride > min(self.eval.lengths):
            problems.append(
                f"eval.stride = {self.eval.stride} exceeds the shortest evaluation length "
                f"{min(self.eval.lengths)}"
            )
        return problems

    def _encoding_problems(self) -> list[str]:
        """Each encoding's own rules for this model, and the scalings it must carry (an
        hf: model's config is checked where it is read: ``source_problem``)."""
        problems = []
        scalings = [v for v in self.eval.variants if v.method != "none"]
        if (
            scalings
            and self.model.hf is None
            and not any(REGISTRY[e.name].scalable for e in self.encodings)
        ):
            scalable = ", ".join(n for n, e in REGISTRY.items() if e.scalable)
            problems.append(
                f"eval.variants: {short_repr(scalings[0].label)} scales RoPE and applies "
                f"to {scalable}; "
                "this study trains none of them"
            )
        fit = Fit(
            self.model.head_dim, self.train.length, max(self.eval.lengths), self.model.n_layers
        )
        for encoding in self.encodings:
            entry = info(encoding.name)
            problems += [
                f"encodings: {encoding.label}: {problem}"
                for problem in entry.problems(encoding.resolved_params, fit)
            ]
            width = entry.rotary_width(self.model.head_dim, encoding.resolved_params)
            refused = entry.scaling_problem(encoding.resolved_params)
            if scalings and refused:
                problems.append(
                    f"eval.variants: {short_repr(scalings[0].label)} with {encoding.label}: "
                    f"{refused}"
                )
                continue
            for variant in scalings if entry.scalable else []:
                scaling = SCALINGS[variant.method]
                resolved = scaling.resolve(variant.params, variant.label)
                problems += [
                    f"eval.variants: {short_repr(variant.label)} with {encoding.label}: {problem}"
                    for problem in scaling.width_problems(resolved, width, "it")
                ]
        return problems

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
        if self.model.hf is None and not any(REGISTRY[e.name].scalable for e in self.encodings):
            return out
        labels = {v.label for v in self.eval.variants}
        for method, scaling in SCALINGS.items():  # each scaling's first note, in its order
            notes = [
                scaling.notes(
                    v.label, scaling.resolve(v.params, v.label), self.train.length, labels
                )
                for v in self.eval.variants
                if v.method == method and scaling.notes
            ]
            out += next((found for found in notes if found), [])
        return out

    def source_problem(self, sources: SourcePolicy, models: ModelPolicy) -> str | None:
        """Why this service may not read the study's data (``sources``: the corpus rules)
        or its hf: model (``models``: the models roots, the hub switch), or None: the
        caller's settings, checked at submit and by ``posbench run``."""
        return self.task.source_problem(sources) or model_source_problem(self, models)

    # -- runs ---------------------------------------------------------------------------------

    def runs(self) -> list[RunSpec]:
        if self.model.hf is not None:  # one run: the model itself
            encoding = HfEncoding(model=self.model.hf)
            seed = self.seeds[0]
            return [
                RunSpec(
                    encoding=encoding,
                    seed=seed,
                    config_hash=self.config_hash(encoding, seed),
                    train_hash=None,
                )
            ]
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

    def _training_payload(self, encoding: EncodingSpec | HfEncoding, seed: int) -> dict[str, Any]:
        # Reporting, checkpointing and validation change no weight of the trained model.
        reporting = {"checkpoint_every", "progress_every", "val_every", "val_tokens"}
        train = self.train.model_dump(exclude=reporting)
        # Fields added later enter the payload only when set away from their default,
        # so every earlier run keeps its hash (and is still reused).
        if train["grad_accum"] == 1:
            del train["grad_accum"]
        if train["min_length"] is None:
            del train["min_length"]
        if train["optimizer"] == "adamw":
            del train["optimizer"]
        if self.model.hf is not None:  # nothing trained: the model's original context
            train = {"length": self.train.length}
        return {
            "results_version": RESULTS_VERSION,
            "task": {"name": self.task.name, "params": self.task.params},
            "model": self.model.identity(),
            "train": train,
            "encoding": {"name": encoding.name, "params": encoding.resolved_params},
            "seed": seed,
        }

    @staticmethod
    def _digest(payload: dict[str, Any]) -> str:
        canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str)
        return hashlib.sha256(canonical.encode()).hexdigest()[:24]

    def config_hash(self, encoding: EncodingSpec | HfEncoding, seed: int) -> str:
        """Stable hash of everything that changes a run's results (not the study's name,
        nor the other encodings or seeds), RESULTS_VERSION included."""
        evaluation = self.eval.model_dump(mode="json", exclude={"order_probe"})
        for variant in evaluation["variants"]:
            if not variant["params"]:
                del variant["params"]
            if variant["finetune"] is None:  # added later: absent, so old hashes hold
                del variant["finetune"]
            if not variant["logn"]:
                del variant["logn"]
        # Added later: absent at their defaults, so old hashes hold.
        if evaluation["effective_length"] is None:
            del evaluation["effective_length"]
        if evaluation["min_document_bytes"] is None:
            del evaluation["min_document_bytes"]
        if evaluation["key_tokens"] is None:
            del evaluation["key_tokens"]
        elif evaluation["key_tokens"]["finder"] == "model":
            del evaluation["key_tokens"]["finder"], evaluation["key_tokens"]["ngram"]
        if not evaluation["bos"]:
            del evaluation["bos"]
        if evaluation["cache_policy"] == "keep":
            del evaluation["cache_policy"]
        if evaluation["window"] is None:
            del evaluation["window"]
        if not evaluation["sinks"]:
            del evaluation["sinks"]
        if not evaluation["diagnostics"]:
            del evaluation["diagnostics"]
        # The order probe adds summaries but changes no point of the curve.
        return self._digest({**self._training_payload(encoding, seed), "eval": evaluation})

    def train_hash(self, encoding: EncodingSpec | HfEncoding, seed: int) -> str:
        """Stable hash of what the trained model depends on: the config hash less the
        evaluation settings. Runs that share it share their trained model (a study that
        only evaluates differently trains nothing again), and it stamps checkpoints."""
        return self._digest({**self._training_payload(encoding, seed), "training_only": True})

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json", exclude_defaults=False), sort_keys=False)


# -- loading and error wording ----------------------------------------------------------------
