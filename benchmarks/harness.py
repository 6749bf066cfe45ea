"""Side-by-side timing: posbench and x-transformers in one process, interleaved rounds.

Every round shuffles the encodings; for each, posbench's model and x-transformers'
run back to back in a random order, so a noisy neighbour slows both alike and
their ratio in that round is a paired measurement. A 1024x1024 matmul is timed in
the same round as the hardware reference. Ratios are the median of the per-round
ratios, with their interquartile range: figures are reported, never asserted.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from core.catalog.encodings import REGISTRY
from core.catalog.models import ATTN_IMPLEMENTATIONS
from core.tables import markdown_rows
from worker.memory import peak_resident_bytes, reset_peak_resident, resident_bytes
from worker.model import build_model

# The sizes: dim 128, depth 4, 4 heads of 32, byte vocabulary.
DIM, DEPTH, HEADS, HEAD_DIM, VOCAB = 128, 4, 4, 32, 256

# x-transformers' fastest faithful configuration of each encoding (flash where it
# allows it; full-head rotary like ours). KERPLE and randomized have no counterpart:
# they are compared with the nearest one (ALiBi's fixed distance kernel, RoPE).
XT_CONFIGS: dict[str, tuple[dict, dict, bool]] = {
    # name: (TransformerWrapper kwargs, Decoder kwargs, flash allowed)
    "nope": ({"use_abs_pos_emb": False}, {}, True),
    "sinusoidal": ({"scaled_sinu_pos_emb": True}, {}, True),
    "learned": ({}, {}, True),
    "rope": (
        {"use_abs_pos_emb": False},
        {"rotary_pos_emb": True, "rotary_emb_dim": HEAD_DIM},
        True,
    ),
    "xpos": (
        {"use_abs_pos_emb": False},
        {"rotary_pos_emb": True, "rotary_xpos": True, "rotary_emb_dim": HEAD_DIM},
        True,
    ),
    "alibi": ({"use_abs_pos_emb": False}, {"alibi_pos_bias": True}, True),
    "t5": ({"use_abs_pos_emb": False}, {"rel_pos_bias": True}, False),
    "kerple_log": ({"use_abs_pos_emb": False}, {"alibi_pos_bias": True}, True),
    "kerple_power": ({"use_abs_pos_emb": False}, {"alibi_pos_bias": True}, True),
    "fire": ({"use_abs_pos_emb": False}, {"dynamic_pos_bias": True}, False),
    # CoPE's term reads the scores: no flash kernel on either side.
    "cope": ({"use_abs_pos_emb": False}, {"attn_use_cope": True, "attn_cope_max_pos": 64}, False),
    "randomized": (
        {"use_abs_pos_emb": False},
        {"rotary_pos_emb": True, "rotary_emb_dim": HEAD_DIM},
        True,
    ),
}


def posbench_model(encoding: str, max_length: int) -> nn.Module:
    from worker.layers import ModelConfig

    config = ModelConfig(d_model=DIM, n_layers=DEPTH, n_heads=HEADS, vocab_size=VOCAB)
    params = {"max_position": 4 * max_length} if encoding == "randomized" else {}
    return build_model(config, encoding, train_length=max_length, **params)


def xtransformers_model(
    encoding: str, max_length: int, dim: int = DIM, depth: int = DEPTH, heads: int = HEADS
) -> nn.Module:
    """x-transformers' model of ``encoding`` in its fastest faithful configuration, of
    the issue's sizes or the ones given (rotary over the whole head, as ours)."""
    from x_transformers import Decoder, TransformerWrapper

    wrapper, layers, flash = XT_CONFIGS[encoding]
    if "rotary_emb_dim" in layers:
        layers = {**layers, "rotary_emb_dim": dim // heads}
    decoder = Decoder(
        dim=dim, depth=depth, heads=heads, attn_dim_head=dim // heads, attn_flash=flash, **layers
    )
    return TransformerWrapper(
        num_tokens=VOCAB, max_seq_len=max_length, attn_layers=decoder, **wrapper
    )


def flops_per_token(length: int, training: bool) -> float:
    """Model FLOPs per token of this architecture, the count ``Transformer.flops_per_token``
    and the GPU benchmark use (PaLM appendix B, nanoGPT's MFU: 6N + 12 L d T for
    training, the full attention square counted); a forward pass is a third of it."""
    training_flops = posbench_model("nope", length).flops_per_token(length)
    return training_flops if training else training_flops / 3


def matmul_flops_per_second(size: int = 1024, repeats: int = 8) -> float:
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    started = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * size**3 * repeats / (time.perf_counter() - started)


@dataclass
class Contender:
    name: str
    encoding: str
    implementation: str
    work: Callable[[], int]  # runs one unit of work, returns the tokens it processed
    samples: list[float] = field(default_factory=list)  # tokens/s per round
    utilisation: list[float] = field(default_factory=list)


def pairs(
    encodings: list[str], length: int, work: Callable[[nn.Module], Callable[[], int]]
) -> list[Contender]:
    """For every encoding, posbench's model and x-transformers', each wrapped by ``work``."""
    contenders = []
    for encoding in encodings:
        for implementation, build in (
            ("posbench", posbench_model),
            ("x-transformers", xtransformers_model),
        ):
            contenders.append(
                Contender(
                    f"{implementation}:{encoding}",
                    encoding,
                    implementation,
                    work(build(encoding, length)),
                )
            )
    return contenders


def interleave(
    contenders: list[Contender], rounds: int, units: int, flops: float, seed: int = 0
) -> float:
    """Run ``rounds`` shuffled rounds; returns the median matmul FLOP/s."""
    rng = random.Random(seed)
    groups: dict[str, list[Contender]] = {}
    for contender in contenders:
        groups.setdefault(contender.encoding, []).append(contender)
    references = []
    for contender in contenders:  # warm up: allocations, autotuning, lazy init
        contender.work()
    for _ in range(rounds):
        order = list(groups.values())
        rng.shuffle(order)
        reference = matmul_flops_per_second()
        references.append(reference)
        for group in order:
            for contender in rng.sample(group, len(group)):
                started = time.perf_counter()
                tokens = sum(contender.work() for _ in range(units))
                rate = tokens / (time.perf_counter() - started)
                contender.samples.append(rate)
                contender.utilisation.append(rate * flops / reference)
    return statistics.median(references)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU): before a clock is read."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cuda_peak_bytes(device: torch.device, run: Callable[[], object]) -> int:
    """The CUDA allocator's peak while ``run`` runs, above what was allocated before it."""
    synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run()
    synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def peak_bytes(run: Callable[[], object]) -> int:
    """Peak resident memory while ``run`` runs, above what the process held before.

    Meant for a fresh process (``probe_in_subprocess``): ru_maxrss would carry an
    earlier peak, so the kernel's high-water mark is reset first (Linux: "5" into
    /proc/self/clear_refs)."""
    before = resident_bytes()
    if not reset_peak_resident():
        raise OSError("the peak resident set cannot be reset here (needs Linux /proc)")
    run()
    return peak_resident_bytes() - before


def probe_in_subprocess(module: str, *args: str) -> float | str:
    """Run ``python -m module --probe ARGS`` in a fresh process: the peak in MiB it
    prints as JSON on its last line, or why it failed."""
    done = subprocess.run(
        [sys.executable, "-m", module, "--probe", *args], capture_output=True, text=True
    )
    if done.returncode != 0:
        return "failed: " + done.stderr.strip()[-120:]
    return json.loads(done.stdout.strip().splitlines()[-1])["peak_bytes"] / 2**20


def quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    low, _, high = statistics.quantiles(values, n=4, method="inclusive")
    return low, high


def report(
    contenders: list[Contender],
    reference: float,
    title: str,
    out: Path | None,
    extra: dict[str, dict] | None = None,
) -> list[dict]:
    rows = []
    by_encoding: dict[str, dict[str, Contender]] = {}
    for contender in contenders:
        by_encoding.setdefault(contender.encoding, {})[contender.implementation] = contender
    for encoding, pair in by_encoding.items():
        ours, theirs = pair.get("posbench"), pair.get("x-transformers")
        row = {"encoding": encoding}
        for label, contender in (("posbench", ours), ("x-transformers", theirs)):
            if contender is None:
                continue
            row[f"{label}_tokens_per_s"] = statistics.median(contender.samples)
            row[f"{label}_utilisation"] = statistics.median(contender.utilisation)
        if ours and theirs:
            # Paired: each round's two samples ran back to back.
            ratios = [a / b for a, b in zip(ours.samples, theirs.samples, strict=True)]
            row["ratio"] = statistics.median(ratios)
            row["ratio_q1"], row["ratio_q3"] = quartiles(ratios)
        row.update((extra or {}).get(encoding, {}))
        rows.append(row)
    print(f"\n### {title}\n\nmatmul reference: {reference / 1e9:.1f} GFLOP/s (median of rounds)\n")
    columns = list(dict.fromkeys(k for row in rows for k in row))
    cells = [
        [f"{row[c]:,.3g}" if isinstance(row.get(c), float) else row.get(c, "") for c in columns]
        for row in rows
    ]
    print(markdown_rows(columns, cells))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(
            json.dumps(
                {
                    "title": title,
                    "matmul_flops_per_s": reference,
                    "rows": rows,
                    "samples": [asdict(c) | {"work": None} for c in contenders],
                },
                indent=1,
                default=str,
            )
        )
    return rows


# What a GPU part records for the work its --budget-s left no time for.
SPENT = "skipped: the part's budget was spent"


def over_budget(started: float, budget_s: float | None) -> bool:
    """Whether a part started at ``started`` (time.monotonic) has spent ``budget_s``: the
    next measurement is not begun (each one is whole, or absent)."""
    return budget_s is not None and time.monotonic() - started >= budget_s


def by_value(encodings: Iterable[str]) -> list[str]:
    """``encodings`` with those that bias the logits first, the fused kernel's subject,
    each group in the catalogue's order."""
    names = list(encodings)
    return sorted(names, key=lambda name: REGISTRY[name].family != "bias")


def add_execution_options(parser: argparse.ArgumentParser) -> None:
    """--attn-implementation and --budget-s, shared by the GPU benchmarks."""
    parser.add_argument("--attn-implementation", default="auto", choices=list(ATTN_IMPLEMENTATIONS))
    parser.add_argument(
        "--budget-s",
        type=float,
        help="seconds after which no further measurement is begun (each is recorded as "
        "skipped); default: no limit",
    )
