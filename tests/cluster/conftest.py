"""The compose stack for real: the project's own Dockerfile and docker-compose.yml, in a
Docker engine, with two CPU workers (`make test-cluster`; not part of `make test`).

Under CI=true an engine that cannot be installed or started fails the test; elsewhere
it is skipped with the reason.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.cluster.engine import (
    DOCKER,
    POSTGRES_IMAGE,
    REDIS_IMAGE,
    ROOT,
    Engine,
    EngineUnavailable,
    build_arguments,
    build_standins,
    start_engine,
)

IN_CI = os.environ.get("CI") == "true"
IMAGE = "posbench-cluster-test:slim"
PROJECT = "posbench-cluster-test"
CPU_WORKERS = 2


@dataclass
class Stack:
    engine: Engine
    env_file: Path
    build_log: str

    def compose(
        self,
        *args: str,
        timeout: float = 600,
        check: bool = True,
        input: str | None = None,
        program: tuple[str, ...] = (DOCKER, "compose"),
        **env: str,
    ) -> subprocess.CompletedProcess:
        """``docker compose ARGS`` on the project's own compose file and the stack's .env
        (``program``: another compose; ``env``: more environment)."""
        command = [
            *program,
            "--project-name",
            PROJECT,
            "--env-file",
            str(self.env_file),
            "--file",
            str(ROOT / "docker-compose.yml"),
            *args,
        ]
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=timeout,
            input=input,
            env=self.engine.env(**env),
        )
        if check and done.returncode != 0:
            raise AssertionError(
                f"docker compose {' '.join(args)} exited {done.returncode}:\n"
                f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
            )
        return done

    def posbench(self, *args: str, **options) -> subprocess.CompletedProcess:
        """``posbench ARGS`` in the dashboard's container, as an operator would."""
        return self.compose("exec", "-T", "dashboard", "posbench", *args, **options)

    def sql(self, query: str) -> list[list[str]]:
        """Rows of ``query``, read with psql inside the PostgreSQL container."""
        done = self.compose(
            "exec",
            "-T",
            "postgres",
            "psql",
            "--username",
            "posbench",
            "--dbname",
            "posbench",
            "--no-align",
            "--tuples-only",
            "--field-separator",
            "\t",
            "--command",
            query,
        )
        return [line.split("\t") for line in done.stdout.splitlines() if line]

    def containers(self) -> list[dict]:
        """`docker compose ps` of every container, running or exited."""
        out = self.compose("ps", "--all", "--format", "json").stdout.strip()
        if out.startswith("["):
            return json.loads(out)
        return [json.loads(line) for line in out.splitlines() if line]


def wait_for(check, what: str, timeout: float, every: float = 1.0):
    """``check()``'s first truthy value within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"{what}: not within {timeout:.0f} s")


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    try:
        engine = start_engine()
    except EngineUnavailable as err:
        if IN_CI:
            pytest.fail(f"no Docker engine: {err}")
        pytest.skip(f"no Docker engine: {err}")
    env_file = Path(tempfile.mkdtemp(prefix="pb-cluster-")) / "cluster.env"
    # What an operator's .env holds: the passwords, the images (stand-ins for Docker
    # Hub's, and a tag of our own), and the build arguments of a closed network.
    settings = {
        "POSTGRES_PASSWORD": secrets.token_hex(16),
        "REDIS_PASSWORD": secrets.token_hex(16),
        "POSBENCH_DASHBOARD_PASSWORD": secrets.token_hex(16),
        "POSBENCH_REDIS_IMAGE": REDIS_IMAGE,
        "POSBENCH_POSTGRES_IMAGE": POSTGRES_IMAGE,
        "POSBENCH_IMAGE": IMAGE,
        "POSBENCH_WORKER_IMAGE": IMAGE,  # only created (docker-compose 1.29), never run
    }
    stack = None
    try:
        build_standins(engine)
        with build_arguments() as arguments:
            env_file.write_text("".join(f"{k}={v}\n" for k, v in {**settings, **arguments}.items()))
            env_file.chmod(0o600)
            stack = Stack(engine, env_file, build_log="")
            # The project's Dockerfile through the compose file's build section, by the
            # classic builder (what docker-compose 1.x uses too).
            built = stack.compose("build", "migrate", timeout=1500, DOCKER_BUILDKIT="0")
            stack.build_log = built.stdout + built.stderr
        # docs/cluster.md's CPU-only command, with a second CPU worker.
        stack.compose(
            "up",
            "--detach",
            "--no-build",
            "--scale",
            f"worker-cpu={CPU_WORKERS}",
            "--wait",
            "--wait-timeout",
            "300",
            timeout=400,
        )
        yield stack
    finally:
        if stack is not None:
            stack.compose("down", "--volumes", "--timeout", "30", check=False, timeout=300)
        engine.close()
