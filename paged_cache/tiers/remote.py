"""Remote tier: blocks shared by several hosts on a Valkey or Redis server, below the SSD tier.

Values are block files (tiers/format.py: versioned, checksummed); a damaged, truncated or foreign
value is a counted miss. Server keys (every part checked: block keys and fingerprints are 64 hex
characters) are ``paged-cache:<format version>:b:<block key>`` for a block and
``paged-cache:<format version>:c:<fingerprint>:<parent key | root>`` for the hash of a parent's
children (field: child key, value: the child's meta minus its layer descriptors). A block key
hashes the model fingerprint and the prefix cache's namespace, so two models or namespaces never
share a block entry.

Reads run on the caller thread in pipelines (one round trip for any number of keys); writes are
queued (bounded in bytes) for one writer thread, so a caller never waits on the network to store.
Any network or server error starts an outage: one WARNING, then reads and writes are skipped
(counted) while the writer thread probes the server with growing back-off; the first answer ends
it (INFO). Capacity is the server's: ``maxmemory`` with ``allkeys-lru``, and ``remote_ttl``.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from paged_cache.block import Block, check_key, is_key
from paged_cache.config import REMOTE_PASSWORD_ENV, RemoteURL
from paged_cache.tiers import format as fmt

log = logging.getLogger("paged_cache.remote")

KEY_PREFIX = f"paged-cache:{fmt.FORMAT_VERSION}"
ROOT_NAME = "root"             # the child hash name part of a chain's first blocks
READ_AHEAD_BLOCKS = 32         # at most this many blocks of a planned chain per read round trip
READ_AHEAD_BYTES = 64 << 20    # ... and at most this many value bytes (beyond the first block)
MAX_LISTINGS = 1024            # child hashes of a planned chain read in one round trip
WRITE_BATCH_BLOCKS = 16        # queued blocks the writer sends per pipeline ...
WRITE_BATCH_BYTES = 64 << 20   # ... within this many raw bytes (beyond the first block)
PRESENT_SECONDS = 2.0          # how long a key seen on the server counts as held without asking
MAX_REMEMBERED = 1 << 14       # bound of the remembered child metas and present keys
BACKOFF_FIRST, BACKOFF_MAX = 0.25, 30.0  # seconds between reconnection probes (doubling)
MAX_VALUE_BYTES = 1 << 31      # a value larger than this is not decoded (counted damaged)
SUMMARY_SCAN_LIMIT = 1_000_000  # keys `inspect` counts at most
_COUNTERS = ("hits", "misses", "damaged", "errors", "skipped", "outages", "reads", "read_bytes",
             "read_seconds", "writes", "write_bytes", "writes_existing", "write_drops",
             "write_errors", "discards")


def block_name(key: str) -> str:
    """Server key of a block's value."""
    return f"{KEY_PREFIX}:b:{check_key(key)}"


def children_name(parent: str, fingerprint: str) -> str:
    """Server key of the hash listing the children of ``parent`` ("" = a chain's first blocks)."""
    if not is_key(fingerprint):
        raise ValueError(f"fingerprint: expected 64 lower-case hex characters, got {fingerprint!r:.80}")
    return f"{KEY_PREFIX}:c:{fingerprint}:{check_key(parent) if parent else ROOT_NAME}"


def child_entry(meta: dict[str, str]) -> str:
    """The child hash value of a block: its meta without the layer descriptors (JSON)."""
    return json.dumps({k: v for k, v in meta.items() if k != fmt.META_LAYERS},
                      sort_keys=True, separators=(",", ":"))


def parse_child_entry(value: Any) -> dict[str, str] | None:
    """A child hash value as meta (str -> str), or None when it is not one."""
    try:
        meta = json.loads(bytes(value).decode("utf-8"))
    except (TypeError, ValueError):
        return None
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                             for k, v in meta.items()):
        return None
    return meta


@dataclass
class _Write:
    key: str
    raw: fmt.RawTensors | None  # None: a discard
    meta: dict[str, str]
    nbytes: int


def _client_module() -> Any:
    try:
        import valkey
    except ImportError as exc:
        raise ImportError("remote_url: the remote tier needs the valkey client; install it with "
                          "pip install 'paged-cache[remote]'") from exc
    return valkey


def connect(url: str, *, timeout: float, cluster: bool = False) -> Any:
    """A client of ``url`` (a cluster client when ``cluster``: it connects to discover the
    shards, so it may raise the client's errors). No client-side retry: a failure is reported at
    once (the tier starts an outage and probes). The password comes from the URL or, without
    one there, from REMOTE_PASSWORD_ENV."""
    valkey = _client_module()
    from valkey.backoff import NoBackoff
    from valkey.retry import Retry

    password = None if "@" in url.partition("://")[2] else os.environ.get(REMOTE_PASSWORD_ENV)
    options = dict(password=password, socket_timeout=timeout, socket_connect_timeout=timeout,
                   retry=Retry(NoBackoff(), 0), client_name="paged-cache")
    if cluster:
        from valkey.cluster import ValkeyCluster

        return ValkeyCluster.from_url(url, cluster_error_retry_attempts=1, **options)
    return valkey.Valkey.from_url(url, health_check_interval=0, **options)


class RemoteTier:
    """Blocks on a Valkey / Redis server at ``url``: pipelined reads, a byte-bounded writer thread."""

    def __init__(self, url: str, *, timeout: float = 0.5, ttl: float = 0.0,
                 queue_max_bytes: int = 64 << 20, compression: str = "none",
                 cluster: bool = False) -> None:
        valkey = _client_module()
        self.url = url
        self.timeout = timeout
        self.cluster = cluster
        self.ttl = ttl
        self.queue_max_bytes = queue_max_bytes
        self.compression = compression
        self._errors: tuple[type[BaseException], ...] = (
            valkey.ValkeyError, valkey.exceptions.ValkeyClusterException, OSError)
        self._client: Any = None                   # made on first use (see _connected)
        self._client_lock = threading.Lock()
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._counts["read_seconds"] = 0.0
        self._read_seconds_max = 0.0
        self._lock = threading.Lock()              # counters, plan, fetched, remembered
        self._plan: dict[str, int] = {}            # chain keys found on the server, in order
        self._plan_keys: list[str] = []
        self._chain: list[str] = []
        self._fetched: dict[str, Block] = {}       # read ahead, not yet asked for
        self._metas: OrderedDict[str, dict[str, str]] = OrderedDict()  # from child listings
        self._present: OrderedDict[str, tuple[float, int]] = OrderedDict()  # key -> (seen, bytes)
        self._listings: OrderedDict[str, tuple[float, list[str]]] = OrderedDict()  # name -> (at, keys)
        self._cond = threading.Condition()
        self._queue: deque[_Write] = deque()
        self._queued: set[str] = set()
        self._queue_bytes = 0
        self._sending = 0
        self._down = False
        self._write_failing = False
        self._backoff = BACKOFF_FIRST
        self._next_probe = 0.0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="paged-cache-remote-writer",
                                        daemon=True)
        self._thread.start()

    # ---- reads (caller thread) -------------------------------------------------------------
    def held(self, keys: Sequence[str]) -> list[bool]:
        """Which ``keys`` the server holds now: one pipelined round trip of STRLEN (none for keys
        seen in the last PRESENT_SECONDS); their sizes size the read-ahead. All False while the
        server is unreachable."""
        now = time.monotonic()
        with self._lock:
            out = [now - self._present.get(k, (-PRESENT_SECONDS, 0))[0] < PRESENT_SECONDS
                   for k in keys]
        ask = [k for k, seen in zip(keys, out) if not seen]
        if not ask:
            return out
        answers = self._pipelined(lambda p: [p.strlen(block_name(k)) for k in ask])
        if answers is None:
            return out
        found = {k: n for k, n in zip(ask, answers) if isinstance(n, int) and n > 0}
        self._remember_present(found)
        return [seen or k in found for k, seen in zip(keys, out)]

    def plan(self, chain: Sequence[str], on_server: Sequence[str]) -> None:
        """Record a fetch's chain (the keys held somewhere, in order) and which of them only the
        server holds: ``read`` then fetches up to READ_AHEAD_BLOCKS / READ_AHEAD_BYTES of those
        per round trip, and
        the first ``children`` call lists the children of the whole chain in one. Drops older
        read-ahead."""
        with self._lock:
            self._chain = list(chain)
            self._plan_keys = list(on_server)
            self._plan = {k: i for i, k in enumerate(self._plan_keys)}
            self._fetched = {}

    def read(self, key: str) -> Block | None:
        """The verified block for ``key`` (a read-ahead hit or one pipelined round trip that also
        reads the planned keys after it), or None: a miss, damage (counted) or an outage."""
        check_key(key)
        with self._lock:
            block = self._fetched.pop(key, None)
            if block is not None:
                self._counts["hits"] += 1
                return block
            i = self._plan.get(key)
            batch = [key] if i is None else self._read_ahead(i)
        values = self._pipelined(lambda p: [p.get(block_name(k)) for k in batch])
        if values is None:
            return None
        found: dict[str, Block] = {}
        for j, k in enumerate(batch):
            block = self._decode(k, values[j])
            values[j] = None  # one value's bytes at a time beside the decoded blocks
            if block is not None:
                found[k] = block
        block = found.pop(key, None)
        with self._lock:
            self._counts["hits" if block is not None else "misses"] += 1
            if self._plan.get(key) == i and i is not None:
                self._fetched.update(found)
        return block

    def _read_ahead(self, i: int) -> list[str]:
        """Planned keys from position ``i`` within READ_AHEAD_BLOCKS and READ_AHEAD_BYTES (by
        the sizes ``held`` saw; at least one key). Caller holds the lock."""
        batch, total = [self._plan_keys[i]], 0
        for key in self._plan_keys[i + 1:i + READ_AHEAD_BLOCKS]:
            total += self._present.get(key, (0.0, READ_AHEAD_BYTES))[1]
            if total > READ_AHEAD_BYTES:
                break
            batch.append(key)
        return batch

    def children(self, parent: str, fingerprint: str) -> list[str]:
        """Keys the server lists as children of ``parent`` for ``fingerprint`` and still holds;
        their metas are remembered for ``meta``. Two round trips list ``parent`` and every block of
        the planned chain not listed in the last PRESENT_SECONDS. [] during an outage."""
        name = children_name(parent, fingerprint)
        keys = self._listed(name)
        if keys is None:
            with self._lock:
                chain = [k for k in self._chain if k != parent][:MAX_LISTINGS]
            parents = [parent] + [k for k in chain
                                  if self._listed(children_name(k, fingerprint)) is None]
            self._list([children_name(k, fingerprint) for k in parents])
            keys = self._listed(name)
        return list(keys or [])

    def _listed(self, name: str) -> list[str] | None:
        with self._lock:
            at, keys = self._listings.get(name, (-PRESENT_SECONDS, []))
        return keys if time.monotonic() - at < PRESENT_SECONDS else None

    def _list(self, names: list[str]) -> None:
        """Read the child hashes ``names`` (one round trip), keep the children the server still
        holds (one more) and unlist the others (evicted by the server)."""
        listed = self._pipelined(lambda p: [p.hgetall(n) for n in names])
        if listed is None:
            return
        entries: dict[str, dict[str, dict[str, str]]] = {}
        for name, fields in zip(names, listed):
            entries[name] = {}
            if not isinstance(fields, dict):  # e.g. WRONGTYPE: something else planted there
                self._count("damaged")
                continue
            for field, value in fields.items():
                key = field.decode("ascii", "replace") if isinstance(field, bytes) else ""
                meta = parse_child_entry(value)
                if is_key(key) and meta is not None:
                    entries[name][key] = meta
                else:
                    self._count("damaged")
        every = list({k for children in entries.values() for k in children})
        present = dict(zip(every, self.held(every)))
        gone = {n: [k for k in children if not present[k]] for n, children in entries.items()}
        if any(gone.values()) and not self._down:
            self._pipelined(lambda p: [p.hdel(n, *keys) for n, keys in gone.items() if keys])
        now = time.monotonic()
        with self._lock:
            for name, children in entries.items():
                keys = [k for k in children if present[k]]
                for key in keys:
                    self._metas[key] = children[key]
                    self._metas.move_to_end(key)
                self._listings[name] = (now, keys)
                self._listings.move_to_end(name)
            for remembered in (self._metas, self._listings):
                while len(remembered) > MAX_REMEMBERED:
                    remembered.popitem(last=False)

    def meta(self, key: str) -> dict[str, str] | None:
        """The meta of a child seen in a listing (no round trip), or None."""
        with self._lock:
            meta = self._metas.get(key)
        return None if meta is None else dict(meta)

    def _decode(self, key: str, value: Any) -> Block | None:
        if value is None:
            return None
        if isinstance(value, BaseException) or not isinstance(value, bytes) \
                or len(value) > MAX_VALUE_BYTES:
            reason = str(value) if isinstance(value, BaseException) else "not a string value"
        else:
            self._count("read_bytes", len(value))
            try:
                arrays, meta = fmt.decode(value, key, max_bytes=255 * len(value) + (1 << 16))
                return Block(key, arrays, meta)
            except ValueError as exc:
                reason = str(exc)
        self._count("damaged")
        log.debug("remote block %s: damaged value treated as a miss (%s)", key[:16], reason)
        return None

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

    def _remember_present(self, sizes: dict[str, int]) -> None:
        """Record keys seen on the server now, with their value sizes."""
        now = time.monotonic()
        with self._lock:
            for key, size in sizes.items():
                self._present[key] = (now, size)
                self._present.move_to_end(key)
            while len(self._present) > MAX_REMEMBERED:
                self._present.popitem(last=False)

    # ---- writes (queued for the writer thread) ----------------------------------------------
    def enqueue(self, key: str, raw: fmt.RawTensors, meta: dict[str, str]) -> bool:
        """Queue a block for the server; False (counted) when the queue is full or the server
        unreachable. Never waits on the network."""
        check_key(key)
        return self._queue_write(_Write(key, raw, dict(meta), fmt.check_raw(raw)))

    def discard(self, key: str) -> None:
        """Queue the removal of ``key`` from the server (its child listing entry goes lazily)."""
        check_key(key)
        with self._lock:
            self._fetched.pop(key, None)
            self._present.pop(key, None)
            self._metas.pop(key, None)
            self._listings.clear()
        self._queue_write(_Write(key, None, {}, 0))

    def _queue_write(self, item: _Write) -> bool:
        with self._cond:
            if self._closed:
                raise RuntimeError("RemoteTier is closed")
            if item.raw is not None and item.key in self._queued:
                return True
            if self._down or self._queue_bytes + item.nbytes > self.queue_max_bytes:
                self._count("write_drops")
                return False
            self._queue.append(item)
            self._queued.add(item.key)
            self._queue_bytes += item.nbytes
            self._cond.notify_all()
            return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write was sent (or dropped); False if ``timeout`` ran out."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queue or self._sending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self) -> None:
        """Send what is queued (unless the server is unreachable), stop the writer; idempotent."""
        with self._cond:
            if self._closed:
                return
        self.flush()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()
        with self._lock:
            self._fetched = {}
        if self._client is not None:
            self._client.close()

    def _connected(self) -> Any:
        """The client, made on first use (a cluster client connects when it is made)."""
        with self._client_lock:
            if self._client is None:
                self._client = connect(self.url, timeout=self.timeout, cluster=self.cluster)
            return self._client

    # ---- writer thread -------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (self._down or not self._queue):
                    wait = max(self._next_probe - time.monotonic(), 0.0) if self._down else None
                    if self._down and wait == 0.0:
                        break
                    self._cond.wait(wait)
                if self._closed and (self._down or not self._queue):
                    return
                batch: list[_Write] = []
                if not self._down:
                    total = 0
                    while self._queue and len(batch) < WRITE_BATCH_BLOCKS and (
                            not batch or total + self._queue[0].nbytes <= WRITE_BATCH_BYTES):
                        total += self._queue[0].nbytes
                        batch.append(self._queue.popleft())
                    self._sending = len(batch)
            if not batch:
                self._probe()
                continue
            try:
                self._send(batch)
            except self._errors as exc:
                self._count("write_errors", len(batch))
                self._outage(exc)
            with self._cond:
                for item in batch:
                    self._queued.discard(item.key)
                    self._queue_bytes -= item.nbytes
                self._sending = 0
                self._cond.notify_all()
            batch = []  # the wait above must not pin the last batch's arrays

    def _send(self, batch: list[_Write]) -> None:
        """Send a batch: two pipelines (which blocks the server has, then the new ones with
        their listing entries); a discard in the batch wins over a put of the same key."""
        discarded = {w.key for w in batch if w.raw is None}
        puts = [w for w in batch if w.raw is not None and w.key not in discarded]
        with self._connected().pipeline(transaction=False) as pipe:
            for w in puts:
                pipe.strlen(block_name(w.key))
            for w in batch:
                if w.raw is None:
                    pipe.delete(block_name(w.key))
            sizes = pipe.execute()[:len(puts)]
        self._count("discards", len(discarded))
        px = int(self.ttl * 1000) or None
        sent = new = 0
        with self._connected().pipeline(transaction=False) as pipe:
            for j, w in enumerate(puts):
                if sizes[j]:
                    self._count("writes_existing")
                    if px:
                        pipe.pexpire(block_name(w.key), px)
                else:
                    chunks = fmt.encode(w.key, w.raw, w.meta, self.compression).chunks
                    value = b"".join(fmt.byte_view(c) for c in chunks)
                    pipe.set(block_name(w.key), value, nx=True, px=px)
                    sizes[j] = len(value)
                    sent += len(value)
                    new += 1
                listing = _listing(w.meta)
                if listing is not None:  # a block of a prefix cache chain: list it under its parent
                    pipe.hset(listing, w.key, child_entry(w.meta))
                    if px:
                        pipe.pexpire(listing, px)
            results = pipe.execute(raise_on_error=False)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:  # e.g. OOM under maxmemory with noeviction: the server is full
            self._count("write_errors", len(failed))
            if not self._write_failing:
                self._write_failing = True
                log.warning("remote writes failing (%s); further failures are counted, not logged, "
                            "until a write succeeds", failed[0])
            return
        if self._write_failing:
            self._write_failing = False
            log.info("remote writes resumed")
        self._count("writes", new)
        self._count("write_bytes", sent)
        self._remember_present({w.key: size for w, size in zip(puts, sizes)})

    def _outage(self, exc: BaseException) -> None:
        """Start (or continue) an outage: count the error, WARNING once, probe with back-off."""
        self._count("errors")
        with self._cond:
            if self._down:
                return
            self._down = True
            self._backoff = BACKOFF_FIRST
            self._next_probe = time.monotonic() + self._backoff
            dropped = len(self._queue)
            self._count("write_drops", dropped)
            for item in self._queue:
                self._queued.discard(item.key)
                self._queue_bytes -= item.nbytes
            self._queue.clear()
            self._cond.notify_all()
        self._count("outages")
        with self._lock:
            self._fetched, self._present, self._listings = {}, OrderedDict(), OrderedDict()
        log.warning("remote tier %s unreachable (%s): serving from the local tiers, retrying in "
                    "the background", _shown(self.url), exc)

    def _probe(self) -> None:
        """One reconnection attempt (writer thread); ends the outage on an answer."""
        try:
            self._connected().ping()
        except self._errors:
            with self._cond:
                self._backoff = min(self._backoff * 2, BACKOFF_MAX)
                self._next_probe = time.monotonic() + self._backoff
            return
        with self._cond:
            self._down = False
            self._cond.notify_all()
        log.info("remote tier %s reachable again", _shown(self.url))

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
        with self._cond:
            out.update(queue_bytes=self._queue_bytes, queue_blocks=len(self._queue),
                       available=not self._down, queue_max_bytes=self.queue_max_bytes,
                       ttl=self.ttl, url=_shown(self.url))
        return out


def server_summary(url: str, timeout: float = 2.0, cluster: bool = False) -> dict[str, Any]:
    """What the server at ``url`` holds and how it evicts (``paged-cache inspect --remote-url``):
    paged-cache's block and listing keys (a bounded SCAN), memory, maxmemory and its policy,
    evictions, expiries (a cluster's primaries added up). OSError when the server does not answer
    (or refuses us)."""
    valkey = _client_module()
    db = None
    try:
        db = connect(url, timeout=timeout, cluster=cluster)
        return _summary(db, url, valkey.ResponseError, cluster)
    except (valkey.ValkeyError, valkey.exceptions.ValkeyClusterException, OSError) as exc:
        raise OSError(str(exc)) from exc
    finally:
        if db is not None:
            db.close()


def _summary(db: Any, url: str, response_error: type[BaseException],
             cluster: bool) -> dict[str, Any]:
    """The summary of ``server_summary`` read through an open client ``db``."""
    info = db.info(target_nodes=db.PRIMARIES) if cluster else db.info()
    if cluster:  # {node: info}: add the counts up
        nodes = list(info.values())
        info = dict(nodes[0])
        for name in ("used_memory", "maxmemory", "evicted_keys", "expired_keys"):
            info[name] = sum(node.get(name) or 0 for node in nodes)
    counts = {b"b": 0, b"c": 0}  # block values, child listings
    scanned = 0
    for name in db.scan_iter(match=f"{KEY_PREFIX}:*", count=1000):
        kind = bytes(name).split(b":")[2:3]
        if kind and kind[0] in counts:
            counts[kind[0]] += 1
        scanned += 1
        if scanned >= SUMMARY_SCAN_LIMIT:
            break
    try:
        policy = info.get("maxmemory_policy") or \
            db.config_get("maxmemory-policy").get("maxmemory-policy")
    except response_error:  # CONFIG is often disabled on managed servers
        policy = info.get("maxmemory_policy")
    return {"url": _shown(url), "server": f"{'valkey' if 'valkey_version' in info else 'redis'} "
                                          f"{info.get('valkey_version') or info.get('redis_version')}",
            "blocks": counts[b"b"], "listings": counts[b"c"],
            "counted_all": scanned < SUMMARY_SCAN_LIMIT,
            "used_memory": info.get("used_memory"), "maxmemory": info.get("maxmemory"),
            "maxmemory_policy": policy, "evicted_keys": info.get("evicted_keys"),
            "expired_keys": info.get("expired_keys")}


def _shown(url: str) -> str:
    return RemoteURL(url).redacted()


def _listing(meta: dict[str, str]) -> str | None:
    """The child hash a block belongs in, or None when its meta names no valid parent and model."""
    parent, fingerprint = meta.get(fmt.META_PARENT), meta.get(fmt.META_FINGERPRINT, "")
    if parent is None or not is_key(fingerprint) or (parent and not is_key(parent)):
        return None
    return children_name(parent, fingerprint)
