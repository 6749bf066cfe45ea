"""Export a study to MLflow, for teams that track every experiment there.

One MLflow run per finished posbench run, in an experiment named after the study:

- params: the task, model, training and evaluation settings, the encoding and its
  resolved parameters, the seed (everything the config hash covers);
- tags: ``posbench.*`` ids and hashes, the encoding label, and the provenance (code
  commit, library versions, device, data fingerprint);
- metrics: the training curve (``train/loss``, ``train/val_loss``, ``train/lr``,
  ``train/tokens_per_second`` by step); each extrapolation curve as
  ``eval/<metric>/<variant>/<protocol>`` with the *evaluation length as the step*, so
  MLflow's metric chart is the curve; every summary as ``summary/<name>/<variant>/
  <protocol>``.

MLflow keys allow letters, digits and ``_ - . /``; other characters of a variant's
label (``yarn:4+ft200``) become ``_``, and the exact labels are listed in the
``posbench.variants`` tag. Each run carries the study's spec as the artifact
``posbench_spec.json``.

Under each run, one child run per variant (MLflow's nested runs: the
``mlflow.parentRunId`` tag), named by its line (``rope + yarn:4 seed 0``, ``alibi seed
0``), with the same keys for every variant: ``eval/<metric>/<protocol>`` by length and
``summary/<name>/<protocol>``. Selecting child runs in MLflow's compare view overlays
"rope + yarn:4" and "alibi" on one chart, which one key per variant cannot.

Exporting again skips runs already in the experiment (the same ``posbench.study_id``,
``posbench.run_id`` and ``posbench.config_hash``, the parent finished: it is finished
last); ``replace`` deletes and writes them, children included, anew.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from dataclasses import replace as replace_fields
from typing import Any

from sqlalchemy import select

from core.analysis import ANY_PROTOCOL, line_name
from core.errors import UserError
from core.metrics import METRICS
from core.spec import PROTOCOLS, protocol_title
from core.status import RunStatus
from db.engine import transaction
from db.models import Evaluation, Run, RunSummary, Study, TrainPoint, as_utc
from jobs.audit import deleted_message

CURVE_METRICS = tuple(METRICS.values())  # every metric an evaluation point can carry
TRAIN_METRICS = ("loss", "val_loss", "lr", "tokens_per_second")
BATCH = 900  # MLflow accepts at most 1000 metrics in one log_batch call
_UNSAFE = re.compile(r"[^A-Za-z0-9_\-./]")


class ExportError(UserError, ValueError):
    """The export cannot be made as asked (unknown study, no MLflow client, ...)."""


@dataclass
class Exported:
    experiment: str
    experiment_id: str
    written: list[int] = field(default_factory=list)  # posbench run ids
    skipped: list[int] = field(default_factory=list)  # already in the experiment
    unfinished: list[int] = field(default_factory=list)  # not done: nothing to export


def key(*parts: str) -> str:
    """An MLflow metric or param key from posbench names (unsafe characters -> ``_``)."""
    return "/".join(_UNSAFE.sub("_", part) for part in parts)


def flatten(prefix: str, value: Any) -> dict[str, str]:
    """``{"train": {"lr": 0.002}}`` -> ``{"train.lr": "0.002"}``; lists as JSON."""
    if isinstance(value, dict):
        out: dict[str, str] = {}
        for name, inner in value.items():
            out.update(flatten(f"{prefix}.{name}" if prefix else str(name), inner))
        return out
    if isinstance(value, list | tuple):
        return {prefix: json.dumps(value, default=str)}
    return {prefix: str(value)}


def _client(tracking_uri: str):
    try:
        from mlflow.tracking import MlflowClient
    except ImportError:
        raise ExportError(
            "exporting to MLflow needs its client: pip install 'posbench[mlflow]' (mlflow-skinny)"
        ) from None
    return MlflowClient(tracking_uri=tracking_uri)


def _millis(moment) -> int:
    return int(as_utc(moment).timestamp() * 1000)


def run_params(spec: dict[str, Any], run: Run) -> dict[str, str]:
    """What the run measured with: the study's settings less the lists of encodings and
    seeds, plus this run's encoding (resolved parameters) and seed."""
    settings = {k: v for k, v in spec.items() if k not in ("name", "encodings", "seeds")}
    params = flatten("", settings)
    params.update(flatten("encoding", {"name": run.encoding, **(run.params or {})}))
    params["seed"] = str(run.seed)
    return {key(name): value[:6000] for name, value in params.items()}


def run_tags(study: Study, run: Run, variants: Iterable[str]) -> dict[str, str]:
    provenance = run.provenance if isinstance(run.provenance, dict) else {}
    tags = {
        "posbench.study_id": str(study.id),
        "posbench.study": study.name,
        "posbench.run_id": str(run.id),
        "posbench.label": run.label,
        "posbench.config_hash": run.config_hash,
        "posbench.train_hash": run.train_hash or "",
        "posbench.variants": json.dumps(sorted(variants)),
        "mlflow.source.name": "posbench",
    }
    for name in ("git_commit", "posbench_version", "torch_version", "device_name", "data"):
        if provenance.get(name) is not None:
            tags[f"posbench.{name}"] = str(provenance[name])
    model = provenance.get("model")
    if isinstance(model, dict):  # a HuggingFace model evaluated as it is (model: {hf: ...})
        for name in (
            "hf",
            "hub_id",
            "model_type",
            "config_sha256",
            "weights_sha256",
            "transformers_version",
        ):
            if model.get(name) is not None:
                tags[f"posbench.model.{name}"] = str(model[name])[:5000]
    # What each protocol scored, with the settings that change it (stride, window, ...).
    spec = study.spec if isinstance(study.spec, dict) else {}
    for protocol in (spec.get("eval") or {}).get("protocols") or PROTOCOLS[:1]:
        if protocol in PROTOCOLS:  # a stored spec is checked; a key never takes other text
            tags[f"posbench.protocol.{protocol}"] = protocol_title([spec], protocol)[:5000]
    if "trained_by_run" in provenance:
        tags["posbench.trained_by_run"] = str(provenance["trained_by_run"])
    # Imported with posbench import (or reused from such a run): not trained here.
    tags["posbench.imported"] = "true" if run.imported_from is not None else "false"
    if run.imported_from is not None:
        tags["posbench.imported_from"] = run.imported_from[:5000]
    if run.reused_from_run_id is not None:  # the same results as that run's
        tags["posbench.reused_from_run"] = str(run.reused_from_run_id)
    if provenance.get("finetune"):  # each fine-tuned variant's recipe, loss and time
        tags["posbench.finetune"] = json.dumps(provenance["finetune"])[:5000]
    return tags


def run_metrics(
    session,
    run: Run,
    evaluations: Iterable[Evaluation],
    summaries: Iterable[RunSummary],
    start: int,
    stamp: int,
) -> list[tuple[str, float, int, int]]:
    """(key, value, timestamp ms, step) of every number stored for ``run`` (its
    ``evaluations`` and ``summaries`` given): training points at the run's start plus
    their elapsed time, the rest at ``stamp``."""
    metrics = []
    for point in session.scalars(select(TrainPoint).where(TrainPoint.run_id == run.id)):
        at = start + int(point.elapsed * 1000)
        for name in TRAIN_METRICS:
            value = getattr(point, name)
            if value is not None and math.isfinite(value):
                metrics.append((key("train", name), float(value), at, point.step))
    for row in evaluations:
        for curve in CURVE_METRICS:
            value = getattr(row, curve.column)
            if value is not None and math.isfinite(value):
                metric = key("eval", curve.name, row.variant, row.protocol)
                metrics.append((metric, float(value), stamp, row.eval_length))
    for summary in summaries:
        if summary.value is not None and math.isfinite(summary.value):
            metric = key("summary", summary.name, summary.variant, summary.protocol)
            metrics.append((metric, float(summary.value), stamp, 0))
    return metrics


def variant_metrics(
    evaluations: Iterable[Evaluation], summaries: Iterable[RunSummary], stamp: int
) -> dict[str, list[tuple[str, float, int, int]]]:
    """Each variant's points and summaries under keys without the variant (the child
    runs'), so that one key compares every line; the order probe's under ``none``."""

    out: dict[str, list[tuple[str, float, int, int]]] = {}
    for row in evaluations:
        for curve in CURVE_METRICS:
            value = getattr(row, curve.column)
            if value is not None and math.isfinite(value):
                metric = key("eval", curve.name, row.protocol)
                out.setdefault(row.variant, []).append(
                    (metric, float(value), stamp, row.eval_length)
                )
    for summary in summaries:
        if summary.value is None or not math.isfinite(summary.value):
            continue
        if summary.protocol == ANY_PROTOCOL:
            metric = key("summary", summary.name)
        else:
            metric = key("summary", summary.name, summary.protocol)
        out.setdefault(summary.variant, []).append((metric, float(summary.value), stamp, 0))
    return out


@dataclass
class _RunExport:
    """What one run's export sends, read in one short transaction."""

    run_id: int
    label: str
    seed: int
    start: int
    end: int
    tags: dict[str, str]
    params: dict[str, str]
    metrics: list[tuple[str, float, int, int]]
    variants: dict[str, list[tuple[str, float, int, int]]]
    spec: dict[str, Any]

    @property
    def name(self) -> str:
        return f"{self.label} seed {self.seed}"


def _read_run(url: str, study_id: int, run_id: int) -> _RunExport:
    with transaction(url) as session:
        study = session.get(Study, study_id)
        run = session.get(Run, run_id)
        start = _millis(run.started_at or run.created_at)
        end = _millis(run.finished_at or run.created_at)
        evaluations = session.scalars(select(Evaluation).where(Evaluation.run_id == run_id)).all()
        summaries = session.scalars(select(RunSummary).where(RunSummary.run_id == run_id)).all()
        return _RunExport(
            run_id=run_id,
            label=run.label,
            seed=run.seed,
            start=start,
            end=end,
            tags=run_tags(study, run, {row.variant for row in evaluations}),
            params=run_params(study.spec, run),
            metrics=run_metrics(session, run, evaluations, summaries, start, end),
            variants=variant_metrics(evaluations, summaries, end),
            spec=study.spec,
        )


def to_mlflow(
    url: str,
    study_id: int,
    *,
    tracking_uri: str,
    experiment: str | None = None,
    replace: bool = False,
) -> Exported:
    """Write study ``study_id``'s finished runs to the MLflow tracking server (or store)
    at ``tracking_uri``, in ``experiment`` (default: the study's name). The database is
    read in short transactions, none held across a call to MLflow (a slow server must
    not hold up the workers' writes)."""
    client = _client(tracking_uri)  # first: a clear message when MLflow is missing

    with transaction(url) as session:
        study = session.get(Study, study_id)
        if study is None:
            raise ExportError(f"no study with id {study_id}")
        if study.deleted_at is not None:  # hidden as everywhere, until it is restored
            raise ExportError(deleted_message(study.id, study.deleted_by, study.deleted_at))
        name = experiment or study.name
        runs = session.execute(
            select(Run.id, Run.status, Run.config_hash)
            .where(Run.study_id == study_id)
            .order_by(Run.id)
        ).all()
    found = client.get_experiment_by_name(name)  # also the check that the server answers
    if found is not None and found.lifecycle_stage != "active":
        raise ExportError(
            f"the MLflow experiment {name!r} is deleted: restore it in MLflow, or give "
            "another name with --experiment"
        )
    experiment_id = (
        found.experiment_id
        if found is not None
        else client.create_experiment(name, tags={"posbench.study_id": str(study_id)})
    )
    result = Exported(name, experiment_id)
    for run_id, status, config_hash in runs:
        if status != RunStatus.DONE:
            result.unfinished.append(run_id)
            continue
        # The same run: ids alone are not enough (another database, or ids handed out
        # again after a delete), the configuration must be the same too.
        same = f"tags.`posbench.run_id` = '{run_id}' and tags.`posbench.config_hash` = "
        earlier = [
            r
            for r in client.search_runs([experiment_id], filter_string=f"{same}'{config_hash}'")
            if r.data.tags.get("posbench.study_id") == str(study_id)
        ]
        # A run whose export was cut short (its parent not FINISHED: the parent is
        # finished after every child) is written again, children and all.
        parents = [r for r in earlier if "posbench.variant" not in r.data.tags]
        children = [r for r in earlier if "posbench.variant" in r.data.tags]
        # (A parent without children was exported before there were any: written again.)
        if not replace and children and any(r.info.status == "FINISHED" for r in parents):
            result.skipped.append(run_id)
            continue
        for old in earlier:
            client.delete_run(old.info.run_id)
        export = _read_run(url, study_id, run_id)
        mlflow_id = _write_run(client, experiment_id, export, export.tags, export.name)
        client.log_dict(mlflow_id, export.spec, "posbench_spec.json")  # the study as run
        for variant, metrics in export.variants.items():
            line = line_name(export.label, variant)
            tags = export.tags | {
                "mlflow.parentRunId": mlflow_id,
                "posbench.variant": variant,
                "posbench.line": line,
            }
            child = _write_run(
                client,
                experiment_id,
                replace_fields(
                    export, params=export.params | {"variant": variant}, metrics=metrics
                ),
                tags,
                f"{line} seed {export.seed}",
            )
            client.set_terminated(child, status="FINISHED", end_time=export.end)
        client.set_terminated(mlflow_id, status="FINISHED", end_time=export.end)
        result.written.append(run_id)
    return result


def _write_run(client, experiment_id: str, export: _RunExport, tags: dict[str, str], name: str):
    """Create an MLflow run with ``export``'s params and metrics; its id."""
    from mlflow.entities import Metric, Param

    created = client.create_run(experiment_id, start_time=export.start, tags=tags, run_name=name)
    mlflow_id = created.info.run_id
    params = [Param(k, v) for k, v in export.params.items()]
    for start in range(0, len(params), 90):  # at most 100 params a call
        client.log_batch(mlflow_id, params=params[start : start + 90])
    metrics = [Metric(*m) for m in export.metrics]
    for start in range(0, len(metrics), BATCH):
        client.log_batch(mlflow_id, metrics=metrics[start : start + BATCH])
    return mlflow_id
