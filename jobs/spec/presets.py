"""Preset studies, one YAML file each in ``jobs/presets/``, read by the loader users'
spec files go through: ``smoke`` (seconds on a CPU), ``quick`` (the published ordering
at small scale in minutes) and ``paper`` (the ALiBi paper's setting on one GPU)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jobs.spec.base import SpecError
from jobs.spec.loading import parse_spec, read_spec_file
from jobs.spec.study import StudySpec
from worker.catalog.params import short_repr

PRESETS_DIR = Path(__file__).parents[1] / "presets"
# The order people see them in (the CLI's help, the dashboard's choice).
PRESET_NAMES = ("smoke", "quick", "paper")

PRESET_SPECS: dict[str, dict[str, Any]] = {
    name: read_spec_file(PRESETS_DIR / f"{name}.yaml") for name in PRESET_NAMES
}


def preset_spec(name: str) -> StudySpec:
    if name not in PRESET_SPECS:
        raise SpecError(
            [f"unknown preset {short_repr(name)} (available: {', '.join(PRESET_SPECS)})"]
        )
    return parse_spec(PRESET_SPECS[name])
