"""CPU arithmetic for training and evaluation processes.

A bias encoding whose bias grows fast with distance (KERPLE's power kernel, FIRE, T5's
far buckets, ALiBi at long lengths) gives attention probabilities of exp(-90) and
below: subnormal float32 numbers, which x86 CPUs multiply in microcode, many times
slower than normal ones. On the 2-core development CPU the matmuls over those
probabilities made KERPLE-power's training step 10-20% slower than KERPLE-log's at the
same shapes. Flushing subnormals to zero (FTZ/DAZ, as GPU kernels commonly do) removes
that; a value below 1.2e-38 changes no loss, probability or gradient that matters.

The flag lives in each thread's control register, and OpenMP's worker threads copy it
from the thread that starts them: ``flush_denormals`` must run before torch's first
parallel operation in the process (an entry point: ``posbench run``, a Celery pool
process, a benchmark), or the pool's threads keep computing with subnormals.
"""

from __future__ import annotations

import torch


def flush_denormals() -> bool:
    """Flush subnormal floats to zero on the CPU from now on, in this thread and the
    threads it starts; False where the CPU has no such mode."""
    return torch.set_flush_denormal(True)
