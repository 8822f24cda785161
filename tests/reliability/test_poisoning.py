"""Poisoning: what someone who can write to the shared server (or plant files and manifest rows)
can make a host serve. Real valkey-server / redis-server on 127.0.0.1, real block files, real
subprocesses for memory. Every attack ends as a counted miss; the fetch that meets it returns
the prefix before it, exact (logits diff 0.0 against a cold prefill, prefill and 8 decodes)."""

from __future__ import annotations

import json
import sqlite3
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import lz4.frame
import mlx.core as mx
import pytest
import xxhash

from paged_cache.block import Block
from paged_cache.config import CacheConfig
from paged_cache.hashing import chain_keys, encode_token_ids
from paged_cache.manager import PagedSSDCacheManager
from paged_cache.prefix_cache import BlockAwarePrefixCache
from paged_cache.testing import tiny_model
from paged_cache.testing.server import client
from paged_cache.tiers import format as fmt
from paged_cache.tiers.remote.mac import SEAL_BYTES
from paged_cache.tiers.remote.client import KEY_PREFIX, block_name
from helpers.prefix import DECODE_STEPS, prefill, prompt, store_prompt

BLOCK = 16
SECRET = "correct horse battery staple 42"
HERE = Path(__file__).resolve().parent
BOMB_CLAIM = 1 << 28          # float32 elements the bomb declares: 1 GiB
HOT_BUDGET = 64 << 20         # the victim's hot tier in the memory tests


def remote_config(url: str, **kw: Any) -> CacheConfig:
    kw.setdefault("remote_timeout", 5.0)
    kw.setdefault("hot_cache_only", True)
    kw.setdefault("fetch_policy", "always-restore")  # what a restore does, not the cost trade
    return CacheConfig(block_size=BLOCK, remote_url=url, **kw)


def logits_diff(model: Any, prefix: BlockAwarePrefixCache, query: list[int]) -> tuple[int, float]:
    """Fetch for ``query``, continue warm and cold (same chunking): (n, max abs logits diff over
    the rest of the prompt and DECODE_STEPS greedy steps). The fetch must not raise."""
    cache, n = prefix.fetch(query)
    cold = prefix.make_cache()
    if n:
        prefill(model, cold, query[:n], 0, BLOCK)
    else:
        cache = prefix.make_cache()
    ref, got = prefill(model, cold, query, n, BLOCK), prefill(model, cache, query, n, BLOCK)
    diff = mx.abs(ref.astype(mx.float32) - got.astype(mx.float32)).max().item()
    for _ in range(DECODE_STEPS):
        tok = mx.argmax(ref[:, -1:], axis=-1)
        ref, got = model(tok, cache=cold), model(tok, cache=cache)
        diff = max(diff, mx.abs(ref.astype(mx.float32) - got.astype(mx.float32)).max().item())
    return n, diff


# Three conversations sharing two blocks: the victim's third block is its own.
COMMON = prompt(2 * BLOCK)
OTHER = COMMON + prompt(BLOCK, seed=3) + [7, 7]
VICTIM = COMMON + prompt(BLOCK, seed=5) + [9, 9]


def planted_meta(fingerprint: str, parent: str, start: int, ids: list[int]) -> dict[str, str]:
    """A listing entry's meta claiming ``ids`` at ``start`` under ``parent``."""
    return {"fingerprint": fingerprint, "parent": parent, "start": str(start),
            "tokens": str(len(ids)), "token_ids": encode_token_ids(ids), "checkpoint": "0",
            "restorable": "1"}


# ------------------------------------------------------------------------------ planted entries

@pytest.mark.parametrize("where", ["remote", "remote-other-namespace", "ssd-manifest"])
def test_a_planted_listing_entry_is_a_counted_miss(tmp_path: Path, url: str, where: str,
                                                   record: Callable[..., None]) -> None:
    """A listing entry naming a real block of another conversation, with the victim's token ids,
    under the victim's real parent: rejected (its key is not the hash of those ids under that
    parent, model and namespace), counted, never read."""
    model = tiny_model("llama")
    ssd = where == "ssd-manifest"
    config = (CacheConfig(block_size=BLOCK, ssd_dir=tmp_path / "c", hot_cache_max_bytes=0,
                          fetch_policy="always-restore") if ssd else remote_config(url))
    theirs = "alice" if where == "remote-other-namespace" else None
    with PagedSSDCacheManager(config) as manager:
        store_prompt(model, BlockAwarePrefixCache(manager, model, namespace=theirs), OTHER)
        victim = BlockAwarePrefixCache(manager, model, namespace="bob" if theirs else None)
        store_prompt(model, victim, COMMON)
        fp, ns = victim.fingerprint, victim.namespace
    planted = chain_keys(fp, theirs or "", OTHER, BLOCK)[2]      # a real block, other tokens
    parent = chain_keys(fp, ns, COMMON, BLOCK)[1]                # the victim's real parent
    meta = planted_meta(fp, parent, 2 * BLOCK, VICTIM[2 * BLOCK:3 * BLOCK])
    if ssd:
        with sqlite3.connect(tmp_path / "c" / "manifest.sqlite") as db:
            db.execute("UPDATE blocks SET parent = ?, token_ids = ? WHERE key = ?",
                       (parent, meta["token_ids"], planted))
    else:
        listing = f"{KEY_PREFIX}:c:{fp}:{parent}"
        client(url).hset(listing, planted, json.dumps(meta, sort_keys=True))
    with PagedSSDCacheManager(config) as manager:              # a fresh host
        victim = BlockAwarePrefixCache(manager, model, namespace=ns or None)
        n, diff = logits_diff(model, victim, VICTIM)
        stats = manager.stats()
    record(f"planted_entry[{where}]", n=n, diff=diff, rejected=stats.get("nodes_rejected"))
    assert (n, diff) == (2 * BLOCK, 0.0)
    assert stats["nodes_rejected"] >= 1


# ------------------------------------------------------------------------------ forged values

def forged(value: bytes, key: str, change: Callable[[dict[str, mx.array]], None]) -> bytes:
    """``value`` decoded, its arrays changed, encoded again: fresh valid checksums."""
    arrays, meta = fmt.decode(value, key, max_bytes=len(value) * 4 + (1 << 20))
    change(arrays)
    block = Block(key, arrays, meta)
    mx.eval(*arrays.values())
    return b"".join(fmt.byte_view(c) for c in fmt.encode(key, fmt.raw_tensors(block), meta).chunks)


def shifted(arrays: dict[str, mx.array]) -> None:
    arrays["l0.keys"] = arrays["l0.keys"] + 1


def test_a_forged_value_is_rejected_with_a_secret(url: str, record: Callable[..., None]) -> None:
    """With remote_secret every value carries a keyed MAC: a value re-encoded with altered KV and
    fresh checksums (no tag, or a tag under another secret) is counted in remote.rejected and
    never decoded; hosts with the secret share blocks exactly; a host without it refuses the
    sealed values (remote.sealed_refused: it cannot check their tags)."""
    model = tiny_model("llama")
    config = remote_config(url, remote_secret=SECRET)
    with PagedSSDCacheManager(config) as manager:
        store_prompt(model, BlockAwarePrefixCache(manager, model), VICTIM)
        fp = BlockAwarePrefixCache(manager, model).fingerprint
        manager.flush()
    keys = chain_keys(fp, "", VICTIM, BLOCK)
    db = client(url)
    real = {k: db.get(block_name(k)) for k in keys}
    with PagedSSDCacheManager(remote_config(url)) as manager:   # no secret: refuses sealed values
        n, diff = logits_diff(model, BlockAwarePrefixCache(manager, model), VICTIM)
        remote = manager.stats()["remote"]
        assert (n, diff) == (0, 0.0) and remote["sealed_refused"] >= 1 and remote["rejected"] == 0
    with PagedSSDCacheManager(remote_config(url, remote_secret="another secret, 16+ chars")) as m:
        n, diff = logits_diff(model, BlockAwarePrefixCache(m, model), VICTIM)
        assert (n, diff) == (0, 0.0) and m.stats()["remote"]["rejected"] >= 1
    untagged = forged(real[keys[2]][SEAL_BYTES:], keys[2], shifted)
    db.set(block_name(keys[2]), untagged)
    with PagedSSDCacheManager(config) as manager:
        n, diff = logits_diff(model, BlockAwarePrefixCache(manager, model), VICTIM)
        remote = manager.stats()["remote"]
    record("forged_value", n=n, diff=diff, rejected=remote["rejected"])
    assert (n, diff) == (2 * BLOCK, 0.0)
    assert remote["rejected"] == 1 and remote["damaged"] == 0 and remote["hits"] == 2
    db.set(block_name(keys[2]), real[keys[1]])                 # another block's tagged value
    with PagedSSDCacheManager(config) as manager:
        n, diff = logits_diff(model, BlockAwarePrefixCache(manager, model), VICTIM)
        assert (n, diff) == (2 * BLOCK, 0.0) and manager.stats()["remote"]["rejected"] == 1


# ------------------------------------------------------------------------------ values that do not fit

def bomb(key: str, meta: dict[str, str]) -> bytes:
    """An lz4 block file (about 4 MiB) whose header, with valid checksums, declares a 1 GiB
    float32 tensor of zeros: built in 1 MiB pieces, never held whole."""
    chunk = bytes(1 << 20)
    digest = xxhash.xxh3_128()
    for _ in range(BOMB_CLAIM * 4 // len(chunk)):
        digest.update(chunk)
    full = {"header_checksum": "0" * 16, **meta, "format": fmt.FORMAT_NAME,
            "format_version": fmt.FORMAT_VERSION, "key": key, "checksum": digest.hexdigest()}
    entries = {"l0.keys": {"dtype": "F32", "shape": [1, 2, BOMB_CLAIM // 2],
                           "data_offsets": [0, BOMB_CLAIM * 4]}}
    header = fmt.sealed(json.dumps({"__metadata__": full, **entries},
                                   separators=(",", ":")).encode())   # a valid header checksum
    head = struct.pack("<Q", len(header)) + header
    comp = lz4.frame.LZ4FrameCompressor(content_checksum=False)
    parts = [comp.begin(source_size=len(head) + BOMB_CLAIM * 4), comp.compress(head)]
    parts += [comp.compress(chunk) for _ in range(BOMB_CLAIM * 4 // len(chunk))]
    return b"".join(parts + [comp.flush()])


def mismatched(kind: str) -> Callable[[dict[str, mx.array]], None]:
    """Changes that leave a block's arrays disagreeing with its layer descriptors."""
    def change(arrays: dict[str, mx.array]) -> None:
        if kind == "missing":
            del arrays["l0.values"]
        elif kind == "rows":
            arrays["l1.keys"] = arrays["l1.keys"][:, :, :BLOCK // 2]
        elif kind == "heads":
            arrays["l0.values"] = mx.concatenate([arrays["l0.values"]] * 2, axis=1)
        elif kind == "dtype":
            arrays["l1.values"] = arrays["l1.values"].astype(mx.float16)
        elif kind == "extra":
            arrays["l9.keys"] = arrays["l0.keys"]
    return change


def retagged(value: bytes, meta_change: Callable[[dict[str, str]], None], key: str) -> bytes:
    arrays, meta = fmt.decode(value, key, max_bytes=len(value) * 4 + (1 << 20))
    meta_change(meta)
    return b"".join(fmt.byte_view(c) for c in fmt.encode(
        key, fmt.raw_tensors(Block(key, arrays, meta)), meta).chunks)


def _descriptor(kind: str) -> Callable[[dict[str, str]], None]:
    def change(meta: dict[str, str]) -> None:
        layers = json.loads(meta["layers"])
        if kind == "desc-rows":
            layers[0]["rows"] = [[0, 1 << 30]]
        elif kind == "desc-layers":
            layers = layers[:1]
        elif kind == "desc-type":
            layers[0]["type"] = "ArraysCache"
        elif kind == "desc-garbage":
            layers[0]["has_rows"] = "yes"
        meta["layers"] = json.dumps(layers)
    return change


MISMATCHES = ["missing", "rows", "heads", "dtype", "extra",
              "desc-rows", "desc-layers", "desc-type", "desc-garbage"]


def bad_value(kind: str, value: bytes, key: str) -> bytes:
    if kind.startswith("desc-"):
        return retagged(value, _descriptor(kind), key)
    return forged(value, key, mismatched(kind))


@pytest.mark.parametrize("tier", ["remote", "ssd", "ssd-lz4"])
@pytest.mark.parametrize("kind", MISMATCHES)
def test_a_value_that_does_not_fit_the_layout_is_a_counted_miss(tmp_path: Path, url: str,
                                                                tier: str, kind: str) -> None:
    """Arrays that disagree with their layer descriptors or with the model's layout (a missing
    array, too few rows, twice the heads, another dtype, an array of a layer the model lacks,
    descriptors claiming other rows, layers or types): a counted miss before anything is
    allocated for it; the fetch never raises and stops at the block before."""
    model = tiny_model("llama")
    if tier == "remote":
        config = remote_config(url)
    else:
        config = CacheConfig(block_size=BLOCK, ssd_dir=tmp_path / "c", hot_cache_max_bytes=0,
                             compression="lz4" if tier == "ssd-lz4" else "none",
                             fetch_policy="always-restore")
    with PagedSSDCacheManager(config) as manager:
        prefix = BlockAwarePrefixCache(manager, model)
        store_prompt(model, prefix, VICTIM)
        fp = prefix.fingerprint
    key = chain_keys(fp, "", VICTIM, BLOCK)[1]
    if tier == "remote":
        db = client(url)
        db.set(block_name(key), bad_value(kind, db.get(block_name(key)), key))
    else:
        path = next((tmp_path / "c" / "blocks" / key[:2]).glob(key + ".*"))
        value = path.read_bytes()
        plain = lz4.frame.decompress(value) if tier == "ssd-lz4" else value
        bad = bad_value(kind, plain, key)
        path.write_bytes(lz4.frame.compress(bad) if tier == "ssd-lz4" else bad)
    with PagedSSDCacheManager(config) as manager:
        n, diff = logits_diff(model, BlockAwarePrefixCache(manager, model), VICTIM)
        damaged = manager.stats()["remote" if tier == "remote" else "ssd"]["damaged"]
    assert (n, diff) == (BLOCK, 0.0)
    assert damaged == 1


def child_fetch(config: dict[str, Any], arch: str) -> dict[str, Any]:
    """Fetch VICTIM in a fresh process with ``config``: n, the growth of its peak memory during
    the fetch (RSS, MLX's, Python's), its damaged count; a fetch that raises is reported."""
    out = subprocess.run([sys.executable, str(HERE / "fetch_child.py"), json.dumps(config),
                          json.dumps(VICTIM), arch], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("tier,arch", [("remote", "llama"), ("ssd", "llama"), ("ssd", "mamba")])
def test_a_decompression_bomb_is_a_counted_miss_within_the_hot_budget(
        tmp_path: Path, url: str, tier: str, arch: str, record: Callable[..., None]) -> None:
    """A 4 MiB lz4 value whose valid header declares a 1 GiB tensor: rejected by the model's
    layout before its data is decompressed; the victim's peak memory (RSS, MLX's, Python's
    allocations) grows by less than its 64 MiB hot budget during the fetch. (mamba's layers are
    read from SSD whole, llama's straight into the rebuilt cache: both paths.)"""
    model = tiny_model(arch)
    if tier == "remote":
        config = dict(block_size=BLOCK, remote_url=url, remote_timeout=5.0, hot_cache_only=True,
                      fetch_policy="always-restore")
    else:
        config = dict(block_size=BLOCK, ssd_dir=str(tmp_path / "c"), compression="lz4",
                      fetch_policy="always-restore")
    with PagedSSDCacheManager(CacheConfig(**config)) as manager:
        prefix = BlockAwarePrefixCache(manager, model)
        store_prompt(model, prefix, VICTIM)
        fp = prefix.fingerprint
    keys = chain_keys(fp, "", VICTIM, BLOCK)
    if tier == "remote":
        db = client(url)
        _, meta = fmt.decode(db.get(block_name(keys[1])), keys[1], max_bytes=1 << 24)
        value = bomb(keys[1], meta)
        db.set(block_name(keys[1]), value)
    else:
        path = tmp_path / "c" / "blocks" / keys[1][:2] / (keys[1] + ".safetensors.lz4")
        _, meta = fmt.decode(path.read_bytes(), keys[1], max_bytes=1 << 24)
        value = bomb(keys[1], meta)
        path.write_bytes(value)
    got = child_fetch(dict(config, hot_cache_max_bytes=HOT_BUDGET), arch)
    record(f"bomb[{tier}-{arch}]", value_bytes=len(value), **got)
    assert got["error"] is None
    assert got["n"] == BLOCK and got["damaged"] == 1
    for what in ("rss_growth", "mx_growth", "traced"):
        assert got[what] < HOT_BUDGET, f"{what}: {got[what] >> 20} MiB during the fetch"
