"""A real valkey-server / redis-server on 127.0.0.1 for tests and benchmarks of the remote tier.

The binary comes from PATH (``make test`` installs one when it is missing); no persistence, a
free port, killed with SIGKILL and restarted on the same port when a test asks.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

SERVER_BINARIES = ("valkey-server", "redis-server")
START_SECONDS = 20.0


def server_binary() -> str:
    """Path of valkey-server or redis-server on PATH; RuntimeError saying how to get one."""
    for name in SERVER_BINARIES:
        found = shutil.which(name)
        if found:
            return found
    raise RuntimeError("no valkey-server or redis-server on PATH: run `make server` (apt-get or "
                       "brew install) or install one by hand")


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ValkeyServer:
    """One server process; ``url`` for clients, ``kill`` (SIGKILL), ``start`` again, ``stop``.
    ``settings``: extra config directives, e.g. {"maxmemory": "2mb", "maxmemory-policy":
    "allkeys-lru"}."""

    def __init__(self, **settings: Any) -> None:
        self.binary = server_binary()
        self.port = free_port()
        self.settings = {k.replace("_", "-"): str(v) for k, v in settings.items()}
        self._dir = tempfile.mkdtemp(prefix="paged-cache-valkey-")
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "ValkeyServer":
        """Start the server (again) on ``port`` and wait until it answers PING."""
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", self._dir, "--protected-mode", "yes"]
        for name, value in self.settings.items():
            args += [f"--{name}", value]
        log = open(Path(self._dir) / "server.log", "ab")
        self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.binary} exited with {self.process.returncode}: "
                                   f"{self.log_tail()}")
            if self.ping():
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"{self.binary} did not answer on port {self.port} within "
                           f"{START_SECONDS:.0f}s: {self.log_tail()}")

    def ping(self) -> bool:
        """True when the server answers a RESP PING (raw socket, no client library; a server
        with a password answers NOAUTH)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1.0) as s:
                s.sendall(b"*1\r\n$4\r\nPING\r\n")
                return s.recv(16).startswith((b"+PONG", b"-NOAUTH"))  # answering
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL the server and reap it (its data is gone: nothing is persisted)."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        """Kill the server and remove its directory."""
        self.kill()
        shutil.rmtree(self._dir, ignore_errors=True)

    def log_tail(self) -> str:
        try:
            return (Path(self._dir) / "server.log").read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def __enter__(self) -> "ValkeyServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def client(url: str) -> Any:
    """A valkey client of ``url`` for planting and reading values directly in tests."""
    import valkey

    return valkey.Valkey.from_url(url, socket_timeout=5.0)


__all__ = ["ValkeyServer", "client", "free_port", "server_binary"]
