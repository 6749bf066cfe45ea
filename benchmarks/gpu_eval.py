"""Evaluation at long lengths on a GPU: tokens/s and peak memory per encoding, 1x to 32x.

    python -m benchmarks.gpu_eval [--preset base] [--train-length 512]
                                  [--factors 1 2 4 8 16 32] [--tokens-per-pass N] [--rounds 3]
                                  [--encodings rope alibi] [--device cuda] [--out FILE]
                                  [--attn-implementation auto] [--budget-s S]

For each encoding, posbench's model of the preset (trained at ``--train-length``; the
weights do not matter to speed or memory) runs the forward pass posbench's evaluation
runs (inference mode, bf16 autocast on a GPU, fp32 on the CPU) at every factor of the
training length, each pass as many sequences as make ``--tokens-per-pass`` tokens (by
default the longest length: 32 sequences at 1x, one at 32x). Beside it,
x-transformers' model of the same shape, in its fastest faithful configuration
(``benchmarks.harness``), runs the same tokens: the two take turns in a random order
each round, and the ratio of tokens/s is the median of the rounds' ratios. Peak memory
is what one forward pass allocates above the weights (the CUDA allocator's peak; not
measured on the CPU), and ``memory_vs_nope`` divides it by NoPE's at the same length,
NoPE being measured first whatever ``--encodings`` says. A point that runs out of
memory is recorded as such; a learned table has no rows past its training length, so
its longer points are recorded as beyond it. The JSON is rewritten after each
encoding, so a run stopped early keeps what it measured. Encodings run NoPE first, then
those with a bias (what the fused kernel is for), then the rest; with ``--budget-s`` an
encoding not started by then is recorded as skipped, so the part ends within its time
with whole rows. Each row says which attention kernel ran (``--attn-implementation``,
default auto: flex_attention on CUDA for a bias).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.harness import (
    SPENT,
    add_execution_options,
    by_value,
    cuda_peak_bytes,
    over_budget,
    synchronize,
    xtransformers_model,
)
from core.catalog.encodings import REGISTRY
from core.tables import markdown_rows
from worker.encodings.base import PositionOutOfRange
from worker.fused import compiled_shapes
from worker.model import PRESETS, build_model

MIB = 2**20


def forward_pass(model: nn.Module, tokens: torch.Tensor) -> Callable[[], None]:
    """One evaluation forward pass of ``model`` over ``tokens``, as ``worker.evaluate``
    runs it: inference mode, bf16 autocast on a GPU."""
    device = tokens.device
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")

    def run() -> None:
        with torch.inference_mode(), autocast:
            model(tokens)
        synchronize(device)

    return run


def pass_memory(run: Callable[[], None], device: torch.device) -> float | None:
    """MiB one pass allocates above what was allocated before it: the CUDA allocator's
    peak. None on the CPU, where freed pages are reused in place and an in-process
    peak says little (``benchmarks.eval_length`` measures it in fresh processes)."""
    return cuda_peak_bytes(device, run) / MIB if device.type == "cuda" else None


def measure_point(
    runs: dict[str, Callable[[], None]], device: torch.device, rounds: int, tokens: int
) -> dict[str, Any]:
    """Memory and tokens/s of each of ``runs`` (implementation -> pass) at one length:
    a warm-up pass each, one measured for memory, then ``rounds`` rounds taking turns.
    An implementation that cannot run the length (out of memory, or positions beyond a
    learned table) says so in its tokens/s cell; the others are measured."""
    rng = random.Random(0)
    figures: dict[str, Any] = {}
    runnable = {}
    for name, run in runs.items():
        try:
            run()  # warm-up: kernels chosen, workspaces allocated
            memory = pass_memory(run, device)
        except PositionOutOfRange:
            figures[f"{name}_tokens_per_s"] = "beyond its table"
            continue
        except torch.cuda.OutOfMemoryError:
            figures[f"{name}_tokens_per_s"] = "out of memory"
            torch.cuda.empty_cache()
            continue
        runnable[name] = run
        if memory is not None:
            figures[f"{name}_peak_memory_mib"] = round(memory, 1)
    rates: dict[str, list[float]] = {name: [] for name in runnable}
    for _ in range(rounds):
        for name in rng.sample(list(runnable), len(runnable)):
            started = time.perf_counter()
            runnable[name]()
            rates[name].append(tokens / (time.perf_counter() - started))
    for name, samples in rates.items():
        figures[f"{name}_tokens_per_s"] = round(statistics.median(samples))
    if len(rates) == 2:
        ours, theirs = rates.values()
        figures["ratio"] = round(
            statistics.median(a / b for a, b in zip(ours, theirs, strict=True)), 3
        )
    return figures


def measure_encoding(
    encoding: str, preset: str, train_length: int, lengths: list[int], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """One row per length for ``encoding``: posbench's figures and x-transformers'."""
    device = torch.device(args.device)
    shape = PRESETS[preset]
    ours = build_model(
        preset, encoding, train_length=train_length, attn_implementation=args.attn_implementation
    )
    ours = ours.to(device).eval()
    theirs = (
        xtransformers_model(
            encoding, max(lengths), dim=shape.d_model, depth=shape.n_layers, heads=shape.n_heads
        )
        .to(device)
        .eval()
    )
    rows = []
    for length in lengths:
        row: dict[str, Any] = {
            "encoding": encoding,
            "length": length,
            "factor": length // train_length,
        }
        batch = max(1, args.tokens_per_pass // length)
        row["batch"] = batch
        tokens = torch.randint(0, 256, (batch, length), device=device)
        runs = {"posbench": forward_pass(ours, tokens)}
        if not args.no_xtransformers:
            runs["xt"] = forward_pass(theirs, tokens)
        row |= measure_point(runs, device, args.rounds, tokens.numel())
        row["kernel"] = ours.attention_record()["eval"]
        if device.type == "cuda":
            torch.cuda.empty_cache()
        rows.append(row)
    return rows


def against_nope(rows: list[dict[str, Any]]) -> None:
    """Each row's peak memory over NoPE's at the same length, where both were measured."""
    nope = {
        row["length"]: row.get("posbench_peak_memory_mib")
        for row in rows
        if row["encoding"] == "nope"
    }
    for row in rows:
        mine, base = row.get("posbench_peak_memory_mib"), nope.get(row["length"])
        if isinstance(mine, float) and isinstance(base, float) and base > 0:
            row["memory_vs_nope"] = round(mine / base, 3)


def write(rows: list[dict[str, Any]], title: str, out: Path | None) -> None:
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        # Each (length, encoding form) compiles flex once: the count of the sweep's compiles.
        document = {"title": title, "rows": rows, "flex_shapes_compiled": compiled_shapes()}
        out.write_text(json.dumps(document, indent=1))


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="base", choices=sorted(PRESETS))
    parser.add_argument("--train-length", type=int, default=512)
    parser.add_argument("--factors", nargs="*", type=int, default=[1, 2, 4, 8, 16, 32])
    parser.add_argument(
        "--tokens-per-pass",
        type=int,
        help="tokens of one pass, in as many sequences as fit (default: the longest length, "
        "so every length runs the same tokens per pass)",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--encodings", nargs="*", default=list(REGISTRY), choices=list(REGISTRY))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-xtransformers", action="store_true")
    add_execution_options(parser)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.train_length < 1 or args.rounds < 1 or min(args.factors, default=0) < 1:
        parser.error("--train-length, --rounds and every --factors must be positive")
    torch.manual_seed(0)
    device = torch.device(args.device)
    lengths = [args.train_length * factor for factor in args.factors]
    args.tokens_per_pass = args.tokens_per_pass or max(lengths)
    encodings = ["nope", *by_value(name for name in args.encodings if name != "nope")]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    title = (
        f"evaluation forward, {args.preset} preset trained at {args.train_length}, "
        f"{args.tokens_per_pass} tokens a pass, "
        f"{'bf16 autocast' if device.type == 'cuda' else 'fp32, no memory figures'} on {name}"
    )
    rows: list[dict[str, Any]] = []
    started = time.monotonic()
    for encoding in encodings:
        if over_budget(started, args.budget_s):
            rows.append({"encoding": encoding, "skipped": SPENT})
            write(rows, title, args.out)
            continue
        rows += measure_encoding(encoding, args.preset, args.train_length, lengths, args)
        against_nope(rows)
        write(rows, title, args.out)
        print(json.dumps(rows[-1]), flush=True)
    columns = list(dict.fromkeys(key for row in rows for key in row))
    print(f"\n### {title}\n")
    print(markdown_rows(columns, [[row.get(c, "") for c in columns] for row in rows]))
    return rows


if __name__ == "__main__":
    main()
