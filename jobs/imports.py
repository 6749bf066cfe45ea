"""Import the ``results.json`` of ``posbench run`` into the results database.

A study run on a laptop or a lone GPU box, without the service, joins the others: the
dashboard compares it, ``posbench results`` and SQL query it, and a later submit reuses
its runs by config hash like any finished run. The file is checked whole before
anything is written (its spec is validated as a submitted one; every run must be one of
that spec's runs, by the config hash this version computes), and the study is written in
one transaction: all of it or nothing.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from sqlalchemy import select

from db.engine import transaction
from db.models import Evaluation, PositionBin, Run, RunSummary, TrainPoint, utcnow
from jobs.service import new_run, new_study
from jobs.settings import Settings, get_settings
from jobs.spec import MAX_VARIANT_LABEL, SpecError, parse_spec
from worker.encodings import REGISTRY
from worker.evaluate import Evaluation as Row
from worker.evaluate import evaluation_plan
from worker.train import TrainPoint as Point


class ImportProblem(ValueError):
    """The file cannot be imported: what is wrong with it, and nothing was written."""


class _Loose(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Train(_Loose):
    steps: int = Field(ge=0)
    curve: list[Point] = Field(default_factory=list)  # the worker's own records


class _Summary(_Loose):
    variant: str = Field(max_length=MAX_VARIANT_LABEL)
    protocol: str
    name: str = Field(max_length=40)
    value: float | None


class _Run(_Loose):
    label: str
    seed: int
    config_hash: str
    train: _Train
    evaluations: list[Row]
    summaries: list[_Summary] = Field(default_factory=list)
    provenance: dict[str, Any] = Field(default_factory=dict)


class _Results(_Loose):
    spec: dict[str, Any]
    runs: list[_Run] = Field(min_length=1)


@dataclass
class Imported:
    study_id: int
    name: str
    runs: int
    evaluations: int


def _read(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except OSError as err:
        raise ImportProblem(f"{path}: cannot be read ({err.strerror or err})") from None
    except ValueError as err:
        raise ImportProblem(f"{path}: not JSON ({err})") from None


def _where(error: dict[str, Any]) -> str:
    return ".".join(str(part) for part in error["loc"]) or "the file"


def _check_complete(path: Path, index: int, run: _Run, spec, planned) -> None:
    """A run is stored as done only when it is whole: trained for the spec's steps, and
    evaluated at exactly the points its spec plans for it."""
    where = f"{path}: runs[{index}] ({run.label}, seed {run.seed})"
    if run.train.steps != spec.train.steps or not run.train.curve:
        raise ImportProblem(
            f"{where} trained {run.train.steps} of {spec.train.steps} steps"
            + ("" if run.train.curve else ", with no training curve")
        )
    scalable = REGISTRY[planned.encoding.name].scalable
    plan = {(v.label, p, n) for v, p, n in evaluation_plan(spec.eval, scalable)}
    stored = {(e.variant, e.protocol, e.length) for e in run.evaluations}
    if stored - plan:
        raise ImportProblem(f"{where}: evaluation {sorted(stored - plan)[0]} is not in its plan")
    if plan - stored:
        raise ImportProblem(f"{where}: evaluation {sorted(plan - stored)[0]} is missing")


def _summaries(spec, run: _Run) -> list:
    """The run's curve summaries computed from its points here (not taken from the file,
    so they always match the curve), and the order probe's as the file has them."""
    from jobs.analysis import ANY_PROTOCOL, summarize_points

    metric = spec.task.metric
    points = ((e.variant, e.protocol, e.length, getattr(e, metric)) for e in run.evaluations)
    probe = {s.name: s.value for s in run.summaries if s.protocol == ANY_PROTOCOL}
    return summarize_points(
        points, train_length=spec.train.length, metric=metric, extra=probe or None
    )


def import_results(path: Path, *, settings: Settings | None = None, force: bool = False):
    """Store ``posbench run``'s ``results.json`` at ``path`` as a finished study; refused
    (ImportProblem, nothing written) when a run's results are already in the database
    (by config hash), unless ``force``."""
    settings = settings or get_settings()
    path = path.expanduser().resolve()
    data = _read(path)
    if not isinstance(data, dict):
        raise ImportProblem(f"{path}: not the results.json of posbench run (a JSON object)")
    try:
        results = _Results.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        raise ImportProblem(f"{path}: {_where(first)}: {first['msg']}") from None
    try:
        spec = parse_spec(results.spec)
    except SpecError as err:
        raise ImportProblem(f"{path}: its spec: {err}") from None
    planned = {run.config_hash: run for run in spec.runs()}
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
        long = [e.variant for e in run.evaluations if len(e.variant) > MAX_VARIANT_LABEL]
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
        summaries[run.config_hash] = _summaries(spec, run)
    missing = [r for h, r in planned.items() if h not in seen]
    if missing:
        names = ", ".join(f"{r.encoding.label} seed {r.seed}" for r in missing)
        raise ImportProblem(
            f"{path}: its spec has {len(planned)} runs, the file {len(seen)}; missing: {names}"
        )
    with transaction(settings.database) as session:
        if not force:
            there = session.execute(
                select(Run.id, Run.study_id)
                .where(Run.config_hash.in_(seen), Run.status == "done")
                .order_by(Run.id)
            ).first()
            if there is not None:
                raise ImportProblem(
                    f"{path}: its results are already stored (run {there.id} of study "
                    f"{there.study_id} has the same config hash); --force imports them again"
                )
        study = new_study(spec)
        session.add(study)
        session.flush()
        now = utcnow()
        evaluations = 0
        for run in results.runs:
            last = run.train.curve[-1]
            row = new_run(
                study,
                spec,
                planned[run.config_hash],
                step=run.train.steps,
                latest_loss=last.loss,
                tokens_per_second=last.tokens_per_second,
                status="done",
                # The file keeps durations, not times: it finished now, after training.
                started_at=now - dt.timedelta(seconds=max(0.0, last.elapsed)),
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
    return Imported(study_id, spec.name, len(results.runs), evaluations)
