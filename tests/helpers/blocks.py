"""Blocks and keys for tests: deterministic keys, blocks whose content is a function of their
label (any reader can check it), bit-exact comparison, and the block files of a cache directory."""

from __future__ import annotations

import hashlib
from pathlib import Path

import mlx.core as mx
import numpy as np

from paged_cache.block import Block
from paged_cache.hashing import encode_token_ids

DTYPES = [mx.float32, mx.float16, mx.bfloat16, mx.uint32]


def key_of(label: object, space: str = "") -> str:
    """The key of ``label`` (in a key ``space``): a sha256, 64 hex characters."""
    return hashlib.sha256((f"{space}:{label}" if space else str(label)).encode()).hexdigest()


def make_block(label: object, nbytes: int = 1024, dtype=None, meta: dict | None = None,
               names: tuple[str, str] = ("k", "v")) -> Block:
    """A block of ``nbytes`` payload in two arrays whose values are derived from ``label`` (an
    int label picks the dtype from DTYPES unless ``dtype`` is given); meta ``i`` and ``tokens``
    unless ``meta`` is given."""
    seed = label if isinstance(label, int) else int(key_of(label)[:8], 16) % 1000
    dtype = dtype or DTYPES[seed % len(DTYPES)]
    n = nbytes // dtype.size
    scale = 1000 if dtype == mx.uint32 else 1

    def values(lo: int, hi: int, shape: tuple[int, ...]) -> mx.array:
        out = (mx.arange(lo, hi, dtype=mx.float32) * 0.37 + seed)
        out = (out * scale if scale != 1 else out).astype(dtype).reshape(shape)
        mx.eval(out)  # one array at a time (transients of one block at most), evaluated here
        return out

    first = values(0, n // 2, (1, 1, -1))
    second = values(n // 2, n, (-1,))
    return Block(key_of(label), {names[0]: first, names[1]: second},
                 {"i": str(label), "tokens": "4"} if meta is None else meta)



def stored_block(label: object, n: int = 256, dtype=mx.float16, model: str = "m1",
                 parent: str | None = None) -> Block:
    """``make_block`` (two arrays of ``n`` values) with the meta a stored block carries: its
    model, 16 tokens, a parent (derived from the label unless given) and one KV layer."""
    meta = {"fingerprint": model, "tokens": "16",
            "parent": key_of(f"parent-{label}") if parent is None else parent,
            "layers": '[{"type": "KVCache"}]'}
    return make_block(label, 2 * n * dtype.size, dtype, meta, names=("keys", "values"))


def random_block(key: str, model: str = "m1") -> Block:
    """The block stored under ``key``: fp16 keys and bf16 values (any bit pattern) seeded by it."""
    seed = int(key[:8], 16)
    n = 256 * (1 + seed % 4)
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal(n, dtype=np.float32).astype(np.float16).reshape(2, -1)
    values = mx.array(rng.integers(0, 1 << 16, size=n, dtype=np.uint16)).view(mx.bfloat16)
    arrays = {"k": mx.array(keys), "v": values}
    mx.eval(*arrays.values())
    return Block(key, arrays, {"fingerprint": model, "tokens": "16",
                               "parent": key_of(seed, "parent"),
                               "layers": '[{"type": "KVCache"}]'})


def same_block(got: Block | None, want: Block) -> bool:
    """Bit-exact equality of key, meta, dtypes, shapes and bytes."""
    return (got is not None and got.key == want.key and got.meta == want.meta
            and set(got.arrays) == set(want.arrays)
            and all(got.arrays[n].dtype == a.dtype and got.arrays[n].shape == a.shape
                    and bytes(memoryview(got.arrays[n])) == bytes(memoryview(a))
                    for n, a in want.arrays.items()))


def block_files(root: Path) -> dict[str, Path]:
    """key -> path of every regular block file under ``root``/blocks ({} when there is none)."""
    blocks = root / "blocks"
    return {path.name[:64]: path for path in (blocks.rglob("*") if blocks.is_dir() else ())
            if path.is_file() and not path.is_symlink()}



def text_rows(rows: list[tuple]) -> list[tuple]:
    """Node rows with their token ids in text form, as the manifest stores them: a row a lookup
    made from its route holds them as an array (tiers/ssd/child_rows.py)."""
    return [row[:5] + (encode_token_ids(row[5]) if isinstance(row[5], np.ndarray) else row[5],)
            + row[6:] for row in rows]
