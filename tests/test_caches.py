"""PreallocatedRotatingKVCache equals mlx-lm's RotatingKVCache; make_bounded_cache layouts."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from paged_cache.caches import PreallocatedRotatingKVCache, cache_layout, make_bounded_cache
from paged_cache.testing import tiny_model

WINDOW, KEEP = 32, 4


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def _greedy(model, cache, prompt, max_tokens, step):
    """Greedy tokens and log-probs of mlx-lm's own generate_step on ``cache`` (mutated)."""
    out = list(generate_step(mx.array(prompt), model, prompt_cache=cache,
                             max_tokens=max_tokens, prefill_step_size=step))
    return [t for t, _ in out], [lp for _, lp in out]


@pytest.mark.parametrize("step", [16, 48])  # chunks shorter and longer than the window
def test_preallocated_equals_rotating_token_for_token(llama, step):
    prompt = [(i * 7) % 256 for i in range(100)]
    follow_up = [(i * 11) % 256 for i in range(50)]
    runs = []
    for cls in (RotatingKVCache, PreallocatedRotatingKVCache):
        cache = [cls(WINDOW, KEEP) for _ in llama.layers]
        first = _greedy(llama, cache, prompt, 1000, step)
        assert cache[0].keys.shape[2] == WINDOW  # after 1000 decode tokens
        # second turn on the same cache: a multi-token chunk after the buffer became a ring
        second = _greedy(llama, cache, follow_up, 20, step)
        runs.append((first, second))
    (ref1, ref2), (pre1, pre2) = runs
    assert pre1[0] == ref1[0] and pre2[0] == ref2[0]
    assert len(set(ref1[0])) > 20  # not a degenerate repetition
    for ref, pre in ((ref1, pre1), (ref2, pre2)):
        assert max(mx.abs(a - b).max().item() for a, b in zip(ref[1], pre[1])) == 0.0


def test_buffer_is_max_size_from_first_update():
    cache = PreallocatedRotatingKVCache(WINDOW, KEEP)
    row = mx.ones((1, 2, 1, 8))
    cache.update_and_fetch(row, row)
    assert cache.keys.shape == (1, 2, WINDOW, 8) and cache.values.shape == (1, 2, WINDOW, 8)
    assert cache.nbytes == 2 * WINDOW * 2 * 8 * 4
    for _ in range(1000):
        k, v = cache.update_and_fetch(row, row)
    assert cache.keys.shape[2] == WINDOW and k.shape[2] == WINDOW and cache.offset == 1001
    # a first chunk longer than the window attends to all of it but keeps only the window
    long = PreallocatedRotatingKVCache(WINDOW, KEEP)
    chunk = mx.arange(100 * 8, dtype=mx.float32).reshape(1, 1, 100, 8)
    k, _ = long.update_and_fetch(chunk, chunk)
    assert k.shape[2] == 100 and long.keys.shape[2] == WINDOW
    kept = long.keys[0, 0, :, 0].tolist()
    assert kept == [8.0 * t for t in list(range(KEEP)) + list(range(100 - WINDOW + KEEP, 100))]


def _decode_peak(cls) -> tuple[int, set[int]]:
    """Peak bytes above the steady state while decoding 1000 tokens into a 4 MiB window.

    ``reset_peak_memory`` sets the peak to 0, so a result <= 0 means nothing was allocated.
    """
    cache = cls(1024, KEEP)
    mx.random.seed(0)
    prefix, row = mx.random.normal((1, 8, 40, 128)), mx.random.normal((1, 8, 1, 128))
    mx.eval(cache.update_and_fetch(prefix, prefix), cache.state, row)
    steady = mx.get_active_memory()
    mx.reset_peak_memory()
    sizes = set()
    for _ in range(1000):
        mx.eval(cache.update_and_fetch(row, row))
        sizes.add(cache.keys.shape[2])
    return mx.get_peak_memory() - steady, sizes


def test_decode_never_reallocates():
    buffer = 2 * 1024 * 8 * 128 * 4  # keys + values of a full window
    grown_peak, grown_sizes = _decode_peak(RotatingKVCache)
    peak, sizes = _decode_peak(PreallocatedRotatingKVCache)
    assert sizes == {1024}
    assert peak <= 0  # nothing allocated at all: every row is written in place
    assert grown_peak >= buffer and len(grown_sizes) > 1  # mlx-lm's class: grow-by-concat spikes


def test_make_bounded_cache_layouts(llama):
    assert cache_layout(make_bounded_cache(llama)) == ["KVCache"] * 2
    assert cache_layout(make_bounded_cache(llama, 128)) == [
        ("PreallocatedRotatingKVCache", 128, 4)] * 2
    assert cache_layout(make_bounded_cache(llama, 128, keep=0, preallocate=False)) == [
        ("RotatingKVCache", 128, 0)] * 2

    gemma = tiny_model("gemma3_text")  # sliding window 64 on layers 0 and 2
    assert cache_layout(make_bounded_cache(gemma, 48)) == [
        ("PreallocatedRotatingKVCache", 48, 0), ("PreallocatedRotatingKVCache", 48, 4)] * 2
    assert cache_layout(make_bounded_cache(gemma, 128, preallocate=False)) == [
        ("RotatingKVCache", 64, 0), ("RotatingKVCache", 128, 4)] * 2

    qwen = make_bounded_cache(tiny_model("qwen3_next"), 128)
    assert cache_layout(qwen) == ["ArraysCache", ("PreallocatedRotatingKVCache", 128, 4)] * 2
    assert isinstance(qwen[0], ArraysCache)

    baichuan = make_bounded_cache(tiny_model("baichuan_m1"), 128)
    assert cache_layout(baichuan) == [
        ("ArraysCache", ("PreallocatedRotatingKVCache", 32, 0)),
        ("ArraysCache", ("PreallocatedRotatingKVCache", 128, 4))]
    assert all(isinstance(c, KVCache) for c in make_bounded_cache(tiny_model("llama")))


@pytest.mark.parametrize("arch", ["gemma3_text", "baichuan_m1"])
def test_bounded_models_match_mlx_rotating(arch):
    """Through a model's own mixed layout, preallocated windows give mlx-lm's exact logits."""
    model = tiny_model(arch)
    prompt = [(i * 5 + 3) % 256 for i in range(90)]
    ref = _greedy(model, make_bounded_cache(model, 40, preallocate=False), prompt, 120, 24)
    pre = _greedy(model, make_bounded_cache(model, 40), prompt, 120, 24)
    assert pre[0] == ref[0]
    assert max(mx.abs(a - b).max().item() for a, b in zip(ref[1], pre[1])) == 0.0


@pytest.mark.parametrize("kwargs, name", [
    (dict(max_kv_size=1), "max_kv_size"), (dict(max_kv_size="64"), "max_kv_size"),
    (dict(max_kv_size=64, keep=64), "keep"), (dict(max_kv_size=64, keep=-1), "keep"),
])
def test_make_bounded_cache_rejects_bad_sizes(llama, kwargs, name):
    with pytest.raises(ValueError, match=name):
        make_bounded_cache(llama, **kwargs)
