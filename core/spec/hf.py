"""The rules of a study whose model is a HuggingFace model (``model: {hf: NAME}``), and of
one that trains (every other study).

An hf: model is evaluated as it is: no training (``train.steps`` 0, the default then,
and no other training setting), no encodings (the model brings its own), one seed
(evaluation draws nothing at random but the order probe's shuffles), a task whose
examples are text (the catalogue entry's ``text``: the model reads them in its own
tokens, ``worker.hf.answers`` for the synthetic tasks), and no fine-tuned variant.
``train.length`` is required: the model's original context, which an 'auto' factor and
the "beyond training" marks measure from.

What only the model's config can say (RoPE or not, how much of a head it rotates, its
context) is checked against the config where it can be read: at submit for a local
folder (``model_source_problem``, under the operator's rules), and by the loader on the
worker for every model (``model_problems``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from core.catalog.encodings import NO_SCALING, SCALINGS
from core.catalog.hf_models import HfModelError, ModelFacts, ModelPolicy, local_facts
from core.catalog.params import short_repr
from core.catalog.tasks import TASKS
from core.spec.base import MAX_TRAIN_LENGTH

if TYPE_CHECKING:
    from core.spec.study import StudySpec

# What an hf: model's train section may hold: the original context, and no training.
HF_TRAIN_KEYS = ("length", "steps")


def _is_hf(data: dict[str, Any]) -> bool:
    model = data.get("model")
    return isinstance(model, dict) and model.get("hf") is not None


def with_model_length(data: Any, policy: ModelPolicy) -> tuple[Any, str | None]:
    """An hf: spec mapping that gives no ``train.length``, with the model's original
    context from its folder's config (``original_max_position_embeddings`` where its
    rope parameters name one, else ``max_position_embeddings`` or GPT-2's
    ``n_positions``), and a line that says which value was used and why; any other
    mapping unchanged, with None (a hub id's config is read on the worker, so its spec
    gives the length; a folder that cannot be read is refused by the spec's checks)."""
    if not isinstance(data, dict) or not _is_hf(data):
        return data, None
    train = data.get("train", {})
    if not isinstance(train, dict) or "length" in train:
        return data, None
    try:
        _, facts = local_facts(str(data["model"]["hf"]), policy)
    except HfModelError:
        return data, None
    if facts is None or facts.context is None:
        return data, None
    told = (
        f"train.length = {facts.context}, the model's original context, from its config's "
        f"{facts.context_key} (give train.length to override it)"
    )
    return {**data, "train": {**train, "length": facts.context}}, told


def hf_defaults(data: Any) -> Any:
    """A spec mapping of an hf: model with its defaults: no encodings, no training steps.
    ``train.length`` must be given (the model's original context)."""
    if not isinstance(data, dict) or not _is_hf(data):
        return data
    train = data.get("train")
    if not isinstance(train, dict) or "length" not in train:
        raise ValueError(
            "train.length is required with a hub model.hf (a folder's config gives it "
            "itself): the model's original context (its config's max_position_embeddings, "
            "n_positions for GPT-2, or original_max_position_embeddings where its rope "
            "parameters name one)"
        )
    return {**data, "encodings": data.get("encodings", []), "train": {"steps": 0, **train}}


def trained_problems(spec: StudySpec) -> list[str]:
    """A study that trains its models: encodings to train, steps, a length it can train at."""
    problems = []
    if not spec.encodings:
        problems.append("encodings: must have at least 1 item")
    if spec.train.steps < 1:
        problems.append(
            f"train.steps = {spec.train.steps}: must be greater than or equal to 1 (0 steps: "
            "only a model.hf is evaluated without training)"
        )
    if spec.train.length > MAX_TRAIN_LENGTH:
        problems.append(
            f"train.length = {spec.train.length}: must be less than or equal to "
            f"{MAX_TRAIN_LENGTH} (the longest training; a model.hf's context may be longer)"
        )
    return problems


def hf_problems(spec: StudySpec) -> list[str]:
    """What an hf: model's study may not ask for, from the spec alone."""
    problems = []
    if spec.encodings:
        problems.append(
            "encodings: model.hf brings its own position encoding; leave encodings out "
            "(variants apply RoPE scalings to it)"
        )
    defaults = type(spec.train).model_fields
    changed = [
        name
        for name, field in defaults.items()
        if name not in HF_TRAIN_KEYS and getattr(spec.train, name) != field.default
    ]
    if spec.train.steps:
        changed.insert(0, "steps")
    if changed:
        problems.append(
            f"train.{changed[0]}: model.hf is evaluated as it is, not trained; the train "
            "section takes only length (the model's original context)"
        )
    if len(spec.seeds) > 1:
        problems.append(
            "seeds: model.hf is evaluated once (its numbers do not depend on a seed); give one seed"
        )
    if not TASKS[spec.task.name].text:
        readable = ", ".join(name for name, entry in TASKS.items() if entry.text)
        problems.append(
            f"task {short_repr(spec.task.name)}: its examples are not text, and model.hf "
            f"reads a task's text in its own tokens (tasks for model.hf: {readable})"
        )
    tuned = [v.label for v in spec.eval.variants if v.finetune is not None]
    if tuned:
        problems.append(
            f"eval.variants: {short_repr(tuned[0])} fine-tunes; model.hf is evaluated "
            "without fine-tuning"
        )
    return problems


def model_problems(spec: StudySpec, facts: ModelFacts) -> list[str]:
    """What keeps the study from evaluating a model with these config ``facts``: the
    original context it names, RoPE scalings on a model without RoPE or rotating too few
    dimensions for them."""
    problems = []
    if spec.train.length != facts.context:
        problems.append(
            f"train.length = {spec.train.length}, but the model's config says its original "
            f"context is {facts.context} ({facts.context_key}); give train.length: "
            f"{facts.context}"
        )
    scalings = [v for v in spec.eval.variants if v.method != NO_SCALING]
    if scalings and (not facts.scalable or facts.rotary is None):
        problems.append(
            f"eval.variants: {short_repr(scalings[0].label)} scales RoPE; the model is "
            f"{facts.described}, without RoPE"
        )
        return problems
    width = facts.rotary.rotary_dim if facts.rotary is not None else 0
    for variant in scalings:
        scaling = SCALINGS[variant.method]
        resolved = scaling.resolve(variant.params, variant.label)
        problems += [
            f"eval.variants: {short_repr(variant.label)}: {problem}"
            for problem in scaling.width_problems(resolved, width)
        ]
    return problems


def model_source_problem(spec: StudySpec, policy: ModelPolicy) -> str | None:
    """Why this service may not evaluate the study's hf: model (a folder outside the
    models roots, the hub turned off, a config that does not fit the spec), or None; a
    study that trains its own models has none. A hub id's config is checked on the
    worker, once it has it."""
    if spec.model.hf is None:
        return None
    try:
        _, facts = local_facts(spec.model.hf, policy)
    except HfModelError as err:
        return str(err)
    problems = model_problems(spec, facts) if facts is not None else []
    return "; ".join(problems) or None
