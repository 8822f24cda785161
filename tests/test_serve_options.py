"""`paged-cache serve` with mlx_lm.server's options, in subprocesses, against plain mlx_lm.server:
a draft model, --kv-bits, three concurrent requests on one prefix, a client that goes away
mid-stream, and each way the server can fail to start."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx_lm.server
import pytest
from helpers.serve import ask, conversation, free_port, live_stats, paged_argv, server

from paged_cache.config import format_size, physical_memory_bytes
from paged_cache.testing import write_model_dir

BLOCK = 16   # paged_argv's --block-size
SYSTEM = "You answer in one short line for a cache test, nothing else. " * 2
# mlx_lm.server's --kv-bits options came with mlx-lm 0.32.
SERVER_KV_BITS = "--kv-bits" in Path(mlx_lm.server.__file__).read_text()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    # head_dim 64: --kv-bits quantizes in groups of 64 along it.
    return write_model_dir(tmp_path_factory.mktemp("model") / "tiny", "llama", head_dim=64)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("draft") / "draft", "llama", seed=1, layers=1,
                           head_dim=64)


def plain_argv(model: Path, *extra: str) -> list[str]:
    return ["-m", "mlx_lm", "server", "--model", str(model), *extra]


def check_cache_healthy(url: str) -> dict:
    """No store or cache error, and every request finished with a store."""
    requests = live_stats(url)["requests"]
    assert requests["store_errors"] == 0 and requests["cache_errors"] == 0, requests
    return requests


# With a draft model the server inserts the last accepted token before the model has seen it:
# LRUPromptCache counts (and reuses) a cache one token short of its key, paged-cache stores and
# reports the tokens the cache holds.
@pytest.mark.parametrize("option, slack", [
    (["--draft-model"], 1),
    pytest.param(["--kv-bits", "4", "--quantized-kv-start", "0"], 0, marks=pytest.mark.skipif(
        not SERVER_KV_BITS, reason="the installed mlx_lm.server has no --kv-bits (mlx-lm < 0.32)"))],
    ids=["draft-model", "kv-bits"])
def test_server_option_matches_plain_and_caches(option, slack, model_dir, draft_dir, tmp_path):
    extra = [*option, str(draft_dir)] if option == ["--draft-model"] else option
    with server(plain_argv(model_dir, *extra), tmp_path / "plain.log") as (c, _, _):
        plain = conversation(c, turns=3)
    argv = paged_argv(model_dir, "--ssd-dir", str(tmp_path / "ssd"), *extra)
    with server(argv, tmp_path / "paged.log") as (c, proc, url):
        paged = conversation(c, turns=3)
        requests = check_cache_healthy(url)
    assert proc.returncode == 0
    assert [t for t, _, _ in paged] == [t for t, _, _ in plain]
    cached, plain_cached = [c for _, c, _ in paged], [c for _, c, _ in plain]
    assert cached[0] == 0 and all(c > 0 for c in cached[1:]), (cached, plain_cached)
    assert all(p >= q - slack for p, q in zip(cached, plain_cached)), (cached, plain_cached)
    assert requests["cached_tokens"] == sum(cached)


def warm_prefix(client) -> tuple[list[dict], int]:
    """One turn stored; returns the conversation so far and its prompt tokens."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "First?"}]
    reply, _, prompt = ask(client, messages, stream=False, seed=None)
    return messages + [{"role": "assistant", "content": reply}], prompt


@pytest.mark.parametrize("hot_only", [False, True], ids=["ssd", "hot-only"])
def test_three_concurrent_requests_on_one_prefix_all_hit(hot_only, model_dir, tmp_path):
    tier = ["--hot-cache-only"] if hot_only else ["--ssd-dir", str(tmp_path / "ssd")]
    with server(paged_argv(model_dir, *tier), tmp_path / "paged.log") as (c, _, url):
        history, prompt = warm_prefix(c)
        questions = [history + [{"role": "user", "content": q}] for q in ("Two?", "Three?", "Four?")]
        with ThreadPoolExecutor(3) as pool:
            results = list(pool.map(lambda m: ask(c, m, stream=False, seed=None), questions))
        check_cache_healthy(url)
    cached = [c for _, c, _ in results]
    assert all(c >= prompt // BLOCK * BLOCK for c in cached), (cached, prompt)


def stream_and_hang_up(url: str, messages: list[dict]) -> None:
    """Start a long streamed completion, read its first data chunk, close the connection."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": "default_model", "messages": messages, "stream": True,
                       "max_tokens": 2000, "temperature": 0.0}).encode()
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        received = b""
        while b"data: " not in received:
            chunk = sock.recv(4096)
            assert chunk, received
            received += chunk
        assert received.startswith(b"HTTP/1.0 200") or received.startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize("hot_only", [False, True], ids=["ssd", "hot-only"])
def test_client_gone_mid_stream_keeps_its_prefix(hot_only, model_dir, tmp_path):
    tier = ["--hot-cache-only"] if hot_only else ["--ssd-dir", str(tmp_path / "ssd")]
    with server(paged_argv(model_dir, *tier), tmp_path / "paged.log") as (c, _, url):
        history, prompt = warm_prefix(c)
        follow = history + [{"role": "user", "content": "Go on, at length."}]
        stream_and_hang_up(url, follow)
        time.sleep(1.0)   # the server notices on its next write and drops the request
        _, cached, _ = ask(c, follow, stream=True, seed=None)
        check_cache_healthy(url)
    assert cached >= prompt // BLOCK * BLOCK, (cached, prompt)


def run_serve(*argv: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "paged_cache.cli.main", "serve", *argv],
                          capture_output=True, text=True, timeout=120, env=env)


def test_an_unreachable_hub_says_so_and_what_to_do_instead(tmp_path):
    """A Hugging Face id with no network (the hub's endpoint a closed port on this machine): the
    error says the hub could not be reached, and names a local directory, make-model and the
    hub's offline variable instead of the HTTP client's own words alone."""
    endpoint = f"http://127.0.0.1:{free_port()}"   # bound and closed: the connection is refused
    done = run_serve("--model", "org/some-model", "--port", str(free_port()), "--hot-cache-only",
                     env_extra={"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": endpoint,
                                "HF_HOME": str(tmp_path / "hf")})
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith(f"paged-cache serve: error: --model 'org/some-model' could not be "
                           f"loaded: the Hugging Face hub at {endpoint} could not be reached ("), line
    for advice in (f"it is not in the hub's cache ({tmp_path / 'hf' / 'hub'})",
                   "a local mlx-lm model directory", "`paged-cache make-model DIR --real smollm2`",
                   "HF_HUB_OFFLINE=1"):
        assert advice in line, (advice, line)


def test_startup_failures_exit_fast_and_create_nothing(model_dir, tmp_path):
    ssd, xdg = tmp_path / "ssd", tmp_path / "xdg"
    ram = physical_memory_bytes()
    env = {"XDG_CACHE_HOME": str(xdg)}
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((model_dir / "config.json").read_text())
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        cases = {
            "hub id, offline": (["--model", "org/missing-model", "--port", str(free_port())],
                                "--model 'org/missing-model' could not be loaded: HF_HUB_OFFLINE "
                                "is set and it is not in the hub's cache ("),
            "unloadable directory": (["--model", str(broken), "--port", str(free_port())],
                                     f"--model '{broken}' could not be loaded"),
            "port in use": (["--model", str(model_dir), "--port", port],
                            f"HTTP server on 127.0.0.1:{port} failed: [Errno 98] Address already in use"),
            "unresolvable host": (["--model", str(model_dir), "--host", "no-such-host.invalid"],
                                  "HTTP server on no-such-host.invalid:8080 failed"),
            # Below RAM, but not beside the model's weights: refused once the model is loaded.
            "hot budget beside the weights": (
                ["--model", str(model_dir), "--port", str(free_port()), "--hot-cache-max-bytes",
                 str(ram - 1000)],
                f"hot_cache_max_bytes: {ram - 1000} = {format_size(ram - 1000)} (from "
                "flag:--hot-cache-max-bytes) plus the model's weights ("),   # as typed, and sized
        }
        for i, (name, (argv, message)) in enumerate(cases.items()):
            tier = ["--ssd-dir", str(ssd)] if i % 2 else []   # the default: under XDG_CACHE_HOME
            done = run_serve(*argv, *tier, env_extra=env)
            assert done.returncode == 1, (name, done.stderr[-2000:])
            lines = done.stderr.strip().splitlines()
            assert lines[-1].startswith(f"paged-cache serve: error: {message}"), (name, lines)
            assert "Traceback" not in done.stderr, (name, done.stderr[-2000:])
            assert not ssd.exists() and not xdg.exists(), name
    # An SSD directory that cannot be created: the same one-line error, after the model loaded.
    blocker = tmp_path / "file"
    blocker.write_text("")
    done = run_serve("--model", str(model_dir), "--port", str(free_port()), "--ssd-dir",
                     str(blocker / "ssd"))
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1].startswith(
        f"paged-cache serve: error: cannot open the SSD tier at {blocker / 'ssd'}: "), done.stderr


def test_option_mistakes_show_serves_own_usage_and_start_nothing(model_dir, tmp_path):
    """A typo in a flag, a bad value of an mlx_lm.server option and a port outside 1-65535
    exit 2 with `paged-cache serve`'s usage (which lists paged-cache's flags, unlike
    mlx_lm.server's), before any model loads or directory is made."""
    ssd = tmp_path / "ssd"
    cases = {
        "typo of a paged-cache flag": (["--hot-cache-max-bites", "4GB"],
                                       "unrecognized arguments: --hot-cache-max-bites 4GB"),
        "typo of an mlx_lm.server option": (["--max-tokns", "5"],
                                            "unrecognized arguments: --max-tokns 5"),
        "bad value of an mlx_lm.server option": (["--max-tokens", "many"],
                                                 "argument --max-tokens: invalid int value: 'many'"),
        "port above 65535": (["--port", "99999"], "--port: expected a TCP port in 1-65535, got 99999"),
        "port 0": (["--port", "0"], "--port: expected a TCP port in 1-65535, got 0"),
        "negative port": (["--port", "-1"], "--port: expected a TCP port in 1-65535, got -1"),
    }
    for name, (argv, message) in cases.items():
        done = run_serve("--model", str(model_dir), "--ssd-dir", str(ssd), *argv)
        assert done.returncode == 2, (name, done.stderr[-2000:])
        assert done.stderr.startswith("usage: paged-cache serve "), (name, done.stderr)
        assert "--hot-cache-max-bytes SIZE" in done.stderr and "--ssd-dir DIR" in done.stderr
        assert done.stderr.strip().splitlines()[-1].startswith(
            f"paged-cache serve: error: {message}"), (name, done.stderr)
        assert "Traceback" not in done.stderr and not ssd.exists(), name
