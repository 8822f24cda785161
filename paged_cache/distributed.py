"""The seam to MLX distributed: which ranks act together, what shard of the model a rank holds,
and the one collective by which they agree on a fetch.

A model split over several ranks (tensor parallel: each rank its slice of heads / experts;
pipeline: each rank its range of layers) keeps a different KV shard on every rank. Two things
follow. The shard is part of what a block is (``Shard.identity`` goes into the fingerprint every
key commits to), so ranks never share a key, on one directory or one remote server. And every
rank must restore the same prefix, or the ranks' collectives run on different inputs: a fetch
ends at the longest prefix every rank of the group can rebuild (``Agreement``). Nothing here is
specific to one engine: a group and a model are all it needs.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generation_stream

from paged_cache import compat

logger = logging.getLogger("paged_cache.distributed")


class _World:
    """The default group: the world group when ``mx.distributed.init()`` has more than one rank,
    else none (one process: nothing changes)."""

    def __repr__(self) -> str:
        return "WORLD"


WORLD: Any = _World()

# Linear layers MLX's tensor parallelism swaps in (mlx.nn): their presence marks a tensor shard.
_SHARDED_LINEARS = tuple(getattr(nn, name) for name in (
    "AllToShardedLinear", "ShardedToAllLinear", "QuantizedAllToShardedLinear",
    "QuantizedShardedToAllLinear") if hasattr(nn, name))


def resolve_group(group: Any, name: str = "group") -> mx.distributed.Group | None:
    """The group to agree with: ``WORLD`` -> the world group if it has more than one rank;
    None -> none; a Group -> itself (None when it has a single rank)."""
    if group is WORLD:
        if not mx.distributed.is_available():
            return None
        group = mx.distributed.init()
    elif group is None:
        return None
    elif not isinstance(group, mx.distributed.Group):
        raise TypeError(f"{name}: expected an mx.distributed.Group, None or WORLD, got "
                        f"{type(group).__name__}")
    return group if group.size() > 1 else None


@dataclass(frozen=True)
class Shard:
    """What one rank of a group holds of the model: its rank, the group's size, the layers it
    runs (pipeline) and whether its layers are split by heads / experts (tensor)."""

    rank: int
    size: int
    layers: tuple[int, int] | None = None  # pipeline: [start, end) of the model's layer numbers
    tensor: bool = False

    def identity(self) -> dict[str, Any]:
        """The fields hashed into the fingerprint (two ranks never share a key)."""
        return {"rank": self.rank, "size": self.size,
                "layers": list(self.layers) if self.layers else None, "tensor": self.tensor}

    def describe(self) -> str:
        """For people (block meta, CLI, stats): e.g. "rank 1/2 layers 0-2" or "rank 0/2 tensor"."""
        parts = [f"rank {self.rank}/{self.size}"]
        if self.layers:
            parts.append(f"layers {self.layers[0]}-{self.layers[1]}")
        if self.tensor:
            parts.append("tensor")
        return " ".join(parts)


def shard_of(model: Any, group: mx.distributed.Group | None) -> Shard | None:
    """The shard this rank of ``group`` holds of ``model`` (None without a group)."""
    if group is None:
        return None
    tensor = any(isinstance(m, _SHARDED_LINEARS) for _, m in model.named_modules())
    return Shard(group.rank(), group.size(), compat.pipeline_layers(model), tensor)


def any_rank(group: mx.distributed.Group, flags: list[bool]) -> list[bool]:
    """For each flag, True when it is True on some rank of ``group`` (one collective)."""
    mx.synchronize(generation_stream)
    seen = mx.distributed.all_max(mx.array([int(f) for f in flags], dtype=mx.int32), group=group)
    return [bool(v) for v in seen.tolist()]


class Agreement:
    """The one collective of a fetch: every rank proposes the prefix length it rebuilt, and the
    group learns the longest and the shortest proposal (and the shortest stored match) at once.

    Equal proposals end the fetch; otherwise ranks above the shortest search again below it and
    the group proposes again, until all agree (at worst on 0: a miss on every rank).
    """

    def __init__(self, group: mx.distributed.Group) -> None:
        self.group = group
        self.counters = {"agreements": 0, "agreement_rounds": 0, "agreement_seconds": 0.0,
                         "tokens_given_up_to_group": 0, "fetch_errors": 0}

    def propose(self, n: int, shared: int) -> tuple[int, int, int]:
        """(longest, shortest proposal, shortest ``shared``) over the group's ranks."""
        t0 = time.perf_counter()
        # Ranks run their collectives in the order each stream executes them: the proposal goes
        # on this thread's default stream (where mlx_lm.server and the Scheduler run the model)
        # after mlx-lm's own generation stream has finished, so no rank pairs it with a
        # collective of the model that another rank has not reached.
        mx.synchronize(generation_stream)
        mine = mx.array([n, -n, -shared], dtype=mx.int64)
        seen = mx.distributed.all_max(mine, group=self.group)
        longest, minus_shortest, minus_shared = seen.tolist()
        self.counters["agreement_rounds"] += 1
        self.counters["agreement_seconds"] += time.perf_counter() - t0
        return longest, -minus_shortest, -minus_shared
