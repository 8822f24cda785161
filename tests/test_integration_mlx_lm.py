"""PagedPromptCache: LRUPromptCache's interface over the tiered block cache (in process)."""

from __future__ import annotations

import re
import time

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache

from paged_cache import BlockAwarePrefixCache
from paged_cache.config import CacheConfig
from paged_cache.hashing import chain_keys
from paged_cache.integrations.mlx_lm import (MAX_DEFERRED, MAX_OPEN_REQUESTS, ModelBinding,
                                             PagedPromptCache, model_id_for)
from paged_cache.manager import PagedSSDCacheManager
from paged_cache.testing import tiny_model, write_model_dir
from helpers.metrics import ttft_counts

BLOCK = 16
KEY = ("/models/tiny", None, None)  # what mlx_lm.server passes as the model key


def prefill(model, tokens, cache=None, chunk=BLOCK):
    """Prefill ``tokens`` into ``cache`` in ``chunk``-token steps; return the cache."""
    cache = make_prompt_cache(model) if cache is None else cache
    for s in range(0, len(tokens), chunk):
        mx.eval(model(mx.array(tokens[s:s + chunk])[None], cache=cache))
    return cache


def last_logits(model, cache, token):
    out = model(mx.array([[token]]), cache=cache)
    mx.eval(out)
    return out[0, -1]


@pytest.fixture
def model():
    return tiny_model("llama")


def make(tmp_path, model, **kw):
    hot_only = kw.pop("hot_cache_only", False)
    # a restore whatever it costs: a tiny model's measured prefill may beat one (fetch_plan.py)
    cfg = dict(block_size=BLOCK, fetch_policy="always-restore",
               hot_cache_max_bytes=kw.pop("hot", 64 * 2**20))
    cfg.update(hot_cache_only=True) if hot_only else cfg.update(ssd_dir=tmp_path / "ssd")
    manager = PagedSSDCacheManager(CacheConfig(**cfg))
    return manager, PagedPromptCache.for_model(manager, model, **kw)


def tokens_of(n, seed=0):
    return [(seed * 7 + 3 * i) % 250 for i in range(n)]


def test_fetch_is_exact_and_mutation_safe(tmp_path, model):
    manager, cache = make(tmp_path, model)
    with manager:
        seq = tokens_of(100)
        cache.insert_cache(KEY, seq, prefill(model, seq), cache_type="assistant")
        prompt = seq + [5, 6, 7]
        got, rest = cache.fetch_nearest_cache(KEY, prompt)
        n = len(prompt) - len(rest)
        assert n == 100 and rest == [5, 6, 7]
        cold = prefill(model, prompt[:n])
        want = last_logits(model, cold, rest[0])
        assert mx.abs(last_logits(model, got, rest[0]) - want).max().item() == 0.0
        # The server mutates what it got: generation appends, trim moves the offset, and even
        # overwriting the buffers in place must not reach the stored blocks.
        for _ in zip(range(5), generate_step(mx.array(rest[1:]), model, prompt_cache=got)):
            pass
        got[0].trim(30)
        got[0].keys[:] = 0.0
        again, rest2 = cache.fetch_nearest_cache(KEY, prompt)
        # The 4-token partial tail, not written yet, was copied, not taken: with no insert in
        # between, the second fetch gets all 100 tokens again, none of the mutations above.
        assert len(prompt) - len(rest2) == 100
        rest = rest2
        want = last_logits(model, prefill(model, prompt[:100]), rest[0])
        assert mx.abs(last_logits(model, again, rest[0]) - want).max().item() == 0.0
        assert again[0] is not got[0] and again[0].keys is not got[0].keys


def test_miss_unknown_model_and_short_prompts(tmp_path, model):
    manager = PagedSSDCacheManager(CacheConfig(block_size=BLOCK, ssd_dir=tmp_path / "ssd",
                                                   fetch_policy="always-restore"))
    with manager:
        cache = PagedPromptCache(manager, lambda key: ModelBinding(model) if key == KEY else None)
        seq = tokens_of(64)
        assert cache.fetch_nearest_cache(KEY, seq) == (None, seq)
        cache.insert_cache(("/other", None, None), seq, prefill(model, seq))  # not loaded: ignored
        assert len(cache) == 0 and cache.nbytes == 0
        cache.insert_cache(KEY, seq, prefill(model, seq))
        assert cache.fetch_nearest_cache(("/other", None, None), seq + [1]) == (None, seq + [1])
        got, rest = cache.fetch_nearest_cache(KEY, seq[:1])
        assert got is None and rest == seq[:1]   # a prompt must keep one token to feed
        got, rest = cache.fetch_nearest_cache(KEY, seq)
        assert len(rest) == 1   # an exact match leaves the last token to recompute


def test_byte_and_sequence_limits_spill_to_ssd(tmp_path, model):
    kv = prefill(model, tokens_of(64))
    per_seq = sum(c.keys[..., :64, :].nbytes + c.values[..., :64, :].nbytes for c in kv)
    limit = per_seq * 3 // 2  # room for one and a half 64-token sequences of blocks
    manager, cache = make(tmp_path, model, max_bytes=limit, max_size=3)
    with manager:
        seqs = [tokens_of(64, seed=s) for s in range(4)]
        for s in seqs:
            cache.insert_cache(KEY, s, prefill(model, s), cache_type="user")
            assert cache.nbytes <= limit
            assert len(cache) <= 3
        assert len(cache) == 1   # the byte limit binds before the sequence limit
        stats = cache.stats_by_type()
        assert stats["user"]["n_sequences"] == len(cache) >= 1
        assert sum(v["n_bytes"] for v in stats.values()) == cache.nbytes
        # The oldest sequence left RAM but is still served, from SSD (once the writer is done:
        # its blocks may still be queued, written-through or spilled, until the flush).
        manager.flush()
        assert manager.stats()["ssd"]["blocks"] > 0
        got, rest = cache.fetch_nearest_cache(KEY, seqs[0] + [9])
        assert rest == [9]
        assert cache.prefix_cache(KEY).last_fetch.tier in ("ssd", "mixed")
        cache.trim_to(n_bytes=0)
        assert cache.nbytes == 0 and len(cache) == 0
        cache.trim_to(n_sequences=0)
        got, rest = cache.fetch_nearest_cache(KEY, seqs[3] + [9])
        assert rest == [9]   # still on SSD


def test_hot_cache_only_trim_drops(tmp_path, model):
    manager, cache = make(tmp_path, model, hot_cache_only=True)
    with manager:
        seq = tokens_of(48)
        cache.insert_cache(KEY, seq, prefill(model, seq), cache_type="system")
        assert cache.stats_by_type()["system"]["n_sequences"] == 1
        assert cache.nbytes > 0
        cache.trim_to(n_sequences=0)
        assert cache.nbytes == 0
        assert cache.fetch_nearest_cache(KEY, seq + [1]) == (None, seq + [1])
    assert not (tmp_path / "ssd").exists()


class _NotACache:
    """A layer as a buggy caller might hand one over: its offset is an (unhashable) list."""

    offset = [40]
    nbytes = 0


def test_bad_input_is_reported_and_keeps_what_is_stored(tmp_path, model, caplog):
    manager, cache = make(tmp_path, model)
    with manager:
        seq = tokens_of(40)
        cache.insert_cache(KEY, seq, prefill(model, seq))
        with pytest.raises(ValueError, match="cache_type"):
            cache.insert_cache(KEY, seq, prefill(model, seq), cache_type="tool")
        # A cache that disagrees with its tokens is not stored, and does not raise into the
        # server's generation thread: it is logged and counted.
        with caplog.at_level("WARNING", logger="paged_cache.integrations.mlx_lm"):
            cache.insert_cache(KEY, seq + [1, 2], prefill(model, seq))
            cache.insert_cache(KEY, seq, [prefill(model, seq)[0]])   # one layer missing
        assert cache.store_errors == 2
        assert "offset" in caplog.text and "cache entries" in caplog.text
        # layers that are no cache at all (an offset that cannot even be compared): the same
        cache.insert_cache(KEY, seq, [_NotACache(), _NotACache()])
        assert cache.store_errors == 3
        with pytest.raises(TypeError, match="tokens"):
            cache.fetch_nearest_cache(KEY, "not tokens")
        with pytest.raises(ValueError, match="max_bytes"):
            PagedPromptCache(manager, lambda k: None, max_bytes=-1)
        with pytest.raises(TypeError, match="manager"):
            PagedPromptCache(LRUPromptCache(), lambda k: None)
        got, rest = cache.fetch_nearest_cache(KEY, seq + [3])
        assert rest == [3]


def test_same_interface_as_lru_prompt_cache():
    public = {n for n in dir(LRUPromptCache) if not n.startswith("_")} - {"CacheEntry", "CacheOrder"}
    assert public <= set(dir(PagedPromptCache))
    assert hasattr(PagedPromptCache, "__len__")


def test_model_id_changes_with_weights(tmp_path):
    path = write_model_dir(tmp_path / "m", "llama", seed=0)
    first = model_id_for(str(path))
    assert first == model_id_for(str(path))
    write_model_dir(tmp_path / "m", "llama", seed=1, layers=1)
    assert model_id_for(str(path)) != first
    assert model_id_for("org/some-repo") is None  # the default identity: config + weights digest


def test_sequence_limit_moves_oldest_out_of_ram(tmp_path, model):
    manager, cache = make(tmp_path, model, max_size=2)
    with manager:
        seqs = [tokens_of(32, seed=s) for s in range(3)]
        for s in seqs:
            cache.insert_cache(KEY, s, prefill(model, s), cache_type="assistant")
        assert len(cache) == 2
        assert cache.stats_by_type()["assistant"]["n_sequences"] == 2
        manager.flush()
        got, rest = cache.fetch_nearest_cache(KEY, seqs[0] + [1])
        assert rest == [1] and cache.prefix_cache(KEY).last_fetch.tier == "ssd"
        got, rest = cache.fetch_nearest_cache(KEY, seqs[2] + [1])
        assert rest == [1] and cache.prefix_cache(KEY).last_fetch.tier == "hot"


def test_one_info_line_per_request_and_stats_sections(tmp_path, model, caplog):
    manager, cache = make(tmp_path, model)
    with manager, caplog.at_level("INFO", logger="paged_cache"):
        seq = tokens_of(40)
        assert cache.stats()["prefix"] == {}                  # no model used yet
        # Request 1: a miss; the server inserts the user segment, then prompt + reply.
        prompt = seq[:36]
        assert cache.fetch_nearest_cache(KEY, prompt) == (None, prompt)
        cache.insert_cache(KEY, prompt[:20], prefill(model, prompt[:20]), cache_type="user")
        cache.insert_cache(KEY, seq, prefill(model, seq), cache_type="assistant")
        # Request 2: extends the conversation and hits.
        prompt2 = seq + [9, 8, 7]
        got, rest = cache.fetch_nearest_cache(KEY, prompt2)
        cached = len(prompt2) - len(rest)
        assert cached == 40
        reply = prompt2 + [1, 2]
        cache.insert_cache(KEY, reply, prefill(model, reply))   # sequential path's default type
        lines = [r.getMessage() for r in caplog.records if r.levelname == "INFO"
                 and r.name.startswith("paged_cache") and "SSD tier" not in r.getMessage()]
        assert len(lines) == 2, lines
        assert re.match(r"request: 0/36 prompt tokens cached \(miss\), fetch [\d.]+ ms, "
                        r"store [\d.]+ ms \(2 inserts\); hot tier ", lines[0]), lines[0]
        assert re.match(r"request: 40/43 prompt tokens cached \(hot\), fetch [\d.]+ ms, "
                        r"store [\d.]+ ms \(1 insert\); hot tier ", lines[1]), lines[1]
        stats = cache.stats()
        assert set(stats) == {"manager", "prefix", "requests"}
        req = stats["requests"]
        assert (req["requests"], req["requests_miss"], req["requests_hot"]) == (2, 1, 1)
        assert (req["prompt_tokens"], req["cached_tokens"]) == (36 + 43, 40)
        assert (req["inserts"], req["store_errors"], req["requests_open"]) == (3, 0, 0)
        assert req["fetch_seconds"] > 0 and req["store_seconds"] > 0
        assert stats["prefix"]["tokens_matched"] == 40 and stats["prefix"]["hits"] == 1
        assert stats["manager"]["puts"] > 0
        # A request the client dropped never gets its final insert: logged when it is forgotten.
        for i in range(MAX_OPEN_REQUESTS + 1):
            cache.fetch_nearest_cache(KEY, [251, i % 250, 7])      # never stored: misses
        assert cache.stats()["requests"]["requests_open"] == MAX_OPEN_REQUESTS
        assert caplog.records[-1].getMessage().startswith(
            "request: 0/3 prompt tokens cached (miss), fetch ")
        assert "not stored (ended without a cache insert)" in caplog.records[-1].getMessage()


def test_first_token_counted_after_the_generation_thread_finished_the_request(tmp_path, model):
    """The server's HTTP thread reads a request's first token after the generation thread may
    have finished the request (a short reply: its final insert came first): the time to first
    token still gets the request's tier and gives a prefill-rate sample less its fetch; the
    request is kept only until then."""
    manager, cache = make(tmp_path, model, defer_stores=True)
    with manager:
        seq, prefilled = tokens_of(70), 0
        for step, (prompt, series) in enumerate(((seq[:66], ("miss", "none")),
                                                 (seq + [5] * 70, ("hit", "hot")))):
            got, rest = cache.fetch_nearest_cache(KEY, prompt)
            prefilled += len(rest)
            reply = prompt + [1, 2]
            cache.insert_cache(KEY, reply, prefill(model, reply), cache_type="assistant")
            assert cache.stats()["requests"]["requests_open"] == 0
            before = ttft_counts()
            submitted = time.perf_counter() - 0.5
            streamed = cache.time_first_token(prompt, lambda: len(prompt) - len(rest),
                                              iter("ab"), submitted)
            assert list(streamed) == ["a", "b"]
            after = ttft_counts()
            assert {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)} \
                == {series: 1}
            stats = cache.stats()
            assert stats["prefix"]["prefill_samples"] == step + 1, stats["prefix"]
            assert stats["requests"]["prefill_tokens"] == prefilled
            # counted, the closed request is let go (it held the prompt's tokens)
            before, unknown = ttft_counts(), ("hit", "unknown")
            list(cache.time_first_token(prompt, lambda: len(prompt), iter("c"), submitted))
            assert ttft_counts().get(unknown, 0) == before.get(unknown, 0) + 1


def test_trim_demotes_without_counting_hits_and_bounds_untracked_blocks(tmp_path, model):
    manager, cache = make(tmp_path, model, hot_cache_only=True)
    with manager:
        seqs = [tokens_of(48, seed=s) for s in range(2)]
        for s in seqs:
            cache.insert_cache(KEY, s, prefill(model, s))
        before = manager.stats()
        cache.trim_to(n_sequences=1)                          # the first sequence leaves RAM
        after = manager.stats()
        assert after["hits"] == before["hits"] and after["gets"] == before["gets"]
        assert after["takes"] == before["takes"]
        demoted = after["hot"]["demote_evictions"]
        assert demoted == 3 and after["evicted_dropped"] == 3  # hot only: dropped, counted
        assert cache.stats()["requests"]["demote_evictions"] == 3
        # Blocks put by someone else (no sequence here) are trimmed too when bytes must go.
        other = BlockAwarePrefixCache(manager, model)
        extra = tokens_of(32, seed=9)
        other.store(extra, prefill(model, extra))
        cache.trim_to(n_bytes=0)
        assert cache.nbytes == 0 and manager.hot_bytes == 0 and len(cache) == 0
        assert cache.stats()["requests"]["demote_evictions"] == 3 + 3 + 2


# ---------------------------------------------------------------------------- server options


def lru_survivors(cache, inserts, probe_of) -> list[bool]:
    """For each inserted sequence, whether ``cache`` still serves its prefix from RAM."""
    out = []
    for tokens, _ in inserts:
        got, rest = cache.fetch_nearest_cache(KEY, probe_of(tokens))
        out.append(got is not None and len(rest) < len(tokens))
    return out


def test_eviction_by_cache_type_like_lru_prompt_cache(tmp_path, model):
    # The order of LRUPromptCache on the same inserts, with the same sequence limit.
    kinds = ["system", "user", "assistant", "user", "assistant", "system", "assistant"]
    inserts = [(tokens_of(32 + 16 * i, seed=i + 1), kind) for i, kind in enumerate(kinds)]
    for limit in (1, 2, 3, 4):
        lru = LRUPromptCache(max_size=limit)
        manager, paged = make(tmp_path / str(limit), model, max_size=limit, hot_cache_only=True)
        with manager:
            for tokens, kind in inserts:
                lru.insert_cache(KEY, tokens, prefill(model, tokens), cache_type=kind)
                lru.trim_to(n_sequences=limit)
                paged.insert_cache(KEY, tokens, prefill(model, tokens), cache_type=kind)
                assert len(paged) == len(lru)
                assert ({t: s["n_sequences"] for t, s in paged.stats_by_type().items()}
                        == {t: s["n_sequences"] for t, s in lru.stats_by_type().items()})
            probe = lambda t: t + [1]  # noqa: E731 - one token past each sequence
            want = lru_survivors(lru, inserts, probe)
            assert lru_survivors(paged, inserts, probe) == want
    assert want[0] and not want[2]   # (limit 4) the first system prompt outlives an assistant reply


def test_conversations_count_once_and_keep_their_partial_tails(tmp_path, model):
    """A conversation's prompt insert and its final insert (prompt + reply) count as one sequence,
    as LRUPromptCache drops the prefixes of a cache it can trim; the conversation demoted by the
    sequence limit keeps its partial tail in RAM (put unwritten: a demotion dropped it), so its
    next turn reuses every token."""
    system = tokens_of(40, seed=9)
    lru = LRUPromptCache(max_size=2)
    manager, paged = make(tmp_path, model, max_size=2)
    with manager:
        finals = []
        for c in range(3):
            prompt = system + tokens_of(10, seed=c)
            finals.append(prompt + tokens_of(5, seed=c + 5))   # 55 tokens: a 7-token tail
            for tokens, kind in ((prompt, "user"), (finals[-1], "assistant")):
                for target in (lru, paged):
                    target.insert_cache(KEY, tokens, prefill(model, tokens), cache_type=kind)
                assert len(paged) == len(lru)
        pc = paged.prefix_cache(KEY)
        *blocks, tail = chain_keys(pc.fingerprint, pc.namespace, finals[0], BLOCK)
        manager.flush()  # the demoted block may still wait in the SSD writer's queue
        assert [manager.tier_of(k) for k in blocks] == ["hot", "hot", "ssd"]  # shared ones stay
        assert manager.tier_of(tail) == "hot"
        got, rest = paged.fetch_nearest_cache(KEY, finals[0] + [1])
        assert rest == [1] and pc.last_fetch.tier == "mixed"


@pytest.mark.parametrize("max_size, in_ram", [(2, [False, True, True]), (3, [True, True, True])])
def test_the_sequence_limit_not_only_the_hot_budget_bounds_what_stays_in_ram(tmp_path, model,
                                                                           max_size, in_ram):
    """mlx_lm.server's --prompt-cache-size (max_size; its default 10) applies beside the hot
    budget: with room for every conversation in the hot tier, a third one still moves the oldest
    one's blocks to SSD (still served) when the limit is 2, and stays in RAM when it is 3."""
    manager, cache = make(tmp_path, model, max_size=max_size)
    with manager:
        conversations = [tokens_of(3 * BLOCK, seed=20 + c) for c in range(3)]
        for tokens in conversations:
            cache.insert_cache(KEY, tokens, prefill(model, tokens), cache_type="assistant")
        manager.flush()
        assert manager.hot_bytes * 8 < manager.config.hot_cache_max_bytes   # room to spare
        pc = cache.prefix_cache(KEY)
        assert [all(manager.tier_of(k) == "hot" for k in
                    chain_keys(pc.fingerprint, pc.namespace, tokens, BLOCK))
                for tokens in conversations] == in_ram
        for tokens in conversations:
            got, rest = cache.fetch_nearest_cache(KEY, tokens + [1])
            assert rest == [1]


def test_system_prompt_outlives_turns_with_prompt_cache_size_2(tmp_path, model):
    manager, cache = make(tmp_path, model, max_size=2, hot_cache_only=True)
    with manager:
        system, user, reply = tokens_of(48, seed=1), tokens_of(64, seed=2), tokens_of(80, seed=3)
        for tokens, kind in ((system, "system"), (user, "user"), (reply, "assistant")):
            cache.insert_cache(KEY, tokens, prefill(model, tokens), cache_type=kind)
        got, rest = cache.fetch_nearest_cache(KEY, system + [1])
        assert rest == [1]          # kept: the assistant entry left first


def test_cache_errors_never_raise_into_the_server(tmp_path, model, caplog):
    manager, cache = make(tmp_path, model)
    seq = tokens_of(48)
    cache.insert_cache(KEY, seq, prefill(model, seq))
    manager.close()   # every manager operation now raises RuntimeError
    with caplog.at_level("WARNING", logger="paged_cache.integrations.mlx_lm"):
        assert cache.fetch_nearest_cache(KEY, seq + [1]) == (None, seq + [1])
        cache.insert_cache(KEY, seq + [1, 2], prefill(model, seq + [1, 2]))
        cache.trim_to(n_sequences=0, n_bytes=0)
    counters = cache.stats()["requests"]
    assert counters["cache_errors"] == 2 and counters["store_errors"] == 1
    assert counters["requests_miss"] == 1
    assert "fetch_nearest_cache failed, serving uncached" in caplog.text
    assert "trim_to failed" in caplog.text and "closed" in caplog.text


def test_kv_bits_layers_are_stored_and_fetched_quantized_exactly(tmp_path):
    from mlx_lm.models.cache import QuantizedKVCache

    model = tiny_model("llama", head_dim=32)   # quantization groups of 32 along head_dim
    manager, cache = make(tmp_path, model, kv_quantization=(4, 32))
    with manager:
        seq = tokens_of(70)
        # What mlx-lm's generation does with --kv-bits 4 --quantized-kv-start 0.
        live = [c.to_quantized(group_size=32, bits=4) for c in make_prompt_cache(model)]
        prefill(model, seq, live)
        copy = [c.to_quantized(group_size=32, bits=4) for c in make_prompt_cache(model)]
        prefill(model, seq, copy)
        want = last_logits(model, copy, 9)
        cache.insert_cache(KEY, seq, live, cache_type="assistant")
        assert cache.store_errors == 0 and len(cache) == 1
        got, rest = cache.fetch_nearest_cache(KEY, seq + [9])
        assert rest == [9]
        assert all(type(c) is QuantizedKVCache and (c.bits, c.group_size) == (4, 32) for c in got)
        assert mx.abs(last_logits(model, got, 9) - want).max().item() == 0.0
        # A plain cache of the same model is stored too, under the plain layout.
        short = tokens_of(40, seed=5)
        cache.insert_cache(KEY, short, prefill(model, short))
        got, rest = cache.fetch_nearest_cache(KEY, short + [9])
        assert rest == [9] and all(type(c).__name__ == "KVCache" for c in got)
        assert cache.store_errors == 0
        assert cache.stats()["prefix"]["hits"] == 2


def test_draft_model_layout_and_any_model_key_shape(tmp_path, model):
    from paged_cache.integrations.mlx_lm import ModelWithDraft

    draft = tiny_model("llama", num_hidden_layers=1, seed=3)
    pair = ModelWithDraft(model, draft)
    manager = PagedSSDCacheManager(CacheConfig(block_size=BLOCK, ssd_dir=tmp_path / "ssd",
                                                   fetch_policy="always-restore"))
    with manager:
        for key in (("/m", None), "default_model", ("/m", None, "/draft", "extra")):
            cache = PagedPromptCache(manager, lambda k, key=key: (
                ModelBinding(pair, pair.make_cache, model_id="pair") if k == key else None))
            seq = tokens_of(50)
            live = pair.make_cache()
            for s in range(0, len(seq), BLOCK):
                mx.eval(pair(mx.array(seq[s:s + BLOCK])[None], cache=live))
            cache.insert_cache(key, seq, live)
            assert cache.store_errors == 0
            got, rest = cache.fetch_nearest_cache(key, seq + [4])
            assert rest == [4] and len(got) == len(pair.make_cache()) == 3
            cold = pair.make_cache()
            for s in range(0, len(seq), BLOCK):
                mx.eval(pair(mx.array(seq[s:s + BLOCK])[None], cache=cold))
            for part, lo, hi in ((model, 0, pair.split), (draft, pair.split, 3)):
                diff = mx.abs(last_logits(part, got[lo:hi], 4) - last_logits(part, cold[lo:hi], 4))
                assert diff.max().item() == 0.0


def test_deferred_inserts_are_served_whole_then_cut(tmp_path, model):
    """defer_stores: an insert is kept whole; a fetch it reaches furthest for is served a copy of
    it trimmed to the request, exactly (LRUPromptCache's copy and trim), and it stays whole;
    store_deferred cuts it. A conversation's prompt insert is never cut once its final insert
    extends it (a full-history layout: the final cache holds its rows)."""
    manager, paged = make(tmp_path, model, defer_stores=True)
    with manager:
        pc = paged.prefix_cache(KEY)
        held = lambda tokens: [manager.tier_of(k) for k in  # noqa: E731
                               chain_keys(pc.fingerprint, pc.namespace, tokens, BLOCK)]
        a, b = tokens_of(40, seed=1), tokens_of(40, seed=2)
        paged.insert_cache(KEY, a[:20], prefill(model, a[:20]), cache_type="user")
        paged.insert_cache(KEY, a, prefill(model, a), cache_type="assistant")
        paged.insert_cache(KEY, b, prefill(model, b), cache_type="assistant")
        assert paged.deferred == 2 and paged.counters["stores_superseded"] == 1
        assert held(a) == [None] * 3 and paged.nbytes > 0   # kept whole, counted in RAM
        for prompt, n in ((a + [7, 8], 40), (a[:30] + [9, 9], 30)):   # a longer prompt, a branch
            got, rest = paged.fetch_nearest_cache(KEY, prompt)
            assert rest == prompt[n:] and pc.last_fetch.tier == "hot"
            want = last_logits(model, prefill(model, prompt[:n]), prompt[n])
            assert mx.abs(last_logits(model, got, prompt[n]) - want).max().item() == 0.0
            got[0].keys[:] = 0.0      # the server's copy: what is kept stays intact
        assert paged.deferred == 2 and held(a) == [None] * 3
        assert pc.stats()["tokens_matched"] == paged.counters["cached_tokens"] == 70
        assert paged.store_deferred() == 2 and paged.deferred == 0
        assert None not in held(a) + held(b) and len(paged) == 2   # one sequence each
        got, rest = paged.fetch_nearest_cache(KEY, a + [7, 8])      # now from the blocks
        assert rest == [7, 8] and pc.last_fetch.blocks > 0
        want = last_logits(model, prefill(model, a), 7)
        assert mx.abs(last_logits(model, got, 7) - want).max().item() == 0.0
        assert paged.stats()["requests"]["stores_deferred"] == 3


def test_deferred_inserts_of_a_recurrent_layout_and_their_bound(tmp_path, model):
    """A layout that cannot be trimmed (recurrent state): a deferred insert whose tokens all
    start the request is served whole (a deep copy, exact), the longest such one (a branch
    inside the final insert gets the prompt insert's state); beyond MAX_DEFERRED inserts the
    oldest are cut at once, in order, and the blocks then give what the whole insert gave."""
    hybrid = tiny_model("qwen3_next")
    manager, paged = make(tmp_path, hybrid, defer_stores=True)
    with manager:
        pc = paged.prefix_cache(KEY)
        a, b = tokens_of(40, seed=3), tokens_of(30, seed=4)
        paged.insert_cache(KEY, a[:20], prefill(hybrid, a[:20]), cache_type="user")
        paged.insert_cache(KEY, a, prefill(hybrid, a), cache_type="assistant")
        paged.insert_cache(KEY, b, prefill(hybrid, b), cache_type="assistant")
        assert paged.deferred == 3 and paged.counters["stores_superseded"] == 0
        branch = a[:36] + [9, 9]
        for prompt, n in ((a + [7], 40), (branch, 20)):
            got, rest = paged.fetch_nearest_cache(KEY, prompt)
            assert len(prompt) - len(rest) == n and pc.last_fetch.blocks == 0
            want = last_logits(hybrid, prefill(hybrid, prompt[:n]), prompt[n])
            assert mx.abs(last_logits(hybrid, got, prompt[n]) - want).max().item() == 0.0
        assert paged.deferred == 3
        for i in range(MAX_DEFERRED):
            tokens = tokens_of(18, seed=10 + i)
            paged.insert_cache(KEY, tokens, prefill(hybrid, tokens), cache_type="assistant")
        assert paged.deferred == MAX_DEFERRED and paged.counters["inserts"] == 3
        assert len(paged) == 3    # each insert its sequence (LRUPromptCache keeps them too)
        got, rest = paged.fetch_nearest_cache(KEY, branch)
        assert len(branch) - len(rest) == 20 and pc.last_fetch.blocks > 0
