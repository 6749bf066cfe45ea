"""The spec's foundations: its version, its bounds, the error it raises and the strict
model every part derives from."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
)

from core.errors import UserError

# The version of what a run's numbers mean, part of every config hash: bumped when
# training or evaluation changes what a run with the same spec measures, so results of
# the old code are never reused as if they were the new code's. 2 (2026-11-30): the
# learning-rate schedule's ends, no weight decay on encodings, KERPLE-power's initial
# ranges, YaRN's ramp of the authors' code, float32 logits, and evaluation scoring the
# same bytes at every length. 3 (2026-11-30): the scored bytes spread over the whole
# validation split in up to 64 stretches (they were its first `tokens` bytes),
# training windows may end on the training split's last byte, FIRE's initial
# threshold is a quarter of the training length (it was 512 at every length), and a
# HuggingFace corpus is read from its `text` column with line rows joined as one stream.
RESULTS_VERSION = 3
MAX_VARIANT_LABEL = 120  # evaluations.variant is VARCHAR(120) (migration 0007)

# Bounds. Generous for a GPU cluster, small enough that one study cannot hog it.
DEFAULT_NAME = "study"  # a spec without a name
MAX_RUNS = 64
MAX_TRAIN_LENGTH = 16_384
MAX_EVAL_LENGTH = 131_072
MAX_STEPS = 200_000
MAX_PARAMETERS = 1_000_000_000
MAX_TRAIN_TOKENS = 1 << 36  # per run: steps x batch x length
MAX_EVAL_TOKENS = 1 << 36  # per run: tokens the evaluation feeds the model

Protocol = Literal["nonoverlapping", "sliding", "document", "decode"]
CachePolicy = Literal["keep", "rerotate"]  # the decode protocol's rotary keys
PROTOCOLS: tuple[str, ...] = get_args(Protocol)
Queue = Literal["gpu", "cpu"]  # the broker's queues: GPU and CPU workers
QUEUES: tuple[str, ...] = get_args(Queue)


def exact(number: float) -> str:
    """A number in a label: short (4, 0.0002, 1e-05) yet never two values under one
    label (1.0000001 stays 1.0000001)."""
    short = f"{number:g}"
    return short if float(short) == float(number) else repr(float(number))


class SpecError(UserError, ValueError):
    """A spec that cannot run; the message lists every problem, one per line."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("\n".join(problems))


class _Strict(BaseModel):
    # strict: "128" is not an int, 1 is not true, true is not a seed.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
