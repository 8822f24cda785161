"""MLX buffers whose memory nothing has written yet, for rows read straight into them from disk.

MLX has no uninitialised allocation (``mx.empty`` is ``mx.zeros``), and a zero fill of a fresh
buffer faults every page in from user space before the read writes it again: a second pass over
the whole restore. ``mx.load`` of a safetensors stream allocates the array and asks the stream to
read its bytes into it; this stream declares one tensor and leaves the bytes where they are. The
kernel then faults the pages in while the disk read copies into them, as a plain read into a
fresh buffer does. Whoever takes such a buffer writes every byte of it (rows or zeros) before it
is used.
"""

from __future__ import annotations

import io
import json
import math
import struct
from typing import Any

import mlx.core as mx

from paged_cache.tiers.dtypes import DTYPES, mx_dtype_name


class _Unwritten(io.RawIOBase):
    """A safetensors stream of one tensor ``x`` whose data reads leave the destination as it is."""

    name = "unfilled.safetensors"  # mx.load picks the format by the name's extension

    def __init__(self, shape: tuple[int, ...], dtype: Any) -> None:
        kind = DTYPES[mx_dtype_name(dtype)]
        nbytes = math.prod(shape) * kind.itemsize
        header = json.dumps({"x": {"dtype": kind.code, "shape": list(shape),
                                   "data_offsets": [0, nbytes]}}).encode()
        header += b" " * (-len(header) % 8)
        self.head = struct.pack("<Q", len(header)) + header
        self.size = len(self.head) + nbytes
        self.pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = base + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = min(view.nbytes, max(0, self.size - self.pos))
        if self.pos < len(self.head):  # the header: written; the tensor's bytes: left unwritten
            k = min(n, len(self.head) - self.pos)
            view[:k] = self.head[self.pos:self.pos + k]
        self.pos += n
        return n


def unfilled(shape: tuple[int, ...], dtype: Any) -> mx.array:
    """An evaluated MLX array of ``shape`` and ``dtype`` whose bytes nothing wrote (see module
    doc): the caller writes every one of them before the array is used."""
    return mx.load(_Unwritten(tuple(int(d) for d in shape), dtype))["x"]
