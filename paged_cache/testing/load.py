"""Concurrent chats against one server: ``clients`` conversations at once, each in its own thread
with its own official ``openai`` client, streaming greedy multi-turn chats over one shared system
prompt (each turn's history holds the server's own previous replies). The load the ``load``
benchmark family and the concurrent reuse tests send to plain ``mlx_lm.server`` and to
``paged-cache serve`` alike."""

from __future__ import annotations

import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paged_cache.testing.model_dir import write_model_dir
from paged_cache.testing.engines import (REQUEST_SECONDS, EngineServer, Turn, converse,
                                         questions, usage_cached)

# ~2.4k tokens with the byte tokenizer of ``paged-cache make-model`` (one token per byte)
LOAD_SYSTEM = ("You are the assistant of a concurrent cache test. Answer in one short line, "
               "and keep every reply plain. " * 24).strip()


SIDES = ("plain", "paged-cache")


def load_model(path: Path, arch: str) -> Path:
    """A tiny ``arch`` model directory at ``path`` whose greedy replies encode back to the tokens
    generated (printable text), so a conversation's next prompt extends its previous prompt and
    reply, as with a real model; mamba's as written (its tied embedding cannot be limited to
    printable tokens, and its greedy replies encode back as they are)."""
    return write_model_dir(path, arch, printable_replies=arch != "mamba")


def load_server(side: str, model: Path, work: Path, *extra: str) -> EngineServer:
    """Plain ``mlx_lm.server`` (``side`` "plain") or ``paged-cache serve`` with an empty SSD tier
    under ``work`` ("paged-cache") on ``model``, with mlx_lm.server's options ``extra``; started
    as a context manager."""
    if side not in SIDES:
        raise ValueError(f"side: expected one of {', '.join(SIDES)}, got {side!r}")
    if side == "plain":
        argv = ["-m", "mlx_lm", "server", "--model", str(model), *extra]
    else:
        shutil.rmtree(work / "ssd", ignore_errors=True)
        argv = ["-m", "paged_cache.cli.main", "serve", "--model", str(model), "--ssd-dir",
                str(work / "ssd"), *extra]
    work.mkdir(parents=True, exist_ok=True)
    return EngineServer(sys.executable, argv, work, name=side)


@dataclass
class LoadRun:
    """What one run of the load did: every request (in completion order) and the wall time."""

    turns: list[Turn]
    wall: float

    @property
    def cached(self) -> int:
        """Prompt tokens the server reported as cached, over every request."""
        return sum(t.cached_tokens or 0 for t in self.turns)

    @property
    def later_cached(self) -> int:
        """Cached prompt tokens over the turns after each conversation's first: what a server
        reuses of its conversations, on either server. (A first turn finds the system prompt on
        plain mlx_lm.server only when another conversation stored it before it came: a race;
        paged-cache serve holds chats opening together back until one has stored it.)"""
        return sum(t.cached_tokens or 0 for t in self.turns if t.turn)

    @property
    def prompt(self) -> int:
        """Prompt tokens over every request."""
        return sum(t.prompt_tokens for t in self.turns)

    def ttft(self, q: float) -> float:
        """The ``q`` quantile (0 < q < 1) of the requests' times to first token, in seconds."""
        times = sorted(t.ttft for t in self.turns)
        if len(times) == 1:
            return times[0]
        return statistics.quantiles(times, n=100, method="inclusive")[round(q * 100) - 1]

    def replies(self) -> dict[tuple[int, int], str]:
        """(conversation, turn) -> reply: what two servers must agree on."""
        return {(t.conversation, t.turn): t.reply for t in self.turns}

    def to_dict(self) -> dict[str, Any]:
        return dict(wall=self.wall, cached=self.cached, later_cached=self.later_cached,
                    prompt=self.prompt,
                    ttft_p50=self.ttft(0.5), ttft_p95=self.ttft(0.95),
                    turns=[t.to_dict() for t in self.turns])


def concurrent_chats(url: str, model: str = "default_model", *, clients: int = 8, turns: int = 3,
                     max_tokens: int = 12, system: str = LOAD_SYSTEM,
                     timeout: float = REQUEST_SECONDS) -> LoadRun:
    """Play ``clients`` conversations of ``turns`` turns at once against the server at ``url``;
    a request slower than ``timeout`` seconds raises (openai's timeout), as does any error."""
    if isinstance(clients, bool) or not isinstance(clients, int) or clients < 1:
        raise ValueError(f"clients: expected an int >= 1, got {clients!r}")
    if isinstance(turns, bool) or not isinstance(turns, int) or turns < 1:
        raise ValueError(f"turns: expected an int >= 1, got {turns!r}")
    from openai import OpenAI

    def one(c: int) -> list[Turn]:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=timeout, max_retries=0)
        return converse(client, model, c, [{"role": "system", "content": system}],
                        questions(c, turns), 0, max_tokens=max_tokens, cached=usage_cached)

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=clients) as pool:
        played = list(pool.map(one, range(clients)))
    wall = time.perf_counter() - started
    return LoadRun([t for conv in played for t in conv], wall)
