"""Helpers shared by the prefix-cache tests (no tests here): the Scheduler's part, played by hand.

Prefill runs in block-aligned chunks and captures a boundary snapshot after each chunk, as the
Scheduler does; exactness compares a warm run (fetch + continue) with a cold run of the same
chunking, logits max abs diff 0.0, for the rest of the prompt and 8 greedy decode steps.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import mlx.core as mx

from paged_cache.layout import layer_arrays
from paged_cache.prefix_cache import BlockAwarePrefixCache
from helpers.managers import new_manager

DECODE_STEPS = 8


def prompt(n: int, seed: int = 0) -> list[int]:
    """Deterministic token ids in [0, 256)."""
    return [(i * 37 + seed * 101 + 5) % 256 for i in range(n)]


def chunks(start: int, stop: int, block: int) -> Iterator[tuple[int, int]]:
    """The prefill chunks of ``[start, stop)``: ``(s, e)`` ending on block boundaries."""
    s = start
    while s < stop:
        e = min((s // block + 1) * block, stop)
        yield s, e
        s = e


def prefill(model: Any, cache: list, tokens: list[int], start: int, block: int,
            prefix: BlockAwarePrefixCache | None = None, snapshots: dict | None = None) -> mx.array:
    """Feed tokens[start:] in chunks ending on block boundaries; capture after each boundary."""
    outs = []
    for s, e in chunks(start, len(tokens), block):
        outs.append(model(mx.array([tokens[s:e]]), cache=cache))
        if prefix is not None and e % block == 0:
            snap = prefix.capture_boundary(cache, s, boundary=e)
            if snap is not None:
                snapshots[e] = snap
    mx.eval(outs)
    return mx.concatenate(outs, axis=1)


def store_prompt(model: Any, prefix: BlockAwarePrefixCache, tokens: list[int],
                 decode: int = 0) -> list[int]:
    """Prefill (+ ``decode`` 1-token steps), store, free the snapshots; return the tokens stored.
    The store says its rows were prefilled on the block grid from 0 (``prefill_grid``)."""
    cache, snaps = prefix.make_cache(), {}
    logits = prefill(model, cache, tokens, 0, prefix.block_size, prefix, snaps)
    tokens = list(tokens)
    for _ in range(decode):
        tok = mx.argmax(logits[:, -1:], axis=-1)
        tokens.append(tok.item())
        logits = model(tok, cache=cache)
    # the last decoded token's KV is in the cache: store exactly what the cache covers
    on_grid = len(tokens) - decode
    on_grid -= on_grid % prefix.block_size
    prefix.store(tokens, cache, snapshots=snaps,
                 prefill_grid=(prefix.block_size, on_grid) if on_grid else None)
    for snap in snaps.values():
        snap.release()
    return tokens


def assert_exact(model: Any, prefix: BlockAwarePrefixCache, query: list[int],
                 make_cache: Callable[[], list] | None = None, decoded_from: int | None = None,
                 prefill_chunk: int | None = None) -> int:
    """Fetch for ``query``, continue warm and cold (same chunking), assert 0.0 diff; return n.

    ``decoded_from``: the stored cache fed tokens from there on one at a time (decode), so the
    cold run does the same for its first ``n`` tokens. ``prefill_chunk``: passed to the fetch
    (both at once may prefill a head on that grid; the stores here chunk by block).
    """
    block = prefix.block_size
    cache, n = prefix.fetch(query, prefill_chunk=prefill_chunk)
    assert n <= len(query) - 1
    cold = (make_cache or prefix.make_cache)()
    if n:
        assert cache is not None and len(cache) == len(cold)
        split = n if decoded_from is None else min(n, decoded_from)
        prefill(model, cold, query[:split], 0, block)
        for tok in query[split:n]:
            model(mx.array([[tok]]), cache=cold)
    else:
        assert cache is None
        cache = (make_cache or prefix.make_cache)()
    refs, gots = [], []
    for s, e in chunks(n, len(query), block):
        refs.append(model(mx.array([query[s:e]]), cache=cold))
        gots.append(model(mx.array([query[s:e]]), cache=cache))
        assert_laid_out_alike(cache, cold, f"after the chunk [{s}, {e}) (n={n})")
    ref, got = mx.concatenate(refs, axis=1), mx.concatenate(gots, axis=1)
    diff = mx.abs(ref.astype(mx.float32) - got.astype(mx.float32)).max().item()
    assert diff == 0.0, f"prefill logits differ by {diff} (n={n})"
    for step in range(DECODE_STEPS):
        tok = mx.argmax(ref[:, -1:], axis=-1)
        ref, got = model(tok, cache=cold), model(tok, cache=cache)
        assert_laid_out_alike(cache, cold, f"after decode step {step} (n={n})")
        diff = mx.abs(ref.astype(mx.float32) - got.astype(mx.float32)).max().item()
        assert diff == 0.0, f"decode step {step} logits differ by {diff} (n={n})"
    return n


def assert_laid_out_alike(cache: list, cold: list, where: str) -> None:
    """After a forward, ``cache``'s buffers are laid out as the cold cache's: the shapes its
    kernels just ran on (a GPU picks its kernels by shape and stride)."""
    assert buffer_layout(cache) == buffer_layout(cold), f"buffers differ from a cold cache's {where}"


def buffer_layout(cache: list) -> list:
    """Per layer: its type, offset and every array's dtype, shape and strides (the buffers,
    not views; MLX's buffer protocol gives the strides its kernels are handed)."""
    return [(type(layer).__name__, getattr(layer, "offset", None),
             [(a.dtype, tuple(a.shape), strides(a)) for a in layer_arrays(layer)])
            for layer in cache]


def strides(a: mx.array) -> tuple:
    """``a``'s strides in bytes, None along a dimension of size 1 (no element is stepped to)."""
    return tuple(s if d > 1 else None for s, d in zip(memoryview(a).strides, a.shape))


def hot_prefix(model: Any, block: int, **kwargs: Any) -> BlockAwarePrefixCache:
    """A prefix cache over a hot-only manager."""
    manager = new_manager(block_size=block)
    return BlockAwarePrefixCache(manager, model, **kwargs)
