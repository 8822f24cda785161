"""Helpers shared by the reliability suite (no tests here): key-derived blocks, directory audits,
file damage, and the child processes that write into a cache directory while being killed.

Every block's content is a pure function of its key (`helpers.blocks.random_block`), so any process can check that
a block it was served is exactly the one that was written under that key.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import sqlite3
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from helpers.blocks import block_files, key_of, random_block
from helpers.managers import new_manager
from paged_cache.tiers.ssd.files import MANIFEST_NAME

HERE = Path(__file__).resolve().parent
KEY_RE = r"[0-9a-f]{64}"


# ------------------------------------------------------------------------------ managers

SMALL = dict(hot_cache_max_bytes=16 << 10, ssd_max_bytes=64 << 20)  # small hot tier, room on SSD


# ------------------------------------------------------------------------------ directory audits

def manifest_rows(root: Path) -> dict[str, tuple[int, int]]:
    """key -> (state, file_bytes) of every manifest row."""
    db = sqlite3.connect(root / MANIFEST_NAME, timeout=30)
    try:
        return {k: (s, b) for k, s, b in db.execute("SELECT key, state, file_bytes FROM blocks")}
    finally:
        db.close()


def manifest_totals(root: Path) -> tuple[int, int]:
    db = sqlite3.connect(root / MANIFEST_NAME, timeout=30)
    try:
        return tuple(db.execute("SELECT blocks, bytes FROM totals WHERE id = 0").fetchone())
    finally:
        db.close()


@dataclass
class Audit:
    """What a quiescent cache directory holds: its block files and their bytes."""

    files: dict[str, Path]
    bytes: int


def audit(root: Path, budget: int | None = None) -> Audit:
    """Check a directory no process is writing: names are hex keys, no temp file, every row is a
    complete file and every file has a row, the totals equal the files, the budget holds."""
    files = block_files(root)
    for key, path in files.items():
        assert re.fullmatch(KEY_RE, key), path
        assert path.parent.name == key[:2] and re.fullmatch(KEY_RE + r"\.safetensors(\.lz4)?",
                                                            path.name), path
    temps = sorted(os.listdir(root / "tmp"))
    assert temps == [], f"temp files left: {temps}"
    rows = manifest_rows(root)
    assert set(rows) == set(files), ("manifest rows != block files: rows without a file "
                                     f"{sorted(set(rows) - set(files))}, files without a row "
                                     f"{sorted(set(files) - set(rows))}")
    assert all(state == 1 for state, _ in rows.values()), "a reservation outlived its write"
    size = sum(p.stat().st_size for p in files.values())
    assert all(rows[k][1] == p.stat().st_size for k, p in files.items())
    assert manifest_totals(root) == (len(files), size), "totals do not match the files"
    if budget is not None:
        assert size <= budget, f"{size} bytes on disk > budget {budget}"
    return Audit(files, size)


def fill(path: Path, leave: int) -> int:
    """Create ``path`` taking all free space but ``leave`` bytes; return its size."""
    st = os.statvfs(path.parent)
    size = max(st.f_bavail * st.f_frsize - leave, 0)
    with open(path, "wb") as fh:
        try:
            fh.write(b"\0" * size)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return path.stat().st_size


# ------------------------------------------------------------------------------ damage

DAMAGE_KINDS = ("bit_flips", "truncated", "zero_length", "garbage_header", "header_length",
                "appended", "wrong_model", "swapped_names", "other_block")


def damage(path: Path, kind: str, rng: random.Random, other: Path | None = None) -> None:
    """Damage a block file in place. ``other``: a second block file (wrong_model / swapped / other)."""
    data = bytearray(path.read_bytes())
    if kind == "bit_flips":
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif kind == "truncated":
        del data[rng.randrange(1, len(data)):]
    elif kind == "zero_length":
        data = bytearray()
    elif kind == "garbage_header":
        n = min(struct.unpack("<Q", bytes(data[:8]))[0] if data[:4] != b"\x04\x22\x4d\x18" else 64,
                len(data) - 8)
        start = 8 + rng.randrange(max(n - 16, 1))
        data[start:start + 16] = bytes(rng.randrange(256) for _ in range(16))
    elif kind == "header_length":
        data[:8] = struct.pack("<Q", rng.choice([0, 1, 7, 2**40, 2**63 + 5, len(data)]))
    elif kind == "appended":
        data += bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    elif kind in ("wrong_model", "other_block"):  # a valid file of another block under this name
        assert other is not None
        data = bytearray(other.read_bytes())
    elif kind == "swapped_names":
        assert other is not None
        tmp = path.with_name("swap.tmp")
        os.rename(path, tmp)
        os.rename(other, path)
        os.rename(tmp, other)
        return
    else:
        raise ValueError(f"kind: unknown damage {kind!r}")
    path.write_bytes(bytes(data))


# ------------------------------------------------------------------------------ child processes

def spawn(role: str, log: Path, **kwargs: Any) -> subprocess.Popen:
    """Run ``child_<role>(**kwargs)`` of this module in a fresh Python process, stdout -> ``log``."""
    code = (f"import sys, json; sys.path[:0] = [{str(HERE)!r}, {str(HERE.parent)!r}]; "
            "import reliability_support as s; "
            f"s.child_{role}(**json.loads(sys.argv[1]))")
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-c", code, json.dumps(kwargs)], stdout=out,
                                stderr=subprocess.STDOUT)


def progress(log: Path) -> list[str]:
    """Complete lines a child has printed so far."""
    text = log.read_text() if log.exists() else ""
    return text.split("\n")[:-1]


def wait_for_line(log: Path, child: subprocess.Popen, prefix: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not any(line.startswith(prefix) for line in progress(log)):
        assert child.poll() is None, f"child exited early: {log.read_text()[-2000:]}"
        assert time.monotonic() < deadline, f"child did not print {prefix!r} in {timeout} s"
        time.sleep(0.01)


def discarded_by_writer(i: int) -> int | None:
    """The writer child discards an older block every 7th put (exercises discard under kills)."""
    return i - 5 if i % 7 == 0 and i >= 5 else None


def child_writer(root: str, start: int, budget: int, compression: str, queue: int,
                 space: str = "", stop_after: float | None = None, limit: int | None = None) -> None:
    """Store key-derived blocks through a manager, printing each index, until ``stop_after``
    seconds or ``limit`` blocks (then idle until killed, or exit if ``stop_after`` is set)."""
    config = dict(ssd_max_bytes=budget, compression=compression, write_queue_max_bytes=queue,
                  queue_full_policy="write-on-caller", hot_cache_max_bytes=32 << 10)
    deadline = None if stop_after is None else time.monotonic() + stop_after
    end = None if limit is None else start + limit
    with new_manager(Path(root), **SMALL | dict(**config)) as manager:
        print("ready", flush=True)
        i = start
        while deadline is None or time.monotonic() < deadline:
            if i == end:
                time.sleep(0.01)
                continue
            manager.put(random_block(key_of(i, space)))
            gone = discarded_by_writer(i)
            if gone is not None:
                manager.discard(key_of(gone, space))
            if i % 11 == 0:
                manager.flush()
            print(i, flush=True)
            i += 1
    print("done", flush=True)


def printed_indices(log: Path) -> list[int]:
    """The block indices a writer child has stored so far."""
    return [int(line) for line in progress(log) if line.isdigit()]
