"""A long chain's lookup lists the local tiers' children in spans while the chain is held
(tiers/listing.py): a prompt held in its first blocks costs manifest probes for those, not for
every parent past them, and what the lookup finds is what one listing of every parent finds,
a chain held past the listings (a file the manifest does not list) included."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from paged_cache import CacheConfig, PagedSSDCacheManager
from paged_cache.block import Block
from paged_cache.chain_index import ChainNode
from paged_cache.hashing import ROOT_PARENT, block_key
from paged_cache.tiers import listing
from paged_cache.tiers.format import node_row
from paged_cache.tiers.route import ChildIndex, ids_key, text_key, trim
from paged_cache.tiers.ssd.tier import SSDTier

pytestmark = pytest.mark.unit

BS = 4
FP = "cd" * 32
SPAN = listing.LIST_SPAN
LONG = 3 * SPAN + 5   # blocks of the request's prompt: past three spans (64, 128, 256)


def chain(tokens: np.ndarray) -> list[Block]:
    """The chained blocks of ``tokens`` (whole blocks), root first."""
    out, parent = [], ROOT_PARENT
    for d in range(len(tokens) // BS):
        ids = tokens[d * BS:(d + 1) * BS]
        key = block_key(FP, "", parent, ids)
        meta = ChainNode(key, parent, FP, d * BS, ids).to_meta()
        out.append(Block(key, {"kv": mx.zeros((512,), dtype=mx.uint8)}, meta))
        parent = key
    return out


def found(manager: PagedSSDCacheManager, keys: list[str], tokens: np.ndarray) -> tuple:
    """A lookup's answer: the tiers, and each parent's listed nodes as plain fields."""
    tiers, nodes = manager.chain(keys, FP, tokens=tokens)
    return tiers, {parent: [(n.key, n.start, n.ntokens, n.checkpoint, n.restorable, n.tier)
                            for n in kids] for parent, kids in nodes.items()}


def lookups(manager: PagedSSDCacheManager, keys: list[str], tokens: np.ndarray,
            monkeypatch: pytest.MonkeyPatch) -> tuple[tuple, tuple, int]:
    """The lookup in spans, the same lookup listing every parent at once, and the manifest
    queries the first one made."""
    before = manager.stats()["ssd"]["chain_lookups"]
    spans = found(manager, keys, tokens)
    queries = manager.stats()["ssd"]["chain_lookups"] - before
    with monkeypatch.context() as m:
        m.setattr(listing, "LIST_SPAN", len(keys) + 1)
        whole = found(manager, keys, tokens)
    return spans, whole, queries


@pytest.mark.parametrize("held", [10, SPAN + 20, LONG])
def test_a_long_chain_is_listed_while_it_is_held(tmp_path: Path, held: int,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = np.arange(LONG * BS, dtype=np.int64) % 5000
    blocks = chain(tokens)
    config = CacheConfig(block_size=BS, hot_cache_max_bytes="1KiB", ssd_dir=tmp_path,
                         ssd_max_bytes="64MiB")
    with PagedSSDCacheManager(config) as manager:
        for block in blocks[:held]:
            assert manager.put(block)
        manager.flush()
        keys = [b.key for b in blocks]
        looked: list[str] = []
        contains = SSDTier.contains
        monkeypatch.setattr(SSDTier, "contains", lambda t, k: looked.append(k) or contains(t, k))
        spans, whole, queries = lookups(manager, keys, tokens, monkeypatch)
        assert spans == whole
        tiers, nodes = spans
        assert all(t is not None for t in tiers[:held]) and tiers[held:] == [None] * (LONG - held)
        assert all([n[0] for n in nodes[b.key]] == [keys[d + 1]]
                   for d, b in enumerate(blocks[:held - 1]))
        # one span (one manifest query) per span the chain reaches into; none past it
        assert queries == {10: 1, SPAN + 20: 2, LONG: 3}[held]
        assert looked[:1] == keys[held:held + 1]  # only the first key past the chain, if any


def test_a_chain_held_past_the_listings_is_found_whole(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A block file whose manifest row is gone (another process's, not yet reconciled) ends
    the listed part of the chain; the walk finds the file and the blocks past it, and their
    children are listed as one listing of every parent lists them."""
    tokens = (np.arange(LONG * BS, dtype=np.int64) * 7) % 30000
    blocks = chain(tokens)
    config = CacheConfig(block_size=BS, hot_cache_max_bytes="1KiB", ssd_dir=tmp_path,
                         ssd_max_bytes="64MiB")
    with PagedSSDCacheManager(config) as manager:
        for block in blocks:
            assert manager.put(block)
        manager.flush()
        unlisted = blocks[SPAN - 1].key   # the chain's key under the first span's last parent
        with sqlite3.connect(tmp_path / "manifest.sqlite") as db:
            assert db.execute("DELETE FROM blocks WHERE key = ?", (unlisted,)).rowcount == 1
        keys = [b.key for b in blocks]
        spans, whole, queries = lookups(manager, keys, tokens, monkeypatch)
        assert spans == whole
        tiers, nodes = spans
        assert None not in tiers   # held whole: the file of the unlisted key is found
        assert [n[0] for n in nodes[keys[-2]]] == [keys[-1]]   # listed past the break
        assert unlisted not in {n[0] for n in nodes.get(keys[SPAN - 2], [])}
        assert queries == 2   # the first span, then the rest of the held chain at once


def test_an_unsigned_order_key_is_the_same_as_a_wide_one() -> None:
    for ids in (np.array([0, 7, 65535]), np.array([1, 2**32 - 1, 9])):
        for dtype in (np.uint16, np.uint32):
            if int(ids.max()) <= np.iinfo(dtype).max:
                assert ids_key(ids.astype(dtype)) == ids_key(ids.astype(np.int64))
    assert ids_key(np.array([2**32], dtype=np.uint64)) is None



def test_a_lone_child_is_listed_as_the_index_lists_it() -> None:
    """``trim`` passes a parent's only child through untouched (no ids decoded): the RAM index
    lists it too, for any request, whether it is the request's own block or another's."""
    parent, request = "ab" * 32, np.arange(BS, dtype=np.int64) + 3
    for ids in (request, request[:2], np.r_[request[:2], 0, 0], np.full(BS, 9000)):
        key = block_key(FP, "", parent, ids)
        row = node_row(key, ChainNode(key, parent, FP, BS, ids).to_meta())
        index = ChildIndex()
        index.add(parent, row[5], key)
        assert index.keys([parent], {parent: ids_key(request)}) == [key]
        assert trim([row], ids_key(request)) == [row]
    assert trim([], ids_key(request)) == []
