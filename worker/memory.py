"""Memory for long evaluations: the process' heap policy and the batch size.

glibc raises its mmap threshold each time a large block is freed, after which
large tensors of varying sizes (one per query block) come from the heap and
fragment it: the resident set grows far past what is live. For long sequences,
a fixed threshold puts every large tensor in its own mapping, returned to the
system when freed; measured on the 2-core CPU, ALiBi at 16k tokens peaks at
1.2x NoPE's memory instead of 5x. It costs page faults, so short sequences keep
the default (dynamic) policy.

``eval_batch_size`` picks how many sequences an evaluation batch holds from the
memory the device has free; ``halving_on_oom`` retries a pass with half the batch
when that estimate was wrong.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import resource
from collections.abc import Callable
from typing import TypeVar

import torch

from worker.layers import ModelConfig

T = TypeVar("T")

M_MMAP_THRESHOLD = -3
LONG_SEQUENCE = 8192
FIXED_THRESHOLD = 128 * 1024


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        library = ctypes.CDLL(name)
        library.mallopt  # noqa: B018 - glibc only; absent elsewhere
    except (OSError, AttributeError):
        return None
    return library


def bound_heap_for(length: int) -> bool:
    """Fix glibc's mmap threshold before working on ``length``-token sequences that
    are long; returns whether the policy is in force (False off glibc)."""
    return length >= LONG_SEQUENCE and fix_mmap_threshold()


def fix_mmap_threshold() -> bool:
    """Every allocation past ``FIXED_THRESHOLD`` gets its own mapping, returned to the
    system when freed, so the resident set follows the live tensors (False off glibc)."""
    libc = _libc()
    return bool(libc is not None and libc.mallopt(M_MMAP_THRESHOLD, FIXED_THRESHOLD))


def available_bytes(device: torch.device) -> int:
    """Memory a new allocation can use now: free CUDA memory, or the kernel's
    MemAvailable on the CPU (unbounded when unknown)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as meminfo:
            line = next(line for line in meminfo if line.startswith("MemAvailable:"))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration):
        return 1 << 62


def eval_batch_size(
    config: ModelConfig,
    length: int,
    batch_tokens: int,
    available: int,
    share: float = 0.5,
    bytes_per_value: int = 4,
) -> int:
    """Sequences per evaluation batch: the spec's token budget, capped so that one
    forward pass fits in ``share`` of the ``available`` bytes.

    Under inference_mode a layer's activations die with the layer, so the peak per
    token is one layer's live tensors (residual, norm, qkv, attention output, the MLP
    hidden state and its activation: about 14 d) plus the logits and the float copy
    and log-probabilities the loss takes (3 x vocab), doubled for allocator slack.
    Attention scores are bounded separately (query blocks), so they do not scale
    with the batch here. An estimate, not a promise: out-of-memory still halves the
    batch and retries.
    """
    per_token = 2 * bytes_per_value * (14 * config.d_model + 3 * config.vocab_size)
    fits = int(share * available) // (per_token * length)
    return max(1, min(batch_tokens // length, fits))


def halving_on_oom(run: Callable[[int], T], batch_size: int) -> T:
    """``run(batch_size)``, started again with half the batch while the device runs out of
    memory; one sequence that does not fit is a real failure and is raised."""
    while True:
        try:
            return run(batch_size)
        except torch.OutOfMemoryError:
            if batch_size == 1:
                raise
            batch_size //= 2
            torch.cuda.empty_cache()


def resident_bytes() -> int:
    """The process' resident set now (Linux)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def reset_peak_resident() -> bool:
    """Restart the kernel's high-water mark of the resident set ("5" into
    /proc/self/clear_refs, Linux 4.0+), so the next peak is this phase's alone."""
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
    except OSError:
        return False
    return True


def peak_resident_bytes() -> int:
    """The resident set's high-water mark since the last reset (VmHWM), or the
    process' lifetime peak where /proc is not there."""
    try:
        with open("/proc/self/status") as status:
            line = next(line for line in status if line.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration):
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
