"""Who may talk to the remote server: passwords (in the URL, from the environment, an ACL user
with least privileges) and TLS (the server's certificate and host name verified, client
certificates), against real redis-server / valkey-server processes on 127.0.0.1 started with
``requirepass``, ``user`` and ``tls-*`` settings and certificates made by the test."""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from paged_cache.config import REMOTE_PASSWORD_ENV, CacheConfig
from paged_cache.manager import PagedSSDCacheManager
from paged_cache.prefix_cache import BlockAwarePrefixCache
from paged_cache.testing import tiny_model
from paged_cache.testing.certs import TLSCerts, make_test_certs
from paged_cache.testing.server import ValkeyServer
from helpers.prefix import assert_exact, prompt, store_prompt

BLOCK = 16
TOKENS = prompt(3 * BLOCK + 5)
# The privileges the tier needs, nothing more: its own keys, reads, writes, the connection.
LEAST = ["on", ">app-pw", "~paged-cache:*", "+@read", "+@write", "+@connection", "-@dangerous"]


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> TLSCerts:
    return make_test_certs(tmp_path_factory.mktemp("certs"))


def config(url: str, **kw: object) -> CacheConfig:
    kw.setdefault("remote_timeout", 5.0)
    kw.setdefault("fetch_policy", "always-restore")  # what a restore does, not the cost trade
    return CacheConfig(block_size=BLOCK, hot_cache_only=True, remote_url=url, **kw)


def share(url: str, **kw: object) -> tuple[int, dict]:
    """Host A stores TOKENS through the server at ``url``, host B fetches them: B's n (exact:
    logits diff 0.0) and B's remote stats."""
    model = tiny_model("llama")
    with PagedSSDCacheManager(config(url, **kw)) as a:
        store_prompt(model, BlockAwarePrefixCache(a, model), TOKENS)
        a.flush()
    with PagedSSDCacheManager(config(url, **kw)) as b:
        n = assert_exact(model, BlockAwarePrefixCache(b, model), TOKENS + [1])
        return n, b.stats()["remote"]


def refused(url: str, **kw: object) -> dict:
    """A host that cannot talk to the server: nothing raises, one outage, no remote hit."""
    _, remote = share(url, **kw)
    assert remote["outages"] == 1 and remote["errors"] >= 1 and remote["hits"] == 0
    return remote


def with_user(**settings: object) -> ValkeyServer:
    """A server whose only usable account is the ACL user ``app`` with the least privileges."""
    return ValkeyServer(users=(" ".join(["app", *LEAST]), "default off"), **settings)


def test_passwords_in_the_url_from_the_environment_and_an_acl_user(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(REMOTE_PASSWORD_ENV, raising=False)
    with ValkeyServer(requirepass="s3cret-pw") as server:
        plain = server.url.replace("redis://", "redis://:s3cret-pw@")
        assert share(plain)[0] == len(TOKENS)
        refused(server.url.replace("redis://", "redis://:wrong@"))
        refused(server.url)                                         # no password at all
        monkeypatch.setenv(REMOTE_PASSWORD_ENV, "s3cret-pw")
        assert share(server.url)[0] == len(TOKENS)                  # from the environment
    with with_user() as server:
        app = server.url.replace("redis://", "redis://app:app-pw@")
        assert share(app)[0] == len(TOKENS)                          # least privileges suffice
        monkeypatch.setenv(REMOTE_PASSWORD_ENV, "app-pw")
        assert share(server.url.replace("redis://", "redis://app@"))[0] == len(TOKENS)
        monkeypatch.delenv(REMOTE_PASSWORD_ENV)
        refused(server.url.replace("redis://", "redis://app:wrong@"))
        refused(server.url.replace("redis://", "redis://default:app-pw@"))


def test_tls_verifies_the_server_certificate_and_host_name(certs: TLSCerts) -> None:
    with ValkeyServer(tls=certs) as server:
        assert server.url.startswith("rediss://")
        n, remote = share(server.url, remote_tls_ca=certs.ca)
        assert n == len(TOKENS) and remote["hits"] == 4
        assert share(server.url.replace("127.0.0.1", "localhost"), remote_tls_ca=certs.ca)[0] == \
            len(TOKENS)
        refused(server.url)                                  # the system's CAs do not know it
        refused(server.url, remote_tls_ca=certs.other_ca)    # another CA
        refused(server.url.replace("rediss://", "redis://"))  # plain text to a TLS port
    elsewhere = dataclasses.replace(certs, server=certs.elsewhere, server_key=certs.elsewhere_key)
    with ValkeyServer(tls=elsewhere) as server:              # a valid certificate of another host
        refused(server.url, remote_tls_ca=certs.ca)


def test_tls_with_a_client_certificate_and_a_password(certs: TLSCerts) -> None:
    with with_user(tls=certs, client_certs=True) as server:
        url = server.url.replace("rediss://", "rediss://app:app-pw@")
        mutual = dict(remote_tls_ca=certs.ca, remote_tls_cert=certs.client,
                      remote_tls_key=certs.client_key)
        assert share(url, **mutual)[0] == len(TOKENS)
        refused(url, remote_tls_ca=certs.ca)                 # no client certificate
        refused(server.url, **mutual)                        # no password


def test_tls_and_secret_settings_are_checked_and_never_shown(
        tmp_path: Path, certs: TLSCerts, caplog: pytest.LogCaptureFixture) -> None:
    for bad, words in [(dict(remote_url="redis://h:1/0", remote_tls_ca=certs.ca), "needs a TLS"),
                       (dict(remote_url="rediss://h:1/0", remote_tls_cert=certs.client),
                        "give both"),
                       (dict(remote_secret="xyzzy-42"), "at least 16")]:
        with pytest.raises(ValueError, match=words) as info:
            CacheConfig(**bad)
        assert "xyzzy" not in str(info.value)
    with pytest.raises(ValueError, match="remote_tls_ca: .*not a readable file"):
        PagedSSDCacheManager(config("rediss://127.0.0.1:1/0", remote_tls_ca=tmp_path / "absent"))
    secret = "a secret nobody may see 42"
    with caplog.at_level(logging.DEBUG, logger="paged_cache"):
        cfg = config("redis://127.0.0.1:1/0", remote_secret=secret, remote_timeout=0.2)
        with PagedSSDCacheManager(cfg) as manager:
            manager.get("ab" * 32)
    assert secret not in repr(cfg) and secret not in json.dumps(cfg.to_dict())
    assert cfg.to_dict()["remote_secret"] == "***"
    assert not [r for r in caplog.records if secret in r.getMessage()]
    env = {"PAGED_CACHE_REMOTE_SECRET": secret, "PATH": "/usr/bin:/bin",
           "PYTHONPATH": str(Path(__file__).parents[1])}
    for args in (["config"], ["config", "--json"]):
        out = subprocess.run([sys.executable, "-m", "paged_cache.cli.main", *args], env=env,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and secret not in out.stdout + out.stderr
        assert "***" in out.stdout and "env:PAGED_CACHE_REMOTE_SECRET" in out.stdout
