"""Commands on results: import a results.json, export to MLflow, export a run as a
Hugging Face model, print curves, summaries and pairwise claims."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Annotated

import typer

from cli.common import (
    _check_id,
    _database,
    _first_line,
    _missing_study,
    app,
    cli_actor,
    console,
    fail,
)
from core.safe_text import redact_url
from core.status import ACTIVE
from core.terminal import echo


@app.command("import")
def import_(
    results_file: Annotated[
        Path, typer.Argument(show_default=False, help="results.json written by posbench run.")
    ],
    force: Annotated[
        bool, typer.Option("--force", help="Import results already in the database again.")
    ] = False,
) -> None:
    """Store the results of `posbench run` as a finished study, marked imported: the
    dashboard compares it, `posbench results` and SQL query it, and a later submit
    reuses its runs only with --reuse-imported."""
    from core.settings import get_settings
    from jobs.transfer.importer import ImportProblem, import_results

    url = _database()
    try:
        done = import_results(results_file, actor=cli_actor(), settings=get_settings(), force=force)
    except ImportProblem as err:
        fail(str(err), code=2)
    echo(
        f"imported study {done.study_id} ({done.name}): {done.runs} runs, "
        f"{done.evaluations} evaluations (database {redact_url(url)}); its runs are marked "
        "imported, and a submit reuses them only with --reuse-imported"
    )


@app.command()
def export(
    study: Annotated[int, typer.Argument(show_default=False, help="The study's id.")],
    to: Annotated[str, typer.Option("--to", help="Where: mlflow.")] = "mlflow",
    tracking_uri: Annotated[
        str | None,
        typer.Option(
            "--tracking-uri",
            envvar="MLFLOW_TRACKING_URI",
            help="The MLflow tracking server (http://host:5000) or store; default: "
            "MLFLOW_TRACKING_URI.",
        ),
    ] = None,
    experiment: Annotated[
        str | None,
        typer.Option("--experiment", help="MLflow experiment (default: the study's name)."),
    ] = None,
    replace: Annotated[
        bool, typer.Option("--replace", help="Write runs already exported again.")
    ] = False,
) -> None:
    """Export a study's finished runs to MLflow: parameters, tags, the training curves,
    the extrapolation curves (evaluation length as the step) and the summaries."""
    from sqlalchemy.exc import SQLAlchemyError

    from jobs.transfer.mlflow_export import ExportError, to_mlflow

    _check_id(study, "the study id")
    if to != "mlflow":
        fail(f"--to must be mlflow, got {to!r}", code=2)
    if not tracking_uri:
        fail("give --tracking-uri (e.g. http://localhost:5000) or set MLFLOW_TRACKING_URI", 2)
    url = _database()
    # An unreachable server answers in seconds, not after MLflow's minutes of retries.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
    try:
        done = to_mlflow(
            url, study, tracking_uri=tracking_uri, experiment=experiment, replace=replace
        )
    except ExportError as err:
        fail(str(err), code=2)
    except SQLAlchemyError as err:
        fail(f"the database {redact_url(url)}: {_first_line(err)}", code=1)
    except Exception as err:  # the tracking server refused or is unreachable
        # No credentials in the message: MLflow's own repeats the whole URL.
        message = re.sub(r"//[^/@\s]*@", "//", f"MLflow at {tracking_uri}: {_first_line(err)}")
        fail(message, code=1)
    echo(
        f"study {study} -> MLflow experiment {done.experiment!r} ({done.experiment_id}): "
        f"{len(done.written)} runs written, {len(done.skipped)} already there"
        + (f", {len(done.unfinished)} not finished (not exported)" if done.unfinished else "")
    )


@app.command("export-hf")
def export_hf(
    run: Annotated[
        int, typer.Argument(show_default=False, help="The run's id (posbench status STUDY).")
    ],
    out: Annotated[
        Path,
        typer.Option(
            "--out",
            show_default=False,
            help="The folder to write: new or empty, or an earlier export with --force.",
        ),
    ],
    variant: Annotated[
        str | None,
        typer.Option(
            "--variant",
            "--with-scaling",
            help="A RoPE scaling for the config, named as in eval.variants (yarn:4, pi:2); "
            "default: the trained model as it is.",
        ),
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Replace an earlier export in --out.")
    ] = False,
) -> None:
    """Write a finished run as a Hugging Face transformers folder (GPT-NeoX, byte
    tokenizer) that AutoModelForCausalLM loads; checked against posbench's logits."""
    from sqlalchemy.exc import SQLAlchemyError

    from cli.hf_export import ExportFailed, ExportRefused, export_run
    from core.settings import get_settings

    _check_id(run, "the run id")
    url = _database()
    artifacts = get_settings().artifacts_dir
    try:
        done = export_run(url, run, out, artifacts=artifacts, variant=variant, force=force)
    except ExportRefused as err:
        fail(str(err), code=2)
    except ExportFailed as err:
        fail(str(err), code=1)
    except SQLAlchemyError as err:
        fail(f"the database {redact_url(url)}: {_first_line(err)}", code=1)
    echo(
        f"run {run} ({done.variant}) -> {done.out}: transformers' logits equal posbench's "
        f"to {done.difference:.1e} at {done.checked_length} tokens"
    )


@app.command()
def results(
    study: Annotated[int, typer.Option("--study", help="The study id.")],
    output: Annotated[str, typer.Option("--format", help="table, csv or json.")] = "table",
    protocol: Annotated[
        str | None,
        typer.Option(
            "--protocol",
            help="nonoverlapping, sliding, document or decode (default: every protocol for "
            "curves, the first for summaries and pairwise).",
        ),
    ] = None,
    view: Annotated[
        str,
        typer.Option(
            "--view",
            help="curves (metric by length), summaries (extrapolation ratio, effective "
            "length, log-perplexity area, order probe: mean and bootstrap 95% interval "
            "across seeds), pairwise (P(A beats B) at each length), groups (synthetic "
            "tasks: accuracy by each group key, e.g. depth or word-order variant) or train "
            "(the training curves: every point with csv/json, one row per run as a table).",
        ),
    ] = "curves",
    factor: Annotated[
        float | None,
        typer.Option("--factor", help="pairwise: only this multiple of the training length."),
    ] = None,
    metric: Annotated[
        str | None,
        typer.Option(
            "--metric",
            help="curves as a table: the metric shown (default: the study's), e.g. loss or an "
            "attention diagnostic such as attn_entropy (csv and json carry every one).",
        ),
    ] = None,
) -> None:
    """A study's results: its curves, their summaries, or pairwise comparisons."""
    from core.metrics import Kind, kind_of
    from db import queries

    _check_results_options(study, output, view, factor, protocol)
    if metric is not None and view != "curves":
        fail("--metric applies to --view curves only", code=2)
    url = _database()
    studies = queries.studies(url, [study])
    if studies.empty:
        _missing_study(url, study)
    row = studies.iloc[0]
    if protocol is not None:
        evaluated = (queries.study_spec(url, study) or {}).get("eval", {}).get("protocols", [])
        if protocol not in evaluated:
            fail(
                f"study {study} is evaluated with {', '.join(evaluated)}, not {protocol!r}",
                code=2,
            )
    if view == "groups" and kind_of(row["metric"]) is not Kind.ANSWER:
        fail(
            f"--view groups applies to synthetic tasks; study {study} ({row['task']}) is "
            "language modelling",
            code=2,
        )
    if metric is not None:
        row = row.copy()
        row["metric"] = _shown_metric(metric, row)
    frame, title = _view_frame(url, row, view, protocol, factor)
    frame, note = _mark_imported(url, row, frame, output)
    _print_results(frame, row, view, output, title)
    if note:  # after the table; on stderr beside csv and json, which stay parseable
        if output == "table":
            console.print(note, highlight=False)
        else:
            echo(f"note: {note}", err=True)


def _shown_metric(name: str, study) -> str:
    """``--metric``: a registered metric an evaluation of the study's task carries."""
    from core.metrics import METRICS, kind_of

    kind = kind_of(study["metric"])
    allowed = [m.name for m in METRICS.values() if m.measured_by(kind)]
    if name not in allowed:
        fail(
            f"--metric {name[:60]!r} is not a metric of study {int(study['id'])} "
            f"({study['task']}); allowed: {', '.join(allowed)}",
            code=2,
        )
    return name


def _mark_imported(url: str, row, frame, output: str):
    """The frame with an ``imported`` column (csv and json of the views with a run per
    row), and the note to print when some of the study's runs were imported rather
    than trained here; None when none was."""
    from core.analysis import imported_note
    from db import queries

    runs = queries.runs(url, study_id=int(row["id"]))
    imported = set(runs.loc[runs["imported_from"].notna(), "id"].tolist())
    if output != "table" and "run_id" in frame.columns:
        frame = frame.assign(imported=frame["run_id"].isin(imported))
    if not imported:
        return frame, None
    return frame, imported_note(int(row["id"]), len(imported), len(runs))


RESULT_VIEWS = ("curves", "summaries", "pairwise", "groups", "train")


def _check_results_options(
    study: int, output: str, view: str, factor: float | None, protocol: str | None
) -> None:
    from core.spec import MAX_EVAL_LENGTH, PROTOCOLS  # no evaluation is longer: no factor larger

    _check_id(study, "--study")
    if output not in ("table", "csv", "json"):
        fail(f"--format must be table, csv or json, got {output!r}", code=2)
    if view not in RESULT_VIEWS:
        fail(f"--view must be one of {', '.join(RESULT_VIEWS)}, got {view!r}", code=2)
    if factor is not None and view != "pairwise":
        fail("--factor applies to --view pairwise only", code=2)
    if factor is not None and not (math.isfinite(factor) and 0 < factor <= MAX_EVAL_LENGTH):
        fail(f"--factor must be a number from 0 to {MAX_EVAL_LENGTH}, got {factor:g}", code=2)
    if protocol is not None and protocol not in PROTOCOLS:
        fail(f"--protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}", code=2)


def _view_frame(url: str, row, view: str, protocol: str | None, factor: float | None):
    """The frame a view shows, and its title."""
    from core import analysis
    from core.spec import protocol_title
    from db import queries

    study = int(row["id"])
    frame = queries.curves(url, study_ids=[study], protocol=protocol)
    if view in ("summaries", "pairwise") and protocol is None and not frame.empty:
        # One protocol at a time: its curves are the ones summarised and compared.
        protocol = sorted(frame["protocol"].unique())[0]
        frame = frame[frame["protocol"] == protocol]
    if view == "summaries":
        stored = analysis.with_lines(queries.run_summaries(url, [study], protocol))
        return analysis.summary_statistics(stored), f"summaries across seeds ({protocol})"
    if view == "pairwise":
        return _pairwise(frame, row, factor), f"pairwise ({protocol}): P(a beats b) across seeds"
    if view == "groups":
        return analysis.group_accuracy(analysis.with_lines(frame)), "accuracy by group"
    if view == "train":
        runs = queries.runs(url, study_id=study)
        frame = analysis.training_curves(queries.train_points(url, runs["id"].tolist()), runs)
        return frame, "training (one row per run; --format csv or json for every point)"
    # Every number with what it was scored by: the protocol and its settings (stride, ...).
    stored = queries.study_spec(url, study)
    labels = {p: protocol_title([stored], p) for p in frame["protocol"].unique()}
    return frame.assign(protocol_label=frame["protocol"].map(labels)), "curves"


def _print_results(frame, row, view: str, output: str, title: str) -> None:
    from core import analysis
    from core.metrics import metric_named
    from jobs.watch import curve_table, frame_table

    study = int(row["id"])
    if output == "csv":
        echo(frame.drop(columns=["groups"], errors="ignore").to_csv(index=False), end="")
    elif output == "json":
        echo(frame.to_json(orient="records"))
    elif view == "curves":
        console.print(curve_table(frame.assign(protocol=frame["protocol_label"]), row))
        if metric_named(str(row["metric"])).diagnostic and frame[row["metric"]].isna().all():
            console.print(
                f"study {study}: no {row['metric']}: its spec has no eval.diagnostics "
                "(docs/diagnostics.md)"
            )
    elif frame.empty:
        if sum(int(row[status] or 0) for status in ACTIVE) == 0:
            console.print(
                f"study {study} ({row['name']}): no {view}: every run has ended and none "
                "could be computed (see posbench status)"
            )
        else:
            console.print(
                f"study {study} ({row['name']}): no {view} yet (they come as runs finish)"
            )
    else:
        if view == "summaries":  # the key ones; --format json has them all
            frame = analysis.summary_grid(frame, analysis.KEY_SUMMARIES).reset_index()
        elif view == "train":
            frame = analysis.training_table(frame)
        console.print(frame_table(frame, f"study {study} ({row['name']}): {title}"))


def _pairwise(frame, study, factor: float | None):
    from core import analysis

    frame = analysis.with_lines(frame)
    train_length = int(study["train_length"])
    if factor is not None:
        frame = frame[frame["eval_length"] == round(factor * train_length)]
        if frame.empty:
            fail(f"--factor {factor:g}: no evaluation at {factor:g} x {train_length}", code=2)
    table = analysis.pairwise_table(frame, study["metric"], line="line")
    table["claim"] = [analysis.claim(row, train_length) for _, row in table.iterrows()]
    return table
