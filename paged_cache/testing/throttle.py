"""A TCP proxy on 127.0.0.1 that slows what a server sends back: a slow link to a real server
(the tests and benchmarks of the fetch plan).

``ThrottledProxy(port, rate)`` listens on a free port and forwards every connection to
``127.0.0.1:port``; the bytes coming back are paced to ``rate`` bytes/s over all connections
together (one link), the requests pass at once. ``rate`` can be changed while it runs (0: no
limit), as a link that recovers. Threads only; ``close`` stops it and every connection.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

from paged_cache.testing.server import free_port

CHUNK = 16 << 10  # bytes sent back at a time (the pacing's granularity)


class ThrottledProxy:
    """See module doc. ``url``: a redis:// URL through the proxy; ``sent``: bytes sent back."""

    def __init__(self, port: int, rate: float) -> None:
        self.target, self.rate, self.sent = port, rate, 0
        self.port = free_port()
        self._lock = threading.Lock()
        self._free_at = 0.0  # when the link has sent what it was given
        self._socks: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._closed = False
        threading.Thread(target=self._accept, name="throttle-accept", daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._socks += [client, server]
            for src, dst, paced in ((client, server, False), (server, client, True)):
                threading.Thread(target=self._pump, args=(src, dst, paced), daemon=True,
                                 name="throttle-pump").start()

    def _pump(self, src: socket.socket, dst: socket.socket, paced: bool) -> None:
        """Copy ``src`` to ``dst`` until either closes; ``paced``: at ``rate`` bytes/s."""
        try:
            while True:
                data = src.recv(CHUNK)
                if not data:
                    break
                if paced:
                    self._wait(len(data))
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _wait(self, nbytes: int) -> None:
        """Sleep until the link has room for ``nbytes`` more (every connection shares it)."""
        with self._lock:
            self.sent += nbytes
            if not self.rate:
                return
            now = time.monotonic()
            self._free_at = max(now, self._free_at) + nbytes / self.rate
            until = self._free_at
        time.sleep(max(0.0, until - time.monotonic()))

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        with self._lock:
            socks, self._socks = self._socks, []
        for s in socks:
            s.close()

    def __enter__(self) -> "ThrottledProxy":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
