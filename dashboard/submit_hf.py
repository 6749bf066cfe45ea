"""The Submit form for a HuggingFace model folder (``model: {hf: NAME}``): the folders
found directly under the models roots, and what a study that evaluates one may set.

What the model is (its family, RoPE or not, its original context) is read from the
chosen folder's config.json as JSON, within a bound, under the same containment rules as
submit and the worker (``core.catalog.hf_models``): no transformers here. The study it
makes trains nothing: ``train.length`` is the config's original context, the task is
one whose examples are text (the catalogue's ``text`` flag: the model reads them in its
own tokens), there are no encodings, and RoPE scalings are offered only for a RoPE
model, only those its rotary width allows.
"""

from __future__ import annotations

from typing import Any

import streamlit as st

from core.catalog.encodings import SCALINGS
from core.catalog.hf_models import (
    ROOTS_SETTING,
    HfModelError,
    ModelFacts,
    ModelFolder,
    ModelPolicy,
    local_facts,
    model_folders,
)
from core.catalog.tasks import DEFAULT_TASK, TASKS
from core.safe_text import markdown
from dashboard.submit_form import LENGTHS, VARIANTS, evaluation_inputs, header, task_inputs

# The tasks an hf: model is evaluated on (core.spec.hf): those whose examples are text.
HF_TASKS = [name for name, task in TASKS.items() if task.text]
HF_DEFAULT_TASK = DEFAULT_TASK if DEFAULT_TASK in HF_TASKS else HF_TASKS[0]
DEFAULT_TOKENS = 65536


def no_folders_line(policy: ModelPolicy) -> str:
    """Where to put a model folder, in one line."""
    return (
        "No HuggingFace model folder found: put one (config.json, safetensors weights, "
        f"tokenizer) directly under a models root ({ROOTS_SETTING}: {policy.roots_shown()})."
    )


def offered_variants(facts: ModelFacts) -> list[str]:
    """The RoPE scalings the Submit form offers for a model: none without RoPE; those its
    rotary width allows with it."""
    if not facts.scalable or facts.rotary is None:
        return []
    width = facts.rotary.rotary_dim
    return [v for v in VARIANTS if SCALINGS[v.partition(":")[0]].min_rotary_width <= width]


def described(facts: ModelFacts) -> str:
    """What the config says, in one line."""
    positions = (
        f"RoPE on {facts.rotary.rotary_dim} dimensions of each head (base {facts.rotary.base:g})"
        if facts.rotary is not None
        else f"learned positions up to {facts.max_positions}"
    )
    return (
        f"{facts.described}: {positions}; original context {facts.context} tokens "
        f"({facts.context_key}), the study's train.length"
    )


def evaluation_lengths(context: int) -> list[int]:
    """The lengths offered: the usual powers of two and 1, 2, 4, 8 x the context."""
    return sorted({*LENGTHS, *(context * k for k in (1, 2, 4, 8))})


def _chosen_folder(folders: list[ModelFolder], more: bool) -> ModelFolder:
    index = st.selectbox(
        "Model folder",
        range(len(folders)),
        format_func=lambda i: folders[i].spec_name,
        key="hf:folder",
        help="the folders directly under the models roots that hold a config.json"
        + (f"; the first {len(folders)} listed" if more else ""),
    )
    return folders[index]


def hf_form(policy: ModelPolicy) -> tuple[dict[str, Any] | None, list[str]]:
    """Draw the form; return the spec as a mapping (None: no model folder to choose) and
    any problems found while reading it."""
    folders, more = model_folders(policy)
    if not folders:
        st.info(markdown(no_folders_line(policy)))
        return None, []
    folder = _chosen_folder(folders, more)

    def key(name: str) -> str:  # each folder keeps its own inputs
        return f"hf:{folder.spec_name}:{name}"

    try:
        _, facts = local_facts(folder.spec_name, policy)
    except HfModelError as err:
        return None, [str(err)]
    if facts is None:  # a listed folder is always local; belt and braces
        return None, [f"model.hf {folder.spec_name!r}: not a local folder"]
    st.caption(markdown(described(facts)))
    context = facts.context
    base = {"name": f"{folder.name} at long contexts"}
    spec: dict[str, Any] = header(base, key)
    left, right = st.columns(2)
    with left:
        st.subheader("Task and model")
        spec["task"] = task_inputs({"task": HF_DEFAULT_TASK}, key, HF_TASKS)
        spec["model"] = {"hf": folder.spec_name}
        spec["train"] = {"length": context}
        st.caption(
            "Evaluated as it is: no training, no encodings (the model brings its own), "
            "one run. Lengths, the stride and the scored tokens count the model's tokens; "
            "a synthetic task's examples are rendered in them."
        )
    with right:
        st.subheader("Evaluation")
        variants = offered_variants(facts)
        if not variants:
            st.caption(markdown(f"No RoPE scalings: {facts.model_type} has no RoPE."))
        spec["eval"] = evaluation_inputs(
            {"lengths": [context, 2 * context, 4 * context], "tokens": DEFAULT_TOKENS},
            key,
            lengths=evaluation_lengths(context),
            variants=variants,
            finetuned=False,
        )
    return spec, []
