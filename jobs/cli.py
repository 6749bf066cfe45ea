"""The `posbench` command line.

Exit codes: 0 success, 2 bad input (one-line reason on stderr), 1 failure.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, NoReturn

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
def run(
    spec_file: Annotated[
        Path | None, typer.Argument(help="A study spec (YAML or JSON).", show_default=False)
    ] = None,
    preset: Annotated[
        str | None, typer.Option("--preset", help="A named study: smoke, quick or paper.")
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print every result as JSON on stdout.")
    ] = False,
    out: Annotated[
        Path | None,
        typer.Option("--out", help="Folder for results.json, curves.png and table.md."),
    ] = None,
    device: Annotated[
        str | None, typer.Option("--device", help="cpu, cuda or cuda:N (default: auto).")
    ] = None,
) -> None:
    """Run a study in this process (no broker, no database): train, evaluate, report."""
    from jobs.spec import SpecError, load_spec, preset_spec

    if (spec_file is None) == (preset is None):
        fail("give either a spec file or --preset NAME (smoke, quick, paper)", code=2)
    try:
        spec = load_spec(spec_file) if spec_file is not None else preset_spec(preset or "")
    except SpecError as err:
        fail("invalid spec:\n  " + "\n  ".join(err.problems), code=2)
    from jobs.runner import run_in_process

    run_in_process(spec, as_json=as_json, out=out, device=device)


def fail(message: str, code: int) -> NoReturn:
    """One readable message on stderr and a meaningful exit code (2: bad input, 1: failure)."""
    Console(stderr=True).print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(code)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
