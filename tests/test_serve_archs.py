"""End to end on every architecture: `paged-cache serve` vs plain mlx_lm.server, openai client.

Per architecture three servers answer the same conversation (its history is the cold replies):
plain mlx_lm.server with no prompt cache (``--prompt-cache-size 0``: every reply is a cold
greedy run), plain mlx_lm.server, and `paged-cache serve` with an SSD tier. Every paged reply
equals the cold one, and per request paged-cache caches at least as many tokens as
mlx_lm.server wherever mlx_lm.server's reply equals the cold one. Then a restarted paged server
on the same SSD directory serves the first turn from SSD and the same turn again from RAM.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers.serve import (REQUEST_LINE, TURNS, cold_replies, paged_argv, replay,
                           server)

from paged_cache.testing import write_model_dir

# One of each cache mix: KV, sliding window, linear attention + KV, recurrent only, recurrent +
# window, chunked attention.
ARCHS = ("llama", "gemma3_text", "qwen3_next", "mamba", "baichuan_m1", "llama4")
# llama4 with a chunk longer than the conversation, as real llama4 (8192) has: mlx_lm.server's
# sequential path inserts only at the end of a request, and with the tiny 32-token chunk the
# chunked layers then hold just the last 33 rows, so no earlier position can be restored exactly;
# LRUPromptCache reuses there anyway by trimming a cache that lacks rows (inexact, its replies
# only coincide with the cold ones). Exact chunked restores with a 32-token chunk are covered in
# tests/test_prefix_cache.py and tests/test_reuse_differential.py.
CHUNK = {"llama4": 1024}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """arch -> (cold, plain, paged results, model dir, SSD dir), each arch served once."""
    done: dict[str, tuple] = {}

    def run(arch: str) -> tuple:
        if arch not in done:
            base = tmp_path_factory.mktemp(arch)
            model = write_model_dir(base / "model", arch)
            if arch in CHUNK:
                config = json.loads((model / "config.json").read_text())
                config["text_config"]["attention_chunk_size"] = CHUNK[arch]
                (model / "config.json").write_text(json.dumps(config))
            plain_argv = ["-m", "mlx_lm", "server", "--model", str(model)]
            with server([*plain_argv, "--prompt-cache-size", "0"], base / "cold.log") as (c, _, _):
                cold = cold_replies(c)
            replies = [r for r, _, _ in cold]
            ssd = base / "ssd"

            def answers(argv: list[str], log: str) -> list[tuple[str, int, int]]:
                with server(argv, base / log) as (c, _, _):
                    return replay(c, replies, range(TURNS))

            # Plain and paged side by side (the wait is mostly start-up).
            with ThreadPoolExecutor(2) as pool:
                plain = pool.submit(answers, plain_argv, "plain.log")
                paged = pool.submit(answers, paged_argv(model, "--ssd-dir", str(ssd)), "paged.log")
                done[arch] = (cold, plain.result(), paged.result(), model, ssd)
        return done[arch]

    return run


@pytest.mark.parametrize("arch", ARCHS)
def test_replies_exact_and_reuse_at_least_plain(arch, runs):
    cold, plain, paged, _, _ = runs(arch)
    assert all(c == 0 for _, c, _ in cold)
    assert [r for r, _, _ in paged] == [r for r, _, _ in cold], arch
    for turn, ((p_reply, p_cached, _), (reply, cached, _), (c_reply, _, _)) in enumerate(
            zip(plain, paged, cold)):
        if p_reply == c_reply:
            assert cached >= p_cached, (arch, turn, [c for _, c, _ in paged],
                                        [c for _, c, _ in plain])
    assert all(c > 0 for _, c, _ in paged[1:]), [c for _, c, _ in paged]


@pytest.mark.parametrize("arch", ARCHS)
def test_restart_first_turn_from_ssd_then_ram(arch, runs, tmp_path):
    """After a restart the first turn is read from SSD; its insert puts the conversation's
    blocks in RAM, so the same turn asked again is served from RAM alone. The next turn reuses at
    least what it did before the restart: its own tail is on SSD only (stored before the
    restart), so it is served from both tiers."""
    cold, _, paged, model, ssd = runs(arch)
    replies = [r for r, _, _ in cold]
    log = tmp_path / "restart.log"
    with server(paged_argv(model, "--ssd-dir", str(ssd), "--log-level", "DEBUG"), log) as (c, _, _):
        first, again = replay(c, replies, range(1)) + replay(c, replies, range(1))
        second = replay(c, replies, range(1, 2))[0]
    assert first[0] == again[0] == replies[0] and second[0] == replies[1]
    tiers = [tier for _, _, tier, _ in REQUEST_LINE.findall(log.read_text())]
    assert first[1] > 0 and tiers[0] == "ssd", (arch, tiers)
    assert again[1] >= first[1] and tiers[1] == "hot", (arch, tiers, first, again)
    assert second[1] >= paged[1][1] and tiers[2] in ("hot", "mixed"), (arch, tiers, second)
