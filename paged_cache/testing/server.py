"""A real valkey-server / redis-server on 127.0.0.1 for tests and benchmarks of the remote tier.

The binary comes from PATH (``make test`` installs one when it is missing); no persistence, a
free port, killed with SIGKILL and restarted on the same port when a test asks; with ``tls``
(testing/certs.py) it speaks TLS only, asking clients for a certificate when ``client_certs``.
"""

from __future__ import annotations

import shutil
import signal
import socket
import ssl
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
    "allkeys-lru"}; ``users``: ACL rules; ``tls``: a testing.certs.TLSCerts (TLS only, client
    certificates asked for when ``client_certs``)."""

    def __init__(self, *, tls: Any = None, client_certs: bool = False, users: tuple[str, ...] = (),
                 **settings: Any) -> None:
        self.binary = server_binary()
        self.port = free_port()
        self.tls, self.client_certs = tls, client_certs
        self.users = users  # ACL rules, e.g. "app on >pw ~paged-cache:* +@read"
        self.settings = {k.replace("_", "-"): str(v) for k, v in settings.items()}
        if tls is not None:
            self.settings.update({"tls-cert-file": str(tls.server), "tls-key-file": str(tls.server_key),
                                  "tls-ca-cert-file": str(tls.ca),
                                  "tls-auth-clients": "yes" if client_certs else "no"})
        self._dir = tempfile.mkdtemp(prefix="paged-cache-valkey-")
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    def start(self) -> "ValkeyServer":
        """Start the server (again) on ``port`` and wait until it answers PING."""
        ports = ["--port", "0", "--tls-port", str(self.port)] if self.tls else ["--port", str(self.port)]
        args = [self.binary, *ports, "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", self._dir, "--protected-mode", "yes"]
        for name, value in self.settings.items():
            args += [f"--{name}", value]
        for rule in self.users:
            args += ["--user", *rule.split()]
        log = open(Path(self._dir) / "server.log", "ab")
        self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                hint = (" (TLS asked for: the server must be built with TLS, as the Debian / "
                        "Homebrew packages `make server` installs are)") if self.tls else ""
                raise RuntimeError(f"{self.binary} exited with {self.process.returncode}{hint}: "
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
            with socket.create_connection(("127.0.0.1", self.port), timeout=1.0) as raw:
                s = raw if self.tls is None else self._tls_context().wrap_socket(
                    raw, server_hostname="127.0.0.1")
                s.sendall(b"*1\r\n$4\r\nPING\r\n")
                return s.recv(16).startswith((b"+PONG", b"-NOAUTH"))  # answering
        except OSError:
            return False

    def _tls_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.tls.ca))
        context.check_hostname = False  # whether it answers, whatever host its certificate names
        if self.client_certs:
            context.load_cert_chain(str(self.tls.client), str(self.tls.client_key))
        return context

    def client_options(self) -> dict[str, Any]:
        """Keyword arguments a valkey client of ``url`` needs (TLS files), for ``client``."""
        if self.tls is None:
            return {}
        out = dict(ssl_ca_certs=str(self.tls.ca))
        if self.client_certs:
            out.update(ssl_certfile=str(self.tls.client), ssl_keyfile=str(self.tls.client_key))
        return out

    def settles_within(self, limit: float, seconds: float = 5.0) -> int:
        """The server's used_memory once it is at most ``limit`` (the last one read after
        ``seconds``). A server with ``maxmemory`` evicts before it runs each command, INFO's too,
        and INFO counts memory it allocated for itself after that; on a loaded machine eviction
        may also run out of its time slice and finish on the server's timer: so a limit test
        allows a little over maxmemory, and a moment."""
        c = client(self.url, **self.client_options())
        deadline = time.monotonic() + seconds
        while (used := c.info("memory")["used_memory"]) > limit and time.monotonic() < deadline:
            time.sleep(0.05)
        return used

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


class ServerCluster:
    """A real Valkey / Redis Cluster of ``shards`` primaries on 127.0.0.1 (slots split evenly,
    no replicas); ``url`` names its first node, ``nodes`` are ValkeyServers."""

    def __init__(self, shards: int = 3, **settings: Any) -> None:
        self.nodes = [ValkeyServer(cluster_enabled="yes", cluster_port=free_port(),
                                   cluster_node_timeout=2000, **settings) for _ in range(shards)]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self) -> "ServerCluster":
        """Start every node, give each its slot range, join them, wait until the cluster is ok."""
        for node in self.nodes:
            node.start()
        step = -(-16384 // len(self.nodes))
        for i, node in enumerate(self.nodes):
            client(node.url).execute_command("CLUSTER", "ADDSLOTSRANGE", i * step,
                                             min((i + 1) * step, 16384) - 1)
        first = client(self.url)
        for node in self.nodes[1:]:
            first.execute_command("CLUSTER", "MEET", "127.0.0.1", node.port,
                                  node.settings["cluster-port"])
        deadline = time.monotonic() + START_SECONDS
        while not all(b"cluster_state:ok" in client(n.url).execute_command("CLUSTER", "INFO")
                      for n in self.nodes):
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the test cluster did not reach cluster_state:ok")
            time.sleep(0.1)
        return self

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> "ServerCluster":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def client(url: str, **options: Any) -> Any:
    """A valkey client of ``url`` for planting and reading values directly in tests
    (``options``: e.g. ``ValkeyServer.client_options()``)."""
    import valkey

    return valkey.Valkey.from_url(url, socket_timeout=5.0, **options)


__all__ = ["ServerCluster", "ValkeyServer", "client", "free_port", "server_binary"]
