"""The ``paged-cache`` command run in-process, and cache directories written by the library for it
to read: chains of KV blocks of two synthetic models, and a real HTTP server answering the stats
routes as ``paged-cache serve`` does."""

from __future__ import annotations

import argparse
import contextlib
import http.server
import io
import json
import threading
from pathlib import Path

import mlx.core as mx

from paged_cache.block import Block
from paged_cache.cli.main import main
from paged_cache.cli.options import add_config_arguments, config_from_args
from paged_cache.config import CacheConfig
from paged_cache.hashing import ROOT_PARENT
from paged_cache.integrations.shared.stats_http import answer
from helpers.blocks import key_of
from helpers.managers import new_manager

FP_A, FP_B = "a" * 64, "b" * 64


def run_cli(*argv: str) -> tuple[int, str, str]:
    """paged_cache.cli.main.main in-process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(list(argv))
    return status, out.getvalue(), err.getvalue()


def parse_cli(argv: list[str], environ: dict[str, str] | None = None) -> CacheConfig:
    """The CacheConfig the command's configuration flags ``argv`` give under ``environ``."""
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    return config_from_args(parser.parse_args(argv), environ=environ or {})


def cli_json(*argv: str):
    status, out, err = run_cli(*argv, "--json")
    assert status == 0, err
    return json.loads(out)


def kv_block(label: object, *, fingerprint: str, parent: str, tokens: int, start: int = 0,
               n: int = 64, layers: int = 2) -> Block:
    """A block of ``layers`` KV-like layers whose content is a pure function of its label."""
    seed = int(key_of(label)[:6], 16) % 997
    arrays = {}
    for i in range(layers):
        base = mx.arange(n * tokens, dtype=mx.float32).reshape(1, 2, tokens, n // 2) * 0.5 + seed + i
        arrays[f"l{i}.keys"] = base.astype(mx.float16)
        arrays[f"l{i}.values"] = (base + 1).astype(mx.float16)
    meta = {"fingerprint": fingerprint, "parent": parent, "start": str(start), "tokens": str(tokens),
            "layers": json.dumps([{"type": "KVCache"}] * layers)}
    return Block(key_of(label), arrays, meta)


def chain(prefix: str, fingerprint: str, sizes: list[int], parent: str = ROOT_PARENT) -> list[Block]:
    """Consecutive blocks of one sequence (each the parent of the next)."""
    blocks, start = [], 0
    for j, tokens in enumerate(sizes):
        b = kv_block(f"{prefix}-{j}", fingerprint=fingerprint, parent=parent, tokens=tokens, start=start)
        blocks.append(b)
        parent, start = b.key, start + tokens
    return blocks


def store(directory: Path, blocks: list[Block], **config) -> None:
    """Put ``blocks`` into a cache directory (config: CacheConfig fields over small defaults)."""
    opts = dict(ssd_max_bytes="1GB", hot_cache_max_bytes="1MB", block_size=16)
    opts.update(config)
    with new_manager(directory, **opts) as manager:
        for b in blocks:
            assert manager.put(b)


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True


def serve_stats(source, gauges=frozenset()) -> tuple[_Server, str]:
    """A real HTTP server answering the stats endpoint exactly as `paged-cache serve` must."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if not answer(self, source, gauges):
                self.send_error(404)

        def log_message(self, *args):
            pass

    server = _Server(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"
