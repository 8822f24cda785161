"""Exactness of BlockAwarePrefixCache on real tiny models: fetch + continue == cold run (0.0)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import QuantizedKVCache

from paged_cache.caches import make_bounded_cache
from paged_cache.testing import tiny_model

from helpers.backends import needs_quantized_matmul
from helpers.prefix import assert_exact, hot_prefix, prefill, prompt, store_prompt

# every test on both row paths: numpy copies (the CPU's) and MLX ops (a GPU's)
pytestmark = pytest.mark.usefixtures("rows_moved_by")

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
# which archs restore token-granularly (every layer trimmable when rows are held)
TOKEN_GRANULAR = {"llama": True, "gemma3_text": True, "llama4": True, "qwen3_next": False,
                  "mamba": False, "baichuan_m1": False}
FULL = [(a, b, d) for a in ("llama", "gemma3_text") for b in (16, 64, 256) for d in DTYPES]
DIAGONAL = [(a, b, d) for a in ("qwen3_next", "mamba", "baichuan_m1", "llama4")
            for b, d in ((16, "float32"), (64, "float16"), (256, "bfloat16"))]


def _expected(arch: str, diverge: int, block: int) -> int:
    return diverge if TOKEN_GRANULAR[arch] else diverge // block * block


@pytest.mark.parametrize("arch,block,dtype", FULL + DIAGONAL)
def test_fetch_then_continue_is_exact(arch: str, block: int, dtype: str) -> None:
    model = tiny_model(arch, dtype=DTYPES[dtype])
    prefix = hot_prefix(model, block)
    stored = store_prompt(model, prefix, prompt(block * 3 + block // 2))
    mid, boundary = 2 * block + block // 2 - 3, 2 * block
    for diverge in (mid, boundary):
        query = stored[:diverge] + prompt(block // 2 + 5, seed=9)
        assert assert_exact(model, prefix, query) == _expected(arch, diverge, block)
    # a continuation of the whole stored prompt reuses all of it (the tail block holds states)
    assert assert_exact(model, prefix, stored + [1, 2, 3]) == len(stored)


@pytest.mark.parametrize("arch", ["gemma3_text", "baichuan_m1", "llama4", "qwen3_next"])
def test_windows_past_their_size_and_ring_buffers(arch: str) -> None:
    """Prompt longer than the windows (64 / 32 / chunk 32) plus 1-token decodes (ring) before store."""
    block = 16
    model = tiny_model(arch)
    prefix = hot_prefix(model, block)
    stored = store_prompt(model, prefix, prompt(150), decode=21)  # 171 tokens, ring wrapped
    assert assert_exact(model, prefix, stored + [4, 5], decoded_from=150) == len(stored)
    diverge = 7 * block + 5
    expect = _expected(arch, diverge, block)
    assert assert_exact(model, prefix, stored[:diverge] + [3] * 20) == expect


def test_window_without_snapshots_limits_reuse_honestly() -> None:
    """No captures: rotating rows that left the window are gone; near the end reuse still works."""
    block = 16
    model = tiny_model("gemma3_text")
    prefix = hot_prefix(model, block)
    tokens = prompt(200)
    cache = prefix.make_cache()
    prefill(model, cache, tokens, 0, block)
    prefix.store(tokens, cache)
    assert assert_exact(model, prefix, tokens + [1]) == 200
    n = assert_exact(model, prefix, tokens[:40] + [2] * 30)  # window rows for 40 were dropped
    assert n == 0
    stats = prefix.stats()
    assert stats["walkbacks"] >= 1 and stats["walkback_tokens_lost"] >= 32


@needs_quantized_matmul
def test_quantized_kv_cache_list_stays_quantized() -> None:
    block = 16
    model = tiny_model("llama", hidden_size=128)
    make = lambda: [QuantizedKVCache(group_size=32, bits=8) for _ in model.layers]  # noqa: E731
    prefix = hot_prefix(model, block, make_cache=make)
    stored = store_prompt(model, prefix, prompt(3 * block + 7))
    assert assert_exact(model, prefix, stored[:2 * block + 5] + [8] * 9) == 2 * block + 5
    cache, n = prefix.fetch(stored + [1])
    assert n == len(stored) and all(isinstance(c, QuantizedKVCache) for c in cache)
    assert cache[0].keys[0].dtype == mx.uint32


def test_preallocated_rotating_layout() -> None:
    block = 16
    model = tiny_model("llama")
    make = lambda: make_bounded_cache(model, max_kv_size=48, keep=4)  # noqa: E731
    prefix = hot_prefix(model, block, make_cache=make)
    stored = store_prompt(model, prefix, prompt(100), decode=10)
    assert assert_exact(model, prefix, stored + [9], decoded_from=100) == len(stored)
    assert assert_exact(model, prefix, stored[:90] + [(stored[90] + 1) % 256] * 8) == 90


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "qwen3_next"])
def test_through_generate_step(arch: str) -> None:
    block = 16
    model = tiny_model(arch)
    prefix = hot_prefix(model, block)
    stored = store_prompt(model, prefix, prompt(70))
    query = stored[:50] + [11, 12, 13, 14]
    cache, n = prefix.fetch(query)
    assert n == _expected(arch, 50, block)
    cold = prefix.make_cache()
    prefill(model, cold, query[:n], 0, block)
    warm = list(generate_step(mx.array(query[n:]), model, prompt_cache=cache, max_tokens=8))
    ref = list(generate_step(mx.array(query[n:]), model, prompt_cache=cold, max_tokens=8))
    assert [t for t, _ in warm] == [t for t, _ in ref]
    assert max(mx.abs(a - b).max().item() for (_, a), (_, b) in zip(warm, ref)) == 0.0


def test_namespaces_and_models_never_share_chains() -> None:
    model = tiny_model("llama")
    a = hot_prefix(model, 16, namespace="tenant-a")
    b = type(a)(a.manager, model, namespace="tenant-b")
    c = type(a)(a.manager, tiny_model("llama", dtype=mx.float16), namespace="tenant-a")
    stored = store_prompt(model, a, prompt(40))
    assert a.fetch(stored + [1])[1] == 40
    assert b.fetch(stored + [1]) == (None, 0)
    assert c.fetch(stored + [1]) == (None, 0)
    assert b.last_fetch.tier == "miss"


def test_dedup_of_conversations_sharing_a_system_prompt() -> None:
    block, convs = 16, 5
    model = tiny_model("llama")
    prefix = hot_prefix(model, block)
    system = prompt(3 * block)
    for i in range(convs):
        store_prompt(model, prefix, system + prompt(2 * block + 4, seed=i + 1))
    stats = prefix.stats()
    # 3 shared blocks once, then per conversation 2 full blocks + 1 partial tail
    assert stats["blocks_written"] == 3 + convs * 3
    assert stats["blocks_deduplicated"] == 3 * (convs - 1)
    assert prefix.manager.stats()["hot"]["blocks"] == 3 + convs * 3


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_fetched_cache_goes_into_batch_generator(arch: str) -> None:
    from mlx_lm.generate import BatchGenerator

    block = 16
    model = tiny_model(arch)
    prefix = hot_prefix(model, block)
    stored = store_prompt(model, prefix, prompt(90))
    query = stored[:70] + [21, 22, 23]
    cache, n = prefix.fetch(query)
    assert n == 70
    cold = prefix.make_cache()
    prefill(model, cold, query[:n], 0, block)

    def run(c: list) -> list[int]:
        gen = BatchGenerator(model, max_tokens=8)
        gen.insert([query[n:]], caches=[c])
        out: list[int] = []
        while len(out) < 8:
            _, generated = gen.next()  # (prompt-processing responses, generation responses)
            out += [r.token for r in generated]
        gen.close()
        return out

    assert run(cache) == run(cold)


def test_chain_keys_equal_the_per_block_encoding() -> None:
    """Keys must never change (existing cache directories are reused after a restart): the
    one-buffer chain_keys equals the original per-block encoding, written out here."""
    import hashlib

    import numpy as np

    from paged_cache.hashing import block_key, chain_keys

    def original(fingerprint: str, namespace: str, tokens: list[int], bs: int) -> list[str]:
        keys, parent = [], ""
        for s in range(0, len(tokens), bs):
            h = hashlib.blake2b(digest_size=32)
            for part in (b"paged-cache/block/v1\0", fingerprint.encode(), namespace.encode(),
                         parent.encode(), np.asarray(tokens[s:s + bs], dtype="<i8").tobytes()):
                h.update(len(part).to_bytes(8, "little"))
                h.update(part)
            parent = h.hexdigest()
            keys.append(parent)
        return keys

    tokens = [(i * 7919) % 151_000 for i in range(1000)] + [2**40, 0, 5]
    for bs, n in [(256, 1003), (16, 48), (16, 7), (64, 0), (1, 5)]:
        part = tokens[:n]
        keys = chain_keys("f" * 64, "ns", part, bs)
        assert keys == original("f" * 64, "ns", part, bs)
        assert keys == [block_key("f" * 64, "ns", keys[j - 1] if j else "", part[j * bs:(j + 1) * bs])
                        for j in range(len(keys))]
    assert chain_keys("a" * 64, "", tokens, 100) == original("a" * 64, "", tokens, 100)
    assert chain_keys("a" * 64, "", np.asarray(tokens), 100) == original("a" * 64, "", tokens, 100)
