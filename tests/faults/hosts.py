"""Hosts of their own for the fault suite: Linux network namespaces joined by veth pairs.

A star: the ``core`` host (Redis and PostgreSQL) in the middle, joined to each worker host
and to this process' namespace (the driver: the CLI, the checks) by a veth pair of its
own, each a /24 of 10.213.70-79.0 (private, and nothing else on this machine uses it).
Traffic goes only between these namespaces; nothing is routed out. Cutting a worker
host's link (``cut``) sets its veth end on the core down: the host keeps its processes
and its TCP connections, but nothing reaches the core until ``mend``, as when a cable
or a switch port fails.

Everything here needs root (``ip netns``); ``Net.create`` removes what an earlier,
interrupted run left, and ``Net.destroy`` kills every process of the namespaces and
removes them.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

PREFIX = "pbf"
DRIVER_NET = 70  # 10.213.70.0/24: the driver's link; worker host i: 10.213.(70 + i).0/24


def ip(*args: str) -> str:
    return subprocess.run(["ip", *args], check=True, capture_output=True, text=True).stdout


def available() -> str | None:
    """Why this machine cannot make hosts of their own, or None when it can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (ip) is not installed"
    try:
        ip("netns", "list")
    except (OSError, subprocess.CalledProcessError) as err:
        return f"ip netns does not work here: {err}"
    return None


class Net:
    """The namespaces ``core`` and ``workers`` (names), joined as a star."""

    def __init__(self, workers: Sequence[str]) -> None:
        self.workers = list(workers)

    def ns(self, host: str) -> str:
        return f"{PREFIX}-{host}"

    def subnet(self, host: str) -> int:
        return DRIVER_NET if host == "driver" else DRIVER_NET + 1 + self.workers.index(host)

    def core_address(self, seen_from: str) -> str:
        """The core's address on the link to ``seen_from`` (a worker host, or "driver")."""
        return f"10.213.{self.subnet(seen_from)}.1"

    def address(self, host: str) -> str:
        """A worker host's (or the driver's) own address, as the core sees its packets."""
        return f"10.213.{self.subnet(host)}.2"

    def create(self) -> None:
        self.destroy()
        for host in ["core", *self.workers]:
            ip("netns", "add", self.ns(host))
            ip("-n", self.ns(host), "link", "set", "lo", "up")
        core = self.ns("core")
        # The driver's link: its end stays in this namespace.
        ip("link", "add", f"{PREFIX}-driver", "type", "veth", "peer", "name", "drv", "netns", core)
        ip("addr", "add", f"{self.address('driver')}/24", "dev", f"{PREFIX}-driver")
        ip("link", "set", f"{PREFIX}-driver", "up")
        ip("-n", core, "addr", "add", f"{self.core_address('driver')}/24", "dev", "drv")
        ip("-n", core, "link", "set", "drv", "up")
        for host in self.workers:
            ip(
                "link", "add", f"{PREFIX}-{host}", "netns", core, "type", "veth",
                "peer", "name", "eth0", "netns", self.ns(host),
            )  # fmt: skip
            self._join(host)

    def _join(self, host: str) -> None:
        core, end = self.ns("core"), f"{PREFIX}-{host}"
        ip("-n", core, "link", "set", end, "up")
        ip("-n", core, "addr", "add", f"{self.core_address(host)}/24", "dev", end)
        ip("-n", self.ns(host), "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
        ip("-n", self.ns(host), "link", "set", "eth0", "up")

    def destroy(self) -> None:
        for line in ip("netns", "list").splitlines():
            name = line.split()[0] if line.strip() else ""
            if name.startswith(f"{PREFIX}-"):
                self._kill(name)
                with contextlib.suppress(subprocess.CalledProcessError):
                    ip("netns", "del", name)
        with contextlib.suppress(subprocess.CalledProcessError):
            ip("link", "del", f"{PREFIX}-driver")

    # --- faults ---------------------------------------------------------------------

    def cut(self, host: str) -> None:
        """Take ``host``'s link down at the core's end (its packets go nowhere)."""
        ip("-n", self.ns("core"), "link", "set", f"{PREFIX}-{host}", "down")

    def mend(self, host: str) -> None:
        ip("-n", self.ns("core"), "link", "set", f"{PREFIX}-{host}", "up")

    def pids(self, host: str) -> list[int]:
        return [int(p) for p in ip("netns", "pids", self.ns(host)).split()]

    def kill_host(self, host: str) -> list[int]:
        """SIGKILL every process of ``host`` (a machine that loses its power)."""
        return self._kill(self.ns(host))

    def _kill(self, ns: str) -> list[int]:
        try:
            pids = [int(p) for p in ip("netns", "pids", ns).split()]
        except subprocess.CalledProcessError:
            return []
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return pids

    # --- processes ------------------------------------------------------------------

    def spawn(
        self,
        host: str,
        argv: Sequence[str],
        *,
        env: dict[str, str],
        log: Path,
        user: str | None = None,
        cwd: Path | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` on ``host`` (as ``user``: a name), its output appended to ``log``."""
        prefix = ["ip", "netns", "exec", self.ns(host)]
        if user is not None:
            entry = pwd.getpwnam(user)
            prefix += ["setpriv", f"--reuid={entry.pw_uid}", f"--regid={entry.pw_gid}"]
            prefix += ["--init-groups"]
        output = open(log, "ab")  # noqa: SIM115 - the child owns it
        try:
            return subprocess.Popen(
                [*prefix, *argv],
                env=env,
                cwd=cwd,
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            output.close()


def wait_until(check, timeout: float, what: str, every: float = 0.2):
    """``check()``'s first true value within ``timeout`` seconds; TimeoutError otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = check()
        except Exception:  # not there yet (a refused connection)
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:g} s")
        time.sleep(every)
