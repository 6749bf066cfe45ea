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
import resource
import subprocess
import sys
from pathlib import Path

import torch

from benchmarks.harness import (
    XT_CONFIGS,
    flops_per_token,
    interleave,
    pairs,
    posbench_model,
    report,
)


def forward_fn(model: torch.nn.Module, tokens: torch.Tensor):
    model.eval()

    def forward() -> int:
        with torch.inference_mode():
            model(tokens)
        return tokens.numel()

    return forward


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def _high_water_bytes() -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def probe(encoding: str, length: int) -> None:
    """In a fresh process: peak memory of one forward pass at ``length``.

    ru_maxrss would survive exec and carry the parent's peak, so the kernel's
    high-water mark is reset first (Linux: "5" into /proc/self/clear_refs)."""
    from worker.memory import bound_heap_for

    bound_heap_for(length)  # what posbench's evaluation does at long lengths
    model = posbench_model(encoding, length).eval()
    tokens = torch.randint(0, 256, (1, length))
    before = _rss_bytes()
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    with torch.inference_mode():
        model(tokens)
    peak = _high_water_bytes()
    print(json.dumps({"encoding": encoding, "length": length, "peak_bytes": peak - before}))


def memory(encodings: list[str], lengths: list[int]) -> dict[str, dict]:
    found: dict[str, dict] = {}
    for encoding in encodings:
        for length in lengths:
            done = subprocess.run(
                [sys.executable, "-m", "benchmarks.eval_length", "--probe", encoding, str(length)],
                capture_output=True,
                text=True,
            )
            key = f"peak_MiB_at_{length}"
            if done.returncode != 0:
                found.setdefault(encoding, {})[key] = "failed: " + done.stderr.strip()[-120:]
                continue
            peak = json.loads(done.stdout.strip().splitlines()[-1])["peak_bytes"]
            found.setdefault(encoding, {})[key] = peak / 2**20
    return found


def main() -> None:
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
