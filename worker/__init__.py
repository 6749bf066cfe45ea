"""Everything that runs on a GPU node: encodings, the model, training and evaluation.

``worker.run_study(spec, task=..., device=...)`` runs a study in-process (see
``worker.run``). The import is lazy so that ``worker.encodings``' registry stays free
of torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["run_one", "run_study"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from worker import run

        return getattr(run, name)
    raise AttributeError(f"module 'worker' has no attribute {name!r}")
