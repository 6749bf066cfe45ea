"""Queue: studies and their runs, refreshed live without rerunning the whole page; for
operators, cancel, retry, delete and restore, and the audit trail's recent events."""

from __future__ import annotations

import datetime as dt

import pandas as pd
import streamlit as st

from core import analysis
from core.safe_text import markdown
from core.settings import get_settings
from core.status import ACTIVE, RUN_STATUSES, STOPPING, RunStatus
from dashboard.auth import actor, can_operate, fragment
from dashboard.common import (
    database,
    imported_captions,
    picker_studies,
    query_ints,
    schema_ready,
    set_query,
)
from db import queries
from db.engine import transaction
from db.models import Study
from jobs.retention import Busy, busy_message, delete_study, restore_study
from jobs.service import NotFound
from jobs.watch import progress

REFRESH_SECONDS = 2
EVENTS_SHOWN = 50


def eta(row: pd.Series, tokens_per_step: int) -> str:
    if row["status"] != RunStatus.RUNNING or not row["tokens_per_second"]:
        return ""
    remaining = (row["total_steps"] - row["step"]) * tokens_per_step / row["tokens_per_second"]
    return str(dt.timedelta(seconds=round(remaining)))


def runs_view(study_id: int, tokens_per_step: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    runs = queries.runs(database(), study_id=study_id)
    # Training steps, or an hf: model's stored points out of its plan.
    counts = progress(runs, queries.study_spec(database(), study_id))
    view = pd.DataFrame(
        {
            "run": runs["id"],
            "encoding": runs["label"],
            "seed": runs["seed"],
            "status": runs["status"],
            "progress": (counts["completed"] / counts["total"].where(counts["total"] > 0)).fillna(
                0.0
            ),
            "step": counts["progress"],
            # Numeric even when every run is still queued (or reused) and the column is null.
            "loss": pd.to_numeric(runs["latest_loss"]).round(4),
            "tokens/s": pd.to_numeric(runs["tokens_per_second"]).round(0),
            "ETA": [eta(row, tokens_per_step) for _, row in runs.iterrows()],
            "attempts": runs["attempts"],
            "note": analysis.run_notes(runs),
            "failure": runs["failure_reason"].fillna(""),
        }
    )
    return view, runs


@fragment(run_every=REFRESH_SECONDS)
def live_runs(study_id: int, tokens_per_step: int) -> None:
    view, runs = runs_view(study_id, tokens_per_step)
    counts = view["status"].value_counts().to_dict()
    st.caption(
        " · ".join(f"{counts.get(status, 0)} {status}" for status in RUN_STATUSES)
        + f" · refreshed every {REFRESH_SECONDS}s"
    )
    st.dataframe(
        view,
        hide_index=True,
        width="stretch",
        key=f"runs-{study_id}",
        column_config={
            "progress": st.column_config.ProgressColumn(
                "progress", min_value=0.0, max_value=1.0, format="percent"
            )
        },
    )
    for row in runs.itertuples():
        if row.status == RunStatus.FAILED:
            st.error(
                f"run {row.id} ({markdown(row.label)}, seed {row.seed}) failed: "
                + markdown(row.failure_reason)
            )
    with st.expander("Provenance"):
        for row in runs.itertuples():
            if isinstance(row.provenance, dict):
                st.write(f"run {row.id} ({markdown(row.label)}, seed {row.seed})")
                st.json(row.provenance, expanded=False)


def render() -> None:
    st.title("Queue")
    if not schema_ready():
        return
    operator = can_operate()  # viewers read; operators cancel, retry, delete and restore
    wanted = query_ints("study")
    studies = picker_studies("study", wanted[:1])
    if studies is None:
        st.info("No study yet: submit one on the Submit page or with `posbench submit`.")
        if operator:
            _deleted()
            _events(None)
        return
    if studies.empty:
        return
    ids = studies["id"].tolist()
    default = ids.index(wanted[0]) if wanted and wanted[0] in ids else 0
    labels = {
        row.id: f"{row.id}: {row.name} ({row.runs} runs, {row.task})"
        for row in studies.itertuples()
    }
    study_id = st.selectbox("Study", ids, index=default, format_func=labels.get, key="study")
    set_query("study", [study_id])
    study = studies.set_index("id").loc[study_id]

    with transaction(database()) as session:
        stored = session.get(Study, study_id).spec
    # Read as stored: a study submitted under earlier, looser rules must still show.
    train = stored.get("train", {})
    tokens_per_step = (
        train.get("batch_size", 16) * train.get("grad_accum", 1) * train.get("length", 128)
    )
    st.write(
        f"**{markdown(study['name'])}** · task {markdown(study['task'])} · train length "
        f"{study['train_length']} · {study['runs']} runs"
    )
    imported_captions(studies[studies["id"] == study_id])
    left, right, _ = st.columns([1, 1, 4]) if operator else (None, None, None)
    if left is not None and left.button("Cancel study", key="cancel"):
        from jobs.service import cancel

        counts = cancel(study_id=study_id, actor=actor())
        st.toast(f"{counts[RunStatus.CANCELLED]} cancelled, {counts[STOPPING]} stopping")
    if right is not None and right.button("Retry failed / cancelled", key="retry"):
        from jobs.service import retry

        st.toast(f"{len(retry(study_id=study_id, actor=actor()))} runs queued again")
    live_runs(study_id, tokens_per_step)
    if operator:
        _one_run(study_id)
        _delete(study_id, study)
        _deleted()
        _events(study_id)


def _one_run(study_id: int) -> None:
    with st.expander("One run"):
        runs = queries.runs(database(), study_id=study_id)
        run_id = st.selectbox(
            "Run",
            runs["id"].tolist(),
            key="run",
            format_func=lambda i: f"{i}: {runs.set_index('id').loc[i, 'label']}",
        )
        a, b, _ = st.columns([1, 1, 4])
        if a.button("Cancel run", key="cancel-run"):
            from jobs.service import cancel

            cancel(run_id=run_id, actor=actor())
        if b.button("Retry run", key="retry-run"):
            from jobs.service import retry

            retry(run_id=run_id, actor=actor())


def _delete(study_id: int, study: pd.Series) -> None:
    """Delete a study that has nothing queued or running, after an explicit tick; it can
    be restored within the retention period."""

    with st.expander("Delete study"):
        busy = sum(int(study[status]) for status in ACTIVE)
        if busy:
            st.caption(markdown(busy_message(study_id, busy)))
            return
        days = get_settings().delete_retention_days
        sure = st.checkbox(
            f"Delete study {study_id} with its {study['runs']} runs: hidden at once, "
            f"restorable for {days:g} days, then purged with its curves, evaluations, "
            "summaries and checkpoints",
            key="delete-sure",
        )
        if not st.button("Delete study", key="delete", disabled=not sure, type="primary"):
            return
        try:
            deleted = delete_study(study_id, actor=actor())
        except (Busy, NotFound) as err:
            st.error(markdown(err))
            return
        st.toast(f"deleted study {study_id} ({markdown(deleted.name)}): {deleted.runs} runs")
        for key in ("study", "delete-sure"):
            st.session_state.pop(key, None)
        set_query("study", [])
        st.rerun()


def _deleted() -> None:
    """The deleted studies not yet purged, and the way back for one."""
    deleted = queries.deleted_studies(database())
    if deleted.empty:
        return
    with st.expander(f"Deleted studies ({len(deleted)})"):
        days = get_settings().delete_retention_days
        st.caption(
            f"Restorable for {days:g} days after the delete; then purged with their "
            "results and checkpoints."
        )
        shown = ["id", "name", "runs", "submitted_by", "deleted_by", "deleted_at"]
        st.dataframe(deleted[shown], hide_index=True, width="stretch", key="deleted")
        names = dict(zip(deleted["id"], deleted["name"], strict=True))
        chosen = st.selectbox(
            "Study", list(names), key="restore-study", format_func=lambda i: f"{i}: {names[i]}"
        )
        if not st.button("Restore study", key="restore"):
            return
        try:
            restored = restore_study(chosen, actor=actor())
        except NotFound as err:
            st.error(markdown(err))
            return
        st.toast(f"restored study {chosen} ({markdown(restored.name)}): {restored.runs} runs")
        st.session_state.pop("study", None)
        set_query("study", [chosen])
        st.rerun()


def _events(study_id: int | None) -> None:
    """The audit trail's newest events, of the study in view or of every study."""
    with st.expander("Events (who did what)"):
        every = study_id is None or st.toggle("Of every study", key="events-all")
        frame = queries.events(database(), None if every else study_id, EVENTS_SHOWN)
        if frame.empty:
            st.caption("No event yet.")
            return
        st.caption(f"The newest {EVENTS_SHOWN} at most, newest first; times in UTC.")
        ids = {"study_id": "study", "run_id": "run"}
        # Nullable integers: pandas reads a column with gaps as floats (3.0, NaN).
        frame = frame.astype({column: "Int64" for column in ids}).rename(columns=ids)
        st.dataframe(frame, hide_index=True, width="stretch", key="events")
