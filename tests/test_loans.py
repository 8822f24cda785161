"""Hot-only hand-over: concurrent fetches of one prefix all hit, a request dropped before it stores
gives its blocks back, the request's own store settles its loan, and a holder that trimmed,
rewrote or wrote in place never gets a changed row given back (those blocks are counted lost)."""

from __future__ import annotations

import gc

import mlx.core as mx
import pytest
from mlx_lm.models.cache import QuantizedKVCache

from paged_cache.config import CacheConfig
from paged_cache.manager import PagedSSDCacheManager
from paged_cache.testing import tiny_model
from helpers.backends import needs_quantized_matmul
from helpers.loans import BLOCK, changed_then_asked_again, lent, stored, trim_and_extend
from helpers.prefix import assert_exact, prompt


def test_concurrent_fetches_of_one_prefix_all_hit_exactly() -> None:
    model, prefix, history, first = lent(5, [1, 2])
    model(mx.array([[1, 2]]), cache=first)        # the first request moves on meanwhile
    for tail in ([3, 4], [5, 6, 7]):              # two more requests for the same prefix
        assert assert_exact(model, prefix, history + tail) == len(history)
    assert prefix.stats()["loans_returned"] >= 1
    stored(model, prefix, history + [1, 2])      # the first request's own store
    assert prefix.stats()["loans_open"] == 0
    prefix.manager.close()


def test_a_dropped_request_gives_its_blocks_back() -> None:
    model, prefix, history, cache = lent(4, [9])
    del cache                                     # the client went away: no store
    gc.collect()
    other = prompt(2 * BLOCK, seed=7)              # any later call settles the orphaned loan
    assert prefix.fetch(other)[1] == 0
    assert prefix.stats()["loans_returned"] == 1 and prefix.stats()["loans_open"] == 0
    assert assert_exact(model, prefix, history + [9]) == len(history)
    prefix.manager.close()


def test_a_request_that_stores_settles_its_loan_without_a_copy() -> None:
    model, prefix, history, cache = lent(3, [4, 5])
    model(mx.array([[4, 5]]), cache=cache)
    prefix.store(history + [4, 5], cache, consume=True)
    st = prefix.stats()
    assert st["loans_settled"] == 1 and st["loans_returned"] == 0 and st["loans_open"] == 0
    prefix.manager.close()


@pytest.mark.parametrize("layout", ["kv", pytest.param("quantized", marks=needs_quantized_matmul)])
def test_a_trimmed_and_extended_cache_gives_back_only_the_rows_it_kept(layout: str) -> None:
    model = tiny_model("llama", hidden_size=128)   # head_dim 32: one quantization group
    make = None if layout == "kv" else \
        lambda: [QuantizedKVCache(group_size=32, bits=8) for _ in model.layers]  # noqa: E731
    prefix, n = changed_then_asked_again(trim_and_extend, model, make)
    st = prefix.stats()
    # rows [56, 72) were rewritten: the last lent block [48, 64) is not given back
    assert n == 3 * BLOCK
    assert (st["loan_blocks_returned"], st["loan_blocks_lost"]) == (3, 1)
    assert (st["loans_returned"], st["loans_lost"]) == (0, 1)
    prefix.manager.close()


def test_an_in_place_write_below_the_position_gives_nothing_back() -> None:
    def scribble(model, cache) -> None:
        cache[0].keys[..., 5, :] = 0                    # row 5 of the first lent block
        mx.eval(cache[0].keys)

    prefix, n = changed_then_asked_again(scribble)
    st = prefix.stats()
    assert n == 0                                       # the chain's first block is gone
    assert (st["loan_blocks_returned"], st["loan_blocks_lost"]) == (0, 4)
    assert st["loans_lost"] == 1
    prefix.manager.close()


def test_a_trim_below_the_loan_counts_the_blocks_it_cut_off_as_lost() -> None:
    def trim(model, cache) -> None:
        for layer in cache:
            layer.trim(40)                              # offset 66 -> 26: blocks 2, 3 and half of 1

    prefix, n = changed_then_asked_again(trim)
    st = prefix.stats()
    assert n == BLOCK
    assert (st["loan_blocks_returned"], st["loan_blocks_lost"]) == (1, 3)
    assert (st["loans_returned"], st["loans_lost"]) == (0, 1)
    prefix.manager.close()


def test_a_loan_is_given_back_when_its_list_is_dropped_even_if_its_layers_live_on() -> None:
    model, prefix, history, cache = lent(3, [9])
    layers = list(cache)                              # the holder keeps the layers, not the list
    del cache
    gc.collect()
    assert prefix.fetch(prompt(2 * BLOCK, seed=7))[1] == 0
    st = prefix.stats()
    assert (st["loans_returned"], st["loan_blocks_returned"], st["loans_open"]) == (1, 3, 0)
    assert assert_exact(model, prefix, history + [9]) == len(history)
    del layers
    prefix.manager.close()


def test_through_the_server_prompt_cache_a_changed_loan_never_serves_wrong_rows() -> None:
    from mlx_lm.models.cache import make_prompt_cache

    from paged_cache.integrations.mlx_lm import PagedPromptCache

    model = tiny_model("llama")
    manager = PagedSSDCacheManager(CacheConfig(block_size=BLOCK, hot_cache_only=True))
    server = PagedPromptCache.for_model(manager, model)
    key = ("/models/tiny", None, None)
    history = prompt(4 * BLOCK)
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([history]), cache=cache))
    server.insert_cache(key, history, cache, cache_type="assistant")
    cache, rest = server.fetch_nearest_cache(key, history + [1, 2])
    assert rest == [1, 2]
    trim_and_extend(model, cache)
    query = history + [3, 4]
    cache, rest = server.fetch_nearest_cache(key, query)
    n = len(query) - len(rest)
    cold = make_prompt_cache(model)
    mx.eval(model(mx.array([query[:n]]), cache=cold))
    ref = model(mx.array([rest]), cache=cold)
    got = model(mx.array([rest]), cache=cache if cache is not None else make_prompt_cache(model))
    assert n == 3 * BLOCK and mx.abs(ref - got).max().item() == 0.0
    manager.close()
