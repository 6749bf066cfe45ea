"""The documentation stays true: README.md and docs/*.md are checked against the code.

Every relative link resolves (anchors included); every ``python`` block parses and runs;
every ``yaml`` block loads, and a study spec in one validates; every ``posbench``,
``make``, ``python -m`` and ``docker compose`` line in a shell block names commands,
options, targets and services that exist; every ``sql`` block runs against a database
built by the migrations and returns rows. The spec reference lists every field of the
spec models with its default and bounds, and the schema, settings, registries and CLI
commands are all documented. The README stays a short front door. No page publishes
Redis or PostgreSQL beyond a private address or connects to them elsewhere in clear.
"""

from __future__ import annotations

import ast
import importlib.util
import ipaddress
import itertools
import re
import shlex
import sqlite3
import types
import typing
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
import sqlalchemy as sa
import typer
import yaml
from annotated_types import Ge, Gt, Le, Lt, MaxLen, MinLen
from markdown_pages import (
    ROOT,
    Block,
    anchors,
    fenced_blocks,
    prose_lines,
    section,
    shell_commands,
    table_rows,
    ticked,
)
from pydantic import BaseModel
from pydantic.fields import FieldInfo

README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
README_LIMIT = 15_000  # bytes: a front door, the manuals live in docs/
SHELLS = {"sh", "bash", "shell", "console"}


def all_blocks(*langs: str) -> list[Block]:
    return [b for page in PAGES for b in fenced_blocks(page) if b.lang in langs]


# -- (1) links ------------------------------------------------------------------------------


def test_there_are_docs_to_check() -> None:
    assert README.exists()
    assert len(PAGES) > 5, "docs/*.md is missing"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_existing_files_and_headings(page: Path) -> None:
    broken = []
    for number, line in prose_lines(page):
        for target in re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", line):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                broken.append(f"line {number}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"line {number}: {target} (no heading #{anchor})")
    assert not broken, f"{page.relative_to(ROOT)}:\n" + "\n".join(broken)


def test_the_readme_is_a_short_front_door() -> None:
    size = len(README.read_bytes())
    assert size <= README_LIMIT, f"README.md is {size} bytes; move detail into docs/"
    text = README.read_text()
    for page in sorted(DOCS.glob("*.md")):
        assert f"](docs/{page.name})" in text, f"README.md does not link docs/{page.name}"
    shell = "".join(b.text for b in fenced_blocks(README) if b.lang in SHELLS)
    assert "make run" in shell and "make test" in shell


# -- (2) python and yaml blocks -------------------------------------------------------------


@pytest.fixture(scope="module")
def seeded_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder whose `.posbench/posbench.db` is migrated and holds study 1, finished:
    where the examples' `sqlite:///.posbench/posbench.db` and `--study 1` point."""
    from dashboard_seed import seed_study

    from core.settings import Settings
    from db.migrate import upgrade

    folder = tmp_path_factory.mktemp("docs")
    home = folder / ".posbench"
    settings = Settings(home=home, database_url=f"sqlite:///{home}/posbench.db")
    upgrade(settings.database)
    assert seed_study(settings) == 1
    return folder


@pytest.mark.parametrize("block", all_blocks("python"), ids=str)
def test_python_examples_parse_and_run(
    block: Block, seeded_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    code = compile(ast.parse(block.text, str(block)), str(block), "exec")
    monkeypatch.chdir(seeded_home)
    exec(code, {"__name__": "__docs__"})


@pytest.mark.parametrize("block", all_blocks("yaml", "yml"), ids=str)
def test_yaml_examples_load_and_study_specs_validate(block: Block, tmp_path: Path) -> None:
    from core.spec import SpecError, load_spec

    try:
        data = yaml.safe_load(block.text)
    except yaml.YAMLError as err:
        pytest.fail(f"{block}: not valid YAML: {err}")
    if isinstance(data, dict) and "encodings" in data:  # a study spec
        spec_file = tmp_path / "study.yaml"
        spec_file.write_text(block.text)
        try:
            load_spec(spec_file)  # parse_spec, after the YAML loader `posbench run` uses
        except SpecError as err:
            pytest.fail(f"{block}: the study spec is refused:\n{err}")


# -- (2) shell blocks -----------------------------------------------------------------------


def parse_cli(args: list[str]) -> str | None:
    """Parse ``posbench ARGS`` with the real command line, invoking nothing: None, or
    what the command line says is wrong. (Typer may bring its own copy of click, so its
    classes are recognised by what they have, not imported.)"""
    from cli import app

    command = typer.main.get_command(app)
    try:
        context = command.make_context("posbench", list(args))
        while hasattr(command, "resolve_command"):  # a group: on to its subcommand
            state = vars(context)  # click 8.2 renamed protected_args
            rest = [*state.get("_protected_args", state.get("protected_args", [])), *context.args]
            if not rest:  # a group run without a subcommand (`posbench tasks`)
                break
            name, command, rest = command.resolve_command(context, rest)
            context = command.make_context(name, rest, parent=context)
    except Exception as err:
        kinds = {kind.__name__ for kind in type(err).__mro__}
        if "Exit" in kinds:  # --help
            return None
        if "ClickException" in kinds:
            return err.format_message()
        raise
    return None


def makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", text, re.M))


def argparse_options(module: str) -> set[str] | None:
    """The options a ``python -m`` module's argparse parser declares (None: no argparse)."""
    found = importlib.util.find_spec(module)
    assert found and found.origin, f"no module {module}"
    tree = ast.parse(Path(found.origin).read_text())
    options = {
        arg.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "add_argument"
        for arg in node.args
        if isinstance(arg, ast.Constant) and str(arg.value).startswith("-")
    }
    return options | {"-h", "--help"} if options else None


def compose_problems(args: list[str]) -> list[str]:
    """``docker compose ARGS``: its profiles and services exist in docker-compose.yml."""
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    profiles = {p for service in services.values() for p in service.get("profiles", [])}
    problems, named, words = [], [], []
    tokens = iter(args)
    for token in tokens:
        if token == "--profile":
            profile = next(tokens, "")
            problems += [] if profile in profiles else [f"no profile {profile!r}"]
        elif token == "--scale":
            named.append(next(tokens, "").split("=")[0])
        elif token in ("-f", "--file", "-p", "--project-name", "--env-file"):
            next(tokens, None)
        elif not token.startswith("-"):
            words.append(token)
    if words[:1] == ["up"]:
        named += words[1:]
    elif words[:1] in (["exec"], ["run"], ["logs"]) and len(words) > 1:
        named.append(words[1])  # what follows is the command run in it
    return problems + [f"no service {name!r}" for name in named if name not in services]


def build_problems(args: list[str]) -> list[str]:
    """``docker build ARGS``: its target is a stage, its build arguments are declared."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    stages = set(re.findall(r"^FROM \S+ AS (\S+)$", dockerfile, flags=re.MULTILINE))
    declared = set(re.findall(r"^ARG (\w+)", dockerfile, flags=re.MULTILINE))
    problems = []
    for option, value in itertools.pairwise(args):
        if option == "--target" and value not in stages:
            problems.append(f"no stage {value!r}")
        if option == "--build-arg" and value.split("=")[0] not in declared:
            problems.append(f"no build argument {value.split('=')[0]!r}")
    return problems


def shell_problems(argv: list[str]) -> list[str]:
    program, args = argv[0], argv[1:]
    if program == "posbench":
        problem = parse_cli(args)
        return [problem] if problem else []
    elif program == "make":
        targets = [a for a in args if not a.startswith("-") and "=" not in a]
        return [f"no Makefile target {t!r}" for t in targets if t not in makefile_targets()]
    elif program in ("python", "python3") and args[:1] == ["-m"]:
        module, rest = args[1], args[2:]
        if module == "cli":
            return shell_problems(["posbench", *rest])
        if importlib.util.find_spec(module.split(".")[0]) is None:
            return [f"no module {module}"]
        known = argparse_options(module) if (ROOT / module.split(".")[0]).is_dir() else None
        if known is not None:  # one of ours, with an argparse parser
            flags = {a.split("=")[0] for a in rest if a.startswith("-")}
            return [f"{module} has no option {flag}" for flag in sorted(flags - known)]
    elif program == "docker" and args[:1] == ["compose"]:
        return compose_problems(args[1:])
    elif program == "docker" and args[:1] == ["build"]:
        return build_problems(args[1:])
    elif program == "docker" and args[:1] == ["run"]:
        image = next((i for i, a in enumerate(args) if a.startswith("posbench:")), None)
        if image is not None:  # the image's entry point is the posbench CLI
            return shell_problems(["posbench", *args[image + 1 :]])
    return []


@pytest.mark.parametrize("block", all_blocks(*SHELLS), ids=str)
def test_shell_examples_name_real_commands_options_and_targets(block: Block) -> None:
    problems = [
        f"{shlex.join(argv)}: {problem}"
        for argv in shell_commands(block)
        for problem in shell_problems(argv)
    ]
    assert not problems, f"{block}:\n" + "\n".join(problems)


def test_the_shell_checks_catch_mistakes() -> None:
    """The checker above refuses what it should (so a green run means something)."""
    assert shell_problems(["posbench", "results", "--study", "1"]) == []
    assert shell_problems(["posbench", "results", "--study", "one"])
    assert shell_problems(["posbench", "submit", "--no-such-option"])
    assert shell_problems(["posbench", "no-such-command"])
    assert shell_problems(["posbench", "db", "upgrade"]) == []
    assert shell_problems(["posbench", "tasks", "--json"]) == []
    assert shell_problems(["posbench", "tasks", "sample", "x", "--no-such-option"])
    assert shell_problems(["make", "no-such-target"])
    assert shell_problems(["python", "-m", "benchmarks.train_step", "--no-such-flag"])
    assert shell_problems(["docker", "compose", "--profile", "nope", "up", "-d"])
    assert shell_problems(["docker", "compose", "up", "-d", "no-such-service"])
    assert shell_problems(["docker", "build", "--target", "slim", "--build-arg", "NOPE=1", "."])
    assert shell_problems(["docker", "build", "--target", "nope", "."])
    assert not shell_problems(["docker", "build", "--build-arg", "BASE_IMAGE=x", "."])
    piped = Block(README, 0, "sh", "GIT=1 posbench status 3 --json > out.json  # note\n")
    assert shell_commands(piped) == [["posbench", "status", "3", "--json"]]


# -- (3) SQL --------------------------------------------------------------------------------


def statements(sql: str) -> list[str]:
    out, buffer = [], ""
    for line in sql.splitlines(keepends=True):
        buffer += line
        if sqlite3.complete_statement(buffer):
            out.append(buffer.strip())
            buffer = ""
    assert not buffer.strip() or buffer.strip().startswith("--"), f"unfinished SQL: {buffer}"
    return out


@pytest.mark.parametrize("block", all_blocks("sql"), ids=str)
def test_sql_examples_run_on_a_migrated_database(block: Block, seeded_home: Path) -> None:
    connection = sqlite3.connect(seeded_home / ".posbench" / "posbench.db")
    try:
        for statement in statements(block.text):
            try:
                rows = connection.execute(statement).fetchall()
            except sqlite3.Error as err:
                pytest.fail(f"{block}: {err}\n{statement}")
            assert rows, f"{block}: returns no row for the seeded study 1:\n{statement}"
    finally:
        connection.close()


def test_the_sql_examples_include_the_results_database_page() -> None:
    assert any(b.page == DOCS / "results-database.md" for b in all_blocks("sql"))


def test_the_documented_schema_is_the_migrated_schema(seeded_home: Path) -> None:
    """Every table and view with every column in the results-database page, and nothing
    documented that the migrations do not create."""
    page = DOCS / "results-database.md"
    rows = {ticked(row["table"]): row for row in table_rows(section(page, "Tables"))}
    engine = sa.create_engine(f"sqlite:///{seeded_home / '.posbench' / 'posbench.db'}")
    inspector = sa.inspect(engine)
    real = {
        name: [c["name"] for c in inspector.get_columns(name)]
        for name in [*inspector.get_table_names(), *inspector.get_view_names()]
        if name != "alembic_version"
    }
    engine.dispose()
    assert set(rows) == set(real), "tables documented vs created"
    missing = [
        f"{table}.{column}"
        for table, columns in real.items()
        for column in columns
        if f"`{column}`" not in " ".join(rows[table].values())
    ]
    assert not missing, f"columns not documented in {page.name}: {missing}"


# -- (6) the spec reference follows the spec models -----------------------------------------


def nested_models(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in nested_models(arg)]


def spec_models() -> dict[str, type[BaseModel]]:
    """StudySpec and every model a spec nests, found from its fields."""
    from core.spec import StudySpec

    found: dict[str, type[BaseModel]] = {}

    def visit(model: type[BaseModel]) -> None:
        if model.__name__ not in found:
            found[model.__name__] = model
            for field in model.model_fields.values():
                for inner in nested_models(field.annotation):
                    visit(inner)

    visit(StudySpec)
    return found


def constraints(annotation: Any, metadata: list[Any]) -> tuple[list[set[float]], set[str]]:
    """The bounds a value must meet (each a set of ways to write it) and its choices."""
    bounds, choices = [], set()
    for item in metadata:
        for kind, attr in ((Ge, "ge"), (Le, "le"), (MinLen, "min_length"), (MaxLen, "max_length")):
            if isinstance(item, kind):
                bounds.append({float(getattr(item, attr))})
        if isinstance(item, Gt):
            bounds.append({float(item.gt), float(item.gt) + 1})  # > 0 or, for an int, 1
        if isinstance(item, Lt):
            bounds.append({float(item.lt), float(item.lt) - 1})  # < 2^31 or <= 2^31 - 1
        if isinstance(item, FieldInfo):
            inner_bounds, inner_choices = constraints(None, item.metadata)
            bounds += inner_bounds
            choices |= inner_choices
    if annotation is not None:
        origin, args = typing.get_origin(annotation), typing.get_args(annotation)
        if origin is typing.Literal:
            choices |= {str(a) for a in args}
        elif origin is typing.Annotated:
            inner_bounds, inner_choices = constraints(args[0], list(args[1:]))
            bounds += inner_bounds
            choices |= inner_choices
        elif origin in (list, typing.Union, types.UnionType):
            for arg in args:
                inner_bounds, inner_choices = constraints(arg, [])
                bounds += inner_bounds
                choices |= inner_choices
    return bounds, choices


def numbers(cell: str) -> set[float]:
    found = re.findall(r"(?<![\w.])-?\d[\d,_]*(?:\.\d+)?(?:e[+-]?\d+)?", cell)
    return {float(n.replace(",", "").replace("_", "")) for n in found}


def plain(value: Any) -> bool:
    scalar = (bool, int, float, str)
    return isinstance(value, scalar) or (
        isinstance(value, list) and all(isinstance(v, scalar) for v in value)
    )


def default_problem(default: Any, required: bool, cell: str) -> str | None:
    if required:
        return None if "required" in cell else f"default {cell!r} should say 'required'"
    if default is None or not plain(default):
        return None
    match = re.match(r"`([^`]*)`", cell)
    shown = yaml.safe_load(match[1]) if match else None
    same = shown == default and isinstance(shown, bool) == isinstance(default, bool)
    return None if same else f"default {cell!r}, the code's is `{default!r}`"


def cell_ticks(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def allowed_problems(bounds: list[set[float]], choices: set[str], cell: str) -> list[str]:
    shown = numbers(cell)
    problems = [f"allowed {cell!r} lacks {min(b):g}" for b in bounds if not b & shown]
    return problems + [
        f"allowed {cell!r} lacks `{c}`" for c in sorted(choices - set(cell_ticks(cell)))
    ]


@pytest.mark.parametrize("name", sorted(spec_models()))
def test_the_spec_reference_lists_every_field_with_its_default_and_bounds(name: str) -> None:
    model = spec_models()[name]
    page = DOCS / "spec-reference.md"
    rows = {ticked(row["field"]): row for row in table_rows(section(page, f"({name})"))}
    fields = model.model_fields
    problems = [f"`{f}` is not documented" for f in fields if f not in rows]
    problems += [f"`{f}` is documented but is no field of {name}" for f in rows if f not in fields]
    for field_name, field in fields.items():
        if field_name not in rows:
            continue
        row = rows[field_name]
        required = field.is_required()
        default = None if required else field.get_default(call_default_factory=True)
        problem = default_problem(default, required, row["default"])
        problems += [f"`{field_name}`: {problem}"] if problem else []
        bounds, choices = constraints(field.annotation, field.metadata)
        problems += [
            f"`{field_name}`: {p}" for p in allowed_problems(bounds, choices, row["allowed"])
        ]
    assert not problems, f"{page.name}, section ({name}):\n" + "\n".join(problems)


def test_the_spec_reference_lists_every_task_parameter() -> None:
    from worker.data import TASKS

    page = DOCS / "spec-reference.md"
    rows = {
        (ticked(row["task"]), ticked(row["parameter"])): row
        for row in table_rows(section(page, "Task parameters"))
    }
    problems = []
    for task in TASKS.values():
        assert f"`{task.name}`" in section(page, "(TaskSpec)"), f"task {task.name}"
        for param in task.params:
            row = rows.get((task.name, param.name))
            if row is None:
                problems.append(f"{task.name}.{param.name} is not documented")
                continue
            shown = yaml.safe_load(row["default"].replace("`", ""))
            if shown != param.default:
                problems.append(f"{task.name}.{param.name}: default {row['default']!r}")
            bounds = [{float(b)} for b in (param.low, param.high) if b is not None]
            choices = {str(c) for c in param.choices or ()}
            problems += [
                f"{task.name}.{param.name}: {p}"
                for p in allowed_problems(bounds, choices, row["allowed"])
            ]
    documented = {task for task, _ in rows}
    problems += [f"no task {t!r}" for t in sorted(documented - set(TASKS))]
    assert not problems, "\n".join(problems)


def test_the_spec_checks_catch_mistakes() -> None:
    """The helpers above refuse what they should."""
    assert default_problem(128, False, "`128`") is None
    assert default_problem(128, False, "`256`")
    assert default_problem(True, False, "`1`")
    assert default_problem(None, True, "unset")
    assert allowed_problems([{8.0}, {16384.0}], set(), "8 to 16384") == []
    assert allowed_problems([{8.0}, {16384.0}], set(), "8 to 16k")
    assert allowed_problems([], {"gpu", "cpu"}, "`gpu` only")


# -- registries, settings and commands are documented ---------------------------------------


def test_the_catalogue_table_is_generated_from_the_registry() -> None:
    from cli.render.catalog import BEGIN, END, catalog_markdown

    page = (DOCS / "encodings.md").read_text()
    block = page.partition(BEGIN)[2].partition(END)[0].strip()
    assert block == catalog_markdown(), "docs/encodings.md: run `make docs`"


def test_the_tasks_page_is_generated_from_the_catalogue() -> None:
    """Every task's parameters, scoring and example (drawn by `posbench tasks sample`)."""
    from cli.render.tasks import BEGIN, END, tasks_markdown
    from core.catalog.tasks import TASKS

    page = (DOCS / "tasks.md").read_text()
    block = page.partition(BEGIN)[2].partition(END)[0].strip()
    assert block == tasks_markdown(), "docs/tasks.md: run `make docs`"
    assert all(f"### `{name}`: parameters" in block for name in TASKS)


def test_the_written_task_samples_are_what_the_command_prints() -> None:
    """A `posbench tasks sample ... --json` block followed by a json block (outside the
    generated part) shows the command's first lines as it prints them today."""
    from conftest import posbench_cli

    blocks = re.findall(
        r"```sh\n(posbench tasks sample [^\n]*--json)\n```\s*```json\n(.*?)```",
        (DOCS / "tasks.md").read_text(),
        re.DOTALL,
    )
    assert blocks, "docs/tasks.md: no written `posbench tasks sample` example found"
    for command, shown in blocks:
        done = posbench_cli(*shlex.split(command)[1:])
        assert done.returncode == 0, done.stderr
        lines = shown.strip().splitlines()
        assert done.stdout.splitlines()[: len(lines)] == lines, f"docs/tasks.md: {command}"


def test_the_details_tables_name_registered_encodings_and_parameters() -> None:
    from worker.encodings import REGISTRY, SCALINGS

    page = DOCS / "encodings.md"
    rows = {
        ticked(row["name"]): " ".join(row.values())
        for title in ("How each encoding is built", "How each RoPE scaling works")
        for row in table_rows(section(page, title))
    }
    entries = {**REGISTRY, **SCALINGS}
    problems = [
        f"`{name}` is documented but not registered" for name in rows if name not in entries
    ]
    problems += [
        f"`{name}`: parameter `{p.name}` is not documented"
        for name, text in rows.items()
        if name in entries
        for p in entries[name].params
        if f"`{p.name}`" not in text
    ]
    assert not problems, f"{page.name}:\n" + "\n".join(problems)


def test_every_setting_is_documented() -> None:
    from core.settings import Settings

    text = (DOCS / "service.md").read_text()
    prefix = Settings.model_config.get("env_prefix", "")
    missing = [
        f"{prefix}{name}".upper()
        for name in Settings.model_fields
        if f"`{prefix}{name}`".upper() not in text.upper()
    ]
    assert not missing, f"settings missing from docs/service.md: {missing}"


def cli_commands() -> list[str]:
    from cli import app

    def walk(command: Any, prefix: str) -> list[str]:
        if not hasattr(command, "commands"):
            return [prefix]
        return [
            path
            for name, sub in sorted(command.commands.items())
            for path in walk(sub, f"{prefix} {name}")
        ]

    return walk(typer.main.get_command(app), "posbench")


def test_every_cli_command_is_documented() -> None:
    text = " ".join(page.read_text() for page in PAGES)
    missing = [c for c in cli_commands() if c not in text]
    assert not missing, f"commands nowhere in README.md or docs/: {missing}"


def _settings_rows(text: str) -> dict[str, str]:
    return {
        line.split("|")[1].strip(): line
        for line in text.splitlines()
        if line.startswith("| POSBENCH_")
    }


def test_the_security_page_states_each_setting_it_names_with_its_default() -> None:
    import core.settings
    from core.settings import Settings

    source = _settings_rows(core.settings.__doc__ or "")
    text = (DOCS / "security.md").read_text()
    table = _settings_rows(text.split("## Every setting", 1)[1])
    named = set(re.findall(r"POSBENCH_[A-Z_]+", text))
    fields = {f"POSBENCH_{name}".upper() for name in Settings.model_fields}
    assert sorted((named & fields) - set(table)) == []
    drifted = [name for name, row in table.items() if source.get(name) != row]
    assert drifted == [], "rows differ from core/settings.py's table"


def test_the_settings_table_states_the_defaults_the_settings_have() -> None:
    import core.settings
    from core.settings import Settings

    wrong = []
    for name, row in _settings_rows(core.settings.__doc__ or "").items():
        stated = row.split("|")[2].strip().split(" ")[0]
        field = Settings.model_fields[name.removeprefix("POSBENCH_").lower()]
        default = field.default
        if isinstance(default, bool):
            ok = stated == str(default).lower()
        elif isinstance(default, int | float):
            ok = float(stated) == float(default)
        else:
            continue  # paths under the home, URLs, lists: stated in words
        if not ok:
            wrong.append(f"{name}: table says {stated}, the setting is {default}")
    assert wrong == []


# -- (8) the cluster recipe never exposes Redis or PostgreSQL in clear ----------------------

CLEAR_PORTS = {"6379": "Redis", "5432": "PostgreSQL"}
# Where publishing them is a choice docs/cluster.md allows ("a private network of yours"):
# RFC 1918, the carrier-grade NAT range Tailscale uses, IPv6 unique local, and loopback.
PRIVATE_NETWORKS = [
    ipaddress.ip_network(n)
    for n in (
        "10.0.0.0/8",
        "172.16.0.0/12",
        "192.168.0.0/16",
        "100.64.0.0/10",
        "fc00::/7",
        "127.0.0.0/8",
        "::1/128",
    )
]
# "[IP:]HOST:CONTAINER" for the container's Redis or PostgreSQL port, wherever it is
# written (a compose snippet, `docker run -p`, prose); a URL's host:port is not one.
PORT_MAPPING = re.compile(
    r"(?<![0-9.:\]@/])"
    r"(?:(?P<ip>\[[0-9A-Fa-f:.]*\]|[^\s\"'`,()\[\]]+?):)?"
    r"(?P<host>\d{1,5}(?:-\d{1,5})?):(?P<container>6379|5432)(?![\w.:])"
)
SERVER_URL = re.compile(r"\b(?:redis|rediss|postgres|postgresql)(?:\+\w+)?://[^\s`\"'<>()]+", re.I)
SAFE_SSLMODES = {"require", "verify-ca", "verify-full"}


def private_address(host: str | None) -> bool:
    try:
        address = ipaddress.ip_address((host or "").strip("[]"))
    except ValueError:
        return False  # a name, a variable, nothing: not a specific private address
    return any(address in network for network in PRIVATE_NETWORKS)


def compose_services() -> set[str]:
    """Host names that stay on the head node: the compose file's services."""
    return set(yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"])


def url_problem(url: str, local: set[str]) -> str | None:
    """Why ``url`` sends a password or results across a network in clear, or None."""
    url = url.rstrip(".,;:")
    try:
        parts = urlsplit(url)
        query = parse_qs(parts.query)
        host = parts.hostname or query.get("host", [""])[0]
    except ValueError:
        return f"{url} cannot be parsed"
    if not host or host.startswith("/") or host in local or private_address(host):
        return None  # a socket, a compose service, loopback, a private network
    scheme = parts.scheme.lower().split("+")[0]
    if scheme == "rediss":
        return None
    if scheme.startswith("postgres") and query.get("sslmode", [""])[-1] in SAFE_SSLMODES:
        return None
    fix = "rediss://" if scheme.startswith("redis") else "?sslmode=require (or verify-full)"
    return f"{url} reaches {host} in clear: use {fix}"


def compose_port_problems(snippet: str) -> list[str]:
    """The long and single-port forms of a compose snippet's ``ports`` that publish Redis
    or PostgreSQL beyond a private address (the short "a:b:c" form is a PORT_MAPPING)."""
    try:
        documents = list(yaml.safe_load_all(snippet))
    except yaml.YAMLError:
        return []  # test_yaml_examples_load_and_study_specs_validate says why

    def walk(node: Any) -> list[str]:
        found: list[str] = []
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "ports" and isinstance(value, list):
                    found += [p for entry in value if (p := published(entry))]
                else:
                    found += walk(value)
        elif isinstance(node, list):
            for item in node:
                found += walk(item)
        return found

    def published(entry: Any) -> str | None:
        if isinstance(entry, dict):
            target, host_ip = str(entry.get("target", "")), entry.get("host_ip")
        elif re.fullmatch(r"\d+(/\w+)?", str(entry)):  # "6379": any host port, every address
            target, host_ip = str(entry).split("/")[0], None
        else:
            return None
        if target in CLEAR_PORTS and not private_address(host_ip):
            return (
                f"ports: {entry} publishes {CLEAR_PORTS[target]} on {host_ip or 'all interfaces'}"
            )
        return None

    return [problem for document in documents for problem in walk(document)]


def exposure_problems(text: str, local: set[str], where: str = "") -> list[str]:
    """Every line of ``text`` (a page, code blocks and prose alike) that publishes Redis or
    PostgreSQL beyond a specific private address, or connects to them on another host
    without TLS; and every ``ports`` entry of its compose snippets that does."""
    problems = []
    for number, line in enumerate(text.splitlines(), 1):
        for mapping in PORT_MAPPING.finditer(line):
            ip = mapping["ip"]
            if ip and ("/" in ip or "@" in ip):
                continue  # scheme://user@host:port/..., not a mapping
            if not private_address(ip):
                service = CLEAR_PORTS[mapping["container"]]
                problems.append(
                    f"{where}{number}: publishes {service} on {ip or 'all interfaces'}: "
                    f"{line.strip()}"
                )
        for url in SERVER_URL.finditer(line):
            if problem := url_problem(url[0], local):
                problems.append(f"{where}{number}: {problem}: {line.strip()}")
    fences = re.finditer(r"^```ya?ml[^\n]*\n(.*?)^```", text, re.M | re.S)
    for fence in fences:
        start = text.count("\n", 0, fence.start()) + 1
        problems += [f"{where}{start}: {p}" for p in compose_port_problems(fence[1])]
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_exposes_redis_or_postgres_in_clear(page: Path) -> None:
    where = f"{page.relative_to(ROOT)}:"
    problems = exposure_problems(page.read_text(), compose_services(), where)
    assert not problems, "\n".join(problems)


def test_the_cluster_recipe_is_checked_where_it_publishes_and_connects() -> None:
    # Not trivially satisfied: the page that tells operators how does name both.
    cluster = (DOCS / "cluster.md").read_text()
    assert any(m["ip"] == "10.0.0.1" for m in PORT_MAPPING.finditer(cluster))
    assert {u[0].split("://")[0] for u in SERVER_URL.finditer(cluster)} >= {
        "redis",
        "rediss",
        "postgresql",
    }


@pytest.mark.parametrize(
    "sample",
    [
        'ports: ["6379:6379"]',
        '    ports: ["5432:5432"]',
        '      - "6379:6379"',
        "      - 5432:5432/tcp",
        "docker run -d -p 6379:6379 redis:7",
        "docker run --publish=5432:5432 postgres",
        "docker run -p6379:6379 redis",
        'ports: ["16379:6379"]',
        'ports: ["0.0.0.0:6379:6379"]',
        'ports: ["[::]:5432:5432"]',
        'ports: ["${HEAD_IP}:5432:5432"]',
        'ports: ["203.0.113.7:6379:6379"]',  # a public (documentation) address
        "publish `6379:6379` in an override",
        "POSBENCH_BROKER_URL=redis://:REDIS_PASSWORD@head.example:6379/0",
        "POSBENCH_DATABASE_URL=postgresql://posbench:PW@HEAD:5432/posbench",
        "postgresql+psycopg://posbench:PW@db.example/posbench?sslmode=prefer",
        "postgresql:///posbench?host=db.example&password=PW",
        "```yaml\nservices:\n  redis:\n    ports:\n      - target: 6379\n"
        "        published: 6379\n```",
        "```yaml\nservices:\n  postgres:\n    ports:\n      - 5432\n```",
    ],
)
def test_the_exposure_check_catches_a_port_or_url_in_clear(sample: str) -> None:
    assert exposure_problems(sample, {"redis", "postgres"}), sample


@pytest.mark.parametrize(
    "sample",
    [
        'ports: ["10.0.0.1:6379:6379"]',
        '      - "192.168.1.20:5432:5432"',
        'ports: ["100.101.102.103:5432:5432"]',  # a Tailscale address
        'ports: ["[fd12:3456::1]:6379:6379"]',
        'ports: ["127.0.0.1:8501:8501", "8501:8501"]',  # not Redis or PostgreSQL
        "redis://:PASSWORD@redis:6379/0 and postgresql://posbench:PW@postgres:5432/posbench",
        "redis://:REDIS_PASSWORD@10.0.0.1:6379/0",
        "POSBENCH_BROKER_URL=rediss://:REDIS_PASSWORD@HEAD:6380/0?ssl_cert_reqs=required",
        "postgresql://posbench:PW@HEAD:5432/posbench?sslmode=verify-full",
        "redis+socket:///tmp/redis.sock and postgresql:///posbench?host=/run/postgresql",
        "```yaml\nservices:\n  redis:\n    ports:\n      - target: 6379\n"
        "        host_ip: 10.0.0.1\n        published: 6379\n```",
    ],
)
def test_the_exposure_check_passes_private_binds_and_tls(sample: str) -> None:
    assert exposure_problems(sample, {"redis", "postgres"}) == [], sample


def test_the_tasks_page_is_a_reference_and_the_studies_hold_the_measurements() -> None:
    # docs/tasks.md says what each task is; how small models fare (steps, learning rates,
    # seeds, scores) lives in studies/README.md, linked from it.
    tasks = (ROOT / "docs" / "tasks.md").read_text()
    prose = re.sub(r"```.*?```", "", tasks, flags=re.S)
    diary = re.findall(r"[^.\n]*(?:\blr\b|\b\d[\d,]* steps\b|\bseeds? \d)[^.\n]*", prose)
    assert not diary, diary
    assert "../studies/README.md#what-tiny-learns-of-niah" in tasks
    studies = (ROOT / "studies" / "README.md").read_text()
    assert "### What `tiny` learns of `niah`" in studies and "2,000 steps of 32" in studies
