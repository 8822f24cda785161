"""The bytes a SQLite manifest's own write transactions write to disk, read from the WAL-index
header SQLite keeps in ``<manifest>-shm`` (the manifest's share of the SSD tier's
``bytes_written``)."""

from __future__ import annotations

import os
import struct
import threading
from pathlib import Path


class WalMeter:
    """Counts the bytes a manifest's write transactions write: WAL frames (a page plus a 24-byte
    frame header each) and pages a checkpoint run by the commit copies into the database file.

    Read from the WAL-index header SQLite keeps at the start of ``<manifest>-shm`` (SQLite's
    documented WAL-index format, native byte order: mxFrame, the last valid frame, at offset 16;
    the salts at 32; nBackfill, the frames checkpointed, at 96) right after BEGIN IMMEDIATE (the
    write lock is held: no other commit moves it) and right after COMMIT. New salts mean the WAL
    was restarted from its first frame. A header that cannot be read or looks wrong (its two
    copies differ, another version) counts nothing; a commit of another process landing between
    ours and the second read is counted as ours (rare; only with a shared directory)."""

    _HEADER = struct.Struct("=IIIBBHII8s8s8s")  # a WalIndexHdr, 48 bytes
    _VERSION = 3007000

    def __init__(self, path: Path, page_size: int) -> None:
        self._path = f"{path}-shm"
        self._page = page_size
        self._fd = -1
        self._lock = threading.Lock()
        self._bytes = 0

    def position(self) -> tuple[int, bytes, int] | None:
        """(mxFrame, salts, nBackfill) now, or None."""
        try:
            if self._fd < 0:
                self._fd = os.open(self._path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            raw = os.pread(self._fd, 100, 0)
        except OSError:
            return None
        if len(raw) < 100 or raw[:48] != raw[48:96]:
            return None
        version, _, _, init, _, page, frames, _, _, salts, _ = self._HEADER.unpack(raw[:48])
        if version != self._VERSION or not init or (page if page != 1 else 65536) != self._page:
            return None
        return frames, salts, struct.unpack("=I", raw[96:100])[0]

    def count(self, before: tuple[int, bytes, int] | None) -> None:
        """Add what was written since ``before`` (a ``position``)."""
        after = self.position()
        if before is None or after is None:
            return
        restarted = after[1] != before[1]
        frames = after[0] if restarted else after[0] - before[0]
        copied = after[2] if restarted else after[2] - before[2]
        if frames >= 0 and copied >= 0:
            with self._lock:
                self._bytes += frames * (self._page + 24) + copied * self._page

    def take(self) -> int:
        """The bytes counted since the last call."""
        with self._lock:
            out, self._bytes = self._bytes, 0
        return out

    def close(self) -> None:
        """Close the ``-shm`` file (reopened by the next ``position``)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
