"""Block payloads read from disk straight into the buffers a rebuild fills (no array per block).

``SSDTier.open_stored`` checks a block file's header and returns a ``StoredBlock`` whose arrays are
``StoredTensor`` placeholders. A rebuild asks for token rows of them to land in its destination
buffer (``read_rows``); ``read_stored`` then reads every asked-for file once, in file order, with
one vectored read per file and several files at once, straight into those buffers (lz4 files are
decompressed piece by piece into them), and verifies each file's payload checksum over the same
bytes. A file whose checksum fails makes ``read_stored`` return False: the rebuilt buffers hold
damaged rows and must be dropped.
"""

from __future__ import annotations

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
    ``StoredTensor``s. ``on_damage(reason)`` reports a payload that fails its checksum."""

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

    @property
    def nbytes(self) -> int:
        return self.data_bytes

    def close(self) -> None:
        """Release the file (and any destination views still asked for)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.wanted.clear()
        self.compressed = None

    def __del__(self) -> None:  # a fetch that gave up before reading: no fd outlives the block
        self.close()

    def read(self) -> bool:
        """Read the data section into the asked-for places (the rest into scratch) and verify
        its checksum; False, reported through ``on_damage``, when it does not match."""
        try:
            pieces = _tile(sorted(self.wanted, key=lambda w: w[0]), self.data_bytes)
            reason = self._read_lz4(pieces) if self.compressed is not None else self._read_plain(pieces)
            if reason is None:
                digest = xxhash.xxh3_128()
                for view in pieces:
                    digest.update(view)
                if digest.hexdigest() != self.checksum:
                    reason = "payload checksum mismatch"
        except OSError as exc:
            reason = f"read failed: {exc}"
        finally:
            self.close()
        if reason is not None:
            self.on_damage(reason)
        return reason is None

    def _read_plain(self, pieces: list[memoryview]) -> str | None:
        """One preadv per IOV_MAX pieces (continued after a short read)."""
        offset, first = self.data_start, 0
        pieces = list(pieces)
        while first < len(pieces):
            n = os.preadv(self.fd, pieces[first:first + IOV_MAX], offset)
            if n == 0:
                return "file ends early"
            offset += n
            while first < len(pieces) and n >= pieces[first].nbytes:
                n -= pieces[first].nbytes
                first += 1
            if n:
                pieces[first] = pieces[first][n:]
        return None

    def _read_lz4(self, pieces: list[memoryview]) -> str | None:
        """Decompress the file LZ4_CHUNK compressed bytes at a time, each output scattered into
        place while it is in cache (the header, checked when the block was opened, skipped)."""
        dec = lz4.frame.LZ4FrameDecompressor()
        src, skip = memoryview(self.compressed), self.data_start
        views = iter(pieces)
        view, pos = next(views, None), 0
        for start in range(0, src.nbytes, LZ4_CHUNK):
            try:
                out = memoryview(dec.decompress(src[start:start + LZ4_CHUNK]))
            except RuntimeError as exc:
                return f"lz4: {exc}"
            cut = min(skip, out.nbytes)
            out, skip = out[cut:], skip - cut
            while out.nbytes:
                if view is None:
                    return "lz4 frame holds bytes after the data section"
                n = min(view.nbytes - pos, out.nbytes)
                view[pos:pos + n] = out[:n]
                out, pos = out[n:], pos + n
                if pos == view.nbytes:
                    view, pos = next(views, None), 0
        self.compressed = None
        if view is not None or skip:
            return "lz4 frame ends early"
        if not dec.eof or dec.unused_data:
            return "lz4 frame is not complete or has trailing bytes"
        return None


def _tile(wanted: list[tuple[int, int, memoryview]], total: int) -> list[memoryview]:
    """Views covering ``[0, total)`` of the data section in order: the asked-for destinations,
    scratch for the gaps (every byte is read: the checksum covers them all)."""
    out: list[memoryview] = []
    pos = 0
    for offset, n, view in wanted:
        if offset < pos:
            raise ValueError("overlapping reads asked of one block file")
        if offset > pos:
            out.append(memoryview(bytearray(offset - pos)))
        out.append(view.cast("B") if view.format != "B" or view.ndim != 1 else view)
        pos = offset + n
    if pos < total:
        out.append(memoryview(bytearray(total - pos)))
    return out


def read_stored(blocks: Sequence[Any], threads: int) -> bool:
    """Read every ``StoredBlock`` among ``blocks`` (others are skipped), ``threads`` files at a
    time; True when every file's checksum matched."""
    stored = []
    for block in blocks:
        if isinstance(block, StoredBlock):
            if block.wanted:
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
