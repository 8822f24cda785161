"""Damaged block files: every one is a counted miss and is removed; the caller never sees an
exception; intact blocks stay exact; a prefix-cache fetch stops the chain at the first bad block.

Damage is done for real to files on disk: bit flips, truncation, zero length, garbage headers,
absurd header lengths, appended bytes, another model's file under this name, another block's file,
and two files whose names were swapped. Each case is applied while the manager is open, while it
is closed (then reopened), or with the manifest row also deleted (the file is adopted at open).
"""

from __future__ import annotations

import random
import sqlite3
from pathlib import Path

import pytest

from paged_cache.block import Block
from paged_cache.hashing import chain_keys
from paged_cache.manager import PagedSSDCacheManager
from paged_cache.prefix_cache import BlockAwarePrefixCache
from paged_cache.testing import tiny_model
from paged_cache.tiers.ssd.files import MANIFEST_NAME
from helpers.blocks import block_files, key_of, random_block, same_block
from helpers.managers import new_manager
from reliability_support import DAMAGE_KINDS, SMALL, audit, damage, manifest_rows
from helpers.prefix import assert_exact, prompt, store_prompt

MODES = ("open", "reopen", "unindexed")


def _outcome(manager: PagedSSDCacheManager, want: Block) -> str:
    """Return "served" (bit-exact) or "missed"; a wrong block or an exception fails the test."""
    got = manager.get(want.key)
    if got is None:
        return "missed"
    assert same_block(got, want), "a damaged file was served as a different block"
    return "served"


def _drop_row(root: Path, key: str) -> None:
    with sqlite3.connect(root / MANIFEST_NAME) as db:
        db.execute("DELETE FROM blocks WHERE key = ?", (key,))


def test_damaged_files_are_counted_misses(tmp_path: Path, long_run: bool, record) -> None:
    root = tmp_path / "cache"
    rng = random.Random(777)
    cases = 1000 if long_run else 100
    opts = dict(hot_cache_max_bytes=0)        # every read goes to the file
    bystanders = [random_block(key_of(i, "bystander")) for i in range(4)]
    manager = new_manager(root, **SMALL | dict(**opts))
    for b in bystanders:
        manager.put(b)
    tally = {kind: {"missed": 0, "served": 0} for kind in DAMAGE_KINDS}
    for case in range(cases):
        kind, mode = DAMAGE_KINDS[case % len(DAMAGE_KINDS)], rng.choice(MODES)
        victim = random_block(key_of(case, "victim"))
        other = random_block(key_of(case, "other"), model="other-model" if kind == "wrong_model"
                          else "reliability-model")
        manager.put(victim)
        manager.put(other)
        manager.flush()
        files = block_files(root)
        path, other_path = files[victim.key], files[other.key]
        if mode != "open":
            manager.close()
        damage(path, kind, rng, other_path)
        if mode == "unindexed":
            _drop_row(root, victim.key)
        if mode != "open":
            manager = new_manager(root, **SMALL | dict(**opts, compression=rng.choice(["none", "lz4"])))
            assert manager.tier("ssd").wait_reconciled(timeout=60)  # an unindexed file: adopted?
        before = manager.stats()["ssd"]["damaged"] if mode == "open" else 0

        hurt = [victim, other] if kind == "swapped_names" else [victim]
        outcomes = [_outcome(manager, b) for b in hurt]
        for b, outcome in zip(hurt, outcomes):
            tally[kind][outcome] += 1
            if outcome == "missed":
                assert b.key not in block_files(root), "a damaged file was left in place"
        assert manager.stats()["ssd"]["damaged"] - before == outcomes.count("missed")
        if kind != "swapped_names":
            assert same_block(manager.get(other.key), other)   # the file it was copied from
        manager.flush()
        rows = manifest_rows(root)
        assert all(b.key not in rows for b, o in zip(hurt, outcomes) if o == "missed")
        for b in (victim, other):
            manager.discard(b.key)
    for b in bystanders:
        assert same_block(manager.get(b.key), b)
    manager.close()
    audit(root)
    harmless = {k: v["served"] for k, v in tally.items() if v["served"]}
    assert set(harmless) <= {"bit_flips"}, f"only a flip in header padding may be harmless: {tally}"
    record("damage", cases=cases, damaged_files=sum(v["missed"] for v in tally.values()),
           harmless_flips=sum(harmless.values()), by_kind=tally)


CHAIN_DAMAGE = ["zero_length", "bit_flips", "swapped_names", "truncated", "garbage_header",
                "wrong_model"]   # the index is the damaged block k (5: the partial tail block)


@pytest.mark.parametrize("kind", CHAIN_DAMAGE)
def test_fetch_stops_the_chain_at_the_first_bad_block(tmp_path: Path, kind: str) -> None:
    """A chain of 6 blocks (the last partial) from a tiny llama, on SSD only; block k is damaged:
    fetch returns n == k * block_size with exact logits, and storing again heals the chain."""
    block = 16
    model = tiny_model("llama")
    root = tmp_path / "cache"
    rng = random.Random(kind)
    k = CHAIN_DAMAGE.index(kind)
    with new_manager(root, **SMALL | dict(block_size=block, hot_cache_max_bytes=0)) as manager:
        prefix = BlockAwarePrefixCache(manager, model)
        tokens = store_prompt(model, prefix, prompt(5 * block + 7))
        manager.flush()
        keys = chain_keys(prefix.fingerprint, "", tokens, block)
        files = block_files(root)
        assert len(keys) == 6 and set(keys) <= set(files)
        other = files[keys[(k + 1) % 6]]     # swapped_names: k and k + 1 swap; k is the first bad
        if kind == "wrong_model":   # the same position's block stored by another model
            other_model = tiny_model("llama", seed=1)
            alien = BlockAwarePrefixCache(manager, other_model, model_id="other")
            store_prompt(other_model, alien, tokens)
            manager.flush()
            other = block_files(root)[chain_keys(alien.fingerprint, "", tokens, block)[k]]
        damage(files[keys[k]], kind, rng, other)
    with new_manager(root, **SMALL | dict(block_size=block, hot_cache_max_bytes=0)) as manager:   # a restart
        prefix = BlockAwarePrefixCache(manager, model)
        query = tokens + [1, 2, 3]
        assert assert_exact(model, prefix, query) == k * block
        assert manager.stats()["ssd"]["damaged"] >= 1
        assert keys[k] not in block_files(root)
        # Storing again rewrites the missing block; a second bad block (swapped_names: k + 1) is
        # only found by the next fetch, and the store after that heals it too.
        for _ in range(2):
            store_prompt(model, prefix, tokens)
            n = assert_exact(model, prefix, query)
        assert n == len(tokens)
