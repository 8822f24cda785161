"""Out of file descriptors is not damage: a read refused with EMFILE is a counted miss and the
block file stays (read again once descriptors are free), with a real descriptor limit set in a
subprocess; and an SSD tier raises a low soft limit (macOS starts a process at 256) so a long
prompt's in-place reads fit."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

CHILD = textwrap.dedent("""
    import json, os, resource, sys
    import mlx.core as mx
    from paged_cache import CacheConfig, PagedSSDCacheManager
    from paged_cache.block import Block
    from paged_cache.hashing import block_key
    root = sys.argv[1]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    cfg = CacheConfig(block_size=4, hot_cache_max_bytes="1KiB", ssd_dir=root,
                      ssd_max_bytes="64MiB")
    with PagedSSDCacheManager(cfg) as m:
        raised = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        keys = [block_key("f" * 64, "", "", [i]) for i in range(40)]
        for k in keys:
            assert m.put(Block(k, {"kv": mx.zeros((4096,), dtype=mx.uint8)}))
        m.flush()
        # use up every descriptor but a few, then read every block in place
        hog = []
        try:
            while True:
                hog.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            pass
        for fd in hog[:3]:
            os.close(fd)
        held = [m.get(k, take=True, in_place=True) for k in keys]
        stats = m.stats()["ssd"]
        for fd in hog[3:]:
            os.close(fd)
        del held
        again = sum(m.get(k, take=False) is not None for k in keys)
        print(json.dumps(dict(raised=raised, hard=hard, read_errors=stats["read_errors"],
                              damaged=stats["damaged"], again=again,
                              files=sum(len(f) for _, _, f in os.walk(os.path.join(root, "blocks"))))))
""")


def test_a_read_out_of_descriptors_is_a_miss_and_the_file_stays(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "ssd")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["raised"] >= min(1024, got["hard"])  # the tier raised the soft limit of 256
    assert got["read_errors"] > 0  # some reads found no descriptor...
    assert got["damaged"] == 0  # ...and none was taken for damage
    assert got["files"] == 40 and got["again"] == 40  # every block file is still there


def test_a_block_dropped_unread_closes_its_file_at_once(tmp_path: Path) -> None:
    """A block read in place and dropped before its payload is read (a fetch that gave up)
    releases its open file when the last reference goes, not at the garbage collector's next
    full pass (no reference cycle between a block and its tensors)."""
    import gc
    import os

    import mlx.core as mx

    from paged_cache import CacheConfig, PagedSSDCacheManager
    from paged_cache.block import Block
    from paged_cache.hashing import block_key

    config = CacheConfig(block_size=4, hot_cache_max_bytes="1KiB", ssd_dir=tmp_path,
                         ssd_max_bytes="64MiB")
    gc.disable()
    try:
        with PagedSSDCacheManager(config) as manager:
            keys = [block_key("f" * 64, "", "", [i]) for i in range(30)]
            for key in keys:
                assert manager.put(Block(key, {"kv": mx.zeros((4096,), dtype=mx.uint8)}))
            manager.flush()
            before = len(os.listdir("/proc/self/fd"))
            for key in keys:
                stored = manager.get(key, take=True, in_place=True)
                assert stored is not None and stored.fd >= 0
                del stored
            assert len(os.listdir("/proc/self/fd")) <= before
    finally:
        gc.enable()
