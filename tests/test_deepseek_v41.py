"""DeepSeek-V4 (mlx-lm's deepseek_v41) is cached: its LayerCache (sliding window, compressed
groups of 4 and 128 tokens with index keys, the open group's rows) is rebuilt exactly, from RAM
and from SSD after a restart, and a conversation reuses its earlier turns through the Scheduler
as much as a recurrent hybrid does."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlx_lm import __version__ as mlx_lm_version

from paged_cache.config import CacheConfig
from paged_cache.manager import PagedSSDCacheManager
from paged_cache.prefix_cache import BlockAwarePrefixCache
from paged_cache.testing import ARCHS, tiny_model
from paged_cache.scheduler import Scheduler
from helpers.prefix import assert_exact, hot_prefix, prompt, store_prompt

pytestmark = pytest.mark.skipif(
    "deepseek_v41" not in ARCHS,
    reason=f"the installed mlx-lm {mlx_lm_version} has no deepseek_v41 (it arrived in 0.32)")

BLOCK = 16


# fetch position -> tokens restored (300-token prompt + 10 decoded, block 16). A rebuild inside a
# group needs the open group's rows, seen only where a forward ended: at the stored end and at
# the block boundaries (each capture holds the open group whole). So a ratio-4 layer restores
# positions that 4 divides, and the ratio-128 layer those whose next boundary is in the same
# group (120: its 128-group closed at the next boundary, 128, so it walks back to 112).
EXPECTED = {310: 310, 256: 256, 200: 200, 130: 128, 128: 128, 120: 112, 100: 100, 37: 32}


def _query(stored: list[int], n: int) -> list[int]:
    nxt = (stored[n] + 1) % 256 if n < len(stored) else 1
    return stored[:n] + [nxt, 2, 3]


@pytest.mark.parametrize("tier", ["hot", "ssd-restart"])
def test_layer_caches_are_rebuilt_exactly_hot_and_from_ssd_after_a_restart(tier: str,
                                                                           tmp_path: Path) -> None:
    model = tiny_model("deepseek_v41")
    if tier == "hot":
        prefix = hot_prefix(model, BLOCK)
    else:
        config = CacheConfig(block_size=BLOCK, ssd_dir=tmp_path, fetch_policy="always-restore")
        with PagedSSDCacheManager(config) as manager:
            store_prompt(model, BlockAwarePrefixCache(manager, model), prompt(300), decode=10)
        prefix = BlockAwarePrefixCache(PagedSSDCacheManager(config), model)
    assert prefix.needs_snapshots
    stored = store_prompt(model, prefix, prompt(300), decode=10) if tier == "hot" else \
        prompt(300) + _decoded(model, prompt(300), 10)
    assert len(stored) == 310
    tiers = []
    for n, expected in EXPECTED.items():
        got = assert_exact(model, prefix, _query(stored, n),
                           decoded_from=300 if n > 300 else None)
        assert got == expected, n
        tiers.append(prefix.last_fetch.tier)
    assert tiers[0] == ("hot" if tier == "hot" else "ssd")   # later fetches find promoted blocks
    prefix.manager.close()


def _decoded(model, tokens: list[int], steps: int) -> list[int]:
    """The greedy tokens ``store_prompt`` decodes after ``tokens`` (the same computation)."""
    prefix = hot_prefix(model, BLOCK)
    return store_prompt(model, prefix, tokens, decode=steps)[len(tokens):]


def _conversation(arch: str) -> list[int]:
    """Three turns through the Scheduler (each prompt: the previous prompt + its reply + a new
    user turn), decoding one request at a time as it must for deepseek_v41 (BatchGenerator does
    not merge LayerCache); the tokens each turn reused."""
    model = tiny_model(arch)
    sched = Scheduler(model, hot_prefix(model, BLOCK), batch_decode=False)
    history, cached = prompt(90, seed=1), []
    for turn in range(3):
        result = sched.generate(history, max_tokens=12)
        cached.append(result.cached_tokens)
        history = history + result.tokens + prompt(40, seed=turn + 2)
    return cached


def test_a_conversation_reuses_its_turns_like_a_recurrent_hybrid() -> None:
    deepseek, qwen = _conversation("deepseek_v41"), _conversation("qwen3_next")
    # every earlier turn: its prompt and reply but the last reply token (never fed)
    assert deepseek == [0, 90 + 11, 90 + 12 + 40 + 11], deepseek
    assert all(a >= b for a, b in zip(deepseek, qwen)), (deepseek, qwen)
