"""When does a model learn a task? Trains a preset model on a task and scores it at its
training length every ``--every`` steps: the training loss (over the scored bytes, the
answer's for a synthetic task) and exact match on ``--examples`` evaluation examples.
The learning studies of issue 20 (``studies/README.md``) are its runs.

    python studies/learning_curve.py niah --param haystack=needles --param num_keys=4 \\
        --encoding alibi --steps 2000 --lr 1e-3 --every 100

``--train-param`` trains on another parameterisation of the task than the one scored
(``--train-param num_keys=1`` with ``--min-length 64``: single-key haystacks of 2-5
needles, scored on the task of ``--param``). Every figure is printed as measured; one
line per mark: ``step  loss  exact_match``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
import yaml
from pydantic import ValidationError

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from core.spec import EvalSpec, TrainSpec  # noqa: E402
from worker.data import build_task, task_info  # noqa: E402
from worker.evaluate import evaluate_in_distribution  # noqa: E402
from worker.model import build_model  # noqa: E402
from worker.training.hooks import BaseHooks  # noqa: E402
from worker.training.trainer import Trainer  # noqa: E402


def pairs(values: list[str]) -> dict[str, Any]:
    """``NAME=VALUE`` options as parameters (a value in YAML's scalar form)."""
    out: dict[str, Any] = {}
    for item in values:
        name, sep, raw = item.partition("=")
        if not sep or not name:
            raise SystemExit(f"a parameter is NAME=VALUE, got {item!r}")
        out[name] = yaml.safe_load(raw)
    return out


def fits(name: str, params: dict[str, Any], lengths: range, option: str) -> None:
    """Refuses a length an example of the task cannot be built at (the catalogue's check),
    naming the ``option`` that asked for it."""
    entry = task_info(name)
    if lengths.start < entry.min_length:
        problem = f"task {name!r} needs sequences of at least {entry.min_length} bytes"
        raise ValueError(f"{option} (a length of {lengths.start}): {problem}")
    if misfit := entry.first_misfit(entry.resolve(params), lengths):
        raise ValueError(f"{option} (a length of {misfit[0]}): {misfit[1][0]}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("task")
    parser.add_argument("--param", action="append", default=[], help="NAME=VALUE")
    parser.add_argument("--train-param", action="append", default=[], help="NAME=VALUE")
    parser.add_argument("--encoding", default="alibi")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--min-length", type=int, default=None)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-3)
    for field in ("warmup", "min_lr_ratio", "weight_decay"):  # TrainSpec's defaults
        default = TrainSpec.model_fields[field].default
        parser.add_argument(f"--{field.replace('_', '-')}", type=float, default=default)
    parser.add_argument("--optimizer", default=TrainSpec.model_fields["optimizer"].default)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--examples", type=int, default=100)
    args = parser.parse_args(argv)

    params = pairs(args.param)
    try:  # the catalogue's and the spec's own checks, as one line each
        if task_info(args.task).metric != "accuracy":
            raise ValueError(f"task {args.task!r} is not scored by exact match (accuracy)")
        EvalSpec(lengths=[args.length], examples=args.examples)
        task = build_task(args.task, **params)
        trained_params = {**params, **pairs(args.train_param)}
        trained_on = build_task(args.task, **trained_params) if args.train_param else task
        fits(args.task, params, range(args.length, args.length + 1), "--length")
        drawn = range(args.min_length or args.length, args.length + 1)
        fits(args.task, trained_params, drawn, "--min-length" if args.min_length else "--length")
        spec = TrainSpec(
            length=args.length,
            min_length=args.min_length,
            steps=args.steps,
            batch_size=args.batch_size,
            lr=args.lr,
            warmup=args.warmup,
            min_lr_ratio=args.min_lr_ratio,
            weight_decay=args.weight_decay,
            optimizer=args.optimizer,
            progress_every=args.every,
            val_every=0,
            checkpoint_every=max(1, args.steps),
        )
        model = build_model(args.model, args.encoding, train_length=args.length, seed=args.seed)
    except (ValueError, KeyError) as err:
        message = (
            "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
            if isinstance(err, ValidationError)
            else str(err)
        )
        raise SystemExit(f"learning_curve.py: {message}") from None

    class Marks(BaseHooks):
        def on_progress(self, point: Any) -> None:
            if point.step % args.every and point.step != args.steps:
                return
            score = float(
                evaluate_in_distribution(model, task, args.length, examples=args.examples).accuracy
            )
            model.train()
            print(f"{point.step:6d}  {point.loss:.3f}  {score:.3f}", flush=True)

    Trainer(
        model, trained_on, spec, seed=args.seed, device=torch.device("cpu"), hooks=Marks()
    ).fit()


if __name__ == "__main__":
    main()
