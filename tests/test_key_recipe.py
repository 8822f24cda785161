"""docs/file-format.md's block key recipe, implemented here from the document alone (no import of
paged_cache.hashing or the format module), verifies every key of a real stored directory."""

from __future__ import annotations

import base64
import hashlib
import json
import struct
from pathlib import Path

import lz4.frame
import numpy as np
import pytest

from paged_cache.config import CacheConfig
from paged_cache.manager import PagedSSDCacheManager
from paged_cache.prefix_cache import BlockAwarePrefixCache
from paged_cache.testing import tiny_model
from helpers.prefix import prompt, store_prompt

DOMAIN = b"paged-cache/block/v1\x00"
ID_TYPES = {"u2": "<u2", "i4": "<i4", "i8": "<i8"}


def field(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


def recipe_key(fingerprint: str, namespace: str, parent: str, ids: np.ndarray) -> str:
    message = (field(DOMAIN) + field(fingerprint.encode()) + field(namespace.encode())
               + field(parent.encode()) + field(ids.astype("<i8").tobytes()))
    return hashlib.blake2b(message, digest_size=32).hexdigest()


def read_meta(path: Path) -> dict[str, str]:
    """``__metadata__`` of a block file, read as the document describes the bytes."""
    data = path.read_bytes()
    if path.name.endswith(".lz4"):
        data = lz4.frame.decompress(data)
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n].decode("utf-8"))["__metadata__"]


def token_ids(text: str) -> np.ndarray:
    code, payload = text.split(":", 1)
    return np.frombuffer(base64.b64decode(payload), dtype=ID_TYPES[code])


@pytest.mark.parametrize("compression", ["none", "lz4"])
def test_every_stored_key_follows_the_documented_recipe(tmp_path: Path, compression: str) -> None:
    model = tiny_model("llama")
    config = CacheConfig(block_size=16, hot_cache_only=False, ssd_dir=tmp_path / "ssd",
                         compression=compression)
    namespace = "adapter=/models/lora;draft=None"
    with PagedSSDCacheManager(config) as manager:
        prefix = BlockAwarePrefixCache(manager, model, namespace=namespace, model_name="./tiny")
        shared = prompt(40)
        store_prompt(model, prefix, shared + prompt(21, seed=1))   # partial tail of 13 tokens
        store_prompt(model, prefix, shared + prompt(30, seed=2))
        manager.flush()
    files = sorted((tmp_path / "ssd" / "blocks").glob("*/*.safetensors*"))
    assert len(files) >= 6 and all(f.name.endswith(".lz4") == (compression == "lz4") for f in files)
    metas = {f.name.split(".", 1)[0]: read_meta(f) for f in files}
    for name, meta in metas.items():
        ids = token_ids(meta["token_ids"])
        assert len(ids) == int(meta["tokens"])
        assert meta["namespace"] == namespace and meta["model_name"] == "./tiny"
        key = recipe_key(meta["fingerprint"], meta["namespace"], meta["parent"], ids)
        assert key == meta["key"] == name
        assert meta["parent"] == "" or meta["parent"] in metas  # the chains are whole
        changed = ids.copy()
        changed[-1] += 1
        assert recipe_key(meta["fingerprint"], meta["namespace"], meta["parent"], changed) != key
        assert recipe_key(meta["fingerprint"], "", meta["parent"], ids) != key
    roots = [m for m in metas.values() if m["parent"] == ""]
    assert len(roots) == 1 and roots[0]["start"] == "0"
