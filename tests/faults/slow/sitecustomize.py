"""Hooks the fault tests put in a worker host's way, each only when its variables are set
on the host whose PYTHONPATH holds this folder:

- a slow evaluation step, for the test that a live worker in a long step keeps its
  lease: the first evaluation batch at length POSBENCH_FAULTS_SLOW_LENGTH (64 by
  default) waits POSBENCH_FAULTS_SLOW_SECONDS first (in the run's own thread, as a long
  GPU kernel or a slow file system would);
- a gate before a checkpoint, for the test that fills the disk while a run trains: the
  first periodic checkpoint at step POSBENCH_FAULTS_GATE_STEP or later waits until the
  file POSBENCH_FAULTS_GATE_FILE exists, so the test acts between two steps however
  fast the run trains (without it, a fast machine finished the run before the disk was
  full).

Python imports ``sitecustomize`` at start-up; this one patches ``worker.evaluate`` and
``worker.training.trainer`` when a process first imports them, so processes that never
train (Celery's parent, the reconciler) do not load torch for it."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import time
from pathlib import Path


def _slow_evaluation(module) -> None:
    length = int(os.environ.get("POSBENCH_FAULTS_SLOW_LENGTH", "64"))
    seconds = float(os.environ["POSBENCH_FAULTS_SLOW_SECONDS"])
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


def _gated_checkpoint(module) -> None:
    step = int(os.environ["POSBENCH_FAULTS_GATE_STEP"])
    gate = Path(os.environ["POSBENCH_FAULTS_GATE_FILE"])
    original = module.Trainer.checkpoint
    done: list[bool] = []

    def gated(self, periodic: bool = False) -> None:
        if periodic and self.step >= step and not done:
            done.append(True)
            sys.stderr.write(f"faults: the checkpoint at step {self.step} waits at the gate\n")
            deadline = time.monotonic() + 300
            while not gate.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            sys.stderr.write("faults: through the gate\n")
        return original(self, periodic)

    module.Trainer.checkpoint = gated


HOOKS = {
    "worker.evaluate": ("POSBENCH_FAULTS_SLOW_SECONDS", _slow_evaluation),
    "worker.training.trainer": ("POSBENCH_FAULTS_GATE_STEP", _gated_checkpoint),
}


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, pending: dict) -> None:
        self.pending = pending

    def find_spec(self, name, path, target=None):
        if name not in self.pending:
            return None
        patch = self.pending.pop(name)
        if not self.pending:
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module) -> None:
            execute(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


_pending = {name: patch for name, (variable, patch) in HOOKS.items() if variable in os.environ}
if _pending:
    sys.meta_path.insert(0, _Finder(_pending))
