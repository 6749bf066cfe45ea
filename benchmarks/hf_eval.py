"""Evaluating a HuggingFace model: posbench's path against a plain transformers loop.

    python -m benchmarks.hf_eval [--size tiny|small|150m] [--factors 1 2 4 8] [--rounds 3]
                                 [--tokens N] [--batch-tokens 16384] [--device cuda|cpu]
                                 [--no-memory] [--head-variants fp32 tf32] [--out FILE]

A Llama-style model with random weights (a fixed seed) and a byte-level BPE tokenizer
trained here on generated text are built locally (``benchmarks.hf_build``; nothing is
downloaded), saved with ``save_pretrained`` into a models root and loaded by posbench's
loader. At 1x, 2x, 4x and 8x the model's context, the same windows are evaluated two
ways, in alternating rounds (``benchmarks.harness.interleave``: each length's two sides
back to back, in a random order):

- **posbench**: ``worker.evaluate.evaluate_length`` on the loaded ``HfCausalLM`` and the
  tokenized text (``worker.hf``), the code a worker runs, batch sized by the spec's
  ``batch_tokens`` as there (the batch it used is checked);
- **transformers**: a plain loop, ``model(input_ids, labels=input_ids)`` under
  ``torch.no_grad`` with ``attn_implementation="sdpa"`` on the same HF model object, the
  same batches, the same autocast (bf16 on CUDA, none on the CPU). Each window is given
  as its ``length + 1`` tokens, so that it scores the same ``length`` targets as
  posbench's.

Reported per length: tokens/s of each side (tokens the model read: ``length`` per window
for posbench, ``length + 1`` for the plain loop), the median of the per-round ratios
(posbench / transformers) with its interquartile range, the peak memory of one pass
above what was allocated before it (CUDA: ``torch.cuda.max_memory_allocated``; CPU: the
peak resident set, large blocks in mappings of their own, ``benchmarks.harness.peak_bytes``)
and the ratio of those peaks, and both sides' mean loss, which must agree (1e-4 relative
in float32, 1e-2 under bf16 autocast, where posbench's logits are float32 and
transformers' bf16). ``--head-variants`` adds, on CUDA, posbench's path with the output
layer computed other ways (a diagnostic of what its precision costs). Figures are
reported, never asserted; a loss disagreement or other windows fail the run.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import Contender, cuda_peak_bytes, interleave, peak_bytes, quartiles
from benchmarks.hf_build import NAME, SIZES, Size, generated_documents, save_model, text_task
from core.tables import markdown_rows


class RecordingTask:
    """``task`` (the tokenized text), noting the batch size of each evaluation pass."""

    def __init__(self, task: Any) -> None:
        self.task = task
        self.metric = task.metric
        self.batch_sizes: list[int] = []

    def eval_batches(self, length: int, **kwargs: Any) -> Iterator[Any]:
        self.batch_sizes.append(kwargs["batch_size"])
        return self.task.eval_batches(length, **kwargs)


@dataclass
class Setup:
    """What both sides evaluate: the loaded model, the task and the plan."""

    loaded: Any  # worker.hf.loader.LoadedModel
    task: RecordingTask
    spec: Any  # core.spec.EvalSpec
    size: Size
    lengths: list[int]
    device: torch.device

    @property
    def autocast(self) -> torch.autocast:
        # As worker.evaluate: bf16 autocast on CUDA, none on the CPU.
        return torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.device.type == "cuda")


def prepare(
    size: Size,
    folder: Path,
    device: torch.device,
    factors: list[int],
    tokens_per_length: int | None = None,
    batch_tokens: int = 16_384,
) -> Setup:
    """Build and save the model under ``folder`` (a models root), load it as a worker
    does, and tokenize enough generated text for ``tokens_per_length`` scored targets
    (32 windows of the longest length by default) at every length."""
    from core.catalog.hf_models import ModelPolicy
    from core.spec import EvalSpec
    from worker.hf.loader import load_model

    lengths = [factor * size.context for factor in factors]
    longest = max(lengths)
    tokens = tokens_per_length or 32 * longest
    words = 2 * (tokens + longest) + 4000  # a word is one or two tokens: ample
    documents = generated_documents(words)
    save_model(folder / NAME, size, documents)
    loaded = load_model(NAME, ModelPolicy(roots=(folder.resolve(),)))
    loaded.model.to(device).eval()
    task = text_task(documents, loaded.tokenizer)
    if len(task.ids) < tokens + longest + 1:
        raise RuntimeError(f"{len(task.ids)} tokens of text, {tokens + longest + 1} needed")
    spec = EvalSpec(lengths=lengths, tokens=tokens, batch_tokens=batch_tokens, order_probe=False)
    return Setup(loaded, RecordingTask(task), spec, size, lengths, device)


def batch_size(setup: Setup, length: int) -> int:
    """The batch posbench's evaluation picks at ``length`` (the call it makes)."""
    from worker.memory import available_bytes, eval_batch_size

    return eval_batch_size(
        setup.loaded.model.config, length, setup.spec.batch_tokens, available_bytes(setup.device)
    )


def windows(setup: Setup, length: int, size: int) -> list[torch.Tensor]:
    """posbench's batches at ``length`` as ``[B, length + 1]`` token windows (inputs and
    the last target), on the CPU, as a plain loop would slice them."""
    batches = setup.task.task.eval_batches(
        length,
        protocol="nonoverlapping",
        batch_size=size,
        tokens=setup.spec.tokens,
        examples=setup.spec.examples,
        longest=max(setup.lengths),
    )
    out = []
    for batch in batches:
        if batch.scored is not None:
            raise ValueError("a window is partly scored: give --tokens as whole longest windows")
        out.append(torch.cat([batch.inputs, batch.targets[:, -1:]], dim=1))
    return out


@dataclass
class Pass:
    loss: float
    tokens: int  # tokens the model read
    scored: int
    batch: int


def posbench_pass(setup: Setup, length: int, model: Any = None) -> Pass:
    """One evaluation at ``length``, as ``worker.evaluate.evaluate`` runs each point
    (``model``: the loaded adapter unless given)."""
    from core.spec import VariantSpec
    from worker.evaluate import evaluate_length

    row = evaluate_length(
        model if model is not None else setup.loaded.model,
        setup.task,  # type: ignore[arg-type]  # the task, batch sizes noted
        setup.spec,
        length=length,
        protocol="nonoverlapping",
        variant=VariantSpec(),
        train_length=setup.size.context,
        device=setup.device,
    )
    assert row.loss is not None and row.tokens is not None
    # Every window is whole (``windows`` checks): the model read as many tokens as it scored.
    return Pass(row.loss, row.tokens, row.tokens, setup.task.batch_sizes[-1])


def transformers_pass(setup: Setup, batches: list[torch.Tensor], size: int) -> Pass:
    """The plain loop: ``model(input_ids, labels=input_ids)`` on each batch (``batches``
    of at most ``size`` windows)."""
    model = setup.loaded.model.hf
    nats = torch.zeros((), dtype=torch.float64, device=setup.device)
    read = scored = 0
    with torch.no_grad(), setup.autocast:
        for window in batches:
            input_ids = window.to(setup.device)
            loss = model(input_ids=input_ids, labels=input_ids, use_cache=False).loss
            count = input_ids.shape[0] * (input_ids.shape[1] - 1)
            nats += loss.double() * count
            read += input_ids.numel()
            scored += count
    return Pass(float(nats) / scored, read, scored, size)


def head_variant(setup: Setup, mode: str) -> Any:
    """A diagnostic: the loaded adapter with its output layer computed another way under
    CUDA autocast, float32 in and out (``fp32``: a float32 product, as posbench did before
    ``worker.hf.model.float32_logits``; ``tf32``: the same on TF32 tensor cores), to see
    what the output layer's precision costs. Not posbench's path."""
    import torch.nn.functional as F

    from worker.hf.model import HfCausalLM

    class HeadVariant(HfCausalLM):
        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            hidden = self.hf.base_model(input_ids=tokens, use_cache=False).last_hidden_state
            weight = self.hf.get_output_embeddings().weight
            previous = torch.backends.cuda.matmul.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = mode == "tf32"
            try:
                with torch.autocast(hidden.device.type, enabled=False):
                    return F.linear(hidden.float(), weight.float())
            finally:
                torch.backends.cuda.matmul.allow_tf32 = previous

    return HeadVariant(setup.loaded.model.hf, setup.loaded.facts)


def peak_memory(setup: Setup, run: Callable[[], object]) -> int:
    """Peak bytes of one ``run`` above what was allocated (CUDA) or resident (CPU)
    before it."""
    if setup.device.type == "cuda":
        return cuda_peak_bytes(setup.device, run)
    return peak_bytes(run)


def tolerance(device: torch.device) -> float:
    """Relative loss agreement expected: float32 on the CPU, bf16 autocast on CUDA."""
    return 1e-2 if device.type == "cuda" else 1e-4


REFERENCE = "transformers"


def measure(
    setup: Setup,
    rounds: int,
    memory: bool = True,
    seed: int = 0,
    head_variants: tuple[str, ...] = (),
) -> list[dict]:
    """Interleaved rounds at every length, then (``memory``) one measured pass of each
    side per length, in a random order; a row per length and posbench side
    (``head_variants``: diagnostics beside posbench's own path)."""
    passes: dict[tuple[str, int], Pass] = {}
    models = {"posbench": setup.loaded.model}
    for mode in head_variants:
        if setup.device.type == "cuda":
            models[f"posbench[{mode} head]"] = head_variant(setup, mode)
        else:
            print(f"head variant {mode}: CUDA only, skipped")
    contenders = []
    for length in setup.lengths:
        size = batch_size(setup, length)
        batches = windows(setup, length, size)

        def theirs(
            batches: list[torch.Tensor] = batches, length: int = length, size: int = size
        ) -> int:
            done = transformers_pass(setup, batches, size)
            passes[REFERENCE, length] = done
            return done.tokens

        contenders.append(Contender(f"{REFERENCE}:{length}", str(length), REFERENCE, theirs))
        for name, model in models.items():

            def ours(length: int = length, name: str = name, model: Any = model) -> int:
                done = posbench_pass(setup, length, model)
                passes[name, length] = done
                return done.tokens

            contenders.append(Contender(f"{name}:{length}", str(length), name, ours))
    # The matmul reference and utilisation are the CPU's; here only the ratios count.
    interleave(contenders, rounds, 1, 0.0, seed)
    peaks: dict[tuple[str, int], int] = {}
    if memory:
        if setup.device.type == "cpu":
            from worker.memory import fix_mmap_threshold

            fix_mmap_threshold()  # large blocks unmapped when freed: RSS follows live tensors
        order = list(contenders)
        random.Random(seed).shuffle(order)
        for contender in order:
            peaks[contender.implementation, int(contender.encoding)] = peak_memory(
                setup, contender.work
            )
    return rows(setup, contenders, passes, peaks)


def rows(
    setup: Setup,
    contenders: list[Contender],
    passes: dict[tuple[str, int], Pass],
    peaks: dict[tuple[str, int], int],
) -> list[dict]:
    """A row per length and posbench side, against the plain loop at that length."""
    by_length: dict[int, dict[str, Contender]] = {}
    for contender in contenders:
        by_length.setdefault(int(contender.encoding), {})[contender.implementation] = contender
    out = []
    for length, sides in by_length.items():
        theirs, reference = sides[REFERENCE], passes[REFERENCE, length]
        for name, ours in sides.items():
            if name == REFERENCE:
                continue
            mine = passes[name, length]
            ratios = [a / b for a, b in zip(ours.samples, theirs.samples, strict=True)]
            low, high = quartiles(ratios)
            difference = abs(mine.loss - reference.loss) / abs(reference.loss)
            row: dict[str, Any] = {
                "length": length,
                "factor": length // setup.size.context,
                "side": name,
                "batch": mine.batch,
                "same_windows": mine.batch == reference.batch and mine.scored == reference.scored,
                "tokens_per_s": statistics.median(ours.samples),
                "transformers_tokens_per_s": statistics.median(theirs.samples),
                "ratio": statistics.median(ratios),
                "ratio_q1": low,
                "ratio_q3": high,
            }
            if peaks:
                row["peak_MiB"] = peaks[name, length] / 2**20
                row["transformers_peak_MiB"] = peaks[REFERENCE, length] / 2**20
                # None where the loop's peak is under the measure's resolution (tiny sizes).
                theirs_peak = peaks[REFERENCE, length]
                row["memory_ratio"] = peaks[name, length] / theirs_peak if theirs_peak else None
            row |= {
                "loss": mine.loss,
                "transformers_loss": reference.loss,
                "loss_rel_diff": difference,
                "loss_agrees": math.isfinite(difference) and difference <= tolerance(setup.device),
            }
            out.append(row)
    return out


def problems(rows: list[dict]) -> list[str]:
    """What makes a run's figures wrong: other windows, or losses that disagree."""
    found = []
    for row in rows:
        where = f"{row['side']} at {row['length']}"
        if not row["same_windows"]:
            found.append(f"{where}: not the plain loop's batches")
        if not row["loss_agrees"]:
            found.append(f"{where}: loss {row['loss']} against {row['transformers_loss']}")
    return found


def describe(setup: Setup, rounds: int) -> str:
    import transformers

    parameters = sum(p.numel() for p in setup.loaded.model.parameters())
    device = torch.cuda.get_device_name(setup.device) if setup.device.type == "cuda" else "CPU"
    precision = "bf16 autocast" if setup.device.type == "cuda" else "fp32"
    threads = f", {torch.get_num_threads()} threads" if setup.device.type == "cpu" else ""
    return (
        f"HF Llama, {parameters / 1e6:.1f}M parameters, context {setup.size.context}, "
        f"{setup.spec.tokens} scored tokens per length, batch_tokens {setup.spec.batch_tokens}; "
        f"{precision} on {device}{threads}; {rounds} rounds; torch {torch.__version__}, "
        f"transformers {transformers.__version__}"
    )


def _rate(value: float) -> str:
    return f"{value / 1e6:.2f}M" if value >= 1e6 else f"{value / 1e3:.1f}k"


def table(rows: list[dict]) -> str:
    """The markdown table docs/performance.md shows."""
    memory = any("peak_MiB" in row for row in rows)
    columns = ["length", "side", "batch", "tok/s", "transformers tok/s", "ratio [IQR]"]
    if memory:
        columns += ["peak MiB", "transformers peak MiB", "memory ratio"]
    columns += ["loss", "transformers loss", "rel. diff."]
    cells = []
    for row in rows:
        cell = [
            f"{row['length']} ({row['factor']}x)",
            row["side"],
            row["batch"],
            _rate(row["tokens_per_s"]),
            _rate(row["transformers_tokens_per_s"]),
            f"{row['ratio']:.2f} [{row['ratio_q1']:.2f}, {row['ratio_q3']:.2f}]",
        ]
        if memory:
            cell += [
                f"{row['peak_MiB']:,.0f}",
                f"{row['transformers_peak_MiB']:,.0f}",
                "-" if row["memory_ratio"] is None else f"{row['memory_ratio']:.2f}",
            ]
        cell += [f"{row['loss']:.5f}", f"{row['transformers_loss']:.5f}"]
        cell.append(f"{row['loss_rel_diff']:.1e}")
        cells.append(cell)
    return markdown_rows(columns, cells)


def report(rows: list[dict], title: str, out: Path | None) -> None:
    print(f"\n### {title}\n")
    print(table(rows))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"title": title, "rows": rows}, indent=1))


def main(argv: list[str] | None = None) -> list[dict]:
    from worker.cpu import flush_denormals

    flush_denormals()  # as posbench run and the workers do; before the first parallel op
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", choices=sorted(SIZES), help="tiny on the CPU, 150m on CUDA")
    parser.add_argument("--factors", nargs="*", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, help="scored tokens per length")
    parser.add_argument("--batch-tokens", type=int, default=16_384)
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument(
        "--head-variants",
        nargs="*",
        choices=["fp32", "tf32"],
        default=[],
        help="CUDA diagnostics: the output layer computed another way (not posbench's path)",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    size = SIZES[args.size or ("150m" if device.type == "cuda" else "tiny")]
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="hf-eval-") as root:
        started = time.perf_counter()
        setup = prepare(size, Path(root), device, args.factors, args.tokens, args.batch_tokens)
        print(f"prepared in {time.perf_counter() - started:.1f} s", flush=True)
        measured = measure(
            setup,
            args.rounds,
            memory=not args.no_memory,
            head_variants=tuple(args.head_variants),
        )
        report(measured, describe(setup, args.rounds), args.out)
    found = problems(measured)
    if found:
        raise SystemExit("the two evaluations differ: " + "; ".join(found))
    return measured


if __name__ == "__main__":
    main()
