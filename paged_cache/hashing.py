"""Model fingerprints and chained block keys (blake2b-256, 64 hex characters).

A block key commits to the model fingerprint, the namespace, the parent block's key and the
block's token ids, so equal keys mean equal prefixes computed by a compatible model and layout.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any, Iterable, Sequence

import numpy as np

_DOMAIN = b"paged-cache/block/v1\0"
ROOT_PARENT = ""  # parent key of a chain's first block


def _digest(*parts: bytes) -> str:
    h = hashlib.blake2b(digest_size=32)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


def token_bytes(tokens: Sequence[int]) -> bytes:
    """Canonical byte encoding of token ids (int64 little-endian)."""
    return np.asarray(tokens, dtype="<i8").tobytes()


def block_key(fingerprint: str, namespace: str, parent: str, tokens: Sequence[int]) -> str:
    """Key of one block: hash(fingerprint, namespace, parent key, the block's token ids)."""
    return _digest(_DOMAIN, fingerprint.encode(), namespace.encode(), parent.encode(),
                   token_bytes(tokens))


def chain_keys(fingerprint: str, namespace: str, tokens: Sequence[int], block_size: int,
               parent: str = ROOT_PARENT) -> list[str]:
    """Keys of consecutive blocks of ``tokens`` (the last one may be partial), chained from parent."""
    keys = []
    for start in range(0, len(tokens), block_size):
        parent = block_key(fingerprint, namespace, parent, tokens[start:start + block_size])
        keys.append(parent)
    return keys


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return repr(value)


def model_identity(model: Any, model_id: str | None = None) -> str:
    """``model_id`` when given, else a hash of the model's config (``args`` / ``config``)."""
    if model_id is not None:
        if not isinstance(model_id, str) or not model_id:
            raise ValueError(f"model_id: expected a non-empty string, got {model_id!r}")
        return "id:" + model_id
    config = getattr(model, "args", None) or getattr(model, "config", None)
    if config is None:
        from mlx.utils import tree_flatten
        config = {"class": type(model).__qualname__,
                  "params": [(k, list(v.shape), str(v.dtype))
                             for k, v in tree_flatten(model.parameters())]}
    elif not isinstance(config, dict) and not dataclasses.is_dataclass(config):
        config = vars(config)
    payload = json.dumps({"class": type(model).__module__ + "." + type(model).__qualname__,
                          "config": _jsonable(config)}, sort_keys=True)
    return "config:" + hashlib.blake2b(payload.encode(), digest_size=32).hexdigest()


def model_fingerprint(identity: str, layout: Iterable[dict]) -> str:
    """Fingerprint of model identity + per-entry cache layout (class, dtype, heads, dims, ...)."""
    payload = json.dumps({"model": identity, "layout": list(layout)}, sort_keys=True)
    return _digest(b"paged-cache/fingerprint/v1", payload.encode())
