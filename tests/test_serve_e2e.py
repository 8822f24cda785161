"""End to end: `paged-cache serve` in a subprocess, driven by the official openai client."""

from __future__ import annotations

import json
import math
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest
from openai import OpenAI

from paged_cache.testing import write_model_dir

BYTE_LIMIT = 40_000    # --prompt-cache-bytes for the SSD server: small enough to force spills
SYSTEM = "You are a terse assistant for a cache test. " * 3
QUESTIONS = ["What is a KV cache?", "Why split it into blocks of tokens?",
             "And what happens after a restart of the server?", "Thanks. One more detail?"]
# Per turn: streamed or not, and a seed (a seeded request takes mlx_lm.server's sequential path;
# the others go through its BatchGenerator).
MODES = [(False, None), (True, None), (False, 7), (True, 7)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("model") / "tiny-llama", "llama")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def server(argv: list[str], log: Path, env_extra: dict | None = None):
    """Start a server subprocess, wait for /health, yield (client, process, base URL); stop it
    (SIGTERM)."""
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", **(env_extra or {}))
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, *argv, "--host", "127.0.0.1", "--port", str(port),
                                 "--max-tokens", "12"], stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"server exited early:\n{log.read_text()[-3000:]}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"server did not start:\n{log.read_text()[-3000:]}"
            time.sleep(0.3)
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


def block_files(directory: Path) -> list[Path]:
    return list(directory.rglob("*.safetensors")) if directory.exists() else []


def paged_argv(model_dir: Path, *extra: str) -> list[str]:
    return ["-m", "paged_cache.cli.main", "serve", "--model", str(model_dir), "--block-size", "16",
            *extra]


SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*) (\S+)$")
REQUEST_LINE = re.compile(r"paged_cache\.integrations\.mlx_lm INFO request: (\d+)/(\d+) prompt tokens "
                          r"cached \((hot|ssd|mixed|miss)\), fetch [\d.]+ ms, (.*); hot tier ")


def parse_prometheus(text: str) -> dict[str, tuple[str, float]]:
    """Strict reading of the text exposition format 0.0.4 as `paged-cache serve` writes it (no
    labels): every sample follows its own HELP and TYPE lines; counters are named *_total."""
    metrics: dict[str, tuple[str, float]] = {}
    help_of, type_of = set(), {}
    assert text.endswith("\n")
    for line in text.splitlines():
        if line.startswith("# HELP "):
            help_of.add(line.split(" ", 3)[2])
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge") and name not in type_of, line
            type_of[name] = kind
        else:
            m = SAMPLE.match(line)
            assert m, f"not a sample line: {line!r}"
            name, value = m.groups()
            assert name in help_of and name in type_of and name not in metrics, line
            assert type_of[name] == "gauge" or name.endswith("_total"), line
            number = float(value)
            assert not math.isnan(number), line
            metrics[name] = (type_of[name], number)
    return metrics


def live_stats(url: str) -> dict:
    """`paged-cache stats --url URL --json`, run as a real subprocess."""
    out = subprocess.run([sys.executable, "-m", "paged_cache.cli.main", "stats", "--url", url,
                          "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def check_live_stats(url: str, turns: list[tuple[str, int, int]]) -> None:
    """The running server's counters agree with what the client saw, in JSON and Prometheus."""
    doc = live_stats(url)
    requests, prefix = doc["requests"], doc["prefix"]
    prompt, cached = sum(p for _, _, p in turns), sum(c for _, c, _ in turns)
    assert requests["requests"] == len(turns)
    assert requests["prompt_tokens"] == prefix["tokens_requested"] == prompt
    assert requests["cached_tokens"] == prefix["tokens_matched"] == cached
    assert prefix["hits"] == sum(c > 0 for _, c, _ in turns)
    assert requests["requests_miss"] == prefix["misses"] == sum(c == 0 for _, c, _ in turns)
    assert sum(requests[f"requests_{t}"] for t in ("hot", "ssd", "mixed", "miss")) == len(turns)
    assert doc["manager"]["hits"]["total"] > 0
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        metrics = parse_prometheus(r.read().decode())
    assert metrics["paged_cache_requests_cached_tokens_total"] == ("counter", cached)
    assert metrics["paged_cache_prefix_tokens_matched_total"] == ("counter", cached)
    assert metrics["paged_cache_manager_hot_bytes"][0] == "gauge"
    # types come from the STAT_GAUGES declarations, not from the names
    assert metrics["paged_cache_requests_sequences"][0] == "gauge"
    if "ssd" in doc["manager"]:
        assert metrics["paged_cache_manager_ssd_open_seconds"][0] == "gauge"
        assert metrics["paged_cache_manager_ssd_queue_bytes"][0] == "gauge"
    assert metrics["paged_cache_prefix_restore_seconds_total"][0] == "counter"
    # mlx_lm.server's own routes still answer next to the stats routes.
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
        assert r.status == 200


def test_serve_matches_plain_server_and_reuses_across_restart(model_dir, tmp_path):
    plain_argv = ["-m", "mlx_lm", "server", "--model", str(model_dir)]
    with server(plain_argv, tmp_path / "plain.log") as (c, _, _):
        plain = conversation(c)
    ssd = tmp_path / "ssd"
    log = tmp_path / "paged.log"
    argv = paged_argv(model_dir, "--ssd-dir", str(ssd), "--prompt-cache-bytes", str(BYTE_LIMIT),
                      "--log-level", "DEBUG")
    with server(argv, log) as (c, proc, url):
        paged = conversation(c)
        check_live_stats(url, paged)
        assert live_stats(url)["manager"]["hot"]["demote_evictions"] > 0   # the byte limit bit
    assert proc.returncode == 0, log.read_text()[-3000:]

    # Greedy outputs equal those of mlx_lm.server with its own prompt cache.
    assert [t for t, _, _ in paged] == [t for t, _, _ in plain]
    # Cached tokens grow turn by turn, on both server paths (turns 3-4 are sequential).
    cached = [c for _, c, _ in paged]
    assert cached[0] == 0
    assert all(b > a for a, b in zip(cached, cached[1:])), cached
    assert all(c < p for _, c, p in paged)
    # The byte limit holds after every insert on both paths; spilled blocks were still reused.
    text = log.read_text()
    hot = [int(m) for m in re.findall(r"insert: \w+, \d+ tokens; hot tier (\d+) bytes", text)]
    assert hot and max(hot) <= BYTE_LIMIT, hot
    # One INFO line per request: cached / prompt tokens as the client saw them, tier, times.
    lines = REQUEST_LINE.findall(text)
    assert [(int(c), int(p)) for c, p, _, _ in lines] == [(c, p) for _, c, p in paged], lines
    assert [t for _, _, t, _ in lines][0] == "miss" and "miss" not in [t for _, _, t, _ in lines][1:]
    assert all(re.fullmatch(r"store [\d.]+ ms \(\d+ inserts\)", st) for *_, st in lines), lines
    info = [ln for ln in re.findall(r"paged_cache\S* INFO (.*)", text)
            if not ln.startswith(("serving with", "SSD tier at"))]   # once, at startup
    assert len(info) == len(MODES), info
    files = block_files(ssd)
    assert files
    # The blocks carry the model as serve was given it; the CLI shows it beside the fingerprint.
    shown = json.loads(subprocess.run(
        [sys.executable, "-m", "paged_cache.cli.main", "inspect", str(ssd), "--json"],
        capture_output=True, text=True, check=True, timeout=60).stdout)
    assert [m["name"] for m in shown["models"]] == [str(model_dir)]

    # A new server process on the same directory serves the conversation's prefix from SSD.
    with server(paged_argv(model_dir, "--ssd-dir", str(ssd)), tmp_path / "restart.log") as (c, _, _):
        again = conversation(c, turns=1)
        messages = [{"role": "system", "content": SYSTEM}]
        for (reply, _, _), question in zip(paged[:-1], QUESTIONS):
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": reply}]
        messages.append({"role": "user", "content": QUESTIONS[len(paged) - 1]})
        # The mode the conversation used for this turn: mlx_lm.server's two paths may end the same
        # tokens differently (0.31.3's batched path drops a trailing incomplete UTF-8 character).
        last = ask(c, messages, *MODES[len(paged) - 1])
    restart_log = (tmp_path / "restart.log").read_text()
    assert again[0][0] == plain[0][0]
    assert again[0][1] > 0 and "cached (ssd)" in restart_log   # the system prompt came from disk
    assert last[0] == paged[-1][0]
    assert last[1] >= paged[-1][1]


def test_serve_hot_cache_only_writes_nothing(model_dir, tmp_path):
    xdg = tmp_path / "xdg"
    log = tmp_path / "hot.log"
    with server(paged_argv(model_dir, "--hot-cache-only"), log,
                {"XDG_CACHE_HOME": str(xdg)}) as (c, proc, url):
        results = conversation(c, turns=3)
        check_live_stats(url, results)
    assert proc.returncode == 0, log.read_text()[-3000:]
    cached = [c for _, c, _ in results]
    assert cached[0] == 0 and all(b > a for a, b in zip(cached, cached[1:])), cached
    assert not block_files(xdg) and not (xdg / "paged-cache").exists()
    assert not block_files(tmp_path)
