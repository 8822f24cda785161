"""Handlers in isolation: owning copies, rotating row/position mapping, explicit flags, bad input."""

from __future__ import annotations

import gc
import logging

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, ChunkedKVCache, KVCache, RotatingKVCache

from paged_cache.caches import PreallocatedRotatingKVCache
from paged_cache.handlers import Part, Span, handler_for
from paged_cache.testing import tiny_model

from helpers.prefix import hot_prefix, prefill, prompt, store_prompt


def _positions(n0: int, n1: int) -> tuple[mx.array, mx.array]:
    """Keys/values whose every element is the token position (so rows name their position)."""
    pos = mx.arange(n0, n1, dtype=mx.float32).reshape(1, 1, -1, 1)
    kv = mx.broadcast_to(pos, (1, 2, n1 - n0, 4))
    return kv, kv + 0.5


def _feed(layer, schedule: list[int]) -> int:
    """Feed chunks of the given sizes (1 = a decode step); return the offset."""
    pos = 0
    for size in schedule:
        layer.update_and_fetch(*_positions(pos, pos + size))
        pos += size
    mx.eval(layer.keys)
    return pos


def test_block_copies_do_not_pin_the_sequence_buffer() -> None:
    layer = KVCache()
    layer.update_and_fetch(mx.zeros((1, 8, 4000, 64)), mx.zeros((1, 8, 4000, 64)))
    mx.eval(layer.keys, layer.values)
    (arrays, desc), = handler_for(layer).cut(layer, [(100, 116)], {}, 4000)
    mx.eval(list(arrays.values()))
    block_bytes = sum(a.nbytes for a in arrays.values())
    gc.collect()
    before = mx.get_active_memory()
    del layer
    gc.collect()
    freed = before - mx.get_active_memory()
    assert freed >= 2 * 8 * 4096 * 64 * 4 - 1  # the whole 4096-row buffer pair went away
    assert block_bytes == 2 * 8 * 16 * 64 * 4 and desc == {"has_rows": True}


@pytest.mark.parametrize("cls", [RotatingKVCache, PreallocatedRotatingKVCache])
@pytest.mark.parametrize("schedule", [[40], [16] * 7, [16] * 6 + [1] * 29, [50, 30] + [1] * 70])
def test_rotating_rows_map_to_absolute_positions(cls, schedule: list[int]) -> None:
    layer = cls(max_size=32, keep=4)
    end = _feed(layer, schedule)
    handler = handler_for(layer)
    spans = [(s, min(s + 8, end)) for s in range(0, end, 8)]
    cuts = handler.cut(layer, spans, {}, end)
    window = set(range(4)) | set(range(end - 28, end)) if end > 32 else set(range(end))
    for (s, e), (arrays, desc) in zip(spans, cuts):
        if not desc["has_rows"]:
            assert not set(range(s, e)) & window
            continue
        held = [p for a, b in desc.get("rows", [[s, e]]) for p in range(a, b)]
        assert set(range(s, e)) & window <= set(held) <= set(range(s, e))  # the buffer may hold more
        assert arrays["keys"][0, 0, :, 0].tolist() == held
        assert arrays["values"][0, 1, 0, 0].item() == held[0] + 0.5
    # rebuild at the end: keep rows + newest rows, never fewer than max_size once past it
    fresh = cls(max_size=32, keep=4)
    parts = [Part(s, e, d, dict(a)) for (s, e), (a, d) in zip(spans, cuts)]
    idx = handler.plan(fresh, [Span(p.start, p.end, p.desc) for p in parts], end)
    assert idx is not None
    rebuilt = handler.rebuild(fresh, [parts[i] for i in idx], end)
    temporal = rebuilt._temporal_order(rebuilt.keys)[0, 0, :, 0].tolist()
    expect = sorted(window)
    assert temporal == expect and rebuilt.offset == end
    assert rebuilt.keys.shape[2] >= min(end, 32)
    live = layer._temporal_order(layer.keys)[0, 0, :, 0].tolist()
    assert live[:4] == expect[:4] and live[-28:] == expect[-28:]


def test_chunked_rows_are_relative_to_start_position() -> None:
    layer = ChunkedKVCache(chunk_size=20)
    end = 0
    for size in (16, 16, 16):
        layer.maybe_trim_front()
        layer.update_and_fetch(*_positions(end, end + size))
        end += size
    handler = handler_for(layer)
    cuts = handler.cut(layer, [(0, 16), (16, 32), (32, 48)], {}, end)
    assert [d.get("rows") for _, d in cuts] == [[[12, 16]], None, None]  # start_position 12
    fresh = ChunkedKVCache(chunk_size=20)
    parts = [Part(s, s + 16, d, dict(a)) for s, (a, d) in zip((0, 16, 32), cuts)]
    spans = [Span(p.start, p.end, p.desc) for p in parts]
    # a query at 48 attends within its chunk [40, 60): only rows [40, 48) are needed
    assert handler.plan(fresh, spans, 48) == [2]
    rebuilt = handler.rebuild(fresh, [Part(p.start, p.end, p.desc, dict(p.arrays))
                                      for p in parts[1:]], 48)   # (rebuild pops arrays)
    assert rebuilt.start_position == 28 and rebuilt.offset == 48
    assert rebuilt.keys[0, 0, :20, 0].tolist() == list(range(28, 48))
    # from the block holding [32, 48) alone: rows [28, 32), masked for every later query, are 0
    rebuilt = handler.rebuild(ChunkedKVCache(chunk_size=20), [parts[2]], 48)
    assert rebuilt.keys[0, 0, :20, 0].tolist() == [0] * 4 + list(range(32, 48))
    assert handler.plan(fresh, spans, 32) == [1]  # needs [20, 32)
    assert handler.plan(fresh, spans, 40) == [2]  # a chunk boundary: any block, for the shapes
    assert handler.plan(fresh, spans, 30) == [1]  # needs [20, 30)
    assert handler.plan(fresh, spans, 18) is None  # needs [0, 18): rows 0-11 are gone


def test_arrays_cache_records_has_state_per_block() -> None:
    layer = ArraysCache(size=2)
    layer[0], layer[1] = mx.ones((1, 2, 3)), mx.zeros((1, 4))
    handler = handler_for(layer)
    snap = handler.capture(layer, 0, 16)
    cuts = handler.cut(layer, [(0, 16), (16, 32), (32, 40)], {16: snap}, 40)
    assert [d["has_state"] for _, d in cuts] == [True, False, True]
    spans = [Span(s, e, d) for (s, e), (_, d) in zip([(0, 16), (16, 32), (32, 40)], cuts)]
    assert handler.plan(ArraysCache(2), spans, 32) is None
    assert handler.plan(ArraysCache(2), spans, 16) == [0]


def test_bad_input_is_rejected_and_nothing_stored_is_corrupted() -> None:
    model = tiny_model("llama")
    prefix = hot_prefix(model, 16)
    stored = store_prompt(model, prefix, prompt(40))
    held = prefix.manager.stats()["hot"]["blocks"]
    cache = prefix.make_cache()
    prefill(model, cache, prompt(40, seed=2), 0, 16)
    with pytest.raises(TypeError, match="tokens"):
        prefix.store([1.0] * 40, cache)
    with pytest.raises(TypeError, match="tokens"):
        prefix.fetch("hello")
    with pytest.raises(TypeError, match="tokens"):
        prefix.fetch(mx.array([[1, 2, 3]]))
    with pytest.raises(ValueError, match="offset"):
        prefix.store(prompt(39, seed=2), cache)
    with pytest.raises(ValueError, match="entries"):
        prefix.store(prompt(40, seed=2), cache[:1])
    with pytest.raises(TypeError, match="entry 1"):
        prefix.store(prompt(40, seed=2), [cache[0], RotatingKVCache(8)])
    with pytest.raises(TypeError, match="snapshots"):
        prefix.store(prompt(40, seed=2), cache, snapshots=[1])
    with pytest.raises(ValueError, match="since"):
        prefix.capture_boundary(cache, -1, boundary=32)
    assert prefix.manager.stats()["hot"]["blocks"] == held
    assert prefix.fetch(stored + [1])[1] == 40


class OpaqueCache:
    """A cache type no handler knows (real class, used by a real model call)."""

    def __init__(self) -> None:
        self.inner = KVCache()

    def __getattr__(self, name: str):
        return getattr(self.__dict__["inner"], name)


def test_unknown_cache_type_is_not_cached_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    model = tiny_model("llama")
    prefix = hot_prefix(model, 16, make_cache=lambda: [OpaqueCache() for _ in model.layers])
    with caplog.at_level(logging.WARNING, logger="paged_cache"):
        assert prefix.store(prompt(20), [OpaqueCache() for _ in model.layers]) == 0
        assert prefix.fetch(prompt(20)) == (None, 0)
        assert prefix.store(prompt(20), []) == 0
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "OpaqueCache" in warnings[0].getMessage()
    assert prefix.manager.stats()["hot"]["blocks"] == 0 and not prefix.needs_snapshots
    assert prefix.stats()["refused_unsupported"] == 3 and prefix.stats()["misses"] == 1
    assert prefix.unsupported == "no paged-cache handler for cache type OpaqueCache"
