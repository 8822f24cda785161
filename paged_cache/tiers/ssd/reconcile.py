"""Startup reconciliation of an SSD tier directory: manifest rows and block files made to agree.

Runs once when an ``SSDTier`` opens, before its writer thread starts, without reading any block
payload: files without rows are adopted (header read), rows without files dropped, finished
reservations of dead writers completed, temp files of dead writers and stray entries removed.
"""

from __future__ import annotations

import logging
import os
import stat
from typing import Callable

from paged_cache.block import HEX, KEY_HEX_LEN, is_key
from paged_cache.tiers import format as fmt
from paged_cache.tiers.ssd.files import (DIR_FLAGS, READ_FLAGS, STALE_SECONDS,
                                         SUFFIX_TO_COMPRESSION, file_compression, pid_alive,
                                         unlink_quiet, writer_alive)
from paged_cache.tiers.ssd.manifest import COMPLETE, RESERVED, Manifest, Row, now, row_from_meta

log = logging.getLogger("paged_cache.ssd")

Count = Callable[[str, int], None]  # the tier's counter: count(name, n)


def reconcile(manifest: Manifest, blocks_fd: int, tmp_fd: int, *, compressions: tuple[str, ...],
              count: Count) -> None:
    """Make ``manifest`` and the files under blocks/ and tmp/ agree (see the module docstring).

    ``compressions``: the order in which a key's file suffixes are tried; ``count`` receives the
    tier counters ``adopted``, ``rows_dropped``, ``damaged``, ``strays_removed``, ``temps_removed``.
    """
    _Reconcile(manifest, blocks_fd, tmp_fd, compressions, count).run()


class _Reconcile:
    def __init__(self, manifest: Manifest, blocks_fd: int, tmp_fd: int,
                 compressions: tuple[str, ...], count: Count) -> None:
        self._manifest = manifest
        self._blocks_fd = blocks_fd
        self._tmp_fd = tmp_fd
        self._compressions = compressions
        self._count = count

    def run(self) -> None:
        """Rows are read before the directory is listed: a file renamed in by another process after
        the snapshot is merely adopted (header read), never lost. The common case is two set
        differences over keys; only the differences are looked at one by one."""
        expected = self._manifest.complete_keys()
        reserved = self._manifest.reservations()
        present = self._scan_blocks()
        adopt, complete = [], []
        for key in present - expected:
            if not is_key(key):  # keys from the manifest were checked when inserted
                self._remove_stray_key(key)
                continue
            comp = self._file_compression(key)
            if comp is None:
                continue
            if key in reserved:
                if not writer_alive(*reserved.pop(key)):
                    complete.append(key)
                continue
            row = self._adopt(key, comp)
            if row is not None:
                adopt.append(row)
        drop = [key for key in expected - present if self._file_compression(key) is None]
        drop += [key for key, (writer, created) in reserved.items()
                 if not writer_alive(writer, created) and self._file_compression(key) is None]
        self._manifest.adopt(adopt)
        self._manifest.mark_complete(complete)
        self._manifest.remove(drop, states=(COMPLETE, RESERVED))
        self._count("adopted", len(adopt))
        self._count("rows_dropped", len(drop))
        self._clean_temps()

    def _file_compression(self, key: str) -> str | None:
        return file_compression(self._blocks_fd, key, self._compressions)

    def _scan_blocks(self) -> set[str]:
        """Keys of the block files in blocks/; anything else there is removed, as is a second
        copy of a block under the other compression."""
        present: set[str] = set()
        for fan in os.listdir(self._blocks_fd):
            if len(fan) != 2 or not HEX.issuperset(fan):
                self._remove_stray(self._blocks_fd, fan)
                continue
            try:
                fan_fd = os.open(fan, DIR_FLAGS, dir_fd=self._blocks_fd)
            except OSError:
                self._remove_stray(self._blocks_fd, fan)
                continue
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
                present |= keys
            finally:
                os.close(fan_fd)
        return present

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

    def _adopt(self, key: str, comp: str) -> Row | None:
        """A manifest row for a complete file found without one (header read only), or None if bad."""
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
                                          fmt.decoded_limit(st.st_size))
            if header.meta.get(fmt.META_KEY) != key:
                raise fmt.BlockFileError("file name does not match the block key inside")
            if (comp == "lz4") != (os.pread(fd, 4, 0) == fmt.LZ4_MAGIC):
                raise fmt.BlockFileError("file suffix does not match its compression")
        except (OSError, ValueError) as exc:
            self._count("damaged", 1)
            log.warning("block %s: unadoptable file removed (%s)", key[:16], exc)
            unlink_quiet(name, self._blocks_fd)
            return None
        finally:
            os.close(fd)
        return row_from_meta(key, COMPLETE, st.st_size, header.data_bytes, comp, header.meta,
                             st.st_mtime, "adopted")

    def _clean_temps(self) -> None:
        """Delete temp files left by dead writers (or older than STALE_SECONDS)."""
        for name in os.listdir(self._tmp_fd):
            parts = name.split(".")
            try:
                st = os.stat(name, dir_fd=self._tmp_fd, follow_symlinks=False)
            except OSError:
                continue
            pid = int(parts[1]) if len(parts) == 4 and parts[1].isdigit() else None
            if pid is None or not pid_alive(pid) or now() - st.st_mtime > STALE_SECONDS:
                unlink_quiet(name, self._tmp_fd)
                self._count("temps_removed", 1)
