"""The sequences a ``PagedPromptCache`` inserted, least recently inserted first, and which of
them leaves RAM next: LRUPromptCache's limits (a number of sequences, a number of bytes) applied
to the hot tier's blocks, whose sequences share blocks (``Sequences``)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from paged_cache.hashing import ROOT_PARENT, block_key
from paged_cache.manager import PagedSSDCacheManager
from paged_cache.prefix_cache import BlockAwarePrefixCache

CACHE_TYPES = ("assistant", "user", "system")  # LRUPromptCache's types, in its eviction order


@dataclass
class _Sequence:
    cache_type: str
    keys: list[str] = field(default_factory=list)
    ntokens: int = 0


class Sequences:
    """The tracked sequences (chain head key -> type, block keys, tokens) of one manager's hot
    tier; ``demoted(n)`` is told the blocks each eviction demotes."""

    def __init__(self, manager: PagedSSDCacheManager, demoted: Callable[[int], None]) -> None:
        self.manager = manager
        self._demoted = demoted
        self._held: OrderedDict[str, _Sequence] = OrderedDict()

    def __len__(self) -> int:
        """Sequences tracked (``prune`` first to count only those holding hot blocks)."""
        return len(self._held)

    def add(self, prefix: BlockAwarePrefixCache, tokens: list[int], keys: list[str],
            cache_type: str) -> None:
        """Track ``tokens`` just stored by ``prefix`` as ``keys``, the most recent sequence; in a
        full-history layout the sequences it extends stop counting (``_forget_prefixes``)."""
        if prefix.layout.full_history:
            self._forget_prefixes(prefix, tokens, keys)
        self._held.pop(keys[-1], None)
        self._held[keys[-1]] = _Sequence(cache_type, keys, len(tokens))

    def _forget_prefixes(self, prefix: BlockAwarePrefixCache, tokens: list[int],
                         keys: list[str]) -> None:
        """Stop tracking the sequences whose tokens are a proper prefix of ``tokens`` (just stored
        as ``keys``), as LRUPromptCache drops the prefixes of a cache it can trim: they no longer
        count against ``max_size``. Their blocks are the new sequence's, but for a partial tail it
        supersedes; counted, they would push other conversations out of RAM (whose partial tails,
        never written to SSD, would be lost)."""
        bs = prefix.block_size
        for head, seq in list(self._held.items()):
            n, held = seq.ntokens, len(seq.keys)
            if not 0 < n < len(tokens) or seq.keys[:-1] != keys[:held - 1]:
                continue
            parent = seq.keys[-2] if held > 1 else ROOT_PARENT
            if block_key(prefix.fingerprint, prefix.namespace, parent,
                         tokens[(held - 1) * bs:n]) == head:
                del self._held[head]

    def trim(self, n_sequences: int | None, n_bytes: int | None,
             nbytes: Callable[[], int]) -> None:
        """Evict the sequences chosen next until at most ``n_sequences`` hold hot blocks and
        ``nbytes()`` is at most ``n_bytes``; then, if blocks of no tracked sequence keep it
        above, the least recently used hot blocks."""
        self.prune()
        if n_sequences is not None:
            while len(self._held) > max(0, n_sequences):
                self._evict(self._victim())
        if n_bytes is not None:
            while nbytes() > max(0, n_bytes) and self._held:
                self._evict(self._victim())
            if nbytes() > max(0, n_bytes):
                self._demoted(self.manager.trim_hot(max(0, n_bytes)))
                self.prune()

    def by_type(self, total_bytes: int) -> dict[str, dict[str, int]]:
        """Per cache type: sequences holding hot blocks and their share of ``total_bytes``, each
        hot block counted for the most recently inserted sequence holding it."""
        hot = self.prune()
        owned = dict.fromkeys(CACHE_TYPES, 0)
        counts = dict.fromkeys(CACHE_TYPES, 0)
        seen: set[str] = set()
        for seq in reversed(self._held.values()):
            counts[seq.cache_type] += 1
            for key in seq.keys:
                if key not in seen and key in hot:
                    seen.add(key)
                    owned[seq.cache_type] += 1
        blocks = max(1, sum(owned.values()))
        return {t: {"n_sequences": counts[t], "n_bytes": total_bytes * owned[t] // blocks}
                for t in CACHE_TYPES}

    def prune(self) -> set[str]:
        """Forget sequences none of whose blocks is in the hot tier any more; returns the keys of
        the tracked sequences that are. One batched lookup (``tiers_of``) for every key: the
        server calls this before each fetch (``len``, ``stats_by_type``), on its generation
        thread, and the sequences share most of their blocks."""
        keys = list({k: None for s in self._held.values() for k in s.keys})
        hot = {k for k, tier in zip(keys, self.manager.tiers_of(keys)) if tier == "hot"}
        for head in [h for h, s in self._held.items() if hot.isdisjoint(s.keys)]:
            del self._held[head]
        return hot

    def _victim(self) -> str:
        """The sequence to leave RAM next, chosen as LRUPromptCache does: walking the types in
        CACHE_TYPES order (assistant, user, system), the oldest of the first type that holds at
        least as many sequences as the next type; else the oldest system sequence."""
        by_type: dict[str, list[str]] = {t: [] for t in CACHE_TYPES}
        for head, seq in self._held.items():  # least recently inserted first
            by_type[seq.cache_type].append(head)
        for this, following in zip(CACHE_TYPES, CACHE_TYPES[1:]):
            if by_type[this] and len(by_type[this]) >= len(by_type[following]):
                return by_type[this][0]
        return by_type[CACHE_TYPES[-1]][0]  # (some type above holds one when system is empty)

    def _evict(self, head: str) -> None:
        """Demote a sequence's hot blocks out of RAM (to SSD when there is an SSD tier),
        keeping blocks that another tracked sequence also holds, and its partial tail: the store
        put that unwritten (``deferred``), so a demotion would drop it and the conversation's next
        turn would recompute its tokens; it stays until the hot tier's budget evicts it (with
        ``hot_cache_only``, only while every block before it stays too: else it is unreachable)."""
        seq = self._held.pop(head)
        keep = {k for s in self._held.values() for k in s.keys}
        if seq.ntokens % self.manager.config.block_size and (
                not self.manager.config.hot_cache_only or keep.issuperset(seq.keys[:-1])):
            keep.add(seq.keys[-1])
        self._demoted(self.manager.demote(k for k in seq.keys if k not in keep))
