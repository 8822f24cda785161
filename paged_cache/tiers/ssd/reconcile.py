"""Reconciliation of an SSD tier directory: manifest rows and block files made to agree.

Files without rows are adopted (header read), rows without files dropped, finished reservations
of dead writers completed, temp files of dead writers and stray entries removed; no block payload
is read. It reads the rows first, then goes one fan-out folder at a time, and each change it
makes checks the files again inside its transaction, so it can run while this and other
processes use the directory: an open tier runs it on a background thread (``OpenManifest``), a
reopen after damage on the calling thread.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from typing import Callable

from paged_cache.block import HEX, KEY_HEX_LEN, is_key
from paged_cache.tiers import format as fmt
from paged_cache.tiers.ssd.block_files import BlockFiles
from paged_cache.tiers.ssd.files import (DIR_FLAGS, READ_FLAGS, STALE_SECONDS,
                                         SUFFIX_TO_COMPRESSION, pid_alive, unlink_quiet,
                                         writer_alive)
from paged_cache.tiers.ssd.manifest import (COMPLETE, RESERVED, Deferred, Manifest, Row, now,
                                            row_from_meta)

log = logging.getLogger("paged_cache.ssd")

Count = Callable[[str, int], None]  # the tier's counter: count(name, n)
FANS = tuple(f"{i:02x}" for i in range(256))  # the fan-out folder names
BATCH = 1024  # rows adopted, or dropped for want of a file, per transaction


class Reconciliation:
    """One pass over ``files``' directory against ``manifest`` (see the module docstring).

    ``count`` receives the tier counters ``adopted``, ``rows_dropped``, ``damaged``,
    ``strays_removed``, ``temps_removed``; ``stop``, once set, ends the pass after the folder
    being reconciled (the rows it adopted so far are inserted first)."""

    def __init__(self, manifest: Manifest, files: BlockFiles, count: Count,
                 stop: threading.Event | None = None) -> None:
        self._manifest = manifest
        self._files = files
        self._blocks_fd = files.blocks_fd
        self._count = count
        self._stop = stop or threading.Event()
        self._adopting: list[Row] = []  # rows of files found without one, inserted by BATCH

    def run(self) -> bool:
        """Reconcile every folder, then the rows left without a file, then ``tmp/``; False when
        stopped before the end.

        The rows are read before any folder is listed: a file renamed in by another process (or
        this one's writer) after the snapshot is merely adopted (header read, its row kept if it
        has one), never lost. Every change checks the files again inside its transaction: a file
        evicted meanwhile gets no row, a row whose key was stored again meanwhile stays."""
        unseen = self._manifest.complete_keys()  # complete rows whose file is not listed yet
        reserved = self._manifest.reservations()
        listed = self._fan_folders()
        for fan in FANS:
            if self._stop.is_set():
                self._adopt_rows()
                return False
            if fan in listed:
                self._fan(self._scan_fan(fan), unseen, reserved)
        self._adopt_rows()
        dead = [key for key, writer in reserved.items() if not writer_alive(*writer)]
        if dead:  # reservations of dead writers that left no file
            self._manifest.remove(dead, states=(RESERVED,))
        missing = list(unseen)
        for start in range(0, len(missing), BATCH):
            if self._stop.is_set():
                return False
            self._manifest.apply(Deferred({}, set(missing[start:start + BATCH])),
                                 self._files.exists)
        self._count("rows_dropped", len(dead) + len(missing))
        self._clean_temps()
        return True

    def _fan(self, present: set[str], unseen: set[str],
             reserved: dict[str, tuple[str, float]]) -> None:
        """One folder's files (``present``: their keys), taken out of ``unseen`` and, when
        reserved, out of ``reserved`` (writer, created): only the files without a complete row
        are looked at one by one."""
        complete = []
        for key in present - unseen:
            writer = reserved.pop(key, None)
            if writer is not None:
                if not writer_alive(*writer):
                    complete.append(key)  # renamed into place, so complete
                continue
            if not is_key(key):  # keys from the manifest were checked when inserted
                self._remove_stray_key(key)
                continue
            row = self._adopt(key)
            if row is not None:
                self._adopting.append(row)
        unseen -= present
        if complete:
            self._manifest.mark_complete(complete)
        if len(self._adopting) >= BATCH:
            self._adopt_rows()

    def _adopt_rows(self) -> None:
        """Insert the rows of the files found without one, each only if its file is still there
        then (one evicted meanwhile gets no row) and no row has its key (``adopted`` counts the
        rows inserted: two processes reconciling at once adopt each file once)."""
        if self._adopting:
            self._count("adopted", self._manifest.adopt(self._adopting, self._files.exists))
            self._adopting = []

    def _fan_folders(self) -> set[str]:
        """The fan-out folders under blocks/; anything else there is removed."""
        out = set()
        for name in os.listdir(self._blocks_fd):
            if len(name) == 2 and HEX.issuperset(name):
                out.add(name)
            else:
                self._remove_stray(self._blocks_fd, name)
        return out

    def _scan_fan(self, fan: str) -> set[str]:
        """Keys of the block files in blocks/<fan>; anything else there is removed, as is a
        second copy of a block under the other compression."""
        try:
            fan_fd = os.open(fan, DIR_FLAGS, dir_fd=self._blocks_fd)
        except OSError:
            self._remove_stray(self._blocks_fd, fan)
            return set()
        try:
            names = os.listdir(fan_fd)
            good = [n for n in names if n[KEY_HEX_LEN:] in SUFFIX_TO_COMPRESSION
                    and n.startswith(fan) and len(n) > KEY_HEX_LEN]
            keys = {n[:KEY_HEX_LEN] for n in good}
            if len(good) != len(names):
                for name in set(names).difference(good):
                    self._remove_stray(fan_fd, name)
            if len(keys) != len(good):  # a second copy under the other compression
                plain = {n[:KEY_HEX_LEN] for n in good if n.endswith(fmt.SUFFIXES["none"])}
                for name in good:
                    if name.endswith(fmt.SUFFIXES["lz4"]) and name[:KEY_HEX_LEN] in plain:
                        unlink_quiet(name, fan_fd)
            return keys
        finally:
            os.close(fan_fd)

    def _remove_stray_key(self, key: str) -> None:
        fan_fd = os.open(fmt.fan_name(key), DIR_FLAGS, dir_fd=self._blocks_fd)
        try:
            for sfx in fmt.SUFFIXES.values():
                self._remove_stray(fan_fd, key + sfx)
        finally:
            os.close(fan_fd)

    def _remove_stray(self, dir_fd: int, name: str) -> None:
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode):
                os.unlink(name, dir_fd=dir_fd)
                self._count("strays_removed", 1)
            else:
                log.warning("ignoring unexpected directory %r in the cache directory", name)
        except OSError:
            pass

    def _adopt(self, key: str) -> Row | None:
        """A manifest row for a complete file found without one (header read only), or None if
        it has none now or a bad one (removed, counted)."""
        comp = self._files.compression_of(key)
        if comp is None:
            return None
        name = fmt.block_path(key, comp)
        try:
            fd = os.open(name, READ_FLAGS, dir_fd=self._blocks_fd)
        except OSError:
            unlink_quiet(name, self._blocks_fd)
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise fmt.BlockFileError("not a regular file")
            header = fmt.read_header_only(lambda off, n: os.pread(fd, n, off), st.st_size,
                                          fmt.decoded_limit(st.st_size), key=key)
            if (comp == "lz4") != (os.pread(fd, 4, 0) == fmt.LZ4_MAGIC):
                raise fmt.BlockFileError("file suffix does not match its compression")
        except (OSError, ValueError) as exc:
            try:  # counted by whoever removes it (a reader may have found the damage first)
                os.unlink(name, dir_fd=self._blocks_fd)
            except OSError:
                return None
            self._count("damaged", 1)
            log.warning("block %s: unadoptable file removed (%s)", key[:16], exc)
            return None
        finally:
            os.close(fd)
        return row_from_meta(key, COMPLETE, st.st_size, header.data_bytes, comp, header.meta,
                             st.st_mtime, "adopted")

    def _clean_temps(self) -> None:
        """Delete temp files left by dead writers (or older than STALE_SECONDS)."""
        tmp_fd = self._files.tmp_fd
        for name in os.listdir(tmp_fd):
            parts = name.split(".")
            try:
                st = os.stat(name, dir_fd=tmp_fd, follow_symlinks=False)
            except OSError:
                continue
            pid = int(parts[1]) if len(parts) == 4 and parts[1].isdigit() else None
            if pid is None or not pid_alive(pid) or now() - st.st_mtime > STALE_SECONDS:
                unlink_quiet(name, tmp_fd)
                self._count("temps_removed", 1)
