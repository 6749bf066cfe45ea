"""A finished run's files in the artifacts folder: one checkpoint, nothing else.

While a run trains and evaluates, its folder may hold, besides its checkpoint
``<id>.pt``: a fine-tuned variant's checkpoint (``<id>.pt.ft-<hash>``), checkpoints set
aside as another configuration's or unreadable (``<id>.pt.<hex>.stale``), and
temporaries a killed write or a model taken from the cache left (``.<id>.pt.<hex>.tmp``,
``<id>.pt.<hex>.tmp``). When the run ends (done, failed or cancelled) under this
worker's lease, only ``<id>.pt`` stays:

- done: it is the trained model, which the result cache lends to runs that train the
  same thing and which a fine-tune of a later study starts from; every result is stored;
- failed or cancelled: it is the last checkpoint, from which ``posbench retry``
  resumes the training. A fine-tuning it stopped is not kept: the retry fine-tunes that
  variant again from the trained model (the same numbers, deterministically; only time
  is lost), and the points already stored are not evaluated again.

A run released to the queue (the worker shuts down) keeps everything: it resumes where
it stopped, its fine-tuning included.
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)


def leftovers(folder: Path, run_id: int) -> list[Path]:
    """The files of run ``run_id`` in ``folder`` other than its checkpoint."""
    found = [*folder.glob(f"{run_id}.pt.*"), *folder.glob(f".{run_id}.pt.*")]
    return sorted(path for path in found if not path.is_dir())


def tidy(folder: Path, run_id: int) -> list[str]:
    """Leave the finished run ``run_id`` its checkpoint alone (see the module's words):
    call it only once the run has ended under this worker's lease, so that no other
    worker is writing the run's files. Returns the names removed."""
    removed = []
    for path in leftovers(folder, run_id):
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        except OSError as err:  # never fail a finished run for it: delete removes it later
            log.warning("run %s: could not remove %s: %s", run_id, path.name, err)
            continue
        removed.append(path.name)
    if removed:
        log.info("run %s finished: removed %s", run_id, ", ".join(removed))
    return removed
