"""Every table the CLI prints stays readable in an 80-column terminal: no line wider than
80 cells, and no word folded in two (each word of the 80-column output is a word of the
same output printed 400 columns wide, where nothing needs folding; a cell cut short on
purpose ends in '…')."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import isolated_env, posbench_cli
from dashboard_seed import seed_study
from rich.cells import cell_len

from core.settings import Settings
from db.migrate import upgrade

WORD = re.compile(r"\b\w{3,}\b(?!…)")


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A home whose database holds a seeded study (done, running and failed runs)."""
    folder = tmp_path_factory.mktemp("home")
    url = f"sqlite:///{folder}/posbench.db"
    upgrade(url)
    seed_study(Settings(home=folder, database_url=url))
    return folder


COMMANDS = [
    ["tasks"],
    *[["tasks", "show", name] for name in ("lm", "passkey", "niah", "sort")],
    ["encodings"],
    ["status"],
    ["status", "1"],
    ["status", "--events"],
    ["results", "--study", "1"],
    ["results", "--study", "1", "--view", "summaries"],
    ["results", "--study", "1", "--view", "pairwise"],
    ["results", "--study", "1", "--view", "train"],
    ["status", "--deleted"],
]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_table_reads_at_80_columns(home: Path, command: list[str]) -> None:
    narrow = posbench_cli(*command, env=isolated_env(home, COLUMNS="80"))
    wide = posbench_cli(*command, env=isolated_env(home, COLUMNS="400"))
    assert narrow.returncode == 0 and wide.returncode == 0, narrow.stderr + wide.stderr
    lines = narrow.stdout.splitlines()
    assert lines and max(cell_len(line) for line in lines) <= 80, narrow.stdout
    whole = set(WORD.findall(wide.stdout))
    folded = [word for word in WORD.findall(narrow.stdout) if word not in whole]
    assert not folded, f"words broken across lines: {folded[:8]}\n{narrow.stdout}"
