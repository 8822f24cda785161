"""Differential: PagedPromptCache against mlx-lm's LRUPromptCache on the same request streams.

Both caches see the same random streams (new prompts over two shared system prompts,
continuations of an earlier request and its reply, exact repeats, branches at random points of an
earlier request), fetched and inserted where mlx_lm.server's batched path does it: one fetch, an
insert at the end of the system segment and of the user segment (the prompt but its last token),
and one at the end of the request (prompt + reply). Budgets are large enough that neither evicts.

Asserted per request: paged-cache never caches fewer tokens than LRUPromptCache where
LRUPromptCache's reuse gives the cold run's greedy tokens, and paged-cache's own greedy tokens
always equal a cold run's. Variants: hot tier only, with the SSD tier, and across a restart
(the manager is closed and reopened on the same directory halfway through the stream). The
windowed layouts (gemma3_text, llama4) also get repeat-heavy streams with prompts up to 12 blocks.
"""

from __future__ import annotations

import copy
import functools
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache

from paged_cache.integrations.mlx_lm import PagedPromptCache
from paged_cache.manager import PagedSSDCacheManager
from paged_cache.testing import ARCHS as TINY_ARCHS
from paged_cache.testing import tiny_model
from helpers.managers import new_manager

BLOCK = 16
KEY = ("/models/tiny", None, None)   # the model key mlx_lm.server passes
STEPS = 4                            # greedy decode steps per request (the reply)
MAX_PROMPT = 8 * BLOCK
SYSTEMS = [random.Random(seed).choices(range(256), k=n) for seed, n in ((1, 37), (2, 52))]
BIG = 1 << 30                        # budgets: nothing is evicted on either side

ARCHS = [a for a in ("llama", "gemma3_text", "qwen3_next", "mamba", "baichuan_m1", "llama4",
                     "nemotron_h", "falcon_h1", "granitemoehybrid", "jamba", "lfm2", "deepseek_v41")
         if a in TINY_ARCHS]   # deepseek_v41: mlx-lm 0.32 on
VARIANTS = ["hot", "ssd", "restart"]


def open_variant(root: Path, variant: str) -> PagedSSDCacheManager:
    """The manager of a variant: hot-only, or with an SSD tier under ``root``; nothing evicted."""
    ssd = None if variant == "hot" else root / "ssd"
    return new_manager(ssd, block_size=BLOCK, hot_cache_max_bytes=BIG,
                       **({} if ssd is None else dict(ssd_max_bytes=BIG)))


RECURRENT = ["qwen3_next", "mamba", "baichuan_m1", "nemotron_h", "falcon_h1", "granitemoehybrid",
             "jamba", "lfm2"]


COLD: dict[str, dict] = {}   # arch -> (prompt, system end) -> cold greedy tokens


@functools.cache
def _model(arch: str) -> Any:
    return tiny_model(arch)


# ---------------------------------------------------------------------------- request streams

_seed = st.integers(0, 2**16)
_ref = st.integers(0, 63)
_ops = st.one_of(
    st.tuples(st.just("new"), st.integers(0, len(SYSTEMS) - 1), st.integers(2, 40), _seed),
    st.tuples(st.just("continue"), _ref, st.integers(2, 24), _seed),
    st.tuples(st.just("repeat"), _ref),
    st.tuples(st.just("branch"), _ref, st.integers(1, 999), st.integers(1, 20), _seed),
)
STREAMS = st.lists(_ops, min_size=6, max_size=10)
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


def _fresh(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def _next_request(op: tuple, history: list[Req], max_prompt: int = MAX_PROMPT) -> Req:
    """The request ``op`` describes, over the requests made so far (refs wrap around)."""
    if not history and op[0] != "new":
        op = ("new", 0, 8, op[-1])
    if op[0] == "new":
        system = SYSTEMS[op[1]]
        return Req(system + _fresh(op[2], op[3]), len(system))
    ref = history[op[1] % len(history)]
    if op[0] == "repeat":
        return Req(list(ref.prompt), ref.sys_end)
    if op[0] == "continue":
        prompt = ref.prompt + ref.reply + _fresh(op[2], op[3])
        if len(prompt) <= max_prompt:
            return Req(prompt, ref.sys_end)
        op = ("branch", op[1], 999, op[2], op[3])  # too long: branch off its end instead
    cut = max(1, len(ref.prompt) * op[2] // 1000)
    prompt = ref.prompt[:cut] + _fresh(op[3], op[4])
    return Req(prompt[:max_prompt], ref.sys_end if cut >= ref.sys_end else 0)


# ---------------------------------------------------------------------------- the server's path


def _run(model: Any, cache: list, req: Req, cached: int,
         insert: Callable[[list[int], list, str], None] | None = None) -> list[int]:
    """Prefill ``req.prompt[cached:]`` segment by segment as mlx_lm.server's batched path does
    (calling ``insert(tokens, cache copy, type)`` at each segment end but the last token), then
    decode STEPS greedy tokens, feeding each; returns them. ``cache`` ends at prompt + reply."""
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
        logits = model(mx.array([[y]]), cache=cache)
        y = int(mx.argmax(logits[0, -1]).item())
        tokens.append(y)
    mx.eval(model(mx.array([[y]]), cache=cache))
    return tokens


def _serve(prompt_cache: Any, model: Any, req: Req) -> tuple[int, list[int] | None]:
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

    tokens = _run(model, cache, req, cached, insert)
    prompt_cache.insert_cache(KEY, req.prompt + tokens, cache, cache_type="assistant")
    return cached, tokens


def _cold(model: Any, req: Req, memo: dict) -> list[int]:
    key = (tuple(req.prompt), req.sys_end)
    if key not in memo:
        memo[key] = _run(model, make_prompt_cache(model), req, 0)
    return memo[key]


def drive(model: Any, variant: str, ops: list[tuple], memo: dict,
          max_prompt: int = MAX_PROMPT) -> tuple[list, list]:
    """Drive ``ops`` through LRUPromptCache and PagedPromptCache. Returns one row per request
    (index, kind, prompt length, LRU cached, LRU tokens exact, paged cached) and the requests
    whose paged-cache greedy tokens differ from the cold run's."""
    lru = LRUPromptCache(max_size=10_000)
    history: list[Req] = []
    rows, wrong = [], []
    with tempfile.TemporaryDirectory() as tmp:
        manager = open_variant(Path(tmp), variant)
        paged = PagedPromptCache.for_model(manager, model)
        try:
            for i, op in enumerate(ops):
                if variant == "restart" and i == len(ops) // 2:
                    manager.close()
                    manager = open_variant(Path(tmp), variant)
                    paged = PagedPromptCache.for_model(manager, model)
                req = _next_request(op, history, max_prompt)
                req.reply = _cold(model, req, memo)
                history.append(req)
                n_lru, t_lru = _serve(lru, model, req)
                n_paged, t_paged = _serve(paged, model, req)
                rows.append((i, op[0], len(req.prompt), n_lru, t_lru == req.reply, n_paged))
                if t_paged != req.reply:
                    wrong.append((i, op[0], n_paged, t_paged, req.reply))
            assert paged.store_errors == 0
        finally:
            manager.close()
    return rows, wrong


def check_stream(model: Any, variant: str, ops: list[tuple], memo: dict,
                 max_prompt: int = MAX_PROMPT) -> None:
    """Assert paged-cache's reuse (>= LRUPromptCache's where that is exact) and exactness."""
    rows, wrong = drive(model, variant, ops, memo, max_prompt)
    short = [r for r in rows if r[4] and r[5] < r[3]]
    table = "\n".join(f"  #{i} {kind:8} prompt {n:3}: LRUPromptCache {a:3} "
                      f"({'exact' if ok else 'WRONG'}), paged-cache {b:3}"
                      for i, kind, n, a, ok, b in rows)
    assert not wrong, f"paged-cache's greedy tokens differ from a cold run's: {wrong}\n{table}"
    shortfall = [r[3] - r[5] for r in short]
    assert not short, (f"paged-cache cached fewer tokens than LRUPromptCache on {len(short)} "
                       f"requests (shortfall {shortfall}):\n{table}")


def _cases(long: bool = False) -> list:
    marks = [pytest.mark.long] if long else []
    return [pytest.param(arch, variant, id=f"{arch}-{variant}", marks=marks)
            for arch in ARCHS for variant in VARIANTS]


# Repeat-heavy streams for the windowed layouts: conversations continued turn after turn up to
# 12 blocks (past gemma3_text's 64-token window and many of llama4's 32-token chunks), exact
# repeats of them, branches near their ends.
REPEAT_PROMPT = 12 * BLOCK
REPEATS = st.lists(st.one_of(_ops, st.tuples(st.just("continue"), _ref, st.integers(2, 24), _seed),
                             st.tuples(st.just("repeat"), _ref), st.tuples(st.just("repeat"), _ref)),
                   min_size=8, max_size=14)
# Tried first: a 77-token prompt continued to 101, 118 and 143 tokens with a repeat after each
# turn, a branch near the end of the longest, repeats of earlier turns, and a second
# conversation over the other system prompt.
REPEAT_SCENARIO = [("new", 0, 40, 1), ("continue", 0, 20, 2), ("repeat", 1), ("continue", 1, 13, 3),
                   ("repeat", 3), ("continue", 3, 21, 4), ("repeat", 5), ("branch", 5, 900, 5, 5),
                   ("repeat", 3), ("new", 1, 30, 6), ("continue", 9, 30, 7), ("repeat", 10),
                   ("repeat", 5)]

_SETTINGS = dict(deadline=None, derandomize=True, database=None,
                 phases=[Phase.explicit, Phase.generate],   # no shrinking: the table says enough
                 suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("arch, variant", _cases())
@settings(max_examples=6, **_SETTINGS)
@given(ops=STREAMS)
@example(ops=SCENARIO)
def test_paged_reuses_at_least_lru_and_is_exact(arch, variant, ops):
    check_stream(_model(arch), variant, ops, COLD.setdefault(arch, {}))


@pytest.mark.parametrize("arch, variant", _cases(long=True))
@settings(max_examples=25, **_SETTINGS)
@given(ops=STREAMS)
@example(ops=SCENARIO)
def test_paged_reuses_at_least_lru_and_is_exact_long(arch, variant, ops):
    check_stream(_model(arch), variant, ops, COLD.setdefault(arch, {}))


@pytest.mark.parametrize("arch, variant", [pytest.param(a, v, id=f"{a}-{v}")
                                           for a in ("llama4", "gemma3_text") for v in VARIANTS])
@settings(max_examples=3, **_SETTINGS)
@given(ops=REPEATS)
@example(ops=REPEAT_SCENARIO)
def test_repeat_heavy_streams_on_windowed_layouts(arch, variant, ops):
    check_stream(_model(arch), variant, ops, COLD.setdefault(arch, {}), REPEAT_PROMPT)
