"""The Submit form: widgets built from the encodings and tasks registries and the spec
schema, read back into a spec mapping (``form``).

Each section draws its widgets and returns its part of the spec. Number inputs take
their bounds from the spec models' fields (``spec_bounds``): a bound changed in the spec
changes the form. What spans fields (min_length <= length) is left to ``parse_spec``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, get_args

import streamlit as st
from pydantic import BaseModel

from core.catalog.encodings import LOGN, NO_SCALING, REGISTRY, SCALINGS, TEMPERATURES
from core.catalog.models import ATTN_IMPLEMENTATIONS, MODEL_PRESETS
from core.catalog.params import Param
from core.catalog.tasks import DEFAULT_TASK, TASKS
from core.spec import PROTOCOLS, QUEUES, EvalSpec, ModelSpec, TrainSpec
from dashboard.common import queue_warning, served_queues
from jobs.routing import preferred_queue

LENGTHS = [2**k for k in range(4, 18)]
FIXED_FACTOR = 4  # the factor offered for a scaling that takes no "auto" one


def _offered(name: str, needs_factor: bool, auto_factor: bool) -> str:
    if not needs_factor:
        return name
    return f"{name}:auto" if auto_factor else f"{name}:{FIXED_FACTOR}"


# Each scaling at its "auto" factor (s = length / L at each length) where it takes one,
# otherwise at a fixed factor; another name for an entry at the same factor (linear: pi)
# is not offered twice.
VARIANTS = [
    _offered(name, s.needs_factor, s.needs_factor and s.auto_factor)
    for name, s in SCALINGS.items()
    if s.same_as is None or not s.needs_factor
]
Keys = Callable[[str], str]  # a widget's name -> its key under the chosen preset


def parse_seeds(text: str) -> list[int]:
    """'0, 1 2' -> [0, 1, 2]: integers separated by commas and/or spaces."""
    return [int(part) for part in re.split(r"[\s,]+", text.strip()) if part]


def _names(items: list[Any]) -> list[str]:
    return [item if isinstance(item, str) else item["name"] for item in items]


def _param_input(param: Param, key: str, given: Any = None) -> Any:
    """An input for one parameter, starting from ``given`` (the preset's value) or the
    default. Returns None for a derived default left as it is."""
    label = f"{param.name}"
    start = param.default if given is None else given
    if param.choices is not None:
        return st.selectbox(
            label, param.choices, index=param.choices.index(start), key=key, help=param.help
        )
    derived = f" (default: {param.derived})" if param.derived else ""
    if param.type is bool:
        return st.checkbox(label, value=bool(start), key=key, help=param.help)
    if param.type is int:
        shown = start if start is not None else int(param.low or 1)
        value = st.number_input(
            label,
            value=int(shown),
            step=1,
            key=key,
            min_value=int(param.low) if param.low is not None else None,
            max_value=int(param.high) if param.high is not None else None,
            help=param.help + derived,
        )
        return None if start is None and value == shown else int(value)
    if param.type is float:
        shown = start if start is not None else float(param.low or 1.0)
        value = st.number_input(
            label,
            value=float(shown),
            key=key,
            format="%g",
            min_value=float(param.low) if param.low is not None else None,
            max_value=float(param.high) if param.high is not None else None,
            help=param.help + derived,
        )
        return None if start is None and value == shown else float(value)
    return st.text_input(label, value=str(start), key=key, help=param.help)


def spec_bounds(model: type[BaseModel], name: str) -> dict[str, Any]:
    """``min_value`` / ``max_value`` for a number input, read from the spec field's
    bounds, so that a bound changed in the spec changes the form."""
    field = model.model_fields[name]
    number = float if float in (field.annotation, *get_args(field.annotation)) else int
    bounds: dict[str, Any] = {}
    for rule in field.metadata:
        if getattr(rule, "gt", None) is not None or getattr(rule, "lt", None) is not None:
            # A number input's bounds are inclusive: a strict bound has no widget form.
            raise TypeError(f"{model.__name__}.{name} has a strict bound; show it unbounded")
        if getattr(rule, "ge", None) is not None:
            bounds["min_value"] = number(rule.ge)
        if getattr(rule, "le", None) is not None:
            bounds["max_value"] = number(rule.le)
    return bounds


def header(base: dict[str, Any], key: Keys) -> dict[str, Any]:
    """The study's name and queue: the base's queue, else the first with live workers
    (gpu, then cpu), with a warning while no live worker serves the one chosen."""
    name_column, queue_column = st.columns([3, 1])
    queue = base.get("queue") or preferred_queue(served_queues())
    spec = {
        "name": name_column.text_input("Study name", base.get("name", "study"), key=key("name")),
        "queue": queue_column.selectbox(
            "Queue",
            QUEUES,
            index=QUEUES.index(queue),
            key=key("queue"),
            help="the workers that train it (posbench worker --queues)",
        ),
    }
    queue_warning(spec["queue"])
    return spec


def task_inputs(
    base: dict[str, Any], key: Keys, task_names: list[str] | None = None
) -> dict[str, Any]:
    """The task (one of ``task_names``, default: every task) and its parameters (only
    those that differ from the defaults)."""
    task_names = task_names or list(TASKS)
    task_default = base.get("task", DEFAULT_TASK)
    task_default = task_default if isinstance(task_default, str) else task_default["name"]
    task = st.selectbox(
        "Task",
        task_names,
        index=task_names.index(task_default),
        key=key("task"),
        format_func=lambda n: f"{n}: {TASKS[n].summary}",
    )
    chosen: dict[str, Any] = {"name": task}
    base_task = base.get("task")
    same = isinstance(base_task, dict) and base_task.get("name", DEFAULT_TASK) == task
    given = base_task if same else {}
    for param in TASKS[task].params:
        value = _param_input(param, key(f"{task}.{param.name}"), given.get(param.name))
        if value is not None and value != param.default:
            chosen[param.name] = value
    return chosen


def _model_input(base: dict[str, Any], key: Keys) -> str | dict[str, Any]:
    """A preset's name, or custom sizes; the attention implementation where it is not
    auto."""
    sizes = [*MODEL_PRESETS, "custom"]
    model = st.selectbox(
        "Model",
        sizes,
        index=sizes.index(base.get("model", "small")),
        key=key("model"),
        format_func=lambda n: (
            n
            if n == "custom"
            else f"{n} (d={MODEL_PRESETS[n]['d_model']}, "
            f"{MODEL_PRESETS[n]['n_layers']} layers, "
            f"{MODEL_PRESETS[n]['n_heads']} heads)"
        ),
    )
    attention = st.selectbox(
        "Attention",
        ATTN_IMPLEMENTATIONS,
        key=key("attn_implementation"),
        help="how attention runs: auto (flex_attention on CUDA for an encoding with a bias, "
        "sdpa otherwise), eager (scores written out), sdpa or flex_attention; no number "
        "changes beyond rounding, and each run records what ran",
    )
    chosen: dict[str, Any] = {} if attention == "auto" else {"attn_implementation": attention}
    # Gemma 2's soft cap: unbounded here (the spec's bound is strict), refused there.
    if st.checkbox("Soft-cap attention logits", key=key("softcapped")):
        chosen["attn_softcap"] = float(
            st.number_input(
                "attn_softcap",
                value=50.0,
                key=key("attn_softcap"),
                help="cap x tanh(logit / cap) on every layer's logits (Gemma 2: 50)",
            )
        )
    if model != "custom":
        return {"preset": model, **chosen} if chosen else model
    a, b, c = st.columns(3)
    return chosen | {
        "d_model": int(
            a.number_input(
                "d_model", value=128, step=16, key=key("d"), **spec_bounds(ModelSpec, "d_model")
            )
        ),
        "n_layers": int(
            b.number_input(
                "layers", value=4, key=key("layers"), **spec_bounds(ModelSpec, "n_layers")
            )
        ),
        "n_heads": int(
            c.number_input("heads", value=4, key=key("heads"), **spec_bounds(ModelSpec, "n_heads"))
        ),
    }


def _step_inputs(train: dict[str, Any], key: Keys) -> dict[str, Any]:
    """What each optimizer step trains on, how many there are, and the learning rate."""
    a, b, c = st.columns(3)
    chosen = {
        "length": int(
            a.number_input(
                "Train length",
                value=train.get("length", 128),
                key=key("length"),
                **spec_bounds(TrainSpec, "length"),
            )
        ),
        "steps": int(
            b.number_input(
                "Steps",
                value=train.get("steps", 600),
                key=key("steps"),
                **spec_bounds(TrainSpec, "steps"),
            )
        ),
        "batch_size": int(
            c.number_input(
                "Batch size",
                value=train.get("batch_size", 16),
                key=key("batch"),
                **spec_bounds(TrainSpec, "batch_size"),
            )
        ),
    }
    a, b = st.columns(2)
    # lr is bounded strictly above 0: left to the spec's validation, not the widget.
    chosen["lr"] = float(
        a.number_input(
            "Peak learning rate", value=float(train.get("lr", 2e-3)), format="%g", key=key("lr")
        )
    )
    chosen["warmup"] = float(
        b.number_input(
            "Warmup fraction",
            value=float(train.get("warmup", 0.05)),
            key=key("warmup"),
            **spec_bounds(TrainSpec, "warmup"),
        )
    )
    return chosen


def _training_inputs(train: dict[str, Any], key: Keys) -> dict[str, Any]:
    """The training setup; what the form does not show (a preset's checkpoint cadence)
    stays as the preset has it."""
    chosen = {**train, **_step_inputs(train, key)}
    a, b = st.columns(2)
    chosen["val_every"] = int(
        a.number_input(
            "Validate every (steps; 0: never)",
            value=int(train.get("val_every", 100)),
            key=key("val_every"),
            help="the held-out loss at the training length, drawn with the training loss",
            **spec_bounds(TrainSpec, "val_every"),
        )
    )
    shortest = b.number_input(
        "Shortest training length (optional)",
        value=train.get("min_length"),
        key=key("min_length"),
        placeholder="every step at the train length",
        help="each step draws its length from [this, train length]: training on every "
        "length up to the train length (length-generalisation studies)",
        **spec_bounds(TrainSpec, "min_length"),
    )
    chosen.pop("min_length", None)
    if shortest is not None:
        chosen["min_length"] = int(shortest)
    return chosen


def _seeds_input(base: dict[str, Any], key: Keys) -> tuple[list[int] | None, list[str]]:
    """The seeds, or None and the problem when the text is not a list of integers."""
    seeds = st.text_input(
        "Seeds",
        ", ".join(str(s) for s in base.get("seeds", [0])),
        key=key("seeds"),
        help="integers separated by commas or spaces",
    )
    try:
        return parse_seeds(seeds), []
    except ValueError:
        return None, [f"seeds: {seeds!r} is not a comma-separated list of integers"]


def _encoding_inputs(base: dict[str, Any], key: Keys) -> list[Any]:
    """The chosen encodings: a name, or a mapping with the parameters that differ from
    the defaults."""
    chosen = st.multiselect(
        "Encodings",
        list(REGISTRY),
        default=_names(base["encodings"]),
        key=key("encodings"),
        format_func=lambda n: f"{n} ({REGISTRY[n].family})",
    )
    encodings: list[Any] = []
    for name in chosen:
        entry = REGISTRY[name]
        with st.expander(f"{name} parameters"):
            st.caption(entry.reference)
            given = next(
                (e for e in base["encodings"] if isinstance(e, dict) and e["name"] == name), {}
            )
            params = {
                p.name: _param_input(p, key(f"{name}.{p.name}"), given.get(p.name))
                for p in entry.all_params
            }
        changed = {k: v for k, v in params.items() if v is not None and v != entry.param(k).default}
        encodings.append({"name": name, **changed} if changed else name)
    return encodings


def _variant_inputs(
    evaluation: dict[str, Any], key: Keys, offered: list[str], finetuned: bool
) -> list[str]:
    """RoPE inference variants: the training-free ones ``offered``, then (``finetuned``)
    fine-tuned ones as text."""
    variants = st.multiselect(
        "RoPE inference variants (rotary encodings)",
        offered,
        default=[v for v in evaluation.get("variants", []) if v in offered],
        key=key("variants"),
        help=" · ".join(f"{n}: {s.summary}" for n, s in SCALINGS.items()),
    )
    if not finetuned:
        return variants
    listed = [v for v in evaluation.get("variants", []) if isinstance(v, str) and "+ft" in v]
    tuned = st.text_input(
        "Fine-tuned RoPE variants",
        ", ".join(listed),
        key=key("finetuned"),
        placeholder="yarn:4+ft200, pi:4+ft200@512",
        help="method:factor+ftSTEPS[@LENGTH]: the trained model fine-tuned under the "
        "scaling for STEPS steps at LENGTH tokens (default: factor x the training "
        "length) at a tenth of the peak learning rate, then evaluated (the PI and YaRN "
        "papers' recipe)",
    )
    return variants + [v.strip() for v in tuned.split(",") if v.strip()]


def _decode_inputs(evaluation: dict[str, Any], key: Keys) -> dict[str, Any]:
    """The decode protocol's cache policy, and its window with sinks when asked for."""
    policies = list(get_args(EvalSpec.model_fields["cache_policy"].annotation))
    chosen: dict[str, Any] = {
        "cache_policy": st.selectbox(
            "KV-cache policy (decode)",
            policies,
            index=policies.index(evaluation.get("cache_policy", "keep")),
            key=key("cache_policy"),
            help="keep: a cached key keeps the rotation it was written with (HF, vLLM); "
            "rerotate: every cached key rotated with the current length's frequencies. "
            "They differ only under dynamic NTK and LongRoPE past the original length.",
        )
    }
    if st.checkbox(
        "Sliding-window cache (decode)",
        value=evaluation.get("window") is not None,
        key=key("windowed"),
        help="Evict keys between the first sinks and the most recent ones (StreamingLLM).",
    ):
        chosen["window"] = int(
            st.number_input(
                "Window (keys kept)",
                value=evaluation.get("window") or 256,
                key=key("window"),
                **spec_bounds(EvalSpec, "window"),
            )
        )
        chosen["sinks"] = int(
            st.number_input(
                "Attention sinks",
                value=evaluation.get("sinks", 4),
                key=key("sinks"),
                **spec_bounds(EvalSpec, "sinks"),
            )
        )
    return chosen


def evaluation_inputs(
    evaluation: dict[str, Any],
    key: Keys,
    lengths: list[int] = LENGTHS,
    variants: list[str] = VARIANTS,
    finetuned: bool = True,
) -> dict[str, Any]:
    """Lengths (among ``lengths``), protocols, how much is scored, the order probe and
    RoPE variants (among ``variants``: none offered when empty; fine-tuned ones as text
    with ``finetuned``)."""
    chosen: dict[str, Any] = {
        "lengths": st.multiselect(
            "Evaluation lengths",
            lengths,
            default=evaluation.get("lengths", [128, 256, 512]),
            key=key("lengths"),
        ),
        "protocols": st.multiselect(
            "Protocols",
            list(PROTOCOLS),
            default=evaluation.get("protocols", ["nonoverlapping"]),
            key=key("protocols"),
        ),
    }
    if "sliding" in chosen["protocols"]:
        chosen["stride"] = int(
            st.number_input(
                "Sliding stride", value=64, key=key("stride"), **spec_bounds(EvalSpec, "stride")
            )
        )
    if "decode" in chosen["protocols"]:
        chosen.update(_decode_inputs(evaluation, key))
    chosen["tokens"] = int(
        st.number_input(
            "Scored tokens per length",
            value=evaluation.get("tokens", 65536),
            key=key("tokens"),
            **spec_bounds(EvalSpec, "tokens"),
        )
    )
    chosen["order_probe"] = st.checkbox(
        "Order probe (language modelling)",
        value=evaluation.get("order_probe", True),
        key=key("order_probe"),
        help="Also score each window's second half with its first half shuffled: "
        "how much each model relies on word order.",
    )
    chosen["diagnostics"] = st.checkbox(
        "Attention diagnostics",
        value=evaluation.get("diagnostics", False),
        key=key("diagnostics"),
        help="At every point: attention entropy, mean distance, sink mass, mass past the "
        "training length and the largest logit, per layer, from sampled queries; every "
        "other number unchanged (Compare's Diagnostics view; docs/diagnostics.md).",
    )
    chosen_variants = _variant_inputs(evaluation, key, variants, finetuned) if variants else []
    given = [v for v in evaluation.get("variants", []) if isinstance(v, str)]
    if st.checkbox(
        "Also with log-n scaling (logn)",
        value=any(v == LOGN or v.endswith(f"+{LOGN}") for v in given),
        key=key("logn"),
        help=f"{TEMPERATURES[LOGN].summary} ({TEMPERATURES[LOGN].reference}). Adds the "
        "trained model with it (logn) and each chosen variant with it (ntk:auto+logn).",
    ):
        chosen_variants = [LOGN, *chosen_variants]
        chosen_variants += [f"{v}+{LOGN}" for v in chosen_variants if v not in (LOGN, NO_SCALING)]
    if chosen_variants:
        chosen["variants"] = chosen_variants
    return chosen


def form(base: dict[str, Any], prefix: str) -> tuple[dict[str, Any], list[str]]:
    """Draw the form; return the spec as a mapping and any problems found while reading it."""

    def key(name: str) -> str:
        return f"{prefix}:{name}"

    spec = header(base, key)
    left, right = st.columns(2)
    with left:
        st.subheader("Task and model")
        spec["task"] = task_inputs(base, key)
        spec["model"] = _model_input(base, key)
        st.subheader("Training")
        spec["train"] = _training_inputs(base.get("train", {}), key)
        seeds, problems = _seeds_input(base, key)
        if seeds is not None:
            spec["seeds"] = seeds
    with right:
        st.subheader("Encodings")
        spec["encodings"] = _encoding_inputs(base, key)
        st.subheader("Evaluation")
        spec["eval"] = evaluation_inputs(base.get("eval", {}), key)
    return spec, problems
