"""Block: one fixed-size token block of KV as named mx.arrays plus string metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import mlx.core as mx

KEY_HEX_LEN = 64  # blake2b-256 / sha256 hex digest


HEX = frozenset("0123456789abcdef")
_HEX_BYTES = "".join(sorted(HEX)).encode()


def is_key(key: object) -> bool:
    """True for a block key: KEY_HEX_LEN lower-case hex characters (file names derive from it)."""
    return isinstance(key, str) and len(key) == KEY_HEX_LEN and HEX.issuperset(key)


def are_keys(keys: list) -> bool:
    """True when every element of ``keys`` is a block key (``is_key``), checked in a few passes
    over the whole list rather than one Python call per key (a 128k-token chain has 512)."""
    if not (all(isinstance(k, str) for k in keys) and set(map(len, keys)) <= {KEY_HEX_LEN}):
        return False
    try:
        joined = "".join(keys).encode("ascii")
    except UnicodeEncodeError:
        return False
    return not joined.translate(None, _HEX_BYTES)  # nothing left once hex digits are deleted


def check_key(key: str) -> str:
    """Validate a block key (``is_key``); raise ValueError naming what was expected."""
    if not is_key(key):
        raise ValueError(f"key: expected {KEY_HEX_LEN} lower-case hex characters, got {key!r:.80}")
    return key


def checked_keys(keys: Sequence[str]) -> list[str]:
    """``keys`` as a list, each checked to be a block key (TypeError / ValueError naming it)."""
    if isinstance(keys, str):
        raise TypeError("keys: expected a sequence of keys, got a single str")
    keys = list(keys)
    if not are_keys(keys):
        for key in keys:
            check_key(key)  # raises with the standard message for the first bad one
    return keys


@dataclass
class Block:
    """A stored unit: ``arrays`` (evaluated, owning their memory) and ``meta`` (str -> str).

    ``meta`` carries what a reader needs without the payload: model fingerprint, parent key,
    token count, per-layer descriptors (JSON). The storage layer adds format version and checksum.
    """

    key: str
    arrays: dict[str, mx.array]
    meta: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise (ValueError / TypeError naming the field) unless the key is a block key,
        ``arrays`` maps str -> mx.array and ``meta`` str -> str: at construction, and again
        where a block is stored (its fields are the caller's to change)."""
        check_key(self.key)
        for name, value in self.arrays.items():
            if not isinstance(name, str) or not isinstance(value, mx.array):
                raise TypeError(f"arrays: expected str -> mx.array, got {name!r}: {type(value).__name__}")
        for k, v in self.meta.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise TypeError(f"meta: expected str -> str, got {k!r}: {type(v).__name__}")

    @property
    def nbytes(self) -> int:
        """Payload bytes (what the hot tier and the write queue budget count)."""
        return sum(a.nbytes for a in self.arrays.values())
