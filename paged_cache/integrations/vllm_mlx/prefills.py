"""Chats opening together on vllm-mlx share one prefill of their common prefix.

vllm-mlx's Scheduler fetches a request's cache when it admits it and stores one when the request
ends (and, for a cache it cannot trim, after its prefill); nothing stores a system prompt while
it is prefilled, so eight chats opening at once over one system prompt prefill it eight times in
one batch. Here, as in ``paged-cache serve`` (``SharedPrefills`` decides who waits), a request
whose chat prefix (vllm-mlx's ``prefix_boundary``: its prompt before the last user message) the
cache lacks by a block *leads*: its prompt goes to the BatchGenerator in two segments split
there, and the cache at the first segment's end is inserted. A later request sharing that prefix
is admitted with no fetch and kept out of the Scheduler's rounds until an insert covers it, its
leader's prompt is done or ``MAX_WAIT_SECONDS`` passed; it is then admitted again, and its fetch
restores the prefix. Everything runs on the engine's worker thread; an error is logged, counted
and never raised into it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Hashable

from paged_cache.integrations.vllm_mlx import compat
from paged_cache.integrations.mlx_lm import PagedPromptCache
from paged_cache.integrations.shared.prefills import SharedPrefills, Tokenized

logger = logging.getLogger("paged_cache.integrations.vllm_mlx")

# Splits and segment ends remembered at most (requests that never reached the generator, or left
# it before their segment's end): beyond, the oldest goes.
MAX_PENDING = 256


@dataclass(eq=False)
class _Split:
    """A leader's prompt to split at ``boundary``: the Scheduler inserts ``rest`` (the tokens
    its fetch left) or ``prompt`` (when it drops the fetched cache)."""

    prompt: list[int]
    rest: list[int]
    boundary: int


class SchedulerPrefills:
    """Shared prefills for one Scheduler's prefix cache ``cache`` (stored under ``model_key``);
    ``enabled`` False: every request is admitted at once and no prompt is split."""

    def __init__(self, cache: PagedPromptCache, model_key: Hashable, *, enabled: bool) -> None:
        self._cache, self._key = cache, model_key
        self._min = cache.manager.config.block_size
        self.sharing = SharedPrefills(
            self._segments, lambda tokens, salt: cache.reach(model_key, tokens, salt),
            cache.counters, min_tokens=self._min, enabled=enabled)
        cache.on_insert = self.sharing.inserted
        self._held: dict[int, Any] = {}       # id(request) -> a request kept out of the rounds
        self._live: dict[int, Any] = {}       # id(request) -> admitted, its prompt not done
        self._splits: dict[int, _Split] = {}  # id(request) -> its prompt's split, not inserted
        self._readmitting: Any = None

    @property
    def enabled(self) -> bool:
        return self.sharing.enabled

    @staticmethod
    def _segments(request: Any, _args: Any) -> Tokenized:
        """A request's prompt and its chat prefix's end, where its leader inserts."""
        tokens = list(request.prompt_token_ids)
        boundary = compat.prefix_boundary(request)
        return tokens, [boundary] if 0 < boundary < len(tokens) else []

    # ------------------------------------------------------------------ admission (the fetch)

    def hold(self, request: Any) -> bool:
        """Whether the Scheduler admitting ``request`` (None: not known) must hold it back, its
        fetch left for later; a request admitted again (``held``) never is."""
        if request is None or not self.enabled:
            return False
        if request is not self._readmitting and self.sharing.admit((None, request, request)):
            self._held[id(request)] = request
            return True
        self._live[id(request)] = request
        return False

    def fetched(self, request: Any, prompt: list[int], rest: list[int]) -> None:
        """``request``'s fetch restored ``prompt`` but ``rest``: when its chat prefix's end lies
        a block or more past that, its prompt is split there when the Scheduler inserts it."""
        if request is None or not self.enabled:
            return
        boundary = compat.prefix_boundary(request)
        if boundary < len(prompt) and boundary - (len(prompt) - len(rest)) >= self._min:
            _bounded(self._splits)[id(request)] = _Split(prompt, rest, boundary)

    # ------------------------------------------------------------------ each round of admission

    def held(self, scheduler: Any) -> list[Any]:
        """Before a round of ``scheduler``: tell the requests whose prompt is done, admit again
        those whose wait is over; the requests still held back."""
        for key, request in list(self._live.items()):
            if compat.prompt_done(scheduler, request):
                del self._live[key]
                self._splits.pop(key, None)
                self.sharing.prompt_done(request)
        while (queued := self.sharing.ready()) is not None:
            request = queued[1]
            self._held.pop(id(request), None)
            self._readmitting = request
            try:
                if not compat.readmit(scheduler, request):
                    self.sharing.prompt_done(request)   # aborted while held
            finally:
                self._readmitting = None
        return list(self._held.values())

    # ------------------------------------------------------------------ the BatchGenerator

    def split_prompts(self, generator: Any) -> None:
        """Make ``generator`` (the Scheduler's BatchGenerator) take a leader's prompt in two
        segments and insert the cache at the first one's end; left alone when it cannot."""
        if not self.enabled or not compat.splits_prompts(generator):
            return
        insert, step = generator.insert, generator.next
        ends: dict[int, list[int]] = {}   # its uid -> the prefix its first segment ends at

        def split_insert(prompts: list, *args: Any, **kwargs: Any) -> Any:
            split = self._split_of(prompts)
            if split is None:
                return insert(prompts, *args, **kwargs)
            tokens, (prefix, cut) = prompts[0], split
            uids = generator.insert_segments([[tokens[:cut], tokens[cut:]]], *args, **kwargs)
            _bounded(ends)[uids[0]] = prefix
            return uids

        def next_step(*args: Any, **kwargs: Any) -> Any:
            out = step(*args, **kwargs)
            if ends and isinstance(out, tuple):
                self._insert_ends(generator, ends, out[0])
            return out

        generator.insert, generator.next = split_insert, next_step

    def _split_of(self, prompts: list) -> tuple[list[int], int] | None:
        """When the one prompt ``prompts`` holds is a leader's (the very list its fetch left, or
        its whole prompt), its split, taken: the chat prefix and where it ends in that list;
        else None."""
        if len(prompts) != 1 or not self._splits:
            return None
        tokens = prompts[0]
        for key, split in self._splits.items():
            if tokens is split.rest or tokens is split.prompt:
                del self._splits[key]
                cut = split.boundary - (len(split.prompt) - len(tokens))
                return (split.prompt[:split.boundary], cut) if 0 < cut < len(tokens) else None
        return None

    def _insert_ends(self, generator: Any, ends: dict[int, list[int]], responses: list) -> None:
        """Insert the cache of each leader of ``generator`` (``ends``: its uids and prefixes)
        whose first segment ``responses`` (a step's prompt responses) ended."""
        for response in responses:
            if not getattr(response, "end_of_segment", False) or \
                    getattr(response, "end_of_prompt", False):
                continue
            prefix = ends.pop(response.uid, None)
            if prefix is None:
                continue
            try:
                cache = generator.extract_cache([response.uid])[response.uid][0]
                self._cache.insert_cache(self._key, prefix, cache, cache_type="system")
            except Exception as error:  # noqa: BLE001 - never into the engine's loop
                self._cache.counters["store_errors"] += 1
                logger.error("shared prefill: the insert at %d tokens failed: %r", len(prefix),
                             error)


def _bounded(table: dict) -> dict:
    """``table``, its oldest entries dropped to leave room for one more under MAX_PENDING."""
    while len(table) >= MAX_PENDING:
        table.pop(next(iter(table)))
    return table
