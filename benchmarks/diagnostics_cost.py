"""What do attention diagnostics add to an evaluation's time?

    python -m benchmarks.diagnostics_cost [--rounds 5] [--lengths 256 1024 4096]
        [--encodings nope rope alibi xpos fire] [--tokens 8192] [--out FILE]

For each encoding and length, one model (dim 128, depth 4, 4 heads of 32) evaluates the
same ``--tokens`` targets of the language-modelling corpus (``worker.evaluate``: the
whole point, scoring included) with ``eval.diagnostics`` off and on, back to back in a
random order every round; the ratio on/off is the median of the per-round ratios with
its interquartile range. The on and off losses are compared too: they must be equal, bit
for bit. Nothing is asserted; docs/performance.md has the figures.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from benchmarks.harness import quartiles
from core.settings import get_settings
from core.spec import EvalSpec, VariantSpec, parse_spec
from core.tables import markdown_rows
from worker.evaluate import evaluate_length
from worker.layers import ModelConfig
from worker.model import build_model
from worker.run import prepared_task

TRAIN_LENGTH = 256
CPU = torch.device("cpu")


def measure(encodings: list[str], lengths: list[int], tokens: int, rounds: int) -> list[dict]:
    spec = parse_spec({"model": "tiny", "train": {"length": TRAIN_LENGTH}, "encodings": ["rope"]})
    task = prepared_task(spec, get_settings().corpus_cache)
    rng = random.Random(0)
    rows = []
    for encoding in encodings:
        model = build_model(ModelConfig(), encoding, train_length=TRAIN_LENGTH, seed=0).eval()
        for length in lengths:
            specs = {
                on: EvalSpec(lengths=[length], tokens=tokens, diagnostics=on, order_probe=False)
                for on in (False, True)
            }

            def run(on: bool, model=model, specs=specs, length=length) -> tuple[float, float]:
                started = time.perf_counter()
                row = evaluate_length(
                    model,
                    task,
                    specs[on],
                    length=length,
                    protocol="nonoverlapping",
                    variant=VariantSpec(),
                    train_length=TRAIN_LENGTH,
                    device=CPU,
                )
                return time.perf_counter() - started, row.loss

            run(False), run(True)  # warm up
            seconds: dict[bool, list[float]] = {False: [], True: []}
            losses: dict[bool, float] = {}
            for _ in range(rounds):
                for on in rng.sample([False, True], 2):
                    elapsed, losses[on] = run(on)
                    seconds[on].append(elapsed)
            ratios = [a / b for a, b in zip(seconds[True], seconds[False], strict=True)]
            low, high = quartiles(ratios)
            rows.append(
                {
                    "encoding": encoding,
                    "length": length,
                    "off_s": statistics.median(seconds[False]),
                    "on_s": statistics.median(seconds[True]),
                    "ratio": statistics.median(ratios),
                    "ratio_q1": low,
                    "ratio_q3": high,
                    "same_loss": losses[True] == losses[False],
                }
            )
            print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--encodings", nargs="+", default=["nope", "rope", "alibi", "xpos", "fire"])
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = measure(args.encodings, args.lengths, args.tokens, args.rounds)
    columns = ["encoding", "length", "off_s", "on_s", "ratio", "ratio_q1", "ratio_q3", "same_loss"]
    cells = [
        [f"{row[c]:.3g}" if isinstance(row[c], float) else str(row[c]) for c in columns]
        for row in rows
    ]
    print(markdown_rows(columns, cells))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"rows": rows, "rounds": args.rounds}, indent=1))


if __name__ == "__main__":
    main()
