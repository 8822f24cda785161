"""The check every engine test makes: one run of the chat workload with paged-cache against the
same requests served by the engine's own cache and by a cold run (no cache)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Callable

import pytest

from paged_cache.testing.engines import (REQUEST_SECONDS, EngineServer, Turn, chat, openai_client,
                                         start_all)

# A KV model, a hybrid (recurrent + attention) and a sliding-window one.
ARCHS = ("llama", "qwen3_next", "gemma3_text")
# The cache flags of a run whose reuse is compared with the engine's own: the tokens counted are
# what the cache restores, not what the default (cost) fetch plan chooses to restore, which may
# prefill a last block's few tokens instead of reading it when the measured rates say so.
RESTORE = ("--fetch-policy", "always-restore")


def same_requests(own: list[Turn], cold: list[Turn]) -> list[bool]:
    """Per request: True while every earlier reply of its conversation (and its own) equals the
    cold run's, i.e. the engine's own cache answered the same request with the same reply."""
    out, ok = [], {}
    for o, c in zip(own, cold, strict=True):
        ok[o.conversation] = ok.get(o.conversation, True) and o.reply == c.reply
        out.append(ok[o.conversation])
    return out


def check_reuse(paged: list[Turn], own: list[Turn], cold: list[Turn]) -> tuple[int, int]:
    """Every paged-cache reply equals the cold run's; on every request the engine's own cache
    answered like the cold run, paged-cache reused at least as many tokens. Returns the total
    cached tokens (paged-cache, own cache) over those requests."""
    assert [t.reply for t in paged] == [t.reply for t in cold], \
        "paged-cache changed a greedy reply (cold run vs paged-cache)"
    assert [t.prompt_tokens for t in paged] == [t.prompt_tokens for t in cold]
    totals = [0, 0]
    for p, o, same in zip(paged, own, same_requests(own, cold)):
        if not same:
            continue
        assert p.cached_tokens >= o.cached_tokens, \
            f"conversation {p.conversation} turn {p.turn}: paged-cache reused {p.cached_tokens} " \
            f"tokens, the engine's own cache {o.cached_tokens}"
        totals[0] += p.cached_tokens
        totals[1] += o.cached_tokens
    return totals[0], totals[1]


def first_turns_together(url: str, model: str, history: dict, conversations: int = 2,
                         cached: Callable[[Any], int | None] = lambda _usage: None) -> list[Turn]:
    """Turn 0 of each conversation, all sent at once (the engine batches them); ``history``
    (keyed by conversation) is updated for the next turns."""
    out: dict[int, list[Turn]] = {}

    def one(c: int) -> None:
        out[c] = chat(url, model, conversations=1, first_conversation=c, turns=1,
                      history=history, cached=cached)

    threads = [threading.Thread(target=one, args=(c,)) for c in range(conversations)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=2 * REQUEST_SECONDS)
    assert len(out) == conversations, "a concurrent request did not finish"
    return [out[c][0] for c in range(conversations)]


def drop_a_stream(url: str, model: str) -> None:
    """Start a long stream and go away after its first chunk (the engine must cancel it).
    Greedy, as the requests around it: vllm-mlx applies another sampler only once its running
    batch drains, so a request right after a sampled one may be sampled like it."""
    stream = openai_client(url).chat.completions.create(
        model=model, messages=[{"role": "user", "content": "A long answer. " * 30}],
        max_tokens=4000, temperature=0.0, stream=True)
    next(iter(stream))
    stream.close()


Reference = Callable[[str], tuple[list[Turn], list[Turn]]]


def references(tmp_path_factory: pytest.TempPathFactory,
               start: Callable[[str, Path, str, tuple[str, ...]], EngineServer],
               play: Callable[[EngineServer, str], list[Turn]], cold: tuple[str, ...]) -> Reference:
    """``reference(arch)`` -> (cold run, own-cache run) of the workload: ``start(arch, workdir,
    name, extra options)`` makes the plain engine (``cold``: its options for no cache), ``play``
    runs the workload on it. Each computed once, on first use, both servers at once."""
    done: dict[str, tuple[list[Turn], list[Turn]]] = {}

    def get(arch: str) -> tuple[list[Turn], list[Turn]]:
        if arch not in done:
            work = tmp_path_factory.mktemp(f"reference-{arch}")
            servers = [start(arch, work / "cold", "cold", cold), start(arch, work / "own", "own", ())]
            start_all(servers)
            try:
                done[arch] = play(servers[0], arch), play(servers[1], arch)
            finally:
                for server in servers:
                    server.stop()
        return done[arch]

    return get
