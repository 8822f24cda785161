"""Property-based tests: prefix cache + manager against a reference model of what must be
fetchable, fuzzed block files on disk, fuzzed configuration values."""

from __future__ import annotations

import random
import shutil
import sqlite3
import tempfile
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from paged_cache.config import CacheConfig
from paged_cache.hashing import chain_keys
from paged_cache.prefix_cache import BlockAwarePrefixCache
from paged_cache.testing import tiny_model
from paged_cache.tiers.ssd.files import MANIFEST_NAME
from helpers.blocks import block_files, key_of, random_block, same_block
from helpers.managers import new_manager
from reliability_support import SMALL, damage
from helpers.prefix import assert_exact, store_prompt

BLOCK = 4
HOT = 6 << 10
MODEL = tiny_model("llama")
token_lists = st.lists(st.integers(0, 4), min_size=2, max_size=18)
TALLY: Counter = Counter()   # what the state machine did, for the record


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class PrefixCacheMachine(RuleBasedStateMachine):
    """Stores, fetches, discards, damaged files and restarts; the reference model knows which
    blocks are held. Every fetch must be exact (logits diff 0.0), must cover at least the held
    full blocks of the query's chain, and never more than some stored sequence shares with it."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="paged-cache-rel-sm-"))
        self.stored: list[list[int]] = []
        self.held: set[str] = set()
        self.open()

    def open(self) -> None:
        self.manager = new_manager(self.dir, **SMALL | dict(block_size=BLOCK, hot_cache_max_bytes=HOT, queue_full_policy="write-on-caller"))
        self.prefix = BlockAwarePrefixCache(self.manager, MODEL)

    def keys(self, tokens: list[int]) -> list[str]:
        return chain_keys(self.prefix.fingerprint, "", tokens, BLOCK)

    @rule(tokens=token_lists, extra=st.integers(0, 4))
    def store(self, tokens: list[int], extra: int) -> None:
        store_prompt(MODEL, self.prefix, tokens)
        TALLY["stores"] += 1
        self.stored.append(tokens)
        self.held.update(self.keys(tokens))
        # the continuation of what was just stored reuses all of it
        assert self.check_fetch(tokens + [extra]) == len(tokens)

    @rule(tokens=token_lists, base=st.integers(0, 1000), cut=st.integers(0, 18))
    def fetch(self, tokens: list[int], base: int, cut: int) -> None:
        if self.stored and base % 4:   # mostly queries that share a prefix with a stored one
            tokens = self.stored[base % len(self.stored)][:cut] + tokens
        self.check_fetch(tokens)

    def check_fetch(self, tokens: list[int]) -> int:
        n = assert_exact(MODEL, self.prefix, tokens)
        TALLY["fetches"] += 1
        TALLY["fetch_hits"] += n > 0
        full = 0
        for key in self.keys(tokens)[: len(tokens) // BLOCK]:
            if key not in self.held:
                break
            full += BLOCK
        assert n >= min(full, len(tokens) - 1), "a held chain was not fetched"
        assert n <= max((_lcp(tokens, s) for s in self.stored), default=0)
        return n

    @precondition(lambda self: self.held)
    @rule(pick=st.integers(0, 10**6))
    def discard(self, pick: int) -> None:
        key = sorted(self.held)[pick % len(self.held)]
        self.manager.discard(key)
        self.held.discard(key)
        TALLY["discards"] += 1

    @precondition(lambda self: self.held)
    @rule(pick=st.integers(0, 10**6), kind=st.sampled_from(["zero_length", "bit_flips", "truncated"]))
    def damage_a_file(self, pick: int, kind: str) -> None:
        key = sorted(self.held)[pick % len(self.held)]
        self.manager.flush()          # "pending" vs "ssd" must not depend on the writer's timing
        if self.manager.tier_of(key) != "ssd":
            return
        damage(block_files(self.dir)[key], kind, random.Random(pick))
        before = self.manager.stats()["ssd"]["damaged"]
        got = self.manager.get(key)
        if got is None:                 # found: a counted miss, the file is gone
            assert self.manager.stats()["ssd"]["damaged"] == before + 1
            assert key not in block_files(self.dir)
            self.held.discard(key)
            TALLY["damaged_found"] += 1

    @rule(chance=st.integers(0, 3))
    def restart(self, chance: int) -> None:
        if chance != 3:      # restarts are rarer than the other steps
            return
        TALLY["restarts"] += 1
        self.manager.close()
        self.open()

    @invariant()
    def hot_budget_holds(self) -> None:
        assert self.manager.stats()["hot"]["bytes"] <= HOT

    def teardown(self) -> None:
        self.manager.close()
        shutil.rmtree(self.dir, ignore_errors=True)


TestPrefixCacheMachine = PrefixCacheMachine.TestCase


@pytest.fixture(autouse=True)
def _sizes(long_run: bool, record, request: pytest.FixtureRequest):
    TestPrefixCacheMachine.settings = settings(
        max_examples=150 if long_run else 10, stateful_step_count=30 if long_run else 25,
        deadline=None, suppress_health_check=list(HealthCheck))
    TALLY.clear()
    yield
    if TALLY:
        record(request.node.name, **TALLY)


# ------------------------------------------------------------------------------ fuzzed block files

mutations = st.lists(st.tuples(st.sampled_from(["flip", "set", "cut", "insert", "delete"]),
                               st.integers(0, 1 << 16), st.integers(0, 255)),
                     min_size=1, max_size=6)


def _mutate(data: bytes, ops: list[tuple[str, int, int]]) -> bytes:
    buf = bytearray(data)
    for op, pos, value in ops:
        pos = pos % (len(buf) + 1)
        if op == "flip" and pos < len(buf):
            buf[pos] ^= 1 << (value % 8)
        elif op == "set" and pos < len(buf):
            buf[pos] = value
        elif op == "cut":
            del buf[pos:]
        elif op == "insert":
            buf[pos:pos] = bytes([value]) * (1 + value % 9)
        elif op == "delete":
            del buf[pos:pos + 1 + value % 9]
    return bytes(buf)


def _fuzz_settings(long_run: bool):
    return settings(max_examples=1000 if long_run else 120, deadline=None,
                    suppress_health_check=list(HealthCheck))


def test_fuzzed_block_files_are_misses_or_exact(tmp_path: Path, long_run: bool) -> None:
    """Mutated block files, plain and lz4, read by a live manager or adopted at open."""
    root = tmp_path / "cache"
    counter = iter(range(10**9))

    @_fuzz_settings(long_run)
    @given(ops=mutations, compression=st.sampled_from(["none", "lz4"]), adopt=st.booleans())
    def check(ops, compression: str, adopt: bool) -> None:
        block = random_block(key_of(next(counter), "fuzz"))
        with new_manager(root, **SMALL | dict(hot_cache_max_bytes=0, compression=compression)) as manager:
            manager.put(block)
            manager.flush()
            path = block_files(root)[block.key]
            path.write_bytes(_mutate(path.read_bytes(), ops))
            TALLY["fuzzed_files"] += 1
            if not adopt:
                got = manager.get(block.key)
                TALLY["served" if got else "missed"] += 1
                assert got is None or same_block(got, block)
                if got is None:
                    assert block.key not in block_files(root)
                manager.discard(block.key)
                return
        with sqlite3.connect(root / MANIFEST_NAME) as db:
            db.execute("DELETE FROM blocks WHERE key = ?", (block.key,))
        with new_manager(root, **SMALL | dict(hot_cache_max_bytes=0)) as manager:     # adopted or removed at open
            got = manager.get(block.key)
            TALLY["served" if got else "missed"] += 1
            assert got is None or same_block(got, block)
            assert got is not None or block.key not in block_files(root)
            manager.discard(block.key)

    check()


# ------------------------------------------------------------------------------ fuzzed config

FIELDS = CacheConfig.field_names()
values = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=20), st.binary(max_size=8),
    st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.sampled_from(["8GB", "1.5GiB", "auto", "-1", "1e9", "0", "0.5", "lz4", "LZ4 ", "zstd",
                     "write-back", "skip", "write-on-caller", "true", "off", "", " ", "~", "nan",
                     "inf", "1" * 400 + "TB", "١٢", "12 kib", "\x00", "/dev/null"]),
    st.builds(Path, st.text(max_size=10)), st.builds(object))


@settings(max_examples=400, deadline=None)
@given(kwargs=st.dictionaries(st.sampled_from(FIELDS), values, max_size=4))
def test_fuzzed_config_values_raise_value_error_only(kwargs: dict) -> None:
    try:
        config = CacheConfig(**kwargs)
    except ValueError:
        return
    assert isinstance(config.block_size, int) and config.block_size > 0
    assert isinstance(config.hot_cache_max_bytes, int) and config.hot_cache_max_bytes >= 0


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(env=st.dictionaries(st.sampled_from(FIELDS), st.text(max_size=12), max_size=4),
       toml=st.text(max_size=60))
def test_fuzzed_env_and_toml_raise_value_error_only(tmp_path_factory, env: dict, toml: str) -> None:
    try:
        CacheConfig.from_env({f"PAGED_CACHE_{k.upper()}": v for k, v in env.items()})
    except ValueError:
        pass
    path = tmp_path_factory.mktemp("toml") / "paged-cache.toml"
    for text in (toml, "[paged_cache]\n" + "\n".join(f"{k} = {v!r}" for k, v in env.items())):
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
        try:
            CacheConfig.from_toml(path)
        except ValueError:
            pass
