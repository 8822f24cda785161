"""A RESTATEMENT, not exo's code: how exo's callers use their prefix cache, written from exo's
source at commit b5375f8 (version 0.3.70) so the adapter's logic (paged_cache.integrations.exo.
prefix) is tested on Python 3.11 without exo (tests/test_exo_restated.py). The real callers run
in tests/engines/test_exo.py. Each function names the exo file it restates; the order of calls,
their arguments and what is done with the results follow it, with exo's logging, stats, vision,
remote prefill and pipeline branches left out (none is taken in these tests).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models.cache import ArraysCache, RotatingKVCache

PREFILL_STEP = 4096          # generate.py prefill: prefill_step_size
MIN_PREFIX_HIT = 1000        # generate.py / batch_generate.py: max(1000, system prompt tokens)
MIN_HIT_RATIO = 0.5          # _MIN_PREFIX_HIT_RATIO_TO_UPDATE


def greedy(logprobs: mx.array) -> mx.array:
    """make_sampler(temp=0.0): argmax."""
    return mx.argmax(logprobs, axis=-1)


def non_trimmable(layer: Any) -> bool:
    """cache.py is_non_trimmable_cache_entry, for the layer types of these tests."""
    return isinstance(layer, (ArraysCache, RotatingKVCache))


def _state_copy(cache: list) -> list:
    """cache.py snapshot_ssm_states: the recurrent layers' state (their arrays are replaced, never
    written in place, by an update: holding them is a copy), None for the others."""
    out = []
    for layer in cache:
        if isinstance(layer, ArraysCache):
            copy = ArraysCache(len(layer.cache))
            copy.cache = list(layer.cache)
            out.append(copy)
        else:
            out.append(None)
    return out


def cache_length(cache: list) -> int:
    """cache.py cache_length: the largest offset of the cache's layers."""
    return max((getattr(c, "offset", 0) for c in cache), default=0)


def prefill(model: Any, tokens: mx.array, cache: list) -> tuple[float, int, list]:
    """generate.py ``prefill``: mlx-lm's stream_generate over ``tokens`` with max_tokens=1 (its
    generate_step, without the detokenizer), snapshots of the recurrent layers at each progress
    callback, then ``trim(2)`` of the trimmable layers and the snapshot before the last restored
    into the others. Returns ``(tps, tokens, snapshots[:-1])``; a snapshot is ``(token_count,
    states)``."""
    n = len(tokens)
    if n == 0:
        return 0.0, 0, []
    has_ssm = any(non_trimmable(c) for c in cache)
    snapshots: list = []

    def progress(_processed: int, _total: int) -> None:
        if has_ssm:
            snapshots.append((cache_length(cache), _state_copy(cache)))

    for _ in generate_step(tokens, model, max_tokens=1, sampler=greedy, prompt_cache=cache,
                           prefill_step_size=PREFILL_STEP, prompt_progress_callback=progress):
        break
    pre_gen = snapshots[-2] if has_ssm else None
    for i, c in enumerate(cache):
        if has_ssm and non_trimmable(c):
            cache[i] = pre_gen[1][i]
        else:
            c.trim(2)
    return 1.0, n, snapshots[:-1]


def _store(kv: Any, all_tokens: mx.array, cache: list, snapshots: list, hit: int,
           matched: int | None, tps: float, min_hit: int = MIN_PREFIX_HIT) -> None:
    """generate.py mlx_generate / batch_generate.py _save_prefix_cache: update the matched entry
    on a large enough hit, else add a new one."""
    ratio = hit / len(all_tokens) if len(all_tokens) else 0.0
    if matched is not None and hit >= min_hit and ratio >= MIN_HIT_RATIO:
        kv.update_kv_cache(matched, all_tokens, cache, snapshots or None, restore_pos=hit,
                           media_regions=[], prefill_tps=tps)
    else:
        kv.add_kv_cache(all_tokens, cache, snapshots or None, media_regions=[], prefill_tps=tps)


@dataclass
class Served:
    """What a caller did: the greedy reply, exo's cached-token count (prompt - remaining), and
    of the cache it handed to add/update: its token count, its snapshots' token counts and a
    deep copy taken then (the reference a later restore must equal)."""

    reply: list[int]
    cached: int
    stored_tokens: int = 0
    snapshots: list[int] = field(default_factory=list)
    stored: list = field(default_factory=list)


def _served(reply: list[int], hit: int, cache: list, snapshots: list) -> Served:
    return Served(reply, hit, cache_length(cache), [s[0] for s in snapshots],
                  copy.deepcopy(list(cache)))


def mlx_generate(model: Any, kv: Any, make_cache: Any, tokens: list[int],
                 max_tokens: int) -> Served:
    """generator/generate.py ``mlx_generate``: get_kv_cache, prefill of ``remaining[:-1]``, the
    exact hit's ``prefill_tps[matched_index]``, update/add, then stream_generate from the last two
    tokens with prefill_step_size=1."""
    all_tokens = mx.array(tokens)
    if kv is None:
        cache, prompt, matched, exact = make_cache(), all_tokens, None, False
    else:
        cache, prompt, matched, exact = kv.get_kv_cache(model, all_tokens, media_regions=[])
    hit = len(all_tokens) - len(prompt)
    tps, _, snapshots = prefill(model, prompt[:-1], cache)
    if kv is not None and matched is not None and exact:
        tps = kv.prefill_tps[matched]
    served = _served([], hit, cache, snapshots)
    if kv is not None:
        _store(kv, all_tokens, cache, snapshots, hit, matched, tps)
    served.reply = [int(t) for t, _ in generate_step(prompt[-2:], model, max_tokens=max_tokens,
                                              sampler=greedy, prompt_cache=cache,
                                              prefill_step_size=1)]
    return served


def batch_submit(model: Any, kv: Any, make_cache: Any, tokens: list[int],
                 max_tokens: int) -> Served:
    """generator/batch_generate.py ``ExoBatchGenerator.submit`` then ``step`` until done:
    get_kv_cache, prefill, the exact hit's rate, _save_prefix_cache(list(cache)), then mlx-lm's
    BatchGenerator given the last two tokens and the cache."""
    all_tokens = mx.array(tokens)
    if kv is not None:
        cache, remaining, matched, exact = kv.get_kv_cache(model, all_tokens, media_regions=[])
        hit = len(all_tokens) - len(remaining)
        prompt = remaining if hit > 0 else all_tokens
    else:
        cache, prompt, matched, exact, hit = make_cache(), all_tokens, None, False, 0
    tps, _, snapshots = prefill(model, prompt[:-1], cache)
    if matched is not None and hit > 0 and exact:
        tps = kv.prefill_tps[matched]
    served = _served([], hit, cache, snapshots)
    if kv is not None:
        _store(kv, all_tokens, list(cache), snapshots, hit, matched, tps)
    gen = BatchGenerator(model, stop_tokens=[], prefill_step_size=PREFILL_STEP)
    (uid,) = gen.insert(prompts=[prompt[-2:].tolist()], max_tokens=[max_tokens],
                        caches=[list(cache)], samplers=[greedy])
    reply: list[int] = []
    while len(reply) < max_tokens:
        for r in gen.next_generated():
            assert r.uid == uid
            reply.append(int(r.token))
    gen.close()
    served.reply = reply
    return served


def prefill_server(model: Any, kv: Any, make_cache: Any, tokens: list[int]) -> Served:
    """disaggregated/serve.py ``run_prefill_for_request``: get_kv_cache (no media), prefill of
    the remaining tokens up to ``n - 2``, one snapshot of the end state, update on a hit of at
    least half the prompt, else add; the cache goes to the decoding node (no reply here)."""
    all_tokens = mx.array(tokens)
    n = len(tokens)
    matched, hit = None, 0
    if kv is not None:
        cache, remaining, matched, _ = kv.get_kv_cache(model, all_tokens)
        hit = n - len(remaining)
    else:
        cache, remaining = make_cache(), all_tokens
    new = max(0, max(0, n - 2) - hit)
    if new > 0:
        prefill(model, remaining[:new], cache)
    snapshots = [(cache_length(cache), _state_copy(cache))]
    served = _served([], hit, cache, snapshots)
    if kv is not None:
        if matched is not None and (hit / n if n else 0.0) >= MIN_HIT_RATIO:
            kv.update_kv_cache(matched, all_tokens, cache, snapshots, restore_pos=hit)
        else:
            kv.add_kv_cache(all_tokens, cache, snapshots)
    return served


class OwnReuse:
    """cache.py ``KVPrefixCache.get_kv_cache``'s choice of where to restore, restated for the
    reuse comparison (its copies are not made): the longest stored prompt match; exact at
    ``>= len - 1``; a KV model restores ``min(cached length, len - 1 if exact else match)``; one
    with recurrent layers the nearest snapshot at or before the match, else nothing."""

    def __init__(self, hybrid: bool) -> None:
        self.hybrid = hybrid
        self.entries: list[tuple[np.ndarray, int, list[int]]] = []

    def reuse(self, tokens: list[int]) -> int:
        query = np.asarray(tokens)
        best, best_len, exact = None, 0, False
        for i, (prompt, _, _) in enumerate(self.entries):
            m = min(len(query), len(prompt))
            diff = np.nonzero(query[:m] != prompt[:m])[0]
            length = int(diff[0]) if len(diff) else m
            if length >= len(query) - 1:
                best, best_len, exact = i, length, True
                break
            if length > best_len:
                best, best_len = i, length
        if best is None:
            return 0
        _, cached, snaps = self.entries[best]
        if not self.hybrid:
            return min(cached, len(query) - 1 if exact else best_len)
        return max((s for s in snaps if s <= best_len), default=0)

    def stored(self, tokens: list[int], cache_tokens: int, snapshot_counts: list[int]) -> None:
        """A store of the caller (add or update: the reuse rule reads the newest entry alike)."""
        self.entries.append((np.asarray(tokens), cache_tokens, snapshot_counts))
