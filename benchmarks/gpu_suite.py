"""One prepared GPU run: every GPU figure and a study at real scale, within a budget.

    python -m benchmarks.gpu_suite [--budget-s 450] [--out DIR] [--device cuda] [--tiny]

A lent GPU comes for about 15 minutes of device time, start-up included, so the whole
GPU story is this one command. It runs the parts in order of value, each in a process
of its own, and stops cleanly before the budget:

0. ``checks``: the fused attention against the written-out reference on the GPU, values
   and the learned biases' gradients, flex's run-to-run spread, compiled training steps
   (``benchmarks.gpu_checks``: what the CPU cannot run);
1. ``train``: training throughput and utilisation of every encoding on the ``base``
   preset at 512, bf16, eager and compiled, beside x-transformers' model of the same
   shape trained by the same step (``benchmarks.gpu_train --xtransformers``); ``mfu``:
   nope and rope compiled at 64k tokens a step (``large``, 64 x 1024);
2. ``eval``: evaluation tokens/s and peak memory of every encoding from 1x to 32x of
   512 (16,384 tokens), beside NoPE and x-transformers (``benchmarks.gpu_eval``);
3. ``study``: nope, rope, alibi, t5 and sinusoidal, with rope also under YaRN, on the
   ``base`` preset (25M parameters) trained at 512 and evaluated at 1x to 16x
   (``posbench run``); its results.json is ready for ``posbench import``;
4. ``hf``: a 134M Llama evaluated by posbench against a plain transformers loop
   (``benchmarks.hf_eval``);
5. ``decode``: greedy decoding with a KV cache against transformers' ``generate``
   (``benchmarks.decode``).

It prints a one-line plan first (each part's estimated seconds). A part whose estimate
no longer fits what is left of the budget is skipped; a part still running at 1.5 times
its estimate, or when the budget ends, is stopped, keeping the figures it wrote so far.
Either way the reason is recorded. The report is rewritten after every part, so a
suite killed from outside keeps the report of what it finished. ``DIR/report.json`` and
``DIR/report.md`` hold the device, the torch and CUDA versions, every part's figures
and what did not run. Each part's own JSON and log are in ``DIR`` too.

``--tiny`` runs every part on the CPU with tiny shapes, in under 2 minutes
(``tests/test_gpu_suite.py``), so the script is known to work before a device exists.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu_targets import targets
from core.catalog.encodings import REGISTRY
from core.metrics import Kind, headline
from core.tables import markdown_rows

ROOT = Path(__file__).resolve().parents[1]
METRIC = headline(Kind.LANGUAGE_MODELLING).column  # the study's: language modelling
FINISHED = "finished"  # a part's status when it ran to its end
STUDY_ENCODINGS = ["nope", "rope", "alibi", "t5", "sinusoidal"]
# Measured compiled too, in this order: the utilisation target's (rope, nope), then every
# bias encoding (compiled within 0.8x of NoPE's speed is a target), then sinusoidal; as
# many as the part's time box allows.
COMPILED = ["nope", "rope", "alibi", "t5", "fire", "kerple_log", "kerple_power", "sinusoidal"]


def one_per_family() -> list[str]:
    """The first registered encoding of each family: the tiny run's training set."""
    first: dict[str, str] = {}
    for name, entry in REGISTRY.items():
        first.setdefault(entry.family, name)
    return list(first.values())


def study_spec(tiny: bool) -> dict[str, Any]:
    """The real-scale study: 25M parameters (``base``), 600 steps of 32 x 512 tokens,
    1x to 16x; tiny: the ``tiny`` preset, a few steps, 1x to 4x of 16."""
    if tiny:
        train = {"length": 16, "steps": 4, "batch_size": 2}
        evaluation = {"lengths": [16, 32, 64], "tokens": 256}
        model = "tiny"
    else:
        train = {"length": 512, "steps": 600, "batch_size": 32, "lr": 1e-3}
        evaluation = {"lengths": [512, 1024, 2048, 4096, 8192], "tokens": 32_768}
        model = "base"
    return {
        "name": "gpu-real-scale",
        "task": "lm",
        "model": model,
        "train": {**train, "val_every": 0},
        "encodings": STUDY_ENCODINGS,
        "seeds": [0],
        "eval": {**evaluation, "variants": ["yarn"], "order_probe": False},
    }


@dataclass(frozen=True)
class Part:
    name: str
    measures: str
    estimate_s: float  # on a GPU of the H100 class
    tiny_estimate_s: float  # --tiny, on a 2-core CPU
    command: Callable[[bool, Path, str], list[str]]  # (tiny, folder, device) -> python's argv


def _module(module: str, device: str, shape: list[str], out: Path) -> list[str]:
    """python's argv for a benchmark module: ``--device``, its shape and ``--out``."""
    return ["-m", module, "--device", device, *shape, "--out", str(out)]


def _checks(tiny: bool, folder: Path, device: str) -> list[str]:
    # On the GPU one length (700: six tiles, the last one partial) after the bf16 rows.
    shape = ["--encodings", "alibi", "fire", "--no-compiled"] if tiny else ["--lengths", "700"]
    return _module("benchmarks.gpu_checks", device, shape, folder / "checks.json")


def _train(tiny: bool, folder: Path, device: str) -> list[str]:
    shape = ["--preset", "tiny", "--length", "32", "--batch", "2", "--steps", "1"]
    if tiny:
        shape += ["--modes", "eager", "--encodings", *one_per_family()]
    else:  # every encoding eagerly, then compiled those the targets name (a compile each)
        shape = ["--preset", "base", "--length", "512", "--batch", "32", "--steps", "20"]
        shape += ["--compiled-encodings", *COMPILED, "--budget-s", str(_estimate("train"))]
    shape += ["--xtransformers"]
    return _module("benchmarks.gpu_train", device, shape, folder / "train.json")


def _mfu(tiny: bool, folder: Path, device: str) -> list[str]:
    """nope and rope compiled at 64k tokens a step (``large``, 64 x 1024): the 40% target's
    shape; tiny: eager at a CPU's size (a compile there costs more than the rest)."""
    if tiny:
        shape = ["--preset", "tiny", "--length", "32", "--batch", "2", "--steps", "1"]
        shape += ["--modes", "eager"]
    else:
        shape = ["--preset", "large", "--length", "1024", "--batch", "64", "--steps", "10"]
        shape += ["--modes", "compiled", "--budget-s", str(_estimate("mfu"))]
    shape += ["--encodings", "nope", "rope"]
    return _module("benchmarks.gpu_train", device, shape, folder / "mfu.json")


def _eval(tiny: bool, folder: Path, device: str) -> list[str]:
    if tiny:
        shape = ["--preset", "tiny", "--train-length", "16", "--factors", "1", "4", "32"]
        shape += ["--rounds", "1", "--encodings", *one_per_family()]
    else:
        shape = ["--preset", "base", "--train-length", "512", "--rounds", "3"]
        shape += ["--budget-s", str(_estimate("eval"))]
    return _module("benchmarks.gpu_eval", device, shape, folder / "eval.json")


def _study(tiny: bool, folder: Path, device: str) -> list[str]:
    spec = folder / "study-spec.json"
    spec.write_text(json.dumps(study_spec(tiny), indent=1))
    return ["-m", "cli", "run", str(spec), "--device", device, "--out", str(folder / "study")]


def _hf(tiny: bool, folder: Path, device: str) -> list[str]:
    size = ["--size", "tiny", "--factors", "1", "2", "--rounds", "1", "--tokens", "512"]
    if tiny:
        size += ["--no-memory"]
    else:
        size = ["--size", "150m", "--rounds", "2", "--factors", "1", "2", "4"]
    return _module("benchmarks.hf_eval", device, size, folder / "hf.json")


def _decode(tiny: bool, folder: Path, device: str) -> list[str]:
    shape = ["--train-length", "16", "--factors", "1", "2", "--rounds", "1"]
    if tiny:
        shape += ["--encodings", "rope", "alibi", "--train-steps", "3", "--threads", "1"]
    else:
        shape = ["--preset", "small", "--train-length", "512", "--factors", "1", "4"]
        shape += ["--rounds", "2", "--train-steps", "20", "--encodings", "rope", "alibi", "nope"]
    return _module("benchmarks.decode", device, shape, folder / "decode.json")


# Sized from the first H200 run (issue 43): there train was stopped at 225 s, eval at 90 s,
# the study took 158 s alone and decode (every encoding, 1x-8x) had no figure at 90 s; and
# the second (2026-12-04): checks stopped at 52 s with both lengths, mfu at 75 s after
# nope's compile (27 s warm-up), decode at 38 s without a figure, hf done in 23 s.
# Flex compiles once per shape (tens of seconds, counted in the warm-ups), so train and
# eval get a time box they keep themselves (--budget-s: no measurement begun past it),
# the study reads fewer tokens per length and decode measures three encodings.
PARTS = (
    Part(
        "checks",
        "flex against eager: bf16 builds, values, gradients; compiled steps",
        45,
        30,
        _checks,
    ),
    Part("train", "training tokens/s and MFU per encoding, eager and compiled", 110, 10, _train),
    Part("mfu", "compiled MFU of nope and rope at 64k tokens a step", 60, 10, _mfu),
    Part("eval", "evaluation tokens/s and memory per encoding, 1x to 32x", 75, 10, _eval),
    Part("study", "a study at real scale: ppl from 1x to 16x per encoding", 90, 15, _study),
    Part("hf", "an HF Llama evaluated by posbench against transformers", 25, 15, _hf),
    Part("decode", "KV-cache decoding against transformers' generate", 45, 15, _decode),
)


def _estimate(name: str) -> float:
    """A part's own time box: its estimate less a tenth for start-up and writing."""
    return next(round(0.9 * p.estimate_s) for p in PARTS if p.name == name)


# A part may run this many times its estimate (the budget left permitting) before it
# is stopped, so that one slow part does not take the time of all that follow it.
OVERRUN = 1.5


def device_facts(device: str) -> dict[str, Any]:
    facts: dict[str, Any] = {
        "device": device,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        facts["device_name"] = torch.cuda.get_device_name(torch.device(device))
    else:
        facts["device_name"] = "cpu"
    return facts


def run_part(part: Part, tiny: bool, folder: Path, device: str, left: float) -> dict[str, Any]:
    """Run ``part`` in a process of its own for at most ``left`` seconds: its status,
    seconds and figures (the JSON it wrote, when it did)."""
    estimate = part.tiny_estimate_s if tiny else part.estimate_s
    record: dict[str, Any] = {"part": part.name, "measures": part.measures, "estimate_s": estimate}
    if estimate > left:
        return record | {"status": f"skipped: needs about {estimate:.0f} s, {left:.0f} s left"}
    # An earlier run's, in a folder used again: its JSON, and the study's whole folder
    # (posbench run refuses to write over a folder whose results.json is gone).
    part_json, results = _outputs(part.name, folder)
    part_json.unlink(missing_ok=True)
    shutil.rmtree(results.parent, ignore_errors=True)
    argv = [sys.executable, *part.command(tiny, folder, device)]
    env = {**os.environ, "POSBENCH_HOME": str(folder / "home")}
    limit = left if tiny else min(left, OVERRUN * estimate)
    started = time.monotonic()
    with open(folder / f"{part.name}.log", "w") as log:
        try:
            done = subprocess.run(
                argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=limit
            )
            status = FINISHED if done.returncode == 0 else f"failed (exit {done.returncode})"
        except subprocess.TimeoutExpired:
            status = f"stopped after {limit:.0f} s"
    record["seconds"] = round(time.monotonic() - started, 1)
    # What a stopped or failed part measured before it ended is kept (the parts rewrite
    # their JSON as they go), marked partial.
    figures = _figures(part.name, folder)
    if status != FINISHED:
        status += f"; see {part.name}.log" + ("; partial figures kept" if figures else "")
    return record | {"status": status, "figures": figures}


def _outputs(name: str, folder: Path) -> list[Path]:
    return [folder / f"{name}.json", folder / name / "results.json"]


def _figures(name: str, folder: Path) -> Any:
    part_json, results = _outputs(name, folder)
    if results.exists():  # the study's, ready for posbench import
        spec = json.loads((folder / f"{name}-spec.json").read_text())
        return {
            "results": str(results),
            "model": spec["model"],
            "train": spec["train"],
            "rows": study_rows(json.loads(results.read_text())),
        }
    try:
        return json.loads(part_json.read_text()) if part_json.exists() else None
    except json.JSONDecodeError:  # stopped while writing it
        return None


def study_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The study's metric (perplexity) per (encoding, variant) and length of a
    results.json."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for run in results["runs"]:
        for point in run["evaluations"]:
            key = (run["label"], point["variant"])
            row = rows.setdefault(key, {"encoding": key[0], "variant": key[1]})
            value = point[METRIC]
            row[str(point["length"])] = None if value is None else round(value, 3)
    return list(rows.values())


def markdown_report(report: dict[str, Any]) -> str:
    facts = report["facts"]
    lines = [
        f"# GPU suite on {facts['device_name']}",
        "",
        f"torch {facts['torch']}, CUDA {facts['cuda']}, budget {report['budget_s']:.0f} s, "
        f"used {report['seconds']:.0f} s{' (--tiny)' if report['tiny'] else ''}.",
        *(
            [
                "",
                "Not reached yet (the suite was still running): "
                f"{', '.join(report['not_reached'])}.",
            ]
            if report["not_reached"]
            else []
        ),
        "",
        markdown_rows(
            ["part", "measures", "status", "seconds"],
            [
                [p["part"], p["measures"], p["status"], p.get("seconds", "")]
                for p in report["parts"]
            ],
        ),
        "",
        "## targets",
        "",
        *(
            [
                f"The targets are an H100-class GPU's; on {facts['device_name']} these rows "
                "only show that the checks run.",
                "",
            ]
            if report["tiny"] or facts["device"] == "cpu"
            else []
        ),
        markdown_rows(["target", "measured", "held"], report["targets"]),
    ]
    for part in report["parts"]:
        figures = part.get("figures")
        rows = figures.get("rows") if isinstance(figures, dict) else None
        if rows:
            columns = list(dict.fromkeys(key for row in rows for key in row))
            lines += ["", f"## {part['part']}", ""]
            if "results" in figures:  # the study: how it was trained, where its results are
                train = figures["train"]
                lines += [
                    f"`{figures['model']}` trained {train['steps']} steps of "
                    f"{train['batch_size']} x {train['length']}; results: `{figures['results']}` "
                    "(ready for `posbench import`).",
                    "",
                ]
            lines.append(
                markdown_rows(columns, [[row.get(c, "") for c in columns] for row in rows])
            )
    return "\n".join(lines) + "\n"


def _cell(value: object) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def plan_line(tiny: bool, budget: float, device: str) -> str:
    parts = ", ".join(
        f"{p.name} ~{p.tiny_estimate_s if tiny else p.estimate_s:.0f} s" for p in PARTS
    )
    return f"plan (budget {budget:.0f} s on {device}): {parts}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-s", type=float, default=450.0)
    parser.add_argument("--out", type=Path, default=Path("gpu-suite"))
    parser.add_argument("--device", default=None, help="default: cuda when present, else cpu")
    parser.add_argument("--tiny", action="store_true", help="every part, tiny, on the CPU")
    args = parser.parse_args(argv)
    if args.budget_s <= 0:
        parser.error("--budget-s must be positive")
    device = args.device or ("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    args.out.mkdir(parents=True, exist_ok=True)
    print(plan_line(args.tiny, args.budget_s, device), flush=True)
    started = time.monotonic()
    parts: list[dict[str, Any]] = []
    for part in PARTS:
        left = args.budget_s - (time.monotonic() - started)
        parts.append(run_part(part, args.tiny, args.out, device, left))
        print(f"{part.name}: {parts[-1]['status']}", flush=True)
        # Written after every part: a suite killed from outside (a device's own time
        # limit) leaves the report of the parts it finished.
        report = {
            "facts": device_facts(device),
            "tiny": args.tiny,
            "budget_s": args.budget_s,
            "seconds": round(time.monotonic() - started, 1),
            "parts": parts,
            "not_reached": [p.name for p in PARTS[len(parts) :]],
            "targets": targets(parts),
        }
        (args.out / "report.json").write_text(json.dumps(report, indent=1))
        (args.out / "report.md").write_text(markdown_report(report))
    print(f"report: {args.out / 'report.md'}", flush=True)
    return report


if __name__ == "__main__":
    main()
