"""How do `posbench status` and the dashboard's study pickers fare with many studies?

    python -m benchmarks.status_scale [--studies 20000] [--out FILE]

Builds a SQLite database of ``--studies`` studies, 3 runs each (done), 3 evaluations per
run (60,000 runs and 180,000 evaluations at the default), then times, each the median
of ``--rounds``:

- the CLI as a person runs it (a fresh process: start-up included): ``posbench status``
  (the newest 20), ``posbench status --all`` (every study, as the CLI printed before
  the listing was bounded), ``posbench status ID`` and ``posbench results --study ID``;
- the pages' queries in this process: a picker's (the newest 200 and the count) beside
  the unbounded listing the pickers read before (``db.queries.studies`` of every
  study), a study's runs and its curves.

Prints a markdown table (with the ratio of each bounded query to the unbounded one) and
writes JSON with --out. Nothing here is asserted; docs/performance.md has the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import sqlalchemy as sa

from core.catalog.tasks import TASKS
from core.status import RunStatus
from db import queries
from db.engine import engine_for
from db.migrate import upgrade
from db.models import Evaluation, Run, Study

ROOT = Path(__file__).resolve().parents[1]
LENGTHS = (128, 256, 512)
METRIC = TASKS["lm"].metric  # the studies' task: language modelling


def build(url: str, studies: int) -> None:
    """``studies`` studies of 3 done runs, each with 3 evaluated lengths, in bulk."""
    engine = engine_for(url)
    with engine.begin() as connection:
        connection.execute(
            sa.insert(Study),
            [
                {
                    "id": i,
                    "name": f"study-{i}",
                    "task": "lm",
                    "metric": METRIC,
                    "train_length": 128,
                    "spec": {},
                }
                for i in range(1, studies + 1)
            ],
        )
        connection.execute(
            sa.insert(Run),
            [
                {
                    "id": 3 * (i - 1) + seed + 1,
                    "study_id": i,
                    "label": "rope",
                    "encoding": "rope",
                    "params": {},
                    "seed": seed,
                    "config_hash": f"{i}-{seed}",
                    "status": RunStatus.DONE,
                    "step": 100,
                    "total_steps": 100,
                }
                for i in range(1, studies + 1)
                for seed in range(3)
            ],
        )
        connection.execute(
            sa.insert(Evaluation),
            [
                {
                    "run_id": run_id,
                    "variant": "none",
                    "protocol": "nonoverlapping",
                    "eval_length": length,
                    "loss": 2.0 + length / 1000,
                    METRIC: 7.4,
                    "tokens": 4096,
                }
                for run_id in range(1, 3 * studies + 1)
                for length in LENGTHS
            ],
        )


def median_seconds(work: Callable[[], object], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def cli(home: Path, *args: str) -> Callable[[], None]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("POSBENCH_")}
    env.update(POSBENCH_HOME=str(home), COLUMNS="100")

    def run() -> None:
        subprocess.run(
            [sys.executable, "-m", "cli", *args],
            cwd=ROOT,
            env=env,
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--studies", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    home = Path(tempfile.mkdtemp(prefix="pb-status-"))
    url = f"sqlite:///{home}/posbench.db"
    upgrade(url)
    started = time.perf_counter()
    build(url, args.studies)
    built = time.perf_counter() - started
    newest = args.studies
    rows = [
        ("posbench status (newest 20)", cli(home, "status"), "cli"),
        ("posbench status --all", cli(home, "status", "--all"), "cli"),
        (f"posbench status {newest}", cli(home, "status", str(newest)), "cli"),
        (f"posbench results --study {newest}", cli(home, "results", "--study", str(newest)), "cli"),
        ("posbench --help (start-up alone)", cli(home, "--help"), "cli"),
        (
            "picker: newest 200 + count",
            lambda: (queries.studies(url, limit=200), queries.count_studies(url)),
            "query",
        ),
        ("unbounded listing (every study)", lambda: queries.studies(url), "query"),
        ("a study's runs", lambda: queries.runs(url, study_id=newest), "query"),
        ("a study's curves", lambda: queries.curves(url, study_ids=[newest]), "query"),
    ]
    results = {
        name: {"seconds": median_seconds(work, args.rounds), "kind": kind}
        for name, work, kind in rows
    }
    unbounded = results["unbounded listing (every study)"]["seconds"]
    print(
        f"{args.studies:,} studies, {3 * args.studies:,} runs, "
        f"{3 * len(LENGTHS) * args.studies:,} evaluations (built in {built:.1f} s); "
        f"median of {args.rounds}"
    )
    print("| what | kind | seconds | / unbounded listing |")
    print("|---|---|---|---|")
    for name, result in results.items():
        ratio = result["seconds"] / unbounded if result["kind"] == "query" else None
        shown = f"{ratio:.3f}" if ratio is not None else "-"
        print(f"| {name} | {result['kind']} | {result['seconds']:.3f} | {shown} |")
    if args.out:
        payload = {"studies": args.studies, "rounds": args.rounds, "results": results}
        args.out.write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
