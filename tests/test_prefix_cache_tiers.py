"""Chains served from the SSD tier (after a manager restart) equal chains served hot; lz4 on/off."""

from __future__ import annotations

from pathlib import Path

import pytest

from paged_cache.config import CacheConfig
from paged_cache.hashing import chain_keys
from paged_cache.manager import PagedSSDCacheManager
from paged_cache.prefix_cache import BlockAwarePrefixCache
from paged_cache.testing import tiny_model

from helpers.prefix import assert_exact, hot_prefix, prompt, store_prompt

# these tests assert what a restore from SSD does; with the fetch plan a tiny model's measured
# prefill may beat it (tests/test_fetch_plan.py and test_fetch_cutoff.py test the plan)
RESTORE = "always-restore"


@pytest.mark.parametrize("arch,compression", [("llama", "none"), ("qwen3_next", "lz4"),
                                              ("gemma3_text", "lz4")])
def test_ssd_after_restart_equals_hot(tmp_path: Path, arch: str, compression: str) -> None:
    block = 16
    model = tiny_model(arch)
    config = CacheConfig(block_size=block, ssd_dir=tmp_path, compression=compression,
                         fetch_policy=RESTORE)
    tokens = prompt(5 * block + 3)
    with PagedSSDCacheManager(config) as manager:
        stored = store_prompt(model, BlockAwarePrefixCache(manager, model), tokens)
    queries = [stored + [1, 2], stored[:3 * block + 2] + [9] * 6, stored[:2 * block] + [9] * 6]
    hot = hot_prefix(model, block)
    hot_n = []
    for q in queries:  # hot_cache_only hands an unshared chain over on fetch: store it again
        store_prompt(model, hot, tokens)
        hot_n.append(assert_exact(model, hot, q))
    with PagedSSDCacheManager(config) as manager:  # a new process's view: files + manifest only
        prefix = BlockAwarePrefixCache(manager, model)
        ssd_n = []
        for q in queries:
            ssd_n.append(assert_exact(model, prefix, q))
            assert prefix.last_fetch.tier in ("ssd", "hot", "mixed")
        assert prefix.stats()["hits"] == 3
    # Both exact, and a new process reuses as much as the hot run (token-granular where the
    # architecture is): the children of a block are listed from the SSD manifest.
    assert ssd_n[0] == len(stored)
    assert ssd_n == hot_n


@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_restart_then_store_under_a_shared_parent_keeps_other_tails(tmp_path: Path, arch: str) -> None:
    """After a restart, storing one chain under a shared parent must not hide the other tails
    already on disk under it: every query reuses exactly what it reused before the restart."""
    block = 16
    model = tiny_model(arch)
    config = CacheConfig(block_size=block, ssd_dir=tmp_path, fetch_policy=RESTORE)
    system = prompt(2 * block)
    long_tail = system + prompt(block + 7, seed=1)   # a full block + a partial tail under system
    short_tail = system + prompt(5, seed=2)          # a partial tail right under system
    queries = [long_tail[:2 * block + 9] + [7] * 5,  # diverges inside long_tail's full block
               short_tail + [1, 2], long_tail + [3]]
    with PagedSSDCacheManager(config) as manager:
        prefix = BlockAwarePrefixCache(manager, model)
        for tokens in (long_tail, short_tail):
            store_prompt(model, prefix, tokens)
        before = [assert_exact(model, prefix, q) for q in queries]
        # a fetch hands a whole partial tail over unwritten (tails wait in RAM until close):
        # the request's own store puts it back, as a server's insert does
        for tokens in (long_tail, short_tail):
            store_prompt(model, prefix, tokens)
    granular = arch == "llama"
    assert before == [2 * block + (9 if granular else 0), len(short_tail), len(long_tail)]
    with PagedSSDCacheManager(config) as manager:
        prefix = BlockAwarePrefixCache(manager, model)
        store_prompt(model, prefix, system + prompt(block + 3, seed=3))  # indexes system's key
        after = [assert_exact(model, prefix, q) for q in queries]
        assert prefix.last_fetch.tier in ("ssd", "mixed")
    assert after == before


def test_weights_are_part_of_the_model_identity(tmp_path: Path) -> None:
    """Same config, different weights: different fingerprints, no shared blocks; the same seed
    rebuilt in a new process gets the same fingerprint and reuses its blocks from SSD."""
    block = 16
    config = CacheConfig(block_size=block, ssd_dir=tmp_path, fetch_policy=RESTORE)
    one, two = tiny_model("llama", seed=1), tiny_model("llama", seed=2)
    tokens = prompt(2 * block + 8)
    with PagedSSDCacheManager(config) as manager:
        first, second = BlockAwarePrefixCache(manager, one), BlockAwarePrefixCache(manager, two)
        assert first.fingerprint != second.fingerprint
        store_prompt(one, first, tokens)
        assert second.fetch(tokens + [1]) == (None, 0)
        assert store_prompt(two, second, tokens) and second.stats()["blocks_written"] == 3
        assert manager.stats()["puts"] == 6
        # an explicit model_id overrides the computed identity (the caller vouches for the weights)
        assert (BlockAwarePrefixCache(manager, one, model_id="m").fingerprint
                == BlockAwarePrefixCache(manager, two, model_id="m").fingerprint)
        fingerprint = first.fingerprint
    with PagedSSDCacheManager(config) as manager:
        rebuilt = tiny_model("llama", seed=1)
        prefix = BlockAwarePrefixCache(manager, rebuilt)
        assert prefix.fingerprint == fingerprint
        assert assert_exact(rebuilt, prefix, tokens + [1]) == len(tokens)
        other = BlockAwarePrefixCache(manager, tiny_model("llama", seed=2))
        assert assert_exact(two, other, tokens + [1]) == len(tokens)  # its own blocks, exact


def test_weights_digest_sees_a_small_weight_change() -> None:
    """A fine-tune-like change (every weight nudged) changes the digest; an identical copy does not."""
    from mlx.utils import tree_map

    from paged_cache.hashing import weights_digest

    model = tiny_model("llama")
    digest = weights_digest(model)
    assert weights_digest(tiny_model("llama")) == digest
    model.update(tree_map(lambda p: p * 1.001, model.parameters()))
    assert weights_digest(model) != digest


def test_root_children_listed_from_ssd_respect_namespaces(tmp_path: Path) -> None:
    """Root blocks of every namespace share the manifest's parent "": a new process lists them
    but only ever extends with its own namespace's (the key is checked against the token ids)."""
    block = 16
    model = tiny_model("llama")
    config = CacheConfig(block_size=block, ssd_dir=tmp_path, fetch_policy=RESTORE)
    tokens = prompt(block - 4)  # a partial root block only
    with PagedSSDCacheManager(config) as manager:
        store_prompt(model, BlockAwarePrefixCache(manager, model, namespace="a"), tokens)
    with PagedSSDCacheManager(config) as manager:
        other = BlockAwarePrefixCache(manager, model, namespace="b")
        assert other.fetch(tokens[:8] + [1, 2]) == (None, 0)
        own = BlockAwarePrefixCache(manager, model, namespace="a")
        assert assert_exact(model, own, tokens[:8] + [1, 2]) == 8  # token-granular in a root tail


def _block_bytes(model, block: int) -> int:
    """Hot bytes of one full block of ``model``'s layout (stored through a probe prefix cache)."""
    probe = hot_prefix(model, block)
    store_prompt(model, probe, prompt(block))
    return probe.manager.hot_bytes


@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_hot_budget_smaller_than_a_conversation_keeps_its_prefix(arch: str) -> None:
    """hot_cache_only, budget of 4.5 blocks: a 10-block chain keeps its first 4 blocks reachable
    (plain LRU kept the last ones, unreachable: no hit at all), and over a growing multi-turn
    conversation every turn still hits its longest resident prefix, exactly."""
    block = 16
    model = tiny_model(arch)
    budget = 4 * _block_bytes(model, block) + _block_bytes(model, block) // 2
    config = CacheConfig(hot_cache_only=True, block_size=block, hot_cache_max_bytes=budget)
    tokens = prompt(10 * block + 5)
    with PagedSSDCacheManager(config) as manager:
        prefix = BlockAwarePrefixCache(manager, model)
        store_prompt(model, prefix, tokens)
        assert manager.hot_bytes <= budget
        assert assert_exact(model, prefix, tokens + [1]) == 4 * block
    with PagedSSDCacheManager(config) as manager:  # the memory benchmark's session, in small
        prefix = BlockAwarePrefixCache(manager, model)
        history: list[int] = []
        for turn in range(6):
            query = history + prompt(block + block // 2, seed=turn + 1)
            n = assert_exact(model, prefix, query) if turn else 0
            if turn:
                assert n == min(len(history), 4 * block)
            history = store_prompt(model, prefix, query, decode=2)
            assert manager.hot_bytes <= budget


@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_superseded_partial_tails_never_block_hand_over(tmp_path: Path, arch: str) -> None:
    """Each turn stores its prompt (end of prefill) and prompt + reply (end of generation), so
    a parent collects partial tails the next turn's full block extends. KV-only layouts discard a
    tail once a longer sibling serves its tokens; recurrent layouts keep its state (as a
    checkpoint: not in the longer block) but it does not count as another conversation: every
    used full block of every turn is handed over, exactly, and what is not dominated stays
    reusable."""
    block = 16
    model = tiny_model(arch)
    config = CacheConfig(block_size=block, ssd_dir=tmp_path, fetch_policy=RESTORE)
    with PagedSSDCacheManager(config) as manager:
        prefix = BlockAwarePrefixCache(manager, model)
        history = store_prompt(model, prefix, prompt(2 * block + 5))
        for turn in range(3):
            query = history + prompt(block // 2 + 3, seed=turn + 1)
            taken = prefix.stats()["blocks_taken"]
            assert assert_exact(model, prefix, query) > 0
            # every used block is handed over; recurrent layouts keep their partial tails (the
            # next store turns them into checkpoints)
            used = prefix.last_fetch
            assert prefix.stats()["blocks_taken"] - taken == (
                used.blocks if arch == "llama" else used.tokens_matched // block)
            store_prompt(model, prefix, query)                 # end of prefill: a partial tail
            history = store_prompt(model, prefix, query, decode=3)   # end of generation
        full = len(history) // block * block
        assert len(query) // block * block == full   # both tails hang under the same parent
        keys = chain_keys(prefix.fingerprint, prefix.namespace, history[:full], block)
        tails = [n for n in manager.chain(keys, prefix.fingerprint)[1].get(keys[-1], [])
                 if len(n.token_ids) < block]
        assert len(tails) == 1 if arch == "llama" else len(tails) >= 2  # qwen3_next keeps them
        # KV: token-granular through the longer tail; recurrent: the tail's state at its end
        if arch == "llama":
            assert assert_exact(model, prefix, history[:len(query) + 2] + [7]) == len(query) + 2
        else:
            assert assert_exact(model, prefix, history + [7]) == len(history)
