"""``paged-cache serve`` as a real process: a SIGKILL after ``tail_write_delay_s`` loses no stored
token (a chat longer than a block and one shorter than a block come back whole after a restart on
the same directory), and a client that disconnects while its request is prefilled costs the next
identical request nothing. Tiny random-weight llama, default block size (256), the official
openai client and a raw HTTP connection on 127.0.0.1."""

from __future__ import annotations

import http.client
import json
import time
import urllib.request
from pathlib import Path

from paged_cache.testing import write_model_dir

from helpers.serve import ask, live_stats, server

DELAY = "0.5"
LONG = [{"role": "system", "content": "You answer questions about caches, briefly. " * 8},
        {"role": "user", "content": "What is a KV cache?"}]
SHORT = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi?"}]


def _argv(model_dir: Path, ssd: Path) -> list[str]:
    return ["-m", "paged_cache.cli.main", "serve", "--model", str(model_dir), "--ssd-dir",
            str(ssd), "--tail-write-delay-s", DELAY]


def _wait_until_written(url: str, tails: int, seconds: float = 60.0) -> None:
    """Poll the server's stats until its timer wrote ``tails`` tails and the SSD write queue is
    empty (every queued block written); fail after ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        manager = live_stats(url)["manager"]
        if manager["tails_written"] >= tails and manager["ssd"]["queue_blocks"] == 0:
            return
        assert time.monotonic() < deadline, f"tails not written after {seconds:g} s: {manager}"
        time.sleep(0.2)


def test_a_sigkill_after_the_delay_loses_no_stored_token(tmp_path: Path) -> None:
    model_dir = write_model_dir(tmp_path / "model", "llama", printable_replies=True)
    ssd = tmp_path / "ssd"
    with server(_argv(model_dir, ssd), tmp_path / "first.log") as (client, proc, url):
        _, _, long_tokens = ask(client, LONG, False, None)
        _, _, short_tokens = ask(client, SHORT, False, None)
        assert 256 < long_tokens < 512 and short_tokens < 256
        # what the same requests reuse without a crash: every prompt token but the last
        assert ask(client, LONG, False, None)[1:] == (long_tokens - 1, long_tokens)
        assert ask(client, SHORT, False, None)[1:] == (short_tokens - 1, short_tokens)
        _wait_until_written(url, tails=2)
        proc.kill()
        proc.wait(timeout=60)
    with server(_argv(model_dir, ssd), tmp_path / "second.log") as (client, _, _):
        assert ask(client, LONG, False, None)[1:] == (long_tokens - 1, long_tokens)
        assert ask(client, SHORT, False, None)[1:] == (short_tokens - 1, short_tokens)


def _stats(url: str) -> dict:
    with urllib.request.urlopen(url + "/paged-cache/stats", timeout=30) as reply:
        return json.loads(reply.read())


def _disconnect_during_prefill(url: str, messages: list[dict]) -> int:
    """Send a streamed chat request on a raw connection and close it as soon as the server has
    fetched for it (its prefill runs next); the tokens that fetch reused."""
    before = _stats(url)["prefix"]
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = json.dumps({"model": "default_model", "messages": messages, "max_tokens": 12,
                       "temperature": 0.0, "stream": True})
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    deadline = time.monotonic() + 120
    while (now := _stats(url)["prefix"])["hits"] == before["hits"]:
        assert now["misses"] == before["misses"], "the request's fetch missed"
        assert time.monotonic() < deadline, "no fetch for the request"
        time.sleep(0.01)
    conn.sock.close()  # gone before any token: the server finds out when it writes one
    conn.close()
    return now["tokens_matched"] - before["tokens_matched"]


def test_a_client_that_disconnects_during_prefill_costs_nothing(tmp_path: Path) -> None:
    model_dir = write_model_dir(tmp_path / "model", "llama", printable_replies=True)
    log = tmp_path / "serve.log"
    with server(_argv(model_dir, tmp_path / "ssd"), log) as (client, _, url):
        reply, _, _ = ask(client, LONG, False, None)
        # the next turn: a long new message, so its prefill is still running when the client goes
        nxt = LONG + [{"role": "assistant", "content": reply},
                      {"role": "user", "content": "And the blocks? " * 400}]
        reused = _disconnect_during_prefill(url, nxt)
        assert reused > 256  # the first turn's blocks and its tail
        _, again, _ = ask(client, nxt, False, None)  # served after the dropped one ends
        assert again >= reused, (again, reused)
