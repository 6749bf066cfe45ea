"""The structure the redesign made, kept: small functions and modules, one declaration
of each metric and of each run status (docs/architecture.md, rules of thumb)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from core.metrics import METRICS
from lint.project import PACKAGES, ROOT

MAX_FUNCTION_LINES = 100
MAX_MODULE_LINES = 500


def _sources(*, history: bool = False) -> list[Path]:
    """Our Python modules; Alembic revisions are history (they keep the names of their
    day) unless ``history``."""
    return [
        path
        for package in PACKAGES
        if package != "studies"  # analyses of a results.json: they name the columns they read
        for path in sorted((ROOT / package).rglob("*.py"))
        if history or "migrations" not in path.parts
    ]


def test_no_module_over_500_lines_and_no_function_over_100() -> None:
    problems = []
    for path in _sources(history=True):
        text = path.read_text(encoding="utf-8")
        name = path.relative_to(ROOT)
        if (lines := len(text.splitlines())) > MAX_MODULE_LINES:
            problems.append(f"{name}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    problems.append(f"{name}:{node.lineno} {node.name}(): {length} lines")
    assert not problems, "\n".join(problems)


def _string_literals(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    ]


# "loss" also names the training loss (train_points.loss, the training curves' column),
# which is not the evaluation metric; every other metric name is the registry's alone.
@pytest.mark.parametrize("metric", sorted(set(METRICS) - {"loss"}))
def test_metric_names_are_written_only_in_the_registry(metric: str) -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in _sources()
        if path != ROOT / "core" / "metrics.py"
        for line, value in _string_literals(path)
        if value == metric and not _is_field_name(path, line, metric)
    ]
    assert not found, f"{metric!r} written outside core/metrics.py: {found}"


def _is_plotly_axis_type(path: Path, line: int, value: str) -> bool:
    """Plotly's axis type ``"log" if ... else "linear"``, not the RoPE scaling ``linear``
    (HF transformers' name for position interpolation)."""
    text = path.read_text(encoding="utf-8").splitlines()[line - 1]
    return value == "linear" and bool(re.search(r'"log" if \w+ else "linear"', text))


def _is_field_name(path: Path, line: int, metric: str) -> bool:
    """A metric's column declared in the schema (an attribute, not a switch)."""
    text = path.read_text(encoding="utf-8").splitlines()[line - 1]
    return bool(re.match(rf"\s*{metric}\s*:", text))


def test_run_statuses_are_written_only_in_their_enum() -> None:
    from core.status import RunStatus

    statuses = {status.value for status in RunStatus}
    found = [
        f"{path.relative_to(ROOT)}:{line} {value!r}"
        for path in _sources()
        if path != ROOT / "core" / "status.py"
        for line, value in _string_literals(path)
        if value in statuses
    ]
    assert not found, f"run statuses written outside core/status.py: {found}"


def test_the_architecture_doc_lists_the_layers_the_contract_enforces() -> None:
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    layers = next(c for c in config["contracts"] if c["id"] == "floors")["layers"]
    enforced = [set(re.split(r"\s*[|:]\s*", layer.strip())) for layer in layers]
    documented = [
        {
            cell.removesuffix("/").removesuffix(".py").replace("/", ".")
            for cell in re.findall(r"`([a-z_/.]+)`", row.split("|")[2])
        }
        for row in (ROOT / "docs" / "architecture.md").read_text().splitlines()
        if re.match(r"\| \d ", row)
    ]
    assert documented == enforced


def test_catalogue_names_are_written_only_in_the_catalogue() -> None:
    """A name switch on an encoding, scaling or task outside its catalogue entry is a
    missing hook (the entry's check, family, scalable, needs_factor, notes say it).
    Implementations (worker/encodings, worker/data) name themselves; the benchmarks map
    each encoding to the reference's configuration of it; the Submit form starts from an
    example study."""
    from core.catalog.encodings import REGISTRY, SCALINGS
    from core.catalog.tasks import DEFAULT_TASK, TASKS

    names = {*REGISTRY, *SCALINGS, *TASKS}
    exempt = ("catalog", "encodings", "data", "migrations")
    found = [
        f"{path.relative_to(ROOT)}:{line} {value!r}"
        for path in _sources()
        if path.parts[len(ROOT.parts)] != "benchmarks"
        and not any(part in exempt for part in path.relative_to(ROOT).parts)
        and path != ROOT / "dashboard" / "submit_page.py"
        for line, value in _string_literals(path)
        if value in names and not _is_plotly_axis_type(path, line, value)
    ]
    assert not found, f"catalogue names written outside the catalogue: {found}"
    assert DEFAULT_TASK in TASKS


FAST_TIER = "not slow and not cluster and not faults"


def test_the_fast_tier_leaves_out_every_test_that_starts_processes() -> None:
    # `make test-fast` selects -m "not slow and not cluster and not faults"; the conftest
    # marks a test slow by what it uses (tests/conftest.py, _starts_processes).
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", FAST_TIER],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    fast = [line for line in done.stdout.splitlines() if "::" in line]
    assert len(fast) > 1000, done.stdout[-2000:]
    for starts_processes in (
        "tests/integration/",  # real Redis, PostgreSQL, workers, Chromium
        "tests/cluster/",
        "tests/faults/",
        "tests/test_cli_run.py::test_run_smoke_preset_writes_json_table_and_png",  # the CLI
        "tests/test_dashboard.py::test_presets_fill_the_form",  # a Streamlit app
        "tests/test_model.py::test_the_model_compiles_as_one_graph",  # marked by hand
    ):
        assert not [test for test in fast if test.startswith(starts_processes)], starts_processes
    assert f'-m "{FAST_TIER}"' in (ROOT / "Makefile").read_text()
