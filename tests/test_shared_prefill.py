"""Requests arriving together with a prefix nobody has cached: one prefills it, the others wait
for its insert and restore it (``SharedPrefills``, paged_cache/integrations/shared/prefills.py).

The unit tests drive the queue poll with plain Python requests (the class holds no MLX state);
the end-to-end tests send concurrent openai chats over one system prompt to `paged-cache serve`
on tiny models, with and without sharing, and compare what the first turns reuse and reply."""

from __future__ import annotations

import json
import queue
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

from paged_cache.integrations.shared import prefills as shared_prefill
from paged_cache.integrations.shared.prefills import SharedPrefills
from paged_cache.integrations.shared.tenants import attach_salt
from paged_cache.testing import write_model_dir
from paged_cache.testing.load import LOAD_SYSTEM, concurrent_chats, load_server

BLOCK = 4


class Harness:
    """SharedPrefills' inputs as plain data: a real queue of requests, each request's ``tokens``
    and segment ``ends`` as its tokenization, and as the cache's reach the longest ``stored``
    token list a prompt starts with (the end-to-end tests below run it in the real server)."""

    def __init__(self, **options) -> None:
        self.queue: queue.Queue = queue.Queue()
        self.stored: list[list[int]] = []
        self.counters = dict(prefill_waits=0, prefill_wait_seconds=0.0, prefill_waits_expired=0)
        self.sharing = SharedPrefills(self.tokenize, self.reach, self.counters, min_tokens=BLOCK,
                                      **options)

    @staticmethod
    def tokenize(request, args):
        if request.tokens is None:
            raise ValueError("no chat template")
        return (request.tokens, request.ends) if request.batchable else None

    def reach(self, tokens: list[int], salt) -> int:
        return max((len(s) for s in self.stored if tokens[:len(s)] == s), default=0)

    def send(self, tokens, ends=(), *, model="m", salt=None, batchable=True):
        args = SimpleNamespace(model=model)
        attach_salt(args, salt)
        queued = (queue.Queue(), SimpleNamespace(tokens=tokens, ends=list(ends),
                                                 batchable=batchable), args)
        self.queue.put(queued)
        return queued

    def poll(self, timeout=None):
        try:
            return self.queue.get(timeout=timeout) if timeout is not None else self.queue.get_nowait()
        except queue.Empty:
            return None

    def next(self):
        return self.sharing.next(self.poll, None)

    def insert(self, tokens, salt=None):
        self.stored.append(tokens)
        self.sharing.inserted(tokens, salt)


SYSTEM_TOKENS = list(range(100, 120))   # a 20-token "system prompt": 5 blocks


def chat(user: int, n: int = 6) -> list[int]:
    return SYSTEM_TOKENS + [user] * n


@pytest.mark.unit
def test_a_request_sharing_the_leaders_system_prompt_waits_for_its_insert() -> None:
    s = Harness()
    leader = s.send(chat(1), ends=[20])
    follower = s.send(chat(2), ends=[20])
    other = s.send(list(range(500, 530)), ends=[20])       # shares nothing: goes on
    assert s.next() is leader
    assert s.next() is other                                # the follower is held back
    assert s.next() is None and s.sharing.parked == 1
    s.insert(SYSTEM_TOKENS[:16])                            # not yet what it waits for
    assert s.next() is None
    s.insert(SYSTEM_TOKENS)                                 # the leader's system segment
    assert s.next() is follower and s.sharing.parked == 0
    assert s.counters["prefill_waits"] == 1 and s.counters["prefill_waits_expired"] == 0
    assert s.sharing.waited(follower[1]) > 0 and s.sharing.waited(follower[1]) == 0.0


@pytest.mark.unit
def test_followers_go_on_in_arrival_order_when_the_leaders_prompt_is_done() -> None:
    s = Harness()
    leader = s.send(chat(1), ends=[20])
    followers = [s.send(chat(u), ends=[20]) for u in (2, 3, 4)]
    assert s.next() is leader and s.next() is None and s.sharing.parked == 3
    s.sharing.prompt_done(leader[1])                        # first token, error or disconnect
    assert [s.next() for _ in followers] == followers and s.next() is None


@pytest.mark.unit
def test_what_is_never_held_back() -> None:
    s = Harness()
    leader = s.send(chat(1), ends=[20])
    assert s.next() is leader
    s.stored.append(SYSTEM_TOKENS)                          # the cache already reaches it
    cached = s.send(chat(2), ends=[20])
    assert s.next() is cached
    s.stored.clear()
    for queued in (s.send(chat(3), ends=[20], salt="tenant-b"),   # another tenant
                   s.send(chat(4), ends=[20], model="other"),     # another model
                   s.send(chat(5), ends=[20], batchable=False),   # served alone
                   s.send(SYSTEM_TOKENS[:BLOCK - 1] + [9] * 20),  # shares less than a block
                   s.send(None)):                                 # its tokenization fails
        assert s.next() is queued
    assert s.sharing.parked == 0 and s.counters["prefill_waits"] == 0


@pytest.mark.unit
def test_a_leader_leads_only_up_to_its_pending_inserts() -> None:
    """A prompt with no segment end before its own end (or only ends the cache already holds)
    leads nobody: the server inserts nothing of it before its first token."""
    s = Harness()
    assert s.next() is None
    first = s.send(chat(1))                                 # no segments
    second = s.send(chat(2), ends=[20])
    assert s.next() is first and s.next() is second         # nobody waits for `first`
    third = s.send(chat(3), ends=[20])
    assert s.next() is None and s.sharing.parked == 1       # waits for `second`
    s.sharing.prompt_done(second[1])
    assert s.next() is third


@pytest.mark.unit
def test_a_wait_is_bounded_and_what_is_held_goes_back_on_stop(monkeypatch) -> None:
    s = Harness()
    leader = s.send(chat(1), ends=[20])
    follower = s.send(chat(2), ends=[20])
    assert s.next() is leader and s.next() is None
    monkeypatch.setattr(shared_prefill, "MAX_WAIT_SECONDS", 0.0)
    assert s.next() is follower and s.counters["prefill_waits_expired"] == 1
    late = s.send(chat(3), ends=[20])
    monkeypatch.setattr(shared_prefill, "MAX_WAIT_SECONDS", 60.0)
    assert s.next() is None and s.sharing.parked == 1
    s.sharing.requeue(s.queue.put)
    assert s.sharing.parked == 0 and s.queue.get_nowait() is late
    monkeypatch.setattr(shared_prefill, "MAX_WAIT_SECONDS", 0.0)   # a leader whose end is lost
    s.send(chat(4), ends=[20])
    assert s.next() is not None and s.sharing.parked == 0


@pytest.mark.unit
def test_off_it_passes_the_poll_through() -> None:
    s = Harness(enabled=False)
    queued = [s.send(chat(u), ends=[20]) for u in (1, 2)]
    assert [s.next(), s.next()] == queued


@pytest.mark.unit
def test_an_engine_handed_its_requests_admits_and_takes_the_ready_ones() -> None:
    """``admit`` / ``ready``: the same decisions for an engine that is handed each request
    (vllm-mlx's Scheduler) instead of polling a queue; off, nothing is held."""
    s = Harness()
    leader, follower = (s.send(chat(u), ends=[20]) for u in (1, 2))
    assert s.sharing.admit(leader) is False and s.sharing.ready() is None
    assert s.sharing.admit(follower) is True and s.sharing.ready() is None
    s.insert(SYSTEM_TOKENS)
    assert s.sharing.ready() is follower and s.sharing.ready() is None
    assert s.counters["prefill_waits"] == 1
    off = Harness(enabled=False)
    assert not any(off.sharing.admit(off.send(chat(u), ends=[20])) for u in (1, 2))


@pytest.mark.unit
def test_min_tokens_is_checked() -> None:
    with pytest.raises(ValueError, match="min_tokens"):
        SharedPrefills(Harness.tokenize, lambda t, s: 0, {}, min_tokens=0)


# ---------------------------------------------------------------------------- end to end

CLIENTS = 4
REQUEST_SECONDS = 120.0


def _requests_stats(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/paged-cache/stats", timeout=10) as answer:
        return json.load(answer)["requests"]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_chats_opening_together_prefill_their_system_prompt_once(tmp_path: Path,
                                                                arch: str) -> None:
    """Four chats opening at once over one ~2.4k-token system prompt: with sharing, every first
    turn but one restores the system prompt (waiting for the first one's prefill, or finding
    it stored), and the replies are those of the server without sharing (greedy)."""
    model = write_model_dir(tmp_path / "model", arch)
    runs, stats = {}, {}
    for mode, flag in (("shared", "--shared-prefill"), ("alone", "--no-shared-prefill")):
        with load_server("paged-cache", model, tmp_path / mode, flag) as server:
            runs[mode] = concurrent_chats(server.url, clients=CLIENTS, turns=1,
                                          system=LOAD_SYSTEM, timeout=REQUEST_SECONDS)
            stats[mode] = _requests_stats(server.url)
    assert runs["shared"].replies() == runs["alone"].replies()
    cached = sorted(t.cached_tokens or 0 for t in runs["shared"].turns)
    # the first request prefills; the others restore at least the system prompt (one token per
    # byte), some beyond it when they came after the first one's reply was stored
    assert cached[0] == 0 and cached[1] >= len(LOAD_SYSTEM), cached
    s = stats["shared"]
    assert s["cache_errors"] == s["store_errors"] == 0 and s["prefill_waits_expired"] == 0
    assert stats["alone"]["prefill_waits"] == 0
    assert (s["prefill_waits"] > 0) == (s["prefill_wait_seconds"] > 0)
