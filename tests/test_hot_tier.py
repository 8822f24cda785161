"""HotTier: byte-budgeted LRU of live mx.arrays; evict-before-insert; memory really returns."""

from __future__ import annotations

import gc
import threading
from collections import OrderedDict

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_cache.block import Block
from paged_cache.tiers.hot import HotTier
from helpers.backends import mlx_keeps_freed_buffers
from helpers.blocks import key_of, make_block

pytestmark = pytest.mark.unit


def test_lru_order_and_eviction_callback_sees_lru_first():
    evicted: list[tuple[str, bool]] = []
    hot = HotTier(4000, on_evict=lambda b, persisted: evicted.append((b.key, persisted)))
    blocks = [make_block(i, 1000) for i in range(5)]
    for b in blocks[:4]:
        assert hot.insert(b, persisted=(b.meta["i"] == "1"))
    assert hot.nbytes == 4000 and len(hot) == 4
    assert hot.get(blocks[0].key) is blocks[0]            # 0 becomes most recent
    assert hot.insert(blocks[4], persisted=False)
    assert evicted == [(blocks[1].key, True)]             # 1 was least recently used
    assert hot.keys() == [blocks[i].key for i in (2, 3, 0, 4)]
    assert hot.get(key_of(99)) is None
    stats = hot.stats()
    assert (stats["hits"], stats["misses"], stats["evictions"], stats["bytes"], stats["blocks"]) == \
        (1, 1, 1, 4000, 4)


def test_budget_is_made_before_insert_never_exceeded():
    hot: HotTier

    def check(block: Block, persisted: bool) -> None:
        # Called while room is being made: the incoming block is not in yet, the evicted one is out.
        assert incoming.key not in hot and block.key not in hot
        assert hot.nbytes + incoming.nbytes <= hot.max_bytes
        calls.append(block.key)

    calls: list[str] = []

    hot = HotTier(10_000, on_evict=check)
    for i, size in enumerate([3000, 3000, 3000, 6000, 1000, 9000, 10_000, 500]):
        incoming = make_block(i, size)
        assert hot.insert(incoming, persisted=False)
        assert hot.nbytes <= hot.max_bytes
        assert hot.nbytes == sum(hot.get(k).nbytes for k in hot.keys())
    assert len(calls) >= 5


def test_oversized_block_is_refused_and_counted_without_evicting():
    hot = HotTier(5000)
    small = make_block(0, 4000)
    assert hot.insert(small, persisted=False)
    assert not hot.insert(make_block(1, 5004), persisted=False)
    assert hot.keys() == [small.key] and hot.stats()["rejected"] == 1


def test_take_discard_and_persisted_flags():
    hot = HotTier(10_000)
    a, b = make_block(0, 1000), make_block(1, 1000)
    hot.insert(a, persisted=False)
    hot.insert(b, persisted=True)
    assert hot.unpersisted() == [a]
    hot.mark_persisted(a.key)
    assert hot.unpersisted() == []
    assert hot.take(a.key) == (a, True)
    assert a.key not in hot and hot.nbytes == 1000 and hot.take(a.key) is None
    assert hot.discard(b.key) and not hot.discard(b.key)
    assert hot.nbytes == 0 and len(hot) == 0


@pytest.mark.parametrize("bad", [-1, 1.5, "1GB", True])
def test_bad_budget(bad):
    with pytest.raises(ValueError, match="max_bytes"):
        HotTier(bad)


@settings(max_examples=60, deadline=None)
@given(budget=st.integers(0, 20), ops=st.lists(
    st.tuples(st.sampled_from(["insert", "get", "take", "discard"]), st.integers(0, 7),
              st.integers(1, 12)), max_size=40))
def test_matches_an_lru_model(budget, ops):
    """Every operation sequence leaves exactly the blocks a plain LRU model predicts (sizes in KiB)."""
    unit = 256
    hot = HotTier(budget * unit)
    model: OrderedDict[str, int] = OrderedDict()
    for op, i, size in ops:
        key = key_of(i)
        if op == "insert":
            model.pop(key, None)
            if size * unit <= budget * unit:
                while sum(model.values()) + size * unit > budget * unit:
                    model.popitem(last=False)
                model[key] = size * unit
            hot.insert(make_block(i, size * unit), persisted=False)
        elif op == "get":
            assert (hot.get(key) is not None) == (key in model)
            if key in model:
                model.move_to_end(key)
        elif op == "take":
            assert (hot.take(key) is not None) == (model.pop(key, None) is not None)
        else:
            assert hot.discard(key) == (model.pop(key, None) is not None)
        assert hot.keys() == list(model)
        assert hot.nbytes == sum(model.values()) <= budget * unit


def test_threads_share_the_tier_safely():
    blocks = [make_block(i, 512) for i in range(64)]
    hot = HotTier(512 * 16)
    errors: list[BaseException] = []

    def worker(offset: int) -> None:
        try:
            for round_ in range(200):
                b = blocks[(offset * 7 + round_) % len(blocks)]
                hot.insert(b, persisted=True)
                got = hot.get(blocks[(round_ * 3) % len(blocks)].key)
                assert got is None or got.nbytes == 512
                assert hot.nbytes <= hot.max_bytes
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert hot.nbytes == 512 * len(hot) <= hot.max_bytes


def test_memory_stays_within_budget_while_streaming_blocks_through():
    """40 fresh 4 MiB blocks through a 32 MiB tier: active memory stays within budget + 1 block
    (the incoming one), peak within budget + 2, and nothing is left after clear()."""
    block_bytes, budget = 4 * 2**20, 32 * 2**20
    gc.collect()
    mx.clear_cache()
    base_active = mx.get_active_memory()
    mx.reset_peak_memory()
    hot = HotTier(budget)
    for i in range(40):
        hot.insert(make_block(i, block_bytes, mx.float32), persisted=True)   # the test keeps no reference
        assert mx.get_active_memory() - base_active <= budget + block_bytes
    assert mx.get_peak_memory() - base_active <= budget + 2 * block_bytes
    hot.clear()
    gc.collect()
    assert mx.get_active_memory() - base_active <= 0
    assert mx.get_cache_memory() == 0


@pytest.mark.parametrize("clears", [True, False])
def test_large_eviction_returns_memory_to_the_system(clears):
    """One 30 MiB block evicting eight ~4 MiB blocks: the freed buffers leave MLX's cache at once
    (the control with clearing disabled shows they would otherwise stay cached, where MLX's
    allocator keeps freed buffers at all)."""
    budget = 32 * 2**20
    keeps = mlx_keeps_freed_buffers()
    gc.collect()
    mx.clear_cache()
    hot = HotTier(budget, clear_cache_bytes=None if clears else 2**62)
    for i in range(8):
        hot.insert(make_block(i, 4 * 2**20 - i * 4096, mx.float32), persisted=True)
    cached_before = mx.get_cache_memory()
    hot.insert(make_block(100, 30 * 2**20, mx.float32), persisted=True)
    assert len(hot) == 1
    if clears:
        assert mx.get_cache_memory() == 0 and hot.stats()["cache_clears"] >= 1
    elif keeps:
        assert mx.get_cache_memory() - cached_before >= 28 * 2**20
    else:  # no cache to leave: the memory went back at once anyway
        assert mx.get_cache_memory() == 0
    hot.clear()


def test_demote_and_trim_evict_through_the_callback_without_hits():
    evicted: list[tuple[str, bool]] = []
    hot = HotTier(4000, on_evict=lambda b, persisted: evicted.append((b.key, persisted)))
    blocks = [make_block(i, 1000) for i in range(4)]
    for b in blocks:
        hot.insert(b, persisted=(b.meta["i"] == "2"))
    # Unknown and repeated keys are skipped; held ones leave in the order given.
    assert hot.demote([blocks[2].key, key_of(99), blocks[2].key, blocks[0].key]) == 2
    assert evicted == [(blocks[2].key, True), (blocks[0].key, False)]
    assert hot.keys() == [blocks[1].key, blocks[3].key] and hot.nbytes == 2000
    hot.get(blocks[1].key)                                   # 3 is now least recently used
    assert hot.trim(1500) == 1 and evicted[-1] == (blocks[3].key, False)
    assert hot.trim(1000) == 0 and hot.keys() == [blocks[1].key]
    s = hot.stats()
    assert (s["evictions"], s["evicted_bytes"]) == (3, 3000)
    assert (s["demote_evictions"], s["demote_evicted_bytes"]) == (3, 3000)
    assert (s["hits"], s["misses"], s["takes"], s["discards"]) == (1, 0, 0, 0)
    # A plain LRU eviction is an eviction, not a demotion.
    hot.insert(make_block(5, 4000), persisted=False)
    s = hot.stats()
    assert (s["evictions"], s["demote_evictions"]) == (4, 3) and hot.trim(0) == 1
    assert hot.nbytes == 0 and len(hot) == 0
    with pytest.raises(ValueError, match="max_bytes"):
        hot.trim(-1)


def chain_block(i: int, parent: int | None, nbytes: int = 1000) -> Block:
    """A block whose meta names block `parent` (None: a root) as its parent, as stored chains do."""
    block = make_block(i, nbytes)
    block.meta["parent"] = key_of(parent) if parent is not None else ""
    return block


def fetch_touch(hot: HotTier, chain: list[int]) -> list[int]:
    """Touch a chain root first, as a fetch does; return the reachable prefix (indices)."""
    reachable = []
    for i in chain:
        if hot.get(key_of(i)) is None:
            break
        reachable.append(i)
    return reachable


def test_chain_longer_than_the_budget_keeps_its_prefix_reachable():
    """Plain LRU evicts a chain's root first (a fetch touches it first), stranding the rest; the
    hot tier evicts leaves before parents, so the longest prefix that fits stays reachable."""
    evicted: list[str] = []
    hot = HotTier(4000, on_evict=lambda b, persisted: evicted.append(b.key))
    chain = list(range(10))
    for i in chain:                                          # 10 blocks into a 4-block budget
        hot.insert(chain_block(i, i - 1 if i else None), persisted=False)
    assert fetch_touch(hot, chain) == [0, 1, 2, 3]           # plain LRU would keep [6..9]
    assert hot.nbytes <= hot.max_bytes and hot.stats()["rejected_ancestors"] == 6
    # Another conversation: evicts the first chain from its tip back (leaves first), never its root
    # while a deeper block of it is held.
    other = list(range(20, 23))
    for pos, i in enumerate(other):
        assert hot.insert(chain_block(i, other[pos - 1] if pos else None), persisted=False)
        assert fetch_touch(hot, chain) == [0, 1, 2, 3][:3 - pos]
        assert fetch_touch(hot, other) == other[:pos + 1]
    assert evicted == [key_of(i) for i in (3, 2, 1)]
    # Branches: the least recently used leaf goes first, whatever the depth.
    hot.insert(chain_block(30, 20), persisted=False)         # 20 -> 21 -> 22 and 20 -> 30
    assert evicted[-1] == key_of(0)                          # the oldest leaf (a lone root)
    hot.get(key_of(22))
    hot.insert(chain_block(40, None), persisted=False)
    assert evicted[-1] == key_of(30)                         # 30 is older than leaf 22
    hot.insert(chain_block(41, 40), persisted=False)         # 40 (its parent) is no candidate
    assert evicted[-1] == key_of(22)
    assert hot.keys() == [key_of(i) for i in (20, 21, 40, 41)]


def test_trim_evicts_leaves_first_and_parent_cycles_fall_back_to_lru():
    hot = HotTier(4000)
    for i in range(4):
        hot.insert(chain_block(i, i - 1 if i else None), persisted=False)
    hot.get(key_of(0))
    assert hot.trim(2000) == 2 and fetch_touch(hot, [0, 1, 2, 3]) == [0, 1]
    hot.clear()
    hot.insert(chain_block(5, 6), persisted=False)           # foreign meta: 5 <-> 6, no leaf
    hot.insert(chain_block(6, 5), persisted=False)
    assert hot.trim(1000) == 1 and hot.keys() == [key_of(6)]
    hot.insert(chain_block(7, None, 3000), persisted=False)  # 6 is a leaf again: evictable
    assert hot.keys() == [key_of(6), key_of(7)]


@settings(max_examples=100, deadline=None)
@given(budget=st.integers(0, 12), ops=st.lists(
    st.tuples(st.sampled_from(["insert", "insert", "get", "take", "discard", "trim"]),
              st.integers(0, 7), st.integers(1, 5), st.one_of(st.none(), st.integers(0, 7))),
    max_size=50))
def test_matches_a_leaves_first_lru_model(budget, ops):
    """Every operation sequence on blocks with parent links leaves what a slow reference model of
    the policy predicts: evict the least recently used block with no held child, where a block
    counts as a child of its nearest held ancestor (parent, or remembered ancestors of blocks that
    left: each remembers its parent if held, else its parent's remembered one) and the incoming
    block counts too; none left: refuse the incoming block if that ancestor
    is held, else plain LRU. Sizes in units of 256 bytes."""
    unit = 256
    hot = HotTier(budget * unit)
    model: OrderedDict[str, tuple[int, str | None]] = OrderedDict()   # key -> (bytes, parent)
    ghosts: dict[str, str] = {}

    def anchor(parent: str | None) -> str | None:
        for _ in range(64):
            if parent is None or parent in model:
                return parent
            parent = ghosts.get(parent)
        return None

    def pop(key: str) -> bool:
        if key not in model:
            return False
        parent = model.pop(key)[1]
        if parent is not None:  # its parent if held, else what its parent was remembered by
            ghosts[key] = parent if parent in model else ghosts.get(parent, parent)
        return True

    def victim(protected: str | None) -> str | None:
        parents = [p for _, p in model.values()] + [protected]
        leaf = next((k for k in model if k not in parents), None)
        if leaf is not None or not model or protected in model:
            return leaf
        return next(iter(model))

    used = lambda: sum(b for b, _ in model.values())  # noqa: E731
    for op, i, size, parent_i in ops:
        key = key_of(i)
        parent_i = None if parent_i == i else parent_i
        parent = key_of(parent_i) if parent_i is not None else None
        if op == "insert":
            pop(key)
            if size <= budget:
                protected = anchor(parent)
                while used() + size * unit > budget * unit and (v := victim(protected)) is not None:
                    pop(v)
                if used() + size * unit <= budget * unit:
                    model[key] = (size * unit, parent)
                else:
                    ghosts[key] = protected
            hot.insert(chain_block(i, parent_i, size * unit), persisted=False)
        elif op == "get":
            assert (hot.get(key) is not None) == (key in model)
            if key in model:
                model.move_to_end(key)
        elif op == "take":
            assert (hot.take(key) is not None) == pop(key)
        elif op == "discard":
            assert hot.discard(key) == pop(key)
        else:
            while used() > size * unit:
                pop(victim(None))
            hot.trim(size * unit)
        assert hot.keys() == list(model)
        assert hot.nbytes == used() <= budget * unit
