"""Tasks (what a model learns and how it is scored) and the data they draw from.

``TASKS`` is torch-free metadata; :func:`build_task` imports the implementation.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from core.catalog.tasks import TASKS, TaskInfo, task_info

if TYPE_CHECKING:
    from worker.data.base import Task

__all__ = ["TASKS", "TaskInfo", "build_task", "task_info"]


def build_task(name: str, **params: Any) -> Task:
    entry = task_info(name)
    resolved = entry.resolve(params)
    module_name, class_name = entry.implementation.split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(**resolved)
