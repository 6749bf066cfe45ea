"""Extrapolation evaluation: one trained model, every (variant x protocol x length).

For language modelling the metrics are mean loss (nats per byte; per token of its
tokenizer for an hf: model), perplexity and bits per byte (the scored targets' nats
over ln 2 x the bytes of text they cover: loss / ln 2 for byte-level models), plus the
loss in log-spaced bins of position inside the window;
synthetic tasks report exact-match accuracy (per group too, e.g. a pass key's
depth). Every row records tokens/s and peak memory. A length an encoding cannot
represent (a learned table past its end) is recorded as *not applicable*, never
clamped and never a crash.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from core.metrics import Kind, diagnostics, kind_of
from core.results_schema import Evaluation, PositionBin, bounded_text
from core.spec import EvalSpec, VariantSpec
from worker import liveness
from worker.data.base import Batch, Task
from worker.decode import DecodeTally, decode_scores
from worker.diagnostics import AttentionDiagnostics, AttentionProbe, attribute_set
from worker.key_tokens import KeyTokenTally
from worker.memory import (
    available_bytes,
    bound_heap_for,
    eval_batch_size,
    halving_on_oom,
    peak_resident_bytes,
    reset_peak_resident,
)
from worker.model import Transformer
from worker.training import NO_HOOKS, RunCancelled, RunHooks

NONE = VariantSpec()


def log_bins(length: int) -> list[tuple[int, int]]:
    """[0, 1), [1, 2), [2, 4), [4, 8), ... up to ``length``: positions on a log scale."""
    edges = [0, 1]
    while edges[-1] < length:
        edges.append(min(length, edges[-1] * 2))
    return [(a, b) for a, b in itertools.pairwise(edges) if a < length]


def _reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        reset_peak_resident()


def _peak_memory(device: torch.device) -> int:
    """Since the last reset: the CUDA allocator's peak, or on the CPU the process'
    peak resident set (model and all; what this length needed on top of it shows as
    the difference between lengths)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return peak_resident_bytes()


class _Accumulator:
    def __init__(self, length: int) -> None:
        self.loss_sum = 0.0
        self.tokens = 0
        self.text_bytes: int | None = None  # bytes the scored targets cover (tokenizers)
        self.position_loss = torch.zeros(length, dtype=torch.float64)
        self.position_tokens = torch.zeros(length, dtype=torch.float64)
        self.inputs = 0
        self.exact = 0
        self.examples = 0
        self.right_tokens = 0
        self.group_exact: dict[str, list[int]] = {}
        # RULER's part metrics: the sum over examples of the fraction of their answer's
        # parts right, and the examples with at least one part right.
        self.parts_all = 0.0
        self.parts_any = 0

    def add(self, logits: torch.Tensor, batch: Batch) -> None:
        logits = logits.float()
        token_loss = F.cross_entropy(
            logits.flatten(0, 1), batch.targets.flatten(), reduction="none"
        ).view_as(batch.targets)
        scored = (
            batch.scored
            if batch.scored is not None
            else torch.ones_like(batch.targets, dtype=torch.bool)
        )
        masked = token_loss * scored
        self.inputs += batch.inputs.numel()
        self.loss_sum += float(masked.sum(dtype=torch.float64))
        self.tokens += int(scored.sum())
        if batch.target_bytes is not None:
            covered = int((batch.target_bytes * scored).sum(dtype=torch.int64))
            self.text_bytes = (self.text_bytes or 0) + covered
        self.position_loss += masked.sum(0).double().cpu()
        self.position_tokens += scored.sum(0).double().cpu()
        if batch.scored is not None:
            hits = logits.argmax(-1) == batch.targets
            self.right_tokens += int((hits & scored).sum())
            correct = hits | ~scored
            exact = correct.all(-1).cpu()
            self.exact += int(exact.sum())
            self.examples += len(exact)
            self._add_parts(correct, batch, exact)
            for label, hit in zip(batch.groups or [], exact.tolist(), strict=False):
                if label:
                    tally = self.group_exact.setdefault(label, [0, 0])
                    tally[0] += int(hit)
                    tally[1] += 1

    def _add_parts(self, correct: torch.Tensor, batch: Batch, exact: torch.Tensor) -> None:
        """string_match_all and string_match_part (Hsieh et al., 2024) under teacher
        forcing: a part is right when the argmax at every target carrying a byte of it is
        that target; an answer of one part is right when it all is (exact match)."""
        if batch.parts is None:
            self.parts_all += float(exact.sum())
            self.parts_any += int(exact.sum())
            return
        inside = batch.parts  # [B, T, P]
        present = inside.any(1)  # [B, P]: the parts each row has
        right = (correct.unsqueeze(-1) | ~inside).all(1) & present
        fraction = right.sum(-1).double() / present.sum(-1).clamp(min=1)
        self.parts_all += float(fraction.sum())
        self.parts_any += int(right.any(-1).sum())

    def bins(self) -> list[PositionBin]:
        out = []
        for start, end in log_bins(len(self.position_loss)):
            count = float(self.position_tokens[start:end].sum())
            if count:
                loss = float(self.position_loss[start:end].sum()) / count
                out.append(PositionBin(start, end, loss, int(count)))
        return out


def _run_batches(
    model: Transformer,
    batches: Iterator[Batch],
    length: int,
    device: torch.device,
    should_stop: Callable[[], bool] | None = None,
    no_grad: Callable[[], Any] = torch.inference_mode,
    scores: Callable[[Batch], torch.Tensor] | None = None,
    key_tokens: KeyTokenTally | None = None,
) -> _Accumulator:
    """The accumulated scores of ``batches``: the model's logits of each batch's inputs in
    one pass, or what ``scores`` gives for the batch (the decode protocol); with
    ``key_tokens``, each batch's targets scored again with their context cut short."""
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    accumulator = _Accumulator(length)
    with no_grad(), autocast:
        for batch in batches:
            # Every batch: a long length may take minutes; its partial sums are dropped.
            if should_stop is not None and should_stop():
                raise RunCancelled(f"cancelled while evaluating at length {length}")
            batch = batch.to(device)
            logits = model(batch.inputs) if scores is None else scores(batch)
            accumulator.add(logits, batch)
            if key_tokens is not None:
                # The short passes draw nothing from the generators the full ones read,
                # and the attention probe reads the full ones only.
                with _rng_kept(device), attribute_set(model, "probe", None):
                    key_tokens.add(model, batch.inputs, batch.targets, logits, batch.scored)
            liveness.touch()
    return accumulator


def _rng_kept(device: torch.device) -> contextlib.AbstractContextManager:
    """The random generators restored on leaving: the CPU's, and an accelerator's (CUDA,
    MPS: a generator of its own)."""
    accelerator = device.type != "cpu"
    return torch.random.fork_rng(
        devices=[device] if accelerator else [], device_type=device.type if accelerator else None
    )


@contextlib.contextmanager
def _seeded(point: str, device: torch.device) -> Iterator[None]:
    """Random draws inside the model (randomized positions are sampled at evaluation too,
    as in Ruoss et al.'s code) come from generators seeded by ``point`` (the run's seed
    and the point of the plan): a rerun or a resumed run measures the same thing, and
    the generators training draws from are restored afterwards."""
    seed = zlib.crc32(point.encode())
    with _rng_kept(device):
        torch.random.default_generator.manual_seed(seed)
        if device.type == "cuda":
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)
        elif device.type != "cpu":
            torch.get_device_module(device.type).manual_seed(seed)
        yield


def validation_loss(
    model: Transformer,
    task: Task,
    *,
    length: int,
    tokens: int,
    batch_tokens: int,
    device: torch.device,
    seed: int = 0,
    longest: int | None = None,
) -> float:
    """Mean loss of the model (in training: its weights now) on ``tokens`` held-out
    targets at ``length``, the same targets at every call (synthetic tasks: the first
    ``tokens // length`` evaluation examples); with ``longest`` (the study's longest
    evaluation length) the stretches the evaluation scores, so the last validation and
    the evaluation at this length agree when their budgets do. The model's mode and the
    random generators training draws from are left as they were, so validating changes
    no later step."""
    training = model.training
    model.eval()

    def run(batch_size: int) -> _Accumulator:
        batches = task.eval_batches(
            length,
            protocol="nonoverlapping",
            batch_size=batch_size,
            tokens=tokens,
            examples=max(1, tokens // length),
            longest=longest or length,
        )
        with _seeded(f"{seed}/validation/{length}", device):
            # no_grad, not inference_mode: tensors the model keeps (cached tables) must
            # stay usable by the training steps that follow.
            return _run_batches(model, batches, length, device, no_grad=torch.no_grad)

    try:
        size = eval_batch_size(model.config, length, batch_tokens, available_bytes(device))
        result = halving_on_oom(run, size)
    finally:
        model.train(training)
    return result.loss_sum / max(1, result.tokens)


def _decode_scores(
    model: Transformer, spec: EvalSpec, tally: DecodeTally, answers: bool
) -> Callable[[Batch], torch.Tensor]:
    """The decode protocol's logits of a batch (``worker.decode.decode_scores``), with the
    cache options of the spec: ``answers`` generated greedily (synthetic tasks), or
    windows teacher-forced (language modelling, whatever targets it scores)."""

    def scores(batch: Batch) -> torch.Tensor:
        return decode_scores(
            model,
            batch.inputs,
            batch.scored if answers else None,
            tally,
            policy=spec.cache_policy,
            window=spec.window,
            sinks=spec.sinks,
        )

    return scores


def evaluate_in_distribution(
    model: Transformer, task: Task, length: int, *, examples: int = 200
) -> Evaluation:
    """The trained model itself (no variant) on ``examples`` of the task's evaluation
    examples at its training ``length``, non-overlapping windows, on the CPU: how well it
    learnt the task (the learnability tests, ``studies/learning_curve.py``)."""
    return evaluate_length(
        model,
        task,
        EvalSpec(lengths=[length], examples=examples),
        length=length,
        protocol="nonoverlapping",
        variant=VariantSpec(),
        train_length=length,
        device=torch.device("cpu"),
    )


def evaluate_length(
    model: Transformer,
    task: Task,
    spec: EvalSpec,
    *,
    length: int,
    protocol: str,
    variant: VariantSpec,
    train_length: int,
    device: torch.device,
    seed: int = 0,
    should_stop: Callable[[], bool] | None = None,
) -> Evaluation:
    row = Evaluation(variant=variant.label, protocol=protocol, length=length)
    limit = model.encoding.max_length
    if limit is not None and length > limit:
        row.not_applicable = f"not applicable: {model.encoding.name} positions end at {limit}" + (
            f" (L={train_length})" if limit == train_length else ""
        )
        return row
    row.factor = variant.factor_at(length, train_length)
    bound_heap_for(length)
    batch_size = eval_batch_size(model.config, length, spec.batch_tokens, available_bytes(device))
    _reset_peak_memory(device)
    started = time.perf_counter()

    # Only language modelling reads documents (the spec refuses the protocol elsewhere).
    document = {"min_document_bytes": spec.min_document_bytes} if protocol == "document" else {}

    # Decoding reads the nonoverlapping windows (or examples), one token at a time.
    tally = DecodeTally()
    answers = kind_of(task.metric) is Kind.ANSWER
    scores = _decode_scores(model, spec, tally, answers) if protocol == "decode" else None

    # Key tokens: language modelling with eval.key_tokens only.
    lm = kind_of(task.metric) is Kind.LANGUAGE_MODELLING
    found = KeyTokenTally.of(spec.key_tokens, train_length) if lm else None

    # Attention diagnostics read every full pass (not decoding's steps); log-n scaling.
    probe = AttentionProbe(train_length) if spec.diagnostics and protocol != "decode" else None
    logn = train_length if variant.logn else None

    def run(batch_size: int) -> _Accumulator:
        tally.reset()
        if found is not None:
            found.reset()
        if probe is not None:
            probe.reset()
        batches = task.eval_batches(
            length,
            protocol="nonoverlapping" if protocol == "decode" else protocol,
            batch_size=batch_size,
            tokens=spec.tokens,
            examples=spec.examples,
            stride=spec.stride,
            longest=max(spec.lengths),
            **document,
        )
        with (
            _seeded(f"{seed}/{variant.label}/{protocol}/{length}", device),
            attribute_set(model, "logn_length", logn),
            attribute_set(model, "probe", probe),
        ):
            options = {"scores": scores, "key_tokens": found}
            if variant.method == "none":
                return _run_batches(model, batches, length, device, should_stop, **options)
            with model.scaled(variant.method, row.factor, train_length, **variant.params):
                return _run_batches(model, batches, length, device, should_stop, **options)

    result = halving_on_oom(run, batch_size)
    elapsed = time.perf_counter() - started
    row.tokens = result.tokens
    # Throughput counts every token the model read, scored or not.
    row.tokens_per_second = result.inputs / max(elapsed, 1e-9)
    row.peak_memory_bytes = _peak_memory(device)
    if protocol == "decode":
        row.decode_tokens_per_second = tally.tokens_per_second
        row.kv_cache_bytes = tally.kv_bytes
    if probe is not None and (diagnosed := probe.result()) is not None:
        _store_diagnostics(row, diagnosed)
    _score(row, result, task, found)
    return row


def _score(row: Evaluation, result: _Accumulator, task: Task, found: KeyTokenTally | None) -> None:
    """The point's metrics from its accumulated scores (and key tokens, when counted)."""
    row.loss = result.loss_sum / max(1, result.tokens)
    if kind_of(task.metric) is Kind.LANGUAGE_MODELLING:
        row.perplexity = math.exp(row.loss)
        # Per byte of text whatever the tokenizer: models with different ones compare.
        per_byte = result.loss_sum / result.text_bytes if result.text_bytes else row.loss
        row.bits_per_byte = per_byte / math.log(2)
        row.position_bins = result.bins()
        if found is not None:
            row.key_token_fraction = found.fraction
            row.key_token_perplexity = found.perplexity
            row.key_token_gain = found.mean_gain
    else:
        row.accuracy = result.exact / max(1, result.examples)
        # Partial success: exact match drops to 0 as soon as one answer byte is wrong.
        row.token_accuracy = result.right_tokens / max(1, result.tokens)
        # RULER's recall over an answer's parts, and whether any part is right.
        row.string_match_all = result.parts_all / max(1, result.examples)
        row.string_match_part = result.parts_any / max(1, result.examples)
        row.groups = {
            label: hit / total for label, (hit, total) in sorted(result.group_exact.items())
        }


def _store_diagnostics(row: Evaluation, found: AttentionDiagnostics) -> None:
    """The point's diagnostics: each averaged over layers and heads in its column, and
    per layer (and head, where affordable) in ``row.attention``."""
    summary, layers, heads = found.summary(), found.layers(), found.heads()
    for metric in diagnostics():
        setattr(row, metric.column, summary[metric.diagnostic])
    row.attention = {
        "queries": found.queries,
        "layers": {m.name: layers[m.diagnostic] for m in diagnostics()},
        "heads": None if heads is None else {m.name: heads[m.diagnostic] for m in diagnostics()},
    }


def evaluate(
    model: Transformer,
    task: Task,
    spec: EvalSpec,
    *,
    train_length: int,
    scalable: bool,
    device: torch.device,
    hooks: RunHooks = NO_HOOKS,
    skip: set[tuple[str, str, int]] | None = None,
    seed: int = 0,
    model_for: Callable[[VariantSpec], Transformer | str] | None = None,
) -> list[Evaluation]:
    """Evaluate at every point of the plan, telling ``hooks`` each row; ``skip`` holds
    (variant, protocol, length) keys already stored (a resumed run does not redo them).
    ``seed`` (the run's) seeds any random draw the model makes, per point of the plan.
    ``model_for`` gives the model each variant evaluates, or why it has none (asked
    only for a point still to do); without it every variant evaluates ``model``, and a
    fine-tuned variant is an error (``worker.training.finetune.FineTuner`` makes them)."""
    model.to(device)
    model.eval()
    rows = []
    for variant, protocol, length in spec.plan(scalable):
        if skip and (variant.label, protocol, length) in skip:
            continue
        if hooks.should_stop():
            raise RunCancelled(f"cancelled while evaluating, before {variant.label} @ {length}")
        if model_for is not None:
            evaluated = model_for(variant)
        elif variant.finetune is None:
            evaluated = model
        else:
            raise ValueError(f"variant {variant.label!r} evaluates a fine-tuned model")
        if isinstance(evaluated, str):
            row = Evaluation(
                variant.label, protocol, length, not_applicable=bounded_text(evaluated)
            )
        else:
            row = evaluate_length(
                evaluated,
                task,
                spec,
                length=length,
                protocol=protocol,
                variant=variant,
                train_length=train_length,
                device=device,
                seed=seed,
                should_stop=hooks.should_stop,
            )
        rows.append(row)
        hooks.on_evaluation(row)
    return rows
