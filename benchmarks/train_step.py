"""Training-step throughput: posbench against x-transformers, every encoding.

    python -m benchmarks.train_step [--rounds 5] [--encodings rope alibi] [--compile] [--out FILE]

dim 128, depth 4, 4 heads of 32, batch 16 x 256, fp32 on the CPU: forward, backward
and a fused AdamW step (the same optimizer for both) per unit of work. Memory: for
each model, a fresh process runs a warm-up step, then reports the peak resident
memory of one more step above the warmed-up process (see ``probe``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.harness import (
    XT_CONFIGS,
    flops_per_token,
    interleave,
    pairs,
    peak_bytes,
    posbench_model,
    probe_in_subprocess,
    report,
    xtransformers_model,
)

BATCH, LENGTH = 16, 256


def step_fn(model: torch.nn.Module, tokens: torch.Tensor, compile: bool = False):
    # The same optimizer for both models: fused AdamW, the fastest on the CPU.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    forward = torch.compile(model) if compile else model

    def step() -> int:
        logits = forward(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return BATCH * LENGTH

    return step


def probe(implementation: str, encoding: str) -> None:
    """In a fresh process: peak memory of one model's training step, after a first step
    that allocated the optimizer state and anything either library builds lazily. Large
    blocks get mappings of their own (as in posbench's long evaluations), so the
    resident set follows the live tensors instead of glibc's heap policy."""
    from worker.memory import fix_mmap_threshold

    fix_mmap_threshold()
    build = posbench_model if implementation == "posbench" else xtransformers_model
    torch.manual_seed(0)
    step = step_fn(build(encoding, LENGTH).train(), torch.randint(0, 256, (BATCH, LENGTH + 1)))
    step()
    print(json.dumps({"encoding": encoding, "peak_bytes": peak_bytes(step)}))


def memory(encodings: list[str]) -> dict[str, dict]:
    return {
        encoding: {
            f"{implementation}_peak_MiB": probe_in_subprocess(
                "benchmarks.train_step", implementation, encoding
            )
            for implementation in ("posbench", "x-transformers")
        }
        for encoding in encodings
    }


def main() -> None:
    from worker.cpu import flush_denormals

    flush_denormals()  # as posbench run and the workers do; before the first parallel op
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2, help="steps per contender per round")
    parser.add_argument("--encodings", nargs="*", default=list(XT_CONFIGS))
    parser.add_argument(
        "--compile", action="store_true", help="both models under torch.compile (compiled first)"
    )
    parser.add_argument("--no-memory", action="store_true", help="skip the memory probes")
    parser.add_argument("--probe", nargs=2, metavar=("IMPLEMENTATION", "ENCODING"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.probe:
        probe(*args.probe)
        return
    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (BATCH, LENGTH + 1))
    contenders = pairs(
        args.encodings, LENGTH, lambda model: step_fn(model.train(), tokens, args.compile)
    )
    reference = interleave(contenders, args.rounds, args.steps, flops_per_token(LENGTH, True))
    report(
        contenders,
        reference,
        f"training step, batch {BATCH} x {LENGTH}, fp32, {torch.get_num_threads()} threads"
        + (", both compiled" if args.compile else ""),
        args.out,
        {} if args.no_memory else memory(args.encodings),
    )


if __name__ == "__main__":
    main()
