"""Windowed layers rebuilt exactly past their window: rotating layers in the live cache's own row
order whatever the history's chunking (one token at a time, block chunks, both), chunked layers
(llama4) at any position whose rows since the last chunk boundary are held."""

from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx
import pytest

from paged_cache.caches import make_bounded_cache
from paged_cache.prefix_cache import BlockAwarePrefixCache
from paged_cache.testing import tiny_model

from helpers.prefix import assert_exact, hot_prefix, prefill, prompt

# every test on both row paths: numpy copies (the CPU's) and MLX ops (a GPU's)
pytestmark = pytest.mark.usefixtures("rows_moved_by")

BLOCK = 16


def _run(model: Any, cache: list, tokens: list[int], split: int,
         prefix: BlockAwarePrefixCache | None = None, snaps: dict | None = None) -> None:
    """Feed ``tokens`` into a fresh ``cache``: chunks ending on the block grid up to ``split``,
    then one token at a time (a decode); with ``prefix``, capture at every block boundary."""
    pos = since = 0
    while pos < len(tokens):
        end = min((pos // BLOCK + 1) * BLOCK, split) if pos < split else pos + 1
        mx.eval(model(mx.array([tokens[pos:end]]), cache=cache))
        pos = end
        if prefix is not None and pos % BLOCK == 0:
            snap = prefix.capture_boundary(cache, since)
            if snap is not None:
                snaps[pos] = snap
            since = pos


def _decode_diff(model: Any, warm: list, cold: list, tokens: list[int]) -> float:
    """Feed ``tokens`` one at a time to both caches; the largest logits difference."""
    worst = 0.0
    for tok in tokens:
        a, b = model(mx.array([[tok]]), cache=warm), model(mx.array([[tok]]), cache=cold)
        worst = max(worst, mx.abs(a - b).max().item())
    return worst


LAYOUTS: dict[str, Callable[[Any], Any]] = {
    "gemma3_text": lambda: (tiny_model("gemma3_text"), None),                 # window 64, keep 0
    "rotating-keep4": lambda: (tiny_model("llama"), lambda m: make_bounded_cache(m, 48, 4, False)),
    "preallocated-keep4": lambda: (tiny_model("llama"), lambda m: make_bounded_cache(m, 48, 4)),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("split", [0, 70, 128], ids=["one-token", "chunks-then-tokens", "chunks"])
def test_a_rotating_layer_is_rebuilt_past_its_window_in_the_live_row_order(layout: str,
                                                                          split: int) -> None:
    model, bounded = LAYOUTS[layout]()
    make = None if bounded is None else (lambda: bounded(model))
    prefix = hot_prefix(model, BLOCK, make_cache=make)
    tokens = prompt(128)
    cache, snaps = prefix.make_cache(), {}
    _run(model, cache, tokens, split, prefix, snaps)
    prefix.store(tokens, cache, snapshots=snaps)
    for n in (80, 90, 96, 112, 127):
        branch = [(tokens[n] + 1) % 256, 8, 9, 10]
        warm, got = prefix.fetch(tokens[:n] + branch)
        assert got == n
        cold = prefix.make_cache()
        _run(model, cold, tokens[:n], split)        # the same history up to n
        diff = _decode_diff(model, warm, cold, branch + [11, 12])
        assert diff == 0.0, f"n={n}: one-token continuation off by {diff}"


def test_a_chunked_layer_is_restored_wherever_its_rows_since_the_chunk_boundary_are_held() -> None:
    """llama4's chunked layers attend only within their chunk of 32 positions: a rebuild at ``n``
    needs the rows since the last chunk boundary, not the last 32 rows (those before the boundary
    are masked out for every later query)."""
    model = tiny_model("llama4")
    prefix = hot_prefix(model, BLOCK)
    tokens = prompt(160)
    cache = prefix.make_cache()
    prefill(model, cache, tokens, 0, BLOCK)    # no captures: the chunked rows held are [112, 160)
    prefix.store(tokens, cache)
    for n, expect in ((159, 159), (150, 150), (130, 130), (128, 128), (127, 96), (100, 96)):
        query = tokens[:n] + [(tokens[n] + 1) % 256] * 5
        assert assert_exact(model, prefix, query) == expect, n
