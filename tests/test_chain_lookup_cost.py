"""The chain lookup's work does not grow with what it has already checked: a parent many
conversations continue (a shared system prompt) lists every held child on every lookup, and a
child listed again with the same fields is not verified (hashed) again, whether the hot tier or
the SSD manifest listed it; a manifest row altered since is verified again and refused."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from paged_cache import CacheConfig, PagedSSDCacheManager
from paged_cache.block import Block
from paged_cache.chain_index import ChainNode, FitNodes
from paged_cache.hashing import ROOT_PARENT, block_key, encode_token_ids

pytestmark = pytest.mark.unit

BS = 16
FP = "ab" * 32
CHILDREN = 40


def node_block(parent: str, start: int, ids: np.ndarray) -> Block:
    key = block_key(FP, "", parent, ids)
    meta = ChainNode(key, parent, FP, start, ids).to_meta()
    return Block(key, {"kv": mx.zeros((512,), dtype=mx.uint8)}, meta)


def fan_out(manager: PagedSSDCacheManager) -> tuple[Block, list[Block]]:
    """A root block with CHILDREN children (each another conversation's next block)."""
    root = node_block(ROOT_PARENT, 0, np.arange(BS, dtype=np.int64))
    kids = [node_block(root.key, BS, np.full(BS, 100 + i, dtype=np.int64))
            for i in range(CHILDREN)]
    for block in [root, *kids]:
        assert manager.put(block)
    return root, kids


def lookup(manager: PagedSSDCacheManager, keys: list[str]) -> dict:
    tiers, nodes = manager.chain(keys, FP)
    assert tiers[0] is not None
    return nodes


def test_a_hot_parent_s_children_are_verified_once() -> None:
    config = CacheConfig(block_size=BS, hot_cache_only=True, hot_cache_max_bytes="1MiB")
    with PagedSSDCacheManager(config) as manager:
        root, kids = fan_out(manager)
        first = lookup(manager, [root.key, kids[0].key])
        assert len(first[root.key]) == CHILDREN
        assert manager._fits.verified == CHILDREN - 1  # each child but the path's, once
        for kid in kids[:5]:  # every other conversation's lookup lists the same children
            again = lookup(manager, [root.key, kid.key])
            assert [n.key for n in again[root.key]] == [n.key for n in first[root.key]]
        assert manager._fits.verified == CHILDREN  # kids[0], no longer the path's block
        assert manager.stats()["nodes_rejected"] == 0


def test_manifest_rows_are_verified_once_and_again_when_altered(tmp_path: Path) -> None:
    config = CacheConfig(block_size=BS, hot_cache_max_bytes="1KiB", ssd_dir=tmp_path,
                         ssd_max_bytes="64MiB")
    with PagedSSDCacheManager(config) as manager:
        root, kids = fan_out(manager)
        manager.flush()
        keys = [root.key, kids[0].key]
        assert len(lookup(manager, keys)[root.key]) == CHILDREN
        verified = manager._fits.verified
        assert verified == CHILDREN - 1  # each child but the path's
        lookup(manager, keys)
        assert manager._fits.verified == verified  # the same rows: nothing hashed again
        planted = encode_token_ids(np.full(BS, 7, dtype=np.int64))  # another's tokens
        with sqlite3.connect(tmp_path / "manifest.sqlite") as db:
            assert db.execute("UPDATE blocks SET token_ids = ? WHERE key = ?",
                              (planted, kids[1].key)).rowcount == 1
        listed = lookup(manager, keys)[root.key]
        assert manager._fits.verified == verified + 1
        assert kids[1].key not in {n.key for n in listed}
        assert manager.stats()["nodes_rejected"] == 1


def test_the_bound_forgets_the_least_recently_listed_node() -> None:
    fits = FitNodes(limit=2)
    a, b, c = (ChainNode(node_block(ROOT_PARENT, 0, np.full(BS, i, dtype=np.int64)).key,
                         ROOT_PARENT, FP, 0, np.full(BS, i, dtype=np.int64)) for i in range(3))
    check = lambda node: fits.unfit(node, FP, "", 0, BS, None)  # noqa: E731
    assert [check(n) for n in (a, b, a, c)] == [None] * 4
    assert fits.verified == 3  # a's second listing was remembered
    assert check(a) is None and fits.verified == 3  # listed since b: kept
    assert check(b) is None and fits.verified == 4  # forgotten for c: verified again


def routed_tail(root: Block) -> Block:
    """A partial tail under ``root`` starting with the first child's first token."""
    return node_block(root.key, BS, np.full(BS // 2, 100, dtype=np.int64))


@pytest.mark.parametrize("tier", ["hot", "ssd"])
def test_a_routed_lookup_lists_the_request_s_children_and_one_other(tmp_path: Path,
                                                                    tier: str) -> None:
    """Given the request's tokens, a lookup lists a parent's children that start with the
    request's token there (its own block, a partial tail of it) and one other child (another
    conversation continues there: the hand-over keeps the parent), not every child; the
    request's blocks are found as an unrouted lookup finds them."""
    config = CacheConfig(block_size=BS, hot_cache_only=True, hot_cache_max_bytes="1MiB") \
        if tier == "hot" else CacheConfig(block_size=BS, hot_cache_max_bytes="1KiB",
                                          ssd_dir=tmp_path, ssd_max_bytes="64MiB")
    with PagedSSDCacheManager(config) as manager:
        root, kids = fan_out(manager)
        tail = routed_tail(root)
        assert manager.put(tail)
        manager.flush()
        keys = [root.key, kids[0].key]
        tokens = np.concatenate([np.arange(BS), np.full(BS + 3, 100)]).astype(np.int64)
        tiers, nodes = manager.chain(keys, FP, tokens=tokens)
        whole_tiers, whole = manager.chain(keys, FP)
        assert tiers == whole_tiers and tiers[0] is not None
        listed = {n.key for n in nodes[root.key]}
        assert {kids[0].key, tail.key} < listed  # the request's block and its tail
        assert len(listed - {kids[0].key, tail.key}) == 1  # one other: a witness
        assert listed < {n.key for n in whole[root.key]}
        assert len(whole[root.key]) == CHILDREN + 1
        # the request ends where root's children start: only a witness is listed (per tier)
        _, ends = manager.chain([root.key], FP, tokens=np.arange(BS, dtype=np.int64))
        by_tier = [n.tier for n in ends[root.key]]
        assert by_tier and len(by_tier) == len(set(by_tier))
        with pytest.raises(ValueError, match="too few"):
            manager.chain(keys, FP, tokens=np.arange(BS, dtype=np.int64))


def test_first_token_reads_only_the_first_id() -> None:
    from paged_cache.tiers.route import first_token
    for dtype_ids in (np.array([7, 65535, 3]), np.array([70000, 1]), np.array([2**40, 5])):
        assert first_token(encode_token_ids(dtype_ids)) == int(dtype_ids[0])
    assert first_token(encode_token_ids(np.array([-3, 4]))) == -3
    for bad in (None, "", "u2", "x9:AAAA", "i8:AA", "u2:!!!!"):
        assert first_token(bad) is None
