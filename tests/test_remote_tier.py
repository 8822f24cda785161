"""The remote tier against a real valkey-server / redis-server on 127.0.0.1 (from PATH; `make test`
installs one): hosts sharing blocks exactly, outages, damaged values, capacity, config, metrics."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest

from paged_cache.block import Block
from paged_cache.cli.remote_summary import server_summary
from paged_cache.config import REMOTE_PASSWORD_ENV, CacheConfig
from paged_cache.hashing import chain_keys
from paged_cache.manager import PagedSSDCacheManager
from paged_cache.prefix_cache import BlockAwarePrefixCache
from paged_cache.stats import nested_gauges, render_prometheus
from helpers.metrics import kind, parse_exposition, value
from paged_cache.testing import tiny_model
from paged_cache.testing.server import ServerCluster, ValkeyServer, client, free_port
from paged_cache.tiers import format as fmt
from paged_cache.tiers.remote.client import KEY_PREFIX, block_name, children_name

from helpers.prefix import assert_exact, prompt, store_prompt

BLOCK = 16
WALK = "0" * 64  # a fingerprint for chain walks that only ask where the keys are held
HOST = Path(__file__).with_name("remote_host.py")


LOADED = 5.0  # remote_timeout of tests that do not test timeouts: a busy CI machine is slow


def remote_config(url: str, **kw) -> CacheConfig:
    kw.setdefault("remote_timeout", LOADED)
    kw.setdefault("fetch_policy", "always-restore")  # where blocks are found, not the cost trade
    return CacheConfig(block_size=BLOCK, hot_cache_only=True, remote_url=url, **kw)


def stored_chain(url: str, model, tokens: list[int]) -> list[str]:
    """Store ``tokens`` through a hot-only host; return the chain keys (all on the server)."""
    with PagedSSDCacheManager(remote_config(url)) as manager:
        prefix = BlockAwarePrefixCache(manager, model)
        store_prompt(model, prefix, tokens)
        manager.flush()
        fingerprint = prefix.fingerprint
    return chain_keys(fingerprint, "", tokens, BLOCK)


# ------------------------------------------------------------------------------ hosts

class Host:
    """A real subprocess serving from its own SSD directory and the shared server."""

    def __init__(self, ssd_dir: Path, url: str) -> None:
        self.proc = subprocess.Popen([sys.executable, str(HOST), str(ssd_dir), url],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, command: str) -> dict:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"host exited ({self.proc.wait()}) on {command!r}"
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        assert self.proc.wait(timeout=120) == 0


def test_hosts_share_blocks_and_survive_a_killed_server(tmp_path: Path, server: ValkeyServer,
                                                       url: str) -> None:
    a, b = Host(tmp_path / "a", url), Host(tmp_path / "b", url)
    try:
        assert a.ask("store 1") == {"ok": True}
        first = b.ask("fetch 1")  # b's first request for a's prefix: a remote hit, exact
        assert first["tier"] == "remote" and first["n"] == 4 * BLOCK + 5 and first["remote_hits"] == 5

        server.kill()  # SIGKILL: both keep serving from their local tiers, nothing raises
        assert a.ask("store 2") == {"ok": True}
        assert a.ask("fetch 2")["n"] > 0             # a's own blocks, local
        again = b.ask("fetch 1")                     # promoted into b's local tiers
        assert again["n"] == first["n"] and again["remote_hits"] == 0
        assert b.ask("store 3") == {"ok": True}
        assert b.ask("fetch 2")["n"] == 0            # a's store 2 never reached the server
        for host in (a, b):
            remote = host.ask("stats")["remote"]
            assert remote["errors"] >= 1 and remote["outages"] == 1

        server.start()  # empty again; the writer threads reconnect with back-off
        deadline = time.monotonic() + 30
        while not all(h.ask("stats")["remote"]["available"] for h in (a, b)):
            assert time.monotonic() < deadline, "hosts did not reconnect"
            time.sleep(0.2)
        assert a.ask("store 4") == {"ok": True}
        resumed = b.ask("fetch 4")
        assert resumed["tier"] == "remote" and resumed["remote_hits"] == 5
    finally:
        server.start() if not server.ping() else None
        a.close()
        b.close()


# ------------------------------------------------------------------------------ damage

def test_damaged_truncated_and_foreign_values_are_counted_misses(url: str) -> None:
    model, other = tiny_model("llama"), tiny_model("llama", seed=1)
    tokens = prompt(5 * BLOCK)
    keys = stored_chain(url, model, tokens)
    foreign = stored_chain(url, other, tokens)
    db = client(url)
    value = db.get(block_name(keys[0]))
    damaged = bytearray(value)
    damaged[-7] ^= 0xFF
    db.set(block_name(keys[0]), bytes(damaged))                    # payload bit flip
    db.set(block_name(keys[1]), value[:len(value) // 2])           # truncated
    db.set(block_name(keys[2]), db.get(block_name(foreign[2])))    # another model's block
    db.set(block_name(keys[3]), b"not a block file")               # garbage
    db.delete(block_name(keys[4]))
    db.hset(block_name(keys[4]), "x", "y")                         # not even a string
    with PagedSSDCacheManager(remote_config(url)) as manager:
        assert [manager.get(k) for k in keys] == [None] * 5
        remote = manager.stats()["remote"]
        assert remote["damaged"] == 5 and remote["misses"] == 5 and remote["hits"] == 0
        assert remote["errors"] == 0 and remote["available"]
        prefix = BlockAwarePrefixCache(manager, model)
        cache, n = prefix.fetch(tokens + [1])
        assert (cache, n) == (None, 0)
        assert manager.get(foreign[2]) is not None  # the other model's own block is intact


def test_planted_child_listings_are_ignored_and_counted(url: str) -> None:
    model = tiny_model("llama")
    tokens = prompt(3 * BLOCK + 5)
    keys = stored_chain(url, model, tokens)
    with PagedSSDCacheManager(remote_config(url)) as manager:
        prefix = BlockAwarePrefixCache(manager, model)
        db = client(url)
        listing = [n.decode() for n in db.keys(f"{KEY_PREFIX}:c:*:{keys[1]}")]
        assert len(listing) == 1
        db.hset(listing[0], "../../etc/passwd", "{}")
        db.hset(listing[0], "f" * 64, "not json")
        n = assert_exact(model, prefix, tokens + [7])
        assert n == len(tokens)
        assert manager.stats()["remote"]["damaged"] == 2


# ------------------------------------------------------------------------------ outages

def test_absent_server_degrades_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    model = tiny_model("llama")
    tokens = prompt(3 * BLOCK + 1)
    config = remote_config(f"redis://127.0.0.1:{free_port()}/0", remote_timeout=0.2)
    with caplog.at_level(logging.WARNING, logger="paged_cache"), \
            PagedSSDCacheManager(config) as manager:
        prefix = BlockAwarePrefixCache(manager, model)
        for _ in range(3):
            assert_exact(model, prefix, tokens)  # exact whatever it reuses; never raises
            store_prompt(model, prefix, tokens)
        remote = manager.stats()["remote"]
    warnings = [r for r in caplog.records if r.name == "paged_cache.remote"]
    assert len(warnings) == 1 and "unreachable" in warnings[0].getMessage()
    assert remote["outages"] == 1 and remote["errors"] == 1 and remote["skipped"] >= 2
    assert remote["available"] is False


def test_stalled_server_times_out_then_resumes(server: ValkeyServer, url: str) -> None:
    model = tiny_model("llama")
    tokens = prompt(3 * BLOCK + 1)
    keys = stored_chain(url, model, tokens)
    with PagedSSDCacheManager(remote_config(url, remote_timeout=0.2)) as manager:
        server.process.send_signal(signal.SIGSTOP)  # slow as can be: answers nothing
        try:
            started = time.perf_counter()
            assert manager.chain(keys, WALK)[0] == [None] * len(keys)
            assert manager.get(keys[0]) is None
            assert time.perf_counter() - started < 2.0  # one timeout, then skipped
        finally:
            server.process.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 10
        while not manager.stats()["remote"]["available"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert manager.chain(keys, WALK)[0] == ["remote"] * len(keys)
        assert manager.get(keys[0]) is not None
        assert manager.stats()["remote"]["outages"] == 1


def test_write_queue_is_bounded_in_bytes(url: str) -> None:
    blocks = [Block(f"{i:064x}", {"a": mx.ones((64, 64))}, {}) for i in range(8)]  # 16 KiB each
    with PagedSSDCacheManager(remote_config(url, remote_queue_max_bytes=20_000)) as manager:
        for block in blocks:
            manager.put(block)
        manager.flush()
        remote = manager.stats()["remote"]
        assert remote["write_drops"] >= 1 and remote["queue_bytes"] == 0
        assert remote["writes"] + remote["write_drops"] == len(blocks)


# ------------------------------------------------------------------------------ capacity

def put_each(url: str, blocks: list[Block]) -> dict:
    """Put and send the blocks one by one through a hot-only host; its remote stats."""
    with PagedSSDCacheManager(remote_config(url)) as manager:
        for block in blocks:
            manager.put(block)
            manager.flush()
        return manager.stats()["remote"]


def test_allkeys_lru_bounds_the_server_and_ttl_expires(tmp_path: Path) -> None:
    blocks = [Block(f"{i:064x}", {"a": mx.full((128, 128), i, dtype=mx.float32)}, {})
              for i in range(40)]  # 64 KiB each, 2.5 MiB in all
    with ValkeyServer(maxmemory="2mb", maxmemory_policy="allkeys-lru") as srv:
        remote = put_each(srv.url, blocks)
        assert remote["write_errors"] == 0 and remote["writes"] == len(blocks)
        assert srv.settles_within(2 * 2**20 + 2**16) <= 2 * 2**20 + 2**16  # + a block
        held = client(srv.url).exists(*[block_name(b.key) for b in blocks])
        assert 0 < held < len(blocks)
        assert client(srv.url).exists(block_name(blocks[-1].key))  # the newest survive
    with ValkeyServer(maxmemory="1mb", maxmemory_policy="noeviction") as srv:
        remote = put_each(srv.url, blocks)
        assert remote["write_errors"] > 0 and remote["outages"] == 0  # full: counted, served
    with ValkeyServer() as srv:
        with PagedSSDCacheManager(remote_config(srv.url, remote_ttl=100)) as manager:
            manager.put(blocks[0])
            manager.flush()
        assert 0 < client(srv.url).ttl(block_name(blocks[0].key)) <= 100


# ------------------------------------------------------------------------------ config / metrics

def test_remote_settings_parse_and_hide_the_password(monkeypatch: pytest.MonkeyPatch) -> None:
    config = CacheConfig.from_env({"PAGED_CACHE_REMOTE_URL": "redis://app:s3cret@h:6379/1",
                                   REMOTE_PASSWORD_ENV: "ignored-here", "PAGED_CACHE_REMOTE_TTL": "60",
                                   "PAGED_CACHE_REMOTE_SECRET": "a secret of 16+ chars"})
    assert config.remote_url == "redis://app:s3cret@h:6379/1" and config.remote_ttl == 60.0
    assert "s3cret" not in repr(config) and "s3cret" not in json.dumps(config.to_dict())
    assert CacheConfig().remote_url is None
    for bad, word in [("http://h:1", "schemes"), ("redis://:1", "schemes"), ("redis://h:x", "does not parse"),
                      ("redis://h/abc", "database"), (5, "remote_url")]:
        with pytest.raises(ValueError, match=word):
            CacheConfig(remote_url=bad)
    for field, bad in [("remote_ttl", -1), ("remote_timeout", 0), ("remote_ttl", "soon")]:
        with pytest.raises(ValueError, match=field):
            CacheConfig(**{field: bad})


def test_password_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with ValkeyServer(requirepass="pw-from-env") as srv:
        block = Block("ab" * 32, {"a": mx.ones((4,))}, {})
        monkeypatch.setenv(REMOTE_PASSWORD_ENV, "pw-from-env")
        with PagedSSDCacheManager(remote_config(srv.url)) as manager:
            manager.put(block)
            manager.flush()
            assert manager.stats()["remote"]["writes"] == 1
        monkeypatch.setenv(REMOTE_PASSWORD_ENV, "wrong")
        with PagedSSDCacheManager(remote_config(srv.url)) as manager:
            assert manager.get(block.key) is None
            assert manager.stats()["remote"]["errors"] == 1


def test_stats_and_metrics_show_the_remote_tier(url: str) -> None:
    model = tiny_model("llama")
    tokens = prompt(2 * BLOCK + 3)
    stored_chain(url, model, tokens)
    with PagedSSDCacheManager(remote_config(url)) as manager:
        prefix = BlockAwarePrefixCache(manager, model)
        assert assert_exact(model, prefix, tokens) == len(tokens) - 1
        stats = manager.stats()
        text = render_prometheus({"manager": stats},
                                 gauges=nested_gauges("manager", manager.STAT_GAUGES))
    assert stats["hits"]["remote"] == 3 and stats["remote"]["read_bytes"] > 0
    metrics = parse_exposition(text)
    assert value(metrics, "paged_cache_tier_hits_total", tier="remote") == 3
    assert value(metrics, "paged_cache_tier_read_bytes_total", tier="remote") \
        == stats["remote"]["read_bytes"]
    for counter in ("errors", "write_bytes", "read_seconds", "outages", "skipped"):
        assert kind(metrics, f"paged_cache_tier_{counter}_total") == "counter"
        assert (frozenset({("tier", "remote")}) in metrics[f"paged_cache_tier_{counter}_total"][1])
    for gauge in ("available", "ttl", "read_seconds_max"):
        assert kind(metrics, f"paged_cache_tier_{gauge}") == "gauge"


def test_server_keys_are_namespaced(url: str) -> None:
    model = tiny_model("llama")
    keys = stored_chain(url, model, prompt(2 * BLOCK))
    names = sorted(n.decode() for n in client(url).keys("*"))
    assert all(n.startswith(KEY_PREFIX + ":") for n in names)
    assert block_name(keys[0]) in names and block_name(keys[1]) in names
    with pytest.raises(ValueError, match="key"):
        block_name("../x")
    with pytest.raises(ValueError, match="fingerprint"):
        children_name("", "*")
    assert fmt.FORMAT_VERSION in KEY_PREFIX


def test_inspect_and_stats_cli_show_the_remote_tier(tmp_path: Path, url: str) -> None:
    from helpers.cli import cli_json, run_cli, serve_stats

    model = tiny_model("llama")
    config = CacheConfig(block_size=BLOCK, ssd_dir=tmp_path, remote_url=url, remote_timeout=LOADED)
    with PagedSSDCacheManager(config) as manager:
        prefix = BlockAwarePrefixCache(manager, model)
        store_prompt(model, prefix, prompt(3 * BLOCK))
        manager.flush()
        server, stats_url = serve_stats(lambda: {"manager": manager.stats()})
        try:
            status, out, _ = run_cli("stats", "--url", stats_url, "--all")
            summary = next(line for line in out.splitlines() if line.startswith("remote tier"))
            assert status == 0 and f"{url}: up" in summary and "remote_write_bytes" in out
            status, out, _ = run_cli("stats", "--url", stats_url, "--prometheus")
            assert value(parse_exposition(out), "paged_cache_tier_writes_total", tier="remote") == 3
        finally:
            server.shutdown()
    data = cli_json("inspect", str(tmp_path), "--remote-url", url)
    assert data["remote"]["blocks"] == 3 and data["remote"]["listings"] == 3
    assert data["remote"]["used_memory"] > 0 and data["remote"]["maxmemory_policy"]
    status, out, _ = run_cli("inspect", str(tmp_path), "--remote-url", url)
    assert status == 0 and "remote tier" in out and "3 blocks" in out
    absent = f"redis://127.0.0.1:{free_port()}/0"
    data = cli_json("inspect", str(tmp_path), "--remote-url", absent)
    assert "error" in data["remote"] and data["totals"]["blocks"] == 3
    assert cli_json("inspect", str(tmp_path))["remote"] is None


def test_a_cluster_shards_blocks_by_key_hash(tmp_path: Path) -> None:
    model = tiny_model("llama")
    tokens = prompt(6 * BLOCK + 3)
    with ServerCluster(shards=3) as cluster:
        config = remote_config(cluster.url, remote_cluster=True)
        with PagedSSDCacheManager(config) as manager:
            store_prompt(model, BlockAwarePrefixCache(manager, model), tokens)
            manager.flush()
            assert manager.stats()["remote"]["writes"] == 7
        per_node = [client(n.url).dbsize() for n in cluster.nodes]
        assert sum(per_node) == 14 and sum(1 for n in per_node if n) >= 2  # blocks + listings
        with PagedSSDCacheManager(config) as manager:  # another host: exact, from the shards
            prefix = BlockAwarePrefixCache(manager, model)
            assert assert_exact(model, prefix, tokens + [5]) == len(tokens)
            assert prefix.last_fetch.tier == "remote" and manager.stats()["hits"]["remote"] == 7
            summary = server_summary(cluster.url, cluster=True)
            assert summary["blocks"] == 7 and summary["listings"] == 7
            cluster.nodes[1].kill()  # one shard gone: what is local is served exactly, no raise
            assert_exact(model, prefix, tokens + [6])
            other = prompt(3 * BLOCK, seed=9)
            assert_exact(model, prefix, other)
            store_prompt(model, prefix, other)
            # at least one outage: once the cluster marks the dead shard failed (its node timeout,
            # 15 s), a probe answered by the live primaries ends it and the dead shard's next key
            # starts another, so how many depends on how long a loaded machine takes to get here
            assert manager.stats()["remote"]["outages"] >= 1


def test_a_fetch_costs_a_bounded_number_of_round_trips(url: str) -> None:
    model = tiny_model("llama")
    base = prompt(40 * BLOCK)
    with PagedSSDCacheManager(remote_config(url)) as manager:
        prefix = BlockAwarePrefixCache(manager, model)
        store_prompt(model, prefix, base)
        for j in range(1, 40, 2):  # 20 branches: every other block has a second child
            store_prompt(model, prefix, base[:j * BLOCK] + prompt(BLOCK + 5, seed=j))
        manager.flush()
    with PagedSSDCacheManager(remote_config(url)) as manager:
        prefix = BlockAwarePrefixCache(manager, model)
        assert assert_exact(model, prefix, base + [3, 4]) == len(base)
        # chain lookup 1 + listings 2 + reads 1 (the first 64 KiB: the fetch times them) +
        # ceil(32 / 32) = 1 + the last block's children 2
        assert manager.stats()["remote"]["reads"] <= 7
        assert manager.stats()["hits"]["remote"] == 40


def test_two_servers_share_a_prompt_through_the_remote_tier(tmp_path: Path, url: str) -> None:
    from helpers.cli import run_cli
    from helpers.serve import SYSTEM, ask, live_stats, paged_argv, server

    from paged_cache.testing import write_model_dir

    model = write_model_dir(tmp_path / "tiny-llama", "llama")
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello?"}]
    replies = []
    for name in ("a", "b"):  # two `paged-cache serve` hosts, own SSD directories, one server
        argv = paged_argv(model, "--ssd-dir", str(tmp_path / name), "--remote-url", url,
                          "--remote-timeout", str(LOADED))
        with server(argv, tmp_path / f"{name}.log") as (c, proc, base):
            replies.append(ask(c, messages, stream=False, seed=None))
            doc = live_stats(base)
            status, out, _ = run_cli("stats", "--url", base)
        assert proc.returncode == 0
    (text_a, cached_a, prompt_a), (text_b, cached_b, prompt_b) = replies
    assert cached_a == 0 and text_b == text_a and prompt_b == prompt_a
    assert 0 < cached_b < prompt_b                       # b's first request: a's blocks
    assert doc["requests"]["requests_remote"] == 1 and doc["manager"]["hits"]["remote"] > 0
    assert "cached (remote)" in (tmp_path / "b.log").read_text()
    assert status == 0 and "remote tier" in out and ": up," in out


def test_a_remote_hit_is_promoted_into_the_local_tiers(tmp_path: Path, url: str) -> None:
    model = tiny_model("llama")
    keys = stored_chain(url, model, prompt(2 * BLOCK))
    config = CacheConfig(block_size=BLOCK, ssd_dir=tmp_path, remote_url=url, remote_timeout=LOADED)
    with PagedSSDCacheManager(config) as manager:
        assert manager.chain(keys, WALK)[0] == ["remote", "remote"]
        assert manager.get(keys[0]) is not None and manager.get(keys[1], take=True) is not None
        manager.flush()
        assert [manager.tier_of(k) for k in keys] == ["hot", "ssd"]   # a taken block: SSD only
        client(url).flushall()                                          # the server forgets
        manager.trim_hot(0)
        assert all(manager.get(k) is not None for k in keys)
        stats = manager.stats()
        assert stats["hits"] == dict(hot=0, pending=0, ssd=2, remote=2, total=4)
        # the chain lookup (where the keys are, then the listings of the whole chain) + one
        # read-ahead round trip for both blocks
        assert stats["remote"]["reads"] == 3
