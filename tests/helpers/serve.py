"""``paged-cache serve`` in a subprocess on 127.0.0.1, driven by the official openai client: the
server's life, one conversation sharing a system prompt, the stats routes and the log lines."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from openai import OpenAI

SYSTEM = "You are a terse assistant for a cache test. " * 3
QUESTIONS = ["What is a KV cache?", "Why split it into blocks of tokens?",
             "And what happens after a restart of the server?", "Thanks. One more detail?"]
# Per turn: streamed or not, and a seed (a seeded request takes mlx_lm.server's sequential path;
# the others go through its BatchGenerator).
MODES = [(False, None), (True, None), (False, 7), (True, 7)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_health(proc: subprocess.Popen, port: int, log: Path, seconds: float) -> None:
    """Wait until the server ``proc`` started answers /health on ``port``; fails (with the end of
    its ``log``) when it exits first or ``seconds`` pass."""
    deadline = time.monotonic() + seconds
    while True:
        assert proc.poll() is None, f"server exited early:\n{log.read_text()[-3000:]}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        assert time.monotonic() < deadline, f"server did not start:\n{log.read_text()[-3000:]}"
        time.sleep(0.3)


# The servers of these tests restore every hit: they assert what a hit does, and a tiny model's
# measured prefill (and a noisy first read rate on a loaded machine) may make the fetch plan
# prefill instead (tests/test_fetch_plan.py tests the plan; env_extra may set another policy).
RESTORING = {"PAGED_CACHE_FETCH_POLICY": "always-restore"}


@contextmanager
def server(argv: list[str], log: Path, env_extra: dict | None = None):
    """Start a server subprocess, wait for /health, yield (client, process, base URL); stop it
    (SIGTERM)."""
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **RESTORING, **(env_extra or {})}
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, *argv, "--host", "127.0.0.1", "--port", str(port),
                                 "--max-tokens", "12"], stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        wait_for_health(proc, port, log, 120)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        yield client, proc, f"http://127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            proc.terminate()
        proc.wait(timeout=60)


def ask(client: OpenAI, messages: list[dict], stream: bool, seed: int | None) -> tuple[str, int, int]:
    """One chat completion (greedy): (text, cached prompt tokens, prompt tokens)."""
    kw = dict(model="default_model", messages=messages, temperature=0.0, max_tokens=12, seed=seed)
    if not stream:
        r = client.chat.completions.create(**kw)
        return (r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens,
                r.usage.prompt_tokens)
    text, usage = "", None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                                **kw):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage is not None:
            usage = chunk.usage
    return text, usage.prompt_tokens_details.cached_tokens, usage.prompt_tokens


def conversation(client: OpenAI, turns: int = len(QUESTIONS)) -> list[tuple[str, int, int]]:
    """A multi-turn chat; each turn's history holds the server's own previous replies."""
    messages = [{"role": "system", "content": SYSTEM}]
    results = []
    for question, (stream, seed) in zip(QUESTIONS[:turns], MODES):
        messages.append({"role": "user", "content": question})
        results.append(ask(client, messages, stream, seed))
        messages.append({"role": "assistant", "content": results[-1][0]})
    return results


# A conversation replayed with a given history (the cold replies): each turn is asked alone.
REPLAY_SYSTEM = "You are a terse assistant for a cache test. Answer briefly. " * 2
TURNS = 3


def turn_messages(replies: list[str], turn: int) -> list[dict]:
    """The conversation up to question ``turn`` (0-based), with ``replies`` as its history."""
    messages = [{"role": "system", "content": REPLAY_SYSTEM}]
    for question, reply in zip(QUESTIONS[:turn], replies):
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": reply}]
    return messages + [{"role": "user", "content": QUESTIONS[turn]}]


def cold_replies(client) -> list[tuple[str, int, int]]:
    """Each turn asked with the previous cold replies as history (the server caches nothing)."""
    results: list[tuple[str, int, int]] = []
    for turn, (stream, seed) in zip(range(TURNS), MODES):
        results.append(ask(client, turn_messages([r for r, _, _ in results], turn), stream, seed))
    return results


def replay(client, replies: list[str], turns: range) -> list[tuple[str, int, int]]:
    """The turns ``turns``, each asked with ``replies`` as its history."""
    return [ask(client, turn_messages(replies, turn), *MODES[turn]) for turn in turns]


def paged_argv(model_dir: Path, *extra: str) -> list[str]:
    return ["-m", "paged_cache.cli.main", "serve", "--model", str(model_dir), "--block-size", "16",
            *extra]


REQUEST_LINE = re.compile(r"paged_cache\.integrations\.mlx_lm INFO request: (\d+)/(\d+) prompt tokens "
                          r"cached \((hot|ssd|mixed|miss)\), fetch [\d.]+ ms, (.*); hot tier ")


def live_stats(url: str) -> dict:
    """`paged-cache stats --url URL --json`, run as a real subprocess."""
    out = subprocess.run([sys.executable, "-m", "paged_cache.cli.main", "stats", "--url", url,
                          "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)
