"""The exo adapter's logic (paged_cache.integrations.exo.prefix) driven by exo's three callers'
call sequences as RESTATED from exo's code at commit b5375f8 (tests/helpers/exo_calls.py: a
restatement, not exo's code; exo itself runs in tests/engines/test_exo.py on Python 3.13).

Per caller and model (a KV one, llama, and a hybrid, qwen3_next): greedy replies equal a run
with no prefix cache; every request reuses at least what exo's own cache would (its restore rule,
restated); a restored cache continues exactly as the cache stored (logits max abs diff 0.0); the
RAM tier stays within its budget while exo's own copies grow; a model paged-cache cannot serve
and media requests take the fallback, counted.
"""

from __future__ import annotations

import copy

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from helpers import exo_calls
from helpers.managers import new_manager
from paged_cache.integrations.exo.prefix import CUT, FALLBACK_BASE, ExoPrefixCache
from paged_cache.layout import layer_arrays

ARCHS = ("llama", "qwen3_next")
CALLERS = {"mlx_generate": exo_calls.mlx_generate, "batch_submit": exo_calls.batch_submit,
           "prefill_server": lambda model, kv, make, tokens, _: exo_calls.prefill_server(
               model, kv, make, tokens)}
BLOCK = 16
REPLY = 6


def chat(conversations: int, system: int = 90, user: int = 70) -> list[tuple[int, str, list[int]]]:
    """(conversation, round, tokens): a first turn, a second one extending it (a reply and a
    new question), the second again (a retry), the first again (a prompt the longer second
    covers); every conversation opens with one system prompt."""
    def text(seed: int, n: int) -> list[int]:
        return [(i * 37 + seed * 101 + 5) % 251 + 1 for i in range(n)]
    out = []
    for c in range(conversations):
        first = text(0, system) + text(1 + c, user)
        second = first + text(500 + c, 9) + text(900 + c, user // 2)
        out += [(c, "first", first), (c, "second", second), (c, "retry", second),
                (c, "again", first)]
    return out


def paged(model, **config) -> ExoPrefixCache:
    kv = ExoPrefixCache()
    kv.setup(new_manager(block_size=BLOCK, **config), group=None,
             make_cache=lambda m: make_prompt_cache(m), cache_length=exo_calls.cache_length)
    return kv


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("caller", sorted(CALLERS))
def test_replies_equal_cold_and_reuse_at_least_exos_own(models, arch, caller) -> None:
    model = models[arch]
    make = lambda: make_prompt_cache(model)  # noqa: E731
    call = CALLERS[caller]
    kv, own = paged(model), exo_calls.OwnReuse(hybrid=arch != "llama")
    for c, round_, tokens in chat(3):
        cold = call(model, None, make, tokens, REPLY)
        mine = own.reuse(tokens)
        got = call(model, kv, make, tokens, REPLY)
        own.stored(tokens, got.stored_tokens, got.snapshots)
        assert got.reply == cold.reply, (c, round_)
        assert got.cached >= mine, (c, round_, got.cached, mine)
        assert got.cached <= len(tokens) - 1   # exo prefills at least the last token
        if round_ == "retry" and caller != "prefill_server":
            assert got.cached == len(tokens) - CUT   # the same prompt: all but exo's cut
        if round_ == "again" and arch == "llama":   # all but the last: the second covers it
            assert got.cached == len(tokens) - 1, (caller, got.cached, mine)
    st = kv.counters
    assert st["cache_errors"] == st["store_errors"] == 0 and st["stores"] == 12
    assert st["cached_tokens"] > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_a_restored_cache_continues_exactly_as_the_one_stored(models, arch) -> None:
    model = models[arch]
    make = lambda: make_prompt_cache(model)  # noqa: E731
    kv, stored, checked = paged(model), [], 0
    for c, round_, tokens in chat(2):
        cache, remaining, index, exact = kv.get_kv_cache(model, mx.array(tokens))
        n = len(tokens) - len(remaining)
        if round_ != "first":
            assert n > 0 and index is not None and exact == (n >= len(tokens) - CUT)
            # the newest cache stored for a prompt sharing those n tokens, and holding them
            # (only KV layers can be cut back: a hybrid's restore ends where one was stored)
            held, ref = next((s.stored_tokens, copy.deepcopy(s.stored))
                             for t, s in reversed(stored) if t[:n] == tokens[:n]
                             and (s.stored_tokens == n or arch == "llama" and s.stored_tokens > n))
            for layer in ref if held > n else ():
                layer.trim(held - n)
            want = model(remaining[None], cache=ref)
            got = model(remaining[None], cache=cache)
            diff = mx.abs(want - got).max().item()
            assert diff == 0.0, (c, round_, n, diff)
            checked += 1
        stored.append((tokens, exo_calls.mlx_generate(model, kv, make, tokens, REPLY)))
    assert checked == 6


def test_ram_stays_within_the_hot_budget_while_exos_own_copies_grow(models) -> None:
    model = models["llama"]
    make = lambda: make_prompt_cache(model)  # noqa: E731
    budget = 64 * 1024
    kv, own_bytes = paged(model, hot_cache_max_bytes=budget), []
    for _, round_, tokens in chat(6, system=40, user=120):
        got = exo_calls.mlx_generate(model, kv, make, tokens, REPLY)
        assert kv.manager.stats()["hot"]["bytes"] <= budget
        # exo's own cache keeps a deep copy of every stored cache (no bound but system memory)
        own_bytes.append(sum(a.nbytes for layer in got.stored for a in layer_arrays(layer)))
    assert sum(own_bytes) > 4 * budget
    assert kv.counters["stores"] == 24 and kv.counters["store_errors"] == 0


def test_media_requests_go_to_the_fallback_cache_counted(models) -> None:
    """exo's own cache serves them in exo (tests/engines/test_exo.py); here the fallback is a
    second paged one, a real cache with the same members, which is handed the media regions
    (and, having no fallback of its own, serves them uncached)."""
    model = models["llama"]
    kv, own = paged(model), paged(model)
    kv.fallback = own
    tokens = mx.array(list(range(1, 60)))
    cache, remaining, index, exact = kv.get_kv_cache(model, tokens, media_regions=["image"])
    assert index is None and len(remaining) == len(tokens)
    exo_calls.prefill(model, remaining[:-1], cache)
    kv.add_kv_cache(tokens, cache, media_regions=["image"], prefill_tps=12.5)
    kv.get_kv_cache(model, tokens, media_regions=["image"])
    assert kv.counters["fallbacks_media"] == own.counters["fallbacks_media"] == 2
    assert kv.counters["requests"] == own.counters["requests"] == 0
    assert kv.counters["stores"] == own.counters["stores"] == 0


def test_a_layout_without_handler_goes_to_the_fallback_cache(models) -> None:
    model = models["llama"]
    kv = ExoPrefixCache()
    kv.setup(new_manager(block_size=BLOCK), group=None, make_cache=lambda m: [object()] * 2,
             cache_length=exo_calls.cache_length, fallback=paged(model))
    tokens = mx.array(list(range(1, 40)))
    cache, remaining, index, exact = kv.get_kv_cache(model, tokens)
    assert kv.prefix is None and kv.counters["fallbacks_layout"] == 1
    exo_calls.prefill(model, remaining[:-1], cache)
    kv.add_kv_cache(tokens, cache, prefill_tps=12.5)
    assert kv.fallback.counters["stores"] == 1
    cache, remaining, index, exact = kv.get_kv_cache(model, tokens)
    assert index >= FALLBACK_BASE and exact and kv.prefill_tps[index] == 12.5
    assert len(remaining) == CUT and kv.counters["fallbacks_layout"] == 2
