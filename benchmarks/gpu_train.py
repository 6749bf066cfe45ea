"""Training throughput on a GPU: every encoding on a model preset, bf16, eager and compiled.

    python -m benchmarks.gpu_train [--preset base] [--length 512] [--batch 32] [--steps 20]
                                   [--encodings rope alibi] [--compiled-encodings rope]
                                   [--peak-tflops 989] [--xtransformers]
                                   [--attn-implementation auto] [--budget-s S] [--out FILE]

The GPU half of the performance issue, prepared as one short script for a lent GPU:
for each encoding, a posbench model of the preset trains under bf16 autocast with the
fused AdamW (as ``worker.training`` does), eagerly and under torch.compile, and reports
tokens/s and utilisation = model FLOPs/s / the GPU's dense bf16 peak. The peak comes from
``--peak-tflops`` or a small table of known GPUs. With ``--xtransformers``, x-transformers'
model of the same shape (its fastest faithful configuration, ``benchmarks.harness``)
trains by the same step right after each of ours, and the ratio of tokens/s is
reported. Encodings with a bias come first (the fused kernel's reason to be), and with
``--budget-s`` a measurement not started by then is recorded as skipped, so the part
ends within its time with whole rows; each row says which attention kernel trained
(``--attn-implementation``, default auto: flex_attention on CUDA for a bias). Runs on the
CPU too (``--device cpu``, fp32, no peak), which is how it is checked without a GPU.
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.harness import (
    SPENT,
    add_execution_options,
    by_value,
    over_budget,
    synchronize,
    xtransformers_model,
)
from core.catalog.encodings import REGISTRY
from core.tables import markdown_rows
from worker.model import PRESETS, build_model
from worker.training.trainer import tf32_matmuls

# Dense bf16 tensor-core peaks (no sparsity), TFLOP/s, from the vendors' datasheets.
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}


def peak_flops(device: torch.device, given: float | None) -> float | None:
    if given is not None:
        return given * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tflops * 1e12 for key, tflops in PEAK_BF16_TFLOPS.items() if key in name), None)


def measure(
    encoding: str,
    preset: str,
    length: int,
    batch: int,
    steps: int,
    device: torch.device,
    compiled: bool,
    xtransformers: bool = False,
    attn_implementation: str = "auto",
) -> dict[str, Any]:
    """One encoding's training steps: posbench's model of ``preset``, or (``xtransformers``)
    x-transformers' of the same shape in its fastest faithful configuration, trained by
    the same step; FLOPs are counted on posbench's model for both."""
    params = {"max_position": 4 * length} if encoding == "randomized" else {}
    ours = build_model(
        preset, encoding, train_length=length, attn_implementation=attn_implementation, **params
    )
    record = ours.attention_record
    flops_per_token = ours.flops_per_token(length)
    if xtransformers:
        shape = PRESETS[preset]
        ours = xtransformers_model(
            encoding, length, dim=shape.d_model, depth=shape.n_layers, heads=shape.n_heads
        )
    model = ours.to(device).train()
    forward = torch.compile(model) if compiled else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda" or None)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    tokens = torch.randint(0, 256, (batch, length + 1), device=device)

    def step() -> None:
        with autocast:
            logits = forward(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    started = time.perf_counter()
    with tf32_matmuls(device):  # as the trainer trains
        for _ in range(3):  # warm-up: compilation, autotuning, allocator
            step()
        synchronize(device)
        warmup = time.perf_counter() - started
        started = time.perf_counter()
        for _ in range(steps):
            step()
        synchronize(device)
        elapsed = time.perf_counter() - started
    rate = steps * batch * length / elapsed
    return {
        "tokens_per_s": rate,
        "flops_per_s": rate * flops_per_token,
        "warmup_s": warmup,
        "peak_memory_gib": (
            torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
        ),
        "kernel": None if xtransformers else (record()["train"] or record()["eval"]),
    }


def measure_mode(row: dict[str, object], mode: str, args: argparse.Namespace) -> None:
    """Fill ``row`` (one encoding) with ``mode``'s figures, ours and (``--xtransformers``)
    theirs; a failure (a compiler error, memory) is recorded in the row, not raised."""
    device = torch.device(args.device)
    peak = peak_flops(device, args.peak_tflops)
    steps = partial(
        measure,
        str(row["encoding"]),
        args.preset,
        args.length,
        args.batch,
        args.steps,
        device,
        compiled=mode == "compiled",
        attn_implementation=args.attn_implementation,
    )
    try:
        result = steps()
        row[f"{mode}_tokens_per_s"] = round(result["tokens_per_s"])
        row[f"{mode}_utilisation"] = (
            round(result["flops_per_s"] / peak, 3) if peak is not None else None
        )
        row[f"{mode}_warmup_s"] = round(result["warmup_s"], 1)
        row[f"{mode}_peak_memory_gib"] = round(result["peak_memory_gib"], 2)
        row[f"{mode}_kernel"] = result["kernel"]
        if args.xtransformers:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            theirs = steps(xtransformers=True)
            row[f"{mode}_xt_tokens_per_s"] = round(theirs["tokens_per_s"])
            row[f"{mode}_ratio"] = round(result["tokens_per_s"] / theirs["tokens_per_s"], 3)
    except Exception as error:  # one encoding's failure must not lose the others' figures
        row[f"{mode}_failed"] = f"{type(error).__name__}: {str(error)[:160]}"
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="base", choices=sorted(PRESETS))
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--encodings", nargs="*", default=list(REGISTRY), choices=list(REGISTRY))
    parser.add_argument("--modes", nargs="*", default=["eager", "compiled"])
    parser.add_argument(
        "--compiled-encodings",
        nargs="*",
        choices=list(REGISTRY),
        help="the encodings measured compiled (default: all); compiling takes a while each",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--peak-tflops", type=float)
    parser.add_argument(
        "--xtransformers",
        action="store_true",
        help="also train x-transformers' model of the same shape by the same step, each "
        "encoding's two back to back, and report the ratio",
    )
    add_execution_options(parser)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    title = (
        f"training, {args.preset} preset, batch {args.batch} x {args.length}, "
        f"{'bf16 autocast' if device.type == 'cuda' else 'fp32'} on {name}"
    )
    peak = peak_flops(device, args.peak_tflops)
    rows: list[dict[str, object]] = [{"encoding": name} for name in by_value(args.encodings)]
    compiled = set(args.encodings if args.compiled_encodings is None else args.compiled_encodings)
    # Every encoding eagerly first, then compiled: a run stopped early has the cheap
    # figures of all of them. The JSON is rewritten after each measurement.
    started = time.monotonic()
    for mode in args.modes:
        for row in rows:
            if mode == "compiled" and row["encoding"] not in compiled:
                continue
            if over_budget(started, args.budget_s):
                row[f"{mode}_skipped"] = SPENT
            else:
                measure_mode(row, mode, args)
            print(json.dumps(row), flush=True)
            if args.out is not None:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps({"title": title, "peak_flops": peak, "rows": rows}))
    columns = list(dict.fromkeys(key for row in rows for key in row))
    print(f"\n### {title}\n")
    print(markdown_rows(columns, [[row.get(c, "") for c in columns] for row in rows]))


if __name__ == "__main__":
    main()
