"""A deliberately slow evaluation step, for the test that a live worker in a long step
keeps its lease: on the worker host whose PYTHONPATH holds this folder, the first
evaluation batch at length POSBENCH_FAULTS_SLOW_LENGTH waits POSBENCH_FAULTS_SLOW_SECONDS
first (in the run's own thread, as a long GPU kernel or a slow file system would).

Python imports ``sitecustomize`` at start-up; this one patches ``worker.evaluate`` when
a process first imports it, so processes that never evaluate (Celery's parent, the
reconciler) do not load torch for it."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import time

TARGET = "worker.evaluate"


def _patch(module) -> None:
    length = int(os.environ.get("POSBENCH_FAULTS_SLOW_LENGTH", "64"))
    seconds = float(os.environ.get("POSBENCH_FAULTS_SLOW_SECONDS", "180"))
    original = module._run_batches
    done: list[bool] = []

    def slow(model, batches, step_length, *args, **kwargs):
        if step_length == length and not done:
            done.append(True)
            sys.stderr.write(f"faults: a slow step of {seconds:g} s at length {length}\n")
            time.sleep(seconds)
            sys.stderr.write("faults: the slow step is over\n")
        return original(model, batches, step_length, *args, **kwargs)

    module._run_batches = slow


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module) -> None:
            execute(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Finder())
