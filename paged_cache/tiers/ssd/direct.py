"""Block payloads read from disk straight into the buffers a rebuild fills (no array per block).

``SSDTier.open_stored`` checks a block file's header and returns a ``StoredBlock`` whose arrays are
``StoredTensor`` placeholders. A rebuild asks for token rows of them to land in its destination
buffer (``read_rows``); ``read_stored`` then reads every asked-for file once, in file order, with
one vectored read per file and several files at once, straight into those buffers (lz4 files are
decompressed piece by piece into them), and verifies each file's payload checksum over the same
bytes. A rebuild that needs a layer's rows before the next layer is built (the device path,
``row_path``) reads each file's places so far with ``advance_all``; the file goes on from there.
The disk reads ahead of the copies: the kernel is asked (``POSIX_FADV_WILLNEED``) for each whole
file once a rebuild first places its rows (the host path: ``read_ahead_whole``, so the disk reads
while the buffers are allocated), for the next file while one is read, and on the device path
for each file's next layers, a few MiB of every file in turn; the bytes hinted and not read yet
are bounded process-wide (READ_AHEAD_BYTES). A file whose checksum fails makes ``read_stored`` return False: the rebuilt buffers hold damaged
rows and must be dropped.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import lz4.frame
import numpy as np
import xxhash

from paged_cache.tiers import format as fmt
from paged_cache.tiers.dtypes import DType

IOV_MAX = 1024  # Linux's bound on the buffers of one preadv
LZ4_CHUNK = 1 << 20  # lz4: at most this many bytes in and out of one decompression call
READ_AHEAD_BYTES = 512 << 20  # most block-file bytes hinted to the kernel and not read yet
FILE_AHEAD = 8 << 20  # how far past what was read a rebuild reading layer by layer hints a file
HINT_STEP = 1 << 20  # read-ahead extended this much per file in turn (``read_ahead``)


class _ReadAhead:
    """Bytes of block files' data sections the process asked the kernel to read ahead
    (``POSIX_FADV_WILLNEED``) and has not read yet: at most ``READ_AHEAD_BYTES``, so a restore
    larger than that keeps the page cache it fills bounded."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pending = 0

    def take(self, n: int) -> bool:
        """Reserve ``n`` bytes of the budget; False when they do not fit."""
        with self.lock:
            if self.pending + n > READ_AHEAD_BYTES:
                return False
            self.pending += n
            return True

    def give(self, n: int) -> None:
        with self.lock:
            self.pending -= n


_READ_AHEAD = _ReadAhead()


@dataclass
class StoredTensor:
    """One tensor of a block file, not read yet: where its bytes lie in the data section. It
    refers to its file weakly: the block holds its tensors, and a reference back would make a
    cycle that keeps a block dropped unread (and its open file) until a full collection."""

    ref: "weakref.ReferenceType[StoredBlock]"
    kind: DType
    shape: tuple[int, ...]
    begin: int

    @property
    def file(self) -> "StoredBlock":
        """The block file (whoever reads the tensor holds it)."""
        block = self.ref()
        if block is None:
            raise RuntimeError("a stored tensor used after its block file was released")
        return block

    @property
    def dtype(self) -> Any:
        """The MLX dtype the tensor has once read."""
        import mlx.core as mx

        return getattr(mx, self.kind.name)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.kind.itemsize

    def read_rows(self, take: tuple[slice, ...], into: np.ndarray) -> None:
        """Have ``self[take]`` (a slice on its last indexed axis, whole axes before and after)
        land in ``into`` (a numpy view of that shape, C-contiguous from that axis on) when the
        block's file is read."""
        axis = len(take) - 1
        lo, hi = take[axis].start, take[axis].stop
        size = self.kind.itemsize * math.prod(self.shape[axis + 1:])
        for i, index in enumerate(np.ndindex(*self.shape[:axis])):
            piece = into[index]
            if not piece.flags.c_contiguous or piece.nbytes != (hi - lo) * size:
                raise ValueError("read_rows: destination rows must be contiguous")
            offset = self.begin + (i * self.shape[axis] + lo) * size
            self.file.wanted.append((offset, piece.nbytes, memoryview(piece).cast("B")))


@dataclass(slots=True, weakref_slot=True)  # slots: made for every SSD block a fetch takes
class StoredBlock:
    """A block whose header is checked and whose payload is still on disk; ``arrays`` hold
    ``StoredTensor``s. ``on_damage(reason)`` reports a payload that fails its checksum.

    The data section is read once, in file order: ``advance`` reads the places asked for so far
    (a rebuild that needs some rows now, one layer at a time), ``read`` the rest and verifies the
    checksum over every byte."""

    key: str
    meta: dict[str, str]
    fd: int
    data_start: int  # offset of the data section in the (decompressed) file
    data_bytes: int
    checksum: str
    on_damage: Callable[[str], None]
    compressed: bytes | None = None  # lz4: the whole file, read when the header was checked
    arrays: dict[str, Any] = field(default_factory=dict)
    wanted: list[tuple[int, int, memoryview]] = field(default_factory=list)
    damage: str | None = None  # why the payload cannot be used (reported by ``read``)
    rereads: int = 0  # places asked for behind what was read already, read a second time
    hinted: int = 0  # bytes of the read-ahead budget this file holds (hinted, not read yet)
    _pos: int = 0  # data bytes read and hashed so far
    _hinted_to: int = 0  # data bytes the kernel was asked to read ahead (``hint_to``)
    _digest: Any = None  # the payload's running checksum, from its first bytes read
    _lz4: "_Lz4Stream | None" = None

    @property
    def nbytes(self) -> int:
        return self.data_bytes

    @property
    def position(self) -> int:
        """Bytes of the data section read (and hashed) so far."""
        return self._pos

    @property
    def begun(self) -> bool:
        """True once part of the data section was read (``read`` must finish and verify it)."""
        return self._pos > 0 or self._lz4 is not None

    def close(self) -> None:
        """Release the file (and any destination views still asked for, and its read-ahead)."""
        if self.hinted:
            _READ_AHEAD.give(self.hinted)
            self.hinted = 0
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.wanted.clear()
        self.compressed = self._lz4 = None

    def __del__(self) -> None:  # a fetch that gave up before reading: no fd outlives the block
        self.close()

    def advance(self) -> None:
        """Read the places asked for so far, the bytes before them into scratch (hashed too), so
        the rows are there now; a place behind what was read already is read again directly."""
        wanted = sorted(self.wanted, key=lambda w: w[0])
        self.wanted.clear()
        if self.damage is not None or not wanted:
            return
        ahead = [w for w in wanted if w[0] >= self._pos]
        behind = [w for w in wanted if w[0] < self._pos]
        try:
            if ahead:
                self._consume(_tile(ahead, self._pos, ahead[-1][0] + ahead[-1][1]))
            for offset, _, view in behind:
                self.rereads += 1
                if self.damage is None:
                    self._read_again(offset, _flat(view))
        except OSError as exc:
            self.damage = f"read failed: {exc}"

    def hint_to(self, end: int) -> bool:
        """Ask the kernel to start reading the data section up to ``end`` (from what was read or
        hinted so far) into its page cache (``POSIX_FADV_WILLNEED``), when the bytes fit the
        process's read-ahead budget: the disk reads ahead with no thread of ours and no memory of
        the process. False when nothing more can be hinted (the end, the budget, no
        ``posix_fadvise``, an lz4 file: in memory already). Only a hint: an error is ignored."""
        start = max(self._pos, self._hinted_to)
        end = min(end, self.data_bytes)
        if (end <= start or self.compressed is not None or self.fd < 0
                or not hasattr(os, "posix_fadvise") or not _READ_AHEAD.take(end - start)):
            return False
        self.hinted += end - start
        self._hinted_to = end
        with contextlib.suppress(OSError):
            os.posix_fadvise(self.fd, self.data_start + start, end - start, os.POSIX_FADV_WILLNEED)
        return True

    def wanted_end(self) -> int:
        """The end of the furthest place asked for so far (0 when none)."""
        return max((offset + n for offset, n, _ in self.wanted), default=0)

    def read(self) -> bool:
        """Read the rest of the data section into the asked-for places (the rest into scratch)
        and verify its checksum; False, reported through ``on_damage``, when it does not match."""
        try:
            self.advance()
            if self.damage is None and self._pos < self.data_bytes:
                self._consume(_tile([], self._pos, self.data_bytes))
            if self.damage is None and self._lz4 is not None:
                self.damage = self._lz4.finish()
            digest = self._digest if self._digest is not None else xxhash.xxh3_128()  # none read
            if self.damage is None and digest.hexdigest() != self.checksum:
                self.damage = "payload checksum mismatch"
        except OSError as exc:
            self.damage = f"read failed: {exc}"
        finally:
            reason = self.damage
            self.close()
        if reason is not None:
            self.on_damage(reason)
        return reason is None

    def _consume(self, pieces: list[memoryview]) -> None:
        """Fill ``pieces`` with the next bytes of the data section and hash them."""
        if self.compressed is not None:
            if self._lz4 is None:
                self._lz4 = _Lz4Stream(self.compressed, self.data_start)
            self.damage = self._lz4.fill(pieces)
        else:
            self.damage = _read_plain(self.fd, self.data_start + self._pos, pieces)
        if self.damage is None:
            if self._digest is None:
                self._digest = xxhash.xxh3_128()
            for view in pieces:
                self._digest.update(view)
                self._pos += view.nbytes
        left = max(0, self._hinted_to - self._pos)  # hinted and not read yet
        _READ_AHEAD.give(self.hinted - left)
        self.hinted = left

    def _read_again(self, offset: int, view: memoryview) -> None:
        """Bytes already read and hashed, read again into ``view`` (the file is not changed by
        anyone else while it is open; lz4: decompressed again from the start)."""
        if self.compressed is None:
            self.damage = _read_plain(self.fd, self.data_start + offset, [view])
            return
        stream = _Lz4Stream(self.compressed, self.data_start)
        self.damage = stream.fill([memoryview(bytearray(offset))]) or stream.fill([view])


def _flat(view: memoryview) -> memoryview:
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _read_plain(fd: int, offset: int, pieces: list[memoryview]) -> str | None:
    """One preadv per IOV_MAX pieces from ``offset`` (continued after a short read)."""
    first = 0
    pieces = list(pieces)
    while first < len(pieces):
        n = os.preadv(fd, pieces[first:first + IOV_MAX], offset)
        if n == 0:
            return "file ends early"
        offset += n
        while first < len(pieces) and n >= pieces[first].nbytes:
            n -= pieces[first].nbytes
            first += 1
        if n:
            pieces[first] = pieces[first][n:]
    return None


class _Lz4Stream:
    """The data section of an lz4 block file, decompressed at most LZ4_CHUNK bytes out at a time
    (whatever the ratio) straight from the file's bytes, each output scattered into place while
    it is in cache (the header, checked when the block was opened, skipped)."""

    def __init__(self, compressed: Any, skip: int) -> None:
        self.ctx = lz4.frame.create_decompression_context()
        self.src, self.at, self.skip = memoryview(compressed), 0, skip
        self.out = memoryview(b"")
        self.eof = False  # the frame's end marker was decoded

    def _more(self) -> str | None:
        if self.eof or self.at >= self.src.nbytes:
            return "lz4 frame ends early"
        try:
            out, used, self.eof = lz4.frame.decompress_chunk(
                self.ctx, self.src[self.at:self.at + LZ4_CHUNK], max_length=LZ4_CHUNK)
        except RuntimeError as exc:
            return f"lz4: {exc}"
        if not used and not out and not self.eof:
            return "lz4 frame makes no progress"
        self.at += used
        out = memoryview(out)
        cut = min(self.skip, out.nbytes)
        self.out, self.skip = out[cut:], self.skip - cut
        return None

    def fill(self, pieces: list[memoryview]) -> str | None:
        """The next bytes into ``pieces``, in order."""
        for view in pieces:
            pos = 0
            while pos < view.nbytes:
                if not self.out.nbytes:
                    reason = self._more()
                    if reason is not None:
                        return reason
                    continue
                n = min(view.nbytes - pos, self.out.nbytes)
                view[pos:pos + n] = self.out[:n]
                self.out, pos = self.out[n:], pos + n
        return None

    def finish(self) -> str | None:
        """Why the frame is not exactly the data section (bytes after it, not complete), or None."""
        while not self.eof and self.at < self.src.nbytes and not self.out.nbytes:
            reason = self._more()
            if reason is not None:
                return reason
        if self.out.nbytes or self.skip:
            return "lz4 frame holds bytes after the data section"
        if not self.eof or self.at < self.src.nbytes:
            return "lz4 frame is not complete or has trailing bytes"
        return None


def _tile(wanted: list[tuple[int, int, memoryview]], start: int, end: int) -> list[memoryview]:
    """Views covering ``[start, end)`` of the data section in order: the asked-for destinations
    (sorted, none before ``start``), scratch for the gaps (every byte is read: the checksum
    covers them all)."""
    out: list[memoryview] = []
    pos = start
    for offset, n, view in wanted:
        if offset < pos:
            raise ValueError("overlapping reads asked of one block file")
        if offset > pos:
            out.append(memoryview(bytearray(offset - pos)))
        out.append(_flat(view))
        pos = offset + n
    if pos < end:
        out.append(memoryview(bytearray(end - pos)))
    return out


def advance_all(blocks: Sequence[Any]) -> None:
    """``advance`` every ``StoredBlock`` among ``blocks`` with places asked for (a rebuild calls it
    once per layer, in file order): the kernel is asked for every file's places first, then each
    is read, then each file's read-ahead is extended (``read_ahead``), so the disk reads the next
    layers while this one is copied and the next one's buffers are allocated."""
    asked = list({id(b): b for b in blocks if isinstance(b, StoredBlock) and b.wanted}.values())
    for block in asked:
        block.hint_to(block.wanted_end())
    for block in asked:
        block.advance()
    read_ahead(asked)


def read_ahead(blocks: Sequence[StoredBlock]) -> None:
    """Extend each file's read-ahead to FILE_AHEAD bytes past what was read, HINT_STEP at a time
    across the files in turn: the disk gets the files' next layers in the order a rebuild reads
    them (one layer of every file, then the next), not one whole file after another."""
    more = list(blocks)
    while more:
        more = [b for b in more if b.hint_to(min(b._pos + FILE_AHEAD, b._hinted_to + HINT_STEP))]


def read_ahead_whole(blocks: Sequence[Any]) -> None:
    """Ask the kernel for the rest of every ``StoredBlock`` among ``blocks``, file after file, as
    far as the read-ahead budget goes: a rebuild that reads each file whole once its buffers
    exist (the host path) has the disk read them meanwhile."""
    for block in blocks:
        if isinstance(block, StoredBlock):
            block.hint_to(block.data_bytes)


def read_stored(blocks: Sequence[Any], threads: int) -> bool:
    """Read the rest of every ``StoredBlock`` among ``blocks`` (others are skipped), ``threads``
    files at a time, each file's rest and the next file's asked of the kernel first; True when
    every file's checksum matched."""
    stored = []
    for block in blocks:
        if isinstance(block, StoredBlock):
            if block.wanted or block.begun:
                stored.append(block)
            else:
                block.close()  # nothing of it was used
    if not stored:
        return True

    sequential = threads <= 1 or len(stored) == 1

    def read(i: int) -> bool:  # the next file is another thread's when several are read at once
        for block in stored[i:i + 2 if sequential else i + 1]:
            block.hint_to(block.data_bytes)
        return stored[i].read()

    if sequential:
        results = [read(i) for i in range(len(stored))]
    else:
        with ThreadPoolExecutor(min(threads, len(stored)), thread_name_prefix="paged-cache-read") as pool:
            results = list(pool.map(read, range(len(stored))))
    return all(results)
