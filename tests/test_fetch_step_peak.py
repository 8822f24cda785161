"""Fetch + the first forward copy the KV once: no grow copy at the step after a fetch.

A restore ends on a block boundary, so a buffer holding exactly its rows would be full, and the
next token would make mlx-lm's KVCache grow every layer by concatenating the whole buffer with
256 new rows. A rebuilt buffer is sized as a cold cache is after that forward, so the step
writes in place. Measured as MLX's peak of the fetch and one decode step above the state before
the fetch and the KV the fetch brings into memory (from SSD the rebuilt cache is new memory;
from RAM, ``hot_cache_only``, the blocks are handed over), per byte of live KV: <= 0.1x, hot and
SSD, both for a decode step of the model and for the token's rows written into every layer and
evaluated at once (``benchmarks.scale.write_step``: where the grow copies of all layers coexist,
0.37x at this size with buffers sized as a cold cache before the forward). The default suite runs a 32-layer fp16 model at 128 MiB of KV
(8,192 tokens: the 256 rows of room a cold cache also holds are 3% of it); ``--long`` runs the
8B-shaped 2 GiB conversation of ``benchmarks/scale.py`` (32 layers x 8 KV heads x 128 dims,
16,384 tokens).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

from benchmarks.common import io_model, kv_model
from benchmarks.scale import BLOCK, paged

BOUND = 0.1


def _over_kv(tmp_path: Path, model, n: int, ssd: bool) -> float:
    tokens = [(7 * i + 3) % 251 for i in range(n + 1)]
    side = paged(tmp_path, model, tokens, n, 1, ssd=ssd)
    print(f"\n{'ssd' if ssd else 'hot'}: peak above before +{side['peak_per_kv']:.3f}x (decode "
          f"step), +{side['write_peak_per_kv']:.3f}x (every layer's write at once); "
          f"+{side['over_kv']:.3f}x above before and the KV fetched")
    return side["over_kv"]


@pytest.mark.parametrize("ssd", [False, True], ids=["hot_cache_only", "ssd"])
def test_fetch_and_step_add_no_copy(tmp_path: Path, ssd: bool) -> None:
    model = kv_model(layers=32, kv_heads=2, head_dim=64, dtype=mx.float16)
    assert _over_kv(tmp_path, model, 32 * BLOCK, ssd) <= BOUND


@pytest.mark.long
@pytest.mark.parametrize("ssd", [False, True], ids=["hot_cache_only", "ssd"])
def test_fetch_and_step_add_no_copy_at_2_gib(tmp_path: Path, ssd: bool) -> None:
    assert _over_kv(tmp_path, io_model(), 64 * BLOCK, ssd) <= BOUND
