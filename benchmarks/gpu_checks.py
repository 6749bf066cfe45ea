"""GPU-only checks of the fused attention: what the CPU cannot run (FlexAttention's backward).

    python -m benchmarks.gpu_checks [--device cuda] [--out FILE]

For every encoding that acts on the logits (ALiBi also with log-n factors), a float32
``small`` model whose learned position values are moved off their initial ones:

- ``values``: its logits through flex_attention against the written-out reference
  (``eager``) at lengths that are not a multiple of the kernel's 128-row tiles;
- ``gradients``: every parameter's gradient the same way, the learned biases' included
  (T5's table, KERPLE's r1 / r2, FIRE's MLP, c and threshold), as the largest
  difference relative to the gradient's norm;
- ``spread``: flex's gradient of the same pass taken twice (captured learned tensors get
  atomic adds, so the order of the sums varies from run to run);
- ``compiled``: three training steps with ``train.compile`` (bf16 autocast) against the
  same steps uncompiled, and the compiled graph's breaks;
- ``bf16``, first: a forward and backward of the ``base`` preset (head size 64) under
  bf16 autocast against eager's: the shape the suite trains, whose kernel tiles must fit
  the GPU's shared memory (float32 and the small preset's head size 32 fit where bf16 at
  64 did not: the first H200 run). A kernel that does not build is a row that did not
  hold, with its error.

Each row says whether it held; the exit status is 1 when one did not. On the CPU
(``--device cpu``; FlexAttention has no backward there in torch 2.13) the gradients
compare sdpa with eager instead, which is how the script is tested without a GPU.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from worker.fused import compiled_shapes
from worker.model import build_model

BIASED = ["alibi", "t5", "kerple_log", "kerple_power", "fire"]
TRAIN_LENGTH = 64
LENGTHS = (200, 700)  # neither a multiple of 128
VALUE_TOLERANCE = 1e-5  # float32 logits, absolute
GRADIENT_TOLERANCE = 1e-4  # largest difference / the gradient's norm, per parameter
COMPILED_TOLERANCE = 0.02  # relative loss, bf16 autocast compiled against uncompiled
BF16_LENGTH = 512
BF16_TOLERANCE = 0.05  # relative loss and gradient, bf16 autocast fused against eager


def _model(name: str, device: torch.device, logn: bool = False):
    model = build_model("small", name, train_length=TRAIN_LENGTH, seed=7).to(device)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for parameter in model.encoding.parameters():
            noise = torch.randn(parameter.shape, generator=generator).to(device)
            parameter.add_(0.5 * noise)
    model.logn_length = TRAIN_LENGTH if logn else None
    return model


def _pass(model, tokens: torch.Tensor, implementation: str):
    model.attn_implementation = implementation
    model.zero_grad(set_to_none=True)
    logits = model(tokens)
    logits.logsumexp(-1).mean().backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    return logits.detach(), grads


def _relative(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """The largest difference of a parameter's gradient over that gradient's norm, the
    norm floored at 1e-3 of the whole gradient's (a gradient that is zero in exact
    arithmetic, like the bias MLP's output bias under the softmax, is rounding alone)."""
    whole = torch.sqrt(sum(ref.double().square().sum() for ref in reference.values()))
    return max(
        float((ours[name] - ref).abs().max() / torch.maximum(ref.norm(), 1e-3 * whole))
        for name, ref in reference.items()
    )


def fused_rows(
    name: str, device: torch.device, logn: bool, lengths: tuple[int, ...] = LENGTHS
) -> list[dict[str, Any]]:
    """The values, gradients and spread rows of one encoding."""
    label = f"{name}+logn" if logn else name
    fused = "flex_attention" if device.type == "cuda" else "sdpa"
    model = _model(name, device, logn)
    rows = []
    generator = torch.Generator().manual_seed(1)
    for length in lengths:
        tokens = torch.randint(0, 256, (2, length), generator=generator).to(device)
        reference, reference_grads = _pass(model, tokens, "eager")
        logits, grads = _pass(model, tokens, fused)
        again = _pass(model, tokens, fused)[1]
        worst = float((logits - reference).abs().max())
        rows.append(_row(label, "values", length, fused, worst, VALUE_TOLERANCE))
        relative = _relative(grads, reference_grads)
        rows.append(_row(label, "gradients", length, fused, relative, GRADIENT_TOLERANCE))
        encoding = [n for n in grads if n.startswith("encoding.")]
        spread = max((float((grads[n] - again[n]).abs().max()) for n in encoding), default=0.0)
        rows.append(_row(label, "spread", length, fused, spread, None))
    return rows


def bf16_row(name: str, device: torch.device) -> dict[str, Any]:
    """The ``base`` preset's loss and gradients under bf16 autocast, fused against eager."""
    fused = "flex_attention" if device.type == "cuda" else "sdpa"
    model = build_model("base", name, train_length=BF16_LENGTH, seed=7).to(device)
    generator = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 256, (2, BF16_LENGTH), generator=generator).to(device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    try:
        with autocast:
            reference, reference_grads = _pass(model, tokens, "eager")
            logits, grads = _pass(model, tokens, fused)
    except Exception as exc:  # the row says what did not build, the other checks go on
        row = _row(name, "bf16", BF16_LENGTH, fused, float("inf"), BF16_TOLERANCE)
        return row | {"error": f"{type(exc).__name__}: {str(exc)[-300:]}"}
    loss, reference_loss = (float(x.float().logsumexp(-1).mean()) for x in (logits, reference))
    worst = max(abs(loss - reference_loss) / abs(reference_loss), _relative(grads, reference_grads))
    return _row(name, "bf16", BF16_LENGTH, fused, worst, BF16_TOLERANCE)


def compiled_rows(name: str, device: torch.device, folder: Path) -> list[dict[str, Any]]:
    """Three steps of the trainer compiled against the same three uncompiled."""
    from torch._dynamo.utils import counters

    from core.spec import TrainSpec
    from worker.data import build_task
    from worker.training import Trainer

    task = build_task("lm")
    task.prepare(folder)
    losses = {}
    for compile_step in (False, True):
        torch._dynamo.reset()
        counters.clear()
        model = build_model("small", name, train_length=TRAIN_LENGTH, seed=0)
        spec = TrainSpec(
            length=TRAIN_LENGTH, steps=3, batch_size=8, progress_every=1, compile=compile_step
        )
        trainer = Trainer(model, task, spec, seed=0, device=device)
        losses[compile_step] = [point.loss for point in trainer.fit().curve]
        breaks = sum(counters["graph_break"].values())
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses[True], losses[False], strict=True))
    row = _row(name, "compiled", TRAIN_LENGTH, "auto", worst, COMPILED_TOLERANCE)
    return [row | {"graph_breaks": breaks, "trained_with": model.attention_record()["train"]}]


def _row(
    encoding: str, check: str, length: int, kernel: str, measured: float, tolerance: float | None
) -> dict[str, Any]:
    held = None if tolerance is None else measured <= tolerance
    return {
        "encoding": encoding,
        "check": check,
        "length": length,
        "kernel": kernel,
        "measured": float(f"{measured:.3g}"),
        "tolerance": tolerance,
        "held": held,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--encodings", nargs="*", default=BIASED, choices=BIASED)
    parser.add_argument("--no-compiled", action="store_true", help="leave out the training steps")
    parser.add_argument(
        "--lengths", type=int, nargs="+", default=list(LENGTHS), help="of the values rows"
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    # The lm task's prepared data for the compiled steps: beside the report, or in a
    # temporary folder (never the working folder).
    folder = args.out.parent / "gpu-checks-data" if args.out else Path(tempfile.mkdtemp())
    started = time.monotonic()
    rows: list[dict[str, Any]] = []

    def save() -> None:
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            document = {
                "device": str(device),
                "seconds": round(time.monotonic() - started, 1),
                "flex_shapes_compiled": compiled_shapes(),
                "rows": rows,
            }
            args.out.write_text(json.dumps(document, indent=1))

    for name in args.encodings:
        rows.append(bf16_row(name, device))
        print(json.dumps(rows[-1]), flush=True)
        save()
    plan = [(name, False) for name in args.encodings]
    plan += [("alibi", True)] if "alibi" in args.encodings else []
    for name, logn in plan:
        rows.extend(fused_rows(name, device, logn, tuple(args.lengths)))
        print(json.dumps(rows[-1]), flush=True)
        save()
    if not args.no_compiled:
        for name in [n for n in ("alibi", "t5") if n in args.encodings]:
            rows.extend(compiled_rows(name, device, folder))
            print(json.dumps(rows[-1]), flush=True)
            save()
    failed = [row for row in rows if row["held"] is False]
    for row in failed:
        print(f"did not hold: {row}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
