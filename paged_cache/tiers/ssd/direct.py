"""Block payloads read from disk straight into the buffers a rebuild fills (no array per block).

``SSDTier.open_stored`` checks a block file's header and returns a ``StoredBlock`` whose arrays are
``StoredTensor`` placeholders. A rebuild asks for token rows of them to land in its destination
buffer (``read_rows``); ``read_stored`` then reads every asked-for file once, in file order, with
one vectored read per file and several files at once, straight into those buffers (lz4 files are
decompressed piece by piece into them), and verifies each file's payload checksum over the same
bytes. A rebuild that needs a layer's rows before the next layer is built (the device path,
``row_path``) reads each file's places so far with ``advance_all``; the file goes on from there,
and the kernel is asked to start reading each file's next layer meanwhile (``hint_next_layer``).
A file whose checksum fails makes ``read_stored`` return False: the rebuilt buffers hold damaged
rows and must be dropped.
"""

from __future__ import annotations

import contextlib
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import lz4.frame
import numpy as np
import xxhash

from paged_cache.tiers import format as fmt

IOV_MAX = 1024  # Linux's bound on the buffers of one preadv
LZ4_CHUNK = 64 << 10  # compressed bytes decompressed at a time (output at most ~255x that)


@dataclass
class StoredTensor:
    """One tensor of a block file, not read yet: where its bytes lie in the data section."""

    file: "StoredBlock"
    kind: fmt.DType
    shape: tuple[int, ...]
    begin: int

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


@dataclass
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
    _pos: int = 0  # data bytes read and hashed so far
    _digest: Any = field(default_factory=xxhash.xxh3_128)
    _lz4: "_Lz4Stream | None" = None

    @property
    def nbytes(self) -> int:
        return self.data_bytes

    @property
    def begun(self) -> bool:
        """True once part of the data section was read (``read`` must finish and verify it)."""
        return self._pos > 0 or self._lz4 is not None

    def close(self) -> None:
        """Release the file (and any destination views still asked for)."""
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

    def next_layer_span(self) -> tuple[int, int] | None:
        """Data offsets ``[start, end)`` from what was read so far to the end of the next layer's
        tensors in the file (the first layer with a tensor that starts there or later), or None
        when no layer is left."""
        following = [(t.begin, t.begin + t.nbytes, layer[0]) for name, t in self.arrays.items()
                     if isinstance(t, StoredTensor) and t.begin >= self._pos
                     and (layer := fmt.layer_of(name)) is not None]
        if not following:
            return None
        nxt = min(following)[2]
        return self._pos, max(end for _, end, layer in following if layer == nxt)

    def hint_next_layer(self) -> None:
        """Ask the kernel to start reading ``next_layer_span`` into its page cache
        (``POSIX_FADV_WILLNEED``, where the platform has it): the disk reads it while the caller
        moves this layer to the device, with no thread of ours and no memory of the process.
        Only a hint: an error is ignored; an lz4 file is in memory already."""
        span = self.next_layer_span()
        if (span is None or self.compressed is not None or self.fd < 0
                or not hasattr(os, "posix_fadvise")):
            return
        with contextlib.suppress(OSError):
            os.posix_fadvise(self.fd, self.data_start + span[0], span[1] - span[0],
                             os.POSIX_FADV_WILLNEED)

    def read(self) -> bool:
        """Read the rest of the data section into the asked-for places (the rest into scratch)
        and verify its checksum; False, reported through ``on_damage``, when it does not match."""
        try:
            self.advance()
            if self.damage is None and self._pos < self.data_bytes:
                self._consume(_tile([], self._pos, self.data_bytes))
            if self.damage is None and self._lz4 is not None:
                self.damage = self._lz4.finish()
            if self.damage is None and self._digest.hexdigest() != self.checksum:
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
            for view in pieces:
                self._digest.update(view)
                self._pos += view.nbytes

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
    """The data section of an lz4 block file, decompressed LZ4_CHUNK compressed bytes at a time,
    each output scattered into place while it is in cache (the header, checked when the block
    was opened, skipped)."""

    def __init__(self, compressed: bytes, skip: int) -> None:
        self.dec = lz4.frame.LZ4FrameDecompressor()
        self.src, self.at, self.skip = memoryview(compressed), 0, skip
        self.out = memoryview(b"")

    def _more(self) -> str | None:
        if self.at >= self.src.nbytes:
            return "lz4 frame ends early"
        try:
            out = memoryview(self.dec.decompress(self.src[self.at:self.at + LZ4_CHUNK]))
        except RuntimeError as exc:
            return f"lz4: {exc}"
        self.at += LZ4_CHUNK
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
        while self.at < self.src.nbytes and not self.out.nbytes:
            reason = self._more()
            if reason is not None:
                return reason
        if self.out.nbytes or self.skip:
            return "lz4 frame holds bytes after the data section"
        if not self.dec.eof or self.dec.unused_data:
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
    """``advance`` every ``StoredBlock`` among ``blocks`` with places asked for, then hint each
    one's next layer to the kernel (``hint_next_layer``): the device path builds layers in file
    order, so the disk reads the next layer while this one is moved to the device."""
    advanced = []
    for block in blocks:
        if isinstance(block, StoredBlock) and block.wanted:
            block.advance()
            advanced.append(block)
    for block in advanced:
        block.hint_next_layer()


def read_stored(blocks: Sequence[Any], threads: int) -> bool:
    """Read every ``StoredBlock`` among ``blocks`` (others are skipped), ``threads`` files at a
    time; True when every file's checksum matched."""
    stored = []
    for block in blocks:
        if isinstance(block, StoredBlock):
            if block.wanted or block.begun:
                stored.append(block)
            else:
                block.close()  # nothing of it was used
    if not stored:
        return True
    if threads <= 1 or len(stored) == 1:
        results = [b.read() for b in stored]
    else:
        with ThreadPoolExecutor(min(threads, len(stored)), thread_name_prefix="paged-cache-read") as pool:
            results = list(pool.map(StoredBlock.read, stored))
    return all(results)
