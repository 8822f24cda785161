"""Block file format: exact round trips, standard safetensors readers, validation before allocation."""

from __future__ import annotations

import json
import random
import struct
import tracemalloc

import lz4.frame
import mlx.core as mx
import numpy as np
import pytest
from safetensors import safe_open

from paged_cache.block import Block
from paged_cache.tiers import format as fmt
from paged_cache.tiers import header_tensors as ht
from paged_cache.tiers.dtypes import DTYPES

pytestmark = pytest.mark.unit

KEY = "3f" * 32


def _arrays() -> dict[str, mx.array]:
    mx.random.seed(7)
    base = mx.random.normal((2, 4, 8, 16))
    return {
        "fp32": base,
        "fp16": base.astype(mx.float16),
        "bf16": (base * 1000).astype(mx.bfloat16),
        "u32": mx.random.randint(0, 2**31, (3, 5)).astype(mx.uint32),
        "i8": mx.arange(-8, 8, dtype=mx.int8),
        "mask": mx.array([True, False, True]),
        "empty": mx.zeros((0, 4), dtype=mx.float32),
        "transposed": mx.arange(12, dtype=mx.float32).reshape(3, 4).T,
    }


def _file(arrays: dict[str, mx.array], compression: str, meta: dict[str, str] | None = None) -> bytes:
    block = Block(KEY, arrays, meta if meta is not None else {"tokens": "16", "fingerprint": "m1"})
    encoded = fmt.encode(KEY, fmt.raw_tensors(block), block.meta, compression)
    data = b"".join(bytes(memoryview(c).cast("B")) for c in encoded.chunks)
    assert len(data) == encoded.file_bytes
    return data


def _assert_same(got: dict[str, mx.array], want: dict[str, mx.array]) -> None:
    assert set(got) == set(want)
    for name, a in want.items():
        b = got[name]
        assert b.dtype == a.dtype and b.shape == a.shape, name
        # compare bit patterns, so bf16 / NaN payloads must match exactly
        assert bytes(memoryview(mx.contiguous(a))) == bytes(memoryview(b)), name


@pytest.mark.parametrize("compression", ["none", "lz4"])
def test_round_trip_exact(compression: str) -> None:
    arrays = _arrays()
    arrays["bf16_nan"] = mx.array([float("nan"), float("inf"), -0.0, 1e-40], dtype=mx.bfloat16)
    data = _file(arrays, compression, {"tokens": "16", "note": "é ünïcode"})
    got, meta = fmt.decode(data, KEY, max_bytes=1 << 30)
    _assert_same(got, arrays)
    assert meta == {"tokens": "16", "note": "é ünïcode"}
    assert (data[:4] == fmt.LZ4_MAGIC) == (compression == "lz4")


@pytest.mark.parametrize("compression", ["none", "lz4"])
def test_standard_readers(tmp_path, compression: str) -> None:
    arrays = _arrays()
    data = _file(arrays, compression)
    plain = lz4.frame.decompress(data) if compression == "lz4" else data
    path = tmp_path / "block.safetensors"
    path.write_bytes(plain)
    loaded, meta = mx.load(str(path), return_metadata=True)
    _assert_same(loaded, arrays)
    assert meta[fmt.META_KEY] == KEY and meta[fmt.META_VERSION] == fmt.FORMAT_VERSION
    with safe_open(str(path), framework="numpy") as f:
        assert f.metadata()["fingerprint"] == "m1"
        assert set(f.keys()) == set(arrays)
        for name, a in arrays.items():
            if a.dtype == mx.bfloat16:  # numpy has no bfloat16: check layout, then the bits
                assert f.get_slice(name).get_dtype() == "BF16"
                assert f.get_slice(name).get_shape() == list(a.shape)
                continue
            np.testing.assert_array_equal(f.get_tensor(name), np.array(a))


def test_checksums_in_metadata() -> None:
    data = _file({"x": mx.ones((4, 4))}, "none")
    n = struct.unpack("<Q", data[:8])[0]
    assert n % 8 == 0
    meta = json.loads(data[8:8 + n])["__metadata__"]
    assert len(meta[fmt.META_CHECKSUM]) == 32  # xxh3-128 hex
    import xxhash
    assert meta[fmt.META_CHECKSUM] == xxhash.xxh3_128_hexdigest(data[8 + n:])


def _version_1(arrays: dict[str, mx.array], meta: dict[str, str]) -> bytes:
    """A block file as format version 1 wrote it (docs/file-format.md): the header checksum of a
    canonical re-encoding, stored after the rest of the metadata."""
    import xxhash

    raw = fmt.raw_tensors(Block(KEY, arrays, meta))
    entries, body, offset = {}, b"", 0
    for name in sorted(raw):
        dname, shape, buf = raw[name]
        data = bytes(memoryview(buf).cast("B"))
        entries[name] = {"dtype": DTYPES[dname].code, "shape": list(shape),
                         "data_offsets": [offset, offset + len(data)]}
        offset, body = offset + len(data), body + data
    full = {**meta, "format": fmt.FORMAT_NAME, "format_version": "1", "key": KEY,
            "checksum": xxhash.xxh3_128_hexdigest(body)}
    full["header_checksum"] = xxhash.xxh3_64_hexdigest(json.dumps(
        {"tensors": entries, "meta": full}, sort_keys=True, separators=(",", ":")).encode())
    header = json.dumps({"__metadata__": full, **entries}, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + body


def test_a_version_1_file_is_still_read_and_its_damage_found() -> None:
    arrays = {"x": mx.arange(12, dtype=mx.float16).reshape(3, 4), "y": mx.ones((5,))}
    data = _version_1(arrays, {"tokens": "16", "fingerprint": "m1"})
    got, meta = fmt.decode(data, KEY, max_bytes=1 << 30)
    _assert_same(got, arrays)
    assert meta == {"tokens": "16", "fingerprint": "m1"}
    n = struct.unpack("<Q", data[:8])[0]
    head = fmt.read_header_only(lambda at, k: data[at:at + k], len(data), 1 << 30, key=KEY)
    assert head.meta[fmt.META_VERSION] == "1" and head.header_len == n
    at = data.index(b'"m1"') + 1
    flipped = data[:at] + b"n" + data[at + 1:]   # the same length, another fingerprint
    with pytest.raises(fmt.BlockFileError, match="header checksum"):
        fmt.decode(flipped, KEY, max_bytes=1 << 30)


def test_a_header_s_checksum_is_of_its_own_bytes_at_a_fixed_place() -> None:
    """Format version 2: the header starts with its checksum, which is of the header's bytes with
    those 16 characters as zeros; one changed there, elsewhere, or a second checksum key after
    it (a JSON reader keeps the last) is damage."""
    import xxhash

    data = _file({"x": mx.ones((4, 4))}, "none")
    n = struct.unpack("<Q", data[:8])[0]
    header = data[8:8 + n]
    at = len(fmt.HEADER_START)
    assert header.startswith(fmt.HEADER_START)
    hole = header[:at] + b"0" * 16 + header[at + 16:]
    assert header[at:at + 16] == xxhash.xxh3_64_hexdigest(hole).encode()
    assert json.loads(header)["__metadata__"][fmt.META_VERSION] == fmt.FORMAT_VERSION == "2"
    wrong = header[:at] + (b"1" if header[at:at + 1] == b"0" else b"0") + header[at + 1:]
    twice = fmt.sealed(hole.rstrip().replace(   # sealed right, but the parsed value is the second
        b'"format":', b'"header_checksum":"' + b"1" * 16 + b'","format":', 1))
    for bad in (wrong, twice):
        with pytest.raises(fmt.BlockFileError, match="header checksum"):
            fmt.decode(struct.pack("<Q", len(bad)) + bad + data[8 + n:], KEY, max_bytes=1 << 30)


def _damaged_variants(data: bytes) -> dict[str, bytes]:
    n = struct.unpack("<Q", data[:8])[0]
    header = data[8:8 + n]
    flipped_payload = bytearray(data)
    flipped_payload[-3] ^= 0x01
    flipped_meta = bytearray(data)
    at = 8 + header.index(b'"m1"') + 1
    flipped_meta[at] ^= 0x02
    return {
        "zero_length": b"",
        "short": data[:5],
        "truncated": data[:-7],
        "extended": data + b"\0" * 8,
        "flipped_payload": bytes(flipped_payload),
        "flipped_metadata": bytes(flipped_meta),
        "garbage_header": data[:8] + b"\xff" * n + data[8 + n:],
        "huge_header_len": struct.pack("<Q", 2**60) + data[8:],
        "not_json_object": struct.pack("<Q", 8) + b"[1,2,3] " + data[8 + n:],
    }


@pytest.mark.parametrize("case", list(_damaged_variants(_file({"x": mx.ones((4, 4))}, "none"))))
def test_damage_is_detected(case: str) -> None:
    data = _damaged_variants(_file({"x": mx.ones((4, 4)), "y": mx.zeros((3,))}, "none"))[case]
    with pytest.raises(fmt.BlockFileError):
        fmt.decode(data, KEY, max_bytes=1 << 30)


def test_wrong_key_and_lz4_damage() -> None:
    data = _file({"x": mx.ones((64,))}, "lz4")
    with pytest.raises(fmt.BlockFileError, match="expected"):
        fmt.decode(data, "ab" * 32, max_bytes=1 << 30)
    for bad in (data[:-5], data[:4] + b"\0" * (len(data) - 4), data + b"junk"):
        with pytest.raises(fmt.BlockFileError):
            fmt.decode(bad, KEY, max_bytes=1 << 30)


def test_huge_tensor_claim_is_rejected_before_allocation() -> None:
    claim = 1 << 40  # a 4 TiB tensor in a 200-byte file
    header = json.dumps({"__metadata__": {}, "x": {"dtype": "F32", "shape": [claim],
                                                    "data_offsets": [0, 4 * claim]}}).encode()
    header += b" " * (-len(header) % 8)
    for data in (struct.pack("<Q", len(header)) + header + b"\0" * 16,
                 lz4.frame.compress(struct.pack("<Q", len(header)) + header + b"\0" * 16)):
        tracemalloc.start()
        with pytest.raises(fmt.BlockFileError, match="data bytes"):
            fmt.decode(data, KEY, max_bytes=1 << 30)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < 1 << 20


def test_fuzzed_files_never_raise_anything_else() -> None:
    data = _file({"k": mx.arange(32, dtype=mx.float16), "v": mx.ones((2, 8), dtype=mx.bfloat16)}, "none")
    want, _ = fmt.decode(data, KEY, max_bytes=1 << 30)
    rng = random.Random(1234)
    for _ in range(300):
        buf = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            op = rng.random()
            pos = rng.randrange(len(buf))
            if op < 0.7:
                buf[pos] ^= 1 << rng.randrange(8)
            elif op < 0.85:
                del buf[pos:]
            else:
                buf[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 9)))
        try:
            got, _ = fmt.decode(bytes(buf), KEY, max_bytes=1 << 30)
        except fmt.BlockFileError:
            continue
        _assert_same(got, want)  # a mutation that still decodes must be harmless (header padding)


def test_bad_input_raises_clear_errors() -> None:
    block = Block(KEY, {"x": mx.ones((2,))}, {})
    raw = fmt.raw_tensors(block)
    with pytest.raises(ValueError, match="reserved"):
        fmt.encode(KEY, raw, {fmt.META_CHECKSUM: "0"})
    with pytest.raises(ValueError, match="compression"):
        fmt.encode(KEY, raw, {}, "zstd")
    with pytest.raises(ValueError, match="not storable"):
        fmt.raw_tensors(Block(KEY, {"c": mx.array([1 + 2j])}, {}))
    with pytest.raises(ValueError, match="bytes, expected"):
        fmt.encode(KEY, {"x": ("float32", (3,), memoryview(b"\0" * 8))}, {})


def test_layers_summary() -> None:
    layers = [{"type": "KVCache"}, {"type": "KVCache"}, [{"type": "ArraysCache"}, {"type": "RotatingKVCache"}]]
    assert json.loads(fmt.layers_summary({"layers": json.dumps(layers)})) == {
        "KVCache": 2, "ArraysCache+RotatingKVCache": 1}
    assert fmt.layers_summary({}) is None and fmt.layers_summary({"layers": "{"}) is None


@pytest.mark.parametrize("compression", ["none", "lz4"])
def test_a_deeply_nested_header_is_damage_not_a_recursion_error(compression: str) -> None:
    """JSON nested beyond the interpreter's recursion limit (200,000 brackets, 200 KB): a
    BlockFileError like any unreadable header (it raised RecursionError, which no reader
    catches)."""
    header = b"[" * 200_000
    data = struct.pack("<Q", len(header)) + header
    data = lz4.frame.compress(data) if compression == "lz4" else data
    with pytest.raises(fmt.BlockFileError, match="not JSON"):
        fmt.decode(data, KEY, max_bytes=1 << 30)
    with pytest.raises(fmt.BlockFileError, match="not JSON"):
        fmt.read_header_only(lambda off, n: data[off:off + n], len(data), 1 << 30)


def _entries(data: bytes) -> dict:
    """A block file's header entries, its metadata left out."""
    n = struct.unpack("<Q", data[:8])[0]
    doc = json.loads(data[8:8 + n])
    doc.pop("__metadata__")
    return doc


def test_fieldwise_header_check_accepts_only_what_the_entrywise_one_does() -> None:
    """A header's entries checked a field at a time (``tensors_in_order``, the path of headers
    with many tensors) either give the tensors the entry-at-a-time check gives, or nothing (and
    that check decides): over headers this format writes and 3,000 of their mutations (none;
    shapes permuted; two dimensions negated, the size kept; fields of other types; negative,
    boolean or float numbers (equal to the right ones too); extra or missing fields; sizes that do not match; entries out of
    order or overlapping; a zero-size entry)."""
    layers = {f"{i}.{kv}": mx.zeros((1, 2, 16, 8), dtype=mx.float16)
              for i in range(30) for kv in ("keys", "values")}
    written = [_entries(_file(layers, "none")), _entries(_file(_arrays(), "none"))]
    for doc in written:  # what this format writes takes the field-at-a-time path, unchanged
        assert len(doc) >= ht.FIELDWISE_FROM
        assert ht.tensors_in_order(doc, 1 << 30) == ht.tensors_checked(doc, 1 << 30)
    rng = random.Random(45)
    odd = [None, True, False, -1, 0, 1, 2.0, "2", [], [1], [-1, 2], [0, True], {}, "F16", "X9"]
    outcomes = {"same": 0, "deferred": 0}
    for _ in range(3_000):
        original = rng.choice(written)
        doc = json.loads(json.dumps(original))
        for _ in range(rng.randint(0, 3)):
            name = rng.choice(list(doc))
            entry = doc[name]
            op = rng.random()
            if op < 0.1:  # entries listed out of data order (still a valid file)
                doc = dict(rng.sample(list(doc.items()), len(doc)))
            elif op < 0.2 and isinstance(entry, dict) and isinstance(entry.get("shape"), list):
                entry["shape"] = rng.sample(entry["shape"], len(entry["shape"]))  # still valid
            elif (op < 0.25 and isinstance(entry, dict) and isinstance(entry.get("shape"), list)
                  and len(entry["shape"]) > 1):
                entry["shape"] = [-entry["shape"][0], -entry["shape"][1], *entry["shape"][2:]]
            elif op < 0.3 or not isinstance(entry, dict):
                doc[name] = rng.choice(odd)
            elif op < 0.45:
                entry[rng.choice(["dtype", "shape", "data_offsets"])] = rng.choice(odd)
            elif op < 0.6:
                entry["shape"] = [rng.choice([0, 1, 2, -2]) for _ in range(rng.randint(0, 3))]
            elif op < 0.7:
                entry["data_offsets"] = [rng.choice([-2, 0, 2]) + v for v in
                                         original[name]["data_offsets"]]
            elif op < 0.75:  # the same numbers as floats (a bool where it is 0 or 1)
                field = rng.choice(["shape", "data_offsets"])
                entry[field] = [rng.choice([float, lambda v: bool(v) if v in (0, 1) else v])(v)
                                for v in original[name][field]]
            elif op < 0.85:
                entry.pop(rng.choice(["dtype", "shape", "data_offsets"]), None)
            else:
                entry["extra"] = 1
        end = max(e["data_offsets"][1] for e in original.values())
        limit = rng.choice([1 << 30, end, end - 1])
        fast = ht.tensors_in_order(doc, limit)
        try:
            checked = ht.tensors_checked(doc, limit)
        except fmt.BlockFileError:
            checked = None
        if fast is None:
            outcomes["deferred"] += 1
        else:
            assert fast == checked, doc
            outcomes["same"] += 1
    assert outcomes["same"] > 400 and outcomes["deferred"] > 1_000, outcomes


def _header_text(data: bytes) -> str:
    n = struct.unpack("<Q", data[:8])[0]
    return data[8:8 + n].decode()


def test_a_header_s_tensor_entries_are_checked_once_for_the_same_text() -> None:
    """A version 2 header's metadata is parsed on its own and its tensor entries (the text after
    it) checked once for every header with the same text (``section_tensors``): the same header
    as a whole parse gives; the data limit checked on every header; a text that differs by a
    number's type, a damaged one (not kept) or one naming ``__metadata__`` again each read as
    before."""
    text = _header_text(_file({"x": mx.ones((4, 4)), "y": mx.zeros((3,))}, "none"))
    doc = json.loads(text)
    meta = doc.pop("__metadata__")
    limit = 64 + 12
    before = ht.section_tensors.cache_info()
    first, second = (fmt.parse_header(text.encode(), data_limit=limit) for _ in range(2))
    assert ht.section_tensors.cache_info().hits >= before.hits + 1  # the second from the memo
    for h in (first, second):
        assert h.meta == meta and h.tensors == ht.tensors_checked(doc, limit)
        assert h.header_len == len(text) and h.raw == text.encode()
    second.tensors.clear()  # a header's list is its own
    assert fmt.parse_header(text.encode(), data_limit=limit).tensors == first.tensors
    with pytest.raises(fmt.BlockFileError, match="tensors need 76 data bytes, the file holds 75"):
        fmt.parse_header(text.encode(), data_limit=limit - 1)
    floats = text.replace('"shape":[4,4]', '"shape":[4.0,4]')
    assert floats != text
    with pytest.raises(fmt.BlockFileError, match="non-negative integers"):
        fmt.parse_header(floats.encode(), data_limit=limit)
    damaged = text.replace('"F32"', '"F99"')
    kept = ht.section_tensors.cache_info()
    for _ in range(2):
        with pytest.raises(fmt.BlockFileError, match="unsupported dtype"):
            fmt.parse_header(damaged.encode(), data_limit=limit)
    now = ht.section_tensors.cache_info()
    assert (now.misses, now.currsize) == (kept.misses + 2, kept.currsize)  # checked each time
    spaced = text.replace('},"x"', '} ,"x"', 1)  # JSON, but not as this format writes it
    assert spaced != text
    assert fmt.parse_header(spaced.encode(), data_limit=limit).tensors == first.tensors
    again = text.rstrip()[:-1] + ',"__metadata__":{"a":"2"}}'
    assert fmt.parse_header(again.encode(), data_limit=limit).meta == {"a": "2"}  # JSON's rule
