"""How rows move between stored blocks and live caches, chosen once per process, and a count of
what moving them costs on a GPU.

Two paths:
- ``host``: numpy copies straight into MLX-owned memory, SSD payloads read straight into the
  rebuilt buffers. The default on the CPU backend, where an evaluated array's buffer is plain
  host memory and MLX's own copy kernels run at a fraction of memcpy speed.
- ``device``: MLX ops on the default device: one concatenate per array per layer, evaluated once
  per layer; SSD payloads read into one host staging buffer per array per layer, moved to the
  device once. The default on a GPU backend (Metal, CUDA), where every evaluation is a launch and
  a synchronization and every host view of a device array a transfer.

``PAGED_CACHE_ROW_PATH`` (``host`` or ``device``) forces the choice (the tests run both on the
CPU backend); ``forced`` does the same for a block of code. ``counts`` tells how many
evaluations, host views and uploads the library made: on a CPU they cost little, on a GPU they
are the cost, so tests bound them per fetch and per store.
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Any, Iterator

import mlx.core as mx
import numpy as np

ENV = "PAGED_CACHE_ROW_PATH"
PATHS = ("host", "device")


@dataclass(frozen=True)
class Counts:
    """Work the library asked of MLX since the process started: ``syncs`` (evaluations it waited
    for), ``launches`` (evaluations started without waiting), ``to_host`` (MLX arrays read as
    host memory), ``to_device`` (host buffers turned into MLX arrays)."""

    syncs: int = 0
    launches: int = 0
    to_host: int = 0
    to_device: int = 0

    def __sub__(self, other: "Counts") -> "Counts":
        return Counts(*(getattr(self, f.name) - getattr(other, f.name) for f in fields(self)))


class _State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.chosen: str | None = None
        self.forced: str | None = None
        self.counts = {f.name: 0 for f in fields(Counts)}


_STATE = _State()


def _from_env() -> str:
    value = os.environ.get(ENV, "").strip().lower()
    if not value:
        return "host" if mx.default_device().type == mx.DeviceType.cpu else "device"
    if value not in PATHS:
        raise ValueError(f"{ENV}={os.environ[ENV]!r} (from the environment): expected one of "
                         f"{', '.join(PATHS)}, or unset for the default device's path")
    return value


def row_path() -> str:
    """``host`` or ``device``: forced by ``forced``, else chosen once per process from
    ``PAGED_CACHE_ROW_PATH`` or the default device (ValueError naming the variable when its value
    is neither)."""
    if _STATE.forced is not None:
        return _STATE.forced
    if _STATE.chosen is None:
        _STATE.chosen = _from_env()
    return _STATE.chosen


def copies_on_host() -> bool:
    """True when rows are copied by numpy into MLX-owned memory (the ``host`` path)."""
    return row_path() == "host"


@contextmanager
def forced(path: str) -> Iterator[None]:
    """Run the block with rows moved by ``path`` (``host`` or ``device``), whatever the device."""
    if path not in PATHS:
        raise ValueError(f"path: expected one of {', '.join(PATHS)}, got {path!r}")
    before, _STATE.forced = _STATE.forced, path
    try:
        yield
    finally:
        _STATE.forced = before


def counts() -> Counts:
    """The work counted so far (subtract two to get what a call made)."""
    with _STATE.lock:
        return Counts(**_STATE.counts)


def _count(name: str, n: int = 1) -> None:
    with _STATE.lock:
        _STATE.counts[name] += n


def evaluate(arrays: Any) -> None:
    """``mx.eval``, counted as one synchronization."""
    _count("syncs")
    mx.eval(arrays)


def launch(arrays: Any) -> None:
    """``mx.async_eval``, counted as one launch (no wait)."""
    _count("launches")
    mx.async_eval(arrays)


def host_view(x: Any) -> np.ndarray:
    """A numpy view (no copy) of an mx.array's memory, evaluated first, counted as one transfer
    to the host (on CUDA the array moves to managed memory); bfloat16 as uint16 (numpy has no
    bfloat16, the bytes are the same). A numpy array is returned as is."""
    if isinstance(x, np.ndarray):
        return x
    _count("to_host")
    if x.dtype == mx.bfloat16:
        x = x.view(mx.uint16)
    return np.asarray(x)


def to_device(host: np.ndarray, dtype: Any) -> mx.array:
    """An MLX array of ``dtype`` holding a copy of ``host`` (bfloat16 from its uint16 bits),
    counted as one transfer to the device."""
    _count("to_device")
    array = mx.array(host)
    return array.view(dtype) if array.dtype != dtype else array
