"""Remote tier: blocks shared by several hosts on a Valkey or Redis server, below the SSD tier.

Values are block files (tiers/format.py: versioned, checksummed), sealed with a MAC under
``remote_secret`` (tiers/remote/mac.py); a damaged, truncated or foreign value, or one that does not fit
the reader's layout, is a counted miss, and with a secret a value without a valid tag is refused
(``rejected``) before it is decoded; without one, a sealed value is (``sealed_refused``). The
server keys are named in tiers/remote/client.py; a block key hashes the model fingerprint and the
prefix cache's namespace, so two models or namespaces never share a block entry.

Reads run on the caller thread in pipelines (one round trip for any number of keys;
tiers/remote/reads.py: read-ahead and child listings); writes are queued (bounded in bytes) for
one writer thread (tiers/remote/writer.py), so a caller never waits on the network to store.
Any network or server error starts an outage: one WARNING, then reads and writes are skipped
(counted) while the writer thread probes the server with growing back-off; the first answer ends
it (INFO). Capacity is the server's: ``maxmemory`` with ``allkeys-lru``, and ``remote_ttl``.
"""

from __future__ import annotations

import threading
import time
from typing import AbstractSet, Any, Callable, Sequence

from paged_cache.block import Block, check_key
from paged_cache.config import REMOTE_QUEUE_DEFAULT
from paged_cache.tiers import format as fmt
from paged_cache.tiers.base import Tier
from paged_cache.tiers.route import Route, routed
from paged_cache.tiers.remote.mac import Sealer
from paged_cache.tiers.remote.client import TLSFiles, client_module, connect, shown
from paged_cache.tiers.remote.reads import RemoteReads
from paged_cache.tiers.remote.writer import RemoteWriter
from paged_cache.tiers.write_queue import Write

_COUNTERS = ("hits", "misses", "damaged", "rejected", "sealed_refused", "errors", "skipped",
             "outages", "reads", "read_bytes", "read_seconds", "writes", "write_bytes",
             "bytes_written", "writes_existing", "write_drops", "write_errors", "discards")


class RemoteTier(RemoteReads, RemoteWriter, Tier):
    """Blocks on a Valkey / Redis server at ``url``: pipelined reads, a byte-bounded writer thread."""

    name = "remote"
    shared = True

    def __init__(self, url: str, *, timeout: float = 0.5, ttl: float = 0.0,
                 queue_max_bytes: int = REMOTE_QUEUE_DEFAULT, compression: str = "none",
                 cluster: bool = False, secret: str | None = None,
                 tls: TLSFiles | None = None) -> None:
        valkey = client_module()
        if tls is not None:
            tls.options()  # a TLS file that cannot be read: ValueError naming it, now
        RemoteWriter.__init__(self, queue_max_bytes)
        self.url = url
        self.tls = tls
        self._sealer = Sealer(secret) if secret else None  # remote_secret: values carry a MAC
        self.timeout = timeout
        self.cluster = cluster
        self.ttl = ttl
        self.compression = compression
        self._errors: tuple[type[BaseException], ...] = (
            valkey.ValkeyError, valkey.exceptions.ValkeyClusterException, OSError)
        self._client: Any = None                   # made on first use (see _connected)
        self._client_lock = threading.Lock()
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._counts["read_seconds"] = 0.0
        self._read_seconds_max = 0.0
        self._lock = threading.Lock()              # counters, plan, fetched, remembered
        self._init_reads()
        self._start_writer()

    # ---- round trips (caller thread) -------------------------------------------------------
    def _pipelined(self, build: Callable[[Any], list]) -> list | None:
        """Run the commands ``build`` queues on one pipeline (one round trip, caller thread);
        per-command server errors come back as exception objects; None during an outage."""
        if self._down:
            self._count("skipped")
            return None
        started = time.perf_counter()
        try:
            with self._connected().pipeline(transaction=False) as pipe:
                build(pipe)
                result = pipe.execute(raise_on_error=False)
        except self._errors as exc:
            self._outage(exc)
            return None
        finally:
            seconds = time.perf_counter() - started
            with self._lock:
                self._counts["reads"] += 1
                self._counts["read_seconds"] += seconds
                self._read_seconds_max = max(self._read_seconds_max, seconds)
        return result

    # ---- the tier interface (tiers/base.py) ------------------------------------------------
    def holds(self, keys: Sequence[str], *, listed: AbstractSet[str] = frozenset(),
              stop_at_miss: bool = False) -> list[str | None]:
        """"remote" for the keys the server holds now (``held``), else None. Only the manager's
        chain walk asks a shared tier, with the held part of a chain in order: their TTLs are
        renewed."""
        return [self.name if h else None for h in self.held(keys, chain=True)]

    def children(self, parents: Sequence[str], fingerprint: str,
                 route: Route | None = None) -> list[fmt.NodeRow]:
        """Node rows of the children the server lists under ``parents`` (``listed_children``),
        those ``route`` leads to (tiers/route.py: the listing holds every child)."""
        out = []
        for parent in parents:
            for key in self.listed_children(parent, fingerprint):
                meta = self.meta(key)
                if meta is not None:
                    out.append(fmt.node_row(key, meta))
        return routed(out, route)

    def read(self, key: str, *, in_place: bool = False,
             expect: fmt.Expected | None = None) -> tuple[Block, str] | None:
        """``(block, "remote")`` (``read_block``), or None."""
        block = self.read_block(key, expect)
        return None if block is None else (block, self.name)

    def write(self, block: Block, raw: fmt.RawTensors | None = None, *, now: bool = False,
              persisted: bool = False) -> bool:
        """Queue the block for the server (``enqueue``); with ``now``, wait until it was sent."""
        queued = self.enqueue(block.key, raw if raw is not None else fmt.raw_tensors(block),
                              block.meta)
        return queued and (not now or self.flush())

    # ---- writes (queued for the writer thread) ----------------------------------------------
    def enqueue(self, key: str, raw: fmt.RawTensors, meta: dict[str, str]) -> bool:
        """Queue a block for the server; False (counted) when the queue is full or the server
        unreachable. Never waits on the network."""
        check_key(key)
        return self._queue_write(Write(key, raw, dict(meta), fmt.check_raw(raw)))

    def discard(self, key: str) -> bool:
        """Queue the removal of ``key`` from the server (its child listing entry goes lazily);
        False: whether the server held it is not asked."""
        check_key(key)
        with self._lock:
            self._fetched.pop(key, None)
            self._present.pop(key, None)
            self._metas.pop(key, None)
            self._listings.clear()
        self._queue_write(Write(key, None, {}, 0))
        return False

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write was sent (or dropped); False if ``timeout`` ran out."""
        return self.drain(timeout)

    def close(self) -> None:
        """Send what is queued (unless the server is unreachable), stop the writer; idempotent."""
        with self._cond:
            if self._closed:
                return
        self.flush()
        self._stop_writer()
        with self._lock:
            self._fetched = {}
        if self._client is not None:
            self._client.close()

    def _connected(self) -> Any:
        """The client, made on first use (a cluster client connects when it is made)."""
        with self._client_lock:
            if self._client is None:
                self._client = connect(self.url, timeout=self.timeout, cluster=self.cluster,
                                       tls=self.tls)
            return self._client

    # ---- stats -------------------------------------------------------------------------------
    def _count(self, name: str, n: int | float = 1) -> None:
        with self._lock:
            self._counts[name] += n

    @property
    def available(self) -> bool:
        """False during an outage."""
        return not self._down

    # stats(): the levels; the rest are counters since open (url, a string, is not a number)
    STAT_GAUGES = frozenset({"read_seconds_max", "queue_bytes", "queue_blocks", "available",
                             "queue_max_bytes", "ttl"})

    def stats(self) -> dict[str, Any]:
        """Counters (hits, misses, damaged, errors, bytes read / written, read round trips and
        their seconds) and gauges (queue, availability, slowest read)."""
        with self._lock:
            out: dict[str, Any] = dict(self._counts)
            out["read_seconds_max"] = self._read_seconds_max
        out.update(self._queue_gauges(), available=not self._down,
                   queue_max_bytes=self.queue_max_bytes, ttl=self.ttl, url=shown(self.url),
                   writer_cpu_seconds=self.writer_cpu_seconds)
        return out
