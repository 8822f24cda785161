"""The SSD tier's block files under ``directory``: ``blocks/<k[:2]>/<key>.safetensors[.lz4]``
(fan-out directories opened without following links) and ``tmp/`` (files being written).

``BlockFiles`` reads a file and verifies it (damage is counted, the file removed and its
manifest row handed to ``forget``), writes temp files and renames them into place, and removes
a block's files. It writes no manifest row itself: the SSD tier (tiers/ssd/tier.py) does.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import weakref
from pathlib import Path
from typing import Any, Callable

from paged_cache.block import Block, check_key, is_key
from paged_cache.tiers import format as fmt
from paged_cache.tiers.ssd.direct import StoredBlock, StoredTensor
from paged_cache.tiers.ssd.files import (DIR_FLAGS, PLANTED, READ_FLAGS, CacheDirError,
                                         drain, file_compression, open_cache_root,
                                         open_private_dir, raise_open_files_limit, read_exact)

log = logging.getLogger("paged_cache.ssd")


class BlockFiles:
    """The block files of one cache directory (see module doc). ``count(name, n)`` counts the
    tier's events; ``forget(key)`` defers the removal of a block's manifest row."""

    def __init__(self, directory: Path, *, max_bytes: int, compression: str,
                 count: Callable[..., None], forget: Callable[[str], None]) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self.compression = compression
        # a block file's name is its key and one of these, looked for in this order
        self._suffixes = tuple(fmt.SUFFIXES[c] for c in self.compression_order())
        self._count = count
        self._forget = forget
        raise_open_files_limit()  # a fetch holds one open file per SSD block it restores
        self.root_fd = open_cache_root(self.directory)
        self.blocks_fd = self.tmp_fd = -1
        # blocks/<k[:2]> kept open once used (at most 256): a take opens only its file. A fan
        # found replaced on a miss is reopened; the descriptor it had is kept (``_retired``)
        # until close, as another thread may be opening a file through it.
        self._fans: dict[str, int] = {}
        self._retired: list[int] = []
        self._fans_lock = threading.Lock()
        try:
            self.blocks_fd = self._open_subdir("blocks")
            self.tmp_fd = self._open_subdir("tmp")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Close the directory descriptors."""
        with self._fans_lock:
            fans = [*self._fans.values(), *self._retired]
            self._fans.clear()
            self._retired.clear()
        for fd in (*fans, self.tmp_fd, self.blocks_fd, self.root_fd):
            if fd >= 0:
                os.close(fd)
        self.tmp_fd = self.blocks_fd = self.root_fd = -1

    def read(self, key: str, expect: fmt.Expected | None = None) -> Block | None:
        """Read and verify a block from disk (and against ``expect``); None on a miss or damage
        (damage is counted, file removed)."""
        return self._with_file(key, lambda *a: self._read_open_file(*a, expect))

    def open_stored(self, key: str, expect: fmt.Expected | None = None) -> StoredBlock | None:
        """The block with its header verified (and checked against ``expect``) and its payload
        left on disk (see SSDTier.open_stored)."""
        return self._with_file(key, lambda *a: self._stored_open_file(*a, expect))

    def warm(self, key: str) -> int:
        """Read the block's file through the page cache without keeping it (a read of it that
        follows finds it in memory); the bytes read, 0 when it has none (not counted: that read
        counts it). Not verified here: the read that follows verifies what it uses."""
        return self._with_file(key, _drain_open_file, missing=lambda key: None) or 0

    def _with_file(self, key: str, use: Any, missing: Callable[[str], None] | None = None) -> Any:
        """``use(fan_fd, fd, name, key)`` on the block's file (which ``use`` closes), or None;
        ``missing(key)`` when it has none (default ``_missing``)."""
        check_key(key)
        missing = missing or self._missing
        for fresh in (False, True):  # a miss through a kept fan: once more, the fan looked up
            try:
                fan_fd = self.fan(key, create=False, fresh=fresh)
            except OSError as exc:  # out of descriptors, an I/O error: nothing is known of it
                return self._read_error(key, exc)
            if fan_fd is None:
                break
            for suffix in self._suffixes:
                name = key + suffix
                try:
                    fd = os.open(name, READ_FLAGS, dir_fd=fan_fd)
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    if exc.errno in PLANTED:  # a symlink, fifo or directory under our name
                        self._damaged(fan_fd, name, None, f"cannot open safely: {exc.strerror}",
                                      key)
                        return None
                    return self._read_error(key, exc)  # the file is kept: it may be whole
                return use(fan_fd, fd, name, key)
            if fresh or not self._fan_replaced(key, fan_fd):
                break
        missing(key)
        return None

    def _read_error(self, key: str, exc: OSError) -> None:
        """A read that could not open the block's file for a reason that says nothing of the
        file (EMFILE: the process's descriptors are all in use; EIO, EACCES): a counted miss,
        the file and its row kept."""
        self._count("read_errors")
        log.warning("block %s: read failed: %s", key[:16], exc)

    def _missing(self, key: str) -> None:
        """A read found no file: counted, and a row the manifest may still have for it (a file
        removed behind its back, a crash between unlink and row delete) goes at the next flush
        (if the file is still gone then), so chain lookups stop listing it."""
        self._count("misses")
        self._forget(key)

    def _read_open_file(self, fan_fd: int, fd: int, name: str, key: str,
                        expect: fmt.Expected | None) -> Block | None:
        try:
            st = os.fstat(fd)
            reason = self._unreadable(st, expect)
            if reason is None:
                data = read_exact(fd, st.st_size)
        except OSError as exc:
            return self._read_error(key, exc)
        finally:
            os.close(fd)
        if reason is None:
            try:
                arrays, meta = fmt.decode(data, key, max_bytes=fmt.decoded_limit(st.st_size),
                                          expect=expect)
            except ValueError as exc:
                reason = str(exc)
        if reason is not None:
            self._damaged(fan_fd, name, st.st_ino, reason, key)
            return None
        return Block(key, arrays, meta)

    def _stored_open_file(self, fan_fd: int, fd: int, name: str, key: str,
                          expect: fmt.Expected | None) -> StoredBlock | None:
        try:
            st = os.fstat(fd)
            reason = self._unreadable(st, expect)
            if reason is None:
                first = os.pread(fd, min(st.st_size, fmt.HEAD_READ_BYTES), 0)  # the header's
                whole = read_exact(fd, st.st_size) if first[:4] == fmt.LZ4_MAGIC else None
                in_memory = memoryview(whole if whole is not None else first)  # sliced, not copied
                read_at = (lambda off, n: in_memory[off:off + n] if off + n <= len(in_memory)
                           else os.pread(fd, n, off))
        except OSError as exc:
            os.close(fd)
            return self._read_error(key, exc)
        if reason is None:
            try:
                header = fmt.read_header_only(read_at, st.st_size,
                                              fmt.decoded_limit(st.st_size), expect, key)
            except (OSError, ValueError) as exc:
                reason = str(exc)
        if reason is not None:
            os.close(fd)
            self._damaged(fan_fd, name, st.st_ino, reason, key)
            return None
        block = StoredBlock(key, {k: v for k, v in header.meta.items() if k not in fmt.RESERVED_META},
                            fd, 8 + header.header_len, header.data_bytes,
                            header.meta.get(fmt.META_CHECKSUM, ""),
                            lambda why: self._damaged_later(key, name, st.st_ino, why),
                            compressed=whole)
        ref = weakref.ref(block)
        block.arrays = {n: StoredTensor(ref, dtype, shape, begin)
                        for n, dtype, shape, begin, _ in header.tensors}
        return block

    def _unreadable(self, st: os.stat_result, expect: fmt.Expected | None) -> str | None:
        """Why a block file is not read at all (not a regular file, larger than the budget or
        than any block ``expect`` allows), or None."""
        if not stat.S_ISREG(st.st_mode):
            return "not a regular file"
        if st.st_size > self.max_bytes:
            return f"{st.st_size} bytes exceeds the tier budget"
        if expect is not None and st.st_size > fmt.stored_limit(expect):
            return f"{st.st_size} bytes is more than a block of this layout can take"
        return None

    def _damaged_later(self, key: str, name: str, ino: int, reason: str) -> None:
        """``_damaged`` for a file found damaged after it was opened (through its kept
        directory, where the file was read)."""
        fan_fd = self.fan(key, create=False)
        if fan_fd is None:
            self._count("damaged")
            self._forget(key)
            return
        self._damaged(fan_fd, name, ino, reason, key)

    def _damaged(self, fan_fd: int, name: str, ino: int | None, reason: str, key: str) -> None:
        """Count a damaged file, remove it (only if it is still the file we read) and its row."""
        self._count("damaged")
        log.warning("block %s: damaged file removed (%s)", key[:16], reason)
        try:
            if ino is None or os.stat(name, dir_fd=fan_fd, follow_symlinks=False).st_ino == ino:
                os.unlink(name, dir_fd=fan_fd)
        except OSError:
            pass
        self._forget(key)

    def compression_order(self) -> tuple[str, ...]:
        return (self.compression,) + tuple(c for c in fmt.COMPRESSIONS if c != self.compression)

    def fan(self, key: str, *, create: bool, fresh: bool = False) -> int | None:
        """The kept fd of blocks/<key[:2]> (opened the first time, never through a symlink;
        ``fresh``: looked up again); None if absent and not created. Not to be closed."""
        name = fmt.fan_name(key)
        fd = None if fresh else self._fans.get(name)
        if fd is not None:
            return fd
        fd = self._open_fan(name, create)
        if fd is None:
            return None
        with self._fans_lock:
            kept = self._fans.get(name)
            if kept is not None and not fresh:
                os.close(fd)  # another thread kept one first
                return kept
            if kept is not None:
                self._retired.append(kept)
            self._fans[name] = fd
        return fd

    def _fan_replaced(self, key: str, fan_fd: int) -> bool:
        """True when blocks/<key[:2]> is no longer the directory ``fan_fd`` is (removed, or
        replaced by another): the fan is then looked up again."""
        try:
            now = os.stat(fmt.fan_name(key), dir_fd=self.blocks_fd, follow_symlinks=False)
            kept = os.fstat(fan_fd)
        except FileNotFoundError:
            return True
        except OSError:  # nothing known of it: the miss stands
            return False
        return (now.st_ino, now.st_dev) != (kept.st_ino, kept.st_dev)

    def _open_fan(self, fan: str, create: bool) -> int | None:
        """A new fd of blocks/``fan`` (never through a symlink); None if absent and not
        created."""
        try:
            return os.open(fan, DIR_FLAGS, dir_fd=self.blocks_fd)
        except FileNotFoundError:
            if not create:
                return None
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            log.warning("removing %r planted in blocks/: not a directory", fan)
            os.unlink(fan, dir_fd=self.blocks_fd)
            if not create:
                return None
        return open_private_dir(self.blocks_fd, fan)

    def compression_of(self, key: str) -> str | None:
        """The compression of the block's regular file if one exists (symlinks do not count)."""
        return file_compression(self.blocks_fd, key, self.compression_order())

    def exists(self, key: str) -> bool:
        return self.compression_of(key) is not None

    def remove(self, key: str) -> bool:
        """Remove every file of the block; True once none is left. A file that cannot be removed
        (EACCES, EIO, a read-only mount, ...) is logged and counted, and its row must stay."""
        if not is_key(key):  # a tampered manifest row must never name a path outside blocks/
            return False
        gone = True
        for comp in fmt.COMPRESSIONS:
            name = fmt.block_path(key, comp)
            try:
                os.unlink(name, dir_fd=self.blocks_fd)
            except (FileNotFoundError, NotADirectoryError):
                continue
            except OSError as exc:
                self._count("unlink_errors")
                log.warning("block %s: file could not be removed (%s); its manifest row is kept",
                            key[:16], exc)
                gone = False
        return gone

    def write_temp(self, name: str, chunks: list[Any]) -> None:
        """Write ``chunks`` to a new file ``tmp/<name>`` and fsync it."""
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600, dir_fd=self.tmp_fd)
        try:
            for chunk in chunks:
                view = fmt.byte_view(chunk)
                while view:
                    view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)

    def install(self, tmp_name: str, key: str, compression: str) -> None:
        """Rename the complete ``tmp/<tmp_name>`` into ``blocks/`` as the block's file (durably),
        into the fan-out directory that is there now (a kept one is checked first)."""
        fan_fd = self.fan(key, create=True)
        if self._fan_replaced(key, fan_fd):  # moved or removed since it was kept: never there
            fan_fd = self.fan(key, create=True, fresh=True)
        os.rename(tmp_name, key + fmt.SUFFIXES[compression],
                  src_dir_fd=self.tmp_fd, dst_dir_fd=fan_fd)
        os.fsync(fan_fd)

    def _open_subdir(self, name: str) -> int:
        """Open blocks/ or tmp/, replacing a file that took its place (WARNING); a symlink there
        is refused (CacheDirError), never followed nor removed."""
        try:
            st = os.stat(name, dir_fd=self.root_fd, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        if st is not None and not stat.S_ISDIR(st.st_mode) and not stat.S_ISLNK(st.st_mode):
            log.warning("%s/%s is not a directory: replaced by an empty one", self.directory, name)
            os.unlink(name, dir_fd=self.root_fd)
        try:
            return open_private_dir(self.root_fd, name)
        except CacheDirError as exc:
            raise CacheDirError(self.directory / name, exc.reason) from None


def _drain_open_file(fan_fd: int, fd: int, name: str, key: str) -> int:
    """``BlockFiles.warm``'s use of an open block file: read it through, then close it."""
    try:
        return drain(fd)
    except OSError:
        return 0
    finally:
        os.close(fd)
