"""What a study costs the service, estimated from its spec alone: the tokens it trains
and evaluates, its compute (training and evaluation) and its checkpoints' size - what the
Submit page shows and the quotas bound (``jobs.quotas``). A mixin of ``StudySpec``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from core.catalog.encodings import REGISTRY
from core.metrics import Kind

if TYPE_CHECKING:
    from core.spec.study import StudySpec

# float32 weights and AdamW's two float32 moments (exp_avg, exp_avg_sq).
CHECKPOINT_BYTES_PER_PARAMETER = 12
# An hf: model's (parameters, layers, width), from its config (ModelFacts).
ModelSizes = tuple[int, int, int]


class StudyCost:
    """The estimates of a study spec (``self`` is a StudySpec)."""

    def eval_tokens(self: StudySpec) -> int:
        """Tokens one run's evaluation feeds the model, at most (every variant counted):
        a sliding window of ``length`` scores ``stride`` of them."""
        spec, total = self.eval, 0
        language_model = self.task.kind is Kind.LANGUAGE_MODELLING
        for length in spec.lengths:
            scored = spec.tokens if language_model else spec.examples * length
            for protocol in spec.protocols:
                windows = length / spec.stride if protocol == "sliding" and spec.stride else 1
                total += round(scored * windows)
        return total * len(spec.variants)

    def finetune_tokens(self: StudySpec) -> int:
        """Tokens the fine-tuned variants read, over every run they apply to (rotary)."""
        scalable = sum(REGISTRY[e.name].scalable for e in self.encodings)
        total = 0
        for variant, tuning in self.finetunings():
            # Without a scaling, every encoding is fine-tuned; with one, rotary ones.
            encodings = len(self.encodings) if variant.method == "none" else scalable
            total += encodings * len(self.seeds) * tuning.steps * tuning.tokens_per_step
        return total

    def train_tokens(self: StudySpec) -> int:
        """Tokens the study's training reads, over every run (fine-tuning not counted)."""
        return len(self.encodings) * len(self.seeds) * self.train.steps * self.train.tokens_per_step

    def training_flops(self: StudySpec) -> float:
        """The study's training compute: 6 x parameters x tokens (training and fine-tuning,
        every run; an hf: model trains nothing)."""
        if self.model.hf is not None:
            return 0.0
        return 6.0 * self.model.parameters * (self.train_tokens() + self.finetune_tokens())

    def eval_flops(self: StudySpec, sizes: ModelSizes | None = None) -> float:
        """The study's evaluation compute, every run, variant, protocol and length: the
        tokens the model reads (a sliding window reads length / stride of them per scored
        token; the key tokens' short-context sub-windows, short_context / their stride
        more; the order probe, the tokens twice at the training length), each costing 2 x
        parameters plus attention's 2 x layers x width x the window it sees (audit F1:
        evaluation escaped every quota). ``sizes``: an hf: model's, from its config."""
        parameters, layers, width = sizes or (
            self.model.parameters,
            self.model.n_layers,
            self.model.d_model,
        )

        def cost(tokens: float, window: int) -> float:
            return tokens * (2.0 * parameters + 2.0 * layers * width * window)

        spec, per_run = self.eval, 0.0
        language_model = self.task.kind is Kind.LANGUAGE_MODELLING
        keys = spec.key_tokens if language_model else None
        for length in spec.lengths:
            scored = spec.tokens if language_model else spec.examples * length
            for protocol in spec.protocols:
                sliding = protocol == "sliding" and spec.stride
                per_run += cost(scored * length / spec.stride if sliding else scored, length)
                if keys is not None:
                    short = keys.short_context or self.train.length
                    per_run += cost(scored * short / (keys.stride or max(1, short // 4)), short)
        per_run *= len(spec.variants)
        if spec.order_probe:
            per_run += cost(2 * spec.tokens, self.train.length)
        return per_run * len(self.runs())

    def estimated_flops(self: StudySpec, sizes: ModelSizes | None = None) -> float:
        """The study's compute: training (6 x parameters x tokens) and evaluation
        (``eval_flops``): what the Submit page shows and what POSBENCH_MAX_STUDY_FLOPS
        bounds. ``sizes``: an hf: model's (parameters, layers, width), from its config."""
        return self.training_flops() + self.eval_flops(sizes)

    def estimated_checkpoint_bytes(self: StudySpec) -> int:
        """The size of one run's checkpoint, estimated as 12 bytes per parameter: float32
        weights and AdamW's two float32 moments (the parameters as the FLOPs estimate
        counts them; the RNG states and the loss curve add little): what
        POSBENCH_MAX_CHECKPOINT_BYTES bounds. A fine-tuned variant's is as large. An hf:
        model writes none."""
        if self.model.hf is not None:
            return 0
        return CHECKPOINT_BYTES_PER_PARAMETER * self.model.parameters
