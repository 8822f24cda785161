"""A real Prometheus server on 127.0.0.1 for tests: it scrapes given targets every second, and
``query`` asks its HTTP API. ``promtool`` checks an exposition. Both binaries come from PATH
(``make test`` installs Debian's ``prometheus`` package, or brew's, when they are missing).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Sequence

from paged_cache.testing.server import free_port

START_SECONDS = 60.0
SCRAPE_INTERVAL = "1s"


def binary(name: str) -> str:
    """Path of ``name`` (prometheus, promtool) on PATH; RuntimeError saying how to get it."""
    found = shutil.which(name)
    if found is None:
        raise RuntimeError(f"no {name} on PATH: run `make server` (apt-get install prometheus, "
                           "or brew install prometheus)")
    return found


def promtool_check(text: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    """``promtool check metrics`` of an exposition (its lint: names, HELP, units, types)."""
    return subprocess.run([binary("promtool"), "check", "metrics"], input=text,
                          capture_output=True, text=True, timeout=timeout)


class PrometheusServer:
    """One Prometheus process scraping ``targets`` (``host:port``) at ``/metrics`` every second,
    its data in a temporary directory; a context manager (stopped, then its directory removed)."""

    def __init__(self, targets: Sequence[str], job: str = "paged-cache") -> None:
        self.binary = binary("prometheus")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._dir = Path(tempfile.mkdtemp(prefix="paged-cache-prometheus-"))
        targets_json = json.dumps(list(targets))
        (self._dir / "prometheus.yml").write_text(
            f"global:\n  scrape_interval: {SCRAPE_INTERVAL}\n  evaluation_interval: "
            f"{SCRAPE_INTERVAL}\nscrape_configs:\n  - job_name: {job}\n    static_configs:\n"
            f"      - targets: {targets_json}\n")
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> "PrometheusServer":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> None:
        """Start it and wait until it is ready; RuntimeError (with its log) when it is not."""
        log = (self._dir / "prometheus.log").open("w")
        self.process = subprocess.Popen(
            [self.binary, f"--config.file={self._dir / 'prometheus.yml'}",
             f"--storage.tsdb.path={self._dir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                break
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"prometheus did not start: {self.log()[-2000:]}")

    def log(self) -> str:
        path = self._dir / "prometheus.log"
        return path.read_text() if path.exists() else ""

    def query(self, promql: str, at: float | None = None, timeout: float = 30.0) -> list[dict]:
        """The result of an instant query (``/api/v1/query``): the vector's or matrix's items
        (``metric``, ``value`` / ``values``); RuntimeError naming the query when it fails."""
        params = {"query": promql, **({"time": f"{at:.3f}"} if at is not None else {})}
        url = f"{self.url}/api/v1/query?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as reply:
                body = json.loads(reply.read())
        except OSError as error:
            raise RuntimeError(f"query {promql!r}: {error}") from error
        if body.get("status") != "success":
            raise RuntimeError(f"query {promql!r}: {body}")
        return body["data"]["result"]

    def targets_up(self) -> bool:
        """True when every target's last scrape succeeded."""
        return all(float(item["value"][1]) == 1 for item in self.query("up")) and bool(
            self.query("up"))

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL) and remove its directory."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)
        shutil.rmtree(self._dir, ignore_errors=True)
