"""Sealed remote values: with a shared secret, every value a host writes carries a keyed MAC.

A sealed value is ``MAGIC`` (8 bytes) + a 32-byte HMAC-SHA256 tag keyed by the secret + the
block file (OpenSSL's SHA-256 uses the CPU's SHA instructions where it has them: twice
BLAKE2b's speed on the x86 test machine). The tag covers the server key the value is stored under and every byte of the file
(header and payload), so a value forged or altered without the secret, or moved to another key,
fails. The magic cannot begin a block file (a plain file starts with a header length below
16 MiB, whose high bytes are zero; an lz4 file with the lz4 frame magic), so a host without a
secret knows a sealed value when it reads one: it cannot verify the tag, so it refuses the value
(counted) rather than skip the seal.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any, Sequence

MAGIC = b"PCMAC1\xff\xff"
TAG_BYTES = 32
SEAL_BYTES = len(MAGIC) + TAG_BYTES
_DOMAIN = b"paged-cache/remote-value/v1\0"  # what a tag is of (no other use of the key collides)


def _bytes(chunk: Any) -> memoryview:
    view = memoryview(chunk)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class Sealer:
    """Seals and opens remote values with one secret (``remote_secret``)."""

    def __init__(self, secret: str) -> None:
        self._key = secret.encode()

    def __repr__(self) -> str:  # never the key
        return "Sealer(***)"

    def _tag(self, name: str, chunks: Sequence[Any]) -> bytes:
        h = hmac.new(self._key, _DOMAIN, hashlib.sha256)
        encoded = name.encode()
        h.update(len(encoded).to_bytes(8, "little") + encoded)
        for chunk in chunks:
            h.update(_bytes(chunk))
        return h.digest()

    def seal(self, name: str, chunks: Sequence[Any]) -> list[Any]:
        """The chunks of the value to store under server key ``name``: seal first, then ``chunks``
        (the block file's bytes, unchanged)."""
        return [MAGIC + self._tag(name, chunks), *chunks]

    def open(self, name: str, value: Any) -> memoryview | None:
        """The block file inside a value read from server key ``name``, or None when the value
        carries no valid tag for it (unsealed, forged, altered, or another key's)."""
        view = _bytes(value)
        if view.nbytes < SEAL_BYTES or view[:len(MAGIC)] != MAGIC:
            return None
        body = view[SEAL_BYTES:]
        return body if hmac.compare_digest(view[len(MAGIC):SEAL_BYTES], self._tag(name, [body])) \
            else None


def is_sealed(value: Any) -> bool:
    """True when a value carries a seal (whether its tag is valid takes the secret)."""
    return _bytes(value)[:len(MAGIC)] == MAGIC
