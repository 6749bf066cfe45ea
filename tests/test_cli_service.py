"""The service's CLI commands on bad input: exit 2 and one line saying what is wrong."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from conftest import isolated_env, posbench_cli
from pydantic import ValidationError

from core.settings import Settings, describe_settings_error


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
        (["delete", "5", "--yes"], "error: no study with id 5"),
        (["delete", "0", "--yes"], "the study id must be a positive integer"),
        (["retry", "--run", "3"], "error: no run with id 3"),
        (["cancel"], "error: give a study id or --run ID"),
        (["retry", "1", "--run", "2"], "error: give a study id or --run ID"),
        (["status", "9"], "error: no study with id 9"),
        (["results", "--study", "9"], "error: no study with id 9"),
        (["results", "--study", "1", "--format", "xml"], "--format must be table, csv or json"),
        (["worker", "--queues", "tpu"], "unknown queue 'tpu' (allowed: gpu, cpu)"),
        (["submit", "--preset", "huge"], "unknown preset 'huge' (available: smoke, quick"),
        (["status", str(10**20)], "the study id must be a positive integer below 2^63"),
        (["cancel", "--run", str(10**20)], "--run must be a positive integer below 2^63"),
        (["results", "--study", str(10**20)], "--study must be a positive integer below 2^63"),
        (["results", "--study", "1", "--protocol", "bogus"], "--protocol must be one of"),
        (
            ["results", "--study", "1", "--view", "pairwise", "--factor", "nan"],
            "--factor must be a number from 0 to 131072, got nan",
        ),
        (
            ["results", "--study", "1", "--view", "pairwise", "--factor", "1e308"],
            "--factor must be a number from 0 to 131072, got 1e+308",
        ),
        (["dashboard", "--port", "70000"], "--port must be in 1..65535, got 70000"),
        (["up", "--port", "0"], "--port must be in 1..65535, got 0"),
        (["dashboard", "--address", "not a host!"], "--address 'not a host!' is not an address"),
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


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("POSBENCH_DATABASE_URL", "garbage", "POSBENCH_DATABASE_URL: must be an SQLAlchemy URL"),
        ("POSBENCH_BROKER_URL", "htp:/nonsense", "POSBENCH_BROKER_URL: must be a Redis URL"),
        ("POSBENCH_HEARTBEAT_SECONDS", "abc", "POSBENCH_HEARTBEAT_SECONDS = 'abc'"),
        ("POSBENCH_MAX_ATTEMPTS", "0", "POSBENCH_MAX_ATTEMPTS = '0'"),
        ("POSBENCH_STALE_AFTER_SECONDS", "1", "must be at least twice POSBENCH_HEARTBEAT"),
        ("POSBENCH_ARTIFACTS", "s3://bucket/ckpt", "must be a folder or a file:// URL"),
        ("POSBENCH_DEVICE", "tpu", "POSBENCH_DEVICE = 'tpu': must be cpu, cuda, cuda:N or mps"),
    ],
)
def test_bad_settings_exit_2_before_any_command_runs(
    tmp_path: Path, variable: str, value: str, message: str
) -> None:
    env = isolated_env(tmp_path, **{variable: value})
    for args in (["status"], ["submit", "--preset", "smoke"], ["db", "upgrade"]):
        done = posbench(env, *args)
        assert done.returncode == 2, done.stderr
        assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not any(tmp_path.iterdir())  # nothing written


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("POSBENCH_HANG_SECONDS", "inf", "POSBENCH_HANG_SECONDS = 'inf': Input should be less"),
        ("POSBENCH_RECONCILE_SECONDS", "1e12", "POSBENCH_RECONCILE_SECONDS = '1e12'"),
        ("POSBENCH_STALE_AFTER_SECONDS", "1e20", "POSBENCH_STALE_AFTER_SECONDS = '1e20'"),
        ("POSBENCH_HEARTBEAT_SECONDS", "nan", "POSBENCH_HEARTBEAT_SECONDS = 'nan'"),
        ("POSBENCH_VISIBILITY_TIMEOUT", "1", "greater than or equal to 3600"),
        ("POSBENCH_MAX_ATTEMPTS", "1000000", "less than or equal to 100"),
        ("POSBENCH_BROKER_URL", "redis://:pw@host:notaport/0", "has a port that is not a number"),
        ("POSBENCH_DATABASE_URL", "postgresql://u:p@h:notaport/db", "must be an SQLAlchemy URL"),
        ("POSBENCH_DATABASE_URL", "sqlite:///:memory:", "must name a database file"),
        ("POSBENCH_DATABASE_URL", "sqlite://", "must name a database file"),
        ("POSBENCH_ARTIFACTS", "file://", "must name a folder"),
    ],
)
def test_settings_out_of_range_are_named_with_what_is_allowed(
    monkeypatch, variable: str, value: str, message: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValidationError) as refused:
        Settings()
    described = describe_settings_error(refused.value)
    assert message in described and "\n" not in described
    assert ":pw@" not in described  # URLs are named, never echoed


def test_reading_commands_never_create_a_database(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/typo/dir/x.db"
    env = isolated_env(tmp_path / "home", POSBENCH_DATABASE_URL=url)
    done = posbench(env, "status")
    assert done.returncode == 1 and "no database at" in done.stderr
    assert not (tmp_path / "typo").exists()


def test_an_unreachable_database_is_one_line(tmp_path: Path) -> None:
    url = "postgresql://user:secret@127.0.0.1:1/nowhere"
    env = isolated_env(tmp_path, POSBENCH_DATABASE_URL=url)
    for args in (["status"], ["db", "upgrade"]):
        done = posbench(env, *args)
        assert done.returncode == 1
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert "Traceback" not in done.stderr and "secret" not in done.stderr


def test_an_empty_setting_means_unset(tmp_path: Path) -> None:
    # KEY= in an env file, ${X:-} in compose: the default, not an invalid value.
    env = isolated_env(
        tmp_path,
        POSBENCH_DEVICE="",
        POSBENCH_DATABASE_URL="",
        POSBENCH_BROKER_URL="",
        POSBENCH_DASHBOARD_PASSWORD="",
    )
    done = posbench(env, "db", "upgrade")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "posbench.db").is_file()
