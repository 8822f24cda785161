"""Bad arguments get a clear error naming the argument and the value, never a bare OSError,
OverflowError or AttributeError from deep inside, and nothing stored is touched by them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from paged_cache.config import CacheConfig
from paged_cache.manager import PagedSSDCacheManager
from paged_cache.prefix_cache import BlockAwarePrefixCache
from paged_cache.testing import tiny_model
from helpers.blocks import key_of, random_block, same_block
from helpers.managers import new_manager
from reliability_support import SMALL, audit
from helpers.prefix import prompt, store_prompt

INT64_MAX = 2**63 - 1


@pytest.fixture(scope="module")
def prefix() -> Iterator[BlockAwarePrefixCache]:
    model = tiny_model("llama")
    with PagedSSDCacheManager(CacheConfig(hot_cache_only=True, block_size=16)) as manager:
        yield BlockAwarePrefixCache(manager, model)


@pytest.mark.parametrize("bad", [2**63, 2**64 - 1, -(2**63) - 1,
                                 np.array([5, 2**64 - 1], dtype=np.uint64)],
                         ids=["2**63", "uint64-max", "below-int64", "uint64-array"])
def test_token_ids_outside_int64_are_refused_by_name(prefix: BlockAwarePrefixCache, bad) -> None:
    stored = store_prompt(prefix.model, prefix, prompt(40))
    tokens = list(bad) if isinstance(bad, np.ndarray) else prompt(20) + [bad]
    value = str(int(tokens[-1]))
    for call in (lambda: prefix.fetch(tokens), lambda: prefix.store(tokens, prefix.make_cache())):
        with pytest.raises(ValueError, match=rf"tokens: .*{value}.*int64"):
            call()
    prefix.fetch([INT64_MAX, -INT64_MAX - 1, 3])                 # int64's edges are token ids
    assert prefix.fetch(stored + [1])[1] == len(stored)          # nothing stored was touched


def test_a_missing_model_is_refused_by_name() -> None:
    with PagedSSDCacheManager(CacheConfig(hot_cache_only=True)) as manager:
        for bad in (None, "llama", 3):
            with pytest.raises(TypeError, match=rf"model: .*{bad!r}"):
                BlockAwarePrefixCache(manager, bad)


def _refused(ssd_dir: str | Path, *fragments: str) -> str:
    """Opening a manager on ``ssd_dir`` raises ValueError naming ssd_dir, the path and fragments."""
    with pytest.raises(ValueError) as info:
        PagedSSDCacheManager(CacheConfig(ssd_dir=ssd_dir))
    message = str(info.value)
    assert message.startswith("ssd_dir: "), message
    for fragment in (repr(str(ssd_dir))[1:-1], *fragments):
        assert fragment in message, message
    return message


def test_an_ssd_dir_inside_a_regular_file_is_refused_by_name(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"x")
    _refused(tmp_path / "file" / "cache", "Not a directory")
    _refused(tmp_path / "file", "not a symlink or file")


def test_an_ssd_dir_with_a_nul_byte_is_refused_by_name(tmp_path: Path) -> None:
    _refused(f"{tmp_path}/ca\0che", "NUL byte")


def test_an_ssd_dir_on_a_read_only_filesystem_is_refused_by_name(tmp_path: Path) -> None:
    root = tmp_path / "ro"
    with new_manager(root / "cache", **SMALL) as manager:
        manager.put(random_block(key_of(1, "ro")))
    if subprocess.run(["mount", "--bind", str(root), str(root)], capture_output=True).returncode:
        pytest.skip("cannot bind-mount here (needs root)")
    try:
        assert subprocess.run(["mount", "-o", "remount,bind,ro", str(root)]).returncode == 0
        _refused(root / "cache", "read-only filesystem")
        _refused(root / "new", "Read-only file system")
    finally:
        subprocess.run(["umount", "-l", str(root)], capture_output=True)
    with new_manager(root / "cache", **SMALL) as manager:                  # nothing stored was touched
        assert same_block(manager.get(key_of(1, "ro")), random_block(key_of(1, "ro")))
    audit(root / "cache")


_UNPRIVILEGED = """
import json, os, sys
from paged_cache.config import CacheConfig
from paged_cache.manager import PagedSSDCacheManager
import paged_cache.tiers.ssd.tier  # loaded before the privileges go
os.setgid(65534)
os.setuid(65534)
try:
    PagedSSDCacheManager(CacheConfig(ssd_dir=sys.argv[1]))
    print(json.dumps(["opened", ""]))
except Exception as exc:
    print(json.dumps(["ValueError" if isinstance(exc, ValueError) else type(exc).__name__, str(exc)]))
"""


def test_an_ssd_dir_under_an_unreadable_directory_is_refused_by_name() -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to run a child as another user")
    outer = Path(tempfile.mkdtemp(prefix="paged-cache-perm-"))
    try:
        outer.chmod(0o755)
        (outer / "locked").mkdir(mode=0o000)
        ssd_dir = outer / "locked" / "cache"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        out = subprocess.run([sys.executable, "-c", _UNPRIVILEGED, str(ssd_dir)], env=env,
                             capture_output=True, text=True, check=True).stdout
        kind, message = json.loads(out.strip().splitlines()[-1])
    finally:
        shutil.rmtree(outer)
    assert kind == "ValueError", (kind, message)
    assert message.startswith(f"ssd_dir: {str(ssd_dir)!r}") and "Permission denied" in message
