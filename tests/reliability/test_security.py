"""Security: cryptographic block keys, tenant namespaces, a private cache directory, symlinks
refused and never followed, file names only from hex digests, nothing unpickled, and headers
validated before anything is allocated."""

from __future__ import annotations

import ast
import hashlib
import json
import logging
import os
import re
import resource
import sqlite3
import stat
import struct
import tracemalloc
from pathlib import Path

import lz4.frame
import mlx.core as mx
import numpy as np
import pytest

import paged_cache
from paged_cache.block import Block
from paged_cache.cachedir.inventory import CacheDir
from paged_cache.cachedir.maintenance import delete_blocks, select_prune
from paged_cache.hashing import block_key, chain_keys
from paged_cache.prefix_cache import BlockAwarePrefixCache
from paged_cache.testing import tiny_model
from paged_cache.tiers import format as fmt
from paged_cache.tiers.ssd.files import MANIFEST_NAME
from helpers.blocks import block_files, key_of, random_block, same_block
from helpers.managers import new_manager
from reliability_support import KEY_RE, SMALL, audit
from helpers.prefix import prompt, store_prompt

FP = "f" * 64


# ------------------------------------------------------------------------------ keys

def _reference_key(fingerprint: str, namespace: str, parent: str, tokens: list[int]) -> str:
    """The documented construction, recomputed independently: blake2b-256 over length-prefixed
    fields (domain, fingerprint, namespace, parent key, int64 little-endian token ids)."""
    h = hashlib.blake2b(digest_size=32)
    for part in (b"paged-cache/block/v1\0", fingerprint.encode(), namespace.encode(), parent.encode(),
                 np.asarray(tokens, dtype="<i8").tobytes()):
        h.update(len(part).to_bytes(8, "little") + part)
    return h.hexdigest()


def test_block_keys_are_cryptographic_and_commit_to_every_input() -> None:
    base = ("fp-a", "tenant", key_of(1), [1, 2, 3, 4])
    key = block_key(*base)
    assert re.fullmatch(KEY_RE, key) and key == _reference_key(*base)
    variants = [
        ("fp-b", "tenant", key_of(1), [1, 2, 3, 4]),        # another model / layout
        ("fp-a", "tenant2", key_of(1), [1, 2, 3, 4]),       # another namespace
        ("fp-a", "tenant", key_of(2), [1, 2, 3, 4]),        # another parent chain
        ("fp-a", "tenant", key_of(1), [1, 2, 3, 5]),        # another token
        ("fp-a", "tenant", key_of(1), [1, 2, 3]),           # a shorter (partial) block
        ("fp-a", "tenant", key_of(1), [1, 2, 3, 4 + 2**32]),  # ids beyond 32 bits stay distinct
        ("fp-at", "enant", key_of(1), [1, 2, 3, 4]),        # field boundaries moved
        ("fp-a", "", "tenant" + key_of(1), [1, 2, 3, 4]),
    ]
    keys = {block_key(*v) for v in variants} | {key}
    assert len(keys) == len(variants) + 1
    # chains: the same block of tokens under different histories gets different keys
    a = chain_keys(FP, "", [1, 2, 3, 4, 9, 9, 9, 9], 4)
    b = chain_keys(FP, "", [5, 6, 7, 8, 9, 9, 9, 9], 4)
    assert a[1] != b[1] and a[1] == block_key(FP, "", a[0], [9, 9, 9, 9])
    # 10,000 random blocks: no collision (a 64-bit truncation or a weak hash would still pass
    # this; the reference construction above pins the hash itself)
    rng = np.random.default_rng(0)
    many = {block_key(FP, "", "", rng.integers(0, 1 << 17, 16).tolist()) for _ in range(10_000)}
    assert len(many) == 10_000


def test_namespaces_keep_tenants_apart(tmp_path: Path) -> None:
    model = tiny_model("llama")
    tokens = prompt(3 * 16 + 5)
    with new_manager(tmp_path / "c", **SMALL | dict(block_size=16, hot_cache_max_bytes=1 << 20)) as manager:
        alice = BlockAwarePrefixCache(manager, model, namespace="alice")
        bob = BlockAwarePrefixCache(manager, model, namespace="bob")
        anon = BlockAwarePrefixCache(manager, model)
        store_prompt(model, alice, tokens)
        manager.flush()  # before the fetch, which hands the partial tail over (in RAM till now)
        for other in (bob, anon):
            assert other.fetch(tokens + [1]) == (None, 0)
        assert alice.fetch(tokens + [1])[1] == len(tokens)
    with new_manager(tmp_path / "c", **SMALL | dict(block_size=16, hot_cache_max_bytes=0)) as manager:  # from SSD
        for ns in ("bob", "", "alice/", "ALICE"):
            assert BlockAwarePrefixCache(manager, model, namespace=ns).fetch(tokens + [1]) == (None, 0)
        assert BlockAwarePrefixCache(manager, model, namespace="alice").fetch(tokens + [1])[1] == \
            len(tokens)


# ------------------------------------------------------------------------------ files

def _tree_modes(root: Path) -> dict[Path, int]:
    return {p: stat.S_IMODE(p.lstat().st_mode) for p in [root, *root.rglob("*")]}


def test_cache_directory_and_files_are_private(tmp_path: Path) -> None:
    old = os.umask(0)   # a permissive umask must not leak into the modes
    try:
        root = tmp_path / "c"
        with new_manager(root, **SMALL | dict(compression="lz4")) as manager:
            for i in range(4):
                manager.put(random_block(key_of(i)))
            manager.flush()
            for path, mode in _tree_modes(root).items():
                assert mode == (0o700 if path.is_dir() else 0o600), (path, oct(mode))
        os.chmod(root, 0o755)                          # loosened by someone: tightened on open
        os.chmod(root / "blocks", 0o777)
        with new_manager(root, **SMALL):
            assert stat.S_IMODE(root.stat().st_mode) == 0o700
            assert stat.S_IMODE((root / "blocks").stat().st_mode) == 0o700
    finally:
        os.umask(old)


def _outside(tmp_path: Path) -> tuple[Path, dict[Path, tuple[bytes, int]]]:
    """A directory outside the cache holding a valid block file and a sentinel file."""
    target = tmp_path / "outside"
    target.mkdir()
    victim = random_block(key_of("victim"))
    encoded = fmt.encode(victim.key, fmt.raw_tensors(victim), victim.meta)
    (target / (victim.key + ".safetensors")).write_bytes(
        b"".join(bytes(memoryview(c).cast("B")) for c in encoded.chunks))
    (target / "sentinel").write_bytes(b"do not touch")
    return target, _snapshot(target)


def _snapshot(target: Path) -> dict[Path, tuple[bytes, int]]:
    return {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in target.iterdir()}


_PLACES = ["block_file", "fanout_dir", "manifest", "manifest_wal", "tmp_dir", "blocks_dir"]


# A manifest swapped while open is not a case: SQLite holds the open file, so the swap is only seen
# at the next open, which is the "closed" case.
@pytest.mark.parametrize("place,when", [(p, "closed") for p in _PLACES] +
                         [(p, "open") for p in _PLACES if not p.startswith("manifest")])
def test_planted_symlinks_are_refused_never_followed(tmp_path: Path, place: str, when: str) -> None:
    root = tmp_path / "c"
    target, before = _outside(tmp_path)
    victim_key = key_of("victim")
    with new_manager(root, **SMALL | dict(hot_cache_max_bytes=0)) as manager:
        manager.put(random_block(key_of(1)))
        manager.flush()
    link = {"block_file": root / "blocks" / victim_key[:2] / (victim_key + ".safetensors"),
            "fanout_dir": root / "blocks" / victim_key[:2],
            "manifest": root / MANIFEST_NAME,
            "manifest_wal": root / (MANIFEST_NAME + "-wal"),
            "tmp_dir": root / "tmp",
            "blocks_dir": root / "blocks"}[place]
    link_to = {"block_file": target / (victim_key + ".safetensors"),
               "manifest": target / "sentinel", "manifest_wal": target / "sentinel"}.get(place, target)

    def plant() -> None:
        if link.exists() and not link.is_symlink():
            aside = link.with_name(link.name + ".aside")
            os.rename(link, aside)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(link_to)

    if when == "closed":
        plant()
        if place in ("tmp_dir", "blocks_dir"):
            with pytest.raises(ValueError, match="symlink"):   # refused at open
                new_manager(root, **SMALL)
            assert _snapshot(target) == before
            return
        manager = new_manager(root, **SMALL | dict(hot_cache_max_bytes=0))
    else:
        manager = new_manager(root, **SMALL | dict(hot_cache_max_bytes=0))
        plant()
    with manager:
        assert manager.get(victim_key) is None                     # never served through a link
        for i in range(2, 12):                                     # writes go to real files only
            manager.put(random_block(key_of(i)))
        fresh = random_block(victim_key)
        manager.put(fresh)                                         # same fan-out as the link
        manager.flush()
        assert same_block(manager.get(key_of(3)), random_block(key_of(3)))
    assert _snapshot(target) == before, "a file outside the cache was changed"
    if place not in ("tmp_dir", "blocks_dir"):
        assert not any(p.is_symlink() for p in [root, *root.rglob("*")])


def test_file_names_come_only_from_hex_digests(tmp_path: Path) -> None:
    root = tmp_path / "c"
    model = tiny_model("llama")
    with new_manager(root, **SMALL | dict(block_size=16)) as manager:
        for ns in ("../../etc", "a/b", "\x00", "tenant ünïcode", "x" * 300):
            store_prompt(model, BlockAwarePrefixCache(manager, model, namespace=ns,
                                                      model_id="../../" + ns), prompt(40))
        for bad in ("../" * 21 + "x", "A" * 64, "g" * 64, "0" * 63, "0" * 65, "", 12):
            with pytest.raises((ValueError, TypeError)):
                manager.get(bad)
            with pytest.raises((ValueError, TypeError)):
                manager.discard(bad)
            with pytest.raises((ValueError, TypeError)):
                manager.put(Block(bad, {"x": mx.ones((2,))}))
        manager.flush()
    names = [p.relative_to(root).as_posix() for p in root.rglob("*")]
    allowed = re.compile(rf"blocks|tmp|blocks/[0-9a-f]{{2}}|blocks/[0-9a-f]{{2}}/{KEY_RE}"
                         rf"\.safetensors(\.lz4)?|{re.escape(MANIFEST_NAME)}(-wal|-shm)?")
    assert names and all(allowed.fullmatch(n) for n in names), names
    assert len(audit(root).files) == 5 * 3


def _tampered_manifest(tmp_path: Path) -> tuple[Path, Path]:
    """A cache whose manifest holds a row keyed ``../victim`` (so ``blocks/<key[:2]>/<key>
    .safetensors`` names tmp_path/victim.safetensors, a file outside the cache) of 1 GB."""
    root = tmp_path / "c"
    with new_manager(root, **SMALL) as manager:
        manager.put(random_block(key_of(1)))
    victim = tmp_path / "victim.safetensors"
    victim.write_bytes(b"precious")
    with sqlite3.connect(root / MANIFEST_NAME) as db:
        db.execute("INSERT INTO blocks(key, state, compression, file_bytes, raw_bytes, created, "
                   "last_access, writer) VALUES ('../victim', 1, 'none', 1000000000, 0, 0, 0, "
                   "'adopted')")
    return root, victim


def test_manifest_keys_never_name_files_outside_the_cache(tmp_path: Path) -> None:
    """Eviction of a tampered row must not delete the path its key spells (fixed in ssd.py)."""
    root, victim = _tampered_manifest(tmp_path)
    with new_manager(root, **SMALL | dict(ssd_max_bytes=1 << 20)) as manager:  # over budget: evicts the evil row
        manager.put(random_block(key_of(2)))
        manager.flush()
    assert victim.read_bytes() == b"precious"


def test_prune_never_follows_a_tampered_manifest_key(tmp_path: Path) -> None:
    """`paged-cache prune` deletes only files whose names are hex digests (fixed in inventory.py)."""
    root, victim = _tampered_manifest(tmp_path)
    cache = CacheDir(root)
    delete_blocks(cache, select_prune(cache.rows().values(), max_bytes=0))
    assert victim.read_bytes() == b"precious"


# ------------------------------------------------------------------------------ no pickle

UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "shelve",
                  "marshal", "torch"}


def test_nothing_is_unpickled() -> None:
    offenders = []
    for path in Path(paged_cache.__file__).parent.rglob("*.py"):
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path}: import {n}" for n in names if n.split(".")[0] in UNSAFE_MODULES]
            if isinstance(node, ast.keyword) and node.arg == "allow_pickle":
                offenders.append(f"{path}: allow_pickle=")
            if isinstance(node, ast.Attribute) and node.attr in ("load", "loads") and \
                    isinstance(node.value, ast.Name) and node.value.id in ("np", "numpy"):
                offenders.append(f"{path}: numpy.{node.attr} (may unpickle)")
    assert offenders == []
    assert not re.search(r"\bpickle\b", Path(fmt.__file__).read_text())


# ------------------------------------------------------------------------------ allocation

def _huge_claim_file(key: str, claim: int, compression: str) -> bytes:
    meta = {"header_checksum": "0" * 16, "format": fmt.FORMAT_NAME,
            "format_version": fmt.FORMAT_VERSION, "key": key, "checksum": "0" * 32}
    entries = {"x": {"dtype": "F32", "shape": [claim], "data_offsets": [0, 4 * claim]}}
    # a valid header checksum (docs/file-format.md): only the size check can stop this file
    header = fmt.sealed(json.dumps({"__metadata__": meta, **entries},
                                   separators=(",", ":")).encode())
    data = struct.pack("<Q", len(header)) + header + b"\0" * 64
    return lz4.frame.compress(data) if compression == "lz4" else data


@pytest.mark.parametrize("compression", ["none", "lz4"])
@pytest.mark.parametrize("claim", [1 << 28, 1 << 40, 1 << 62])
def test_header_claiming_a_huge_tensor_allocates_nothing(tmp_path: Path, compression: str,
                                                         claim: int) -> None:
    root = tmp_path / "c"
    key = key_of(("huge", claim))
    with new_manager(root, **SMALL | dict(hot_cache_max_bytes=0, ssd_max_bytes="1GB")) as manager:
        manager.put(random_block(key_of(0)))
        manager.flush()
        fan = root / "blocks" / key[:2]
        fan.mkdir(mode=0o700, exist_ok=True)
        (fan / (key + fmt.SUFFIXES[compression])).write_bytes(_huge_claim_file(key, claim, compression))
        mx.reset_peak_memory()
        mx_before = mx.get_peak_memory()
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        tracemalloc.start()
        assert manager.get(key) is None                    # read path
        traced = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert manager.stats()["ssd"]["damaged"] == 1
    (fan / (key + fmt.SUFFIXES[compression])).write_bytes(_huge_claim_file(key, claim, compression))
    tracemalloc.start()
    with new_manager(root, **SMALL | dict(hot_cache_max_bytes=0, ssd_max_bytes="1GB")) as manager:  # adoption path
        assert manager.get(key) is None
    traced = max(traced, tracemalloc.get_traced_memory()[1])
    tracemalloc.stop()
    assert traced < 4 << 20, f"{traced} bytes traced for a {claim * 4}-byte claim"
    assert mx.get_peak_memory() - mx_before < 1 << 20
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before
    assert grown_kib < 64 << 10, f"max RSS grew by {grown_kib} KiB"
    assert key not in block_files(root)


def test_a_writable_cache_directory_gets_one_warning_naming_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """An existing cache directory its group or others could write to: tightened to 0700 at open,
    with one WARNING naming it; a private one, or a new one, opens without a word."""
    old = os.umask(0)
    try:
        for mode, warned in [(0o777, "others"), (0o770, "its group"), (0o755, None), (None, None)]:
            root = tmp_path / f"c{mode}"
            if mode is not None:
                root.mkdir()
                os.chmod(root, mode)
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="paged_cache"):
                with new_manager(root, **SMALL):
                    pass
                with new_manager(root, **SMALL):  # a second open: private now, nothing to say
                    pass
            found = [r.getMessage() for r in caplog.records if "writable by" in r.getMessage()]
            assert found == ([] if warned is None else [found[0]]), found
            if warned is not None:
                assert str(root) in found[0] and warned in found[0] and f"{mode:04o}" in found[0]
            assert stat.S_IMODE(root.stat().st_mode) == 0o700
    finally:
        os.umask(old)
