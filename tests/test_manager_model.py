"""PagedSSDCacheManager against a reference model: random operation sequences (hypothesis
stateful) on hot-only, write-through, write-back and budget-bound managers."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from paged_cache import Block, PagedSSDCacheManager
from helpers.blocks import block_files, key_of, make_block, same_block
from helpers.managers import new_manager

UNIT = 256
sizes = st.integers(1, 8)
indexes = st.integers(0, 11)


class ManagerMachine(RuleBasedStateMachine):
    """Random puts / gets / takes / discards against a plain model of what must be retrievable."""

    hot_units = 8
    config_kw: dict = {}

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="paged-cache-sm-"))
        self.manager = self.open()
        self.sizes: dict[int, int] = {}                      # i -> size of the block put under i

    def open(self) -> PagedSSDCacheManager:
        kw = dict(hot_cache_max_bytes=self.hot_units * UNIT, **self.config_kw)
        return new_manager(None if kw.get("hot_cache_only") else self.dir / "ssd", **kw)

    def expected(self, i: int) -> Block:
        return make_block(i, self.sizes[i] * UNIT)

    @invariant()
    def budgets_hold(self) -> None:
        assert self.manager.stats()["hot"]["bytes"] <= self.hot_units * UNIT

    def teardown(self) -> None:
        self.manager.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class HotOnlyMachine(ManagerMachine):
    """hot_cache_only: an exact LRU model (sizes in UNIT bytes) says what is retrievable."""

    config_kw = dict(hot_cache_only=True)

    def __init__(self) -> None:
        super().__init__()
        self.lru: list[int] = []

    def _evict_for(self, size: int) -> None:
        while sum(self.sizes[j] for j in self.lru) + size > self.hot_units:
            self.lru.pop(0)

    @rule(i=indexes, size=sizes)
    def put(self, i: int, size: int) -> None:
        new = i not in self.lru
        if new:
            self.sizes[i] = size
        stored = self.manager.put(make_block(i, self.sizes[i] * UNIT))
        assert stored == (new and self.sizes[i] <= self.hot_units)
        if new and self.sizes[i] <= self.hot_units:
            self._evict_for(self.sizes[i])
            self.lru.append(i)
        elif not new:
            self.lru.remove(i)
            self.lru.append(i)

    @rule(i=indexes, take=st.booleans())
    def get(self, i: int, take: bool) -> None:
        got = self.manager.get(key_of(i), take=take)
        assert (got is not None) == (i in self.lru)
        if got is not None:
            assert same_block(got, self.expected(i))
            self.lru.remove(i)
            if not take:
                self.lru.append(i)

    @rule(i=indexes)
    def discard(self, i: int) -> None:
        self.manager.discard(key_of(i))
        if i in self.lru:
            self.lru.remove(i)

    @invariant()
    def model_matches(self) -> None:
        assert self.manager.tier("hot").keys() == [key_of(i) for i in self.lru]
        assert self.manager.stats()["hot"]["bytes"] == sum(self.sizes[i] for i in self.lru) * UNIT


class SSDMachine(ManagerMachine):
    """With an SSD large enough for everything, every put block stays retrievable until discarded
    (also across close and reopen); the hot tier stays within budget throughout."""

    config_kw = dict(ssd_max_bytes="32MB", queue_full_policy="write-on-caller")

    def __init__(self) -> None:
        super().__init__()
        self.held: set[int] = set()

    @rule(i=indexes, size=sizes)
    def put(self, i: int, size: int) -> None:
        if i not in self.held:
            self.sizes[i] = size
        assert self.manager.put(make_block(i, self.sizes[i] * UNIT)) == (i not in self.held)
        self.held.add(i)

    @rule(i=indexes, take=st.booleans())
    def get(self, i: int, take: bool) -> None:
        got = self.manager.get(key_of(i), take=take)
        assert (got is not None) == (i in self.held)
        if got is not None:
            assert same_block(got, self.expected(i))

    @rule(i=indexes)
    def discard(self, i: int) -> None:
        self.manager.discard(key_of(i))
        self.held.discard(i)

    @rule()
    def reopen(self) -> None:
        self.manager.close()
        self.manager = self.open()

    @invariant()
    def everything_held_is_found(self) -> None:
        assert {i for i in range(12) if self.manager.contains(key_of(i))} == self.held


class WriteBackSSDMachine(SSDMachine):
    config_kw = dict(ssd_max_bytes="32MB", write_policy="write-back", write_queue_max_bytes=2048,
                     queue_full_policy="write-on-caller")


class SmallSSDMachine(ManagerMachine):
    """A tight SSD budget: blocks may be evicted from SSD too, but whatever is returned is exact
    and after a flush the files never exceed the budget."""

    ssd_budget = 6000
    config_kw = dict(ssd_max_bytes=ssd_budget, compression="lz4")

    @rule(i=indexes, size=sizes)
    def put(self, i: int, size: int) -> None:
        self.sizes.setdefault(i, size)
        self.manager.put(make_block(i, self.sizes[i] * UNIT))

    @rule(i=indexes, take=st.booleans())
    def get(self, i: int, take: bool) -> None:
        got = self.manager.get(key_of(i), take=take)
        if got is not None:
            assert same_block(got, self.expected(i))

    @rule()
    def flush(self) -> None:
        self.manager.flush()
        stats = self.manager.stats()["ssd"]
        assert stats["bytes"] <= self.ssd_budget
        on_disk = sum(p.stat().st_size for p in block_files(self.dir / "ssd").values())
        assert on_disk == stats["bytes"]


_SETTINGS = settings(max_examples=25, stateful_step_count=30, deadline=None)
TestHotOnlyMachine = HotOnlyMachine.TestCase
TestHotOnlyMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestSSDMachine = SSDMachine.TestCase
TestSSDMachine.settings = _SETTINGS
TestWriteBackSSDMachine = WriteBackSSDMachine.TestCase
TestWriteBackSSDMachine.settings = _SETTINGS
TestSmallSSDMachine = SmallSSDMachine.TestCase
TestSmallSSDMachine.settings = _SETTINGS
