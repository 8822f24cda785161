"""The row path: chosen once per process (forced by PAGED_CACHE_ROW_PATH), and the work a fetch or
a store asks of MLX, counted: one evaluation per layer or fewer, never one per block, on both
paths; on the device path no host views of a RAM hit and one upload per array per layer from SSD.
On a GPU those counts are the cost; this is what CI sees of it. From SSD the kernel is asked to
read the files ahead, within a process-wide budget, and rows read from disk land in buffers that
are not zero-filled first (the rows no block holds are zeroed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from paged_cache import Block, row_path
from paged_cache.prefix_cache import BlockAwarePrefixCache
from paged_cache.testing import tiny_model
from paged_cache.handlers.base import assemble_rows
from paged_cache.tiers import format as fmt
from paged_cache.tiers.ssd import direct
from paged_cache.tiers.ssd.direct import advance_all, read_ahead_whole, read_stored
from paged_cache.tiers.ssd.tier import SSDTier

from helpers.backends import mlx_keeps_freed_buffers
from helpers.managers import new_manager
from helpers.prefix import assert_exact, prefill, prompt

BLOCK, LAYERS = 16, 6
MODEL = tiny_model("llama", num_hidden_layers=LAYERS)


def _chosen(env: str | None) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != row_path.ENV}
    if env is not None:
        environ[row_path.ENV] = env
    return subprocess.run([sys.executable, "-c", "from paged_cache.row_path import row_path; "
                           "print(row_path())"], env=environ, capture_output=True, text=True,
                          timeout=120)


def test_the_path_is_the_default_devices_unless_forced() -> None:
    assert _chosen(None).stdout.strip() == ("host" if mx.default_device() == mx.cpu else "device")
    assert _chosen("device").stdout.strip() == "device"
    assert _chosen(" HOST ").stdout.strip() == "host"
    bad = _chosen("gpu")
    assert bad.returncode != 0
    assert "PAGED_CACHE_ROW_PATH='gpu' (from the environment): expected one of host, device" in bad.stderr
    with pytest.raises(ValueError, match="path: expected one of host, device, got 'cuda'"):
        with row_path.forced("cuda"):
            pass


def _work(blocks: int, tmp_path: Path) -> dict[str, row_path.Counts]:
    """The counts of a store, a RAM-tier fetch and (after a restart) an SSD fetch of a prompt of
    ``blocks`` full blocks; each fetch checked exact against a cold run."""
    tokens = prompt(blocks * BLOCK + 5)
    ssd_dir = tmp_path / str(blocks)
    out = {}
    with new_manager(ssd_dir, block_size=BLOCK, hot_cache_max_bytes="64MB") as manager:
        prefix = BlockAwarePrefixCache(manager, MODEL)
        cache = prefix.make_cache()
        prefill(MODEL, cache, tokens, 0, BLOCK)
        before = row_path.counts()
        prefix.store(tokens, cache)
        out["store"] = row_path.counts() - before
        before = row_path.counts()
        got, n = prefix.fetch(tokens + [1])
        out["ram"] = row_path.counts() - before
        assert n == len(tokens) and prefix.last_fetch.tier == "hot"
        del got
        manager.flush()
    with new_manager(ssd_dir, block_size=BLOCK, hot_cache_max_bytes=0) as manager:
        prefix = BlockAwarePrefixCache(manager, MODEL)
        before = row_path.counts()
        # the whole prompt again: its partial tail is on SSD too (written by the flush), so a
        # prompt that left it would share the last block with it and read its blocks untaken
        got, n = prefix.fetch(tokens + [1])
        out["ssd"] = row_path.counts() - before
        assert n == len(tokens) and prefix.last_fetch.tier == "ssd"
        del got
        assert assert_exact(MODEL, prefix, tokens + [1, 2]) == len(tokens)
    return out


def test_work_per_fetch_and_store_grows_with_layers_not_blocks(tmp_path: Path,
                                                               rows_moved_by: str) -> None:
    short, long = _work(4, tmp_path), _work(12, tmp_path)
    print(f"\n{rows_moved_by}: 4 blocks {short}\n{rows_moved_by}: 12 blocks {long}")
    for what in ("store", "ram", "ssd"):
        s, l = short[what], long[what]
        assert (s.syncs, s.launches, s.to_device) == (l.syncs, l.launches, l.to_device), what
        assert s.syncs <= LAYERS + 1 and s.launches <= 3 * LAYERS, (what, s)
    # a store evaluates its cuts once, and moves nothing between host and device
    assert short["store"] == row_path.Counts(syncs=1)
    if rows_moved_by == "device":
        # a RAM hit: one evaluation per layer and one for the cache, nothing through the host
        assert short["ram"] == long["ram"] == row_path.Counts(syncs=LAYERS + 1)
        # an SSD hit: each layer's keys and values staged and moved to the device once
        assert short["ssd"] == long["ssd"] == row_path.Counts(syncs=LAYERS + 1,
                                                               to_device=2 * LAYERS)
    else:
        # on the host: one evaluation per layer, nothing moved to the device
        assert long["ram"].to_device == long["ssd"].to_device == 0


def _block(i: int) -> Block:
    keys = (mx.arange(2 * 3 * 8 * 4) + 100 * i).astype(mx.float16).reshape(1, 6, 8, 4)
    values = (keys + 0.5).astype(mx.float16)
    mx.eval(keys, values)
    return Block(f"{i:064x}", {"l0.keys": keys, "l0.values": values, "l1.keys": keys + 1,
                               "l1.values": values + 1}, {"tokens": "8"})


@pytest.mark.parametrize("compression", ["none", "lz4"])
def test_a_stored_block_is_read_in_steps_front_to_back(tmp_path: Path, compression: str) -> None:
    """The device path reads each layer's rows of a file when it builds that layer (``advance``),
    then ``read`` reads the rest and verifies the checksum over every byte; rows asked for behind
    what was read are read again; a damaged byte anywhere still fails the read."""
    block = _block(1)
    with SSDTier(tmp_path, max_bytes=1 << 30, compression=compression) as tier:
        assert tier.write_sync(block.key, fmt.raw_tensors(block), block.meta)
        want = {n: np.asarray(a) for n, a in block.arrays.items()}
        stored = tier.open_stored(block.key)
        out = {n: np.zeros((1, 6, 8, 4), np.float16) for n in block.arrays}
        rows = (slice(None), slice(None), slice(2, 7))
        for name in ("l1.keys", "l1.values"):
            stored.arrays[name].read_rows(rows, out[name][rows])
        stored.advance()  # the second layer first: its rows are there now
        assert all(np.array_equal(out[n][rows], want[n][rows]) for n in ("l1.keys", "l1.values"))
        assert stored.begun and not out["l0.keys"].any()
        assert stored.rereads == 0
        stored.arrays["l0.keys"].read_rows(rows, out["l0.keys"][rows])  # behind: read again
        assert read_stored([stored], threads=1) and stored.fd == -1
        assert np.array_equal(out["l0.keys"][rows], want["l0.keys"][rows])
        assert not out["l0.values"].any() and stored.rereads == 6  # one place per head
        # places asked for in any order before a read are read in one pass, none twice
        stored = tier.open_stored(block.key)
        got = {n: np.zeros((1, 6, 8, 4), np.float16) for n in block.arrays}
        for name in sorted(block.arrays, reverse=True):
            stored.arrays[name].read_rows(rows, got[name][rows])
        assert read_stored([stored], threads=1) and stored.rereads == 0
        assert all(np.array_equal(got[n][rows], want[n][rows]) for n in block.arrays)
        # damage past every asked-for row is still found: the checksum covers the whole file
        path = next(p for p in (tmp_path / "blocks").rglob("*") if p.name.startswith(block.key))
        import lz4.frame
        plain = compression == "none"
        data = bytearray(path.read_bytes() if plain else lz4.frame.decompress(path.read_bytes()))
        data[-3] ^= 0x40
        path.write_bytes(bytes(data) if plain else lz4.frame.compress(bytes(data)))
        stored = tier.open_stored(block.key)
        stored.arrays["l0.keys"].read_rows(rows, np.zeros((1, 6, 8, 4), np.float16)[rows])
        stored.advance()
        assert stored.damage is None  # nothing wrong in what was read so far
        assert not read_stored([stored], threads=1)
        assert tier.stats()["damaged"] == 1 and not tier.contains(block.key)


@pytest.mark.parametrize("compression", ["none", "lz4"])
def test_files_are_read_ahead_within_the_budget(tmp_path: Path, compression: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Once a layer's rows are read (``advance_all``), the kernel is asked for the file's next
    bytes (up to FILE_AHEAD past what was read); the bytes hinted and not read yet are held in
    the process's read-ahead budget until they are read or the file is closed, and nothing is
    hinted past the budget (lz4: in memory, nothing to hint). The rows and the checksum are
    those of a plain read either way."""
    block = _block(3)
    rows = (slice(None), slice(None), slice(2, 7))
    want = {n: np.asarray(a) for n, a in block.arrays.items()}
    with SSDTier(tmp_path, max_bytes=1 << 30, compression=compression) as tier:
        assert tier.write_sync(block.key, fmt.raw_tensors(block), block.meta)
        for budget in (direct.READ_AHEAD_BYTES, 16):
            monkeypatch.setattr(direct, "READ_AHEAD_BYTES", budget)
            stored = tier.open_stored(block.key)
            out = {n: np.zeros((1, 6, 8, 4), np.float16) for n in block.arrays}
            for name in ("l0.keys", "l0.values"):
                stored.arrays[name].read_rows(rows, out[name][rows])
            advance_all([stored, stored])
            hinted = compression == "none" and budget > 16
            assert stored.hinted == (stored.data_bytes - stored.position if hinted else 0)
            assert direct._READ_AHEAD.pending == stored.hinted
            for name in ("l1.keys", "l1.values"):
                stored.arrays[name].read_rows(rows, out[name][rows])
            assert read_stored([stored], threads=1) and stored.rereads == 0
            assert stored.hinted == 0 and direct._READ_AHEAD.pending == 0
            assert all(np.array_equal(out[n][rows], want[n][rows]) for n in block.arrays)
        monkeypatch.setattr(direct, "READ_AHEAD_BYTES", 1 << 30)
        stored = tier.open_stored(block.key)  # hinted, then closed unread: the budget comes back
        read_ahead_whole([stored])
        assert direct._READ_AHEAD.pending == (stored.data_bytes if compression == "none" else 0)
        stored.close()
        assert direct._READ_AHEAD.pending == 0


@pytest.mark.parametrize("path", ["host", "device"])
def test_rows_read_from_disk_land_in_a_buffer_zero_where_no_block_holds_rows(
        tmp_path: Path, path: str) -> None:
    """A buffer some of whose rows are read from disk is not zero-filled first on the host path
    (handlers/unfilled.py: the read faults its pages in): the rows no block holds (a gap, the
    room past the last row) are zeros however dirty the recycled memory was, and the read rows
    are the file's."""
    block = _block(5)
    with SSDTier(tmp_path, max_bytes=1 << 30) as tier, row_path.forced(path):
        assert tier.write_sync(block.key, fmt.raw_tensors(block), block.meta)
        limit = mx.set_cache_limit(1 << 30)
        try:
            dirty = [mx.full((1, 6, 32, 4), 7.0, dtype=mx.float16) for _ in range(8)]
            mx.eval(dirty)
            del dirty  # MLX's cache now holds buffers full of 7s of the rebuilt buffers' size
            stored = tier.open_stored(block.key)
            pieces = [(4, 12, {"keys": stored.arrays["l0.keys"]}, 0)]  # positions 4..12: rows 0..8
            out = assemble_rows(pieces, ["keys"], [(0, 20)], 32)["keys"]
            assert read_stored([stored], threads=1)
        finally:
            mx.set_cache_limit(limit)
        got, want = np.asarray(out), np.asarray(block.arrays["l0.keys"])
        assert not got[:, :, :4].any() and not got[:, :, 12:].any()
        assert np.array_equal(got[:, :, 4:12], want)


@pytest.mark.parametrize("cache_limit", [0, 1 << 30])
def test_rows_copied_from_memory_land_zero_where_no_block_holds_rows(cache_limit: int) -> None:
    """A hot restore into memory MLX's cache hands back (a server's reused memory) takes its
    buffers unfilled, with no zero fill first (handlers/base.py ``_allocate``); into fresh
    memory it zero-fills them: either way the rows no block holds are zeros however dirty the
    recycled memory was, and the copied rows are the blocks' (where MLX's allocator keeps no
    freed buffers, mlx 0.31.2's CPU backend, both take the fresh-memory path)."""
    first, second = _block(3), _block(4)
    limit = mx.set_cache_limit(cache_limit)
    try:
        keeps = mlx_keeps_freed_buffers()  # under this limit
        dirty = [mx.full((1, 6, 32, 4), 7.0, dtype=mx.float16) for _ in range(8)]
        mx.eval(dirty)
        del dirty  # with a cache limit: MLX's cache holds buffers of 7s of the rebuilt size
        assert (mx.get_cache_memory() > 0) == keeps
        pieces = [(4, 12, {"keys": first.arrays["l0.keys"]}, 0),
                  (12, 16, {"keys": second.arrays["l0.keys"]}, 2)]  # rows 2..6 of the second
        with row_path.forced("host"):
            out = assemble_rows(pieces, ["keys"], [(0, 20)], 32)["keys"]
    finally:
        mx.set_cache_limit(limit)
    got = np.asarray(out)
    assert not got[:, :, :4].any() and not got[:, :, 16:].any()
    assert np.array_equal(got[:, :, 4:12], np.asarray(first.arrays["l0.keys"]))
    assert np.array_equal(got[:, :, 12:16], np.asarray(second.arrays["l0.keys"])[:, :, 2:6])
