"""Submit: a form built from the encodings and tasks registries and the spec schema.

Nothing is enqueued while the form is invalid: the same ``parse_spec`` that guards
the CLI validates every change, and its messages appear next to the form.
"""

from __future__ import annotations

import re
from typing import Any

import streamlit as st
import yaml

from jobs.spec import PRESET_SPECS, QUEUES, SpecError, StudySpec, parse_spec
from worker.catalog.encodings import REGISTRY, SCALINGS
from worker.catalog.models import MODEL_PRESETS
from worker.catalog.params import Param
from worker.catalog.tasks import TASKS

LENGTHS = [2**k for k in range(4, 18)]
VARIANTS = ["pi:auto", "ntk:auto", "dynamic_ntk", "yarn:auto"]
CUSTOM = {
    "name": "my-study",
    "model": "small",
    "train": {"length": 128, "steps": 600, "batch_size": 16, "lr": 2e-3},
    "encodings": ["rope", "alibi"],
    "eval": {"lengths": [128, 256, 512, 1024]},
}


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
    if param.type is int:
        shown = start if start is not None else int(param.low or 1)
        value = st.number_input(
            label,
            value=int(shown),
            step=1,
            key=key,
            min_value=int(param.low) if param.low is not None else None,
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
            help=param.help + derived,
        )
        return None if start is None and value == shown else float(value)
    return st.text_input(label, value=str(start), key=key, help=param.help)


def form(base: dict[str, Any], prefix: str) -> tuple[dict[str, Any], list[str]]:
    """Draw the form; return the spec as a mapping and any problems found while reading it."""
    problems: list[str] = []
    train = base.get("train", {})
    evaluation = base.get("eval", {})

    def key(name: str) -> str:
        return f"{prefix}:{name}"

    name_column, queue_column = st.columns([3, 1])
    spec: dict[str, Any] = {
        "name": name_column.text_input("Study name", base.get("name", "study"), key=key("name")),
        "queue": queue_column.selectbox(
            "Queue",
            QUEUES,
            index=QUEUES.index(base.get("queue", "gpu")),
            key=key("queue"),
            help="the workers that train it (posbench worker --queues)",
        ),
    }
    left, right = st.columns(2)
    with left:
        st.subheader("Task and model")
        task_names = list(TASKS)
        task_default = base.get("task", "lm")
        task_default = task_default if isinstance(task_default, str) else task_default["name"]
        task = st.selectbox(
            "Task",
            task_names,
            index=task_names.index(task_default),
            key=key("task"),
            format_func=lambda n: f"{n}: {TASKS[n].summary}",
        )
        spec["task"] = {"name": task}
        base_task = base.get("task")
        same = isinstance(base_task, dict) and base_task.get("name", "lm") == task
        given = base_task if same else {}
        for param in TASKS[task].params:
            value = _param_input(param, key(f"{task}.{param.name}"), given.get(param.name))
            if value is not None and value != param.default:
                spec["task"][param.name] = value
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
        if model == "custom":
            a, b, c = st.columns(3)
            spec["model"] = {
                "d_model": int(a.number_input("d_model", 16, 4096, 128, step=16, key=key("d"))),
                "n_layers": int(b.number_input("layers", 1, 64, 4, key=key("layers"))),
                "n_heads": int(c.number_input("heads", 1, 64, 4, key=key("heads"))),
            }
        else:
            spec["model"] = model
        st.subheader("Training")
        a, b, c = st.columns(3)
        spec["train"] = {
            **train,  # what the form does not show (a preset's checkpoint cadence) stays
            "length": int(
                a.number_input(
                    "Train length", 8, 16384, train.get("length", 128), key=key("length")
                )
            ),
            "steps": int(
                b.number_input("Steps", 1, 200_000, train.get("steps", 600), key=key("steps"))
            ),
            "batch_size": int(
                c.number_input("Batch size", 1, 1024, train.get("batch_size", 16), key=key("batch"))
            ),
        }
        a, b = st.columns(2)
        spec["train"]["lr"] = float(
            a.number_input(
                "Peak learning rate", value=float(train.get("lr", 2e-3)), format="%g", key=key("lr")
            )
        )
        spec["train"]["warmup"] = float(
            b.number_input(
                "Warmup fraction", 0.0, 0.5, float(train.get("warmup", 0.05)), key=key("warmup")
            )
        )
        a, b = st.columns(2)
        spec["train"]["val_every"] = int(
            a.number_input(
                "Validate every (steps; 0: never)",
                0,
                200_000,
                int(train.get("val_every", 100)),
                key=key("val_every"),
                help="the held-out loss at the training length, drawn with the training loss",
            )
        )
        shortest = b.number_input(
            "Shortest training length (optional)",
            8,
            16384,
            train.get("min_length"),
            key=key("min_length"),
            placeholder="every step at the train length",
            help="each step draws its length from [this, train length]: training on every "
            "length up to the train length (length-generalisation studies)",
        )
        spec["train"].pop("min_length", None)
        if shortest is not None:
            spec["train"]["min_length"] = int(shortest)
        seeds = st.text_input(
            "Seeds",
            ", ".join(str(s) for s in base.get("seeds", [0])),
            key=key("seeds"),
            help="integers separated by commas or spaces",
        )
        try:
            spec["seeds"] = parse_seeds(seeds)
        except ValueError:
            problems.append(f"seeds: {seeds!r} is not a comma-separated list of integers")
    with right:
        st.subheader("Encodings")
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
            if not entry.params:
                encodings.append(name)
                continue
            with st.expander(f"{name} parameters"):
                st.caption(entry.reference)
                given = next(
                    (e for e in base["encodings"] if isinstance(e, dict) and e["name"] == name), {}
                )
                params = {
                    p.name: _param_input(p, key(f"{name}.{p.name}"), given.get(p.name))
                    for p in entry.params
                }
            changed = {
                k: v for k, v in params.items() if v is not None and v != entry.param(k).default
            }
            encodings.append({"name": name, **changed} if changed else name)
        spec["encodings"] = encodings
        st.subheader("Evaluation")
        spec["eval"] = {
            "lengths": st.multiselect(
                "Evaluation lengths",
                LENGTHS,
                default=evaluation.get("lengths", [128, 256, 512]),
                key=key("lengths"),
            ),
            "protocols": st.multiselect(
                "Protocols",
                ["nonoverlapping", "sliding"],
                default=evaluation.get("protocols", ["nonoverlapping"]),
                key=key("protocols"),
            ),
        }
        if "sliding" in spec["eval"]["protocols"]:
            spec["eval"]["stride"] = int(
                st.number_input("Sliding stride", 1, 131072, 64, key=key("stride"))
            )
        spec["eval"]["tokens"] = int(
            st.number_input(
                "Scored tokens per length",
                64,
                1 << 24,
                evaluation.get("tokens", 65536),
                key=key("tokens"),
            )
        )
        spec["eval"]["order_probe"] = st.checkbox(
            "Order probe (language modelling)",
            value=evaluation.get("order_probe", True),
            key=key("order_probe"),
            help="Also score each window's second half with its first half shuffled: "
            "how much each model relies on word order.",
        )
        variants = st.multiselect(
            "RoPE inference variants (rotary encodings)",
            VARIANTS,
            default=[v for v in evaluation.get("variants", []) if v in VARIANTS],
            key=key("variants"),
            help=" · ".join(f"{n}: {s.summary}" for n, s in SCALINGS.items()),
        )
        listed = [v for v in evaluation.get("variants", []) if isinstance(v, str) and "+" in v]
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
        variants += [v.strip() for v in tuned.split(",") if v.strip()]
        if variants:
            spec["eval"]["variants"] = variants
    return spec, problems


def estimate(spec: StudySpec) -> str:
    runs = len(spec.runs())
    batch = spec.train.batch_size * spec.train.grad_accum
    tokens = spec.train.steps * spec.train.tokens_per_step
    tuning = spec.finetune_tokens()
    flops = 6 * spec.model.parameters * (tokens * runs + tuning)
    return (
        f"{runs} runs x {spec.train.steps:,} steps x {batch} x "
        f"{spec.train.length} tokens = {runs * tokens:,} training tokens "
        + (f"+ {tuning:,} fine-tuning tokens " if tuning else "")
        + f"(about {flops:.2g} FLOPs), evaluated at {len(spec.eval.lengths)} lengths"
    )


def render() -> None:
    from dashboard.common import schema_ready

    st.title("Submit a study")
    presets = ["custom", *PRESET_SPECS]
    preset = st.selectbox(
        "Start from",
        presets,
        key="preset",
        help="smoke: seconds (tiny model); quick: minutes on a CPU; "
        "paper: the ALiBi paper's setting on WikiText-103 (downloaded), for GPUs",
    )
    base = PRESET_SPECS.get(preset, CUSTOM)
    data, problems = form(base, prefix=preset)
    spec = None
    if not problems:
        try:
            spec = parse_spec(data)
        except SpecError as err:
            problems = err.problems
    if problems:
        for problem in problems:
            st.error(problem)
    else:
        st.info(estimate(spec))
        for note in spec.notes():  # runs as written, but worth knowing first
            st.warning("Note: " + note[0].upper() + note[1:])
    with st.expander("YAML (for `posbench submit`)", expanded=False):
        st.code(yaml.safe_dump(data, sort_keys=False), language="yaml")
    clicked = st.button("Submit", type="primary", disabled=spec is None, key="submit")
    if clicked and spec is not None and schema_ready():
        from jobs.service import submit

        submitted = submit(spec)
        st.session_state["last_study"] = submitted.study_id
        note = f", {len(submitted.reused)} reused" if submitted.reused else ""
        st.success(
            f"Study {submitted.study_id} submitted: {len(submitted.queued)} runs queued{note}."
        )
        if submitted.unsent:
            st.warning(
                "The broker could not be reached; the runs stay queued and are sent "
                "when a worker's reconciler next runs."
            )
        from dashboard import queue_page

        st.page_link(
            st.Page(queue_page.render, title="Queue", url_path="queue"),
            label=f"Watch study {submitted.study_id} on the queue",
            query_params={"study": str(submitted.study_id)},
        )
