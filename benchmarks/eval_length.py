"""Evaluation at long lengths: throughput against x-transformers, and memory.

    python -m benchmarks.eval_length [--length 2048] [--batch 4] [--memory 16384 32768]

Throughput: forward passes under inference_mode at ``--length`` tokens, interleaved
rounds with x-transformers' fastest configuration. Memory: for each encoding and
each ``--memory`` length, a fresh process runs one forward pass of one sequence
and reports its peak resident memory above what it held before the pass (so
models do not share one high-water mark).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.harness import (
    XT_CONFIGS,
    flops_per_token,
    interleave,
    pairs,
    peak_bytes,
    posbench_model,
    probe_in_subprocess,
    report,
)


def forward_fn(model: torch.nn.Module, tokens: torch.Tensor):
    model.eval()

    def forward() -> int:
        with torch.inference_mode():
            model(tokens)
        return tokens.numel()

    return forward


def probe(encoding: str, length: int) -> None:
    """In a fresh process: peak memory of one forward pass of one sequence at ``length``,
    with the heap bounded as posbench's evaluation bounds it at long lengths."""
    from worker.memory import bound_heap_for

    bound_heap_for(length)
    model = posbench_model(encoding, length).eval()
    tokens = torch.randint(0, 256, (1, length))

    def forward() -> None:
        with torch.inference_mode():
            model(tokens)

    print(json.dumps({"encoding": encoding, "length": length, "peak_bytes": peak_bytes(forward)}))


def memory(encodings: list[str], lengths: list[int]) -> dict[str, dict]:
    return {
        encoding: {
            f"peak_MiB_at_{length}": probe_in_subprocess(
                "benchmarks.eval_length", encoding, str(length)
            )
            for length in lengths
        }
        for encoding in encodings
    }


def main() -> None:
    from worker.cpu import flush_denormals

    flush_denormals()  # as posbench run and the workers do; before the first parallel op
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--encodings", nargs="*", default=list(XT_CONFIGS))
    parser.add_argument("--memory", nargs="*", type=int, default=[16384, 32768])
    parser.add_argument("--probe", nargs=2, metavar=("ENCODING", "LENGTH"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.probe:
        probe(args.probe[0], int(args.probe[1]))
        return
    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (args.batch, args.length))
    contenders = pairs(args.encodings, args.length, lambda model: forward_fn(model, tokens))
    reference = interleave(contenders, args.rounds, 1, flops_per_token(args.length, False))
    extra = memory(args.encodings, args.memory) if args.memory else {}
    report(
        contenders,
        reference,
        f"evaluation forward, batch {args.batch} x {args.length}, "
        f"fp32, {torch.get_num_threads()} threads; memory: one sequence, posbench",
        args.out,
        extra,
    )


if __name__ == "__main__":
    main()
