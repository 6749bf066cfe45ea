"""Greedy decoding with a KV cache: posbench against transformers' ``generate``.

    python -m benchmarks.decode [--preset tiny] [--train-length 128] [--factors 1 2 4 8]
                                [--encodings rope alibi ...] [--rounds 3] [--batch 1]
                                [--prompt-fraction 0.5] [--train-steps 100]
                                [--threads N] [--device cpu|cuda] [--no-memory]
                                [--out FILE]

For each encoding (every registered one by default) a model of ``--preset`` is built for
``--train-length``; at each length L = factor x the training length, one greedy decode
reads a prompt of ``--prompt-fraction`` x L bytes of this repository's Python source
(``worker/``, from a place drawn per length) in one pass (prefill), then generates the
rest, L - prompt new tokens, one at a time with the KV cache (``worker.kv_cache.new_cache``,
``worker.decode.greedy``). ``--threads 1`` suits a shared CPU: a decoding step is small
work, and torch's threads waiting on each other under load cost more than they give.

The reference is transformers' own loop: the encodings with an HF form (``posbench
export-hf``: ``nope`` and ``rope``) are exported as GPT-NeoX folders with the same weights
(``worker.export_hf.write_hf_folder``, which checks their logits against posbench's),
loaded with ``attn_implementation="sdpa"``, and run ``generate(max_new_tokens=N,
do_sample=False, use_cache=True)`` on the same prompt (no end-of-text stop, so both
generate N tokens). Every other encoding is compared with the RoPE export of the same
size, named in the table. The exported models are first trained for ``--train-steps``
AdamW steps on that source, so that greedy continuations are not one byte repeated and
the agreement check below means something; the other models keep their random weights
(speed does not depend on them).

Rounds are interleaved as in the other benchmarks (``benchmarks.harness.interleave``):
every round, each length's contenders run back to back in a random order, and a ratio
(posbench / transformers) is the median of per-round ratios, with its interquartile
range. Tokens/s counts the new tokens over the whole call, prefill included, on both
sides. Memory (``--no-memory`` skips it): one more call of each contender after the
rounds, its peak above what was held before it (CUDA: ``max_memory_allocated``; CPU: the
peak resident set, with large blocks in mappings of their own and the heap's free pages
given back first), and the bytes of keys and
values each side's cache holds at the end (posbench's ``KVCache``, transformers'
``past_key_values``).

Greedy tokens must agree between posbench and the export of the same model: a
disagreement within the training length fails the run; past it, where the first one
happens is reported (float sums in another order can flip a near tie).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.harness import (
    Contender,
    cuda_peak_bytes,
    interleave,
    peak_bytes,
    quartiles,
    synchronize,
)
from core.tables import markdown_rows

REFERENCE = "transformers"
SOURCE = Path(__file__).resolve().parents[1] / "worker"


@dataclass
class Plan:
    """What every contender decodes."""

    preset: str
    train_length: int
    factors: list[int]
    batch: int
    prompt_fraction: float
    device: torch.device
    source: torch.Tensor = field(repr=False)  # the bytes prompts and training read

    def prompt_length(self, length: int) -> int:
        return max(1, min(length - 1, round(self.prompt_fraction * length)))

    def prompt(self, length: int) -> torch.Tensor:
        """``[batch, prompt]`` bytes of source, the same for every contender at ``length``."""
        size = self.prompt_length(length)
        generator = torch.Generator().manual_seed(length)
        starts = torch.randint(0, len(self.source) - size, (self.batch,), generator=generator)
        rows = [self.source[s : s + size] for s in starts.tolist()]
        return torch.stack(rows).to(self.device)


def source_bytes() -> torch.Tensor:
    text = b"".join(path.read_bytes() for path in sorted(SOURCE.rglob("*.py")))
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


def posbench_model(plan: Plan, encoding: str) -> Any:
    from worker.model import build_model

    return build_model(plan.preset, encoding, train_length=plan.train_length).to(plan.device)


def train_briefly(model: Any, plan: Plan, steps: int, seed: int = 0) -> float:
    """``steps`` AdamW steps on batches of 16 windows of the source; the last loss."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(seed)
    length, loss = plan.train_length, torch.tensor(float("nan"))
    model.train()
    for _ in range(steps):
        starts = torch.randint(0, len(plan.source) - length - 1, (16,), generator=generator)
        batch = torch.stack([plan.source[s : s + length + 1] for s in starts.tolist()])
        batch = batch.to(plan.device)
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    model.eval()
    return float(loss.detach())


def export(model: Any, encoding: str, plan: Plan, folder: Path) -> Any:
    """The GPT-NeoX export of ``model`` (checked against posbench's logits when written),
    loaded as a plain transformers user loads it."""
    from transformers import GPTNeoXForCausalLM

    from core.catalog.encodings import info
    from worker.export_hf import write_hf_folder

    entry = info(encoding)
    rotary = entry.hf_rotary(entry.resolve({}), model.config.head_dim, plan.train_length)
    out = folder / encoding
    write_hf_folder(model, out, rotary=rotary)
    hf = GPTNeoXForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="sdpa"
    ).to(plan.device)
    hf.generation_config.eos_token_id = None  # no stop at NUL: N new tokens on both sides
    return hf.eval()


@dataclass
class Outcome:
    """A contender's last call: its new tokens and the bytes its cache held."""

    tokens: torch.Tensor | None = None
    kv_bytes: int = 0


def posbench_work(model: Any, plan: Plan, length: int, outcome: Outcome) -> Callable[[], int]:
    from worker.decode import greedy
    from worker.kv_cache import new_cache

    prompt = plan.prompt(length)
    new = length - prompt.shape[1]

    def run() -> int:
        with torch.inference_mode():
            cache = new_cache(model, plan.batch, length)
            outcome.tokens = greedy(model, prompt, new, cache)
        synchronize(plan.device)
        outcome.kv_bytes = cache.nbytes() * plan.batch
        return plan.batch * new

    return run


def transformers_work(hf: Any, plan: Plan, length: int, outcome: Outcome) -> Callable[[], int]:
    prompt = plan.prompt(length)
    new = length - prompt.shape[1]

    def run() -> int:
        with torch.inference_mode():
            out = hf.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=new,
                do_sample=False,
                use_cache=True,
                return_dict_in_generate=True,
            )
        synchronize(plan.device)
        outcome.tokens = out.sequences[:, prompt.shape[1] :]
        outcome.kv_bytes = _cache_bytes(getattr(out, "cache", None) or out.past_key_values)
        return plan.batch * new

    return run


def _cache_bytes(cache: Any) -> int:
    """Bytes of keys and values in a transformers cache (layers with keys and values)."""
    return sum(
        tensor.nbytes
        for layer in cache.layers
        for tensor in (layer.keys, layer.values)
        if isinstance(tensor, torch.Tensor)
    )


def first_divergence(ours: torch.Tensor, theirs: torch.Tensor) -> int | None:
    """The first new-token index where any row differs (None when all agree)."""
    if ours.shape != theirs.shape:
        return 0
    differ = (ours.cpu() != theirs.cpu()).any(dim=0).nonzero()
    return int(differ[0]) if len(differ) else None


@dataclass
class Side:
    contender: Contender
    outcome: Outcome
    reference: str  # the transformers contender it is compared with


def contenders(
    plan: Plan, encodings: list[str], exports: dict[str, Any], models: dict[str, Any]
) -> dict[tuple[str, int], Side]:
    """Every (implementation:encoding, length) the rounds run, grouped by length."""
    from core.catalog.encodings import REGISTRY

    fallback = next(iter(exports))  # the rope export when there is one
    sides: dict[tuple[str, int], Side] = {}
    for factor in plan.factors:
        length = factor * plan.train_length
        for encoding, hf in exports.items():
            name, outcome = f"{REFERENCE}:{encoding}", Outcome()
            work = transformers_work(hf, plan, length, outcome)
            sides[name, length] = Side(Contender(name, str(length), REFERENCE, work), outcome, "")
        for encoding in encodings:
            if factor > 1 and REGISTRY[encoding].bounded_by_train_length:
                continue  # no positions past the training length
            name, outcome = f"posbench:{encoding}", Outcome()
            work = posbench_work(models[encoding], plan, length, outcome)
            reference = f"{REFERENCE}:{encoding if encoding in exports else fallback}"
            sides[name, length] = Side(
                Contender(name, str(length), "posbench", work), outcome, reference
            )
    return sides


def release_free_heap() -> bool:
    """Give the heap's free pages back to the system (glibc's ``malloc_trim``), so that
    a call reusing them shows in the resident set (False off glibc)."""
    name = ctypes.util.find_library("c")
    try:
        return bool(name and ctypes.CDLL(name).malloc_trim(0) >= 0)
    except (OSError, AttributeError):
        return False


def peak_memory(device: torch.device, run: Callable[[], object]) -> int:
    """Peak bytes of one ``run`` above what was allocated (CUDA) or resident (CPU)."""
    if device.type == "cuda":
        return cuda_peak_bytes(device, run)
    release_free_heap()
    return peak_bytes(run)


def measure(
    plan: Plan, sides: dict[tuple[str, int], Side], rounds: int, memory: bool, seed: int = 0
) -> dict[tuple[str, int], int]:
    """The interleaved rounds, then (``memory``) one measured call of each contender in a
    random order: their peaks."""
    every = [side.contender for side in sides.values()]
    interleave(every, rounds, 1, 0.0, seed)  # utilisation is not reported here
    peaks: dict[tuple[str, int], int] = {}
    if memory:
        if plan.device.type == "cpu":
            from worker.memory import fix_mmap_threshold

            # Large blocks unmapped when freed, and (``peak_memory``) the heap's free pages
            # given back before each call: RSS follows the live tensors. Not during the
            # rounds: a growing cache would pay a page fault per step there.
            fix_mmap_threshold()
        order = list(sides)
        random.Random(seed).shuffle(order)
        for key in order:
            peaks[key] = peak_memory(plan.device, sides[key].contender.work)
    return peaks


def rows(
    plan: Plan, sides: dict[tuple[str, int], Side], peaks: dict[tuple[str, int], int]
) -> list[dict]:
    """A row per posbench contender and length, against its transformers reference."""
    out = []
    for (name, length), side in sides.items():
        if side.contender.implementation == REFERENCE:
            continue
        theirs = sides[side.reference, length]
        ours_samples, theirs_samples = side.contender.samples, theirs.contender.samples
        ratios = [a / b for a, b in zip(ours_samples, theirs_samples, strict=True)]
        low, high = quartiles(ratios)
        encoding = name.split(":", 1)[1]
        row: dict[str, Any] = {
            "encoding": encoding,
            "length": length,
            "factor": length // plan.train_length,
            "prompt": plan.prompt_length(length),
            "new_tokens": length - plan.prompt_length(length),
            "reference": side.reference.split(":", 1)[1],
            "tokens_per_s": statistics.median(ours_samples),
            "transformers_tokens_per_s": statistics.median(theirs_samples),
            "ratio": statistics.median(ratios),
            "ratio_q1": low,
            "ratio_q3": high,
            "kv_MiB": side.outcome.kv_bytes / 2**20,
            "transformers_kv_MiB": theirs.outcome.kv_bytes / 2**20,
        }
        if peaks:
            row["peak_MiB"] = peaks[name, length] / 2**20
            row["transformers_peak_MiB"] = peaks[side.reference, length] / 2**20
        if side.reference.endswith(f":{encoding}"):  # the same weights: the same tokens
            assert side.outcome.tokens is not None and theirs.outcome.tokens is not None
            diverged = first_divergence(side.outcome.tokens, theirs.outcome.tokens)
            # As a position in the sequence: the prompt's length plus the new token's index.
            row["diverges_at"] = None if diverged is None else row["prompt"] + diverged
        out.append(row)
    return out


def problems(rows: list[dict], train_length: int) -> list[str]:
    """Greedy tokens that differ from the export's within the training length."""
    return [
        f"{row['encoding']} at {row['length']}: tokens differ from transformers' at "
        f"position {row['diverges_at']}, within the training length {train_length}"
        for row in rows
        if row.get("diverges_at") is not None and row["diverges_at"] < train_length
    ]


def _rate(value: float) -> str:
    return f"{value / 1e3:.2f}k" if value >= 1e3 else f"{value:.0f}"


def table(rows: list[dict]) -> str:
    """The markdown table docs/performance-history.md shows (docs/performance.md: its ratios)."""
    memory = any("peak_MiB" in row for row in rows)
    columns = ["encoding", "length", "new", "tok/s", "transformers tok/s", "ratio [IQR]"]
    columns += ["KV MiB", "transformers KV MiB"]
    if memory:
        columns += ["peak MiB", "transformers peak MiB"]
    columns.append("same tokens")
    cells = []
    for row in rows:
        reference = "" if row["reference"] == row["encoding"] else f" ({row['reference']})"
        cell = [
            row["encoding"],
            f"{row['length']} ({row['factor']}x)",
            row["new_tokens"],
            _rate(row["tokens_per_s"]),
            _rate(row["transformers_tokens_per_s"]) + reference,
            f"{row['ratio']:.2f} [{row['ratio_q1']:.2f}, {row['ratio_q3']:.2f}]",
            f"{row['kv_MiB']:.2f}",
            f"{row['transformers_kv_MiB']:.2f}",
        ]
        if memory:
            cell += [f"{row['peak_MiB']:.1f}", f"{row['transformers_peak_MiB']:.1f}"]
        if "diverges_at" not in row:
            cell.append("-")
        elif row["diverges_at"] is None:
            cell.append("yes")
        else:
            cell.append(f"up to position {row['diverges_at']}")
        cells.append(cell)
    return markdown_rows(columns, cells)


def describe(plan: Plan, rounds: int, trained: dict[str, float]) -> str:
    import transformers

    device = torch.cuda.get_device_name(plan.device) if plan.device.type == "cuda" else "CPU"
    threads = f", {torch.get_num_threads()} threads" if plan.device.type == "cpu" else ""
    losses = ", ".join(f"{name} {loss:.2f}" for name, loss in trained.items())
    return (
        f"preset {plan.preset}, training length {plan.train_length}, batch {plan.batch}, "
        f"prompt {plan.prompt_fraction:g} of each length; fp32 on {device}{threads}; "
        f"{rounds} rounds; exports trained to loss {losses or '-'}; torch {torch.__version__}, "
        f"transformers {transformers.__version__}"
    )


def parse(argv: list[str] | None) -> argparse.Namespace:
    from core.catalog.encodings import REGISTRY
    from worker.model import PRESETS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=list(PRESETS), default="tiny")
    parser.add_argument("--train-length", type=int, default=128)
    parser.add_argument("--factors", nargs="+", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--encodings", nargs="+", choices=list(REGISTRY), default=list(REGISTRY))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-fraction", type=float, default=0.5)
    parser.add_argument("--train-steps", type=int, default=100)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--threads", type=int, help="torch CPU threads (default: torch's, one per core)"
    )
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    for name in ("train_length", "rounds", "batch", "threads"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.train_length < 2:
        parser.error("--train-length must be at least 2 (a prompt and a new token)")
    if any(f < 1 for f in args.factors):
        parser.error(f"--factors must be positive integers, got {args.factors}")
    if not 0 < args.prompt_fraction < 1:
        parser.error(f"--prompt-fraction must be in (0, 1), got {args.prompt_fraction}")
    if args.train_steps < 0:
        parser.error(f"--train-steps must be 0 or more, got {args.train_steps}")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    from core.catalog.encodings import hf_exportable
    from worker.cpu import flush_denormals

    flush_denormals()  # as posbench run and the workers do; before the first parallel op
    args = parse(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    plan = Plan(
        args.preset,
        args.train_length,
        sorted(set(args.factors)),
        args.batch,
        args.prompt_fraction,
        torch.device(args.device),
        source_bytes(),
    )
    torch.manual_seed(0)
    models = {encoding: posbench_model(plan, encoding).eval() for encoding in args.encodings}
    # The rope export first: the reference of the encodings without an HF form.
    exported = [name for name in ("rope", *hf_exportable()) if name in args.encodings]
    exported = list(dict.fromkeys(["rope", *exported]))
    trained: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="decode-bench-") as folder:
        exports = {}
        for encoding in exported:
            model = models.get(encoding) or posbench_model(plan, encoding)
            started = time.perf_counter()
            trained[encoding] = train_briefly(model, plan, args.train_steps)
            print(f"{encoding}: trained in {time.perf_counter() - started:.1f} s", flush=True)
            exports[encoding] = export(model, encoding, plan, Path(folder))
            models.setdefault(encoding, model)
    sides = contenders(plan, args.encodings, exports, models)
    peaks = measure(plan, sides, args.rounds, memory=not args.no_memory)
    measured = rows(plan, sides, peaks)
    title = describe(plan, args.rounds, trained)
    print(f"\n### decoding: {title}\n\n{table(measured)}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"title": title, "rows": measured}, indent=1))
    found = problems(measured, plan.train_length)
    if found:
        raise SystemExit("greedy tokens differ: " + "; ".join(found))
    return measured


if __name__ == "__main__":
    main()
