"""The results a claimed run writes, each guarded by the run's lease, and what it reads
back of them.

Every write names the run's lease (``jobs.lifecycle.ClaimedRun``), so a worker that
lost its run to the reconciler can no longer touch it; every write is an idempotent
upsert, so a redelivered run rewrites the same rows.
"""

from __future__ import annotations

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from core.analysis import Summary
from core.results_schema import Evaluation as EvaluationRow
from db.engine import transaction, with_retry
from db.models import Evaluation, PositionBin, Run, RunSummary
from db.queries import run_points
from db.upsert import upsert
from jobs.lifecycle import ClaimedRun, hold, under_lease


def stored_provenance(session: Session, run_id: int) -> dict:
    """A copy of the run's provenance as stored ({} when it has none), to change and
    write back in the same transaction."""
    stored = session.scalar(select(Run.provenance).where(Run.id == run_id))
    return dict(stored) if isinstance(stored, dict) else {}


def note_provenance(claimed: ClaimedRun, key: str, name: str, value: dict) -> dict:
    """Store ``provenance[key][name] = value`` now (a fine-tuned variant's record), so an
    attempt that dies later keeps it; returns the run's provenance after the change."""

    def attempt() -> dict:
        with transaction(claimed.url) as session:
            hold(session, claimed)
            provenance = stored_provenance(session, claimed.run_id)
            provenance[key] = {**provenance.get(key, {}), name: value}
            session.execute(
                update(Run).where(Run.id == claimed.run_id).values(provenance=provenance)
            )
            return provenance

    return under_lease(claimed, attempt)


def record_evaluation(claimed: ClaimedRun, row: EvaluationRow) -> None:
    """Upsert one point of the curve with its position bins (idempotent on redelivery)."""

    def attempt() -> None:
        with transaction(claimed.url) as session:
            hold(session, claimed)
            values = row.to_dict()
            bins = values.pop("position_bins")
            values["eval_length"] = values.pop("length")
            evaluation_id = upsert(
                session,
                Evaluation.__table__,
                {"run_id": claimed.run_id, **values},
                keys=("run_id", "variant", "protocol", "eval_length"),
            )
            for b in bins:
                upsert(
                    session,
                    PositionBin.__table__,
                    {"evaluation_id": evaluation_id, **b},
                    keys=("evaluation_id", "start"),
                    returning=None,
                )

    under_lease(claimed, attempt)


def stored_evaluations(url: str, run_id: int) -> set[tuple[str, str, int]]:
    def attempt() -> set[tuple[str, str, int]]:
        with transaction(url) as session:
            rows = session.execute(
                select(Evaluation.variant, Evaluation.protocol, Evaluation.eval_length).where(
                    Evaluation.run_id == run_id
                )
            )
            return {(v, p, n) for v, p, n in rows}

    return with_retry(attempt)


def stored_points(url: str, run_id: int, metric: str) -> list[tuple[str, str, int, float]]:
    """(variant, protocol, length, metric) of every stored point of a run (None where
    not applicable)."""

    def attempt() -> list[tuple[str, str, int, float]]:
        with transaction(url) as session:
            return [tuple(row) for row in session.execute(run_points(run_id, metric))]

    return with_retry(attempt)


def record_summaries(claimed: ClaimedRun, summaries: list[Summary]) -> None:
    """Upsert a run's summaries (idempotent: a retried finish rewrites the same rows)."""

    def attempt() -> None:
        with transaction(claimed.url) as session:
            hold(session, claimed)
            for summary in summaries:
                upsert(
                    session,
                    RunSummary.__table__,
                    {"run_id": claimed.run_id, **summary._asdict()},
                    keys=("run_id", "variant", "protocol", "name"),
                    returning=None,
                )

    under_lease(claimed, attempt)
