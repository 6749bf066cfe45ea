"""The `posbench` command line.

Exit codes: 0 success, 2 bad input (one-line reason on stderr), 1 failure.
"""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(
    name="posbench",
    help="Benchmark transformer position encodings: train, evaluate far beyond the "
    "training length, compare extrapolation curves.",
    no_args_is_help=True,
    add_completion=False,
)
console = Console()


@app.command()
def encodings(
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the registry as JSON (for scripts).")
    ] = False,
) -> None:
    """List the registered position encodings and RoPE inference-time scalings."""
    from worker.encodings import REGISTRY, SCALINGS

    if as_json:
        payload = {
            "encodings": [entry.to_json() for entry in REGISTRY.values()],
            "scalings": [entry.to_json() for entry in SCALINGS.values()],
        }
        typer.echo(json.dumps(payload, indent=2))
        return
    table = Table(title="position encodings")
    for column in ("name", "family", "parameters", "summary"):
        table.add_column(column)
    for entry in REGISTRY.values():
        params = ", ".join(
            f"{p.name}={p.derived if p.default is None else p.default}" for p in entry.params
        )
        table.add_row(entry.name, entry.family, params or "-", entry.summary)
    console.print(table)
    scalings = Table(title="RoPE inference-time scalings (rope, xpos)")
    for column in ("name", "summary"):
        scalings.add_column(column)
    for entry in SCALINGS.values():
        scalings.add_row(entry.name, entry.summary)
    console.print(scalings)


@app.command()
def demo(
    steps: Annotated[int, typer.Option(min=1, max=5000, help="Training steps per encoding.")] = 150,
) -> None:
    """Train a tiny model per encoding on the CPU and print perplexity at 1x-8x its length."""
    from worker.demo import DEMO_ENCODINGS
    from worker.demo import demo as run_demo

    console.print(
        f"training the tiny model for {steps} steps with {', '.join(DEMO_ENCODINGS)} "
        "(train length 64, Python stdlib bytes)"
    )
    run_demo(steps=steps, report=console.print)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
