"""The remote tier's reads (caller thread): which keys the server holds, the read-ahead of a
planned chain, and the child listings cache.

``RemoteReads`` is a part of ``RemoteTier`` (tiers/remote/tier.py): it works on the tier's ``_lock``
(counters, plan, read-ahead, remembered keys / metas / listings), its ``_pipelined`` round trips,
``_count`` and ``_sealer`` (tiers/remote/mac.py: None without a remote_secret).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Any, Sequence

from paged_cache.block import Block, check_key, is_key
from paged_cache.tiers import format as fmt
from paged_cache.tiers.remote.mac import SEAL_BYTES, is_sealed
from paged_cache.tiers.remote.client import (block_name, chain_ttl_ms, children_name,
                                              parse_child_entry)

log = logging.getLogger("paged_cache.remote")

READ_AHEAD_BLOCKS = 32         # at most this many blocks of a planned chain per read round trip
# ... but the first round trip of a planned chain reads only the blocks that make up this many
# bytes (at least one): the fetch times them before it asks for the rest (its cut-off,
# fetch_plan.Watch), so a slow link costs it about this much, not the whole chain; enough bytes
# that the link's bandwidth shows rather than its latency
FIRST_READ_BYTES = 64 << 10
READ_AHEAD_BYTES = 64 << 20    # ... and at most this many value bytes (beyond the first block)
MAX_LISTINGS = 1024            # child hashes of a planned chain read in one round trip
PRESENT_SECONDS = 2.0          # how long a key seen on the server counts as held without asking
MAX_REMEMBERED = 1 << 14       # bound of the remembered child metas and present keys
MAX_VALUE_BYTES = 1 << 31      # a value larger than this is not decoded (counted damaged)


class RemoteReads:
    """Pipelined reads with read-ahead, and the child listings of a chain (see module doc)."""

    def _init_reads(self) -> None:
        self._plan: dict[str, int] = {}            # chain keys found on the server, in order
        self._plan_keys: list[str] = []
        self._plan_reads = 0
        self._chain: list[str] = []
        self._fetched: dict[str, Block | None] = {}  # read ahead, not yet asked for (None: no
        # value there, or a damaged one)
        self._metas: OrderedDict[str, dict[str, str]] = OrderedDict()  # from child listings
        self._present: OrderedDict[str, tuple[float, int]] = OrderedDict()  # key -> (seen, bytes)
        self._listings: OrderedDict[str, tuple[float, list[str]]] = OrderedDict()  # name -> (at, keys)

    def _forget_reads(self) -> None:
        """Drop what the reads remember of the server (an outage). Caller holds no lock."""
        with self._lock:
            self._fetched, self._present, self._listings = {}, OrderedDict(), OrderedDict()

    def held(self, keys: Sequence[str], *, chain: bool = False) -> list[bool]:
        """Which ``keys`` the server holds now: one pipelined round trip of STRLEN (none for keys
        seen in the last PRESENT_SECONDS); their sizes size the read-ahead. All False while the
        server is unreachable. ``chain``: ``keys`` are a chain in order from its start, and with
        ``remote_ttl`` those asked get their TTL renewed in the same round trip (``chain_ttl_ms``:
        a parent's never shorter than its children's)."""
        now = time.monotonic()
        with self._lock:
            out = [now - self._present.get(k, (-PRESENT_SECONDS, 0))[0] < PRESENT_SECONDS
                   for k in keys]
        ask = [(i, k) for i, (k, seen) in enumerate(zip(keys, out)) if not seen]
        if not ask:
            return out
        renew = chain and self.ttl > 0

        def build(pipe: Any) -> list:
            asked = [pipe.strlen(block_name(k)) for _, k in ask]
            if renew:
                for i, k in ask:
                    pipe.pexpire(block_name(k), chain_ttl_ms(self.ttl, i))
            return asked

        answers = self._pipelined(build)
        if answers is None:
            return out
        found = {k: n for (_, k), n in zip(ask, answers) if isinstance(n, int) and n > 0}
        self._remember_present(found)
        return [seen or k in found for k, seen in zip(keys, out)]

    def plan(self, chain: Sequence[str], on_server: Sequence[str]) -> None:
        """Record a fetch's chain (the keys held somewhere, in order) and which of them only the
        server holds: ``read_block`` then fetches up to READ_AHEAD_BLOCKS / READ_AHEAD_BYTES of those
        per round trip, and
        the first ``listed_children`` call lists the children of the whole chain in one. Drops older
        read-ahead."""
        with self._lock:
            self._chain = list(chain)
            self._plan_keys = list(on_server)
            self._plan = {k: i for i, k in enumerate(self._plan_keys)}
            self._fetched = {}
            self._plan_reads = 0  # round trips of this plan so far

    def read_block(self, key: str, expect: fmt.Expected | None = None) -> Block | None:
        """The verified block for ``key`` (a read-ahead hit or one pipelined round trip that also
        reads the planned keys after it), or None: a miss, damage (counted) or an outage.
        ``expect``: what every block read must be (a value that is not, or that is larger than
        any such block can be, is damage: no more than that is read or decompressed)."""
        check_key(key)
        with self._lock:
            if key in self._fetched:  # read ahead: a block, or None (no value, or damaged)
                block = self._fetched.pop(key)
                self._counts["hits" if block is not None else "misses"] += 1
                return block
            i = self._plan.get(key)
            batch = [key] if i is None else self._read_ahead(i)
        cap = MAX_VALUE_BYTES if expect is None else fmt.stored_limit(expect) + SEAL_BYTES
        # at most one byte past the largest acceptable value is read (a longer one is damage)
        values = self._pipelined(lambda p: [p.getrange(block_name(k), 0, cap) for k in batch])
        if values is None:
            return None
        found: dict[str, Block | None] = {}
        for j, k in enumerate(batch):
            found[k] = self._decode(k, values[j] or None, cap, expect)  # b"": no such key
            values[j] = None  # one value's bytes at a time beside the decoded blocks
        block = found.pop(key)
        with self._lock:
            self._counts["hits" if block is not None else "misses"] += 1
            if self._plan.get(key) == i and i is not None:
                self._fetched.update(found)
        return block

    def _read_ahead(self, i: int) -> list[str]:
        """Planned keys from position ``i`` within READ_AHEAD_BLOCKS and READ_AHEAD_BYTES (on
        the plan's first round trip: until FIRST_READ_BYTES) by the sizes ``held`` saw; at least
        one key. Caller holds the lock."""
        first = self._plan_reads == 0
        self._plan_reads += 1
        size = lambda key: self._present.get(key, (0.0, READ_AHEAD_BYTES))[1]  # noqa: E731
        batch, total, sent = [self._plan_keys[i]], 0, size(self._plan_keys[i])
        for key in self._plan_keys[i + 1:i + READ_AHEAD_BLOCKS]:
            total += size(key)
            if total > READ_AHEAD_BYTES or (first and sent >= FIRST_READ_BYTES):
                break
            sent += size(key)
            batch.append(key)
        return batch

    def fetched(self, key: str) -> bool:
        """True when a read of ``key`` would not wait for the server: it was read ahead."""
        with self._lock:
            return key in self._fetched

    def listed_children(self, parent: str, fingerprint: str) -> list[str]:
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

    def _decode(self, key: str, value: Any, cap: int, expect: fmt.Expected | None) -> Block | None:
        """The block a value read (at most ``cap`` + 1 bytes of it) holds, or None: a miss (no
        value), damage (counted) or a value refused before it is decoded: with a secret, one
        without a valid tag (``rejected``); without one, a sealed value, whose tag this host
        cannot check (``sealed_refused``, the first logged at WARNING)."""
        if value is None:
            return None
        if isinstance(value, BaseException) or not isinstance(value, bytes):
            reason = str(value) if isinstance(value, BaseException) else "not a string value"
        elif len(value) > cap:
            reason = f"more than {cap} bytes, more than a block can take"
        else:
            self._count("read_bytes", len(value))
            if self._sealer is not None:
                body = self._sealer.open(block_name(key), value)
                refusal = "rejected"
            else:
                body = None if is_sealed(value) else memoryview(value)
                refusal = "sealed_refused"
            if body is None:
                self._refused(key, refusal)
                return None
            try:
                arrays, meta = fmt.decode(body, key, max_bytes=fmt.decoded_limit(body.nbytes),
                                          expect=expect)
                return Block(key, arrays, meta)
            except ValueError as exc:
                reason = str(exc)
        self._count("damaged")
        log.debug("remote block %s: damaged value treated as a miss (%s)", key[:16], reason)
        return None

    def _refused(self, key: str, counter: str) -> None:
        """Count a value refused before decoding; the first sealed value a host without a secret
        refuses is logged at WARNING (its hosts disagree on the secret)."""
        with self._lock:
            self._counts[counter] += 1
            first = counter == "sealed_refused" and self._counts[counter] == 1
        if first:
            log.warning("remote block %s is sealed and this host has no remote_secret to check "
                        "it: refused, as every sealed value will be (counted in "
                        "remote.sealed_refused); give this host the secret the others use "
                        "(PAGED_CACHE_REMOTE_SECRET)", key[:16])
        else:
            log.debug("remote block %s: value without a valid tag refused (%s)", key[:16], counter)

    def _remember_present(self, sizes: dict[str, int]) -> None:
        """Record keys seen on the server now, with their value sizes."""
        now = time.monotonic()
        with self._lock:
            for key, size in sizes.items():
                self._present[key] = (now, size)
                self._present.move_to_end(key)
            while len(self._present) > MAX_REMEMBERED:
                self._present.popitem(last=False)
