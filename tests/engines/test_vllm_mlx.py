"""vllm-mlx (installed from the package registry) serving over HTTP with paged-cache as its prefix
cache, against the same vllm-mlx with its own cache and with none (the cold run).

Run inside the engine's environment: `make test-engines` (pytest --engine vllm-mlx).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from openai import APITimeoutError, OpenAI

from paged_cache import rates_file
from paged_cache.integrations.shared.stats_http import HISTOGRAMS
from paged_cache.metrics import histograms
from paged_cache.testing.engines import (ENGINES, SYSTEM, EngineServer, Turn, chat, openai_client,
                                         start_all)
from paged_cache.testing.load import LOAD_SYSTEM, concurrent_chats
from paged_cache.testing.server import ValkeyServer
from helpers.tenants import chat_ask, check_salts, check_user_salts
from reuse import ARCHS, RESTORE, Reference, check_reuse, references, drop_a_stream, first_turns_together

pytestmark = pytest.mark.timeout(900)

# Caches the Scheduler cannot trim after the first token (recurrent state, a full sliding window):
# it snapshots them after prefill, once per 4096 tokens of growth; paged-cache on every request.
SNAPSHOT_ARCHS = ("qwen3_next", "gemma3_text")
# Requests that name a salt and are served: 5 of check_salts, 4 of check_user_salts.
SALTED_REQUESTS = {False: 5, True: 4}
# Chats opening at once over one system prompt (test_chats_opening_together_...).
CLIENTS = 4
# vllm-mlx's --chunked-prefill-tokens in test_chats_opening_together_with_chunked_prefill: a
# tenth of the system prompt, so every first turn is prefilled in chunks.
CHUNK_TOKENS = 256


ENGINE = ENGINES["vllm-mlx"]


def vllm(model: Path, workdir: Path, *extra: str, name: str) -> EngineServer:
    """Plain `vllm-mlx serve MODEL --continuous-batching` (its own cache unless told otherwise)."""
    return ENGINE.own(sys.executable, model, workdir, *extra, name=name)


def paged(model: Path, workdir: Path, *cache_flags: str, extra: tuple[str, ...] = (),
          name: str = "paged") -> EngineServer:
    """`paged-cache vllm-mlx --block-size 16 [cache flags] serve MODEL --continuous-batching`."""
    return ENGINE.paged(sys.executable, model, workdir, "--block-size", "16", *cache_flags,
                        extra=extra, name=name)


def run(server: EngineServer, model: Path, **kw: object) -> list[Turn]:
    """The workload (or part of it); cached tokens as vllm-mlx's /v1/cache/stats counts them."""
    return chat(server.url, str(model), cached=ENGINE.cached(server), **kw)


def paged_stats(server: EngineServer) -> dict:
    return server.get("/v1/cache/stats")["engine_cache"]["paged_cache"]


@pytest.fixture(scope="module")
def reference(models, tmp_path_factory) -> Reference:
    """(cold run, own-cache run) per arch: vllm-mlx without a prefix cache and with its own."""
    return references(tmp_path_factory,
                      lambda arch, work, name, extra: vllm(models[arch], work, *extra, name=name),
                      lambda s, arch: run(s, models[arch]), ENGINE.cold)


@pytest.mark.parametrize("arch", ARCHS)
def test_reuse_at_least_own_cache_and_replies_equal_cold(arch, models, reference, tmp_path):
    """Two conversations of three turns sharing a system prompt: every reply equals the cold
    run's; every request reuses at least what vllm-mlx's own cache reuses; on the hybrid and the
    sliding-window model strictly more in total (a snapshot on every turn, not every 4096
    tokens). The Scheduler's prefills are samples of the model's prefill rate (in stats, and
    saved in the SSD directory at shutdown for the next start); each request's time to first
    token is in the histogram by outcome and tier."""
    cold, own = reference(arch)
    with paged(models[arch], tmp_path, "--ssd-dir", str(tmp_path / "ssd"), *RESTORE) as ours:
        turns = run(ours, models[arch])
        stats = paged_stats(ours)
        assert ours.stop() == 0, ours.tail()
    assert stats["prefix"]["prefill_samples"] >= len(turns)
    assert stats["prefix"]["prefill_tokens_per_s"] > 0
    saved = rates_file.load(tmp_path / "ssd")
    assert saved is not None and list(saved.prefill_tokens_per_s.values()) == [
        pytest.approx(stats["prefix"]["prefill_tokens_per_s"])]
    total, own_total = check_reuse(turns, own, cold)
    assert total > 0
    if arch in SNAPSHOT_ARCHS:
        assert total > own_total
    assert stats["requests"]["cache_errors"] == stats["requests"]["store_errors"] == 0
    assert stats["requests"]["cached_tokens"] == sum(t.cached_tokens for t in turns)
    assert list((tmp_path / "ssd").rglob("*.safetensors")), "no block reached the SSD tier"
    check_first_tokens(stats, len(turns))


def check_first_tokens(stats: dict, requests: int) -> None:
    """Each of the ``requests`` served has its time to first token in the histogram (and the
    counters `paged-cache stats` averages), under the outcome and tier its fetch counted."""
    counted = stats["requests"]
    series = {(s["labels"]["outcome"], s["labels"]["tier"]): s
              for s in stats[HISTOGRAMS]["time_to_first_token_seconds"]}
    expected = {("miss", "none"): counted["requests_miss"],
                **{("hit", t): counted[f"requests_{t}"] for t in histograms.HIT_TIERS}}
    assert {k: s["count"] for k, s in series.items()} == {k: n for k, n in expected.items() if n}
    assert counted["ttft_requests"] == counted["requests"] == requests
    assert series[("hit", "hot")]["count"] > 0 and series[("miss", "none")]["count"] > 0
    assert all(s["sum"] > 0 and s["labels"]["engine"] == "vllm_mlx" for s in series.values())
    assert sum(s["sum"] for s in series.values()) == pytest.approx(counted["ttft_seconds"])


def test_batching_cancel_and_restart_from_ssd(models, reference, tmp_path):
    """Concurrent first turns (one batch) get the cold run's replies; a stream the client drops
    is aborted and the server goes on serving, the next turn from the cache; after a restart the
    turn after that is rebuilt from the SSD tier, named by vllm-mlx's own --ssd-cache-dir."""
    model, ssd = models["qwen3_next"], tmp_path / "ssd"
    cold, _ = reference("qwen3_next")      # conversation 0: turns 0-2, then conversation 1
    histories: dict[int, list[dict]] = {}
    with paged(model, tmp_path, extra=("--ssd-cache-dir", str(ssd)), name="first") as first:
        firsts = first_turns_together(first.url, str(model), histories)
        assert [t.reply for t in firsts] == [cold[0].reply, cold[3].reply]
        drop_a_stream(first.url, str(model))   # vllm-mlx aborts it
        second = run(first, model, conversations=1, turns=1, history=histories, first_turn=1)
        assert first.stop() == 0, first.tail()
    assert second[0].reply == cold[1].reply
    assert second[0].cached_tokens > cold[0].prompt_tokens
    assert list(ssd.rglob("*.safetensors"))
    assert not (tmp_path / "home" / ".cache" / "vllm-mlx").exists()
    with paged(model, tmp_path, extra=("--ssd-cache-dir", str(ssd)), name="second") as again:
        third = run(again, model, conversations=1, turns=1, history=histories, first_turn=2)
        stats = paged_stats(again)
    assert third[0].reply == cold[2].reply
    assert third[0].cached_tokens > cold[1].prompt_tokens
    assert stats["requests"]["requests_ssd"] + stats["requests"]["requests_mixed"] == 1
    assert stats["requests"]["cache_errors"] == 0


@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_chats_opening_together_prefill_their_system_prompt_once(arch, models, tmp_path):
    """Four chats opening at once over one ~2.4k-token system prompt: every first turn but one
    restores the system prompt (the others wait for the first one's insert at its chat prefix,
    instead of prefilling it in the same batch); with --no-shared-prefill every one prefills
    it. The replies are the same either way (greedy)."""
    model = models[arch]
    runs, stats = {}, {}
    for mode, flags in (("shared", ()), ("alone", ("--no-shared-prefill",))):
        work = tmp_path / mode
        with paged(model, work, "--ssd-dir", str(work / "ssd"), *flags, name=mode) as server:
            runs[mode] = concurrent_chats(server.url, str(model), clients=CLIENTS, turns=1)
            stats[mode] = paged_stats(server)["requests"]
            assert server.stop() == 0, server.tail()
    assert runs["shared"].replies() == runs["alone"].replies()
    shared, alone = stats["shared"], stats["alone"]
    assert shared["requests"] == alone["requests"] == CLIENTS
    assert alone["requests_miss"] == CLIENTS and alone["prefill_waits"] == 0
    assert shared["requests_miss"] == 1          # one prefill of the system prompt
    assert shared["cached_tokens"] >= (CLIENTS - 1) * len(LOAD_SYSTEM)  # one token per byte
    assert shared["prefill_waits"] > 0 and shared["prefill_waits_expired"] == 0
    for s in (shared, alone):
        assert s["cache_errors"] == s["store_errors"] == 0


@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_chats_opening_together_with_chunked_prefill(arch, models, tmp_path):
    """As above with vllm-mlx's --chunked-prefill-tokens at a budget well under the system
    prompt: the waiting chats are released by the first one's insert at its chat prefix (none
    waits out MAX_WAIT_SECONDS) and restore the system prompt; the replies equal those with
    --no-shared-prefill; a later chat restores at least what vllm-mlx's own cache (chunked
    the same way) restores of the same stream, and the system prompt."""
    model, chunked = models[arch], ("--chunked-prefill-tokens", str(CHUNK_TOKENS))
    servers = {
        "shared": paged(model, tmp_path / "shared", "--ssd-dir", str(tmp_path / "shared" / "ssd"),
                        *RESTORE, extra=chunked, name="shared"),
        "alone": paged(model, tmp_path / "alone", "--ssd-dir", str(tmp_path / "alone" / "ssd"),
                       "--no-shared-prefill", extra=chunked, name="alone"),
        "own": vllm(model, tmp_path / "own", *chunked, name="own"),
    }
    start_all(list(servers.values()))
    runs, later, stats = {}, {}, {}
    try:
        for mode, server in servers.items():
            runs[mode] = concurrent_chats(server.url, str(model), clients=CLIENTS, turns=1)
            if mode != "own":
                stats[mode] = paged_stats(server)["requests"]
            later[mode] = run(server, model, conversations=1, first_conversation=CLIENTS,
                              turns=1, system=LOAD_SYSTEM)[0]
    finally:
        codes = {mode: server.stop() for mode, server in servers.items()}
    assert codes["shared"] == codes["alone"] == 0, \
        servers["shared"].tail() + servers["alone"].tail()
    assert runs["shared"].replies() == runs["alone"].replies()
    assert later["shared"].reply == later["alone"].reply
    shared, alone = stats["shared"], stats["alone"]
    assert alone["requests_miss"] == CLIENTS and alone["prefill_waits"] == 0
    assert shared["requests_miss"] == 1          # one prefill of the system prompt
    assert shared["prefill_waits"] > 0 and shared["prefill_waits_expired"] == 0
    assert shared["cached_tokens"] >= (CLIENTS - 1) * len(LOAD_SYSTEM)  # one token per byte
    assert later["shared"].cached_tokens >= len(LOAD_SYSTEM)
    if later["own"].reply == later["shared"].reply:   # its cache served the same request
        assert later["shared"].cached_tokens >= later["own"].cached_tokens
    for s in (shared, alone):
        assert s["cache_errors"] == s["store_errors"] == 0


def test_a_chat_dropped_while_it_waits_for_a_shared_prefill(models, tmp_path):
    """A chat opening with others whose client gives up at once (on the CPU backend while it
    waits for the first chat's prefill: vllm-mlx aborts it in its queue) leaves the others and
    the next request served as usual, without a cache error."""
    model = models["llama"]
    outcome: list[str] = []

    def give_up(url: str) -> None:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=0.3, max_retries=0)
        try:
            for _ in client.chat.completions.create(
                    model=str(model), stream=True, max_tokens=12, temperature=0.0,
                    messages=[{"role": "system", "content": LOAD_SYSTEM},
                              {"role": "user", "content": "Never mind."}]):
                pass
            outcome.append("answered")
        except APITimeoutError:
            outcome.append("gave up")

    with paged(model, tmp_path, "--ssd-dir", str(tmp_path / "ssd")) as server:
        dropped = threading.Timer(0.1, give_up, args=(server.url,))
        dropped.start()
        together = concurrent_chats(server.url, str(model), clients=CLIENTS - 1, turns=1)
        dropped.join(timeout=60)
        later = concurrent_chats(server.url, str(model), clients=1, turns=1)
        stats = paged_stats(server)["requests"]
        assert server.stop() == 0, server.tail()
    assert outcome in (["gave up"], ["answered"])
    assert len(together.turns) == CLIENTS - 1 and later.turns[0].reply
    assert stats["requests_miss"] == 1 and stats["prefill_waits_expired"] == 0
    assert stats["cache_errors"] == stats["store_errors"] == 0


def test_a_later_conversation_restores_the_system_prompt_on_a_hybrid(models, tmp_path):
    """On the hybrid, a conversation's first turn stores its state where its chat prefix ends
    (it leads, even alone), so the next conversation restores the system prompt; with
    --no-shared-prefill the only state stored is at the prompt's end, and it restores
    nothing."""
    model = models["qwen3_next"]
    cached = {}
    for mode, flags in (("shared", ()), ("alone", ("--no-shared-prefill",))):
        work = tmp_path / mode
        with paged(model, work, "--ssd-dir", str(work / "ssd"), *flags, name=mode) as server:
            turns = run(server, model, conversations=2, turns=1)
            assert paged_stats(server)["requests"]["store_errors"] == 0
        cached[mode] = [t.cached_tokens for t in turns]
    assert cached["alone"] == [0, 0]
    assert cached["shared"][0] == 0 and cached["shared"][1] >= len(SYSTEM)


def test_hot_cache_only_hosts_share_through_the_remote_tier(models, reference, tmp_path):
    """Two hot-only servers on one Valkey / Redis: the second continues the first's conversation
    from the remote tier; neither writes a file."""
    model = models["qwen3_next"]
    cold, _ = reference("qwen3_next")
    history: dict = {}
    with ValkeyServer() as valkey:
        flags = ("--hot-cache-only", "--remote-url", valkey.url)
        with paged(model, tmp_path / "a", *flags, name="a") as first:
            before = run(first, model, conversations=1, turns=2, history=history)
        with paged(model, tmp_path / "b", *flags, name="b") as second:
            after = run(second, model, conversations=1, turns=1, history=history, first_turn=2)
            stats = paged_stats(second)
    assert [t.reply for t in before + after] == [t.reply for t in cold[:3]]
    assert after[0].cached_tokens > before[1].prompt_tokens
    assert stats["requests"]["requests_remote"] + stats["requests"]["requests_mixed"] == 1
    for host in ("a", "b"):
        assert not list((tmp_path / host).rglob("*.safetensors"))


@pytest.mark.parametrize("from_user", [False, True], ids=["salts", "users"])
def test_tenants_reuse_only_their_own_prefixes(models, tmp_path, from_user):
    """As with `paged-cache serve` (tests/helpers/tenants.py): a second tenant (another salt, no
    salt; with --cache-salt-from-user another user) reuses 0 tokens of the first's private
    text, the same tenant all of it; bad salts get HTTP 400. Every salted request reached the
    cache's fetch under its salt."""
    model = models["llama"]
    flags = ("--cache-salt-from-user",) if from_user else ()
    with paged(model, tmp_path, "--ssd-dir", str(tmp_path / "ssd"), *flags) as server:
        ask = chat_ask(openai_client(server.url), str(model), ENGINE.cached(server))
        (check_user_salts if from_user else check_salts)(ask)
        stats = paged_stats(server)
    assert stats["requests"]["requests_salted"] == SALTED_REQUESTS[from_user]
    assert stats["requests"]["cache_errors"] == stats["requests"]["store_errors"] == 0


def test_the_user_flag_is_refused_for_a_model_on_the_vision_path(models, tmp_path):
    """vllm-mlx routes a model whose config has a vision part to its vision path, whose cache
    knows no salt: with --cache-salt-from-user the start fails with one line, before the model
    loads."""
    vision = tmp_path / "vision"
    shutil.copytree(models["llama"], vision)
    config = json.loads((vision / "config.json").read_text())
    (vision / "config.json").write_text(json.dumps({**config, "vision_config": {}}))
    done = subprocess.run([sys.executable, "-m", "paged_cache.cli.main", "vllm-mlx",
                           "--cache-salt-from-user", "--ssd-dir", str(tmp_path / "ssd"), "serve",
                           str(vision), "--continuous-batching"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env=dict(os.environ, HOME=str(tmp_path), HF_HUB_OFFLINE="1"))
    assert done.returncode == 1, done.stderr[-3000:]
    assert "paged-cache vllm-mlx: error: --cache-salt-from-user (from flag:" in done.stderr
    assert "vllm-mlx's vision path" in done.stderr


@pytest.mark.parametrize("argv, message", [
    (["serve", "M"], "add --continuous-batching"),
    (["serve", "M", "--continuous-batching", "--use-paged-cache"], "selects another prefix cache"),
    (["--ssd-dir", "/tmp/x", "serve", "M", "--continuous-batching", "--ssd-cache-dir", "/tmp/y"],
     "both set the SSD tier"),
    (["--cache-salt-from-user", "serve", "M", "--continuous-batching", "--mllm"],
     "vision path (--mllm, or a vision model), which keeps a prefix cache of its own"),
])
def test_command_lines_paged_cache_cannot_serve_fail_clearly(argv, message, tmp_path):
    done = subprocess.run([sys.executable, "-m", "paged_cache.cli.main", "vllm-mlx", *argv],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr.startswith("paged-cache vllm-mlx: error: ") and message in done.stderr



LONG_TURN = "And what then, step by step? " * 150


def _fetches(server: EngineServer) -> int:
    prefix = paged_stats(server)["prefix"]
    return prefix["hits"] + prefix["misses"]


def _second_turn(model: Path, workdir: Path, drop: bool) -> int:
    """Cached tokens of a conversation's second turn (a long message: its prefill takes a while)
    on a fresh server, after (``drop``) the same turn sent as a stream the client drops as soon
    as the server answered its headers (vllm-mlx aborts it, before it could store)."""
    histories: dict[int, list[dict]] = {}
    with paged(model, workdir, "--ssd-dir", str(workdir / "ssd"), name=workdir.name) as server:
        run(server, model, conversations=1, turns=1, history=histories)
        messages = histories[0] + [{"role": "user", "content": LONG_TURN}]
        if drop:
            fetches = _fetches(server)
            openai_client(server.url).chat.completions.create(
                model=str(model), messages=messages, max_tokens=4000, temperature=0.0,
                stream=True).close()
            deadline = time.monotonic() + 30  # its fetch (unless aborted before it)
            while _fetches(server) == fetches and time.monotonic() < deadline:
                time.sleep(0.05)
        before = paged_stats(server)["prefix"]["tokens_matched"]
        openai_client(server.url).chat.completions.create(
            model=str(model), messages=messages, max_tokens=12, temperature=0.0)
        cached = paged_stats(server)["prefix"]["tokens_matched"] - before
        assert server.stop() == 0, server.tail()
    return cached


def test_a_dropped_turn_costs_the_same_turn_asked_again_nothing(models, tmp_path):
    """A client that goes away while its turn is served (the request may never store): the
    same turn asked again reuses at least what it reuses when nobody dropped it (the
    conversation's partial tail was read by the dropped request's fetch, not taken)."""
    plain = _second_turn(models["llama"], tmp_path / "plain", drop=False)
    assert _second_turn(models["llama"], tmp_path / "dropped", drop=True) >= plain > 0
