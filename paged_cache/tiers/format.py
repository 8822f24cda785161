"""Block file format: standard safetensors written from raw buffers, optional lz4 frame, xxh3 checksums.

Encoding runs on the writer thread and never calls MLX; ``raw_tensors`` (caller thread) turns a
Block's evaluated arrays into byte views first. Decoding validates every header field against the
file size before anything is allocated, then builds mx.arrays with one copy. See docs/file-format.md.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import lz4.frame
import numpy as np
import xxhash

from paged_cache.tiers.dtypes import DTYPES, DType, storable_dtype
from paged_cache.tiers.header_tensors import (SECTION_MEMO_CHARS, BlockFileError,
                                              check_data_limit, section_tensors, tensors_of)

FORMAT_NAME = "paged-cache-block"
FORMAT_VERSION = "2"
READ_VERSIONS = ("1", "2")  # version 1 files (their header checksum over a re-encoding) still read
COMPRESSIONS = ("none", "lz4")
SUFFIXES = {"none": ".safetensors", "lz4": ".safetensors.lz4"}
LZ4_MAGIC = b"\x04\x22\x4d\x18"
LZ4_FEED = 64 << 10  # compressed bytes given to the decompressor at a time (header reads)
LZ4_MAX_RATIO = 255  # an lz4 frame cannot expand more than this (bounds decompression)
MAX_HEADER_BYTES = 16 << 20  # well below safetensors' own 100 MB limit
HEADER_ALIGN = 8

# Metadata keys the storage layer writes; a Block's own meta must not use them.
META_FORMAT = "format"
META_VERSION = "format_version"
META_KEY = "key"
META_CHECKSUM = "checksum"            # xxh3-128 hex of the tensor bytes (the data section)
META_HEADER_CHECKSUM = "header_checksum"  # xxh3-64 hex of the header itself (see docs)
RESERVED_META = frozenset({META_FORMAT, META_VERSION, META_KEY, META_CHECKSUM, META_HEADER_CHECKSUM})
# A version 2 header starts with its checksum, so it sits at a fixed place: the checksum is of the
# header's bytes with those 16 characters as ASCII zeros, and a read checks it without encoding
# anything again (version 1's was of a canonical re-encoding: a few microseconds a block).
META_OPEN = b'{"__metadata__":'  # a version 2 header's metadata comes first: it starts so
HEADER_START = META_OPEN + b'{"' + META_HEADER_CHECKSUM.encode() + b'":"'
HEADER_CHECKSUM_HOLE = b"0" * 16

# Block meta keys the manifest copies into its columns when present (set by the prefix cache).
META_FINGERPRINT = "fingerprint"
META_PARENT = "parent"
META_TOKENS = "tokens"
META_LAYERS = "layers"
META_START = "start"            # first token position of the block
META_TOKEN_IDS = "token_ids"    # the block's own token ids (hashing.encode_token_ids)
META_CHECKPOINT = "checkpoint"  # "1": a checkpoint node (state at its end, no rows a block holds)
META_RESTORABLE = "restorable"  # "1": every layer that cannot be cut by token is restorable at its end
# A node row: the chain fields of one stored node, in this order, as every tier lists them (the
# manifest's columns of the same names; tokens = the node's token count), then, where the tier
# keeps it (block meta: RAM, the SSD queue, remote listings), the node's namespace. chain_index
# builds the typed node from a row.
NODE_FIELDS = ("key", "parent", "fingerprint", "start", "tokens", "token_ids", "checkpoint",
               "restorable")
NodeRow = tuple  # (str, str | None, str | None, int | None, int | None, str | None, int, int[, str])
# Block meta keys read from the file only (set by the prefix cache).
META_NAMESPACE = "namespace"    # the namespace hashed into the block's key (docs/file-format.md)
META_MODEL_NAME = "model_name"  # the model as given at serve time (for people; not in the key)
META_SHARD = "shard"            # a sharded model's rank and what it holds (for people; the
                                # shard itself is in the fingerprint, so in the key)
META_GRID = "prefill_grid"      # "<chunk>:<until>": the request that computed the node's rows
                                # prefilled [0, until) itself, in chunks ending on the absolute
                                # grid of <chunk> tokens (what a fetch's head must match)



def decoded_limit(file_size: int) -> int:
    """Most bytes a block file (or remote value) of ``file_size`` bytes may decode to: the bound
    every reader passes as ``max_bytes`` before anything is decompressed or allocated."""
    return LZ4_MAX_RATIO * file_size + (1 << 16)


def fan_name(key: str) -> str:
    """The ``blocks/`` subdirectory holding the files of ``key``."""
    return key[:2]


def block_path(key: str, compression: str) -> str:
    """The path of the block file of ``key`` with ``compression``, relative to ``blocks/``."""
    return f"{fan_name(key)}/{key}{SUFFIXES[compression]}"


def node_row(key: str, meta: dict[str, str]) -> NodeRow:
    """The node row (``NODE_FIELDS``, then the namespace: "" when the meta names none) of a
    block's meta: counts where the meta has digits and None where a field is missing or
    malformed (the row is then no node: chain_index says)."""
    start, tokens = meta.get(META_START, ""), meta.get(META_TOKENS, "")
    return (key, meta.get(META_PARENT), meta.get(META_FINGERPRINT),
            int(start) if start.isdigit() else None, int(tokens) if tokens.isdigit() else None,
            meta.get(META_TOKEN_IDS), int(meta.get(META_CHECKPOINT) == "1"),
            int(meta.get(META_RESTORABLE, "1") == "1"), meta.get(META_NAMESPACE, ""))


def array_name(layer: int, name: str) -> str:
    """The block array name of layer ``layer``'s array ``name``: ``l<layer>.<name>``."""
    return f"l{layer}.{name}"


def file_order(layers: int) -> list[int]:
    """Layer indices in the order their arrays lie in a block file (``encode`` sorts names:
    ``l0.``, ``l1.``, ``l10.``, ..., ``l2.``)."""
    return sorted(range(layers), key=lambda i: array_name(i, ""))


def layer_of(array: str) -> tuple[int, str] | None:
    """``(layer, name)`` of a block array name (``array_name``'s inverse), or None if not one."""
    head, sep, name = array.partition(".")
    index = head[1:]
    if not sep or head[:1] != "l" or not index.isdigit():
        return None
    return int(index), name

RawTensor = tuple[str, tuple[int, ...], memoryview]
RawTensors = dict[str, RawTensor]
"""name -> (dtype name, shape, C-contiguous byte view of the evaluated array)."""


def raw_tensors(block: Any) -> RawTensors:
    """Byte views of a Block's arrays, taken on the caller thread so the writer never calls MLX.

    Each view keeps its (evaluated, C-contiguous) array alive through ``memoryview.obj``.
    """
    out: RawTensors = {}
    for name, array in block.arrays.items():
        dname = storable_dtype(name, array)
        view = memoryview(array)
        if not view.c_contiguous:
            import mlx.core as mx

            array = mx.contiguous(array)
            mx.eval(array)
            view = memoryview(array)
        out[name] = (dname, tuple(map(int, array.shape)), view)
    return out


def layers_summary(meta: dict[str, str]) -> str | None:
    """Compact cache-type summary for the manifest: JSON {type: layer count} from meta["layers"].

    ``meta["layers"]`` is a JSON list with one descriptor per layer; a descriptor is a dict with a
    "type" (or a list of such dicts for layers holding several caches). None if absent or malformed.
    """
    try:
        layers = json.loads(meta[META_LAYERS])
    except (KeyError, ValueError):
        return None
    if not isinstance(layers, list):
        return None
    counts: dict[str, int] = {}
    for layer in layers:
        members = layer if isinstance(layer, list) else [layer]
        kind = "+".join(str(m.get("type")) for m in members if isinstance(m, dict))
        counts[kind or "?"] = counts.get(kind or "?", 0) + 1
    return json.dumps(counts, sort_keys=True, separators=(",", ":"))


def check_meta(meta: dict[str, str]) -> None:
    """Reject metadata that is not str -> str or that uses a key the storage layer reserves."""
    for k, v in meta.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise ValueError(f"meta: expected str -> str, got {k!r}: {type(v).__name__}")
    check_reserved(meta)


def check_reserved(meta: dict[str, str]) -> None:
    """Reject metadata that uses a key the storage layer reserves (its types checked already)."""
    if not RESERVED_META.isdisjoint(meta):
        k = min(RESERVED_META.intersection(meta))
        raise ValueError(f"meta: key {k!r} is reserved by the block file format "
                         f"(reserved: {sorted(RESERVED_META)})")


def check_raw(raw: RawTensors) -> int:
    """Validate raw tensors (known dtype, byte count matching the shape); return their total bytes."""
    total = 0
    for name, entry in raw.items():
        if not isinstance(name, str) or not isinstance(entry, tuple) or len(entry) != 3:
            raise ValueError(f"raw[{name!r}]: expected (dtype name, shape, buffer) from raw_tensors")
        dname, shape, buf = entry
        if dname not in DTYPES:
            raise ValueError(f"raw[{name!r}]: dtype {dname!r} unknown; expected one of {sorted(DTYPES)}")
        expected = math.prod(shape) * DTYPES[dname].itemsize
        nbytes = memoryview(buf).nbytes
        if nbytes != expected:
            raise ValueError(f"raw[{name!r}]: {nbytes} bytes, expected {expected} for {dname} {list(shape)}")
        total += nbytes
    return total


def byte_view(buf: Any) -> memoryview:
    """A flat unsigned-byte view of any C-contiguous buffer (empty buffers included)."""
    view = memoryview(buf)
    if view.nbytes == 0:
        return memoryview(b"")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _canonical(tensors: dict[str, Any], meta: dict[str, str]) -> bytes:
    """Bytes a version 1 header checksum covers: tensor entries and metadata minus the checksum
    field, re-encoded."""
    covered = {k: v for k, v in meta.items() if k != META_HEADER_CHECKSUM}
    return json.dumps({"tensors": tensors, "meta": covered}, sort_keys=True,
                      separators=(",", ":")).encode()


@dataclass
class Encoded:
    """An encoded block file: the byte chunks to write in order, their total, and the raw payload size."""

    chunks: list[Any]
    file_bytes: int
    raw_bytes: int
    compression: str


def encode(key: str, raw: RawTensors, meta: dict[str, str], compression: str = "none") -> Encoded:
    """Build the block file from raw buffers (no MLX): safetensors header + data, lz4 if asked."""
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression: expected one of {COMPRESSIONS}, got {compression!r}")
    check_meta(meta)
    check_raw(raw)
    entries: dict[str, Any] = {}
    buffers: list[memoryview] = []
    offset = 0
    digest = xxhash.xxh3_128()
    for name in sorted(raw):
        dname, shape, buf = raw[name]
        dtype = DTYPES[dname]
        view = byte_view(buf)
        entries[name] = {"dtype": dtype.code, "shape": list(shape),
                         "data_offsets": [offset, offset + view.nbytes]}
        offset += view.nbytes
        digest.update(view)
        buffers.append(view)
    full_meta = {META_HEADER_CHECKSUM: HEADER_CHECKSUM_HOLE.decode(), **meta}
    full_meta.update({META_FORMAT: FORMAT_NAME, META_VERSION: FORMAT_VERSION, META_KEY: key,
                      META_CHECKSUM: digest.hexdigest()})
    header = sealed(json.dumps({"__metadata__": full_meta, **entries},
                               separators=(",", ":")).encode())
    chunks: list[Any] = [struct.pack("<Q", len(header)) + header, *buffers]
    total = 8 + len(header) + offset
    if compression == "lz4":
        comp = lz4.frame.LZ4FrameCompressor(content_checksum=False)
        parts = [comp.begin(source_size=total)] + [comp.compress(c) for c in chunks] + [comp.flush()]
        chunks = [b"".join(parts)]
    return Encoded(chunks, sum(memoryview(c).nbytes for c in chunks), offset, compression)


def sealed(header: bytes) -> bytes:
    """A version 2 header from its JSON (``HEADER_START`` then its checksum's 16 zeros): padded
    to ``HEADER_ALIGN`` with spaces, its checksum in place."""
    if not header.startswith(HEADER_START + HEADER_CHECKSUM_HOLE):
        raise ValueError("header: expected its checksum first, as 16 zeros")
    header += b" " * (-len(header) % HEADER_ALIGN)
    at = len(HEADER_START)
    return header[:at] + _raw_checksum(header) + header[at + 16:]


def _raw_checksum(header: bytes) -> bytes | None:
    """The checksum of a version 2 ``header``, the one rule ``sealed`` writes and a read checks,
    or None when it does not start as one does."""
    at = len(HEADER_START)
    if header[:at] != HEADER_START:
        return None
    return xxhash.xxh3_64_hexdigest(header[:at] + HEADER_CHECKSUM_HOLE + header[at + 16:]).encode()


@dataclass
class Header:
    """A validated safetensors header: tensors in data order, the metadata, and its bytes."""

    header_len: int
    tensors: list[tuple[str, DType, tuple[int, ...], int, int]]  # name, dtype, shape, begin, end
    meta: dict[str, str]
    entries: dict[str, Any]  # the tensor entries as parsed (shared by headers of the same
    # tensors, ``section_tensors``: read only; version 1's checksum encodes them again)
    raw: bytes

    @property
    def data_bytes(self) -> int:
        return self.tensors[-1][4] if self.tensors else 0

    @property
    def file_bytes(self) -> int:
        return 8 + self.header_len + self.data_bytes


_DECODER = json.JSONDecoder()


class Expected(Protocol):
    """What a reader knows about a block before reading its data (a prefix cache: from the
    model's layout): bounds on its header and data section, and a check of a parsed header that
    raises BlockFileError when its tensors or meta cannot be such a block. Applied before
    anything is allocated or decompressed for the data."""

    header_bytes: int
    data_bytes: int

    def check(self, header: "Header") -> None: ...


def stored_limit(expect: Expected) -> int:
    """Most bytes a stored block file (plain, or in an lz4 frame, which may be slightly larger
    than its content) of a block ``expect`` allows can take."""
    raw = 8 + expect.header_bytes + expect.data_bytes
    return raw + raw // LZ4_MAX_RATIO + 1024


def expected_limit(max_bytes: int, expect: Expected | None) -> int:
    """The most bytes a (decompressed) block file may hold: ``max_bytes``, and at most what
    ``expect`` allows when given."""
    return max_bytes if expect is None else min(max_bytes, 8 + expect.header_bytes + expect.data_bytes)


def header_length(prefix: bytes, limit: int, header_bytes: int = MAX_HEADER_BYTES) -> int:
    """The header length from the first 8 bytes, checked against MAX_HEADER_BYTES,
    ``header_bytes`` (what the reader expects at most) and ``limit`` (the file's bytes)."""
    if len(prefix) < 8:
        raise BlockFileError(f"file too short: {len(prefix)} bytes")
    n = struct.unpack("<Q", prefix[:8])[0]
    most = min(MAX_HEADER_BYTES, header_bytes)
    if n < 2 or n > most or n > limit - 8:
        raise BlockFileError(f"header length {n} out of range (file holds {limit} bytes, "
                             f"headers at most {most})")
    return n


def parse_header(header: bytes, *, data_limit: int) -> Header:
    """Validate a header's JSON, dtypes, shapes and offsets; the data section may hold at most
    ``data_limit``. A version 2 header's metadata is parsed on its own and its tensor entries
    checked once for all headers with the same ones (``section_tensors``)."""
    raw = bytes(header)
    try:
        text = raw.decode("utf-8")
        meta, section = _meta_first(text) if raw.startswith(HEADER_START) else (None, "")
        checked = section_tensors(section) if section and _is_meta(meta) else None
        if checked is None:
            doc = json.loads(text)
            if not isinstance(doc, dict):
                raise BlockFileError("header is not a JSON object")
            meta = doc.pop("__metadata__", {})
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise BlockFileError(f"header is not JSON: {exc}") from None
    if checked is None:
        if not _is_meta(meta):
            raise BlockFileError("__metadata__ is not str -> str")
        return Header(len(raw), tensors_of(doc, data_limit), meta, doc, raw)
    h = Header(len(raw), list(checked[1]), meta, checked[0], raw)
    check_data_limit(h.data_bytes, data_limit)
    return h


def _is_meta(meta: Any) -> bool:
    """True for a header's metadata as the format writes it: str -> str (JSON keys are str)."""
    return isinstance(meta, dict) and set(map(type, meta.values())) <= {str}


def _meta_first(text: str) -> tuple[Any, str]:
    """A version 2 header's ``__metadata__`` value (the first thing it holds) and the text after
    it, its tensor entries; the text is "" when it is not a comma or the object's end, or longer
    than SECTION_MEMO_CHARS (the header is parsed whole then)."""
    meta, end = _DECODER.raw_decode(text, len(META_OPEN))
    section = text[end:]
    return meta, section if section[:1] in (",", "}") and len(section) <= SECTION_MEMO_CHARS else ""


def verify_header(h: Header, key: str | None) -> None:
    """Check format name, version, header checksum and (if given) that the file holds ``key``."""
    meta = h.meta
    if meta.get(META_FORMAT) != FORMAT_NAME:
        raise BlockFileError(f"not a {FORMAT_NAME} file")
    version = meta.get(META_VERSION)
    if version not in READ_VERSIONS:
        raise BlockFileError(f"unsupported format version {version!r}")
    if version == "1":
        expected = xxhash.xxh3_64_hexdigest(_canonical(h.entries, meta))
    else:  # its own bytes, the checksum where it stands (what was parsed must be that too)
        got = _raw_checksum(h.raw)
        at = len(HEADER_START)
        expected = got.decode() if got is not None and h.raw[at:at + 16] == got else None
    if expected is None or expected != meta.get(META_HEADER_CHECKSUM):
        raise BlockFileError("header checksum mismatch")
    if key is not None and meta.get(META_KEY) != key:
        raise BlockFileError(f"file holds block {meta.get(META_KEY)!r:.20}, expected {key:.20}...")


def _lz4_reader(data: memoryview) -> Callable[[int], bytearray]:
    """Return read(n): exactly the next n decompressed bytes; never decompresses more than asked,
    fed LZ4_FEED input bytes at a time (the decompressor copies what it is given: one file's
    header read copied the whole file). ``read.rest()`` is the input not fed yet."""
    dec = lz4.frame.LZ4FrameDecompressor()
    at = 0

    def read(n: int) -> bytearray:
        nonlocal at
        out = bytearray()
        while len(out) < n:
            src = data[at:at + LZ4_FEED] if dec.needs_input else b""
            at += len(src)
            try:
                piece = dec.decompress(src, max_length=n - len(out))
            except RuntimeError as exc:
                raise BlockFileError(f"lz4: {exc}") from None
            if not piece and not src:
                raise BlockFileError("lz4 frame ends early")
            out += piece
        return out

    read.decompressor = dec  # type: ignore[attr-defined]
    read.rest = lambda: data[at:]  # type: ignore[attr-defined]
    return read


def split_file(data: Any, *, max_bytes: int, admit: Callable[[Header], None] | None = None,
               header_bytes: int = MAX_HEADER_BYTES) -> tuple[Header, memoryview]:
    """Validate a whole block file (plain or lz4) and return its header and data section.

    ``max_bytes`` bounds the decompressed size of an lz4 file before it is decompressed and
    ``header_bytes`` its header; ``admit(header)`` (raising BlockFileError) runs before any data
    is decompressed.
    """
    view = byte_view(data)
    if view[:4] == LZ4_MAGIC:
        read = _lz4_reader(view)
        n = header_length(read(8), max_bytes, header_bytes)
        h = parse_header(read(n), data_limit=max_bytes - 8 - n)
        if admit is not None:
            admit(h)
        body = memoryview(read(h.data_bytes)) if h.data_bytes else memoryview(b"")
        dec = read.decompressor  # type: ignore[attr-defined]
        if not dec.eof and dec.decompress(read.rest(), max_length=1):  # type: ignore[attr-defined]
            raise BlockFileError("lz4 frame holds bytes after the data section")
        if not dec.eof or dec.unused_data:
            raise BlockFileError("lz4 frame is not complete or has trailing bytes")
        return h, body
    limit = min(view.nbytes, max_bytes)
    n = header_length(bytes(view[:8]), limit, header_bytes)
    h = parse_header(view[8:8 + n], data_limit=limit - 8 - n)
    if h.file_bytes != view.nbytes:
        raise BlockFileError(f"file has {view.nbytes} bytes, header describes {h.file_bytes}")
    if admit is not None:
        admit(h)
    return h, view[8 + n:]


HEAD_READ_BYTES = 1 << 16  # a header is read with the file's first bytes, in one read


def read_header_only(read_at: Callable[[int, int], bytes], file_size: int,
                     max_bytes: int, expect: Expected | None = None,
                     key: str | None = None) -> Header:
    """Parse just the header of a block file via ``read_at(offset, n)`` (to adopt files, or to
    read a payload in place later), verified (``verify_header``: that it holds ``key`` too,
    when given), and checked against ``expect`` when given."""
    limit = expected_limit(max_bytes, expect)
    most = MAX_HEADER_BYTES if expect is None else expect.header_bytes
    head = read_at(0, min(file_size, HEAD_READ_BYTES))
    if bytes(head[:4]) == LZ4_MAGIC:  # the whole file, once (a view when the caller holds it)
        whole = head if len(head) == file_size else read_at(0, file_size)
        read = _lz4_reader(memoryview(whole))
        n = header_length(read(8), limit, most)
        h = parse_header(read(n), data_limit=limit - 8 - n)
    else:
        n = header_length(head[:8], min(file_size, limit), most)
        raw = head[8:8 + n] if len(head) >= 8 + n else read_at(8, n)
        h = parse_header(raw, data_limit=file_size - 8 - n)
        if h.file_bytes != file_size:
            raise BlockFileError(f"file has {file_size} bytes, header describes {h.file_bytes}")
    verify_header(h, key)
    if expect is not None:
        expect.check(h)
    return h


def decode(data: Any, key: str, *, max_bytes: int,
           expect: Expected | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """Verify a block file (header, key, ``expect``, payload checksum) and build its mx.arrays
    (one copy). Nothing is decompressed or allocated for the data before the header passed.

    Returns (arrays, meta) with the storage layer's reserved keys removed from meta.
    Raises BlockFileError on any damage; runs on the caller thread (it calls MLX).
    """
    import mlx.core as mx

    def admit(h: Header) -> None:
        verify_header(h, key)
        if expect is not None:
            expect.check(h)

    h, body = split_file(data, max_bytes=expected_limit(max_bytes, expect), admit=admit,
                         header_bytes=MAX_HEADER_BYTES if expect is None else expect.header_bytes)
    if xxhash.xxh3_128_hexdigest(body) != h.meta.get(META_CHECKSUM):
        raise BlockFileError("payload checksum mismatch")
    arrays: dict[str, Any] = {}
    for name, dtype, shape, begin, end in h.tensors:
        host = np.frombuffer(body, dtype=np.dtype(dtype.storage), count=(end - begin) // dtype.itemsize,
                             offset=begin).reshape(shape)
        array = mx.array(host)
        arrays[name] = array.view(mx.bfloat16) if dtype.name == "bfloat16" else array
    mx.eval(*arrays.values())
    meta = {k: v for k, v in h.meta.items() if k not in RESERVED_META}
    return arrays, meta


def pending_arrays(raw: RawTensors) -> dict[str, Any]:
    """The mx.arrays behind raw views (zero copy); rebuilt from bytes if a view is not an mx.array."""
    import mlx.core as mx

    arrays: dict[str, Any] = {}
    rebuilt = []
    for name, (dname, shape, buf) in raw.items():
        owner = memoryview(buf).obj
        if isinstance(owner, mx.array) and tuple(owner.shape) == tuple(shape):
            arrays[name] = owner  # evaluated when its view was taken
            continue
        dtype = DTYPES[dname]
        array = mx.array(np.frombuffer(buf, dtype=np.dtype(dtype.storage)).reshape(shape))
        arrays[name] = array.view(mx.bfloat16) if dname == "bfloat16" else array
        rebuilt.append(arrays[name])
    if rebuilt:  # an eval lets other threads run (it releases the GIL): only when one is due
        mx.eval(*rebuilt)
    return arrays
