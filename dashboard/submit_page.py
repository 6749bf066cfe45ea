"""Submit: the form (``dashboard.submit_form``), its validation, a cost estimate and
the submit button.

Nothing is enqueued while the form is invalid: the same ``parse_spec`` that guards
the CLI validates every change, and its messages appear next to the form.
"""

from __future__ import annotations

import json

import streamlit as st
import yaml

from core.safe_text import markdown
from core.settings import get_settings
from core.spec import PRESET_SPECS, SpecError, StudySpec, parse_spec
from dashboard.auth import actor, can_operate
from dashboard.common import queue_warning, schema_ready
from dashboard.submit_form import form
from dashboard.submit_hf import hf_form

OWN_SOURCE, HF_SOURCE = "posbench", "hf"
SOURCES = {OWN_SOURCE: "posbench's own model", HF_SOURCE: "a HuggingFace model folder"}
CUSTOM = {
    "name": "my-study",
    "model": "small",
    "train": {"length": 128, "steps": 600, "batch_size": 16, "lr": 2e-3},
    "encodings": ["rope", "alibi"],
    "eval": {"lengths": [128, 256, 512, 1024]},
}


@st.cache_data(ttl=60, show_spinner=False, max_entries=64)
def sources_refusal(spec_json: str, rules: str) -> str | None:
    """Why the service would refuse the spec's data (``jobs.service.sources_problem``:
    an hf: folder is read, not loaded), cached a minute per spec: the form reruns on
    every change; ``rules``: the operator's, as text, part of the key."""
    from jobs.service import sources_problem

    return sources_problem(parse_spec(json.loads(spec_json)), get_settings())


def estimate(spec: StudySpec) -> str:
    if spec.model.hf is not None:
        return (
            f"1 run: {spec.runs()[0].encoding.label} evaluated as it is (no training) at "
            f"{len(spec.eval.lengths)} lengths, up to {spec.eval_tokens():,} of its tokens"
        )
    runs = len(spec.runs())
    batch = spec.train.batch_size * spec.train.grad_accum
    tokens = spec.train.steps * spec.train.tokens_per_step
    tuning = spec.finetune_tokens()
    flops = spec.estimated_flops()
    return (
        f"{runs} runs x {spec.train.steps:,} steps x {batch} x "
        f"{spec.train.length} tokens = {runs * tokens:,} training tokens "
        + (f"+ {tuning:,} fine-tuning tokens " if tuning else "")
        + f"(about {flops:.2g} FLOPs), evaluated at {len(spec.eval.lengths)} lengths"
    )


def render() -> None:

    st.title("Submit a study")
    if not can_operate():  # the navigation has no Submit page for viewers; belt and braces
        st.info("Submitting needs the operator role.")
        return
    source = st.radio(
        "Model source",
        list(SOURCES),
        format_func=SOURCES.get,
        key="source",
        horizontal=True,
        help="a HuggingFace model folder is evaluated as it is, next to posbench's models",
    )
    if source == HF_SOURCE:
        data, problems = hf_form(get_settings().models)
        if data is None and not problems:
            return  # no folder to choose: where to put one is said
    else:
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
    if not problems and data is not None:
        try:
            spec = parse_spec(data)
        except SpecError as err:
            problems = err.problems
    if not problems and spec is not None:
        # The operator's rules too (a model without RoPE for a scaling, a corpus outside
        # the roots), so that a spec that will be refused shows its refusal, not its notes.
        settings = get_settings()
        rules = repr((settings.sources, settings.models))  # the cache's key includes them
        refusal = sources_refusal(spec.model_dump_json(), rules)
        if refusal:
            problems, spec = [refusal], None
    if problems:
        for problem in problems:
            st.error(markdown(problem))
    else:
        st.info(estimate(spec))
        for note in spec.notes():  # runs as written, but worth knowing first
            st.warning(markdown("Note: " + note[0].upper() + note[1:]))
    if data is not None:
        with st.expander("YAML (for `posbench submit`)", expanded=False):
            st.code(yaml.safe_dump(data, sort_keys=False), language="yaml")
    clicked = st.button("Submit", type="primary", disabled=spec is None, key="submit")
    if clicked and spec is not None and schema_ready():
        from jobs.service import Refused, submit

        try:
            submitted = submit(spec, actor=actor())
        except Refused as err:
            st.error(markdown(err))  # it may name the submitter
            return
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
        else:
            queue_warning(spec.queue)
        from dashboard import queue_page

        st.page_link(
            st.Page(queue_page.render, title="Queue", url_path="queue"),
            label=f"Watch study {submitted.study_id} on the queue",
            query_params={"study": str(submitted.study_id)},
        )
