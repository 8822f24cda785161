"""Both at once: the fetch prefills a prefix's head while the files of its rest are read.

The unit tests drive the split with given rates; the model tests make the SSD tier slow on
purpose (``test_ssd_read_bytes_per_s``, a real tier) against a seeded prefill rate, and assert
the decision, its counters and exactness (logits 0.0 against a cold run of the same chunking) on
KV, sliding-window, chunked, hybrid and recurrent models.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from paged_cache.config import CacheConfig
from paged_cache.fetch_plan import Plan, plan_fetch
from paged_cache.hashing import chain_keys
from paged_cache.manager import PagedSSDCacheManager
from paged_cache.prefix_cache import BlockAwarePrefixCache
from paged_cache.rates import Rates
from paged_cache.testing import tiny_model
from paged_cache.tiers.format import META_GRID
from paged_cache.scheduler import Scheduler

from helpers.managers import new_manager
from helpers.prefix import assert_exact, prefill, prompt, store_prompt

BLOCK = 16
PER_TOKEN = 512       # bytes of KV per token the unit plans assume
PREFILL = 500.0       # tokens/s: a 16-token block prefills in 32 ms
BLOCK_BYTES = BLOCK * PER_TOKEN
ENDS = [8 * BLOCK, 6 * BLOCK, 4 * BLOCK]


def _rates(ssd_block_seconds: float, hot: float = 1e12) -> Rates:
    rates = Rates(PREFILL)
    rates.learn_bytes_per_token("layout", BLOCK_BYTES, BLOCK)
    rates.add_read("ssd", BLOCK_BYTES, ssd_block_seconds)
    rates.add_read("hot", hot, 1.0)
    return rates


def _chain(tiers: list[str]):
    """reads_of and nodes_of for a chain of blocks held in ``tiers``."""
    def reads_of(n: int) -> list[tuple[str, int]]:
        return [(t, BLOCK) for t in tiers[:n // BLOCK]]

    def nodes_of(n: int) -> list[tuple[int, int, str]]:
        return [(j * BLOCK, BLOCK, t) for j, t in enumerate(tiers[:n // BLOCK])]
    return reads_of, nodes_of


def _plan(tiers: list[str], rates: Rates, grid: int = BLOCK) -> Plan:
    reads_of, nodes_of = _chain(tiers)
    return plan_fetch("cost", ENDS, reads_of, rates, "model", "layout", nodes_of, grid)


@pytest.mark.unit
def test_split_where_the_prefill_and_the_reads_finish_together() -> None:
    """An SSD block reads in 64 ms, prefills in 32 ms: restoring 8 blocks takes 512 ms, prefilling
    them 256 ms; prefilling 5 while reading 3 takes max(160, 192) = 192 ms, 6 while 2: 192 ms too;
    the shorter head wins the tie. Deterministic."""
    plans = [_plan(["ssd"] * 8, _rates(0.064)) for _ in range(2)]
    assert plans[0] == plans[1]
    split = plans[0].split
    assert (split.head, split.end) == (5 * BLOCK, 8 * BLOCK) and "predicted" in split.detail
    # the plan without it, the way back when the split cannot be made: prefill all
    assert plans[0].ends == [] and plans[0].reason == "cost"


@pytest.mark.unit
def test_no_split_unless_it_beats_the_better_single_way() -> None:
    # SSD as fast as the prefill: a restore of all is cheaper than any split; restored whole
    fast = _plan(["ssd"] * 8, _rates(0.001))
    assert fast.split is None and fast.ends == ENDS
    # SSD 20x slower: the best split (7 blocks, 224 ms against 640 ms of reads) is slower than
    # prefilling all (256 ms): prefill all
    slow = _plan(["ssd"] * 8, _rates(0.032 * 20))
    assert slow.split is None and slow.ends == [] and slow.reason == "cost"
    # RAM blocks: nothing to read beside the prefill
    assert _plan(["hot"] * 8, _rates(0.064, hot=1.0)).split is None
    # no grid (the caller does not chunk on one), or a grid no node starts on
    assert _plan(["ssd"] * 8, _rates(0.064), grid=0).split is None
    assert _plan(["ssd"] * 8, _rates(0.064), grid=16 * BLOCK).split is None
    # an estimate missing: restore as without a plan
    reads_of, nodes_of = _chain(["ssd"] * 8)
    assert plan_fetch("cost", ENDS, reads_of, Rates(PREFILL), "model", "layout", nodes_of,
                      BLOCK).split is None
    # a forced policy is never split
    assert plan_fetch("always-restore", ENDS, reads_of, _rates(0.064), "model", "layout",
                      nodes_of, BLOCK).split is None


@pytest.mark.unit
def test_the_head_is_on_the_grid() -> None:
    """An SSD block read in 56 ms: on the block grid a head of 5 blocks (max(160, 168) = 168 ms)
    is best; on a grid of two blocks 5 is not a choice, and 6 (max(192, 112) = 192 ms) beats 4
    (max(128, 224) = 224 ms)."""
    assert _plan(["ssd"] * 8, _rates(0.056)).split.head == 5 * BLOCK
    assert _plan(["ssd"] * 8, _rates(0.056), grid=2 * BLOCK).split.head == 6 * BLOCK


@pytest.mark.unit
def test_prefill_chunk_is_checked(tmp_path: Path) -> None:
    model = tiny_model("llama")
    with new_manager(block_size=BLOCK) as manager:
        prefix = BlockAwarePrefixCache(manager, model)
        for bad in (0, BLOCK + 1, True, "16"):
            with pytest.raises(ValueError, match="prefill_chunk: expected a positive multiple of "
                                                 "the block size 16"):
                prefix.fetch(prompt(4 * BLOCK), prefill_chunk=bad)


# ---------------------------------------------------------------------- a real, slow SSD tier

SLOW_SSD = "128KB"  # an 8 KiB block of the tiny llama: 64 ms
SLOW_PREFILL = 1.0  # tokens/s seeded: the first restore is never cut off, so it measures the SSD


def _slow_ssd(tmp_path: Path, model, tokens: list[int]) -> CacheConfig:
    """Store ``tokens`` on SSD (a first process); the config of a restart whose SSD reads are
    slow."""
    with new_manager(tmp_path, block_size=BLOCK, ssd_max_bytes="64MB") as manager:
        store_prompt(model, BlockAwarePrefixCache(manager, model), tokens)
    return CacheConfig(block_size=BLOCK, ssd_dir=tmp_path, ssd_max_bytes="64MB",
                       test_ssd_read_bytes_per_s=SLOW_SSD, prefill_tokens_per_s=SLOW_PREFILL)


def _measure_ssd(model, prefix: BlockAwarePrefixCache, tokens: list[int]) -> None:
    """One SSD restore (no read rate yet, a prefill seeded far slower: restored whole), which
    measures the tier, then every block out of RAM again; then a prefill sample (it replaces the
    seed) twice as fast as the SSD reads a token of this model's layout (the tiny model's real
    prefill is far faster than any read)."""
    assert assert_exact(model, prefix, tokens[:2 * BLOCK] + [7, 7]) == 2 * BLOCK
    prefix.manager.trim_hot(0)
    rates = prefix.manager.rates
    read_tokens_per_s = rates.read("ssd") / rates.bytes_per_token(prefix.fingerprint)
    prefix.record_prefill(round(2 * read_tokens_per_s), 1.0)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "llama4", "qwen3_next", "mamba"])
def test_head_prefilled_while_the_rest_is_read_exact(tmp_path: Path, arch: str) -> None:
    """KV, sliding-window, chunked, hybrid and recurrent: the head is prefilled on the caller's
    grid, the rest read from the slow SSD (its files read ahead beside the prefill), and the
    rebuilt cache continues exactly like a cold run of the same chunking."""
    model = tiny_model(arch)
    tokens = prompt(8 * BLOCK)
    with PagedSSDCacheManager(_slow_ssd(tmp_path, model, tokens)) as manager:
        prefix = BlockAwarePrefixCache(manager, model)
        _measure_ssd(model, prefix, tokens)
        assert assert_exact(model, prefix, tokens + [1], prefill_chunk=BLOCK) == 8 * BLOCK
        info = prefix.last_fetch
        assert info.tier == "ssd" and 0 < info.tokens_prefilled < 8 * BLOCK
        assert info.tokens_prefilled % BLOCK == 0 and info.tokens_recomputed == 0
        stats = prefix.stats()
        assert stats["overlapped_fetches"] == 1
        assert stats["overlapped_head_tokens"] == info.tokens_prefilled
        assert stats["tokens_saved"] == 2 * BLOCK + 8 * BLOCK - info.tokens_prefilled
        ssd = manager.stats()["ssd"]
        assert ssd["warmed"] >= 1 and ssd["warmed_bytes"] > 0


def test_without_a_grid_the_plan_chooses_one_way(tmp_path: Path) -> None:
    """The same slow SSD, no prefill grid given: prefill everything (the better single way)."""
    model = tiny_model("llama")
    tokens = prompt(8 * BLOCK)
    with PagedSSDCacheManager(_slow_ssd(tmp_path, model, tokens)) as manager:
        prefix = BlockAwarePrefixCache(manager, model)
        _measure_ssd(model, prefix, tokens)
        assert assert_exact(model, prefix, tokens + [1]) == 0
        assert prefix.last_fetch.tokens_recomputed == 8 * BLOCK
        assert prefix.stats()["overlapped_fetches"] == 0


def test_scheduler_prefills_the_head_and_counts_only_the_rest_as_cached(tmp_path: Path) -> None:
    """Through the Scheduler (its chunk is the grid): the generated tokens are the cold run's,
    and ``cached_tokens`` counts the tokens restored, not the head the fetch prefilled."""
    model = tiny_model("llama")
    tokens = prompt(8 * BLOCK)
    cold = Scheduler(model, None, block_size=BLOCK, prefill_chunk_size=BLOCK)
    want = cold.generate(tokens + [5], max_tokens=4).tokens
    with PagedSSDCacheManager(_slow_ssd(tmp_path, model, tokens)) as manager:
        prefix = BlockAwarePrefixCache(manager, model)
        _measure_ssd(model, prefix, tokens)
        sched = Scheduler(model, prefix, prefill_chunk_size=BLOCK)
        got = sched.generate(tokens + [5], max_tokens=4)
        head = prefix.last_fetch.tokens_prefilled
        assert got.tokens == want
        assert head > 0 and got.cached_tokens == 8 * BLOCK - head


def _unmarked(tmp_path: Path, model, tokens: list[int]) -> CacheConfig:
    """``_slow_ssd``, but the store does not say how its rows were prefilled."""
    with new_manager(tmp_path, block_size=BLOCK, ssd_max_bytes="64MB") as manager:
        prefix = BlockAwarePrefixCache(manager, model)
        cache = prefix.make_cache()
        prefill(model, cache, tokens, 0, BLOCK)
        prefix.store(tokens, cache)
    return CacheConfig(block_size=BLOCK, ssd_dir=tmp_path, ssd_max_bytes="64MB",
                       test_ssd_read_bytes_per_s=SLOW_SSD, prefill_tokens_per_s=SLOW_PREFILL)


def test_no_split_over_rows_prefilled_another_way(tmp_path: Path) -> None:
    """Rows stored without ``prefill_grid``, or on another grid: a head prefilled on this grid
    might not be the rows they were computed after. The node at the head's end is read, its
    mark refused, and the plan without the split is followed (here: prefill all), exactly."""
    model = tiny_model("llama")
    tokens = prompt(8 * BLOCK)
    with PagedSSDCacheManager(_unmarked(tmp_path / "a", model, tokens)) as manager:
        prefix = BlockAwarePrefixCache(manager, model)
        _measure_ssd(model, prefix, tokens)
        assert assert_exact(model, prefix, tokens + [1], prefill_chunk=BLOCK) == 0
        assert prefix.last_fetch.tokens_recomputed == 8 * BLOCK
        assert prefix.stats()["overlapped_fetches"] == 0
    with PagedSSDCacheManager(_slow_ssd(tmp_path / "b", model, tokens)) as manager:
        prefix = BlockAwarePrefixCache(manager, model)
        _measure_ssd(model, prefix, tokens)
        # a grid of 2 blocks: the stored rows were prefilled a block at a time
        assert assert_exact(model, prefix, tokens + [1], prefill_chunk=2 * BLOCK) == 0
        assert prefix.stats()["overlapped_fetches"] == 0


def test_scheduler_marks_what_it_prefilled_on_its_grid(tmp_path: Path) -> None:
    """A request that restored nothing marks its blocks with its chunk and the last grid position
    its chunks reached (the final chunk ends off the grid); one that restored a prefix marks none."""
    model = tiny_model("llama")
    tokens = prompt(8 * BLOCK + 5)
    with new_manager(tmp_path, block_size=BLOCK, ssd_max_bytes="64MB") as manager:
        prefix = BlockAwarePrefixCache(manager, model)
        sched = Scheduler(model, prefix, prefill_chunk_size=2 * BLOCK)
        sched.generate(tokens[:6 * BLOCK + 3], max_tokens=2)
        sched.generate(tokens, max_tokens=2)
        keys = chain_keys(prefix.fingerprint, "", tokens[:8 * BLOCK], BLOCK)
        marks = [manager.get(key).meta.get(META_GRID) for key in keys]
    # the first request prefilled [0, 32), [32, 64), [64, 96) on the grid, then [96, 98) short
    assert marks[:6] == [f"{2 * BLOCK}:{6 * BLOCK}"] * 6
    assert marks[6:] == [None, None]  # the second request restored 6 blocks, then went on


def test_prefill_grid_is_checked() -> None:
    model = tiny_model("llama")
    with new_manager(block_size=BLOCK) as manager:
        prefix = BlockAwarePrefixCache(manager, model)
        cache = prefix.make_cache()
        tokens = prompt(2 * BLOCK)
        prefill(model, cache, tokens, 0, BLOCK)
        for bad in ((BLOCK + 1, BLOCK), (BLOCK, 0), (BLOCK, 3 * BLOCK), [BLOCK, BLOCK], BLOCK):
            with pytest.raises(ValueError, match=r"prefill_grid: expected \(chunk, until\)"):
                prefix.store(tokens, cache, prefill_grid=bad)
        assert prefix.stats()["stores"] == 0


def test_fetch_overlap_off_chooses_one_way(tmp_path: Path) -> None:
    """``fetch_overlap=false``: the same slow SSD and grid, one way (here: prefill all)."""
    model = tiny_model("llama")
    tokens = prompt(8 * BLOCK)
    config = _slow_ssd(tmp_path, model, tokens)
    off = CacheConfig(**{**{n: getattr(config, n) for n in config.explicit}, "fetch_overlap": False})
    with PagedSSDCacheManager(off) as manager:
        prefix = BlockAwarePrefixCache(manager, model)
        _measure_ssd(model, prefix, tokens)
        assert assert_exact(model, prefix, tokens + [1], prefill_chunk=BLOCK) == 0
        assert prefix.last_fetch.tokens_recomputed == 8 * BLOCK
        assert prefix.stats()["overlapped_fetches"] == 0


def test_header_of_a_remote_or_hot_node_is_read_from_the_node(url: str) -> None:
    """Only the SSD tier reads a header without its payload; the remote tier (whose own ``meta``
    is a listing's) and RAM answer None, so the node is read whole to check its mark."""
    model = tiny_model("llama")
    tokens = prompt(2 * BLOCK)
    with PagedSSDCacheManager(CacheConfig(block_size=BLOCK, hot_cache_only=True, remote_url=url,
                                          remote_timeout=5.0)) as manager:
        prefix = BlockAwarePrefixCache(manager, model)
        store_prompt(model, prefix, tokens)
        manager.flush()
        key = chain_keys(prefix.fingerprint, "", tokens, BLOCK)[0]
        assert manager.header(key, "remote", prefix.bounds) is None
        assert manager.header(key, "hot", prefix.bounds) is None


def test_header_of_an_ssd_node_is_its_verified_meta(tmp_path: Path) -> None:
    model = tiny_model("llama")
    tokens = prompt(2 * BLOCK)
    with new_manager(tmp_path, block_size=BLOCK, ssd_max_bytes="64MB") as manager:
        prefix = BlockAwarePrefixCache(manager, model)
        store_prompt(model, prefix, tokens)
        manager.flush()
        key = chain_keys(prefix.fingerprint, "", tokens, BLOCK)[0]
        header = manager.header(key, "ssd", prefix.bounds)
        assert header[META_GRID] == f"{BLOCK}:{2 * BLOCK}"
        assert header == {k: v for k, v in manager.get(key).meta.items() if k in header}
