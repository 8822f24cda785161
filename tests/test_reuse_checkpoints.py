"""Fetch returns the longest prefix every layer can be rebuilt at, over every stored branch, and
stores leave checkpoints where recurrent / windowed state would otherwise be missing.

Stores here are made as mlx_lm.server makes them (no boundary snapshots: a cache at the end of a
segment) unless a test says otherwise; every fetch is checked against a cold run with the same
chunking (max abs diff 0.0 of the logits, prefill and decode).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from paged_cache.config import CacheConfig
from paged_cache.hashing import chain_keys
from paged_cache.manager import PagedSSDCacheManager
from paged_cache.prefix_cache import BlockAwarePrefixCache
from paged_cache.testing import tiny_model
from paged_cache.tiers.ssd.tier import SSDTier
from paged_cache.scheduler import Scheduler
from helpers.prefix import assert_exact, prefill, prompt, store_prompt
from helpers.managers import new_manager

BLOCK = 16
ARCHS = ["llama", "gemma3_text", "qwen3_next", "mamba", "baichuan_m1", "llama4"]
RECURRENT = ["qwen3_next", "mamba", "baichuan_m1"]


def segment_store(model, prefix: BlockAwarePrefixCache, tokens: list[int]) -> None:
    """Prefill ``tokens`` in block-aligned chunks without snapshots and store the cache."""
    cache = prefix.make_cache()
    prefill(model, cache, tokens, 0, prefix.block_size)
    prefix.store(tokens, cache)


@pytest.mark.parametrize("ssd", [False, True], ids=["hot", "ssd"])
@pytest.mark.parametrize("arch", ARCHS)
def test_shared_system_prompt_is_reused_whole(tmp_path: Path, arch: str, ssd: bool) -> None:
    """System segment stored, then a request through it (its full block crossing the segment end
    has no state there): a new request over the same system prompt restores the whole segment
    from the shorter sibling, the longer branch not standing in its way."""
    model = tiny_model(arch)
    system = prompt(45, seed=1)
    with new_manager(tmp_path if ssd else None, block_size=BLOCK) as manager:
        prefix = BlockAwarePrefixCache(manager, model)
        segment_store(model, prefix, system)
        segment_store(model, prefix, system + prompt(30, seed=2))
        assert assert_exact(model, prefix, system + prompt(20, seed=3)) == len(system)
        assert prefix.last_fetch.tokens_shared == len(system)


@pytest.mark.parametrize("arch", RECURRENT)
def test_store_through_a_stateless_block_end_leaves_a_checkpoint(arch: str) -> None:
    """A longer conversation stored first holds no state at 32; storing the 32-token prefix then
    finds its blocks held and writes a checkpoint (state only, no KV rows a block holds)."""
    model = tiny_model(arch)
    with new_manager(block_size=BLOCK) as manager:
        prefix = BlockAwarePrefixCache(manager, model)
        long = prompt(60, seed=4)
        segment_store(model, prefix, long)
        assert prefix.fetch(long[:32] + [1, 2])[1] == 0  # no state at 32 (nor before)
        segment_store(model, prefix, long[:32])
        st = prefix.stats()
        assert st["checkpoints_written"] == 1 and st["blocks_written"] == 4
        assert assert_exact(model, prefix, long[:32] + [1, 2]) == 32
        keys = chain_keys(prefix.fingerprint, "", long[:32], BLOCK)
        _, kids = manager.chain(keys, prefix.fingerprint)
        ckpt = [n for n in kids[keys[0]] if n.checkpoint]
        assert len(ckpt) == 1 and ckpt[0].end == 32 and ckpt[0].restorable
        block = manager.get(ckpt[0].key)
        for i, full_history in enumerate(not s for s in prefix.layout.snapshot_layers):
            names = [k for k in block.arrays if k.startswith(f"l{i}.")]
            assert not names if full_history else names  # KV layers: rows stay in the blocks


@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_fetch_after_restart_costs_one_manifest_query(tmp_path: Path, arch: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A fetch of a chain under 64 blocks (tiers/listing.py) in a new process asks the manifest
    once, and looks at no block file to learn where the chain is (the manifest's rows say it);
    only the first key past the stored chain is looked for on disk."""
    model = tiny_model(arch)
    tokens = prompt(20 * BLOCK + 5, seed=6)
    with new_manager(tmp_path, block_size=BLOCK) as manager:
        segment_store(model, BlockAwarePrefixCache(manager, model), tokens)
    looked = []
    contains = SSDTier.contains
    monkeypatch.setattr(SSDTier, "contains", lambda t, key: looked.append(key) or contains(t, key))
    with new_manager(tmp_path, block_size=BLOCK) as manager:
        prefix = BlockAwarePrefixCache(manager, model)
        before = manager.stats()["ssd"]["chain_lookups"]
        cache, n = prefix.fetch(tokens + [3])
        assert n == len(tokens)
        assert manager.stats()["ssd"]["chain_lookups"] - before == 1
        assert looked == []
        before = manager.stats()["ssd"]["chain_lookups"]
        prefix.fetch(tokens[:5 * BLOCK + 3] + [9])
        assert manager.stats()["ssd"]["chain_lookups"] - before == 1
        assert looked == []
        other = tokens[:3 * BLOCK] + prompt(2 * BLOCK, seed=7)
        prefix.fetch(other + [1])
        assert looked == chain_keys(prefix.fingerprint, "", other, BLOCK)[3:4]


def test_block_file_removed_behind_the_manifest(tmp_path: Path) -> None:
    """The manifest says where a chain is; a block file deleted behind its back (by hand, or by
    a crash between unlink and row delete) costs one failed read: the fetch restores exactly up
    to the missing block, and from the next flush its row is gone, so lookups stop listing it."""
    model = tiny_model("llama")
    tokens = prompt(4 * BLOCK, seed=8)
    config = CacheConfig(block_size=BLOCK, ssd_dir=tmp_path, hot_cache_max_bytes="1KiB")
    with PagedSSDCacheManager(config) as manager:  # every block on SSD only
        prefix = BlockAwarePrefixCache(manager, model)
        segment_store(model, prefix, tokens)
        manager.flush()
        keys = chain_keys(prefix.fingerprint, "", tokens, BLOCK)
        assert manager.chain(keys, prefix.fingerprint)[0] == ["ssd"] * 4
        (path,) = (tmp_path / "blocks" / keys[2][:2]).glob(keys[2] + "*")
        path.unlink()
        misses = manager.stats()["ssd"]["misses"]
        assert assert_exact(model, prefix, tokens + [5]) == 2 * BLOCK
        assert manager.stats()["ssd"]["misses"] == misses + 1
        manager.flush()
        tiers, kids = manager.chain(keys, prefix.fingerprint)
        assert tiers[2:] == [None, None]
        assert keys[2] not in {n.key for n in kids.get(keys[1], [])}


def test_namespaces_do_not_share_root_nodes(tmp_path: Path) -> None:
    """Root nodes of every namespace share the parent "": a fetch only takes its own."""
    model = tiny_model("qwen3_next")
    tokens = prompt(BLOCK + 5, seed=8)
    with new_manager(tmp_path, block_size=BLOCK) as manager:
        segment_store(model, BlockAwarePrefixCache(manager, model, namespace="a"), tokens)
        other = BlockAwarePrefixCache(manager, model, namespace="b")
        assert other.fetch(tokens + [1]) == (None, 0)
        assert assert_exact(model, BlockAwarePrefixCache(manager, model, namespace="a"),
                            tokens + [1]) == len(tokens)


@pytest.mark.parametrize("arch", RECURRENT + ["llama4", "gemma3_text"])
def test_scheduler_branch_reuses_to_the_block_then_to_the_token(arch: str) -> None:
    """A request branching 13 tokens into the third block reuses the two blocks before it (one
    block per prefill chunk: a state at every boundary); the prefill ends a chunk where the
    stored match ends and stores a checkpoint there, so the next request reuses all 77 tokens.
    Generated tokens equal a cold run's."""
    model = tiny_model(arch)
    block = 32
    with new_manager(block_size=block) as manager:
        prefix = BlockAwarePrefixCache(manager, model)
        sched = Scheduler(model, prefix)
        cold = Scheduler(model, None, block_size=block, prefill_chunk_size=block)
        base = prompt(3 * block + 10, seed=9)
        sched.generate(base, max_tokens=4)
        branch = base[:2 * block + 13] + prompt(20, seed=10)
        got = sched.generate(branch, max_tokens=4)
        assert got.cached_tokens >= 2 * block
        assert got.tokens == cold.generate(branch, max_tokens=4).tokens
        again = branch[:2 * block + 13] + prompt(9, seed=11)
        got = sched.generate(again, max_tokens=4)
        assert got.cached_tokens == 2 * block + 13
        assert got.tokens == cold.generate(again, max_tokens=4).tokens
        assert sched.stats()["snapshot_bytes"] == 0


@pytest.mark.parametrize("arch", RECURRENT)
def test_scheduler_checkpoints_make_the_system_prompt_reusable(arch: str) -> None:
    """``checkpoints=[end of system prompt]`` on the first conversation: the second and third
    reuse the whole system prompt; without it the third does (the second leaves one)."""
    model = tiny_model(arch)
    block = 32
    system = prompt(70, seed=12)
    with new_manager(block_size=block) as manager:
        sched = Scheduler(model, BlockAwarePrefixCache(manager, model))
        sched.generate(system + prompt(20, seed=13), max_tokens=3, checkpoints=[len(system)])
        assert sched.generate(system + prompt(25, seed=14), max_tokens=3).cached_tokens == 70
    with new_manager(block_size=block) as manager:
        sched = Scheduler(model, BlockAwarePrefixCache(manager, model))
        sched.generate(system + prompt(20, seed=13), max_tokens=3)
        assert sched.generate(system + prompt(25, seed=14), max_tokens=3).cached_tokens == 64
        assert sched.generate(system + prompt(30, seed=15), max_tokens=3).cached_tokens == 70
        assert sched.stats()["match_checkpoints"] == 1


def test_checkpoints_argument_is_checked() -> None:
    model = tiny_model("mamba")
    with PagedSSDCacheManager(CacheConfig(hot_cache_only=True, block_size=16)) as manager:
        sched = Scheduler(model, BlockAwarePrefixCache(manager, model))
        with pytest.raises(ValueError, match="checkpoints: expected positions in"):
            sched.submit([1, 2, 3], checkpoints=[4])
        with pytest.raises(ValueError, match="checkpoints"):
            sched.submit([1, 2, 3], checkpoints=["a"])


def test_inspect_counts_checkpoints(tmp_path: Path) -> None:
    """`paged-cache inspect --json` shows how many of a model's blocks are checkpoints, and
    counts their tokens once (in the blocks that hold them)."""
    import json
    import subprocess
    import sys

    model = tiny_model("mamba")
    long = prompt(60, seed=4)
    with new_manager(tmp_path, block_size=BLOCK) as manager:
        prefix = BlockAwarePrefixCache(manager, model)
        segment_store(model, prefix, long)
        segment_store(model, prefix, long[:32])
        assert prefix.stats()["checkpoints_written"] == 1
    out = subprocess.run([sys.executable, "-m", "paged_cache.cli.main", "inspect", str(tmp_path),
                          "--json"], capture_output=True, text=True, check=True)
    (model_row,) = json.loads(out.stdout)["models"]
    assert model_row["checkpoints"] == 1 and model_row["tokens"] == len(long)


@pytest.mark.parametrize("ssd", [False, True], ids=["hot", "ssd"])
@pytest.mark.parametrize("arch", ["baichuan_m1", "gemma3_text"])
def test_after_a_mid_prefill_store_the_snapshots_restore_every_boundary(tmp_path: Path, arch: str,
                                                                       ssd: bool) -> None:
    """A store at a 7-token partial block during prefill, then boundary snapshots at 8, 16, ...
    (each holding the window's rows since the previous one) and a store once the window has
    dropped the first rows: rows 0-6 live only in the 7-token node (turned into a checkpoint).
    Every boundary is restored, with those rows taken from it (before: 7 tokens reused)."""
    block = 8
    model = tiny_model(arch)
    window = 64 if arch == "gemma3_text" else 32
    tokens = prompt(window + 40, seed=4)
    config = CacheConfig(block_size=block, hot_cache_only=True) if not ssd else \
        CacheConfig(block_size=block, ssd_dir=tmp_path)
    with PagedSSDCacheManager(config) as manager:
        prefix = BlockAwarePrefixCache(manager, model)
        cache = prefix.make_cache()
        prefill(model, cache, tokens[:7], 0, 7)
        prefix.store(tokens[:7], cache)
        snaps, since = {}, 7
        for end in range(block, len(tokens) - 7, block):
            prefill(model, cache, tokens[:end], since, block)
            snaps[end] = prefix.capture_boundary(cache, since)
            since = end
        prefill(model, cache, tokens[:since + 1], since, block)
        prefix.store(tokens[:since + 1], cache, snapshots=snaps)
        for n in (24, 32, window):
            assert assert_exact(model, prefix, tokens[:n] + [255, 254]) == n


@pytest.mark.parametrize("ssd", [False, True])
def test_a_checkpoint_restores_a_cache_list_that_needs_no_state(tmp_path: Path, ssd: bool) -> None:
    """longcat_flash_ngram: a recurrent n-gram state and a CacheList of KV layers. A checkpoint
    holds the state; its CacheList descriptor lists its members (holding nothing), as every
    block's does. (It was a bare ``{"has_rows": false}``: the fetch at the checkpoint raised
    KeyError 'members'.)"""
    model = tiny_model("longcat_flash_ngram")
    base = prompt(5 * BLOCK + 3)
    with new_manager(tmp_path if ssd else None, block_size=BLOCK) as manager:
        prefix = BlockAwarePrefixCache(manager, model)
        store_prompt(model, prefix, base)
        store_prompt(model, prefix, base[:3 * BLOCK + 5])
        assert prefix.stats()["checkpoints_written"] >= 1
        assert assert_exact(model, prefix, base[:3 * BLOCK + 5] + [1]) == 3 * BLOCK + 5
