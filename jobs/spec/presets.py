"""Preset studies: a quick check, the ALiBi paper's comparison and the full catalogue."""

from __future__ import annotations

from typing import Any

from jobs.spec.base import (
    SpecError,
)
from jobs.spec.loading import (
    parse_spec,
)
from jobs.spec.study import (
    StudySpec,
)
from worker.catalog.params import short_repr

PRESET_SPECS: dict[str, dict[str, Any]] = {
    # Seconds on a CPU: what the tests and `make run` use.
    "smoke": {
        "name": "smoke",
        "model": "tiny",
        "train": {
            "length": 32,
            "steps": 40,
            "batch_size": 8,
            "lr": 3e-3,
            "checkpoint_every": 20,
            "progress_every": 5,
        },
        "encodings": ["nope", "rope", "alibi"],
        "eval": {"lengths": [32, 64, 128], "tokens": 4096, "variants": ["none"]},
    },
    # Minutes on 2 CPU cores: the published ordering at small scale.
    "quick": {
        "name": "quick",
        "model": "small",
        "train": {"length": 128, "steps": 600, "batch_size": 16, "lr": 2e-3, "warmup": 0.05},
        "encodings": ["nope", "sinusoidal", "learned", "rope", "alibi", "t5"],
        "eval": {"lengths": [128, 256, 512, 1024, 2048, 4096], "tokens": 65_536},
    },
    # One GPU: the ALiBi paper's setting (WikiText-103, train 512, evaluate to 16x) at a
    # smaller scale: 20k steps x 32 x 512 bytes is about 0.6 of an epoch of its 540 MB
    # (pystdlib's 30 MB would be repeated 11 times).
    "paper": {
        "name": "paper",
        "task": {"name": "lm", "corpus": "hf:wikitext:wikitext-103-raw-v1"},
        "model": "base",
        "train": {
            "length": 512,
            "steps": 20_000,
            "batch_size": 32,
            "lr": 6e-4,
            "warmup": 0.02,
            "checkpoint_every": 1000,
            "progress_every": 50,
        },
        "encodings": [
            "nope",
            "sinusoidal",
            "learned",
            "rope",
            "xpos",
            "alibi",
            "t5",
            "kerple_log",
            "fire",
        ],
        "eval": {
            "lengths": [512, 1024, 2048, 4096, 8192],
            "tokens": 262_144,
            "variants": ["none", "pi:auto", "ntk:16", "dynamic_ntk", "yarn:auto"],
        },
    },
}


def preset_spec(name: str) -> StudySpec:
    if name not in PRESET_SPECS:
        raise SpecError(
            [f"unknown preset {short_repr(name)} (available: {', '.join(PRESET_SPECS)})"]
        )
    return parse_spec(PRESET_SPECS[name])
