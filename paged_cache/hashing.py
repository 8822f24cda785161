"""Model fingerprints and chained block keys (blake2b-256, 64 hex characters).

A block key commits to the model fingerprint, the namespace, the parent block's key and the
block's token ids, so equal keys mean equal prefixes computed by a compatible model and layout.
The model identity hashes the config and a sampled digest of the weights (see weights_digest).
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import threading
from typing import Any, Iterable, Sequence

import mlx.core as mx
import numpy as np

_DOMAIN = b"paged-cache/block/v1\0"
_CHECKPOINT_DOMAIN = b"paged-cache/checkpoint/v1\0"
ROOT_PARENT = ""  # parent key of a chain's first block
TOKEN_MIN, TOKEN_MAX = -(2**63), 2**63 - 1  # token ids are hashed as int64 (token_bytes)


def _feed(h: Any, *parts: bytes | memoryview) -> None:
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)


def _hasher(*parts: bytes | memoryview) -> Any:
    h = hashlib.blake2b(digest_size=32)
    _feed(h, *parts)
    return h


def _digest(*parts: bytes | memoryview) -> str:
    return _hasher(*parts).hexdigest()


def token_ids(tokens: Any, name: str = "tokens") -> np.ndarray:
    """Token ids as a 1-D int64 array from a sequence of ints, a 1-D integer numpy array or
    mx.array, with no per-token Python work (numpy converts; an element is looked at one by
    one only to name it in the TypeError raised for anything else, or the ValueError for an id
    outside int64, the width block keys hash them in)."""
    if isinstance(tokens, (np.ndarray, mx.array)):
        array = np.asarray(tokens) if isinstance(tokens, np.ndarray) else _from_mx(tokens, name)
        if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
            raise TypeError(f"{name}: expected a 1-D integer array, got shape {tuple(array.shape)} "
                            f"dtype {array.dtype}")
        return _in_int64(array, name)
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence):
        raise TypeError(f"{name}: expected a sequence of ints, got {type(tokens).__name__}")
    types = set(map(type, tokens))
    if bool in types or not all(issubclass(t, (int, np.integer)) for t in types):
        i, bad = next((i, t) for i, t in enumerate(tokens)
                      if isinstance(t, bool) or not isinstance(t, (int, np.integer)))
        raise TypeError(f"{name}: expected ints, element {i} is {type(bad).__name__} {bad!r:.40}")
    if not len(tokens):
        return np.zeros(0, dtype="<i8")
    return _in_int64(np.asarray(tokens), name, tokens)


def _in_int64(array: np.ndarray, name: str, source: Sequence[int] | None = None) -> np.ndarray:
    """``array`` as int64 when every id fits; else ValueError naming the first that does not
    (numpy gives a list holding ids past int64 an unsigned, float or object dtype)."""
    if array.dtype.kind not in "iu" or (array.dtype.kind == "u" and array.size
                                        and int(array.max()) > TOKEN_MAX):
        items = array.tolist() if source is None else source
        i, t = next((i, t) for i, t in enumerate(map(int, items))
                    if not TOKEN_MIN <= t <= TOKEN_MAX)
        raise ValueError(f"{name}: element {i} is {t}, outside the int64 range token ids are "
                         f"hashed in ([{TOKEN_MIN}, {TOKEN_MAX}])")
    return array.astype("<i8", copy=False)


def _from_mx(tokens: Any, name: str) -> np.ndarray:
    if not mx.issubdtype(tokens.dtype, mx.integer):
        raise TypeError(f"{name}: expected a 1-D integer array, got shape {tuple(tokens.shape)} "
                        f"dtype {tokens.dtype}")
    return np.array(tokens, copy=True)  # never a view of MLX memory


def token_bytes(tokens: Sequence[int] | np.ndarray) -> memoryview:
    """Canonical byte encoding of token ids (int64 little-endian)."""
    return memoryview(np.ascontiguousarray(tokens, dtype="<i8")).cast("B")


def token_array(tokens: Sequence[int]) -> np.ndarray:
    """Token ids as the narrowest of uint16 / int32 / int64 (little-endian) that holds them all."""
    given = np.asarray(tokens)
    if given.dtype.kind == "u" and given.dtype.itemsize <= 4:  # none negative: one reduction
        hi = int(given.max()) if given.size else 0
        return given.astype("<u2" if hi <= 0xFFFF else "<i4" if hi <= 0x7FFFFFFF else "<i8")
    wide = np.asarray(tokens, dtype="<i8")
    lo, hi = (int(wide.min()), int(wide.max())) if wide.size else (0, 0)
    for dtype in ("<u2", "<i4"):
        info = np.iinfo(dtype)
        if info.min <= lo and hi <= info.max:
            return wide.astype(dtype)
    return wide


def encode_token_ids(tokens: Sequence[int]) -> str:
    """Compact text form of a block's token ids for its meta: "<u2|i4|i8>:<base64 bytes>"."""
    array = token_array(tokens)
    return f"{array.dtype.str[1:]}:{base64.b64encode(array.tobytes()).decode('ascii')}"


def decode_token_ids(text: str) -> np.ndarray:
    """Inverse of encode_token_ids; ValueError when ``text`` is not in that form."""
    code, sep, payload = text.partition(":")
    if not sep or code not in ("u2", "i4", "i8"):
        raise ValueError(f"token_ids: expected '<u2|i4|i8>:<base64>', got {text[:20]!r}")
    raw = base64.b64decode(payload.encode("ascii"), validate=True)
    if len(raw) % int(code[1]):
        raise ValueError(f"token_ids: {len(raw)} bytes is not a whole number of {code} ids")
    return np.frombuffer(raw, dtype="<" + code)


def block_key(fingerprint: str, namespace: str, parent: str, tokens: Sequence[int]) -> str:
    """Key of one block: hash(fingerprint, namespace, parent key, the block's token ids)."""
    return _digest(_DOMAIN, fingerprint.encode(), namespace.encode(), parent.encode(),
                   token_bytes(tokens))


def checkpoint_key(fingerprint: str, namespace: str, parent: str, tokens: Sequence[int]) -> str:
    """Key of a checkpoint node: like ``block_key`` under its own domain tag, so a checkpoint and
    the block of the same tokens never collide."""
    return _digest(_CHECKPOINT_DOMAIN, fingerprint.encode(), namespace.encode(), parent.encode(),
                   token_bytes(tokens))


def chain_keys(fingerprint: str, namespace: str, tokens: Sequence[int], block_size: int,
               parent: str = ROOT_PARENT) -> list[str]:
    """Keys of consecutive blocks of ``tokens`` (the last one may be partial), chained from parent.

    Equal to chaining ``block_key`` block by block, but the tokens are converted to bytes once
    and each block hashes a slice of that buffer (128k tokens: ~2 ms instead of ~8 ms).
    """
    data = token_bytes(tokens)
    step = block_size * 8  # token_bytes: 8 bytes per token
    head = _hasher(_DOMAIN, fingerprint.encode(), namespace.encode())  # shared by every block
    keys = []
    for start in range(0, len(data), step):
        h = head.copy()
        _feed(h, parent.encode(), data[start:start + step])
        parent = h.hexdigest()
        keys.append(parent)
    return keys


class ChainKeys:
    """The chained block keys of the last token ids asked for, so that the stages one request goes
    through (how far the stored nodes reach, the fetch, a group's agreement, the store after it)
    hash each of its blocks once: a new request reuses the keys of the full blocks it shares with
    the last one (a chat's next turn, the store of a prompt just fetched) and hashes the rest.
    ``hashed_blocks`` counts the blocks hashed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._scope: tuple[str, str, int] | None = None
        self._ids = np.empty(0, dtype="<i8")
        self._keys: list[str] = []
        self.hashed_blocks = 0

    def keys(self, fingerprint: str, namespace: str, tokens: Sequence[int] | np.ndarray,
             block_size: int) -> list[str]:
        """``chain_keys(fingerprint, namespace, tokens, block_size)``."""
        ids = np.ascontiguousarray(tokens, dtype="<i8")
        scope = (fingerprint, namespace, block_size)
        with self._lock:
            reuse = 0
            if scope == self._scope:
                common = min(len(ids), len(self._ids))
                differ = np.flatnonzero(ids[:common] != self._ids[:common])
                same = int(differ[0]) if differ.size else common
                reuse = len(self._keys) if same == len(ids) == len(self._ids) \
                    else same // block_size   # the same ids: every key, the partial last too
            kept = self._keys[:reuse]
            parent = kept[-1] if kept else ROOT_PARENT
            rest = chain_keys(fingerprint, namespace, ids[len(kept) * block_size:], block_size,
                              parent) if len(kept) * block_size < len(ids) else []
            self.hashed_blocks += len(rest)
            self._scope, self._ids, self._keys = scope, ids.copy(), kept + rest
            return list(self._keys)


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


WEIGHT_SAMPLE_BYTES = 256  # bytes sampled from the start and from the end of every parameter
WEIGHT_SAMPLE_STRIDED = 16  # elements sampled at even strides across every parameter


def weights_digest(model: Any) -> str:
    """Cheap digest of a model's weights: per parameter its name, shape, dtype and a fixed sample.

    The sample is the first and last 256 bytes and 16 evenly strided elements, so fine-tunes and
    differently seeded random weights get different digests without reading every byte.
    """
    from mlx.utils import tree_flatten

    params = sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0])
    samples = []
    for _, p in params:
        flat = p.reshape(-1)
        edge = -(-WEIGHT_SAMPLE_BYTES // p.dtype.size)
        if flat.size <= 2 * edge + WEIGHT_SAMPLE_STRIDED:
            picked = flat
        else:
            stride = flat.size // WEIGHT_SAMPLE_STRIDED
            picked = mx.concatenate([flat[:edge], flat[-edge:], flat[::stride][:WEIGHT_SAMPLE_STRIDED]])
        samples.append(mx.view(picked, mx.uint8))
    mx.eval(samples)
    h = hashlib.blake2b(digest_size=32)
    for (name, p), sample in zip(params, samples):
        h.update(json.dumps([name, list(p.shape), str(p.dtype)]).encode())
        h.update(memoryview(sample))
    return h.hexdigest()


def model_identity(model: Any, model_id: str | None = None) -> str:
    """``model_id`` when given, else a hash of the model's class, config (``args`` / ``config``)
    and weights digest (weights_digest: models sharing a config but not weights never mix)."""
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
                          "config": _jsonable(config), "weights": weights_digest(model)},
                         sort_keys=True)
    return "model:" + hashlib.blake2b(payload.encode(), digest_size=32).hexdigest()


def model_fingerprint(identity: str, layout: Iterable[dict], block_size: int,
                      shard: dict | None = None) -> str:
    """Fingerprint of model identity + per-entry cache layout (class, dtype, heads, dims, ...) +
    block size (+ the rank's shard of a model split over several ranks): chains of different
    block sizes on one directory never meet (a cache would take the other's full blocks for
    partial tails of its own and discard them), nor do two ranks' shards (equal shapes, other
    heads or layers)."""
    fields: dict[str, Any] = {"model": identity, "layout": list(layout), "block_size": block_size}
    if shard is not None:
        fields["shard"] = shard
    payload = json.dumps(fields, sort_keys=True)
    return _digest(b"paged-cache/fingerprint/v1", payload.encode())


def shared_prefix(ids: np.ndarray, tokens: np.ndarray) -> int:
    """Leading tokens ``ids`` and ``tokens`` share (token id arrays of any integer dtype)."""
    n = min(len(ids), len(tokens))
    if n == 0:
        return 0
    diff = np.flatnonzero(ids[:n] != tokens[:n])
    return int(diff[0]) if diff.size else n
