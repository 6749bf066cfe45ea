"""Checkpoints: written atomically and durably, stamped with what they hold.

A checkpoint is the trainer's ``state_dict()`` (model, optimizer, RNG states, step,
curve, the running interval) plus three stamps: the format version, the run's
fingerprint (its train hash) and the data's. A run that finds its own checkpoint
resumes from it; one of another configuration, of another format version, trained
on other data or unreadable is set aside and the run starts afresh.

A ``DiskBudget`` (the service's POSBENCH_MAX_ARTIFACTS_BYTES) says whether a periodic
checkpoint still fits in the artifacts folder; the trainer skips one that does not.
"""

from __future__ import annotations

import logging
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from core.files import folder_bytes, private_folder, shown_bytes, write_atomic

CHECKPOINT_VERSION = 2
log = logging.getLogger(__name__)


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Write to a temporary file in the same folder, flush it to disk, then rename: never
    half a checkpoint, even after a power loss; the temporary is removed on failure."""
    private_folder(path.parent)
    try:
        write_atomic(path, lambda handle: _save(state, handle), private=True)
    except OSError as err:
        if err.filename is not None:
            raise
        raise OSError(err.errno, err.strerror, str(path)) from err  # which file it was
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)  # the rename itself is durable
    finally:
        os.close(folder)


class _Writes:
    """A file handle that keeps the OSError its writes raised: torch's zip writer turns a
    failed write (a full disk) into a RuntimeError about positions that says nothing of
    the cause."""

    def __init__(self, handle: BinaryIO) -> None:
        self.handle = handle
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            return self.handle.write(data)
        except OSError as err:
            self.error = err
            raise

    def flush(self) -> None:
        self.handle.flush()


def _save(state: dict[str, Any], handle: BinaryIO) -> None:
    """``torch.save`` to ``handle``; a write that failed raises its own OSError (ENOSPC:
    "No space left on device"), not torch's RuntimeError."""
    writes = _Writes(handle)
    try:
        torch.save(state, writes)  # type: ignore[arg-type]
    except RuntimeError as err:
        if writes.error is not None:
            raise writes.error from err
        raise


def checkpoint_problem(
    state: dict[str, Any], fingerprint: str | None, data: str | None = None
) -> str | None:
    """Why a loaded checkpoint is not this run's (another format version or, when
    ``fingerprint`` is given, another configuration; when ``data`` is given and the
    checkpoint is stamped, other data: an edited corpus file), or None when it is."""
    if state.get("version") != CHECKPOINT_VERSION:
        return f"format version {state.get('version')}, not {CHECKPOINT_VERSION}"
    if fingerprint is not None and state.get("fingerprint") != fingerprint:
        return f"another configuration ({state.get('fingerprint')})"
    if data is not None and state.get("data") not in (None, data):
        return f"trained on other data ({state.get('data')})"
    return None


def load_checkpoint(
    path: Path, device: torch.device, fingerprint: str | None = None, data: str | None = None
) -> dict[str, Any] | None:
    """The checkpoint at ``path`` when it is this run's (same format version and, when
    given, the same fingerprint and data); None when there is none. One that is
    unreadable, of another version, configuration or data is renamed aside
    (``.stale``), so the run starts afresh instead of failing on it at every retry."""
    if not path.exists():
        return None
    try:
        state = torch.load(path, map_location=device, weights_only=True)
        problem = checkpoint_problem(state, fingerprint, data)
    except Exception as err:  # truncated, not a checkpoint, or not torch's format
        state, problem = None, f"unreadable ({type(err).__name__})"
    if problem is None:
        return state
    aside = path.with_name(f"{path.name}.{uuid.uuid4().hex[:8]}.stale")
    os.replace(path, aside)
    log.warning("checkpoint %s is %s: moved to %s, starting afresh", path, problem, aside.name)
    return None


@dataclass(frozen=True)
class Checkpointer:
    """One run's checkpoint file. ``fingerprint`` (the run's train hash) and ``data`` (the
    task's fingerprint) stamp it, so another run can tell what it was trained on."""

    path: Path
    fingerprint: str | None = None
    data: str | None = None

    def load(self, device: torch.device) -> dict[str, Any] | None:
        """The trainer state this run saved, or None (see ``load_checkpoint``)."""
        return load_checkpoint(self.path, device, self.fingerprint, self.data)

    def save(self, state: dict[str, Any]) -> None:
        """``state`` (a trainer's ``state_dict()``), stamped, written atomically."""
        stamps = {"version": CHECKPOINT_VERSION, "fingerprint": self.fingerprint, "data": self.data}
        save_checkpoint(self.path, stamps | state)


@dataclass(frozen=True)
class DiskBudget:
    """The most bytes ``folder`` (the artifacts folder, every run's checkpoints) may hold
    after a periodic checkpoint is written. A soft bound: the folder is measured before
    each write, so runs writing at the same moment may each pass, and a run's final
    checkpoint (its trained model) and a stopped run's are written whatever it says."""

    folder: Path
    max_bytes: int

    def problem(self, writing: int) -> str | None:
        """Why a checkpoint of ``writing`` bytes does not fit (the folder holds the old one
        and the new one while it is written), or None when it does."""
        held = folder_bytes(self.folder)
        if held + writing <= self.max_bytes:
            return None
        return (
            f"the artifacts folder holds {shown_bytes(held)} and a checkpoint of "
            f"{shown_bytes(writing)} would take it past POSBENCH_MAX_ARTIFACTS_BYTES "
            f"({shown_bytes(self.max_bytes)}) by {shown_bytes(held + writing - self.max_bytes)}"
        )
