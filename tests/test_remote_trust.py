"""A shared tier is closed unless the user opens it: a remote_url off loopback needs remote_secret
or the explicit opt-out remote_insecure (a WARNING at every start); a host without the secret
refuses sealed values and counts them; a node planted among a listing's root children is counted.
Against a real valkey-server / redis-server on 127.0.0.1."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import pytest

from paged_cache.cli.options import add_config_arguments, config_from_args
from paged_cache.config import CacheConfig
from paged_cache.remote_settings import is_loopback
from paged_cache.hashing import chain_keys, encode_token_ids
from paged_cache.manager import PagedSSDCacheManager
from paged_cache.prefix_cache import BlockAwarePrefixCache
from paged_cache.testing import tiny_model
from paged_cache.testing.server import client
from paged_cache.tiers.remote.client import children_name

from helpers.prefix import assert_exact, prompt, store_prompt

BLOCK = 16
SECRET = "the pool's secret, 16+ chars"
OFF_LOOPBACK = "redis://cache.invalid:6379/0"  # a reserved name: never resolved, never reached


def remote_config(url: str, **kw: object) -> CacheConfig:
    kw.setdefault("remote_timeout", 5.0)
    kw.setdefault("fetch_policy", "always-restore")  # what a restore does, not the cost trade
    return CacheConfig(block_size=BLOCK, hot_cache_only=True, remote_url=url, **kw)


def cli_config(argv: list[str], environ: dict[str, str]) -> CacheConfig:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    return config_from_args(parser.parse_args(argv), environ)


# ------------------------------------------------------------------------------ closed by default

@pytest.mark.unit
@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("127.8.9.10", True), ("localhost", True), ("LOCALHOST.", True),
    ("::1", True), ("::ffff:127.0.0.1", True), ("10.0.0.5", False), ("cache.lan", False),
    ("2001:db8::1", False), ("127.0.0.1.nip.io", False), ("0.0.0.0", False), (None, False)])
def test_only_loopback_addresses_and_localhost_are_this_machine(host: str | None,
                                                                loopback: bool) -> None:
    assert is_loopback(host) is loopback


@pytest.mark.unit
def test_a_remote_url_off_loopback_without_a_secret_is_refused_saying_how_to_set_it(
        tmp_path: Path) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text(f'[paged_cache]\nremote_url = "{OFF_LOOPBACK}"\n')
    for make, source in [
            (lambda: CacheConfig(remote_url="redis://app:pw@10.0.0.5:6379/0"), "constructor"),
            (lambda: CacheConfig.from_env({"PAGED_CACHE_REMOTE_URL": "rediss://[2001:db8::1]/0"}),
             "env:PAGED_CACHE_REMOTE_URL"),
            (lambda: CacheConfig.from_toml(toml), f"toml:{toml}"),
            (lambda: cli_config(["--remote-url", OFF_LOOPBACK], {}), "flag:--remote-url")]:
        with pytest.raises(ValueError) as info:
            make()
        message = str(info.value)
        assert message.startswith("remote_url: ") and f"(from {source})" in message
        assert "PAGED_CACHE_REMOTE_SECRET" in message and "remote_insecure" in message
        assert "pw@" not in message  # the URL's password is never shown
    # loopback, a secret, or the explicit opt-out from any source: allowed
    for url in ("redis://127.0.0.1:6379/0", "redis://localhost/0", "valkey://[::1]:6379/0"):
        assert CacheConfig(remote_url=url).remote_url == url
    assert CacheConfig(remote_url=OFF_LOOPBACK, remote_secret=SECRET).remote_secret == SECRET
    opted = [CacheConfig(remote_url=OFF_LOOPBACK, remote_insecure=True),
             CacheConfig.from_env({"PAGED_CACHE_REMOTE_URL": OFF_LOOPBACK,
                                   "PAGED_CACHE_REMOTE_INSECURE": "1"}),
             cli_config(["--config", str(toml), "--remote-insecure"], {})]
    assert [c.sources["remote_insecure"] for c in opted] == \
        ["constructor", "env:PAGED_CACHE_REMOTE_INSECURE", "flag:--remote-insecure"]
    toml.write_text(f'[paged_cache]\nremote_url = "{OFF_LOOPBACK}"\nremote_insecure = true\n')
    assert CacheConfig.from_toml(toml).remote_insecure is True
    assert CacheConfig().remote_insecure is False


def test_the_opt_out_warns_at_every_start(url: str, caplog: pytest.LogCaptureFixture) -> None:
    """remote_insecure: one WARNING each time a manager starts, off loopback (no I/O: the tier
    connects on first use) and on the real server, where blocks are shared as before; without
    it a loopback tier starts without one (serve announces it once)."""
    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records
                if r.levelno == logging.WARNING and "remote_insecure" in r.getMessage()]

    with caplog.at_level(logging.WARNING, logger="paged_cache"):
        for _ in range(2):
            with PagedSSDCacheManager(remote_config(OFF_LOOPBACK, remote_insecure=True)):
                pass
        assert len(warnings()) == 2 and "cache.invalid" in warnings()[0]
        model = tiny_model("llama")
        tokens = prompt(3 * BLOCK + 5)
        for host in range(2):
            with PagedSSDCacheManager(remote_config(url, remote_insecure=True)) as manager:
                prefix = BlockAwarePrefixCache(manager, model)
                if host == 0:
                    store_prompt(model, prefix, tokens)
                else:
                    assert assert_exact(model, prefix, tokens + [1]) == len(tokens)
        assert len(warnings()) == 4
        caplog.clear()
        with PagedSSDCacheManager(remote_config(url)):
            pass
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


# ------------------------------------------------------------------------------ sealed values

def test_a_host_without_the_secret_refuses_sealed_values_and_counts_them(
        url: str, caplog: pytest.LogCaptureFixture) -> None:
    """Sealed values read by a host with no secret: refused before decoding (it cannot check the
    tag), each counted in remote.sealed_refused, the first logged at WARNING; the fetch is exact
    from what the host has itself (nothing). A host with the secret still reads them all."""
    model = tiny_model("llama")
    tokens = prompt(4 * BLOCK + 3)
    with PagedSSDCacheManager(remote_config(url, remote_secret=SECRET)) as sealed:
        store_prompt(model, BlockAwarePrefixCache(sealed, model), tokens)
    with caplog.at_level(logging.WARNING, logger="paged_cache.remote"), \
            PagedSSDCacheManager(remote_config(url)) as plain:
        assert assert_exact(model, BlockAwarePrefixCache(plain, model), tokens + [1]) == 0
        for key in chain_keys(BlockAwarePrefixCache(plain, model).fingerprint, "", tokens, BLOCK):
            assert plain.get(key) is None
        remote = plain.stats()["remote"]
    assert remote["sealed_refused"] >= 4 and remote["hits"] == 0
    assert remote["rejected"] == 0 and remote["damaged"] == 0
    logged = [r.getMessage() for r in caplog.records if "sealed" in r.getMessage()]
    assert len(logged) == 1 and "PAGED_CACHE_REMOTE_SECRET" in logged[0]
    with PagedSSDCacheManager(remote_config(url, remote_secret=SECRET)) as sealed:
        assert assert_exact(model, BlockAwarePrefixCache(sealed, model), tokens + [1]) == len(tokens)
        assert sealed.stats()["remote"]["sealed_refused"] == 0


# ------------------------------------------------------------------------------ planted root nodes

@pytest.mark.parametrize("claims", [None, "", "alice"])
def test_a_node_planted_among_the_root_children_is_counted(url: str, claims: str | None) -> None:
    """Another namespace's chain starts share the root listing: refused for this request, not
    counted. An entry planted there (a real block of another conversation, listed with the
    victim's first token ids, naming no namespace, none or another's) fits no namespace:
    refused and counted in nodes_rejected; the fetch stays exact."""
    model = tiny_model("llama")
    victim_tokens, other_tokens = prompt(3 * BLOCK + 2, seed=5), prompt(3 * BLOCK + 2, seed=3)
    with PagedSSDCacheManager(remote_config(url)) as manager:
        store_prompt(model, BlockAwarePrefixCache(manager, model, namespace="alice"), other_tokens)
        victim = BlockAwarePrefixCache(manager, model)
        store_prompt(model, victim, victim_tokens)
        fingerprint = victim.fingerprint
    with PagedSSDCacheManager(remote_config(url)) as fresh:
        assert assert_exact(model, BlockAwarePrefixCache(fresh, model), victim_tokens + [1]) == \
            len(victim_tokens)
        assert fresh.stats()["nodes_rejected"] == 0  # alice's chain start is no damage
    planted = chain_keys(fingerprint, "alice", other_tokens, BLOCK)[1]  # a real block
    meta = {"fingerprint": fingerprint, "parent": "", "start": "0", "tokens": str(BLOCK),
            "token_ids": encode_token_ids(victim_tokens[:BLOCK]), "checkpoint": "0",
            "restorable": "1", **({} if claims is None else {"namespace": claims})}
    client(url).hset(children_name("", fingerprint), planted, json.dumps(meta, sort_keys=True))
    with PagedSSDCacheManager(remote_config(url)) as fresh:
        assert assert_exact(model, BlockAwarePrefixCache(fresh, model), victim_tokens + [1]) == \
            len(victim_tokens)
        assert fresh.stats()["nodes_rejected"] >= 1
