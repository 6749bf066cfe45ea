"""Commands on tasks: list them with their parameters, and print a task's examples as
a model sees them (``posbench tasks sample``), validated here, drawn by the task's own
code (``worker.data.samples``, imported inside the command: torch loads only then)."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich.table import Table

from cli.common import app, console, fail
from core.safe_text import text
from core.terminal import echo, styled

tasks_app = typer.Typer(
    help="The tasks: what a model learns and how it is scored; `tasks sample` prints "
    "a task's examples.",
    invoke_without_command=True,
)
app.add_typer(tasks_app, name="tasks")

EVAL_SEED = "eval"
MAX_LENGTH = 65536  # bytes of one example
MAX_SAMPLES = 1000
MAX_TOTAL = 1 << 24  # bytes printed at most (--n x --length)
MAX_SEED = 2**63 - 1


@tasks_app.callback()
def tasks(
    context: typer.Context,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the catalogue as JSON (for scripts).")
    ] = False,
) -> None:
    """List every task: its name, metric, shortest length and a one-line summary
    (`posbench tasks show NAME` has the rest)."""
    if context.invoked_subcommand is not None:
        return
    from cli.render.tasks import one_line
    from core.catalog.tasks import TASKS

    if as_json:
        payload = [{**t.to_json(), "kind": t.kind.value, "text": t.text} for t in TASKS.values()]
        echo(json.dumps(payload, indent=2))
        return
    table = Table(title="tasks", caption="posbench tasks show NAME: parameters, scoring, reference")
    entries = list(TASKS.values())
    fixed = {
        "name": [e.name for e in entries],
        "metric": [e.metric for e in entries],
        "min length": [str(e.min_length) for e in entries],
    }
    widths = {column: max(len(column), *map(len, cells)) for column, cells in fixed.items()}
    for column, width in widths.items():  # whole words, never folded or cut
        table.add_column(column, no_wrap=True, min_width=width)
    # The summary takes the rest of the line (borders and padding: 3 per column, plus 1).
    room = max(20, console.width - sum(widths.values()) - 3 * (len(widths) + 1) - 1)
    table.add_column("summary", no_wrap=True, max_width=room)
    for entry in entries:
        summary = one_line(entry)
        if len(summary) > room:
            summary = summary[: room - 1].rstrip() + "…"
        table.add_row(text(entry.name), text(entry.metric), str(entry.min_length), text(summary))
    console.print(table)


@tasks_app.command()
def show(
    name: Annotated[str, typer.Argument(help="A task's name (posbench tasks lists them).")],
) -> None:
    """A task in full: what it is, how it is scored, its parameters (default, what is
    allowed, what each does), the shortest length it fits in, and its reference."""
    from cli.render.tasks import parameter_text
    from core.catalog.tasks import TASKS

    entry = TASKS.get(name)
    if entry is None:
        fail(f"no task {name[:64]!r}; the tasks are {', '.join(TASKS)}", code=2)
    console.print(styled((entry.name, "bold"), f": {entry.summary}"))
    console.print(styled(("scored by ", "bold"), f"{entry.metric} ({entry.kind.value})"))
    console.print(styled(("shortest length ", "bold"), f"{entry.min_length} tokens"))
    reads = "UTF-8 text (a model.hf reads it in its own tokens)" if entry.text else "bytes"
    console.print(styled(("examples ", "bold"), reads))
    if entry.params:
        table = Table(title="parameters")
        table.add_column("parameter", no_wrap=True)
        table.add_column("default and allowed")
        table.add_column("what it does")
        for param in entry.params:
            table.add_row(text(param.name), text(parameter_text(param)), text(param.help))
        console.print(table)
    else:
        console.print(styled(("parameters ", "bold"), "none"))
    console.print(styled(("reference ", "bold"), entry.reference))
    console.print(styled(("implementation ", "bold"), entry.implementation))


def _params(pairs: list[str], declared: dict[str, Any]) -> dict[str, Any]:
    """``k=v`` pairs as parameters: a value in YAML's scalar form (``digits=7`` is an
    int), a string parameter's value as written."""
    from core.spec import SpecError
    from core.spec.loading import read_scalar

    out: dict[str, Any] = {}
    for pair in pairs:
        name, sep, raw = pair.partition("=")
        name = name.strip()
        if not sep or not name:
            fail(f"--param takes NAME=VALUE, got {pair!r}", code=2)
        if name in out:
            fail(f"--param {name!r} given twice", code=2)
        param = declared.get(name)
        if param is not None and param.type is str:
            out[name] = raw
            continue
        try:
            out[name] = read_scalar(raw)
        except SpecError as err:
            fail(f"--param {name}: {err.problems[0]}", code=2)
    return out


def _seed(seed: str) -> int | None:
    if seed == EVAL_SEED:
        return None
    try:
        value = int(seed)
    except ValueError:
        value = -1
    if not 0 <= value <= MAX_SEED:
        fail(f"--seed must be {EVAL_SEED!r} or an integer in [0, 2^63 - 1], got {seed!r}", code=2)
    return value


def _checked(name: str, pairs: list[str], length: int, n: int) -> dict[str, Any]:
    """The task's resolved parameters, or exit 2 naming what is allowed."""
    from core.catalog.params import EncodingConfigError
    from core.catalog.tasks import task_info

    try:
        entry = task_info(name)
        params = entry.resolve(_params(pairs, {p.name: p for p in entry.params}))
    except EncodingConfigError as err:  # a TaskConfigError, or a parameter's own check
        fail(str(err), code=2)
    if not entry.min_length <= length <= MAX_LENGTH:
        fail(
            f"--length for task {name!r} must be in [{entry.min_length}, {MAX_LENGTH}], "
            f"got {length}",
            code=2,
        )
    if not 1 <= n <= MAX_SAMPLES:
        fail(f"--n must be in [1, {MAX_SAMPLES}], got {n}", code=2)
    if n * length > MAX_TOTAL:
        fail(f"--n x --length must be at most {MAX_TOTAL:,} bytes, got {n * length:,}", code=2)
    problems = entry.length_problems(params, length)
    if problems:
        fail(problems[0], code=2)
    return params


@tasks_app.command()
def sample(
    name: Annotated[str, typer.Argument(help="The task (see `posbench tasks`).")],
    length: Annotated[
        int, typer.Option("--length", help="Bytes a model reads (each example is one more).")
    ],
    param: Annotated[
        list[str] | None,
        typer.Option("--param", help="A task parameter, NAME=VALUE (repeatable)."),
    ] = None,
    n: Annotated[
        int,
        typer.Option(
            "--n", help="Examples: with --seed eval, an evaluation's `examples` (whole groups)."
        ),
    ] = 1,
    seed: Annotated[
        str,
        typer.Option(
            "--seed",
            help=f"{EVAL_SEED!r}: the examples evaluation scores; an integer: training-like draws.",
        ),
    ] = EVAL_SEED,
    as_json: Annotated[
        bool,
        typer.Option(
            "--json", help="One JSON object per line: prompt, answer, answers (its parts), group."
        ),
    ] = False,
) -> None:
    """Print a task's examples as a model sees them: the prompt, the answers it is
    scored on, and the example's group."""
    params = _checked(name, param or [], length, n)
    drawn = _seed(seed)
    from worker.data.samples import draw

    try:
        samples = draw(name, params, length, n, drawn)
    except ValueError as err:  # a task without answers, or an example it cannot build
        fail(str(err), code=2)
    for index, item in enumerate(samples, 1):
        if as_json:
            echo(json.dumps(item.to_json(), ensure_ascii=False))
            continue
        group = "" if item.group is None else f" ({item.group})"
        console.print(styled((f"example {index}", "bold"), group), highlight=False)
        console.print(text(item.prompt), soft_wrap=True, highlight=False)
        for answer in item.answers:
            console.print(text(f"answer: {answer}"), soft_wrap=True, highlight=False)
