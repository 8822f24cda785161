"""Keeps a thread that ran the model from aborting the process when it exits, on mlx < 0.32.

There each thread keeps its own cache of compiled functions (mlx-lm's models call compiled
functions: qwen3_next's gated delta step, for one), holding Python objects, and frees it when
the thread exits without taking the GIL: "Fatal Python error: PyThreadState_Get", the process
aborted. A server that stops its generation thread and then closes the cache (writing the
partial tails and the SSD tier's last manifest rows) dies in the middle of that close. Creating a
compiled function on a thread makes those releases register a clean-up that takes the GIL, so
the prefix cache does that once on each thread that fetches or stores (the engine's generation
thread). mlx 0.32 registers it itself; there this does nothing.
"""

from __future__ import annotations

import threading
from importlib import metadata

import mlx.core as mx

NEEDED = tuple(int(p) for p in metadata.version("mlx").split(".")[:2]) < (0, 32)
_guarded = threading.local()


def _identity(x: mx.array) -> mx.array:
    return x


def guard_thread() -> None:
    """Make the calling thread's exit free its compiled functions with the GIL held (once per
    thread; nothing on mlx >= 0.32)."""
    if NEEDED and not getattr(_guarded, "done", False):
        mx.compile(_identity)
        _guarded.done = True
