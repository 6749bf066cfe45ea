"""Import the ``results.json`` of ``posbench run`` into the results database.

A study run on a laptop or a lone GPU box, without the service, joins the others: the
dashboard compares it, ``posbench results`` and SQL query it. Its runs are marked
imported (``runs.imported_from``) wherever they are shown, and a later submit reuses
them by config hash only when asked to (``posbench submit --reuse-imported``): numbers
no worker of this service trained are never passed off as trained. The file is checked
whole before anything is written (its spec is validated as a submitted one; every run
must be one of that spec's runs, by the config hash this version computes), and the
study is written in one transaction: all of it or nothing.
"""

from __future__ import annotations

import datetime as dt
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from sqlalchemy import select

from core.analysis import ANY_PROTOCOL, effective_setting, summarize_points
from core.catalog.encodings import REGISTRY
from core.catalog.params import short_repr
from core.errors import UserError
from core.files import FileRefused, read_bounded
from core.metrics import GROWTH_DIAGNOSTIC, METRICS, Kind, diagnostics, measured, metric_named
from core.results_schema import MAX_RESULTS_BYTES, RunRecord, parse_results
from core.results_schema import Evaluation as Row
from core.settings import Settings, get_settings
from core.spec import MAX_VARIANT_LABEL, SpecError, parse_spec
from core.status import RunStatus
from db.engine import transaction
from db.models import (
    Evaluation,
    PositionBin,
    Run,
    RunSummary,
    TrainPoint,
    in_live_study,
    utcnow,
)
from jobs.audit import Action, record, run_count
from jobs.lifecycle import import_run
from jobs.service import new_study


class ImportProblem(UserError, ValueError):
    """The file cannot be imported: what is wrong with it, and nothing was written."""


@dataclass
class Imported:
    study_id: int
    name: str
    runs: int
    evaluations: int


# The order probe's summaries are the only ones taken from the file (the curves' are
# computed here from the points).
PROBE_SUMMARIES = ("order_ordered_loss", "order_shuffled_loss", "order_sensitivity")
MAX_COUNT = 1 << 53  # tokens, bytes: exact in a float, far past any real run
MAX_SECONDS = 10 * 365 * 86400
MAX_PROVENANCE_BYTES = 1 << 20
MAX_GROUPS = 1000  # a task's groups (depths, operand sizes): dozens at most
MAX_GROUP_LABEL = 80  # "depth=0.5", "digits=(3, 7)": a few words
MAX_IMPORT_BYTES = MAX_RESULTS_BYTES


def _read(path: Path) -> str:
    try:
        return read_bounded(path, MAX_IMPORT_BYTES, "an import").decode("utf-8")
    except FileRefused as err:
        raise ImportProblem(str(err)) from None
    except OSError as err:
        raise ImportProblem(f"{path}: cannot be read ({err.strerror or err})") from None
    except UnicodeDecodeError:
        raise ImportProblem(f"{path}: not JSON (not UTF-8 text)") from None


def _where(error: dict[str, Any]) -> str:
    return ".".join(str(part) for part in error["loc"]) or "the file"


def _check_complete(path: Path, index: int, run: RunRecord, spec, planned) -> None:
    """A run is stored as done only when it is whole: trained for the spec's steps, and
    evaluated at exactly the points its spec plans for it."""
    where = f"{path}: runs[{index}] ({run.label}, seed {run.seed})"
    # An hf: model trains nothing (0 steps, no curve).
    if run.train.steps != spec.train.steps or (spec.train.steps and not run.train.curve):
        raise ImportProblem(
            f"{where} trained {run.train.steps} of {spec.train.steps} steps"
            + ("" if run.train.curve else ", with no training curve")
        )
    # An hf: model's variants were checked against its config where it was evaluated.
    scalable = spec.model.hf is not None or REGISTRY[planned.encoding.name].scalable
    plan = {(v.label, p, n) for v, p, n in spec.eval.plan(scalable)}
    stored = {(e.variant, e.protocol, e.length) for e in run.evaluations}
    if stored - plan:
        raise ImportProblem(f"{where}: evaluation {sorted(stored - plan)[0]} is not in its plan")
    if plan - stored:
        raise ImportProblem(f"{where}: evaluation {sorted(plan - stored)[0]} is missing")


def _bad(value: float | int | None, low: float, high: float = math.inf) -> bool:
    return value is not None and not low <= value <= high


def _check_values(where: str, run: RunRecord, spec) -> None:
    """Every number is one a run can have measured: in range, consistent with the
    others (perplexity is exp(loss)), and of the study's metric; a file edited by hand
    or written by something else is refused here, not stored and averaged."""
    for i, point in enumerate(run.train.curve):
        at = f"{where}.train.curve[{i}]"
        if not 1 <= point.step <= run.train.steps:
            raise ImportProblem(f"{at}.step: {point.step} is not within 1..{run.train.steps}")
        if i and point.step <= run.train.curve[i - 1].step:
            raise ImportProblem(f"{at}.step: the curve's steps must increase")
        for name in ("loss", "lr", "tokens_per_second", "val_loss"):
            if _bad(getattr(point, name), 0):
                raise ImportProblem(f"{at}.{name}: must be at least 0")
        if _bad(point.elapsed, 0, MAX_SECONDS):
            raise ImportProblem(f"{at}.elapsed: must be 0..{MAX_SECONDS} seconds")
    for i, row in enumerate(run.evaluations):
        at = f"{where}.evaluations[{i}] ({row.variant}, {row.protocol}, {row.length})"
        if row.not_applicable is not None:
            given = [m.name for m in METRICS.values() if getattr(row, m.column) is not None]
            if given:
                raise ImportProblem(f"{at}: not applicable, yet has a {given[0]}")
            continue
        _check_metrics(at, row, spec.task, byte_level=spec.model.hf is None)
        _check_groups(at, row, spec)
        _check_attention(at, row)
        if _bad(row.tokens, 0, MAX_COUNT) or _bad(row.peak_memory_bytes, 0, MAX_COUNT):
            raise ImportProblem(f"{at}: tokens and peak_memory_bytes must be 0..2^53")
        if _bad(row.tokens_per_second, 0) or _bad(row.factor, 1e-9):
            raise ImportProblem(f"{at}: tokens_per_second must be >= 0, factor > 0")
        if _bad(row.kv_cache_bytes, 0, MAX_COUNT) or _bad(row.decode_tokens_per_second, 0):
            raise ImportProblem(
                f"{at}: kv_cache_bytes must be 0..2^53 and decode_tokens_per_second >= 0"
            )
        starts = [b.start for b in row.position_bins]
        if len(set(starts)) != len(starts):
            raise ImportProblem(f"{at}: two position bins start at the same position")
        for b in row.position_bins:
            if not 0 <= b.start < b.end <= row.length or _bad(b.loss, 0):
                raise ImportProblem(
                    f"{at}: position bin [{b.start}, {b.end}) must lie within 0..{row.length} "
                    "with a loss >= 0"
                )
            if _bad(b.tokens, 0, MAX_COUNT):
                raise ImportProblem(f"{at}: position bin tokens must be 0..2^53")

    for i, summary in enumerate(run.summaries):
        at = f"{where}.summaries[{i}]"
        if summary.protocol != ANY_PROTOCOL:
            continue  # the curves' summaries are computed here, not read
        if summary.name not in PROBE_SUMMARIES:
            raise ImportProblem(
                f"{at}: {summary.name!r} is not one of the order probe's "
                f"{', '.join(PROBE_SUMMARIES)}"
            )
        if summary.value is not None and not math.isfinite(summary.value):
            raise ImportProblem(f"{at}: {summary.name} must be a finite number")


def _check_provenance(where: str, run: RunRecord, spec, planned) -> None:
    """The provenance is a few fields, within MAX_PROVENANCE_BYTES, and the fine-tunings'
    loss curves, which grow with their steps: one per fine-tuned variant of the run's
    plan, each a list of at most that variant's steps (step, loss) pairs of numbers, as
    the worker records them (one per progress report), so their size is bounded too."""
    tunings = run.provenance.get("finetune")
    rest = {k: v for k, v in run.provenance.items() if k != "finetune"}
    if isinstance(tunings, dict):
        scalable = REGISTRY[planned.encoding.name].scalable
        tuned = {
            v.label: v.finetune.steps
            for v, _, _ in spec.eval.plan(scalable)
            if v.finetune is not None
        }
        rest["finetune"] = {}
        for label, record in tunings.items():
            at = f"{where}.provenance.finetune.{short_repr(label)}"
            if label not in tuned:
                raise ImportProblem(
                    f"{at}: not a fine-tuned variant of this run's spec (allowed: "
                    f"{', '.join(tuned) or 'none'})"
                )
            if isinstance(record, dict) and "curve" in record:
                _check_curve(at, record["curve"], tuned[label])
                record = {k: v for k, v in record.items() if k != "curve"}
            rest["finetune"][label] = record
    if len(json.dumps(rest, default=str)) > MAX_PROVENANCE_BYTES:
        raise ImportProblem(f"{where}.provenance: larger than 1 MiB (fine-tuning curves aside)")


def _check_curve(at: str, curve: Any, steps: int) -> None:
    """A fine-tuning's curve: a point per progress report, at steps 1..``steps``."""
    if not isinstance(curve, list) or len(curve) > steps:
        raise ImportProblem(
            f"{at}.curve: must be a list of at most {steps:,} points (the fine-tuning's steps)"
        )
    last = 0
    for point in curve:
        if not (
            isinstance(point, list)
            and len(point) == 2
            and type(point[0]) is int
            and last < point[0] <= steps
            and type(point[1]) in (int, float)
            and 0 <= point[1] <= MAX_COUNT
        ):
            raise ImportProblem(
                f"{at}.curve: each point must be a pair [step, loss] of numbers, the steps "
                f"increasing within 1..{steps:,}, the loss 0..2^53"
            )
        last = point[0]


def _check_groups(at: str, row: Row, spec) -> None:
    """Per-group accuracies as an evaluation has them (audit F8: 1,200 groups of 100 KB
    were accepted, for lm too, and slowed every Compare page): only for a task scored on
    answers, at most one group per scored example (and MAX_GROUPS), each label a short
    line of text, each accuracy within 0..1."""
    groups = row.groups
    if not groups:
        return
    if spec.task.kind is not Kind.ANSWER:
        raise ImportProblem(f"{at}: groups: task {spec.task.name} scores no groups")
    most = min(MAX_GROUPS, spec.eval.examples)
    if len(groups) > most:
        raise ImportProblem(f"{at}: {len(groups):,} groups; an evaluation has at most {most}")
    label = next((g for g in groups if len(g) > MAX_GROUP_LABEL or not g.isprintable()), None)
    if label is not None:
        raise ImportProblem(
            f"{at}: group {short_repr(label)} is not a label (printable, at most "
            f"{MAX_GROUP_LABEL} characters)"
        )
    if any(_bad(value, 0, 1) for value in groups.values()):
        raise ImportProblem(f"{at}: group accuracies must be within 0..1")


MAX_LAYERS = 1024  # an evaluated model's layers, at most
MAX_HEADS = 1024  # per-head diagnostics are stored up to this many heads in all


def _check_attention(at: str, row: Row) -> None:
    """Per-layer diagnostics (``Evaluation.attention``) as the probe writes them: a
    known diagnostic's finite values, a bounded number of them, with the means."""
    attention = row.attention
    if attention is None:
        return
    names = {m.name for m in diagnostics()}
    if row.attn_entropy is None or set(attention) != {"queries", "layers", "heads"}:
        raise ImportProblem(
            f"{at}: attention must hold queries, layers and heads, beside the diagnostics"
        )
    queries, layers, heads = attention["queries"], attention["layers"], attention["heads"]
    if not isinstance(queries, int) or _bad(queries, 1, MAX_COUNT):
        raise ImportProblem(f"{at}: attention.queries must be a count of sampled queries")
    for part, most, nested in ((layers, MAX_LAYERS, False), (heads, MAX_HEADS, True)):
        if part is None and nested:
            continue
        if not isinstance(part, dict) or set(part) != names:
            raise ImportProblem(f"{at}: attention per layer must name {', '.join(sorted(names))}")
        for values in part.values():
            cells = _flattened(values) if nested else values
            if (
                not isinstance(cells, list)
                or not 0 < len(cells) <= most
                or not all(isinstance(v, float | int) and math.isfinite(v) for v in cells)
            ):
                raise ImportProblem(
                    f"{at}: attention values must be 1 to {most} finite numbers per diagnostic"
                )


def _flattened(values: object) -> object:
    """A list of lists as one list; anything else as it is (and refused)."""
    if isinstance(values, list) and all(isinstance(row, list) for row in values):
        return [v for row in values for v in row]
    return values


def _check_metrics(at: str, row: Row, task, *, byte_level: bool = True) -> None:
    """The metrics of an evaluation point (``core.metrics``): the loss and the task's
    metric present, no metric of another kind of task, each within its range, and those
    that follow from the loss consistent with it (per byte: for byte-level models only,
    not ``byte_level`` for an hf: model's tokens)."""
    kind = task.kind
    required = [m for m in measured(kind) if m.every_task or m.headline]
    missing = [m.name for m in required if getattr(row, m.column) is None]
    if missing:
        raise ImportProblem(f"{at}: has no {missing[0]}")
    other = [m for m in METRICS.values() if not m.measured_by(kind)]
    given = [m.name for m in other if getattr(row, m.column) is not None]
    if given:
        raise ImportProblem(f"{at}: {given[0]} is not a metric of task {task.name}")
    for metric in METRICS.values():
        value = getattr(row, metric.column)
        if _bad(value, metric.low, metric.high):
            raise ImportProblem(
                f"{at}: expected {metric.name} {metric.range_text()}, got {value:g}"
            )
    for metric in METRICS.values():
        value = getattr(row, metric.column)
        if metric.to_loss is None or value is None or (metric.per_byte and not byte_level):
            continue
        if not math.isclose(metric.to_loss(value), row.loss, rel_tol=1e-6, abs_tol=1e-9):
            raise ImportProblem(f"{at}: {metric.name} is not {metric.from_loss}")


def _summaries(spec, run: RunRecord) -> list:
    """The run's curve summaries computed from its points here (not taken from the file,
    so they always match the curve), and the order probe's as the file has them."""

    metric = spec.task.metric
    column = metric_named(metric).column
    points = ((e.variant, e.protocol, e.length, getattr(e, column)) for e in run.evaluations)
    probe = {s.name: s.value for s in run.summaries if s.protocol == ANY_PROTOCOL}
    growth = (
        (e.variant, e.protocol, e.length, getattr(e, GROWTH_DIAGNOSTIC)) for e in run.evaluations
    )
    return summarize_points(
        points,
        train_length=spec.train.length,
        metric=metric,
        extra=probe or None,
        effective=effective_setting(spec),
        growth=growth,
    )


def _parse(path: Path):
    """The file read and validated against the results schema, and its spec."""
    text = _read(path)
    try:
        results = parse_results(text)
    except ValidationError as err:
        first = err.errors()[0]
        if first["type"] == "json_invalid":
            raise ImportProblem(f"{path}: not JSON ({first['msg']})") from None
        if first["type"] == "dataclass_type" and not first["loc"]:
            raise ImportProblem(
                f"{path}: not the results.json of posbench run (a JSON object)"
            ) from None
        raise ImportProblem(f"{path}: {_where(first)}: {first['msg']}") from None
    try:
        spec = parse_spec(results.spec)
    except SpecError as err:
        raise ImportProblem(f"{path}: its spec: {err}") from None
    return results, spec


def _check_runs(path: Path, results, spec, planned) -> dict[str, list]:
    """Every run checked whole (one of the spec's, once, complete, its numbers ones a
    run can have measured); its summaries computed, by config hash."""
    seen = set()
    summaries = {}
    for index, run in enumerate(results.runs):
        if run.config_hash not in planned:
            raise ImportProblem(
                f"{path}: runs[{index}] ({run.label}, seed {run.seed}) is not a run of its "
                "spec as this posbench version hashes it (written by another results "
                "version, or edited)"
            )
        if run.config_hash in seen:
            raise ImportProblem(f"{path}: runs[{index}] ({run.label}) appears twice")
        seen.add(run.config_hash)
        variants = [e.variant for e in run.evaluations] + [s.variant for s in run.summaries]
        long = [variant for variant in variants if len(variant) > MAX_VARIANT_LABEL]
        if long:
            raise ImportProblem(
                f"{path}: runs[{index}]: variant {long[0]!r} is longer than "
                f"{MAX_VARIANT_LABEL} characters"
            )
        keys = {
            "train.curve": [p.step for p in run.train.curve],
            "evaluations": [(e.variant, e.protocol, e.length) for e in run.evaluations],
            "summaries": [(s.variant, s.protocol, s.name) for s in run.summaries],
        }
        for part, values in keys.items():
            twice = sorted({v for v in values if values.count(v) > 1}, key=str)
            if twice:
                raise ImportProblem(f"{path}: runs[{index}].{part}: {twice[0]} appears twice")
        _check_complete(path, index, run, spec, planned[run.config_hash])
        _check_values(f"{path}: runs[{index}]", run, spec)
        _check_provenance(f"{path}: runs[{index}]", run, spec, planned[run.config_hash])
        summaries[run.config_hash] = _summaries(spec, run)
    missing = [r for h, r in planned.items() if h not in seen]
    if missing:
        names = ", ".join(f"{r.encoding.label} seed {r.seed}" for r in missing)
        raise ImportProblem(
            f"{path}: its spec has {len(planned)} runs, the file {len(seen)}; missing: {names}"
        )
    return summaries


def import_results(
    path: Path, *, actor: str, settings: Settings | None = None, force: bool = False
):
    """Store ``posbench run``'s ``results.json`` at ``path`` as a finished study, submitted
    by ``actor`` (the audit trail records the import); refused (ImportProblem, nothing
    written) when a run's results are already in the database (by config hash, a
    deleted study's aside), unless ``force``."""
    settings = settings or get_settings()
    path = path.expanduser().resolve()
    results, spec = _parse(path)
    planned = {run.config_hash: run for run in spec.runs()}
    summaries = _check_runs(path, results, spec, planned)
    seen = set(summaries)
    with transaction(settings.database) as session:
        if not force:
            there = session.execute(
                select(Run.id, Run.study_id)
                .where(Run.config_hash.in_(seen), Run.status == RunStatus.DONE, in_live_study())
                .order_by(Run.id)
            ).first()
            if there is not None:
                raise ImportProblem(
                    f"{path}: its results are already stored (run {there.id} of study "
                    f"{there.study_id} has the same config hash); --force imports them again"
                )
        study = new_study(spec, actor)
        session.add(study)
        session.flush()
        now = utcnow()
        evaluations = 0
        for run in results.runs:
            last = run.train.curve[-1] if run.train.curve else None  # none: an hf: model
            row = import_run(
                study,
                spec,
                planned[run.config_hash],
                str(path),
                step=run.train.steps,
                latest_loss=last.loss if last else None,
                tokens_per_second=last.tokens_per_second if last else None,
                # The file keeps durations, not times: it finished now, after training.
                started_at=now - dt.timedelta(seconds=max(0.0, last.elapsed if last else 0.0)),
                finished_at=now,
                provenance={**run.provenance, "imported_from": str(path)},
            )
            session.add(row)
            session.flush()
            session.add_all(TrainPoint(run_id=row.id, **asdict(p)) for p in run.train.curve)
            for evaluation in run.evaluations:
                values = asdict(evaluation)
                bins = values.pop("position_bins")
                values.pop("length")
                stored = Evaluation(run_id=row.id, eval_length=evaluation.length, **values)
                session.add(stored)
                session.flush()
                session.add_all(PositionBin(evaluation_id=stored.id, **b) for b in bins)
                evaluations += 1
            session.add_all(
                RunSummary(run_id=row.id, **summary._asdict())
                for summary in summaries[run.config_hash]
            )
        study_id = study.id
        counts = f"{run_count(len(results.runs))}, {evaluations} evaluations"
        detail = f"{spec.name}: {counts} from {path}"
        record(session, actor, Action.IMPORT, study_id=study_id, detail=detail)
    return Imported(study_id, spec.name, len(results.runs), evaluations)
