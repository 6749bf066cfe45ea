"""Which queues live workers serve, and the queue a study goes to.

A study that names no queue goes to the first of ``QUEUES`` (gpu, then cpu) that a
live worker serves, so that a preset submitted to a CPU-only cluster runs. A study
that names a queue goes there even when no live worker serves it (one may join), but
the submitter is told, with the queues that do have workers: nothing waits silently.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.settings import Settings, get_settings
from core.spec import QUEUES, StudySpec

# How long to wait for the workers' answers: Celery's broadcast gathers replies
# until then, so it is the time a submission spends asking.
ASK_SECONDS = 1.0


def live_queues(
    settings: Settings | None = None, timeout: float = ASK_SECONDS
) -> dict[str, int] | None:
    """Each queue a live worker consumes from, with how many workers do; ``None`` when
    the broker cannot be asked (then nothing is known, and nothing is said)."""
    from jobs.celery_app import producer

    app = producer(settings or get_settings())
    try:
        with app.connection_for_write() as connection:
            connection.ensure_connection(max_retries=1, timeout=5)
            replies = app.control.inspect(timeout=timeout, connection=connection).active_queues()
    except Exception:  # an unreachable or refusing broker: the submit path says so itself
        return None
    served: dict[str, int] = {}
    for queues in (replies or {}).values():
        for name in {queue.get("name") for queue in queues or []}:
            if name in QUEUES:
                served[name] = served.get(name, 0) + 1
    return served


@dataclass(frozen=True)
class Routing:
    """Where a study goes, and what the live workers were when it was decided."""

    queue: str
    chosen: bool  # the study named no queue: ``queue`` was chosen from the live workers
    served: dict[str, int] | None  # queue -> live workers; None: not known

    @property
    def unserved(self) -> bool:
        return self.served is not None and not self.served.get(self.queue)

    def warning(self) -> str | None:
        """One line when no live worker serves the study's queue, naming it and the
        queues that have workers."""
        if not self.unserved:
            return None
        others = ", ".join(
            f"{name} ({count} worker{'s' * (count != 1)})"
            for name, count in sorted(self.served.items())
        )
        where = (
            f"queues with live workers: {others}"
            if others
            else "no worker answered on any queue (start one: posbench worker, or "
            "docker compose up -d)"
        )
        return (
            f"no live worker serves queue {self.queue!r}: its runs wait there until one "
            f"does; {where}"
        )

    def apply(self, spec: StudySpec) -> StudySpec:
        """``spec`` sent to this queue."""
        return spec if spec.queue == self.queue else spec.model_copy(update={"queue": self.queue})

    def note(self) -> str | None:
        """What was chosen for a study that named no queue."""
        if not self.chosen or self.unserved:
            return None
        return f"queue {self.queue!r} (the study names none; it has live workers)"


def preferred_queue(served: dict[str, int] | None, default: str = QUEUES[0]) -> str:
    """The first of ``QUEUES`` that a live worker serves; ``default`` when none does or
    nothing is known."""
    return next((name for name in QUEUES if (served or {}).get(name)), default)


def route(spec: StudySpec, served: dict[str, int] | None) -> Routing:
    """The queue for ``spec``: its own when it names one, else ``preferred_queue``."""
    if "queue" in spec.model_fields_set:
        return Routing(spec.queue, chosen=False, served=served)
    return Routing(preferred_queue(served, spec.queue), chosen=bool(served), served=served)
