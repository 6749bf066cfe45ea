"""The service's CLI commands on bad input: exit 2 and one line saying what is wrong."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from conftest import isolated_env, posbench_cli


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return isolated_env(tmp_path)


def posbench(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return posbench_cli(*args, env=env)


def test_commands_before_the_schema_exists_say_how_to_create_it(env) -> None:
    done = posbench(env, "status")
    assert done.returncode == 1 and "run `posbench db upgrade`" in done.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["cancel", "5"], "error: no study with id 5"),
        (["retry", "--run", "3"], "error: no run with id 3"),
        (["cancel"], "error: give a study id or --run ID"),
        (["retry", "1", "--run", "2"], "error: give a study id or --run ID"),
        (["status", "9"], "error: no study with id 9"),
        (["results", "--study", "9"], "error: no study with id 9"),
        (["results", "--study", "1", "--format", "xml"], "--format must be table, csv or json"),
        (["worker", "--queues", "tpu"], "unknown queue 'tpu' (allowed: gpu, cpu)"),
        (["submit", "--preset", "huge"], "unknown preset 'huge' (available: smoke, quick"),
    ],
)
def test_bad_ids_and_options_exit_2(env, args: list[str], message: str) -> None:
    assert posbench(env, "db", "upgrade").returncode == 0
    done = posbench(env, *args)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_status_lists_no_study_on_an_empty_database(env) -> None:
    posbench(env, "db", "upgrade")
    done = posbench(env, "status", "--json")
    assert done.returncode == 0 and done.stdout.strip() == "[]"
