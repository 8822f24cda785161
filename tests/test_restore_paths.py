"""The restore's copy paths: numpy copies into MLX-owned buffers (CPU) and MLX ops (GPU backends)
give the same exact caches; SSD payloads read straight into place; token ids from any input."""

from __future__ import annotations

import os
from pathlib import Path

import lz4.frame
import mlx.core as mx
import numpy as np
import pytest

from paged_cache import Block
from paged_cache.config import CacheConfig
from paged_cache.hashing import chain_keys, token_ids
from paged_cache.manager import PagedSSDCacheManager
from paged_cache.row_path import host_view
from paged_cache.prefix_cache import BlockAwarePrefixCache
from paged_cache.testing import tiny_model
from paged_cache.tiers import format as fmt
from paged_cache.tiers.ssd.direct import StoredBlock, read_stored
from paged_cache.tiers.ssd.tier import SSDTier

from helpers.prefix import assert_exact, hot_prefix, prompt, store_prompt

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


@pytest.mark.parametrize("arch,dtype", [("llama", "float16"), ("llama", "bfloat16"),
                                        ("gemma3_text", "float32"), ("qwen3_next", "bfloat16")])
def test_both_copy_paths_are_exact(rows_moved_by: str, arch: str, dtype: str) -> None:
    block = 16
    model = tiny_model(arch, dtype=DTYPES[dtype])
    prefix = hot_prefix(model, block)
    stored = store_prompt(model, prefix, prompt(3 * block + 5))
    assert assert_exact(model, prefix, stored + [1, 2, 3]) == len(stored)
    store_prompt(model, prefix, stored)  # the hit handed the chain over: store it again
    assert assert_exact(model, prefix, stored[:2 * block] + [7] * 9) >= 2 * block


def test_restored_buffers_own_their_memory() -> None:
    """A hit on blocks another conversation shares copies them (the hot tier keeps them as they
    were); the rebuilt buffers alias neither the blocks nor each other."""
    block = 16
    model = tiny_model("llama", dtype=mx.float16)
    prefix = hot_prefix(model, block)
    tokens = prompt(3 * block)
    store_prompt(model, prefix, tokens + [5] * block)
    store_prompt(model, prefix, tokens + [6] * block)  # the first three blocks are shared
    held = {k: {n: np.array(host_view(a)) for n, a in prefix.manager.get(k).arrays.items()}
            for k in chain_keys(prefix.fingerprint, "", tokens, block)}
    cache, n = prefix.fetch(tokens + [9])
    assert n == len(tokens)
    views = [host_view(a) for layer in cache for a in (layer.keys, layer.values)]
    for key, arrays in held.items():
        block_arrays = prefix.manager.get(key).arrays
        for name, before in arrays.items():
            now = host_view(block_arrays[name])
            assert np.array_equal(now, before)
            assert not any(np.shares_memory(now, v) for v in views)
    assert not any(np.shares_memory(a, b) for i, a in enumerate(views) for b in views[i + 1:])


@pytest.mark.parametrize("compression", ["none", "lz4"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_ssd_blocks_are_read_into_place_and_exact(tmp_path: Path, compression: str, dtype: str,
                                                  rows_moved_by: str) -> None:
    block = 16
    model = tiny_model("llama", dtype=DTYPES[dtype])
    config = CacheConfig(block_size=block, ssd_dir=tmp_path, compression=compression,
                         hot_cache_max_bytes=0, ssd_read_threads=2, fetch_policy="always-restore")
    with PagedSSDCacheManager(config) as manager:
        stored = store_prompt(model, BlockAwarePrefixCache(manager, model), prompt(4 * block + 3))
    with PagedSSDCacheManager(config) as manager:  # a restart: every block only on disk
        prefix = BlockAwarePrefixCache(manager, model)
        key = chain_keys(prefix.fingerprint, "", stored, block)[0]
        got = manager.get(key, take=True, in_place=True)
        assert isinstance(got, StoredBlock) and isinstance(manager.get(key, take=True), Block)
        got.close()
        assert assert_exact(model, prefix, stored + [1, 2]) == len(stored)
        assert prefix.last_fetch.tier == "ssd"
        assert manager.stats()["ssd"]["damaged"] == 0


def _block(i: int, dtype=mx.float16) -> Block:
    keys = (mx.arange(2 * 3 * 8 * 4) + 100 * i).astype(dtype).reshape(1, 2 * 3, 8, 4)
    values = (keys + 0.5).astype(dtype)
    mx.eval(keys, values)
    key = f"{i:064x}"
    return Block(key, {"l0.keys": keys, "l0.values": values}, {"tokens": "8"})


@pytest.mark.parametrize("compression", ["none", "lz4"])
def test_stored_rows_land_in_place_and_damage_is_caught(tmp_path: Path, compression: str) -> None:
    blocks = [_block(i, mx.bfloat16 if i % 2 else mx.float16) for i in range(3)]
    with SSDTier(tmp_path, max_bytes=1 << 30, compression=compression) as tier:
        for b in blocks:
            assert tier.write_sync(b.key, fmt.raw_tensors(b), b.meta)
        stored = [tier.open_stored(b.key) for b in blocks]
        outs = []
        for b, s in zip(blocks, stored):
            assert s.meta == b.meta and set(s.arrays) == set(b.arrays)
            # rows 2..7 of each tensor into rows 1..6 of a 10-row destination
            out = {n: np.zeros((1, 6, 10, 4), dtype=np.uint16 if a.dtype == mx.bfloat16 else np.float16)
                   for n, a in b.arrays.items()}
            for n, t in s.arrays.items():
                assert t.dtype == b.arrays[n].dtype and t.shape == tuple(b.arrays[n].shape)
                t.read_rows((slice(None), slice(None), slice(2, 8)), out[n][:, :, 1:7])
            outs.append(out)
        assert read_stored(stored, threads=2)
        for b, out in zip(blocks, outs):
            for n, a in b.arrays.items():
                assert np.array_equal(out[n][:, :, 1:7], host_view(a)[:, :, 2:8])
                assert not out[n][:, :, [0, 7, 8, 9]].any()
        assert all(s.fd == -1 for s in stored)
        # a flipped payload byte: the read fails, the file is removed, the damage counted
        path = next(p for p in (tmp_path / "blocks").rglob("*") if p.name.startswith(blocks[1].key))
        plain = compression == "none"
        data = bytearray(path.read_bytes() if plain else lz4.frame.decompress(path.read_bytes()))
        data[-3] ^= 0x40
        path.write_bytes(bytes(data) if plain else lz4.frame.compress(bytes(data)))
        s = tier.open_stored(blocks[1].key)
        t = s.arrays["l0.values"]
        t.read_rows((slice(None), slice(None), slice(0, 8)), np.zeros((1, 6, 8, 4), np.uint16))
        assert not read_stored([s], threads=1)
        assert tier.stats()["damaged"] == 1 and not tier.contains(blocks[1].key)
        # an opened block nothing asked of is closed without a read
        s = tier.open_stored(blocks[0].key)
        assert read_stored([s], threads=2) and s.fd == -1
    assert not os.listdir(tmp_path / "tmp")


def test_token_ids_from_any_input_without_copying_numpy() -> None:
    ids = [(7 * i + 3) % 50_000 for i in range(1000)]
    want = np.array(ids, dtype=np.int64)
    for given in (ids, tuple(ids), want, want.astype(np.int32), mx.array(ids)):
        got = token_ids(given)
        assert got.dtype == np.int64 and np.array_equal(got, want)
    assert token_ids(want) is want  # already int64: no copy, no per-token work
    assert chain_keys("f", "", want, 16) == chain_keys("f", "", ids, 16)
    for bad, message in (([1, True], "element 1 is bool"), ([1, 2.5], "element 1 is float"),
                         ("abc", "got str"), (np.zeros((2, 2), int), "1-D integer array"),
                         (mx.array([1.5]), "1-D integer array")):
        with pytest.raises(TypeError, match=message):
            token_ids(bad)
    for bad in ([1, 1 << 70], [1, 2**64 - 1], np.array([1, 2**64 - 1], dtype=np.uint64)):
        with pytest.raises(ValueError, match="element 1 is .* outside the int64 range"):
            token_ids(bad)
