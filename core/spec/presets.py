"""Preset studies, one YAML file each in ``core/presets/``, read by the loader users'
spec files go through: ``smoke`` (seconds on a CPU), ``quick`` (the published ordering
at small scale in minutes) and ``paper`` (the ALiBi paper's setting on one GPU)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from core.catalog.params import short_repr
from core.spec.base import SpecError
from core.spec.loading import parse_spec, read_spec_file
from core.spec.study import StudySpec

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
