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
from paged_cache.tiers.route import NEIGHBORS

from helpers.blocks import text_rows

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
    """A partial tail under ``root``: the first half of the first child's tokens."""
    return node_block(root.key, BS, np.full(BS // 2, 100, dtype=np.int64))


@pytest.mark.parametrize("tier", ["hot", "ssd"])
def test_a_routed_lookup_lists_the_request_s_children_and_its_neighbours(tmp_path: Path,
                                                                         tier: str) -> None:
    """Given the request's tokens, a lookup lists of a parent's children those that are
    prefixes of the request's tokens there (its own block, a partial tail of it) and a few
    neighbours in token order (one a side when its own block is there), not every child; the
    request's blocks are found as an unrouted lookup finds them."""
    config = CacheConfig(block_size=BS, hot_cache_only=True, hot_cache_max_bytes="1MiB") \
        if tier == "hot" else CacheConfig(block_size=BS, hot_cache_max_bytes="1KiB",
                                          ssd_dir=tmp_path, ssd_max_bytes="64MiB")
    with PagedSSDCacheManager(config) as manager:
        root, kids = fan_out(manager)
        tail = routed_tail(root)
        assert manager.put(tail)
        manager.flush()
        mine = kids[CHILDREN // 2]  # tokens 100 + CHILDREN // 2: children on both sides
        keys = [root.key, mine.key]
        tokens = np.concatenate([np.arange(BS), np.full(BS + 3, 100 + CHILDREN // 2)])
        tiers, nodes = manager.chain(keys, FP, tokens=tokens)
        whole_tiers, whole = manager.chain(keys, FP)
        assert tiers == whole_tiers and tiers[0] is not None
        listed = {n.key for n in nodes[root.key]}
        assert mine.key in listed
        near = {k.key for k in kids[CHILDREN // 2 - NEIGHBORS:CHILDREN // 2 + NEIGHBORS + 1]}
        # the manifest orders by first token only: its witness is the first other child
        assert len(listed - near - {tail.key}) <= (tier == "ssd")
        assert len(listed) <= 2 * NEIGHBORS + 2
        assert len(whole[root.key]) == CHILDREN + 1
        # the first child's own request: its tail (a prefix of its tokens) is listed too
        first = np.concatenate([np.arange(BS), np.full(BS, 100)])
        listed = {n.key for n in manager.chain([root.key, kids[0].key], FP,
                                               tokens=first)[1][root.key]}
        assert {kids[0].key, tail.key} <= listed
        # the request ends where root's children start: a few are listed (a witness)
        _, ends = manager.chain([root.key], FP, tokens=np.arange(BS, dtype=np.int64))
        assert 1 <= len(ends[root.key]) <= 2 * NEIGHBORS
        with pytest.raises(ValueError, match="too few"):
            manager.chain(keys, FP, tokens=np.arange(BS, dtype=np.int64))


def test_a_shared_prefix_ending_inside_a_block_lists_few_children(tmp_path: Path) -> None:
    """The common case of a system prompt: it ends a few tokens into a block, so every
    conversation's next block starts with the same tokens. A routed lookup still lists only the
    request's neighbours and its prefixes (a partial node at the prompt's end), in the hot tier
    and the manifest alike (the manifest reads every child starting with that token to find
    them: tiers/ssd/child_rows.py)."""
    shared = np.arange(5, dtype=np.int64) + 1000   # the prompt's last 5 tokens
    for config in (CacheConfig(block_size=BS, hot_cache_only=True, hot_cache_max_bytes="1MiB"),
                   CacheConfig(block_size=BS, hot_cache_max_bytes="1KiB", ssd_dir=tmp_path,
                               ssd_max_bytes="64MiB")):
        with PagedSSDCacheManager(config) as manager:
            root = node_block(ROOT_PARENT, 0, np.arange(BS, dtype=np.int64))
            kids = [node_block(root.key, BS, np.concatenate([shared, np.full(BS - 5, 7 * i)]))
                    for i in range(CHILDREN)]
            end = node_block(root.key, BS, shared)   # a tail at the prompt's end
            for block in [root, end, *kids]:
                assert manager.put(block)
            manager.flush()
            ids = np.concatenate([np.arange(BS), shared, np.full(BS - 5, 7 * 3 + 1)])
            _, nodes = manager.chain([root.key], FP, tokens=ids)
            listed = {n.key for n in nodes[root.key]}
            assert end.key in listed
            assert len(listed) <= 2 * NEIGHBORS + 2
            assert len(manager.chain([root.key], FP)[1][root.key]) == CHILDREN + 1


def test_order_keys_and_the_prefix_walk() -> None:
    from paged_cache.tiers.route import first_of, first_token, ids_key, prefix_walk, text_key
    for ids in (np.array([7, 65535, 3]), np.array([70000, 1]), np.array([2**32 - 1, 5])):
        assert text_key(encode_token_ids(ids)) == ids_key(ids) == ids.astype(">u4").tobytes()
        assert first_token(encode_token_ids(ids)) == first_of(ids_key(ids)) == ids[0]
    assert ids_key(np.array([-3, 4])) is None and ids_key(np.array([2**32])) is None
    assert first_token(encode_token_ids(np.array([-3, 4]))) is None
    for bad in (None, "", "u2", "x9:AAAA", "i8:AA", "u2:!!!!"):
        assert text_key(bad) is None and first_token(bad) is None
    stored = sorted(ids_key(np.array(t)) for t in ([1], [1, 2], [1, 2, 3, 9], [1, 2, 5], [4]))
    request = ids_key(np.array([1, 2, 3, 4]))

    def below(q: bytes) -> bytes | None:
        return max((s for s in stored if s <= q), default=None)

    assert prefix_walk(request, below) == [ids_key(np.array([1, 2])), ids_key(np.array([1]))]


def test_a_child_holding_the_request_s_tokens_still_lists_the_next_one_going_on() -> None:
    """A parent's child with exactly the request's tokens there may be a checkpoint (state, no
    rows of the layers a block holds): the shortest child going on past those tokens holds the
    rows, so it is listed beside it (a gemma3 request that was a prefix of an earlier prompt got
    one token fewer than LRUPromptCache without it)."""
    from paged_cache.tiers.route import ids_key, select

    request = ids_key(np.array([1, 2, 3]))
    entries = sorted([(ids_key(np.array(ids)), key) for ids, key in (
        ([0, 9], "before"), ([1, 2, 3], "own"), ([1, 2, 3, 4, 5], "longer"),
        ([1, 2, 3, 7, 7, 7], "longest"), ([5], "after"))])
    listed = {entries[i][1] for i in select(entries, request)}
    assert listed == {"before", "own", "longer"}


def test_a_parent_s_only_child_is_indexed_without_decoding_its_ids() -> None:
    """The RAM index keeps a parent's only child with its token id text (a lookup lists it
    whatever the request), so a chain of single children costs no decoding; a second child
    orders both. Through any adds and removes it lists what ordering every child lists."""
    from paged_cache.tiers.route import ChildIndex, _text_key, ids_key, select, text_key

    rng = np.random.default_rng(7)
    parents = [f"{i:064x}" for i in range(6)]
    index, held = ChildIndex(), {p: {} for p in parents}
    _text_key.cache_clear()
    for i, parent in enumerate(parents):  # one child each: nothing decoded
        index.add(parent, encode_token_ids(np.full(BS, i)), f"{i:02x}" * 32)
        held[parent][f"{i:02x}" * 32] = encode_token_ids(np.full(BS, i))
    assert _text_key.cache_info().misses == 0
    for step in range(400):
        parent = parents[int(rng.integers(len(parents)))]
        if held[parent] and rng.random() < 0.4:
            key = list(held[parent])[int(rng.integers(len(held[parent])))]
            index.remove(parent, held[parent].pop(key), key)
        else:
            ids = rng.integers(0, 4, size=int(rng.integers(1, BS + 1)))
            text = "malformed" if rng.random() < 0.1 else encode_token_ids(ids)
            key = f"{step:064x}"
            index.add(parent, text, key)
            held[parent][key] = text
        request = ids_key(rng.integers(0, 4, size=BS))
        for p in parents:
            odd = [k for k, t in held[p].items() if text_key(t) is None]
            entries = sorted((text_key(t), k) for k, t in held[p].items()
                             if text_key(t) is not None)
            want = [k for k in held[p]] if len(held[p]) == 1 else \
                odd + [entries[i][1] for i in sorted(select(entries, request))]
            assert sorted(index.keys([p], {p: request})) == sorted(want), (step, p)
            assert sorted(index.keys([p], None)) == sorted(held[p]), (step, p)


def test_the_manifest_makes_the_request_s_own_rows_from_its_route(tmp_path: Path) -> None:
    """A routed manifest lookup reads the route index alone for the request's own blocks (their
    keys commit to the request's fingerprint, parent and tokens) and the rows of the others: the
    rows it makes are the stored ones. A stored row's fingerprint and ids altered since are not
    read where the key says what it holds (as the manager knows the request's own node by its
    key); a row whose token count does not fit the request's block is read."""
    from paged_cache.tiers.route import route_of

    config = CacheConfig(block_size=BS, hot_cache_max_bytes="1KiB", ssd_dir=tmp_path,
                         ssd_max_bytes="64MiB")
    with PagedSSDCacheManager(config) as manager:
        tokens = np.arange(6 * BS, dtype=np.int64) + 70_000   # i4 ids: the text's widest form
        chain, parent = [], ROOT_PARENT
        for d in range(6):
            chain.append(node_block(parent, d * BS, tokens[d * BS:(d + 1) * BS]))
            parent = chain[-1].key
        sibling = node_block(chain[2].key, 3 * BS, tokens[3 * BS:4 * BS - 1])  # a tail
        for block in [*chain, sibling]:
            assert manager.put(block)
        manager.flush()
        keys = [b.key for b in chain]
        parents = [ROOT_PARENT, *keys]
        route = route_of(parents, tokens, BS)
        manifest = manager.tier("ssd")._manifest
        routed = text_rows(manifest.child_rows(parents, FP, route))
        stored = manifest.child_rows(parents, FP)
        assert sorted(routed) == sorted(stored) and len(routed) == 7
        with sqlite3.connect(tmp_path / "manifest.sqlite") as db:
            for block, column, value in ((chain[1], "token_ids", encode_token_ids(
                    np.full(BS, 5))), (chain[1], "fingerprint", "ef" * 32),
                    (chain[4], "tokens", BS - 1)):
                db.execute(f"UPDATE blocks SET {column} = ? WHERE key = ?", (value, block.key))
        routed = {row[0]: row for row in text_rows(manifest.child_rows(parents, FP, route))}
        assert routed[chain[1].key] == next(r for r in stored if r[0] == chain[1].key)
        assert routed[chain[4].key][4] == BS - 1   # read: the stored count
        assert routed[chain[4].key][5] == next(r for r in stored if r[0] == chain[4].key)[5]
        tiers, nodes = manager.chain(keys, FP, tokens=tokens)
        assert None not in tiers and chain[1].key in {n.key for n in nodes[chain[0].key]}
        assert manager.stats()["nodes_rejected"] == 0


def test_token_ids_take_the_narrowest_text_form_whatever_their_array_type() -> None:
    """A route's ids (unsigned, big-endian) and a request's (int64) give the same text form: the
    narrowest of u2 / i4 / i8 holding them, decoded back to the same ids."""
    from paged_cache.hashing import decode_token_ids

    for top, code in ((0, "u2"), (65535, "u2"), (65536, "i4"), (2**31 - 1, "i4"),
                      (2**31, "i8"), (2**32 - 1, "i8")):
        ids = np.array([0, 7, top], dtype=np.int64)
        want = encode_token_ids(ids)
        assert want.startswith(code + ":")
        for dtype in (">u4", "<u4", "<u2", "<u1", "<i8", "<i4"):
            if np.iinfo(np.dtype(dtype)).max < top:
                continue
            assert encode_token_ids(ids.astype(dtype)) == want, (top, dtype)
        assert encode_token_ids(ids.tolist()) == want
        assert decode_token_ids(want).tolist() == ids.tolist()
    assert encode_token_ids(np.zeros(0, dtype=">u4")) == encode_token_ids([])
