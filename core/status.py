"""A run's status: the five values a run's ``status`` column holds.

Torch-free and free of the database, so that every layer can name a status:
the models (``db.models``), the read queries, the renderers and the dashboard.
Only ``jobs.lifecycle`` *changes* a run's status; everyone else reads it.

``RunStatus`` is a ``StrEnum``: a member equals its string (``RunStatus.DONE ==
"done"``), so rows and DataFrames, which hold plain strings, compare with it.
"""

from __future__ import annotations

from enum import StrEnum


class RunStatus(StrEnum):
    QUEUED = "queued"  # stored, sent (or to be sent) to the broker, waiting for a worker
    RUNNING = "running"  # claimed by a worker, which holds its lease
    DONE = "done"  # trained and evaluated; its results are final
    FAILED = "failed"  # stopped with a readable reason; a retry queues it again
    CANCELLED = "cancelled"  # stopped by a user (or never started); a retry queues it again


# Every status, in the order a run goes through them (the columns of a status count).
RUN_STATUSES: tuple[RunStatus, ...] = tuple(RunStatus)
# A run waiting for a worker or held by one: a study with one is busy.
ACTIVE: tuple[RunStatus, ...] = (RunStatus.QUEUED, RunStatus.RUNNING)
# A run no worker will touch again (until a retry, for failed and cancelled).
FINISHED: tuple[RunStatus, ...] = (RunStatus.DONE, RunStatus.FAILED, RunStatus.CANCELLED)
# Not a status: what a cancel does to a running run, which stops at its next check
# (its status stays RUNNING until it does, then CANCELLED).
STOPPING = "stopping"
# The statuses a retry queues again.
RETRYABLE: tuple[RunStatus, ...] = (RunStatus.FAILED, RunStatus.CANCELLED)
