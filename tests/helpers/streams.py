"""Request streams in mlx_lm.server's vocabulary (new prompts over two shared system prompts,
continuations of an earlier request and its reply, exact repeats, branches), served through a
prompt cache the way mlx_lm.server's batched path does; used by the differential and the
determinism tests."""

from __future__ import annotations

import copy
import functools
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from helpers.managers import new_manager
from paged_cache.manager import PagedSSDCacheManager
from paged_cache.testing import tiny_model

BLOCK = 16
KEY = ("/models/tiny", None, None)   # the model key mlx_lm.server passes
STEPS = 4                            # greedy decode steps per request (the reply)
# Cold logits this close to a step's best are a tie: a prefill chunked otherwise (a reused cache,
# mlx-lm's own included) rounds differently by ~1e-6 and may take either token there.
TIE = 1e-4
MAX_PROMPT = 8 * BLOCK
SYSTEMS = [random.Random(seed).choices(range(256), k=n) for seed, n in ((1, 37), (2, 52))]
BIG = 1 << 30                        # budgets: nothing is evicted on either side


def open_variant(root: Path, variant: str) -> PagedSSDCacheManager:
    """The manager of a variant: hot-only, or with an SSD tier under ``root``; nothing evicted."""
    ssd = None if variant == "hot" else root / "ssd"
    return new_manager(ssd, block_size=BLOCK, hot_cache_max_bytes=BIG,
                       **({} if ssd is None else dict(ssd_max_bytes=BIG)))


@functools.cache
def model_of(arch: str) -> Any:
    """The tiny random-weight model of ``arch`` (built once per process)."""
    return tiny_model(arch)


# Tried first: three two-turn conversations over one system prompt, an exact repeat, a branch
# inside the first conversation, a conversation over the other system prompt.
SCENARIO = [("new", 0, 30, 1), ("continue", 0, 12, 2), ("new", 0, 25, 3), ("continue", 2, 10, 4),
            ("new", 0, 20, 5), ("continue", 4, 9, 6), ("repeat", 1), ("branch", 1, 500, 6, 7),
            ("new", 1, 12, 8)]


@dataclass
class Req:
    """One request of a stream: the prompt, where its system segment ends, the cold reply."""

    prompt: list[int]
    sys_end: int
    reply: list[int] | None = None
    ties: list[frozenset[int]] | None = None  # per reply step: the tokens tied for the cold best

    def agrees(self, tokens: list[int] | None) -> bool:
        """True when ``tokens`` are the cold reply, or are until a step where they take another
        token tied for the cold run's best (TIE); from there on they follow that token."""
        if tokens is None or self.reply is None or self.ties is None:
            return False
        for got, want, tied in zip(tokens, self.reply, self.ties):
            if got != want:
                return got in tied
        return len(tokens) == len(self.reply)


def fresh(n: int, seed: int) -> list[int]:
    """``n`` random tokens of seed ``seed``."""
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def next_request(op: tuple, history: list[Req], max_prompt: int = MAX_PROMPT) -> Req:
    """The request ``op`` describes, over the requests made so far (refs wrap around)."""
    if not history and op[0] != "new":
        op = ("new", 0, 8, op[-1])
    if op[0] == "new":
        system = SYSTEMS[op[1]]
        return Req(system + fresh(op[2], op[3]), len(system))
    ref = history[op[1] % len(history)]
    if op[0] == "repeat":
        return Req(list(ref.prompt), ref.sys_end)
    if op[0] == "continue":
        prompt = ref.prompt + ref.reply + fresh(op[2], op[3])
        if len(prompt) <= max_prompt:
            return Req(prompt, ref.sys_end)
        op = ("branch", op[1], 999, op[2], op[3])  # too long: branch off its end instead
    cut = max(1, len(ref.prompt) * op[2] // 1000)
    prompt = ref.prompt[:cut] + fresh(op[3], op[4])
    return Req(prompt[:max_prompt], ref.sys_end if cut >= ref.sys_end else 0)


# ---------------------------------------------------------------------------- the server's path


def run_request(model: Any, cache: list, req: Req, cached: int,
                insert: Callable[[list[int], list, str], None] | None = None,
                ties: list[frozenset[int]] | None = None) -> list[int]:
    """Prefill ``req.prompt[cached:]`` segment by segment as mlx_lm.server's batched path does
    (calling ``insert(tokens, cache copy, type)`` at each segment end but the last token), then
    decode STEPS greedy tokens, feeding each; returns them. ``cache`` ends at prompt + reply.
    ``ties``: each step's tokens within TIE of its best logit are appended to it."""
    prompt, last = req.prompt, len(req.prompt) - 1
    ends = sorted({e for e in (req.sys_end, last) if cached < e <= last})
    pos = cached
    for end in ends:
        mx.eval(model(mx.array(prompt[pos:end])[None], cache=cache))
        pos = end
        if insert is not None:
            insert(prompt[:end], copy.deepcopy(cache), "system" if end == req.sys_end else "user")
    tokens, y = [], prompt[-1]
    for _ in range(STEPS):
        logits = model(mx.array([[y]]), cache=cache)[0, -1]
        y = int(mx.argmax(logits).item())
        tokens.append(y)
        if ties is not None:
            row = np.array(logits.astype(mx.float32))
            ties.append(frozenset(np.flatnonzero(row >= row.max() - TIE).tolist()))
    mx.eval(model(mx.array([[y]]), cache=cache))
    return tokens


def serve(prompt_cache: Any, model: Any, req: Req) -> tuple[int, list[int] | None]:
    """One request through ``prompt_cache`` (LRUPromptCache or PagedPromptCache): fetch, run,
    insert; returns (cached tokens, greedy tokens), tokens None when the fetch left nothing to
    feed (the server cannot serve that)."""
    got, rest = prompt_cache.fetch_nearest_cache(KEY, list(req.prompt))
    cached = len(req.prompt) - len(rest)
    if not rest:
        return cached, None
    cache = got if got is not None else make_prompt_cache(model)

    def insert(tokens: list[int], live: list, cache_type: str) -> None:
        prompt_cache.insert_cache(KEY, list(tokens), live, cache_type=cache_type)

    tokens = run_request(model, cache, req, cached, insert)
    prompt_cache.insert_cache(KEY, req.prompt + tokens, cache, cache_type="assistant")
    return cached, tokens


def cold(model: Any, req: Req, memo: dict) -> None:
    """Set ``req.reply`` and ``req.ties`` from the cold run's greedy reply (memoized in
    ``memo``)."""
    key = (tuple(req.prompt), req.sys_end)
    if key not in memo:
        ties: list[frozenset[int]] = []
        memo[key] = run_request(model, make_prompt_cache(model), req, 0, ties=ties), ties
    req.reply, req.ties = memo[key]
