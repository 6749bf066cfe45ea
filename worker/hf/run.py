"""One run of a study whose model is an hf: model: load it, check the study against its
config, evaluate it at every planned point (its variants set on its config), probe it,
and record what was loaded. Nothing is trained: the run's training record is empty."""

from __future__ import annotations

from typing import Any

import torch

from core.catalog.hf_models import NO_MODELS, HfModelError, ModelPolicy
from core.spec import RunSpec, StudySpec
from core.spec.hf import model_problems
from worker.data.base import Task
from worker.data.synthetic import SyntheticTask
from worker.evaluate import evaluate
from worker.hf.answers import TokenizedSynthetic
from worker.hf.loader import LoadedModel, load_model
from worker.hf.tokens import TokenizedLanguageModelling, tokenized
from worker.outcome import RunResult, probe_order, provenance
from worker.training import NO_HOOKS, RunCancelled, RunHooks, TrainResult


def checked_model(spec: StudySpec, models: ModelPolicy) -> LoadedModel:
    """The study's hf: model, loaded, with the spec checked against its config (the
    service checks a local folder's at submit; a hub id's is known here first)."""
    if spec.model.hf is None:
        raise ValueError("the study's model is not an hf: model")
    loaded = load_model(spec.model.hf, models)
    problems = model_problems(spec, loaded.facts)
    if problems:
        raise HfModelError("; ".join(problems))
    return loaded


def in_tokens(
    task: Task, tokenizer: Any, bos: bool = False
) -> TokenizedSynthetic | TokenizedLanguageModelling:
    """The study's prepared task in the model's tokens: a synthetic task's examples
    rendered in them, or the corpus tokenized (``bos``: the document protocol's windows
    start with the tokenizer's BOS)."""
    if isinstance(task, SyntheticTask):
        return TokenizedSynthetic(task, tokenizer)
    return tokenized(task, tokenizer, bos)


def run_hf(
    spec: StudySpec,
    run: RunSpec,
    *,
    task: Task,
    device: torch.device,
    hooks: RunHooks = NO_HOOKS,
    skip_evaluations: set[tuple[str, str, int]] | None = None,
    models: ModelPolicy = NO_MODELS,
):
    """Evaluate the study's hf: model (``run``: its one run) at every planned point but
    those in ``skip_evaluations``; ``task`` is the study's task, prepared."""
    loaded = checked_model(spec, models)
    text = in_tokens(task, loaded.tokenizer, spec.eval.bos)
    text.check_plan(spec.eval, spec.train.length if spec.eval.order_probe else None)
    rows = evaluate(
        loaded.model,
        text,
        spec.eval,
        train_length=spec.train.length,
        scalable=loaded.facts.scalable,
        device=device,
        hooks=hooks,
        skip=skip_evaluations,
        seed=run.seed,
    )
    if hooks.should_stop():
        raise RunCancelled("cancelled after evaluation, before the order probe")
    order = probe_order(loaded.model, text, spec, run, device)
    record = {**loaded.provenance, **text.describe()}
    return RunResult(
        label=run.encoding.label,
        encoding=run.encoding.name,
        params=run.encoding.resolved_params,
        seed=run.seed,
        config_hash=run.config_hash,
        train=TrainResult(steps=0, final_loss=None, resumed_from=0, seconds=0.0),
        evaluations=rows,
        provenance=provenance(device, run.seed, text.fingerprint) | {"model": record},
        order=order,
    )
