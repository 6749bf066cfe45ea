"""``posbench export-hf``: a finished run's trained model as a Hugging Face transformers
folder, so lm-evaluation-harness, vLLM and anything else that loads
``AutoModelForCausalLM`` can run posbench models.

The run must be done, its encoding one with an HF form (the catalogue's ``hf_export``)
and its checkpoint on this machine. A RoPE scaling may be written into the config
(``variant``, as a study's ``eval.variants`` names it: ``yarn:4``); a fine-tuned
variant's weights are not the run's checkpoint and are not exported. The conversion
and its check are the engine's (``worker.export_hf``); this module finds the run, says
why one cannot be exported, and writes its model card.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

import yaml
from pydantic import ValidationError
from sqlalchemy import select

from core.catalog.encodings import NO_SCALING, SCALINGS, hf_exportable, info
from core.catalog.params import EncodingConfigError, short_repr
from core.catalog.scalings import Rotary
from core.errors import UnavailableError, UserError
from core.safe_text import markdown
from core.spec import SpecError, StudySpec, VariantSpec, parse_spec
from core.spec.loading import describe
from core.status import RunStatus
from db.engine import transaction
from db.models import Evaluation, Run

if TYPE_CHECKING:
    from core.spec import RunSpec
    from worker.export_hf import HfScaling


class ExportRefused(UserError, ValueError):
    """A run that cannot be exported as asked: the message says why (exit 2)."""


class ExportFailed(UnavailableError, RuntimeError):
    """The export was written but does not compute what posbench does (exit 1)."""


@dataclass(frozen=True)
class StoredRun:
    """What the export reads of a run and its study."""

    id: int
    status: str
    encoding: str
    label: str
    seed: int
    config_hash: str
    train_hash: str | None
    params: dict[str, Any]
    checkpoint_uri: str | None
    provenance: dict[str, Any]
    study_id: int
    study_name: str
    spec: dict[str, Any]
    metric: str


@dataclass(frozen=True)
class HfExported:
    run_id: int
    out: Path
    variant: str
    checked_length: int
    difference: float


def stored_run(url: str, run_id: int) -> StoredRun:
    with transaction(url) as session:
        run = session.get(Run, run_id)
        if run is None:
            raise ExportRefused(f"no run {run_id} (posbench status STUDY lists a study's runs)")
        study = run.study
        return StoredRun(
            id=run.id,
            status=run.status,
            encoding=run.encoding,
            label=run.label,
            seed=run.seed,
            config_hash=run.config_hash,
            train_hash=run.train_hash,
            params=dict(run.params or {}),
            checkpoint_uri=run.checkpoint_uri,
            provenance=dict(run.provenance) if isinstance(run.provenance, dict) else {},
            study_id=study.id,
            study_name=study.name,
            spec=study.spec,
            metric=study.metric,
        )


def run_spec_of(spec: StudySpec, run: StoredRun) -> RunSpec:
    """The run's (encoding, seed) in its study's spec: by config hash, or (a study stored
    by an earlier version) by encoding, resolved parameters and seed."""
    runs = spec.runs()
    for candidate in runs:
        if candidate.config_hash == run.config_hash:
            return candidate
    for candidate in runs:
        if (candidate.encoding.name, candidate.seed) == (run.encoding, run.seed) and (
            candidate.encoding.resolved_params == run.params
        ):
            return candidate
    raise ExportRefused(f"run {run.id} ({run.label}, seed {run.seed}) is not in its study's spec")


def parse_variant(text: str | None, encoding: str) -> VariantSpec | None:
    """The scaling to write into the config, or None for the trained model as it is:
    ``yarn:4`` as a spec's shorthand, or a mapping as a spec writes one
    (``{method: yarn, factor: 4, beta_fast: 16}``)."""
    if text is None:
        return None
    given: Any = text
    if text.lstrip().startswith("{"):
        try:
            given = yaml.safe_load(text)
        except yaml.YAMLError:
            raise ExportRefused(f"--variant {short_repr(text)}: not a YAML mapping") from None
    try:
        variant = VariantSpec.model_validate(given)
    except ValidationError as err:
        raise ExportRefused(f"--variant {short_repr(text)}: {'; '.join(describe(err))}") from None
    if variant.method == NO_SCALING and variant.finetune is None:
        return None
    if variant.finetune is not None:
        raise ExportRefused(
            f"--variant {variant.label}: a fine-tuned variant's weights are not the run's "
            "checkpoint; export-hf writes the trained model, with a scaling or without"
        )
    if not info(encoding).scalable:
        raise ExportRefused(
            f"--variant {variant.label}: RoPE scalings apply to rotary encodings, not "
            f"{short_repr(encoding)}"
        )
    if SCALINGS[variant.method].needs_factor and variant.factor == "auto":
        raise ExportRefused(
            f"--variant {variant.label}: an HF config holds one factor; give a number "
            f"({variant.method}:4, ...)"
        )
    return variant


def checkpoint_path(run: StoredRun, artifacts: Path) -> Path:
    """Where the run's checkpoint is on this machine: where its worker wrote it, or this
    machine's artifacts folder."""
    places = []
    if run.checkpoint_uri and urlparse(run.checkpoint_uri).scheme == "file":
        places.append(Path(unquote(urlparse(run.checkpoint_uri).path)))
    places.append(artifacts / "runs" / f"{run.id}.pt")
    for place in places:
        if place.is_file():
            return place
    raise ExportRefused(
        f"run {run.id}'s checkpoint is not on this machine (looked for {places[-1]}); "
        "export on the machine whose artifacts folder holds it"
    )


def export_run(
    url: str,
    run_id: int,
    out: Path,
    *,
    artifacts: Path,
    variant: str | None = None,
    force: bool = False,
) -> HfExported:
    """Write run ``run_id`` of the database at ``url`` as an HF transformers folder at
    ``out`` (its checkpoint found under ``artifacts`` when not where its worker wrote it)."""
    run = stored_run(url, run_id)
    entry = info(run.encoding)
    if not entry.hf_export:
        raise ExportRefused(
            f"run {run.id} is {run.label}: encoding {short_repr(run.encoding)} has no HF "
            f"transformers form; export-hf writes runs of {', '.join(hf_exportable())}"
        )
    if run.status != RunStatus.DONE:
        raise ExportRefused(
            f"run {run.id} is {run.status}; only a finished (done) run has a trained model"
        )
    try:
        spec = parse_spec(run.spec)
    except SpecError as err:
        raise ExportRefused(f"run {run.id}'s study spec no longer validates: {err}") from None
    run_spec = run_spec_of(spec, run)
    if spec.model.attn_softcap is not None:
        raise ExportRefused(
            f"run {run.id} soft-caps its attention logits (model.attn_softcap="
            f"{spec.model.attn_softcap:g}); GPT-NeoX has no cap, so it would compute another model"
        )
    chosen = parse_variant(variant, run.encoding)
    params = run_spec.encoding.resolved_params
    head_dim = spec.model.d_model // spec.model.n_heads
    rotary = entry.hf_rotary(params, head_dim, spec.train.length)
    checkpoint = checkpoint_path(run, artifacts)
    curve = stored_curve(url, run, NO_SCALING if chosen is None else chosen.label)
    return _write(run, spec, run_spec, out, checkpoint, rotary, chosen, curve, force)


def _write(
    run: StoredRun,
    spec: StudySpec,
    run_spec: RunSpec,
    out: Path,
    checkpoint: Path,
    rotary: Rotary,
    variant: VariantSpec | None,
    curve: list[tuple[str, int, float | None]],
    force: bool,
) -> HfExported:
    import torch

    from worker.export_hf import (
        ExportMismatch,
        HfScaling,
        check_length,
        out_problem,
        write_hf_folder,
    )
    from worker.export_hf import ExportRefused as Unwritable
    from worker.run import build_run_model
    from worker.training.checkpoint import checkpoint_problem

    problem = out_problem(out, force)
    if problem:
        raise ExportRefused(problem)
    try:
        state = torch.load(checkpoint, map_location="cpu", weights_only=True)
        problem = checkpoint_problem(state, run.train_hash)
    except Exception as err:  # truncated, not a checkpoint, or not torch's format
        problem = f"unreadable ({type(err).__name__})"
    if problem:
        raise ExportRefused(f"run {run.id}'s checkpoint {checkpoint} is {problem}")
    model = build_run_model(spec, run_spec)
    try:
        model.load_state_dict(state["model"])
    except (KeyError, RuntimeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ExportRefused(
            f"run {run.id}'s checkpoint does not fit the model its study describes: {first}"
        ) from None
    scaling = None
    if variant is not None:
        factor = None if variant.factor is None else float(variant.factor)
        scaling = HfScaling(variant.method, factor, dict(variant.params))
    label = NO_SCALING if variant is None else variant.label
    card = model_card(run, spec, label, scaling, state.get("step"), curve)
    try:
        difference = write_hf_folder(
            model, out, rotary=rotary, scaling=scaling, card=card, force=force
        )
    except EncodingConfigError as err:  # a scaling this model's rotary width cannot take
        raise ExportRefused(f"--variant {label}: {err}") from None
    except ExportMismatch as err:
        raise ExportFailed(str(err)) from None
    except Unwritable as err:
        raise ExportRefused(str(err)) from None
    except OSError as err:  # a folder that cannot be written, a full disk
        raise ExportRefused(f"--out {out} cannot be written: {err.strerror or err}") from None
    return HfExported(run.id, out, label, check_length(rotary), difference)


def stored_curve(url: str, run: StoredRun, variant: str) -> list[tuple[str, int, float | None]]:
    """The run's stored points of ``variant``: (protocol, length, the study's metric)."""
    with transaction(url) as session:
        rows = session.execute(
            select(Evaluation)
            .where(Evaluation.run_id == run.id, Evaluation.variant == variant)
            .order_by(Evaluation.protocol, Evaluation.eval_length)
        ).scalars()
        return [(row.protocol, row.eval_length, getattr(row, run.metric, None)) for row in rows]


def model_card(
    run: StoredRun,
    spec: StudySpec,
    variant: str,
    scaling: HfScaling | None,
    step: int | None,
    curve: list[tuple[str, int, float | None]],
) -> str:
    """README.md: where the model comes from, how it maps to GPT-NeoX, what posbench
    measured of it."""
    origin = run.provenance.get("training") or run.provenance
    commit = origin.get("git_commit") or "unknown"
    version = origin.get("posbench_version") or "unknown"
    # Escaped: the study's name and the task's parameters (a corpus path), which users
    # write; the rest is the catalogue's and the code's.
    lines = [
        "---",
        "library_name: transformers",
        "pipeline_tag: text-generation",
        "tags: [posbench, byte-level, gpt_neox]",
        "---",
        "",
        f"# posbench run {run.id}: {run.label}, seed {run.seed}",
        "",
        "A byte-level language model trained by posbench, the benchmark of transformer "
        "position encodings, written as a GPT-NeoX model by `posbench export-hf`.",
        "",
        "| | |",
        "|---|---|",
        f"| run | {run.id} of study {run.study_id}, {markdown(spec.name)} |",
        f"| encoding | {run.label} ({_params_text(run.params)}) |",
        f"| scaling in the config | {variant} |",
        f"| model | d_model {spec.model.d_model}, {spec.model.n_layers} layers, "
        f"{spec.model.n_heads} heads |",
        f"| training | task {spec.task.name} ({markdown(_params_text(spec.task.params))}), "
        f"length {spec.train.length}, "
        f"{step if step is not None else spec.train.steps} steps of {spec.train.batch_size} |",
        f"| train hash | {run.train_hash or 'none'} |",
        f"| posbench | {version}, commit {commit} |",
        f"| torch | {origin.get('torch_version') or 'unknown'} on "
        f"{origin.get('device_name') or origin.get('device') or 'unknown'} |",
        "",
        *_mapping_lines(spec.train.length),
        *_curve_lines(curve, run.metric, variant),
    ]
    return "\n".join(lines) + "\n"


def _params_text(params: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(params.items())) or "defaults"


def _mapping_lines(train_length: int) -> list[str]:
    return [
        "## Using it",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        'model = AutoModelForCausalLM.from_pretrained("path/to/this/folder")',
        'tokenizer = AutoTokenizer.from_pretrained("path/to/this/folder")',
        "```",
        "",
        "- Tokens are UTF-8 bytes: a token's id is the byte's value (256 tokens). Byte 0, "
        "the separator posbench puts between documents, is bos, eos and pad; nothing is "
        "added around a text.",
        f"- The model was trained on sequences of {train_length} bytes: "
        "`max_position_embeddings` is that length, or with a scaling that states its "
        "`original_max_position_embeddings`, the factor times it (transformers' "
        "convention). How the model behaves past the training length is what posbench "
        "measures: tools that stop at `max_position_embeddings` (lm-evaluation-harness's "
        "`max_length`, vLLM's `--max-model-len`) take a longer length when given one.",
        "- GPT-NeoX computes what posbench's model computes: sequential pre-norm blocks "
        "(`use_parallel_residual` false), exact GELU, no attention bias; the LayerNorm and "
        "MLP biases GPT-NeoX has are zeros; `embed_in` is posbench's token embedding "
        "times sqrt(d_model) and `embed_out` the embedding itself (posbench ties them). "
        "The export was checked: transformers' logits equal posbench's.",
        "",
    ]


def _curve_lines(
    curve: list[tuple[str, int, float | None]], metric: str, variant: str
) -> list[str]:
    if not curve:
        return [f"posbench stored no evaluation of this run under {variant}."]
    lines = [
        f"## What posbench measured ({variant})",
        "",
        f"| protocol | length | {metric} |",
        "|---|---:|---:|",
    ]
    for protocol, length, value in curve:
        shown = "n/a" if value is None else f"{value:.4g}"
        lines.append(f"| {protocol} | {length} | {shown} |")
    return lines
