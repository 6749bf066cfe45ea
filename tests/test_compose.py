"""docker-compose.yml and the Dockerfile, checked without a Docker engine: the compose-spec
JSON schema, and the properties the cluster relies on."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import tomllib
import yaml
from compose_env import InterpolationError, interpolate, read_env_file

from jobs.settings import Settings
from worker.tasks import gpu_for_pool_process

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict[str, Any] = COMPOSE["services"]
LONG_RUNNING = [name for name, s in SERVICES.items() if s.get("restart") != "no"]


def check_against_the_compose_spec(path: Path) -> subprocess.CompletedProcess[str]:
    schema = ["--builtin-schema", "vendor.compose-spec"]
    return subprocess.run(
        [sys.executable, "-m", "check_jsonschema", *schema, str(path)],
        capture_output=True,
        text=True,
    )


def test_compose_file_validates_against_the_compose_spec_schema() -> None:
    done = check_against_the_compose_spec(ROOT / "docker-compose.yml")
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_schema_check_can_fail(tmp_path: Path) -> None:
    broken = {**COMPOSE, "services": {"redis": {**SERVICES["redis"], "healthcheck": {"tset": 1}}}}
    path = tmp_path / "compose.yml"
    path.write_text(yaml.safe_dump(broken))
    assert check_against_the_compose_spec(path).returncode != 0


def test_expected_services_and_profiles() -> None:
    assert {"redis", "postgres", "migrate", "dashboard", "worker", "worker-cpu", "flower"} <= set(
        SERVICES
    )
    assert SERVICES["worker-cpu"]["profiles"] == ["cpu"]
    assert SERVICES["flower"]["profiles"] == ["monitor"]
    assert "container_name" not in SERVICES["worker-cpu"]  # --scale worker-cpu=N must work


@pytest.mark.parametrize("name", ["worker", "worker-cpu"])
def test_workers_get_time_to_hand_their_runs_back(name: str) -> None:
    # docker stop's default 10 s grace is shorter than one long evaluation length.
    grace = SERVICES[name]["stop_grace_period"]
    assert grace.endswith("m") and int(grace[:-1]) >= 2


@pytest.mark.parametrize("name", LONG_RUNNING)
def test_every_long_running_service_has_a_healthcheck(name: str) -> None:
    check = SERVICES[name].get("healthcheck", {})
    assert check.get("test") and not check.get("disable")


def test_migration_is_one_shot_and_gates_the_others() -> None:
    assert SERVICES["migrate"]["restart"] == "no"
    assert SERVICES["migrate"]["command"] == ["db", "upgrade"]
    for name in ("dashboard", "worker", "worker-cpu"):
        needs = SERVICES[name]["depends_on"]
        assert needs["migrate"]["condition"] == "service_completed_successfully"
        assert needs["redis"]["condition"] == needs["postgres"]["condition"] == "service_healthy"


def test_broker_and_database_publish_no_port() -> None:
    assert "ports" not in SERVICES["redis"] and "ports" not in SERVICES["postgres"]
    assert SERVICES["dashboard"]["ports"] == ["127.0.0.1:8501:8501"]
    assert all(p.startswith("127.0.0.1:") for p in SERVICES["flower"]["ports"])


def test_redis_persists_and_never_evicts() -> None:
    command = SERVICES["redis"]["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert command[command.index("--maxmemory-policy") + 1] == "noeviction"
    assert "pg_isready -h 127.0.0.1" in SERVICES["postgres"]["healthcheck"]["test"][1]


def test_gpu_reservation_is_well_formed() -> None:
    devices = SERVICES["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert len(devices) == 1
    device = devices[0]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert ("count" in device) != ("device_ids" in device)  # exactly one of them
    count = re.sub(r"\$\{[A-Z_]+:-(\w+)\}", r"\1", str(device["count"]))
    assert count == "all" or int(count) >= 1
    # One pool process per reserved GPU.
    command = SERVICES["worker"]["command"]
    assert command[command.index("--concurrency") + 1] == str(device["count"])


def test_environment_variables_match_the_settings_object() -> None:
    fields = {f"POSBENCH_{name.upper()}" for name in Settings.model_fields}
    for name, service in SERVICES.items():
        environment = service.get("environment") or {}
        for key in environment:
            if key.startswith("POSBENCH_"):
                assert key in fields, f"{name}: {key} is not a setting"
    for line in (ROOT / ".env.example").read_text().splitlines():
        key = line.split("=", 1)[0]
        if key.startswith("POSBENCH_") and key != "POSBENCH_GPUS_PER_NODE":
            assert key in fields


def test_required_variables_are_in_env_example() -> None:
    text = (ROOT / "docker-compose.yml").read_text()
    required = set(re.findall(r"\$\{(\w+):\?", text))
    example = {
        line.split("=", 1)[0]
        for line in (ROOT / ".env.example").read_text().splitlines()
        if "=" in line and not line.startswith("#")
    }
    assert required and required <= example


def test_images_are_pinned_and_built_from_this_dockerfile() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    stages = set(re.findall(r"^FROM .+ AS (\S+)$", dockerfile, flags=re.MULTILINE))
    for name, service in SERVICES.items():
        build = service.get("build")
        if build:
            assert build["target"] in stages
        image = service["image"]
        if image.startswith("posbench:"):
            assert image.split(":")[1] in stages
        else:
            assert ":" in image and not image.endswith(":latest"), name
    assert re.search(r"^USER posbench$", dockerfile, flags=re.MULTILINE)
    assert '"posbench"' in dockerfile and ".venv" in (ROOT / ".dockerignore").read_text()


def test_the_images_copy_every_package_pip_installs() -> None:
    # `pip install .` inside an image sees only what the source stage copied.
    dockerfile = (ROOT / "Dockerfile").read_text()
    copied = set()
    for line in re.findall(r"^COPY (?!--from)(.+) /src/\S*$", dockerfile, flags=re.MULTILINE):
        copied.update(line.split())
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    assert {"pyproject.toml", pyproject["project"]["readme"]} <= copied
    assert {name.rstrip("*") for name in packages} <= copied
    for path in copied:
        assert (ROOT / path).exists(), path
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert not copied & set(ignored)
    # Each image takes the source stage whole.
    assert dockerfile.count("COPY --from=source /src/ ./") == 2
    # Workers of either image can read HuggingFace corpora (the paper preset's).
    assert dockerfile.count('pip install ".[hf]"') == 2


@pytest.mark.parametrize("name", ["migrate", "dashboard", "worker", "worker-cpu"])
def test_service_commands_are_real_posbench_commands(name: str) -> None:
    command = [
        part.replace("${POSBENCH_GPUS_PER_NODE:-1}", "1") for part in SERVICES[name]["command"]
    ]
    done = subprocess.run(
        [sys.executable, "-m", "jobs.cli", command[0], "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    for option in command[1:]:
        if option.startswith("--"):
            assert option in done.stdout, f"{name}: {option} is not an option of {command[0]}"


def test_healthcheck_module_reports_an_unreachable_service() -> None:
    env = {
        **os.environ,
        "POSBENCH_BROKER_URL": "redis://127.0.0.1:1/0",
        "POSBENCH_DATABASE_URL": "sqlite:////nonexistent/dir/x.db",
    }
    done = subprocess.run(
        [sys.executable, "-m", "jobs.healthcheck"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1 and "unhealthy" in done.stderr


def test_each_pool_process_gets_its_own_gpu() -> None:
    assert [gpu_for_pool_process(i, None) for i in range(3)] == ["0", "1", "2"]
    assert [gpu_for_pool_process(i, "4,5") for i in range(3)] == ["4", "5", "4"]


# -- finding 10 and the compose half of finding 1: passwords, published ports ---------------

REQUIRED = set(re.findall(r"\$\{(\w+):\?", (ROOT / "docker-compose.yml").read_text()))
SECRETS = {"POSTGRES_PASSWORD", "REDIS_PASSWORD", "POSBENCH_DASHBOARD_PASSWORD"}
STRONG = {name: f"{name.lower()}-0123456789abcdef" for name in SECRETS}


def rendered(env: dict[str, str]) -> dict[str, Any]:
    """docker-compose.yml as `docker compose config` would render it with ``env``."""
    return yaml.safe_load(interpolate((ROOT / "docker-compose.yml").read_text(), env))


def test_the_interpolation_rules_match_compose() -> None:
    assert interpolate("${A:-x}${B-y}$$C${D}", {"A": "", "B": ""}) == "x$C"
    assert interpolate("${B-y}", {}) == "y"
    with pytest.raises(InterpolationError):
        interpolate("${A:?set A}", {"A": ""})
    assert interpolate("${A?set A}", {"A": ""}) == ""
    with pytest.raises(InterpolationError):
        interpolate("${A?set A}", {})


def test_every_password_is_required() -> None:
    assert SECRETS <= REQUIRED


@pytest.mark.parametrize("name", sorted(SECRETS))
def test_compose_refuses_the_env_example_as_shipped(name: str) -> None:
    # Before: .env.example's POSTGRES_PASSWORD=change-me passed the `:?` check.
    example = read_env_file(ROOT / ".env.example")
    assert example[name] == "", f"{name} must ship empty"
    with pytest.raises(InterpolationError, match=name):
        rendered({**example, **{k: v for k, v in STRONG.items() if k != name}})


def test_compose_renders_once_every_password_is_set(tmp_path: Path) -> None:
    config = rendered({**read_env_file(ROOT / ".env.example"), **STRONG})
    path = tmp_path / "compose.yml"
    path.write_text(yaml.safe_dump(config))
    done = check_against_the_compose_spec(path)
    assert done.returncode == 0, done.stdout + done.stderr


def test_redis_requires_the_password_and_the_broker_url_carries_it() -> None:
    services = rendered({**read_env_file(ROOT / ".env.example"), **STRONG})["services"]
    password = STRONG["REDIS_PASSWORD"]
    redis = services["redis"]
    assert redis["command"][redis["command"].index("--requirepass") + 1] == password
    # The healthcheck authenticates (REDISCLI_AUTH) and fails on NOAUTH.
    assert redis["environment"]["REDISCLI_AUTH"] == password
    assert "grep -q PONG" in redis["healthcheck"]["test"][1]
    broker = f"redis://:{password}@redis:6379/0"
    for name in ("migrate", "dashboard", "worker", "worker-cpu"):
        assert services[name]["environment"]["POSBENCH_BROKER_URL"] == broker, name
    flower = services["flower"]
    assert flower["environment"]["CELERY_BROKER_URL"] == broker
    assert not any("redis://" in part for part in flower["command"])  # not in `ps`


def test_the_dashboard_is_on_loopback_and_requires_its_password() -> None:
    services = rendered({**read_env_file(ROOT / ".env.example"), **STRONG})["services"]
    dashboard = services["dashboard"]
    # Before: "8501:8501" (every interface) and a password defaulting to empty.
    assert dashboard["ports"] == ["127.0.0.1:8501:8501"]
    assert (
        dashboard["environment"]["POSBENCH_DASHBOARD_PASSWORD"]
        == (STRONG["POSBENCH_DASHBOARD_PASSWORD"])
    )
    command = dashboard["command"]
    assert command[command.index("--address") + 1] == "0.0.0.0"  # inside the container


def test_only_loopback_ports_are_published_and_never_redis_or_postgres() -> None:
    services = rendered({**read_env_file(ROOT / ".env.example"), **STRONG})["services"]
    for name, service in services.items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port}"
            assert str(port).rsplit(":", 1)[-1] not in {"6379", "5432"}, name


def test_env_is_ignored_by_git_and_the_example_is_not() -> None:
    def ignored(path: str) -> bool:
        done = subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT, check=False)
        return done.returncode == 0

    assert ignored(".env")
    assert not ignored(".env.example")


# Images whose registry gives a digest (Docker Hub's official images, as recorded in
# docker-library/repo-info): pinned by it. Flower is no official image: an exact tag.
BY_DIGEST = ("redis", "postgres")


def test_third_party_images_are_pinned_by_digest_or_an_exact_version() -> None:
    for name, service in SERVICES.items():
        image = service["image"]
        if image.startswith("posbench:"):
            continue
        reference, _, digest = image.partition("@")
        tag = reference.rsplit(":", 1)[1]
        assert re.match(r"\d+\.\d+(\.\d+)?(-\w+)?$", tag), name  # the version it pins
        if name in BY_DIGEST:
            assert re.fullmatch(r"sha256:[0-9a-f]{64}", digest), name
