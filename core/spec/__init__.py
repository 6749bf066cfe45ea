"""Study specs: what a user submits, validated at the edge.

A study is one task, one model size, one training setup, a list of encodings
(with parameters), a list of seeds, and how to evaluate: lengths, protocols and
RoPE inference-time variants. Unknown keys are rejected and every size is
bounded, so one spec cannot exhaust a cluster; a violation names the field, the
value and what is allowed.

The package, lowest first: ``base`` (version, bounds, the error), ``parts`` (task,
model, training, encoding, fine-tuning), ``variants`` (evaluation variants and
settings), ``hf`` (the rules of a study of a HuggingFace model, ``model: {hf: NAME}``),
``study`` (the study and its runs), ``loading`` (mappings and YAML files) and
``presets``. Torch-free: the CLI and the dashboard validate specs without it.
"""

from core.spec.base import (
    DEFAULT_NAME,
    MAX_EVAL_LENGTH,
    MAX_STEPS,
    MAX_VARIANT_LABEL,
    PROTOCOLS,
    QUEUES,
    RESULTS_VERSION,
    SpecError,
)
from core.spec.loading import load_spec, parse_spec
from core.spec.parts import EncodingSpec, FinetuneSpec, ModelSpec, TaskSpec, TrainSpec
from core.spec.presets import PRESET_SPECS, preset_spec
from core.spec.study import RunSpec, StudySpec
from core.spec.variants import EvalSpec, VariantSpec, protocol_title

__all__ = [
    "DEFAULT_NAME",
    "MAX_EVAL_LENGTH",
    "MAX_STEPS",
    "MAX_VARIANT_LABEL",
    "PRESET_SPECS",
    "PROTOCOLS",
    "QUEUES",
    "RESULTS_VERSION",
    "EncodingSpec",
    "EvalSpec",
    "FinetuneSpec",
    "ModelSpec",
    "RunSpec",
    "SpecError",
    "StudySpec",
    "TaskSpec",
    "TrainSpec",
    "VariantSpec",
    "load_spec",
    "parse_spec",
    "preset_spec",
    "protocol_title",
]
