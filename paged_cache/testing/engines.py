"""Serving engines as real subprocesses on 127.0.0.1, and the multi-turn chat workload tests and
benchmarks send them through the official ``openai`` client.

An engine runs from its own virtual environment (its python, ``ENGINE_VENVS``); ``EngineServer``
starts one command line with a private HOME and a free port, waits until it answers, and stops
it with SIGTERM (SIGKILL after a timeout). ``chat`` plays conversations that share a system
prompt, turn by turn, each turn's history holding the engine's own previous replies, and records
per request the prompt tokens, the tokens the engine reported as cached, the reply and the time
to first token.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from paged_cache.testing.server import free_port

START_SECONDS = 240.0   # a cold engine import + tiny model load on 2 busy cores
STOP_SECONDS = 60.0
REQUEST_SECONDS = 120.0
SYSTEM = ("You are the assistant of a cache test. Answer in one short line. " * 6).strip()


def engine_python(venv: str | os.PathLike) -> str:
    """The python of an engine's virtual environment; FileNotFoundError saying how to build it."""
    path = Path(venv) / "bin" / "python"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: build the engine's environment with "
                                "`make test-engines` (see docs/integration.md)")
    return str(path)


class EngineServer:
    """One engine process: ``argv`` (without host / port, which are appended as ``port_flags``
    names them), run with ``python`` and a private HOME under ``workdir``; ``url`` once started.
    ``ready`` is the path polled until it answers 200."""

    def __init__(self, python: str, argv: Sequence[str], workdir: Path, *,
                 port_flags: tuple[str, str] = ("--host", "--port"), ready: str = "/v1/models",
                 env: dict[str, str] | None = None, name: str = "engine") -> None:
        self.python = python
        self.argv = list(argv)
        self.workdir = Path(workdir)
        self.port_flags = port_flags
        self.ready = ready
        self.env = dict(env or {})
        self.name = name
        self.port = free_port()
        self.log = self.workdir / f"{name}.log"
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "EngineServer":
        """Start the process (asynchronously); ``wait`` blocks until it answers."""
        home = self.workdir / "home"
        home.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, HOME=str(home), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   PYTHONUNBUFFERED="1", **self.env)
        host, port = self.port_flags
        with self.log.open("a") as out:
            self.process = subprocess.Popen(
                [self.python, *self.argv, host, "127.0.0.1", port, str(self.port)],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                cwd=self.workdir, start_new_session=True)
        return self

    def wait(self, timeout: float = START_SECONDS) -> "EngineServer":
        """Block until ``ready`` answers 200; RuntimeError with the log's tail if the process
        exits or ``timeout`` passes first."""
        deadline = time.monotonic() + timeout
        while True:
            if self.process is None or self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited before answering:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + self.ready, timeout=2) as reply:
                    if reply.status == 200:
                        return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.name} did not answer within {timeout:.0f}s:\n"
                                   f"{self.tail()}")
            time.sleep(0.3)

    def get(self, path: str) -> Any:
        """GET ``path`` and decode its JSON."""
        with urllib.request.urlopen(self.url + path, timeout=30) as reply:
            return json.loads(reply.read())

    def stop(self) -> int | None:
        """SIGTERM the process group, SIGKILL after STOP_SECONDS; the exit status."""
        proc = self.process
        if proc is None:
            return None
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_SECONDS)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=STOP_SECONDS)
        return proc.returncode

    def tail(self, chars: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def __enter__(self) -> "EngineServer":
        return self.start().wait()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


@dataclass
class Turn:
    """One request of the workload and what the engine answered."""

    conversation: int
    turn: int
    prompt_tokens: int
    cached_tokens: int | None
    reply: str
    ttft: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def questions(conversation: int, turns: int) -> list[str]:
    """The user messages of one conversation (distinct per conversation and turn)."""
    return [f"Conversation {conversation}, question {t}: what does block {t * 7 + conversation} "
            f"of the cache hold, and why?" for t in range(turns)]


def ask(client: Any, model: str, messages: list[dict], *, max_tokens: int,
        cached: Callable[[Any], int | None]) -> tuple[str, int, int | None, float]:
    """One streamed greedy chat completion: (reply, prompt tokens, cached tokens, TTFT s).
    ``cached(usage)`` reads the cached tokens (the engine's report, or another source)."""
    started = time.perf_counter()
    ttft, text, usage = None, "", None
    stream = client.chat.completions.create(
        model=model, messages=messages, temperature=0.0, max_tokens=max_tokens, stream=True,
        stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if ttft is None:
                ttft = time.perf_counter() - started
            text += chunk.choices[0].delta.content
        if getattr(chunk, "usage", None) is not None:
            usage = chunk.usage
    if usage is None:
        raise RuntimeError("the engine sent no usage (stream_options.include_usage)")
    return text, usage.prompt_tokens, cached(usage), ttft if ttft is not None else float("nan")


def usage_cached(usage: Any) -> int | None:
    """Cached prompt tokens as the OpenAI usage reports them (None when the engine does not)."""
    details = getattr(usage, "prompt_tokens_details", None)
    return getattr(details, "cached_tokens", None) if details is not None else None


def openai_client(url: str) -> Any:
    """The official openai client of the server at ``url`` (each request under
    REQUEST_SECONDS, never retried)."""
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=REQUEST_SECONDS, max_retries=0)


def chat(url: str, model: str, *, conversations: int = 2, turns: int = 3, max_tokens: int = 12,
         cached: Callable[[Any], int | None] = usage_cached, system: str = SYSTEM,
         history: dict[int, list[dict]] | None = None, first_turn: int = 0,
         first_conversation: int = 0) -> list[Turn]:
    """Play ``conversations`` chats (numbered from ``first_conversation``) of ``turns`` turns,
    conversation by conversation, sharing ``system``; each turn's history holds the engine's
    previous replies. ``history`` (updated in place, keyed by conversation) continues earlier
    turns (``first_turn``: the index of the first turn played now)."""
    client = openai_client(url)
    history = {} if history is None else history
    out = []
    for c in range(first_conversation, first_conversation + conversations):
        messages = history.setdefault(c, [{"role": "system", "content": system}])
        out += converse(client, model, c, messages, questions(c, first_turn + turns)[first_turn:],
                        first_turn, max_tokens=max_tokens, cached=cached)
    return out


def converse(client: Any, model: str, conversation: int, messages: list[dict],
             asked: Sequence[str], first_turn: int, *, max_tokens: int,
             cached: Callable[[Any], int | None]) -> list[Turn]:
    """Ask ``asked`` in order as turns ``first_turn``, ... of ``conversation``, each question and
    its reply appended to ``messages`` (the history the next turn sends)."""
    out = []
    for t, question in enumerate(asked, first_turn):
        messages.append({"role": "user", "content": question})
        reply, prompt, hit, ttft = ask(client, model, messages, max_tokens=max_tokens,
                                       cached=cached)
        messages.append({"role": "assistant", "content": reply})
        out.append(Turn(conversation, t, prompt, hit, reply, ttft))
    return out


def agentic(url: str, model: str = "default_model", *, turns: int = 20, tool_lines: int = 22,
            max_tokens: int = 24) -> list[dict]:
    """Play one agentic conversation: each turn a tool's output (``tool_lines`` lines, ~45 tokens
    each with the byte tokenizer: 20 turns of 22 lines are ~20k tokens) and a greedy reply kept in
    the history; returns the messages (the last reply included)."""
    client = openai_client(url)
    messages = [{"role": "system", "content": "You are a coding agent. " * 20}]
    for t in range(turns):
        tool = "".join(f"line {t}.{i}: def f{i}(x): return x * {i} + {t}\n"
                       for i in range(tool_lines))
        messages.append({"role": "user", "content": f"Tool output {t}:\n{tool}\nNext step?"})
        reply = ask(client, model, messages, max_tokens=max_tokens, cached=usage_cached)[0]
        messages.append({"role": "assistant", "content": reply})
    return messages


def start_all(servers: Sequence[EngineServer]) -> None:
    """Start every server at once (their imports overlap), then wait for each (all are stopped
    if one fails)."""
    for server in servers:
        server.start()
    try:
        for server in servers:
            server.wait()
    except BaseException:
        for server in servers:
            server.stop()
        raise


class StatsSaved:
    """Cached tokens of each request from an engine that does not report them in its usage:
    the growth of ``tokens_saved`` in its cache statistics (``GET path``, the number under
    ``keys``), between sequential requests. None for a server without a cache."""

    def __init__(self, server: EngineServer, path: str, keys: Sequence[str]) -> None:
        self.server, self.path, self.keys = server, path, keys
        self.last = self.read()

    def read(self) -> int | None:
        value: Any = self.server.get(self.path)
        for key in self.keys:
            value = None if value is None else value.get(key)
        return value

    def __call__(self, _usage: Any) -> int | None:
        now = self.read()
        if now is None:
            return None
        delta, self.last = now - self.last, now
        return delta


@dataclass(frozen=True)
class Engine:
    """How to run one serving engine, plain and under paged-cache (``paged-cache NAME``), from
    the python of its environment (``.venv-engine-NAME``)."""

    name: str
    entry: tuple[str, ...]                      # python arguments running the engine's CLI
    serve: Callable[[Path], list[str]]          # its command line serving a model directory
    cold: tuple[str, ...]                       # its options for running without a cache
    stats: tuple[str, tuple[str, ...]] | None   # where it counts cached tokens, if not in usage

    def own(self, python: str, model: Path, workdir: Path, *extra: str,
            name: str = "own") -> EngineServer:
        """The engine with its own cache (``extra``: e.g. ``cold``)."""
        return EngineServer(python, [*self.entry, *self.serve(model), *extra], workdir, name=name)

    def paged(self, python: str, model: Path, workdir: Path, *cache_flags: str,
              extra: Sequence[str] = (), name: str = "paged") -> EngineServer:
        """``paged-cache NAME [cache flags] <its command line> [extra]``."""
        return EngineServer(python, ["-m", "paged_cache.cli.main", self.name, *cache_flags,
                                     *self.serve(model), *extra], workdir, name=name)

    def cached(self, server: EngineServer) -> Callable[[Any], int | None]:
        """How to read a request's cached tokens from ``server`` (call before the requests)."""
        if self.stats is None:
            return usage_cached
        return StatsSaved(server, *self.stats)


ENGINES = {
    "vllm-mlx": Engine(
        "vllm-mlx", ("-m", "vllm_mlx.cli"),
        lambda model: ["serve", str(model), "--continuous-batching"],
        ("--disable-prefix-cache",), ("/v1/cache/stats", ("engine_cache", "tokens_saved"))),
    "openai-server": Engine(
        "openai-server", ("-c", "from app.main import main; main()"),
        lambda model: ["launch", "--model-path", str(model), "--model-type", "lm",
                       "--no-log-file"],
        ("--prompt-cache-size", "0"), None),
}
