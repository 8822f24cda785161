"""`paged-cache serve` under mlx.launch (two ranks on 127.0.0.1): a model sharded by layers
(--pipeline, hybrid qwen3_next) and by heads (tensor parallel, llama), driven by the openai client.

Three sharded servers answer the same conversation (its history is the cold replies): plain
distributed mlx_lm.server with no prompt cache (every reply a cold greedy run), plain distributed
mlx_lm.server, and `paged-cache serve` with one SSD directory both ranks share. Every paged reply
equals the cold one; per request paged-cache caches at least as many tokens as plain
mlx_lm.server wherever plain's reply equals the cold one; rank 0 alone logs requests; its stats
say the rank and the group's agreed hits. Every server runs under a deadline that fails the test.
"""

from __future__ import annotations

import os
import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest
from helpers.serve import (RESTORING, REQUEST_LINE, TURNS, cold_replies, live_stats, replay,
                           wait_for_health)
from openai import OpenAI

from paged_cache.testing import write_model_dir
from paged_cache.testing.ranks import can_split, free_ports, start, stop

START_SECONDS = 240.0
SHARDINGS = [("qwen3_next", ["--pipeline"]), ("llama", [])]


@contextmanager
def sharded_server(argv: list[str], log: Path) -> Iterator[tuple[OpenAI, str]]:
    """Two ranks of a server module (rank 0 answers HTTP); yields (client, base URL), then stops
    every rank."""
    port = free_ports(1)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **RESTORING}
    with log.open("w") as out:
        proc = start([*argv, "--host", "127.0.0.1", "--port", str(port), "--max-tokens", "12"],
                     module=True, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for_health(proc, port, log, START_SECONDS)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                        timeout=120)
        yield client, f"http://127.0.0.1:{port}"
    finally:
        stop(proc)


@pytest.fixture(scope="module", params=SHARDINGS, ids=lambda s: s[0])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    arch, split = request.param
    mode = "pipeline" if split else "tensor"
    if not can_split(arch, mode):
        pytest.skip(f"the installed mlx-lm cannot split {arch} by {mode}")
    base = tmp_path_factory.mktemp(f"served-{arch}")
    model = write_model_dir(base / "model", arch)
    plain = ["mlx_lm", "server", "--model", str(model), *split]
    with sharded_server([*plain, "--prompt-cache-size", "0"], base / "cold.log") as (c, _):
        cold = cold_replies(c)
    replies = [r for r, _, _ in cold]
    with sharded_server(plain, base / "plain.log") as (c, _):
        plain_runs = replay(c, replies, range(TURNS))
    paged = ["paged_cache.cli.main", "serve", "--model", str(model), "--block-size", "16",
             "--ssd-dir", str(base / "ssd"), *split]
    with sharded_server(paged, base / "paged.log") as (c, url):
        paged_runs = replay(c, replies, range(TURNS))
        stats = live_stats(url)
    return {"cold": cold, "plain": plain_runs, "paged": paged_runs, "stats": stats,
            "log": (base / "paged.log").read_text()}


def test_replies_exact_and_reuse_at_least_plain(served: dict) -> None:
    cold, plain, paged = served["cold"], served["plain"], served["paged"]
    assert all(c == 0 for _, c, _ in cold)
    assert [r for r, _, _ in paged] == [r for r, _, _ in cold]
    for turn, ((p_reply, p_cached, _), (_, cached, _), (c_reply, _, _)) in enumerate(
            zip(plain, paged, cold)):
        if p_reply == c_reply:
            assert cached >= p_cached, (turn, [c for _, c, _ in paged], [c for _, c, _ in plain])
    assert all(c > 0 for _, c, _ in paged[1:]), [c for _, c, _ in paged]


def test_rank_zero_alone_logs_and_its_stats_name_the_group(served: dict) -> None:
    lines = REQUEST_LINE.findall(served["log"])
    assert [(int(c), int(p)) for c, p, _, _ in lines] == [(c, p) for _, c, p in served["paged"]]
    stats = served["stats"]["prefix"]
    assert (stats["rank"], stats["group_size"]) == (0, 2), stats
    assert stats["agreements"] == TURNS and stats["fetch_errors"] == 0, stats
    assert stats["shard"].startswith("rank 0/2"), stats
