"""Decode loops: one sequence at a time, or batched through mlx-lm's BatchGenerator.

Both produce, per step, one token per decoding request and say how many tokens of the request's
sequence the cache then covers (``covered``), so the engine knows where block boundaries fall.
"""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache

from paged_cache import compat
from paged_cache.scheduler.request import Request


def is_batchable(cache: list[Any]) -> bool:
    """True when BatchGenerator can merge every layer and give it back as the same class.

    That holds for mlx-lm's KVCache, ArraysCache, CacheList of those, and RotatingKVCache with
    ``keep == 0`` (``BatchRotatingKVCache`` has no attention-sink rows). Subclasses such as
    PreallocatedRotatingKVCache would come back as their base class, so they decode one by one.
    """

    def ok(layer: Any) -> bool:
        if type(layer) is CacheList:
            return all(ok(member) for member in layer.caches)
        if type(layer) is RotatingKVCache:
            return layer.keep == 0
        return type(layer) in (KVCache, ArraysCache)

    return all(ok(layer) for layer in cache)


class SequentialDecoder:
    """Decodes each request on its own cache: the computation of mlx-lm's ``generate_step``."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._active: dict[int, tuple[Request, int]] = {}   # id -> (request, next input token)

    def add(self, req: Request) -> None:
        self._active[req.id] = (req, req.prompt[-1])

    def step(self) -> list[tuple[Request, int | BaseException]]:
        """One token for every request (or the exception its step raised); ``req.covered`` then
        counts the token just fed."""
        out: list[tuple[Request, int | BaseException]] = []
        for req, token in list(self._active.values()):
            try:
                logits = self.model(mx.array([[token]]), cache=req.cache)[:, -1, :]
                logprobs = logits - mx.logsumexp(logits, keepdims=True)
                nxt = int((req.sampler or compat.GREEDY)(logprobs).item())
            except Exception as exc:  # reported per request: the others keep decoding
                out.append((req, exc))
                continue
            req.covered += 1
            self._active[req.id] = (req, nxt)
            out.append((req, nxt))
        return out

    def cache_of(self, req: Request) -> list[Any]:
        return req.cache

    def remove(self, req: Request, *, keep_cache: bool = True) -> None:
        """Stop decoding ``req``; with ``keep_cache`` its cache stays in ``req.cache``."""
        self._active.pop(req.id, None)
        if not keep_cache:
            req.cache = None

    def reset(self) -> list[Request]:
        lost = [req for req, _ in self._active.values()]
        self._active = {}
        return lost

    def __len__(self) -> int:
        return len(self._active)


class BatchDecoder:
    """Decodes all requests together through mlx-lm's ``BatchGenerator`` (continuous batching).

    The request's cache is handed to the generator on ``add`` and comes back in ``req.cache``
    on ``remove``. BatchGenerator feeds a token before reporting it, so after a step the cache
    covers every token reported so far.
    """

    def __init__(self, model: nn.Module, max_batch: int) -> None:
        self.model = model
        self.max_batch = max_batch
        self._gen: Optional[BatchGenerator] = None
        self._by_uid: dict[int, Request] = {}
        self._uid: dict[int, int] = {}            # request id -> uid
        self._finished: dict[int, list[Any]] = {}  # request id -> cache the generator gave back

    def _generator(self) -> BatchGenerator:
        if self._gen is None:
            # on this thread's default stream, like the prefill: the ranks of a sharded model
            # then run the model's collectives (and a fetch's agreement) in one order
            self._gen = BatchGenerator(self.model, completion_batch_size=self.max_batch,
                                       prefill_batch_size=self.max_batch,
                                       stream=mx.default_stream(mx.default_device()))
        return self._gen

    def add(self, req: Request) -> None:
        (uid,) = self._generator().insert(
            [[req.prompt[-1]]], max_tokens=[req.max_tokens], caches=[req.cache],
            **compat.batch_options(req.sampler, req.stop_tokens))
        req.cache = None
        req.covered += 1  # the generator feeds the last prompt token before its first report
        self._by_uid[uid] = req
        self._uid[req.id] = uid

    def step(self) -> list[tuple[Request, int]]:
        if not self._by_uid:
            return []
        out = []
        for response in self._generator().next_generated():
            req = self._by_uid[response.uid]
            req.covered += 1
            if response.finish_reason is not None:
                self._finished[req.id] = response.prompt_cache
            out.append((req, int(response.token)))
        return out

    def cache_of(self, req: Request) -> list[Any]:
        """The request's cache as a per-sequence list (lazy slices of the batch cache)."""
        if req.id in self._finished:
            return self._finished[req.id]
        uid = self._uid[req.id]
        return self._generator().extract_cache([uid])[uid][0]

    def remove(self, req: Request, *, keep_cache: bool = True) -> None:
        """Stop decoding ``req``; with ``keep_cache`` its cache comes back in ``req.cache``."""
        uid = self._uid.pop(req.id, None)
        if uid is None:
            return
        self._by_uid.pop(uid)
        cache = self._finished.pop(req.id, None)
        if cache is None:
            caches = self._generator().remove([uid], return_prompt_caches=keep_cache)
            cache = caches[uid][0] if keep_cache else None
        req.cache = cache if keep_cache else None

    def reset(self) -> list[Request]:
        """Drop the generator (after an error in it); returns the requests it was decoding."""
        lost = list(self._by_uid.values())
        if self._gen is not None:
            self._gen.close()
        self._gen, self._by_uid, self._uid, self._finished = None, {}, {}, {}
        return lost

    def __len__(self) -> int:
        return len(self._by_uid)
